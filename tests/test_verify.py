"""`hfport verify DIR` on a folder that says what it is, without --source, and the export-format registry.

Each folder kind is detected by its format's record and proven against hfport's own load of what it names: a plain
HF folder (transformers vs hfport on the same folder), a LoRA adapter (peft over transformers on its base), a
sentence-transformers embedding folder (SentenceTransformer.encode vs hfport's sentence-embedding pipeline), a
reranker (CrossEncoder.predict vs hfport), an ONNX folder (onnxruntime vs its recorded source, or, with none
reachable, vs hfport's ONNX backend on the folder). A damaged folder of each kind fails, and every check that
cannot run is a FAIL row. Then the writers of the sentence-transformers formats through `--format`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import hfport
from hfport.cli import app
from hfport.export import FORMATS, ExportError, detect_format, export, read_st_pooling, verify
from hfport.formats.sentence_transformers import mark_cross_encoder, write_embedding_layout
from tests.tiny import TOKENIZER_FILES, save_hf, save_random_adapter

torch.set_num_threads(1)  # tiny models on shared cores: threads only add overhead


def with_tokenizer(folder: Path, minilm: Path) -> Path:
    for name in TOKENIZER_FILES:
        shutil.copy(minilm / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory, minilm_path) -> dict[str, Path]:
    """One tiny BERT folder of each kind (the real MiniLM tokenizer beside each)."""
    root = tmp_path_factory.mktemp("verify")
    made = {}
    made["hf"] = root / "hf"
    save_hf("bert", "sequence-classification", made["hf"], vocab_size=30522)
    with_tokenizer(made["hf"], minilm_path)
    made["sentence-transformers"] = root / "st"
    model = save_hf("bert", "base", made["sentence-transformers"], vocab_size=30522)
    write_embedding_layout(made["sentence-transformers"], pooling="mean", normalize=True,
                           hidden_size=model.config.hidden_size, max_seq_length=128)
    with_tokenizer(made["sentence-transformers"], minilm_path)
    made["cross-encoder"] = root / "reranker"
    save_hf("bert", "sequence-classification", made["cross-encoder"], vocab_size=30522, num_labels=1)
    mark_cross_encoder(with_tokenizer(made["cross-encoder"], minilm_path))
    base = root / "base"
    save_hf("bert", "base", base, vocab_size=30522)
    with_tokenizer(base, minilm_path)
    adapter = hfport.AutoModelForSequenceClassification.from_pretrained(base, id2label={0: "a", 1: "b"})
    made["peft"] = root / "adapter"
    save_random_adapter(adapter, made["peft"], base=base, seed=3, r=4, alpha=8, targets=["q", "v"])
    return made


def damaged(folder: Path, tmp_path: Path) -> Path:
    copy = tmp_path / f"damaged-{folder.name}"
    shutil.copytree(folder, copy)
    return copy


def checks(report: hfport.VerifyReport) -> set[str]:
    return {r.check for r in report.rows}


@pytest.mark.parametrize("kind", ["hf", "sentence-transformers", "cross-encoder", "peft"])
def test_each_folder_kind_verifies_without_source(kind, folders):
    folder = folders[kind]
    assert detect_format(folder) is FORMATS[kind]
    report = verify(folder)
    assert report.passed, report.table()
    assert {"config", "load", "tokenizer", "outputs"} <= checks(report)
    if kind in ("sentence-transformers", "cross-encoder"):  # sentence-transformers' own loader agrees too
        outputs = {r.output for r in report.rows if r.check == "sentence-transformers"}
        assert ("encode/values" if kind == "sentence-transformers" else "predict") in outputs, report.table()
    run = CliRunner().invoke(app, ["verify", str(folder)])
    assert run.exit_code == 0 and "PASS" in run.output, run.output


def test_damaged_hf_folder_fails(folders, tmp_path):
    folder = damaged(folders["hf"], tmp_path)
    weights = load_file(str(folder / "model.safetensors"))
    del weights["classifier.weight"]  # transformers would initialise it at random
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    report = verify(folder)
    assert not report.passed and any(r.check in ("load", "source") for r in report.failures), report.table()
    assert CliRunner().invoke(app, ["verify", str(folder)]).exit_code == 1


def test_damaged_embedding_folder_fails(folders, tmp_path):
    folder = damaged(folders["sentence-transformers"], tmp_path)
    pooling = folder / "1_Pooling" / "config.json"
    config = json.loads(pooling.read_text())
    config.update(pooling_mode_mean_tokens=False, pooling_mode_weightedmean_tokens=True)  # hfport does not compute it
    pooling.write_text(json.dumps(config))
    report = verify(folder)
    assert not report.passed and any(r.check == "sentence-transformers" for r in report.failures), report.table()


def test_damaged_reranker_fails(folders, tmp_path):
    folder = damaged(folders["cross-encoder"], tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["sentence_transformers"] = {"activation_fn": "torch.nn.modules.linear.Identity"}  # raw logits
    (folder / "config.json").write_text(json.dumps(config))
    report = verify(folder)
    failed = {r.output for r in report.failures}
    assert not report.passed and "CrossEncoder activation" in failed, report.table()


def test_merged_folder_verifies_against_its_adapter(folders, tmp_path):
    """An HF folder checked against an adapter source is proven as the merge of it (format merged)."""
    export(folders["peft"], tmp_path / "merged", merge=True)
    assert detect_format(tmp_path / "merged") is FORMATS["hf"]
    report = verify(tmp_path / "merged", folders["peft"])
    assert report.passed, report.table()
    assert any(r.check == "config" and r.detail.startswith("merged") for r in report.rows), report.table()
    assert verify(tmp_path / "merged").passed  # and, without a source, as the plain HF folder it is


def test_damaged_adapter_fails(folders, tmp_path):
    folder = damaged(folders["peft"], tmp_path)
    weights = load_file(str(folder / "adapter_model.safetensors"))
    dropped = next(k for k in weights if "lora_B" in k)
    del weights[dropped]
    save_file(weights, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    report = verify(folder)
    assert not report.passed, report.table()


def test_a_folder_no_format_knows_fails_closed(tmp_path):
    (tmp_path / "empty").mkdir()
    for folder in (tmp_path / "empty", tmp_path / "nowhere"):
        assert detect_format(folder) is None
        report = verify(folder)
        assert not report.passed and [r.check for r in report.rows] == ["format"], report.table()
    with pytest.raises(ExportError, match="format 'tarball': expected one of"):
        verify(tmp_path / "empty", format="tarball")


def test_a_fine_tune_output_folder_stands_for_its_best_or_final(folders, tmp_path):
    """`hfport verify run` right after `hfport finetune --output-dir run` proves run/best (--final: run/final), as
    export, evaluate and mine take a run folder; a run without that model is a FAIL row naming what it has."""
    run = tmp_path / "run"
    shutil.copytree(folders["hf"], run / "best")
    shutil.copytree(folders["peft"], run / "final")
    report = verify(run)
    assert report.passed and report.dir == str(run / "best"), report.table()
    assert {"config", "load", "tokenizer", "outputs"} <= checks(report)
    final = CliRunner().invoke(app, ["verify", str(run), "--final"])
    assert final.exit_code == 0 and f"{run / 'final'} matches" in final.output, final.output
    shutil.rmtree(run / "best")
    report = verify(run)
    assert not report.passed and [r.check for r in report.rows] == ["format"], report.table()
    assert "a fine-tune output folder without a best/ model" in report.rows[0].detail and "final/" in \
        report.rows[0].detail


def test_verify_options_belong_to_their_format(folders):
    with pytest.raises(ExportError, match="min_agreement: not an option of the hf verify"):
        verify(folders["hf"], min_agreement=0.9)
    run = CliRunner().invoke(app, ["verify", str(folders["hf"]), "--min-agreement", "0.9"])
    assert run.exit_code == 1 and "not an option of the hf verify" in run.output


# --- the sentence-transformers writers ------------------------------------------------------------------------------


def test_sentence_transformers_format_writes_the_layout(folders, tmp_path, minilm_path):
    """A bare encoder without modules.json gets the layout the options ask for, proven by SentenceTransformer."""
    src = tmp_path / "encoder"
    save_hf("bert", "base", src, vocab_size=30522)
    with_tokenizer(src, minilm_path)
    result = export(src, tmp_path / "st", format="sentence-transformers", pooling="cls", normalize=True, verify=True)
    assert result.report.passed and result.format == "sentence-transformers", result.report.table()
    assert detect_format(tmp_path / "st") is FORMATS["sentence-transformers"]
    assert read_st_pooling(tmp_path / "st") == ("cls", True)
    with pytest.raises(ExportError, match="holds the bare encoder"):
        export(folders["hf"], tmp_path / "x", format="sentence-transformers")
    assert not (tmp_path / "x").exists()


def test_cross_encoder_format_marks_a_one_label_classifier(folders, tmp_path, minilm_path):
    src = tmp_path / "scorer"
    save_hf("bert", "sequence-classification", src, vocab_size=30522, num_labels=1)
    with_tokenizer(src, minilm_path)
    run = CliRunner().invoke(app, ["export", str(src), "--out", str(tmp_path / "ce"), "--format", "cross-encoder",
                                   "--verify"])
    assert run.exit_code == 0, run.output
    assert "predict" in run.output and detect_format(tmp_path / "ce") is FORMATS["cross-encoder"]
    bad = CliRunner().invoke(app, ["export", str(folders["hf"]), "--out", str(tmp_path / "x"),
                                   "--format", "cross-encoder"])
    assert bad.exit_code == 1 and "one-label" in bad.output
    wrong = CliRunner().invoke(app, ["export", str(src), "--out", str(tmp_path / "x"), "--pooling", "cls"])
    assert wrong.exit_code == 1 and "--pooling: only with --format sentence-transformers" in wrong.output
    unknown = CliRunner().invoke(app, ["export", str(src), "--out", str(tmp_path / "x"), "--format", "zip"])
    assert unknown.exit_code == 1 and "expected one of" in unknown.output and "onnx-int8" in unknown.output
