"""Row shards: an inference call on a padded batch split into contiguous groups of rows, each group's forward run on
its own worker thread with ONE intra-op thread, the outputs concatenated on the batch axis.

Why: the padding-free engine's matmuls and attention runs are small (M = a batch's real tokens, one sequence's
length), and a 2-thread OpenMP team splits each of them again, with a barrier per op; one thread per core, each over
its own rows, keeps both cores busy on whole ops. Measured (issue 30, real MiniLM, 6 batches of 16 rows of 8..256
tokens, 2-core EPYC, one noisy run): int8 1192 ms on one 2-thread team vs 1092 ms as two 1-thread halves, bf16
1410 vs 1253 ms. fp32 gains the same way. The kernels release the GIL, so Python threads are enough.

When (`plan`): the model is in eval mode, autograd is off (no_grad or inference_mode: a worker enters the same one,
these modes being per thread), no argument beyond the model inputs (INPUTS) is given (labels, QA positions: a loss
over the whole batch), the inputs are on the CPU, no torch function or dispatch mode is active and nothing traces or
compiles (such modes are per thread and would not follow the rows into the workers), the call is not a mixed-adapter
batch's head replaying the shared body's output (nn/lora.py's `replay_of`: thread-local, keyed on the very input
tensor), and the batch has rows and tokens enough for SHARDS >= 2 shards. Every shard keeps the batch's padded width,
so the outputs' sequence axes match and merge with torch.cat on dim 0 (multiple choice's (B, C, T) inputs split on
B too). A forward running on a worker never shards again (the workers are marked), so the pool is never waited on
from one of its own threads: callers from many threads (the server's predict threads) queue their shards on the same
workers, and each waits only for its own.

HFPORT_ROW_SHARDS (checked at import, read at each call): "auto" (the default) shards into
min(torch.get_num_threads(), rows, real tokens // MIN_SHARD_TOKENS) groups; "off" never; an integer N >= 1 shards
into min(N, rows) groups whatever the intra-op thread count and batch size (N = 1: never).

Thread counts: torch.set_num_threads(n) (ATen's ParallelOpenMP.cpp) sets the calling thread's OpenMP and MKL counts
and ALSO stores n in a process-global atomic, from which every thread that touches ATen later initialises its own
count (at::init_num_threads, once per thread, lazily, at its first get_num_threads or parallel op). A worker setting 1
would so make every thread started afterwards single-threaded. `set_num_threads_here` (what each worker, and a
server's predict threads, run first) therefore reads the count a fresh thread gets, sets its own (after its own lazy
init, which would otherwise reset it on the first op), then stores the count it read back into the global from a
short-lived helper thread (whose own count does not matter), one thread at a time: the caller's count and a new
thread's count are what they were. This happens once per worker (the
pool is persistent): set_num_threads also resizes caffe2's pthreadpool and clears ideep's convolution cache, process-
wide. A thread that makes its first ATen call during those few milliseconds would start with 1.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import os
import queue
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from dataclasses import fields, is_dataclass
from functools import lru_cache
from typing import Any

import torch
from torch import Tensor

from ..errors import ConfigError
from .lora import replay_of

ENV = "HFPORT_ROW_SHARDS"
MODES = ("auto", "off")
# The model inputs, split by rows; a call with any other argument set (labels, start/end positions) is not sharded.
INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids")
# "auto" gives each shard at least this many real tokens. Each shard pays its own Python dispatch per op (~1 ms per
# forward of MiniLM's 6 layers), which holds the GIL and so does not overlap with the other shards; a batch whose
# whole forward is a few ms gains nothing from being cut. Not tuned by measurement (issue 30 measured 16-row batches
# of 8..256 tokens only): a floor against tiny batches, not an optimum.
MIN_SHARD_TOKENS = 64
# "auto" shards only models that compute in these dtypes. Measured (scripts/bench_engine_ab.py's batches, 16 rows of
# 8..256 tokens, 2-core AVX512-BF16 EPYC, 7 interleaved rounds, sharded / unsharded time): fp32 MiniLM 1.16x faster,
# BERT-base shape 1.07x; bf16 1.01x and 0.97x; int8 (bf16 float parts) 1.02x and 1.00x: oneDNN's bf16 and int8
# kernels already split small matmuls well over two threads, fp32's do not
AUTO_DTYPES = (torch.float32,)


@lru_cache(maxsize=8)
def parse(value: str) -> str | int:
    """An HFPORT_ROW_SHARDS value: "auto", "off" or a shard count >= 1."""
    text = value.strip().lower() or "auto"
    if text in MODES:
        return text
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise ConfigError(f"{ENV}={value!r}: expected 'auto', 'off' or a shard count (an integer >= 1)")
    return count


def setting() -> str | int:
    """HFPORT_ROW_SHARDS now: read at each call, so a process may change it between calls."""
    return parse(os.environ.get(ENV, "auto"))


setting()  # and at import: a bad value stops `import hfport` (a server's start), as HFPORT_ROW_BUCKETS's does


def shard_count(rows: int, tokens: int, dtype: torch.dtype = torch.float32) -> int:
    """How many shards a batch of `rows` rows and `tokens` real tokens runs as under the setting (1: unsharded), for
    a model whose parameters are in DTYPE."""
    mode = setting()
    if mode == "off":
        return 1
    if isinstance(mode, int):
        return max(1, min(mode, rows))
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


# --- the worker pool ------------------------------------------------------------------------------------------


class _Local(threading.local):
    worker = False  # True on the pool's own threads: a forward there never shards (nor waits on the pool)


_local = _Local()


def in_worker() -> bool:
    return _local.worker


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
        _local.worker = True
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


# --- one sharded call -----------------------------------------------------------------------------------------


@lru_cache(maxsize=64)
def _signature(forward: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(forward)


def _busy_thread() -> bool:
    """Per-thread state that would not follow the rows into the workers: torch function / dispatch modes (a
    torch.device context, a FLOP counter), tracing, compiling, an ONNX export."""
    if torch.compiler.is_compiling():  # first: dynamo reads it as True and traces nothing of the rest
        return True
    onnx = sys.modules.get("torch.onnx")  # loaded by an export; not imported here for nothing
    return (torch._C._len_torch_function_stack() > 0 or torch._C._len_torch_dispatch_stack() > 0
            or torch.jit.is_tracing() or (onnx is not None and onnx.is_in_onnx_export()))


def plan(forward: Callable[..., Any], model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
         ) -> tuple[dict[str, Any], list[tuple[int, int]]] | None:
    """(the call's model inputs by name, the shards' row ranges) when model(*args, **kwargs) shards, else None.
    `forward`: the model class's forward function. The caller has checked the cheap part: eval mode, autograd off
    (module docstring)."""
    if _busy_thread() or _local.worker or setting() == "off":
        return None
    try:
        bound = _signature(forward).bind(model, *args, **kwargs)
    except TypeError:  # the unsharded call raises it, as it would have
        return None
    inputs = dict(bound.arguments)
    inputs.pop(next(iter(bound.signature.parameters)))  # the model itself
    if any(name not in INPUTS and value is not None for name, value in inputs.items()):
        return None  # labels or positions: a loss over the whole batch
    ids, mask = inputs.get("input_ids"), inputs.get("attention_mask")
    if not isinstance(ids, Tensor) or ids.dim() < 2 or ids.device.type != "cpu" or ids.shape[0] < 2:
        return None
    if replay_of(ids) is not None:  # a mixed-adapter batch's head: the body's output is waiting on this thread
        return None
    rows = ids.shape[0]
    if isinstance(mask, Tensor) and mask.shape[:1] == ids.shape[:1]:
        weights = mask.reshape(rows, -1).ne(0).sum(1).tolist()  # (B,): real tokens (of every choice) per row
    else:
        weights = [ids[0].numel()] * rows
    first = next(model.parameters(), None)
    parts = shard_count(rows, sum(weights), first.dtype if first is not None else torch.float32)
    if parts < 2:
        return None
    return inputs, split_rows(weights, parts)


def _rows(value: Any, rows: int, start: int, stop: int) -> Any:
    """A shard's part of an input: a tensor with the batch's rows on dim 0 is sliced (a view), the rest as given
    (position ids (1, T) broadcast over the rows)."""
    return value[start:stop] if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] == rows else value


def run(call: Callable[..., Any], inputs: dict[str, Any], ranges: list[tuple[int, int]]) -> Any:
    """call(**inputs) as one call per row range on the pool's workers, in the caller's autograd and autocast
    modes (thread-local in torch), the outputs merged on dim 0."""
    rows = ranges[-1][1]
    grad_mode = torch.inference_mode if torch.is_inference_mode_enabled() else torch.no_grad
    autocast = torch.is_autocast_enabled("cpu")
    cast_dtype = torch.get_autocast_dtype("cpu") if autocast else None

    def shard(start: int, stop: int) -> Any:
        part = {name: _rows(value, rows, start, stop) for name, value in inputs.items()}
        cast = torch.autocast("cpu", dtype=cast_dtype) if autocast else contextlib.nullcontext()
        with grad_mode(), cast:
            return call(**part)

    workers = pool()
    workers.ensure(len(ranges))
    futures = [workers.submit(lambda a=a, b=b: shard(a, b)) for a, b in ranges]
    wait(futures)  # all of them, so no shard still runs when an error is raised here
    return merge([f.result() for f in futures], [b - a for a, b in ranges])


def merge(outputs: list[Any], counts: list[int], where: str = "output") -> Any:
    """The shards' outputs as one: tensors concatenated on dim 0 (each must hold its shard's rows there), None
    kept, dataclasses (the model outputs), tuples, lists and dicts merged field by field."""
    first = outputs[0]
    if first is None:
        if any(o is not None for o in outputs):
            raise RuntimeError(f"row shards: {where} is None in some shards only ({ENV}=off runs unsharded)")
        return None
    if isinstance(first, Tensor):
        for o, n in zip(outputs, counts):
            if not isinstance(o, Tensor) or o.dim() == 0 or o.shape[0] != n:
                raise RuntimeError(f"row shards: {where} is not batch-first (a shard of {n} rows gave "
                                   f"{getattr(o, 'shape', type(o).__name__)}; {ENV}=off runs unsharded)")
        return torch.cat(outputs)
    if is_dataclass(first) and not isinstance(first, type):
        return type(first)(**{f.name: merge([getattr(o, f.name) for o in outputs], counts, f"{where}.{f.name}")
                              for f in fields(first)})
    if isinstance(first, (tuple, list)):
        items = [merge([o[i] for o in outputs], counts, f"{where}[{i}]") for i in range(len(first))]
        return type(first)(*items) if hasattr(first, "_fields") else type(first)(items)  # a namedtuple: by position
    if isinstance(first, dict):
        return {k: merge([o[k] for o in outputs], counts, f"{where}[{k!r}]") for k in first}
    raise RuntimeError(f"row shards: cannot merge {where} of type {type(first).__name__} ({ENV}=off runs unsharded)")
