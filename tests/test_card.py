"""The model card of an export: YAML front matter the Hub reads (huggingface_hub's ModelCard is the judge), the
training data with row counts, the hyperparameters, hfport's version, the eval metrics and the verify result."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from huggingface_hub import ModelCard

import hfport
from hfport.export import export
from hfport.export.card import NOT_VERIFIED, front_matter
from hfport.rundir import RunSummary
from hfport.train.loop import finetune
from tests.test_finetune import write_sentiment
from tests.tiny import save_hf


@pytest.fixture(scope="module")
def run(tmp_path_factory, minilm_path) -> Path:
    """A 4-step fine-tune of a tiny BERT with an eval file."""
    root = tmp_path_factory.mktemp("card")
    save_hf("bert", "base", root / "model", vocab_size=30522)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(minilm_path / f, root / "model" / f)
    write_sentiment(root / "train.jsonl", 40, seed=0)
    write_sentiment(root / "eval.jsonl", 12, seed=1)
    finetune({"model": str(root / "model"), "train": str(root / "train.jsonl"), "eval": str(root / "eval.jsonl"),
              "output_dir": str(root / "run"), "batch_size": 8, "max_steps": 4, "lr": 3e-3, "precision": "fp32",
              "save_strategy": "no"}, progress=False)
    return root / "run"


def split_card(text: str) -> tuple[dict, str]:
    assert text.startswith("---\n")
    head, body = text[4:].split("\n---\n", 1)
    return yaml.safe_load(head), body


def test_card_front_matter_and_body(run, tmp_path):
    export(run, tmp_path / "out", verify=True)
    text = (tmp_path / "out" / "README.md").read_text()
    meta, body = split_card(text)
    summary = json.loads((run / "summary.json").read_text())
    accuracy = summary["final_eval"]["eval_accuracy"]

    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "text-classification"
    assert meta["tags"] == ["hfport", "bert"]
    assert "base_model" not in meta and "datasets" not in meta  # local paths mean nothing on the Hub
    (index,) = meta["model-index"]
    (result,) = index["results"]
    assert index["name"] == "out" and result["task"]["type"] == "text-classification"
    assert result["dataset"] == {"type": "custom", "name": "eval.jsonl", "split": "validation"}
    metrics = {m["type"]: m["value"] for m in result["metrics"]}
    assert metrics["accuracy"] == accuracy and metrics["loss"] == summary["final_eval"]["eval_loss"]

    card = ModelCard(text)  # the Hub's own parser
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-classification"
    parsed = {r.metric_type: r.metric_value for r in card.data.eval_results}
    assert parsed["accuracy"] == accuracy and card.data.eval_results[0].dataset_split == "validation"

    config = summary["config"]
    assert f"| train | `{config['train']}` | - | 40 |" in body and f"| eval | `{config['eval']}` | - | 12 |" in body
    assert "| lr | `0.003` |" in body and "| batch_size | `8` |" in body and "| max_steps | `4` |" in body
    assert f"exported by hfport {hfport.__version__}" in body
    assert f"| eval_accuracy | {accuracy:.4f} |" in body
    assert "**PASS** at export" in body and "| outputs | texts/logits |" in body and NOT_VERIFIED not in body
    assert body.index("## Verification") < body.index("## Use")  # filled in where it stood


def test_card_without_verify_says_so(run, tmp_path):
    export(run, tmp_path / "out", verify=False)
    meta, body = split_card((tmp_path / "out" / "README.md").read_text())
    assert NOT_VERIFIED in body and "**PASS**" not in body and meta["model-index"]


def test_hub_ids_become_base_model_and_datasets():
    summary = RunSummary(steps=3, epochs=1, best_metric={"f1": 0.5}, best_step=3, stopped_early=False,
                         metric_mode="max", frozen=0, train_examples=10, eval_examples=0, labels=None,
                         problem_type=None, config={"model": "google-bert/bert-base-uncased",
                                                    "train": "stanfordnlp/imdb", "eval": None}, final_eval=None)
    meta = yaml.safe_load(front_matter({"model_type": "bert"}, summary, "m", "text-classification", None)
                          .strip("-\n"))
    assert meta["base_model"] == "google-bert/bert-base-uncased" and meta["datasets"] == ["stanfordnlp/imdb"]
    assert "model-index" not in meta  # no evaluation ran: no results to claim
    summary.config["train"] = "no/such/train.jsonl"
    assert "datasets" not in yaml.safe_load(front_matter({"model_type": "bert"}, summary, "m", "fill-mask", None)
                                            .strip("-\n"))
