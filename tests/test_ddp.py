"""Every task under DDP equals one process: `accelerate launch --num_processes 2` (gloo, CPU) with batch B per process
against one process with batch 2B, fp32, SGD, no dropout, 3 steps per case. Sentence-embedding equals one process
only with gather_across_devices (every process's embeddings gathered, texts repeated across processes counted
once, with and without GradCache's mini_batch_size); without it, it runs and each process scores its own negatives.

CI budget: tests/ddp_driver.py runs every case's fine-tune one after another inside ONE launch (and one plain
process), so the whole file costs two process start-ups and ~13 tiny runs on each side.

Tolerances. The two runs compute the same sums in a different order (two half-batch sums, their all-reduce, and
the all-reduced count that normalises them, against one sum): fp32 rounding, ~1e-7 relative. With SGD at lr 0.1 a
gradient's rounding moves a weight by ~lr * 1e-7 * |grad|, measured at <= 2e-8 over every case; the bound 1e-6 leaves
room for another BLAS's summation order and is still far below what a mean over the wrong units gives (measured
before the losses were normalised over the global batch: token-classification 7e-4, class-weighted tokens 1.6e-3,
fill-mask 1.5e-3, text-ranking (bce over uneven groups) 9e-4, class-weighted text-classification 1.3e-2;
sentence-embedding's gathered negatives measure <= 1.2e-7, the scale-20 cosine softmax amplifying rounding most,
and 2.5e-3 when the texts repeated across processes are not merged into one candidate). The loss
lines are rounded to 6 decimals in metrics.jsonl, so their bound is 1e-6 (the two roundings) plus 4e-7 x the loss (a
few fp32 ulps of it: fill-mask's loss near 10, over a 30522-word vocabulary, measured 2e-6 apart).
"""

from __future__ import annotations

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


@pytest.fixture(scope="module")
def runs(tmp_path_factory, minilm_path) -> Path:
    """Every case run twice: once on one process with 2B, once under a 2-process launch with B each."""
    root = tmp_path_factory.mktemp("ddp")
    ddp_driver.prepare(root, minilm_path)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(DRIVER.parents[1]), os.environ.get("PYTHONPATH", "")])}
    one = subprocess.run([sys.executable, str(DRIVER), "run", str(root), "one"], env=env, capture_output=True,
                         timeout=300)
    assert one.returncode == 0, one.stderr.decode()[-3000:]
    two = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                          "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                          str(DRIVER), "run", str(root), "two"], env=env, capture_output=True, timeout=300)
    assert two.returncode == 0, two.stderr.decode()[-3000:]
    return root


EQUAL = [c["name"] for c in ddp_driver.CASES if c.get("equal", True)]


@pytest.mark.parametrize("name", EQUAL)
def test_two_processes_equal_one_with_the_global_batch(runs, name):
    """The same loss curve and final weights (every tensor of final/, the adapter's for LoRA)."""
    diff = ddp_driver.differences(runs, name)
    assert diff["steps"] == [3, 3], diff
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


def test_gather_across_devices_is_for_in_batch_negatives(runs, tmp_path):
    scored = tmp_path / "scored.jsonl"
    scored.write_text("".join(f'{{"sentence1": "a {k}", "sentence2": "b {k}", "score": {k / 4}}}\n' for k in range(4)))
    with pytest.raises(ConfigError, match="gather_across_devices .* mnrl loss, not 'cosent'"):
        preflight(FinetuneConfig(model=str(runs / "bert"), task="sentence-embedding", train=str(scored),
                                 output_dir=str(tmp_path / "out"), gather_across_devices=True))
