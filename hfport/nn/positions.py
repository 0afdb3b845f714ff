"""Positions: RoBERTa's position ids counted from the padding, and rotary embeddings (RoPE).

Absolute position embeddings live in the embedding module (nn/layers.py); relative terms come as a score bias
(nn/relative.py); rotary positions rotate q and k inside attention, at the positions the layout gives its rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


def positions_from_padding(input_ids: Tensor, pad_token_id: int) -> Tensor:
    """RoBERTa's position ids: real tokens count from pad_token_id + 1, padding stays at pad_token_id."""
    real = input_ids.ne(pad_token_id).long()  # (B, T)
    return torch.cumsum(real, dim=1) * real + pad_token_id


def rotate_half(x: Tensor) -> Tensor:
    """(.., D) -> (.., D): [x1, x2] -> [-x2, x1], the halves pairing dimension i with i + D / 2."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


@dataclass(frozen=True)
class RopeScaling:
    """transformers' two RoPE scalings that change the frequencies only (attention factor 1), as
    modeling_rope_utils computes them:

    linear   inv_freq / factor
    dynamic  NTK: base * (factor * L / max_positions - (factor - 1)) ** (D / (D - 2)), L = max(the batch's longest
             position + 1, max_positions): below max_positions nothing changes. L is the batch's, so with dynamic
             scaling one row's values depend on the batch's longest row (transformers reads max(position_ids) + 1
             of the padded batch; the packed layout's positions give the longest real row)."""

    kind: str  # "linear" | "dynamic"
    factor: float
    max_positions: int  # config.max_position_embeddings

    def inv_freq(self, theta: float, head_dim: int, positions: Tensor) -> Tensor:
        """(D / 2,) float32 frequencies, computed with transformers' operations in transformers' order."""
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
        if self.kind == "linear":
            return (1.0 / (theta ** exponents)) / self.factor
        longest = positions.max() + 1  # 0-d long tensor: no host sync, traceable
        length = torch.maximum(longest, torch.tensor(self.max_positions, dtype=longest.dtype, device=longest.device))
        base = theta * ((self.factor * length / self.max_positions) - (self.factor - 1)) ** (head_dim / (head_dim - 2))
        return 1.0 / (base ** exponents)  # (D / 2,)


class Rotary(nn.Module):
    """RoPE as transformers' ModernBERT applies it: inv_freq = 1 / theta^(arange(0, D, 2) / D), angles
    position * inv_freq repeated over both halves, x * cos + rotate_half(x) * sin, computed in float32.

    Positions are the layout's (nn/layout.py): (B|1, T) on a padded batch, (N,) on packed rows, where each
    right-padded sequence restarts at 0. The scores depend on position differences only, so a constant shift per
    sequence changes nothing. No parameters and no buffers: inv_freq is recomputed (D / 2 numbers) so a model cast
    to bf16 keeps float32 frequencies; the cos / sin tables are built once per batch and shared by every layer
    with the same theta."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None = None):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head dimension, got {head_dim}")
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling

    def tables(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions (..) -> cos, sin (.., 1, D) in dtype (broadcast over heads)."""
        if self.scaling is not None:
            inv_freq = self.scaling.inv_freq(self.theta, self.head_dim, positions)  # (D / 2,)
        else:
            inv_freq = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float,
                                                          device=positions.device) / self.head_dim))  # (D / 2,)
        freqs = positions[..., None].float() * inv_freq  # (.., D / 2)
        angles = torch.cat((freqs, freqs), dim=-1)[..., None, :]  # (.., 1, D)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x (.., H, D) -> (.., H, D), in float32 and back to x's dtype, as transformers does."""
        xf = x.float()
        return (xf * cos + rotate_half(xf) * sin).to(x.dtype)

    def forward(self, q: Tensor, k: Tensor, layout, heads: int) -> tuple[Tensor, Tensor]:
        """q, k: rows (.., C) of `layout` -> rotated (.., C) each."""
        cos, sin = layout.cached(("rotary", self.theta, self.head_dim, self.scaling, q.dtype),
                                 lambda: self.tables(layout.positions, q.dtype))  # (.., 1, D)
        shape = (*q.shape[:-1], heads, self.head_dim)
        q = self.rotate(q.reshape(shape), cos, sin)  # (.., H, D)
        k = self.rotate(k.reshape(shape), cos, sin)
        return q.flatten(-2), k.flatten(-2)  # (.., C)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}" + (f", scaling={self.scaling}" if self.scaling else "")
