"""Dependency aliases handlers declare: the store, the worker, the model service (settings live in settings.py)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from .serving import ModelService
from .store import BaseStore


def get_store(request: Request) -> BaseStore:
    return request.app.state.store


def get_models(request: Request) -> ModelService:
    return request.app.state.model_service


StoreDep = Annotated[BaseStore, Depends(get_store)]
ModelServiceDep = Annotated[ModelService, Depends(get_models)]
