"""The fine-tune run folder: its layout, its checkpoints and its summary, defined here and read everywhere else.

    OUT/checkpoints/step-<N>/    a resumable checkpoint (train/checkpoint.py writes its contents)
    OUT/checkpoints/latest       one line: the name of the newest complete checkpoint (moved last)
    OUT/best/, OUT/final/        HF model folders with the tokenizer files
    OUT/metrics.jsonl            one JSON line per logged step and per evaluation
    OUT/summary.json             RunSummary
    OUT/report.html              the curves (train/report.py)

The training loop writes it, export reads it (which model, the model card's facts), the server reads it (resume a
job, register its best model). Nothing here imports torch or the model code, so every layer may use it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

from . import hub
from .errors import HfportError

MODELS = ("best", "final")  # the model folders a run ends with
RUN_FILES = ("metrics.jsonl", "summary.json", "report.html", "checkpoints", *MODELS)
STEP_DIR = re.compile(r"step-(\d+)\Z")
TRAINER_STATE = "trainer_state.json"  # present only in a complete checkpoint


class RunDirError(HfportError, ValueError):
    """A run folder, or a file in it, that cannot be read."""


@dataclass
class RunSummary:
    """What a finished run reports: written to summary.json by the loop, read by export's model card and the server."""

    steps: int
    epochs: int
    best_metric: dict[str, float | None]  # {metric name: best value}
    best_step: int | None
    stopped_early: bool
    metric_mode: str  # "max" | "min"
    frozen: int  # parameters frozen by `freeze`
    train_examples: int
    eval_examples: int
    labels: dict[int, str] | None  # id2label of the trained head (None for tasks without labels)
    problem_type: str | None
    config: dict[str, Any]  # the resolved FinetuneConfig
    final_eval: dict[str, Any] | None = None  # {"eval_<metric>": value} of the last evaluation
    num_processes: int = 1  # the processes (DDP ranks) that trained it

    def to_dict(self, *, with_config: bool = True) -> dict[str, Any]:
        out = asdict(self)
        if self.final_eval is None:
            del out["final_eval"]  # summary.json has no key when no evaluation ran
        if not with_config:
            del out["config"]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "summary") -> RunSummary:
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING}  # older summaries lack the rest
        missing = sorted(required - set(data))
        if missing:
            raise RunDirError(f"{where}: missing {missing}")
        values = {k: v for k, v in data.items() if k in names}  # newer writers may add keys: ignore them
        if isinstance(values.get("labels"), dict):  # JSON object keys are strings
            values["labels"] = {int(k): v for k, v in values["labels"].items()}
        return cls(**values)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> RunSummary:
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise RunDirError(f"{path}: cannot be read ({e})") from e
        if not isinstance(data, dict):
            raise RunDirError(f"{path}: expected a JSON object, got {type(data).__name__}")
        return cls.from_dict(data, str(path))

    def write(self, path: str | os.PathLike[str]) -> None:
        hub.write_json_atomic(Path(path), self.to_dict())


@dataclass(frozen=True)
class ResumePoint:
    """The newest complete checkpoint of a run and the optimizer step it was taken at."""

    checkpoint: Path
    step: int


@dataclass(frozen=True)
class RunDir:
    """One fine-tune output folder. Paths are properties; nothing is created until a method writes."""

    root: Path  # str or PathLike accepted; stored as a Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root).expanduser())

    # --- the layout ---------------------------------------------------------------------------------------

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def latest_pointer(self) -> Path:
        return self.checkpoints / "latest"

    @property
    def best(self) -> Path:
        return self.root / "best"

    @property
    def final(self) -> Path:
        return self.root / "final"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def summary_path(self) -> Path:
        return self.root / "summary.json"

    @property
    def report(self) -> Path:
        return self.root / "report.html"

    def model(self, which: str) -> Path:
        """best/ or final/."""
        if which not in MODELS:
            raise RunDirError(f"which={which!r}: expected one of {list(MODELS)}")
        return self.root / which

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step-{step}"

    # --- what is there ------------------------------------------------------------------------------------

    @staticmethod
    def is_run(folder: str | os.PathLike[str]) -> bool:
        """A run folder: no config.json of its own, and a summary or one of best/, final/, checkpoints/."""
        folder = Path(folder)
        return folder.is_dir() and not (folder / "config.json").is_file() and (
            (folder / "summary.json").is_file() or any((folder / n).is_dir() for n in (*MODELS, "checkpoints")))

    @classmethod
    def model_folder(cls, model: str | os.PathLike[str]) -> str | os.PathLike[str]:
        """MODEL as the folder to load: a run folder stands for its best/ model, so that every command that takes a
        model takes the run that made it (export, evaluate, finetune's model and teacher, mine); anything else (a
        model folder, a repo id) as given."""
        if cls.is_run(model) and "best" in cls(model).models():
            return cls(model).best
        return model

    @classmethod
    def containing(cls, model_folder: str | os.PathLike[str]) -> RunDir | None:
        """The run a model folder belongs to: OUT for OUT/best, OUT/final or OUT/checkpoints/step-N."""
        path = Path(model_folder)
        if path.name in MODELS and cls.is_run(path.parent):
            return cls(path.parent)
        if path.parent.name == "checkpoints" and cls.is_run(path.parent.parent):
            return cls(path.parent.parent)
        return None

    def existing(self) -> list[str]:
        """The names of RUN_FILES present: a non-empty list means the folder already holds a run."""
        return [name for name in RUN_FILES if (self.root / name).exists()]

    def models(self) -> list[str]:
        """Which of best/ and final/ hold a model."""
        return [n for n in MODELS if (self.root / n / "config.json").is_file()]

    def checkpoint_steps(self) -> list[int]:
        """Steps of the step-N folders, ascending (complete or not)."""
        if not self.checkpoints.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.checkpoints.iterdir() if (m := STEP_DIR.match(p.name)))

    def latest_checkpoint(self) -> Path | None:
        """The checkpoint `latest` names, or else the newest complete step-N folder; None if there is none."""
        if self.latest_pointer.is_file():
            path = self.checkpoints / self.latest_pointer.read_text().strip()
            if (path / TRAINER_STATE).is_file():
                return path
        complete = [s for s in self.checkpoint_steps() if (self.checkpoint(s) / TRAINER_STATE).is_file()]
        return self.checkpoint(complete[-1]) if complete else None

    def resume_point(self) -> ResumePoint | None:
        """Where `resume="latest"` continues from."""
        path = self.latest_checkpoint()
        if path is None:
            return None
        try:
            step = json.loads((path / TRAINER_STATE).read_text())["step"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise RunDirError(f"{path / TRAINER_STATE}: cannot be read ({e})") from e
        return ResumePoint(path, int(step))

    def summary(self) -> RunSummary | None:
        """summary.json, or None when the run has none (it did not finish)."""
        return RunSummary.from_file(self.summary_path) if self.summary_path.is_file() else None

    # --- writing ------------------------------------------------------------------------------------------

    def set_latest(self, checkpoint: Path) -> None:
        """Point `latest` at a checkpoint, atomically: written beside it under a name of this write's own, then
        renamed (a fixed name let two writers rename each other's file, or find it gone)."""
        hub.write_text_atomic(self.latest_pointer, checkpoint.name + "\n")

    def clear(self) -> None:
        """Delete an earlier run's files (and only those) before a fresh run writes here."""
        for name in self.existing():
            target = self.root / name
            shutil.rmtree(target) if target.is_dir() else target.unlink()
