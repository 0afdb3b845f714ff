"""`python -m server` and `hfport serve`: settings from flags (given here) over HFPORT_* variables, then uvicorn."""

from __future__ import annotations

from typing import Any


def serve(*, quiet: bool = False, **overrides: Any) -> None:
    """Run the service. overrides: Settings fields (host, port, data_dir, max_concurrent_jobs, role); None means
    unset. Raises hfport's SettingsError (a ValueError) for a bad setting, StoreError for an unusable store."""
    from .app import serve as run_service
    from .settings import Settings

    settings = Settings(**{k: v for k, v in overrides.items() if v is not None})
    run_service(settings, log_level="warning" if quiet else "info")


def main() -> None:
    serve()


if __name__ == "__main__":
    main()
