"""Fine-tuning: data, the accelerate loop, checkpoints, metrics, reports."""
