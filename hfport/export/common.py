"""What every export format shares: its errors, the dtype and task tables, and where the source model is.

SRC may be a fine-tune run folder (its best/ or final/), one of its checkpoints, any model folder hfport loads, or a
repo id in the local HF cache; the run folder's layout is RunDir's (hfport/rundir.py).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .. import hub
from ..errors import HfportError
from ..rundir import MODELS, RunDir, RunSummary
from ..tasks import TASKS
from ..tokenizer import SLOW_FILES, TOKENIZER_FILE, has_tokenizer_files

if TYPE_CHECKING:
    from ..modeling import PreTrainedEncoder

WHICH = MODELS  # a run's model folders: best/, final/
EXPORT_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
# task -> transformers' pipeline tag, auto class, and the outputs verify compares, from the task records
# (hfport/tasks/): a task's name is its pipeline tag
PIPELINE_TAGS = {name: name for name in TASKS}
TRANSFORMERS_AUTO = {name: t.auto_class for name, t in TASKS.items()}
OUTPUTS = {name: t.outputs for name, t in TASKS.items()}


class ExportError(HfportError):
    """SRC or DIR is not usable, or writing the export failed; nothing was left at DIR."""


@dataclass
class Source:
    """The model folder SRC names, and the fine-tune run it belongs to (if any)."""

    given: Path
    model: Path  # the folder with config.json + weights
    run: RunDir | None = None  # the fine-tune output folder (summary.json, best/, final/, checkpoints/)

    def summary(self) -> RunSummary | None:
        """The run's summary.json, when SRC belongs to a run that finished."""
        if self.run is None:
            return None
        try:
            return self.run.summary()
        except HfportError as e:
            raise ExportError(str(e)) from e


def resolve_source(src: str | os.PathLike[str], which: str = "best") -> Source:
    """SRC as a model folder: a run's best/ (or final/), a checkpoint, a model folder, or a repo id in the cache."""
    if which not in WHICH:
        raise ExportError(f"which={which!r}: expected one of {list(WHICH)}")
    path = Path(src).expanduser()
    if not path.exists():
        return Source(path, hub.resolve(str(src)))  # a repo id in the local HF cache, or a clear error
    if not path.is_dir():
        raise ExportError(f"{path}: is a file; give a fine-tune output folder or a model folder")
    if RunDir.is_run(path):
        run = RunDir(path)
        model = run.model(which)
        if not (model / "config.json").is_file():
            have = run.models()
            raise ExportError(f"{path}: a fine-tune output folder without a {which}/ model (no {model}/config.json)"
                              + (f"; it has {', '.join(h + '/' for h in have)}" if have else ""))
        return Source(path, model, run)
    if not (path / "config.json").is_file() and not (path / "adapter_config.json").is_file():
        raise ExportError(f"{path}: not a model folder (no config.json) and not a fine-tune output folder "
                          "(no summary.json, best/, final/ or checkpoints/)")
    return Source(path, path, RunDir.containing(path))


def tokenizer_folder(source: Source) -> Path | None:
    """The first of: the model folder, the run's final/ and best/, the run's base model, that has a tokenizer."""
    candidates = [source.model]
    if source.run is not None:
        candidates += [source.run.final, source.run.best]
        summary = source.summary()
        base = summary.config.get("model") if summary is not None else None
        if base:
            try:
                candidates.append(hub.resolve(base))
            except HfportError:
                pass
    return next((folder for folder in candidates if has_tokenizer_files(folder)), None)


def no_tokenizer_message(source: Source) -> str:
    return (f"{source.model}: no tokenizer files ({TOKENIZER_FILE} or one of {', '.join(SLOW_FILES)}) beside the "
            "model" + (f" or in {source.run.final}, {source.run.best} or the run's base model" if source.run else ""))


def check_places(source: Source, out: Path) -> None:
    """OUT must lie outside the source and must not contain it (replacing OUT would delete the source)."""
    out_r = out.resolve()
    places = (source.given, source.model, source.run.root if source.run else None)
    for place in dict.fromkeys(p.resolve() for p in places if p is not None):
        if out_r == place or place in out_r.parents:
            raise ExportError(f"--out {out} lies inside the source {place}; choose a folder outside it")
        if out_r in place.parents:
            raise ExportError(f"--out {out} contains the source {place}; replacing it would delete the source")


def export_config(model: PreTrainedEncoder, architecture: str, dtype: torch.dtype) -> dict[str, Any]:
    """The source config.json, with the head's metadata as the loaded model has it, the dtype and hfport version."""
    from ..version import __version__

    out = model.config.to_hf_dict(architecture)
    out.pop("torch_dtype", None)
    out["dtype"] = DTYPE_NAMES[dtype]
    out["hfport_version"] = __version__
    return out


@contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A hidden sibling folder to write the export into; it replaces OUT when the body returns. If the body (or the
    rename) fails, the staging folder is removed and OUT is left as it was; an OSError becomes an ExportError."""
    staging = hub.staging_dir(out)
    try:
        yield staging
        replace_folder(staging, out)
    except OSError as e:
        shutil.rmtree(staging, ignore_errors=True)
        raise ExportError(f"{out}: writing the export failed ({e.strerror or e}); "
                          + ("the previous folder is unchanged" if out.exists() else "nothing was left there")) from e
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def replace_folder(staging: Path, out: Path) -> None:
    """Rename the finished staging folder to OUT; an old OUT is moved aside first and restored if that fails."""
    if not out.exists():
        os.replace(staging, out)
        return
    aside = out.parent / f".{out.name}.{uuid.uuid4().hex[:12]}.old"
    os.replace(out, aside)
    try:
        os.replace(staging, out)
    except BaseException:
        os.replace(aside, out)
        raise
    shutil.rmtree(aside, ignore_errors=True)
