"""Serving models to /predict: pipelines loaded once and kept in an LRU cache bounded by count and by weight memory, and a micro-batcher that merges
concurrent requests for the same model and options into one pipeline call (the pipeline then packs their rows under
its token budget). Forward passes run in a thread pool, so the event loop stays free."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .settings import Settings

log = logging.getLogger("hfport.server.serving")


class ModelService:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.pool = ThreadPoolExecutor(settings.predict_threads, thread_name_prefix="hfport-predict")
        self._pipes: OrderedDict[tuple[str, str, str], Any] = OrderedDict()
        self._lock = threading.Lock()
        self._loading: dict[tuple[str, str, str], threading.Lock] = {}
        self._batchers: dict[tuple, _Batcher] = {}
        self.pending = 0

    @property
    def loaded(self) -> int:
        return len(self._pipes)

    def _load(self, key: tuple[str, str, str]) -> Any:
        """The pipeline for (name, path, task): from the cache, or loaded once (concurrent callers wait)."""
        from hfport import pipeline

        with self._lock:
            if key in self._pipes:
                self._pipes.move_to_end(key)
                return self._pipes[key]
            gate = self._loading.setdefault(key, threading.Lock())
        with gate:
            with self._lock:
                if key in self._pipes:
                    return self._pipes[key]
            pipe = pipeline(key[2], model=key[1], dtype=self.settings.predict_dtype)
            with self._lock:
                self._pipes[key] = pipe
                budget = self.settings.model_cache_mb * 2**20
                while len(self._pipes) > 1 and (len(self._pipes) > self.settings.model_cache_size
                                                or sum(map(weight_bytes, self._pipes.values())) > budget):
                    old, _ = self._pipes.popitem(last=False)
                    log.info("model cache: evicted %s (%s)", old[0], old[2])
                self._loading.pop(key, None)
            return pipe

    def evict(self, name: str) -> None:
        with self._lock:
            for key in [k for k in self._pipes if k[0] == name]:
                del self._pipes[key]

    async def predict(self, name: str, path: str, task: str, items: list[Any], parameters: dict[str, Any]) -> list:
        loop = asyncio.get_running_loop()
        key = (name, path, task)
        pipe = await loop.run_in_executor(self.pool, self._load, key)
        bkey = (key, json.dumps(parameters, sort_keys=True, default=str))
        batcher = self._batchers.get(bkey)
        if batcher is None or batcher.pipe is not pipe:
            batcher = self._batchers[bkey] = _Batcher(pipe, parameters, self.pool, self.settings)
        return await batcher.submit(items)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def weight_bytes(pipe: Any) -> int:
    """Memory held by a pipeline's model weights and buffers."""
    model = pipe.model
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


class _Batcher:
    """Requests arriving within batch_max_wait_ms of each other (same model, same options) share one call."""

    def __init__(self, pipe: Any, parameters: dict[str, Any], pool: ThreadPoolExecutor, settings: Settings):
        self.pipe, self.parameters, self.pool, self.settings = pipe, parameters, pool, settings
        self.waiting: list[tuple[list[Any], asyncio.Future]] = []
        self.timer: asyncio.TimerHandle | None = None

    async def submit(self, items: list[Any]) -> list[Any]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self.waiting.append((items, future))
        if sum(len(i) for i, _ in self.waiting) >= self.settings.batch_max_inputs:
            self._flush()
        elif self.timer is None:
            self.timer = loop.call_later(self.settings.batch_max_wait_ms / 1000, self._flush)
        return await future

    def _flush(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        group, self.waiting = self.waiting, []
        group = [(items, f) for items, f in group if not f.cancelled()]  # timed out while waiting
        if not group:
            return
        merged = [x for items, _ in group for x in items]
        loop = asyncio.get_running_loop()
        task = loop.run_in_executor(self.pool, lambda: self.pipe.predict(merged, **self.parameters))

        def done(fut: asyncio.Future) -> None:
            error = fut.exception()
            start = 0
            for items, f in group:
                if f.done():
                    start += len(items)
                    continue
                if error is not None:
                    f.set_exception(error)
                else:
                    results = fut.result()[start:start + len(items)]
                    # per-item error entries carry the merged index: give each request its own
                    for offset, r in enumerate(results):
                        if isinstance(r, dict) and set(r) == {"error", "error_type", "index"}:
                            r["index"] = offset
                            r["error"] = r["error"].replace(f"input {start + offset}:", f"input {offset}:", 1)
                    f.set_result(results)
                start += len(items)

        task.add_done_callback(done)
