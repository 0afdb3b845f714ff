"""create_app(settings): the FastAPI app. It opens the store (SQLite, or PostgreSQL by HFPORT_DATABASE_URL); the
lifespan starts the job worker when the role is `all`; routers are mounted here, every one but /health and the
dashboard page behind the bearer token when one is set (the dashboard is a static page without data: its requests
carry the token the user types in). One model service (server/serving) runs every protocol's inference."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

import hfport
from hfport.verbosity import LEVELS

from . import errors, metrics, preload
from .routes import dashboard, docs, health, jobs, models, openai, tei
from .security import Authorized, BodyLimit
from .serving import ModelService
from .settings import Settings, make_data_dir
from .store import open_store
from .worker import Worker, run_worker

log = logging.getLogger("hfport.server")


def create_app(settings: Settings | None = None, *, run_worker: bool = True, verbosity: str | None = None) -> FastAPI:
    """The service. `run_worker=False` builds it without the job worker (jobs then stay queued): for unit tests.
    Role `api` (settings.role) builds it without the worker too: workers elsewhere run the jobs it enqueues.
    verbosity: the level its job processes log at (`serve -q`, `-vv`); None: theirs (HFPORT_VERBOSITY, else
    verbose)."""
    settings = settings or Settings()
    make_data_dir(settings.data_dir)
    run_worker = run_worker and settings.role == "all"
    store = open_store(settings.store_target, connect_timeout_s=settings.database_connect_timeout_s)
    worker = Worker(settings, store, verbosity=verbosity)
    if run_worker:
        worker.register()  # now, so a duplicate worker id fails before the port opens, with its message

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if run_worker:
            worker.start()
        preload.load_in_background(app.state.startup, app.state.store, app.state.model_service)
        app.state.worker = worker
        log.info("hfport serving from %s (allowed dirs: %s)", settings.data_dir,
                 ", ".join(str(r) for r in settings.roots))
        try:
            yield
        finally:
            if run_worker:
                worker.stop()
            app.state.model_service.close()
            store.close()

    app = FastAPI(title="hfport", version=hfport.__version__, lifespan=lifespan, openapi_url=None, docs_url=None,
                  redoc_url=None,
                  description="Predict with, fine-tune and export hfport encoder models. Errors are JSON "
                              "{\"error\", \"error_type\"}.")

    app.state.settings = settings
    app.state.store = store
    app.state.metrics = metrics.Metrics()
    app.state.model_service = ModelService(settings, app.state.metrics,
                                           trusted=lambda folder: preload.operator_chose(store, folder))
    app.state.startup = preload.register(settings.models, app.state.store)  # `serve --model`: bad ones fail here
    errors.install(app)
    metrics.install(app, app.state.metrics)
    app.add_middleware(BodyLimit, settings=settings, upload_paths=(jobs.UPLOAD_PATH,))
    app.include_router(health.router)
    app.include_router(dashboard.router)
    # the schema and its browser view need the token too (FastAPI's own are always public)
    app.include_router(docs.router, dependencies=[Authorized])
    # TEI's routes (POST /predict takes hfport's native body too: routes/tei.py tells them apart) and OpenAI's
    for router in (models.router, jobs.router, tei.router, openai.router, metrics.router):
        app.include_router(router, dependencies=[Authorized])
    return app


def serve(settings: Settings, verbosity: str = "verbose") -> None:
    """`hfport serve`: HTTP (+ the worker) under uvicorn, or for role `worker` the worker loop alone (no port).
    verbosity (a hfport.verbosity.LEVELS name): uvicorn's level and its job processes'.
    Raises StoreError (unreachable database, newer schema, duplicate worker id) or SettingsError (a data dir this
    process cannot make or write in) before anything starts."""
    if settings.role == "worker":
        make_data_dir(settings.data_dir)  # job runs and their logs go there (with PostgreSQL nothing else makes it)
        store = open_store(settings.store_target, connect_timeout_s=settings.database_connect_timeout_s)
        log.info("hfport worker %s on %s (data dir %s)", settings.worker_id, store.describe(), settings.data_dir)
        run_worker(settings, store, verbosity=verbosity)
        return
    import uvicorn

    uvicorn.run(create_app(settings, verbosity=verbosity), host=settings.host, port=settings.port,
                log_level=LEVELS[verbosity])
