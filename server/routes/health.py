"""GET /health: liveness, with job counts and the server's resources; the one route that never needs a token."""

from __future__ import annotations

from fastapi import APIRouter

import hfport
from hfport import tasks
from hfport.train import FinetuneConfig
from hfport.train.monitor import ResourceSampler

from ..deps import ModelServiceDep, StoreDep
from ..schemas import Health

router = APIRouter(tags=["health"])
_sampler: ResourceSampler | None = None  # started on the first request: a daemon thread sampling every 2 s


@router.get("/health", response_model=Health, summary="Liveness, job counts, resources")
def health(store: StoreDep, models: ModelServiceDep) -> Health:
    global _sampler
    if _sampler is None:
        _sampler = ResourceSampler().start()
    resources = _sampler.latest or _sampler.sample()
    return Health(version=hfport.__version__, jobs=store.count_by_status(), models_loaded=models.loaded,
                  resources=resources, trainable_tasks=[t.name for t in tasks.TASKS.values() if t.train],
                  features={"lora": any(n.startswith("lora") for n in FinetuneConfig.model_fields)})
