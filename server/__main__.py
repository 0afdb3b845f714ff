"""`python -m server` and `hfport serve`: settings from flags (given here) over HFPORT_* variables, then uvicorn."""

from __future__ import annotations

import logging
from typing import Any

import hfport.settings as library_settings
from hfport import verbosity

log = logging.getLogger("hfport.server")


def serve(*, log_level: int = logging.INFO, **overrides: Any) -> None:
    """Run the service. overrides: Settings fields (host, port, data_dir, max_concurrent_jobs, role); None means
    unset. log_level: uvicorn's, the verbosity's level (hfport.verbosity.LEVELS). Raises hfport's SettingsError (a
    ValueError) for a bad setting, StoreError for an unusable store."""
    from .app import serve as run_service
    from .settings import Settings

    settings = Settings(**{k: v for k, v in overrides.items() if v is not None})
    for problem in library_settings.unknown_variables(Settings, library_settings.Settings):
        log.warning("%s: ignored (docs/settings.md lists the settings)", problem)
    run_service(settings, log_level=log_level)


def main() -> None:
    level = verbosity.from_env(default="verbose")  # as `hfport serve` without flags
    verbosity.configure(level)
    serve(log_level=verbosity.LEVELS[level])


if __name__ == "__main__":
    main()
