"""Sequence classification: single-label, multi-label and regression."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..data import (DataError, EncodedData, Features, Record, encode_label, field_of, infer_label_space, pad_ids,
                    read_records, split_off, where)
from ..metrics import classification as metrics
from . import TrainTask


class SequenceClassification(TrainTask):
    name = "text-classification"
    compute_metrics = staticmethod(metrics.compute)

    def read(self, config: Any, tokenizer: Any, model_id2label: dict[int, str] | None) -> EncodedData:
        """text (+ text_pair) and label: a name, an id, a float (regression) or a list of names (multi-label)."""
        train_path = Path(config.train)
        train_records = read_records(train_path)
        eval_path = Path(config.eval) if config.eval else None
        eval_records = read_records(eval_path) if eval_path else []
        columns = [config.text_column, config.label_column] + (
            [config.text_pair_column] if config.text_pair_column else [])
        for path, records in ((train_path, train_records), (eval_path, eval_records)):
            for r in records:
                for c in columns:
                    value = field_of(r, c, path)
                    if c != config.label_column and (not isinstance(value, str) or not value.strip()):
                        raise DataError(f"{where(path, r.line, c)}: expected non-empty text, got {value!r}")
        space = infer_label_space([(r.values[config.label_column], r.line) for r in train_records], train_path,
                                  config.label_column, config.problem_type, model_id2label)

        def encode(path: Path, records: list[Record]) -> list[Features]:
            targets = [encode_label(r.values[config.label_column], space, path, r.line, config.label_column)
                       for r in records]
            texts = [r.values[config.text_column] for r in records]
            pairs = [r.values[config.text_pair_column] for r in records] if config.text_pair_column else None
            enc = tokenizer(texts, text_pair=pairs, truncation=True, max_length=config.max_length)
            types = enc.get("token_type_ids")
            return [Features(enc["input_ids"][i], types[i] if types is not None else None, targets[i],
                             (str(path), r.line)) for i, r in enumerate(records)]

        train = encode(train_path, train_records)
        if eval_path is not None:
            evaluation = encode(eval_path, eval_records)
        else:
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

    def loss_count(self, batch: dict[str, torch.Tensor], data: EncodedData, class_weights: Any) -> Any:
        """Examples; with class weights, the sum of the targets' weights (what the weighted mean divides by)."""
        if class_weights is None or data.space.problem_type in ("regression", "multi_label_classification"):
            return batch["labels"].shape[0]
        return class_weights.to(batch["labels"].device)[batch["labels"]].sum()  # ()

    def eval_rows(self, outputs: Any, batch: dict[str, torch.Tensor], items: list[Features],
                  data: EncodedData) -> list[Any]:
        logits = outputs.logits.float().cpu().numpy()
        labels = batch["labels"].cpu().numpy()
        return [(logits[k], labels[k]) for k in range(len(items))]

    def metrics(self, rows: list[Any], data: EncodedData, id2label: dict[int, str]) -> dict[str, float]:
        predictions, labels = np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])
        if data.space.problem_type == "regression":
            predictions = predictions.reshape(-1)  # (N, 1) logits -> (N,) values
        names = [id2label[i] for i in range(len(id2label))]
        return self.compute_metrics(data.space.problem_type, predictions=predictions, labels=labels,
                               num_labels=len(names), label_names=names)

