"""The model a TEI or OpenAI request goes to: named by the request (the OpenAI body's `model`, else the x-model
header), else the first `serve --model`; served with its protocol task (a bare encoder embeds sentences) and known
by TEI's kinds: embedding, reranker (a one-label classifier), classifier, else its task."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request

from hfport import SentenceEmbeddingPipeline, TextClassificationPipeline
from hfport.errors import HfportError

from ..errors import ApiError
from ..store import BaseStore
from .records import PROTOCOL_TASK, ModelRecord, lookup
from .service import ModelService


class Served:
    """A loaded model: its record (the cache's key), its pipeline and its kind."""

    def __init__(self, record: ModelRecord, pipe: Any):
        self.record, self.pipe, self.name = record, pipe, record.name
        if isinstance(pipe, SentenceEmbeddingPipeline):
            self.kind = "embedding"
        elif isinstance(pipe, TextClassificationPipeline):
            self.kind = "reranker" if pipe.model.config.num_labels == 1 else "classifier"
        else:
            self.kind = record.task

    def need(self, *kinds: str, route: str) -> None:
        if self.kind not in kinds:
            raise ApiError(424, f"model {self.name!r} is not a {' or '.join(kinds)} model (it is: {self.kind}); "
                                f"{route} needs one", "Backend")


async def served(request: Request, store: BaseStore, service: ModelService, name: str | None = None) -> Served:
    """The request's model, loaded (404 ModelNotFound, 424 Backend when it cannot load)."""
    name = name or request.headers.get("x-model")
    startup = getattr(request.app.state, "startup", None)
    if not name:
        name = startup.default if startup is not None else None
    if not name:
        raise ApiError(400, "no model: name one with the x-model header, or start the server with --model",
                       "Validation")
    request.state.model_name = name
    entry = await asyncio.to_thread(lookup, store, name)
    task = PROTOCOL_TASK.get(entry["task"], entry["task"])
    if task is None:
        raise ApiError(424, f"model {name!r} has no task the server can serve", "Backend")
    record = ModelRecord.of(entry, task)
    try:
        pipe = await service.get(record)
    except HfportError as e:
        raise ApiError(424, f"model {name!r} failed to load: {e}", "Backend") from e
    return Served(record, pipe)
