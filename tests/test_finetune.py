"""The fine-tuning engine: it learns, resumes bit-exactly after SIGKILL, accumulates gradients exactly,
runs under `accelerate launch` with 2 processes, refuses bad data before training, batches by length (with a
token budget) without losing exactness, and its opt-in extras (compile, bf16 on CPU) train."""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import hfport
from hfport.hardware import cpu_capabilities
from hfport.rundir import RunDir
from hfport.train.config import FinetuneConfig
from hfport.train.data import DataError, epoch_batches, eval_batches, padding_fraction, planned_steps
from hfport.train.loop import finetune
from tests.finetuning import base_config, check_resume_after_sigkill, model_lines
from tests.forked import run_cli


def _losses(out: Path) -> list[float]:
    """The train losses in metrics.jsonl."""
    return [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines() if '"train"' in x]


def test_classification_learns(workdir, tmp_path):
    out = tmp_path / "run"
    # 5 epochs: transformers' warmup starts at lr 0, and at 4 epochs the loss ended a hair above half (0.350 of
    # 0.694) where hfport's old warmup, a step ahead, had it just below; at 5 it ends near 0.1
    summary = finetune(base_config(workdir, out, epochs=5), progress=False)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [x["loss"] for x in lines if x["type"] == "train"]
    evals = [x for x in lines if x["type"] == "eval"]
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, "training loss did not fall"
    assert evals[-1]["eval_accuracy"] >= 0.9, evals[-1]
    assert summary["labels"] == {0: "negative", 1: "positive"}
    for folder in ("best", "final"):  # HF folders with the tokenizer beside the weights
        assert {"config.json", "model.safetensors", "tokenizer.json", "vocab.txt"} <= {
            p.name for p in (out / folder).iterdir()}
    trained = hfport.AutoModelForSequenceClassification.from_pretrained(out / "best")
    assert trained.config.id2label == {0: "negative", 1: "positive"} and not trained.load_report.initialized
    report = (out / "report.html").read_text()  # the curves are drawn by the inlined charts.js (test_monitor)
    assert "HfCharts.render(" in report and '"eval_accuracy"' in report
    assert json.loads((out / "summary.json").read_text())["best_metric"]["accuracy"] >= 0.9


def _run_cli(args: list[str]) -> subprocess.CompletedProcess:
    """`hfport finetune -q ARGS` in its own process (tests/forked.py: the CLI as `python -m hfport` runs it)."""
    return run_cli("finetune", "-q", *args, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)


def test_resume_after_sigkill_is_bit_identical(workdir, tmp_path):
    """SIGKILL at seeded random steps (sometimes mid-checkpoint), resume: same weights bit for bit, same metrics."""
    def config(out: Path, **kw) -> FinetuneConfig:
        return base_config(workdir, out, max_steps=16, batch_size=8, save_steps=2, eval_strategy="steps",
                           eval_steps=5, **kw)

    rng = random.Random(1234)
    for out in check_resume_after_sigkill(config, tmp_path, "model.safetensors",
                                          [rng.randint(3, 15) for _ in range(5)]):
        assert not list((out / "checkpoints").glob(".tmp-*")), "a half-written checkpoint was left behind"


def test_resume_through_the_cli(workdir, tmp_path):
    """`hfport finetune --resume` (no value: latest) finishes a run whose checkpoints exist."""
    common = ["--model", str(workdir / "model"), "--train", str(workdir / "train.jsonl"), "--eval",
              str(workdir / "eval.jsonl"), "--batch-size", "8", "--save-steps", "2", "--lr", "3e-3",
              "--output-dir", str(tmp_path / "run")]
    first = _run_cli([*common, "--max-steps", "4"])
    assert first.returncode == 0, first.stderr
    again = _run_cli([*common, "--max-steps", "6", "--resume"])
    assert again.returncode == 0, again.stderr
    steps = [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 6
    refused = _run_cli(common + ["--max-steps", "4"])
    assert refused.returncode != 0 and "already holds a run" in refused.stderr


def test_gradient_accumulation_matches_big_batch(workdir, tmp_path):
    """4 x 8 with accumulation == 32 in one batch (dropout off; only fp32 summation order differs)."""
    common = dict(model=str(workdir / "model_nodrop"), max_steps=4, eval=None, eval_fraction=0.0,
                  eval_strategy="no", scheduler="constant_with_warmup", max_grad_norm=None)
    finetune(base_config(workdir, tmp_path / "big", batch_size=32, grad_accum=1, **common), progress=False)
    finetune(base_config(workdir, tmp_path / "acc", batch_size=8, grad_accum=4, **common), progress=False)
    a = load_file(str(tmp_path / "big" / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "acc" / "final" / "model.safetensors"))
    for key in a:
        # Adam normalises updates, so tiny fp32 differences in the gradient can move weights by ~lr * 1e-4
        torch.testing.assert_close(b[key], a[key], atol=2e-5, rtol=1e-4, msg=lambda m: f"{key}: {m}")


def test_two_processes_follow_one(workdir, tmp_path):
    """`accelerate launch` with 2 CPU processes (gloo), 2 x 4 per step == 1 x 8: the same loss curve, and the
    final evaluation, split over the processes and gathered back, gives the same metrics."""
    common = ["--model", str(workdir / "model_nodrop"), "--train", str(workdir / "varied.jsonl"), "--max-steps", "6",
              "--eval", str(workdir / "varied_eval.jsonl"), "--set", "eval_strategy=no", "--set", "logging_steps=1",
              "--set", "scheduler=constant", "-q"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    # the one-process reference in its own process (tests/forked.py: the CLI as `python -m hfport` runs it)
    one = run_cli("finetune", *common, "--batch-size", "8", "--output-dir", str(tmp_path / "one"), env=env,
                  timeout=300)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                          "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                          "-m", "hfport", "finetune", *common, "--batch-size", "4",
                          "--output-dir", str(tmp_path / "two")], env=env, capture_output=True, timeout=300)
    assert two.returncode == 0, two.stderr.decode()[-3000:]
    curve = [_losses(tmp_path / d) for d in ("one", "two")]
    # the 2-process loss is the mean of two half-batch means: equal up to fp32 rounding in the all-reduce
    assert len(curve[0]) == len(curve[1]) == 6
    torch.testing.assert_close(torch.tensor(curve[1]), torch.tensor(curve[0]), atol=1e-4, rtol=1e-4)
    evals = [json.loads((tmp_path / d / "summary.json").read_text())["final_eval"] for d in ("one", "two")]
    assert evals[1]["eval_accuracy"] == evals[0]["eval_accuracy"]
    assert evals[1]["eval_loss"] == pytest.approx(evals[0]["eval_loss"], abs=1e-4)


# --- bad input: clear errors before training, naming file, line and field --------------------------------------


def _bad(workdir: Path, tmp_path: Path, content: bytes | str, suffix: str = ".jsonl", **overrides) -> str:
    path = tmp_path / f"bad{suffix}"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises((DataError, hfport.ConfigError)) as info:
        finetune(base_config(workdir, tmp_path / "out", train=str(path), **overrides), progress=False)
    assert not (tmp_path / "out" / "checkpoints").exists(), "training started despite bad data"
    return str(info.value)


def test_empty_file(workdir, tmp_path):
    assert "no examples" in _bad(workdir, tmp_path, "")


def test_missing_column(workdir, tmp_path):
    msg = _bad(workdir, tmp_path, '{"text": "fine", "label": "positive"}\n{"text": "oops"}\n')
    assert "bad.jsonl, line 2, field 'label'" in msg


def test_unknown_eval_label(workdir, tmp_path):
    path = tmp_path / "eval.jsonl"
    path.write_text('{"text": "hmm", "label": "neutral"}\n')
    with pytest.raises(DataError, match=r"eval.jsonl, line 1, field 'label': unknown label 'neutral'"):
        finetune(base_config(workdir, tmp_path / "out", eval=str(path)), progress=False)


def test_mixed_label_types(workdir, tmp_path):
    msg = _bad(workdir, tmp_path, '{"text": "a", "label": "positive"}\n{"text": "b", "label": ["x"]}\n')
    assert "mixed label types" in msg and "line 2" in msg


def test_huge_line(workdir, tmp_path):
    msg = _bad(workdir, tmp_path, '{"text": "ok", "label": "a"}\n{"text": "' + "x" * 1_100_000 + '", "label": "b"}\n')
    assert "line 2" in msg and "limit" in msg


def test_non_utf8(workdir, tmp_path):
    msg = _bad(workdir, tmp_path, b'{"text": "ok", "label": "a"}\n{"text": "caf\xe9", "label": "b"}\n')
    assert "line 2" in msg and "UTF-8" in msg


def test_fewer_rows_than_a_batch(workdir, tmp_path):
    msg = _bad(workdir, tmp_path, '{"text": "a b", "label": "x"}\n{"text": "c d", "label": "y"}\n', batch_size=16,
               eval=None, eval_fraction=0.0)
    assert "fewer than one batch" in msg


def test_csv_errors_name_the_line(workdir, tmp_path):
    msg = _bad(workdir, tmp_path, "text,label\nfine,positive\nno label here\n", suffix=".csv")
    assert "bad.csv, line 3" in msg


def test_existing_run_is_not_overwritten(workdir, tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(hfport.ConfigError, match="already holds a run"):
        finetune(base_config(workdir, out), progress=False)
    assert (out / "metrics.jsonl").read_text() == "{}\n"


def test_print_config_shows_sources(workdir, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("lr: 0.001\nepochs: 2\n")
    res = run_cli("finetune", "--config", str(cfg), "--model", "m", "--train", "t.jsonl", "--epochs", "5",
                  "--print-config")
    assert res.returncode == 0, res.stderr
    rows = {line.split()[0]: line for line in res.stdout.splitlines()}
    assert "(flag)" in rows["epochs"] and "5.0" in rows["epochs"]
    assert str(cfg) in rows["lr"] and "0.001" in rows["lr"]
    assert "(default)" in rows["batch_size"]
    bad = run_cli("finetune", "--model", "m", "--train", "t", "--set", "learning_rat=1")
    assert bad.returncode != 0 and "unknown option 'learning_rat'; did you mean lr (transformers: learning_rate)?" \
        in bad.stderr


def test_early_stopping_stops(workdir, tmp_path):
    """patience 1 with a threshold nothing can beat: the second eval stops the run."""
    summary = finetune(base_config(workdir, tmp_path / "run", epochs=10, eval_strategy="steps", eval_steps=2,
                                   early_stopping_patience=1, early_stopping_threshold=10.0), progress=False)
    assert summary["stopped_early"] and summary["steps"] == 4 and summary["best_step"] == 2


def test_stops_when_the_metric_has_converged(workdir, tmp_path):
    """converged_window 2 with a generous tolerance: stop as soon as two evals agree."""
    summary = finetune(base_config(workdir, tmp_path / "run", epochs=10, eval_strategy="steps", eval_steps=2,
                                   converged_window=2, converged_tolerance=1.0), progress=False)
    assert summary["steps"] == 4


# --- batching by length --------------------------------------------------------------------------------------------

_rng = random.Random(5)
LENGTHS = [_rng.randint(4, 200) for _ in range(1000)]  # a seeded, length-varied set
LAYOUTS = [dict(group_by_length=g, max_tokens=t, world=w, grad_accum=a)
           for g in (True, False) for t in (None, 600) for w in (1, 2, 3) for a in (1, 3)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
def test_epoch_batches_cover_every_example_once(layout):
    """Each epoch: every example exactly once, every process a share, the same list for the same (seed, epoch),
    another for another epoch; per process at most batch_size examples (one more where an epoch's last few,
    fewer than the processes, joined a batch), and within the budget unless a batch is one example a process."""
    world = layout["world"]
    epochs = [epoch_batches(LENGTHS, 8, seed=3, epoch=e, **layout) for e in range(3)]
    for batches in epochs:
        assert sorted(i for b in batches for i in b) == list(range(len(LENGTHS)))
        for b in batches:
            per_process = math.ceil(len(b) / world)
            assert len(b) >= world and per_process <= 8 + (world > 1)
            if layout["max_tokens"] and len(b) > world:
                longest = max(LENGTHS[i] for i in b)
                assert (per_process - (world > 1)) * longest <= layout["max_tokens"]
    assert epoch_batches(LENGTHS, 8, seed=3, epoch=1, **layout) == epochs[1], "not a pure function"
    assert epochs[0] != epochs[1] != epochs[2]
    assert epoch_batches(LENGTHS, 8, seed=4, epoch=1, **layout) != epochs[1]


def test_token_budget_on_one_process_is_strict():
    batches = epoch_batches(LENGTHS, 16, seed=0, epoch=0, group_by_length=True, max_tokens=500)
    for b in batches:
        assert len(b) <= 16 and (len(b) == 1 or len(b) * max(LENGTHS[i] for i in b) <= 500)
    assert len(batches) > math.ceil(len(LENGTHS) / 16), "the budget should split the long batches"
    alone = epoch_batches([10, 900, 12, 11], 4, seed=0, epoch=0, group_by_length=True, max_tokens=100)
    assert sorted(map(sorted, alone)) == [[0, 2, 3], [1]], "an over-budget example forms its own batch"


def test_grouping_cuts_padding():
    """Structural, not a timing: sorting within mega-buckets leaves far less padding than random batches."""
    for world in (1, 2):
        grouped = padding_fraction(epoch_batches(LENGTHS, 16, 0, 0, group_by_length=True, world=world), LENGTHS, world)
        plain = padding_fraction(epoch_batches(LENGTHS, 16, 0, 0, group_by_length=False, world=world), LENGTHS, world)
        assert plain > 0.3 and grouped < plain / 2, (grouped, plain)


def test_grouped_steps_do_not_depend_on_accumulation():
    """k accumulated batches of b hold the same examples as one batch of k x b (and as b x world over processes):
    what lets the accumulation and two-process tests compare against one big batch."""
    big = epoch_batches(LENGTHS, 32, 1, 2, group_by_length=True)
    acc = epoch_batches(LENGTHS, 8, 1, 2, group_by_length=True, grad_accum=4)
    assert [sorted(b) for b in big] == [sorted(i for b in acc[k:k + 4] for i in b) for k in range(0, len(acc), 4)]
    assert epoch_batches(LENGTHS, 16, 1, 2, group_by_length=True, world=2) == big


def test_group_by_length_off_keeps_the_old_order():
    """Shuffled, fixed-size batches: the order runs made before grouping existed."""
    order = list(range(len(LENGTHS)))
    random.Random(7 * 1_000_003 + 2).shuffle(order)
    assert epoch_batches(LENGTHS, 16, 7, 2) == [order[i:i + 16] for i in range(0, len(order), 16)]


def test_eval_batches_sorted_and_complete():
    mine = list(range(1, len(LENGTHS), 3))
    batches = eval_batches(mine, LENGTHS, 16, max_tokens=800, group_by_length=True)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == mine and [LENGTHS[i] for i in flat] == sorted(LENGTHS[i] for i in mine)
    assert all(len(b) == 1 or len(b) * max(LENGTHS[i] for i in b) <= 800 for b in batches)
    assert eval_batches(mine, LENGTHS, 16, None, group_by_length=False)[0] == mine[:16]


def test_planned_steps_counts_each_epoch():
    per_epoch = {0: 10, 1: 12, 2: 9}
    assert planned_steps(2.5, per_epoch.__getitem__) == 10 + 12 + 5
    assert planned_steps(3, per_epoch.__getitem__) == 31 and planned_steps(0.25, per_epoch.__getitem__) == 3


def test_grouped_resume_mid_epoch_is_exact(workdir, tmp_path):
    """Grouping and a token budget on, resumed from checkpoints in the middle of the first and the second epoch:
    the same weights bit for bit and the same metrics as the unbroken run (every epoch's batches are rebuilt,
    the number of steps per epoch varies with the budget)."""
    def config(out: Path, **kw) -> FinetuneConfig:
        return base_config(workdir, out, train=str(workdir / "varied.jsonl"), eval=str(workdir / "varied_eval.jsonl"),
                           epochs=1.5, batch_size=8, max_batch_tokens=200, save_steps=5, save_total_limit=100,
                           eval_strategy="steps", eval_steps=7, **kw)

    ref = tmp_path / "ref"
    summary = finetune(config(ref), progress=False)
    ref_lines = model_lines((ref / "metrics.jsonl").read_text())
    ref_weights = load_file(str(ref / "final" / "model.safetensors"))
    states = {p: json.loads((p / "trainer_state.json").read_text()) for p in (ref / "checkpoints").glob("step-*")}
    mid = {e: max((p for p, s in states.items() if s["epoch"] == e and s["batch_in_epoch"] > 0),
                  key=lambda p: states[p]["step"]) for e in (0, 1)}
    assert summary["steps"] > math.ceil(96 / 8) * 1.5, "the budget should have added steps"
    for epoch, ckpt in mid.items():
        out = tmp_path / f"resumed{epoch}"
        finetune(config(out, resume=str(ckpt)), progress=False)
        after = [x for x in ref_lines if json.loads(x)["step"] > states[ckpt]["step"]]
        assert model_lines((out / "metrics.jsonl").read_text()) == after, f"resumed in epoch {epoch}"
        weights = load_file(str(out / "final" / "model.safetensors"))
        for key in ref_weights:
            assert torch.equal(weights[key], ref_weights[key]), f"resumed in epoch {epoch}: {key} differs"


def test_length_sorted_eval_matches_file_order(workdir, tmp_path):
    """The run's eval metrics (batches sorted by length, within a budget) equal the final model's, scored one
    example at a time in file order."""
    out = tmp_path / "run"
    summary = finetune(base_config(workdir, out, train=str(workdir / "varied.jsonl"), max_steps=4, eval_strategy="no",
                                   eval=str(workdir / "varied_eval.jsonl"), max_batch_tokens=120), progress=False)
    model = hfport.AutoModelForSequenceClassification.from_pretrained(out / "final").eval()
    tokenizer = hfport.AutoTokenizer.from_pretrained(out / "final")
    rows = [json.loads(x) for x in (workdir / "varied_eval.jsonl").read_text().splitlines()]
    losses, correct = [], 0
    with torch.inference_mode():
        for row in rows:
            enc = tokenizer(row["text"], truncation=True, max_length=256, return_tensors="pt")
            logits = model(**enc).logits  # (1, 2)
            label = model.config.label2id[row["label"]]
            losses.append(float(torch.nn.functional.cross_entropy(logits, torch.tensor([label]))))
            correct += int(logits.argmax(-1)) == label
    final = summary["final_eval"]
    assert final["eval_accuracy"] == pytest.approx(correct / len(rows))
    assert final["eval_loss"] == pytest.approx(sum(losses) / len(losses), abs=1e-5)


# --- opt-in extras: torch.compile, bf16 on the CPU -----------------------------------------------------------------


def _compile_missing() -> str | None:
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile is not supported on this Python/platform"
    if not any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "g++", "c++", "clang++")):
        return "no C++ compiler for inductor"
    return None


@pytest.mark.skipif(_compile_missing() is not None, reason=str(_compile_missing()))
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's own
def test_compile_trains_and_saves_plain_names(workdir, tmp_path):
    """compile=True: the same losses as eager (dropout off), finite, and checkpoints with the model's own names
    (no `_orig_mod.`) that load back. The slow test here: about a minute with a cold inductor cache, ~15 s warm."""
    common = dict(model=str(workdir / "model_nodrop"), train=str(workdir / "varied.jsonl"), max_steps=2, eval=None,
                  eval_fraction=0.0, eval_strategy="no", save_steps=2, batch_size=8)
    finetune(base_config(workdir, tmp_path / "eager", **common), progress=False)
    finetune(base_config(workdir, tmp_path / "compiled", compile=True, **common), progress=False)
    eager, compiled = _losses(tmp_path / "eager"), _losses(tmp_path / "compiled")
    assert len(compiled) == 2 and all(math.isfinite(x) for x in compiled)
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), atol=1e-4, rtol=1e-4)
    for folder in ("final", "checkpoints/step-2"):
        keys = load_file(str(tmp_path / "compiled" / folder / "model.safetensors")).keys()
        assert keys == load_file(str(tmp_path / "eager" / folder / "model.safetensors")).keys(), folder
        assert not [k for k in keys if "_orig_mod" in k]
        loaded = hfport.AutoModelForSequenceClassification.from_pretrained(tmp_path / "compiled" / folder)
        assert not loaded.load_report.initialized and not loaded.load_report.unexpected


def test_bf16_on_cpu_trains(workdir, tmp_path):
    """precision=bf16 on the CPU is CPU autocast: finite losses, near the fp32 ones (bf16 keeps 8 bits)."""
    common = dict(model=str(workdir / "model_nodrop"), max_steps=2, eval=None, eval_fraction=0.0,
                  eval_strategy="no")
    finetune(base_config(workdir, tmp_path / "fp32", precision="fp32", **common), progress=False)
    finetune(base_config(workdir, tmp_path / "bf16", precision="bf16", **common), progress=False)
    bf16, fp32 = _losses(tmp_path / "bf16"), _losses(tmp_path / "fp32")
    assert len(bf16) == 2 and all(math.isfinite(x) for x in bf16)
    assert abs(bf16[0] - fp32[0]) < 2e-2, (bf16, fp32)
    auto = finetune(base_config(workdir, tmp_path / "auto", precision="auto", **common), progress=False)
    native = cpu_capabilities().bf16_native  # measured: bf16 matmul >= 1.5x fp32's speed
    assert auto["config"]["precision"] == "auto"
    assert _losses(tmp_path / "auto") == (bf16 if native else fp32), "auto is bf16 where native, else fp32"


@pytest.mark.skipif(torch.cuda.is_available(), reason="fp16 is refused on CPU-only machines")
def test_fp16_on_cpu_is_refused(workdir, tmp_path):
    with pytest.raises(hfport.ConfigError, match="precision: 'fp16' needs a CUDA GPU"):
        finetune(base_config(workdir, tmp_path / "run", precision="fp16"), progress=False)
    assert not (tmp_path / "run").exists()


def test_heap_policy_changes_no_value_and_is_undone(workdir, tmp_path, monkeypatch):
    """The loop keeps big per-step blocks on the heap (HeapPolicy: where the word-embedding gradient lives, not what
    it holds): a run without it gives the same weights bit for bit and the same metrics; the policy is undone when
    the run ends, and when it fails."""
    from hfport import hardware
    from hfport.train import loop

    if sys.platform == "linux" and os.confstr("CS_GNU_LIBC_VERSION"):
        assert hardware.HeapPolicy().libc is not None, "on glibc the policy must find mallopt"

    def run(out: Path) -> tuple[list[str], dict[str, torch.Tensor]]:
        finetune(base_config(workdir, out, max_steps=5, eval_strategy="no", eval=None, eval_fraction=0.0),
                 progress=False)
        return model_lines((out / "metrics.jsonl").read_text()), load_file(str(out / "final" / "model.safetensors"))

    calls = []
    keep, restore = hardware.HeapPolicy.keep_large_blocks, hardware.HeapPolicy.restore
    monkeypatch.setattr(hardware.HeapPolicy, "keep_large_blocks", lambda self: calls.append("keep") or keep(self))
    monkeypatch.setattr(hardware.HeapPolicy, "restore", lambda self: calls.append("restore") or restore(self))
    lines, weights = run(tmp_path / "with")
    assert calls == ["keep", "restore"]
    monkeypatch.setattr(hardware.HeapPolicy, "keep_large_blocks", lambda self: self)  # glibc's own thresholds
    plain_lines, plain_weights = run(tmp_path / "without")
    assert lines == plain_lines
    assert weights.keys() == plain_weights.keys()
    for key in weights:
        assert torch.equal(weights[key], plain_weights[key]), key

    calls.clear()
    monkeypatch.setattr(hardware.HeapPolicy, "keep_large_blocks", lambda self: calls.append("keep") or keep(self))
    monkeypatch.setattr(loop, "float32_outputs", lambda outputs: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        finetune(base_config(workdir, tmp_path / "failed", max_steps=5, eval_strategy="no"), progress=False)
    assert calls == ["keep", "restore"]


def test_heap_policy_is_restored_by_its_last_holder():
    """The allocator setting is the process's: two fine-tunes in one process (threads of a worker) share it, and
    only the second to end puts glibc back; restoring twice does nothing."""
    from hfport.hardware import HeapPolicy

    calls = []

    class Libc:  # records what HeapPolicy asks of glibc
        def mallopt(self, what: int, value: int) -> int:
            calls.append((what, value))
            return 1

        def malloc_trim(self, pad: int) -> int:
            calls.append(("trim", pad))
            return 1

    first, second = HeapPolicy(), HeapPolicy()
    first.libc = second.libc = Libc()
    first.keep_large_blocks()
    second.keep_large_blocks()
    assert calls == [(HeapPolicy.M_MMAP_THRESHOLD, 1 << 30), (HeapPolicy.M_TRIM_THRESHOLD, 1 << 30)]
    first.restore()
    first.restore()
    assert len(calls) == 2, "the second holder still runs"
    second.restore()
    assert calls[2:] == [(HeapPolicy.M_MMAP_THRESHOLD, 32 << 20), (HeapPolicy.M_TRIM_THRESHOLD, 64 << 20),
                         ("trim", 0)]


@pytest.mark.parametrize("strategy, save_steps, expected", [
    ("epoch", None, [2, 4]),  # every epoch end (192 rows, batch 96: 2 steps an epoch)
    ("epoch", 3, [2, 3, 4]),  # epoch ends and every save_steps
    ("steps", 3, [3]),
    ("no", 3, []),  # none at all; best/ and final/ are still written
])
def test_save_strategy_decides_the_checkpoints(workdir, tmp_path, strategy, save_steps, expected):
    out = tmp_path / "run"
    finetune(base_config(workdir, out, epochs=2, batch_size=96, save_strategy=strategy, save_steps=save_steps,
                         save_total_limit=10, eval_strategy="no"), progress=False)
    assert RunDir(out).checkpoint_steps() == expected
    assert (out / "final" / "model.safetensors").is_file() and (out / "best" / "model.safetensors").is_file()


def test_save_strategy_steps_without_save_steps_saves_every_500(workdir, tmp_path):
    # transformers' save_steps default (tests/test_training_arguments.py compares it with TrainingArguments)
    assert base_config(workdir, tmp_path / "run", save_strategy="steps").save_steps == 500


@pytest.mark.parametrize("fused", ["on", "off"])  # the fused AdamW takes the scale itself: accelerate's flag misses it
def test_a_step_the_loss_scaler_skips_holds_the_schedule_and_is_counted(workdir, tmp_path, monkeypatch, fused):
    """AMP bookkeeping: with a loss scaler (a CPU GradScaler stands in for fp16's on a GPU), a step whose gradients
    overflow is skipped by the scaler; the scheduler does not advance on it (transformers' Trainer neither), the step
    still counts, and the train lines count the skips."""
    from hfport.train import loop

    skip, steps = 3, 6
    build, clip = loop.build_accelerator, loop.clip_grad_norm

    def with_scaler(config):
        accelerator = build(config)
        # scale 1.0: the scaled loss and gradients equal the plain ones bit for bit until the overflow
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
        return accelerator

    calls = []

    def overflow_once(accelerator, params, max_norm):
        calls.append(len(calls) + 1)
        if calls[-1] == skip:  # an overflow in one gradient on this step
            next(p for p in params if p.grad is not None).grad[0].fill_(float("inf"))
        return clip(accelerator, params, max_norm)

    def train_lines(out: Path) -> list[dict]:
        return [e for e in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if e["type"] == "train"]

    cfg = dict(max_steps=steps, eval_strategy="no", eval=None, eval_fraction=0.0, scheduler="linear", warmup_ratio=0.0,
               max_grad_norm=None, fused_optimizer=fused, save_steps=steps, save_strategy="steps")
    monkeypatch.setattr(loop, "build_accelerator", with_scaler)
    monkeypatch.setattr(loop, "clip_grad_norm", overflow_once)
    finetune(base_config(workdir, tmp_path / "scaled", **cfg), progress=False)
    monkeypatch.undo()
    finetune(base_config(workdir, tmp_path / "plain", **cfg), progress=False)
    scaled, plain = train_lines(tmp_path / "scaled"), train_lines(tmp_path / "plain")

    assert [e["step"] for e in scaled] == list(range(1, steps + 1)), "a skipped step still counts"
    assert [e["loss"] for e in scaled[:skip]] == [e["loss"] for e in plain[:skip]]
    lrs, plain_lrs = [e["lr"] for e in scaled], [e["lr"] for e in plain]
    assert lrs[:skip - 1] == plain_lrs[:skip - 1]
    assert lrs[skip - 1:] == plain_lrs[skip - 2:-1], "the schedule stood still on the skipped step"
    assert [e["skipped_steps"] for e in scaled] == [0] * (skip - 1) + [1] * (steps - skip + 1)
    assert all("skipped_steps" not in e for e in plain), "runs without a loss scaler keep their lines"
    state = json.loads((RunDir(tmp_path / "scaled").checkpoint(steps) / "trainer_state.json").read_text())
    assert state["skipped_steps"] == 1 and state["step"] == steps  # a resumed run goes on counting


def test_resume_refuses_settings_that_make_it_another_run(workdir, tmp_path, caplog, monkeypatch):
    """--resume continues the checkpoint's run: a changed batch size, seed or learning rate (the checkpoint's place
    in the data, its optimizer state) is refused naming each field, before any weight is loaded; a longer run is
    taken with a warning that the schedule now spans the new length; where it logs and saves may change freely."""
    import logging

    def config(**kw) -> FinetuneConfig:
        values = dict(max_steps=4, batch_size=8, save_steps=2, eval_strategy="no")
        return base_config(workdir, tmp_path / "run", **{**values, **kw})

    finetune(config(), progress=False)
    with monkeypatch.context() as patched:  # refused before the data and model load
        patched.setattr("hfport.train.loop.preflight", lambda *a, **k: pytest.fail("loaded before the refusal"))
        with pytest.raises(hfport.ConfigError,
                           match=r"batch_size: 8 -> 4; lr: 0\.003 -> 0\.01; seed: 7 -> 8\. Set them back"):
            finetune(config(batch_size=4, lr=1e-2, seed=8, max_steps=6, resume="latest"), progress=False)
    with caplog.at_level(logging.WARNING, logger="hfport.train"):
        finetune(config(max_steps=6, logging_steps=2, save_total_limit=1, resume="latest"), progress=False)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("resume:")]
    assert said == ["resume: max_steps: 4 -> 6; the schedule now runs over 6 steps, and the 4 steps taken followed "
                    "the old length's"], said
    steps = [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 6


def test_resume_refuses_another_number_of_processes(workdir, tmp_path, monkeypatch):
    """A checkpoint records how many processes trained (batch_size is per process, so the global batches and the
    checkpoint's place among them are that many processes'): resumed by another number, it was another run, silently
    (a 2-process run resumed by one process went on at half the global batch, its epoch's position read in another
    order); now refused naming the count and the launch, before anything loads. tests/test_ddp.py checks a 2-process
    run records 2."""
    out = tmp_path / "run"
    finetune(base_config(workdir, out, max_steps=2, batch_size=8, save_steps=2, eval_strategy="no"), progress=False)
    state_file = RunDir(out).checkpoint(2) / "trainer_state.json"
    state = json.loads(state_file.read_text())
    assert state["num_processes"] == 1
    state_file.write_text(json.dumps({**state, "num_processes": 2}))  # as a run under accelerate launch wrote it
    monkeypatch.setattr("hfport.train.loop.preflight", lambda *a, **k: pytest.fail("loaded before the refusal"))
    with pytest.raises(hfport.ConfigError, match=r"must match it: num_processes: 2 -> 1 \(batch_size is per process; "
                                                 r"launch 2 processes: accelerate launch --multi_gpu --num_processes 2\)"):
        finetune(base_config(workdir, out, max_steps=4, batch_size=8, save_steps=2, eval_strategy="no",
                             resume="latest"), progress=False)


def test_resume_with_nothing_to_continue_writes_nothing(workdir, tmp_path, monkeypatch):
    """--resume on a folder without a checkpoint, or naming a folder that is not one, is refused naming the folder
    before the data or model is loaded, and leaves no output folder behind."""
    monkeypatch.setattr("hfport.train.loop.preflight", lambda *a, **k: pytest.fail("loaded before the refusal"))
    out = tmp_path / "never-ran"
    with pytest.raises(hfport.ConfigError, match=rf"resume: {re.escape(str(out / 'checkpoints'))} holds no complete "
                                                 "checkpoint to continue; start the run without --resume"):
        finetune(base_config(workdir, out, resume="latest"), progress=False)
    assert not out.exists()
    named = tmp_path / "elsewhere" / "step-3"
    with pytest.raises(hfport.ConfigError, match=rf"resume: {re.escape(str(named))} is not a complete checkpoint "
                                                 r"\(no trainer_state.json\)"):
        finetune(base_config(workdir, out, resume=str(named)), progress=False)
    assert not out.exists()
    monkeypatch.undo()
    finetune(base_config(workdir, out, max_steps=1, eval_strategy="no", save_strategy="no"), progress=False)
    with pytest.raises(hfport.ConfigError, match=r"holds no complete checkpoint to continue; start the run with "
                                                 r"--overwrite instead of --resume \(the folder holds a run"):
        finetune(base_config(workdir, out, max_steps=1, eval_strategy="no", save_strategy="no", resume="latest"),
                 progress=False)


def test_a_run_refused_while_setting_up_writes_nothing(workdir, tmp_path):
    """A setting refused once the model is built (a freeze prefix that matches nothing, class weights for another
    number of labels) leaves no output folder; with --overwrite the earlier run stays as it was."""
    out = tmp_path / "run"
    with pytest.raises(hfport.ConfigError, match=r"freeze: prefix\(es\) \['nowhere'\] match no parameter"):
        finetune(base_config(workdir, out, freeze=["nowhere"]), progress=False)
    assert not out.exists()
    with pytest.raises(hfport.ConfigError, match=r"class_weights has 3 values for 2 labels"):
        finetune(base_config(workdir, out, class_weights=[1.0, 2.0, 3.0]), progress=False)
    assert not out.exists()
    finetune(base_config(workdir, out, max_steps=1, eval_strategy="no"), progress=False)
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(hfport.ConfigError, match=r"freeze: prefix"):
        finetune(base_config(workdir, out, freeze=["nowhere"], overwrite=True), progress=False)
    assert sorted(p.name for p in out.iterdir()) == before and (out / "final" / "config.json").is_file()


@pytest.mark.parametrize("option, value, task, rows, refused", [
    # a float label: regression, trained with MSE
    ("label_smoothing", 0.1, "text-classification", [{"text": "a b", "label": 0.5}, {"text": "c", "label": 1.5}],
     "label_smoothing=0.1: the loss of text-classification with problem_type regression does not use it"),
    ("class_weights", [1.0], "text-classification", [{"text": "a b", "label": 0.5}, {"text": "c", "label": 1.5}],
     "class_weights=[1.0]: the loss of text-classification with problem_type regression"),
    ("label_smoothing", 0.2, "sentence-embedding", [{"anchor": "a b", "positive": "a c"}, {"anchor": "d", "positive": "e"}],
     "label_smoothing=0.2: the loss of sentence-embedding does not use it"),
    ("label_smoothing", 0.1, "text-classification", [{"text": "a b", "label": "x"}, {"text": "c", "label": "y"}], None),
])
def test_a_loss_option_the_loss_ignores_is_refused(workdir, tmp_path, option, value, task, rows, refused):
    """label_smoothing / class_weights where the task's loss never reads them (MSE, BCE, contrastive losses): refused
    by the preflight, before anything is written, instead of a run that silently trains without them."""
    from hfport.train.preflight import preflight

    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows * 4))
    config = base_config(workdir, tmp_path / "run", train=str(train), eval=None, eval_fraction=0.0, task=task,
                         batch_size=2, **{option: value})
    if refused is None:
        preflight(config)
        return
    with pytest.raises(hfport.ConfigError, match=re.escape(refused)):
        preflight(config)
    assert not (tmp_path / "run").exists()


def test_an_unknown_metric_is_refused_before_the_model_loads(workdir, tmp_path, monkeypatch):
    """--set metric=bogus failed at the first evaluation, after training steps and with metrics.jsonl written: the
    preflight now refuses it, naming the field and the metrics evaluation computes on this data, before the model
    loads and before anything is written."""
    import hfport.train.loop as loop

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded for a run with a bad metric")

    monkeypatch.setattr(loop, "build_model", no_model)
    out = tmp_path / "run"
    with pytest.raises(hfport.ConfigError) as e:
        finetune(base_config(workdir, out, metric="bogus"), progress=False)
    assert str(e.value) == (
        "metric 'bogus' (the config field metric; transformers: metric_for_best_model): evaluation of "
        "text-classification with problem_type single_label_classification on this data computes loss, accuracy, "
        "f1/negative, f1/positive, f1_macro, f1_micro, precision_macro, precision_micro, recall_macro, recall_micro")
    assert not out.exists()


def test_the_metrics_a_config_may_name_are_what_evaluation_reports(workdir, tmp_path):
    """metric_names runs the task's own metrics: a one-step run's eval line holds exactly those names (and loss), so
    every metric it reports may pick best/, f1/<label> included."""
    from hfport.train.preflight import preflight

    config = base_config(workdir, tmp_path / "run", max_steps=1, metric="f1/positive", save_strategy="no")
    checked = preflight(config)
    summary = finetune(config, progress=False)
    assert sorted(summary["final_eval"]) == sorted(f"eval_{n}" for n in ["loss", *checked.task.metric_names(
        checked.data)])
    assert summary["best_metric"].keys() == {"f1/positive"}
