"""GET /health: liveness, with job counts; the one route that never needs a token."""

from __future__ import annotations

from fastapi import APIRouter

import hfport

from ..deps import ModelServiceDep, StoreDep
from ..schemas import Health

router = APIRouter(tags=["health"])


@router.get("/health", response_model=Health, summary="Liveness and job counts")
def health(store: StoreDep, models: ModelServiceDep) -> Health:
    return Health(version=hfport.__version__, jobs=store.count_by_status(), models_loaded=models.loaded)
