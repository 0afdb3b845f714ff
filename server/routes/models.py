"""The model registry: GET/POST /models, GET/DELETE /models/{name}. Fine-tune jobs register their best model."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, status

from hfport import AutoTokenizer
from hfport.errors import HfportError
from hfport.lora import check_adapter_base, is_adapter_folder, read_adapter_config
from hfport.pipelines import graph_backend

from ..deps import ModelServiceDep, StoreDep
from ..errors import ApiError
from ..jobrun import model_task
from ..preload import confine_model_files
from ..schemas import ERRORS, Deleted, ModelInfo, ModelList, ModelRegistration
from ..security import confine
from ..serving import lookup, named_folder
from ..settings import SettingsDep
from ..store import ModelNameTaken

router = APIRouter(prefix="/models", tags=["models"], responses=ERRORS)


@router.get("", response_model=ModelList, summary="Registered models")
def list_models(store: StoreDep) -> ModelList:
    return ModelList(models=[ModelInfo(**m) for m in store.list_models()])


@router.post("", response_model=ModelInfo, status_code=status.HTTP_201_CREATED, summary="Register a model folder")
def register(body: ModelRegistration, store: StoreDep, settings: SettingsDep) -> ModelInfo:
    folder = confine(body.path, settings, "path")
    confine_model_files(store, settings, folder, "path")  # a symlink inside (vocab.txt -> /etc/...) is refused too
    adapter = is_adapter_folder(folder)
    if body.kind == "adapter" and not adapter:
        raise ApiError(400, f"path: {body.path!r} is not an adapter folder (no adapter_config.json)", "InvalidModel")
    if not adapter and not (folder / "config.json").is_file():
        raise ApiError(400, f"path: {body.path!r} is not a model folder (no config.json)", "InvalidModel")
    if body.base is not None and not adapter:
        raise ApiError(400, "base: only an adapter folder runs over a base model", "InvalidModel")
    if not adapter:  # an adapter without tokenizer files serves with its base's
        try:
            AutoTokenizer.from_pretrained(folder)  # refused here, not as a 424 on every request that follows
        except (HfportError, OSError) as e:
            raise ApiError(400, f"path: {body.path!r}: its tokenizer does not load, and a served model needs it ({e})",
                           "InvalidModel") from e
    task = body.task or model_task(folder)
    if task is None:
        raise ApiError(400, f"path: {body.path!r}: config.json does not name a supported model", "InvalidModel")
    if store.get_model(body.name) is not None:
        raise ApiError(409, f"a model named {body.name!r} exists; DELETE it first", "Conflict")
    base = adapter_base(store, settings, folder, body.base) if adapter else None
    try:
        return ModelInfo(**store.register_model(body.name, str(folder), task, kind="adapter" if adapter else "model",
                                                base=base))
    except ModelNameTaken as e:  # a queued or running fine-tune will register this name
        raise ApiError(409, str(e), "Conflict") from e


def adapter_base(store, settings, folder, given: str | None) -> str:
    """The base folder of an adapter: a registered model's folder, or a folder in the allowed dirs (default the
    adapter's base_model_name_or_path). The adapter must fit it (checked by loading both's configs)."""
    from hfport.errors import HfportError

    try:
        name = given or read_adapter_config(folder).get("base_model_name_or_path")
    except HfportError as e:
        raise ApiError(400, f"path: {e}", "InvalidModel") from e
    if not name:
        raise ApiError(400, "base: the adapter names no base_model_name_or_path; give \"base\"", "InvalidModel")
    entry = store.get_model(name)
    if entry is not None and entry.get("kind") == "adapter":
        raise ApiError(400, f"base: {name!r} is an adapter; give its base model", "InvalidModel")
    what = "base" if given else "base: the adapter's base_model_name_or_path"
    base = Path(entry["path"]) if entry is not None else named_folder(store, settings, name, what, "model")
    confine_model_files(store, settings, base, "base")
    graph = graph_backend(base, None)
    if graph is not None:  # its layers are a fixed graph: no LoRA layers to route an adapter's rows through
        raise ApiError(400, f"base: {name!r} is an {graph.name} folder, which runs a fixed graph; register the adapter "
                            "over the model folder it was trained on", "InvalidModel")
    try:
        check_adapter_base(folder, base)
    except HfportError as e:
        raise ApiError(400, f"base: {e}", "InvalidModel") from e
    return str(base)


@router.get("/{name}", response_model=ModelInfo, summary="One registered model")
def get_model(name: str, store: StoreDep) -> ModelInfo:
    return ModelInfo(**lookup(store, name))


@router.delete("/{name}", response_model=Deleted, summary="Unregister a model (its files stay)")
def delete_model(name: str, store: StoreDep, models: ModelServiceDep) -> Deleted:
    lookup(store, name)
    store.delete_model(name)
    models.evict(name)
    return Deleted(deleted=name)
