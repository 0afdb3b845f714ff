"""The server's evaluate job (POST /jobs/evaluate: hfport.evaluate in a job process, eval.json and report.html in its
folder, the figures in its result), its paths confined and its options checked before it is queued, and the store's
migration 5 (jobs.kind takes 'evaluate') on SQLite and a real PostgreSQL, with the jobs and events a version-4
database already holds kept."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import hfport
from server.store import SCHEMA_VERSION, open_store
from server.store import migrations
from tests.pgserver import fresh_db_name

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "examples" / "data"


@pytest.fixture(params=["sqlite", "postgresql"])
def target(request, tmp_path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "hfport.db")
    return request.getfixturevalue("pg_server").create_database(fresh_db_name())


def _v4_job(store, kind: str) -> dict:
    """A job row as hfport at schema version 4 wrote it (today's create_job writes columns added since)."""
    job_id = store.new_id()
    with store.connect() as db:
        db.execute(f"INSERT INTO jobs (id, kind, status, config, created_at) VALUES (?, ?, 'queued', '{{}}', "
                   f"{store.NOW})", (job_id, kind))
    store.add_event(job_id, {"type": "status", "status": "queued"})
    return {"id": job_id}


def test_a_version_4_database_takes_evaluate_jobs_and_keeps_its_own(target, monkeypatch):
    with monkeypatch.context() as m:  # the schema as version 4 left it
        for dialect, steps in migrations.MIGRATIONS.items():
            m.setitem(migrations.MIGRATIONS, dialect, tuple(s for s in steps if s.version <= 4))
        old = open_store(target)
        assert old.schema_version() == 4
        kept, exported = (_v4_job(old, kind) for kind in ("finetune", "export"))
        old.add_event(kept["id"], {"type": "train", "step": 1})
        old.close()
    store = open_store(target)
    assert store.schema_version() == SCHEMA_VERSION >= 5
    assert store.get_job(kept["id"])["kind"] == "finetune" and store.get_job(exported["id"])["kind"] == "export"
    assert [e["type"] for _, e in store.events_after(kept["id"])] == ["status", "train"]
    job = store.create_job("evaluate", {"model": "/m"})
    assert store.get_job(job["id"])["kind"] == "evaluate"
    with pytest.raises(Exception, match="(?i)check"):  # the database itself still refuses a kind it does not know
        with store.connect() as db:
            db.execute(f"INSERT INTO jobs (id, kind, status, config, created_at) VALUES ('x', 'bogus', 'queued', "
                       f"'{{}}', {store.NOW})")
    store.close()


def test_http_evaluate_job(tmp_path, tiny_bert, minilm_path):
    """A registered model, a run folder (its best/) to compare with, data inside the allowed dirs: the job writes
    eval.json and report.html and its result holds both models' figures, those `hfport evaluate` computes. Paths
    outside the allowed dirs and options the task's evaluation does not take are refused before anything is
    queued."""
    import httpx

    from tests.serving import Server, assert_error, wait_job

    root = tmp_path / "allowed"
    (root / "data").mkdir(parents=True)
    shutil.copytree(tiny_bert, root / "base")
    shutil.copytree(tiny_bert, root / "run" / "best")  # a fine-tune's run folder: its best/ is evaluated
    shutil.copy(DATA / "embed_eval.jsonl", root / "data" / "queries.jsonl")
    (root / "data" / "corpus.txt").write_text("Paris lies in Europe.\nThe yen is Japan's money.\n")
    server = Server(tmp_path / "srv", root, workers=1).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            assert client.post("/models", json={"name": "base", "path": str(root / "base")}).status_code == 201
            body = {"model": "base", "task": "sentence-similarity", "data": "queries.jsonl", "compare":
                    str(root / "run"), "corpus": str(root / "data" / "corpus.txt")}
            assert_error(client.post("/jobs/evaluate", json=body), 400, "InvalidPath")  # relative: from data dir
            body["data"] = str(root / "data" / "queries.jsonl")
            assert_error(client.post("/jobs/evaluate", json={**body, "data": str(DATA / "embed_eval.jsonl")}), 403,
                         "PathNotAllowed")
            error = assert_error(client.post("/jobs/evaluate", json={**body, "options": {"label_column": "x"}}),
                                 422, "InvalidConfig")
            assert "unknown option(s) ['label_column']" in error["error"]
            r = client.post("/jobs/evaluate", json=body)
            assert r.status_code == 202, r.text
            assert r.json()["kind"] == "evaluate" and r.json()["config"]["task"] == "sentence-embedding"
            assert r.json()["config"]["compare"] == str((root / "run" / "best").resolve())
            job = wait_job(client, r.json()["id"], lambda j: j["status"] == "succeeded", timeout=240)
            result = job["result"]
            saved = json.loads(Path(result["json"]).read_text())
            assert Path(result["report"]).is_file() and "recall@k" in Path(result["report"]).read_text()
            assert [r["model"] for r in result["results"]] == [str((root / "base").resolve()),
                                                               str((root / "run" / "best").resolve())]
            assert saved["results"][0]["metrics"] == result["results"][0]["metrics"]
            assert job["metrics"]["cosine_ndcg@10"] == result["results"][0]["metrics"]["cosine_ndcg@10"]
            local = hfport.evaluate(root / "base", root / "data" / "queries.jsonl", task="sentence-embedding",
                                    corpus=root / "data" / "corpus.txt", cache=False, progress=False).metrics
            assert local == pytest.approx(result["results"][0]["metrics"], abs=1e-9)
            listed = client.get("/jobs").json()["jobs"]
            assert any(j["id"] == job["id"] and j["kind"] == "evaluate" for j in listed)
    finally:
        server.stop()
