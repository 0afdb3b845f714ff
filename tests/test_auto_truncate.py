"""HFPORT_AUTO_TRUNCATE (TEI's --auto-truncate, on by default since TEI 1.9) on every TEI route and OpenAI's
/v1/embeddings, in process (TestClient over create_app, tiny models): a long input is cut at the model's maximum length
unless a TEI request says truncate=false (TEI's `req.truncate.unwrap_or(info.auto_truncate)`); off, the refusal names
only switches that exist. Also truncate/truncation as one pipeline option, and `hfport predict -o truncation=True`.

Results are compared with hfport.pipeline on the same inputs at 1e-5 (the project's fp32 bound: the server batches
the same rows under its own token budget)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

import hfport
from server.app import create_app
from server.settings import Settings

LONG = " ".join(["word"] * 3000)  # 3,000 words: far past the tiny models' 128 positions, under 20,000 characters


def close(a, b) -> None:
    torch.testing.assert_close(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64),
                               atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    from tests.tiny import save_hf
    from tests.tiny_tokenizers import make_folder

    root = tmp_path_factory.mktemp("auto-truncate")
    emb = make_folder(root, "bert", "base")
    cls = make_folder(root, "bert", "sequence-classification")
    rr = root / "reranker"
    tok = hfport.AutoTokenizer.from_pretrained(cls)
    save_hf("bert", "sequence-classification", rr, seed=3, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
            id2label={0: "LABEL_0"}, label2id={"LABEL_0": 0})
    for f in cls.iterdir():
        if f.name.startswith(("tokenizer", "special", "vocab")):
            shutil.copy(f, rr / f.name)
    return {"emb": emb, "cls": cls, "rr": rr}


def app_client(tmp_path: Path, folders: dict[str, Path], **settings) -> TestClient:
    models = [f"{name}={folder}" for name, folder in folders.items()]  # emb first: the default model
    app = create_app(Settings(data_dir=tmp_path / "data", models=models, predict_dtype="float32",
                              batch_token_budgets=[], **settings), run_worker=False)
    return TestClient(app)


@pytest.fixture(scope="module")
def on(tmp_path_factory, folders):
    with app_client(tmp_path_factory.mktemp("on"), folders) as client:
        yield client


@pytest.fixture(scope="module")
def off(tmp_path_factory, folders):
    with app_client(tmp_path_factory.mktemp("off"), folders, auto_truncate=False) as client:
        yield client


@pytest.fixture(scope="module")
def pipes(folders):
    return {"emb": hfport.pipeline("sentence-embedding", model=folders["emb"]),
            "rr": hfport.pipeline("text-classification", model=folders["rr"]),
            "cls": hfport.pipeline("text-classification", model=folders["cls"])}


def test_default_is_on_as_tei(on, off):
    assert Settings().auto_truncate is True
    assert on.get("/info").json()["auto_truncate"] is True
    assert off.get("/info").json()["auto_truncate"] is False


def test_tei_routes_cut_long_inputs_unless_the_request_says_no(on, pipes):
    r = on.post("/embed", json={"inputs": [LONG]})
    assert r.status_code == 200, r.text
    close(r.json()[0], pipes["emb"](LONG, truncate=True, normalize=True))
    r = on.post("/embed", json={"inputs": [LONG], "truncate": False})  # the request's own false wins, as in TEI
    assert r.status_code == 413 and r.json()["error_type"] == "Validation", r.text
    assert "truncate=True" in r.json()["error"]  # a field /embed has
    assert on.post("/embed_all", json={"inputs": LONG}).status_code == 200
    assert on.post("/similarity", json={"inputs": {"source_sentence": LONG, "sentences": ["a b"]}}).status_code == 200
    # a reranker and a classifier cut at their position table (the tiny tokenizer's own limit is lower: 64)
    limit = pipes["rr"].max_positions
    r = on.post("/rerank", json={"query": "word", "texts": [LONG, "a b"], "raw_scores": True},
                headers={"x-model": "rr"})
    assert r.status_code == 200, r.text
    scores = {x["index"]: x["score"] for x in r.json()}
    theirs = pipes["rr"]({"text": "word", "text_pair": LONG}, truncation=True, max_length=limit, top_k=None,
                         function_to_apply="none")
    close(scores[0], theirs[0]["score"])
    r = on.post("/predict", json={"inputs": LONG, "raw_scores": True}, headers={"x-model": "cls"})
    assert r.status_code == 200, r.text
    theirs = pipes["cls"](LONG, truncation=True, max_length=limit, top_k=None, function_to_apply="none")
    close(sorted(x["score"] for x in r.json()), sorted(x["score"] for x in theirs))
    r = on.post("/predict", json={"inputs": LONG, "truncate": False}, headers={"x-model": "cls"})
    assert r.status_code == 413, r.text


def test_off_refuses_unless_the_request_asks(off, pipes):
    r = off.post("/embed", json={"inputs": [LONG]})
    assert r.status_code == 413, r.text
    r = off.post("/embed", json={"inputs": [LONG], "truncate": True})
    assert r.status_code == 200, r.text
    close(r.json()[0], pipes["emb"](LONG, truncate=True, normalize=True))
    assert off.post("/rerank", json={"query": "q", "texts": [LONG]}, headers={"x-model": "rr"}).status_code == 413
    r = off.post("/rerank", json={"query": "q", "texts": [LONG], "truncate": True}, headers={"x-model": "rr"})
    assert r.status_code == 200, r.text


def test_openai_embeddings(on, off, pipes):
    r = on.post("/v1/embeddings", json={"input": LONG})
    assert r.status_code == 200, r.text
    close(r.json()["data"][0]["embedding"], pipes["emb"](LONG, truncate=True, normalize=True))
    ids = pipes["emb"].tokenizer(LONG)["input_ids"]  # token ids are cut too
    r = on.post("/v1/embeddings", json={"input": [ids]})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == pipes["emb"].max_input_length, r.text
    # OpenAI's body has no truncate: refused as an unknown field, and no message ever asks for one
    assert on.post("/v1/embeddings", json={"input": LONG, "truncate": True}).status_code == 400
    r = off.post("/v1/embeddings", json={"input": ["short", LONG]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["type"] == "invalid_request_error", err
    assert err["message"].startswith("input[1]: ") and "HFPORT_AUTO_TRUNCATE" in err["message"], err
    assert f"{pipes['emb'].max_input_length} tokens" in err["message"] and "truncate=" not in err["message"], err


def test_the_character_limit_names_its_setting(tmp_path, folders):
    with app_client(tmp_path, {"emb": folders["emb"]}, predict_max_chars=100) as client:
        for path, body in (("/embed", {"inputs": "x" * 101}), ("/v1/embeddings", {"input": "x" * 101})):
            r = client.post(path, json=body)
            assert r.status_code == 413 and "HFPORT_PREDICT_MAX_CHARS" in r.text, r.text


# --- truncate and truncation: one option in every pipeline ---------------------------------------------------------

def test_pipelines_take_both_spellings(pipes):
    emb, cls = pipes["emb"], pipes["cls"]
    close(emb(LONG, truncation=True), emb(LONG, truncate=True))
    assert cls(LONG, truncate=True) == cls(LONG, truncation=True)
    assert emb(LONG, truncate=True, truncation=True) == emb(LONG, truncate=True)  # the same value twice is fine
    with pytest.raises(ValueError, match="spelled two ways"):
        cls("a b", truncate=True, truncation=False)
    with pytest.raises(ValueError, match="truncate='only_first': expected True or False"):
        emb("a b", truncation="only_first")
    with pytest.raises(hfport.pipelines.InputTooLongError, match="pass truncation=True"):
        cls(LONG)


def test_cli_reads_python_spelled_values(folders):
    from typer.testing import CliRunner

    from hfport.cli import _option, app

    assert _option("truncation=True") == ("truncation", True)
    assert _option("top_k=None") == ("top_k", None) and _option("label=Truest") == ("label", "Truest")
    result = CliRunner().invoke(app, ["predict", str(folders["cls"]), LONG, "--task", "text-classification",
                                      "-o", "truncation=True"])
    assert result.exit_code == 0, result.output
    assert set(json.loads(result.output.splitlines()[-1])) == {"label", "score"}, result.output
