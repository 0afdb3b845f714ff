"""Multi-head self-attention: one module, the kernel chosen through a backend slot.

Backends take q, k, v as (B, H, T, D), a boolean key mask (B, 1, 1, T) where True means "attend" (or None
when nothing is padded), and an optional additive score bias (B|1, H|1, T, T) for families that add
relative-position terms (DeBERTa). On a packed batch (nn/unpad.py) the same kernel runs once per sequence over
that sequence's own tokens, with no mask.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .unpad import Packed

# bias(q, k) -> the additive score bias (1|G, H, L, L) of G sequences of length L given their (G, H, L, D) queries
# and keys (DeBERTa's relative terms), or None
SequenceBias = Callable[[Tensor, Tensor], "Tensor | None"]


class AttentionBackend(Protocol):
    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, bias: Tensor | None,
                 dropout_p: float, scale: float) -> Tensor: ...


def _merge_mask_and_bias(mask: Tensor | None, bias: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    if bias is None:
        return mask
    if mask is None:
        return bias.to(dtype)
    return bias.to(dtype).masked_fill(~mask, torch.finfo(dtype).min)  # (B, H, T, T)


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, bias: Tensor | None,
                   dropout_p: float, scale: float) -> Tensor:
    attn_mask = _merge_mask_and_bias(mask, bias, q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale)


def eager_attention(q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, bias: Tensor | None,
                    dropout_p: float, scale: float) -> Tensor:
    """The textbook form; kept as a readable reference and for debugging."""
    scores = (q @ k.transpose(-1, -2)) * scale  # (B, H, T, T)
    if bias is not None:
        scores = scores + bias
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = F.dropout(scores.softmax(dim=-1), p=dropout_p)
    return probs @ v  # (B, H, T, D)


ATTENTION_BACKENDS: dict[str, Callable[..., Tensor]] = {"sdpa": sdpa_attention, "eager": eager_attention}


class SelfAttention(nn.Module):
    """Projections q, k, v, o around a pluggable attention kernel."""

    def __init__(self, hidden_size: int, num_heads: int, dropout: float, backend: str = "sdpa"):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.scale = self.head_dim ** -0.5
        self.dropout = dropout
        self.backend = backend
        self.q = nn.Linear(hidden_size, hidden_size)
        self.k = nn.Linear(hidden_size, hidden_size)
        self.v = nn.Linear(hidden_size, hidden_size)
        self.o = nn.Linear(hidden_size, hidden_size)

    def split_heads(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, bias: Tensor | None = None,
               scale: float | None = None) -> Tensor:
        """Kernel + output projection on already split heads; families with extra score terms call this."""
        b, _, t, _ = q.shape
        out = ATTENTION_BACKENDS[self.backend](
            q, k, v, mask=mask, bias=bias, dropout_p=self.dropout if self.training else 0.0,
            scale=self.scale if scale is None else scale)  # (B, H, T, D)
        out = out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)  # (B, T, C)
        return self.o(out)

    def packed_heads(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Packed rows (N, C) -> q, k, v as (N, H, D) each."""
        n = x.shape[0]
        return tuple(proj(x).view(n, self.num_heads, self.head_dim) for proj in (self.q, self.k, self.v))

    def attend_packed(self, q: Tensor, k: Tensor, v: Tensor, packed: Packed, bias: SequenceBias | None = None,
                      scale: float | None = None) -> Tensor:
        """q, k, v: (N, H, D) packed rows -> (N, C): each sequence attends over its own L_i tokens only.

        One kernel call per run of equal-length sequences (often one per sequence); the per-call overhead is
        small next to the B * T^2 - sum(L_i^2) score entries a masked padded call computes and throws away.
        Measured on a 2-core CPU, 16 rows with 41% padding, attention forward + backward with dropout / without:
        per sequence 156 / 105 ms, one masked padded call 380 / 126 ms, nested-tensor SDPA 672 / 700 ms."""
        n, h, d = q.shape
        kernel = ATTENTION_BACKENDS[self.backend]
        dropout_p = self.dropout if self.training else 0.0
        scale = self.scale if scale is None else scale
        pieces = []
        for start, count, length in packed.runs:
            rows = slice(start, start + count * length)
            qi, ki, vi = (x[rows].view(count, length, h, d).transpose(1, 2) for x in (q, k, v))  # (G, H, L, D)
            out = kernel(qi, ki, vi, mask=None, bias=bias(qi, ki) if bias is not None else None,
                         dropout_p=dropout_p, scale=scale)  # (G, H, L, D)
            pieces.append(out.transpose(1, 2).reshape(count * length, h, d))  # (G * L, H, D)
        return self.o(torch.cat(pieces).reshape(n, h * d))  # (N, C)

    def forward(self, x: Tensor, mask: Tensor | Packed | None) -> Tensor:
        """x: (B, T, C) with a key mask (B, 1, 1, T) or None, or packed (N, C) with its Packed layout."""
        if isinstance(mask, Packed):
            return self.attend_packed(*self.packed_heads(x), mask)  # (N, C)
        q, k, v = self.split_heads(self.q(x)), self.split_heads(self.k(x)), self.split_heads(self.v(x))
        return self.attend(q, k, v, mask)  # (B, T, C)
