"""The service (server/), mostly through httpx against a real uvicorn server started as `hfport serve` on a free
loopback port: health, the model registry and path confinement, predict for every task, fine-tune jobs end to end
with their SSE stream, cancel, upload limits, restart recovery after kill -9, export jobs, token auth, JSON errors,
and the dashboard in headless Chromium."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.serving import TERMINAL, Server, allowed_root, assert_error, finetune_config, wait_job

CHROMIUM = Path("/usr/bin/chromium")


# --- fixtures: tiny models, data, and a running server -----------------------------------------------------------

@pytest.fixture(scope="module")
def root(tmp_path_factory, tiny_bert) -> Path:
    """The one allowed dir: tiny models of every head, a tiny BERT with MiniLM's tokenizer, sentiment data."""
    return allowed_root(tmp_path_factory.mktemp("allowed"), tiny_bert)


@pytest.fixture(scope="module")
def server(root, tmp_path_factory) -> Iterator[Server]:
    data = tmp_path_factory.mktemp("srv") / "data"
    srv = Server(data, root, HFPORT_MAX_DATA_BYTES=str(64 * 1024), HFPORT_PREDICT_MAX_INPUTS="16",
                 HFPORT_PREDICT_MAX_CHARS="2000", HFPORT_BATCH_MAX_WAIT_MS="30").start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def registered(client, root) -> dict[str, str]:
    """Every tiny model registered; name -> pipeline task."""
    names = {"cls": "sequence-classification", "ner": "token-classification", "qa": "question-answering",
             "mlm": "masked-lm", "feat": "base", "ftbase": "ft-base"}
    tasks = {}
    for name, folder in names.items():
        r = client.post("/models", json={"name": name, "path": str(root / "models" / folder)})
        assert r.status_code == 201, r.text
        tasks[name] = r.json()["task"]
    return tasks


def read_sse(url: str, headers: dict[str, str] | None = None, timeout: float = 120) -> list[tuple[str, dict]]:
    """Every (event, data) frame of an SSE stream, to its end."""
    frames: list[tuple[str, dict]] = []
    event, data = "message", []
    with httpx.stream("GET", url, headers=headers, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
            elif line == "" and data:
                frames.append((event, json.loads("\n".join(data))))
                event, data = "message", []
    return frames


# --- health, errors, registry, confinement --------------------------------------------------------------------

def test_health_and_json_errors(client):
    r = client.get("/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    assert r.json()["resources"]["rss_gb"] > 0 and "text-classification" in r.json()["trainable_tasks"]
    assert_error(client.get("/jobs/nope"), 404, "JobNotFound")
    assert_error(client.get("/models/nope"), 404, "ModelNotFound")
    assert_error(client.get("/no/such/route"), 404)
    assert_error(client.post("/predict", content=b"{not json", headers={"content-type": "application/json"}), 422)
    assert_error(client.post("/predict", json={"model": "x"}), 422, "ValidationError")
    assert_error(client.get("/jobs", params={"status": "sleeping"}), 422)
    assert_error(client.post("/models", json={"name": "../x", "path": "models"}), 422)
    assert_error(client.delete("/health"), 405)


def test_openapi_is_complete(client):
    spec = client.get("/openapi.json").json()
    schemas = spec["components"]["schemas"]
    assert {"PredictRequest", "PredictResponse", "JobInfo", "JobList", "ModelInfo", "ModelList", "ModelRegistration",
            "FinetuneJobRequest", "ExportJobRequest", "ErrorBody", "Health"} <= set(schemas)
    for path, methods in spec["paths"].items():
        for method, op in methods.items():
            ok = op["responses"].get("200") or op["responses"].get("201") or op["responses"].get("202")
            assert ok and ok.get("content"), f"{method.upper()} {path} documents no response body"
            if method == "post" and path not in ("/jobs/{job_id}/cancel",):
                assert "requestBody" in op, f"POST {path} documents no request body"


def test_model_registry_and_path_confinement(client, root, tmp_path):
    folder = str(root / "models" / "sequence-classification")
    r = client.post("/models", json={"name": "reg-a", "path": folder})
    assert r.status_code == 201, r.text
    assert r.json()["task"] == "text-classification" and r.json()["source"] == "registered"
    assert client.get("/models/reg-a").json()["path"] == folder
    assert "reg-a" in [m["name"] for m in client.get("/models").json()["models"]]
    assert_error(client.post("/models", json={"name": "reg-a", "path": folder}), 409, "Conflict")
    # relative paths are taken from the data dir; '..' never passes, even when it would land inside
    assert_error(client.post("/models", json={"name": "esc1", "path": f"{root}/models/../models/base"}), 400,
                 "InvalidPath")
    assert_error(client.post("/models", json={"name": "esc2", "path": "../../etc"}), 400, "InvalidPath")
    outside = tmp_path / "outside-model"
    shutil.copytree(root / "models" / "sequence-classification", outside)
    assert_error(client.post("/models", json={"name": "esc3", "path": str(outside)}), 403, "PathNotAllowed")
    link = root / "models" / "sneaky-link"
    link.symlink_to(outside, target_is_directory=True)
    try:
        assert_error(client.post("/models", json={"name": "esc4", "path": str(link)}), 403, "PathNotAllowed")
    finally:
        link.unlink()
    assert_error(client.post("/models", json={"name": "esc5", "path": str(root / "data")}), 400, "InvalidModel")
    assert_error(client.post("/models", json={"name": "esc6", "path": str(root / "nothing-here")}), 400)
    assert client.delete("/models/reg-a").json() == {"deleted": "reg-a"}
    assert_error(client.get("/models/reg-a"), 404)
    assert_error(client.delete("/models/reg-a"), 404)


# --- predict --------------------------------------------------------------------------------------------------

def test_predict_every_task(client, registered):
    assert registered == {"cls": "text-classification", "ner": "token-classification", "qa": "question-answering",
                          "mlm": "fill-mask", "feat": "feature-extraction", "ftbase": "feature-extraction"}
    r = client.post("/predict", json={"model": "cls", "inputs": "Herman Melville wrote Moby-Dick."})
    assert r.status_code == 200, r.text
    one = r.json()
    assert one["task"] == "text-classification" and set(one["outputs"][0] if isinstance(one["outputs"], list)
                                                         else one["outputs"]) == {"label", "score"}
    r = client.post("/predict", json={"model": "cls", "inputs": ["a text", "another text"],
                                      "parameters": {"top_k": None}})
    outs = r.json()["outputs"]
    assert len(outs) == 2 and all(len(o) == 3 for o in outs), outs  # all three labels, for each input
    assert abs(sum(x["score"] for x in outs[0]) - 1) < 1e-4
    ner = client.post("/predict", json={"model": "ner", "inputs": ["Herman Melville lived in Paris."],
                                        "parameters": {"aggregation_strategy": "simple", "ignore_labels": []}})
    assert ner.status_code == 200 and ner.json()["outputs"][0][0].keys() >= {"entity_group", "score", "word"}
    qa = client.post("/predict", json={"model": "qa", "inputs": {"question": "Who wrote it?",
                                                                 "context": "Herman Melville wrote Moby-Dick."}})
    assert qa.status_code == 200 and {"answer", "start", "end", "score"} <= set(qa.json()["outputs"])
    mask = client.post("/predict", json={"model": "mlm", "inputs": "Paris is the [MASK] of France.",
                                         "parameters": {"top_k": 2}})
    assert mask.status_code == 200 and len(mask.json()["outputs"]) == 2, mask.text
    feat = client.post("/predict", json={"model": "feat", "inputs": ["a text"],
                                         "parameters": {"pooling": "mean", "normalize": True}})
    assert feat.status_code == 200 and len(feat.json()["outputs"][0]) == 32, feat.text
    # the task can be given: the masked-LM folder's body as features
    r = client.post("/predict", json={"model": "cls", "inputs": ["x y"], "task": "feature-extraction"})
    assert r.status_code == 200, r.text


def test_predict_errors_and_limits(client, registered):
    assert_error(client.post("/predict", json={"model": "nope", "inputs": "x"}), 404, "ModelNotFound")
    assert_error(client.post("/predict", json={"model": "cls", "inputs": "x", "parameters": {"bogus": 1}}), 422,
                 "InvalidParameters")
    assert_error(client.post("/predict", json={"model": "cls", "inputs": ["x"] * 17}), 413, "TooManyInputs")
    assert_error(client.post("/predict", json={"model": "cls", "inputs": ["x" * 2001]}), 413, "InputTooLong")
    assert_error(client.post("/predict", json={"model": "cls", "inputs": []}), 422)
    assert_error(client.post("/predict", json={"model": "mlm", "inputs": "no mask token here"}), 422)
    # a list answers every item it can; a bad item gets an error entry in its place
    outs = client.post("/predict", json={"model": "mlm", "inputs": ["a [MASK] b", "no mask"]}).json()["outputs"]
    assert isinstance(outs[0], list) and outs[1]["index"] == 1 and outs[1]["error_type"], outs
    assert_error(client.post("/predict", content=b"x" * (9 * 2**20), headers={"content-type": "application/json"}),
                 413, "PayloadTooLarge")


def test_concurrent_predicts_are_answered_separately(client, registered):
    """Requests batched together still get their own results (and item indices) back."""
    texts = [[f"text [MASK] {i}", "no mask here" if i % 2 else f"more {i} [MASK]"] for i in range(8)]
    solo = [client.post("/predict", json={"model": "mlm", "inputs": t}).json()["outputs"] for t in texts]
    results: list[Any] = [None] * len(texts)

    def call(i: int) -> None:
        with httpx.Client(base_url=client.base_url, timeout=60) as c:
            results[i] = c.post("/predict", json={"model": "mlm", "inputs": texts[i]}).json()["outputs"]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for got, want in zip(results, solo):
        assert json.dumps(got, sort_keys=True) == json.dumps(want, sort_keys=True)
    assert solo[1][1]["index"] == 1 and solo[1][1]["error"].startswith("input 1:"), solo[1]


# --- jobs -----------------------------------------------------------------------------------------------------

def test_finetune_job_end_to_end_with_sse(client, server, registered, root):
    body = {"config": finetune_config(root, max_steps=6, eval_strategy="steps", eval_steps=3, save_steps=3),
            "register_as": "sentiment"}
    r = client.post("/jobs/finetune", json=body)
    assert r.status_code == 202, r.text
    job = r.json()
    assert job["status"] in ("queued", "running") and job["kind"] == "finetune"
    assert job["config"]["eval"] == str(root / "data" / "eval.jsonl")
    frames = read_sse(f"{server.url}/jobs/{job['id']}/events")
    kinds = [k for k, _ in frames]
    assert kinds[-1] == "end" and frames[-1][1]["status"] == "succeeded", frames[-3:]
    assert [d["step"] for k, d in frames if k == "train"] == [1, 2, 3, 4, 5, 6]
    assert [d["step"] for k, d in frames if k == "eval"] == [3, 6]
    assert "done" in kinds and kinds.index("done") < kinds.index("end")
    statuses = [d["status"] for k, d in frames if k == "status"]
    assert statuses == ["queued", "running", "succeeded"]
    done = client.get(f"/jobs/{job['id']}").json()
    assert done["status"] == "succeeded" and done["progress"]["step"] == 6 and done["progress"]["total_steps"] == 6
    assert "eval_accuracy" in done["metrics"] and "loss" in done["metrics"]
    assert done["result"]["model"] == "sentiment" and done["result"]["summary"]["steps"] == 6
    model = client.get("/models/sentiment").json()
    assert model["task"] == "text-classification" and model["source"] == f"job:{job['id']}"
    assert Path(model["path"]).name == "best" and (Path(model["path"]) / "model.safetensors").is_file()
    pred = client.post("/predict", json={"model": "sentiment", "inputs": "the plot was great overall"})
    assert pred.json()["outputs"]["label"] in ("positive", "negative")
    # a late subscriber gets the same history, from the store; Last-Event-ID resumes a dropped stream
    assert [k for k, _ in read_sse(f"{server.url}/jobs/{job['id']}/events")] == kinds
    assert [k for k, _ in read_sse(f"{server.url}/jobs/{job['id']}/events", {"Last-Event-ID": "3"})] == kinds[3:]
    assert any(j["id"] == job["id"] for j in client.get("/jobs", params={"status": "succeeded"}).json()["jobs"])
    assert_error(client.post(f"/jobs/{job['id']}/cancel"), 409, "Conflict")
    # the monitor: speed, ETA and resources per logged step, in the stream and the job's progress
    assert [d["step"] for k, d in frames if k == "perf"] == [1, 2, 3, 4, 5, 6]
    assert {"eta_s", "steps_per_s", "tokens_per_s", "rss_gb", "mem_total_gb"} <= set(done["progress"]), done
    assert not any(k.startswith("gpu") for k in done["progress"]) or "gpu0_mem_total_gb" in done["progress"]
    # every point as CSV; a corrupt line is skipped and named, the rest still served
    csv_rows = client.get(f"/jobs/{job['id']}/metrics.csv").text.splitlines()
    assert csv_rows[0].startswith("type,step,epoch,") and sum(r.startswith("train,") for r in csv_rows) == 6
    metrics_file = Path(done["config"]["output_dir"]) / "metrics.jsonl"
    with open(metrics_file, "a") as f:
        f.write('{"type": "train", "st\n')
    body = client.get(f"/jobs/{job['id']}/metrics").json()
    assert len([e for e in body["entries"] if e["type"] == "train"]) == 6
    assert body["problems"] and body["problems"][0].startswith(f"metrics.jsonl:{len(csv_rows)}:"), body["problems"]
    assert client.get(f"/jobs/{job['id']}/metrics.csv").status_code == 200
    assert "checkpoint step 3" in client.get(f"/jobs/{job['id']}/log").text  # the job runs at verbose by default
    assert client.get(f"/jobs/{job['id']}/log", params={"lines": 0}).status_code == 422


def test_finetune_job_input_errors(client, registered, root, tmp_path):
    body = assert_error(client.post("/jobs/finetune", json={"config": finetune_config(root, bogus=1)}), 422,
                        "InvalidConfig")
    assert "'bogus'" in body["error"], body  # an unknown field is named
    assert_error(client.post("/jobs/finetune", json={"config": finetune_config(root, train="/etc/passwd")}), 403)
    assert_error(client.post("/jobs/finetune", json={"config": finetune_config(root, train="../x.jsonl")}), 400)
    assert_error(client.post("/jobs/finetune", json={"config": finetune_config(root, model="/etc")}), 403)
    assert_error(client.post("/jobs/finetune", json={"config": finetune_config(root, resume="latest")}), 422)
    assert_error(client.post("/jobs/finetune", json={"config": finetune_config(root, output_dir=str(root))}), 409)
    # bad data is read with the engine's readers before queueing: a 422 naming file, line and field, no job
    (root / "data" / "nolabel.jsonl").write_text('{"text": "a"}\n' * 40)
    before = len(client.get("/jobs").json()["jobs"])
    body = assert_error(client.post("/jobs/finetune", json={"config": finetune_config(
        root, train=str(root / "data" / "nolabel.jsonl"), eval=None, max_steps=2)}), 422, "DataError")
    assert "nolabel.jsonl, line 1, field 'label'" in body["error"], body
    assert len(client.get("/jobs").json()["jobs"]) == before


def test_finetune_body_is_typed_from_finetune_config(root, tmp_path):
    """POST /jobs/finetune's `config` is FinetuneConfig's fields in OpenAPI (type, default, description; derived, so
    a new field shows untouched); an unknown field is 422 naming it; a typed body, and the dashboard's upload body,
    queue a job as before."""
    from fastapi.testclient import TestClient
    from pydantic_core import PydanticUndefined

    from hfport.train import FinetuneConfig
    from server.app import create_app
    from server.settings import Settings

    app = create_app(Settings(data_dir=tmp_path / "d", allowed_dirs=[root]), run_worker=False)
    with TestClient(app) as c:
        schemas = c.get("/openapi.json").json()["components"]["schemas"]
        request = schemas["FinetuneJobRequest"]["properties"]["config"]
        assert request.get("$ref") == "#/components/schemas/FinetuneJobConfig" or any(
            x.get("$ref") == "#/components/schemas/FinetuneJobConfig" for x in request.get("allOf", [])), request
        config = schemas["FinetuneJobConfig"]
        assert config["additionalProperties"] is False and set(config["required"]) == {"model", "train"}
        assert set(config["properties"]) == set(FinetuneConfig.model_fields)
        # the service's own meaning
        restated = {"model", "teacher", "train", "eval", "output_dir", "resume", "overwrite", "logging_dir"}
        for name, field in FinetuneConfig.model_fields.items():
            shown = config["properties"][name]
            assert shown.get("description"), name  # every field says what it is
            if name not in restated:
                assert shown["description"] == field.description, name
                assert (name in config["required"]) == field.is_required(), name
                if field.default not in (None, PydanticUndefined):  # OpenAPI leaves a null default implied
                    assert shown["default"] == json.loads(json.dumps(field.default)), name
        assert config["properties"]["lr"]["type"] == "number" and config["properties"]["lr"]["default"] == 5e-5
        assert config["properties"]["lr"]["exclusiveMinimum"] == 0
        assert config["properties"]["scheduler"]["enum"] == ["linear", "cosine", "constant", "constant_with_warmup",
                                                             "one_cycle", "plateau", "reduce_lr_on_plateau"]
        assert "$ref" in str(config["properties"]["lora"]) and "LoraSettings" in schemas

        c.post("/models", json={"name": "ftbase", "path": str(root / "models" / "ft-base")})
        bad = assert_error(c.post("/jobs/finetune", json={"config": finetune_config(root, bogus=1, lr=-1)}), 422,
                           "InvalidConfig")
        assert "unknown option(s) ['bogus']" in bad["error"] and "config.lr:" in bad["error"], bad
        bad = assert_error(c.post("/jobs/finetune", json={"config": finetune_config(root, lora={"rank": 4})}), 422,
                           "InvalidConfig")
        assert "config.lora.rank" in bad["error"], bad
        bad = assert_error(c.post("/jobs/finetune", json={"config": finetune_config(root), "bogus": 1}), 422,
                           "ValidationError")
        assert "bogus" in bad["error"], bad
        # what FinetuneConfig's own validators take still goes: a task alias, `lora: true`, freeze as "a,b"
        r = c.post("/jobs/finetune", json={"config": finetune_config(root, task="sentiment-analysis", lora=True,
                                                                     freeze="embeddings.,pooler.", max_steps=2)})
        assert r.status_code == 202, r.text
        job = r.json()
        assert job["status"] == "queued" and job["config"]["task"] == "text-classification"
        assert job["config"]["lora"]["r"] == 8 and job["config"]["freeze"] == ["embeddings.", "pooler."]
        assert job["config"]["output_dir"] == str(tmp_path / "d" / "runs" / job["id"] / "run")
        assert job["config"]["model"] == str(root / "models" / "ft-base")
        # the body the dashboard builds (server/static/index.html), through the upload route
        dashboard = {"model": "ftbase", "task": "text-classification", "epochs": 3, "max_steps": 4,
                     "batch_size": 16, "lr": 0.00003, "eval_steps": 2, "eval_strategy": "steps",
                     "lora": {"r": 4, "alpha": 8}}
        r = c.post("/jobs/finetune/upload", data={"config": json.dumps(dashboard)},
                   files={"train": ("train.jsonl", (root / "data" / "train.jsonl").read_bytes())})
        assert r.status_code == 202, r.text
        assert r.json()["config"]["lora"]["alpha"] == 8
        up = assert_error(c.post("/jobs/finetune/upload", data={"config": json.dumps({**dashboard, "lora_r": 4})},
                                 files={"train": ("train.jsonl", b'{"text": "a", "label": "x"}\n')}), 422,
                          "InvalidConfig")
        assert "unknown option(s) ['lora_r']" in up["error"], up


def test_upload_and_cancel(client, server, registered, root):
    data = (root / "data" / "train.jsonl").read_bytes()
    config = json.dumps({k: v for k, v in finetune_config(root, max_steps=100000, eval_strategy="no").items()
                         if k not in ("train", "eval")})
    r = client.post("/jobs/finetune/upload", data={"config": config},
                    files={"train": ("my train.jsonl", data, "application/jsonl")})
    assert r.status_code == 202, r.text
    job = r.json()
    saved = Path(job["config"]["train"])
    assert saved.read_bytes() == data and saved.parent.parent == server.data_dir / "uploads"
    running = wait_job(client, job["id"], lambda j: j["status"] == "running" and j["progress"].get("step", 0) >= 1)
    pid = running["pid"]
    assert pid and client.post(f"/jobs/{job['id']}/cancel").json()["cancel_requested"]
    frames = read_sse(f"{server.url}/jobs/{job['id']}/events", timeout=60)
    assert frames[-1] == ("end", {"status": "cancelled", "error": None})
    assert client.get(f"/jobs/{job['id']}").json()["status"] == "cancelled"
    deadline = time.time() + 10
    while time.time() < deadline and Path(f"/proc/{pid}").exists():
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower(), \
        "the job process outlived its cancel"
    # oversize uploads are refused before they are read
    big = b'{"text": "the plot was great overall", "label": "positive"}\n' * 2000  # ~120 KB > 64 KB
    assert_error(client.post("/jobs/finetune/upload", data={"config": config}, files={"train": ("t.jsonl", big)}),
                 413, "PayloadTooLarge")
    assert_error(client.post("/jobs/finetune/upload", data={"config": "{nope"},
                             files={"train": ("t.jsonl", data)}), 422)


def test_export_job_every_format(client, registered, root):
    """An HTTP export job for every format the CLI writes (hfport.export.FORMATS): each succeeds, is verified, and
    leaves a folder its format recognises (the hf one asked for without a format: the default); a model outside the
    allowed dirs is a 403, an unknown format a 422 listing them, an unknown option or another format's a 422."""
    import hfport
    from hfport.export import FORMATS, detect_format
    from tests.tiny import save_hf, save_random_adapter

    models = root / "models"
    scorer = models / "scorer"  # a one-label classifier: the reranker format's source
    if not scorer.exists():
        shutil.copytree(models / "sequence-classification", scorer)
        config = json.loads((scorer / "config.json").read_text())
        save_hf("bert", "sequence-classification", scorer, vocab_size=config["vocab_size"],
                pad_token_id=config["pad_token_id"], num_labels=1)
    adapter = models / "adapter"  # a LoRA adapter over the base: the peft and merged formats' source
    if not adapter.exists():
        model = hfport.AutoModelForSequenceClassification.from_pretrained(models / "base", id2label={0: "a", 1: "b"})
        save_random_adapter(model, adapter, base=models / "base", seed=3, r=4, alpha=8, targets=["q", "v"])
    sources = {"hf": "cls", "onnx": "cls", "onnx-int8": "cls", "openvino": "cls", "openvino-int8": "cls",
               "sentence-transformers": "feat",
               "cross-encoder": str(scorer), "peft": str(adapter), "merged": str(adapter), "sparse-encoder": "mlm"}
    assert set(sources) == set(FORMATS)
    jobs = {}
    for name, model_ref in sources.items():
        r = client.post("/jobs/export", json={"model": model_ref} | ({} if name == "hf" else {"format": name}))
        assert r.status_code == 202, r.text
        jobs[name] = r.json()["id"]
    outputs = {}
    for name, job_id in jobs.items():
        done = wait_job(client, job_id, lambda j: j["status"] in TERMINAL, timeout=240)
        assert done["status"] == "succeeded", (name, done)
        result = done["result"]
        assert result["format"] == name and result["verify"]["passed"] is True, (name, result)
        found = detect_format(result["output_dir"])
        assert found is not None and found.name == ("hf" if name == "merged" else name), (name, found)
        if name == "hf":
            assert (Path(result["output_dir"]) / "config.json").is_file() and result["task"] == "text-classification"
        outputs[name] = result["output_dir"]
    # the server serves a graph folder as hfport.pipeline does: OpenVINO's int8 IR (the folder's default_file)
    assert client.post("/models", json={"name": "cls-ov", "path": outputs["openvino-int8"]}).status_code == 201
    texts = ["a text", "another text"]
    r = client.post("/predict", json={"model": "cls-ov", "inputs": texts, "parameters": {"top_k": None}})
    assert r.status_code == 200, r.text
    want = hfport.pipeline("text-classification", model=outputs["openvino-int8"], top_k=None)(texts)
    assert [[x["label"] for x in o] for o in r.json()["outputs"]] == [[x["label"] for x in o] for o in want]
    assert max(abs(x["score"] - y["score"]) for o, w in zip(r.json()["outputs"], want) for x, y in zip(o, w)) < 1e-5
    assert_error(client.post("/jobs/export", json={"model": "/etc"}), 403)
    assert_error(client.post("/jobs/export", json={"model": "cls", "options": {"bogus": 1}}), 422)
    assert_error(client.post("/jobs/export", json={"model": "cls", "options": {"force": True}}), 422)
    body = assert_error(client.post("/jobs/export", json={"model": "cls", "format": "tarball"}), 422)
    assert "onnx-int8" in body["error"] and "sentence-transformers" in body["error"], body
    body = assert_error(client.post("/jobs/export", json={"model": "cls", "format": "hf", "options": {"opset": 17}}),
                        422)
    assert "opset" in body["error"], body


def test_restart_recovery_after_kill(root, tmp_path):
    """kill -9 the server and its job process mid-run; a new server resumes the job from its checkpoint."""
    srv = Server(tmp_path / "data", root, workers=1).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            assert c.post("/models", json={"name": "ftbase", "path": str(root / "models" / "ft-base")}).status_code \
                == 201
            cfg = finetune_config(root, max_steps=30, batch_size=8, save_steps=3, eval_strategy="no")
            job = c.post("/jobs/finetune", json={"config": cfg}).json()
            queued = c.post("/jobs/finetune", json={"config": {**cfg, "max_steps": 2}}).json()  # one worker: waits
            ckpts = Path(job["config"]["output_dir"]) / "checkpoints"
            running = wait_job(c, job["id"], lambda j: j["progress"].get("step", 0) >= 4
                               and any(ckpts.glob("step-*/trainer_state.json")))
            assert running["progress"]["step"] < 30, "the job finished before it could be killed; make it longer"
            assert c.get(f"/jobs/{queued['id']}").json()["status"] == "queued"
        os.kill(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait()
        try:
            os.kill(running["pid"], signal.SIGKILL)
        except ProcessLookupError:
            pass  # it died with its server
        srv.stop()  # dead already: only what the parent held for it is closed
        srv = Server(tmp_path / "data", root, workers=1).start()
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            # the job queued when the server died is still queued (behind the resumed one: one worker); a queued
            # job cancels at once, without ever running
            other = c.get(f"/jobs/{queued['id']}").json()
            assert other["status"] == "queued" and other["attempts"] == 0, other
            assert c.post(f"/jobs/{queued['id']}/cancel").json()["status"] == "cancelled"
            frames = read_sse(f"{srv.url}/jobs/{job['id']}/events", timeout=120)
            assert frames[-1][1]["status"] == "succeeded", frames[-4:]
            done = c.get(f"/jobs/{job['id']}").json()
            assert done["attempts"] == 2 and done["result"]["summary"]["steps"] == 30, done
            resumed = [i for i, (k, _) in enumerate(frames) if k == "resumed"]
            assert len(resumed) == 1, [k for k, _ in frames]
            at = frames[resumed[0]][1]["step"]
            assert at >= 3 and at % 3 == 0, at  # a checkpoint step
            # a live subscriber sees steps past the checkpoint twice: before the kill, then redone after "resumed"
            assert [d["step"] for k, d in frames[resumed[0]:] if k == "train"] == list(range(at + 1, 31))
            # the stored history drops the lost steps, so a late subscriber sees every step once, in order
            late = read_sse(f"{srv.url}/jobs/{job['id']}/events")
            assert [d["step"] for k, d in late if k == "train"] == list(range(1, 31))
            other = c.get(f"/jobs/{queued['id']}").json()
            assert other["status"] == "cancelled" and other["attempts"] == 0 and other["started_at"] is None, other
    finally:
        srv.stop()


# --- auth (in-process: quick) ---------------------------------------------------------------------------------

def test_token_auth(tmp_path, root):
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.settings import Settings

    app = create_app(Settings(data_dir=tmp_path / "d", allowed_dirs=[root], api_token="s3cret"), run_worker=False)
    with TestClient(app) as c:
        assert c.get("/health").status_code == 200
        for method, path, body in (("GET", "/models", None), ("GET", "/jobs", None), ("GET", "/jobs/x/events", None),
                                   ("POST", "/predict", {"model": "m", "inputs": "x"}),
                                   ("POST", "/models", {"name": "m", "path": "x"}), ("DELETE", "/models/m", None),
                                   ("POST", "/jobs/finetune", {"config": {}}), ("POST", "/jobs/x/cancel", None),
                                   ("GET", "/openapi.json", None), ("GET", "/docs", None)):
            r = c.request(method, path, json=body)
            assert_error(r, 401, "Unauthorized")
            assert r.headers["www-authenticate"] == "Bearer"
            assert_error(c.request(method, path, json=body, headers={"Authorization": "Bearer wrong"}), 403)
            assert_error(c.request(method, path, json=body, headers={"Authorization": "Basic czNjcmV0"}), 401)
        ok = {"Authorization": "Bearer s3cret"}
        assert c.get("/models", headers=ok).json() == {"models": []}
        assert "/predict" in c.get("/openapi.json", headers=ok).json()["paths"]
        assert c.get("/", headers={}).status_code == 200  # the static dashboard page holds no data
        assert_error(c.get("/jobs/x", headers=ok), 404)


def test_predict_timeout_is_a_json_504(tmp_path, root):
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.settings import Settings

    app = create_app(Settings(data_dir=tmp_path / "d", allowed_dirs=[root], predict_timeout_s=0.001),
                     run_worker=False)
    with TestClient(app) as c:
        folder = str(root / "models" / "sequence-classification")
        assert c.post("/models", json={"name": "m", "path": folder}).status_code == 201
        assert_error(c.post("/predict", json={"model": "m", "inputs": "x"}), 504, "Timeout")


def test_model_cache_is_bounded_by_memory(tmp_path, root):
    import asyncio

    from server.serving import ModelRecord, ModelService
    from server.settings import Settings

    async def load_all(service: ModelService) -> list[str]:
        for folder, task in (("sequence-classification", "text-classification"),
                             ("token-classification", "token-classification"), ("base", "feature-extraction")):
            out = await service.predict(ModelRecord(folder, str(root / "models" / folder), task), ["some text"], {})
            assert "error" not in out[0], out
        return [record.name for record in service.cache.records()]

    def run(**limits: float) -> tuple[list[str], dict[str, int]]:
        service = ModelService(Settings(data_dir=tmp_path / "d", allowed_dirs=[root], **limits))  # what it may read
        try:
            return asyncio.run(load_all(service)), {r.name: n for r, n in service.cache.memory().items()}
        finally:
            service.close()

    names, held = run()  # what each model holds once it has served (packed weight copies included)
    assert names == ["sequence-classification", "token-classification", "base"]
    newest_two = (held["token-classification"] + held["base"]) * 1.01 / 2**20
    assert run(model_cache_mb=newest_two)[0] == ["token-classification", "base"]  # room for two tiny models
    assert run(model_cache_mb=held["base"] * 1.01 / 2**20)[0] == ["base"]  # room for one only


def test_predict_threads_share_the_cores(tmp_path):
    """Each predict thread runs torch on its share of the process's intra-op threads (at least one); the process's
    own count stays."""
    import torch

    from server.serving import ModelService
    from server.settings import Settings

    main = torch.get_num_threads()
    for settings, want in ((Settings(data_dir=tmp_path / "d", predict_threads=2), max(1, main // 2)),
                           (Settings(data_dir=tmp_path / "d", predict_threads=4 * main), 1)):
        service = ModelService(settings)
        try:
            assert service.pool.submit(torch.get_num_threads).result(timeout=60) == want
        finally:
            service.close()
    assert torch.get_num_threads() == main


def test_settings_from_env(monkeypatch, tmp_path):
    from server.settings import Settings

    monkeypatch.setenv("HFPORT_PORT", "9123")
    monkeypatch.setenv("HFPORT_ALLOWED_DIRS", json.dumps([str(tmp_path)]))
    monkeypatch.setenv("HFPORT_DATA_DIR", str(tmp_path / "d"))
    s = Settings()
    assert s.port == 9123 and s.host == "127.0.0.1" and s.api_token is None
    assert s.roots == [tmp_path / "d", tmp_path]
    monkeypatch.setenv("HFPORT_PORT", "not-a-port")
    with pytest.raises(ValueError, match=r"HFPORT_PORT='not-a-port': input should be a valid integer"):
        Settings()


# --- the dashboard ----------------------------------------------------------------------------------------------

@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium "
                                                  "(apt-get install -y chromium)")
def test_dashboard_in_headless_chromium(client, server, registered, root):
    from playwright.sync_api import sync_playwright

    job = client.post("/jobs/finetune", json={"config": finetune_config(root, max_steps=8, eval_strategy="steps",
                                                                          eval_steps=4)}).json()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"])
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(server.url + "/")
            page.locator(f"tr.job[data-id='{job['id']}']").click()
            page.wait_for_function("document.querySelectorAll('#charts .hc-panel').length >= 4", timeout=90_000)
            page.wait_for_selector(f"tr.job[data-id='{job['id']}'] td.succeeded", timeout=90_000)
            # one panel per metric group, with values on the axes (a late joiner got every point from the stream)
            page.wait_for_function("document.querySelectorAll(\"[data-panel='loss'] path.hc-line\").length == 2")
            panels = page.eval_on_selector_all("#charts .hc-panel", "els => els.map(e => e.dataset.panel)")
            assert {"loss", "lr", "grad_norm", "eval:accuracy", "tokens", "memory"} <= set(panels), panels
            counts = page.eval_on_selector_all("[data-panel='loss'] path.hc-line",
                                               "els => els.map(e => [e.dataset.label, +e.dataset.points])")
            assert counts == [["train loss", 8], ["eval loss", 2]], counts
            ticks = page.eval_on_selector_all("[data-panel='eval:accuracy'] .hc-tick", "els => els.length")
            assert ticks >= 4
            page.wait_for_function("document.querySelector('#job-stats').textContent.includes('step/s')")
            stats, res = page.inner_text("#job-stats"), page.inner_text("#job-res")
            assert "8 / 8" in stats and "tok/s" in stats and "RSS" in res, (stats, res)
            assert "/jobs/" + job["id"] + "/metrics.csv" in page.get_attribute("#btn-csv", "href")
            assert page.is_visible("#btn-export") and not page.is_visible("#btn-cancel")
            assert not page.is_visible("#lora-fields")  # the server reports no LoRA support
            page.wait_for_function("document.querySelector('#job-log').textContent.length > 0")
            # overlay another run's curves
            other = [j["id"] for j in client.get("/jobs").json()["jobs"]
                     if j["kind"] == "finetune" and j["status"] == "succeeded" and j["id"] != job["id"]]
            if other:
                page.check(f"#compare input[value='{other[0]}']")
                page.wait_for_function("document.querySelectorAll(\"[data-panel='loss'] path.hc-line\").length > 2")
            shot = Path(os.environ.get("HFPORT_TEST_ARTIFACTS") or (root / "artifacts")) / "dashboard.png"
            shot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(shot), full_page=True)
            print(f"dashboard screenshot: {shot}")
            assert "cls" in page.inner_text("#models")
            page.select_option("#model", "cls")
            page.fill("#inputs", "a happy text\nanother one")
            page.click("#predict")
            page.wait_for_function("document.querySelector('#output').textContent.includes('score')")
            assert len(json.loads(page.inner_text("#output"))) == 2
            # /health answers 503 while the default model loads, after it failed or was deleted: the page still
            # lists the jobs and models, and says why the server is unhealthy
            page.route("**/health", lambda route: route.fulfill(
                status=503, content_type="application/json",
                body=json.dumps({"error": "model 'base' was deleted", "error_type": "Unhealthy"})))
            page.evaluate("refresh()")
            page.wait_for_function("document.querySelector('#error').textContent.includes('was deleted')")
            assert "cls" in page.inner_text("#models") and page.locator("tr.job").count() >= 1
            assert page.inner_text("#server-res") == "server unhealthy"
            assert not errors, errors
        finally:
            browser.close()
