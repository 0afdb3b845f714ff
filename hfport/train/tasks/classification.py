"""Sequence classification: single-label, multi-label and regression."""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..data import (ENCODE_ROWS, DataError, EncodedData, Features, Record, Source, compact, data_sources,
                    encode_label, field_of, infer_label_space, iter_records, pad_ids, retarget, split_off, where,
                    without_tokens)
from ..distill import SOFT_TARGETS, teacher_label_space
from ..metrics import classification as metrics
from ..stored import collect
from . import TrainTask

UNLABELLED = -100  # a single-label row's target without a label (with a teacher); regression and multi-label: NaN


class RawLabels:
    """(label as written, line or row) of each example, read off the features, which hold the label as their target
    until the training labels fix the label space: iterable as often as infer_label_space needs, without a tuple
    kept per row."""

    def __init__(self, features: Sequence[Features]) -> None:
        self.features = features

    def __iter__(self) -> Iterator[tuple[Any, int]]:
        return ((x.target, x.source[1]) for x in without_tokens(self.features))


def encode_rows(path: Source, config: Any, tokenizer: Any) -> Iterator[list[Features]]:
    """A source's rows checked and tokenized a chunk at a time (yielded as they are encoded); each target is the label
    as written (one object per distinct value) until encode_label replaces it."""
    columns = [config.text_column, config.label_column] + ([config.text_pair_column] if config.text_pair_column else [])
    optional = bool(getattr(config, "teacher", None))  # with a teacher a row may have no label
    seen: dict[Any, Any] = {}
    name = str(path)

    def encode(chunk: list[Record]) -> list[Features]:
        texts = [r.values[config.text_column] for r in chunk]
        pairs = [r.values[config.text_pair_column] for r in chunk] if config.text_pair_column else None
        enc = tokenizer(texts, text_pair=pairs, truncation=True, max_length=config.max_length)
        types = enc.get("token_type_ids")
        features = []
        for i, r in enumerate(chunk):
            label = r.values.get(config.label_column)
            label = None if optional and label in (None, "") else label  # a row the teacher alone teaches
            if isinstance(label, (str, int, float)):  # keyed with its type: True == 1 and 1.0 == 1 stay apart
                label = seen.setdefault((type(label), label), label)
            features.append(Features(compact(enc["input_ids"][i]),
                                     compact(types[i], "b") if types is not None else None, label, (name, r.line)))
        return features

    chunk: list[Record] = []
    for r in iter_records(path):
        for c in columns:
            if c == config.label_column and optional and r.values.get(c) in (None, ""):
                continue
            value = field_of(r, c, path)
            if c != config.label_column and (not isinstance(value, str) or not value.strip()):
                raise DataError(f"{where(path, r.line, c)}: expected non-empty text, got {value!r}")
        chunk.append(r)
        if len(chunk) == ENCODE_ROWS:
            yield encode(chunk)
            chunk = []
    if chunk:
        yield encode(chunk)


def encoded(path: Source, config: Any, tokenizer: Any) -> Sequence[Features]:
    """A source's examples: in a list, or on disk for a large source (hfport/train/stored.py)."""
    settings = {"text": config.text_column, "pair": config.text_pair_column, "label": config.label_column,
                "max_length": config.max_length}
    if getattr(config, "teacher", None):
        settings["labels"] = "optional"
    return collect(encode_rows(path, config, tokenizer), path, tokenizer, SequenceClassification.name, settings)


class SequenceClassification(TrainTask):
    name = "text-classification"
    compute_metrics = staticmethod(metrics.compute)

    def read(self, config: Any, tokenizer: Any, model_id2label: dict[int, str] | None) -> EncodedData:
        """text (+ text_pair) and label: a name, an id, a float (regression) or a list of names (multi-label).

        Rows are encoded as they are read (ENCODE_ROWS at a time), so a large Parquet file's text is never held
        whole, and a large source's examples go to disk as they come (hfport/train/stored.py); the targets follow
        once the training labels have fixed the label space."""
        train_path, eval_path = data_sources(config)
        train = encoded(train_path, config, tokenizer)
        evaluation = encoded(eval_path, config, tokenizer) if eval_path else []
        class_names = train_path.class_names(config.label_column)
        space = teacher_label_space(config) or infer_label_space(
            RawLabels(train), train_path, config.label_column, config.problem_type, model_id2label, class_names)
        for path, features in ((train_path, train), (eval_path, evaluation)):
            # a source's ClassLabel ids are its own classes: the eval source's are found in the training labels by
            # name (its classes may be listed in another order, or be a subset)
            names = path.class_names(config.label_column) if path is not None else None
            retarget(features, lambda x, path=path, names=names: no_label(space) if x.target is None else
                     encode_label(x.target, space, path, x.source[1], config.label_column, names))
        if eval_path is None:
            train, evaluation = split_off(train, config.eval_fraction, config.seed)
        return EncodedData(train, evaluation, space, tokenizer.pad_token_id)

    def collate(self, items: list[Features], data: EncodedData, seed: int) -> dict[str, torch.Tensor]:
        batch = pad_ids(items, data.pad_token_id)
        float_targets = data.space.problem_type in ("regression", "multi_label_classification")
        batch["labels"] = torch.tensor([x.target for x in items], dtype=torch.float if float_targets else torch.long)
        return batch

    def loss(self, outputs: Any, batch: dict[str, torch.Tensor], data: EncodedData, class_weights: Any,
             label_smoothing: float) -> torch.Tensor:
        logits, labels = outputs.logits.float(), batch["labels"]  # (B, L), (B,) | (B, L)
        if data.space.problem_type == "regression":
            return F.mse_loss(logits.squeeze(-1), labels)
        if data.space.problem_type == "multi_label_classification":
            return F.binary_cross_entropy_with_logits(logits, labels)
        weight = class_weights.to(logits.device) if class_weights is not None else None
        return F.cross_entropy(logits, labels, weight=weight, label_smoothing=label_smoothing)

    def loss_options(self, data: EncodedData) -> frozenset[str]:
        if data.space.problem_type in ("regression", "multi_label_classification"):  # MSE, BCE
            return frozenset()
        return frozenset({"label_smoothing", "class_weights"})

    def loss_count(self, batch: dict[str, torch.Tensor], data: EncodedData, class_weights: Any) -> Any:
        """Examples; with class weights, the sum of the targets' weights (what the weighted mean divides by)."""
        if class_weights is None or data.space.problem_type in ("regression", "multi_label_classification"):
            return batch["labels"].shape[0]
        return class_weights.to(batch["labels"].device)[batch["labels"]].sum()  # ()

    # distillation (hfport/train/distill.py): the teacher's logits, per row

    distillable = True
    teacher_stands_in_for = ("label_column",)

    def teacher_targets(self, outputs: Any, batch: dict[str, torch.Tensor], items: list[Features],
                        data: EncodedData) -> list[np.ndarray]:
        logits = outputs.logits.float().cpu().numpy()  # (B, L)
        return list(logits)

    def distill_terms(self, outputs: Any, batch: dict[str, torch.Tensor], teacher: torch.Tensor, data: EncodedData,
                      temperature: float, companion: Any) -> tuple[torch.Tensor, torch.Tensor]:
        logits = outputs.logits.float()  # (B, L)
        per_row = SOFT_TARGETS[data.space.problem_type](logits, teacher.view_as(logits), temperature)  # (B,)
        return per_row, torch.arange(len(per_row), device=per_row.device)

    def labelled(self, batch: dict[str, torch.Tensor], data: EncodedData) -> torch.Tensor | None:
        labels = batch["labels"]  # (B,) | (B, L)
        if labels.is_floating_point():
            return ~labels.view(labels.shape[0], -1).isnan().any(-1)  # (B,)
        return labels != UNLABELLED  # (B,)

    def eval_rows(self, outputs: Any, batch: dict[str, torch.Tensor], items: list[Features],
                  data: EncodedData) -> list[Any]:
        logits = outputs.logits.float().cpu().numpy()
        labels = batch["labels"].cpu().numpy()
        return [(logits[k], labels[k]) for k in range(len(items))]

    def sample_rows(self, data: EncodedData) -> list[Any]:
        n = len(data.space.id2label)
        if data.space.problem_type == "regression":
            return [(np.array([float(k)]), float(k)) for k in range(2)]  # (1,) logits, a value
        if data.space.problem_type == "multi_label_classification":
            return [(np.eye(n)[k], np.eye(n)[k]) for k in range(n)]  # (n,) logits, multi-hot labels
        return [(np.eye(n)[k], k) for k in range(n)]  # (n,) logits, a label id

    def metrics(self, rows: list[Any], data: EncodedData, id2label: dict[int, str]) -> dict[str, float]:
        predictions, labels = np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])
        if data.space.problem_type == "regression":
            predictions = predictions.reshape(-1)  # (N, 1) logits -> (N,) values
        names = [id2label[i] for i in range(len(id2label))]
        return self.compute_metrics(data.space.problem_type, predictions=predictions, labels=labels,
                               num_labels=len(names), label_names=names)


def no_label(space: Any) -> Any:
    """The target of a row without a label (distillation: the teacher alone teaches it; the task's own loss skips
    it)."""
    if space.problem_type == "regression":
        return float("nan")
    if space.problem_type == "multi_label_classification":
        return [float("nan")] * len(space.id2label)
    return UNLABELLED
