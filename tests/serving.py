"""The service as the tests run it: `hfport serve` in a child process (Server: allowed dirs),
the allowed folder of tiny models and sentiment data the service tests register and train on, and the checks they
share: JSON errors, waiting on a job, walking the app's routes."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import httpx

from server.launch import ServerProcess
from tests.data import write_sentiment
from tests.forked import ForkedPopen, popen_cli
from tests.tiny_tokenizers import make_folder

REPO = Path(__file__).resolve().parent.parent
TERMINAL = ("succeeded", "failed", "cancelled")


def allowed_root(root: Path, tiny_bert: Path) -> Path:
    """`root`: models/<head> (a tiny BERT of every head with a trained tokenizer), models/ft-base (a copy of
    conftest's tiny_bert: a tiny BERT without dropout and MiniLM's tokenizer) and data/{train,eval}.jsonl (sentiment
    rows). The service tests make it their one allowed dir."""
    for task in ("sequence-classification", "token-classification", "question-answering", "masked-lm", "base"):
        folder = make_folder(root / "models", "bert", task)
        folder.rename(root / "models" / task)
    shutil.copytree(tiny_bert, root / "models" / "ft-base")
    (root / "data").mkdir()
    write_sentiment(root / "data" / "train.jsonl", 96, seed=0)
    write_sentiment(root / "data" / "eval.jsonl", 24, seed=1)
    return root


class ForkedServerProcess(ServerProcess):
    """server.launch's ServerProcess, its `hfport serve` started in a child of the session's fork server, which
    imported torch, hfport and the server's app once (tests/forked.py): the CLI as `python -m hfport serve` runs
    it, without a fresh interpreter's ~3 s of imports at each of the suite's server starts. What the server starts
    (job processes) are plain subprocesses, as always."""

    def spawn(self, argv: list[str], env: dict[str, str]) -> ForkedPopen:
        return popen_cli(*argv, log=self.log_path, env=env, cwd=self.cwd)


class Server(ForkedServerProcess):
    """`hfport serve` for the tests: allowed dirs, one thread per op; `env` adds HFPORT_*."""

    def __init__(self, data_dir: Path, allowed: Path, workers: int = 2, **env: str):
        self.allowed = allowed
        super().__init__(data_dir, data_dir.parent / f"{data_dir.name}-server.log",
                         env={"HFPORT_ALLOWED_DIRS": json.dumps([str(allowed)]), "OMP_NUM_THREADS": "1",
                              "HF_HUB_OFFLINE": "1", **env},
                         args=("--workers", str(workers)), cwd=REPO)


def assert_error(r: httpx.Response, status: int, error_type: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body = r.json()
    assert set(body) == {"error", "error_type"} and body["error"], body
    if error_type:
        assert body["error_type"] == error_type, body
    return body


def wait_job(client: httpx.Client, job_id: str, until: Any, timeout: float = 90) -> dict[str, Any]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        job = client.get(f"/jobs/{job_id}").json()
        if until(job):
            return job
        if job["status"] in TERMINAL:
            raise AssertionError(f"job ended before the condition held: {job}")
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting on job {job_id}: {client.get(f'/jobs/{job_id}').json()}")


def finetune_config(root: Path, **overrides: Any) -> dict[str, Any]:
    return {"model": "ftbase", "train": str(root / "data" / "train.jsonl"), "eval": str(root / "data" / "eval.jsonl"),
            "batch_size": 16, "lr": 3e-3, "logging_steps": 1, "seed": 7, "max_length": 32, **overrides}


def walk_routes(items, kinds, prefix: str = "") -> set[tuple[str, str]]:
    """(method, path) of every route, schema or not, through included routers (flat in older FastAPI releases,
    wrapped in an include record holding the original router and its prefix in newer ones)."""
    found = set()
    for route in items:
        if isinstance(route, kinds):
            found |= {(m, prefix + route.path) for m in (route.methods or ()) if m != "HEAD"}
        elif hasattr(route, "original_router"):
            context = getattr(route, "include_context", None)
            found |= walk_routes(route.original_router.routes, kinds, prefix + getattr(context, "prefix", ""))
        elif hasattr(route, "routes"):  # a mounted sub-application
            found |= walk_routes(route.routes, kinds, prefix + getattr(route, "path", ""))
    return found
