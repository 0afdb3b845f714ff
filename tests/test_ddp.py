"""Every task under DDP equals one process: `accelerate launch --num_processes 2` (gloo, CPU) with batch B per process
against one process with batch 2B, fp32, SGD, no dropout, 3 steps per case (one fill-mask case with momentum and
checkpoints, 5 steps, also killed on one rank and resumed: bit-identical to the unbroken 2-process run).
Sentence-embedding equals one process only with gather_across_devices (every process's embeddings gathered, texts
repeated across processes counted once, with and without GradCache's mini_batch_size); without it, it runs and each
process scores its own negatives.

CI budget: tests/ddp_driver.py runs every case's fine-tune one after another inside ONE launch (and one plain
process), so the comparison costs two process start-ups and ~17 tiny runs on each side; the kill-and-resume test
adds two short launches.

Tolerances. The two runs compute the same sums in a different order (two half-batch sums, their all-reduce, and the
all-reduced count that normalises them, against one sum): fp32 rounding, ~1e-7 relative. With SGD at lr 0.1 a
gradient's rounding moves a weight by ~lr * 1e-7 * |grad|: measured <= 2e-8, sentence-embedding's gathered negatives
(the scale-20 cosine softmax amplifies rounding) <= 1.2e-7. Adam is not used: it divides each update by the
gradient's own running scale, so tiny gradients' rounding is not scaled down (AdamW at lr 1e-3 measured 1.3e-6 on
fill-mask). The bound 1e-6 leaves room for another BLAS's summation order and is far below what a mean over the
wrong units gives (measured before the losses were normalised over the global batch: token-classification 7e-4,
accumulated 5e-4, class-weighted tokens 1.6e-3, fill-mask 1.5e-3, text-ranking bce over uneven groups 9e-4,
class-weighted text-classification 1.3e-2; gathered negatives without merging texts repeated across processes
2.5e-3). The loss lines are rounded to 6 decimals in metrics.jsonl, so their bound is 1e-6 (the two roundings) plus
4e-7 x the loss (a few fp32 ulps of it: fill-mask's loss near 10, over a 30522-word vocabulary, measured 2e-6
apart).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import hfport
from hfport.errors import ConfigError
from hfport.train.config import FinetuneConfig
from hfport.train.preflight import preflight
from tests import ddp_driver

DRIVER = Path(ddp_driver.__file__)
WEIGHT_TOLERANCE = 1e-6
LOSS_ROUNDING, LOSS_RELATIVE = 1e-6, 4e-7


def _driver(root: Path, *args: str, processes: int) -> subprocess.CompletedProcess:
    """tests/ddp_driver.py `run ROOT ARGS`, as one plain process or under `accelerate launch` (gloo)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "HFPORT_CACHE_DIR": str(root / "cache"),
           "PYTHONPATH": os.pathsep.join([str(DRIVER.parents[1]), os.environ.get("PYTHONPATH", "")])}
    launch = ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes), "--num_machines",
              "1", "--mixed_precision", "no", "--dynamo_backend", "no"] if processes > 1 else []
    return subprocess.run([sys.executable, *launch, str(DRIVER), "run", str(root), *args], env=env,
                          capture_output=True, timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, minilm_path) -> Path:
    """Every case run twice: once on one process with 2B, once under a 2-process launch with B each."""
    root = tmp_path_factory.mktemp("ddp")
    ddp_driver.prepare(root, minilm_path)
    one = _driver(root, "one", processes=1)
    assert one.returncode == 0, one.stderr.decode()[-3000:]
    two = _driver(root, "two", processes=2)
    assert two.returncode == 0, two.stderr.decode()[-3000:]
    return root


EQUAL = {c["name"]: c for c in ddp_driver.CASES if c.get("equal", True)}


@pytest.mark.parametrize("name", EQUAL)
def test_two_processes_equal_one_with_the_global_batch(runs, name):
    """The same loss curve and final weights (every tensor of final/, the adapter's for LoRA)."""
    diff = ddp_driver.differences(runs, name)
    steps = EQUAL[name].get("max_steps", ddp_driver.COMMON["max_steps"])
    assert diff["steps"] == [steps, steps], diff
    for one, two in zip(*diff.pop("curves")):
        assert abs(one - two) <= LOSS_ROUNDING + LOSS_RELATIVE * abs(one), (one, two, diff)
    assert diff["weights"] <= WEIGHT_TOLERANCE, diff


def test_sentence_embedding_runs_under_ddp_into_a_complete_folder(runs):
    """Each process scores its own in-batch negatives (no gather_across_devices), so the run cannot equal one
    process; it completes (the pooler, never read by the loss, is kept out of training: DDP refused it at step 2
    before) and final/ is a complete BertModel-style folder whose pooler is the source's, unchanged."""
    diff = ddp_driver.differences(runs, "sentence-embedding")
    assert diff["steps"] == [3, 3], diff
    final = runs / "runs" / "two" / "sentence-embedding" / "final"
    saved, source = load_file(final / "model.safetensors"), load_file(runs / "bert" / "model.safetensors")
    assert saved.keys() == source.keys()
    pooler = [k for k in saved if k.startswith("pooler.")]
    assert pooler, sorted(saved)
    for key in pooler:
        assert torch.equal(saved[key], source[key]), key
    assert any(not torch.equal(saved[k], source[k]) for k in saved), "nothing trained"
    vectors = hfport.pipeline("sentence-embedding", model=final)(["a sentence", "another one"])
    assert len(vectors) == 2 and torch.isfinite(torch.as_tensor(vectors)).all()


def test_a_two_process_run_killed_and_resumed_ends_as_the_unbroken_one(runs):
    """Rank 1 SIGKILLed as step 3 begins (the step-2 checkpoint complete): the launcher ends the run. Relaunched with
    resume "latest", it ends bit-identical to the unbroken 2-process run (fill-mask, SGD with momentum): every final
    weight, and every train and eval line of metrics.jsonl."""
    killed = _driver(runs, "kill", "resume", processes=2)
    assert killed.returncode != 0, "rank 1 was not killed"
    folder = runs / "runs" / "killed" / "resume"
    assert (folder / "checkpoints" / "step-2").is_dir() and not (folder / "final").exists()
    again = _driver(runs, "resume", "resume", processes=2)
    assert again.returncode == 0, again.stderr.decode()[-3000:]
    unbroken = runs / "runs" / "two" / "resume"
    a, b = load_file(unbroken / "final" / "model.safetensors"), load_file(folder / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    def lines(run: Path) -> list[dict]:  # perf lines hold timings
        return [e for e in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if e["type"] != "perf"]

    assert lines(folder) == lines(unbroken) and len([e for e in lines(folder) if e["type"] == "train"]) == 5


def test_gather_across_devices_is_for_in_batch_negatives(runs, tmp_path):
    scored = tmp_path / "scored.jsonl"
    scored.write_text("".join(f'{{"sentence1": "a {k}", "sentence2": "b {k}", "score": {k / 4}}}\n' for k in range(4)))
    with pytest.raises(ConfigError, match="gather_across_devices .* mnrl loss, not 'cosent'"):
        preflight(FinetuneConfig(model=str(runs / "bert"), task="sentence-embedding", train=str(scored),
                                 output_dir=str(tmp_path / "out"), gather_across_devices=True))
