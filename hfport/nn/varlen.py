"""Packed attention on CUDA without padding: torch's variable-length flash attention
(`torch.nn.attention.varlen.varlen_attn`, torch >= 2.10) runs every sequence of a packed batch in one call, the
sequences told apart by `cu_seqlens` (B' + 1 row offsets, int32) and bounded by the longest length. nn/layout.py's
Packed builds both on the host before they reach the GPU and picks this path or its fallback (`cuda_route`).

Which torch has it: torch 2.9 had varlen_attn(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False,
return_aux=None), without a scale or a window; torch 2.10 and 2.11 (the GPU machine's) take
`*, return_aux=None, scale=None, window_size=(-1, -1)`; 2.12 and 2.13 add enable_gqa, seqused_k, block_table and
num_splits after those. hfport calls the common form, (q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, scale=,
window_size=), and takes the function only where its signature has both keywords (VARLEN_ATTN is None elsewhere,
and packed attention on CUDA then runs padded SDPA over length groups, said once in the log).

What the kernel takes: q, k, v (N, H, D) in fp16 or bf16 on CUDA, D a multiple of 8 up to 256 (flash attention's
head sizes); window_size (left, right): key j is seen by query i when i - left <= j <= i + right, rows counted
within the sequence, -1 unbounded. torch's wrapper fixes dropout at 0; a training pass with attention dropout
(BERT's default 0.1) calls the flash kernel underneath it, `aten._flash_attention_forward`, with its dropout_p
(`varlen_dropout`): its backward (derivatives.yaml's _flash_attention_backward) replays the forward's dropout mask
from the RNG state the forward returns. Before, such a pass took padded SDPA over length groups: on an H200,
BERT-base fine-tuning ran at 0.53x transformers' Trainer that way (scripts/bench_gpu.py). No additive bias either:
DeBERTa's relative bias takes the padded SDPA path. `varlen_reference` is the same computation in plain torch, one
sequence at a time: tests run the CUDA branch's arithmetic through it on the CPU.
"""

from __future__ import annotations

import inspect
import logging
import sys
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

log = logging.getLogger("hfport.nn")


def _common_form(fn: Callable[..., Tensor] | None) -> Callable[..., Tensor] | None:
    """fn when it takes the keywords hfport passes (torch >= 2.10), else None."""
    if fn is None:
        return None
    params = inspect.signature(fn).parameters
    return fn if {"scale", "window_size"} <= set(params) else None


def _load_varlen_attn() -> Callable[..., Tensor] | None:
    """torch's varlen_attn in the common form, or None. Imported on first use, not with hfport:
    torch.nn.attention.varlen imports torch._dynamo, about a second of CPU at every start-up (a server, a CLI call, an
    export or evaluate job) that never runs packed attention on CUDA."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.9
        return None
    return _common_form(varlen_attn)


def __getattr__(name: str) -> object:
    """VARLEN_ATTN, varlen_attn(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=, window_size=) -> (N, H, D) or
    None, resolved on its first read (PEP 562) and kept as a module attribute from then on (tests set it)."""
    if name == "VARLEN_ATTN":
        globals()[name] = kernel = _load_varlen_attn()
        return kernel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def varlen_kernel() -> Callable[..., Tensor] | None:
    """VARLEN_ATTN as the module holds it now (read through the module: a plain global read would not load it)."""
    return sys.modules[__name__].VARLEN_ATTN


VARLEN_DTYPES = (torch.float16, torch.bfloat16)  # flash attention's
VARLEN_HEAD_DIMS = range(8, 257, 8)  # flash attention's head sizes


@dataclass(frozen=True)
class BoundKernel:
    """An attention backend with its dropout and scale bound: SelfAttention's kernel. Called as a band.Kernel
    (q, k, v, mask=, bias=); a layout that runs another kernel for the same attention (varlen_attn) reads the scale
    and the dropout from it."""

    backend: Callable[..., Tensor]  # (q, k, v, *, mask, bias, dropout_p, scale) -> (G, H, L, D)
    dropout_p: float
    scale: float

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, bias: Tensor | None) -> Tensor:
        return self.backend(q, k, v, mask=mask, bias=bias, dropout_p=self.dropout_p, scale=self.scale)


def varlen_dropout(q: Tensor, k: Tensor, v: Tensor, cu_seq_q: Tensor, cu_seq_k: Tensor, max_q: int, max_k: int,
                   *, scale: float, window_size: tuple[int, int], dropout_p: float) -> Tensor:
    """varlen_attn with attention dropout: (N, H, D) -> (N, H, D). The flash kernel varlen_attn wraps (torch >= 2.10:
    the same arguments, window_size split in two), called with dropout_p; autograd differentiates it itself."""
    out, *_ = torch.ops.aten._flash_attention_forward(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, dropout_p, False,
                                                      False, scale=scale, window_size_left=window_size[0],
                                                      window_size_right=window_size[1])
    return out


def cu_seqlens(lengths: tuple[int, ...]) -> Tensor:
    """(B' + 1,) int32 on the host: the packed row where each non-empty sequence starts, then N. An empty sequence
    has no rows and no entry (the kernel never sees a zero-length sequence)."""
    out = torch.zeros(1 + sum(1 for n in lengths if n), dtype=torch.int32)
    torch.cumsum(torch.tensor([n for n in lengths if n], dtype=torch.int32), dim=0, out=out[1:])
    return out


def window_size(window: int | None) -> tuple[int, int]:
    """A symmetric local window (|i - j| <= window // 2, ModernBERT's) as the kernel's (left, right); None: global."""
    return (-1, -1) if window is None else (window // 2, window // 2)


def cuda_route(dtype: torch.dtype, head_dim: int, *, bias: bool, rows_in_order: bool, varlen: bool) -> str:
    """How a packed batch's attention runs on CUDA: "varlen" (one varlen_attn call over every sequence; with attention
    dropout, varlen_dropout) or "groups" (padded SDPA over length groups, fused kernels; nn/groups.py). varlen needs
    the kernel (`varlen`: this torch has it), fp16/bf16, a flash head size and no additive bias, and, with a window,
    rows one position apart within each sequence (`rows_in_order`: its window counts rows, hfport's counts position
    ids). Attention dropout does not decide: the flash kernel takes any rate."""
    if not varlen or bias or dtype not in VARLEN_DTYPES or head_dim not in VARLEN_HEAD_DIMS \
            or not rows_in_order:
        return "groups"
    return "varlen"


_said: set[str] = set()


def say_once(reason: str) -> None:
    """Why packed attention on CUDA took the padded path, logged the first time each reason comes up."""
    if reason not in _said:
        _said.add(reason)
        level = logging.WARNING if varlen_kernel() is None else logging.INFO
        log.log(level, "packed attention on CUDA: padded SDPA over length groups (fused kernels), %s", reason)


def fallback_reason(dtype: torch.dtype, head_dim: int, *, bias: bool) -> str:
    """The words say_once logs for a "groups" route."""
    if varlen_kernel() is None:
        return (f"since torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn with scale= and "
                "window_size= (torch >= 2.10)")
    if bias:
        return "for an additive score bias (DeBERTa's relative positions), which varlen_attn does not take"
    if dtype not in VARLEN_DTYPES:
        return f"for {dtype} (varlen_attn takes float16 and bfloat16)"
    if head_dim not in VARLEN_HEAD_DIMS:
        return f"for heads of {head_dim} (varlen_attn takes multiples of 8 up to 256)"
    return "for a windowed batch whose position ids skip (a hole in the attention mask)"


def varlen_reference(q: Tensor, k: Tensor, v: Tensor, cu_seq_q: Tensor, cu_seq_k: Tensor, max_q: int, max_k: int,
                     *, scale: float, window_size: tuple[int, int] = (-1, -1), dropout_p: float = 0.0) -> Tensor:
    """varlen_attn's arithmetic in plain torch, one sequence at a time in fp32: q, k, v (N, H, D) -> (N, H, D).
    Sequence s owns rows cu[s]:cu[s + 1] (queries and keys alike: self-attention); query i sees key j when
    i - left <= j <= i + right (-1: no bound), rows counted from the sequence's first. dropout_p: inverted dropout on
    the probabilities (torch's generator, not the flash kernel's: the same law, other draws). For tests on any
    device."""
    if not torch.equal(cu_seq_q, cu_seq_k):
        raise ValueError("varlen_reference computes self-attention: cu_seq_q and cu_seq_k must be equal")
    bounds = cu_seq_q.tolist()
    longest = max((b - a for a, b in zip(bounds[:-1], bounds[1:])), default=0)
    if longest > min(max_q, max_k):
        raise ValueError(f"a sequence of {longest} rows exceeds max_q={max_q} / max_k={max_k}")
    left, right = window_size
    out = torch.zeros_like(q)
    for a, b in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (x[a:b].transpose(0, 1).float() for x in (q, k, v))  # (H, L, D)
        scores = (qs @ ks.transpose(-1, -2)) * scale  # (H, L, L)
        rows = torch.arange(b - a, device=q.device)
        offset = rows[None, :] - rows[:, None]  # (L, L): j - i
        seen = torch.ones_like(offset, dtype=torch.bool)
        if left >= 0:
            seen &= offset >= -left
        if right >= 0:
            seen &= offset <= right
        probs = scores.masked_fill(~seen, float("-inf")).softmax(dim=-1)  # (H, L, L)
        if dropout_p > 0:
            probs = torch.nn.functional.dropout(probs, dropout_p)
        out[a:b] = (probs @ vs).transpose(0, 1).to(q.dtype)  # (L, H, D)
    return out
