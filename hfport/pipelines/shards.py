"""Row shards: a pipeline's batch split into contiguous groups of rows, each group's forward pass run on its own worker
thread with ONE intra-op thread (Pipeline.forward_batch; the pipeline's `row_shards`).

Why: the padding-free engine's matmuls and attention runs are small (M = a batch's real tokens, one sequence's
length), and a 2-thread OpenMP team splits each of them again, with a barrier per op; one thread per core, each over
its own rows, keeps both cores busy on whole ops. Measured (scripts/bench_engine_ab.py's batches, 16 rows of 8..256
tokens, 2-core AVX512-BF16 EPYC, 7 interleaved rounds, sharded / unsharded time): fp32 MiniLM 1.16x faster, BERT-base
shape 1.07x; bf16 1.01x and 0.97x; int8 (bf16 float parts) 1.02x and 1.00x: oneDNN's bf16 and int8 kernels already
split small matmuls well over two threads, fp32's do not. The kernels release the GIL, so Python threads are enough.

A pipeline's rows are independent (a result never depends on its batch-mates), so each shard is a batch of its own:
padded to its own longest row, run through the task's forward, its outputs scattered to its own rows. Nothing is
merged and the model is called as usual, once per shard, on a worker thread. Not sharded: a batch mixing adapters
(one pass of the shared body over every row), a model that is no torch module (ONNX graphs run in onnxruntime's own
threads) or not on the CPU, and a caller thread under a torch function or dispatch mode or a trace (per-thread state
that would not follow the rows into the workers).

row_shards: "auto" (the default) shards a model computing in AUTO_DTYPES into min(torch.get_num_threads(), rows,
real tokens // MIN_SHARD_TOKENS) groups; "off" never; an integer N >= 1 into min(N, rows) groups whatever the dtype,
thread count and batch size (N = 1: never).

Thread counts: torch.set_num_threads(n) (ATen's ParallelOpenMP.cpp) sets the calling thread's OpenMP and MKL counts
and ALSO stores n in a process-global atomic, from which every thread that touches ATen later initialises its own
count (at::init_num_threads, once per thread, lazily, at its first get_num_threads or parallel op). A worker setting 1
would so make every thread started afterwards single-threaded. `set_num_threads_here` (what each worker, and a
server's predict threads, run first) therefore reads the count a fresh thread gets, sets its own (after its own lazy
init, which would otherwise reset it on the first op), then stores the count it read back into the global from a
short-lived helper thread (whose own count does not matter), one thread at a time: the caller's count and a new
thread's count are what they were. This happens once per worker (the pool is persistent): set_num_threads also
resizes caffe2's pthreadpool and clears ideep's convolution cache, process-wide. A thread that makes its first ATen
call during those few milliseconds would start with 1. Callers from many threads (the server's predict threads)
queue their shards on the same workers, and each waits only for its own; a worker never waits on the pool.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from typing import Any

import torch

MODES = ("auto", "off")
# "auto" gives each shard at least this many real tokens. Each shard pays its own Python dispatch per op (~1 ms per
# forward of MiniLM's 6 layers), which holds the GIL and so does not overlap with the other shards; a batch whose
# whole forward is a few ms gains nothing from being cut. Not tuned by measurement (issue 30 measured 16-row batches
# of 8..256 tokens only): a floor against tiny batches, not an optimum.
MIN_SHARD_TOKENS = 64
# "auto" shards only models that compute in these dtypes (the module docstring's measurements)
AUTO_DTYPES = (torch.float32,)


def check_row_shards(value: Any) -> str | int:
    """A pipeline's row_shards: "auto", "off" or a shard count >= 1, else a ValueError naming the choices."""
    if isinstance(value, str) and value.strip().lower() in MODES:
        return value.strip().lower()
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise ValueError(f"row_shards={value!r}: expected 'auto', 'off' or a shard count (an integer >= 1)")


def describe(setting: str | int, dtype: torch.dtype) -> str:
    """What SETTING does for a model computing in DTYPE, in words (`hfport info`)."""
    if setting == "off" or setting == 1:
        return f"{setting}: every batch whole"
    if isinstance(setting, int):
        return f"{setting}: batches split into up to {setting} row groups"
    if dtype not in AUTO_DTYPES:
        return f"auto: every batch whole ({str(dtype).removeprefix('torch.')}: no gain measured)"
    return (f"auto: batches of {2 * MIN_SHARD_TOKENS}+ real tokens split over the intra-op threads "
            f"({str(dtype).removeprefix('torch.')})")


def shard_count(setting: str | int, rows: int, tokens: int, dtype: torch.dtype = torch.float32) -> int:
    """How many shards a batch of `rows` rows and `tokens` real tokens runs as under SETTING (1: unsharded), for a
    model computing in DTYPE."""
    if setting == "off":
        return 1
    if isinstance(setting, int):
        return max(1, min(setting, rows))
    if dtype not in AUTO_DTYPES:
        return 1
    return max(1, min(torch.get_num_threads(), rows, tokens // MIN_SHARD_TOKENS))


def split_rows(weights: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """`parts` non-empty contiguous (start, stop) row ranges covering the rows in order, whose weights sum near
    total / parts each: cut k falls where the running sum is nearest k / parts of the total."""
    n = len(weights)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot split {n} rows into {parts} non-empty parts")
    total = sum(weights)
    running = [0, *itertools.accumulate(weights)]  # running[c]: the weight of rows [0, c)
    cuts = [0]
    for k in range(1, parts):
        target = total * k / parts
        # room for the parts still to come: each needs a row
        cuts.append(min(range(cuts[-1] + 1, n - (parts - k) + 1), key=lambda c: abs(running[c] - target)))
    cuts.append(n)
    return list(zip(cuts, cuts[1:]))


def busy_thread() -> bool:
    """Per-thread state that would not follow the rows into the workers: torch function / dispatch modes (a
    torch.device context, a FLOP counter), tracing, compiling, an ONNX export."""
    if torch.compiler.is_compiling():  # first: dynamo reads it as True and traces nothing of the rest
        return True
    onnx = sys.modules.get("torch.onnx")  # loaded by an export; not imported here for nothing
    return (torch._C._len_torch_function_stack() > 0 or torch._C._len_torch_dispatch_stack() > 0
            or torch.jit.is_tracing() or (onnx is not None and onnx.is_in_onnx_export()))


# --- the worker pool ------------------------------------------------------------------------------------------


def _in_fresh_thread(fn: Callable[[], Any]) -> Any:
    """fn() on a thread of its own: what a thread started now sees (or sets) for the process."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn()), name="hfport-shard-probe")
    thread.start()
    thread.join()
    return out[0] if out else None


_threads_lock = threading.Lock()  # one thread at a time between reading the process's count and putting it back


def set_num_threads_here(n: int | None = None, share: int = 1) -> int:
    """This thread's torch intra-op thread count set to N (None: the process's count divided by SHARE, at least 1),
    the process's count (what threads started later get) left as it was (module docstring: torch.set_num_threads
    alone would change both). For a thread pool's initializer, e.g. a server's SHARE predict threads dividing the
    cores: each then runs its matmuls on its share. Serialized: two threads doing it at once would each read the
    other's count as the process's and could leave it behind. Returns the count set."""
    with _threads_lock:
        fresh = _in_fresh_thread(torch.get_num_threads)  # what a thread started now initialises to
        n = n or max(1, fresh // max(1, share))
        torch.get_num_threads()  # ATen's per-thread lazy init first: run later, it would reset the count set next
        torch.set_num_threads(n)
        _in_fresh_thread(lambda: torch.set_num_threads(fresh))  # the global count back; the helper's is ignored
    return n


class ShardPool:
    """Persistent daemon worker threads, each with one intra-op thread, taking shard jobs from one queue."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        self.size = 0
        self._lock = threading.Lock()

    def ensure(self, workers: int) -> None:
        """At least `workers` worker threads, with the process's thread counts as they were (module docstring)."""
        if self.size >= workers:
            return
        with self._lock:
            if self.size >= workers:
                return
            ready = [threading.Event() for _ in range(workers - self.size)]
            for i, event in enumerate(ready):
                threading.Thread(target=self._work, args=(event,), daemon=True,
                                 name=f"hfport-shard-{self.size + i}").start()
            for event in ready:
                event.wait()
            self.size = workers

    def _work(self, ready: threading.Event) -> None:
        set_num_threads_here(1)
        ready.set()
        while True:
            fn, future = self.jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller waiting on the future
                future.set_exception(e)

    def submit(self, fn: Callable[[], Any]) -> Future:
        future: Future = Future()
        self.jobs.put((fn, future))
        return future


_pool: ShardPool | None = None
_pool_lock = threading.Lock()


def pool() -> ShardPool:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ShardPool()
        return _pool


def _forget_pool() -> None:  # a forked child has the pool object but none of its threads (nor a lock's holder)
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def run(jobs: Sequence[Callable[[], Any]]) -> list[Any]:
    """Each job on a worker of the pool, in the caller's autograd and autocast modes (thread-local in torch): their
    results in order, once every job has finished (an error is raised then, so no job still runs behind it)."""
    grad_mode = torch.inference_mode if torch.is_inference_mode_enabled() else torch.no_grad
    if torch.is_grad_enabled():
        grad_mode = torch.enable_grad
    autocast = torch.is_autocast_enabled("cpu")
    cast_dtype = torch.get_autocast_dtype("cpu") if autocast else None

    def in_modes(job: Callable[[], Any]) -> Any:
        cast = torch.autocast("cpu", dtype=cast_dtype) if autocast else contextlib.nullcontext()
        with grad_mode(), cast:
            return job()

    workers = pool()
    workers.ensure(len(jobs))
    futures = [workers.submit(lambda job=job: in_modes(job)) for job in jobs]
    try:
        wait(futures)
    except BaseException:  # Ctrl-C in the caller: the jobs not started are dropped and the running ones waited for
        # (a shard is one forward pass), since a daemon worker still inside a torch op when the interpreter exits
        # aborts the process ("terminate called without an active exception") instead of exiting with 130
        for f in futures:
            f.cancel()
        wait(futures)
        raise
    return [f.result() for f in futures]
