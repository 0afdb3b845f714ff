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
from tests.test_finetune import write_sentiment
from tests.test_pipelines import make_folder
from tests.tiny import save_random_adapter


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
                                          batch_autotune=False, **settings), run_worker=False))


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
