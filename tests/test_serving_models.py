"""The model a request names, on every route that serves one, in process (TestClient over create_app without the
worker): a registered model that fails to load for any reason is its protocol's clear 4xx naming the model and the
cause, and the other models keep serving; a name that is not registered (a request's model, a job's, an adapter's
base) is refused naming the registered ones, at most 20."""

from __future__ import annotations

import errno
import json
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

import hfport

from server.app import create_app
from server.serving import cache
from server.settings import Settings
from tests.tiny import save_random_adapter
from tests.tiny_tokenizers import make_folder


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """The allowed dir: models/base (a tiny bare encoder, the default) and models/broken (a copy of it, broken by the
    tests that need it at load time)."""
    root = tmp_path_factory.mktemp("allowed")
    make_folder(root / "models", "bert", "base").rename(root / "models" / "base")
    shutil.copytree(root / "models" / "base", root / "models" / "broken")
    return root


@contextmanager
def serve(tmp_path: Path, root: Path, *models: str):
    """The app started with `serve --model` for each of `models` (the first: the default), once the default is
    loaded."""
    app = create_app(Settings(data_dir=tmp_path / "data", allowed_dirs=[root], predict_dtype="float32",
                              batch_token_budgets=[], models=list(models)), run_worker=False)
    with TestClient(app, raise_server_exceptions=False) as c:  # as a client sees it: a 500, not a raise
        assert app.state.startup.ready.wait(120) and app.state.startup.error is None
        yield c


@pytest.fixture
def client(tmp_path, root):
    with serve(tmp_path, root, f"base={root / 'models' / 'base'}") as c:
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


@pytest.fixture
def adapter_folder(tmp_path, root) -> Path:
    """A LoRA adapter (feature extraction) over models/base, inside the allowed dir."""
    out = root / "adapters" / tmp_path.name
    model = hfport.tasks.get("feature-extraction").model_class.from_pretrained(root / "models" / "base")
    save_random_adapter(model, out, base=root / "models" / "base", seed=1, r=4, alpha=8, targets=["q", "v"])
    return out


@pytest.mark.parametrize("how", ["unknown target module", "rank mismatch", "no adapter_config.json"])
def test_a_failed_adapter_load_keeps_nothing_of_its_base_in_memory(tmp_path, root, adapter_folder, monkeypatch, how):
    """An adapter registered over a base that is not loaded, whose folder broke after registration: its request loads
    the base for it, then the adapter fails. The base's pipeline stayed in the cache's tables with no cached record
    using it: its weights held, in no memory gauge, never evicted. Now nothing of the failed load stays (the models
    the cache loaded are collected; the gauges say nothing is loaded), and the base and the repaired adapter serve."""
    import gc
    import weakref

    loaded: list[weakref.ref] = []  # the model of every pipeline the cache loads
    load = cache.pipeline
    monkeypatch.setattr(cache, "pipeline", lambda task, model, **kw: loaded.append(
        weakref.ref((pipe := load(task, model=model, **kw)).model)) or pipe)
    with serve(tmp_path, root) as client:
        assert client.post("/models", json={"name": "base", "path": str(root / "models" / "base")}).status_code == 201
        r = client.post("/models", json={"name": "ad", "path": str(adapter_folder), "base": "base"})
        assert r.status_code == 201, r.text
        saved = (adapter_folder / "adapter_config.json").read_text()

        def break_adapter() -> None:
            config = json.loads(saved)
            if how == "no adapter_config.json":
                (adapter_folder / "adapter_config.json").unlink()
                return
            config = {**config, "target_modules": [*config["target_modules"], "qkv_proj"]} \
                if how == "unknown target module" else {**config, "r": 2 * config["r"]}
            (adapter_folder / "adapter_config.json").write_text(json.dumps(config))

        break_adapter()
        r = client.post("/predict", json={"model": "ad", "inputs": "a text"})
        assert r.status_code == 400 and r.json()["error_type"] == "LoraError", r.text
        assert len(loaded) == 1  # the base, loaded for the adapter
        assert "hfport_models_loaded 0.0" in client.get("/metrics").text
        gc.collect()
        assert loaded[0]() is None, "the base loaded for the failed adapter is still in memory"
        (adapter_folder / "adapter_config.json").write_text(saved)
        for name in ("ad", "base"):
            r = client.post("/predict", json={"model": name, "inputs": "a text"})
            assert r.status_code == 200, (name, r.text)
        assert "hfport_models_loaded 2.0" in client.get("/metrics").text
        # over a base that serves: the failure takes nothing of it (neither reloaded nor dropped)
        assert client.delete("/models/ad").status_code == 200
        break_adapter()
        r = client.post("/models", json={"name": "ad", "path": str(adapter_folder), "base": "base"})
        if how == "no adapter_config.json":  # refused at registration: nothing to load
            assert r.status_code == 400 and "only an adapter folder runs over a base model" in message(r), r.text
        else:
            assert r.status_code == 201, r.text
            r = client.post("/predict", json={"model": "ad", "inputs": "a text"})
            assert r.status_code == 400 and r.json()["error_type"] == "LoraError", r.text
        assert client.post("/predict", json={"model": "base", "inputs": "a text"}).status_code == 200
        assert len(loaded) == 2 and loaded[1]() is not None  # the base's second load, still serving


def test_a_job_or_an_adapters_base_naming_no_registered_model_lists_the_registered_ones(tmp_path, root,
                                                                                         adapter_folder):
    """It said "model: 'nope' does not exist" (a job's model) and "base: 'nope' does not exist" (an adapter's base):
    a name that is not registered, worded as a path. Only base models are listed where a base is asked for."""
    with serve(tmp_path, root, f"base={root / 'models' / 'base'}") as client:
        assert client.post("/models", json={"name": "ad", "path": str(adapter_folder), "base": "base"}).status_code \
            == 201
        both, bases = "registered: 'ad', 'base'", "registered: 'base'"
        for route, body in (("/jobs/export", {"model": "nope", "format": "merged"}),
                            ("/jobs/evaluate", {"model": "nope", "task": "sentence-embedding", "data": "x.jsonl"})):
            assert error(client.post(route, json=body), 400, "InvalidModel") == \
                f"model: 'nope' is no registered model and no folder; {both}"
        # an adapter's base, given or read from its adapter_config.json
        message = error(client.post("/models", json={"name": "ad2", "path": str(adapter_folder), "base": "nope"}),
                        400, "InvalidModel")
        assert message == f"base: 'nope' is no registered model and no folder; {bases}"
        hub_base = tmp_path.name + "-hub-base"
        shutil.copytree(adapter_folder, root / "adapters" / hub_base)
        config = json.loads((adapter_folder / "adapter_config.json").read_text())
        (root / "adapters" / hub_base / "adapter_config.json").write_text(
            json.dumps({**config, "base_model_name_or_path": "org/missing"}))
        message = error(client.post("/models", json={"name": "ad3", "path": str(root / "adapters" / hub_base)}),
                        400, "InvalidModel")
        assert message == ("base: the adapter's base_model_name_or_path: 'org/missing' is no registered model and no "
                           f"folder; {bases}")
        message = error(client.post("/jobs/export", json={"model": str(root / "adapters" / hub_base),
                                                          "format": "merged"}), 400, "InvalidModel")
        assert message == ("model: the adapter's base_model_name_or_path: 'org/missing' is no registered model and no "
                           f"folder; {bases}")
    with serve(tmp_path / "none", root) as client:  # nothing registered
        message = error(client.post("/models", json={"name": "ad", "path": str(adapter_folder), "base": "nope"}),
                        400, "InvalidModel")
        assert message == "base: 'nope' is no registered model and no folder; no base model is registered (POST " \
                          "/models registers one)"


def test_a_request_for_an_unknown_model_lists_at_most_20_registered_or_says_there_are_none(tmp_path, root):
    """It listed every registered name as a Python list, "[]" when there were none."""
    with serve(tmp_path, root, f"base={root / 'models' / 'base'}") as client:
        for i in range(25):
            client.app.state.store.register_model(f"m{i:02d}", str(root / "models" / "base"), "feature-extraction")
        listed = "registered: " + ", ".join(map(repr, ["base"] + [f"m{i:02d}" for i in range(19)])) + \
                 " and 6 more (GET /models lists them all)"
        assert error(client.post("/predict", json={"model": "nope", "inputs": "x"}), 404, "ModelNotFound") == \
            f"no model named 'nope'; {listed}"
        assert error(client.post("/embed", json={"inputs": "x"}, headers={"x-model": "nope"}), 404,
                     "ModelNotFound") == f"no model named 'nope'; {listed}"
        assert error(client.get("/models/nope"), 404, "ModelNotFound") == f"no model named 'nope'; {listed}"
        r = client.post("/v1/embeddings", json={"input": "x", "model": "nope"})
        assert r.status_code == 404 and r.json()["error"]["message"] == f"the model 'nope' does not exist; {listed}"
    with serve(tmp_path / "none", root) as client:
        none = "no model is registered (POST /models registers one)"
        assert error(client.post("/predict", json={"model": "nope", "inputs": "x"}), 404, "ModelNotFound") == \
            f"no model named 'nope'; {none}"
        r = client.post("/v1/embeddings", json={"input": "x", "model": "nope"})
        assert r.json()["error"]["message"] == f"the model 'nope' does not exist; {none}", r.text


def error(r, status: int, error_type: str) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.json()["error_type"] == error_type, r.text
    return r.json()["error"]


def test_once_the_default_is_deleted_health_is_503_and_requests_naming_no_model_are_told_why(client, root):
    """/health said "ok" while every TEI/OpenAI request that named no model got "no model named 'base'" (404, a name
    the client never sent). Now /health is 503 Unhealthy, as while the default loads or when it failed to; those
    requests (/info too) are the protocol's 400 naming the deleted default and the registered models; named ones
    serve; registering a model under the default's name again makes it the default once more."""
    assert client.post("/models", json={"name": "other", "path": str(root / "models" / "base")}).status_code == 201
    assert client.delete("/models/base").status_code == 200
    gone = error(client.get("/health"), 503, "Unhealthy")
    assert gone.startswith("model 'base', the default (the first --model), is no longer registered"), gone
    for method, path, body in (("post", "/embed", {"inputs": "x"}), ("get", "/info", None),
                               ("post", "/", {"inputs": "x"}), ("post", "/tokenize", {"inputs": "x"})):
        assert error(send(client, method, path, body, {}), 400, "Validation") == (
            "no model: the default model 'base' (the first --model) is no longer registered; name one with the "
            "x-model header, or register a model as 'base' again; registered: 'other'"), path
        assert send(client, method, path, body, {"x-model": "other"}).status_code == 200, path
    r = client.post("/v1/embeddings", json={"input": "x"})
    assert r.status_code == 400 and r.json()["error"] == {
        "message": "no model: the default model 'base' (the first --model) is no longer registered; name one in "
                   "`model`; registered: 'other'", "type": "invalid_request_error", "param": "model",
        "code": "invalid_value"}, r.text
    assert client.post("/v1/embeddings", json={"input": "x", "model": "other"}).status_code == 200
    assert client.post("/models", json={"name": "base", "path": str(root / "models" / "base")}).status_code == 201
    assert client.get("/health").status_code == 200
    assert client.get("/info").json()["model_id"] == "base"


def test_a_model_folder_whose_tokenizer_does_not_load_is_refused_at_registration(client, root):
    """It was registered (201), and every request for it then answered 424: a served model needs its tokenizer. An
    adapter without tokenizer files still registers (it serves with its base's)."""
    folder = root / "models" / "no-tokenizer"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(root / "models" / "base" / name, folder / name)
    r = client.post("/models", json={"name": "mute", "path": str(folder)})
    assert r.status_code == 400 and r.json()["error_type"] == "InvalidModel", r.text
    assert "its tokenizer does not load" in r.json()["error"] and "no tokenizer.json" in r.json()["error"], r.text
    assert client.get("/models/mute").status_code == 404
