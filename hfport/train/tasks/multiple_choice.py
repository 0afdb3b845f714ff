"""Multiple choice (SWAG-style): pick the right continuation or answer among a question's choices.

Data (JSONL, or CSV/TSV whose `choices` cell is a JSON list):
  {"context": ..., "choices": [..., ...], "label": 1}     ("question" in place of "context"; the column names are
                                                          the config's context_column / question_column,
                                                          choices_column and label_column)
The label is the index of the right choice. Every row of a file has the same number of choices: a batch is
(B, C, T). One example is one question with its choices (batch_size counts questions; the token budget reads each
example as its longest choice, as text-ranking's groups). Loss: cross-entropy over the choices. Metric: accuracy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..data import (DataError, EncodedData, Features, Record, Source, compact, data_sources, encoded_splits, field_of,
                    in_chunks, iter_records, pad_ids, where)
from ..metrics import accuracy
from ..stored import collect
from . import TrainTask

def choice_metrics(problem_type: str | None = None, *, predictions: Any = None, labels: Any = None,
                   **_: Any) -> dict[str, float]:
    """accuracy: the fraction of questions whose highest-scoring choice (predictions: (N, C) logits) is the label."""
    return {"accuracy": accuracy(predictions, labels)}


def _stem_column(record: Record, config: Any, path: Path) -> str:
    columns = [c for c in (config.context_column, config.question_column) if c in record.values]
    if len(columns) != 1:
        raise DataError(f"{where(path, record.line)}: a multiple-choice row needs one of '{config.context_column}' or "
                        f"'{config.question_column}' (the text the choices continue or answer); the row has "
                        f"{sorted(record.values)}")
    return columns[0]


def _choices(record: Record, column: str, path: Path) -> list[str]:
    value = field_of(record, column, path)
    if isinstance(value, str):  # CSV: a JSON list in the cell
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise DataError(f"{where(path, record.line, column)}: expected a JSON list of texts ({e.msg})") from e
    if not isinstance(value, list) or len(value) < 2:
        raise DataError(f"{where(path, record.line, column)}: expected a list of at least 2 texts, got {value!r}")
    for choice in value:
        if not isinstance(choice, str) or not choice.strip():
            raise DataError(f"{where(path, record.line, column)}: expected non-empty texts, got {choice!r}")
    return value


def _label(record: Record, column: str, path: Path, n_choices: int) -> int:
    value = field_of(record, column, path)
    try:
        index = int(value) if not isinstance(value, (bool, float)) else None
    except ValueError:
        index = None
    if index is None or not 0 <= index < n_choices:
        raise DataError(f"{where(path, record.line, column)}: expected the index of the right choice, "
                        f"0..{n_choices - 1}, got {value!r}")
    return index


def read_questions(path: Path, config: Any) -> Iterator[tuple[Record, str, list[str], int]]:
    """(record, stem text, choices, label) per row, streamed, every row checked; the choices' count is the file's
    first row's."""
    first: tuple[int, int] | None = None  # (line, choices) of the first row
    for r in iter_records(path):
        column = _stem_column(r, config, path)
        stem = field_of(r, column, path)
        if not isinstance(stem, str) or not stem.strip():
            raise DataError(f"{where(path, r.line, column)}: expected non-empty text, got {stem!r}")
        choices = _choices(r, config.choices_column, path)
        first = first or (r.line, len(choices))
        if len(choices) != first[1]:
            raise DataError(f"{where(path, r.line, config.choices_column)}: {len(choices)} choices, but line "
                            f"{first[0]} has {first[1]}; every row of a file needs the same number (a batch is "
                            "(B, C, T))")
        yield r, stem, choices, _label(r, config.label_column, path, len(choices))


def encode_questions(path: Path, config: Any, tokenizer: Any) -> Iterator[list[Features]]:
    """A source's questions encoded a chunk at a time (yielded as they are encoded): C rows (stem, choice) each."""
    for chunk in in_chunks(read_questions(path, config)):
        out = []
        for r, stem, choices, label in chunk:
            enc = tokenizer([stem] * len(choices), text_pair=choices, truncation=True,
                            max_length=config.max_length)  # C rows: (stem, choice)
            longest = max(enc["input_ids"], key=len)
            out.append(Features(compact(longest), None, label, (str(path), r.line),
                                {"tokens": enc["input_ids"], "types": enc.get("token_type_ids")}))
        yield out


class MultipleChoice(TrainTask):
    name = "multiple-choice"
    compute_metrics = staticmethod(choice_metrics)

    def read(self, config: Any, tokenizer: Any, model_id2label: dict[int, str] | None) -> EncodedData:
        train_path, eval_path = data_sources(config)
        settings = {"columns": [config.context_column, config.question_column, config.choices_column,
                                config.label_column],
                    "max_length": config.max_length}

        def encoded(path: Source) -> Sequence[Features]:
            return collect(encode_questions(path, config, tokenizer), path, tokenizer, self.name, settings)

        train_features, eval_features = encoded_splits(encoded, train_path, eval_path, config)
        return EncodedData(train_features, eval_features, None, tokenizer.pad_token_id)

    def collate(self, items: list[Features], data: EncodedData, seed: int) -> dict[str, torch.Tensor]:
        """Every choice row of the batch's questions padded together, then (B * C, T) -> (B, C, T); labels (B,)."""
        rows = [Features(ids, x.meta["types"][i] if x.meta["types"] is not None else None, None)
                for x in items for i, ids in enumerate(x.meta["tokens"])]
        flat = pad_ids(rows, data.pad_token_id)  # (B * C, T) each
        batch = {k: v.view(len(items), -1, v.shape[-1]) for k, v in flat.items()}  # (B, C, T)
        batch["labels"] = torch.tensor([x.target for x in items], dtype=torch.long)  # (B,)
        return batch

    def loss_options(self, data: EncodedData) -> frozenset[str]:
        return frozenset({"label_smoothing"})

    def loss(self, outputs: Any, batch: dict[str, torch.Tensor], data: EncodedData, class_weights: Any,
             label_smoothing: float) -> torch.Tensor:
        return F.cross_entropy(outputs.logits.float(), batch["labels"], label_smoothing=label_smoothing)  # (B, C)

    def eval_rows(self, outputs: Any, batch: dict[str, torch.Tensor], items: list[Features],
                  data: EncodedData) -> list[Any]:
        logits = outputs.logits.float().cpu().numpy()  # (B, C)
        labels = batch["labels"].cpu().numpy()  # (B,)
        return [(logits[k], labels[k]) for k in range(len(items))]

    def sample_rows(self, data: EncodedData) -> list[Any]:
        return [(np.zeros(2), 0)]  # (C,) logits, the right choice

    def metrics(self, rows: list[Any], data: EncodedData, id2label: dict[int, str]) -> dict[str, float]:
        return self.compute_metrics(predictions=np.stack([r[0] for r in rows]), labels=np.array([r[1] for r in rows]))
