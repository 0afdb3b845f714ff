"""The model a request runs, as a typed record: the model cache's key. A registry entry becomes one here, so an
adapter's base travels with it to every protocol (no side table that one route fills and another forgets)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ApiError
from ..store import BaseStore

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


def lookup(store: BaseStore, name: str) -> dict[str, Any]:
    """The registry entry named `name`; 404 listing the registered names."""
    entry = store.get_model(name)
    if entry is None:
        known = [m["name"] for m in store.list_models()]
        raise ApiError(404, f"no model named {name!r}; registered: {known}", "ModelNotFound")
    return entry
