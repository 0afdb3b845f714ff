"""The micro-batcher: concurrent requests for the same pipeline and options, arriving within batch_max_wait_ms of
each other, share one pipeline call (the pipeline then packs their rows under its token budget). A request may
name one of the pipeline's adapters: requests for different adapters share the call, each item with its own
adapter (Pipeline.predict's adapter=). The call runs in the service's thread pool, so the event loop stays free."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from hfport import phase_times
from hfport.pipelines import adapters_per_pass

from ..settings import Settings


@dataclass
class Timing:
    """Seconds one request spent waiting for its batch, and its batch's tokenization and forward passes."""

    queue: float = 0.0
    tokenization: float = 0.0
    inference: float = 0.0


class Batcher:
    """One pipeline with one set of options: requests submitted close together share one call."""

    def __init__(self, pipe: Any, parameters: dict[str, Any], pool: ThreadPoolExecutor, settings: Settings,
                 name: str = "", metrics: Any = None):
        self.pipe, self.parameters, self.pool, self.settings = pipe, parameters, pool, settings
        self.name, self.metrics = name, metrics
        # (items, their future, arrival time, their adapter or None)
        self.waiting: list[tuple[list[Any], asyncio.Future, float, str | None]] = []
        self.timer: asyncio.TimerHandle | None = None

    async def submit(self, items: list[Any], adapter: str | None = None) -> tuple[list[Any], Timing]:
        """The items' results in order (a failed item is an ItemError) and where the request's time went;
        `adapter`: the pipeline's adapter they run with (None: the pipeline's own model)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self.waiting.append((items, future, time.perf_counter(), adapter))
        if sum(len(i) for i, *_ in self.waiting) >= self.settings.batch_max_inputs:
            self._flush()
        elif self.timer is None:
            self.timer = loop.call_later(self.settings.batch_max_wait_ms / 1000, self._flush)
        return await future

    def _flush(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        group, self.waiting = self.waiting, []
        group = [entry for entry in group if not entry[1].cancelled()]  # timed out while waiting
        if not group:
            return
        merged = [x for items, _, _, _ in group for x in items]
        adapters = [a for items, _, _, a in group for _ in items]
        task = asyncio.get_running_loop().run_in_executor(self.pool, self._call, merged, adapters)
        if self.metrics is not None:
            self.metrics.batch_size.labels(self.name).observe(len(merged))
        task.add_done_callback(lambda fut: self._deliver(fut, group))

    def _call(self, merged: list[Any], adapters: list[str | None]) -> tuple[list[Any], float, dict[str, float],
                                                                            list[int]]:
        started = time.perf_counter()
        mixed = {"adapter": adapters} if any(a is not None for a in adapters) else {}
        with phase_times() as phases, adapters_per_pass() as passes:
            results = self.pipe.predict(merged, **mixed, **self.parameters)
        return results, started, phases, passes

    def _deliver(self, fut: asyncio.Future, group: list[tuple[list[Any], asyncio.Future, float, Any]]) -> None:
        """Hand each request its slice of the merged results (or the call's exception)."""
        error = fut.exception()
        if error is None:
            all_results, started, phases, passes = fut.result()
            if self.metrics is not None:
                for count in passes:  # distinct adapters in each forward pass (the base counts as one)
                    self.metrics.batch_adapters.labels(self.name).observe(count)
                self.metrics.tokenization_time.labels(self.name).observe(phases["tokenization"])
                self.metrics.inference_time.labels(self.name).observe(phases["inference"])
        start = 0
        for items, f, arrived, _ in group:
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
