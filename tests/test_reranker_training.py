"""text-ranking: a one-label cross-encoder trained with BCE or a listwise loss, ranked by MRR/NDCG, saved as a
folder sentence-transformers' CrossEncoder loads (proven through `verify`), and its bad input named.

A tiny random BERT with the real MiniLM WordPiece tokenizer; the examples/data rerank files (real text).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import hfport
from hfport.errors import ConfigError
from hfport.export import verify
from hfport.train.config import FinetuneConfig
from hfport.train.data import DataError
from hfport.train.loop import finetune
from hfport.train.preflight import preflight
from tests.data import DATA, write_jsonl
from tests.tiny import save_with_tokenizer

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, minilm_path) -> Path:
    root = tmp_path_factory.mktemp("rerank") / "model"
    save_with_tokenizer("bert", "base", root, minilm_path, vocab_size=30522)
    return root


def cfg(model_dir: Path, tmp_path: Path, **kw) -> FinetuneConfig:
    values = dict(model=str(model_dir), task="text-ranking", train=str(DATA / "rerank_train.jsonl"),
                  eval=str(DATA / "rerank_eval.jsonl"), output_dir=str(tmp_path / "run"), batch_size=8, lr=1e-3,
                  logging_steps=1, seed=5, max_length=64, precision="fp32")
    return FinetuneConfig(**{**values, **kw})


def test_rows_group_by_query_and_losses_by_hand(model_dir, tmp_path):
    rows = [{"query": "q one", "text": "a", "label": 1}, {"query": "q two", "text": "b", "label": 0.0},
            {"query": "q one", "text": "c", "label": 0}, {"query": "q two", "text": "d", "label": 5},
            {"query": "q one", "text": "e", "label": 2.5}]
    train = write_jsonl(tmp_path / "rows.jsonl", rows)
    checked = preflight(cfg(model_dir, tmp_path, train=str(train), eval=None, eval_fraction=0.0, batch_size=2,
                            score_range=(0, 5), loss="listwise"))
    task, data = checked.task, checked.data
    assert [x.target for x in data.train] == [[0.2, 0.0, 0.5], [0.0, 1.0]]  # per query, scaled by score_range
    batch = task.collate(data.train, data, seed=0)
    assert batch["input_ids"].shape[0] == 5 and batch["groups"].tolist() == [0, 0, 0, 1, 1]
    logits = torch.tensor([0.3, -1.0, 2.0, 0.5, 0.1])

    class Out:
        pass

    out = Out()
    out.logits = logits[:, None]  # (N, 1)
    listwise = task.loss(out, batch, data, None, 0.0)
    t0 = torch.tensor([0.2, 0.0, 0.5]) / 0.7
    expected = (-(t0 * F.log_softmax(logits[:3], 0)).sum() - F.log_softmax(logits[3:], 0)[1]) / 2
    torch.testing.assert_close(listwise, expected)
    data.extra["loss"] = "bce"
    torch.testing.assert_close(task.loss(out, batch, data, None, 0.0),
                               F.binary_cross_entropy_with_logits(logits, batch["labels"]))


@pytest.mark.parametrize("loss", ["bce", "listwise"])
def test_groups_train_into_a_cross_encoder_folder_that_verifies(model_dir, tmp_path, loss):
    summary = finetune(cfg(model_dir, tmp_path, loss=loss, max_steps=20, eval_strategy="steps", eval_steps=10),
                       progress=False)
    evals = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if json.loads(x)["type"] == "eval"]
    assert list(summary["best_metric"]) == ["ndcg@10"] and summary["labels"] == {0: "LABEL_0"}
    assert {"eval_mrr@10", "eval_ndcg@10", "eval_recall@1", "eval_recall@10"} <= set(evals[-1])
    train_losses = [json.loads(x)["loss"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
                    if json.loads(x)["type"] == "train"]
    if loss == "bce":  # a random tiny cross-encoder first learns the prior; the listwise loss moves later (below)
        assert sum(train_losses[-5:]) < sum(train_losses[:5])
    best = tmp_path / "run" / "best"
    config = json.loads((best / "config.json").read_text())
    assert config["architectures"] == ["BertForSequenceClassification"] and config["num_labels"] == 1 \
        if "num_labels" in config else len(config["id2label"]) == 1
    assert config["sentence_transformers"]["activation_fn"].endswith("Sigmoid")
    # served like a text-classification model: the sigmoid of the one logit
    pipe = hfport.pipeline("text-ranking", model=best)
    score = pipe({"text": "What is the capital of Peru?", "text_pair": "Lima is the capital of Peru."})
    assert 0.0 < score["score"] < 1.0
    report = verify(best, tmp_path / "run")
    assert report.passed, report.table()
    assert any(r.check == "sentence-transformers" and r.output == "predict" and r.passed for r in report.rows)


def test_listwise_loss_fits_a_batch(model_dir, tmp_path):
    """The listwise loss's gradient reaches the model: a few steps on one batch of groups lower it clearly."""
    checked = preflight(cfg(model_dir, tmp_path, loss="listwise"))
    task, data = checked.task, checked.data
    batch = task.collate(data.train[:8], data, seed=0)
    model = hfport.AutoModelForSequenceClassification.from_pretrained(
        model_dir, id2label={0: "LABEL_0"}, ignore_mismatched_sizes=True).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(40):
        optimizer.zero_grad()
        loss = task.loss(task.forward(model, batch, data), batch, data, None, 0.0)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert abs(losses[0] - torch.log(torch.tensor(6.0)).item()) < 0.05  # six candidates, near-uniform at first
    assert losses[-1] < 0.9 * losses[0], losses[::5]


def test_verify_fails_when_the_cross_encoder_would_score_differently(model_dir, tmp_path):
    finetune(cfg(model_dir, tmp_path, max_steps=2, eval_strategy="no"), progress=False)
    folder = tmp_path / "run" / "final"
    out = hfport.export(tmp_path / "run", tmp_path / "export", which="final")
    assert "sentence_transformers" in json.loads((tmp_path / "export" / "config.json").read_text())
    assert out.task == "text-classification"
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    config["sentence_transformers"]["activation_fn"] = "torch.nn.modules.linear.Identity"  # raw logits
    (tmp_path / "export" / "config.json").write_text(json.dumps(config))
    report = verify(tmp_path / "export", folder)
    failed = {r.output for r in report.failures}
    assert "CrossEncoder activation" in failed and "predict" in failed


@pytest.mark.parametrize("train_rows, eval_rows, options, fragment", [
    (None, [{"query": "q", "positive": "p", "negatives": ["n"]}, {"query": "r", "text": "x", "label": 0}], {},
     "eval.jsonl, line 2, field 'negatives': missing"),
    ([{"query": "q", "text": "t", "label": 1}, {"query": "q", "text": "u", "label": 0}],
     [{"query": "q", "text": "t", "label": 0}, {"query": "q", "text": "u", "label": 0}], {},
     "evaluation query 'q' has no relevant document"),
    ([{"query": "q", "text": "t", "label": 1}, {"query": "r", "text": "u", "label": 1.5}], None, {},
     "line 2, field 'label': label 1.5 is outside score_range"),
    ([{"query": "q", "text": "t", "label": 1}, {"query": "r", "text": "u", "label": 1}], None, {"loss": "listwise"},
     "the listwise loss needs each query to have a relevant text and another candidate"),
    ([{"query": "q", "positive": "p", "negatives": "n"}], None, {}, "field 'negatives': expected a list"),
    ([{"query": "", "text": "t", "label": 1}], None, {}, "line 1, field 'query': expected non-empty text"),
    ([{"query": "q", "text": "t", "label": 1}], None, {"loss": "mnrl"}, "loss 'mnrl' is not a text-ranking loss"),
])
def test_bad_ranking_data_is_named(model_dir, tmp_path, train_rows, eval_rows, options, fragment):
    train = write_jsonl(tmp_path / "train.jsonl", train_rows) if train_rows else DATA / "rerank_train.jsonl"
    evaluation = write_jsonl(tmp_path / "eval.jsonl", eval_rows) if eval_rows else None
    with pytest.raises((DataError, ConfigError)) as e:
        preflight(cfg(model_dir, tmp_path, **{"train": str(train), "eval": str(evaluation) if evaluation else None,
                                               "eval_fraction": 0.0, "batch_size": 1, **options}))
    assert fragment in str(e.value)
