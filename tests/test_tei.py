"""TEI-compatible routes against a real `hfport serve --model ...` on loopback: the real all-MiniLM-L6-v2 as the
default (embedding) model, a tiny one-label classifier as a reranker, a tiny 3-label classifier; results compared
with hfport.pipeline on the same inputs, errors in TEI's shape and codes, /metrics, and huggingface_hub's
InferenceClient pointed at the server's base URL.

Tolerance: 1e-5 absolute against the in-process pipeline. The server batches the same rows with other rows (and
under another token budget), so float32 sums may differ in the last bits; 1e-5 is the project's fp32 parity bound."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import httpx
import pytest
import torch

import hfport
from tests.serving import assert_error

ATOL = 1e-5


def close(a, b, atol: float = ATOL) -> None:
    torch.testing.assert_close(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64),
                               atol=atol, rtol=0)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, minilm_path) -> dict[str, Path]:
    from tests.tiny import save_hf
    from tests.tiny_tokenizers import make_folder

    root = tmp_path_factory.mktemp("tei-models")
    cls = make_folder(root, "bert", "sequence-classification")
    rr = root / "reranker"
    tok = hfport.AutoTokenizer.from_pretrained(cls)
    save_hf("bert", "sequence-classification", rr, seed=3, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
            id2label={0: "LABEL_0"}, label2id={"LABEL_0": 0})
    for f in cls.iterdir():
        if f.name.startswith(("tokenizer", "special", "vocab")):
            shutil.copy(f, rr / f.name)
    return {"minilm": minilm_path, "cls": cls, "rr": rr}


@pytest.fixture(scope="module")
def server(folders, serve_models):  # minilm first: the default model
    return serve_models(folders, HFPORT_PREDICT_MAX_INPUTS="8", HFPORT_BATCH_TOKEN_BUDGETS="[256, 512]")


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def pipes(folders):
    return {"minilm": hfport.pipeline("sentence-embedding", model=folders["minilm"]),
            "cls": hfport.pipeline("text-classification", model=folders["cls"]),
            "rr": hfport.pipeline("text-classification", model=folders["rr"])}


TEXTS = ["Paris is the capital of France.", "The cat sat on the mat.", "How do I reset my password?"]


def test_info_and_health(client):
    health = client.get("/health")
    assert health.status_code == 200 and health.json()["dtype"] == "float32"  # HFPORT_PREDICT_DTYPE
    served_on = "cpu" if not torch.cuda.is_available() else hfport.pipelines.device_name("cuda:0")  # HFPORT_DEVICE
    assert health.json()["device"] == served_on
    info = client.get("/info").json()
    assert info["model_id"] == "minilm" and info["model_type"] == {"embedding": {"pooling": "mean"}}
    assert info["model_dtype"] == "float32" and info["model_device"] == health.json()["device"]
    assert info["max_input_length"] == 256  # sentence_bert_config.json, below the 512 positions
    assert info["max_batch_tokens"] in (256, 512)  # picked by timing both budgets
    assert info["max_client_batch_size"] == 8
    rr = client.get("/info", headers={"x-model": "rr"}).json()["model_type"]
    assert list(rr) == ["reranker"]
    cls = client.get("/info", headers={"x-model": "cls"}).json()["model_type"]
    assert list(cls) == ["classifier"] and len(cls["classifier"]["id2label"]) == 3


def test_embed_matches_pipeline(client, pipes):
    r = client.post("/embed", json={"inputs": TEXTS})
    assert r.status_code == 200, r.text
    close(r.json(), pipes["minilm"](TEXTS, normalize=True))
    for h in ("x-compute-time", "x-tokenization-time", "x-queue-time", "x-inference-time"):
        assert int(r.headers[h]) >= 0
    one = client.post("/embed", json={"inputs": TEXTS[0], "normalize": False}).json()
    assert len(one) == 1
    close(one[0], pipes["minilm"](TEXTS[0], normalize=False))
    # Matryoshka: the first 32 values of the unnormalized vector, normalized
    cut = client.post("/embed", json={"inputs": TEXTS[:1], "dimensions": 32}).json()[0]
    full = torch.tensor(pipes["minilm"](TEXTS[0], normalize=False))
    close(cut, torch.nn.functional.normalize(full[:32], dim=0).tolist())
    assert math.isclose(sum(x * x for x in cut), 1.0, rel_tol=1e-5)
    ids = pipes["minilm"].tokenizer(TEXTS[0])["input_ids"]
    close(client.post("/embed", json={"inputs": ids}).json()[0], pipes["minilm"](TEXTS[0]))  # token ids


def test_embed_all_and_truncation(client, pipes):
    out = client.post("/embed_all", json={"inputs": "short text"}).json()
    n = len(pipes["minilm"].tokenizer("short text")["input_ids"])
    assert len(out) == 1 and len(out[0]) == n and len(out[0][0]) == 384
    close(out[0], pipes["minilm"]("short text", output="tokens"))
    long = " ".join(["word"] * 400)
    # HFPORT_AUTO_TRUNCATE is on by default (as TEI's): a request's own truncate=false refuses the long input
    assert_error(client.post("/embed", json={"inputs": [long], "truncate": False}), 413, "Validation")
    for side in ("Right", "Left"):
        r = client.post("/embed", json={"inputs": [long + " end"], "truncate": True, "truncation_direction": side})
        assert r.status_code == 200, r.text
        close(r.json()[0], pipes["minilm"](long + " end", truncate=True, truncation_direction=side.lower()))
    right = client.post("/embed", json={"inputs": ["tail " + long], "truncate": True}).json()[0]
    left = client.post("/embed", json={"inputs": ["tail " + long], "truncate": True,
                                       "truncation_direction": "Left"}).json()[0]
    assert max(abs(a - b) for a, b in zip(right, left)) > 1e-4  # the two sides keep different tokens


def test_bad_input_in_tei_shape(client):
    assert_error(client.post("/embed", json={"inputs": []}), 400, "Empty")
    assert_error(client.post("/embed", json={"inputs": ["ok", "  "]}), 400, "Empty")
    assert_error(client.post("/embed", json={"inputs": ["x"] * 9}), 413, "Validation")
    assert_error(client.post("/embed", json={"inputs": "x", "dimensions": 385}), 422, "Validation")
    assert_error(client.post("/embed", json={"inputs": "x", "bogus": 1}), 422, "Validation")
    assert_error(client.post("/embed", json={"inputs": "x", "prompt_name": "query"}), 422, "Validation")
    assert_error(client.post("/embed", json={"inputs": "x"}, headers={"x-model": "nope"}), 404, "ModelNotFound")
    body = assert_error(client.post("/rerank", json={"query": "q", "texts": ["a"]}), 424, "Backend")
    assert "reranker" in body["error"]
    assert_error(client.post("/rerank", json={"query": "q", "texts": ["a"]}, headers={"x-model": "cls"}), 424,
                 "Backend")
    assert_error(client.post("/rerank", json={"query": "q", "texts": []}, headers={"x-model": "rr"}), 400, "Empty")
    body = assert_error(client.post("/embed", json={"inputs": "x"}, headers={"x-model": "cls"}), 424, "Backend")
    assert body["error"] == "model 'cls' is not an embedding model (it is: classifier); /embed needs one", body
    # an empty text inside a pair is an empty text (400 Empty), naming which half, as an empty text alone is
    for inputs, where in [(["a", " "], "inputs[0].text_pair"), ([["a", "b"], ["", "b"]], "inputs[1].text")]:
        body = assert_error(client.post("/predict", json={"inputs": inputs}, headers={"x-model": "cls"}), 400, "Empty")
        assert body["error"] == f"{where} is empty", body


def test_predict_both_shapes(client, pipes):
    want = pipes["cls"](TEXTS[0], top_k=None)
    r = client.post("/predict", json={"inputs": TEXTS[0]}, headers={"x-model": "cls"})
    assert r.status_code == 200, r.text
    got = r.json()
    assert [p["label"] for p in got] == [p["label"] for p in want]
    close([p["score"] for p in got], [p["score"] for p in want])
    batch = client.post("/predict", json={"inputs": [[TEXTS[0], TEXTS[1]], [TEXTS[2], TEXTS[0]]],
                                          "raw_scores": True}, headers={"x-model": "cls"}).json()
    raw = pipes["cls"]([{"text": TEXTS[0], "text_pair": TEXTS[1]}, {"text": TEXTS[2], "text_pair": TEXTS[0]}],
                       top_k=None, function_to_apply="none")
    assert len(batch) == 2
    for g, w in zip(batch, raw):
        close(sorted(p["score"] for p in g), sorted(p["score"] for p in w))
    # a batch mixing texts and pairs, as TEI's PredictInput takes it (docs/serving.md: [str | [a, b]])
    mixed = client.post("/predict", json={"inputs": [TEXTS[0], [TEXTS[1], TEXTS[2]], TEXTS[2]]},
                        headers={"x-model": "cls"})
    assert mixed.status_code == 200, mixed.text
    want = pipes["cls"]([TEXTS[0], {"text": TEXTS[1], "text_pair": TEXTS[2]}, TEXTS[2]], top_k=None)
    assert len(mixed.json()) == 3
    for g, w in zip(mixed.json(), want):
        assert [p["label"] for p in g] == [p["label"] for p in w]
        close([p["score"] for p in g], [p["score"] for p in w])
    # an input longer than a classifier or reranker takes, with truncate false: the refusal names the TEI body's
    # `truncate` (not transformers' truncation=, which this body refuses), and doing as it says answers
    long = " ".join(["word"] * 400)
    limit = pipes["cls"].max_positions
    for route, body, name, where in [("/predict", {"inputs": long}, "cls", "inputs[0]"),
                                     ("/rerank", {"query": "q", "texts": ["a", long]}, "rr", "texts[1]")]:
        refused = assert_error(client.post(route, json={**body, "truncate": False}, headers={"x-model": name}), 413,
                               "Validation")
        assert refused["error"] == (f"{where}: longer than the {limit} tokens the model takes; send truncate: true to "
                                    "cut it"), refused
        assert client.post(route, json={**body, "truncate": True}, headers={"x-model": name}).status_code == 200
    # hfport's native shape on the same path, unchanged
    native = client.post("/predict", json={"model": "cls", "inputs": TEXTS[0]}).json()
    assert set(native) == {"model", "task", "outputs"} and native["task"] == "text-classification"


def test_rerank_and_similarity(client, pipes):
    texts = ["a b c", "the capital of France", "nothing here", "Paris"]
    r = client.post("/rerank", json={"query": "Paris", "texts": texts, "return_text": True},
                    headers={"x-model": "rr"})
    assert r.status_code == 200, r.text
    ranks = r.json()
    scores = [s[0]["score"] for s in pipes["rr"]([{"text": "Paris", "text_pair": t} for t in texts], top_k=None,
                                                 function_to_apply="sigmoid")]
    assert [x["index"] for x in ranks] == sorted(range(4), key=lambda i: -scores[i])
    close([x["score"] for x in ranks], sorted(scores, reverse=True))
    assert all(x["text"] == texts[x["index"]] for x in ranks)
    assert "text" not in client.post("/rerank", json={"query": "Paris", "texts": texts},
                                     headers={"x-model": "rr"}).json()[0]
    sims = client.post("/similarity", json={"inputs": {"source_sentence": TEXTS[0], "sentences": TEXTS[1:]}}).json()
    e = torch.tensor(pipes["minilm"](TEXTS))
    close(sims, (e[1:] @ e[0]).tolist())


def test_tokenize_decode(client, pipes):
    toks = client.post("/tokenize", json={"inputs": ["Hello world"]}).json()[0]
    assert [t["text"] for t in toks] == ["[CLS]", "Hello", "world", "[SEP]"]
    assert toks[0]["special"] and not toks[1]["special"] and (toks[1]["start"], toks[1]["stop"]) == (0, 5)
    bare = client.post("/tokenize", json={"inputs": "Hello world", "add_special_tokens": False}).json()[0]
    assert len(bare) == 2
    ids = [t["id"] for t in toks]
    assert client.post("/decode", json={"ids": ids}).json() == ["hello world"]
    assert client.post("/decode", json={"ids": [ids], "skip_special_tokens": False}).json() == [
        "[CLS] hello world [SEP]"]
    assert_error(client.post("/decode", json={"ids": [10 ** 9]}), 422, "Tokenizer")


def test_root_routes_by_kind(client, pipes):
    close(client.post("/", json={"inputs": TEXTS[0]}).json(), [pipes["minilm"](TEXTS[0])])
    sims = client.post("/", json={"inputs": {"source_sentence": "a", "sentences": ["a", "b"]}}).json()
    assert len(sims) == 2 and math.isclose(sims[0], 1.0, rel_tol=1e-5)
    got = client.post("/", json={"inputs": TEXTS[0]}, headers={"x-model": "cls"}).json()
    assert [p["label"] for p in got] == [p["label"] for p in pipes["cls"](TEXTS[0], top_k=None)]


def test_huggingface_hub_inference_client(server, pipes, monkeypatch):
    from huggingface_hub import InferenceClient, constants

    # offline mode blocks every request huggingface_hub makes, loopback included; this client only talks to the
    # local server (base_url), never to the Hub
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    client = InferenceClient(base_url=server.url)
    emb = client.feature_extraction("Paris is the capital of France.")
    assert emb.shape == (1, 384)
    close(emb.tolist(), [pipes["minilm"]("Paris is the capital of France.")])
    sims = client.sentence_similarity(TEXTS[0], other_sentences=TEXTS[1:])
    e = torch.tensor(pipes["minilm"](TEXTS))
    close(sims, (e[1:] @ e[0]).tolist())
    cls = InferenceClient(base_url=server.url, headers={"x-model": "cls"})
    got = cls.text_classification(TEXTS[0])
    want = pipes["cls"](TEXTS[0], top_k=None)
    assert [g.label for g in got] == [w["label"] for w in want]
    close([g.score for g in got], [w["score"] for w in want])
    top = cls.text_classification(TEXTS[0], top_k=1)
    assert len(top) == 1 and top[0].label == want[0]["label"]


def test_metrics(client):
    client.post("/embed", json={"inputs": ["metrics please"]})
    text = client.get("/metrics").text
    assert 'hfport_requests_total{model="minilm",route="/embed",status="200"}' in text
    assert 'hfport_requests_total{model="minilm",route="/embed",status="400"}' in text
    for name in ("hfport_batch_size_count", "hfport_tokenization_duration_seconds_bucket",
                 "hfport_inference_duration_seconds_sum", "hfport_queue_duration_seconds_count",
                 "hfport_queue_size", 'hfport_model_memory_bytes{model="minilm",task="sentence-embedding"}',
                 'hfport_max_batch_tokens{model="minilm"}', "hfport_models_loaded 3.0"):
        assert name in text, name


def test_serve_refuses_a_bad_model(tmp_path):
    from typer.testing import CliRunner

    from hfport.cli import app

    result = CliRunner().invoke(app, ["serve", "--data-dir", str(tmp_path), "--model", str(tmp_path / "nope")])
    assert result.exit_code == 1
    assert "not a folder" in result.output


def test_serve_refuses_two_models_of_one_name(tmp_path, folders):
    """Two --model specs of one name, given or taken from their folders' names: the later would replace the earlier
    unseen, so the service refuses to start (`hfport serve` prints the ApiError's message and exits 1, as
    test_serve_refuses_a_bad_model checks), naming both."""
    from server.app import create_app
    from server.errors import ApiError
    from server.settings import Settings

    a, b = tmp_path / "a" / "model", tmp_path / "b" / "model"
    shutil.copytree(folders["cls"], a)
    shutil.copytree(folders["rr"], b)
    for first, second, name in [(f"x={a}", f"x={b}", "x"), (str(a), str(b), "model")]:
        with pytest.raises(ApiError) as refused:
            create_app(Settings(data_dir=tmp_path / "data", models=[first, second]), run_worker=False)
        assert (f"--model / HFPORT_MODELS '{second}': the name '{name}' is also --model '{first}''s"
                in refused.value.message)


def test_models_setting_parses_env(monkeypatch):
    from server.settings import Settings

    monkeypatch.setenv("HFPORT_MODELS", "a=/x, /y")
    assert Settings().models == ["a=/x", "/y"]
    monkeypatch.setenv("HFPORT_MODELS", json.dumps(["b=/z"]))
    assert Settings().models == ["b=/z"]
