"""Local (sliding-window) attention: the band of keys a query sees (window_band), and the blocked kernel call that
scores only that band on long sequences (BandPlan). Every layout's attention uses it (nn/layout.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

# kernel(q, k, v, mask=, bias=) -> (G, H, L, D): q, k, v (G, H, L, D); mask bool (G|1, 1, L|1, L), True = attend,
# or None; bias additive (G|1, H|1, L, L) or None. Dropout and scale are bound by the attention module.
Kernel = Callable[..., Tensor]

# Banded local attention (see `BandPlan`) from this many windows of length on. Measured on a 2-core CPU, one
# thread, window 128, 6 heads of 64, two sequences, attention forward + backward (min of 16, blocked / full masked):
# L = 256 1.06, 320 0.89, 384 0.78, 512 0.57; below ~2.5 windows the slab copies eat the saved scores.
BANDED_MIN_WINDOWS = 2.5


def window_band(positions: Tensor, window: int) -> Tensor:
    """(..., L) position ids -> (..., L, L) bool: True where |p_i - p_j| <= window // 2 (ModernBERT's local
    attention, symmetric, window // 2 tokens each side). Distances are between position ids, so a hole in the mask
    keeps its width, as in the padded layout."""
    return (positions[..., :, None] - positions[..., None, :]).abs() <= window // 2  # (..., L, L)


@dataclass(frozen=True, eq=False)
class BandPlan:
    """Local attention over G sequences of length L in query blocks: block [s, s + Q) needs only the keys
    [s - w // 2, s + Q + w // 2) (a slab of S = Q + 2 * (w // 2) rows), so one kernel call over G * nb blocks
    scores G * L * S pairs instead of G * L^2 (PyTorch's CPU SDPA scores the whole L x L, then masks the band).

    Exact: every key outside a block's slab is outside the band of its queries (position ids grow at least as
    fast as the row index, holes included), so a query's softmax sees the same keys; only the summation order
    differs (fp32 ~1e-7). With attention dropout the dropped entries come from another RNG stream than the full
    call's (the same distribution: each in-band probability dropped independently)."""

    blocks: int  # nb = ceil(L / Q)
    block: int  # Q = w // 2 queries per block
    half: int  # w // 2
    length: int  # L
    mask: Tensor  # (G * nb, 1, Q, S) bool, True = attend

    @staticmethod
    def build(positions: Tensor, valid: Tensor | None, window: int) -> BandPlan:
        """positions (G, L) long; valid (G, L) bool real tokens (None: all real). Query rows that are not real
        attend to their whole slab (their outputs are thrown away; a fully masked row would be NaN)."""
        g, length = positions.shape
        half = window // 2
        block = max(half, 1)
        blocks = -(-length // block)
        tail = blocks * block - length
        slab = block + 2 * half
        if valid is None:
            valid = torch.ones_like(positions, dtype=torch.bool)
        qpos = F.pad(positions, (0, tail)).view(g, blocks, block)  # (G, nb, Q)
        qreal = F.pad(valid, (0, tail), value=False).view(g, blocks, block)  # (G, nb, Q)
        kpos = F.pad(positions, (half, tail + half)).unfold(1, slab, block)  # (G, nb, S)
        kreal = F.pad(valid, (half, tail + half), value=False).unfold(1, slab, block)  # (G, nb, S)
        mask = ((qpos[..., :, None] - kpos[..., None, :]).abs() <= half) & kreal[..., None, :]  # (G, nb, Q, S)
        mask = mask | ~qreal[..., :, None]
        return BandPlan(blocks, block, half, length, mask.reshape(g * blocks, 1, block, slab))

    def to(self, device: torch.device, non_blocking: bool = False) -> BandPlan:
        """The same plan with its mask on `device` (as Tensor.to: a plan built on the host, sent to the GPU)."""
        return BandPlan(self.blocks, self.block, self.half, self.length,
                        self.mask.to(device, non_blocking=non_blocking))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, kernel: Kernel) -> Tensor:
        """q, k, v (G, H, L, D) -> (G, H, L, D)."""
        g, h, length, d = q.shape
        nb, block, half = self.blocks, self.block, self.half
        tail = nb * block - length
        slab = block + 2 * half
        qb = F.pad(q, (0, 0, 0, tail)).view(g, h, nb, block, d).transpose(1, 2).reshape(g * nb, h, block, d)

        def slabs(x: Tensor) -> Tensor:  # (G, H, L, D) -> (G * nb, H, S, D)
            x = F.pad(x, (0, 0, half, tail + half)).unfold(2, slab, block)  # (G, H, nb, D, S)
            return x.permute(0, 2, 1, 4, 3).reshape(g * nb, h, slab, d)

        out = kernel(qb, slabs(k), slabs(v), mask=self.mask, bias=None)  # (G * nb, H, Q, D)
        out = out.view(g, nb, h, block, d).transpose(1, 2).reshape(g, h, nb * block, d)  # (G, H, nb * Q, D)
        return out[:, :, :length]


def attend_local(q: Tensor, k: Tensor, v: Tensor, kernel: Kernel, mask: Tensor | BandPlan | None) -> Tensor:
    """One sequence group's kernel call: a BandPlan runs blocked, a mask (or None) one full call."""
    if isinstance(mask, BandPlan):
        return mask.attend(q, k, v, kernel)
    return kernel(q, k, v, mask=mask, bias=None)


def banded(length: int, window: int | None) -> bool:
    """Whether local attention over sequences of this length runs blocked (BandPlan)."""
    return window is not None and length >= BANDED_MIN_WINDOWS * window
