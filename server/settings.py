"""Service settings: pydantic-settings with the env prefix HFPORT_ (e.g. HFPORT_PORT=9000, HFPORT_API_TOKEN=...,
HFPORT_ALLOWED_DIRS='["/data/models", "/data/sets"]'). Handlers get them through `SettingsDep`, so tests build an
app with their own Settings instead of patching the environment."""

from __future__ import annotations

import ipaddress
import json
import os
import socket
from pathlib import Path
from typing import Annotated, Literal

from fastapi import Depends, Request
from pydantic import AliasChoices, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from hfport.pipelines import check_device, check_dtype


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="HFPORT_", extra="forbid", populate_by_name=True)

    host: str = Field("127.0.0.1", description="bind address; loopback by default")
    port: int = Field(8000, ge=0, le=65535)
    data_dir: Path = Field(Path("./hfport-data"), description="job store, registry, uploads and job runs")
    allowed_dirs: list[Path] = Field(default_factory=list,
                                     description="folders server-side paths may point into; data_dir always is one")
    api_token: str | None = Field(None, description="when set, every route but GET /health needs it as a Bearer token")
    max_concurrent_jobs: int = Field(1, ge=1, description="jobs running at once (one subprocess each)")
    max_upload_bytes: int = Field(100 * 2**20, ge=1, description="largest accepted upload (multipart body)")
    upload_grace_s: float = Field(600.0, ge=0, description="an upload no queued or running job refers to is "
                                  "deleted once it is this old (the grace covers a submission still in flight)")
    upload_sweep_s: float = Field(60.0, gt=0, description="how often a worker sweeps uploads no job needs")
    max_request_bytes: int = Field(8 * 2**20, ge=1, description="largest accepted JSON body")
    predict_max_inputs: int = Field(256, ge=1, description="inputs per /predict request")
    predict_max_chars: int = Field(20_000, ge=1, description="characters per input (all its text fields)")
    predict_timeout_s: float = Field(30.0, gt=0, description="per-request deadline for /predict")
    predict_threads: int = Field(2, ge=1, description="threads running model forward passes")
    predict_intra_op_threads: int = Field(0, ge=0, description=(
        "torch intra-op threads of each predict thread: 0 = auto (the process's intra-op threads shared among the "
        "predict threads, at least 1 each, so that busy predict threads never ask for more threads than cores); "
        "N: N each"))
    predict_max_pending: int = Field(64, ge=1, description="requests waiting for a model before 429")
    batch_max_wait_ms: float = Field(5.0, ge=0, description="how long a request waits for others to batch with")
    batch_max_inputs: int = Field(512, ge=1, description="inputs merged into one pipeline call at most")
    strict_dimensions: bool = Field(False, description=(
        "/embed and /v1/embeddings refuse a `dimensions` the model was not trained for (its Matryoshka dimensions, "
        "recorded in config_sentence_transformers.json, or its full size); off: any prefix is served"))
    auto_truncate: bool = Field(True, description=(
        "as TEI's --auto-truncate (on by default since TEI 1.9): inputs longer than the model takes are cut to its "
        "maximum length on /embed, /embed_all, /embed_sparse, /similarity, /rerank, TEI's /predict and "
        "/v1/embeddings, unless a TEI request says truncate=false (then 413); off: refused unless a TEI request says "
        "truncate=true (OpenAI's /v1/embeddings has no such field)"))
    predict_dtype: str = Field("auto", description="dtype models are served in: auto (the checkpoint's, but bf16 "
                               "for an fp32 checkpoint on a CPU with native bf16), float32, bfloat16, float16, int8 "
                               "(the encoder's Linear layers in int8, refused where the int8 gate fails) or "
                               "auto-int8 (int8, else bf16 where the gate fails)")
    device: str = Field("auto", description="where served models run, adapters included: auto (the first CUDA "
                        "device when there is one, else the CPU), cpu, cuda or cuda:N; predict_dtype auto serves an "
                        "fp32 checkpoint in bf16 on a CUDA GPU with bf16")
    model_cache_size: int = Field(4, ge=1, description="loaded models kept in memory, a base and "
                                  "the adapters over it counting as one (least recently used go)")
    model_cache_mb: float = Field(4096, gt=0,
                                  description="weight memory of the kept pipelines (the newest always stays)")
    job_heartbeat_s: float = Field(2.0, gt=0, description="how often a job process proves it is alive")
    job_lease_s: float = Field(30.0, gt=0, description="a running job (or a worker) silent this long is presumed "
                                                       "dead, by the database's clock (HFPORT_LEASE_S)",
                               validation_alias=AliasChoices("HFPORT_LEASE_S", "HFPORT_JOB_LEASE_S"))
    job_lease_margin_s: float | None = Field(None, ge=0, description="a job process that has not renewed its lease "
                                             "for job_lease_s minus this (its own monotonic clock, from when it "
                                             "sent the last renewal that succeeded) kills itself, so it is dead "
                                             "before another worker may take the job; default 20% of the lease")
    job_start_grace_s: float = Field(30.0, ge=0, description="a claimed job's first lease runs this much longer, to "
                                                              "cover the start of its process until it renews the "
                                                              "lease itself")
    job_stall_s: float = Field(1800.0, gt=0, description="a fine-tune with no step progress this long stops renewing "
                                                         "its lease and is killed and requeued (liveness is "
                                                         "progress, not pulse)")
    idempotency_ttl_s: float = Field(24 * 3600.0, gt=0, description="how long an Idempotency-Key on POST /jobs/* "
                                                                    "names its job (a retry within it gets the "
                                                                    "same job)")
    cancel_grace_s: float = Field(5.0, ge=0, description="SIGTERM to SIGKILL delay when cancelling")
    job_processes: int | Literal["auto"] = Field("auto", description="processes a fine-tune job runs: auto (one per "
                                                 "visible GPU, else 1) or an integer >= 1; more than one run under "
                                                 "`accelerate launch` (DDP: nccl on GPUs, gloo on the CPU)")
    dataset_check_max_bytes: int = Field(100 * 2**20, ge=1, description="largest data file (train or eval, given by "
                                         "path or uploaded) POST /jobs/finetune* reads and checks before queueing; "
                                         "a larger one is refused with 413 naming the file and this limit")
    # scale-out: a shared job store, and which parts of the service this process runs
    database_url: str | None = Field(None, description="postgresql://user:password@host:port/db selects a shared "
                                                       "PostgreSQL job store; unset: SQLite under the data dir")
    database_connect_timeout_s: float = Field(30.0, ge=0, description="how long start-up retries an unreachable "
                                                                      "database (with backoff) before giving up")
    role: Literal["api", "worker", "all"] = Field("all", description="api: HTTP only (jobs are enqueued); worker: "
                                                                     "runs jobs, no HTTP; all: both (one box)")
    worker_id: str = Field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}",
                           description="this worker's name in the store, unique among live workers "
                                       "(default hostname-pid)")
    models: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="models registered and loaded at start (`serve --model`): folders or "
                                          "cached repo ids, `name=path` to name one; the first is the default of "
                                          "the TEI/OpenAI routes. A JSON list or comma-separated")
    batch_autotune: bool = Field(True, description="at model load, time forward passes at each of "
                                                   "batch_token_budgets and keep the smallest near the best rate")
    batch_token_budgets: list[int] = Field(default_factory=lambda: [1024, 2048, 4096, 8192, 16384], min_length=1,
                                           description="padded-token budgets batch_autotune tries")

    @model_validator(mode="after")
    def _lease_margin_fits(self) -> Settings:
        if self.lease_margin_s >= self.job_lease_s:
            raise ValueError(f"job_lease_margin_s ({self.lease_margin_s:g} s) must be below the job lease "
                             f"HFPORT_LEASE_S ({self.job_lease_s:g} s): a job process dies when no renewal succeeded "
                             f"for the lease minus the margin")
        return self

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
            raise ValueError(f"HFPORT_JOB_PROCESSES: {v!r} is neither 'auto' (one process per visible GPU, else 1) "
                             "nor a whole number >= 1")
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
        return check_dtype(v)  # a ValueError names the choices

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        return check_device(v)  # a ValueError names the choices and the CUDA devices this process sees

    @field_validator("data_dir")
    @classmethod
    def _absolute(cls, v: Path) -> Path:
        return v.expanduser().resolve()

    @field_validator("allowed_dirs")
    @classmethod
    def _absolute_all(cls, v: list[Path]) -> list[Path]:
        return [p.expanduser().resolve() for p in v]

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
    def lease_margin_s(self) -> float:
        """The self-fencing margin (job_lease_margin_s, default a fifth of the lease)."""
        return self.job_lease_margin_s if self.job_lease_margin_s is not None else 0.2 * self.job_lease_s

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
