"""The job store's one interface on both backends: SQLite (embedded) and a real PostgreSQL started by the tests
(tests/pgserver.py; never a mock). Lifecycle, concurrent claims and event numbering, migrations (legacy database,
newer schema refused), the database clock for leases, worker ids, fencing, cancel across processes, and the bad
inputs at start (unreachable database, missing driver, unknown scheme)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from server.settings import Settings
from server.store import (SCHEMA_VERSION, BaseStore, DatabaseRefused, DuplicateWorker, IdempotencyKey,
                          IdempotencyKeyUsed, Lease, LeaseLost, MissingDriver, ModelNameTaken, SchemaTooNew, Store,
                          StoreError, StoreUnavailable, open_store)
from server.worker import Worker
from tests.forked import run_cli
from tests.pgserver import Relay, fresh_db_name

BACKENDS = ["sqlite", "postgresql"]
CFG = {"model": "/nowhere", "options": {}, "verify": False, "output_dir": "/nowhere/out"}


@pytest.fixture(params=BACKENDS)
def target(request, tmp_path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "hfport.db")
    return request.getfixturevalue("pg_server").create_database(fresh_db_name())


@pytest.fixture
def store(target) -> BaseStore:
    s = open_store(target)
    yield s
    s.close()


def settings_for(tmp_path: Path, target: str, **kw) -> Settings:
    url = target if target.startswith("postgresql://") else None
    return Settings(data_dir=tmp_path / "data", database_url=url, **kw)


# --- the interface ---------------------------------------------------------------------------------------------


def test_job_lifecycle(store):
    assert store.schema_version() == SCHEMA_VERSION
    job = store.create_job("export", CFG)
    assert job["status"] == "queued" and job["attempts"] == 0 and job["worker_id"] is None
    claimed = store.claim_next("w1")
    assert claimed["id"] == job["id"] and claimed["status"] == "running"
    assert claimed["worker_id"] == "w1" and claimed["attempts"] == 1
    assert store.claim_next("w2") is None  # nothing else queued
    assert store.heartbeat(job["id"], attempt=1) and not store.heartbeat(job["id"], attempt=2)
    store.update_progress(job["id"], {"step": 3}, {"loss": 0.5})
    store.update_progress(job["id"], {"epoch": 1})
    got = store.get_job(job["id"])
    assert got["progress"] == {"step": 3, "epoch": 1} and got["metrics"] == {"loss": 0.5}
    assert not store.finish(job["id"], "succeeded", attempt=2)  # a stale attempt cannot finish it
    assert store.finish(job["id"], "succeeded", result={"ok": True}, attempt=1)
    assert not store.finish(job["id"], "failed")  # once
    done = store.get_job(job["id"])
    assert done["status"] == "succeeded" and done["result"] == {"ok": True} and done["finished_at"] >= \
        done["started_at"] >= done["created_at"]
    kinds = [(e["type"], e.get("status")) for _, e in store.events_after(job["id"])]
    assert kinds == [("status", "queued"), ("status", "running"), ("status", "succeeded")]
    assert store.count_by_status() == {"succeeded": 1}


def test_cancel_queued_and_running(store):
    queued = store.create_job("export", CFG)
    assert store.request_cancel(queued["id"])["status"] == "cancelled"
    running = store.create_job("export", CFG)
    store.claim_next("w1")
    flagged = store.request_cancel(running["id"])
    assert flagged["status"] == "running" and flagged["cancel_requested"]
    assert store.request_cancel("nope") is None


def test_event_numbers_survive_a_resume(store):
    """Sequence numbers only grow: events dropped on resume are never renumbered, so a client resuming with
    Last-Event-ID neither repeats nor skips what came after."""
    job = store.create_job("finetune", CFG)
    for step in range(1, 6):
        store.add_event(job["id"], {"type": "train", "step": step})
        store.add_event(job["id"], {"type": "perf", "step": step, "steps_per_s": 9.0})  # the monitor's, per step
    last = store.events_after(job["id"])[-1][0]
    store.drop_events_past(job["id"], 2)
    for kind in ("train", "perf"):  # the resumed attempt writes steps 3.. again: each stays in the history once
        assert [e["step"] for _, e in store.events_after(job["id"]) if e["type"] == kind] == [1, 2], kind
    seq = store.add_event(job["id"], {"type": "resumed", "step": 2})
    assert seq == last + 1
    assert [s for s, _ in store.events_after(job["id"], last)] == [seq]


def test_models_upsert_and_kind(store):
    store.register_model("m", "/a", "text-classification")
    with pytest.raises(Exception):  # a second plain register of the same name is a conflict
        store.register_model("m", "/b", None)
    again = store.register_model("m", "/b", None, replace=True)
    assert again["path"] == "/b" and again["kind"] == "model"
    store.register_model("lora-1", "/c", None, kind="adapter")
    assert [m["name"] for m in store.list_models(kind="adapter")] == ["lora-1"]
    assert [m["name"] for m in store.list_models()] == ["lora-1", "m"]
    assert store.delete_model("m") and not store.delete_model("m")


def test_concurrent_claims_take_each_job_once(target):
    """4 threads (own connections) claim 24 jobs: every job exactly once (SKIP LOCKED on PostgreSQL, the write
    lock on SQLite)."""
    stores = [open_store(target) for _ in range(4)]
    ids = {stores[0].create_job("export", CFG)["id"] for _ in range(24)}
    taken: list[list[str]] = [[] for _ in stores]

    def claim(i: int) -> None:
        while (job := stores[i].claim_next(f"w{i}")) is not None:
            taken[i].append(job["id"])

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    flat = [j for t in taken for j in t]
    assert sorted(flat) == sorted(ids)
    for i, mine in enumerate(taken):
        assert all(stores[0].get_job(j)["worker_id"] == f"w{i}" for j in mine)
    for s in stores:
        s.close()


def test_concurrent_event_appends_are_numbered_without_gaps(target):
    stores = [open_store(target) for _ in range(4)]
    job = stores[0].create_job("finetune", CFG)

    def write(i: int) -> None:
        for k in range(15):
            stores[i].add_event(job["id"], {"type": "train", "writer": i, "k": k})

    threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    seqs = [s for s, _ in stores[0].events_after(job["id"])]
    assert seqs == list(range(1, 62))  # the "queued" event, then 60 appends
    for s in stores:
        s.close()


# --- migrations ------------------------------------------------------------------------------------------------


def test_reopen_is_idempotent_and_newer_schema_is_refused(target):
    first = open_store(target)
    job = first.create_job("export", CFG)
    first.close()
    again = open_store(target)  # nothing pending: no error, data kept
    assert again.get_job(job["id"])["status"] == "queued"
    with again.connect() as db:
        db.execute("INSERT INTO schema_version (version, name) VALUES (?, ?)", (SCHEMA_VERSION + 1, "from the future"))
    again.close()
    with pytest.raises(SchemaTooNew) as info:
        open_store(target)
    message = str(info.value)
    assert f"version {SCHEMA_VERSION + 1}" in message and f"version {SCHEMA_VERSION})" in message
    assert ("SQLite database" in message) if "://" not in target else ("PostgreSQL database" in message)


def test_processes_starting_together_migrate_once(target):
    """Several processes open a fresh database at the same moment: one migrates, none fails."""
    code = ("import sys; from server.store import open_store; s = open_store(sys.argv[1]); "
            "print(s.schema_version())")
    procs = [subprocess.Popen([sys.executable, "-c", code, target], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    assert [o[0].strip() for o in outs] == [str(SCHEMA_VERSION)] * 3
    s = open_store(target)
    with s.connect() as db:
        versions = [r["version"] for r in db.execute("SELECT version FROM schema_version ORDER BY version")]
    assert versions == list(range(1, SCHEMA_VERSION + 1))


def test_legacy_sqlite_database_is_migrated_in_place(tmp_path):
    """A database written before versioning (version 1's tables, no schema_version) keeps its jobs and events; the
    event counter continues after the existing events."""
    from server.store.migrations import MIGRATIONS

    path = tmp_path / "hfport.db"
    db = sqlite3.connect(path)
    for statement in MIGRATIONS["sqlite"][0].statements:
        db.execute(statement)
    db.execute("INSERT INTO jobs (id, kind, status, config, created_at) VALUES ('old1', 'export', 'queued', '{}', 1)")
    db.executemany("INSERT INTO events (job_id, seq, data) VALUES ('old1', ?, '{}')", [(1,), (2,), (3,)])
    db.commit()
    db.close()
    store = Store(path)
    assert store.schema_version() == SCHEMA_VERSION
    assert store.get_job("old1")["event_seq"] == 3
    assert store.add_event("old1", {"type": "x"}) == 4


# --- leases, workers, the database clock -----------------------------------------------------------------------


def _age_heartbeat(store: BaseStore, job_id: str, seconds: float) -> None:
    with store.connect() as db:
        db.execute(f"UPDATE jobs SET heartbeat_at = {store.NOW} - ? WHERE id = ?", (seconds, job_id))


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_lease_rule(store, target, tmp_path):
    """A stale job with no process is requeued (once, even when two workers notice); a fresh one, or one whose
    process still lives on this host, is left alone."""
    settings = settings_for(tmp_path, target, job_lease_s=5.0)
    workers = [Worker(settings, store), Worker(settings, open_store(target))]
    stale, fresh, alive = (store.create_job("export", CFG)["id"] for _ in range(3))
    for _ in range(3):
        store.claim_next("gone-worker")
    _age_heartbeat(store, stale, 60)
    _age_heartbeat(store, alive, 60)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "server.jobrun", alive])
    try:
        for w in workers:
            w._check_leases()
        assert store.get_job(stale)["status"] == "queued"
        requeues = [e for _, e in store.events_after(stale) if "lease expired" in e.get("reason", "")]
        assert len(requeues) == 1, requeues
        assert store.get_job(fresh)["status"] == "running"
        assert store.get_job(alive)["status"] == "running"
    finally:
        holder.kill()
        holder.wait()


def test_a_job_cancelled_while_its_worker_died_is_not_run_again(store):
    """A cancel sent (to any API process) while a job runs is carried out by the worker holding it. If that worker
    died first, whoever moves the job off its expired lease ends it `cancelled` rather than queueing it to resume:
    by hand it was requeued ("resumes from its last checkpoint"), claimed and started by another worker, and only
    then stopped. A job without a cancel request is requeued as before."""
    job, other = store.create_job("finetune", CFG), store.create_job("finetune", CFG)
    store.claim_next("A"), store.claim_next("A")
    assert store.request_cancel(job["id"])["cancel_requested"]
    for stale in (job, other):
        _age_heartbeat(store, stale["id"], 60)
    assert store.requeue(job["id"], "lease expired", stale_after=5.0) == "cancelled"
    assert store.requeue(other["id"], "lease expired", stale_after=5.0) == "queued"
    ended = store.get_job(job["id"])
    assert ended["status"] == "cancelled" and ended["finished_at"] is not None and ended["worker_id"] == "A"
    assert store.claim_next("B")["id"] == other["id"] and store.claim_next("B") is None  # never claimed again
    assert store.requeue(job["id"], "again") is None
    statuses = [e["status"] for _, e in store.events_after(job["id"]) if e["type"] == "status"]
    assert statuses == ["queued", "running", "cancelled"]


def test_leases_use_the_database_clock(store, target, tmp_path, monkeypatch):
    """A worker whose clock jumps an hour ahead does not steal a fresh lease, and one whose clock lags does not
    keep a stale one alive: the comparison is made in SQL against the database's clock."""
    settings = settings_for(tmp_path, target, job_lease_s=5.0)
    fresh, stale = (store.create_job("export", CFG)["id"] for _ in range(2))
    store.claim_next("elsewhere")
    store.claim_next("elsewhere")
    _age_heartbeat(store, stale, 30)
    worker = Worker(settings, store)
    real = time.time
    for skew in (3600.0, -3600.0):
        monkeypatch.setattr(time, "time", lambda skew=skew: real() + skew)
        worker._last_lease_check = -1e9
        worker._check_leases()
    monkeypatch.setattr(time, "time", real)
    assert store.get_job(fresh)["status"] == "running"
    assert store.get_job(stale)["status"] == "queued"
    assert abs(store.db_now() - real()) < 5  # the two clocks agree here; the point is which one is read


def test_duplicate_worker_id_is_refused_while_the_other_lives(store, target, tmp_path):
    settings = settings_for(tmp_path, target, worker_id="gpu-box-1", job_lease_s=5.0)
    first = Worker(settings, store)
    first.register()
    second = Worker(settings, store)
    second.host, second.pid = "another-host", 4242  # the same id, started on another machine
    with pytest.raises(DuplicateWorker, match=r"worker id 'gpu-box-1' is held by a live worker .*HFPORT_WORKER_ID"):
        second.register()
    # the first one dies without cleaning up: once its heartbeat is older than the lease, the id is free
    with store.connect() as db:
        db.execute(f"UPDATE workers SET heartbeat_at = {store.NOW} - 60 WHERE id = ?", ("gpu-box-1",))
    second.register()
    assert [(w["host"], w["pid"]) for w in store.list_workers()] == [("another-host", 4242)]
    assert not first.store.worker_beat("gpu-box-1", first.pid)  # the old holder learns it lost the id
    # on this host, a dead process's row under the same id is taken over at once (a restart keeping its id)
    third = Worker(settings_for(tmp_path, target, worker_id="local-1"), store)
    store.register_worker("local-1", third.host, dead_pid(), 5.0)
    third.register()
    assert {w["id"]: w["pid"] for w in store.list_workers()}["local-1"] == third.pid


def test_cancel_from_another_process_reaches_the_worker(store, target, tmp_path):
    """The worker holding a job polls its cancel flag: a cancel written through another store connection (another
    API process, on any host) stops the job's process and ends it `cancelled`."""
    worker = Worker(settings_for(tmp_path, target), store)
    job = store.create_job("export", CFG)
    claimed = store.claim_next(worker.id)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    worker.procs[job["id"]], worker.attempts[job["id"]] = proc, claimed["attempts"]
    other_api = open_store(target)
    other_api.request_cancel(job["id"])
    worker._sync_held()
    proc.wait(10)
    worker._reap()
    assert store.get_job(job["id"])["status"] == "cancelled"
    other_api.close()


def test_a_lost_lease_stops_the_old_attempt(store, target, tmp_path):
    """Worker A is silent too long; the job is requeued and claimed by B (attempt 2). A kills its process and cannot
    finish the job; only attempt 2 can."""
    settings = settings_for(tmp_path, target, job_lease_s=5.0)
    a = Worker(settings.model_copy(update={"worker_id": "A"}), store)
    job = store.create_job("export", CFG)
    claimed = store.claim_next("A")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    a.procs[job["id"]], a.attempts[job["id"]] = proc, claimed["attempts"]
    _age_heartbeat(store, job["id"], 60)
    assert store.requeue(job["id"], "lease expired", stale_after=5.0)
    assert store.claim_next("B")["attempts"] == 2
    a._sync_held()
    assert proc.poll() is not None and job["id"] not in a.procs
    assert not store.finish(job["id"], "succeeded", attempt=1)
    assert store.get_job(job["id"])["worker_id"] == "B"
    assert store.finish(job["id"], "succeeded", attempt=2)


def _row(store: BaseStore, job_id: str) -> dict:
    with store.connect() as db:
        return dict(db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone())


def test_every_write_of_a_lost_attempt_is_refused(store):
    """Heartbeat, progress, events, the final status and the model registration of an attempt land only while it
    holds the lease: the same attempt AND not expired by the database clock. A refused write changes nothing."""
    job = store.create_job("finetune", CFG)
    store.claim_next("A")
    mine = Lease(job["id"], 1, 5.0)
    assert store.heartbeat(job["id"], lease=mine)
    store.update_progress(job["id"], {"step": 1}, {"loss": 1.0}, lease=mine)
    store.add_event(job["id"], {"type": "train", "step": 1}, lease=mine)
    store.register_model("from-attempt-1", "/runs/a/best", None, lease=mine)
    store.drop_events_past(job["id"], 1, lease=mine)
    with pytest.raises(ValueError, match="cannot write to job"):
        store.add_event("another-job", {"type": "x"}, lease=mine)

    def refused(lease: Lease, name: str) -> None:
        before, events = _row(store, job["id"]), store.events_after(job["id"])
        assert not store.heartbeat(job["id"], lease=lease)
        for write in (lambda: store.update_progress(job["id"], {"step": 99}, {"loss": 9.0}, lease=lease),
                      lambda: store.add_event(job["id"], {"type": "train", "step": 99}, lease=lease),
                      lambda: store.drop_events_past(job["id"], 0, lease=lease),
                      lambda: store.register_model(name, "/stale", None, replace=True, lease=lease)):
            with pytest.raises(LeaseLost, match=rf"job {job['id']}: attempt {lease.attempt} no longer holds"):
                write()
        assert not store.finish(job["id"], "succeeded", result={"stale": True}, lease=lease)
        assert _row(store, job["id"]) == before and store.events_after(job["id"]) == events  # nothing landed
        assert store.get_model(name) is None

    # 1. the lease ran out by the database clock (nobody requeued it yet): the same attempt is refused, and its
    # heartbeat does not revive it
    _age_heartbeat(store, job["id"], 60)
    refused(mine, "late-1")
    assert store.get_job(job["id"])["status"] == "running"
    # 2. requeued and claimed again: attempt 1 is refused even with a fresh heartbeat on the row
    assert store.requeue(job["id"], "lease expired", stale_after=5.0)
    assert store.claim_next("B")["attempts"] == 2
    refused(mine, "late-2")
    theirs = Lease(job["id"], 2, 5.0)
    store.add_event(job["id"], {"type": "train", "step": 2}, lease=theirs)
    assert store.finish(job["id"], "succeeded", result={"ok": True}, lease=theirs)
    # 3. finished: even the winning attempt writes nothing more
    with pytest.raises(LeaseLost):
        store.add_event(job["id"], {"type": "train", "step": 3}, lease=theirs)
    assert store.get_job(job["id"])["result"] == {"ok": True}


def test_start_grace_covers_the_first_lease_only(store):
    """A claim with a start grace is not stale until grace + lease have passed; the job's own first renewal replaces
    it with an ordinary lease."""
    job = store.create_job("export", CFG)
    store.claim_next("A", start_grace_s=30.0)
    assert store.get_job(job["id"])["heartbeat_at"] > store.db_now() + 25
    assert store.stale_running(5.0) == []
    assert store.heartbeat(job["id"], lease=Lease(job["id"], 1, 5.0))
    assert abs(store.get_job(job["id"])["heartbeat_at"] - store.db_now()) < 5
    _age_heartbeat(store, job["id"], 6)
    assert [j["id"] for j in store.stale_running(5.0)] == [job["id"]]


def test_concurrent_submissions_with_one_key_create_one_job(target):
    """8 threads (own connections) submit with one Idempotency-Key at once: one job; the others are told which job
    the key names (the unique key decides, not a check before the insert). An expired key is free again."""
    stores = [open_store(target) for _ in range(8)]
    key = IdempotencyKey("finetune", "retry-1", "hash-a", 3600.0)
    won, lost, barrier = [], [], threading.Barrier(len(stores))

    def submit(i: int) -> None:
        barrier.wait()
        try:
            won.append(stores[i].create_job("finetune", CFG, idempotency=key)["id"])
        except IdempotencyKeyUsed as e:
            lost.append((e.job_id, e.body_hash))

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(won) == 1 and lost == [(won[0], "hash-a")] * 7
    assert [j["id"] for j in stores[0].list_jobs()] == won  # the losers' job rows rolled back
    assert stores[0].idempotent_job("finetune", "retry-1", 3600.0) == (won[0], "hash-a")
    assert stores[0].idempotent_job("export", "retry-1", 3600.0) is None  # keys are per route
    with stores[0].connect() as db:
        db.execute(f"UPDATE idempotency_keys SET created_at = {stores[0].NOW} - 7200")
    assert stores[0].idempotent_job("finetune", "retry-1", 3600.0) is None
    again = stores[0].create_job("finetune", CFG, idempotency=key)
    assert again["id"] != won[0] and stores[0].idempotent_job("finetune", "retry-1", 3600.0)[0] == again["id"]
    for s in stores:
        s.close()


def test_a_model_name_is_reserved_by_the_live_job_that_registers_it(store):
    """register_as is reserved from the submission on, while the job is queued or running (requeued included): a
    second job with the name is refused naming the first, and so is a plain registration of it (the job would
    replace it when it succeeds). A job that ends without registering frees it; a registered model holds it."""
    first = store.create_job("finetune", CFG, register_as="topics")
    for _ in range(2):  # queued, then running
        with pytest.raises(ModelNameTaken, match=f"job {first['id']} .queued or running") as info:
            store.create_job("finetune", CFG, register_as="topics")
        assert info.value.job_id == first["id"] and info.value.name == "topics"
        with pytest.raises(ModelNameTaken, match=first["id"]):
            store.register_model("topics", "/elsewhere", None)
        store.claim_next("w1")
    assert store.requeue(first["id"], "lease expired")
    with pytest.raises(ModelNameTaken, match=first["id"]):
        store.create_job("finetune", CFG, register_as="topics")
    assert store.request_cancel(first["id"])["status"] == "cancelled"
    second = store.create_job("finetune", CFG, register_as="topics")  # free again
    assert [j["id"] for j in store.list_jobs()] == [second["id"], first["id"]]
    store.register_model("held", "/m", None)
    with pytest.raises(ModelNameTaken, match="a model named 'held' exists") as info:
        store.create_job("finetune", CFG, register_as="held")
    assert info.value.job_id is None
    assert store.get_model("topics") is None and len(store.list_jobs()) == 2  # the refusals wrote nothing


def test_concurrent_submissions_for_one_model_name_queue_one_job(target):
    """8 threads (own connections) submit fine-tunes registering one name at once: one is queued, the others are
    refused naming it (the unique index decides). With one Idempotency-Key as well, every one gets the winner's job
    back, as a retry would, rather than a refusal."""
    stores = [open_store(target) for _ in range(8)]
    for key in (None, IdempotencyKey("finetune", "k", "hash-a", 3600.0)):
        name = "keyed" if key else "plain"
        won, refused, replayed, barrier = [], [], [], threading.Barrier(len(stores))

        def submit(i: int) -> None:
            barrier.wait()
            try:
                won.append(stores[i].create_job("finetune", CFG, idempotency=key, register_as=name)["id"])
            except ModelNameTaken as e:
                refused.append(e.job_id)
            except IdempotencyKeyUsed as e:
                replayed.append(e.job_id)

        threads = [threading.Thread(target=submit, args=(i,)) for i in range(len(stores))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(won) == 1, (won, refused, replayed)
        assert (replayed if key else refused) == won * 7 and not (refused if key else replayed)
    assert len(stores[0].list_jobs()) == 2
    for s in stores:
        s.close()


def _until_done_or_waiting(store: BaseStore, thread: threading.Thread) -> None:
    """Returns when THREAD (a transaction on STORE's database) is done or waits on a lock. PostgreSQL shows the wait;
    SQLite does not, but there BEGIN IMMEDIATE makes every second writer wait until the first commits, so a writer
    still busy after a moment is one that waits."""
    if store.dialect == "sqlite":
        thread.join(0.5)
        return
    while thread.is_alive():
        with store.connect() as db:
            if db.execute("SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                          "AND datname = current_database()").fetchone() is not None:
                return
        thread.join(0.02)


class _PausedBeforeInsert:
    """A store connection that, at its first INSERT INTO `table` (its check done), runs `race` in a thread and goes
    on once that is done or waits on a lock: the interleaving in which two check-then-insert transactions both pass."""

    def __init__(self, db, table: str, race, store: BaseStore):
        self.db, self.table, self.race, self.store, self.racer = db, table, race, store, None

    def execute(self, sql: str, params=None):
        if sql.startswith(f"INSERT INTO {self.table}") and self.racer is None:
            self.racer = threading.Thread(target=self.race)
            self.racer.start()
            _until_done_or_waiting(self.store, self.racer)
        return self.db.execute(sql, params) if params is not None else self.db.execute(sql)


@pytest.mark.parametrize("first", ["submission", "registration"])
def test_a_registration_racing_a_submission_for_one_name_lets_one_in(store, target, first):
    """POST /models and a fine-tune submitted with register_as, for one name, at once: each checked the other's table
    and then inserted into its own, in two transactions that did not see each other, so in the interleaving below
    (both checks before either insert) both passed, and the job would later replace the model just registered. Now
    the second is refused naming the first, in either order."""
    other = open_store(target)  # the racing request, on its own connection
    submit = lambda s: s.create_job("finetune", CFG, register_as="topics")  # noqa: E731
    register = lambda s: s.register_model("topics", "/m", None)  # noqa: E731
    first_call, second_call = (submit, register) if first == "submission" else (register, submit)
    outcome: list = []

    def race() -> None:
        try:
            outcome.append(second_call(other))
        except ModelNameTaken as e:
            outcome.append(e)

    connect, paused = store.connect, []

    @contextlib.contextmanager
    def paused_before_insert(*args, **kwargs):
        with connect(*args, **kwargs) as db:
            paused.append(_PausedBeforeInsert(db, "jobs" if first == "submission" else "models", race, other))
            yield paused[-1]

    store.connect = paused_before_insert
    try:
        won = first_call(store)
    finally:
        store.connect = connect
    paused[0].racer.join(60)
    assert len(outcome) == 1 and isinstance(outcome[0], ModelNameTaken), outcome  # the second is refused
    assert outcome[0].job_id == (won["id"] if first == "submission" else None)
    assert len(store.list_jobs()) == (first == "submission")  # and wrote nothing
    assert (store.get_model("topics") is None) == (first == "submission")
    other.close()


def test_a_fenced_job_process_is_requeued_not_failed(store, target, tmp_path):
    """A job process that stopped itself because it could not renew its lease (exit FENCED) goes back to the queue
    (while its attempt still holds the job); any other exit without a result fails the job as before."""
    from server.fence import FENCED

    worker = Worker(settings_for(tmp_path, target, job_lease_s=5.0), store)
    fenced, crashed = (store.create_job("export", CFG)["id"] for _ in range(2))
    for job_id, code in ((fenced, FENCED), (crashed, 3)):
        claimed = store.claim_next(worker.id)
        assert claimed["id"] == job_id
        proc = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"], start_new_session=True)
        proc.wait()
        worker.procs[job_id], worker.attempts[job_id] = proc, claimed["attempts"]
    worker._reap()
    assert store.get_job(fenced)["status"] == "queued"
    assert "could not renew its lease in time" in store.events_after(fenced)[-1][1]["reason"]
    assert store.get_job(crashed)["status"] == "failed" and "exited with code 3" in store.get_job(crashed)["error"]
    assert not store.requeue(fenced, "again", attempt=1)  # requeue is fenced by the attempt too
    store.claim_next("B")
    assert not store.requeue(fenced, "stale attempt", attempt=1) and store.requeue(fenced, "ok", attempt=2)


def test_a_vanished_client_does_not_hold_a_lease_row_locked(pg_server):
    """PostgreSQL: a client cut off inside a transaction (here: one that stops talking while it holds the job row
    locked) is ended by the server after idle_in_transaction_s, so the requeue by another worker goes through, and
    the cut-off client's write is rolled back, never committed."""
    from server.store.postgres import PostgresStore

    url = pg_server.create_database(fresh_db_name())
    stale, other = PostgresStore(url, idle_in_transaction_s=1.0), open_store(url)
    job = other.create_job("export", CFG)
    other.claim_next("A")
    _age_heartbeat(other, job["id"], 60)
    with pytest.raises(StoreUnavailable):
        with stale.connect() as db:
            db.execute("SELECT id FROM jobs WHERE id = ? FOR UPDATE", (job["id"],))
            db.execute("UPDATE jobs SET progress = ? WHERE id = ?", ('{"stale": 1}', job["id"]))
            started = time.monotonic()
            assert other.requeue(job["id"], "lease expired", stale_after=5.0)  # waits for the lock, then moves
            took = time.monotonic() - started
    assert 0.5 < took < 10, took
    assert other.get_job(job["id"])["progress"] == {}  # the vanished client's write never landed
    stale.close(), other.close()


def test_a_silent_link_fails_a_transaction_at_its_deadline(pg_server):
    """PostgreSQL: statements sent over a link that went silent (a relay that stops passing bytes, its connections
    left open, as in a partition) fail with StoreUnavailable at the transaction's deadline, on a pooled connection
    and on a new one, instead of waiting for TCP to give up (about 15 minutes). When the link is back the store
    works again, on a fresh connection."""
    from server.store.postgres import PostgresStore

    pg_server.create_database(name := fresh_db_name())
    relay = Relay(pg_server.port)
    store = PostgresStore(f"postgresql://{pg_server.user}@127.0.0.1:{relay.port}/{name}", transaction_timeout_s=1.0)
    job = store.create_job("export", CFG)  # a connection in the pool
    outcome: list[tuple[str, float]] = []

    def read() -> None:
        started = time.monotonic()
        try:
            store.get_job(job["id"])
            outcome.append(("answered", time.monotonic() - started))
        except StoreUnavailable as e:
            outcome.append((str(e), time.monotonic() - started))

    relay.freeze()
    try:
        for _ in range(2):  # the pooled connection, then a new one (its connect timeout: at least libpq's 1 s)
            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            reader.join(15)
    finally:
        relay.thaw()  # without a deadline the reads above return only now
    reader.join(15)
    assert len(outcome) == 2 and all(took < 10 for _, took in outcome), outcome
    assert "no answer within 1 s; the transaction was abandoned" in outcome[0][0], outcome
    assert outcome[1][0] != "answered", outcome
    assert store.get_job(job["id"])["id"] == job["id"]  # back: a fresh connection, the shut-down one dropped
    store.close(), relay.close()


# --- bad input at start ----------------------------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when this returns: nothing listens there


def test_unreachable_database_retries_bounded_and_quietly(caplog):
    url = f"postgresql://hfport:s3cret-pw@127.0.0.1:{_closed_port()}/jobs"
    started = time.monotonic()
    with caplog.at_level(logging.DEBUG, logger="hfport.server.store"):
        with pytest.raises(StoreUnavailable) as info:
            open_store(url, connect_timeout_s=2.0)
    took = time.monotonic() - started
    message = str(info.value)
    assert "cannot reach the PostgreSQL database postgresql://hfport:***@127.0.0.1" in message
    assert "attempts over 2 s" in message and "s3cret-pw" not in message
    assert int(message.split(" after ")[1].split()[0]) >= 3  # it did retry
    assert took < 15  # bounded by the budget (plus one connect timeout), not forever
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "s3cret-pw" not in warnings[0].getMessage(), warnings  # once, not per retry


@pytest.fixture
def password_role(pg_server):
    """A role that logs in with a password (scram-sha-256 on 127.0.0.1, where the cluster otherwise trusts everyone):
    its URL with a wrong password. pg_hba.conf is restored afterwards."""
    import psycopg

    hba = pg_server.data / "pg_hba.conf"
    trusting = hba.read_text()
    with psycopg.connect(pg_server.url(), autocommit=True) as conn:
        conn.execute("DROP ROLE IF EXISTS pw_user")
        conn.execute("CREATE ROLE pw_user LOGIN PASSWORD 'right-pw'")
        hba.write_text("host all pw_user 127.0.0.1/32 scram-sha-256\n" + trusting)  # the first matching line decides
        conn.execute("SELECT pg_reload_conf()")
    wrong = pg_server.url().replace("//hfport@", "//pw_user:wrong-pw@")
    for _ in range(200):  # the postmaster reloads the file on its signal, a moment later
        try:
            psycopg.connect(wrong, connect_timeout=5).close()
        except psycopg.OperationalError:
            break
        time.sleep(0.05)
    yield wrong
    hba.write_text(trusting)
    with psycopg.connect(pg_server.url(), autocommit=True) as conn:
        conn.execute("SELECT pg_reload_conf()")


def test_a_refused_login_stops_at_once_naming_the_reason(pg_server, password_role, caplog):
    """A wrong password, an unknown role or an unknown database were retried for the whole start-up budget (one lease)
    as a database that 'does not answer', and only the last line named the cause: the server's answer does not change
    however often it is asked. Now the first answer stops the start, naming the database (password hidden) and the
    server's reason; a malformed URL too. An unreachable server is still retried
    (test_unreachable_database_retries_bounded_and_quietly)."""
    refused = {password_role: 'password authentication failed for user "pw_user"',
               pg_server.url().replace("//hfport@", "//nobody@"): 'role "nobody" does not exist',
               pg_server.url("nowhere"): 'database "nowhere" does not exist',
               pg_server.url() + "?no_such_option=1": 'invalid URI query parameter: "no_such_option"'}
    for url, reason in refused.items():
        with caplog.at_level(logging.DEBUG, logger="hfport.server.store"):
            with pytest.raises(DatabaseRefused) as info:
                open_store(url, connect_timeout_s=3.0)
        message = str(info.value)
        assert f"PostgreSQL database {url.replace(':wrong-pw@', ':***@')}" in message, message
        assert reason in message and "wrong-pw" not in message and "does not answer" not in message, message
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records  # no retry began
    assert isinstance(info.value, StoreError)  # `hfport serve` says it in one line, as every store error


def test_a_server_busy_starting_is_retried_a_refused_login_is_not():
    from server.store.postgres import refusal

    at = 'connection failed: connection to server at "127.0.0.1", port 5432 failed: FATAL:  '
    for passing in ("the database system is starting up", "the database system is shutting down",
                    "the database system is in recovery mode", "the database system is not yet accepting connections",
                    "sorry, too many clients already",
                    "remaining connection slots are reserved for roles with the SUPERUSER attribute"):
        assert refusal(at + passing) is None, passing
    assert refusal('connection failed: connection to server at "127.0.0.1", port 1 failed: Connection refused\n'
                   "\tIs the server running on that host and accepting TCP/IP connections?") is None
    assert refusal(at + 'no pg_hba.conf entry for host "10.0.0.1", user "u", database "d", no encryption') == (
        'no pg_hba.conf entry for host "10.0.0.1", user "u", database "d", no encryption')


def test_unreachable_database_through_the_cli(tmp_path):
    out = run_cli("serve", "--data-dir", str(tmp_path), "--role", "api",  # in its own process: tests/forked.py
                  env={**os.environ, "HFPORT_DATABASE_URL": f"postgresql://hfport@127.0.0.1:{_closed_port()}/x",
                       "HFPORT_JOB_LEASE_S": "1"},  # start-up retries the database for one lease
                  timeout=120)
    assert out.returncode == 1
    assert "error: cannot reach the PostgreSQL database postgresql://hfport@127.0.0.1" in out.stderr
    assert "Traceback" not in out.stderr


def test_postgres_url_without_psycopg_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "psycopg", None)  # as if not installed
    with pytest.raises(MissingDriver, match=r"pip install 'hfport\[postgres\]'"):
        open_store("postgresql://u@127.0.0.1:1/x")


def test_unknown_scheme_is_named():
    with pytest.raises(StoreError, match=r"unsupported scheme in 'mysql'"):
        open_store("mysql://u@h/x")


def test_worker_role_refuses_a_live_duplicate_id_through_the_cli(pg_server, tmp_path):
    url = pg_server.create_database(fresh_db_name())
    store = open_store(url)
    store.register_worker("box-7", "some-other-host", 1, 30.0)
    out = run_cli("serve", "--data-dir", str(tmp_path), "--role", "worker",  # in its own process: tests/forked.py
                  env={**os.environ, "HFPORT_DATABASE_URL": url, "HFPORT_WORKER_ID": "box-7"}, timeout=120)
    assert out.returncode == 1, out.stderr
    assert "error: worker id 'box-7' is held by a live worker (host some-other-host, pid 1" in out.stderr
    assert [w["host"] for w in store.list_workers()] == ["some-other-host"]  # the holder's row is untouched
    store.close()
