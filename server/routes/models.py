"""The model registry: GET/POST /models, GET/DELETE /models/{name}. Fine-tune jobs register their best model."""

from __future__ import annotations

from fastapi import APIRouter, status

from ..deps import ModelServiceDep, StoreDep
from ..errors import ApiError
from ..jobrun import model_task
from ..schemas import ERRORS, Deleted, ModelInfo, ModelList, ModelRegistration
from ..security import confine
from ..settings import SettingsDep

router = APIRouter(prefix="/models", tags=["models"], responses=ERRORS)


def lookup(store, name: str) -> dict:
    entry = store.get_model(name)
    if entry is None:
        known = [m["name"] for m in store.list_models()]
        raise ApiError(404, f"no model named {name!r}; registered: {known}", "ModelNotFound")
    return entry


@router.get("", response_model=ModelList, summary="Registered models")
def list_models(store: StoreDep) -> ModelList:
    return ModelList(models=[ModelInfo(**m) for m in store.list_models()])


@router.post("", response_model=ModelInfo, status_code=status.HTTP_201_CREATED, summary="Register a model folder")
def register(body: ModelRegistration, store: StoreDep, settings: SettingsDep) -> ModelInfo:
    folder = confine(body.path, settings, "path")
    if not (folder / "config.json").is_file():
        raise ApiError(400, f"path: {body.path!r} is not a model folder (no config.json)", "InvalidModel")
    task = body.task or model_task(folder)
    if task is None:
        raise ApiError(400, f"path: {body.path!r}: config.json does not name a supported model", "InvalidModel")
    if store.get_model(body.name) is not None:
        raise ApiError(409, f"a model named {body.name!r} exists; DELETE it first", "Conflict")
    return ModelInfo(**store.register_model(body.name, str(folder), task))


@router.get("/{name}", response_model=ModelInfo, summary="One registered model")
def get_model(name: str, store: StoreDep) -> ModelInfo:
    return ModelInfo(**lookup(store, name))


@router.delete("/{name}", response_model=Deleted, summary="Unregister a model (its files stay)")
def delete_model(name: str, store: StoreDep, models: ModelServiceDep) -> Deleted:
    lookup(store, name)
    store.delete_model(name)
    models.evict(name)
    return Deleted(deleted=name)
