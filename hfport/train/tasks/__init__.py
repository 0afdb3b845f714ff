"""What the training loop needs from each task, one file a task; the loop itself never branches on the task.

A task reads and encodes its data (every data error raised before training), collates batches, computes the
training loss, and turns evaluation outputs into metrics.
"""

from __future__ import annotations

from typing import Any

import torch

from ..data import EncodedData, Features


class TrainTask:
    name: str = ""

    def read(self, config: Any, tokenizer: Any, model_id2label: dict[int, str] | None) -> EncodedData:
        raise NotImplementedError

    def collate(self, items: list[Features], data: EncodedData, seed: int) -> dict[str, torch.Tensor]:
        """A padded batch. `seed` is unique to the batch (and fixed across resumes) for random corruption."""
        raise NotImplementedError

    def loss(self, outputs: Any, batch: dict[str, torch.Tensor], data: EncodedData, class_weights: Any,
             label_smoothing: float) -> torch.Tensor:
        raise NotImplementedError

    def eval_rows(self, outputs: Any, batch: dict[str, torch.Tensor], items: list[Features],
                  data: EncodedData) -> list[Any]:
        """Small, picklable per-example results (gathered across processes before `metrics`)."""
        raise NotImplementedError

    def metrics(self, rows: list[Any], data: EncodedData, id2label: dict[int, str]) -> dict[str, float]:
        raise NotImplementedError


TASKS: dict[str, TrainTask] = {}


def register(task: TrainTask) -> TrainTask:
    TASKS[task.name] = task
    return task


def get_task(name: str) -> TrainTask:
    from . import classification  # noqa: F401  (registers)

    for module in ("tokens", "qa", "mlm"):  # tasks that may not be written yet stay optional imports
        try:
            __import__(f"{__name__}.{module}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{module}":
                raise
    if name not in TASKS:
        raise ValueError(f"fine-tuning task {name!r} is not available; available: {sorted(TASKS)}")
    return TASKS[name]
