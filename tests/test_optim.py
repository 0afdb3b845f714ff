"""Optimizer groups, schedules and freezing built from a FinetuneConfig."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import hfport
from hfport.train.config import FinetuneConfig
from hfport.train.optim import PlateauWithWarmup, build_optimizer, build_scheduler, freeze
from tests.tiny import save_hf


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("m")
    save_hf("bert", "sequence-classification", folder)
    return hfport.AutoModelForSequenceClassification.from_pretrained(folder)


def cfg(**kw) -> FinetuneConfig:
    return FinetuneConfig(model="m", train="t.jsonl", **kw)


def test_no_weight_decay_on_bias_and_layernorm(model):
    opt = build_optimizer(model, cfg(weight_decay=0.1))
    decay_of = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    for name, p in model.named_parameters():
        module = model.get_submodule(name.rsplit(".", 1)[0])
        expected = 0.0 if name.endswith("bias") or isinstance(module, torch.nn.LayerNorm) else 0.1
        assert decay_of[id(p)] == expected, name
    assert isinstance(opt, torch.optim.AdamW)


def test_layerwise_lr_decay(model):
    opt = build_optimizer(model, cfg(lr=1.0, layer_lr_decay=0.5, weight_decay=0.0))
    lr_of = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    params = dict(model.named_parameters())
    # 2 layers: head/pooler at 1.0, layer 1 at 0.5, layer 0 at 0.25, embeddings at 0.125
    assert lr_of[id(params["head.out.weight"])] == 1.0
    assert lr_of[id(params["body.pooler.dense.weight"])] == 1.0
    assert lr_of[id(params["body.encoder.layers.1.attn.q.weight"])] == 0.5
    assert lr_of[id(params["body.encoder.layers.0.ffn.up.weight"])] == 0.25
    assert lr_of[id(params["body.embeddings.word.weight"])] == 0.125


def test_sgd_with_momentum(model):
    opt = build_optimizer(model, cfg(optimizer="sgd", momentum=0.8))
    assert isinstance(opt, torch.optim.SGD) and opt.param_groups[0]["momentum"] == 0.8


def test_fused_adamw_auto_on_cpu(model):
    """auto uses the fused kernel where torch has it (CPU, CUDA); off never does."""
    opt = build_optimizer(model, cfg())
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults.get("fused") is True
    assert not build_optimizer(model, cfg(fused_optimizer="off")).defaults.get("fused")
    assert build_optimizer(model, cfg(fused_optimizer="on")).defaults.get("fused") is True


def test_fused_adamw_on_needs_a_supported_device(model):
    meta = copy.deepcopy(model).to("meta")  # a device without the fused kernel
    with pytest.raises(hfport.ConfigError, match=r"fused_optimizer: 'on' needs every trained parameter on one CPU "
                                                 r"or CUDA device .*parameters are on meta"):
        build_optimizer(meta, cfg(fused_optimizer="on"))
    assert not build_optimizer(meta, cfg()).defaults.get("fused")  # auto falls back
    with pytest.raises(hfport.ConfigError, match="fused_optimizer: 'on' applies to the adamw optimizer, not 'sgd'"):
        build_optimizer(model, cfg(fused_optimizer="on", optimizer="sgd"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fused_adamw_on_cuda(model):
    cuda_model = model.to("cuda")
    try:
        assert build_optimizer(cuda_model, cfg()).defaults["fused"] is True
        assert not build_optimizer(cuda_model, cfg(fused_optimizer="off")).defaults.get("fused")
    finally:
        model.to("cpu")


@pytest.mark.parametrize("kind", ["linear", "cosine", "constant_with_warmup"])
def test_schedules_with_warmup(model, kind):
    opt = build_optimizer(model, cfg(lr=1.0, weight_decay=0.0))
    sched = build_scheduler(opt, cfg(lr=1.0, scheduler=kind, warmup_steps=4), total_steps=20, metric_mode="max")
    lrs = []
    for _ in range(20):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    # transformers' warmup: from 0 at step 0 to the peak at step 4 (tests/test_training_arguments.py compares the
    # whole curves with transformers' get_scheduler)
    assert lrs[:5] == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])
    if kind == "constant_with_warmup":
        assert lrs[4:] == pytest.approx([1.0] * 16)
    elif kind == "linear":
        assert lrs[4 + 8] == pytest.approx(0.5) and lrs[-1] == pytest.approx(1 / 16)
    else:
        assert lrs[4 + 8] == pytest.approx(0.5) and lrs[-1] == pytest.approx(0.5 * (1 + math.cos(math.pi * 15 / 16)))


def test_one_cycle(model):
    opt = build_optimizer(model, cfg(lr=1.0, weight_decay=0.0))
    sched = build_scheduler(opt, cfg(lr=1.0, scheduler="one_cycle", warmup_ratio=0.25), total_steps=20,
                            metric_mode="max")
    lrs = []
    for _ in range(20):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    # torch ends the warm phase at step pct_start * total - 1
    assert max(lrs) == pytest.approx(1.0, rel=1e-3) and lrs.index(max(lrs)) == 4 and lrs[-1] < 0.01


def test_plateau_cuts_after_patience_and_resumes(model):
    opt = build_optimizer(model, cfg(lr=1.0, weight_decay=0.0))
    sched = build_scheduler(opt, cfg(lr=1.0, scheduler="plateau", plateau_patience=1, plateau_factor=0.5),
                            total_steps=10, metric_mode="max")
    assert isinstance(sched, PlateauWithWarmup)
    for value in (0.5, 0.6, 0.6, 0.6):  # two evals without improvement > patience 1: one cut
        sched.on_eval(value)
    assert sched.get_last_lr()[0] == pytest.approx(0.5)
    state = sched.state_dict()
    other = build_scheduler(build_optimizer(model, cfg(lr=1.0, weight_decay=0.0)),
                            cfg(lr=1.0, scheduler="plateau"), total_steps=10, metric_mode="max")
    other.load_state_dict(state)
    assert other.get_last_lr()[0] == pytest.approx(0.5)


def test_freeze_accepts_hf_and_hfport_names(model):
    frozen = freeze(model, ["embeddings", "encoder.layer.0", "body.encoder.layers.1.attn"])
    assert "body.embeddings.word.weight" in frozen and "body.encoder.layers.0.ffn.up.weight" in frozen
    assert "body.encoder.layers.1.attn.q.weight" in frozen and "body.encoder.layers.1.ffn.up.weight" not in frozen
    assert all(not p.requires_grad for n, p in model.named_parameters() if n in frozen)
    for p in model.parameters():
        p.requires_grad_(True)
    with pytest.raises(hfport.ConfigError, match="match no parameter"):
        freeze(model, ["encoder.layer.7"])


def _with_grads(model, seed: int):
    """A copy of the model holding the gradients of a random batch's logits."""
    m = copy.deepcopy(model)
    torch.manual_seed(seed)
    ids = torch.randint(5, m.config.vocab_size, (3, 9))  # (B, T)
    m(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.square().sum().backward()
    return m


@pytest.mark.parametrize(("max_norm", "nan"), [(1e-3, False), (1e3, False), (math.inf, False), (1e3, True)],
                         ids=["clipped", "under-the-limit", "no-limit", "nan-gradient"])
def test_loop_clip_is_torchs_clip_bit_for_bit(model, max_norm, nan):
    """The loop's clip_grad_norm returns torch's norm and leaves torch's gradients, bit for bit; under the limit it
    skips the scaling pass (no in-place write: the version counters stay put), where torch multiplies by 1.0. A NaN
    gradient makes the norm NaN, and then torch scales every gradient to NaN: so does the loop."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from hfport.train.loop import clip_grad_norm

    AcceleratorState._reset_state()
    accelerator = Accelerator(cpu=True)
    ours, theirs = _with_grads(model, 0), _with_grads(model, 0)
    if nan:
        for m in (ours, theirs):
            next(p for p in m.parameters() if p.grad is not None).grad[0, 0] = math.nan
    params = [p for p in ours.parameters() if p.grad is not None]
    versions = [p.grad._version for p in params]
    norm = clip_grad_norm(accelerator, params, max_norm)
    torch_norm = torch.nn.utils.clip_grad_norm_([p for p in theirs.parameters() if p.grad is not None], max_norm)
    torch.testing.assert_close(norm, torch_norm, rtol=0, atol=0, equal_nan=True)
    clipped = nan or max_norm == 1e-3
    assert (norm.isnan() or norm.item() > max_norm) == clipped, "each case must be the regime it is named after"
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, equal_nan=True, msg=name)
    written = [p.grad._version != v for p, v in zip(params, versions)]
    assert all(written) if clipped else not any(written)
    AcceleratorState._reset_state()
