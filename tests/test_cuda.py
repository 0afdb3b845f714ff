"""On a CUDA GPU (`pytest -m cuda`; every test here skips without one, and CI never has one): scripts/gpu_check.sh
runs this file on the lent machine, offline (tiny models from transformers' config classes, tests/synthetic.py's
texts and tokenizer: no MiniLM, no hub).

- fp32 parity of every family's heads against transformers on the GPU, TF32 off: outputs, losses, every gradient,
  at tests/parity.py's tolerance (atol 1e-5, rtol 1.3e-6; DeBERTa's rtol 1e-5, as on the CPU);
- bf16 forward: hfport's error against fp32 at most twice transformers' bf16 error (+ 1e-3 absolute for a model
  whose bf16 error is near 0), and which attention path ran (one varlen call where there is no bias);
- a 20-step fine-tune in AMP bf16 and in fp16 with its loss scaler, against transformers' Trainer from the same
  weights on the same data (no dropout, the whole data set each step): every step's loss within 0.05 + 5% of
  Trainer's (bf16 and fp16 rounding, compounded by 20 Adam steps), both curves falling by more than 0.2 (on a CPU in
  fp32 the two agree to 5 digits at every step: 0.693 -> 0.307);
- bit-identical resume under torch.use_deterministic_algorithms (and CUBLAS_WORKSPACE_CONFIG, which gpu_check.sh
  exports before CUDA starts);
- host syncs per optimizer step, counted by torch.cuda.set_sync_debug_mode("warn"): bf16 at most one on a step that
  logs nothing (the layout's read-back of the mask), fp16 one more (the loss scaler's skip check), a logging step one
  more (the loss and the norm, read together).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import torch

import hfport
from hfport.nn import layout as layout_module
from hfport.nn import varlen as varlen_module
from hfport.train import loop
from hfport.train.config import FinetuneConfig
from tests import rotary, synthetic
from tests.parity import AUTO_CLASSES, DEBERTA_PARITY, compare_models, labels_for, real
from tests.tiny import ALL_FAMILIES, HEADS, ROTARY_CONFIGS, ROTARY_EXTRA_HEADS, ROTARY_HEADS, batch, save_hf

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pytest -m cuda on one)")]
CUDA = torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def _no_tf32():
    """fp32 as fp32: TF32 matmuls keep 10 mantissa bits, which no 1e-5 comparison survives."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def on(device: torch.device, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in tensors.items()}


def projection_loss(out, mask: torch.Tensor) -> torch.Tensor:
    """tests/parity.py's base-model loss with its projection on the outputs' device."""
    hidden = real(out.last_hidden_state, mask)  # (N, C)
    w = torch.randn(hidden.shape[-1], generator=torch.Generator().manual_seed(3)).to(hidden.device)
    loss = (hidden @ w).mean()
    if getattr(out, "pooler_output", None) is not None:
        loss = loss + out.pooler_output.mean()
    return loss


# --- 1. host syncs, the fine-tune against Trainer, resume: first, they are what this file is for --------------------


def _classifier(root: Path, hidden: int = 64, layers: int = 2, heads: int = 4, dropout: float = 0.0) -> Path:
    """A small BERT sequence classifier (2 labels) with tests/synthetic.py's tokenizer, saved by transformers."""
    ids = synthetic.wordpiece_tokenizer(root)
    save_hf("bert", "sequence-classification", root, vocab_size=2000, hidden_size=hidden, num_hidden_layers=layers,
            num_attention_heads=heads, intermediate_size=4 * hidden, max_position_embeddings=512,
            pad_token_id=ids["[PAD]"], num_labels=2, hidden_dropout_prob=dropout,
            attention_probs_dropout_prob=dropout)
    return root


def _data(root: Path, n: int, seed: int) -> Path:
    lengths = [4 + (17 * i) % 90 for i in range(n)]  # 4..93 words: a varied batch, padding in every step
    return synthetic.write_jsonl(root / f"train-{seed}.jsonl", synthetic.texts(lengths, seed=seed))


def _config(model: Path, train: Path, out: Path, **overrides) -> FinetuneConfig:
    values = dict(model=str(model), train=str(train), eval=None, eval_fraction=0.0, output_dir=str(out),
                  batch_size=32, lr=2e-3, warmup_ratio=0.0, scheduler="linear", weight_decay=0.0, max_grad_norm=1.0,
                  logging_steps=1, seed=11, max_length=128, save_strategy="no", eval_strategy="no", max_steps=20)
    return FinetuneConfig(**{**values, **overrides})


def _train_lines(out: Path) -> list[dict]:
    return [e for e in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if e["type"] == "train"]


@pytest.mark.parametrize("precision, per_step", [("bf16", 1), ("fp16", 2)])
def test_host_syncs_per_step(tmp_path, monkeypatch, precision, per_step):
    """Counted by CUDA's own sync debug mode over Trainer.step and Trainer.log_step: a step that logs nothing waits
    for the GPU at most `per_step` times, a logging step once more."""
    model = _classifier(tmp_path / "model")
    train = _data(tmp_path, 64, seed=1)
    counts: list[int] = []
    step, log_step = loop.Trainer.step, loop.Trainer.log_step

    def counted(fn, new: bool):
        def run(self, *args):
            if new:
                counts.append(0)
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    return fn(self, *args)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                    counts[-1] += sum("synchroniz" in str(w.message) for w in seen)
        return run

    monkeypatch.setattr(loop.Trainer, "step", counted(step, True))
    monkeypatch.setattr(loop.Trainer, "log_step", counted(log_step, False))
    config = _config(model, train, tmp_path / "run", precision=precision, max_steps=8, logging_steps=4,
                     batch_size=16)
    loop.finetune(config, progress=False)
    logging = [s % 4 == 0 or s == 1 for s in range(1, 9)]
    assert len(counts) == 8
    # step 1 builds what later steps reuse (the optimizer's state: its step counters are copied to the GPU one
    # tensor at a time, each copy a wait), so it is left out
    for n, logs in list(zip(counts, logging))[1:]:
        assert n <= per_step + logs, (counts, logging)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_finetune_tracks_trainer(tmp_path, precision):
    """The same weights, data, optimizer (fused AdamW, no decay), linear schedule, clipping and AMP in both; the
    whole data set in every step, so the order of examples cannot differ."""
    import transformers

    model = _classifier(tmp_path / "model")
    train = _data(tmp_path, 32, seed=2)
    config = _config(model, train, tmp_path / "hfport", precision=precision)
    loop.finetune(config, progress=False)
    ours = [e["loss"] for e in _train_lines(tmp_path / "hfport")]

    tok = transformers.AutoTokenizer.from_pretrained(model)
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    # a list of dicts (Trainer takes any map-style dataset; the GPU machine has no `datasets`)
    data = [{**tok(r["text"], truncation=True, max_length=128), "labels": r["label"]} for r in rows]
    ref = transformers.AutoModelForSequenceClassification.from_pretrained(model, attn_implementation="sdpa")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "trainer"), per_device_train_batch_size=32, max_steps=20, learning_rate=2e-3,
        lr_scheduler_type="linear", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, logging_steps=1,
        save_strategy="no", report_to=[], seed=11, optim="adamw_torch_fused", bf16=precision == "bf16",
        fp16=precision == "fp16", dataloader_drop_last=False)
    trainer = transformers.Trainer(model=ref, args=args, train_dataset=data,
                                   data_collator=transformers.DataCollatorWithPadding(tok))
    trainer.train()
    theirs = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(ours) == len(theirs) == 20, (ours, theirs)
    for step, (a, b) in enumerate(zip(ours, theirs), 1):
        assert abs(a - b) <= 0.05 + 0.05 * abs(b), f"step {step}: hfport {a:.4f}, Trainer {b:.4f}\n{ours}\n{theirs}"
    # the curves move well beyond that tolerance (fp32 on a CPU: 0.693 -> 0.307, identical in both to 5 digits)
    assert ours[0] - ours[-1] > 0.2 and theirs[0] - theirs[-1] > 0.2, (ours, theirs)


def test_resume_is_bit_identical(tmp_path):
    """Deterministic algorithms on: a run resumed from another run's step-3 checkpoint writes that run's train lines
    for steps 4-6 and ends on its final weights, bit for bit (dropout on, so the restored RNG state matters)."""
    from safetensors.torch import load_file

    from hfport.rundir import RunDir

    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") is None:
        pytest.skip("CUBLAS_WORKSPACE_CONFIG must be set before CUDA starts (scripts/gpu_check.sh exports it)")
    model = _classifier(tmp_path / "model", dropout=0.1)
    train = _data(tmp_path, 48, seed=3)
    common = dict(max_steps=6, batch_size=16, precision="bf16", save_strategy="steps", save_steps=3)
    # warn_only: an op without a deterministic kernel warns instead of stopping the run; the bits below decide
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        loop.finetune(_config(model, train, tmp_path / "whole", **common), progress=False)
        resume = str(RunDir(tmp_path / "whole").checkpoint(3))
        loop.finetune(_config(model, train, tmp_path / "part", resume=resume, **common), progress=False)
    finally:
        torch.use_deterministic_algorithms(False)
    whole, part = _train_lines(tmp_path / "whole"), _train_lines(tmp_path / "part")
    assert [e["step"] for e in part] == [4, 5, 6] and part == whole[3:]
    a = load_file(tmp_path / "whole" / "final" / "model.safetensors")
    b = load_file(tmp_path / "part" / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- 2. bf16 forward ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family, route", [("bert", "varlen"), ("modernbert", "varlen"), ("roberta", "varlen"),
                                           ("deberta-v2", "groups")])
def test_bf16_forward_within_tolerance(family, route, tmp_path, monkeypatch):
    import transformers

    save_hf(family, "base", tmp_path)
    inputs = on(CUDA, batch(family, pairs=False))
    keep = inputs["attention_mask"].bool()
    fp32 = transformers.AutoModel.from_pretrained(tmp_path).eval().to(CUDA)
    theirs = transformers.AutoModel.from_pretrained(tmp_path, dtype=torch.bfloat16).eval().to(CUDA)
    ours = hfport.AutoModel.from_pretrained(tmp_path, dtype="bfloat16", device="cuda")
    taken = []
    real_route = layout_module.cuda_route
    monkeypatch.setattr(layout_module, "cuda_route", lambda *a, **k: taken.append(real_route(*a, **k)) or taken[-1])
    with torch.inference_mode():
        want = fp32(**inputs).last_hidden_state[keep].float()
        err_theirs = (theirs(**inputs).last_hidden_state[keep].float() - want).abs().mean().item()
        err_ours = (ours(**inputs).last_hidden_state[keep].float() - want).abs().mean().item()
    assert err_ours <= 2 * err_theirs + 1e-3, (err_ours, err_theirs)
    expected = route if varlen_module.VARLEN_ATTN is not None else "groups"
    assert taken and set(taken) == {expected}, taken


def _qkv(lengths, heads=4, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    qkv = [torch.randn(n, heads, d, generator=g).to(CUDA, torch.bfloat16).requires_grad_() for _ in range(3)]
    cu = varlen_module.cu_seqlens(tuple(lengths)).to(CUDA)
    return qkv, cu, max(lengths)


def test_varlen_dropout_kernel():
    """varlen_dropout (aten's flash forward with dropout_p; training with attention dropout): at rate 0 it is
    torch's varlen_attn, forward and gradients; at 0.1 the same seed gives the same output and gradients (the
    backward replays the forward's mask), and the mean of 256 draws comes back to the undropped output (inverted
    dropout is unbiased): its error at most a quarter of one draw's (expected ~1/16)."""
    (q, k, v), cu, longest = _qkv((70, 41, 9, 33))
    w = torch.randn(q.shape, device=CUDA, dtype=q.dtype)
    args = (q, k, v, cu, cu, longest, longest)
    plain = varlen_module.varlen_kernel()(*args, scale=0.125, window_size=(-1, -1))
    zero = varlen_module.varlen_dropout(*args, scale=0.125, window_size=(-1, -1), dropout_p=0.0)
    # the same flash call where torch's wrapper takes flash (a cuDNN backend, where it takes one, rounds otherwise)
    torch.testing.assert_close(zero, plain, atol=1e-2, rtol=1e-2)
    for a, b in zip(torch.autograd.grad((zero * w).sum(), (q, k, v)), torch.autograd.grad((plain * w).sum(), (q, k, v))):
        torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)

    def draw(seed):
        torch.manual_seed(seed)
        out = varlen_module.varlen_dropout(*args, scale=0.125, window_size=(-1, -1), dropout_p=0.1)
        return out, torch.autograd.grad((out * w).sum(), (q, k, v))

    (o1, g1), (o2, g2) = draw(5), draw(5)
    assert torch.equal(o1, o2) and all(torch.equal(a, b) for a, b in zip(g1, g2))
    assert all(torch.isfinite(g).all() for g in g1)
    with torch.no_grad():
        one = (o1.float() - plain.float()).abs().mean().item()
        total = torch.zeros_like(plain, dtype=torch.float32)
        for seed in range(256):
            total += varlen_module.varlen_dropout(*args, scale=0.125, window_size=(-1, -1), dropout_p=0.1).float()
        mean_err = (total / 256 - plain.float()).abs().mean().item()
    assert one > 1e-3 and mean_err < one / 4, (one, mean_err)


def test_training_with_attention_dropout_takes_varlen(tmp_path, monkeypatch):
    """BERT's default attention dropout (0.1) in training: one varlen call per layer (varlen_dropout), finite
    gradients, and a first attention layer whose output moves ~3% from eval mode's (fp32 on a CPU: 3.0%), far above
    bf16's rounding (0.4%): dropout ran. (The first GPU run compared the tiny classifier's losses, which dropout
    barely moves: equal in bf16.)"""
    save_hf("bert", "base", tmp_path, attention_probs_dropout_prob=0.1, hidden_dropout_prob=0.0)
    model = hfport.AutoModel.from_pretrained(tmp_path, device="cuda")
    inputs = on(CUDA, batch("bert", pairs=False))
    keep = inputs["attention_mask"].bool()
    taken, seen = [], []
    real_route = layout_module.cuda_route
    monkeypatch.setattr(layout_module, "cuda_route", lambda *a, **k: taken.append(real_route(*a, **k)) or taken[-1])
    model.body.encoder.layers[0].attn.register_forward_hook(lambda m, i, o: seen.append(o.detach().float()))
    model.train()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        projection_loss(model(**inputs), keep).backward()
    assert taken and set(taken) == {"varlen" if varlen_module.VARLEN_ATTN is not None else "groups"}, taken
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    model.eval()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        model(**inputs)
    moved = ((seen[0] - seen[1]).abs().mean() / seen[1].abs().mean()).item()
    assert moved > 0.01, moved


# --- 3. fp32 parity of every family's heads, TF32 off -------------------------------------------------------------


def _grid() -> list[tuple[str, str]]:
    import transformers

    families = [f for f in ALL_FAMILIES if hasattr(transformers, ALL_FAMILIES[f][0])]
    rotating = [f for f in ROTARY_CONFIGS if hasattr(transformers, ROTARY_CONFIGS[f][0])]
    return ([(f, t) for f in families for t in HEADS]
            + [(f, t) for f in rotating for t in (*ROTARY_HEADS, *ROTARY_EXTRA_HEADS.get(f, ()))])


@pytest.mark.parametrize("family, task", _grid() if torch.cuda.is_available() else [("bert", "base")])
def test_parity_fp32(family, task, tmp_path):
    import transformers

    ref = save_hf(family, task, tmp_path).to(CUDA)
    options = {}
    if family in ROTARY_CONFIGS:
        inputs = rotary.inputs_for(family, type_vocab_size=getattr(ref.config, "type_vocab_size", 0))
        options["pieces"] = lambda hf: rotary.in_memory(family, hf)
        ref = getattr(transformers, HEADS[task]).from_pretrained(tmp_path).eval().to(CUDA)
    else:
        inputs = batch(family, pairs=getattr(ref.config, "type_vocab_size", 2) > 1)
    if family == "deberta-v2":
        options.update(DEBERTA_PARITY)
    options.setdefault("base_loss", projection_loss)
    ours = getattr(hfport, AUTO_CLASSES[task]).from_pretrained(tmp_path, device="cuda")  # loaded onto the GPU
    assert not ours.load_report.initialized and not ours.load_report.unexpected, ours.load_report.summary()
    labels = labels_for(task, inputs)
    compare_models(ref, ours, on(CUDA, inputs), task, labels=on(CUDA, labels), name=f"{family}/{task} cuda",
                   **options)


def test_auto_classes_cover_the_grid():
    assert set(HEADS) <= set(AUTO_CLASSES)
