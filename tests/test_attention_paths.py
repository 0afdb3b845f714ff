"""The attention paths of nn/layout.py agree: per-run calls, padded calls over the packed rows grouped by length
(one group or several), and blocked local attention (BandPlan) against the full masked call. Outputs and every
gradient at real positions.

Tolerance fp32 atol 1e-6 on attention itself and rtol 1e-6 / atol 2e-6 through whole models: the paths differ
only in summation order (the softmax sees the same keys), and a tiny model's hidden states are O(1).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hfport
from hfport.nn import band as band_module
from hfport.nn import groups as groups_module
from hfport.nn.attention import sdpa_attention
from hfport.nn.band import BandPlan, window_band
from hfport.nn.layout import Packed
from tests.tiny import batch, save_hf

LENGTHS = (70, 41, 41, 9, 33)  # runs of 1, 2, 1, 1: windowed runs of 70 and 41 are >= 2 windows of 16
MODEL_TOL = dict(atol=2e-6, rtol=1e-6)


def kernel(q, k, v, *, mask, bias):
    return sdpa_attention(q, k, v, mask=mask, bias=bias, dropout_p=0.0, scale=q.shape[-1] ** -0.5)


@pytest.mark.parametrize("holes", [False, True])
@pytest.mark.parametrize("window", [16, 17, 6])
def test_band_plan_equals_full_masked_call(window: int, holes: bool) -> None:
    g = torch.Generator().manual_seed(0)
    length = 53
    positions = torch.arange(length).repeat(3, 1)  # (G, L)
    if holes:  # position ids skip over holes in the mask: the band is between position ids
        positions = torch.cumsum(torch.randint(1, 3, (3, length), generator=g), dim=1)
    valid = torch.rand(3, length, generator=g) > 0.2  # (G, L): some keys not real
    valid[:, 0] = True
    q, k, v = (torch.randn(3, 2, length, 8, generator=g, requires_grad=True) for _ in range(3))
    full_mask = (window_band(positions, window) & valid[:, None, :]) | ~valid[:, :, None]  # (G, L, L)
    full = F.scaled_dot_product_attention(q, k, v, attn_mask=full_mask[:, None])
    blocked = BandPlan.build(positions, valid, window).attend(q, k, v, kernel)
    real = valid[:, None, :, None].expand_as(full)
    torch.testing.assert_close(blocked[real], full[real], atol=1e-6, rtol=1e-6)
    w = torch.randn(full.shape, generator=g) * real
    grads_full = torch.autograd.grad((full * w).sum(), (q, k, v))
    grads_blocked = torch.autograd.grad((blocked * w).sum(), (q, k, v))
    for a, b in zip(grads_blocked, grads_full):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def run_model(model, inputs, real):
    model.zero_grad()
    out = model(**inputs).last_hidden_state
    out[real].square().mean().backward()
    return out[real].detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["bert", "modernbert"])
def test_padded_call_and_banded_equal_per_run_calls(family: str, tmp_path, monkeypatch) -> None:
    save_hf(family, "base", tmp_path)
    model = hfport.AutoModel.from_pretrained(tmp_path)
    inputs = batch(family, lengths=LENGTHS, pairs=False)
    real = inputs["attention_mask"].bool()
    assert isinstance(model.body.plan(inputs["input_ids"], inputs["attention_mask"]), Packed)
    results = {}
    plans = [("runs", 10**9), ("runs", 2), ("padded", 10**9), ("padded", 2), ("padded", 0), ("auto", 2.5),
             ("groups", 10**9), ("groups", 2)]
    for strategy, band_from in plans:
        # "groups": the cost rule with free calls and no scatter cost cuts one group per distinct length (4 here),
        # each padded or not: several groups, shortest first, whose rows are not in the batch's order
        monkeypatch.setattr(groups_module, "PACKED_ATTENTION", "auto" if strategy == "groups" else strategy)
        monkeypatch.setattr(groups_module, "CALL_COST", 0 if strategy == "groups" else 1_300_000)
        monkeypatch.setattr(groups_module, "SCATTER_COST", -1 if strategy == "groups" else 100)
        monkeypatch.setattr(band_module, "BANDED_MIN_WINDOWS", band_from)
        if strategy == "groups":
            layout = model.body.plan(inputs["input_ids"], inputs["attention_mask"])
            shapes = list(groups_module.plan_groups(layout, 32).shapes)
            assert shapes == [(1, 9), (1, 33), (2, 41), (1, 70)]
        results[strategy, band_from] = run_model(model, inputs, real)
    reference_out, reference_grads = results.pop(("runs", 10**9))  # one full masked call per run
    for key, (out, grads) in results.items():
        torch.testing.assert_close(out, reference_out, **MODEL_TOL, msg=lambda m, key=key: f"{key}: {m}")
        assert grads.keys() == reference_grads.keys()
        for name in grads:
            torch.testing.assert_close(grads[name], reference_grads[name], **MODEL_TOL,
                                       msg=lambda m, key=key, n=name: f"{key} {n}: {m}")


def test_modernbert_unpadded_batch_banded_equals_full(tmp_path, monkeypatch) -> None:
    """Nothing padded: the Padded layout's one call, blocked when the sequence spans two windows."""
    save_hf("modernbert", "base", tmp_path)
    model = hfport.AutoModel.from_pretrained(tmp_path)
    inputs = batch("modernbert", lengths=(40, 40), pairs=False)
    real = inputs["attention_mask"].bool()
    assert real.all()
    monkeypatch.setattr(band_module, "BANDED_MIN_WINDOWS", 10**9)
    out_full, grads_full = run_model(model, inputs, real)
    monkeypatch.setattr(band_module, "BANDED_MIN_WINDOWS", 2)
    out_band, grads_band = run_model(model, inputs, real)
    torch.testing.assert_close(out_band, out_full, **MODEL_TOL)
    for name in grads_full:
        torch.testing.assert_close(grads_band[name], grads_full[name], **MODEL_TOL, msg=name)


def packed(lengths: list[int]) -> Packed:
    lengths = torch.tensor(lengths)
    return Packed.from_mask((torch.arange(int(lengths.max()))[None, :] < lengths[:, None]).long())


def test_cost_rule_groups_many_short_runs_by_length() -> None:
    def shapes(lengths: list[int]) -> list[tuple[int, int]] | None:
        groups = groups_module.plan_groups(packed(lengths), 384)
        return None if groups is None else list(groups.shapes)

    tiny = [2, 3, 4, 5, 6, 7, 8] * 20  # 140 runs of a few tokens: call overheads dominate
    assert len(packed(tiny).runs) == 140 and shapes(tiny) == [(40, 3), (40, 5), (40, 7), (20, 8)]
    assert shapes([8, 8, 8, 5]) == [(4, 8)]  # two tiny calls cost more than one padded
    assert shapes([512, 40, 30, 20]) is None  # varied lengths: padding would be most of the work
    assert shapes([100, 100, 100, 60]) is None
    # an embedding fine-tune's batch, 32 questions of 8-13 tokens and 32 answers of 10-21, in the data's order:
    # 64 runs, or one padded call with half its scores on padding; a few groups by length instead
    g = torch.Generator().manual_seed(0)
    lengths = torch.cat([torch.randint(8, 14, (32,), generator=g), torch.randint(10, 22, (32,), generator=g)])
    cut = shapes(lengths.tolist())
    assert cut is not None and 2 <= len(cut) <= 6
    assert sum(count for count, _ in cut) == 64 and [n for _, n in cut] == sorted({n for _, n in cut})
    assert max(n for _, n in cut) == int(lengths.max())


def test_groups_place_every_token_once() -> None:
    """Each packed row has its own buffer row, inside its group's block at its offset in its sequence; rows of the
    same sequence are consecutive; padding rows are the only ones not real; empty sequences take no slot."""
    layout = packed([5, 3, 0, 5, 2, 3])
    groups = groups_module.Groups.build(layout, ((3, 3), (2, 5)))  # the 2 and the two 3s, then the two 5s
    assert groups.size == 3 * 3 + 2 * 5 and groups.slots.unique().numel() == sum(layout.lengths)
    assert groups.real.sum() == sum(layout.lengths) and bool(groups.real[groups.slots].all())
    by_sequence = groups.slots.split([n for n in layout.lengths])
    assert [s.tolist() for s in by_sequence] == [[9, 10, 11, 12, 13], [3, 4, 5], [], [14, 15, 16, 17, 18],
                                                 [0, 1], [6, 7, 8]]
    torch.testing.assert_close(groups.positions[groups.slots], layout.positions)
    masks = groups.masks(None)
    assert masks[1] is None  # two 5s: nothing padded, no mask (SDPA's unmasked path)
    assert masks[0].shape == (3, 1, 3, 3) and not bool(masks[0][0, 0, 0, 2])  # the 2's padded key is masked
    assert bool(masks[0][0, 0, 2].all())  # its padded query row attends to every key (no NaN row)


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("length", [16, 48, 64])
def test_bf16_kernel_choice_short_inference_fused_else_math(monkeypatch, grad: bool, length: int) -> None:
    """bf16 on the CPU: an inference call of at most FUSED_INFERENCE_SCORES_MAX score entries takes the fused kernel
    (its fixed cost is lower: nn/attention.py's table), a gradient-carrying call of any size and a longer inference
    call the math form. Both give the fp32 answer to bf16's rounding."""
    from hfport.nn import attention

    calls = []
    fused = F.scaled_dot_product_attention
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append("fused") or fused(*a, **k))
    math = attention.eager_attention
    monkeypatch.setattr(attention, "eager_attention", lambda *a, **k: calls.append("math") or math(*a, **k))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 12, length, 32, generator=g) for _ in range(3))  # (G, H, L, D) fp32
    expected = F.scaled_dot_product_attention(q, k, v, scale=0.17)
    calls.clear()
    qb, kb, vb = (x.bfloat16().requires_grad_(grad) for x in (q, k, v))
    with torch.set_grad_enabled(grad):
        out = attention.sdpa_attention(qb, kb, vb, mask=None, bias=None, dropout_p=0.0, scale=0.17)
    short = 12 * length * length <= attention.FUSED_INFERENCE_SCORES_MAX
    assert calls == ["fused" if short and not grad else "math"]
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)  # bf16: 8 bits of mantissa
