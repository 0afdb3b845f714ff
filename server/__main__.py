"""`python -m server` and `hfport serve`: settings from flags (given here) over HFPORT_* variables, then uvicorn.
Both entry points refuse a start the same way: one line on stderr saying why, exit status 1."""

from __future__ import annotations

import logging
import sys
from typing import Any

import hfport.settings as library_settings
from hfport import verbosity
from hfport.errors import SettingsError

log = logging.getLogger("hfport.server")

# fastapi, uvicorn and the service's other packages are hfport's own dependencies (pyproject.toml: no extra brings
# them), so one is missing only from an install made without them (pip --no-deps, a trimmed image)
INSTALL_HINT = "pip install hfport installs it with the service's other dependencies"


class StartRefused(Exception):
    """The service did not start, for a reason its message says in one line: a bad setting (from a flag or an
    HFPORT_* variable, named with its value), an unusable store (unreachable database, newer schema, duplicate
    worker id), a start-up model that is not a servable folder or a package the service needs that is not installed."""


def serve(*, verbosity: str = "verbose", **overrides: Any) -> None:
    """Run the service. overrides: Settings fields (host, port, data_dir, max_concurrent_jobs, role); None means
    unset. verbosity: the level the entry point resolved (a hfport.verbosity.LEVELS name, flags included), uvicorn's
    and the job processes'. Raises StartRefused when it cannot start."""
    try:
        from .app import serve as run_service
        from .errors import ApiError
        from .settings import Settings
        from .store import StoreError
    except ModuleNotFoundError as e:
        raise missing_package(e) from None
    try:
        settings = Settings(**{k: v for k, v in overrides.items() if v is not None})
        for problem in library_settings.unknown_variables(Settings, library_settings.Settings):
            log.warning("%s: ignored (docs/settings.md lists the settings)", problem)
        run_service(settings, verbosity=verbosity)
    except SettingsError as e:
        raise StartRefused(f"invalid settings: {e}") from None
    except StoreError as e:
        raise StartRefused(str(e)) from None
    except ApiError as e:  # a --model / HFPORT_MODELS entry that is not a servable folder
        raise StartRefused(e.message) from None
    except ModuleNotFoundError as e:  # uvicorn, imported when HTTP is served (a worker runs without it)
        raise missing_package(e) from None


def missing_package(e: ModuleNotFoundError) -> Exception:
    """StartRefused naming the package the service needs and lacks; E itself (a traceback) when the missing module is
    one of hfport's own, which no install step brings back."""
    top = (e.name or "").partition(".")[0]
    if not top or top in ("hfport", "server"):
        return e
    return StartRefused(f"the service needs {top}, which is not installed ({e}); {INSTALL_HINT}")


def main() -> None:
    """As `hfport serve` without flags: HFPORT_VERBOSITY, else verbose; a refusal (or a bad library variable) is
    `error: ...` on stderr and exit status 1, never a traceback."""
    try:
        level = verbosity.from_env(default="verbose")
        verbosity.configure(level)
        serve(verbosity=level)
    except (SettingsError, StartRefused) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
