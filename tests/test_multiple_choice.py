"""multiple-choice end to end, the proof that a task is whole: its model against transformers'
*ForMultipleChoice in every family (padded batches of choices of unequal length: logits, loss and every gradient at
fp32 1e-5), its pipeline, fine-tuning, export + verify against transformers, and POST /predict."""

from __future__ import annotations

import csv
import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import hfport
from hfport import tasks
from hfport.export import ExportError, export
from hfport.pipelines import PipelineInputError
from hfport.train.config import FinetuneConfig
from hfport.train.data import DataError
from hfport.train.loop import finetune
from tests.parity import SCORE_TOL, compare_choices
from tests.tiny import ALL_FAMILIES, build_hf, save_hf
from tests.tiny_tokenizers import make_folder

TASK = "multiple-choice"
MC = tasks.AutoModelForMultipleChoice


# --- the model: parity with transformers ---------------------------------------------------------------------


@pytest.mark.parametrize("family", list(ALL_FAMILIES))
def test_parity_with_transformers(family, tmp_path):
    compare_choices(family, tmp_path)


@pytest.mark.parametrize("family", ["bert", "distilbert", "modernbert", "deberta-v2"])
def test_parity_on_the_padded_layout(family, tmp_path):
    compare_choices(family, tmp_path, padding_free=False)


@pytest.mark.parametrize("family,overrides", [("modernbert", {"classifier_pooling": "mean"}),
                                              ("roberta", {"classifier_dropout": 0.3}),
                                              ("bert", {"type_vocab_size": 1})])
def test_parity_head_variants(family, overrides, tmp_path):
    compare_choices(family, tmp_path, **overrides)


def test_the_record_and_the_families():
    record = tasks.get(TASK)
    assert record.model_record is record and tasks.get("text-ranking").model_record is tasks.get("text-classification")
    assert record.peft_task_type is None and not record.graph_outputs  # PEFT has no task type, no ONNX graph
    for name in ALL_FAMILIES:
        family = hfport.registry.get_family(name)
        assert family.architectures[TASK] == family.class_prefix + "ForMultipleChoice"
        assert TASK in family.head_keys


def test_a_fresh_model_initialises_as_transformers_shapes_it():
    ref = build_hf("distilbert", TASK)
    ours = MC.from_config(ref.config.to_dict())
    assert sorted(ours.hf_state_dict()) == sorted(k for k in ref.state_dict())


# --- the pipeline -----------------------------------------------------------------------------------------------

QUESTIONS = [{"question": "Where did Herman Melville write?", "choices": ["in Paris", "at sea on a long voyage", "no"]},
             {"context": "The quick brown fox", "choices": ["jumps over the lazy dog.", "sleeps.", "runs", "eats"]}]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mc")
    # a wide initialisation: distinct choice scores (the default 0.02 leaves them within 1e-5 of each other)
    return {family: make_folder(root, family, TASK, initializer_range=0.5)
            for family in ("bert", "roberta", "distilbert", "albert")}


@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert", "albert"])
def test_pipeline_scores_are_transformers_softmax_over_the_choices(family, folders):
    import transformers

    folder = folders[family]
    ref = transformers.AutoModelForMultipleChoice.from_pretrained(folder).eval()
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    pipe = hfport.pipeline(TASK, model=folder)
    results = pipe(QUESTIONS, top_k=None)
    for item, ranked in zip(QUESTIONS, results):
        stem = item.get("question") or item["context"]
        enc = tok([stem] * len(item["choices"]), item["choices"], padding=True, return_tensors="pt")
        with torch.no_grad():
            logits = ref(**{k: v[None] for k, v in enc.items()}).logits[0]  # (C,)
        want = torch.softmax(logits, -1).numpy()
        got = np.zeros(len(want))
        for r in ranked:
            got[r["index"]] = r["score"]
            assert r["choice"] == item["choices"][r["index"]]
        np.testing.assert_allclose(got, want, atol=SCORE_TOL)
        assert [r["score"] for r in ranked] == sorted((r["score"] for r in ranked), reverse=True)
    best = pipe(QUESTIONS[0])  # top_k not given: the best choice, one dict (alone: other batch-mates than above)
    assert set(best) == {"index", "choice", "score"} and best["index"] == results[0][0]["index"]
    assert abs(best["score"] - results[0][0]["score"]) < SCORE_TOL
    assert [r["index"] for r in pipe(QUESTIONS[1], top_k=2)] == [r["index"] for r in results[1][:2]]


def test_pipeline_results_do_not_depend_on_batching(folders):
    pipe = hfport.pipeline(TASK, model=folders["bert"])
    together = pipe(QUESTIONS, top_k=None)
    one_row_batches = hfport.pipeline(TASK, model=folders["bert"], batch_size=1)(QUESTIONS, top_k=None)
    for a, b in zip(together, one_row_batches):
        assert [r["index"] for r in a] == [r["index"] for r in b]
        np.testing.assert_allclose([r["score"] for r in a], [r["score"] for r in b], atol=SCORE_TOL)


def test_pipeline_input_errors(folders):
    pipe = hfport.pipeline(TASK, model=folders["bert"])
    with pytest.raises(PipelineInputError, match="'choices' and one of 'question' or 'context'"):
        pipe({"question": "q", "context": "c", "choices": ["a", "b"]})
    with pytest.raises(PipelineInputError, match="at least 2"):
        pipe({"question": "q", "choices": ["a"]})
    with pytest.raises(PipelineInputError, match=r"choices\[1\] is empty"):
        pipe({"question": "q", "choices": ["a", " "]})
    with pytest.raises(ValueError, match="takes a {'question'"):
        pipe("just a text")
    out = pipe([QUESTIONS[0], {"question": "q"}])  # a list answers what it can
    assert out[0]["choice"] in QUESTIONS[0]["choices"] and isinstance(out[1], hfport.ItemError)
    with pytest.raises(ValueError, match="top_k"):
        pipe(QUESTIONS[0], top_k=0)


# --- fine-tuning, export, verify ------------------------------------------------------------------------------


def write_questions(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    colors = ["red", "blue", "green", "yellow"]
    rows = []
    for _ in range(n):
        color = rng.choice(colors)
        choices = rng.sample(colors, 4)
        rows.append({"context": f"the ball is {color}, so its color is", "choices": choices,
                     "label": choices.index(color)})
    if path.suffix == ".csv":
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["context", "choices", "label"])
            for r in rows:
                writer.writerow([r["context"], json.dumps(r["choices"]), r["label"]])
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, minilm_path) -> Path:
    folder = tmp_path_factory.mktemp("model")
    save_hf("bert", TASK, folder, vocab_size=30522, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(minilm_path / f, folder / f)
    return folder


@pytest.fixture(scope="module")
def run(tiny_model, tmp_path_factory) -> Path:
    data = tmp_path_factory.mktemp("data")
    write_questions(data / "train.jsonl", 40)
    write_questions(data / "eval.csv", 8, seed=1)
    out = data / "run"
    summary = finetune(FinetuneConfig(model=str(tiny_model), task=TASK, train=str(data / "train.jsonl"),
                                      eval=str(data / "eval.csv"), output_dir=str(out), max_steps=4, batch_size=8,
                                      lr=1e-3, logging_steps=1), progress=False)
    assert list(summary["best_metric"]) == ["accuracy"] and summary["metric_mode"] == "max"
    assert 0.0 <= summary["final_eval"]["eval_accuracy"] <= 1.0 and summary["eval_examples"] == 8
    assert summary["train_examples"] == 40
    return out


def test_finetune_trains_and_logs_accuracy(run):
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [x["loss"] for x in lines if "loss" in x and "eval_loss" not in x and "step" in x]
    assert losses and all(np.isfinite(losses))
    assert any("eval_accuracy" in x for x in lines)
    model = hfport.load_any(run / "best")  # config.json names BertForMultipleChoice
    assert model.task == TASK and type(model) is MC


def test_data_errors_name_file_line_and_field(tiny_model, tmp_path):
    def fails(rows: list[dict], match: str) -> None:
        path = tmp_path / "bad.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        with pytest.raises(DataError, match=match):
            finetune(FinetuneConfig(model=str(tiny_model), task=TASK, train=str(path),
                                    output_dir=str(tmp_path / "out"), max_steps=1), progress=False)

    good = {"question": "q", "choices": ["a", "b"], "label": 1}
    fails([good, {"question": "q", "choices": ["a", "b"], "label": 2}], r"bad.jsonl, line 2, field 'label'.*0\.\.1")
    fails([good, {"question": "q", "choices": ["a", "b", "c"], "label": 0}],
          r"line 2, field 'choices': 3 choices, but line 1 has 2")
    fails([good, {"choices": ["a", "b"], "label": 0}], r"line 2: a multiple-choice row needs one of 'context'")
    fails([{"question": "q", "choices": "a", "label": 0}], r"line 1, field 'choices': expected a JSON list")
    fails([{"question": "q", "choices": ["a", ""], "label": 0}], r"line 1, field 'choices': expected non-empty")


def test_export_verifies_against_transformers(run, tmp_path):
    result = export(run, tmp_path / "hf", verify=True)
    assert result.report.passed, result.report
    rows = {(r.check, r.output) for r in result.report.rows}
    assert ("outputs", "texts/logits") in rows and ("load", "class BertForMultipleChoice") in rows
    with pytest.raises(ExportError, match="no ONNX graph for multiple-choice"):
        pytest.importorskip("onnx")
        from hfport.export.onnx import export_onnx

        export_onnx(run, tmp_path / "onnx")


def test_http_predict(run, tmp_path):
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.settings import Settings

    app = create_app(Settings(data_dir=tmp_path / "data", allowed_dirs=[str(run)]), run_worker=False)
    with TestClient(app) as client:
        r = client.post("/models", json={"name": "mc", "path": str(run / "best")})
        assert r.status_code == 201 and r.json()["task"] == TASK, r.text
        r = client.post("/predict", json={"model": "mc", "inputs": [QUESTIONS[1], {"question": "q"}],
                                          "parameters": {"top_k": None}})
        assert r.status_code == 200, r.text
        ranked, bad = r.json()["outputs"]
        assert sorted(x["index"] for x in ranked) == [0, 1, 2, 3] and abs(sum(x["score"] for x in ranked) - 1) < 1e-4
        assert bad["index"] == 1 and bad["error_type"] == "PipelineInputError"
        one = client.post("/predict", json={"model": "mc", "inputs": QUESTIONS[0]}).json()
        assert one["task"] == TASK and set(one["outputs"]) == {"index", "choice", "score"}


def test_lora_adapter_trains_exports_and_verifies_with_peft(tiny_model, tmp_path):
    """PEFT has no multiple-choice task type: the adapter's task_type is null and config.json names the head."""
    pytest.importorskip("peft")
    write_questions(tmp_path / "train.jsonl", 16)
    finetune(FinetuneConfig(model=str(tiny_model), task=TASK, train=str(tmp_path / "train.jsonl"),
                            output_dir=str(tmp_path / "run"), max_steps=2, batch_size=8, lora={"r": 4}), progress=False)
    best = tmp_path / "run" / "best"
    assert json.loads((best / "adapter_config.json").read_text())["task_type"] is None
    assert hfport.load_any(best).task == TASK
    result = export(tmp_path / "run", tmp_path / "adapter", verify=True)
    assert result.report.passed and ("outputs", "texts/logits") in {(r.check, r.output) for r in result.report.rows}
