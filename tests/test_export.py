"""Export to an HF folder and verify it against transformers.

Round trips: every family fine-tuned for a few steps on sequence classification, every head of BERT fine-tuned,
every head of every family from a tiny transformers checkpoint (and DeBERTa-v2 when registered) -> export ->
verify passes. Then what must fail: a tampered export (a nudged tensor, a renamed key, a changed label map) fails
verify with the failing check named; the looser bf16 tolerance is needed and sufficient; bad SRC/DIR and a full
disk leave no DIR behind.
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import hfport
from hfport import hub
from hfport.cli import app
from hfport.export import TOLERANCES, ExportError, VerifyFailed, export, verify
from tests.data import mlm_lines, ner_rows, qa_rows, write_jsonl, write_sentiment
from tests.tiny import HEADS, TOKENIZER_FILES, save_hf
from tests.tiny_tokenizers import add_tokenizer, vocab

torch.set_num_threads(1)  # tiny models on shared cores: threads only add overhead

FAMILIES = ("bert", "roberta", "xlm-roberta", "distilbert", "albert")
TASKS = tuple(HEADS)
MEASURED: dict[tuple[str, str], float] = {}  # (family, task) -> max abs output diff, printed by the last test


def record(report: hfport.VerifyReport, family: str, task: str) -> None:
    diffs = [r.max_abs_diff for r in report.rows if r.check == "outputs"]
    assert diffs, report.table()
    MEASURED[(family, task)] = max(diffs)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("export")


@pytest.fixture(scope="module")
def base_models(root, minilm_path):
    """family -> a tiny random base model folder with the family's tokenizer beside it (built on first use)."""
    cache: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in cache:
            folder = root / "base" / family
            save_hf(family, "base", folder, vocab_size=vocab(family))
            add_tokenizer(family, folder, minilm_path, root / "tokenizers")
            cache[family] = folder
        return cache[family]
    return get


def write_task_data(task: str, folder: Path) -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    if task == "sequence-classification":
        write_sentiment(folder / "train.jsonl", 16, seed=0)
        write_sentiment(folder / "eval.jsonl", 8, seed=1)
        return folder / "train.jsonl", folder / "eval.jsonl"
    if task == "token-classification":
        return write_jsonl(folder / "train.jsonl", ner_rows(16, 0)), write_jsonl(folder / "eval.jsonl", ner_rows(8, 1))
    if task == "question-answering":
        return (write_jsonl(folder / "train.jsonl", qa_rows(16, 0, (5, 10))),
                write_jsonl(folder / "eval.jsonl", qa_rows(8, 1, (5, 10))))
    (folder / "train.txt").write_text(mlm_lines(16, 0))
    (folder / "eval.txt").write_text(mlm_lines(8, 1))
    return folder / "train.txt", folder / "eval.txt"


@pytest.fixture(scope="module")
def runs(root, base_models):
    """(family, task) -> a fine-tune output folder: 2 steps of hfport.finetune on generated data."""
    cache: dict[tuple[str, str], Path] = {}

    def get(family: str, task: str = "sequence-classification") -> Path:
        if (family, task) not in cache:
            train, evaluation = write_task_data(task, root / "data" / task)
            out = root / "runs" / f"{family}-{task}"
            hfport.finetune({"model": str(base_models(family)), "task": task, "train": str(train),
                             "eval": str(evaluation), "output_dir": str(out), "max_steps": 2, "batch_size": 8,
                             "lr": 1e-2, "precision": "fp32", "max_length": 32, "doc_stride": 8, "seed": 3},
                            progress=False)
            cache[(family, task)] = out
        return cache[(family, task)]
    return get


@pytest.fixture(scope="module")
def good(root, runs) -> Path:
    """A verified fp32 export of the BERT sentiment run, for the tampering and CLI tests to copy."""
    out = root / "good-bert"
    result = export(runs("bert"), out, verify=True)
    assert result.report.passed, result.report.table()
    return out


def tampered(good: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "tampered"
    shutil.copytree(good, folder)
    return folder


def failed(report: hfport.VerifyReport) -> dict[tuple[str, str], str]:
    return {(r.check, r.output): r.detail for r in report.failures}


# --- round trips -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_finetuned_classifier_exports_and_verifies(family, runs, tmp_path):
    run = runs(family)
    out = tmp_path / "exported"
    result = export(run, out, verify=True)
    report = result.report
    assert report.passed, report.table()
    record(report, family, "sequence-classification (fine-tuned)")
    assert result.source == run / "best" and result.task == "text-classification"
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
            "README.md"} <= names
    assert not list(out.parent.glob(".exported.*")), "a staging folder was left behind"
    config = json.loads((out / "config.json").read_text())
    source_config = json.loads((run / "best" / "config.json").read_text())
    assert config["id2label"] == {"0": "negative", "1": "positive"} and config["num_labels"] == 2
    assert config["label2id"] == {"negative": 0, "positive": 1}
    assert config["problem_type"] == "single_label_classification"
    assert config["architectures"] == [hfport.load_any(run / "best").family.architectures["text-classification"]]
    assert config["hfport_version"] == hfport.__version__ and config["dtype"] == "float32"
    head_fields = {"architectures", "id2label", "label2id", "num_labels", "problem_type", "dtype", "torch_dtype"}
    for key in set(source_config) - head_fields:  # the rest of the source config is preserved as it was
        assert config[key] == source_config[key], key
    card = (out / "README.md").read_text()
    summary = json.loads((run / "summary.json").read_text())
    assert "pipeline_tag: text-classification" in card and "| 1 | positive |" in card
    assert summary["config"]["model"] in card and "eval_accuracy" in card and '"max_steps": 2' in card
    # the checks verify reports, by name
    checks = {(r.check, r.output) for r in report.rows}
    assert {("load", "missing keys"), ("load", "unexpected keys"), ("load", "mismatched keys"), ("labels",
            "id2label/label2id"), ("weights", "model.safetensors"), ("outputs", "texts/logits"),
            ("tokenizer", "texts/input_ids"), ("tokenizer", "texts/attention_mask")} <= checks
    assert (("outputs", "pairs/logits") in checks) == (family == "bert")  # pairs where the family has token types


@pytest.mark.parametrize("task", [t for t in TASKS if t not in ("base", "sequence-classification")])
def test_bert_fine_tuned_heads_export_and_verify(task, runs, tmp_path):
    run = runs("bert", task)
    result = export(run, tmp_path / "out", verify=True)
    assert result.report.passed, result.report.table()
    assert result.task == hfport.tasks.canonical(task)  # masked-lm is fill-mask now
    record(result.report, "bert", f"{task} (fine-tuned)")
    if task == "token-classification":
        labels = json.loads((tmp_path / "out" / "config.json").read_text())["id2label"]
        assert sorted(labels.values()) == ["B-LOC", "B-PER", "I-LOC", "I-PER", "O"]


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_head_of_every_family_round_trips(family, task, root, minilm_path, tmp_path):
    """A tiny transformers checkpoint of each head (the pre-trained models people export after other tools)."""
    src = tmp_path / "src"
    save_hf(family, task, src, vocab_size=vocab(family))
    add_tokenizer(family, src, minilm_path, root / "tokenizers")
    report = export(src, tmp_path / "out", verify=True).report
    assert report.passed, report.table()
    record(report, family, task)
    # the same tensor names transformers wrote, tied weights included (or left out) as it does
    assert safetensors_keys(tmp_path / "out") == safetensors_keys(src)
    outputs = {r.output.split("/")[1] for r in report.rows if r.check == "outputs"}
    expected = {"base": {"last_hidden_state", "pooler_output"}, "question-answering": {"start_logits", "end_logits"}}
    if family == "distilbert":
        expected["base"] = {"last_hidden_state"}  # DistilBERT has no pooler
    assert outputs == expected.get(task, {"logits"})


def safetensors_keys(folder: Path) -> set[str]:
    return set(hub.Checkpoint.open(folder).keys())


@pytest.mark.parametrize("family", ["bert", "roberta", "albert", "distilbert"])
def test_untied_decoder_is_written(family, root, minilm_path, tmp_path):
    """transformers 5 keeps an untied decoder's bias apart from the head's and computes with it: hfport holds both,
    and the export carries both (random, different values here, so using the wrong one would show)."""
    from tests.tiny import build_hf

    src = tmp_path / "src"
    model = build_hf(family, "masked-lm", vocab_size=vocab(family), tie_word_embeddings=False)
    model.save_pretrained(src)
    add_tokenizer(family, src, minilm_path, root / "tokenizers")
    report = export(src, tmp_path / "out", verify=True).report
    assert report.passed, report.table()
    record(report, family, "masked-lm (untied decoder)")
    keys = safetensors_keys(tmp_path / "out")
    assert keys == safetensors_keys(src) and any(k.endswith("decoder.weight") or k == "vocab_projector.weight"
                                                 for k in keys)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["tie_word_embeddings"] is False


def test_source_with_missing_weights_is_refused(root, minilm_path, tmp_path):
    """transformers' BertModel without its pooler: hfport would fill the pooler randomly, so there is nothing
    reproducible to export."""
    import transformers

    from tests.tiny import hf_config

    src = tmp_path / "src"
    transformers.BertModel(hf_config("bert", vocab_size=30522), add_pooling_layer=False).save_pretrained(src)
    add_tokenizer("bert", src, minilm_path, root / "tokenizers")
    with pytest.raises(ExportError, match=r"lacks weights .*body.pooler.dense.weight"):
        export(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_deberta_round_trip(root, minilm_path, tmp_path):
    if "deberta-v2" not in hfport.supported():
        pytest.skip("deberta-v2 is not registered in this tree")
    import transformers

    config = transformers.DebertaV2Config(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=37, max_position_embeddings=128, type_vocab_size=2,
                                          relative_attention=True, position_buckets=8, pos_att_type="p2c|c2p",
                                          id2label={0: "no", 1: "yes", 2: "maybe"},
                                          label2id={"no": 0, "yes": 1, "maybe": 2})
    torch.manual_seed(0)
    model = transformers.DebertaV2ForSequenceClassification(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.02)
    model.save_pretrained(tmp_path / "src")
    add_tokenizer("bert", tmp_path / "src", minilm_path, root / "tokenizers")
    report = export(tmp_path / "src", tmp_path / "out", verify=True).report
    assert report.passed, report.table()
    record(report, "deberta-v2", "sequence-classification")


def test_checkpoint_and_final_folders_export(runs, tmp_path):
    run = runs("bert")
    step = run / "checkpoints" / "step-2"
    assert not (step / "tokenizer.json").exists()  # checkpoints hold no tokenizer: it comes from the run
    result = export(step, tmp_path / "from-ckpt", verify=True)
    assert result.report.passed, result.report.table()
    assert result.tokenizer_from == run / "final"
    assert (tmp_path / "from-ckpt" / "vocab.txt").is_file()
    final = export(run, tmp_path / "from-final", which="final")
    assert final.source == run / "final"


def test_sharded_export_loads(runs, tmp_path):
    out = tmp_path / "sharded"
    result = export(runs("bert"), out, max_shard_size="400KB", verify=True)
    assert result.report.passed, result.report.table()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) >= 2 and sorted(set(index["weight_map"].values())) == shards
    assert not (out / "model.safetensors").exists()
    assert hfport.load_any(out).task == "text-classification"


def test_bf16_export_verifies_at_the_stated_tolerance(runs, tmp_path):
    out = tmp_path / "bf16"
    result = export(runs("bert"), out, dtype="bf16", verify=True)
    report = result.report
    assert report.passed, report.table()
    assert (report.dtype, report.atol, report.rtol) == ("bfloat16", *TOLERANCES["bfloat16"])
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert {t.dtype for t in load_file(str(out / "model.safetensors")).values()} == {torch.bfloat16}
    record(report, "bert", "sequence-classification (bf16)")
    # the looser tolerance is needed: at the fp32 tolerance the rounded weights' outputs fail, weights stay exact
    strict = verify(out, runs("bert"), atol=1e-5, rtol=1e-4)
    assert not strict.passed and {r.check for r in strict.failures} == {"outputs"}, strict.table()


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_real_minilm_verifies_at_each_dtype(dtype, minilm_path, tmp_path):
    """The stated tolerances hold on a real 6-layer model (22M parameters), not only on tiny random ones."""
    report = export(minilm_path, tmp_path / "out", dtype=dtype, verify=True).report
    assert report.passed, report.table()
    record(report, "bert (MiniLM-L6)", f"base ({dtype})")


def test_fp16_export_verifies(runs, tmp_path):
    report = export(runs("bert"), tmp_path / "fp16", dtype="fp16", verify=True).report
    assert report.passed and report.dtype == "float16", report.table()
    record(report, "bert", "sequence-classification (fp16)")


# --- tampering: verify fails and names what failed ------------------------------------------------------------


def test_untampered_copy_passes(good, runs, tmp_path):
    assert verify(tampered(good, tmp_path), runs("bert")).passed


def test_nudged_tensor_fails(good, runs, tmp_path):
    folder = tampered(good, tmp_path)
    weights = load_file(str(folder / "model.safetensors"))
    key = "bert.encoder.layer.1.output.dense.weight"
    weights[key][0, 0] += 0.05
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    report = verify(folder, runs("bert"))
    assert not report.passed
    bad = failed(report)
    assert ("weights", f"model.safetensors: {key}") in bad, report.table()
    assert ("outputs", "texts/logits") in bad, report.table()
    assert {c for c, _ in bad} == {"weights", "outputs"}, report.table()


def test_renamed_key_fails(good, runs, tmp_path):
    folder = tampered(good, tmp_path)
    weights = load_file(str(folder / "model.safetensors"))
    weights["bert.encoder.layer.0.attention.self.kee.weight"] = weights.pop(
        "bert.encoder.layer.0.attention.self.key.weight")
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    report = verify(folder, runs("bert"))
    bad = failed(report)
    assert "bert.encoder.layer.0.attention.self.key.weight" in bad[("load", "missing keys")], report.table()
    assert "self.kee.weight" in bad[("load", "unexpected keys")], report.table()
    assert "weights" in {c for c, _ in bad}
    assert not any(r.check == "outputs" for r in report.rows)  # no outputs from a half-random model


def test_changed_label_map_fails(good, runs, tmp_path):
    folder = tampered(good, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["id2label"] = {"0": "positive", "1": "negative"}
    config["label2id"] = {"positive": 0, "negative": 1}
    (folder / "config.json").write_text(json.dumps(config))
    report = verify(folder, runs("bert"))
    assert set(failed(report)) == {("labels", "id2label/label2id")}, report.table()
    assert "id2label" in failed(report)[("labels", "id2label/label2id")]


def test_tokenizer_disagreement_fails(good, runs, tmp_path):
    """An unknown tokenizer_class: transformers 5 falls back to a generic tokenizer without token types, hfport
    keeps them. The ids agree, the fields do not: the tokenizer check fails and says which fields differ."""
    folder = tampered(good, tmp_path)
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    tok_config["tokenizer_class"] = "NotARealTokenizer"
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    report = verify(folder, runs("bert"))
    bad = failed(report)
    assert {c for c, _ in bad} == {"tokenizer"} and ("tokenizer", "texts/fields") in bad, report.table()
    assert "token_type_ids" in bad[("tokenizer", "texts/fields")]


def test_unknown_head_class_fails_closed(good, runs, tmp_path):
    folder = tampered(good, tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["BertLMHeadModel"]  # BERT as a decoder: a transformers class hfport has not
    (folder / "config.json").write_text(json.dumps(config))
    report = verify(folder, runs("bert"))
    assert not report.passed and ("config", "config.json") in failed(report)
    assert "BertLMHeadModel" in failed(report)[("config", "config.json")]


def test_missing_dir_and_wrong_source_fail_closed(good, runs, tmp_path):
    assert not verify(tmp_path / "nowhere", runs("bert")).passed
    report = verify(good, runs("bert", "masked-lm"))  # a different head as the source
    assert not report.passed and ("source", str(runs("bert", "masked-lm"))) in failed(report), report.table()


def test_failed_verify_leaves_no_dir(runs, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(VerifyFailed) as info:
        export(runs("bert"), out, dtype="bf16", verify=True, atol=1e-7, rtol=0.0, json_path=tmp_path / "r.json")
    assert not out.exists() and not list(tmp_path.glob(".out.*"))
    assert not info.value.report.passed and "texts/logits" in str(info.value)
    assert json.loads((tmp_path / "r.json").read_text())["passed"] is False


# --- bad input ------------------------------------------------------------------------------------------------


def test_source_that_is_not_a_model_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ExportError, match="not a model folder .no config.json. and not a fine-tune output"):
        export(tmp_path / "empty", tmp_path / "out")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ExportError, match="is a file"):
        export(tmp_path / "file.txt", tmp_path / "out")
    with pytest.raises(hfport.HfportError, match="no-such-folder"):
        export(tmp_path / "no-such-folder", tmp_path / "out")
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(ExportError, match="fine-tune output folder without a best/ model"):
        export(tmp_path / "run", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_source_without_tokenizer(base_models, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(base_models("bert"), src)
    for name in TOKENIZER_FILES:
        (src / name).unlink()
    with pytest.raises(ExportError, match="no tokenizer files"):
        export(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_dir_inside_src_is_refused(runs):
    run = runs("bert")
    for out in (run / "exported", run / "best" / "hf", run):
        with pytest.raises(ExportError, match="inside the source"):
            export(run, out, force=True)
    assert not (run / "exported").exists() and not (run / "best" / "hf").exists()
    with pytest.raises(ExportError, match="contains the source"):
        export(run / "best", run.parent, force=True)


def test_existing_dir_needs_force(runs, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="already exists; pass --force"):
        export(runs("bert"), out)
    assert (out / "keep.txt").read_text() == "mine"
    export(runs("bert"), out, force=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert not list(tmp_path.glob(".out.*")), "the replaced folder or the staging folder was left behind"


def test_disk_full_leaves_nothing(runs, tmp_path, monkeypatch):
    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hub, "save_weights", no_space)
    out = tmp_path / "out"
    with pytest.raises(ExportError, match="No space left on device.*nothing was left there"):
        export(runs("bert"), out)
    assert list(tmp_path.iterdir()) == [], "a half-written export was left behind"
    # with --force over an existing export: the old one survives untouched
    out.mkdir()
    (out / "config.json").write_text("{}")
    with pytest.raises(ExportError, match="the previous folder is unchanged"):
        export(runs("bert"), out, force=True)
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (out / "config.json").read_text() == "{}"


def test_bad_options(runs, tmp_path):
    with pytest.raises(ExportError, match="dtype 'int8'"):
        export(runs("bert"), tmp_path / "out", dtype="int8")
    with pytest.raises(ExportError, match="which='middle'"):
        export(runs("bert"), tmp_path / "out", which="middle")
    with pytest.raises(ExportError, match="max_shard_size 'lots'"):
        export(runs("bert"), tmp_path / "out", max_shard_size="lots")
    assert not (tmp_path / "out").exists()


# --- the CLI --------------------------------------------------------------------------------------------------


def test_cli_export_verify_and_json(runs, tmp_path):
    out, report = tmp_path / "out", tmp_path / "report.json"
    res = CliRunner().invoke(app, ["export", str(runs("bert")), "--out", str(out), "--verify", "--json", str(report),
                                   "--dtype", "fp16", "--max-shard-size", "1MB"])
    assert res.exit_code == 0, res.output
    assert "max abs diff" in res.output and "PASS" in res.output and "FAIL" not in res.output
    data = json.loads(report.read_text())
    assert data["passed"] is True and data["dtype"] == "float16" and data["rows"]
    assert {"check", "output", "shape", "max_abs_diff", "tolerance", "passed"} <= set(data["rows"][0])
    again = CliRunner().invoke(app, ["export", str(runs("bert")), "--out", str(out)])
    assert again.exit_code != 0 and "already exists; pass --force" in again.output
    forced = CliRunner().invoke(app, ["export", str(runs("bert")), "--out", str(out), "--force", "--final"])
    assert forced.exit_code == 0, forced.output


def test_cli_verify_fails_on_tampering(good, runs, tmp_path):
    ok = CliRunner().invoke(app, ["verify", str(good), "--source", str(runs("bert"))])
    assert ok.exit_code == 0, ok.output
    folder = tampered(good, tmp_path)
    weights = load_file(str(folder / "model.safetensors"))
    weights["classifier.weight"][1, 3] -= 0.1
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    res = CliRunner().invoke(app, ["verify", str(folder), "--source", str(runs("bert")), "--json",
                                   str(tmp_path / "r.json")])
    assert res.exit_code == 1, res.output
    assert "FAIL weights model.safetensors: classifier.weight" in res.output and "FAIL:" in res.output
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert any(r["output"] == "texts/logits" and not r["passed"] for r in rows)
    bad = CliRunner().invoke(app, ["export", str(tmp_path / "missing"), "--out", str(tmp_path / "x")])
    assert bad.exit_code != 0 and "missing" in bad.output


def test_zz_measured_diffs(capsys):
    """Prints the max |output diff| each round trip measured (run with -s to see it)."""
    if not MEASURED:
        pytest.skip("no round trip ran in this session")
    with capsys.disabled():
        print("\nexport verify: max abs output diff (transformers from DIR vs hfport from SRC)")
        for (family, task), diff in sorted(MEASURED.items()):
            print(f"  {family:<18} {task:<40} {diff:.2e}")
    fp32 = [d for (f, t), d in MEASURED.items() if "bf16" not in t and "fp16" not in t]
    assert len(fp32) >= 30, "the round trips did not all record a diff"
    assert max(fp32) <= TOLERANCES["float32"][0]


@pytest.mark.parametrize("kind", ["embedding", "cross-encoder"])
def test_sentence_transformers_folders_get_their_card(kind, minilm_path, tmp_path):
    """An embedding folder (sentence-transformers modules) and a reranker (CrossEncoder's marker) export with a card
    that lists them as sentence-transformers models, with their Hub pipeline tag and how to load them there."""
    from hfport.formats.sentence_transformers import mark_cross_encoder, write_embedding_layout

    src = tmp_path / "src"
    if kind == "embedding":
        model = save_hf("bert", "base", src)
        write_embedding_layout(src, pooling="mean", normalize=True, hidden_size=model.config.hidden_size,
                               max_seq_length=128)
    else:
        save_hf("bert", "sequence-classification", src, num_labels=1)
        mark_cross_encoder(src)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(minilm_path / name, src / name)
    export(src, tmp_path / "out")
    card = (tmp_path / "out" / "README.md").read_text()
    tag, cls = {"embedding": ("sentence-similarity", "SentenceTransformer"),
                "cross-encoder": ("text-ranking", "CrossEncoder")}[kind]
    assert "library_name: sentence-transformers" in card and f"pipeline_tag: {tag}\n" in card
    assert f"from sentence_transformers import {cls}" in card and "from transformers import" not in card


def test_export_floors():
    """Inside hfport/export/ imports only point down: no circle among its modules, no function-level import of an
    hfport module (optional extras only), no private name imported from another module."""
    import ast

    folder = Path(hfport.__file__).parent / "export"
    graph: dict[str, set[str]] = {}
    problems = []
    for path in sorted(folder.glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        top = set(tree.body)
        graph[path.stem] = set()
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or node.level == 0:
                continue
            if node not in top and not any(isinstance(n, ast.If) and node in ast.walk(n) for n in tree.body):
                problems.append(f"{path.name}:{node.lineno}: function-level import of {'.' * node.level}{node.module}")
            if node.level == 1 and node.module and node in top:  # (imports under TYPE_CHECKING are types only)
                graph[path.stem].add(node.module.split(".")[0])
            problems += [f"{path.name}:{node.lineno}: private name {a.name}" for a in node.names
                         if a.name.startswith("_") and a.name != "__version__"]
    seen: dict[str, int] = {}

    def visit(name: str, trail: list[str]) -> None:
        if seen.get(name) == 1:
            problems.append("import circle: " + " -> ".join([*trail, name]))
            return
        if seen.get(name) == 2:
            return
        seen[name] = 1
        for dep in sorted(graph.get(name, ())):
            visit(dep, [*trail, name])
        seen[name] = 2

    for name in graph:
        visit(name, [])
    assert not problems, "\n".join(problems)


def test_staged_writes_one_helper(tmp_path):
    """hfport/staging.py: the one staged write. Replace (exports), merge into an existing folder (model saves:
    other files kept, stale weights of another layout dropped), and a fixed staging name a killed writer leaves
    behind, fsynced before the rename (the checkpoint writer's needs); a failure leaves the target as it was."""
    from hfport import staging

    target = tmp_path / "out"
    with staging.staged(target) as folder:
        (folder / "a.txt").write_text("1")
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (target / "a.txt").read_text() == "1"
    with pytest.raises(RuntimeError), staging.staged(target) as folder:
        (folder / "a.txt").write_text("2")
        raise RuntimeError("the writer failed")
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (target / "a.txt").read_text() == "1"
    (target / "model.safetensors").write_text("old layout")
    with staging.staged(target, merge=True, stale=("model*.safetensors*",)) as folder:
        (folder / "model-00001-of-00001.safetensors").write_text("new")
    assert sorted(p.name for p in target.iterdir()) == ["a.txt", "model-00001-of-00001.safetensors"]
    leftover = tmp_path / ".tmp-step-3-1"  # a killed writer's staging folder of that name
    leftover.mkdir()
    (leftover / "half.pt").write_text("x")
    with staging.staged(tmp_path / "step-3", name=leftover.name, fsync=True) as folder:
        assert folder == leftover and not (folder / "half.pt").exists()
        (folder / "trainer_state.json").write_text("{}")
    assert not leftover.exists() and (tmp_path / "step-3" / "trainer_state.json").is_file()
