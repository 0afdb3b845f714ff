"""Multi-node fine-tuning: `hfport finetune` unchanged under `accelerate launch --num_machines 2`, two "machines"
on loopback (two launchers, one CPU process each, gloo), follows one process with the same global batch.

Why the comparison is valid: `batch_size` is per process and every process builds the same global batches of
batch_size x world examples and trains on its stride (`batch[rank::world]`, hfport/train/loop.py); so
2 machines x 1 process x batch 4 and 1 process x batch 8 see the same 8 examples per step, and the all-reduced
gradient is the mean over the same examples."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from server.launch import free_port
from tests.data import write_sentiment
from tests.forked import run_cli
from tests.tiny import save_hf

STEPS = 4


def _losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if r.get("type") == "train"]


def test_two_machines_follow_one_process(tmp_path, minilm_path):
    model = tmp_path / "model"
    save_hf("bert", "base", model, vocab_size=30522, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(minilm_path / f, model / f)
    write_sentiment(tmp_path / "train.jsonl", 64, seed=0, filler=10)
    # no --max-length: the default (256) is lowered to the model's 128 positions on every process alike
    common = ["-m", "hfport", "finetune", "--model", str(model), "--train", str(tmp_path / "train.jsonl"),
              "--max-steps", str(STEPS), "--set", "eval_strategy=no", "--set", "logging_steps=1",
              "--set", "scheduler=constant"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}

    # the one-process reference in its own process (tests/forked.py: the CLI as `python -m hfport` runs it)
    one = run_cli(*common[2:], "-q", "--batch-size", "8", "--output-dir", str(tmp_path / "one"), env=env,
                  timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]

    # two launchers, as two machines would run them: same command line but --machine_rank; the output folder is
    # the shared data dir every node sees (only the global main process writes it)
    port = free_port()
    nodes = [subprocess.Popen([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
                               "--num_machines", "2", "--machine_rank", str(rank), "--num_processes", "2",
                               "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
                               "--mixed_precision", "no", "--dynamo_backend", "no",
                               *common, "--batch-size", "4", "--output-dir", str(tmp_path / "two")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for rank in (0, 1)]
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=300)[0].decode(errors="replace"))
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    for rank, (node, text) in enumerate(zip(nodes, outputs)):
        assert node.returncode == 0, f"machine_rank {rank}:\n{text[-3000:]}"
    # the summary is printed once, by the main process (the other rank printed "{}", its empty summary, before)
    assert '"num_processes": 2' in outputs[0], outputs[0][-3000:]
    assert "{}" not in outputs[1].splitlines() and "num_processes" not in outputs[1], outputs[1][-3000:]
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["config"]["max_length"] == 128, summary["config"]

    curve = [_losses(tmp_path / d) for d in ("one", "two")]
    assert len(curve[0]) == len(curve[1]) == STEPS
    # the 2-machine loss is the mean of two half-batch means (all-reduced): equal up to fp32 rounding
    torch.testing.assert_close(torch.tensor(curve[1]), torch.tensor(curve[0]), atol=1e-4, rtol=1e-4)
    a = load_file(str(tmp_path / "one" / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "two" / "final" / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        # the gradient is averaged across machines in another summation order; Adam normalises each update, so
        # those fp32 differences can move a weight by ~lr * 1e-4 (the tolerance the grad-accumulation test uses)
        torch.testing.assert_close(b[key], a[key], atol=2e-5, rtol=1e-4, msg=lambda m, key=key: f"{key}: {m}")
