"""One router per resource: health, models, predict, jobs, dashboard."""
