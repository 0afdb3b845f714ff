"""The model a request runs, as a typed record: the model cache's key. A registry entry becomes one here, so an
adapter's base travels with it to every protocol (no side table that one route fills and another forgets)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..store import BaseStore
from .admission import UNKNOWN_MODEL, Answer

# the task a bare encoder runs as on the embedding protocols (TEI, OpenAI): pooled sentence embeddings, as the
# folder's sentence-transformers files say; every other task is served as itself
PROTOCOL_TASK = {"feature-extraction": "sentence-embedding"}


@dataclass(frozen=True)
class ModelRecord:
    """One pipeline in the cache: the registered name, its folder, the task it runs, and for a LoRA adapter the
    base model folder its tensors come from."""

    name: str
    path: str
    task: str
    base: str | None = None

    @classmethod
    def of(cls, entry: dict[str, Any], task: str) -> ModelRecord:
        """The record of a registry entry run as `task`."""
        return cls(name=entry["name"], path=entry["path"], task=task, base=entry.get("base"))


def lookup(store: BaseStore, name: str, refusal: Answer = UNKNOWN_MODEL) -> dict[str, Any]:
    """The registry entry named `name`; else `refusal` (404 listing the registered names)."""
    entry = store.get_model(name)
    if entry is None:
        raise refusal.error(model=name, known=[m["name"] for m in store.list_models()])
    return entry
