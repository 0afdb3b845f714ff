"""The injection points of nn/ on their own: rotary positions, the gated feed-forward, the pre-LN layer, sliding
windows, the bias callback and the three layouts; then a ModernBERT-shaped body composed from these blocks alone,
against transformers' ModernBertModel.

Tolerance: fp32 atol 1e-5 where two computations differ only in summation order (packed vs padded, a formula
written out vs the module); rotary against transformers is exact up to 1e-6 (the same float32 operations).
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hfport.nn import (ATTENTION_BACKENDS, Embeddings, Encoder, EncoderBody, EncoderLayer, FeedForward, FusedQKV,
                       GatedFeedForward, Packed, Padded, RepresentativePadding, Rotary, SelfAttention, layer_norm)

TOL = dict(atol=1e-5, rtol=1.3e-6)
LENGTHS = (11, 7, 7, 3)  # the two 7s share one attention call on packed rows


def right_padded(lengths=LENGTHS) -> torch.Tensor:
    t = max(lengths)
    return (torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]).long()  # (B, T)


def layouts(mask: torch.Tensor) -> tuple[Padded, Packed]:
    positions = torch.arange(mask.shape[1])[None, :]  # (1, T)
    return Padded.from_mask(mask, positions), Packed.from_mask(mask, positions)


def kernel(q, k, v, *, mask, bias):
    return ATTENTION_BACKENDS["sdpa"](q, k, v, mask=mask, bias=bias, dropout_p=0.0, scale=q.shape[-1] ** -0.5)


def reference_attention(q, k, v, keep, bias=None, window=None):
    """Scores, masks and softmax written out over the padded batch. q, k, v: (B, H, T, D); keep (B, T)."""
    t = q.shape[2]
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5  # (B, H, T, T)
    if bias is not None:
        scores = scores + bias
    allowed = keep[:, None, None, :].expand_as(scores)  # (B, H, T, T)
    if window is not None:
        i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
        allowed = allowed & ((i - j).abs() <= window // 2)
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v  # (B, H, T, D)


# --- rotary -------------------------------------------------------------------------------------------------


def modernbert_config(**overrides):
    import transformers

    return transformers.ModernBertConfig(**{**dict(
        vocab_size=99, hidden_size=32, intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
        local_attention=6, global_attn_every_n_layers=3, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        cls_token_id=1, sep_token_id=2, mask_token_id=3, max_position_embeddings=64), **overrides})


@pytest.mark.parametrize("theta", [10000.0, 160000.0])
def test_rotary_matches_transformers(theta: float) -> None:
    from transformers.models.modernbert.modeling_modernbert import ModernBertRotaryEmbedding, apply_rotary_pos_emb

    g = torch.Generator().manual_seed(0)
    b, h, t, d = 3, 4, 9, 8
    q, k = torch.randn(2, b, h, t, d, generator=g).unbind(0)  # (B, H, T, D) each
    mask = torch.ones(b, t, dtype=torch.long)
    position_ids = torch.arange(t)[None, :].expand(b, t)  # (B, T)
    config = modernbert_config(hidden_size=h * d, num_attention_heads=h)
    config.rope_parameters["full_attention"]["rope_theta"] = theta
    cos, sin = ModernBertRotaryEmbedding(config)(q, position_ids, "full_attention")  # (B, T, D)
    expected_q, expected_k = apply_rotary_pos_emb(q, k, cos, sin)  # (B, H, T, D)

    rotary = Rotary(d, theta)
    layout = Padded.from_mask(mask, position_ids)
    rows = [x.transpose(1, 2).reshape(b, t, h * d) for x in (q, k)]  # (B, T, C): the padded layout's rows
    got_q, got_k = (x.view(b, t, h, d).transpose(1, 2) for x in rotary(*rows, layout, h))
    torch.testing.assert_close(got_q, expected_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_k, expected_k, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(got_q, q)  # it did rotate

    # packed rows restart at position 0 per sequence: the same rotation as the padded row at real positions
    mask = right_padded((9, 4, 6))
    padded, packed = layouts(mask)
    assert packed.positions.tolist() == [*range(9), *range(4), *range(6)]
    packed_q, _ = rotary(packed.pack(rows[0]), packed.pack(rows[1]), packed, h)  # (N, C)
    torch.testing.assert_close(packed.unpack(packed_q)[mask.bool()], rows_rotated := rotary(
        *rows, padded, h)[0][mask.bool()], atol=1e-6, rtol=1e-6)
    assert rows_rotated.shape == (19, h * d)


# --- feed-forward and layer ---------------------------------------------------------------------------------


def test_gated_feed_forward_is_geglu() -> None:
    from transformers.models.modernbert.modeling_modernbert import ModernBertMLP

    torch.manual_seed(0)
    ffn = GatedFeedForward(16, 24, "gelu").eval()
    x = torch.randn(5, 16)
    w, b = ffn.up.weight, ffn.up.bias  # (2I, C), (2I,)
    expected = F.linear(F.gelu(F.linear(x, w[:24], b[:24])) * F.linear(x, w[24:], b[24:]), ffn.down.weight,
                        ffn.down.bias)  # input half first, gate half second
    torch.testing.assert_close(ffn(x), expected, **TOL)
    mlp = ModernBertMLP(modernbert_config(hidden_size=16, intermediate_size=24, mlp_bias=True)).eval()
    mlp.load_state_dict({"Wi.weight": w, "Wi.bias": b, "Wo.weight": ffn.down.weight, "Wo.bias": ffn.down.bias})
    torch.testing.assert_close(ffn(x), mlp(x), **TOL)
    # without biases: no bias parameters at all (ModernBERT's mlp_bias=False, attention_bias=False)
    assert [n for n, _ in GatedFeedForward(16, 24, "gelu", bias=False).named_parameters()] == ["up.weight",
                                                                                                "down.weight"]
    assert not any(n.endswith("bias") for n, _ in SelfAttention(16, 2, 0.0, bias=False).named_parameters())
    assert [n for n, _ in layer_norm(16, 1e-5, bias=False).named_parameters()] == ["weight"]


@pytest.mark.parametrize("first", [True, False])
def test_pre_ln_layer_against_formula(first: bool) -> None:
    """x + attn(norm1(x)), then + ffn(norm2(.)), with an identity first norm as ModernBERT's layer 0."""
    torch.manual_seed(1)
    c, heads = 16, 2
    attn = SelfAttention(c, heads, 0.0, bias=False)
    ffn = GatedFeedForward(c, 24, "gelu", bias=False)
    norm1 = nn.Identity() if first else layer_norm(c, 1e-5, bias=False)
    norm2 = layer_norm(c, 1e-5, bias=False)
    for p in [*norm1.parameters(), *norm2.parameters()]:
        nn.init.normal_(p, 1.0, 0.1)
    layer = EncoderLayer(attn, ffn, norm1, norm2, norm_first=True).eval()
    mask = right_padded()
    keep = mask.bool()
    x = torch.randn(*mask.shape, c)  # (B, T, C)

    h = x if first else F.layer_norm(x, (c,), norm1.weight, None, 1e-5)
    q, k, v = (F.linear(h, w).view(*mask.shape, heads, c // heads).transpose(1, 2)
               for w in (attn.q.weight, attn.k.weight, attn.v.weight))  # (B, H, T, D)
    mixed = reference_attention(q, k, v, keep).transpose(1, 2).reshape(*mask.shape, c)  # (B, T, C)
    y = x + F.linear(mixed, attn.o.weight)
    h2 = F.layer_norm(y, (c,), norm2.weight, None, 1e-5)
    up = F.linear(h2, ffn.up.weight)
    expected = y + F.linear(F.gelu(up[..., :24]) * up[..., 24:], ffn.down.weight)

    padded, packed = layouts(mask)
    torch.testing.assert_close(layer(x, padded)[keep], expected[keep], **TOL)
    torch.testing.assert_close(packed.unpack(layer(packed.pack(x), packed))[keep], expected[keep], **TOL)


def test_post_ln_layer_keeps_bert_order() -> None:
    torch.manual_seed(2)
    c = 16
    layer = EncoderLayer(SelfAttention(c, 2, 0.0), FeedForward(c, 24, "relu"), layer_norm(c, 1e-12),
                         layer_norm(c, 1e-12)).eval()
    mask = right_padded()
    x = torch.randn(*mask.shape, c)
    padded, _ = layouts(mask)
    y = F.layer_norm(x + layer.attn(x, padded), (c,), layer.attn_norm.weight, layer.attn_norm.bias, 1e-12)
    expected = F.layer_norm(y + layer.ffn(y), (c,), layer.ffn_norm.weight, layer.ffn_norm.bias, 1e-12)
    torch.testing.assert_close(layer(x, padded), expected, **TOL)


# --- attention: windows, the bias callback, fused projections, layouts ---------------------------------------


def heads_of(x: torch.Tensor, h: int) -> torch.Tensor:
    b, t, c = x.shape
    return x.view(b, t, h, c // h).transpose(1, 2)  # (B, H, T, D)


@pytest.mark.parametrize("window", [2, 4, 64])
def test_sliding_window_padded_packed_and_reference(window: int) -> None:
    g = torch.Generator().manual_seed(3)
    h, c = 2, 8
    mask = right_padded()
    keep = mask.bool()
    q, k, v = torch.randn(3, *mask.shape, c, generator=g).unbind(0)  # (B, T, C) each
    expected = reference_attention(heads_of(q, h), heads_of(k, h), heads_of(v, h), keep, window=window)
    expected = expected.transpose(1, 2).reshape(*mask.shape, c)  # (B, T, C)
    padded, packed = layouts(mask)
    got = padded.attend(q, k, v, h, kernel, None, window)  # (B, T, C)
    torch.testing.assert_close(got[keep], expected[keep], **TOL)
    got_packed = packed.attend(*(packed.pack(x) for x in (q, k, v)), h, kernel, None, window)  # (N, C)
    torch.testing.assert_close(packed.unpack(got_packed)[keep], expected[keep], **TOL)
    representative = RepresentativePadding.from_mask(mask, padded.positions)
    got_rep = representative.attend(*(representative.pack(x) for x in (q, k, v)), h, kernel, None, window)
    torch.testing.assert_close(representative.unpack(got_rep)[keep], expected[keep], **TOL)
    global_ = padded.attend(q, k, v, h, kernel, None, None)
    assert torch.allclose(global_, got) is (window // 2 >= max(LENGTHS) - 1)  # a narrow window changes the result


def test_sliding_window_in_attention_module() -> None:
    """The module's window argument reaches every layout; packed equals padded at real positions."""
    torch.manual_seed(4)
    attn = SelfAttention(16, 2, 0.0, window=4, rotary=Rotary(8, 10000.0)).eval()
    mask = right_padded()
    keep = mask.bool()
    x = torch.randn(*mask.shape, 16)
    padded, packed = layouts(mask)
    torch.testing.assert_close(packed.unpack(attn(packed.pack(x), packed))[keep], attn(x, padded)[keep], **TOL)


def test_bias_callback_on_every_layout() -> None:
    """A score bias given per sequence (an ALiBi-like distance penalty) acts the same on packed and padded rows."""
    g = torch.Generator().manual_seed(5)
    h, c = 2, 8
    mask = right_padded()
    keep = mask.bool()
    q, k, v = torch.randn(3, *mask.shape, c, generator=g).unbind(0)
    slopes = torch.tensor([0.5, 0.25])[:, None, None]  # (H, 1, 1)

    def bias(qi, ki):  # (G, H, L, D) -> (1, H, L, L)
        n = qi.shape[2]
        return -(slopes * (torch.arange(n)[:, None] - torch.arange(n)[None, :]).abs())[None]

    full = bias(heads_of(q, h), None)  # (1, H, T, T)
    expected = reference_attention(heads_of(q, h), heads_of(k, h), heads_of(v, h), keep, bias=full)
    expected = expected.transpose(1, 2).reshape(*mask.shape, c)
    padded, packed = layouts(mask)
    representative = RepresentativePadding.from_mask(mask, padded.positions)
    torch.testing.assert_close(padded.attend(q, k, v, h, kernel, bias, None)[keep], expected[keep], **TOL)
    for layout in (packed, representative):
        out = layout.attend(*(layout.pack(x) for x in (q, k, v)), h, kernel, bias, None)
        torch.testing.assert_close(layout.unpack(out)[keep], expected[keep], **TOL)


def test_representative_padding_rows() -> None:
    """Padded rows attend uniformly to every key (transformers' pair mask) and share one representative row."""
    g = torch.Generator().manual_seed(6)
    h, c = 2, 8
    mask = right_padded((5, 2, 5))
    keep = mask.bool()
    x = torch.randn(*mask.shape, c, generator=g)
    layout = RepresentativePadding.from_mask(mask, torch.arange(5)[None])
    assert layout.pack(x).shape[0] == 5 + 2 + 1 + 5  # real tokens + one representative for the padded row
    back = layout.unpack(layout.pack(x))  # (B, T, C)
    torch.testing.assert_close(back[keep], x[keep])
    assert torch.equal(back[1, 2:], x[1, 2].expand(3, c))  # every padded position reads its representative
    q, k, v = torch.randn(3, *mask.shape, c, generator=g).unbind(0)
    out = layout.unpack(layout.attend(*(layout.pack(t) for t in (q, k, v)), h, kernel, None, None))
    seen = layout.unpack(layout.pack(v))  # (B, T, C): v as the layout holds it (padding = its representative)
    uniform = seen[1].mean(dim=0)  # (C,): every head's values averaged over all T keys
    torch.testing.assert_close(out[1, 2:], uniform.expand(3, c), **TOL)
    assert isinstance(RepresentativePadding.from_mask(torch.ones(2, 3), torch.arange(3)[None]), Padded)


def test_fused_qkv_equals_separate_projections() -> None:
    torch.manual_seed(7)
    fused = SelfAttention(16, 2, 0.0, qkv=FusedQKV(16)).eval()
    separate = SelfAttention(16, 2, 0.0).eval()
    w, b = fused.qkv.proj.weight.chunk(3), fused.qkv.proj.bias.chunk(3)
    with torch.no_grad():
        for i, name in enumerate("qkv"):
            getattr(separate, name).weight.copy_(w[i])
            getattr(separate, name).bias.copy_(b[i])
        separate.o.load_state_dict(fused.o.state_dict())
    assert "q.weight" not in dict(fused.named_parameters())
    mask = right_padded()
    x = torch.randn(*mask.shape, 16)
    for layout in layouts(mask):
        rows = layout.pack(x)
        torch.testing.assert_close(fused(rows, layout), separate(rows, layout), **TOL)


# --- a ModernBERT-shaped body from these blocks alone ---------------------------------------------------------

MODERNBERT_NAMES = [  # transformers' ModernBertModel name -> the composed body's
    (r"embeddings\.tok_embeddings\.", "embeddings.word."), (r"embeddings\.norm\.", "embeddings.norm."),
    (r"layers\.(\d+)\.attn\.Wqkv\.", r"encoder.layers.\1.attn.qkv.proj."),
    (r"layers\.(\d+)\.attn\.Wo\.", r"encoder.layers.\1.attn.o."),
    (r"layers\.(\d+)\.attn_norm\.", r"encoder.layers.\1.attn_norm."),
    (r"layers\.(\d+)\.mlp_norm\.", r"encoder.layers.\1.ffn_norm."),
    (r"layers\.(\d+)\.mlp\.Wi\.", r"encoder.layers.\1.ffn.up."),
    (r"layers\.(\d+)\.mlp\.Wo\.", r"encoder.layers.\1.ffn.down."),
    (r"final_norm\.", "encoder.norm."),
]


def ours(name: str) -> str:
    for pattern, replacement in MODERNBERT_NAMES:
        new, n = re.subn(f"^{pattern}", replacement, name)
        if n:
            return new
    raise KeyError(name)


def modernbert_body(c) -> EncoderBody:
    """How a ModernBERT family file would compose nn/: pre-LN, GeGLU, rotary with per-layer-type theta, a sliding
    window on local layers, an identity first norm, a final norm, an embedding norm, optional biases."""
    head_dim = c.hidden_size // c.num_attention_heads

    def layer(i: int) -> EncoderLayer:
        kind = c.layer_types[i]
        attn = SelfAttention(c.hidden_size, c.num_attention_heads, c.attention_dropout, bias=c.attention_bias,
                             window=c.local_attention if kind == "sliding_attention" else None,
                             rotary=Rotary(head_dim, c.rope_parameters[kind]["rope_theta"]),
                             qkv=FusedQKV(c.hidden_size, bias=c.attention_bias))
        attn_norm = nn.Identity() if i == 0 else layer_norm(c.hidden_size, c.norm_eps, c.norm_bias)
        ffn = GatedFeedForward(c.hidden_size, c.intermediate_size, c.hidden_activation, c.mlp_dropout, c.mlp_bias)
        return EncoderLayer(attn, ffn, attn_norm, layer_norm(c.hidden_size, c.norm_eps, c.norm_bias),
                            norm_first=True, attn_out_dropout=c.attention_dropout)

    embeddings = Embeddings(c.vocab_size, c.hidden_size, 0, 0, c.norm_eps, c.embedding_dropout, c.pad_token_id,
                            norm_bias=c.norm_bias)
    encoder = Encoder([layer(i) for i in range(c.num_hidden_layers)],
                      norm=layer_norm(c.hidden_size, c.norm_eps, c.norm_bias))
    return EncoderBody(embeddings, encoder, pooler=None)


@pytest.mark.parametrize("biases", [False, True])
def test_modernbert_body_composed_from_nn_matches_transformers(biases: bool) -> None:
    import transformers

    c = modernbert_config(attention_bias=biases, mlp_bias=biases, norm_bias=biases)
    torch.manual_seed(8)
    hf = transformers.ModernBertModel(c).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # biases and norms away from their 0 / 1 init
    body = modernbert_body(c).eval()
    state = {ours(k): v for k, v in hf.state_dict().items()}
    body.load_state_dict(state, strict=True)

    mask = right_padded((20, 13, 13, 5))
    keep = mask.bool()
    ids = torch.randint(4, 99, mask.shape, generator=torch.Generator().manual_seed(9)).masked_fill(~keep, 0)
    expected = hf(input_ids=ids, attention_mask=mask).last_hidden_state
    expected[keep].square().mean().backward()
    hf_grads = {ours(n): p.grad for n, p in hf.named_parameters()}
    for padding_free in (True, False):
        body.padding_free = padding_free
        body.zero_grad()
        got, _ = body(ids, mask)
        torch.testing.assert_close(got[keep], expected[keep], **TOL)
        got[keep].square().mean().backward()
        for name, p in body.named_parameters():
            torch.testing.assert_close(p.grad, hf_grads[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


# --- dropout -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_keeps_torchs_distribution_scale_and_gradient(dtype):
    """hfport's CPU dropout (a uniform draw against p, see nn/dropout.py): kept values scaled by 1/(1-p) exactly,
    dropped ones 0; the keep rate is 1 - p within 5 standard errors; the gradient is the mask times the scale; the
    same seed draws the same mask; eval mode and p=0 are the identity."""
    from hfport.nn import Dropout, dropout

    p, n = 0.1, 200_000
    x = (torch.rand(n) + 0.5).to(dtype).requires_grad_()  # no zeros: a 0 output means dropped
    torch.manual_seed(3)
    y = dropout(x, p)
    keep = y != 0
    assert abs(keep.float().mean().item() - (1 - p)) < 5 * (p * (1 - p) / n) ** 0.5
    torch.testing.assert_close(y[keep], x[keep] * (1 / (1 - p)), rtol=0, atol=0)
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad, keep.to(dtype) * (1 / (1 - p)), rtol=0, atol=0)
    torch.manual_seed(3)
    assert torch.equal(dropout(x, p), y)
    module = Dropout(p).eval()
    assert module(x) is x and dropout(x, 0.0) is x and isinstance(module, torch.nn.Dropout)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dropout_bitwise_torchs_mask_and_scale_kernel(dtype):
    """The output and the gradient are bit for bit torch's native_dropout_backward (x * mask * scale) on the mask
    the same seed draws (rand >= p), signed zeros included: negative inputs and gradients, attention-probability and
    residual shapes."""
    from hfport.nn import dropout

    p = 0.1
    for shape in [(37, 384), (3, 12, 17, 17)]:
        x = (torch.randn(shape) * 3).to(dtype).requires_grad_()
        grad = (torch.randn(shape) * 3).to(dtype)
        torch.manual_seed(5)
        y = dropout(x, p)
        y.backward(grad)
        torch.manual_seed(5)
        keep = torch.rand(shape) >= p
        want_y = torch.ops.aten.native_dropout_backward(x.detach(), keep, 1 / (1 - p))
        want_grad = torch.ops.aten.native_dropout_backward(grad, keep, 1 / (1 - p))
        for got, want in ((y.detach(), want_y), (x.grad, want_grad)):
            assert got.dtype == dtype
            assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())


@pytest.mark.parametrize("p", [0.1, 0.3, 1 / 3, 0.5, 0.7, 0.55, 2 ** -25, 1e-7, 0.9999999])
def test_dropout_decides_as_torch_rand_against_p(p):
    """The mask makes exactly the decisions torch.rand(shape) >= p makes from the same seed, and the generator is
    left in the same state."""
    from hfport.nn import dropout

    x = torch.ones(64, 1000)
    torch.manual_seed(11)
    kept = dropout(x, p) != 0
    after = torch.rand(4)
    torch.manual_seed(11)
    assert torch.equal(kept, torch.rand(64, 1000) >= p)
    assert torch.equal(after, torch.rand(4))


@pytest.mark.parametrize("with_bias", [False, True])
def test_additive_backend_equals_the_masked_forms(with_bias: bool) -> None:
    """The additive kernel (OpenVINO's trace: the mask added to the scores) computes what sdpa and eager do at every
    row that has a key to attend: padded keys, a window-style (T, T) mask and a score bias."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 8) for _ in range(3))  # (B, H, T, D)
    keys = torch.tensor([[1] * 7, [1] * 4 + [0] * 3]).bool()[:, None, None, :]  # (B, 1, 1, T)
    band = (torch.arange(7)[:, None] - torch.arange(7)[None, :]).abs() <= 2  # (T, T)
    bias = torch.randn(2, 3, 7, 7) if with_bias else None
    for mask in (keys, keys & band):
        seen = mask.expand(2, 1, 7, 7).any(-1)[:, 0]  # (B, T): query rows with a key to attend (no key: no contract)
        assert not seen.all() or mask is keys
        got = ATTENTION_BACKENDS["additive"](q, k, v, mask=mask, bias=bias, dropout_p=0.0, scale=0.3)  # (B, H, T, D)
        for other in ("eager", "sdpa"):
            want = ATTENTION_BACKENDS[other](q, k, v, mask=mask, bias=bias, dropout_p=0.0, scale=0.3)
            torch.testing.assert_close(got.transpose(1, 2)[seen], want.transpose(1, 2)[seen], atol=1e-6, rtol=1e-6)
