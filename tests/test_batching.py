"""The micro-batcher under load: while every predict thread is busy, requests whose wait is over are held and join
one batch when a thread frees (instead of queueing one small batch each behind the running call)."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from server.serving.batching import Batcher, Slots
from server.settings import Settings


class SlowPipe:
    """Records each call's inputs; the first call blocks until released, so the test controls when a thread frees."""

    def __init__(self):
        self.calls: list[list[str]] = []
        self.release = threading.Event()

    def predict(self, items, **_):
        self.calls.append(list(items))
        if len(self.calls) == 1:
            assert self.release.wait(10)
        return [x.upper() for x in items]


def _run(threads: int, max_inputs: int = 32) -> tuple[list[list[str]], list]:
    async def main():
        settings = Settings(predict_threads=threads, batch_max_wait_ms=5, batch_max_inputs=max_inputs)
        pool = ThreadPoolExecutor(threads)
        pipe = SlowPipe()
        batcher = Batcher(pipe, {}, pool, settings, slots=Slots(threads))
        first = asyncio.ensure_future(batcher.submit(["a"]))
        await asyncio.sleep(0.05)  # "a" is running and holds the only thread
        later = []
        for x in "bcde":  # each arrives after the previous one's 5 ms wait is over
            later.append(asyncio.ensure_future(batcher.submit([x])))
            await asyncio.sleep(0.02)
        pipe.release.set()
        results = [r for r, _ in await asyncio.gather(first, *later)]
        pool.shutdown()
        return pipe.calls, results

    return asyncio.run(main())


def test_requests_held_while_the_threads_are_busy_share_one_batch():
    calls, results = _run(threads=1)
    assert results == [["A"], ["B"], ["C"], ["D"], ["E"]]
    assert calls == [["a"], ["b", "c", "d", "e"]]  # before holding: [a], [b], [c], [d], [e]


def test_a_full_batch_goes_without_waiting_for_a_thread():
    calls, results = _run(threads=1, max_inputs=2)
    assert results == [["A"], ["B"], ["C"], ["D"], ["E"]]
    assert calls[0] == ["a"] and ["b", "c"] in calls and sum(map(len, calls)) == 5


def test_a_free_thread_takes_the_batch_at_its_timer():
    start = time.perf_counter()
    calls, _ = _run(threads=2)
    # the second thread is free: b goes alone at its timer, not held for a to finish
    assert calls[0] == ["a"] and calls[1] == ["b"]
    assert time.perf_counter() - start < 5
