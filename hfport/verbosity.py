"""How much every hfport process says: HFPORT_VERBOSITY=quiet|normal|verbose|debug|trace (the library setting
`verbosity`, hfport/settings.py), read by the CLI, the server, job processes and every rank under `accelerate
launch` (the environment reaches them all). A command's
-q / -v flags win over the variable. With more than one process, each log record is prefixed `[rank N]`.

    quiet    errors only, no progress bar
    normal   warnings + the progress bar (the default)
    verbose  info: what the run is doing (resuming, saving, evaluating)
    debug    debug records of every library
    trace    debug + one record per optimizer step (hfport.train at TRACE)
"""

from __future__ import annotations

import logging
import os

from .settings import VERBOSITY, settings

TRACE = 5
logging.addLevelName(TRACE, "TRACE")
LEVELS = dict(zip(VERBOSITY, (logging.ERROR, logging.WARNING, logging.INFO, logging.DEBUG, TRACE)))


def from_env(default: str = "normal") -> str:
    """The verbosity the settings name (HFPORT_VERBOSITY), else `default`; an unknown value is a SettingsError
    listing the valid ones."""
    return settings().verbosity or default


def resolve(verbose: int = 0, quiet: bool = False, default: str = "normal") -> str:
    """Flags first (-q; -v verbose, -vv debug, -vvv trace), then HFPORT_VERBOSITY, then `default`."""
    if quiet:
        return "quiet"
    if verbose:
        return ("verbose", "debug", "trace")[min(verbose, 3) - 1]
    return from_env(default)


def rank_prefix() -> str:
    """`[rank N] ` when this process is one of several (accelerate/torchrun set RANK and WORLD_SIZE), else ''."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    return f"[rank {os.environ.get('RANK', '0')}] " if world > 1 else ""


class _RankFilter(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.prefix = rank_prefix()

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.prefix
        return True


def configure(level: str, fmt: str = "%(levelname)s %(name)s: %(message)s") -> None:
    """Root logging at `level` (a LEVELS name), records prefixed with the rank when there are several."""
    handler = logging.StreamHandler()
    handler.addFilter(_RankFilter())
    handler.setFormatter(logging.Formatter("%(rank)s" + fmt))
    logging.basicConfig(level=LEVELS[level] if level != "trace" else logging.DEBUG, handlers=[handler], force=True)
    logging.getLogger("hfport").setLevel(LEVELS[level])
    global _configured
    _configured = level


_configured: str | None = None  # set by configure(): an entry point (CLI, job process) decided, flags included


def apply_env() -> str | None:
    """For library entry points (finetune called from Python): when HFPORT_VERBOSITY is set, set hfport's logger
    level and give it a rank-prefixed handler if nothing else prints its records. Returns the level or None;
    after configure() (an entry point with flags) it only returns that level."""
    if _configured is not None:  # the CLI's -q / -v already decided (flags win over the variable)
        return _configured
    level = settings().verbosity
    if level is None:
        return None
    logger = logging.getLogger("hfport")
    logger.setLevel(LEVELS[level])
    if not logging.getLogger().handlers and not logger.handlers:
        handler = logging.StreamHandler()
        handler.addFilter(_RankFilter())
        handler.setFormatter(logging.Formatter("%(rank)s%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
    return level
