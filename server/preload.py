"""Models named at start (`hfport serve --model [NAME=]PATH`, or HFPORT_MODELS): registered in the store, then
loaded and warmed up in the background. /health answers 503 until the first (the default of the TEI and OpenAI
routes) is ready; requests for a model still loading wait for it."""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ApiError
from .jobrun import model_task
from .schemas import NAME_PATTERN
from .security import confine_files
from .serving import PROTOCOL_TASK, ModelRecord, ModelService
from .settings import Settings
from .store import BaseStore as Store

log = logging.getLogger("hfport.server")
SOURCE = "serve --model"  # the registry's source of a start-up model: the operator's choice, read as a whole
GIVEN = f"--model / {Settings.env_name('models')}"  # where a refused start-up model was given, as errors name it


def operator_chose(store: Store, folder: str) -> bool:
    """Whether FOLDER is a start-up model's (`serve --model`, now or in an earlier run), whose files the server reads
    without confining each (an HF cache snapshot's files are links into the cache's blobs)."""
    return any(m["path"] == folder and m.get("source") == SOURCE for m in store.list_models())


def confine_model_files(store: Store, settings: Settings, folder: str | Path, what: str) -> None:
    """Every file of a model folder a request or job names lies inside the allowed dirs (403 otherwise), unless the
    operator chose the folder at start."""
    if not operator_chose(store, str(folder)):
        confine_files(folder, settings, what)


@dataclass
class Startup:
    default: str | None = None  # the model requests that name none go to
    names: list[str] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)
    error: str | None = None

    def gone(self, store: Store) -> str | None:
        """Why the default cannot serve once it was unregistered (DELETE /models/<name>), else None: requests that
        name no model then have none, and /health says so (503) until a model is registered under its name again."""
        if self.default is None or store.get_model(self.default) is not None:
            return None
        return (f"model {self.default!r}, the default (the first --model), is no longer registered: requests that "
                f"name no model have none; register a model as {self.default!r} again, or restart with --model")


def parse_spec(spec: str) -> tuple[str, Path]:
    """`name=path` or `path` -> (name, folder). A repo id resolves through the local HF cache."""
    from hfport import resolve_model

    name, sep, where = spec.partition("=")
    if not sep:
        name, where = "", spec
    folder = Path(where).expanduser()
    if not folder.is_dir():
        try:
            folder = Path(resolve_model(where))
        except Exception as e:  # noqa: BLE001 - any failure means the same to the operator
            raise ApiError(400, f"{GIVEN} {spec!r}: not a folder, and not a repo id in the local HF cache ({e})",
                           "InvalidModel") from e
    name = name or re.sub(r"[^A-Za-z0-9._-]", "-", folder.resolve().name if where in (".", "") else Path(where).name)
    if not re.match(NAME_PATTERN, name):
        raise ApiError(400, f"{GIVEN} {spec!r}: {name!r} is not a valid model name (letters, digits, . _ -)",
                       "InvalidModel")
    return name, folder.resolve()


def register(specs: list[str], store: Store) -> Startup:
    """Register every spec (replacing a same-named entry: the command line wins over an earlier registration). Two
    specs of one name (given, or both taken from their folders' names) are refused: the later would replace the
    earlier unseen."""
    startup = Startup()
    given: dict[str, str] = {}  # name -> the spec that named it
    for spec in specs:
        name, folder = parse_spec(spec)
        if name in given:
            raise ApiError(400, f"{GIVEN} {spec!r}: the name {name!r} is also --model {given[name]!r}'s; name each "
                                "model once (NAME=PATH)", "InvalidModel")
        given[name] = spec
        task = model_task(folder)
        if task is None:
            raise ApiError(400, f"{GIVEN} {spec!r}: {folder}/config.json does not name a supported model",
                           "InvalidModel")
        store.register_model(name, str(folder), task, source=SOURCE, replace=True)
        startup.names.append(name)
    startup.default = startup.names[0] if startup.names else None
    if not startup.names:
        startup.ready.set()
    return startup


def load_in_background(startup: Startup, store: Store, service: ModelService) -> threading.Thread | None:
    """Load and warm up every start-up model, the default first, as the TEI and OpenAI routes serve it (a bare
    encoder as sentence embeddings); `ready` is set once the default is loaded."""
    if not startup.names:
        return None

    def run() -> None:
        for name in startup.names:
            entry = store.get_model(name)
            try:
                service.load(ModelRecord.of(entry, PROTOCOL_TASK.get(entry["task"], entry["task"])))
                log.info("model %s ready (%s)", name, entry["path"])
            except Exception as e:  # noqa: BLE001 - reported on /health, logged with its traceback
                log.exception("loading start-up model %s failed", name)
                if name == startup.default:
                    startup.error = f"model {name!r} failed to load: {e}"
            if name == startup.default:
                startup.ready.set()

    thread = threading.Thread(target=run, name="hfport-preload", daemon=True)
    thread.start()
    return thread
