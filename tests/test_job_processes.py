"""Server-launched multi-process fine-tunes (issue 34 item 3): with HFPORT_JOB_PROCESSES=2 the worker runs a fine-tune
job under `accelerate launch` (two CPU processes over gloo stand in for two GPUs; the same command with nccl there).

- a job with batch B per process succeeds and equals one process with batch 2B (fp32, SGD: the bounds and their
  reasons are tests/test_ddp.py's), and records num_processes in summary.json, its result and GET /jobs/{id};
- kill -9 of the worker (a `hfport serve`, role all) mid-job: every process of the job (the launcher and both
  ranks, found in /proc by the job id in their command lines) dies with it, none is orphaned; a new worker (set to
  one process) requeues the job, resumes it from its checkpoint with the two processes it started with, and
  completes it;
- HFPORT_JOB_PROCESSES refuses what is neither `auto` nor a whole number >= 1, naming the setting.

CI budget: one tiny BERT, 3 steps for the comparison and a few dozen for the killed job; two server starts."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file

import hfport
from hfport import RunDir
from hfport.errors import SettingsError
from hfport.train.config import FinetuneConfig
from server.settings import Settings
from server.store import Store, open_store
from server.worker import Worker, job_processes
from tests import ddp_driver
from tests.ddp_driver import LOSS_RELATIVE, LOSS_ROUNDING, WEIGHT_TOLERANCE
from tests.serving import TERMINAL, Server, wait_job

PER_PROCESS = ddp_driver.PER_PROCESS
KILL_STEPS = 40  # long enough to kill the job between its first checkpoint and its end


@pytest.fixture(scope="module")
def root(ddp_root) -> Path:
    return ddp_root  # conftest's: tiny no-dropout BERTs with MiniLM's tokenizer, each task's data (read only here)


def config(root: Path, **over) -> dict:
    values = {**ddp_driver.COMMON, "model": str(root / "bert"), "task": "text-classification",
              "train": str(root / "single.jsonl"), "batch_size": PER_PROCESS}
    return {**values, **over}


def losses(run: Path) -> list[float]:
    return [e["loss"] for e in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if e["type"] == "train"]


def test_two_process_job_equals_one_process_and_survives_its_worker(root, tmp_path):
    data = tmp_path / "data"
    env = {"HFPORT_JOB_PROCESSES": "2", "HFPORT_JOB_LEASE_S": "10"}
    srv = Server(data, root, workers=1, **env).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            # 1. a 2 x B job equals one process with 2B
            r = client.post("/jobs/finetune", json={"config": config(root)})
            assert r.status_code == 202, r.text
            job = wait_job(client, r.json()["id"], lambda j: j["status"] in TERMINAL, timeout=180)
            assert job["status"] == "succeeded", (job, srv.read_log())
            assert job["progress"]["num_processes"] == 2, job["progress"]
            assert job["result"]["summary"]["num_processes"] == 2, job["result"]
            run = Path(job["result"]["output_dir"])
            assert json.loads((run / "summary.json").read_text())["num_processes"] == 2

            # 2. a longer job, killed with its worker after its first checkpoint
            r = client.post("/jobs/finetune", json={"config": config(
                root, max_steps=KILL_STEPS, save_strategy="steps", save_steps=2, save_total_limit=2)})
            assert r.status_code == 202, r.text
            killed = r.json()["id"]
            # a complete checkpoint to resume from (the background write of step 2 has ended), the job still running
            held = wait_job(client, killed, lambda j: j["status"] == "running"
                            and RunDir(j["config"]["output_dir"]).resume_point() is not None, timeout=180)
        procs = job_processes(killed)
        assert len(procs) >= 3, procs  # the launcher and two ranks (the launcher's argv names the job too)
        srv.proc.kill()  # SIGKILL: no handler, no cleanup
        srv.proc.wait()
        deadline = time.time() + 15
        while (left := [p for p in procs if Path(f"/proc/{p}").exists() and not _zombie(p)]) and time.time() < deadline:
            time.sleep(0.1)
        assert not left, f"processes of job {killed} outlived their worker: {left}"
        assert job_processes(killed) == []
        print(f"killed the worker at step {held['progress'].get('step')} of {KILL_STEPS}; {len(procs)} processes "
              "of the job ended with it")
    finally:
        srv.stop()

    # the single-process reference (in this process): batch 2B, same seed and data order
    one = tmp_path / "one"
    hfport.finetune(FinetuneConfig(**config(root, batch_size=2 * PER_PROCESS, output_dir=str(one))), progress=False)
    a, b = load_file(str(one / "final" / "model.safetensors")), load_file(str(run / "final" / "model.safetensors"))
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= WEIGHT_TOLERANCE, worst
    la, lb = losses(one), losses(run)
    assert len(la) == len(lb) == ddp_driver.COMMON["max_steps"], (la, lb)
    assert all(abs(x - y) <= LOSS_ROUNDING + LOSS_RELATIVE * abs(x) for x, y in zip(la, lb)), (la, lb)
    print(f"2 x {PER_PROCESS} job against 1 x {2 * PER_PROCESS}: max |weight diff| {worst:.2e}, max |loss diff| "
          f"{max(abs(x - y) for x, y in zip(la, lb)):.2e}")

    # 3. another worker takes the job back, resumes it from its checkpoint and completes it: set to run one process,
    # it runs the two the job started with (a resume by another count would be another run, and is refused)
    srv = Server(data, root, workers=1, **{**env, "HFPORT_JOB_PROCESSES": "1"}).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            done = wait_job(client, killed, lambda j: j["status"] in TERMINAL, timeout=180)
            assert done["status"] == "succeeded", (done, srv.read_log())
            assert done["attempts"] == 2, done
        store = Store(data / "hfport.db")
        events = [e for _, e in store.events_after(killed)]
        store.close()
        resumed = [e for e in events if e.get("type") == "resumed"]
        assert resumed and resumed[0]["step"] >= 2, events
        assert done["result"]["summary"]["steps"] == KILL_STEPS and done["result"]["summary"]["num_processes"] == 2
    finally:
        srv.stop()


def _zombie(pid: int) -> bool:
    """A dead process its parent has not reaped yet (state Z) runs nothing."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


@pytest.mark.parametrize("value", ["0", "-2", "two", "1.5"])
def test_job_processes_setting_refuses_what_it_cannot_run(monkeypatch, value):
    monkeypatch.setenv("HFPORT_JOB_PROCESSES", value)
    with pytest.raises(SettingsError, match=rf"HFPORT_JOB_PROCESSES='{value}': neither 'auto' .* nor a whole number "
                                            ">= 1"):
        Settings()


# an empty variable is unset, as for every setting (docs/settings.md)
@pytest.mark.parametrize(("value", "expected"), [("auto", "auto"), ("AUTO", "auto"), ("3", 3), (" 1 ", 1),
                                               ("", "auto")])
def test_job_processes_setting_reads(monkeypatch, value, expected):
    monkeypatch.setenv("HFPORT_JOB_PROCESSES", value)
    assert Settings().job_processes == expected


@pytest.mark.parametrize(("silent_s", "status"), [(60.0, "queued"), (0.0, "failed")])
def test_a_launcher_exit_after_the_lease_ran_out_requeues(tmp_path, silent_s, status):
    """Under `accelerate launch` rank 0's exit FENCED (75: its watchdog stopped it when no renewal landed for the
    lease minus the margin) reaches the worker as the launcher's 1. A job whose lease was silent that long is
    requeued as fenced, as a single process would be; one that renewed up to its end (a crash) fails."""
    settings = Settings(data_dir=tmp_path / "data", job_lease_s=10.0)
    store = open_store(settings.db_path)
    worker = Worker(settings, store)
    worker.register()
    try:
        job = store.create_job("finetune", {"output_dir": str(tmp_path / "run")})
        claimed = store.claim_next(worker.id)
        with store.connect() as db:  # the last renewal that landed, silent_s ago
            db.execute("UPDATE jobs SET heartbeat_at = ? WHERE id = ?", (time.time() - silent_s, job["id"]))
        launcher = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])  # what the launcher returns
        launcher.wait()
        worker.procs[job["id"]], worker.attempts[job["id"]] = launcher, claimed["attempts"]
        worker._reap()
        done = store.get_job(job["id"])
        assert done["status"] == status, done
        last = [e for _, e in store.events_after(job["id"])][-1]
        if status == "queued":
            assert "could not renew its lease in time" in last["reason"], last
        else:
            assert "exited with code 1" in done["error"], done
    finally:
        store.close()
