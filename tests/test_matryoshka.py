"""Matryoshka: matryoshka_dims on sentence-embedding training is sentence-transformers' MatryoshkaLoss (checked
against it on the same model and texts), evaluation reports every dimension, best/ and final/ record the dimensions
(config_sentence_transformers.json) and sentence-transformers still loads them, and the server refuses an untrained
`dimensions` only under HFPORT_STRICT_DIMENSIONS.

A tiny random BERT without dropout and MiniLM's WordPiece tokenizer; the examples/data retrieval files.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import hfport
from hfport.errors import ConfigError
from hfport.formats.sentence_transformers import read_layout
from hfport.train.loop import finetune
from hfport.train.preflight import preflight
from hfport.train.tasks.embedding import matryoshka_loss, mnrl_loss
from tests.data import DATA
from tests.finetuning import embedding_config as cfg

torch.set_num_threads(1)


def test_matryoshka_loss_is_sentence_transformers_matryoshka_loss(tiny_bert):
    """Their MatryoshkaLoss(MNRL) on a SentenceTransformer's features = ours on the same model's embeddings."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.losses import MatryoshkaLoss, MultipleNegativesRankingLoss

    st = SentenceTransformer(str(tiny_bert), device="cpu")  # mean pooling, no normalize: the bare folder's default
    rows = [json.loads(x) for x in (DATA / "embed_train.jsonl").read_text().splitlines()[:6]]
    anchors, positives = [r["anchor"] for r in rows], [r["positive"] for r in rows]
    dims, weights = [32, 16, 8], [1.0, 0.5, 2.0]
    theirs = MatryoshkaLoss(st, MultipleNegativesRankingLoss(st, scale=20.0), dims, weights)(
        [st.preprocess(anchors), st.preprocess(positives)], None)
    with torch.no_grad():
        embeddings = st.encode(anchors + positives, convert_to_tensor=True)  # (2B, C): every text distinct
    index = torch.arange(12).view(2, 6).T  # (B, 2): anchor and positive rows
    ours = matryoshka_loss(lambda e: mnrl_loss(e, index, 20.0), embeddings, dims, weights)
    torch.testing.assert_close(ours, theirs.detach(), rtol=1e-5, atol=1e-6)
    # the weights count: each dimension's term is its own loss
    alone = matryoshka_loss(lambda e: mnrl_loss(e, index, 20.0), embeddings, [8], [1.0])
    assert not torch.allclose(ours, alone)


def test_matryoshka_training_reports_each_dimension_and_records_them(tiny_bert, tmp_path):
    config = cfg(tiny_bert, tmp_path, max_steps=6, matryoshka_dims=[32, 16, 8], matryoshka_weights=[1, 1, 1],
                 metric="dim_8_ndcg@10")  # a dimension's metric may pick best/
    checked = preflight(config)
    finetune(config, progress=False)
    evals = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if json.loads(x)["type"] == "eval"]
    assert {"eval_ndcg@10", "eval_dim_32_ndcg@10", "eval_dim_16_ndcg@10", "eval_dim_8_ndcg@10"} <= set(evals[-1])
    # what a config's metric may name (the preflight's check) is what evaluation reports
    assert set(evals[-1]) - {"type", "step", "epoch"} == {f"eval_{n}" for n in ["loss", *checked.task.metric_names(
        checked.data)]}
    assert evals[-1]["eval_dim_32_ndcg@10"] == pytest.approx(evals[-1]["eval_ndcg@10"])  # 32 is the full size
    for which in ("best", "final"):
        assert read_layout(tmp_path / "run" / which).matryoshka_dims == (32, 16, 8)
        config = json.loads((tmp_path / "run" / which / "config_sentence_transformers.json").read_text())
        assert config["matryoshka_dims"] == [32, 16, 8]
    # both export formats that keep the sentence-transformers layout keep the dimensions
    for fmt in ("hf", "sentence-transformers"):
        hfport.export(tmp_path / "run", tmp_path / fmt, format=fmt)
        assert read_layout(tmp_path / fmt).matryoshka_dims == (32, 16, 8)
    # sentence-transformers still loads the folder and truncates as hfport's dimensions option does
    from sentence_transformers import SentenceTransformer

    texts = ["What is the capital of Peru?", "Shops in Chile take the peso."]
    theirs = SentenceTransformer(str(tmp_path / "run" / "best"), device="cpu", truncate_dim=16).encode(
        texts, convert_to_tensor=True, normalize_embeddings=True)
    mine = torch.tensor(hfport.pipeline("sentence-embedding", model=tmp_path / "run" / "best")(
        texts, dimensions=16, normalize=True))
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("options,fragment", [
    ({"matryoshka_dims": [64]}, "larger than the model's embeddings"),
    ({"matryoshka_dims": [16, 8], "matryoshka_weights": [1.0]}, "one weight per dimension"),
    ({"matryoshka_dims": [16, 16]}, "distinct positive sizes"),
    ({"matryoshka_weights": [1.0]}, "without matryoshka_dims"),
])
def test_bad_matryoshka_options_are_named(tiny_bert, tmp_path, options, fragment):
    with pytest.raises((ConfigError, ValueError), match=fragment):
        finetune(cfg(tiny_bert, tmp_path, max_steps=1, **options), progress=False)


def test_strict_dimensions_refuse_an_untrained_dimension_only_when_asked(tiny_bert, tmp_path):
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.settings import Settings
    from tests.serving import assert_error

    folder = tmp_path / "mrl"
    shutil.copytree(tiny_bert, folder)
    from hfport.formats.sentence_transformers import write_embedding_layout
    write_embedding_layout(folder, pooling="mean", normalize=False, hidden_size=32, max_seq_length=64,
                           matryoshka_dims=[16, 8])
    for strict in (False, True):
        settings = Settings(data_dir=tmp_path / f"d{strict}", allowed_dirs=[tmp_path], batch_token_budgets=[256],
                            predict_dtype="float32", strict_dimensions=strict)
        with TestClient(create_app(settings, run_worker=False)) as c:
            assert c.post("/models", json={"name": "mrl", "path": str(folder)}).status_code == 201
            headers = {"x-model": "mrl"}
            for dims in (8, 16, 32):  # trained (and the full size): always served
                r = c.post("/embed", json={"inputs": "hello", "dimensions": dims}, headers=headers)
                assert r.status_code == 200 and len(r.json()[0]) == dims, r.text
            r = c.post("/embed", json={"inputs": "hello", "dimensions": 12}, headers=headers)
            o = c.post("/v1/embeddings", json={"input": "hello", "dimensions": 12, "model": "mrl"})
            if not strict:
                assert r.status_code == 200 and len(r.json()[0]) == 12, r.text
                assert o.status_code == 200 and len(o.json()["data"][0]["embedding"]) == 12, o.text
                continue
            body = assert_error(r, 422, "Validation")
            assert "'mrl'" in body["error"] and "[8, 16, 32]" in body["error"], body
            assert o.status_code == 400 and "[8, 16, 32]" in o.json()["error"]["message"], o.text
