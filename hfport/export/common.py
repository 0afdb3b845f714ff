"""What every export format shares: its errors, its result, the dtype and task tables, where the source model is,
where the export may go, and the staged write (hfport/staging.py) that turns an OSError into an ExportError.

SRC may be a fine-tune run folder (its best/ or final/), one of its checkpoints, any model folder hfport loads, or a
repo id in the local HF cache; the run folder's layout is RunDir's (hfport/rundir.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .. import hub, lora, staging
from ..errors import ExportError, HfportError
from ..rundir import MODELS, RunDir, RunSummary
from ..tasks import TASKS
from ..tokenizer import SLOW_FILES, TOKENIZER_FILE, has_tokenizer_files
from ..version import __version__

from .report import VerifyReport

if TYPE_CHECKING:
    from ..modeling import PreTrainedEncoder

WHICH = MODELS  # a run's model folders: best/, final/
EXPORT_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
# task -> transformers' pipeline tag, auto class, and the outputs verify compares, from the task records
# (hfport/tasks/): a task's name is its pipeline tag; a model-only head (pretraining) has none
PIPELINE_TAGS = {name: name for name, t in TASKS.items() if t.pipeline is not None}
TRANSFORMERS_AUTO = {name: t.auto_class for name, t in TASKS.items()}
OUTPUTS = {name: t.outputs for name, t in TASKS.items()}


class FormatOptions(BaseModel):
    """The options every export format takes (each format's options extend these); unknown ones are errors."""

    model_config = ConfigDict(extra="forbid")

    which: Literal["best", "final"] = Field("best", description="a run's best/ or final/ model")

    @field_validator("which", mode="before")
    @classmethod
    def _which(cls, v: Any) -> Any:
        if v not in WHICH:
            raise ValueError(f"which={v!r}: expected one of {list(WHICH)}")
        return v

    @classmethod
    def of(cls, **values: Any) -> Any:
        """Validated options; a bad or unknown value is an ExportError that names it."""
        try:
            return cls(**values)
        except ValidationError as e:
            problems = "; ".join(str(err["ctx"]["error"]) if "error" in err.get("ctx", {}) else
                                 f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
            raise ExportError(problems) from e


@dataclass
class ExportResult:
    """What an export wrote, in any format (export/registry.py): `weights` are the weight files (model.safetensors
    or its shards, adapter_model.safetensors, or the ONNX graphs)."""

    out: Path
    source: Path  # the model folder that was exported
    family: str
    task: str
    dtype: str
    files: list[str]  # everything in OUT
    weights: list[str]
    tokenizer_from: Path | None
    report: VerifyReport | None = None
    format: str = "hf"

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: paths as strings, the verify report as its own dict."""
        return {"out": str(self.out), "source": str(self.source), "format": self.format, "family": self.family,
                "task": self.task, "dtype": self.dtype, "files": list(self.files), "weights": list(self.weights),
                "tokenizer_from": str(self.tokenizer_from) if self.tokenizer_from is not None else None,
                "verify": self.report.to_dict() if self.report is not None else None}


@dataclass
class Source:
    """The model folder SRC names, and the fine-tune run it belongs to (if any)."""

    given: Path
    model: Path  # the folder with config.json + weights
    run: RunDir | None = None  # the fine-tune output folder (summary.json, best/, final/, checkpoints/)
    base_model: Path | None = None  # an adapter's base, given (None: its adapter_config.json's base_model_name_or_path)

    @property
    def adapter(self) -> bool:
        """The model folder holds a LoRA adapter (PEFT's layout) rather than a whole model."""
        return lora.is_adapter_folder(self.model)

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


def check_out(source: Source, out: Path, force: bool) -> None:
    """OUT lies outside the source, is a folder if it exists, and is only replaced with force."""
    check_places(source, out)
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: exists and is not a folder")
    if out.exists() and not force:
        raise ExportError(f"{out}: already exists; pass --force (force=True) to replace it")


def export_config(model: PreTrainedEncoder, architecture: str, dtype: torch.dtype) -> dict[str, Any]:
    """The source config.json, with the head's metadata as the loaded model has it, the dtype and hfport version."""
    out = model.config.to_hf_dict(architecture)
    out.pop("torch_dtype", None)
    out["dtype"] = DTYPE_NAMES[dtype]
    out["hfport_version"] = __version__
    return out


@contextmanager
def staged(out: Path) -> Iterator[Path]:
    """hfport/staging.py's staged write of OUT, an OSError becoming an ExportError that says what was left."""
    try:
        with staging.staged(out) as folder:
            yield folder
    except OSError as e:
        raise ExportError(f"{out}: writing the export failed ({e.strerror or e}); "
                          + ("the previous folder is unchanged" if out.exists() else "nothing was left there")) from e
