"""The CUDA branch of packed attention, checked on the CPU: the metadata it builds on the host (cu_seqlens, the
longest length, rows in position order, the plan of a GPU batch), which path cuda_route picks and why, and its
arithmetic run here in fp32 (varlen_attn's replaced by nn/varlen.py's varlen_reference) against today's packed
attention: attention alone, and whole models' outputs and gradients (BERT and ModernBERT through one varlen call,
DeBERTa's relative bias through padded SDPA per length group).

Tolerances: attention alone fp32 atol 1e-6 (the paths differ only in summation order); whole tiny models rtol 1e-6 /
atol 2e-6, as tests/test_attention_paths.py (hidden states O(1)); bf16 through the varlen route against fp32, 2e-2
(bf16 keeps 8 bits: q, k, v rounded once, the reference computing in fp32)."""

from __future__ import annotations

import logging

import pytest
import torch

import hfport
from hfport.nn import layout as layout_module
from hfport.nn import varlen as varlen_module
from hfport.nn.attention import sdpa_attention
from hfport.nn.band import window_band
from hfport.nn.layout import Packed
from hfport.nn.varlen import (BoundKernel, cu_seqlens, cuda_route, fallback_reason, varlen_reference,
                              window_size)
from tests.tiny import batch, save_hf

ATOL = dict(atol=1e-6, rtol=1e-6)
MODEL_TOL = dict(atol=2e-6, rtol=1e-6)
LENGTHS = (70, 41, 41, 0, 9, 33)  # runs of 1, 2, (an empty row), 1, 1


def mask_of(lengths, left: bool = False) -> torch.Tensor:
    t = max(lengths)
    span = torch.arange(t)[None, :]
    n = torch.tensor(lengths)[:, None]
    return ((span >= t - n) if left else (span < n)).long()  # (B, T)


def kernel(scale: float, dropout_p: float = 0.0) -> BoundKernel:
    return BoundKernel(sdpa_attention, dropout_p=dropout_p, scale=scale)


def plain(q, k, v, *, mask, bias):  # today's kernel as the layout tests call it (a function, not a BoundKernel)
    return sdpa_attention(q, k, v, mask=mask, bias=bias, dropout_p=0.0, scale=q.shape[-1] ** -0.5)


# --- metadata built on the host ----------------------------------------------------------------------------------


def test_cu_seqlens_and_longest_length():
    packed = Packed.from_mask(mask_of(LENGTHS))
    cu = cu_seqlens(packed.lengths)
    assert cu.dtype == torch.int32 and cu.device.type == "cpu"
    assert cu.tolist() == [0, 70, 111, 152, 161, 194]  # the empty row has no entry
    assert packed.max_length == 70 and int(cu[-1]) == packed.index.shape[0]
    # every sequence's rows are where cu_seqlens says: the packed positions restart at 0 at each offset
    assert packed.positions[cu[:-1].long()].tolist() == [0] * 5
    assert window_size(None) == (-1, -1) and window_size(16) == (8, 8) and window_size(17) == (8, 8)


def test_a_device_batch_is_planned_on_the_host_once():
    """Packed.on_host (what from_mask does for a GPU batch) reads the mask and the position ids back in one copy
    and plans exactly what a CPU batch plans; the cached device copies are built once per batch."""
    for left in (False, True):
        mask = mask_of(LENGTHS, left=left)
        positions = torch.arange(mask.shape[1])[None, :] + 3  # (1, T): RoBERTa-like offset ids
        want, got = Packed.from_mask(mask, positions), Packed.on_host(mask, positions)
        assert got.lengths == want.lengths and got.contiguous == want.contiguous
        for name in ("index", "positions", "host_positions", "keep"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert Packed.on_host(torch.ones(2, 5, dtype=torch.long), None) is None  # nothing padded
    packed = Packed.from_mask(mask_of(LENGTHS))
    built = []
    first = packed.device_tensor("cu", lambda: built.append(1) or cu_seqlens(packed.lengths), torch.device("cpu"))
    again = packed.device_tensor("cu", lambda: built.append(1) or cu_seqlens(packed.lengths), torch.device("cpu"))
    assert first is again and built == [1]


def test_rows_in_order():
    """A window counted in rows (varlen_attn's) equals one counted in position ids only without holes and with
    position ids that step by one."""
    assert Packed.from_mask(mask_of(LENGTHS)).rows_in_order
    assert Packed.from_mask(mask_of(LENGTHS, left=True)).rows_in_order
    holes = mask_of((5, 4))
    holes[0, 2] = 0
    assert not Packed.from_mask(holes).rows_in_order
    skipping = torch.arange(5)[None, :] * 2  # position ids 0, 2, 4, ...
    assert not Packed.from_mask(mask_of((5, 4)), skipping).rows_in_order


def test_cuda_route_and_its_reasons(monkeypatch):
    bf16, fp32 = torch.bfloat16, torch.float32
    args = dict(bias=False, rows_in_order=True, varlen=True)
    assert cuda_route(bf16, 64, **args) == "varlen"
    assert cuda_route(torch.float16, 64, **args) == "varlen"
    assert cuda_route(fp32, 64, **args) == "groups"
    assert cuda_route(bf16, 64, **{**args, "bias": True}) == "groups"
    assert cuda_route(bf16, 64, **{**args, "rows_in_order": False}) == "groups"
    assert cuda_route(bf16, 64, **{**args, "varlen": False}) == "groups"
    assert cuda_route(bf16, 12, **args) == "groups" and cuda_route(bf16, 512, **args) == "groups"
    monkeypatch.setattr(varlen_module, "VARLEN_ATTN", len)  # any callable: "this torch has it"
    assert "DeBERTa" in fallback_reason(bf16, 64, bias=True)
    assert "float16 and bfloat16" in fallback_reason(fp32, 64, bias=False)
    monkeypatch.setattr(varlen_module, "VARLEN_ATTN", None)
    assert "torch >= 2.10" in fallback_reason(bf16, 64, bias=False)


def test_the_fallback_is_said_once(monkeypatch, caplog):
    monkeypatch.setattr(varlen_module, "_said", set())
    monkeypatch.setattr(varlen_module, "VARLEN_ATTN", None)
    with caplog.at_level(logging.INFO, logger="hfport.nn"):
        for _ in range(3):
            varlen_module.say_once(fallback_reason(torch.bfloat16, 64, bias=False))
    said = [r for r in caplog.records if "padded SDPA" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING


def test_this_torch_has_the_common_signature():
    """torch 2.10+ (this venv's 2.13 too) has varlen_attn with scale= and window_size=; a torch without them (2.9's
    is_causal form) gets None, so CUDA falls back."""
    if torch.__version__ >= "2.10":
        assert varlen_module.VARLEN_ATTN is not None

    def old(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        raise AssertionError

    assert varlen_module._common_form(old) is None and varlen_module._common_form(None) is None


# --- the arithmetic, in fp32 on the CPU -----------------------------------------------------------------------------


def rows(n: int, c: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(n, c, generator=g, requires_grad=True) for _ in range(3))


@pytest.mark.parametrize("window", [None, 16, 6])
@pytest.mark.parametrize("left", [False, True])
def test_varlen_branch_equals_todays_packed_attention(window, left):
    """One varlen call over every sequence (varlen_reference in place of the kernel) against today's per-run /
    grouped / blocked path: outputs and q, k, v gradients."""
    heads, c = 4, 32
    packed = Packed.from_mask(mask_of(LENGTHS, left=left))
    q, k, v = rows(packed.index.shape[0], c, seed=1)
    scale = (c // heads) ** -0.5
    want = packed.attend(q, k, v, heads, plain, None, window)  # (N, C)
    got = packed.attend_varlen(q, k, v, heads, scale, window, varlen_reference)
    torch.testing.assert_close(got, want, **ATOL)
    w = torch.randn(want.shape, generator=torch.Generator().manual_seed(2))
    for a, b in zip(torch.autograd.grad((got * w).sum(), (q, k, v)), torch.autograd.grad((want * w).sum(), (q, k, v))):
        torch.testing.assert_close(a, b, **ATOL)


@pytest.mark.parametrize("window", [None, 16])
def test_groups_branch_equals_todays_packed_attention(window):
    """The fallback (padded SDPA over length groups planned on the host at the CUDA costs): one or more groups, all
    sequences in them, the same attention."""
    heads, c = 4, 32
    packed = Packed.from_mask(mask_of(LENGTHS))
    q, k, v = rows(packed.index.shape[0], c, seed=3)
    want = packed.attend(q, k, v, heads, plain, None, window)
    got = packed.attend_groups(q, k, v, heads, plain, None, window)
    torch.testing.assert_close(got, want, **ATOL)
    host = packed.cached(("host groups", c), lambda: None)
    assert host is not None and sum(count for count, _ in host.shapes) == 5  # the five non-empty sequences
    for a, b in zip(torch.autograd.grad(got.sum(), (q, k, v)), torch.autograd.grad(want.sum(), (q, k, v))):
        torch.testing.assert_close(a, b, **ATOL)


def test_groups_branch_with_a_score_bias_equals_per_run_calls():
    """DeBERTa's route: a bias callback of the group's length L (distances only) in each padded group's SDPA call,
    against today's one call per run of equal lengths."""
    heads, c = 4, 32
    packed = Packed.from_mask(mask_of(LENGTHS))
    q, k, v = rows(packed.index.shape[0], c, seed=4)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])[:, None, None]  # (H, 1, 1)
    lengths_seen = []

    def bias(qi, ki):  # (G, H, L, D) -> (1, H, L, L): an ALiBi-like distance penalty
        n = qi.shape[2]
        lengths_seen.append(n)
        distance = (torch.arange(n)[:, None] - torch.arange(n)[None, :]).abs()
        return -(slopes * distance)[None] + qi.sum() * 0.0  # a fresh tensor that depends on q (a gradient path)

    want = packed.attend(q, k, v, heads, plain, bias, None)
    per_run = list(lengths_seen)
    lengths_seen.clear()
    got = packed.attend_cuda(q, k, v, heads, kernel((c // heads) ** -0.5), bias, None, varlen=varlen_reference)
    assert len(lengths_seen) < len(per_run)  # fewer calls than runs: 70, 41, 9, 33 -> the CUDA groups
    torch.testing.assert_close(got, want, **ATOL)
    for a, b in zip(torch.autograd.grad(got.sum(), (q, k, v)), torch.autograd.grad(want.sum(), (q, k, v))):
        torch.testing.assert_close(a, b, **ATOL)


def test_bf16_takes_the_varlen_route_within_bf16_of_fp32():
    heads, c = 4, 32
    packed = Packed.from_mask(mask_of(LENGTHS))
    q, k, v = (x.detach() for x in rows(packed.index.shape[0], c, seed=5))
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return varlen_reference(*args, **kwargs)

    want = packed.attend(q, k, v, heads, plain, None, 16)
    got = packed.attend_cuda(*(x.bfloat16() for x in (q, k, v)), heads, kernel((c // heads) ** -0.5), None, 16,
                             varlen=spy)
    assert calls == [{"scale": (c // heads) ** -0.5, "window_size": (8, 8)}]
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_attention_dropout_takes_the_varlen_route_with_its_rate():
    """In training (a kernel with dropout_p > 0) the varlen route still runs, one call, the rate passed to the
    kernel (varlen_dropout on a GPU; the reference here, whose draws equal a direct call's under the same seed)."""
    heads, c = 4, 32
    packed = Packed.from_mask(mask_of(LENGTHS))
    q, k, v = (x.detach().bfloat16() for x in rows(packed.index.shape[0], c, seed=7))
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return varlen_reference(*args, **kwargs)

    scale = (c // heads) ** -0.5
    torch.manual_seed(3)
    got = packed.attend_cuda(q, k, v, heads, kernel(scale, dropout_p=0.25), None, None, varlen=spy)
    assert calls == [{"scale": scale, "window_size": (-1, -1), "dropout_p": 0.25}]
    torch.manual_seed(3)
    n = q.shape[0]
    cu = cu_seqlens(packed.lengths)
    want = varlen_reference(*(x.view(n, heads, c // heads) for x in (q, k, v)), cu, cu, packed.max_length,
                            packed.max_length, scale=scale, dropout_p=0.25).reshape(n, c)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert not torch.equal(got, packed.attend_varlen(q, k, v, heads, scale, None, varlen_reference))


def test_varlen_reference_is_windowed_attention_per_sequence():
    """The reference itself, against a masked full call per sequence built from window_band."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(12, 2, 8, generator=g) for _ in range(3))
    cu = torch.tensor([0, 7, 12], dtype=torch.int32)
    got = varlen_reference(q, k, v, cu, cu, 7, 7, scale=0.3, window_size=(2, 2))
    for a, b in ((0, 7), (7, 12)):
        band = window_band(torch.arange(b - a), 4)  # |i - j| <= 2
        want = torch.nn.functional.scaled_dot_product_attention(
            *(x[a:b].transpose(0, 1) for x in (q, k, v)), attn_mask=band, scale=0.3).transpose(0, 1)
        torch.testing.assert_close(got[a:b], want, **ATOL)
    with pytest.raises(ValueError, match="exceeds max_q=6"):
        varlen_reference(q, k, v, cu, cu, 6, 6, scale=0.3)


# --- whole models, the CUDA branch forced on the CPU ---------------------------------------------------------------


def run_model(model, inputs, real):
    model.zero_grad()
    out = model(**inputs).last_hidden_state
    out[real].square().mean().backward()
    return out[real].detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family, route", [("bert", "varlen"), ("modernbert", "varlen"), ("deberta-v2", "groups")])
def test_models_through_the_cuda_branch_equal_todays(family, route, tmp_path, monkeypatch):
    """Each packed attention call of a whole model (eval mode: no dropout) sent through Packed.attend_cuda with the
    reference kernel, fp32 let through the varlen route: outputs and every gradient equal today's path."""
    save_hf(family, "base", tmp_path)
    model = hfport.AutoModel.from_pretrained(tmp_path)
    inputs = batch(family, lengths=(70, 41, 41, 9, 33), pairs=False)
    real = inputs["attention_mask"].bool()
    assert isinstance(model.body.plan(inputs["input_ids"], inputs["attention_mask"]), Packed)
    want_out, want_grads = run_model(model, inputs, real)
    taken = []
    monkeypatch.setattr(varlen_module, "VARLEN_DTYPES", (torch.float32,))
    monkeypatch.setattr(layout_module, "cuda_route", lambda *a, **k: taken.append(cuda_route(*a, **k)) or taken[-1])
    monkeypatch.setattr(Packed, "attend", lambda self, q, k, v, heads, kern, bias, window: self.attend_cuda(
        q, k, v, heads, kern, bias, window, varlen=varlen_reference))
    got_out, got_grads = run_model(model, inputs, real)
    assert taken and set(taken) == {route}
    torch.testing.assert_close(got_out, want_out, **MODEL_TOL)
    assert got_grads.keys() == want_grads.keys()
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], **MODEL_TOL, msg=name)
