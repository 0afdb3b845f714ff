"""POST /v1/embeddings with the `openai` Python client (nobody here wrote it) against a real `hfport serve --model`
on loopback, compared with hfport.pipeline on the same inputs (1e-5 absolute: the project's fp32 bound; the server
batches rows with others). The client asks for base64 by default and decodes it itself, so that path is the one
exercised first; float is asked for explicitly. Errors in OpenAI's {"error": {message, type, param, code}} shape."""

from __future__ import annotations

import httpx
import pytest
import torch

import hfport

TEXTS = ["Paris is the capital of France.", "The cat sat on the mat.", "How do I reset my password?"]


def close(a, b) -> None:
    torch.testing.assert_close(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64),
                               atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def server(minilm_path, serve_models):
    # the suite's one server started as `python -m hfport serve` in a fresh interpreter (the others: fork-server
    # children, tests/serving.py). One budget of 512 tokens: the load's one warm-up pass is 4 rows of 128 tokens,
    # where "[]" warmed up at the pipeline's own 16384 (the real MiniLM: ~4.5 s of start-up on one core, more on a
    # loaded one). Every request here fits it (the longest row is cut at 256 tokens), and batching is not what these
    # tests check (test_serving_batching.py, test_tei.py do).
    return serve_models({"minilm": minilm_path}, forked=False, HFPORT_BATCH_TOKEN_BUDGETS="[512]")


@pytest.fixture(scope="module")
def pipe(minilm_path):
    return hfport.pipeline("sentence-embedding", model=minilm_path)


@pytest.fixture(scope="module")
def oai(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_openai_client_embeddings(oai, pipe):
    r = oai.embeddings.create(input=TEXTS, model="minilm")  # base64 on the wire, decoded by the client
    assert r.model == "minilm" and [d.index for d in r.data] == [0, 1, 2]
    close([d.embedding for d in r.data], pipe(TEXTS, normalize=True))
    n = sum(len(pipe.tokenizer(t)["input_ids"]) for t in TEXTS)
    assert r.usage.prompt_tokens == r.usage.total_tokens == n
    f = oai.embeddings.create(input=TEXTS[0], model="minilm", encoding_format="float", user="someone")
    assert len(f.data) == 1
    close(f.data[0].embedding, pipe(TEXTS[0]))
    d = oai.embeddings.create(input=[TEXTS[0]], model="minilm", dimensions=64).data[0].embedding
    full = torch.tensor(pipe(TEXTS[0], normalize=False))
    close(d, torch.nn.functional.normalize(full[:64], dim=0).tolist())
    ids = pipe.tokenizer(TEXTS[1])["input_ids"]
    close(oai.embeddings.create(input=[ids], model="minilm").data[0].embedding, pipe(TEXTS[1]))


def test_openai_errors(oai, server):
    import openai

    with pytest.raises(openai.NotFoundError):
        oai.embeddings.create(input="x", model="text-embedding-3-small")
    with pytest.raises(openai.BadRequestError) as e:
        oai.embeddings.create(input="x", model="minilm", dimensions=1000)
    assert "384" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        oai.embeddings.create(input=[], model="minilm")
    r = httpx.post(server.url + "/v1/embeddings", json={"input": ["x"], "encoding_format": "hex"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == "encoding_format"
    long = httpx.post(server.url + "/v1/embeddings", json={"input": " ".join(["word"] * 400)})
    assert long.status_code == 200 and long.json()["usage"]["prompt_tokens"] == 256  # HFPORT_AUTO_TRUNCATE: on
    # no `model`: the server's default; the header names the model too
    ok = httpx.post(server.url + "/v1/embeddings", json={"input": "x"})
    assert ok.status_code == 200 and ok.json()["model"] == "minilm" and "x-inference-time" in ok.headers
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["id"] == "minilm"


def test_a_body_that_is_not_json_gets_openais_error_shape(tmp_path):
    """FastAPI refuses an unparseable body before the route runs; OpenAI's clients still get OpenAI's shape."""
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.settings import Settings

    with TestClient(create_app(Settings(data_dir=tmp_path / "d"), run_worker=False)) as c:
        r = c.post("/v1/embeddings", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code in (400, 422), r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error", error
