"""Serving models to /predict: pipelines loaded once and kept in an LRU cache bounded by count and by weight memory, and a micro-batcher that merges
concurrent requests for the same model and options into one pipeline call (the pipeline then packs their rows under
its token budget). Forward passes run in a thread pool, so the event loop stays free."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .settings import Settings

log = logging.getLogger("hfport.server.serving")


@dataclass
class Timing:
    """Seconds one request spent waiting for its batch, and its batch's tokenization and forward passes."""

    queue: float = 0.0
    tokenization: float = 0.0
    inference: float = 0.0


class ModelService:
    def __init__(self, settings: Settings, metrics: Any = None):
        self.settings = settings
        self.metrics = metrics  # server.metrics.Metrics, or None
        self.tuning: dict[tuple[str, str, str], Any] = {}  # key -> hfport.embeddings.BatchTuning
        self.pool = ThreadPoolExecutor(settings.predict_threads, thread_name_prefix="hfport-predict")
        self._pipes: OrderedDict[tuple[str, str, str], Any] = OrderedDict()
        self._bases: dict[str, Any] = {}  # base folder -> the bare encoder LoRA adapters over it share
        self._adapter_bases: dict[tuple[str, str, str], str] = {}  # adapter key -> its base folder
        self._lock = threading.Lock()
        self._loading: dict[tuple[str, str, str], threading.Lock] = {}
        self._batchers: dict[tuple, _Batcher] = {}
        self.pending = 0

    @property
    def loaded(self) -> int:
        return len(self._pipes)

    def _load(self, key: tuple[str, str, str]) -> Any:
        """The pipeline for (name, path, task): from the cache, or loaded once (concurrent callers wait). An
        adapter (a base recorded by `get`) runs over the base's tensors, loaded once and shared by every adapter
        over it."""
        from hfport import pipeline

        base = self._adapter_bases.get(key)

        with self._lock:
            if key in self._pipes:
                self._pipes.move_to_end(key)
                return self._pipes[key]
            gate = self._loading.setdefault(key, threading.Lock())
        with gate:
            with self._lock:
                if key in self._pipes:
                    return self._pipes[key]
            pipe = (self._adapter_pipeline(key, base) if base else
                    pipeline(key[2], model=key[1], dtype=self.settings.predict_dtype))
            self._warm_up(key, pipe)
            with self._lock:
                self._pipes[key] = pipe
                budget = self.settings.model_cache_mb * 2**20
                while len(self._pipes) > 1 and (len(self._pipes) > self.settings.model_cache_size
                                                or total_weight_bytes(self._pipes.values()) > budget):
                    old, _ = self._pipes.popitem(last=False)
                    log.info("model cache: evicted %s (%s)", old[0], old[2])
                self._loading.pop(key, None)
            return pipe

    def _adapter_pipeline(self, key: tuple[str, str, str], base: str) -> Any:
        from hfport import AutoModel, lora, pipeline, tasks

        with self._lock:
            gate = self._loading.setdefault(("base", base, ""), threading.Lock())
        with gate:  # one load of each base, however many adapters start at once
            shared = self._bases.get(base)
            if shared is None:
                shared = self._bases[base] = AutoModel.from_pretrained(base)
        model = tasks.get(key[2]).model_class.from_pretrained(key[1], base_model=shared)
        return pipeline(key[2], model=model, tokenizer=lora.adapter_tokenizer(key[1], base))

    def _warm_up(self, key: tuple[str, str, str], pipe: Any) -> None:
        """A first forward pass before the model takes requests; with batch_autotune, forward passes at each
        budget of batch_token_budgets pick the pipeline's max_batch_tokens (hfport.embeddings.tune_batch_tokens)."""
        from hfport import tune_batch_tokens

        budgets = tuple(self.settings.batch_token_budgets) if self.settings.batch_autotune else (pipe.max_batch_tokens,)
        tuning = tune_batch_tokens(pipe, budgets)
        self.tuning[key] = tuning
        if self.metrics is not None:
            self.metrics.batch_tokens.labels(key[0]).set(tuning.chosen)
        log.info("%s (%s): max_batch_tokens=%d; padded tokens/s by budget: %s%s", key[0], key[2], tuning.chosen,
                 {b: round(t) for b, t in tuning.throughput.items()},
                 f"; skipped {tuning.skipped}" if tuning.skipped else "")

    async def get(self, name: str, path: str, task: str, base: str | None = None) -> Any:
        """The loaded (warmed-up) pipeline, loading it in the pool if needed."""
        if base:
            self._adapter_bases[(name, path, task)] = base
        return await asyncio.get_running_loop().run_in_executor(self.pool, self._load, (name, path, task))

    def memory(self) -> dict[tuple[str, str, str], int]:
        with self._lock:
            return {k: weight_bytes(p) for k, p in self._pipes.items()}

    def evict(self, name: str) -> None:
        with self._lock:
            for key in [k for k in self._pipes if k[0] == name]:
                del self._pipes[key]

    async def predict(self, name: str, path: str, task: str, items: list[Any], parameters: dict[str, Any],
                      base: str | None = None) -> list:
        return (await self.predict_timed(name, path, task, items, parameters, base))[0]

    async def predict_timed(self, name: str, path: str, task: str, items: list[Any],
                            parameters: dict[str, Any], base: str | None = None) -> tuple[list, Timing]:
        """predict, and where the request's time went (its batch's tokenization and forward passes). `base`: the
        base model folder of a LoRA adapter at `path`."""
        key = (name, path, task)
        pipe = await self.get(name, path, task, base)
        bkey = (key, json.dumps(parameters, sort_keys=True, default=str))
        batcher = self._batchers.get(bkey)
        if batcher is None or batcher.pipe is not pipe:
            batcher = self._batchers[bkey] = _Batcher(pipe, parameters, self.pool, self.settings, name, self.metrics)
        return await batcher.submit(items)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def weight_bytes(pipe: Any) -> int:
    """Memory held by a pipeline's model weights and buffers."""
    model = pipe.model
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def total_weight_bytes(pipes: Any) -> int:
    """Memory held by the pipelines' weights together: a tensor several adapters share counts once."""
    seen: dict[int, int] = {}
    for pipe in pipes:
        for t in (*pipe.model.parameters(), *pipe.model.buffers()):
            seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


class _Batcher:
    """Requests arriving within batch_max_wait_ms of each other (same model, same options) share one call."""

    def __init__(self, pipe: Any, parameters: dict[str, Any], pool: ThreadPoolExecutor, settings: Settings,
                 name: str = "", metrics: Any = None):
        self.pipe, self.parameters, self.pool, self.settings = pipe, parameters, pool, settings
        self.name, self.metrics = name, metrics
        self.waiting: list[tuple[list[Any], asyncio.Future, float]] = []
        self.timer: asyncio.TimerHandle | None = None

    async def submit(self, items: list[Any]) -> tuple[list[Any], Timing]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self.waiting.append((items, future, time.perf_counter()))
        if sum(len(i) for i, _, _ in self.waiting) >= self.settings.batch_max_inputs:
            self._flush()
        elif self.timer is None:
            self.timer = loop.call_later(self.settings.batch_max_wait_ms / 1000, self._flush)
        return await future

    def _flush(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        group, self.waiting = self.waiting, []
        group = [(items, f, t) for items, f, t in group if not f.cancelled()]  # timed out while waiting
        if not group:
            return
        merged = [x for items, _, _ in group for x in items]
        loop = asyncio.get_running_loop()

        def call() -> tuple[list[Any], float, dict[str, float]]:
            from hfport import phase_times

            started = time.perf_counter()
            with phase_times() as phases:
                results = self.pipe.predict(merged, **self.parameters)
            return results, started, phases

        task = loop.run_in_executor(self.pool, call)
        if self.metrics is not None:
            self.metrics.batch_size.labels(self.name).observe(len(merged))

        def done(fut: asyncio.Future) -> None:
            error = fut.exception()
            if error is None:
                all_results, started, phases = fut.result()
                if self.metrics is not None:
                    self.metrics.tokenization_time.labels(self.name).observe(phases["tokenization"])
                    self.metrics.inference_time.labels(self.name).observe(phases["inference"])
            start = 0
            for items, f, arrived in group:
                if f.done():
                    start += len(items)
                    continue
                if error is not None:
                    f.set_exception(error)
                else:  # a failed item is an ItemError without a position: the route renders it at its own index
                    results = all_results[start:start + len(items)]
                    timing = Timing(max(0.0, started - arrived), phases["tokenization"], phases["inference"])
                    if self.metrics is not None:
                        self.metrics.queue_time.labels(self.name).observe(timing.queue)
                    f.set_result((results, timing))
                start += len(items)

        task.add_done_callback(done)
