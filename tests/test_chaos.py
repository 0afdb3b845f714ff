"""Chaos, bounded and on loopback: a real PostgreSQL, 2 API processes (`hfport serve --role api`) and 2 workers
(`--role worker`) sharing one data dir. 8 clients submit tiny fine-tune jobs round-robin across the APIs; in the
middle, one worker is killed with SIGKILL while it runs a job (that job's process dies with it) and one API process
is killed too (clients fail over; a replacement starts). Every job ends `succeeded` exactly once, none is lost, the
killed worker's job is requeued by the lease rule and resumed from its checkpoint by a surviving worker (its log
says so), and every API process lists the same jobs and models. An SSE stream read from one API resumes on another
with Last-Event-ID.

Clients submit with an Idempotency-Key and retry on a refused connection, a timeout or a dropped answer (on the next
API process, with the same key): a retry never makes a second job. Every fifth submission first gives up after
50 ms, so retries really happen; the job count proves none was doubled.

With a `partition` (tests/test_partition.py; scripts/chaos.py, as root), a third worker runs in its own network
namespace and its link to PostgreSQL is cut mid-job: its job is taken over once the lease runs out, the cut-off
attempt writes nothing after its death, and the worker rejoins when the link comes back.

CI runs HFPORT_CHAOS_JOBS jobs (default 12); scripts/chaos.py runs 40 and the 1-vs-2-worker figures."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from server.launch import ServerProcess
from server.store import open_store
from tests.pgserver import fresh_db_name, pg_server  # noqa: F401 - the session fixture

REPO = Path(__file__).resolve().parent.parent
TERMINAL = ("succeeded", "failed", "cancelled")
LEASE_S = 5.0
LONG_STEPS, SHORT_STEPS = 60, 4


def build_inputs(root: Path, minilm: Path) -> tuple[Path, Path]:
    from tests.test_finetune import write_sentiment
    from tests.tiny import save_with_tokenizer

    model = root / "base"
    save_with_tokenizer("bert", "base", model, minilm, vocab_size=30522, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    write_sentiment(root / "train.jsonl", 64, seed=0)
    return model, root / "train.jsonl"


class Cluster:
    """The processes of a scaled-out deployment, all on this host: API processes and workers sharing `data` (the
    data dir every host would mount) and one PostgreSQL URL."""

    def __init__(self, data: Path, url: str):
        self.data, self.url = data, url
        self.env = {"HFPORT_DATABASE_URL": url, "HFPORT_JOB_LEASE_S": str(LEASE_S),
                    "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        self.apis: list[ServerProcess] = []
        self.workers: dict[str, subprocess.Popen] = {}
        self.store = open_store(url)

    def start_apis(self, n: int) -> list[ServerProcess]:
        new = [ServerProcess(self.data, self.data.parent / f"api-{len(self.apis) + i}.log", self.env,
                             args=("--role", "api"), cwd=REPO) for i in range(n)]
        with ThreadPoolExecutor(n) as pool:
            list(pool.map(lambda s: s.start(), new))
        self.apis += new
        return new

    def start_worker(self, worker_id: str, url: str | None = None, prefix: list[str] | None = None) -> None:
        """`url`: another address of the database (the partitioned worker's); `prefix`: e.g. `ip netns exec NS`."""
        log = open(self.data.parent / f"{worker_id}.log", "ab")  # noqa: SIM115 - the process keeps it
        self.workers[worker_id] = subprocess.Popen(
            [*(prefix or []), sys.executable, "-m", "hfport", "serve", "--role", "worker", "--data-dir",
             str(self.data)], env={**os.environ, **self.env, "HFPORT_WORKER_ID": worker_id, "PYTHONPATH": str(REPO),
                                   **({"HFPORT_DATABASE_URL": url} if url else {})},
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + 90
        while time.time() < deadline:
            live = {w["id"]: w["pid"] for w in self.store.list_workers()}
            if live.get(worker_id) == self.workers[worker_id].pid:
                return
            if self.workers[worker_id].poll() is not None:
                raise RuntimeError(f"worker {worker_id} exited: {self.worker_log(worker_id)}")
            time.sleep(0.1)
        raise RuntimeError(f"worker {worker_id} did not register: {self.worker_log(worker_id)}")

    def worker_log(self, worker_id: str) -> str:
        return (self.data.parent / f"{worker_id}.log").read_text(errors="replace")[-3000:]

    def kill_worker(self, worker_id: str) -> float:
        proc = self.workers.pop(worker_id)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return time.time()

    def stop(self) -> None:
        for proc in self.workers.values():
            proc.send_signal(signal.SIGTERM)
        for proc in self.workers.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        for api in self.apis:
            api.stop()
        self.store.close()


def job_config(train: Path, steps: int, save_steps: int) -> dict[str, Any]:
    return {"model": "base", "train": str(train), "batch_size": 8, "max_steps": steps, "save_steps": save_steps,
            "eval_strategy": "no", "logging_steps": 1, "max_length": 32, "lr": 1e-3, "seed": 3}


RETRIED: list[str] = []  # submissions that needed more than one request (for the figures)


def submit(urls: list[str], index: int, config: dict[str, Any]) -> str:
    """POST to urls[index % n] with a fresh Idempotency-Key; on a refused connection (a killed API), a timeout or a
    dropped answer, the same request with the same key goes to the next API. The key makes a retry of a request
    that did reach a server return that job instead of creating another. Every fifth submission's first try gives
    up after 50 ms (the server still creates the job), so that the retry path runs."""
    key = uuid.uuid4().hex
    for k in range(3 * len(urls)):
        url = urls[(index + k) % len(urls)]
        try:
            r = httpx.post(f"{url}/jobs/finetune", json={"config": config}, headers={"Idempotency-Key": key},
                           timeout=0.05 if k == 0 and index % 5 == 0 else 60)
        except (httpx.ConnectError, httpx.TimeoutException, httpx.RemoteProtocolError, httpx.ReadError):
            time.sleep(0.2)
            continue
        assert r.status_code == 202, r.text
        if k:
            RETRIED.append(r.json()["id"])
        return r.json()["id"]
    raise AssertionError("no API process accepted the job")


def sse(url: str, last_event_id: int | None = None, stop_after: int | None = None) -> list[tuple[int | None, str,
                                                                                                 dict]]:
    """(id, event, data) frames of an SSE stream: to its end, or the first `stop_after` frames (then disconnect)."""
    frames, fid, event, data = [], None, "message", []
    headers = {"Last-Event-ID": str(last_event_id)} if last_event_id is not None else None
    with httpx.stream("GET", url, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("id: "):
                fid = int(line[4:])
            elif line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
            elif line == "" and data:
                frames.append((fid, event, json.loads("\n".join(data))))
                fid, event, data = None, "message", []
                if stop_after is not None and len(frames) >= stop_after:
                    break
    return frames


def wait_for(predicate, timeout: float, what: str, poll: float = 0.1):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def start_partitioned(cluster: Cluster, partition: Any, ns_url: str, urls: list[str], train: Path) -> str:
    """Start the worker of the namespace (alone: it claims the long job submitted here)."""
    cluster.start_worker("w-part", ns_url, partition.prefix())
    job_id = submit(urls, 1, job_config(train, 4 * LONG_STEPS, 5))  # long: it must still run once the others start
    wait_for(lambda: cluster.store.get_job(job_id)["status"] == "running", 60, "the partitioned worker's claim")
    return job_id


def cut_partitioned(cluster: Cluster, partition: Any, job_id: str) -> dict[str, Any]:
    """Once its job has a checkpoint, cut the partitioned worker's link; then the job process dies and another
    worker takes over (tests/test_partition.watch_cut asserts the order and the untouched run folder)."""
    from tests.test_partition import watch_cut

    run = cluster.data / "runs" / job_id / "run"
    held = wait_for(lambda: (j := cluster.store.get_job(job_id))["status"] != "running" and j or j["pid"]
                    and any(run.glob("checkpoints/step-*/trainer_state.json")) and j, 180,
                    "the partitioned worker's job to write a checkpoint")
    assert held["worker_id"] == "w-part" and held["status"] == "running", f"it ended before the cut: {held}"
    partition.cut()
    cut = {"job_id": job_id, "cut_at_step": held["progress"].get("step")}
    return {**cut, **watch_cut(cluster.store, job_id, held["pid"], run, time.time(), run.parent / "job.log")}


def rejoin(cluster: Cluster, partition: Any) -> float:
    """Heal the link; seconds until the stale worker heartbeats again."""
    partition.heal()
    healed = time.time()
    wait_for(lambda: next((w["age"] < 1.5 for w in cluster.store.list_workers() if w["id"] == "w-part"), False), 120,
             "the partitioned worker to heartbeat again", poll=0.2)
    return round(time.time() - healed, 2)


def partition_figures(cluster: Cluster, cut: dict[str, Any]) -> dict[str, Any]:
    """After the run: the cut-off attempt's writes after its death (0), and the rejoined worker is clean."""
    from tests.test_partition import stale_writes  # (it imports this module)

    figures = {k: v for k, v in cut.items() if k.startswith("cut_")}
    figures["stale_writes"] = stale_writes(cluster.store, cut["job_id"], cut)
    assert figures["stale_writes"] == 0
    log = cluster.worker_log("w-part")
    assert "Traceback" not in log and cluster.workers["w-part"].poll() is None, log
    return figures


def run_chaos(data: Path, url: str, minilm: Path, n_jobs: int, *, workers: int = 2, chaos: bool = True,
              clients: int = 8, partition: Any = None, ns_url: str | None = None) -> dict[str, Any]:
    """Run the scenario; returns figures. `chaos=False`: no kills (throughput with `workers` workers).
    `partition` (tests.test_partition.Partition) and `ns_url` (the database as the namespace reaches it): one more
    worker, cut off mid-job."""
    data.mkdir(parents=True)
    _, train = build_inputs(data / "inputs", minilm)
    cluster = Cluster(data, url)
    figures: dict[str, Any] = {"jobs": n_jobs, "workers": workers + (partition is not None), "clients": clients}
    RETRIED.clear()
    try:
        cluster.start_apis(2)
        urls = [api.url for api in cluster.apis]
        r = httpx.post(f"{urls[0]}/models", json={"name": "base", "path": str(data / "inputs" / "base")}, timeout=60)
        assert r.status_code == 201, r.text
        started = time.time()
        cut_off = start_partitioned(cluster, partition, ns_url, urls, train) if partition is not None else None
        for i in range(workers):
            cluster.start_worker(f"w{i + 1}")
        cut = cut_partitioned(cluster, partition, cut_off) if cut_off is not None else None

        long_id = submit(urls, 0, job_config(train, LONG_STEPS if chaos else SHORT_STEPS, 5 if chaos else 2))
        short = job_config(train, SHORT_STEPS, 2)
        head = [cut["job_id"]] if cut else []
        first_half = (n_jobs - 1 - len(head)) // 2
        with ThreadPoolExecutor(clients) as pool:
            ids = [*head, long_id, *pool.map(lambda i: submit(urls, i, short), range(1, 1 + first_half))]
        info: dict[str, Any] = {}
        if chaos:
            ckpts = data / "runs" / long_id / "run" / "checkpoints"
            held = wait_for(lambda: (j := cluster.store.get_job(long_id))["status"] == "running"
                            and any(ckpts.glob("step-*/trainer_state.json")) and j, 120,
                            "the long job to run and write a checkpoint")
            assert held["status"] == "running", f"the long job ended before it could be killed: {held}"
            info["victim"] = held["worker_id"]
            killed_at = cluster.kill_worker(held["worker_id"])
            cluster.apis[0].proc.send_signal(signal.SIGKILL)  # and one API process
            cluster.apis[0].proc.wait()
        with ThreadPoolExecutor(clients) as pool:
            ids += list(pool.map(lambda i: submit(urls, i, short), range(1 + first_half, n_jobs - len(head))))
        if chaos:
            requeued = wait_for(lambda: next((e for _, e in cluster.store.events_after(long_id)
                                              if "lease expired" in e.get("reason", "")), None), 60,
                                "the lease rule to requeue the killed worker's job")
            figures["lease_recovery_s"] = round(requeued["time"] - killed_at, 2)
            cluster.start_worker(info["victim"])  # the same id again: the dead holder's row is taken over
            cluster.start_apis(1)  # a replacement API process
        if cut is not None:
            figures["heal_to_rejoin_s"] = rejoin(cluster, partition)
        live = [api for api in cluster.apis if api.proc.poll() is None]

        def all_done() -> bool:
            jobs = httpx.get(f"{live[-1].url}/jobs", params={"limit": 1000}, timeout=30).json()["jobs"]
            return len(jobs) == n_jobs and all(j["status"] in TERMINAL for j in jobs)

        wait_for(all_done, 60 + 20 * n_jobs, "every job to end", poll=0.5)
        figures["wall_s"] = round(time.time() - started, 1)
        figures["jobs_per_min"] = round(n_jobs / (figures["wall_s"] / 60), 1)
        events = {j: cluster.store.events_after(j) for j in ids}
        queued_t = next(e["time"] for _, e in events[long_id] if e.get("status") == "queued")
        running_t = next(e["time"] for _, e in events[long_id] if e.get("status") == "running")
        figures["claim_latency_s"] = round(running_t - queued_t, 3)  # an idle worker, a fresh job
        check(cluster, live, ids, events, [*head, long_id] if chaos else head, data)
        figures["retried_submissions"] = len(RETRIED)
        if cut is not None:
            figures.update(partition_figures(cluster, cut))
        if chaos:
            resumed = next(e for _, e in events[long_id] if e["type"] == "resumed")
            figures["resumed_at_step"] = resumed["step"]
            figures["resume_s"] = round(resumed["time"] - killed_at, 2)
        return figures
    except BaseException:
        for name in list(cluster.workers):
            print(f"--- {name}\n{cluster.worker_log(name)}")
        for api in cluster.apis:
            print(f"--- {api.log_path.name}\n{api.read_log()}")
        for job_log in sorted((data / "runs").glob("*/job.log"), key=lambda p: p.stat().st_mtime)[-3:]:
            print(f"--- {job_log}\n{job_log.read_text(errors='replace')[-3000:]}")
        raise
    finally:
        cluster.stop()


def check(cluster: Cluster, live: list[ServerProcess], ids: list[str], events: dict[str, list], victims: list[str],
          data: Path) -> None:
    assert len(set(ids)) == len(ids)
    for job_id in ids:
        job = cluster.store.get_job(job_id)
        assert job["status"] == "succeeded", job
        finals = Counter(e["status"] for _, e in events[job_id] if e["type"] == "status" and e["status"] in TERMINAL)
        assert finals == Counter({"succeeded": 1}), (job_id, finals)  # ended once, never twice
        steps = job["config"]["max_steps"]
        assert job["result"]["summary"]["steps"] == steps, job["result"]
        # the stored history holds each step once, in order, even for a resumed job
        assert [e["step"] for _, e in events[job_id] if e["type"] == "train"] == list(range(1, steps + 1)), job_id
        if job_id not in victims:
            assert job["attempts"] == 1, job  # only the killed (or cut-off) worker's job ran again
    for victim in victims:
        job = cluster.store.get_job(victim)
        assert job["attempts"] == 2, job
        resumed = [e for _, e in events[victim] if e["type"] == "resumed"]
        assert len(resumed) == 1 and 0 < resumed[0]["step"] < job["config"]["max_steps"], resumed
        log = (data / "runs" / victim / "job.log").read_text(errors="replace")
        assert "resuming from checkpoint" in log and f"(step {resumed[0]['step']})" in log, log[-2000:]
        assert "--- attempt 2 on worker" in log
    # every API process answers the same: any one serves any request
    listings = []
    for api in live:
        jobs = httpx.get(f"{api.url}/jobs", params={"limit": 1000}, timeout=30).json()["jobs"]
        models = httpx.get(f"{api.url}/models", timeout=30).json()["models"]
        listings.append((sorted((j["id"], j["status"], j["attempts"]) for j in jobs),
                         sorted((m["name"], m["path"]) for m in models)))
    assert all(listing == listings[0] for listing in listings)
    assert len(listings[0][0]) == len(ids) and len(listings[0][1]) == len(ids) + 1  # + the base model
    # an SSE client that loses one API process continues on another with Last-Event-ID: nothing repeated, nothing
    # skipped
    job_id = victims[-1] if victims else ids[0]
    whole = sse(f"{live[0].url}/jobs/{job_id}/events")
    part = sse(f"{live[0].url}/jobs/{job_id}/events", stop_after=5)
    rest = sse(f"{live[-1].url}/jobs/{job_id}/events", last_event_id=part[-1][0])
    assert part + rest == whole


def test_chaos(pg_server, tmp_path, minilm_path):  # noqa: F811
    n_jobs = int(os.environ.get("HFPORT_CHAOS_JOBS", "12"))
    figures = run_chaos(tmp_path / "data", pg_server.create_database(fresh_db_name()), minilm_path, n_jobs)
    print(json.dumps(figures))
