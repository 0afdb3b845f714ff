"""The micro-batcher: concurrent requests for the same pipeline and options, arriving within batch_max_wait_ms of
each other, share one pipeline call (the pipeline then packs their rows under its token budget). A request may
name one of the pipeline's adapters: requests for different adapters share the call, each item with its own
adapter (Pipeline.predict's adapter=). The call runs in the service's thread pool, so the event loop stays free.

While every predict thread is busy, a batch whose wait is over is held rather than queued behind the running calls:
requests keep joining it until a thread frees (or it holds batch_max_inputs), so under load batches grow and a
pass's fixed costs (per-layer kernels, an adapter's small matmuls) are shared by more rows; a request waits no longer
than it would have waited in the pool's queue. Under light load nothing changes: a thread is free at the timer."""

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


class Slots:
    """The predict threads' occupancy, shared by a service's batchers (read and changed on the event loop only)."""

    def __init__(self, threads: int):
        self.threads, self.busy = threads, 0
        self.held: list[Batcher] = []  # batchers holding a batch for a free thread, oldest first

    def hold(self, batcher: Batcher) -> None:
        if batcher not in self.held:
            self.held.append(batcher)

    def release(self) -> None:
        """A call finished: the oldest held batches take the free threads."""
        self.busy -= 1
        while self.held and self.busy < self.threads:
            self.held.pop(0)._flush()


class Batcher:
    """One pipeline with one set of options: requests submitted close together share one call."""

    def __init__(self, pipe: Any, parameters: dict[str, Any], pool: ThreadPoolExecutor, settings: Settings,
                 name: str = "", metrics: Any = None, slots: Slots | None = None):
        self.pipe, self.parameters, self.pool, self.settings = pipe, parameters, pool, settings
        self.name, self.metrics = name, metrics
        self.slots = slots or Slots(settings.predict_threads)
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
        self.waiting = [entry for entry in self.waiting if not entry[1].cancelled()]  # timed out while waiting
        if not self.waiting:
            return
        full = sum(len(i) for i, *_ in self.waiting) >= self.settings.batch_max_inputs
        if self.slots.busy >= self.slots.threads and not full:
            self.slots.hold(self)  # flushed by Slots.release when a thread frees; submit() flushes it when full
            return
        group, self.waiting = self.waiting, []
        merged = [x for items, _, _, _ in group for x in items]
        adapters = [a for items, _, _, a in group for _ in items]
        self.slots.busy += 1
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
        """Hand each request its slice of the merged results (or the call's exception), then free the thread."""
        try:
            self._hand_out(fut, group)
        finally:
            self.slots.release()

    def _hand_out(self, fut: asyncio.Future, group: list[tuple[list[Any], asyncio.Future, float, Any]]) -> None:
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
