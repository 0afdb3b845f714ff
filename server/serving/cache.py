"""The model cache: pipelines loaded once, warmed up, and kept in an LRU bounded by count and by weight memory,
keyed by ModelRecord. A LoRA adapter (a record with a base) runs over its base's tensors, loaded once and shared by
every adapter over that base."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from hfport import AutoModel, lora, pipeline, tasks, tune_batch_tokens

from ..settings import Settings
from .records import ModelRecord

log = logging.getLogger("hfport.server.serving")


def weight_bytes(pipe: Any) -> int:
    """Memory held by a pipeline's model weights and buffers."""
    model = pipe.model
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def total_weight_bytes(pipes: Iterable[Any]) -> int:
    """Memory held by the pipelines' weights together: a tensor several adapters share counts once."""
    seen: dict[int, int] = {}
    for pipe in pipes:
        for t in (*pipe.model.parameters(), *pipe.model.buffers()):
            seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


class ModelCache:
    """Thread-safe: concurrent loads of one record wait for the first; the newest pipeline always stays."""

    def __init__(self, settings: Settings, metrics: Any = None):
        self.settings = settings
        self.metrics = metrics  # server.metrics.Metrics, or None
        self.tuning: dict[ModelRecord, Any] = {}  # record -> hfport.embeddings.BatchTuning
        self._pipes: OrderedDict[ModelRecord, Any] = OrderedDict()
        self._bases: dict[str, Any] = {}  # base folder -> the bare encoder LoRA adapters over it share
        self._lock = threading.Lock()
        self._loading: dict[Any, threading.Lock] = {}  # a record (or a base folder) -> the gate of its one load

    def __len__(self) -> int:
        return len(self._pipes)

    def records(self) -> list[ModelRecord]:
        """The cached records, least recently used first."""
        with self._lock:
            return list(self._pipes)

    def get(self, record: ModelRecord) -> Any:
        """The pipeline for `record`: from the cache, or loaded and warmed up once (concurrent callers wait)."""
        with self._lock:
            if record in self._pipes:
                self._pipes.move_to_end(record)
                return self._pipes[record]
            gate = self._loading.setdefault(record, threading.Lock())
        with gate:
            with self._lock:
                if record in self._pipes:
                    return self._pipes[record]
            pipe = (self._adapter_pipeline(record) if record.base else
                    pipeline(record.task, model=record.path, dtype=self.settings.predict_dtype))
            self._warm_up(record, pipe)
            with self._lock:
                self._pipes[record] = pipe
                self._evict_over_budget()
                self._loading.pop(record, None)
            return pipe

    def _evict_over_budget(self) -> None:  # holding the lock
        budget = self.settings.model_cache_mb * 2**20
        while len(self._pipes) > 1 and (len(self._pipes) > self.settings.model_cache_size
                                        or total_weight_bytes(self._pipes.values()) > budget):
            old, _ = self._pipes.popitem(last=False)
            log.info("model cache: evicted %s (%s)", old.name, old.task)

    def _adapter_pipeline(self, record: ModelRecord) -> Any:
        base = record.base
        with self._lock:
            gate = self._loading.setdefault(("base", base), threading.Lock())
        with gate:  # one load of each base, however many adapters start at once
            shared = self._bases.get(base)
            if shared is None:
                shared = self._bases[base] = AutoModel.from_pretrained(base)
        model = tasks.get(record.task).model_class.from_pretrained(record.path, base_model=shared)
        return pipeline(record.task, model=model, tokenizer=lora.adapter_tokenizer(record.path, base))

    def _warm_up(self, record: ModelRecord, pipe: Any) -> None:
        """A first forward pass before the model takes requests; with batch_autotune, forward passes at each
        budget of batch_token_budgets pick the pipeline's max_batch_tokens (hfport.embeddings.tune_batch_tokens)."""
        settings = self.settings
        budgets = tuple(settings.batch_token_budgets) if settings.batch_autotune else (pipe.max_batch_tokens,)
        tuning = tune_batch_tokens(pipe, budgets)
        self.tuning[record] = tuning
        if self.metrics is not None:
            self.metrics.batch_tokens.labels(record.name).set(tuning.chosen)
        log.info("%s (%s): max_batch_tokens=%d; padded tokens/s by budget: %s%s", record.name, record.task,
                 tuning.chosen, {b: round(t) for b, t in tuning.throughput.items()},
                 f"; skipped {tuning.skipped}" if tuning.skipped else "")

    def memory(self) -> dict[ModelRecord, int]:
        with self._lock:
            return {r: weight_bytes(p) for r, p in self._pipes.items()}

    def evict(self, name: str) -> None:
        """Drop every pipeline of the model `name` (unregistered: its folder may change)."""
        with self._lock:
            for record in [r for r in self._pipes if r.name == name]:
                del self._pipes[record]
