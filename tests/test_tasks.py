"""Tasks as records (hfport/tasks/): names and aliases everywhere a task is named, the tables that read the
records, the default metric by problem type (issue 13 §8a), and QA's padded path against transformers (§8b)."""

from __future__ import annotations

import csv
import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import hfport
from hfport import tasks
from hfport.cli import app
from hfport.registry import FAMILIES
from hfport.train.config import FinetuneConfig, resolve_config
from hfport.train.loop import finetune
from tests.tiny import ALL_FAMILIES, batch, build_hf, save_hf

MODEL_TASKS = ["feature-extraction", "text-classification", "token-classification", "question-answering", "fill-mask",
               "multiple-choice", "pretraining", "next-sentence-prediction"]
# model tasks only some families have (their records' every_family=False), and those families
SOME_FAMILIES = {"pretraining": {"bert", "albert", "electra"}, "next-sentence-prediction": {"bert"}}
# tasks that train one of the model tasks' models (their records' model_task)
TRAINING_ONLY = {"sentence-embedding": "feature-extraction", "text-ranking": "text-classification",
                 "sparse-embedding": "fill-mask"}
# a pipeline over another task's model that trains nothing of its own (an NLI model is fine-tuned as text-classification)
SERVING_ONLY = {"zero-shot-classification": "text-classification"}
CANONICAL = [*MODEL_TASKS, *TRAINING_ONLY, *SERVING_ONLY]
PIPELINE_TASKS = [name for name in CANONICAL if name not in SOME_FAMILIES]  # the pre-training heads have none
OLD_NAMES = {"base": "feature-extraction", "sequence-classification": "text-classification",
             "masked-lm": "fill-mask", "sentiment-analysis": "text-classification", "ner": "token-classification"}


# --- the records and the tables built from them -----------------------------------------------------------------


def test_canonical_names_are_the_pipeline_tags_and_aliases_normalize():
    assert list(tasks.TASKS) == CANONICAL
    for name in CANONICAL:
        assert tasks.get(name).name == name
    for alias, name in OLD_NAMES.items():
        assert tasks.canonical(alias) == name
    with pytest.raises(ValueError) as e:
        tasks.get("summarization")
    for name in [*CANONICAL, *OLD_NAMES]:  # the error lists every valid name and alias
        assert name in str(e.value)


def test_records_agree_with_model_classes_pipelines_and_families():
    import transformers

    from hfport.pipelines import PIPELINES

    assert list(PIPELINES) == PIPELINE_TASKS == list(tasks.PIPELINE_TASKS) and list(tasks.MODEL_TASKS) == MODEL_TASKS
    for name, record in tasks.TASKS.items():
        model_task = {**TRAINING_ONLY, **SERVING_ONLY}.get(name, name)
        assert name not in SERVING_ONLY or record.train is None
        assert record.checkpoint_task == model_task
        # a pipeline runs the model of its checkpoint task (sentence-embedding pools feature-extraction's)
        assert record.model_class.task == model_task
        assert name in SOME_FAMILIES or PIPELINES[name].model_task == model_task
        assert hasattr(transformers, record.auto_class)
        assert set(record.per_sequence) <= set(record.outputs)
        assert record.every_family == (name not in SOME_FAMILIES)
    for family in FAMILIES.values():  # every family keys its tables by canonical task names only
        # every model task every family has, or the ones transformers has classes for in the family (Family.tasks:
        # GTE has no QA); a head only some families have where the family maps its keys
        names = family.tasks or [n for n in tasks.MODEL_TASKS
                                 if n not in SOME_FAMILIES or family.model_type in SOME_FAMILIES[n]]
        assert set(family.architectures) == set(names) <= set(tasks.MODEL_TASKS)
        assert set(family.head_keys) | set(family.head_options) <= set(tasks.MODEL_TASKS) - {"feature-extraction"}


def test_the_families_read_task_facts_from_the_records():
    """No side tables: class names are the family's prefix + the record's suffix; whether a head reads the pooler is
    the record's `pooler`, unless the family's record says otherwise (RoBERTa's classifier); a training-only task
    reaches its model task's facts through `model_record`."""
    for family in FAMILIES.values():
        names = [name for name in tasks.MODEL_TASKS if family.has_task(name)]
        assert family.architectures == {name: family.class_prefix + tasks.TASKS[name].architecture_suffix
                                        for name in names}
        for name in names:
            built = family.build_body(family.config_from_hf(build_hf(family.model_type, "base").config.to_dict(),
                                                            "config"), name)
            has_pooler = family.model_type in ("bert", "roberta", "xlm-roberta", "albert", "camembert", "mpnet", "gte",
                                               "nomic_bert", "jina_embeddings_v3") and \
                family.pooler.get(name, tasks.TASKS[name].pooler)
            assert (built.pooler is not None) == has_pooler, (family.model_type, name)
    assert FAMILIES["roberta"].pooler == {"text-classification": False}
    for name, record in tasks.TASKS.items():
        assert record.model_record.name == record.checkpoint_task
        assert record.model_record.output_type is not None and record.model_record.architecture_suffix
    assert tasks.get("text-ranking").model_record.peft_task_type == "SEQ_CLS"


@pytest.mark.parametrize("family", list(ALL_FAMILIES))
def test_every_family_builds_every_head_from_the_records(family):
    hf = build_hf(family, "base")
    raw = hf.config.to_dict()
    for name in tasks.MODEL_TASKS:
        record = tasks.TASKS[name]
        if not FAMILIES[raw["model_type"]].has_task(name):  # the pre-training heads: tests/test_pretraining.py
            continue
        model = record.model_class.from_config(raw)
        assert model.task == name
        assert (model.head is None) == (name == "feature-extraction")
        built = record.build_head(model.config, model.family)
        assert type(built) is type(model.head)


def test_loaded_models_report_canonical_tasks(tmp_path):
    for hf_task, name in (("sequence-classification", "text-classification"), ("masked-lm", "fill-mask"),
                          ("base", "feature-extraction")):
        save_hf("bert", hf_task, tmp_path / hf_task)
        assert hfport.load_any(tmp_path / hf_task).task == name


# --- names on input: config, CLI, pipeline, server schemas ------------------------------------------------------


@pytest.mark.parametrize("given", ["text-classification", "sequence-classification", "sentiment-analysis"])
def test_finetune_config_accepts_aliases_and_stores_the_canonical_name(given):
    config = FinetuneConfig(model="m", train="t.csv", task=given)
    assert config.task == "text-classification"
    config, _ = resolve_config({"task": "masked-lm"}, {"model": "m", "train": "t.txt"})
    assert config.task == "fill-mask"
    with pytest.raises(hfport.ConfigError, match="fill-mask.*masked-lm"):  # the valid names and aliases
        resolve_config({"task": "summarization"}, {"model": "m", "train": "t.txt"})
    with pytest.raises(hfport.ConfigError, match="feature-extraction cannot be fine-tuned"):
        resolve_config({"task": "base"}, {"model": "m", "train": "t.txt"})


def test_cli_names_tasks_users_know(tmp_path):
    runner = CliRunner()
    shown = runner.invoke(app, ["finetune", "--model", "m", "--train", "t.csv", "--task", "sequence-classification",
                                "--print-config"])
    assert shown.exit_code == 0, shown.output
    assert '"text-classification"' in next(line for line in shown.output.splitlines() if line.startswith("task "))
    bad = runner.invoke(app, ["finetune", "--model", "m", "--train", "t.csv", "--task", "summarization"])
    assert bad.exit_code == 1 and "text-classification" in bad.output and "sequence-classification" in bad.output
    helped = runner.invoke(app, ["finetune", "--help"], env={"COLUMNS": "400"})  # rich wraps at the width
    assert "text-classification" in helped.output and "aliases" in helped.output


def test_pipeline_and_server_schemas_accept_aliases(tmp_path, minilm_path):
    from server.schemas import ModelRegistration, PredictRequest

    assert PredictRequest(model="a", inputs="x", task="sentiment-analysis").task == "text-classification"
    assert ModelRegistration(name="a", path="p", task="masked-lm").task == "fill-mask"
    with pytest.raises(ValueError, match="not supported.*fill-mask"):
        PredictRequest(model="a", inputs="x", task="summarization")
    with pytest.raises(ValueError, match="Input should be 'feature-extraction'"):  # a model-only head: no pipeline
        ModelRegistration(name="a", path="p", task="pretraining")
    save_hf("bert", "masked-lm", tmp_path, vocab_size=30522)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(minilm_path / f, tmp_path / f)
    pipe = hfport.pipeline("masked-lm", model=tmp_path)
    assert pipe.task == "fill-mask" and len(pipe("the [MASK] was good", top_k=2)) == 2


# --- §8a: the default metric follows the problem type ----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, minilm_path) -> Path:
    folder = tmp_path_factory.mktemp("model")
    save_hf("bert", "base", folder, vocab_size=30522, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(minilm_path / f, folder / f)
    return folder


def test_regression_without_eval_file_picks_a_regression_metric(tiny_model, tmp_path):
    rng = random.Random(0)
    with open(tmp_path / "reg.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "label"])
        for _ in range(40):
            n = rng.randint(1, 5)
            writer.writerow([" ".join(["good"] * n), f"{n / 2:.2f}"])  # float labels: regression
    summary = finetune(FinetuneConfig(model=str(tiny_model), task="text-classification",
                                      train=str(tmp_path / "reg.csv"), output_dir=str(tmp_path / "run"), max_steps=2,
                                      batch_size=8, eval_fraction=0.2), progress=False)
    assert summary["problem_type"] == "regression"
    assert list(summary["best_metric"]) == ["mse"] and summary["metric_mode"] == "min"
    assert summary["best_metric"]["mse"] >= 0 and "eval_r2" in summary["final_eval"]


def test_multi_label_without_eval_file_picks_a_multi_label_metric(tiny_model, tmp_path):
    rng = random.Random(1)
    with open(tmp_path / "ml.jsonl", "w") as f:
        for _ in range(40):
            labels = sorted(rng.sample(["art", "food", "sport"], rng.randint(1, 2)))
            f.write(json.dumps({"text": " and ".join(labels), "label": labels}) + "\n")
    summary = finetune(FinetuneConfig(model=str(tiny_model), task="sequence-classification",
                                      train=str(tmp_path / "ml.jsonl"), output_dir=str(tmp_path / "run"), max_steps=2,
                                      batch_size=8, eval_fraction=0.2), progress=False)
    assert summary["problem_type"] == "multi_label_classification"
    assert list(summary["best_metric"]) == ["f1_micro"] and summary["metric_mode"] == "max"
    assert summary["config"]["task"] == "text-classification"  # run summaries carry the canonical name


def test_default_metrics_per_problem_type():
    config = FinetuneConfig(model="m", train="t.csv")
    assert config.default_metric() == ("accuracy", "max")
    assert config.default_metric("single_label_classification") == ("accuracy", "max")
    assert config.default_metric("multi_label_classification") == ("f1_micro", "max")
    assert config.default_metric("regression") == ("mse", "min")
    assert FinetuneConfig(model="m", train="t.csv", problem_type="regression").default_metric() == ("mse", "min")
    assert FinetuneConfig(model="m", train="t", task="ner").default_metric() == ("f1", "max")
    assert FinetuneConfig(model="m", train="t", task="masked-lm").default_metric() == ("perplexity", "min")
    assert FinetuneConfig(model="m", train="t", metric="r2").default_metric("regression") == ("r2", "max")


# --- §8b: padding_free=False gives transformers' QA logits and loss on a padded batch ----------------------------


@pytest.mark.parametrize("family", list(ALL_FAMILIES))
def test_padded_qa_matches_transformers_at_every_position(family, tmp_path):
    ref = save_hf(family, "question-answering", tmp_path)
    ours = hfport.AutoModelForQuestionAnswering.from_pretrained(tmp_path)
    inputs = batch(family)  # lengths 70, 41, 9: the shorter rows are mostly padding
    positions = {"start_positions": torch.tensor([3, 20, 60]), "end_positions": torch.tensor([9, 45, 500])}
    theirs = ref(**inputs, **positions)
    ours.padding_free = False
    out = ours(**inputs, **positions)
    for key in ("start_logits", "end_logits"):  # (B, T): padding positions included
        torch.testing.assert_close(getattr(out, key), getattr(theirs, key).detach(), atol=1e-5, rtol=1.3e-6)
    torch.testing.assert_close(out.loss, theirs.loss.detach(), atol=1e-5, rtol=1.3e-6)

    ours.padding_free = True  # the default: padding is never an answer
    packed = ours(**inputs, **positions)
    padding = ~inputs["attention_mask"].bool()
    assert (packed.start_logits[padding] == torch.finfo(torch.float32).min).all()
    torch.testing.assert_close(packed.start_logits[~padding], theirs.start_logits[~padding].detach(),
                               atol=1e-5, rtol=1.3e-6)
