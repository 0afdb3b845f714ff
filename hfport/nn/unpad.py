"""Padding-free execution: a padded batch's real tokens packed into one (N, C) tensor, and back.

A padded batch (B, T) with N real tokens runs its embeddings, projections, feed-forwards and LayerNorms on the N
rows only, and attention per sequence over its own tokens (sum of L_i^2 scores instead of B * T^2). The result is
unpacked into the caller's (B, T, C) layout with zeros at padding positions. Real text under dynamic padding is
40-60% padding, which transformers computes and hfport does not.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate

import torch
from torch import Tensor


@dataclass(frozen=True, eq=False)
class Packed:
    """Where a padded batch's real tokens are, and how to move tensors between the two layouts.

    Real tokens are packed sequence by sequence, in their order within the sequence, so sequence i owns packed
    rows [starts[i], starts[i] + lengths[i])."""

    keep: Tensor  # (B, T) bool: real tokens
    index: Tensor  # (N,) long: flat position b * T + t of each real token
    lengths: tuple[int, ...]  # real tokens per sequence
    contiguous: bool  # every sequence's real tokens form one run (left or right padding, no holes)

    @staticmethod
    def from_mask(attention_mask: Tensor) -> Packed | None:
        """None when nothing is padded: the plain (B, T) path is then as fast and needs no gathering."""
        keep = attention_mask.bool()  # (B, T)
        if bool(keep.all()):
            return None
        b, t = keep.shape
        index = keep.reshape(-1).nonzero().squeeze(1)  # (N,)
        lengths = keep.sum(dim=1)  # (B,)
        first = keep.int().argmax(dim=1)  # (B,): first real token
        span = torch.arange(t, device=keep.device)[None, :]  # (1, T)
        run = (span >= first[:, None]) & (span < (first + lengths)[:, None])  # (B, T)
        return Packed(keep, index, tuple(lengths.tolist()), bool((run == keep).all()))

    @property
    def batch(self) -> int:
        return self.keep.shape[0]

    @property
    def width(self) -> int:
        return self.keep.shape[1]

    @cached_property
    def starts(self) -> tuple[int, ...]:
        return tuple(accumulate(self.lengths, initial=0))[:-1]

    @cached_property
    def runs(self) -> tuple[tuple[int, int, int], ...]:
        """(first packed row, number of sequences, length) of each run of consecutive equal-length sequences:
        one attention call serves a whole run (length-sorted batches, e.g. predict's, have long runs)."""
        out: list[tuple[int, int, int]] = []
        for start, n in zip(self.starts, self.lengths):
            if not n:
                continue
            if out and out[-1][2] == n:
                first, count, _ = out[-1]
                out[-1] = (first, count + 1, n)
            else:
                out.append((start, 1, n))
        return tuple(out)

    @property
    def max_length(self) -> int:
        return max(self.lengths)

    def pack(self, x: Tensor) -> Tensor:
        """(B, T, ...) -> (N, ...). Integer tensors (ids) are gathered directly; float ones keep a fast gradient."""
        flat = x.reshape(self.batch * self.width, *x.shape[2:])  # (B * T, ...)
        if not flat.is_floating_point() or flat.dim() != 2:
            return flat.index_select(0, self.index)
        return Rows.apply(flat, self.index, True)

    def unpack(self, x: Tensor) -> Tensor:
        """(N, F) -> (B, T, F), zeros at padding positions."""
        return _Scatter.apply(x, self.index, self.batch * self.width).view(self.batch, self.width, x.shape[-1])


class Rows(torch.autograd.Function):
    """x.index_select(0, rows) with a faster gradient: index_copy_ when the rows are distinct (packing), which on
    CPU is several times faster than index_select's generic scatter-add backward; index_add_ when rows repeat."""

    @staticmethod
    def forward(ctx, x: Tensor, rows: Tensor, distinct: bool) -> Tensor:  # (M, F) -> (N, F)
        ctx.save_for_backward(rows)
        ctx.m, ctx.distinct = x.shape[0], distinct
        return x.index_select(0, rows)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (rows,) = ctx.saved_tensors
        out = grad.new_zeros(ctx.m, grad.shape[1])
        write = out.index_copy_ if ctx.distinct else out.index_add_
        return write(0, rows, grad.contiguous()), None, None


class _Scatter(torch.autograd.Function):
    """Rows into a zero tensor of M rows; the gradient is the same rows of the incoming gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, rows: Tensor, m: int) -> Tensor:  # (N, F) -> (M, F)
        ctx.save_for_backward(rows)
        return x.new_zeros(m, x.shape[1]).index_copy_(0, rows, x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (rows,) = ctx.saved_tensors
        return grad.index_select(0, rows), None, None
