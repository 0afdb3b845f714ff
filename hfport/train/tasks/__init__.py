"""What the training loop needs from each task, one file a task; the loop itself never branches on the task.
Each task's record (hfport/tasks/) names its class here.

A task reads and encodes its data (every data error raised before training), collates batches, computes the
training loss, and turns evaluation outputs into metrics.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ...tasks import get as task_record
from ..data import EncodedData, Features, Source

MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids")  # what a batch gives the model; the rest is targets


class TrainTask:
    name: str = ""  # the task's canonical name (its record in hfport/tasks/ points here)
    # (problem_type, *, predictions, labels, ...) -> metrics: the task's function in hfport/train/metrics/
    compute_metrics: Callable[..., dict[str, float]]

    def read(self, config: Any, tokenizer: Any, model_id2label: dict[int, str] | None) -> EncodedData:
        raise NotImplementedError

    def reads_own_format(self, source: Source) -> bool:
        """SOURCE is a file of a format of the task's own (its record's `files`: a CoNLL or .txt file), not a table
        whose columns the record's `columns` name: a suffix no table kind claims."""
        return source.kind is None

    def collate(self, items: list[Features], data: EncodedData, seed: int) -> dict[str, torch.Tensor]:
        """A padded batch. `seed` names the training step (fixed across resumes; the same in every process and
        micro-batch of the step): random corruption draws per example from it and the example's identity."""
        raise NotImplementedError

    def forward(self, model: Any, batch: dict[str, torch.Tensor], data: EncodedData) -> Any:
        """The model's outputs for a collated batch: the model on its inputs (the targets stay with the loss). A task
        whose examples are several texts (sentence embeddings) returns what its loss takes instead."""
        return model(**{k: batch[k] for k in MODEL_INPUTS if k in batch})

    def write_model_files(self, folder: Path, data: EncodedData) -> None:
        """Files the task adds to a saved model folder (best/, final/) beside the HF ones; none by default."""

    def loss(self, outputs: Any, batch: dict[str, torch.Tensor], data: EncodedData, class_weights: Any,
             label_smoothing: float) -> torch.Tensor:
        raise NotImplementedError

    def loss_options(self, data: EncodedData) -> frozenset[str]:
        """Which of the config's loss options (label_smoothing, class_weights) this task's loss on `data` uses: the
        cross-entropy losses do; preflight refuses one set where it would be ignored."""
        return frozenset()

    def loss_count(self, batch: dict[str, torch.Tensor], data: EncodedData, class_weights: Any) -> Any:
        """How many units `loss`'s mean is over in this batch (an int or a () tensor): the examples by default; a
        task whose mean is over tokens, pairs or masked positions (or weighted by class) says so. Under DDP the loop
        sums it across processes and weighs each process's loss by its share, so the step's loss is the mean over
        the whole global batch, as one process would compute it."""
        return batch["input_ids"].shape[0]

    def unused_modules(self, model: Any) -> list[str]:
        """Modules of the training model whose parameters the loss never reads (their names in `model`): the loop
        turns their gradients off, so DDP does not wait for them, and they are saved as loaded."""
        return []

    def eval_rows(self, outputs: Any, batch: dict[str, torch.Tensor], items: list[Features],
                  data: EncodedData) -> list[Any]:
        """Small, picklable per-example results (gathered across processes before `metrics`)."""
        raise NotImplementedError

    def metrics(self, rows: list[Any], data: EncodedData, id2label: dict[int, str]) -> dict[str, float]:
        raise NotImplementedError

    def metric_names(self, data: EncodedData) -> list[str]:
        """The names `metrics` reports on DATA (the loop adds loss), found by running `metrics` itself on
        sample_rows: what evaluation will compute, never a list kept beside it. The preflight checks the config's
        metric against them before the model loads."""
        id2label = data.space.id2label if data.space is not None else {}
        return sorted(self.metrics(self.sample_rows(data), data, id2label))

    def sample_rows(self, data: EncodedData) -> list[Any]:
        """A few rows shaped as eval_rows makes them for DATA (their values arbitrary), for metric_names."""
        raise NotImplementedError

    # --- what the loop runs besides the steps (distillation's wrapper, hfport/train/distill.py, fills these) ---

    # trainable modules the loss uses beside the model (distillation's projection): optimised, clipped, synchronised
    # across processes and checkpointed with the model, never saved in best/ or final/
    companion: torch.nn.Module | None = None

    def before_training(self, data: EncodedData, device: torch.device) -> None:
        """Work done once before the first step, in every process (a teacher's outputs); none by default."""

    # --- distillation: what a teacher's outputs teach this task (hfport/train/distill.py runs the teacher) ---

    distillable: bool = False  # the hooks below are this task's own
    # the config fields of the columns a row may lack when a teacher teaches it (it then learns from the teacher alone)
    teacher_stands_in_for: tuple[str, ...] = ()

    def teacher_data(self, data: EncodedData, teacher: Path) -> EncodedData:
        """The data as the teacher's pass reads it: the teacher's own settings where the task has any (pooling)."""
        return data

    def teacher_targets(self, outputs: Any, batch: dict[str, torch.Tensor], items: list[Features],
                        data: EncodedData) -> list[np.ndarray]:
        """What the teacher's outputs for a collated batch teach: one flat float32 array per example, in order
        (stored once before training; collated back as one flat `teacher` tensor, the examples' in turn)."""
        raise NotImplementedError

    def distill_terms(self, outputs: Any, batch: dict[str, torch.Tensor], teacher: torch.Tensor, data: EncodedData,
                      temperature: float, companion: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(the distillation loss of each unit the task distils (n,): an example, a token, a pair; the example each
        unit belongs to (n,)). `teacher`: the batch's stored targets, flat; `companion`: distill_companion's module."""
        raise NotImplementedError

    def labelled(self, batch: dict[str, torch.Tensor], data: EncodedData) -> torch.Tensor | None:
        """Which examples of a batch have a target of their own (B,) (a row without one learns from a teacher
        alone); None: all of them, always (the default)."""
        return None

    def distill_units(self, batch: dict[str, torch.Tensor], data: EncodedData) -> Any:
        """How many units distill_terms returns for this batch (loss_count's count under distillation)."""
        return batch["input_ids"].shape[0]

    def distill_companion(self, data: EncodedData, teacher_width: int, seed: int) -> torch.nn.Module | None:
        """A module the distillation loss trains beside the model (sentence embeddings of another width: a
        projection to the teacher's); none by default."""
        return None


def get_task(name: str) -> TrainTask:
    """The training task of `name` (any of the task's names), as its record in hfport/tasks/ names it."""
    return task_record(name).train_task
