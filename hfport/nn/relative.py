"""Relative positions for DeBERTa's disentangled attention: log buckets, the relative index, and the c2p/p2c bias.

The bias is an additive score term handed to the attention kernel (SDPA), so no softmax is written out here.
Only the rows of the relative-embedding table that a length-T sequence can reach are projected (a window of at
most 2T - 1 rows instead of all 2 * span), and each score term is one matmul against the 2T - 1 distances read
along diagonals, with no (B, H, T, T) gather: the result is the same, the work smaller.

That window and the per-length index are Python values a tracer would bake in; `relative_rows` / `gathered_bias`
compute the same bias from tensor ops on the runtime length (transformers' gather over the whole table), for
graphs that must serve every length (ONNX export).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def log_bucket_position(relative: Tensor, bucket_size: int, max_position: int) -> Tensor:
    """DeBERTa's buckets: distances under bucket_size // 2 stay exact, longer ones share log-spaced buckets.

    Written with the same float32 operations as transformers so the ceil lands in the same bucket."""
    sign = torch.sign(relative)
    mid = bucket_size // 2
    near = (relative < mid) & (relative > -mid)
    abs_pos = torch.where(near, torch.tensor(mid - 1).type_as(relative), torch.abs(relative))  # like relative
    log_pos = torch.ceil(torch.log(abs_pos / mid) / torch.log(torch.tensor((max_position - 1) / mid))
                         * (mid - 1)) + mid  # float32, like relative
    return torch.where(abs_pos <= mid, relative.type_as(log_pos), log_pos * sign)


@dataclass(frozen=True)
class RelativeIndex:
    """Which relative-embedding row each query-key distance reads, for one sequence length T.

    The row depends on the distance d = i - j alone (buckets and clamping are functions of d), so every score term
    is a matrix over the 2T - 1 distances, read along diagonals (`diagonal_shift`) instead of gathered per pair.
    `lo:lo + width` is the window of table rows in use; the rows below are relative to it."""

    lo: int
    width: int
    c2p_rows: Tensor  # (2T - 1,) long: row for column m of the c2p matrix, distance d = T - 1 - m
    p2c_rows: Tensor  # (2T - 1,) long: row for column m of the p2c matrix, distance d = m - (T - 1)

    @staticmethod
    def build(length: int, span: int, bucket_size: int, max_position: int, device: torch.device) -> RelativeIndex:
        # on the model's device, as transformers computes its buckets there (one host sync per new length)
        d = torch.arange(-(length - 1), length, dtype=torch.long, device=device)  # (2T - 1,) distances i - j
        rel = relative_position_of(d, bucket_size, max_position)  # (2T - 1,)
        c2p = torch.clamp(rel + span, 0, span * 2 - 1).flip(0)  # column m <-> distance T - 1 - m
        # transformers' p2c reads row clamp(-r[j, i] + span) for the pair (i, j), and r[j, i] is the bucket of -d
        p2c = torch.clamp(-rel.flip(0) + span, 0, span * 2 - 1)  # column m <-> distance m - (T - 1)
        lo = int(torch.minimum(c2p.min(), p2c.min()))
        width = int(torch.maximum(c2p.max(), p2c.max())) - lo + 1
        return RelativeIndex(lo, width, c2p - lo, p2c - lo)


def relative_position_of(distance: Tensor, bucket_size: int, max_position: int) -> Tensor:
    """The relative position transformers assigns to each query-key distance (log-bucketed when asked)."""
    if bucket_size > 0 and max_position > 0:
        return log_bucket_position(distance, bucket_size, max_position).long()
    return distance


def relative_rows(q: Tensor, span: int, bucket_size: int, max_position: int) -> tuple[Tensor, Tensor]:
    """The traceable counterpart of RelativeIndex: (T, T) rows of the whole (2 * span)-row table, from tensor ops on
    the runtime length of q (.., T, D), so a traced graph serves every length (no window, no cache, no Python
    value from a shape). c2p[i, j]: the row query i reads for key j; p2c[j, i]: the row key j reads for query i,
    laid out as transformers gathers it (its relative positions of (j, i) = the bucket of j - i)."""
    ids = torch.arange(q.shape[-2], dtype=torch.long, device=q.device)  # (T,): a size op in the traced graph
    rel = relative_position_of(ids[:, None] - ids[None, :], bucket_size, max_position)  # (T, T) bucket of i - j
    c2p = torch.clamp(rel + span, 0, span * 2 - 1)  # (T, T) [query, key]
    p2c = torch.clamp(-rel + span, 0, span * 2 - 1)  # (T, T) [key, query]
    return c2p, p2c


def gathered_bias(q: Tensor, k: Tensor, pos_key: Tensor | None, pos_query: Tensor | None, c2p_rows: Tensor,
                  p2c_rows: Tensor) -> Tensor:
    """disentangled_bias as transformers computes it (scores against every table row, then a per-pair gather):
    more work than the diagonal shift, but only ops a traced graph keeps dynamic. At least one term is given.

    q, k: (B, H, T, D), q already scaled; pos_key / pos_query: (H, 2 * span, D), pos_query scaled;
    c2p_rows / p2c_rows: relative_rows' (T, T). Returns (B, H, T, T), a fresh tensor."""
    out = None
    if pos_key is not None:
        c2p = q @ pos_key.transpose(-1, -2)  # (B, H, T, 2 * span)
        out = c2p.gather(-1, c2p_rows.expand(c2p.shape[0], c2p.shape[1], -1, -1))  # (B, H, T, T)
    if pos_query is not None:
        p2c = k @ pos_query.transpose(-1, -2)  # (B, H, T_k, 2 * span)
        p2c = p2c.gather(-1, p2c_rows.expand(p2c.shape[0], p2c.shape[1], -1, -1)).transpose(-1, -2)  # (B, H, T, T)
        out = p2c if out is None else out + p2c
    return out


class RelativeIndexCache:
    """RelativeIndex per (length, device): built once, reused by every layer and every later batch."""

    def __init__(self, span: int, bucket_size: int, max_position: int, max_entries: int = 64):
        self.span, self.bucket_size, self.max_position = span, bucket_size, max_position
        self.max_entries = max_entries
        self._cache: dict[tuple[int, torch.device], RelativeIndex] = {}

    def get(self, length: int, device: torch.device) -> RelativeIndex:
        key = (length, device)
        index = self._cache.get(key)
        if index is None:
            if len(self._cache) >= self.max_entries:  # many distinct lengths: keep memory bounded
                self._cache.clear()
            # built as normal tensors even under torch.inference_mode: a cached inference tensor would make every
            # later training step that indexes with it fail ("Inference tensors cannot be saved for backward")
            with torch.inference_mode(False):
                index = self._cache[key] = RelativeIndex.build(length, self.span, self.bucket_size,
                                                               self.max_position, device)
        return index


def diagonal_shift(scores: Tensor) -> Tensor:
    """(..., T, 2T-1) -> (..., T, T) with out[..., i, j] = scores[..., i, j - i + T - 1], as views only.

    Row i of the output starts T - 1 - i columns into row i of the input; read as one flat buffer, that is a
    matrix with row stride 2T - 2 starting at offset T - 1 (the Transformer-XL relative shift)."""
    *batch, t, w = scores.shape
    if t == 1:
        return scores  # (..., 1, 1)
    flat = scores.reshape(*batch, t * w)[..., t - 1: t - 1 + t * (w - 1)]  # (..., T * (2T - 2))
    return flat.reshape(*batch, t, w - 1)[..., :t]  # (..., T, T)


def diagonal_unshift(grad: Tensor) -> Tensor:
    """The gradient of diagonal_shift: (..., T, T) -> (..., T, 2T-1), zero off the band.

    Every element is written once (band copied, the rest zeroed), instead of autograd's zero-fill + copy for each
    of the two slices in diagonal_shift."""
    *batch, t, _ = grad.shape
    if t == 1:
        return grad.clone()
    out = grad.new_empty(*batch, t * (2 * t - 1))  # (..., T * (2T - 1))
    out[..., : t - 1].zero_()
    out[..., t - 1 + t * (2 * t - 2):].zero_()
    band = out[..., t - 1: t - 1 + t * (2 * t - 2)].view(*batch, t, 2 * t - 2)  # (..., T, 2T - 2)
    band[..., :t].copy_(grad)
    band[..., t:].zero_()
    return out.view(*batch, t, 2 * t - 1)


class _DisentangledBias(torch.autograd.Function):
    """shift(c2p) + shift(p2c)^T with masked pairs replaced, in one output buffer; backward writes each gradient
    once. c2p / p2c: (B, H, T, 2T-1) or None; override: (B, 1, T, T) bool or None; fill: the values there."""

    @staticmethod
    def forward(ctx, c2p: Tensor | None, p2c: Tensor | None, override: Tensor | None,
                fill: Tensor | None) -> Tensor:
        if c2p is not None:
            out = diagonal_shift(c2p) + diagonal_shift(p2c).transpose(-1, -2) if p2c is not None \
                else diagonal_shift(c2p).clone(memory_format=torch.contiguous_format)  # (B, H, T, T)
        else:
            out = diagonal_shift(p2c).transpose(-1, -2).clone(memory_format=torch.contiguous_format)  # (B, H, T, T)
        if override is not None:  # replaced, so masked pairs pass no gradient back (as transformers' masked_fill)
            out.masked_fill_(override, 0.0).add_(fill)
        ctx.save_for_backward(override)
        ctx.has = (c2p is not None, p2c is not None)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        (override,) = ctx.saved_tensors
        if override is not None:
            grad = grad.masked_fill(override, 0.0)
        d_c2p = diagonal_unshift(grad) if ctx.has[0] else None
        d_p2c = diagonal_unshift(grad.transpose(-1, -2)) if ctx.has[1] else None
        return d_c2p, d_p2c, None, None


def disentangled_bias(q: Tensor, k: Tensor, pos_key: Tensor | None, pos_query: Tensor | None,
                      override: Tensor | None = None, fill: Tensor | None = None) -> Tensor:
    """DeBERTa's c2p + p2c score terms as one additive bias (B, H, T, T); at least one of the two is given.

    q: (B, H, T, D), already multiplied by the attention scale; k: (B, H, T, D).
    pos_key: (H, 2T - 1, D), column m the key projection of the row for distance T - 1 - m (RelativeIndex.c2p_rows);
    pos_query: (H, 2T - 1, D), column m the (scaled) query projection of the row for distance m - (T - 1).
    c2p[i, j] = q_i . pos_key[j - i + T - 1];  p2c[i, j] = k_j . pos_query[i - j + T - 1].
    override (B, 1, T, T) / fill: pairs whose bias is replaced by fill (the padding mask), or None."""
    c2p = q @ pos_key.transpose(-1, -2) if pos_key is not None else None  # (B, H, T, 2T - 1)
    p2c = k @ pos_query.transpose(-1, -2) if pos_query is not None else None  # (B, H, T_k, 2T - 1)
    return _DisentangledBias.apply(c2p, p2c, override, fill)
