"""T5-style bucketed relative attention bias (MPNet): one learned scalar per head for each bucket of the query-key
distance, added to the attention scores of every layer.

The bias depends only on j - i within one sequence, so it serves every layout as a per-sequence score bias
(nn/layout.py: SequenceBias): a packed sequence of length L gets the same (H, L, L) bias as its padded row, as long
as its real tokens are contiguous (a hole in the mask shifts distances: such batches run padded, as transformers
counts distances over padded positions).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .layout import Layout, SequenceBias


def relative_bucket(relative: Tensor, num_buckets: int = 32, max_distance: int = 128) -> Tensor:
    """transformers' MPNetEncoder.relative_position_bucket, operation for operation (so every distance lands in the
    same bucket): relative = key position - query position (..) -> bucket (..) long in [0, num_buckets).

    Half the buckets are for keys before the query, half for keys after; within a half, distances below
    num_buckets / 4 get a bucket each, longer ones log-spaced buckets up to max_distance, then the last bucket."""
    n = -relative
    half = num_buckets // 2
    ret = (n < 0).to(torch.long) * half
    n = torch.abs(n)
    max_exact = half // 2
    is_small = n < max_exact
    # log(0) = -inf at n = 0 is cast to long but never selected (is_small there), as in transformers
    large = max_exact + (torch.log(n.float() / max_exact) / math.log(max_distance / max_exact)
                         * (half - max_exact)).to(torch.long)
    large = torch.min(large, torch.full_like(large, half - 1))
    return ret + torch.where(is_small, n, large)


class BucketedRelativeBias(nn.Module):
    """The shared table (rows, H) and the per-sequence bias callback every layer's attention adds.

    rows: the table's size (config.relative_attention_num_buckets); buckets / max_distance: how distances are
    bucketed (MPNet always buckets into 32 up to 128, whatever the table's size)."""

    def __init__(self, rows: int, heads: int, buckets: int = 32, max_distance: int = 128):
        super().__init__()
        if rows < buckets:
            raise ValueError(f"a bucketed bias over {buckets} buckets needs at least {buckets} table rows, got {rows}")
        self.table = nn.Embedding(rows, heads)
        self.buckets, self.max_distance = buckets, max_distance

    def for_layout(self, layout: Layout) -> SequenceBias:
        """The callback for one forward pass: bias(q, k) -> (1, H, L, L) for sequences of length L = q.shape[2].

        The bucket index of each length is built once per batch (a length from the runtime shape, so a traced graph
        keeps it dynamic); the table lookup runs per call, so each call returns a fresh tensor as SequenceBias asks."""
        def bias(q: Tensor, k: Tensor) -> Tensor:  # (G, H, L, D) each -> (1, H, L, L)
            length = q.shape[2]
            index = layout.cached(("bucketed bias", length, q.device), lambda: self._index(q))  # (L, L)
            return self.table(index).permute(2, 0, 1)[None]  # (L, L, H) -> (1, H, L, L)
        return bias

    def _index(self, q: Tensor) -> Tensor:
        ids = torch.arange(q.shape[2], dtype=torch.long, device=q.device)  # (L,): a size op in a traced graph
        return relative_bucket(ids[None, :] - ids[:, None], self.buckets, self.max_distance)  # (L, L) [query, key]

    def extra_repr(self) -> str:
        return f"buckets={self.buckets}, max_distance={self.max_distance}"
