"""`python -m server`: the same as `hfport serve`, settings from HFPORT_* variables."""

from __future__ import annotations


def main() -> None:
    import uvicorn

    from .app import create_app
    from .settings import Settings

    settings = Settings()
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="info")


if __name__ == "__main__":
    main()
