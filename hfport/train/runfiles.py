"""What the loop writes into the run folder besides checkpoints (checkpoint.py) and the report (report.py): the
folder itself (prepare_output_dir), metrics.jsonl (MetricsLog) and the model folders final/ and best/
(save_model_folder). Where each lives is RunDir's (hfport/rundir.py)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from .. import lora
from ..errors import ConfigError
from ..rundir import TRAINER_STATE, RunDir
from ..tokenizer import copy_tokenizer_files
from .checkpoint import NUM_PROCESSES
from .config import FinetuneConfig, resume_changes
from .data import EncodedData
from .monitor import read_metrics

log = logging.getLogger("hfport.train")


def check_output_dir(run: RunDir, config: FinetuneConfig) -> None:
    """Refuse to overwrite an earlier run unless asked to (--overwrite) or continuing it (--resume). Reads only:
    every process calls it before anything loads."""
    existing = run.existing()
    if existing and not config.resume and not config.overwrite:
        raise ConfigError(f"{run.root}: already holds a run ({', '.join(existing)}); pass --overwrite to "
                          "replace it or --resume to continue it")


def prepare_output_dir(run: RunDir, config: FinetuneConfig) -> None:
    """The output folder, made (an earlier run's files cleared with --overwrite) only once the whole setup (data,
    model, LoRA, freezing, optimizer, schedule) has passed: a run refused on the way leaves no folder behind."""
    check_output_dir(run, config)
    if run.existing() and not config.resume:
        run.clear()
    run.root.mkdir(parents=True, exist_ok=True)


def resume_checkpoint(run: RunDir, config: FinetuneConfig, world: int = 1) -> Path | None:
    """The checkpoint `config.resume` continues (None without --resume), for a launch of WORLD processes. Every process
    calls it before anything is loaded or written: no checkpoint to continue, or one written by a run with other
    settings (config.resume_changes) or another number of processes, is a ConfigError that leaves no output folder and
    loads no model. A checkpoint written before its config (or its process count) was kept is not compared."""
    if not config.resume:
        return None
    if config.resume == "latest":
        ckpt = run.latest_checkpoint()
        if ckpt is None:
            again = "with --overwrite instead of --resume (the folder holds a run that saved none)" if \
                run.existing() else "without --resume"
            raise ConfigError(f"resume: {run.checkpoints} holds no complete checkpoint to continue; start the run "
                              f"{again}")
    else:
        ckpt = Path(config.resume)
        if not (ckpt / TRAINER_STATE).is_file():
            raise ConfigError(f"resume: {ckpt} is not a complete checkpoint (no {TRAINER_STATE}); name a step-N "
                              f"folder of a run's checkpoints/, or pass --resume alone for {run.checkpoints}'s "
                              "latest")
    try:
        state = json.loads((ckpt / TRAINER_STATE).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"resume: {ckpt / TRAINER_STATE}: cannot be read ({e})") from e
    saved = state.get("run_config")
    refused = resume_changes(saved, config)[0] if saved is not None else []
    # batch_size is per process: with another process count the global batches, and the checkpoint's place in the
    # epoch's order of them, are another run's
    processes = state.get(NUM_PROCESSES)
    if processes is not None and processes != world:
        refused.append(f"{NUM_PROCESSES}: {processes} -> {world} (batch_size is per process; launch "
                       + ("one process" if processes == 1 else
                          f"{processes} processes: accelerate launch --multi_gpu --num_processes {processes}") + ")")
    if refused:
        raise ConfigError(
            f"resume: {ckpt} was written by a run with other settings; --resume continues that run, so these "
            f"must match it: {'; '.join(refused)}. Set them back, or start a new run from a saved model folder "
            "(the run's best/ or final/) with --model")
    return ckpt


class MetricsLog:
    """metrics.jsonl: one JSON line per logged step and per eval. On resume, lines past the checkpoint's step
    are dropped first so the file ends exactly as an unbroken run's would."""

    def __init__(self, path: Path, keep_through_step: int | None, enabled: bool):
        self.path, self.enabled = path, enabled
        if enabled and keep_through_step is not None and path.exists():
            kept = [line for line in path.read_text().splitlines() if _step_of(line) <= keep_through_step]
            path.write_text("".join(line + "\n" for line in kept))

    def write(self, entry: dict[str, Any]) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(entry) + "\n")

    def read(self) -> list[dict[str, Any]]:
        entries, problems = read_metrics(self.path)
        for problem in problems:
            log.warning("%s", problem)
        return entries


def _step_of(line: str) -> int:
    """A metrics.jsonl line's step; a line that cannot be read (cut off by a kill) counts as past every step."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 2**62


def save_model_folder(model: Any, source: Path, target: Path, task: Any, data: EncodedData,
                      copy_to: Path | None = None) -> None:
    """An HF model folder (weights + config) with the source's tokenizer files beside it, and the task's own files
    (a sentence-transformers layout, say)."""
    if copy_to is not None:
        if copy_to.exists():
            shutil.rmtree(copy_to)
        shutil.copytree(target, copy_to)
        return
    if lora.has_lora(model):  # the adapter in PEFT's format (+ config.json with the labels)
        lora.save_adapter(model, target)
    else:
        model.save_pretrained(target)
    copy_tokenizer_files(source, target)
    task.write_model_files(target, data)


def lora_base(model: str, source: Path) -> str:
    """base_model_name_or_path: a local folder as an absolute path (the adapter is read from anywhere), a repo id
    as given."""
    return str(source.resolve()) if Path(model).expanduser().exists() else model
