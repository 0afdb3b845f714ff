"""Idempotent submission (server/idempotency.py) through the HTTP routes, on the embedded store (the store-level
race on both backends is tests/test_store_backends.py): a retry with the same key and body returns the same job,
another body is a 409 naming the key, concurrent submissions with one key create one job, keys expire after
idempotency.TTL_S (24 h), and a request without a key behaves as before. Fine-tunes racing for one `register_as`
name queue one job: the others get a 409 naming it, or, sent with one key, that job."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from server import idempotency
from server.app import create_app
from server.settings import Settings
from tests.cluster import build_inputs, job_config


@pytest.fixture
def app(tmp_path, minilm_path):
    data = tmp_path / "data"
    model, train = build_inputs(data / "inputs", minilm_path)
    settings = Settings(data_dir=data)
    with TestClient(create_app(settings, run_worker=False)) as client:
        client.model, client.train, client.settings = model, train, settings
        yield client


def export(client: TestClient, key: str | None, out: str = "exports/a"):
    headers = {"Idempotency-Key": key} if key is not None else {}
    return client.post("/jobs/export", json={"model": str(client.model), "output_dir": out}, headers=headers)


def jobs(client: TestClient) -> list[str]:
    return [j["id"] for j in client.get("/jobs", params={"limit": 100}).json()["jobs"]]


def test_a_retry_returns_the_same_job_and_another_body_is_refused(app):
    first = export(app, "k-1")
    assert first.status_code == 202, first.text
    again = export(app, "k-1")
    assert again.status_code == 202 and again.json()["id"] == first.json()["id"]
    other = export(app, "k-1", out="exports/b")
    assert other.status_code == 409
    body = other.json()
    assert set(body) == {"error", "error_type"} and body["error_type"] == "IdempotencyKeyReused"
    assert "Idempotency-Key 'k-1'" in body["error"] and first.json()["id"] in body["error"]
    # without a key, every POST is a new job (as before); a key is per route
    assert export(app, None, "exports/c").json()["id"] != export(app, None, "exports/d").json()["id"]
    assert len(jobs(app)) == 3
    bad = export(app, "has space")
    assert bad.status_code == 422 and "Idempotency-Key" in bad.json()["error"]


def test_the_finetune_route_takes_a_key(app):
    body = {"config": {**job_config(app.train, 4, 2), "model": str(app.model)}}
    first = app.post("/jobs/finetune", json=body, headers={"Idempotency-Key": "ft-1"})
    assert first.status_code == 202, first.text
    again = app.post("/jobs/finetune", json=body, headers={"Idempotency-Key": "ft-1"})
    assert again.status_code == 202 and again.json()["id"] == first.json()["id"]
    changed = {"config": {**body["config"], "max_steps": 5}}
    other = app.post("/jobs/finetune", json=changed, headers={"Idempotency-Key": "ft-1"})
    assert other.status_code == 409 and "'ft-1'" in other.json()["error"]
    # the same key on the other route is another key
    assert export(app, "ft-1").status_code == 202
    assert len(jobs(app)) == 2


def test_concurrent_submissions_with_one_key_create_one_job(app):
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: export(app, "race"), range(16)))
    assert all(r.status_code == 202 for r in answers), [r.text for r in answers]
    assert len({r.json()["id"] for r in answers}) == 1
    assert jobs(app) == [answers[0].json()["id"]]


def test_keys_expire_after_the_ttl(app):
    first = export(app, "old").json()["id"]
    store = app.app.state.store
    with store.connect() as db:
        db.execute(f"UPDATE idempotency_keys SET created_at = {store.NOW} - ?", (idempotency.TTL_S + 1,))
    shutil.rmtree(app.settings.data_dir / "exports", ignore_errors=True)
    second = export(app, "old")
    assert second.status_code == 202 and second.json()["id"] != first
    assert export(app, "old").json()["id"] == second.json()["id"]


def test_concurrent_finetunes_registering_one_name_queue_one_job(app):
    """Two API processes (here threads) that each accept a fine-tune registering one name would let the job that
    ends last silently take the other's model: the name is reserved at submission, so one job is queued and the
    others are refused naming it; a plain registration of the name too, while that job is live."""
    body = {"config": {**job_config(app.train, 4, 2), "model": str(app.model)}, "register_as": "topics"}
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: app.post("/jobs/finetune", json=body), range(4)))
    queued = [r.json()["id"] for r in answers if r.status_code == 202]
    assert len(queued) == 1, [r.text for r in answers]
    for r in answers:
        if r.status_code != 202:
            assert r.status_code == 409 and r.json()["error_type"] == "Conflict", r.text
            assert r.json()["error"].startswith(f"register_as: 'topics' is the name job {queued[0]} "), r.text
    taken = app.post("/models", json={"name": "topics", "path": str(app.model)})
    assert taken.status_code == 409 and queued[0] in taken.json()["error"], taken.text
    with ThreadPoolExecutor(4) as pool:  # one key: a retry, every answer the one job
        keyed = list(pool.map(lambda _: app.post("/jobs/finetune", json={**body, "register_as": "other"},
                                                 headers={"Idempotency-Key": "ft-race"}), range(4)))
    assert {r.status_code for r in keyed} == {202} and len({r.json()["id"] for r in keyed}) == 1
    assert len(jobs(app)) == 2
