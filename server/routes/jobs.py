"""Jobs: submit fine-tune, export and evaluate jobs, list and read them, follow their events (SSE), cancel them.
Handlers only validate and enqueue; the worker (server/worker.py) runs each job in its own process."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import shutil
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, File, Form, Header, Query, Request, Response, UploadFile, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, StreamingResponse
from pydantic import ValidationError

from hfport import RunDir, lora
from hfport.errors import ConfigError, HfportError
from hfport.evaluation import check_options as check_evaluate_options
from hfport.train import preflight, resolve_config
from hfport.train import metrics_csv, read_metrics

from ..deps import StoreDep
from ..errors import ApiError, ShapedErrorRoute, error_response, validation_message
from ..idempotency import IdempotencyKeyHeader, idempotent
from ..preload import confine_model_files
from ..schemas import (ERRORS, EvaluateJobRequest, ExportJobRequest, FinetuneJobConfig, FinetuneJobRequest, JobInfo,
                       JobList, JobStatus)
from ..security import confine
from ..serving import named_folder, registered
from ..settings import Settings, SettingsDep
from ..store import TERMINAL, BaseStore as Store, ModelNameTaken, StoreUnavailable
from ..worker import job_process_count

router = APIRouter(prefix="/jobs", tags=["jobs"], responses=ERRORS)
UPLOAD_PATH = "/jobs/finetune/upload"
CHUNK = 1 << 20
GLOB_CHARS = "*?["  # a data path whose file name holds one is a glob of Parquet/Arrow files (hfport's --train)


def _model_path(value: str, store: Store, settings: Settings, what: str = "model", run_ok: bool = False) -> str:
    """A registered model's folder, or a folder inside the allowed dirs (run_ok: or a fine-tune run folder); every
    file in it inside them too (a symlink out is refused)."""
    entry = store.get_model(value)
    if entry is not None:
        confine_model_files(store, settings, entry["path"], what)
        return entry["path"]
    folder = named_folder(store, settings, value, what)
    confine_model_files(store, settings, folder, what)
    if run_ok and "best" in RunDir(folder).models():  # export takes a run's best/
        return str(folder)
    if not (folder / "config.json").is_file():
        raise ApiError(400, f"{what}: {value!r} is neither a registered model nor a model folder (no config.json); "
                            f"{registered(store)}", "InvalidModel")
    return str(folder)


def _adapter_base(folder: Path, store: Store, settings: Settings, what: str,
                  registered: str | None = None) -> str | None:
    """The base model folder a job over adapter FOLDER reads (None: FOLDER is no adapter): `registered` (a registered
    adapter's base) when given, else the folder's base_model_name_or_path; confined like every path a job reads, its
    files too (a registered model's folder counts as inside: it was confined when registered, or the operator chose
    it at start)."""
    if not lora.is_adapter_folder(folder):
        return None
    base = registered
    if base is None:
        try:
            named = lora.read_adapter_config(folder).get("base_model_name_or_path")
        except HfportError as e:
            raise ApiError(400, f"{what}: {e}", "InvalidModel") from e
        if not named:
            raise ApiError(400, f"{what}: the adapter {folder} names no base_model_name_or_path", "InvalidModel")
        entry = store.get_model(named)
        known = {m["path"] for m in store.list_models() if m.get("kind") != "adapter"}
        base = entry["path"] if entry is not None else named if named in known else str(
            named_folder(store, settings, named, f"{what}: the adapter's base_model_name_or_path", "model"))
    confine_model_files(store, settings, base, f"{what}: the adapter's base")
    return base


def _data_path(value: str, settings: Settings, what: str) -> str:
    """A data source inside the allowed dirs, and everything it reads: a file, a datasets folder (every file in it),
    or a glob of Parquet/Arrow files (its folder and every match). A file that is a symlink out is refused as any
    path is."""
    folder, pattern = Path(value).parent, Path(value).name
    if not any(c in pattern for c in GLOB_CHARS) or (confine(folder, settings, what) / pattern).exists():
        real = confine(value, settings, what)
        inside = real.rglob("*") if real.is_dir() else ()
    else:
        real = confine(folder, settings, what) / pattern  # a pattern in a folder name is refused: no such folder
        inside = real.parent.glob(pattern)
    for path in inside:
        confine(path, settings, what)
    return str(real)


def _output_dir(value: str | None, settings: Settings, job_id: str, default: str) -> str:
    if value is None:
        return str(settings.runs_dir / job_id / default)
    out = confine(value, settings, "output_dir", must_exist=False)
    uploads = settings.uploads_dir.resolve()
    if out == uploads or out.is_relative_to(uploads):  # the upload sweeper deletes what no live job reads there
        raise ApiError(400, f"output_dir: {value!r} lies in the uploads folder ({uploads}), which the server empties "
                            "of files no queued or running job reads; choose a folder outside it", "InvalidPath")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ApiError(409, f"output_dir: {value!r} exists and is not empty; a job writes a fresh folder", "Conflict")
    return str(out)


def data_bytes(path: str) -> int:
    """The bytes a data source's check reads: a file's size, a folder's files together (a datasets save_to_disk
    folder), a glob's matches together (the sources _data_path takes); 0 for a missing one (preflight names it)."""
    where = Path(path)
    if where.is_file():
        return where.stat().st_size
    if where.is_dir():
        files = where.rglob("*")
    elif any(c in where.name for c in GLOB_CHARS):
        files = where.parent.glob(where.name)
    else:
        return 0
    return sum(f.stat().st_size for f in files if f.is_file())


def check_data(config: Any, settings: Settings) -> None:
    """The engine's own preflight (hfport.train.preflight: model, tokenizer, data files read and encoded) before
    the job is queued, so a bad file is a 422 naming file, line and field instead of a job that fails later; for
    the processes the job will run (a batch per process). Callers run it off the event loop; a file over
    HFPORT_MAX_DATA_BYTES is refused before any of it is read: a file, a datasets folder (its files
    together) or a glob of Parquet/Arrow files (its matches together)."""
    for field in ("train", "eval"):
        path = getattr(config, field)
        size = data_bytes(path) if path is not None else 0
        if size > settings.max_data_bytes:
            raise ApiError(413, f"config.{field}: {Path(path).name!r} is {size:,} bytes, more than the "
                                f"{settings.max_data_bytes:,} bytes a submission's data check reads "
                                "(HFPORT_MAX_DATA_BYTES)", "PayloadTooLarge")
    try:
        preflight(config, world=job_process_count(settings, "finetune"))
    except (HfportError, ValueError) as e:  # DataError names file, line and field
        raise ApiError(422, str(e), type(e).__name__ if isinstance(e, HfportError) else "InvalidData") from e
    except OSError as e:
        raise ApiError(400, f"config.train/eval: cannot be read ({e.strerror or e})", "InvalidData") from e


def config_error(errors: list[Any], prefix: tuple[str, ...] = ()) -> ApiError:
    """FinetuneJobConfig's refusals as one 422 InvalidConfig naming each field: unknown ones with the closest valid
    options, as `hfport finetune` words them. `prefix`: where the config sits in the errors' locations."""
    unknown, problems = [], []
    for err in errors:
        loc = tuple(err.get("loc", ()))[len(prefix):]
        if err.get("type") == "extra_forbidden" and len(loc) == 1:
            unknown.append(str(loc[0]))
        else:
            problems.append(f"{'.'.join(['config', *map(str, loc)])}: {err.get('msg')}")
    if unknown:  # each with its closest options (transformers' names among them), not all of them
        problems.insert(0, f"config: unknown option(s) {sorted(unknown)}" + "".join(
            f"; {k}: {FinetuneJobConfig.did_you_mean(k)}" for k in sorted(unknown)))
    return ApiError(422, "; ".join(problems) or "config: invalid", "InvalidConfig")


class FinetuneRoute(ShapedErrorRoute):
    """A `config` that FinetuneJobConfig refuses is 422 InvalidConfig naming the fields (as the upload route's and
    the CLI's); any other malformed body is the app's 422 ValidationError."""

    shaped = (RequestValidationError,)

    def shape(self, exc: Exception) -> Response:
        errors = exc.errors()
        if errors and all(tuple(e.get("loc", ()))[:2] == ("body", "config") for e in errors):
            error = config_error(errors, ("body", "config"))
            return error_response(error.status, error.message, error.error_type)
        return error_response(422, validation_message(exc), "ValidationError")


def _submit_finetune(config: FinetuneJobConfig, register_as: str | None, store: Store, settings: Settings) -> JobInfo:
    """Paths confined (the model may be a registered name), the run folder the job's own, the config resolved as
    the CLI resolves it and its data read (preflight), then the job queued."""
    job_id = store.new_id()
    values = config.model_dump(exclude_unset=True, exclude={"resume", "overwrite"})  # the rest: FinetuneConfig's
    values["model"] = _model_path(config.model, store, settings)
    if config.teacher is not None:  # distillation's teacher: a model as `model` is
        values["teacher"] = _model_path(config.teacher, store, settings, "config.teacher")
    values["train"] = _data_path(config.train, settings, "config.train")
    if config.eval is not None:
        values["eval"] = _data_path(config.eval, settings, "config.eval")
    # a fine-tune loads an adapter over the base its adapter_config.json names (confined here); a registered adapter
    # served over another base cannot be trained from
    entry = store.get_model(config.model)
    base = _adapter_base(Path(values["model"]), store, settings, "config.model")
    if base is not None and entry is not None and entry.get("base") \
            and Path(entry["base"]).resolve() != Path(base).resolve():
        raise ApiError(400, f"config.model: {config.model!r} is registered over the base {entry['base']}, but its "
                            f"adapter_config.json names {base}, which a fine-tune would load; register the adapter "
                            "over that base, or fine-tune from the base", "InvalidModel")
    values["output_dir"] = _output_dir(config.output_dir, settings, job_id, "run")
    try:
        resolved, _ = resolve_config(values, {}, "config")
    except ConfigError as e:
        raise ApiError(422, str(e), "InvalidConfig") from e
    check_data(resolved, settings)
    stored = resolved.model_dump(mode="json", exclude={"resume", "overwrite"})
    if register_as:
        stored["register_as"] = register_as
    try:  # the name is reserved with the job, in one transaction: of two submissions racing for it, one wins
        return JobInfo(**store.create_job("finetune", stored, job_id, register_as=register_as or None))
    except ModelNameTaken as e:
        raise ApiError(409, f"register_as: {e}", "Conflict") from e


def submit_finetune(body: FinetuneJobRequest, store: StoreDep, settings: SettingsDep,
                    idempotency_key: IdempotencyKeyHeader = None) -> JobInfo:
    # a plain def on purpose: FastAPI runs it in its thread pool, so the data check never blocks the event loop
    return idempotent(store, "finetune", idempotency_key, body,
                      lambda s: _submit_finetune(body.config, body.register_as, s, settings))


router.add_api_route("/finetune", submit_finetune, methods=["POST"], response_model=JobInfo,
                     status_code=status.HTTP_202_ACCEPTED, route_class_override=FinetuneRoute,
                     summary="Queue a fine-tune (data by path inside the allowed dirs)")


async def _save_upload(upload: UploadFile, settings: Settings, folder: Path) -> tuple[str, dict[str, str]]:
    """The uploaded file saved into FOLDER: its path, and its name and SHA-256 (what an Idempotency-Key's request
    digest covers)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", Path(upload.filename or "data").name).lstrip(".") or "data"
    if not name.endswith((".jsonl", ".json", ".csv")):
        raise ApiError(422, f"{upload.filename!r}: data files are .jsonl, .json or .csv", "ValidationError")
    target = folder / name
    size = 0
    digest = hashlib.sha256()
    f = await asyncio.to_thread(target.open, "wb")
    try:
        while chunk := await upload.read(CHUNK):
            size += len(chunk)
            if size > settings.max_data_bytes:
                raise ApiError(413, f"{upload.filename!r}: larger than the upload limit of "
                                    f"{settings.max_data_bytes} bytes (HFPORT_MAX_DATA_BYTES)", "PayloadTooLarge")
            digest.update(chunk)
            await asyncio.to_thread(f.write, chunk)
    finally:
        await asyncio.to_thread(f.close)
    return str(target), {"name": upload.filename or name, "sha256": digest.hexdigest()}


@router.post("/finetune/upload", response_model=JobInfo, status_code=status.HTTP_202_ACCEPTED,
             summary="Queue a fine-tune on uploaded data files (multipart)")
async def submit_finetune_upload(
    store: StoreDep, settings: SettingsDep,
    config: Annotated[str, Form(description="the fine-tune config (FinetuneJobConfig) as a JSON object; train/eval "
                                            "come from the files")],
    train: Annotated[UploadFile, File(description="training data (.jsonl or .csv)")],
    eval: Annotated[UploadFile | None, File(description="evaluation data")] = None,
    register_as: Annotated[str | None, Form(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")] = None,
    idempotency_key: IdempotencyKeyHeader = None,
) -> JobInfo:
    """With an Idempotency-Key, a retry (the same config, register_as and file contents) gets the first job back
    and its second copy of the files is dropped; the same key with anything else is a 409, as on POST
    /jobs/finetune."""
    try:
        values = json.loads(config)
    except json.JSONDecodeError as e:
        raise ApiError(422, f"config: not JSON ({e.msg})", "ValidationError") from e
    if not isinstance(values, dict):
        raise ApiError(422, "config: must be a JSON object", "ValidationError")
    request: dict[str, Any] = {"config": dict(values), "register_as": register_as}
    folder = settings.uploads_dir / uuid.uuid4().hex[:12]
    folder.mkdir(parents=True, exist_ok=True)
    created: list[str] = []
    try:
        values["train"], request["train"] = await _save_upload(train, settings, folder)
        if eval is not None:
            values["eval"], request["eval"] = await _save_upload(eval, settings, folder)
        try:
            typed = FinetuneJobConfig.model_validate(values)
        except ValidationError as e:
            raise config_error(e.errors()) from e

        def submit(keyed: Store) -> JobInfo:
            job = _submit_finetune(typed, register_as, keyed, settings)
            created.append(job.id)
            return job

        job = await asyncio.to_thread(idempotent, store, "finetune-upload", idempotency_key, request, submit)
    except ApiError:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    if job.id not in created:  # a retry answered with the first submission's job, which reads that one's files
        shutil.rmtree(folder, ignore_errors=True)
    return job


@router.post("/export", response_model=JobInfo, status_code=status.HTTP_202_ACCEPTED,
             summary="Queue an export in one of the export formats (+ verification)")
def submit_export(body: ExportJobRequest, store: StoreDep, settings: SettingsDep,
                  idempotency_key: IdempotencyKeyHeader = None) -> JobInfo:
    return idempotent(store, "export", idempotency_key, body, lambda s: _submit_export(body, s, settings))


def _submit_export(body: ExportJobRequest, store: Store, settings: Settings) -> JobInfo:
    job_id = store.new_id()
    options = dict(body.options)
    if body.gate_data is not None:  # a server-side file: confined like every other path, passed as the option
        options["gate_data"] = str(confine(body.gate_data, settings, "gate_data"))
    model = _model_path(body.model, store, settings, run_ok=True)
    source = RunDir(model).model(options.get("which", "best")) if RunDir.is_run(model) else Path(model)
    config = {"model": model, "format": body.format, "options": options, "verify": body.verify,
              "output_dir": _output_dir(body.output_dir, settings, job_id, "export")}
    entry = store.get_model(body.model)
    base = _adapter_base(source, store, settings, "model", entry.get("base") if entry is not None else None)
    if base is not None:  # the export loads exactly this base, never the one the adapter's file names
        config["base_model"] = base
    return JobInfo(**store.create_job("export", config, job_id))


@router.post("/evaluate", response_model=JobInfo, status_code=status.HTTP_202_ACCEPTED,
             summary="Queue an evaluation: a task's metrics on labelled data (+ eval.json, report.html)")
def submit_evaluate(body: EvaluateJobRequest, store: StoreDep, settings: SettingsDep,
                    idempotency_key: IdempotencyKeyHeader = None) -> JobInfo:
    return idempotent(store, "evaluate", idempotency_key, body,
                      lambda s: _submit_evaluate(body, s, settings))


def _submit_evaluate(body: EvaluateJobRequest, store: Store, settings: Settings) -> JobInfo:
    """Paths confined (the models may be registered names or run folders), the options checked against the task's
    evaluation, then the job queued; the job process runs hfport.evaluate (server/jobrun.py)."""
    try:
        check_evaluate_options(body.task, body.options)
    except (HfportError, ValueError) as e:
        raise ApiError(422, str(e), "InvalidConfig") from e
    job_id = store.new_id()
    config = {"model": _evaluated_model(body.model, store, settings, "model"), "task": body.task,
              "data": _data_path(body.data, settings, "data"),
              "corpus": _data_path(body.corpus, settings, "corpus") if body.corpus is not None else None,
              "compare": _evaluated_model(body.compare, store, settings, "compare") if body.compare else None,
              "options": body.options, "dtype": body.dtype, "batch_size": body.batch_size,
              "output_dir": _output_dir(body.output_dir, settings, job_id, "evaluate")}
    return JobInfo(**store.create_job("evaluate", config, job_id))


def _evaluated_model(value: str, store: Store, settings: Settings, what: str) -> str:
    """A model to evaluate: a registered one's folder, a model folder, or a run folder's best/; an adapter's base (the
    one its adapter_config.json names, which loading it reads) confined too."""
    path = _model_path(value, store, settings, what, run_ok=True)
    run = RunDir(path)
    if not (Path(path) / "config.json").is_file() and "best" in run.models():
        path = str(run.best)
    base = _adapter_base(Path(path), store, settings, what)
    entry = store.get_model(value)
    if base is not None and entry is not None and entry.get("base") \
            and Path(entry["base"]).resolve() != Path(base).resolve():
        raise ApiError(400, f"{what}: {value!r} is registered over the base {entry['base']}, but its adapter names "
                            f"{base}, the base an evaluation loads", "InvalidModel")
    return path


@router.get("", response_model=JobList, summary="Jobs, newest first")
def list_jobs(store: StoreDep, status: Annotated[JobStatus | None, Query(description="only this status")] = None,
              limit: Annotated[int, Query(ge=1, le=1000)] = 100) -> JobList:
    return JobList(jobs=[JobInfo(**j) for j in store.list_jobs(status, limit)])


def _job(store: Store, job_id: str) -> dict[str, Any]:
    job = store.get_job(job_id)
    if job is None:
        raise ApiError(404, f"no job {job_id!r}", "JobNotFound")
    return job


@router.get("/{job_id}", response_model=JobInfo, summary="One job: status, progress, latest metrics, error")
def get_job(job_id: str, store: StoreDep) -> JobInfo:
    return JobInfo(**_job(store, job_id))


def _run_metrics(store: Store, job_id: str) -> tuple[list[dict[str, Any]], list[str]]:
    job = _job(store, job_id)
    if job["kind"] != "finetune":
        raise ApiError(409, f"job {job_id} is an {job['kind']} job: only fine-tunes have metrics", "Conflict")
    return read_metrics(RunDir(job["config"]["output_dir"]).metrics)


@router.get("/{job_id}/metrics", summary="A fine-tune's metrics.jsonl as JSON: every entry, and unreadable lines")
def job_metrics(job_id: str, store: StoreDep) -> dict[str, Any]:
    entries, problems = _run_metrics(store, job_id)
    return {"entries": entries, "problems": problems}


# no response_class: errors stay documented as JSON ({"error", "error_type"}); the 200 body is declared as text
@router.get("/{job_id}/metrics.csv", summary="A fine-tune's metrics as CSV: every point, no downsampling",
            responses={200: {"content": {"text/csv": {}}}})
def job_metrics_csv(job_id: str, store: StoreDep) -> PlainTextResponse:
    entries, _ = _run_metrics(store, job_id)
    return PlainTextResponse(metrics_csv(entries), media_type="text/csv",
                             headers={"Content-Disposition": f'attachment; filename="{job_id}-metrics.csv"'})


@router.get("/{job_id}/log", summary="The end of the job process's log",
            responses={200: {"content": {"text/plain": {}}}})
def job_log(job_id: str, store: StoreDep, settings: SettingsDep,
            lines: Annotated[int, Query(ge=1, le=5000)] = 200) -> PlainTextResponse:
    _job(store, job_id)
    path = settings.runs_dir / job_id / "job.log"  # written by the worker (server/worker.py)
    if not path.is_file():
        return PlainTextResponse("")
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - 256 * lines))  # ~256 bytes a line is plenty to find the last `lines`
        text = f.read().decode("utf-8", errors="replace")
    return PlainTextResponse("\n".join(text.splitlines()[-lines:]))


@router.post("/{job_id}/cancel", response_model=JobInfo, summary="Cancel a queued or running job")
def cancel_job(job_id: str, store: StoreDep) -> JobInfo:
    job = _job(store, job_id)
    if job["status"] in TERMINAL:
        raise ApiError(409, f"job {job_id} already ended ({job['status']})", "Conflict")
    return JobInfo(**store.request_cancel(job_id))


def _poll(store: Store, job_id: str, seq: int) -> tuple[list[tuple[int, dict[str, Any]]], dict[str, Any] | None] \
        | None:
    """A job's events after `seq` and the job; None while the database does not answer: an open stream waits an
    outage out (keeping alive) and goes on from where it was, rather than dropping its client mid-way."""
    try:
        return store.events_after(job_id, seq), store.get_job(job_id)
    except StoreUnavailable:
        return None


@router.get("/{job_id}/events", summary="Server-Sent Events: the job's history, then live events until it ends",
            response_class=StreamingResponse,
            responses={200: {"content": {"text/event-stream": {}},
                             "description": "`event: <type>` / `id: <seq>` / `data: <JSON>` frames; the last is "
                                            "`event: end` with the job's final status"}})
async def job_events(job_id: str, request: Request, store: StoreDep,
                     last_event_id: Annotated[int | None, Header(alias="Last-Event-ID")] = None) -> StreamingResponse:
    await asyncio.to_thread(_job, store, job_id)

    async def stream() -> AsyncIterator[str]:
        seq = last_event_id or 0
        idle = 0.0
        while True:
            polled = await asyncio.to_thread(_poll, store, job_id, seq)
            events = polled[0] if polled is not None else []
            for seq, event in events:
                yield f"id: {seq}\nevent: {event.get('type', 'message')}\ndata: {json.dumps(event)}\n\n"
            job = polled[1] if polled is not None else {"status": "unknown while the job store does not answer"}
            if job is None or (job["status"] in TERMINAL and not events):
                final = {"status": job["status"] if job else "deleted", "error": job and job["error"]}
                yield f"event: end\ndata: {json.dumps(final)}\n\n"
                return
            if await request.is_disconnected():
                return
            pause = 0.25 if polled is not None else 1.0
            idle = 0.0 if events else idle + pause
            if idle >= 15:  # a comment line keeps proxies from closing a quiet stream
                idle = 0.0
                yield ": keep-alive\n\n"
            await asyncio.sleep(pause)

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
