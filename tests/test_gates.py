"""Gates that refuse: the int8 gate judges each head by what it means, on texts apart from the calibration ones.

Damaged int8 graphs of each head kind (classification, a one-label head as regression and as reranker,
token classification, QA, embeddings under CLS pooling), each with its recorded sha256 rewritten so that only the
gate stands between it and a PASS: each must FAIL with a row that says why. Then the statistics themselves (the
one-label gate's Spearman with its near-tie rule and relative error), `--gate-data` files, checks that cannot run,
and probes that feed a model only the inputs it takes (RoBERTa with one token type and a WordPiece tokenizer).
"""

from __future__ import annotations

import builtins
import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from onnx import helper, numpy_helper  # noqa: E402

import hfport  # noqa: E402
from hfport.cli import app  # noqa: E402
from hfport.export import ExportError, export  # noqa: E402
from hfport.export.onnx import MANIFEST, export_onnx, verify_onnx  # noqa: E402
from hfport.export.onnx_agreement import GATES, MAX_SCORE_ERROR, GateContext, measure, passes  # noqa: E402
from hfport.export.graph_verify import sha256  # noqa: E402
from hfport.export.probes import (CALIBRATION_PAIRS, CALIBRATION_TEXTS, MIN_JUDGED, judged_pairs,  # noqa: E402
                                  judged_texts, read_gate_data)
from hfport.pipelines.onnx_backend import ONNX_FILE, QUANTIZED_FILE  # noqa: E402
from tests.tiny import decisive_qa, save_hf  # noqa: E402
from tests.tiny_tokenizers import add_tokenizer, vocab  # noqa: E402

torch.set_num_threads(1)

# head -> (tests.tiny task, config overrides)
HEADS = {
    "classification": ("text-classification", {}),
    "one-label": ("text-classification", {"num_labels": 1}),
    "token-classification": ("token-classification", {}),
    "question-answering": ("question-answering", {}),
    "embeddings": ("feature-extraction", {}),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gates")


def identity_int8(out: Path) -> None:
    """model_quantized.onnx := model.onnx, recorded in the manifest: an int8 graph that agrees with fp32 exactly.
    The one-label head's base: a tiny random model's single score hardly varies between texts (its spread is
    ~0.3% of its size), so real int8 rounding scrambles its ranking and the gate rightly refuses that export; a
    damaged graph must fail against a graph that passes."""
    shutil.copyfile(out / ONNX_FILE, out / QUANTIZED_FILE)
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["sha256"][QUANTIZED_FILE] = sha256(out / QUANTIZED_FILE)
    (out / MANIFEST).write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def exported(root, minilm_path):
    """head -> (source, verified ONNX int8 folder), built once. Embeddings: a sentence-transformers folder with CLS
    pooling, which the gate must pool as. The one-label head: fp32 exported, int8 as identity_int8 says."""
    made: dict[str, tuple[Path, Path]] = {}

    def get(head: str) -> tuple[Path, Path]:
        if head not in made:
            task, overrides = HEADS[head]
            src = root / "src" / head
            model = save_hf("bert", task, src, vocab_size=vocab("bert"), **overrides)
            if head == "question-answering":
                decisive_qa(model, src)
            add_tokenizer("bert", src, minilm_path, root / "tokenizers")
            if head == "embeddings":
                st = root / "src" / "embeddings-st"
                export(src, st, format="sentence-transformers", pooling="cls")
                src = st
            out = root / "onnx" / head
            report = export_onnx(src, out, quantize=None if head == "one-label" else "int8").report
            assert report.passed, report.table()
            if head == "one-label":
                identity_int8(out)
            made[head] = (src, out)
        return made[head]

    return get


def rewire(path: Path, output: str, nodes) -> None:
    """Damage a graph: OUTPUT is computed by NODES (a function (raw name, output name) -> (nodes, initializers))
    from what the graph computed for it."""
    model = onnx.load(str(path))
    raw = f"{output}_undamaged"
    for node in model.graph.node:
        node.output[:] = [raw if o == output else o for o in node.output]
    new_nodes, inits = nodes(raw, output)
    model.graph.node.extend(new_nodes)
    model.graph.initializer.extend(inits)
    onnx.save(model, str(path))


def const(name: str, values, dtype=None):
    return numpy_helper.from_array(torch.tensor(values, dtype=dtype).numpy(), name)


def affine(raw, out):  # 0.2 x + 3: the same order, other values
    return ([helper.make_node("Mul", [raw, "k_scale"], ["k_scaled"]),
             helper.make_node("Add", ["k_scaled", "k_shift"], [out])],
            [const("k_scale", 0.2), const("k_shift", 3.0)])


def reverse_rows(raw, out):  # the batch's scores in reverse order: the same values, another ranking
    return ([helper.make_node("Slice", [raw, "k_starts", "k_ends", "k_axes", "k_steps"], [out])],
            [const("k_starts", [-1], torch.int64), const("k_ends", [-(2 ** 62)], torch.int64),
             const("k_axes", [0], torch.int64), const("k_steps", [-1], torch.int64)])


def rotate_labels(axis: int, n: int):
    def nodes(raw, out):  # label i's logit moves to label i+1 (of N): every decided label changes
        return ([helper.make_node("Gather", [raw, "k_rotation"], [out], axis=axis)],
                [const("k_rotation", [(i - 1) % n for i in range(n)], torch.int64)])
    return nodes


def negate(raw, out):  # start logits negated: the argmax start becomes the least likely one
    return [helper.make_node("Neg", [raw], [out])], []


def negate_first_token(raw, out):  # the CLS state negated, every other token untouched
    return ([helper.make_node("Slice", [raw, "k_zero", "k_one", "k_axis"], ["k_first"]),
             helper.make_node("Slice", [raw, "k_one", "k_end", "k_axis"], ["k_rest"]),
             helper.make_node("Neg", ["k_first"], ["k_first_neg"]),
             helper.make_node("Concat", ["k_first_neg", "k_rest"], [out], axis=1)],
            [const("k_zero", [0], torch.int64), const("k_one", [1], torch.int64),
             const("k_end", [2 ** 62], torch.int64), const("k_axis", [1], torch.int64)])


# case -> (head, graph output, damage, what the failing row's detail must say)
DAMAGE = {
    "classification": ("classification", "logits", rotate_labels(1, 2), "label agreement"),
    "regression 0.2x+3": ("one-label", "logits", affine, "relative error"),
    "reranker reordered": ("one-label", "logits", reverse_rows, "Spearman"),
    "token-classification": ("token-classification", "logits", rotate_labels(2, 3), "tag agreement"),
    "question-answering": ("question-answering", "start_logits", negate, "span agreement"),
    "embeddings (cls pooling)": ("embeddings", "last_hidden_state", negate_first_token, "cls pooling"),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_int8_graph_fails_the_gate(case, exported, tmp_path):
    head, output, damage, says = DAMAGE[case]
    src, out = exported(head)
    folder = tmp_path / "copy"
    shutil.copytree(out, folder)
    rewire(folder / QUANTIZED_FILE, output, damage)
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["sha256"][QUANTIZED_FILE] = sha256(folder / QUANTIZED_FILE)  # only the gate may catch it
    (folder / MANIFEST).write_text(json.dumps(manifest))
    report = verify_onnx(folder, src)
    assert not report.passed
    assert {r.check for r in report.failures} == {"int8 vs fp32"}, report.table()
    assert all(says in r.detail and "changes the model's answers" in r.detail for r in report.failures), \
        report.table()


def test_clean_exports_pass_on_the_judged_texts(exported):
    """Each head's int8 graph (the one-label head's: identity_int8) passes, judged on >= 64 texts and pairs, not the
    calibration texts."""
    for head in HEADS:
        src, out = exported(head)
        report = verify_onnx(out, src)
        assert report.passed, report.table()
        gate = [r for r in report.rows if r.check == "int8 vs fp32"]
        assert gate and all("built-in judged" in r.detail for r in gate)
        for r in gate:  # "N items (M fp32 near ties)": agreement leaves ties out of N, Spearman keeps them in
            counts = [int(x) for x in re.findall(r"\d+", r.shape)]
            judged = counts[0] if "Spearman" in r.output else sum(counts)
            assert judged >= MIN_JUDGED, r.shape
        if head == "one-label":
            assert all(r.output.split("/")[1].startswith("Spearman") for r in gate)
        if head == "embeddings":
            assert all("cls pooling" in r.detail for r in gate)


def test_judged_texts_are_not_the_calibration_texts():
    texts, pairs = judged_texts(), judged_pairs()
    assert len(set(texts)) == len(texts) >= MIN_JUDGED and len(set(pairs)) == len(pairs) >= MIN_JUDGED
    assert not set(texts) & set(CALIBRATION_TEXTS) and not set(pairs) & set(CALIBRATION_PAIRS)
    assert texts == judged_texts()  # deterministic


# --- the one-label statistic ------------------------------------------------------------------------------


def scores(a: torch.Tensor, b: torch.Tensor):
    cfg = SimpleNamespace(num_labels=1, problem_type="regression")
    gate = GATES["scores"]
    verdict = measure(gate, [({"logits": a[:, None]}, {"logits": b[:, None]}, {})], GateContext(cfg))
    return verdict, passes(gate, verdict, 0.99, 0.99)[0]


def test_scores_gate_rank_error_and_near_ties():
    b = torch.linspace(-4.0, 4.0, 64)
    noise = 0.02 * torch.sin(torch.arange(64.0))  # an int8-sized error (~1% of the scores)
    verdict, ok = scores(b + noise, b)
    assert ok and verdict.value > 0.99 and verdict.error < 0.02
    verdict, ok = scores(0.2 * b + 3, b)  # the same order: Spearman 1, but the values are wrong
    assert verdict.value == pytest.approx(1.0) and verdict.error > MAX_SCORE_ERROR and not ok
    verdict, ok = scores(b.flip(0), b)  # the same values in another order
    assert verdict.value < 0 and not ok
    # near ties: the fp32 scores come in close pairs (gap 1e-3 of a spread of ~4.6); int8 swaps every pair.
    # Counted, Spearman would stay high here, so swap far apart too and check only the ties are forgiven
    base = torch.arange(32.0).repeat_interleave(2) * 0.15
    tied = base + torch.tensor([0.0, 1e-3] * 32)
    swapped = tied.view(32, 2).flip(1).reshape(-1)
    verdict, ok = scores(swapped, tied)
    assert verdict.value == pytest.approx(1.0) and verdict.ties == 64 and ok
    far = tied.clone()
    far[[0, -1]] = far[[-1, 0]]  # the lowest and highest exchanged: not a near tie
    verdict, ok = scores(far, tied)
    assert verdict.value < 0.99 and not ok


# --- --gate-data ------------------------------------------------------------------------------------------


def test_gate_data_files(tmp_path):
    plain = tmp_path / "texts.txt"
    plain.write_text("\n".join(f"text number {i}" for i in range(70)) + "\n\n")
    data = read_gate_data(plain)
    assert len(data.texts) == 70 and not data.pairs and data.origin == str(plain)
    jsonl = tmp_path / "pairs.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": f"q{i}", "text_pair": f"passage {i}"}) for i in range(64)))
    assert len(read_gate_data(jsonl).pairs) == 64
    marked = tmp_path / "marked.jsonl"  # a Windows editor's UTF-8 with a byte-order mark: still JSONL, not 64 texts
    marked.write_bytes(b"\xef\xbb\xbf" + jsonl.read_bytes())
    assert read_gate_data(marked).pairs == read_gate_data(jsonl).pairs and not read_gate_data(marked).texts
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "a"}) + "\n" + "{not json\n")
    with pytest.raises(ExportError, match=rf"{bad}, line 2: not JSON"):
        read_gate_data(bad)
    bad.write_text(json.dumps({"text": "a"}) + "\n" + json.dumps({"label": 1}) + "\n")
    with pytest.raises(ExportError, match=rf"{bad}, line 2: expected an object with a non-empty string 'text'"):
        read_gate_data(bad)
    bad.write_text(json.dumps({"text": "a", "text_pair": 3}) + "\n")
    with pytest.raises(ExportError, match=rf"{bad}, line 1: 'text_pair' must be a non-empty string"):
        read_gate_data(bad)
    few = tmp_path / "few.txt"
    few.write_text("one\ntwo\n")
    with pytest.raises(ExportError, match="2 texts; the gate judges at least 64"):
        read_gate_data(few)
    with pytest.raises(ExportError, match="cannot read it"):
        read_gate_data(tmp_path / "missing.txt")


def test_cli_gate_data_on_export_and_verify(exported, tmp_path):
    src, out = exported("one-label")
    data = tmp_path / "mine.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"query {i}?", "text_pair": t})
                              for i, t in enumerate(judged_texts(80))))
    run = CliRunner().invoke(app, ["verify", str(out), "--gate-data", str(data)])
    assert run.exit_code == 0, run.output
    report = verify_onnx(out, gate_data=data)
    gate = [r for r in report.rows if r.check == "int8 vs fp32"]
    assert len(gate) == 1 and gate[0].output.startswith("pairs/")  # the file has pairs only
    assert gate[0].shape.startswith("80 items") and str(data) in gate[0].detail
    src, _ = exported("classification")
    texts = tmp_path / "mine.txt"
    texts.write_text("\n".join(judged_texts(70)))
    written = tmp_path / "out"
    run = CliRunner().invoke(app, ["export", str(src), "--out", str(written), "--format", "onnx-int8",
                                   "--gate-data", str(texts), "--verify"])
    assert run.exit_code == 0, run.output
    assert "70 items" in run.output and written.is_dir()
    few = tmp_path / "few.txt"
    few.write_text("a\nb\n")
    run = CliRunner().invoke(app, ["export", str(src), "--out", str(tmp_path / "no"), "--format", "onnx-int8",
                                   "--gate-data", str(few)])
    assert run.exit_code != 0 and "the gate judges at least 64" in run.output and not (tmp_path / "no").exists()
    run = CliRunner().invoke(app, ["export", str(src), "--out", str(tmp_path / "no"), "--gate-data", str(data)])
    assert run.exit_code != 0 and "--gate-data: only with --format" in run.output


# --- checks that cannot run -------------------------------------------------------------------------------


def test_missing_manifest_fails(exported, tmp_path):
    _, out = exported("classification")
    folder = tmp_path / "copy"
    shutil.copytree(out, folder)
    (folder / MANIFEST).unlink()
    report = verify_onnx(folder)
    assert not report.passed
    assert any(r.check == "files" and r.output == MANIFEST and "missing" in r.detail for r in report.failures)


def test_transformers_missing_is_a_failing_row(exported, monkeypatch):
    src, out = exported("classification")
    real = builtins.__import__

    def no_transformers(name, *args, **kwargs):
        if name == "transformers":
            raise ImportError("No module named 'transformers'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_transformers)
    report = verify_onnx(out, src)
    assert not report.passed
    failed = [r for r in report.failures if r.check == "fp32 vs transformers"]
    assert failed and "pip install transformers" in failed[0].detail
    assert all(r.passed for r in report.rows if r.check != "fp32 vs transformers")


# --- probes feed only what a model takes ------------------------------------------------------------------


def test_roberta_token_classifier_with_wordpiece_tokenizer(root, minilm_path):
    """type_vocab_size 1: the graph has no token_type_ids input (optimum's RoBERTa layout), and a WordPiece
    tokenizer's segment-1 token types are never fed, so the model passes its own verify (folder and ONNX)."""
    src = root / "src" / "roberta-wordpiece"
    save_hf("roberta", "token-classification", src, vocab_size=vocab("bert"))
    add_tokenizer("bert", src, minilm_path, root / "tokenizers")
    assert "token_type_ids" in hfport.AutoTokenizer.from_pretrained(src).model_input_names
    report = hfport.verify(src)
    assert report.passed, report.table()
    out = root / "onnx" / "roberta-wordpiece"
    result = export_onnx(src, out, quantize="int8")
    assert result.report.passed, result.report.table()
    for name in (ONNX_FILE, QUANTIZED_FILE):
        assert [i.name for i in onnx.load(str(out / name)).graph.input] == ["input_ids", "attention_mask"]
    assert any(r.output.startswith("pairs/") for r in result.report.rows if r.check == "int8 vs fp32")
    pipe = hfport.pipeline("token-classification", model=out)
    assert len(pipe(["Paris is in France."])) == 1


def test_http_export_job_gate_data_is_confined(exported, root, tmp_path):
    """The export job body's gate_data is a server-side path: confined to the allowed dirs like every other, and
    never taken from `options` (which no server check would confine)."""
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.settings import Settings

    src, _ = exported("classification")
    data_dir = tmp_path / "d"
    data_dir.mkdir()
    (data_dir / "texts.txt").write_text("\n".join(judged_texts(64)))
    outside = tmp_path / "outside.txt"
    outside.write_text("\n".join(judged_texts(64)))
    app = create_app(Settings(data_dir=data_dir, allowed_dirs=[root]), run_worker=False)
    with TestClient(app) as c:
        body = {"model": str(src), "format": "onnx-int8"}
        r = c.post("/jobs/export", json=body | {"gate_data": "texts.txt"})  # relative: from the data dir
        assert r.status_code == 202, r.text
        assert r.json()["config"]["options"]["gate_data"] == str((data_dir / "texts.txt").resolve())
        r = c.post("/jobs/export", json=body | {"gate_data": str(outside)})
        assert r.status_code == 403 and "gate_data" in r.text
        r = c.post("/jobs/export", json=body | {"options": {"gate_data": str(outside)}})
        assert r.status_code == 422 and "gate_data" in r.text
        r = c.post("/jobs/export", json=body | {"format": "hf", "gate_data": "texts.txt"})
        assert r.status_code == 422 and "only with format" in r.text


def test_one_token_type_graph_inputs_and_the_older_layout():
    """type_vocab_size 1: no token_type_ids input; a graph exported before (RoBERTa's one token type fed as zeros)
    still loads; more than one: token types are an input."""
    from hfport.pipelines.onnx_backend import check_signature, graph_inputs

    def session(inputs):
        def io(names, rank):
            return [SimpleNamespace(name=n, shape=["batch_size", "sequence_length"][:rank] + [None] * (rank - 2))
                    for n in names]
        return SimpleNamespace(get_inputs=lambda: io(inputs, 2), get_outputs=lambda: io(["last_hidden_state"], 3))

    one = SimpleNamespace(type_vocab_size=1, hidden_size=32)
    assert graph_inputs(one) == ["input_ids", "attention_mask"]
    check_signature(session(["input_ids", "attention_mask"]), one, "feature-extraction", Path("model.onnx"))
    check_signature(session(["input_ids", "attention_mask", "token_type_ids"]), one, "feature-extraction",
                    Path("model.onnx"))
    two = SimpleNamespace(type_vocab_size=2, hidden_size=32)
    assert graph_inputs(two) == ["input_ids", "attention_mask", "token_type_ids"]
    with pytest.raises(hfport.errors.HfportError, match="do not match config.json"):
        check_signature(session(["input_ids", "attention_mask"]), two, "feature-extraction", Path("model.onnx"))
