"""Multi-head self-attention: one module, the kernel chosen through a backend slot, the layout (nn/layout.py)
deciding how sequences reach the kernel.

Backends take q, k, v as (G, H, L, D), a boolean mask (G|1, 1, L|1, L) where True means "attend" (or None when
nothing is masked), and an optional additive score bias (G|1, H|1, L, L). Injection points, all constructor
arguments or call arguments rather than branches on a family: `bias` (a per-sequence score-bias callback, DeBERTa's
relative terms), `rotary` (positions applied to q and k), `window` (local attention), `qkv` (a fused projection),
`bias=False` projections, and `scale` / `scale_query` (DeBERTa scales the query once, before its bias reads it).
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .dropout import dropout
from .layout import Layout, SequenceBias
from .lora import Route, routed
from .positions import Rotary
from .varlen import BoundKernel


class AttentionBackend(Protocol):
    def __call__(self, q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, bias: Tensor | None,
                 dropout_p: float, scale: float) -> Tensor: ...


def _merge_mask_and_bias(mask: Tensor | None, bias: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    if bias is None:
        return mask
    if mask is None:
        return bias.to(dtype)
    return bias.to(dtype).masked_fill(~mask, torch.finfo(dtype).min)  # (B, H, T, T)


# The largest score tensor (G * H * L * L entries) the bf16 CPU path computes in the math form: training keeps the
# probabilities for the backward, which SDPA does not (2**24 entries = 32 MiB in bf16 per call).
MATH_SCORES_MAX = 2 ** 24
# Inference calls (no gradient wanted) with at most this many score entries take the fused kernel instead: the math
# form's five ops cost ~60-70 us of fixed overhead each call, which a short sequence's whole attention does not. bf16,
# heads 12 x 32, forward only, best of 3 x 100 calls, us math / fused (2-core AVX512-BF16 EPYC, quiet):
#   two threads: G=1 L=16 71/25, L=32 99/42, L=48 138/76, L=64 123/105, L=96 170/197; G=4 L=16 126/85, L=32 160/139;
#                G=16 L=16 371/463 (many tiny heads: the fused kernel's per-head cost wins no more)
#   one thread:  G=1 L=16 70/35, L=32 86/60, L=48 142/118, L=64 154/167; G=4 L=16 154/129; G=16 L=16 457/482
# 2**15 entries takes every case where fused won by 1.4x or more (G=1 up to L=48, G=4 at L=16) and none it lost.
FUSED_INFERENCE_SCORES_MAX = 2 ** 15


def _math_is_faster(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """bf16 on the CPU: torch's fused CPU attention is slower there than the math form's two matmuls and a softmax,
    by far in training (its bf16 backward; measured on a 2-core AVX512-BF16 CPU, 12 heads of 32, forward + backward:
    one sequence of 64 / 128 / 256 tokens 1.9 / 4.4 / 8.0 ms fused, 0.6 / 1.2 / 5.6 ms math; 16 sequences of 25
    13.8 ms against 2.8 ms: MiniLM's bf16 fine-tune step 14% faster whole), a little in inference (forward 1.1-1.4x;
    MiniLM inference 3% faster) but for short inference calls, where the fused kernel wins
    (FUSED_INFERENCE_SCORES_MAX). The fused kernel accumulates in fp32, so its attention output is closer to fp32's,
    but not the model's: MiniLM's last hidden state against fp32, mean |diff| 0.0019 math, 0.0018 fused; mean cosine
    0.99989 / 0.99990 (the weights' bf16 rounding dominates). Score tensors above MATH_SCORES_MAX keep the fused
    kernel, which never builds them whole."""
    if q.dtype != torch.bfloat16 or q.device.type != "cpu":
        return False
    entries = q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
    if entries <= FUSED_INFERENCE_SCORES_MAX and not (
            torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
        return False  # a short inference call: the fused kernel (FUSED_INFERENCE_SCORES_MAX)
    return entries <= MATH_SCORES_MAX


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, bias: Tensor | None,
                   dropout_p: float, scale: float) -> Tensor:
    if _math_is_faster(q, k, v):
        return eager_attention(q, k, v, mask=mask, bias=bias, dropout_p=dropout_p, scale=scale)
    attn_mask = _merge_mask_and_bias(mask, bias, q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale)


def eager_attention(q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, bias: Tensor | None,
                    dropout_p: float, scale: float) -> Tensor:
    """The textbook form: a readable reference, and the faster one for bf16 on CPUs (see _math_is_faster)."""
    scores = (q @ k.transpose(-1, -2)) * scale  # (B, H, T, T)
    if bias is not None:
        scores = scores + bias
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = dropout(scores.softmax(dim=-1), dropout_p)
    return probs @ v  # (B, H, T, D)


def additive_attention(q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, bias: Tensor | None,
                       dropout_p: float, scale: float) -> Tensor:
    """The textbook form with the mask added to the scores (0 where attended, the dtype's min where masked) instead
    of filled in: the same probabilities wherever a row has a key to attend. A traced graph then holds attention as
    MatMul -> Add -> Softmax -> MatMul, the pattern OpenVINO's converter turns into its ScaledDotProductAttention
    op; masked_fill traces to a Select, and torch.onnx's SDPA to Where and IsNaN, which it does not fuse
    (export/openvino.py traces with this backend)."""
    scores = (q @ k.transpose(-1, -2)) * scale  # (B, H, T, T)
    if bias is not None:
        scores = scores + bias
    if mask is not None:
        scores = scores + (~mask).to(scores.dtype) * torch.finfo(scores.dtype).min  # (B|1, 1, T|1, T) broadcast
    probs = dropout(scores.softmax(dim=-1), dropout_p)
    return probs @ v  # (B, H, T, D)


ATTENTION_BACKENDS: dict[str, Callable[..., Tensor]] = {"sdpa": sdpa_attention, "eager": eager_attention,
                                                        "additive": additive_attention}


class FusedQKV(nn.Module):
    """One projection to q, k and v side by side (ModernBERT's Wqkv): x (.., C) -> three (.., A) views, A the
    attention width (heads x head_dim; default C)."""

    def __init__(self, hidden_size: int, bias: bool = True, attention_size: int | None = None):
        super().__init__()
        self.proj = nn.Linear(hidden_size, 3 * (attention_size or hidden_size), bias=bias)

    def forward(self, x: Tensor, adapters: Route | None = None) -> tuple[Tensor, Tensor, Tensor]:
        return routed(self.proj, x, adapters).chunk(3, dim=-1)  # (.., A) each, q first


class SelfAttention(nn.Module):
    """Projections q, k, v, o around a pluggable kernel; x in any layout's rows, (B, T, C) or (N, C).

    window: local attention, tokens attend to |i - j| <= window // 2 (None: global). rotary: a Rotary applied to q
    and k at the layout's positions. qkv: a module x -> (q, k, v) replacing the separate q, k, v projections.
    kv_heads: grouped-query attention (EuroBERT's num_key_value_heads): k and v projected to kv_heads heads, each
    shared by num_heads // kv_heads query heads (repeated before the kernel, as transformers' repeat_kv).
    head_dim: each head's width (default hidden_size // num_heads); q, k and v are A = num_heads * head_dim wide
    and o maps A back to C (the families whose config sets head_dim: NomicBERT, EuroBERT, GTE, jina-v3)."""

    def __init__(self, hidden_size: int, num_heads: int, dropout: float, backend: str = "sdpa", *, bias: bool = True,
                 window: int | None = None, rotary: Rotary | None = None, qkv: nn.Module | None = None,
                 scale: float | None = None, scale_query: bool = False, kv_heads: int | None = None,
                 head_dim: int | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim or hidden_size // num_heads
        attention_size = num_heads * self.head_dim  # A
        self.scale = self.head_dim ** -0.5 if scale is None else scale
        self.scale_query = scale_query
        self.dropout = dropout
        self.backend = backend
        self.window = window
        self.rotary = rotary
        self.qkv = qkv
        self.kv_heads = kv_heads or num_heads
        if num_heads % self.kv_heads:
            raise ValueError(f"{num_heads} query heads cannot share {self.kv_heads} key/value heads evenly")
        if qkv is None:
            kv_size = self.kv_heads * self.head_dim
            self.q = nn.Linear(hidden_size, attention_size, bias=bias)
            self.k = nn.Linear(hidden_size, kv_size, bias=bias)
            self.v = nn.Linear(hidden_size, kv_size, bias=bias)
        self.o = nn.Linear(attention_size, hidden_size, bias=bias)

    def project(self, x: Tensor, adapters: Route | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """rows (.., C) -> q, k, v (.., A) each (k and v repeated up from kv_heads heads); adapters: the layout's."""
        if self.qkv is not None:
            return self.qkv(x, adapters)
        q, k, v = (routed(layer, x, adapters) for layer in (self.q, self.k, self.v))  # (.., A), (.., Akv) x 2
        if self.kv_heads != self.num_heads:
            k, v = self.repeat_kv(k), self.repeat_kv(v)  # (.., A) each
        return q, k, v

    def repeat_kv(self, x: Tensor) -> Tensor:
        """(.., Hkv * D) -> (.., H * D): each key/value head repeated for the query heads of its group."""
        lead = x.shape[:-1]  # the sizes read from x (not unflatten/flatten): an ONNX trace keeps them dynamic
        heads = x.reshape(*lead, self.kv_heads, 1, self.head_dim)  # (.., Hkv, 1, D)
        repeated = heads.expand(*lead, self.kv_heads, self.num_heads // self.kv_heads, self.head_dim)  # (.., Hkv, R, D)
        return repeated.reshape(*lead, self.num_heads * self.head_dim)  # (.., H * D)

    def forward(self, x: Tensor, layout: Layout, bias: SequenceBias | None = None) -> Tensor:
        """x: the layout's rows (.., C) -> (.., C); bias: score terms per sequence (see SequenceBias)."""
        q, k, v = self.project(x, layout.adapters)  # (.., A) each
        if self.scale_query:  # once, up front: the bias callback then sees the scaled queries
            q = q * self.scale
        if self.rotary is not None:
            q, k = self.rotary(q, k, layout, self.num_heads)  # (.., A) each
        kernel = BoundKernel(ATTENTION_BACKENDS[self.backend], dropout_p=self.dropout if self.training else 0.0,
                             scale=1.0 if self.scale_query else self.scale)
        out = layout.attend(q, k, v, self.num_heads, kernel, bias, self.window)  # (.., A)
        return routed(self.o, out, layout.adapters)  # (.., C)

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, backend={self.backend}, window={self.window}"
