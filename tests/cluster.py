"""A scaled-out deployment on this host, for the chaos, partition, fencing and idempotency tests and
scripts/chaos.py: API processes (`hfport serve --role api`) and workers (`--role worker`) sharing one data dir and
one PostgreSQL (Cluster), clients that submit with an Idempotency-Key and fail over (submit), SSE readers, and the
scenario run_chaos with the checks every run must pass. A Partition is a network namespace joined to the root
namespace by a veth pair (root and `ip` needed); watch_cut and stale_writes check what a worker cut off from the
database may still do (nothing, once its lease is gone)."""

from __future__ import annotations

import ipaddress
import json
import os
import re
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

from server.store import open_store
from tests.data import write_sentiment
from tests.forked import popen_cli
from tests.serving import ForkedServerProcess as ServerProcess
from tests.tiny import save_with_tokenizer

REPO = Path(__file__).resolve().parent.parent
TERMINAL = ("succeeded", "failed", "cancelled")
LEASE_S = 5.0
LONG_STEPS, SHORT_STEPS = 60, 4
# libpq: a dead link errors out within seconds instead of hanging on TCP retransmissions
TCP_OPTS = "connect_timeout=2&tcp_user_timeout=3000&keepalives=1&keepalives_idle=1&keepalives_interval=1" \
           "&keepalives_count=2"


def build_inputs(root: Path, minilm: Path) -> tuple[Path, Path]:
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
        self.start_workers([worker_id], url, prefix)

    def start_workers(self, worker_ids: list[str], url: str | None = None, prefix: list[str] | None = None) -> None:
        """Workers started together (their start-ups overlap on the cores), each waited for until it registered."""
        for worker_id in worker_ids:
            argv = ["serve", "--role", "worker", "--data-dir", str(self.data)]
            env = {**os.environ, **self.env, "HFPORT_WORKER_ID": worker_id, "PYTHONPATH": str(REPO),
                   **({"HFPORT_DATABASE_URL": url} if url else {})}
            log = self.data.parent / f"{worker_id}.log"
            if prefix:  # e.g. `ip netns exec NS`: a fresh interpreter under it
                with open(log, "ab") as out:
                    self.workers[worker_id] = subprocess.Popen([*prefix, sys.executable, "-m", "hfport", *argv],
                                                               env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
            else:  # a fork-server child (tests/forked.py)
                self.workers[worker_id] = popen_cli(*argv, log=log, env=env, cwd=REPO)
        deadline = time.time() + 90
        waiting = list(worker_ids)
        while waiting and time.time() < deadline:
            live = {w["id"]: w["pid"] for w in self.store.list_workers()}
            waiting = [w for w in waiting if live.get(w) != self.workers[w].pid]
            for worker_id in waiting:
                if self.workers[worker_id].poll() is not None:
                    raise RuntimeError(f"worker {worker_id} exited: {self.worker_log(worker_id)}")
            if waiting:
                time.sleep(0.1)
        if waiting:
            raise RuntimeError(f"workers {waiting} did not register: " +
                               " | ".join(self.worker_log(w) for w in waiting))

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
    worker takes over (watch_cut asserts the order and the untouched run folder)."""
    run = cluster.data / "runs" / job_id / "run"
    held = wait_for(lambda: (j := cluster.store.get_job(job_id))["status"] != "running" and j or j["pid"]
                    and any(run.glob("checkpoints/step-*/trainer_state.json")) and j, 180,
                    "the partitioned worker's job to write a checkpoint")
    assert held["worker_id"] == "w-part" and held["status"] == "running", f"it ended before the cut: {held}"
    partition.cut()
    cut = {"job_id": job_id, "cut_at_step": held["progress"].get("step")}
    return {**cut, **watch_cut(cluster.store, job_id, held["pid"], run, time.time(), run.parent / "job.log", LEASE_S)}


def rejoin(cluster: Cluster, partition: Any) -> float:
    """Heal the link; seconds until the stale worker heartbeats again."""
    partition.heal()
    healed = time.time()
    wait_for(lambda: next((w["age"] < 1.5 for w in cluster.store.list_workers() if w["id"] == "w-part"), False), 120,
             "the partitioned worker to heartbeat again", poll=0.2)
    return round(time.time() - healed, 2)


def partition_figures(cluster: Cluster, cut: dict[str, Any]) -> dict[str, Any]:
    """After the run: the cut-off attempt's writes after its death (0), and the rejoined worker is clean."""
    figures = {k: v for k, v in cut.items() if k.startswith("cut_")}
    figures["stale_writes"] = stale_writes(cluster.store, cut["job_id"], cut)
    assert figures["stale_writes"] == 0
    log = cluster.worker_log("w-part")
    assert "Traceback" not in log and cluster.workers["w-part"].poll() is None, log
    return figures


def run_chaos(data: Path, url: str, minilm: Path, n_jobs: int, *, workers: int = 2, chaos: bool = True,
              clients: int = 8, partition: Any = None, ns_url: str | None = None) -> dict[str, Any]:
    """Run the scenario; returns figures. `chaos=False`: no kills (throughput with `workers` workers).
    `partition` (a Partition, up) and `ns_url` (the database as the namespace reaches it): one more
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
        cluster.start_workers([f"w{i + 1}" for i in range(workers)])
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
            # the killed worker's id again (the dead holder's row is taken over) and a replacement API process,
            # started together: their start-ups overlap
            with ThreadPoolExecutor(2) as pool:
                restarted = pool.submit(cluster.start_worker, info["victim"])
                pool.submit(cluster.start_apis, 1).result()
                restarted.result()
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


# --- a network partition ------------------------------------------------------------------------------------

def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out


def _free_subnet() -> ipaddress.IPv4Network:
    """A /30 of 10.213.0.0/16 overlapping nothing this host has an address or a route for."""
    used = []
    for line in _ip("-o", "-4", "addr").stdout.splitlines() + _ip("-o", "-4", "route").stdout.splitlines():
        for word in line.split():
            try:
                used.append(ipaddress.ip_network(word, strict=False))
            except ValueError:
                continue
    for net in ipaddress.ip_network("10.213.0.0/16").subnets(new_prefix=30):
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return net
    raise RuntimeError("no free /30 in 10.213.0.0/16")


class Partition:
    """A network namespace joined to the root namespace by one veth pair (`cut()` / `heal()` the link)."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 10**7}"
        self.ns, self.root_if, self.ns_if = f"hfport-part-{tag}", f"hfp{tag}r", f"hfp{tag}n"
        self.subnet = _free_subnet()
        self.root_ip, self.ns_ip = (str(h) for h in self.subnet.hosts())

    def up(self) -> Partition:
        self.down()  # leftovers of an earlier run with this pid
        _ip("netns", "add", self.ns)
        _ip("link", "add", self.root_if, "type", "veth", "peer", "name", self.ns_if)
        _ip("link", "set", self.ns_if, "netns", self.ns)
        _ip("addr", "add", f"{self.root_ip}/30", "dev", self.root_if)
        _ip("link", "set", self.root_if, "up")
        for args in (("addr", "add", f"{self.ns_ip}/30", "dev", self.ns_if), ("link", "set", self.ns_if, "up"),
                     ("link", "set", "lo", "up")):
            _ip("netns", "exec", self.ns, "ip", *args)
        return self

    def down(self) -> None:
        _ip("netns", "del", self.ns, check=False)  # takes its end of the pair, and so the pair, with it
        _ip("link", "del", self.root_if, check=False)

    def cut(self) -> None:
        _ip("link", "set", self.root_if, "down")

    def heal(self) -> None:
        _ip("link", "set", self.root_if, "up")

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns]


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under `folder`: (mtime in ns, size)."""
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.stat().st_size)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def pid_alive(pid: int) -> bool:
    """Running (a zombie its cut-off parent has not reaped yet counts as dead: it can write nothing)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def kill_time(job_log: Path, pid: int) -> float:
    """When the job process `pid` began to kill itself, by its own last words in job.log (the test's own polling may
    lag on a loaded host; this does not)."""
    match = re.search(rf"job process {pid} at ([0-9.]+): .* stopping now", job_log.read_text(errors="replace"))
    assert match, job_log.read_text(errors="replace")[-3000:]
    return float(match.group(1))


def watch_cut(store, job_id: str, victim_pid: int, run: Path, cut_at: float, job_log: Path,
              lease_s: float) -> dict[str, Any]:
    """After the cut: the job process kills itself before its lease (`lease_s`, the workers' HFPORT_JOB_LEASE_S) can
    run out, the run folder stays as it left it, and only then does another worker requeue the job (lease rule). Returns
    what stale_writes needs and figures."""
    wait_for(lambda: not pid_alive(victim_pid), lease_s + 10, "the cut-off job process to stop itself", poll=0.02)
    at_death = snapshot(run)
    last = store.get_job(job_id)  # the last renewal that reached the database, before the cut
    assert last["attempts"] == 1 and last["status"] == "running", last
    dead_at = kill_time(job_log, victim_pid)
    # the lease it held would have run out (by the database clock) only after the process was already gone
    assert dead_at < last["heartbeat_at"] + lease_s, (dead_at, last["heartbeat_at"])
    requeue = wait_for(lambda: next((e for _, e in store.events_after(job_id)
                                     if "lease expired" in e.get("reason", "")), None), 60,
                       "another worker to requeue the job by the lease rule", poll=0.02)
    assert snapshot(run) == at_death  # nothing wrote into the run folder from its death to the takeover
    assert all(mtime < requeue["time"] * 1e9 for mtime, _ in at_death.values())
    # dead before the lease ran out by the database clock (one host: the clocks are the same)
    assert dead_at < requeue["time"], (dead_at, requeue["time"])
    return {"dead_at": dead_at, "requeue": requeue, "cut_to_death_s": round(dead_at - cut_at, 2),
            "cut_to_takeover_s": round(requeue["time"] - cut_at, 2)}


def stale_writes(store, job_id: str, cut: dict[str, Any]) -> int:
    """Writes of the cut-off attempt the database holds from its death on: after the requeue only the claim by the
    next worker, then that attempt's own history from its `resumed` event (so 0 when fencing holds)."""
    events = [e for _, e in store.events_after(job_id)]
    requeue, dead_at = cut["requeue"], cut["dead_at"]
    resumed = [e for e in events if e["type"] == "resumed"]
    assert len(resumed) == 1, resumed
    after = [e for e in events if e["time"] >= requeue["time"]]
    assert after[0] == requeue and after[1]["status"] == "running", after[:3]
    late = [e for e in after[2:] if e["time"] < resumed[0]["time"]]
    late += [e for e in events if dead_at < e["time"] < requeue["time"] and e["type"] != "status"]
    return len(late)
