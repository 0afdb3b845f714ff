"""Reliability and security under faults and bad input, seen from outside (issue 9):

- NaN/inf weights: a warning naming the tensors on load, `load_report.nonfinite`, and export refuses them;
- a corpus of bad model folders through `hfport info` in its own process (tests/forked.py: a fork-server child,
  the CLI as `python -m hfport` runs it): a non-zero exit, one clear error line naming the problem, no traceback,
  and a pickle payload never executed;
- a job left "running" by a dead process never stays running: the stale-lease rule, against the store, then in
  a real server;
- a corpus of bad fine-tune data through `hfport finetune` and POST /jobs/finetune: an error naming file, line
  and field, no job and no checkpoint left behind;
- overload: beyond the queue limit /predict answers 429 (scripts/loadtest.py's burst, with a tiny limit);
- a database outage: the routes that read the store answer 503 naming the database, in their protocol's shape;
- security: every route but /health (and the static page /) answers 401 without the token and 403 with a wrong
  one, found by walking the app's routes so a new one cannot be missed; the server binds loopback by default.

What test_loading.py, test_finetune.py and test_server.py already prove in-process is not repeated here."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import pickle
import shutil
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file, save_file

import hfport
from hfport.export import ExportError, export
from server.store import open_store
from tests import forked
from tests.pgserver import Relay, fresh_db_name
from tests.serving import Server, assert_error, walk_routes
from tests.tiny import TOKENIZER_FILES, save_hf

REPO = Path(__file__).resolve().parent.parent


def run_cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """`hfport ARGS` in its own process: a fork-server child running the CLI as `python -m hfport` does, without a
    fresh interpreter's ~2.5 s of imports for each of this module's 16 runs (tests/forked.py)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop("HFPORT_HOST", None)
    return forked.run_cli(*args, env=env, cwd=REPO, timeout=timeout)


def assert_clean_failure(out: subprocess.CompletedProcess, *fragments: str) -> str:
    """Non-zero exit, exactly one `error: ...` line on stderr holding every fragment, no traceback anywhere."""
    text = out.stdout + out.stderr
    assert out.returncode != 0, f"exit 0:\n{text}"
    assert "Traceback" not in text, text
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, out.stderr
    for fragment in fragments:
        assert fragment in errors[0], (fragment, errors[0])
    return errors[0]


@pytest.fixture(scope="module")
def base_model(tmp_path_factory, minilm_path) -> Path:
    """A tiny random BERT with MiniLM's real tokenizer: loads in milliseconds, fine-tunes and serves."""
    folder = tmp_path_factory.mktemp("rel") / "tiny-bert"
    save_hf("bert", "base", folder, vocab_size=30522, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    for f in TOKENIZER_FILES:
        shutil.copy(minilm_path / f, folder / f)
    return folder


def clone(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_tensors(folder: Path, edit) -> None:
    state = load_file(str(folder / "model.safetensors"))
    edit(state)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def edit_header(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    edit(header)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + blob[8 + n:])


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


# --- 1. NaN / inf weights ---------------------------------------------------------------------------------------

NAN_KEY, INF_KEY = "encoder.layer.0.attention.self.query.weight", "pooler.dense.bias"


def poison(folder: Path) -> None:
    def edit(state):
        state[NAN_KEY][0, 0] = float("nan")
        state[INF_KEY][3] = float("-inf")

    edit_tensors(folder, edit)


def test_nonfinite_weights_warn_on_load_and_block_export(base_model, tmp_path, caplog):
    folder = clone(base_model, tmp_path / "poisoned")
    poison(folder)
    with caplog.at_level(logging.WARNING, logger="hfport"):
        model = hfport.AutoModel.from_pretrained(folder)
    assert sorted(model.load_report.nonfinite) == sorted([NAN_KEY, INF_KEY])
    warnings = [r.getMessage() for r in caplog.records if "NaN or inf" in r.getMessage()]
    assert len(warnings) == 1 and NAN_KEY in warnings[0] and INF_KEY in warnings[0], caplog.text
    assert "NaN/inf values (2)" in model.load_report.summary()
    # a clean checkpoint reports nothing
    assert hfport.AutoModel.from_pretrained(base_model).load_report.nonfinite == []
    # export refuses, naming the tensors, and writes nothing
    with pytest.raises(ExportError) as e:
        export(folder, tmp_path / "out")
    assert NAN_KEY in str(e.value) and INF_KEY in str(e.value) and "NaN or inf" in str(e.value)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
    # the same through the CLI: `info` loads and warns, `export` exits non-zero with one clear line
    info = run_cli("info", str(folder))
    assert info.returncode == 0 and NAN_KEY in info.stderr and "NaN/inf values" in info.stdout, info
    out = run_cli("export", str(folder), "--out", str(tmp_path / "out2"))
    assert_clean_failure(out, "NaN or inf", NAN_KEY, INF_KEY)
    assert not (tmp_path / "out2").exists()


# --- 2. bad model files, through the CLI --------------------------------------------------------------------------


class _WritesMarker:
    """Unpickling this calls open(marker, 'w'): the file appears only if someone unpickles the payload."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _truncated(folder: Path, marker: Path) -> None:
    blob = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(blob[: len(blob) // 2])


def _header_larger_than_file(folder: Path, marker: Path) -> None:
    blob = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", 4 * len(blob)) + blob[8:])


def _header_not_json(folder: Path, marker: Path) -> None:
    blob = (folder / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    (folder / "model.safetensors").write_bytes(blob[:8] + b"\xff" * n + blob[8 + n:])


def _unknown_dtype_string(folder: Path, marker: Path) -> None:
    edit_header(folder, lambda h: h[NAN_KEY].update(dtype="float33"))


def _dtype_not_matching_bytes(folder: Path, marker: Path) -> None:
    edit_header(folder, lambda h: h[NAN_KEY].update(dtype="F16"))  # half the bytes an F32 tensor has


def _shape_mismatch(folder: Path, marker: Path) -> None:
    edit_config(folder, intermediate_size=40)


def _unknown_model_type(folder: Path, marker: Path) -> None:
    edit_config(folder, model_type="gpt2")


def _more_than_memory(folder: Path, marker: Path) -> None:
    edit_config(folder, vocab_size=10**11)


def _pickle_only(folder: Path, marker: Path) -> None:
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps({"weights": _WritesMarker(marker)}))


CORPUS = [
    (_truncated, ["model.safetensors", "truncated"]),
    (_header_larger_than_file, ["model.safetensors", "is larger than the file"]),
    (_header_not_json, ["model.safetensors", "the header is not JSON"]),
    (_unknown_dtype_string, [NAN_KEY, "unknown dtype 'float33'"]),
    (_dtype_not_matching_bytes, [NAN_KEY, "do not hold F16"]),
    (_shape_mismatch, ["shape mismatch", "intermediate.dense.weight"]),
    (_unknown_model_type, ["config.json", "model_type 'gpt2' is not supported"]),
    (_more_than_memory, ["config.json", "vocab_size=100000000000", "refusing before allocating"]),
    (_pickle_only, ["pytorch_model.bin", "never unpickles"]),
]


@pytest.mark.parametrize("damage, fragments", CORPUS, ids=[d.__name__[1:] for d, _ in CORPUS])
def test_bad_model_folder_through_cli(base_model, tmp_path, damage, fragments):
    folder = clone(base_model, tmp_path / "model")
    marker = tmp_path / "PAYLOAD-RAN"
    damage(folder, marker)
    started = time.monotonic()
    out = run_cli("info", str(folder))
    line = assert_clean_failure(out, *fragments)
    assert str(folder) in line, line
    assert time.monotonic() - started < 60
    assert not marker.exists(), "a pickle payload was executed"
    if damage is _pickle_only:  # the payload is live: unpickling it really would have written the marker
        pickle.loads((folder / "pytorch_model.bin").read_bytes())["weights"].close()
        assert marker.exists()


# --- 3. the stale-lease rule ----------------------------------------------------------------------------------------


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def fake_running(store, kind: str, config: dict, heartbeat_age: float, pid: int | None) -> str:
    """A job row in 'running' as a vanished process would leave it (written in one transaction, so no worker can
    claim it in between)."""
    job_id = store.new_id()
    now = time.time()
    with store.connect() as db:
        db.execute("INSERT INTO jobs (id, kind, status, config, created_at, started_at, heartbeat_at, pid, attempts) "
                   "VALUES (?, ?, 'running', ?, ?, ?, ?, ?, 1)",
                   (job_id, kind, json.dumps(config), now - heartbeat_age, now - heartbeat_age, now - heartbeat_age,
                    pid))
    return job_id


def test_stale_lease_rule_against_the_store(tmp_path):
    from server.settings import Settings
    from server.store import Store
    from server.worker import Worker

    settings = Settings(data_dir=tmp_path / "d", job_lease_s=5.0)
    store = Store(settings.db_path)
    worker = Worker(settings, store)
    cfg = {"model": "/nowhere", "options": {}, "verify": False, "output_dir": str(tmp_path / "x")}
    stale = fake_running(store, "export", cfg, heartbeat_age=60, pid=dead_pid())
    fresh = fake_running(store, "export", cfg, heartbeat_age=0, pid=dead_pid())
    # a stale heartbeat whose process is still alive (found by its command line) is not taken from it
    alive_id = store.new_id()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "server.jobrun", alive_id])
    try:
        now = time.time()
        with store.connect() as db:
            db.execute("INSERT INTO jobs (id, kind, status, config, created_at, heartbeat_at, pid, attempts) "
                       "VALUES (?, 'export', 'running', ?, ?, ?, ?, 1)", (alive_id, json.dumps(cfg), now - 60,
                                                                          now - 60, holder.pid))
        worker._check_leases()
        assert store.get_job(stale)["status"] == "queued"
        reasons = [e.get("reason", "") for _, e in store.events_after(stale)]
        assert any("lease expired" in r for r in reasons), reasons
        assert store.get_job(fresh)["status"] == "running"  # inside its lease: left alone
        assert store.get_job(alive_id)["status"] == "running"
    finally:
        holder.kill()
        holder.wait()
    # once its lease runs out too, the fresh one goes the same way
    with store.connect() as db:
        db.execute("UPDATE jobs SET heartbeat_at = ? WHERE id = ?", (time.time() - 60, fresh))
    worker._last_lease_check = 0.0
    worker._check_leases()
    assert store.get_job(fresh)["status"] == "queued"


def test_stale_running_jobs_end_in_a_real_server(base_model, tmp_path):
    """One job left running before the server starts (recovery on start) and one that goes stale while it runs
    (the lease rule): neither stays running; each is requeued with a reason, runs again and ends."""
    from server.store import Store

    data = tmp_path / "data"
    store = Store(data / "hfport.db")
    cfg = {"model": str(tmp_path / "no-such-model"), "options": {}, "verify": False,
           "output_dir": str(data / "runs" / "x" / "export")}
    before = fake_running(store, "export", cfg, heartbeat_age=3600, pid=dead_pid())
    # a short lease, so the lease rule notices the stale row soon; not shorter: the job process kills itself when it
    # cannot renew within lease - margin (server/fence.py), and a loaded CI host can stall a renewal for a second
    srv = Server(data, base_model.parent, workers=1, HFPORT_JOB_LEASE_S="5").start()
    try:
        during = fake_running(store, "export", cfg, heartbeat_age=3600, pid=dead_pid())
        deadline = time.time() + 90
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            while time.time() < deadline:
                jobs = [c.get(f"/jobs/{j}").json() for j in (before, during)]
                if all(j["status"] in ("succeeded", "failed", "cancelled") for j in jobs):
                    break
                time.sleep(0.25)
        for job_id, reason in ((before, "the server restarted"), (during, "lease expired")):
            job = store.get_job(job_id)
            assert job["status"] == "failed", job  # it ran again, and failed for a reason it states
            assert "no-such-model" in job["error"], job["error"]
            assert job["attempts"] == 2, (job, store.events_after(job_id))
            events = [e for _, e in store.events_after(job_id)]
            assert any(reason in e.get("reason", "") for e in events), events
    finally:
        srv.stop()


# --- 5. bad fine-tune data, through the CLI and the service -------------------------------------------------------

GOOD = '{"text": "the plot was great overall", "label": "positive"}\n{"text": "an awful ending", "label": "negative"}\n'
DATA_CASES = {
    # name: (train bytes, eval bytes or None, extra config, fragments of the one error line)
    "empty": (b"", None, {}, ["train.jsonl: the file has no examples"]),
    "missing-column": ((GOOD + '{"text": "no label"}\n').encode(), None, {},
                       ["train.jsonl, line 3, field 'label': missing"]),
    "unknown-eval-label": (GOOD.encode() * 8, b'{"text": "hmm", "label": "neutral"}\n', {},
                           ["eval.jsonl, line 1, field 'label': unknown label 'neutral'"]),
    "mixed-types": ((GOOD + '{"text": "b", "label": ["x"]}\n').encode(), None, {},
                    ["train.jsonl, field 'label': mixed label types", "line 3"]),
    "1MB-line": ((GOOD + '{"text": "' + "x" * 1_100_000 + '", "label": "positive"}\n').encode(), None, {},
                 ["train.jsonl, line 3: the line is", "the limit is 1,000,000"]),
    "non-utf8": (GOOD.encode() + b'{"text": "caf\xe9", "label": "positive"}\n', None, {},
                 ["train.jsonl, line 3: not UTF-8"]),
    "fewer-rows-than-a-batch": (GOOD.encode(), None, {"batch_size": 16, "eval_fraction": 0.0},
                                ["train.jsonl: 2 training examples, fewer than one batch"]),
}


@pytest.fixture(scope="module")
def data_server(base_model) -> Iterator[Server]:
    srv = Server(base_model.parent / "srv-data", base_model.parent, workers=1).start()
    yield srv
    srv.stop()


def write_case(folder: Path, name: str) -> tuple[Path, Path | None, dict]:
    train, evaluation, extra, _ = DATA_CASES[name]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.jsonl").write_bytes(train)
    eval_path = None
    if evaluation is not None:
        eval_path = folder / "eval.jsonl"
        eval_path.write_bytes(evaluation)
    return folder / "train.jsonl", eval_path, extra


@pytest.mark.parametrize("name", list(DATA_CASES))
def test_bad_data_through_cli_and_service(base_model, data_server, tmp_path, name):
    fragments = DATA_CASES[name][3]
    # the CLI: one error line naming file, line and field; no checkpoint written
    train, eval_path, extra = write_case(tmp_path / "cli", name)
    out_dir = tmp_path / "run"
    args = ["finetune", "--model", str(base_model), "--train", str(train), "--output-dir", str(out_dir),
            "--batch-size", str(extra.get("batch_size", 2)), "--max-steps", "2", "--quiet"]
    if eval_path is not None:
        args += ["--eval", str(eval_path)]
    for key, value in extra.items():
        if key != "batch_size":
            args += ["--set", f"{key}={json.dumps(value)}"]
    line = assert_clean_failure(run_cli(*args), *fragments)
    assert str(train.parent) in line, line
    assert not (out_dir / "checkpoints").exists(), "training started despite bad data"
    # the service: 422 with the same message before anything is queued
    folder = base_model.parent / "http-data" / name
    train, eval_path, extra = write_case(folder, name)
    config = {"model": str(base_model), "train": str(train), "max_steps": 2, "batch_size": 2, **extra}
    if eval_path is not None:
        config["eval"] = str(eval_path)
    with httpx.Client(base_url=data_server.url, timeout=60) as c:
        jobs_before = c.get("/jobs").json()["jobs"]
        body = assert_error(c.post("/jobs/finetune", json={"config": config}), 422)
        for fragment in fragments:
            assert fragment in body["error"], (fragment, body)
        assert str(folder) in body["error"], body
        # the upload route reads the same files the same way, and keeps nothing
        files = {"train": ("train.jsonl", train.read_bytes())}
        if eval_path is not None:
            files["eval"] = ("eval.jsonl", eval_path.read_bytes())
        upload_config = {k: v for k, v in config.items() if k not in ("train", "eval")}
        r = c.post("/jobs/finetune/upload", data={"config": json.dumps(upload_config)}, files=files)
        up = assert_error(r, 422)
        for fragment in fragments:
            assert fragment in up["error"], (fragment, up)
        assert c.get("/jobs").json()["jobs"] == jobs_before, "a job was queued for bad data"
    uploads = data_server.data_dir / "uploads"
    assert not uploads.exists() or not any(uploads.iterdir()), "the refused upload was kept"


# --- 6. overload answers 429 -----------------------------------------------------------------------------------------


def _loadtest():
    spec = importlib.util.spec_from_file_location("hfport_loadtest", REPO / "scripts" / "loadtest.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_overload_answers_429_and_recovers(base_model, tmp_path):
    import asyncio

    loadtest = _loadtest()
    srv = Server(tmp_path / "data", base_model.parent, workers=1, HFPORT_PREDICT_MAX_PENDING="1",
                 HFPORT_BATCH_MAX_WAIT_MS="50").start()
    try:
        loadtest.register(srv.url, "m", base_model, {})
        assert httpx.post(srv.url + "/predict", json=loadtest.body("m", 0, 1), timeout=60).status_code == 200
        counts = asyncio.run(loadtest.burst(srv.url, "m", 24, 1, {}))
        assert counts.get("429", 0) >= 1 and set(counts) <= {"200", "429"}, counts
        assert counts.get("200", 0) >= 1, counts  # the ones under the limit are served
        assert httpx.post(srv.url + "/predict", json=loadtest.body("m", 0, 1), timeout=60).status_code == 200
        # the steady phase of the script against the same server: a few clients for a second, all answered
        steady = asyncio.run(loadtest.steady_load(srv.url, "m", 1, 1.0, 1, {}))
        assert steady.errors == {} and len(steady.latencies) >= 1
        # and the script only ever targets loopback
        with pytest.raises(SystemExit, match="only targets loopback"):
            loadtest.check_loopback("http://10.1.2.3:8000")
        # the server started without --host listens on loopback only
        port = int(srv.url.rsplit(":", 1)[1])
        assert listening_addresses(port) == {"127.0.0.1"}, listening_addresses(port)
    finally:
        srv.stop()


def listening_addresses(port: int) -> set[str]:
    """Local addresses of LISTEN sockets on `port`, from /proc/net/tcp and tcp6."""
    import ipaddress

    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            addr, hex_port = fields[1].split(":")
            if int(hex_port, 16) != port or fields[3] != "0A":  # 0A: LISTEN
                continue
            raw = bytes.fromhex(addr)
            if len(raw) == 4:
                found.add(str(ipaddress.IPv4Address(raw[::-1])))
            else:  # four little-endian 32-bit words
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                found.add(str(ipaddress.IPv6Address(words)))
    return found


# --- 7. security --------------------------------------------------------------------------------------------------

# liveness, and the static dashboard page that holds no data with the chart script it loads before the user types
# the token (a static file of the package, no data either)
PUBLIC = {("GET", "/health"), ("GET", "/"), ("GET", "/static/charts.js")}


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code, error
    return error


def test_a_database_outage_answers_503_naming_the_database(pg_server, tmp_path):
    """PostgreSQL goes down under an API process (a relay in front of it closes every connection and refuses new
    ones): what reads the store answers 503 StoreUnavailable at once, naming the database (never its password),
    with Retry-After, OpenAI's route in OpenAI's shape; the SSE stream of a job waits the outage out. Once the
    database is back the same process answers again."""
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.settings import Settings

    pg_server.create_database(name := fresh_db_name())
    relay = Relay(pg_server.port)
    where = f"postgresql://{pg_server.user}:***@127.0.0.1:{relay.port}/{name}"
    settings = Settings(data_dir=tmp_path / "data", role="api",
                        database_url=f"postgresql://{pg_server.user}:s3cret-pw@127.0.0.1:{relay.port}/{name}")
    direct = open_store(pg_server.url(name))  # what the outage does not reach: the test's own view
    job = direct.create_job("export", {"model": "/m", "options": {}, "verify": False, "output_dir": "/out"})

    def outage_then_cancel() -> None:
        time.sleep(0.5)
        relay.stop()
        time.sleep(2.5)
        relay.start()
        direct.request_cancel(job["id"])

    with TestClient(create_app(settings)) as client:
        assert client.get("/jobs").status_code == 200
        outage = threading.Thread(target=outage_then_cancel)
        outage.start()
        frames = client.get(f"/jobs/{job['id']}/events").text  # the whole stream: it ends with the job
        outage.join()
        assert [line for line in frames.splitlines() if line.startswith("event: ")] == \
            ["event: status", "event: status", "event: end"] and '"status": "cancelled"' in frames, frames
        relay.stop()
        for method, path, body in (("GET", "/jobs", None), ("GET", "/jobs/abc", None), ("GET", "/health", None),
                                   ("GET", "/models", None), ("POST", "/jobs/export", {"model": "m"}),
                                   ("POST", "/jobs/abc/cancel", None)):
            started = time.monotonic()
            r = client.request(method, path, json=body)
            error = assert_error(r, 503, "StoreUnavailable")["error"]
            assert where in error and "s3cret-pw" not in error and r.headers["retry-after"] == "5", (path, error)
            assert time.monotonic() - started < 10  # refused connections: no wait for a deadline
        r = client.post("/v1/embeddings", json={"input": "a text", "model": "m"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "StoreUnavailable", r.text
        relay.start()
        assert client.get("/jobs").status_code == 200
    relay.close(), direct.close()


def test_a_body_that_is_not_json_is_named_as_such(tmp_path):
    """A truncated or malformed JSON body is refused saying so and where parsing stopped, on the job routes and in
    each protocol's shape (FastAPI's own location is only the character offset: "11: JSON decode error")."""
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.settings import Settings

    with TestClient(create_app(Settings(data_dir=tmp_path / "data"), run_worker=False)) as client:
        for path, body in (("/jobs/finetune", b'{"config": '), ("/jobs/export", b'{"model": "m",}'),
                           ("/embed", b'{"inputs": ["a"'), ("/v1/embeddings", b"{input}")):
            r = client.post(path, content=body, headers={"content-type": "application/json"})
            error = r.json()["error"]
            message = error["message"] if isinstance(error, dict) else error
            assert r.status_code in (400, 422) and message.startswith("body: not valid JSON at character "), \
                (path, r.status_code, r.text)
        r = client.post("/jobs/finetune", content=b'{"config": ', headers={"content-type": "application/json"})
        assert r.json()["error"] == "body: not valid JSON at character 11 (Expecting value)", r.text


def test_every_route_needs_the_token(tmp_path):
    from fastapi.routing import APIRoute
    from fastapi.testclient import TestClient
    from starlette.routing import Route

    from server.app import create_app
    from server.settings import Settings

    app = create_app(Settings(data_dir=tmp_path / "d", api_token="s3cret"), run_worker=False)
    routes = walk_routes(app.routes, (APIRoute, Route))
    # every operation the schema documents is among the routes walked here (and the schema itself is one)
    spec = app.openapi()
    documented = {(m.upper(), p) for p, methods in spec["paths"].items() for m in methods}
    assert documented <= routes and ("GET", "/openapi.json") in routes and ("GET", "/docs") in routes
    assert PUBLIC <= routes
    checked = []
    with TestClient(app) as c:
        for method, path in sorted(routes - PUBLIC):
            url = path.replace("{", "").replace("}", "")  # any value: the token is checked first
            body = {} if method in ("POST", "PUT", "PATCH") else None
            # OpenAI's routes answer in OpenAI's error shape ({"error": {message, type, param, code}}): its clients parse it
            check = assert_openai_error if path.startswith("/v1/") else assert_error
            r = c.request(method, url, json=body)
            check(r, 401, "Unauthorized")
            assert r.headers.get("www-authenticate") == "Bearer", (method, path)
            check(c.request(method, url, json=body, headers={"Authorization": "Bearer wrong"}), 403, "Forbidden")
            check(c.request(method, url, json=body, headers={"Authorization": "Bearer "}), 401)
            checked.append(f"{method} {path}")
        for method, path in PUBLIC:
            assert c.request(method, path).status_code == 200
    assert len(checked) >= 12, checked


def test_binds_loopback_unless_told(monkeypatch, tmp_path):
    from server.settings import Settings

    for key in [k for k in os.environ if k.startswith("HFPORT_")]:
        monkeypatch.delenv(key)
    assert Settings(data_dir=tmp_path).host == "127.0.0.1"
    assert Settings.model_fields["host"].default == "127.0.0.1"
    monkeypatch.setenv("HFPORT_HOST", "0.0.0.0")
    with pytest.raises(ValueError, match="not a loopback address and HFPORT_API_TOKEN is not set"):
        Settings(data_dir=tmp_path)  # an open bind needs a token
    monkeypatch.setenv("HFPORT_API_TOKEN", "s3cret")
    assert Settings(data_dir=tmp_path).host == "0.0.0.0"  # only when told, and with a token
    monkeypatch.delenv("HFPORT_API_TOKEN")
    assert Settings(data_dir=tmp_path, role="worker").host == "0.0.0.0"  # a worker opens no port
    for host in ("127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost"):
        assert Settings(data_dir=tmp_path, host=host).host == host
    for host in ("0.0.0.0", "::", "10.1.2.3", "example.org"):
        with pytest.raises(ValueError, match="HFPORT_API_TOKEN"):
            Settings(data_dir=tmp_path, host=host)
    from typer.testing import CliRunner

    from hfport.cli import app

    help_text = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"}).output
    assert "default 127.0.0.1" in " ".join(help_text.split()), help_text


def test_docker_entrypoint_generates_a_token_once(tmp_path):
    import stat

    from server.entrypoint import TOKEN_FILE, ensure_token

    assert ensure_token(tmp_path, "mine") == ("mine", False)  # the user's wins
    assert not (tmp_path / TOKEN_FILE).exists()
    token, new = ensure_token(tmp_path / "data", None)
    assert new and len(token) >= 40
    path = tmp_path / "data" / TOKEN_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # readable by its owner only
    assert ensure_token(tmp_path / "data", None) == (token, False)  # a restart keeps it, and does not print it again


def test_docker_entrypoint_reads_its_two_settings_alone(tmp_path, monkeypatch):
    """The entry point runs before the token exists, so the settings as a whole would refuse the image's 0.0.0.0 host:
    it reads data_dir and api_token alone (Settings.env_value), validated as the settings validate them."""
    from hfport.errors import SettingsError
    from server import entrypoint
    from server.settings import Settings

    calls = []
    monkeypatch.setattr(entrypoint.os, "execvpe", lambda *a: calls.append(a))
    monkeypatch.setenv("HFPORT_HOST", "0.0.0.0")
    # unset as the settings read it (empty), and restored at teardown: main() below sets the variable itself
    monkeypatch.setenv("HFPORT_API_TOKEN", "")
    monkeypatch.setenv("HFPORT_DATA_DIR", str(tmp_path / "volume"))
    with pytest.raises(SettingsError):
        Settings()  # what a full read would say before the token is made
    entrypoint.main()
    token = (tmp_path / "volume" / entrypoint.TOKEN_FILE).read_text().strip()
    assert calls and calls[0][2]["HFPORT_API_TOKEN"] == token  # the server's environment, not this process's
    monkeypatch.setenv("HFPORT_API_TOKEN", token)
    Settings()  # complete with the token
    monkeypatch.setenv("HFPORT_PORT", "70000")
    with pytest.raises(SettingsError, match="HFPORT_PORT='70000'"):
        Settings.env_value("port")
    monkeypatch.setenv("HFPORT_DATA_DIR", "")
    assert Settings.env_value("data_dir") == Settings.model_fields["data_dir"].default  # empty counts as unset


def test_uploads_no_live_job_needs_are_swept(tmp_path):
    """An upload folder goes once no queued or running job refers to it and it is past the grace period; one a live
    job reads, or a fresh one whose submission may still be in flight, stays."""
    from server.store import open_store
    from server.uploads import sweep

    root = tmp_path / "uploads"
    store = open_store(str(tmp_path / "hfport.db"))
    try:
        folders = {name: root / name for name in ("live", "ended", "orphan", "fresh")}
        for folder in folders.values():
            folder.mkdir(parents=True)
            (folder / "train.jsonl").write_text("{}\n")
        live = store.create_job("finetune", {"train": str(folders["live"] / "train.jsonl")})
        ended = store.create_job("finetune", {"train": str(folders["ended"] / "train.jsonl"),
                                              "eval": str(folders["ended"] / "train.jsonl")})
        now = time.time()
        old = now - 3600
        for name in ("live", "ended", "orphan"):
            os.utime(folders[name], (old, old))
        with store.connect() as db:  # the job has ended (how does not matter here)
            db.execute("UPDATE jobs SET status = 'succeeded' WHERE id = ?", (ended["id"],))
        removed = sweep(store, root, grace_s=600, now=now)
        assert sorted(removed) == ["ended", "orphan"]
        assert folders["live"].is_dir() and folders["fresh"].is_dir()
        assert live["id"] in {j["id"] for s in ("queued", "running") for j in store.list_jobs(s)}
        assert sweep(store, root, grace_s=600, now=now) == []  # nothing more to do
    finally:
        store.close()


def test_dataset_checks_run_off_the_event_loop_within_a_size_limit(base_model, tmp_path, monkeypatch):
    """POST /jobs/finetune (data by path) and /jobs/finetune/upload read and encode the data before queueing: while
    that check runs (held here until released), the event loop still answers other requests; a data file over
    HFPORT_MAX_DATA_BYTES is refused with 413 naming the field, the file and the limit, unread (an upload: before
    its body is read)."""
    import threading

    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.routes import jobs as job_routes
    from server.settings import Settings

    sets = tmp_path / "sets"
    sets.mkdir()
    (sets / "train.jsonl").write_text(GOOD * 8)
    (sets / "big.jsonl").write_text(GOOD * 40)
    limit = len(GOOD.encode()) * 20
    settings = Settings(data_dir=tmp_path / "data", allowed_dirs=[sets, base_model.parent],
                        max_data_bytes=limit)
    entered, release, real = threading.Event(), threading.Event(), job_routes.preflight

    def held_preflight(config, **kw):
        entered.set()
        assert release.wait(60), "never released"
        return real(config, **kw)

    monkeypatch.setattr(job_routes, "preflight", held_preflight)
    config = {"model": str(base_model), "batch_size": 4}
    with TestClient(create_app(settings, run_worker=False)) as client:
        submissions = {
            "path": lambda name: client.post("/jobs/finetune", json={"config": {**config, "train": str(sets / name)}}),
            "upload": lambda name: client.post("/jobs/finetune/upload", data={"config": json.dumps(config)},
                                               files={"train": (name, (sets / name).read_bytes())}),
        }
        for how, submit in submissions.items():
            entered.clear()
            release.clear()
            answers: dict[str, httpx.Response] = {}
            job = threading.Thread(target=lambda: answers.update(job=submit("train.jsonl")))
            job.start()
            assert entered.wait(60), how
            health = threading.Thread(target=lambda: answers.update(health=client.get("/health")))
            health.start()
            health.join(20)
            seen = answers.get("health")  # read before the release: the loop answered while the check ran
            release.set()
            job.join(120)
            health.join(20)
            assert seen is not None and seen.status_code == 200, f"{how}: /health waited on the data check"
            assert answers["job"].status_code == 202, (how, answers["job"].text)

            entered.clear()
            body = assert_error(submit("big.jsonl"), 413, "PayloadTooLarge")
            fragments = {"path": ("config.train", "'big.jsonl'", f"{(sets / 'big.jsonl').stat().st_size:,} bytes",
                                  f"{limit:,} bytes", "HFPORT_MAX_DATA_BYTES"),
                         "upload": (f"upload larger than the server's limit of {limit} bytes (HFPORT_MAX_DATA_BYTES)",)}
            for fragment in fragments[how]:
                assert fragment in body["error"], (how, fragment, body)
            assert not entered.is_set(), f"{how}: the over-limit file was read"
