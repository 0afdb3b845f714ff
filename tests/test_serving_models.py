"""The model a request names, on every route that serves one, in process (TestClient over create_app without the
worker): a registered model that fails to load for any reason is its protocol's clear 4xx naming the model and the
cause, and the other models keep serving."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.serving import cache
from server.settings import Settings
from tests.tiny_tokenizers import make_folder


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """The allowed dir: models/base (a tiny bare encoder, the default) and models/broken (a copy of it, broken by the
    tests that need it at load time)."""
    root = tmp_path_factory.mktemp("allowed")
    make_folder(root / "models", "bert", "base").rename(root / "models" / "base")
    shutil.copytree(root / "models" / "base", root / "models" / "broken")
    return root


@pytest.fixture
def client(tmp_path, root):
    app = create_app(Settings(data_dir=tmp_path / "data", allowed_dirs=[root], predict_dtype="float32",
                              batch_token_budgets=[], models=[f"base={root / 'models' / 'base'}"]), run_worker=False)
    with TestClient(app, raise_server_exceptions=False) as c:  # as a client sees it: a 500, not a raise
        assert app.state.startup.ready.wait(120) and app.state.startup.error is None
        yield c


def requests_for(name: str) -> dict[str, tuple]:
    """Every route that loads a model, asking for `name`: (method, path, json body, headers)."""
    tei = {"x-model": name}
    return {"tei /embed": ("post", "/embed", {"inputs": "a text"}, tei),
            "tei /info": ("get", "/info", None, tei),
            "tei /tokenize": ("post", "/tokenize", {"inputs": "a text"}, tei),
            "tei POST /": ("post", "/", {"inputs": "a text"}, tei),
            "openai": ("post", "/v1/embeddings", {"input": "a text", "model": name}, {}),
            "native /predict": ("post", "/predict", {"model": name, "inputs": "a text"}, {})}


def send(client: TestClient, method: str, path: str, body, headers):
    return client.request(method, path, json=body, headers=headers)


def message(r) -> str:
    body = r.json()
    return body["error"]["message"] if isinstance(body["error"], dict) else body["error"]


@pytest.mark.parametrize("fault", ["io-error-reading-weights", "runtime-error-at-warm-up"])
def test_a_model_that_fails_to_load_is_a_424_naming_it_and_the_cause_and_the_rest_serve(client, root, monkeypatch,
                                                                                         fault):
    """An OSError reading the weights (a failing disk: EIO) and a runtime's RuntimeError at warm-up (out of memory)
    are no HfportError: each was a 500 'internal error'. They are injected at the two calls the cache makes, for the
    broken folder only."""
    broken = str(root / "models" / "broken")
    load, tune = cache.pipeline, cache.tune_batch_tokens
    cause = {"io-error-reading-weights": "OSError: [Errno 5] Input/output error",
             "runtime-error-at-warm-up": "RuntimeError: out of memory"}[fault]
    from_broken: list = []  # the pipelines read from the broken folder

    def failing_load(task, model, **kw):
        if str(model) == broken and fault == "io-error-reading-weights":
            raise OSError(errno.EIO, "Input/output error", f"{broken}/model.safetensors")
        pipe = load(task, model=model, **kw)
        if str(model) == broken:
            from_broken.append(pipe)
        return pipe

    def failing_warm_up(pipe, budgets):
        if any(pipe is p for p in from_broken):
            raise RuntimeError("out of memory")
        return tune(pipe, budgets)
    monkeypatch.setattr(cache, "pipeline", failing_load)
    monkeypatch.setattr(cache, "tune_batch_tokens", failing_warm_up)
    assert client.post("/models", json={"name": "broken", "path": broken}).status_code == 201
    for route, (method, path, body, headers) in requests_for("broken").items():
        r = send(client, method, path, body, headers)
        assert r.status_code == 424, (route, r.status_code, r.text)
        assert "model 'broken' failed to load" in message(r) and cause in message(r), (route, r.text)
        if route == "openai":
            assert r.json()["error"]["code"] == "model_not_supported" and r.json()["error"]["param"] == "model"
        else:
            assert r.json()["error_type"] == "Backend", (route, r.text)
    # the server still serves: the default, and another model by name
    assert client.get("/health").status_code == 200
    assert client.post("/embed", json={"inputs": "a text"}).status_code == 200
    assert client.post("/predict", json={"model": "base", "inputs": "a text"}).status_code == 200
    # nothing of the failed load stayed behind: once the fault is gone the model loads on the next request
    monkeypatch.undo()
    for route, (method, path, body, headers) in requests_for("broken").items():
        r = send(client, method, path, body, headers)
        assert r.status_code == 200, (route, r.status_code, r.text)
