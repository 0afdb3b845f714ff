"""Service settings: pydantic-settings with the env prefix HFPORT_ (e.g. HFPORT_PORT=9000, HFPORT_API_TOKEN=...,
HFPORT_ALLOWED_DIRS='["/data/models", "/data/sets"]'), grouped common / advanced (docs/settings.md, generated from
this class, and `hfport serve --help` list them). Handlers get them through `SettingsDep`, so tests build an app with
their own Settings instead of patching the environment.

The lease's internals are not settings: they follow the one lease length, job_lease_s (30 s by default), by the
ratios below, so that shortening the lease (a test, a fast failover) shortens them with it and they always fit."""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import tempfile
from pathlib import Path
from typing import Annotated, ClassVar, Literal

from fastapi import Depends, Request
from pydantic import Field, PositiveInt, ValidationInfo, field_validator, model_validator
from pydantic_settings import NoDecode

from hfport.errors import SettingsError
from hfport.pipelines import check_device, check_dtype
from hfport.settings import ADVANCED, COMMON, NAMES, EnvSettings

from .store import SCHEMES

# fractions of job_lease_s
HEARTBEAT_PER_LEASE = 1 / 15  # job processes renew, workers heartbeat: 2 s of a 30 s lease, ~15 tries before it ends
MARGIN_PER_LEASE = 1 / 5  # self-fencing margin: covers clock-rate drift and the kill's latency (server/fence.py)
START_GRACE_PER_LEASE = 1.0  # a claimed job's first lease runs this much longer: the job process's start, until it
# renews the lease itself
CONNECT_PER_LEASE = 1.0  # start-up retries an unreachable database this long (a worker cut off longer than a lease
# would have lost its jobs' leases anyway)
BATCH_REQUESTS = 2  # a merged pipeline call holds up to this many full requests (predict_max_inputs each)


class Settings(EnvSettings):
    # --- common -----------------------------------------------------------------------------------------------
    host: str = Field("127.0.0.1", json_schema_extra=COMMON, description="bind address; loopback by default (any "
                      "other address needs api_token)")
    port: int = Field(8000, ge=0, le=65535, json_schema_extra=COMMON, description="the HTTP port")
    data_dir: Path = Field(Path("./hfport-data"), json_schema_extra={**COMMON, "shown_default": "./hfport-data"},
                           description="job store, registry, uploads and job runs; made at start, which stops "
                                       "when this process cannot make it or write in it")
    allowed_dirs: list[Path] = Field(default_factory=list, json_schema_extra=COMMON, description=(
        "folders server-side paths may point into (a JSON list); data_dir always is one. Each must exist at start: "
        "one that does not (a typo, a volume not mounted) stops the server, naming it"))
    api_token: str | None = Field(None, json_schema_extra={**COMMON, "secret": True}, description=(
        "when set, every route but GET /health needs it as a Bearer token"))
    models: Annotated[list[str], NoDecode] = Field(
        default_factory=list, json_schema_extra=COMMON, description=(
            "models registered and loaded at start (`serve --model`): folders or cached repo ids, `name=path` to name "
            "one; the first is the default of the TEI/OpenAI routes. A JSON list or comma-separated"))
    device: str = Field("auto", json_schema_extra={**COMMON, **NAMES}, description=(
        "where served models run, adapters included: auto (the first CUDA device when there is one, else the CPU), "
        "cpu, cuda or cuda:N; predict_dtype auto serves an fp32 checkpoint in bf16 on a CUDA GPU with bf16"))
    predict_dtype: str = Field("auto", json_schema_extra={**COMMON, **NAMES}, description=(
        "dtype models are served in: auto (the checkpoint's, but bf16 for an fp32 checkpoint on a CPU with native "
        "bf16), float32 (or fp32), bfloat16 (or bf16), float16 (or fp16, half), float64, int8 (the encoder's Linear "
        "layers in int8, refused where the int8 gate fails) or auto-int8 (int8, else bf16 where the gate fails); an "
        "alias is kept as its full name"))
    auto_truncate: bool = Field(True, json_schema_extra=COMMON, description=(
        "as TEI's --auto-truncate (on by default since TEI 1.9): inputs longer than the model takes are cut to its "
        "maximum length on /embed, /embed_all, /embed_sparse, /similarity, /rerank, TEI's /predict and "
        "/v1/embeddings, unless a TEI request says truncate=false (then 413); off: refused unless a TEI request says "
        "truncate=true (OpenAI's /v1/embeddings has no such field)"))
    max_concurrent_jobs: int = Field(1, ge=1, json_schema_extra=COMMON,
                                     description="jobs running at once (one subprocess each; `serve --workers`)")
    # scale-out: a shared job store, and which parts of the service this process runs
    role: Literal["api", "worker", "all"] = Field("all", json_schema_extra=COMMON, description=(
        "api: HTTP only (jobs are enqueued); worker: runs jobs, no HTTP; all: both (one box)"))
    database_url: str | None = Field(None, json_schema_extra={**COMMON, "secret": True}, description=(
        "postgresql://user:password@host:port/db (or postgres://) selects a shared PostgreSQL job store; unset: "
        "SQLite under data_dir; anything else is refused. Start-up retries an unreachable database for one "
        "job_lease_s"))

    # --- advanced: request limits and batching ----------------------------------------------------------------
    max_request_bytes: int = Field(8 * 2**20, ge=1, json_schema_extra=ADVANCED,
                                   description="largest accepted JSON body")
    max_data_bytes: int = Field(100 * 2**20, ge=1, json_schema_extra=ADVANCED, description=(
        "largest data file a fine-tune takes: an upload (its whole multipart body) or a file a submission names "
        "(POST /jobs/finetune* reads and checks it before queueing); larger is a 413 naming the file and this limit"))
    predict_max_inputs: int = Field(256, ge=1, json_schema_extra=ADVANCED, description=(
        "inputs per request; the micro-batcher merges requests into pipeline calls of up to twice this many"))
    predict_max_chars: int = Field(20_000, ge=1, json_schema_extra=ADVANCED,
                                   description="characters per input (all its text fields)")
    predict_timeout_s: float = Field(30.0, gt=0, json_schema_extra=ADVANCED,
                                     description="per-request deadline of a prediction")
    predict_threads: int = Field(2, ge=1, json_schema_extra=ADVANCED, description=(
        "threads running model forward passes, each on its share of torch's intra-op threads (at least 1), so "
        "that busy predict threads never ask for more threads than cores"))
    predict_max_pending: int = Field(64, ge=1, json_schema_extra=ADVANCED,
                                     description="requests waiting for a model before 429")
    batch_max_wait_ms: float = Field(5.0, ge=0, json_schema_extra=ADVANCED,
                                     description="how long a request waits for others to batch with")
    batch_token_budgets: list[PositiveInt] = Field(
        default_factory=lambda: [1024, 2048, 4096, 8192, 16384], json_schema_extra=ADVANCED, description=(
            "padded-token budgets timed at each model load: the smallest near the best rate becomes the model's "
            "max_batch_tokens; one budget: that one; []: no timing, the model's own max_batch_tokens"))
    strict_dimensions: bool = Field(False, json_schema_extra=ADVANCED, description=(
        "/embed and /v1/embeddings refuse a `dimensions` the model was not trained for (its Matryoshka dimensions, "
        "recorded in config_sentence_transformers.json, or its full size); off: any prefix is served"))
    model_cache_mb: float = Field(4096, gt=0, json_schema_extra=ADVANCED, description=(
        "weight memory of the loaded models kept (least recently used go first, a base and the adapters over it "
        "as one; the newest always stays)"))

    # --- advanced: jobs ---------------------------------------------------------------------------------------
    job_lease_s: float = Field(30.0, gt=0, json_schema_extra=ADVANCED, description=(
        "a running job (or a worker) silent this long, by the database's clock, is presumed dead and requeued. "
        "Derived from it: heartbeats every 1/15 of it, a job process kills itself 1/5 of it before its lease "
        "runs out, a claimed job's first lease is one lease longer, start-up retries the database for one lease"))
    job_stall_s: float = Field(1800.0, gt=0, json_schema_extra=ADVANCED, description=(
        "a fine-tune with no step progress this long stops renewing its lease and is killed and requeued (liveness "
        "is progress, not pulse)"))
    job_processes: int | Literal["auto"] = Field("auto", json_schema_extra=ADVANCED, description=(
        "processes a fine-tune job runs: auto (one per visible GPU, else 1) or an integer >= 1; more than one run "
        "under `accelerate launch` (DDP: nccl on GPUs, gloo on the CPU)"))
    worker_id: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}",
                           json_schema_extra={**ADVANCED, "shown_default": "hostname-pid"},
                           description="this worker's name in the store, unique among live workers")

    retired: ClassVar[dict[str, str]] = {
        "HFPORT_LEASE_S": "HFPORT_JOB_LEASE_S (one name for the lease)",
        "HFPORT_JOB_HEARTBEAT_S": "derived: HFPORT_JOB_LEASE_S / 15",
        "HFPORT_JOB_LEASE_MARGIN_S": "derived: HFPORT_JOB_LEASE_S / 5",
        "HFPORT_JOB_START_GRACE_S": "derived: one HFPORT_JOB_LEASE_S",
        "HFPORT_DATABASE_CONNECT_TIMEOUT_S": "derived: one HFPORT_JOB_LEASE_S",
        "HFPORT_CANCEL_GRACE_S": "fixed: SIGKILL 5 s after SIGTERM (server/worker.py CANCEL_GRACE_S)",
        "HFPORT_UPLOAD_GRACE_S": "fixed: an upload no job needs is deleted after 10 minutes (server/uploads.py "
                                 "GRACE_S)",
        "HFPORT_UPLOAD_SWEEP_S": "fixed: a worker sweeps uploads every minute (server/uploads.py SWEEP_S)",
        "HFPORT_IDEMPOTENCY_TTL_S": "fixed: an Idempotency-Key names its job for 24 h (server/idempotency.py TTL_S)",
        "HFPORT_MAX_UPLOAD_BYTES": "HFPORT_MAX_DATA_BYTES",
        "HFPORT_DATASET_CHECK_MAX_BYTES": "HFPORT_MAX_DATA_BYTES",
        "HFPORT_PREDICT_INTRA_OP_THREADS": "derived: torch's intra-op threads (OMP_NUM_THREADS) divided among "
                                           "HFPORT_PREDICT_THREADS",
        "HFPORT_BATCH_AUTOTUNE": "HFPORT_BATCH_TOKEN_BUDGETS='[]' loads without timing",
        "HFPORT_BATCH_MAX_INPUTS": "derived: twice HFPORT_PREDICT_MAX_INPUTS",
        "HFPORT_MODEL_CACHE_SIZE": "HFPORT_MODEL_CACHE_MB (the model cache is bounded by weight memory alone)",
    }

    @field_validator("job_processes", mode="before")
    @classmethod
    def _processes(cls, v: object) -> object:
        """`auto` or a whole number >= 1; anything else names the setting and what it accepts."""
        text = str(v).strip().lower()
        if text == "auto":
            return "auto"
        try:
            n = int(text)
        except ValueError:
            n = 0
        if n < 1:  # int() already refused 'two', '1.5', True (as 'true')
            raise ValueError("neither 'auto' (one process per visible GPU, else 1) nor a whole number >= 1")
        return n

    @field_validator("models", mode="before")
    @classmethod
    def _model_list(cls, v: object) -> object:
        if isinstance(v, str):
            v = v.strip()
            return json.loads(v) if v.startswith("[") else [x.strip() for x in v.split(",") if x.strip()]
        return v

    @field_validator("predict_dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        return check_dtype(v)  # the canonical name (bf16: bfloat16); a ValueError names the choices

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        return check_device(v)  # a ValueError names the choices and the CUDA devices this process sees

    @field_validator("api_token", "worker_id")
    @classmethod
    def _not_blank(cls, v: str | None) -> str | None:
        """Set (whitespace is stripped) means a value: a blank token would lock every client out, a blank worker id
        names no worker."""
        if v is not None and not v:
            raise ValueError("blank: set a value, or unset the variable")
        return v

    @field_validator("database_url")
    @classmethod
    def _postgres(cls, v: str | None) -> str | None:
        """A PostgreSQL URL: anything else would be opened as a SQLite file of that name in the working directory."""
        if v is not None and not v.startswith(SCHEMES):
            scheme = f"the scheme {v.split('://')[0]!r}" if "://" in v else "no scheme"
            raise ValueError(f"not a PostgreSQL URL ({scheme}): use postgresql://user:password@host:port/dbname, or "
                             "leave it unset for SQLite under data_dir")
        return v

    @field_validator("data_dir")
    @classmethod
    def _absolute(cls, v: Path) -> Path:
        """Absolute, and a folder or one that can be made: a file there (or above it) is refused here, not met by the
        mkdir at start as a traceback."""
        v = v.expanduser().resolve()
        nearest = next(p for p in (v, *v.parents) if p.exists())
        if not nearest.is_dir():
            below = "" if nearest == v else f" (so {v} cannot be one)"
            raise ValueError(f"{nearest} is a file, not a folder{below}")
        return v

    @field_validator("allowed_dirs")
    @classmethod
    def _existing_folders(cls, v: list[Path], info: ValidationInfo) -> list[Path]:
        """Absolute, and each an existing folder: a mount path with a typo (or a volume not mounted) was accepted
        silently, and every request into the folder meant was then a 403. One inside data_dir may be missing (data_dir
        is made at start, and allows all it holds anyway)."""
        v = [p.expanduser().resolve() for p in v]
        data_dir = info.data.get("data_dir")
        inside = lambda p: data_dir is not None and (p == data_dir or p.is_relative_to(data_dir))  # noqa: E731
        wrong = [f"{p} ({'a file' if p.exists() else 'does not exist'})" for p in v if not p.is_dir() and not inside(p)]
        if wrong:
            raise ValueError(f"not a folder: {', '.join(wrong)}; each entry must be an existing folder (create it, "
                             "mount it or correct the path)")
        return v

    @model_validator(mode="after")
    def _no_open_bind_without_a_token(self) -> Settings:
        """A process that listens on anything but loopback needs HFPORT_API_TOKEN: anyone who reaches the port could
        otherwise submit jobs that read and write server-side files. A worker (role=worker) opens no port."""
        if self.role != "worker" and self.api_token is None and not is_loopback(self.host):
            raise ValueError(f"host {self.host!r} is not a loopback address and HFPORT_API_TOKEN is not set: set a "
                             "token (every route but GET /health then needs it as a Bearer token), or bind 127.0.0.1")
        return self

    @property
    def roots(self) -> list[Path]:
        """Every folder server-side paths may resolve into (the data dir first)."""
        return [self.data_dir, *[p for p in self.allowed_dirs if p != self.data_dir]]

    @property
    def job_heartbeat_s(self) -> float:
        """How often a job process renews its lease and a worker heartbeats."""
        return self.job_lease_s * HEARTBEAT_PER_LEASE

    @property
    def lease_margin_s(self) -> float:
        """The self-fencing margin: a job process kills itself when no renewal succeeded for the lease minus this."""
        return self.job_lease_s * MARGIN_PER_LEASE

    @property
    def job_start_grace_s(self) -> float:
        """How much longer a claimed job's first lease runs."""
        return self.job_lease_s * START_GRACE_PER_LEASE

    @property
    def database_connect_timeout_s(self) -> float:
        """How long start-up retries an unreachable database (with backoff) before giving up."""
        return self.job_lease_s * CONNECT_PER_LEASE

    @property
    def batch_max_inputs(self) -> int:
        """Inputs merged into one pipeline call at most."""
        return self.predict_max_inputs * BATCH_REQUESTS

    @property
    def db_path(self) -> Path:
        return self.data_dir / "hfport.db"

    @property
    def store_target(self) -> str:
        """What open_store opens: the PostgreSQL URL when set, else the SQLite file."""
        return self.database_url or str(self.db_path)

    @property
    def uploads_dir(self) -> Path:
        return self.data_dir / "uploads"

    @property
    def runs_dir(self) -> Path:
        return self.data_dir / "runs"


def make_data_dir(path: Path) -> Path:
    """PATH (the data_dir setting) made when missing, parents too, and written in once: where this process cannot (a
    read-only parent or volume, a folder of another user) a SettingsError names the setting and the OS's reason, at
    start, instead of a traceback from the first mkdir or the store's open."""
    where = f"data_dir (HFPORT_DATA_DIR / --data-dir) {str(path)!r}"
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # the folder that could not be made may be a parent of PATH: the OS names it
        raise SettingsError(f"{where}: cannot create it: {e.strerror or e}: {e.filename or path}") from None
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise SettingsError(f"{where}: cannot write in it: {e.strerror or e}") from None
    return path


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and localhost; a name or a wildcard (0.0.0.0, ::) is not."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


SettingsDep = Annotated[Settings, Depends(get_settings)]
