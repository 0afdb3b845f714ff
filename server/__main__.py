"""`python -m server`: the same as `hfport serve`, settings from HFPORT_* variables."""

from __future__ import annotations


def main() -> None:
    from .app import serve
    from .settings import Settings

    serve(Settings())


if __name__ == "__main__":
    main()
