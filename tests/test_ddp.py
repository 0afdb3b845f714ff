"""Every task under DDP equals one process: `accelerate launch --num_processes 2` (gloo, CPU) with batch B per process
against one process with batch 2B, fp32, SGD, no dropout, 3 steps per case (one fill-mask case with momentum and
checkpoints, 5 steps, also killed on one rank and resumed: bit-identical to the unbroken 2-process run).
Sentence-embedding equals one process only with gather_across_devices (every process's embeddings gathered, texts
repeated across processes counted once, with and without GradCache's mini_batch_size); without it, it runs and each
process scores its own negatives.

CI budget: tests/ddp_driver.py runs every case's fine-tune one after another inside ONE launch (and one plain
process): conftest's ddp_runs, shared with test_sparse_ddp.py, so the comparison costs two process start-ups and ~20
tiny runs on each side; the kill-and-resume test adds two short launches.

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
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import hfport
from hfport.errors import ConfigError
from hfport.train.config import FinetuneConfig
from hfport.train.preflight import preflight
from tests import ddp_driver
from tests.ddp_driver import LOSS_RELATIVE, LOSS_ROUNDING, WEIGHT_TOLERANCE, launch


EQUAL = {c["name"]: c for c in ddp_driver.CASES if c.get("equal", True) and not c.get("refused")}


@pytest.mark.parametrize("name", EQUAL)
def test_two_processes_equal_one_with_the_global_batch(ddp_runs, name):
    """The same loss curve and final weights (every tensor of final/, the adapter's for LoRA)."""
    diff = ddp_driver.differences(ddp_runs, name)
    steps = EQUAL[name].get("max_steps", ddp_driver.COMMON["max_steps"])
    assert diff["steps"] == [steps, steps], diff
    for one, two in zip(*diff.pop("curves")):
        assert abs(one - two) <= LOSS_ROUNDING + LOSS_RELATIVE * abs(one), (one, two, diff)
    assert diff["weights"] <= WEIGHT_TOLERANCE, diff


def test_sentence_embedding_runs_under_ddp_into_a_complete_folder(ddp_runs):
    """Each process scores its own in-batch negatives (no gather_across_devices), so the run cannot equal one
    process; it completes (the pooler, never read by the loss, is kept out of training: DDP refused it at step 2
    before) and final/ is a complete BertModel-style folder whose pooler is the source's, unchanged."""
    diff = ddp_driver.differences(ddp_runs, "sentence-embedding")
    assert diff["steps"] == [3, 3], diff
    final = ddp_runs / "runs" / "two" / "sentence-embedding" / "final"
    saved, source = load_file(final / "model.safetensors"), load_file(ddp_runs / "bert" / "model.safetensors")
    assert saved.keys() == source.keys()
    pooler = [k for k in saved if k.startswith("pooler.")]
    assert pooler, sorted(saved)
    for key in pooler:
        assert torch.equal(saved[key], source[key]), key
    assert any(not torch.equal(saved[k], source[k]) for k in saved), "nothing trained"
    vectors = hfport.pipeline("sentence-embedding", model=final)(["a sentence", "another one"])
    assert len(vectors) == 2 and torch.isfinite(torch.as_tensor(vectors)).all()


def test_a_two_process_run_killed_and_resumed_ends_as_the_unbroken_one(ddp_runs):
    """Rank 1 SIGKILLed as step 3 begins (the step-2 checkpoint complete): the launcher ends the run. Relaunched with
    resume "latest", it ends bit-identical to the unbroken 2-process run (fill-mask, SGD with momentum): every final
    weight, and every train and eval line of metrics.jsonl."""
    killed = launch(ddp_runs, "kill", "resume", processes=2)
    assert killed.returncode != 0, "rank 1 was not killed"
    folder = ddp_runs / "runs" / "killed" / "resume"
    assert (folder / "checkpoints" / "step-2").is_dir() and not (folder / "final").exists()
    state = json.loads((folder / "checkpoints" / "step-2" / "trainer_state.json").read_text())
    assert state["num_processes"] == 2  # a resume by another number of processes is refused (test_finetune.py)
    again = launch(ddp_runs, "resume", "resume", processes=2)
    assert again.returncode == 0, again.stderr.decode()[-3000:]
    unbroken = ddp_runs / "runs" / "two" / "resume"
    a, b = load_file(unbroken / "final" / "model.safetensors"), load_file(folder / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    def lines(run: Path) -> list[dict]:  # perf lines hold timings
        return [e for e in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if e["type"] != "perf"]

    assert lines(folder) == lines(unbroken) and len([e for e in lines(folder) if e["type"] == "train"]) == 5


def test_a_config_refused_under_two_processes_is_refused_by_both(ddp_runs):
    """max_length above the model's 128 positions (fit_max_length's refusal, before anything collective): each rank
    raises the same ConfigError, writes nothing, and the launch goes on to the next cases (none hangs waiting for a
    rank that left)."""
    name = "max-length-above-positions"
    runs = ddp_runs / "runs" / "two"
    messages = [(runs / f"{name}.refused.{rank}").read_text() for rank in (0, 1)]
    assert messages[0] == messages[1] and messages[0].startswith("max_length 512: the model "), messages
    assert "holds 128 positions" in messages[0] and not (runs / name).exists()
    assert all((runs / c["name"] / "final").is_dir() for c in ddp_driver.CASES if not c.get("refused"))


def test_gather_across_devices_is_for_in_batch_negatives(ddp_root, tmp_path):
    scored = tmp_path / "scored.jsonl"
    scored.write_text("".join(f'{{"sentence1": "a {k}", "sentence2": "b {k}", "score": {k / 4}}}\n' for k in range(4)))
    with pytest.raises(ConfigError, match="gather_across_devices .* mnrl loss, not 'cosent'"):
        preflight(FinetuneConfig(model=str(ddp_root / "bert"), task="sentence-embedding", train=str(scored),
                                 output_dir=str(tmp_path / "out"), gather_across_devices=True))
