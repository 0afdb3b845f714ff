"""Training data: reading CSV/JSONL with errors that name file, line and field; label maps; encoding;
deterministic batching and collation.

Every check runs before training starts, so a bad file costs seconds, not a half-finished run.
"""

from __future__ import annotations

import csv
import io
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from ..errors import HfportError

MAX_LINE_BYTES = 1_000_000  # a line longer than this is a broken export, not an example


class DataError(HfportError, ValueError):
    """A data file problem, located: file, line, field."""


def where(path: Path | str, line: int | None = None, column: str | None = None) -> str:
    loc = str(path)
    if line is not None:
        loc += f", line {line}"
    if column is not None:
        loc += f", field '{column}'"
    return loc


@dataclass
class Record:
    line: int  # 1-based line in the file (for CSV: the line the row starts on)
    values: dict[str, Any]


def _decoded_lines(path: Path) -> Iterator[tuple[int, str]]:
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if len(raw) > MAX_LINE_BYTES:
                raise DataError(f"{where(path, number)}: the line is {len(raw):,} bytes; the limit is "
                                f"{MAX_LINE_BYTES:,}")
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{where(path, number)}: not UTF-8 (byte {e.start}: {raw[e.start:e.start + 1]!r})"
                                ) from e


def read_records(path: str | Path) -> list[Record]:
    """Rows of a .csv/.tsv (header line first) or .jsonl/.json (one object per line) file."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    suffix = path.suffix.lower()
    records: list[Record] = []
    if suffix in (".jsonl", ".json", ".ndjson"):
        for number, text in _decoded_lines(path):
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise DataError(f"{where(path, number)}: not valid JSON ({e.msg} at column {e.colno})") from e
            if not isinstance(obj, dict):
                raise DataError(f"{where(path, number)}: expected a JSON object, got {type(obj).__name__}")
            records.append(Record(number, obj))
    elif suffix in (".csv", ".tsv"):
        lines = list(_decoded_lines(path))  # decodes (and locates bad bytes) before csv sees the text
        reader = csv.reader(io.StringIO("".join(t for _, t in lines)), delimiter="\t" if suffix == ".tsv" else ",")
        try:
            header = next(reader, None)
            if header is None:
                raise DataError(f"{path}: the file is empty")
            header = [h.strip() for h in header]
            for row in reader:
                number = reader.line_num  # the line the row ends on; rows rarely span lines
                if not row or all(not c.strip() for c in row):
                    continue
                if len(row) != len(header):
                    raise DataError(f"{where(path, number)}: {len(row)} fields, the header has {len(header)}")
                records.append(Record(number, dict(zip(header, row))))
        except csv.Error as e:
            raise DataError(f"{where(path, reader.line_num)}: {e}") from e
    else:
        raise DataError(f"{path}: unknown data format {suffix!r}; use .csv, .tsv or .jsonl")
    if not records:
        raise DataError(f"{path}: the file has no examples")
    return records


def field_of(record: Record, column: str, path: Path | str, kind: type | tuple[type, ...] | None = None) -> Any:
    if column not in record.values:
        raise DataError(f"{where(path, record.line, column)}: missing; the row has {sorted(record.values)}")
    value = record.values[column]
    if kind is not None and not isinstance(value, kind):
        raise DataError(f"{where(path, record.line, column)}: expected {getattr(kind, '__name__', kind)}, "
                        f"got {type(value).__name__} {value!r}")
    return value


# --- labels ----------------------------------------------------------------------------------------------


def _label_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "other"
    if isinstance(value, list):
        return "list"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "int" if value.is_integer() else "float"
    if isinstance(value, str):
        s = value.strip()
        try:
            int(s)
            return "int"
        except ValueError:
            try:
                float(s)
                return "float"
            except ValueError:
                return "name"
    return "other"


@dataclass
class LabelSpace:
    problem_type: str | None  # None outside sequence classification
    id2label: dict[int, str]

    @property
    def label2id(self) -> dict[str, int]:
        return {v: k for k, v in self.id2label.items()}


def infer_label_space(labels: list[tuple[Any, int]], path: Path | str, column: str,
                      problem_type: str | None, model_id2label: dict[int, str] | None) -> LabelSpace:
    """From the training labels: names (sorted), ids, floats (regression) or lists (multi-label)."""
    kinds: dict[str, int] = {}
    for value, line in labels:
        kind = _label_kind(value)
        if kind == "other":
            raise DataError(f"{where(path, line, column)}: unusable label {value!r}")
        kinds.setdefault(kind, line)
    if len(kinds) > 1 and set(kinds) != {"int", "float"}:
        (a, la), (b, lb) = list(kinds.items())[:2]
        raise DataError(f"{where(path, None, column)}: mixed label types: {a} (line {la}) and {b} (line {lb})")
    kind = "float" if "float" in kinds else next(iter(kinds))
    if problem_type == "regression" or (problem_type is None and kind == "float"):
        return LabelSpace("regression", {0: "LABEL_0"})
    if kind == "list":
        names = sorted({str(n) for value, _ in labels for n in value})
        return LabelSpace("multi_label_classification", dict(enumerate(names)))
    if kind == "int":
        ids = sorted({int(float(v)) for v, _ in labels})
        if ids[0] < 0:
            raise DataError(f"{where(path, None, column)}: label ids must be >= 0, got {ids[0]}")
        n = ids[-1] + 1
        names = (model_id2label if model_id2label and len(model_id2label) == n
                 and any(v != f"LABEL_{k}" for k, v in model_id2label.items()) else {i: str(i) for i in range(n)})
        return LabelSpace(problem_type or "single_label_classification", dict(names))
    names = sorted({str(v).strip() for v, _ in labels})
    return LabelSpace(problem_type or "single_label_classification", dict(enumerate(names)))


def encode_label(value: Any, space: LabelSpace, path: Path | str, line: int, column: str) -> Any:
    if space.problem_type == "regression":
        try:
            return float(value)
        except (TypeError, ValueError):
            raise DataError(f"{where(path, line, column)}: regression label must be a number, got {value!r}")
    label2id = space.label2id
    if space.problem_type == "multi_label_classification":
        if not isinstance(value, list):
            raise DataError(f"{where(path, line, column)}: multi-label rows need a list of names, got {value!r}")
        vec = [0.0] * len(label2id)
        for name in value:
            if str(name) not in label2id:
                raise DataError(f"{where(path, line, column)}: unknown label {name!r}; known: {sorted(label2id)}")
            vec[label2id[str(name)]] = 1.0
        return vec
    if _label_kind(value) == "int" and str(int(float(value))) not in label2id:
        i = int(float(value))
        if not 0 <= i < len(space.id2label):
            raise DataError(f"{where(path, line, column)}: label id {i} is outside 0..{len(space.id2label) - 1}")
        return i
    name = str(value).strip()
    if name not in label2id:
        raise DataError(f"{where(path, line, column)}: unknown label {value!r}; known: {sorted(label2id)}")
    return label2id[name]


# --- encoded datasets and batching -------------------------------------------------------------------------


@dataclass
class Features:
    """One encoded example: token ids (+ type ids) and its target."""

    input_ids: list[int]
    token_type_ids: list[int] | None
    target: Any
    source: tuple[str, int] = ("", 0)  # file, line
    meta: dict[str, Any] = field(default_factory=dict)  # what evaluation needs besides the target (offsets...)


@dataclass
class EncodedData:
    train: list[Features]
    eval: list[Features]
    space: LabelSpace | None
    pad_token_id: int
    extra: dict[str, Any] = field(default_factory=dict)


def split_off(items: list[Features], fraction: float, seed: int) -> tuple[list[Features], list[Features]]:
    """A seeded held-out fraction (at least one example when fraction > 0)."""
    if fraction <= 0:
        return items, []
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    n_eval = max(1, round(len(items) * fraction))
    held = set(order[:n_eval])
    return [x for i, x in enumerate(items) if i not in held], [items[i] for i in sorted(held)]


def epoch_batches(n: int, batch_size: int, seed: int, epoch: int, shuffle: bool = True) -> list[list[int]]:
    """Global batches of example indices for one epoch. Seeded by (seed, epoch) alone, so a resumed run
    rebuilds exactly the order it was interrupted in without any saved RNG."""
    order = list(range(n))
    if shuffle:
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return [order[i:i + batch_size] for i in range(0, n, batch_size)]


def pad_ids(items: list[Features], pad_token_id: int) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask (and token_type_ids) padded to the longest example in the batch."""
    t = max(len(x.input_ids) for x in items)
    b = len(items)
    ids = torch.full((b, t), pad_token_id, dtype=torch.long)  # (B, T)
    mask = torch.zeros(b, t, dtype=torch.long)  # (B, T)
    types = torch.zeros(b, t, dtype=torch.long) if items[0].token_type_ids is not None else None
    for i, x in enumerate(items):
        n = len(x.input_ids)
        ids[i, :n] = torch.tensor(x.input_ids)
        mask[i, :n] = 1
        if types is not None:
            types[i, :n] = torch.tensor(x.token_type_ids)
    batch = {"input_ids": ids, "attention_mask": mask}
    if types is not None:
        batch["token_type_ids"] = types
    return batch


def steps_per_epoch(n_examples: int, global_batch: int, grad_accum: int) -> int:
    return math.ceil(math.ceil(n_examples / global_batch) / grad_accum)
