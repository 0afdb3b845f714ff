"""Packed attention's padded groups: when a packed batch has many short runs of equal-length sequences, a few padded
kernel calls over its sequences grouped by length cost less than one call per run. plan_groups decides (the cost
rule below) and Groups holds the regrouping; Packed.attend (nn/layout.py) runs it."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from .band import BandPlan, banded, window_band

# When Packed.attend runs padded groups instead of one call per run, in units of one multiply-add of q.k or p.v
# per channel (~0.1 ns on a 2-core CPU): per runs, sum over runs of G * L^2 * C plus CALL_COST per call (a small
# fused SDPA call's fixed cost, forward + backward, ~130 us); a padded group of G sequences padded to L, G * L^2 * C
# plus CALL_COST plus SCATTER_COST per padded element G * L * C (scattering q, k, v and the mask, gathering the
# output, and the backward of each, all memory bound, ~10 ms for 64 rows of <= 30 tokens at C = 384). Measured
# there, attention forward + backward, C = 384, 12 heads (medians of 12 interleaved repeats, noisy shared machine),
# one padded call over all rows against per run: 64 rows of 10-30 tokens in 62 runs, per run
# 9.9 ms / padded 12.1 ms; the same length-sorted (18 runs) 6.6 / 11.4; 16 rows of 16-128 tokens 8.4 / 18.3;
# 4 rows of 16-512 19.7 / 34.4. Padded wins only with many more runs than that (long unsorted batches of short
# texts, e.g. 128 rows of a few tokens each). Grouping by length (the rule picks the groups): 64 rows, 32 of 8-13
# and 32 of 10-21 tokens (an embedding fine-tune's anchors and answers), dropout 0.1, per layer forward + backward,
# medians of 8-10 interleaved repeats (1 thread, noisy shared machine): per run 21.9 ms, one padded call 16.5,
# the 5 groups the rule picks 10.8-11.7, 2 groups 11.9-13.1; without dropout per run 10.9, padded 14.5, 5 groups 9.2.
CALL_COST = 1_300_000
SCATTER_COST = 100
# The same rule's costs on a CUDA GPU, where Packed.attend always runs groups when it cannot run varlen_attn
# (nn/varlen.py): estimates from an H200's rates, not measurements (scripts/bench_gpu.py times the paths). A group's
# calls, forward + backward (scatters, mask, SDPA, gather), are ~12 kernel launches of ~5 us when small, ~60 us, at
# ~2e14 multiply-adds/s in bf16: CUDA_CALL_COST ~ 1.2e10; a padded element moves ~16 bytes over those launches at
# ~4.3 TB/s (3.7 ps), ~750 multiply-adds' time. So a GPU batch is one or a few groups.
CUDA_CALL_COST = 12_000_000_000
CUDA_SCATTER_COST = 750
# "auto" (the cost rule), "runs" or "padded" (one group): how Packed.attend runs a batch without a bias callback.
PACKED_ATTENTION = "auto"
# A padded group spans at most this many distinct lengths (bounds the cost rule's DP at D * 64 steps).
MAX_GROUP_SPAN = 64


class PackedRows(Protocol):
    """What grouping reads of a packed batch (nn/layout.py's Packed): sequence i owns the packed rows
    [starts[i], starts[i] + lengths[i])."""

    lengths: tuple[int, ...]  # real tokens per sequence
    positions: Tensor  # (N,) long: each packed row's position id

    @property
    def batch(self) -> int: ...

    @property
    def starts(self) -> tuple[int, ...]: ...

    @property
    def runs(self) -> tuple[tuple[int, int, int], ...]: ...  # (first row, sequences, length) of equal-length runs


@dataclass(frozen=True, eq=False)
class Groups:
    """Packed sequences regrouped for padded attention: sorted by length and cut into groups, group g holding G_g
    sequences padded to its longest, L_g. Its buffer is the groups' (G_g, L_g) blocks one after the other, each
    sequence's rows first in its block row, padding after."""

    shapes: tuple[tuple[int, int], ...]  # (G, L) of each group, shortest first
    slots: Tensor  # (N,) long: each packed row's row in the buffer
    real: Tensor  # (S,) bool, S = sum G * L: buffer rows that hold a token
    positions: Tensor  # (S,) long: each buffer row's position id (0 at padding)

    @property
    def size(self) -> int:
        return self.real.shape[0]

    @staticmethod
    def build(packed: PackedRows, shapes: tuple[tuple[int, int], ...]) -> Groups:
        """Sequences into the groups in length order (stable; empty sequences have no rows and no slot)."""
        device = packed.positions.device
        order = sorted((i for i, n in enumerate(packed.lengths) if n), key=lambda i: packed.lengths[i])
        first = torch.empty(packed.batch, dtype=torch.long)  # (B,): buffer row of each sequence's first token
        block, taken = 0, 0
        for count, length in shapes:
            members = torch.tensor(order[taken:taken + count], dtype=torch.long)
            first[members] = block + torch.arange(count) * length
            block, taken = block + count * length, taken + count
        lengths = torch.tensor(packed.lengths, device=device)  # (B,)
        seq = torch.repeat_interleave(torch.arange(packed.batch, device=device), lengths)  # (N,)
        starts = torch.tensor(packed.starts, device=device)  # (B,)
        slots = first.to(device)[seq] + torch.arange(seq.shape[0], device=device) - starts[seq]  # (N,)
        real = torch.zeros(block, dtype=torch.bool, device=device)
        real[slots] = True
        positions = torch.zeros(block, dtype=packed.positions.dtype, device=device)
        positions[slots] = packed.positions
        return Groups(shapes, slots, real, positions)

    def to(self, device: torch.device) -> Groups:
        """The same groups with their tensors on `device` (planned on the host, copied without waiting)."""
        return Groups(self.shapes, *(x.to(device, non_blocking=True) for x in (self.slots, self.real,
                                                                                 self.positions)))

    def masks(self, window: int | None) -> list[Tensor | BandPlan | None]:
        """Per group: None (nothing padded, no window), a (G, 1, L|1, L) bool mask (real keys, and the band with a
        window; padded query rows attend to every key), or a BandPlan for long windowed groups."""
        out: list[Tensor | BandPlan | None] = []
        for (count, length), real, positions in zip(self.shapes, *(x.split([g * n for g, n in self.shapes])
                                                                   for x in (self.real, self.positions))):
            real, positions = real.view(count, length), positions.view(count, length)  # (G, L) each
            if banded(length, window):
                out.append(BandPlan.build(positions, real, window))
                continue
            mask = real[:, None, None, :]  # (G, 1, 1, L)
            if window is not None:
                mask = window_band(positions, window)[:, None] & mask  # (G, 1, L, L)
            elif bool(real.all()):
                out.append(None)
                continue
            out.append(mask | ~real[:, None, :, None])  # (G, 1, L, L)
        return out


def plan_groups(packed: PackedRows, width: int, *, call_cost: int | None = None, scatter_cost: int | None = None,
                per_run: bool = True) -> Groups | None:
    """The cost rule (see CALL_COST): padded groups by length when they cost less than one call per run, else
    None (per-run calls). Sequences sorted by length are cut where the DP over their distinct lengths says: a
    group costs call_cost + G * L * width * (L + scatter_cost) for G sequences padded to its longest, L. So a
    batch of many short runs of mixed lengths (64 texts of 8-21 tokens) becomes two or three calls over little
    padding, few long varied ones stay per run. PACKED_ATTENTION forces either ("runs" / "padded": one group
    over all sequences), for tests and measurements. per_run=False always groups (CUDA: no per-run loop);
    call_cost / scatter_cost: the rule's costs (default CALL_COST and SCATTER_COST, read at the call)."""
    call_cost = CALL_COST if call_cost is None else call_cost
    scatter_cost = SCATTER_COST if scatter_cost is None else scatter_cost
    if per_run and (PACKED_ATTENTION == "runs" or (PACKED_ATTENTION == "auto" and len(packed.runs) == 1)):
        return None
    per_length = Counter(n for n in packed.lengths if n)
    if not per_length:  # nothing real to attend over
        return None
    lengths = sorted(per_length)  # (D,) distinct lengths
    counts = [per_length[n] for n in lengths]  # (D,) sequences of each
    if PACKED_ATTENTION == "padded":
        return Groups.build(packed, ((sum(counts), lengths[-1]),))
    # best[j]: the cheapest cut of the shortest j distinct lengths; the last group spans lengths[i:j]
    best, cut = [0.0] * (len(lengths) + 1), [0] * (len(lengths) + 1)
    for j in range(1, len(lengths) + 1):
        longest, count, best[j] = lengths[j - 1], 0, float("inf")
        for i in range(j - 1, max(j - 1 - MAX_GROUP_SPAN, -1), -1):
            count += counts[i]
            cost = best[i] + call_cost + count * longest * width * (longest + scatter_cost)
            if cost < best[j]:
                best[j], cut[j] = cost, i
    runs = sum(count * length ** 2 * width + call_cost for _, count, length in packed.runs)
    if per_run and PACKED_ATTENTION == "auto" and runs <= best[-1]:
        return None
    shapes, j = [], len(lengths)
    while j:
        shapes.append((sum(counts[cut[j]:j]), lengths[j - 1]))
        j = cut[j]
    return Groups.build(packed, tuple(reversed(shapes)))
