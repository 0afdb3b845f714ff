"""Row buckets: every linear layer of the encoder sees its row count (the M of its matmul) rounded up to one of a few
sizes, the extra rows zero and sliced off its output, so a long-running process builds a bounded set of matmul shapes.

Why: in bf16 on the CPU, torch runs a Linear through oneDNN, which JIT-builds and caches a primitive per shape
(measured in a bf16 fine-tune: ~1.1 ms to build per matmul and new shape, ~1.6 MB held per weight shape). The
padding-free layout's M is the batch's real token count, different for nearly every batch, so a server or a
fine-tune over varied batches created and kept a new set of primitives per batch (RSS 350 -> 843 MB over 150
serving batches of MiniLM). With buckets, M takes at most 8 values up to 128 rows
(multiples of 16) and 8 per doubling above (steps of 1/8): at most 12.5% extra rows above 128, which cost compute
in the matmuls only (nothing else sees the zero rows: they exist inside the linear call and nowhere else, so
dropout draws, attention, pooling and losses are unchanged). Cost, scripts/bench_buckets_ab.py (MiniLM bf16
serving, interleaved A/B on a shared 2-core CPU, so rough): 1.09x and 1.11x the time without buckets.

ROW_BUCKETS (env HFPORT_ROW_BUCKETS, default "off"): "auto" buckets a linear that computes in bf16 / fp16 (its input's dtype or CPU autocast): torch's fp32
CPU linear is a BLAS call that caches nothing per shape, so padding there would be waste. "always" buckets every
dtype (tests compare it with "off" in fp32), "off" never. Traced and compiled graphs (ONNX export) keep their
dynamic shapes: no bucketing there.

Not bucketed: bf16 attention's two batched matmuls (the math form, nn/attention.py), shaped by each call's
(sequences x heads, length): fewer and smaller primitives than the linears', but still one per new pair, so RSS
still grows there over varied batches, if slowly. scripts/bench_rss_shapes.py, MiniLM bf16, 600 batches of
1..16 texts, RSS every 100 batches: without buckets 350 -> 717, 943, 1047, 1140, 1176, 1200 MB (915 after
malloc_trim); with them 350 -> 552, 598, 623, 629, 635, 644 MB (581 after malloc_trim); with them and
ONEDNN_PRIMITIVE_CACHE_CAPACITY=256, 592 / 620 / 620 MB at 200 / 400 / 600: flat. Heads outside the body (a
masked-LM decoder over B * T rows) run unbucketed too.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

MODES = ("auto", "always", "off")
# Off by default: buckets bound a long-running bf16 process's RSS but cost serving time (bench_buckets_ab.py, quiet
# 2-core EPYC, MiniLM bf16, 8 rounds of 20 fresh batches: 1.074x the time), so the user chooses; a server meant to
# run for days on varied traffic sets HFPORT_ROW_BUCKETS=auto.
ROW_BUCKETS = os.environ.get("HFPORT_ROW_BUCKETS", "off").strip().lower() or "off"
if ROW_BUCKETS not in MODES:
    raise ValueError(f"HFPORT_ROW_BUCKETS={ROW_BUCKETS!r}: expected one of {', '.join(MODES)}")
FINE_STEP, FINE_MAX = 16, 128  # multiples of FINE_STEP up to FINE_MAX rows, then 8 steps per doubling


def bucket(rows: int) -> int:
    """The smallest bucket size >= rows: 16, 32, .., 128, then 144, 160, .., 256, 288, 320, .., 512, 576, .."""
    if rows <= FINE_MAX:
        return max(FINE_STEP, -(-rows // FINE_STEP) * FINE_STEP)
    step = 1 << ((rows - 1).bit_length() - 4)  # 1/8 of the power of two below rows
    return -(-rows // step) * step


def _wanted(x: Tensor) -> bool:
    if ROW_BUCKETS == "always":
        return True
    if x.dtype in (torch.bfloat16, torch.float16):
        return True
    return x.device.type == "cpu" and torch.is_autocast_enabled("cpu")


class _RowBuckets(torch.overrides.TorchFunctionMode):
    """F.linear(x (.., K), w, b) as F.linear over x's M = prod(..) rows padded with zeros to bucket(M), output rows
    sliced back (a slice's backward pads the gradient with zeros, so the weight gradient's matmul is bucketed too)."""

    LINEAR = frozenset({F.linear, torch._C._nn.linear})

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func not in self.LINEAR or not args:
            return func(*args, **kwargs)
        x = args[0]
        if not isinstance(x, Tensor) or x.dim() == 0 or not _wanted(x):
            return func(*args, **kwargs)
        k = x.shape[-1]
        m = x.numel() // k if k else 0
        target = bucket(m)
        if m == 0 or target == m:
            return func(*args, **kwargs)
        rows = torch.cat([x.reshape(m, k), x.new_zeros(target - m, k)])  # (M', K)
        out = func(rows, *args[1:], **kwargs)[:m]  # (M, N)
        return out.reshape(*x.shape[:-1], out.shape[-1])  # (.., N)


_active = threading.local()  # a mode is per thread; so is this flag (nested forwards enter once)


@contextlib.contextmanager
def row_buckets() -> Iterator[None]:
    """Bucket the row count of every linear called inside (see the module's docstring)."""
    onnx = sys.modules.get("torch.onnx")  # loaded by an export; not imported here for nothing
    if (ROW_BUCKETS == "off" or getattr(_active, "on", False) or torch.jit.is_tracing()
            or torch.compiler.is_compiling() or (onnx is not None and onnx.is_in_onnx_export())):
        yield
        return
    _active.on = True
    try:
        with _RowBuckets():
            yield
    finally:
        _active.on = False
