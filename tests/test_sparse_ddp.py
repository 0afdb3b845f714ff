"""sparse-embedding (SPLADE) under DDP: tests/ddp_driver.py's SPARSE_CASES, run once as one process with batch 2B and
once under `accelerate launch --num_processes 2` (gloo, CPU) with B each, fp32, SGD, 3 steps, as tests/test_ddp.py
runs the other tasks (its tolerances, for the same reasons: the runs differ only by the order of fp32 sums).

With gather_across_devices (triplets whose texts repeat across the processes; and pairs with GradCache's
mini_batch_size) the run equals one process with the global batch: each anchor ranked against the global
micro-batch, and the FLOPS regularizers over the global batch's queries and documents. Measured: weights <= 7e-8,
losses equal to the logged 6 decimals (1e-6 once). Regularizing each process's own share instead
(sentence-transformers' SpladeLoss under DDP), all else equal, measured 2.2e-3 and 6.7e-3 on the weights: the
cases' regularizer weights (0.05, 0.03) are raised so that this difference shows. Without gather each process ranks
and regularizes its own share; the run completes into a SparseEncoder folder and differs from one process
(measured 1.2e-2 on the weights, 0.67 on a step's loss).

CI budget: none of its own: the three cases run in conftest's ddp_runs, the one plain process and the one 2-process
launch that run test_ddp.py's cases.
"""

from __future__ import annotations


import pytest
import torch

import hfport
from hfport.formats.sentence_transformers import has_sparse_layout
from tests import ddp_driver
from tests.ddp_driver import LOSS_RELATIVE, LOSS_ROUNDING, WEIGHT_TOLERANCE

EQUAL = {c["name"]: c for c in ddp_driver.SPARSE_CASES if c.get("equal", True)}


@pytest.mark.parametrize("name", EQUAL)
def test_gathered_sparse_training_on_two_processes_equals_one_with_the_global_batch(ddp_runs, name):
    diff = ddp_driver.differences(ddp_runs, name)
    assert diff["steps"] == [3, 3], diff
    for one, two in zip(*diff.pop("curves")):
        assert abs(one - two) <= LOSS_ROUNDING + LOSS_RELATIVE * abs(one), (one, two, diff)
    assert diff["weights"] <= WEIGHT_TOLERANCE, diff


def test_sparse_training_without_gather_runs_on_its_own_negatives_into_a_sparse_encoder_folder(ddp_runs):
    """Each process ranks its anchors against its own share (3 negatives, not 7) and regularizes its own texts:
    not one process's run, by far more than the tolerance; final/ is a SparseEncoder folder whose vectors are sparse."""
    diff = ddp_driver.differences(ddp_runs, "sparse-embedding")
    assert diff["steps"] == [3, 3], diff
    assert diff["weights"] > 1e3 * WEIGHT_TOLERANCE, diff
    final = ddp_runs / "runs" / "two" / "sparse-embedding" / "final"
    assert has_sparse_layout(final) and hfport.model_task(final) == "sparse-embedding"
    vectors = hfport.pipeline("sparse-embedding", model=final)(["a sentence", "another one"])
    assert len(vectors) == 2
    for entries in vectors:
        values = torch.tensor([e["value"] for e in entries])
        assert 0 < len(entries) < 30522 // 4 and bool((values > 0).all()), len(entries)
