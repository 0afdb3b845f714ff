"""`python -m server` and `hfport serve`: settings from flags (given here) over HFPORT_* variables, then uvicorn."""

from __future__ import annotations

from typing import Any


def serve(*, quiet: bool = False, **overrides: Any) -> None:
    """Run the service. overrides: Settings fields (host, port, data_dir, max_concurrent_jobs); None means unset.
    Raises pydantic's ValidationError (a ValueError) for a bad setting."""
    import uvicorn

    from .app import create_app
    from .settings import Settings

    settings = Settings(**{k: v for k, v in overrides.items() if v is not None})
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port,
                log_level="warning" if quiet else "info")


def main() -> None:
    serve()


if __name__ == "__main__":
    main()
