"""What the service reads and deletes on disk, in process (TestClient over create_app without the worker; jobs run by
calling server.jobrun in the test where one must run): the upload sweeper never deletes a path a live job names or a
registered model lies in, and refuses an output_dir under uploads/; an export job of a registered adapter loads its
registered base and never a base outside the allowed dirs; every file of a model folder (not just the folder) must
lie inside them; the data check's size limit counts folders and globs; Idempotency-Key on the upload route."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

import hfport
from server.app import create_app
from server.settings import Settings
from tests.data import write_sentiment
from tests.tiny import save_random_adapter
from tests.tiny_tokenizers import make_folder


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """The allowed dir: a tiny classifier, a tiny bare encoder (a base for adapters), sentiment data."""
    root = tmp_path_factory.mktemp("allowed")
    make_folder(root / "models", "bert", "sequence-classification").rename(root / "models" / "cls")
    make_folder(root / "models", "bert", "base").rename(root / "models" / "base")
    (root / "data").mkdir()
    write_sentiment(root / "data" / "train.jsonl", 32, seed=0)
    return root


def make_app(tmp_path: Path, root: Path, **settings) -> TestClient:
    return TestClient(create_app(Settings(data_dir=tmp_path / "data", allowed_dirs=[root], predict_dtype="float32",
                                          batch_token_budgets=[], **settings), run_worker=False))


def adapter(base: Path, out: Path) -> Path:
    model = hfport.tasks.get("text-classification").model_class.from_pretrained(
        base, id2label={0: "negative", 1: "positive"})
    save_random_adapter(model, out, base=base, seed=1, r=4, alpha=8, targets=["q", "v"])
    return out


def error(r, status: int, error_type: str) -> str:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.json()["error_type"] == error_type, r.text
    return r.json()["error"]


# --- 9: the upload sweeper --------------------------------------------------------------------------------------

def test_the_sweeper_keeps_every_path_a_live_job_or_a_registered_model_names(tmp_path):
    from server.store import open_store
    from server.uploads import sweep

    root = tmp_path / "uploads"
    store = open_store(str(tmp_path / "hfport.db"))
    try:
        names = ("out", "gate", "model", "base", "orphan")
        for name in names:
            (root / name).mkdir(parents=True)
            (root / name / "f").write_text("x")
            os.utime(root / name, (time.time() - 3600,) * 2)
        # a queued fine-tune writing its run under uploads/ (as main accepted), an export reading an option file there
        store.create_job("finetune", {"train": "/elsewhere/train.jsonl", "output_dir": str(root / "out" / "run")})
        store.create_job("export", {"model": "/m", "options": {"gate_data": str(root / "gate" / "f")},
                                    "output_dir": "/x"})
        # jobs long over, their models registered there: the sweeper must not delete a registered model
        store.register_model("m", str(root / "model"), "text-classification")
        store.register_model("a", "/adapters/a", "text-classification", kind="adapter", base=str(root / "base"))
        assert sweep(store, root, grace_s=600) == ["orphan"]
        assert all((root / name / "f").is_file() for name in names if name != "orphan")
    finally:
        store.close()


def test_an_output_dir_under_uploads_is_refused(tmp_path, root):
    with make_app(tmp_path, root) as client:
        uploads = tmp_path / "data" / "uploads"
        body = {"model": str(root / "models" / "cls"), "output_dir": str(uploads / "mine")}
        assert "uploads folder" in error(client.post("/jobs/export", json=body), 400, "InvalidPath")
        config = {"model": str(root / "models" / "cls"), "train": str(root / "data" / "train.jsonl"),
                  "output_dir": str(uploads / "run")}
        error(client.post("/jobs/finetune", json={"config": config}), 400, "InvalidPath")
        assert client.get("/jobs").json()["jobs"] == []


def test_an_export_jobs_gate_thresholds_are_checked_when_it_is_submitted(tmp_path, root):
    """min_agreement / min_cosine outside (0, 1] are a 422 naming the option, not a queued job that fails later."""
    with make_app(tmp_path, root) as client:
        for option, value in (("min_agreement", 1.5), ("min_cosine", 0)):
            body = {"model": str(root / "models" / "cls"), "format": "onnx-int8", "options": {option: value}}
            message = error(client.post("/jobs/export", json=body), 422, "ValidationError")
            assert f"{option} {float(value)!r}: expected a fraction in (0, 1]" in message, message
        assert client.get("/jobs").json()["jobs"] == []
        ok = {"model": str(root / "models" / "cls"), "format": "onnx-int8", "options": {"min_agreement": 0.97}}
        assert client.post("/jobs/export", json=ok).status_code == 202


# --- 10: export of a registered adapter ---------------------------------------------------------------------------

def test_export_of_a_registered_adapter_loads_its_registered_base(tmp_path, root):
    from server import jobrun

    work = root / "moved"
    shutil.copytree(root / "models" / "base", work / "base-old")
    folder = adapter(work / "base-old", work / "adapter")
    (work / "base-old").rename(work / "base-new")  # the base moved: the adapter's file names a folder now gone
    with make_app(tmp_path, root) as client:
        r = client.post("/models", json={"name": "ad", "path": str(folder), "base": str(work / "base-new")})
        assert r.status_code == 201, r.text
        r = client.post("/jobs/export", json={"model": "ad", "format": "merged"})
        assert r.status_code == 202, r.text
        store = client.app.state.store
        result = jobrun.run_export(store, store.get_job(r.json()["id"]))  # what the job process runs
        assert result["verify"]["passed"], result
        assert store.get_job(r.json()["id"])["config"]["base_model"] == str((work / "base-new").resolve())
    # the merge equals the adapter over its registered base
    texts = ["a b c", "d e"]
    merged = hfport.pipeline("text-classification", model=result["output_dir"])(texts, top_k=None)
    model = hfport.tasks.get("text-classification").model_class.from_pretrained(folder,
                                                                                base_model=work / "base-new")
    want = hfport.pipeline("text-classification", model=model, tokenizer=work / "base-new")(texts, top_k=None)
    for got, ref in zip(merged, want):
        assert [d["score"] for d in got] == pytest.approx([d["score"] for d in ref], abs=1e-5)


def test_an_adapter_whose_base_lies_outside_is_refused(tmp_path, root):
    outside = tmp_path / "outside"
    shutil.copytree(root / "models" / "base", outside / "base")
    folder = adapter(outside / "base", root / "adapters" / "outside-base")
    with make_app(tmp_path, root) as client:
        for route, body in (("/jobs/export", {"model": str(folder)}),
                            ("/jobs/export", {"model": str(folder), "format": "merged"}),
                            ("/jobs/finetune", {"config": {"model": str(folder),
                                                           "train": str(root / "data" / "train.jsonl")}})):
            message = error(client.post(route, json=body), 403, "PathNotAllowed")
            assert "base_model_name_or_path" in message, message
        assert client.get("/jobs").json()["jobs"] == []


def test_an_adapter_over_a_graph_folder_is_refused_at_registration(tmp_path, root):
    """An ONNX folder as an adapter's base (registered, or a folder) runs a fixed graph with no LoRA layers: POST
    /models refuses it (it was registered, and every request for the adapter then failed: 500 on the TEI routes)."""
    from hfport.export.onnx import export_onnx

    graph = export_onnx(root / "models" / "cls", root / "graphs" / "cls-onnx").out
    folder = adapter(root / "models" / "base", root / "adapters" / "over-a-graph")
    with make_app(tmp_path, root) as client:
        assert client.post("/models", json={"name": "g", "path": str(graph)}).status_code == 201
        for base in ("g", str(graph)):
            message = error(client.post("/models", json={"name": "ad", "path": str(folder), "base": base}), 400,
                            "InvalidModel")
            assert message == (f"base: {base!r} is an onnx folder, which runs a fixed graph; register the adapter over "
                               "the model folder it was trained on"), message
        assert client.post("/models", json={"name": "ad", "path": str(folder),
                                            "base": str(root / "models" / "base")}).status_code == 201
        # one registered before this check (straight into the store): its requests are refused by name, no 500
        client.app.state.store.register_model("old-ad", str(folder), "text-classification", kind="adapter",
                                              base=str(graph))
        tei = error(client.post("/predict", json={"inputs": "a"}, headers={"x-model": "old-ad"}), 424, "Backend")
        native = error(client.post("/predict", json={"model": "old-ad", "inputs": ["a"]}), 400, "LoraError")
        for message in (tei, native):
            assert "adapter 'old-ad': the OnnxModel backend runs a fixed graph" in message, message


def test_a_model_registered_for_another_heads_task_is_refused(tmp_path, root):
    """A token-classification folder registered as text-classification: its `classifier` weights would load as a
    sequence classifier's (same names and shape) and answer misread; /predict refuses it as an untrained head."""
    ner = make_folder(root / "models", "bert", "token-classification")
    with make_app(tmp_path, root) as client:
        r = client.post("/models", json={"name": "ner-as-cls", "path": str(ner), "task": "text-classification"})
        assert r.status_code == 201, r.text
        message = error(client.post("/predict", json={"model": "ner-as-cls", "inputs": ["a b"]}), 400,
                        "UntrainedHeadError")
        assert "architectures name a token-classification model" in message, message
        assert client.post("/predict", json={"model": "ner-as-cls", "task": "token-classification",
                                             "inputs": ["a b"]}).status_code == 200


def test_the_library_export_takes_the_base(tmp_path, root):
    base = tmp_path / "base"
    shutil.copytree(root / "models" / "base", base)
    folder = adapter(base, tmp_path / "adapter")
    moved = base.rename(tmp_path / "elsewhere")
    with pytest.raises(hfport.HfportError):
        hfport.export(folder, tmp_path / "no-base")  # the folder its adapter_config.json names is gone
    result = hfport.export(folder, tmp_path / "peft", base_model=moved, verify=True)
    assert result.format == "peft" and result.report.passed, result.report
    with pytest.raises(hfport.ExportError, match="plain model"):
        hfport.export(moved, tmp_path / "x", base_model=moved)


# --- 11: files inside a model folder ----------------------------------------------------------------------------

def test_a_symlink_out_of_a_model_folder_is_never_read(tmp_path, root):
    outside = tmp_path / "outside"
    outside.mkdir()
    folder = root / "models" / "linked"
    shutil.copytree(root / "models" / "cls", folder)
    secret = outside / "tokenizer.json"
    shutil.copy(folder / "tokenizer.json", secret)
    with make_app(tmp_path, root) as client:
        # registered while clean, linked out before its first load: the load refuses it
        assert client.post("/models", json={"name": "linked", "path": str(folder)}).status_code == 201
        (folder / "tokenizer.json").unlink()
        (folder / "tokenizer.json").symlink_to(secret)
        message = error(client.post("/decode", json={"ids": [5, 6, 7]}, headers={"x-model": "linked"}), 403,
                        "PathNotAllowed")
        assert "tokenizer.json links outside the allowed directories" in message and str(secret) not in message
        error(client.post("/predict", json={"model": "linked", "inputs": "a b"}), 403, "PathNotAllowed")
        # registering it, or naming it in a job, is refused too
        error(client.post("/models", json={"name": "again", "path": str(folder)}), 403, "PathNotAllowed")
        error(client.post("/jobs/export", json={"model": "linked"}), 403, "PathNotAllowed")
        error(client.post("/jobs/export", json={"model": str(folder)}), 403, "PathNotAllowed")
        # a folder linked out as a whole (a sub-folder here) is refused as its files are
        (folder / "tokenizer.json").unlink()
        shutil.copy(secret, folder / "tokenizer.json")
        (folder / "1_Pooling").symlink_to(outside, target_is_directory=True)
        error(client.post("/models", json={"name": "again", "path": str(folder)}), 403, "PathNotAllowed")
        (folder / "1_Pooling").unlink()
        assert client.post("/models", json={"name": "clean", "path": str(folder)}).status_code == 201
        assert client.post("/decode", json={"ids": [5, 6]}, headers={"x-model": "clean"}).status_code == 200


def test_a_model_the_operator_named_at_start_is_read_as_a_whole(tmp_path, root):
    """`serve --model` folders are the operator's choice (an HF cache snapshot's files are links into its blobs):
    their files are not confined."""
    snapshot = tmp_path / "cache" / "snapshot"
    blobs = tmp_path / "cache" / "blobs"
    shutil.copytree(root / "models" / "cls", snapshot)
    blobs.mkdir()
    (snapshot / "tokenizer.json").rename(blobs / "tok")
    (snapshot / "tokenizer.json").symlink_to(blobs / "tok")
    with make_app(tmp_path, root, models=[f"cached={snapshot}"]) as client:
        r = client.post("/decode", json={"ids": [5, 6]}, headers={"x-model": "cached"})
        assert r.status_code == 200, r.text


# --- 12: the data check's size limit ----------------------------------------------------------------------------

def test_the_data_check_limit_counts_folders_and_globs(tmp_path, root):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    shards = root / "shards"
    shards.mkdir(exist_ok=True)
    rows = {"text": [f"row {i} " * 20 for i in range(64)], "label": ["positive", "negative"] * 32}
    for i in range(3):
        pq.write_table(pa.table(rows), shards / f"part-{i}.parquet")
    one = (shards / "part-0.parquet").stat().st_size
    with make_app(tmp_path, root, max_data_bytes=2 * one) as client:  # each file fits, together they do not
        for train in (str(shards / "*.parquet"), str(shards)):
            config = {"model": str(root / "models" / "cls"), "train": train}
            message = error(client.post("/jobs/finetune", json={"config": config}), 413, "PayloadTooLarge")
            assert f"{3 * one:,} bytes" in message and "HFPORT_MAX_DATA_BYTES" in message, message


# --- 13: Idempotency-Key on the upload route ---------------------------------------------------------------------

def test_idempotency_key_on_the_upload_route(tmp_path, root):
    import json

    data = (root / "data" / "train.jsonl").read_bytes()
    config = json.dumps({"model": str(root / "models" / "cls"), "batch_size": 8, "max_length": 16})

    def upload(key: str, content: bytes = data):
        return client.post("/jobs/finetune/upload", data={"config": config},
                           files={"train": ("train.jsonl", content)}, headers={"Idempotency-Key": key})

    with make_app(tmp_path, root) as client:
        first = upload("k1")
        assert first.status_code == 202, first.text
        again = upload("k1")
        assert again.status_code == 202 and again.json()["id"] == first.json()["id"], again.text
        assert len(client.get("/jobs").json()["jobs"]) == 1
        uploads = tmp_path / "data" / "uploads"
        assert len(list(uploads.iterdir())) == 1  # the retry's copy of the file is gone
        assert Path(first.json()["config"]["train"]).is_file()
        other = data.replace(b"positive", b"negative", 1)
        assert "Idempotency-Key 'k1'" in error(upload("k1", other), 409, "IdempotencyKeyReused")
        assert upload("k2").json()["id"] != first.json()["id"]
        assert len(client.get("/jobs").json()["jobs"]) == 2 and len(list(uploads.iterdir())) == 2
