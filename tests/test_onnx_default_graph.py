"""An ONNX folder serves the model it was exported as (issue 44, item 7): an onnx-int8 folder runs its int8 graph
(the manifest's default_file), `file=` / `--file` picks another of its graphs, and the sentence-embedding pipeline and
`hfport predict --task sentence-embedding` run on an ONNX folder, pooling as the source's sentence-transformers
files say (the export copies them)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer
from typer.testing import CliRunner

pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

import hfport  # noqa: E402
from hfport.cli import app  # noqa: E402
from hfport.export.onnx import export_onnx  # noqa: E402
from hfport.formats.onnx import MANIFEST, ONNX_FILE, QUANTIZED_FILE, OnnxModelError, default_file  # noqa: E402
from hfport.formats.sentence_transformers import write_embedding_layout  # noqa: E402
from tests.tiny import save_with_tokenizer  # noqa: E402

torch.set_num_threads(1)  # tiny models on shared cores

TEXTS = ["The film was wonderful.", "ok", "Paris is the capital of France and a large city full of museums."]


@pytest.fixture(scope="module")
def folders(tmp_path_factory, minilm_path) -> dict[str, Path]:
    """A tiny BERT encoder in the sentence-transformers layout (cls pooling, normalized: not the mean without
    normalizing a folder without the files gets), exported by hfport as onnx and as onnx-int8."""
    root = tmp_path_factory.mktemp("onnx-default")
    src = root / "src"
    model = save_with_tokenizer("bert", "feature-extraction", src, minilm_path, vocab_size=30522)
    write_embedding_layout(src, pooling="cls", normalize=True, hidden_size=model.config.hidden_size,
                           max_seq_length=128)
    fp32 = export_onnx(src, root / "onnx")
    int8 = export_onnx(src, root / "onnx-int8", quantize="int8")
    assert fp32.report.passed and int8.report.passed, int8.report.table()
    return {"src": src, "onnx": root / "onnx", "int8": root / "onnx-int8"}


def ort_embeddings(graph: Path, folder: Path) -> np.ndarray:
    """onnxruntime itself on GRAPH, then cls pooling and L2 normalization: what the folder's files ask for."""
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))  # the `tokenizers` library, not hfport's
    tokenizer.no_padding()  # MiniLM's file pads to 128; int8 scales activations over every row, padding included
    session = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    rows = []
    for text in TEXTS:
        enc = tokenizer.encode(text)
        feeds = {"input_ids": enc.ids, "attention_mask": enc.attention_mask, "token_type_ids": enc.type_ids}
        hidden = session.run(["last_hidden_state"], {k: np.array([feeds[k]], dtype=np.int64) for k in names})[0]
        rows.append(hidden[0, 0] / np.linalg.norm(hidden[0, 0]))  # (1, T, C) -> the first token's (C,)
    return np.stack(rows)


def test_manifest_names_the_graph_the_folder_serves(folders):
    int8, fp32 = (json.loads((folders[k] / MANIFEST).read_text()) for k in ("int8", "onnx"))
    assert (int8["format"], int8["default_file"]) == ("onnx-int8", QUANTIZED_FILE)
    assert (fp32["format"], fp32["default_file"]) == ("onnx", ONNX_FILE)
    assert (folders["int8"] / "modules.json").is_file() and (folders["int8"] / "1_Pooling" / "config.json").is_file()


def test_int8_folder_serves_int8_and_file_picks_fp32(folders):
    pipe = hfport.pipeline("sentence-embedding", model=folders["int8"])
    assert pipe.model.path == folders["int8"] / QUANTIZED_FILE
    assert pipe.model.dtype_name == "int8"  # what TEI's /info reports (the graph's inputs and outputs are float32)
    # one text a call: dynamic quantization scales activations per batch, so batch-mates would change the values
    got = np.array([pipe(text) for text in TEXTS])
    np.testing.assert_allclose(got, ort_embeddings(folders["int8"] / QUANTIZED_FILE, folders["int8"]), atol=1e-6)
    want_fp32 = ort_embeddings(folders["int8"] / ONNX_FILE, folders["int8"])
    assert np.abs(got - want_fp32).max() > 1e-3  # int8 is not the fp32 graph (measured 3.7e-3)
    fp32 = hfport.pipeline("sentence-embedding", model=folders["int8"], file=ONNX_FILE)
    assert fp32.model.path == folders["int8"] / ONNX_FILE and fp32.model.dtype_name == "float32"
    np.testing.assert_allclose(np.array(fp32(TEXTS)), want_fp32, atol=1e-5)
    # the fp32 graph pools and normalizes as the PyTorch source does (its sentence-transformers files came along);
    # 1e-4: the ONNX graph's fp32 tolerance against hfport everywhere (tests/test_onnx.py)
    torch_pipe = hfport.pipeline("sentence-embedding", model=folders["src"])
    np.testing.assert_allclose(np.array(fp32(TEXTS)), np.array(torch_pipe(TEXTS)), atol=1e-4)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    # an fp32 export serves its one graph; another pipeline over the same graph
    assert hfport.pipeline("feature-extraction", model=folders["onnx"]).model.path.name == ONNX_FILE


def test_cli_predict_sentence_embedding_on_onnx_folders(folders):
    pipe = {k: hfport.pipeline("sentence-embedding", model=folders["int8"], **kw)
            for k, kw in (("int8", {}), ("fp32", {"file": ONNX_FILE}))}
    for key, extra in (("int8", []), ("fp32", ["--file", ONNX_FILE])):
        run = CliRunner().invoke(app, ["predict", str(folders["int8"]), "--task", "sentence-embedding", *TEXTS, *extra])
        assert run.exit_code == 0, run.output
        lines = [json.loads(line) for line in run.stdout.splitlines()]
        np.testing.assert_allclose(np.array(lines), np.array(pipe[key](TEXTS)), atol=1e-6)
    bad = CliRunner().invoke(app, ["predict", str(folders["int8"]), "--task", "sentence-embedding", "x", "--file",
                                   "../model.onnx"])
    assert bad.exit_code == 1 and "'../model.onnx' must name a .onnx file in the folder" in bad.output


def test_file_is_checked(folders):
    with pytest.raises(OnnxModelError, match="must name a .onnx file in the folder"):
        hfport.pipeline("sentence-embedding", model=folders["int8"], file="config.json")
    with pytest.raises(OnnxModelError, match="no such ONNX file"):
        hfport.pipeline("sentence-embedding", model=folders["onnx"], file=QUANTIZED_FILE)
    with pytest.raises(OnnxModelError, match="is a graph already"):
        hfport.pipeline("sentence-embedding", model=folders["int8"] / ONNX_FILE, file=QUANTIZED_FILE)
    with pytest.raises(ValueError, match="picks a graph of an ONNX folder"):
        hfport.pipeline("sentence-embedding", model=folders["src"], file=ONNX_FILE)


def test_default_file_of_older_and_foreign_folders(folders, tmp_path):
    """A manifest written before default_file: the int8 graph when it records a quantization; no manifest (optimum's
    export): model.onnx; a default_file outside the folder is refused."""
    folder = tmp_path / "copy"
    shutil.copytree(folders["int8"], folder)
    manifest = json.loads((folder / MANIFEST).read_text())
    for key in ("default_file", "format"):
        manifest.pop(key)
    (folder / MANIFEST).write_text(json.dumps(manifest))
    assert default_file(folder) == QUANTIZED_FILE
    (folder / MANIFEST).write_text(json.dumps({**manifest, "quantization": None}))
    assert default_file(folder) == ONNX_FILE
    (folder / MANIFEST).write_text(json.dumps({**manifest, "default_file": "/etc/passwd.onnx"}))
    with pytest.raises(OnnxModelError, match=r"hfport_onnx.json: default_file '/etc/passwd.onnx' must name"):
        hfport.pipeline("sentence-embedding", model=folder)
    (folder / MANIFEST).unlink()
    assert default_file(folder) == ONNX_FILE
    assert hfport.pipeline("sentence-embedding", model=folder).model.path.name == ONNX_FILE


def test_add_adapter_on_an_onnx_pipeline_is_refused_by_name(folders):
    """The server's model cache adds a registered adapter to its base's pipeline (Pipeline.add_adapter): over an ONNX
    base that must be the same clear refusal `pipeline(..., adapters=)` gives, not an AttributeError from inside."""
    pipe = hfport.pipeline("sentence-embedding", model=str(folders["onnx"]))
    with pytest.raises(ValueError, match="adapter 'a'.*fixed graph.*torch backend"):
        pipe.add_adapter("a", folders["src"])
