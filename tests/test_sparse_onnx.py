"""sparse-embedding on an ONNX folder: `hfport export --format onnx` of a SPLADE model (a masked-LM folder in the
SparseEncoder layout) writes a graph that returns the MLM logits and copies the SparseEncoder files, and
`pipeline("sparse-embedding", ONNX_DIR)` / `hfport predict ONNX_DIR --task sparse-embedding` pool the graph's logits
as the folder says, giving the PyTorch source's sparse vectors (the pipeline used to reach into the PyTorch model's
body and head, which an OnnxModel does not have)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

import hfport  # noqa: E402
from hfport.cli import app  # noqa: E402
from hfport.export.onnx import export_onnx  # noqa: E402
from hfport.formats.onnx import ONNX_FILE  # noqa: E402
from hfport.formats.sentence_transformers import write_sparse_layout  # noqa: E402
from hfport.pipelines.onnx_backend import OnnxModel  # noqa: E402
from hfport.tasks.sparse_embedding import logits_vectors  # noqa: E402
from tests.tiny import SPARSE_TEXTS as TEXTS  # noqa: E402
from tests.tiny import mlm_folder  # noqa: E402

torch.set_num_threads(1)  # tiny models on shared cores

# The ONNX graph is a separate fp32 computation (a traced padded path on onnxruntime's kernels) against hfport's
# padding-free path with its blockwise pooled decoder: 1e-4 is the ONNX export's fp32 tolerance against hfport
# everywhere (hfport verify, tests/test_onnx.py). A SPLADE weight is log1p(relu(max logit)), whose slope is at most 1,
# so the logits' tolerance bounds the weights' (measured: <= 2e-7).
ATOL = 1e-4


@pytest.fixture(scope="module")
def folders(tmp_path_factory, minilm_path) -> dict[str, Path]:
    """The tiny BERT masked-LM of tests/test_sparse.py (sparse vectors: a few hundred nonzeros) in the SparseEncoder
    layout hfport writes (max, relu), and its ONNX export."""
    root = tmp_path_factory.mktemp("sparse-onnx")
    src = mlm_folder(root / "src", minilm_path)
    write_sparse_layout(src, max_seq_length=128)
    result = export_onnx(src, root / "onnx")
    assert result.report.passed, result.report.table()
    return {"src": src, "onnx": root / "onnx"}


def assert_same_sparse(onnx: list[list[dict]], torch_: list[list[dict]]) -> None:
    assert len(onnx) == len(torch_)
    for got, want in zip(onnx, torch_):
        assert [e["index"] for e in got] == [e["index"] for e in want], "the same support, in index order"
        torch.testing.assert_close(torch.tensor([e["value"] for e in got]),
                                   torch.tensor([e["value"] for e in want]), atol=ATOL, rtol=0)
    sizes = [len(r) for r in torch_]
    # the support comparison means something: every vector has nonzeros and none is close to dense
    assert 0 < min(sizes) and max(sizes) < 30522 // 4, sizes


def test_onnx_folder_gives_the_sources_sparse_vectors(folders):
    assert hfport.model_task(folders["onnx"]) == "sparse-embedding"  # its SparseEncoder files came along
    onnx_pipe = hfport.pipeline("sparse-embedding", model=folders["onnx"])
    assert isinstance(onnx_pipe.model, OnnxModel) and onnx_pipe.model.path.name == ONNX_FILE
    torch_pipe = hfport.pipeline("sparse-embedding", model=folders["src"])
    # a padded batch (the long row is ~110 tokens, the shortest 3), and each text alone
    assert_same_sparse(onnx_pipe(TEXTS), torch_pipe(TEXTS))
    assert_same_sparse([onnx_pipe(t) for t in TEXTS], torch_pipe(TEXTS))
    top = onnx_pipe(TEXTS, max_active_dims=7)
    assert all(len(r) == 7 for r in top)
    assert_same_sparse(top, torch_pipe(TEXTS, max_active_dims=7))


@pytest.mark.parametrize("strategy,activation", [("sum", "relu"), ("max", "log1p_relu"), ("sum", "log1p_relu")])
def test_onnx_folder_pools_as_its_splade_config_says(folders, tmp_path, strategy, activation):
    """The pooling is the folder's (1_SpladePooling/config.json, copied by the export), not the graph's."""
    copies = {}
    for key in ("src", "onnx"):
        copies[key] = tmp_path / key
        shutil.copytree(folders[key], copies[key])
        (copies[key] / "1_SpladePooling" / "config.json").write_text(json.dumps(
            {"pooling_strategy": strategy, "activation_function": activation, "embedding_dimension": None}))
    onnx_pipe = hfport.pipeline("sparse-embedding", model=copies["onnx"])
    assert (onnx_pipe.sentence.pooling_strategy, onnx_pipe.sentence.activation) == (strategy, activation)
    torch_pipe = hfport.pipeline("sparse-embedding", model=copies["src"])
    assert_same_sparse(onnx_pipe(TEXTS), torch_pipe(TEXTS))


@pytest.mark.parametrize("strategy", ["max", "sum"])
def test_logits_are_pooled_a_bounded_group_of_rows_at_a_time(folders, strategy):
    """One call's logits stay under the budget (at least a row a call), and the vectors do not depend on the grouping
    (padding is masked, whatever the graph put there)."""
    model = OnnxModel.from_pretrained(folders["onnx"])
    pipe = hfport.pipeline("sparse-embedding", model=folders["src"])
    enc = pipe.tokenizer(TEXTS, padding=True, return_tensors="pt")
    args = (model, enc["input_ids"], enc["attention_mask"], enc["token_type_ids"], strategy)
    ids = enc["input_ids"]
    whole = logits_vectors(*args, budget=ids.numel() * model.config.vocab_size)  # (B, V), one call
    calls = []

    class Counting:  # the graph, recording each call's rows
        config = model.config

        def __call__(self, input_ids, **kwargs):
            calls.append(input_ids.shape[0])
            return model(input_ids, **kwargs)

    one_row = logits_vectors(Counting(), *args[1:], budget=1)  # (B, V)
    assert calls == [1] * len(TEXTS)
    calls.clear()
    two_rows = logits_vectors(Counting(), *args[1:], budget=2 * ids.shape[1] * model.config.vocab_size)  # (B, V)
    assert calls == [2, 2, 1]
    torch.testing.assert_close(two_rows, whole, atol=1e-6, rtol=0)
    torch.testing.assert_close(one_row, whole, atol=1e-6, rtol=0)  # the same padded rows, in other groups


def test_cli_predict_sparse_embedding_on_an_onnx_folder(folders):
    want = hfport.pipeline("sparse-embedding", model=folders["src"])(TEXTS)
    run = CliRunner().invoke(app, ["predict", str(folders["onnx"]), "--task", "sparse-embedding", *TEXTS])
    assert run.exit_code == 0, run.output
    assert_same_sparse([json.loads(line) for line in run.stdout.splitlines()], want)
