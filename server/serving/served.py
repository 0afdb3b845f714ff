"""The model a TEI or OpenAI request goes to: named by the request (the OpenAI body's `model`, else the x-model
header), else the first `serve --model`; served with its protocol task (a bare encoder embeds sentences) and known
by TEI's kinds: embedding, reranker (a one-label classifier), classifier, else its task. Every refusal on the way is
worded by the calling protocol's Answers. `set_timing`: the timing headers every inference answer carries."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import Request, Response

from hfport import SentenceEmbeddingPipeline, TextClassificationPipeline
from hfport.errors import HfportError

from ..store import BaseStore
from .admission import Answers
from .batching import Timing
from .cache import ModelLoadError
from .records import PROTOCOL_TASK, ModelRecord, lookup
from .service import ModelService


class Served:
    """A loaded model: its record (the cache's key), its pipeline and its kind; `answers`: how the protocol that
    asked for it words a refusal."""

    def __init__(self, record: ModelRecord, pipe: Any, answers: Answers):
        self.record, self.pipe, self.name, self.answers = record, pipe, record.name, answers
        if isinstance(pipe, SentenceEmbeddingPipeline):
            self.kind = "embedding"
        elif isinstance(pipe, TextClassificationPipeline):
            self.kind = "reranker" if pipe.model.config.num_labels == 1 else "classifier"
        else:
            self.kind = record.task

    def need(self, *kinds: str, route: str) -> None:
        if self.kind not in kinds:
            wanted = " or ".join(kinds)
            article = "an" if wanted[0] in "aeiou" else "a"
            raise self.answers.unservable.error(model=self.name, reason=f"is not {article} {wanted} model (it "
                                                                        f"is: {self.kind}); {route} needs one")

    def check_dimensions(self, dimensions: int | None, strict: bool) -> None:
        """With HFPORT_STRICT_DIMENSIONS (`strict`): a `dimensions` the model was not trained for (its Matryoshka
        dimensions, else its full size) is refused, naming the model and the allowed sizes. Off (the default), any
        prefix is served."""
        if not strict or dimensions is None:
            return
        allowed = sorted({*self.pipe.sentence.matryoshka_dims, self.pipe.dimension})
        if dimensions not in allowed:
            raise self.answers.dimensions.error(dimensions=dimensions, model=self.name, allowed=allowed)


async def served(request: Request, store: BaseStore, service: ModelService, answers: Answers,
                 name: str | None = None) -> Served:
    """The request's model, loaded; else the protocol's refusal (no model named and no default, none registered
    under the name, a default deleted since (DELETE /models/<default>), one that cannot load)."""
    name = name or request.headers.get("x-model")
    refusal = answers.unknown_model
    if not name:
        startup = getattr(request.app.state, "startup", None)
        name, refusal = (startup.default if startup is not None else None), answers.default_gone
    if not name:
        raise answers.no_model.error()
    request.state.model_name = name
    entry = await asyncio.to_thread(lookup, store, name, refusal)
    task = PROTOCOL_TASK.get(entry["task"], entry["task"])
    if task is None:
        raise answers.unservable.error(model=name, reason="has no task the server can serve")
    record = ModelRecord.of(entry, task)
    try:
        pipe = await service.get(record)
    except (HfportError, ModelLoadError) as e:
        raise answers.unservable.error(model=name, reason=f"failed to load: {e}") from e
    return Served(record, pipe, answers)


def set_timing(response: Response, started: float, timing: Timing, model: Served) -> None:
    """TEI's timing headers in milliseconds (x-compute-time since `started`, x-tokenization-time, x-queue-time,
    x-inference-time) and x-model-id, on every inference answer (OpenAI's too, as TEI's /v1/embeddings)."""
    ms = {"x-compute-time": (time.perf_counter() - started), "x-tokenization-time": timing.tokenization,
          "x-queue-time": timing.queue, "x-inference-time": timing.inference}
    for header, seconds in ms.items():
        response.headers[header] = str(round(seconds * 1000))
    response.headers["x-model-id"] = model.name
