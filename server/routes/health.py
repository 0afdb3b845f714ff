"""GET /health: liveness, with job counts and the server's resources; the one route that never needs a token.
503 while the default model named at start (`serve --model`) is still loading, when it failed to load, or once it
was unregistered (DELETE /models/<name>: the TEI and OpenAI requests that name no model have none), as TEI answers
when its model cannot serve."""

from __future__ import annotations

from fastapi import APIRouter, Request

import hfport
from hfport import tasks
from hfport.pipelines import device_name
from hfport.train import FinetuneConfig, ResourceSampler

from ..deps import ModelServiceDep, StoreDep
from ..errors import ApiError
from ..schemas import ErrorBody, Health
from ..settings import SettingsDep

router = APIRouter(tags=["health"])
_sampler: ResourceSampler | None = None  # started on the first request: a daemon thread sampling every 2 s


@router.get("/health", response_model=Health, summary="Liveness, job counts, resources",
            responses={503: {"model": ErrorBody,
                             "description": "the default model is loading, failed to load, or was unregistered"}})
def health(request: Request, store: StoreDep, models: ModelServiceDep, settings: SettingsDep) -> Health:
    startup = getattr(request.app.state, "startup", None)
    if startup is not None and startup.error is not None:
        raise ApiError(503, startup.error, "Unhealthy")
    if startup is not None and not startup.ready.is_set():
        raise ApiError(503, f"model {startup.default!r} is loading", "Unhealthy")
    if startup is not None and (gone := startup.gone(store)) is not None:
        raise ApiError(503, gone, "Unhealthy")
    global _sampler
    if _sampler is None:
        _sampler = ResourceSampler().start()
    resources = _sampler.latest or _sampler.sample()
    return Health(version=hfport.__version__, jobs=store.count_by_status(), models_loaded=models.loaded,
                  device=device_name(settings.device), dtype=settings.predict_dtype, resources=resources,
                  trainable_tasks=[t.name for t in tasks.TASKS.values() if t.train],
                  features={"lora": any(n.startswith("lora") for n in FinetuneConfig.model_fields)})
