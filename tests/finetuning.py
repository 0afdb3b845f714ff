"""Fine-tuning runs the tests share: the sentiment run folder (a tiny random BERT with MiniLM's WordPiece tokenizer
beside generated sentiment data), the FinetuneConfig over it, a sentence-embedding config over examples/data's
retrieval files, metrics.jsonl without its machine-dependent lines, and the SIGKILL-and-resume check (its children
come from tests/forked.py's fork server)."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

import hfport
from hfport.train.config import FinetuneConfig
from hfport.train.loop import finetune
from hfport.train.monitor import is_perf
from tests.data import DATA, write_sentiment
from tests.faults import finetune_noting_imports
from tests.forked import start_child
from tests.tiny import save_with_tokenizer


def sentiment_run(root: Path, minilm: Path, train: int, eval: int) -> Path:
    """`root`: model/ (a tiny random BERT with MiniLM's WordPiece tokenizer), train.jsonl and eval.jsonl (`train`
    and `eval` generated sentiment rows, seeds 0 and 1)."""
    save_with_tokenizer("bert", "base", root / "model", minilm, vocab_size=30522)
    write_sentiment(root / "train.jsonl", train, seed=0)
    write_sentiment(root / "eval.jsonl", eval, seed=1)
    return root


def finetune_workdir(root: Path, minilm: Path) -> Path:
    """sentiment_run's folder (192 training rows, 48 eval) plus model_nodrop/ (the same BERT without dropout) and
    varied.jsonl / varied_eval.jsonl (rows of varied lengths): conftest's `workdir`."""
    root = sentiment_run(root, minilm, 192, 48)
    save_with_tokenizer("bert", "base", root / "model_nodrop", minilm, vocab_size=30522, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    write_sentiment(root / "varied.jsonl", 96, seed=2, filler=40)
    write_sentiment(root / "varied_eval.jsonl", 40, seed=3, filler=40)
    return root


def base_config(workdir: Path, out: Path, **overrides) -> FinetuneConfig:
    values = dict(model=str(workdir / "model"), train=str(workdir / "train.jsonl"), eval=str(workdir / "eval.jsonl"),
                  output_dir=str(out), batch_size=16, lr=3e-3, warmup_ratio=0.1, logging_steps=1, seed=7,
                  precision="fp32")  # the tests' tolerances are fp32's; bf16 runs are tested in test_bf16.py
    return FinetuneConfig(**{**values, **overrides})


def model_lines(text: str) -> list[str]:
    """metrics.jsonl without its `perf` lines (speed, ETA, memory: the machine's, different every run), i.e. the
    lines that must be identical between a run and its resumed twin."""
    return [x for x in text.splitlines() if not is_perf(json.loads(x))]


def embedding_config(model: Path, tmp_path: Path, **kw) -> FinetuneConfig:
    """A sentence-embedding fine-tune of `model` (conftest's tiny_bert) on examples/data's retrieval files."""
    values = dict(model=str(model), task="sentence-embedding", train=str(DATA / "embed_train.jsonl"),
                  eval=str(DATA / "embed_eval.jsonl"), output_dir=str(tmp_path / "run"), batch_size=16, lr=1e-3,
                  logging_steps=1, seed=3, max_length=48, precision="fp32")
    return FinetuneConfig(**{**values, **kw})


def check_resume_after_sigkill(config: Callable[..., FinetuneConfig], tmp_path: Path, weights: str,
                               kill_steps: list[int]) -> list[Path]:
    """`config(out, **extra)` trained to its end, then once per step in `kill_steps` a run SIGKILLed as soon as its
    log shows that step (sometimes mid-checkpoint) and resumed: the same metrics and the same final/`weights` file,
    bit for bit. Returns the killed-and-resumed runs' folders."""
    ref = start_child(finetune_noting_imports, config(tmp_path / "ref"), tmp_path / "ref-imports.txt")
    ref.join(300)
    assert ref.exitcode == 0
    imported = (tmp_path / "ref-imports.txt").read_text().split()
    # each child would import these again (the fork server's preload is what keeps a child's start cheap)
    heavy = [m for m in imported if m.split(".")[0] in ("sympy", "transformers") or m.startswith("torch._dynamo")]
    assert not heavy, f"a fork-server child imported {len(heavy)} modules of {sorted({m.split('.')[0] for m in heavy})}"
    ref_metrics = model_lines((tmp_path / "ref" / "metrics.jsonl").read_text())
    ref_weights = load_file(str(tmp_path / "ref" / "final" / weights))
    outs = []
    for trial, kill_at in enumerate(kill_steps):
        out = tmp_path / f"trial{trial}"
        child = start_child(finetune, config(out), progress=False)
        deadline = time.time() + 300
        while time.time() < deadline and child.is_alive():
            log = out / "metrics.jsonl"
            if log.exists() and f'"step": {kill_at},' in log.read_text():
                break
            time.sleep(0.005)
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        assert child.exitcode == -signal.SIGKILL, f"trial {trial}: the run ended before it could be killed"
        # checkpoints are written in the background: a kill soon after step 2 can come before the first one
        # landed; then there is nothing to resume and the run starts over (as the server's job runner does)
        again = {"resume": "latest"} if hfport.RunDir(out).latest_checkpoint() else {"overwrite": True}
        resumed = start_child(finetune, config(out, **again), progress=False)
        resumed.join(300)
        assert resumed.exitcode == 0
        assert model_lines((out / "metrics.jsonl").read_text()) == ref_metrics, f"trial {trial} (killed at step {kill_at})"
        got = load_file(str(out / "final" / weights))
        assert got.keys() == ref_weights.keys()
        for key in got:
            assert torch.equal(got[key], ref_weights[key]), f"trial {trial}: {key} differs"
        outs.append(out)
    return outs
