"""hfport's exceptions, each naming what is wrong and where; and ItemError, a failed item as a value."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class HfportError(Exception):
    """Base class of every error hfport raises on purpose."""


class ConfigError(HfportError, ValueError):
    """A config.json that is missing a field, has a bad value, or asks for an unsupported variant."""


class SettingsError(ConfigError):
    """An HFPORT_* variable (or a settings argument) with a value it does not accept, or one that is no longer a
    setting: names the variable, the value and what is accepted (hfport/settings.py)."""


class UntrainedHeadError(HfportError, ValueError):
    """A pipeline asked of a folder whose weights lack the task's head: it would answer with random weights."""


class CheckpointError(HfportError, ValueError):
    """A weights file that is corrupt, truncated, unsafe, or does not fit the model."""


class ModelNotFoundError(HfportError, FileNotFoundError):
    """Neither a local folder nor a repo id in the local HF cache."""


class ExportError(HfportError):
    """An export's SRC or DIR is not usable, or writing the export failed; nothing was left at DIR."""


@dataclass(frozen=True)
class ItemError:
    """An input a pipeline could not answer, returned in its place when the call gave a list.

    A value, not an exception: the other items of the call still have their results. It does not carry the input's
    position; whoever renders results adds it (`to_dict(index)`), so results can be split and merged freely."""

    message: str  # what is wrong with the input, e.g. "text is empty or only whitespace"
    error_type: str  # the exception class that failed it, e.g. "PipelineInputError"

    def to_dict(self, index: int, where: str | None = None) -> dict[str, Any]:
        """The rendering the CLI's JSON lines and the HTTP API use: {"error", "error_type", "index"}. The error is
        prefixed by `where` the input came from when the caller knows it (a file's line), else by its index."""
        return {"error": f"{where or f'input {index}'}: {self.message}", "error_type": self.error_type, "index": index}

    @classmethod
    def render(cls, results: list[Any], places: list[str | None] | None = None) -> list[Any]:
        """`results` with every ItemError rendered at its position in the list (and, given `places`, named by the
        place of the input at that position)."""
        return [r.to_dict(i, places[i] if places else None) if isinstance(r, cls) else r for i, r in enumerate(results)]
