"""The micro-batcher: the one place the server's requests become forward passes.

Requests for one leader pipeline (a model body, and the adapters over it: serving/cache.py) submitted within
batch_max_wait_ms of each other, up to batch_max_inputs inputs, form a group. The group runs as one call in the
service's thread pool, the event loop staying free:
  1. each request is prepared with its own options and adapter (Pipeline.prepare: its items tokenized into rows); a
     request whose options or adapter the pipeline refuses fails alone;
  2. the group's rows are packed longest first into forward passes of at most the model's padded-token budget
     (hfport.pipelines.pack_rows under pipe.max_batch_tokens, which the model cache tuned at load), whatever their
     request, options or adapter (options act before and after the model, never inside it);
  3. each pass runs once over exactly its rows (Pipeline.forward_rows: a pass with rows of several adapters runs the
     shared body once);
  4. each request reads its own results (Pipeline.finish); a failed item is an ItemError in its place.
The pipeline's own batching (Pipeline.batches, for a library call) is not used here."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from hfport.pipelines import Prepared, pack_rows

from ..settings import Settings


@dataclass
class Timing:
    """Seconds one request spent waiting for its group, tokenizing its inputs, and in its group's forward passes."""

    queue: float = 0.0
    tokenization: float = 0.0
    inference: float = 0.0


@dataclass
class Waiting:
    """A submitted request until its group runs."""

    items: list[Any]
    parameters: dict[str, Any]
    adapter: str | None  # the leader's adapter its items run with (None: the leader's own model)
    future: asyncio.Future
    arrived: float = field(default_factory=time.perf_counter)


@dataclass
class GroupRun:
    """What one group's call gives back: per request its results (or the exception that failed it alone) and its
    tokenization seconds; for the group, when it started, the seconds of its forward passes and the distinct
    adapters in each pass."""

    started: float
    results: list[list[Any] | Exception]
    tokenization: list[float]
    inference: float
    adapters: list[int]


class Batcher:
    """One leader pipeline: requests submitted close together share its forward passes."""

    def __init__(self, pipe: Any, pool: ThreadPoolExecutor, settings: Settings, name: str = "", metrics: Any = None):
        self.pipe, self.pool, self.settings = pipe, pool, settings
        self.name, self.metrics = name, metrics
        self.waiting: list[Waiting] = []
        self.timer: asyncio.TimerHandle | None = None

    async def submit(self, items: list[Any], parameters: dict[str, Any],
                     adapter: str | None = None) -> tuple[list[Any], Timing]:
        """The items' results in order (a failed item is an ItemError) and where the request's time went; the
        pipeline's options `parameters`, `adapter` the leader's adapter they run with (None: its own model)."""
        loop = asyncio.get_running_loop()
        self.waiting.append(Waiting(items, parameters, adapter, loop.create_future()))
        future = self.waiting[-1].future
        if sum(len(w.items) for w in self.waiting) >= self.settings.batch_max_inputs:
            self._flush()
        elif self.timer is None:
            self.timer = loop.call_later(self.settings.batch_max_wait_ms / 1000, self._flush)
        return await future

    def _flush(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        group, self.waiting = self.waiting, []
        group = [w for w in group if not w.future.cancelled()]  # timed out while waiting
        if not group:
            return
        task = asyncio.get_running_loop().run_in_executor(self.pool, self.run, group)
        if self.metrics is not None:
            self.metrics.batch_size.labels(self.name).observe(sum(len(w.items) for w in group))
        task.add_done_callback(lambda fut: self._deliver(fut, group))

    def run(self, group: list[Waiting]) -> GroupRun:
        """Steps 1-4 of the module's docstring for one group (in a pool thread)."""
        started = time.perf_counter()
        prepared: list[Prepared | Exception] = []
        tokenization = []
        for w in group:
            begun = time.perf_counter()
            try:
                prepared.append(self.pipe.prepare(w.items, adapter=w.adapter, **w.parameters))
            except Exception as e:  # noqa: BLE001 - its options or its adapter: this request's error alone
                prepared.append(e)
            tokenization.append(time.perf_counter() - begun)
        begun = time.perf_counter()
        passes = pack_rows([row for p in prepared if isinstance(p, Prepared) for row in p.rows],
                           self.pipe.max_batch_tokens)
        for rows in passes:
            self.pipe.forward_rows(rows)
        inference = time.perf_counter() - begun
        results = [p if isinstance(p, Exception) else self.pipe.finish(p) for p in prepared]
        adapters = [len({id(row.pipe) for row in rows}) for rows in passes]  # the base counts as one
        return GroupRun(started, results, tokenization, inference, adapters)

    def _deliver(self, fut: asyncio.Future, group: list[Waiting]) -> None:
        """Hand each request its results (or its own exception, or the group's)."""
        error = fut.exception()
        if error is None:
            done: GroupRun = fut.result()
            if self.metrics is not None:
                for count in done.adapters:
                    self.metrics.batch_adapters.labels(self.name).observe(count)
                self.metrics.tokenization_time.labels(self.name).observe(sum(done.tokenization))
                self.metrics.inference_time.labels(self.name).observe(done.inference)
        for i, w in enumerate(group):
            if w.future.done():
                continue
            if error is not None:
                w.future.set_exception(error)
                continue
            result = done.results[i]
            if isinstance(result, Exception):
                w.future.set_exception(result)
                continue
            # a failed item is an ItemError without a position: the route renders it at its own index
            timing = Timing(max(0.0, done.started - w.arrived), done.tokenization[i], done.inference)
            if self.metrics is not None:
                self.metrics.queue_time.labels(self.name).observe(timing.queue)
            w.future.set_result((result, timing))
