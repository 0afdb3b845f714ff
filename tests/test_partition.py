"""A real network partition: a worker in its own network namespace reaches PostgreSQL over a veth pair; mid-job the
link is cut while that worker (and its job process) stay alive. Another worker, in the root namespace, takes the job
over once the lease ran out by the database clock and finishes it. The cut-off attempt writes nothing after losing
its lease: its job process is dead before the requeue (server/fence.py), the run folder is unchanged from its death
until the takeover, and the database holds no write of it after that. Every job succeeds exactly once; when the link
comes back the stale worker notices, finds its job gone and takes new work without error.

Addresses: a /30 of 10.213.0.0/16 that no interface or route of this host uses, one end in the root namespace
(PostgreSQL listens there and on 127.0.0.1), the other in the test's namespace. Nothing else is ever a target.
Needs root and `ip` (iproute2): skipped, saying why, where they are missing; under CI=true that is a failure. The
namespace and the veth pair are removed on the way out, failure or not."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest

from server.store import open_store
from tests.pgserver import PgServer, fresh_db_name, require_bin
from tests.test_chaos import REPO, TERMINAL, build_inputs, job_config, wait_for

LEASE_S = 4.0
# the long job must still be running when the test looks for its first checkpoint: 50 steps of the tiny model ran in
# 4.5 s (45 steps/s) and ended before the test saw one (a timeout, not a fencing failure); 400 leave a ~9 s window
LONG_STEPS = 400
# libpq: a dead link errors out within seconds instead of hanging on TCP retransmissions
TCP_OPTS = "connect_timeout=2&tcp_user_timeout=3000&keepalives=1&keepalives_idle=1&keepalives_interval=1" \
           "&keepalives_count=2"


def _refuse(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"the partition test must run in CI: {reason}")
    pytest.skip(reason)


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


@contextmanager
def partition_or_skip() -> Iterator[Partition]:
    if os.geteuid() != 0:
        _refuse("network namespaces need root (ip netns add)")
    if shutil.which("ip") is None:
        _refuse("the `ip` command (iproute2) is not installed")
    part = Partition()
    try:
        part.up()
    except (RuntimeError, subprocess.SubprocessError) as e:
        part.down()
        _refuse(f"cannot create a network namespace with a veth pair here: {e}")
    try:
        yield part
    finally:
        part.down()


class Workers:
    """`hfport serve --role worker` processes sharing one data dir; `prefix` runs one inside a namespace."""

    def __init__(self, data: Path, store, env: dict[str, str]):
        self.data, self.store, self.env = data, store, env
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, worker_id: str, url: str, prefix: list[str] | None = None) -> subprocess.Popen:
        log = open(self.data.parent / f"{worker_id}.log", "ab")  # noqa: SIM115 - the process keeps it
        proc = subprocess.Popen(
            [*(prefix or []), sys.executable, "-m", "hfport", "serve", "--role", "worker", "--data-dir",
             str(self.data)], env={**os.environ, **self.env, "HFPORT_DATABASE_URL": url,
                                   "HFPORT_WORKER_ID": worker_id, "PYTHONPATH": str(REPO)},
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        self.procs[worker_id] = proc
        wait_for(lambda: {w["id"]: w["pid"] for w in self.store.list_workers()}.get(worker_id) == proc.pid
                 or proc.poll() is not None, 90, f"worker {worker_id} to register")
        assert proc.poll() is None, self.log(worker_id)
        return proc

    def log(self, worker_id: str) -> str:
        return (self.data.parent / f"{worker_id}.log").read_text(errors="replace")

    def stop(self, worker_id: str) -> None:
        proc = self.procs.pop(worker_id)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def stop_all(self) -> None:
        for worker_id in list(self.procs):
            self.stop(worker_id)


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


def watch_cut(store, job_id: str, victim_pid: int, run: Path, cut_at: float, job_log: Path) -> dict[str, Any]:
    """After the cut: the job process kills itself before its lease can run out, the run folder stays as it left it,
    and only then does another worker requeue the job (lease rule). Returns what stale_writes needs and figures."""
    wait_for(lambda: not pid_alive(victim_pid), LEASE_S + 10, "the cut-off job process to stop itself", poll=0.02)
    at_death = snapshot(run)
    last = store.get_job(job_id)  # the last renewal that reached the database, before the cut
    assert last["attempts"] == 1 and last["status"] == "running", last
    dead_at = kill_time(job_log, victim_pid)
    # the lease it held would have run out (by the database clock) only after the process was already gone
    assert dead_at < last["heartbeat_at"] + LEASE_S, (dead_at, last["heartbeat_at"])
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


def rejoin(store, workers: Workers, part: Partition, config: dict[str, Any]) -> float:
    """The link comes back: the stale worker notices, its job is gone, it takes new work (alone now: the root worker
    is stopped first) and its log shows no error. Returns seconds from the heal to its next heartbeat."""
    workers.stop("w-root")
    part.heal()
    healed_at = time.time()
    wait_for(lambda: next((w["age"] < 1.5 for w in store.list_workers() if w["id"] == "w-cut"), False), 120,
             "the stale worker to heartbeat again", poll=0.2)
    took = round(time.time() - healed_at, 2)
    last = store.create_job("finetune", config)["id"]
    wait_for(lambda: store.get_job(last)["status"] in TERMINAL, 180, "the rejoined worker to run a new job", poll=0.5)
    rejoined = store.get_job(last)
    assert rejoined["status"] == "succeeded" and rejoined["worker_id"] == "w-cut", rejoined
    finals = Counter(e["status"] for _, e in store.events_after(last) if e["type"] == "status"
                     and e["status"] in TERMINAL)
    assert finals == Counter({"succeeded": 1}), finals
    log = workers.log("w-cut")
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
    assert workers.procs["w-cut"].poll() is None
    return took


def run_partition(root: Path, minilm: Path, part: Partition, pg: PgServer, n_short: int = 2) -> dict[str, Any]:
    """The scenario; returns its figures (and asserts every promise on the way)."""
    data = root / "data"
    data.mkdir(parents=True)
    model, train = build_inputs(root / "inputs", minilm)
    name = fresh_db_name()
    local_url = pg.create_database(name)
    ns_url = f"{pg.url(name, host=part.root_ip)}?{TCP_OPTS}"
    store = open_store(local_url)
    workers = Workers(data, store, {"HFPORT_JOB_LEASE_S": str(LEASE_S),
                                    "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    figures: dict[str, Any] = {}
    try:
        workers.start("w-cut", ns_url, part.prefix())
        long_cfg = {**job_config(train, LONG_STEPS, 5), "model": str(model), "output_dir": str(data / "long")}
        long_id = store.create_job("finetune", long_cfg)["id"]
        run = data / "long"
        wait_for(lambda: store.get_job(long_id)["status"] == "running", 60, "the partitioned worker to claim the job")
        workers.start("w-root", f"{local_url}?{TCP_OPTS}")  # only now: the job is the partitioned worker's
        held = wait_for(lambda: (j := store.get_job(long_id))["status"] == "running" and j["pid"]
                        and any(run.glob("checkpoints/step-*/trainer_state.json")) and j, 180,
                        "the partitioned worker's job to write a checkpoint")
        assert held["worker_id"] == "w-cut" and held["status"] == "running", held
        figures["cut_at_step"] = held["progress"].get("step")
        victim_pid = held["pid"]
        assert pid_alive(victim_pid)

        part.cut()
        cut = watch_cut(store, long_id, victim_pid, run, time.time(), data / "runs" / long_id / "job.log")
        assert workers.procs["w-cut"].poll() is None, "the partitioned worker itself stays alive"
        figures.update({k: v for k, v in cut.items() if k.startswith("cut_")})

        short = {**job_config(train, 4, 2), "model": str(model)}
        shorts = [store.create_job("finetune", {**short, "output_dir": str(data / f"short-{i}")})["id"]
                  for i in range(n_short)]
        wait_for(lambda: all(store.get_job(j)["status"] in TERMINAL for j in [long_id, *shorts]), 300,
                 "the long job (resumed by the root worker) and the short ones to end", poll=0.5)
        done = store.get_job(long_id)
        assert done["status"] == "succeeded" and done["attempts"] == 2 and done["worker_id"] == "w-root", done
        figures["stale_writes"] = stale_writes(store, long_id, cut)
        assert figures["stale_writes"] == 0
        events = store.events_after(long_id)
        steps = [e["step"] for _, e in events if e["type"] == "train"]
        assert steps == list(range(1, LONG_STEPS + 1)), steps  # each step once, in order, across the two attempts
        assert done["result"]["summary"]["steps"] == LONG_STEPS
        finished = snapshot(run)

        figures["heal_to_rejoin_s"] = rejoin(store, workers, part, {**short, "output_dir": str(data / "after-heal")})
        for job_id in [long_id, *shorts]:
            finals = Counter(e["status"] for _, e in store.events_after(job_id)
                             if e["type"] == "status" and e["status"] in TERMINAL)
            assert finals == Counter({"succeeded": 1}), (job_id, finals)
        assert snapshot(run) == finished  # nobody wrote into the taken-over run afterwards
        return figures
    except BaseException:
        print("--- jobs", json.dumps([store.get_job(j["id"]) for j in store.list_jobs()], default=str)[:4000])
        print("--- db now", store.db_now(), "workers", store.list_workers())
        for worker_id in ("w-cut", "w-root"):
            path = data.parent / f"{worker_id}.log"
            if path.exists():
                print(f"--- {worker_id}\n{path.read_text(errors='replace')[-4000:]}")
        for job_log in sorted((data / "runs").glob("*/job.log")):
            print(f"--- {job_log}\n{job_log.read_text(errors='replace')[-3000:]}")
        raise
    finally:
        workers.stop_all()
        store.close()


def test_partitioned_worker_is_fenced_and_rejoins(tmp_path, minilm_path):
    with partition_or_skip() as part:
        pg = PgServer(require_bin(), listen=("127.0.0.1", part.root_ip), trust_hosts=(part.ns_ip,))
        try:
            pg.start()
            figures = run_partition(tmp_path, minilm_path, part, pg)
        finally:
            pg.stop()
    print(json.dumps(figures))
