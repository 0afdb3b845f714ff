"""The model a request runs, as a typed record: the model cache's key. A registry entry becomes one here, so an
adapter's base travels with it to every protocol (no side table that one route fills and another forgets)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ApiError
from ..security import confine
from ..settings import Settings
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


SHOWN = 20  # the registered names a refusal lists at most (GET /models lists them all)


def registered(store: BaseStore, kind: str | None = None) -> str:
    """The registered models (of `kind`: "model", "adapter"; None: all) for a refusal to name: "registered: 'a',
    'b'", at most SHOWN of them and how many more; or that none is."""
    names = [m["name"] for m in store.list_models(kind)]
    if not names:
        return f"no {'base ' if kind == 'model' else ''}model is registered (POST /models registers one)"
    more = f" and {len(names) - SHOWN} more (GET /models lists them all)" if len(names) > SHOWN else ""
    return "registered: " + ", ".join(repr(n) for n in names[:SHOWN]) + more


def named_folder(store: BaseStore, settings: Settings, value: str, what: str, kind: str | None = None) -> Path:
    """The folder `value` names (inside the allowed dirs) where no model is registered under it. A missing one is
    refused naming the registered models (of `kind`): a name that is neither was most likely meant as one of them."""
    folder = confine(value, settings, what, must_exist=False)
    if not folder.exists():
        raise ApiError(400, f"{what}: {value!r} is no registered model and no folder; {registered(store, kind)}",
                       "InvalidModel")
    return folder


def lookup(store: BaseStore, name: str, refusal: Answer = UNKNOWN_MODEL) -> dict[str, Any]:
    """The registry entry named `name`; else `refusal` (404 naming the registered models)."""
    entry = store.get_model(name)
    if entry is None:
        raise refusal.error(model=name, known=registered(store))
    return entry
