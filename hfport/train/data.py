"""Training data: the rows of a data source (hfport/formats/tables.py reads CSV, JSONL, Parquet, Arrow and datasets
folders) with errors that name file, split, line or row, and field; label maps; encoding; deterministic batching and
collation.

Every check runs before training starts, so a bad file costs seconds, not a half-finished run.

Encoded examples are a sequence of Features: a list, or for a large source a StoredExamples over an encoded-examples
store on disk (hfport/train/stored.py). What reads them here (example_lengths, split_off, retarget, without_tokens)
takes either, so batching, shuffling and resume do not ask which.
"""

from __future__ import annotations

import hashlib
import math
import random
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from ..formats.tables import DataError, Record, Source, where


def source(given: str | Path | Source, split: str = "train", split_option: str = "train_split") -> Source:
    """The data source a path names (a file, a glob of Parquet/Arrow files, a datasets folder and its split)."""
    return given if isinstance(given, Source) else Source(given, split, split_option)


def data_sources(config: Any) -> tuple[Source, Source | None]:
    """(train, eval) sources of a run's config: its `train`/`eval` paths, a datasets folder's split named by
    train_split/eval_split."""
    train = Source(config.train, config.train_split, "train_split (--train-split)")
    evaluation = Source(config.eval, config.eval_split, "eval_split (--eval-split)") if config.eval else None
    return train, evaluation


def iter_records(path: str | Path | Source) -> Iterator[Record]:
    """The rows of a data source, streamed (a Parquet/Arrow file a batch at a time); an empty source is an error
    once the stream ends."""
    data = source(path)
    empty = True
    for record in data.records():
        empty = False
        yield record
    if empty:
        raise DataError(f"{data}: the file has no examples")


ENCODE_ROWS = 1024  # rows read, checked and tokenized together by a task's reader: the text held at once


def in_chunks(items: Iterable[Any], size: int = ENCODE_ROWS) -> Iterator[list[Any]]:
    """ITEMS as consecutive lists of SIZE (the last shorter), read lazily: how a reader encodes a chunk at a time."""
    chunk: list[Any] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def text_id(text: str) -> int:
    """A text's number: the same for the same text anywhere in the data (a sentence-embedding batch encodes each
    distinct text once; a ranking query's rows are gathered by it), found without holding every text. 63 bits of its
    hash: a collision needs ~3e9 distinct texts for even odds."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def read_records(path: str | Path | Source) -> list[Record]:
    """Every row of a data source (see hfport/formats/tables.py for the kinds), in order."""
    return list(iter_records(path))


def field_of(record: Record, column: str, path: Path | str, kind: type | tuple[type, ...] | None = None) -> Any:
    if column not in record.values:
        raise DataError(f"{where(path, record.line, column)}: missing; the row has {sorted(record.values)}")
    value = record.values[column]
    if kind is not None and not isinstance(value, kind):
        raise DataError(f"{where(path, record.line, column)}: expected {getattr(kind, '__name__', kind)}, "
                        f"got {type(value).__name__} {value!r}")
    return value


# --- labels ----------------------------------------------------------------------------------------------


def _not_finite(value: Any) -> bool:
    """A number (or a number's text: CSV's "nan", "inf") that is NaN or infinite: no target a model can learn."""
    if isinstance(value, bool):
        return False
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            return False
    return isinstance(value, float) and not math.isfinite(value)


def check_label(value: Any, path: Path | str, line: int, column: str) -> None:
    """Refuses a label no model can learn, naming file, line (row) and field: NaN or infinite (a CSV "nan", JSON's
    NaN/Infinity, a Parquet float NaN), blank (an empty CSV cell would be a class named ''), or a list (multi-label)
    holding one of those or a null."""
    problem = None
    if _not_finite(value):
        problem = f"{value!r} is not a finite number (NaN or infinite)"
    elif isinstance(value, str) and not value.strip():
        problem = f"the label is blank ({value!r})"
    elif isinstance(value, list):
        for k, name in enumerate(value):
            if name is None or isinstance(name, (bool, float)) or _not_finite(name) \
                    or (isinstance(name, str) and not name.strip()):
                problem = f"item {k} of the list, {name!r}, is not a label name or id"
                break
    if problem:
        raise DataError(f"{where(path, line, column)}: {problem}; every row needs a label (a name, an id, a number or "
                        "a list of names): fix the row or drop it before training")


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


def infer_label_space(labels: Iterable[tuple[Any, int]], path: Path | str, column: str,
                      problem_type: str | None, model_id2label: dict[int, str] | None,
                      class_names: list[str] | None = None) -> LabelSpace:
    """From the training labels, (value, line) pairs iterated more than once: names (sorted), ids, floats
    (regression) or lists (multi-label). Ids are named by `class_names` when the data has them (a datasets
    ClassLabel column, or a sequence of them for multi-label: every class, also those the training rows never use),
    else by the model's labels when it has as many non-default ones."""
    kinds: dict[str, int] = {}
    for value, line in labels:
        check_label(value, path, line, column)
        kind = _label_kind(value)
        if kind == "other":
            raise DataError(f"{where(path, line, column)}: unusable label {value!r}")
        kinds.setdefault(kind, line)
    if len(kinds) > 1 and set(kinds) != {"int", "float"}:
        (a, la), (b, lb) = list(kinds.items())[:2]
        raise DataError(f"{where(path, None, column)}: mixed label types: {a} ({where(path, la)}) and {b} "
                        f"({where(path, lb)})")
    kind = "float" if "float" in kinds else next(iter(kinds))
    if problem_type == "regression" or (problem_type is None and kind == "float"):
        return LabelSpace("regression", {0: "LABEL_0"})
    if kind == "list":
        if class_names:  # ids of a sequence of ClassLabels (encode_label names each by class_names)
            return LabelSpace("multi_label_classification", dict(enumerate(class_names)))
        names = sorted({str(n) for value, _ in labels for n in value})
        return LabelSpace("multi_label_classification", dict(enumerate(names)))
    if kind == "int":
        ids = sorted({int(float(v)) for v, _ in labels})
        if ids[0] < 0:
            raise DataError(f"{where(path, None, column)}: label ids must be >= 0, got {ids[0]}")
        if class_names:
            if ids[-1] >= len(class_names):
                raise DataError(f"{where(path, None, column)}: label id {ids[-1]} is outside the column's "
                                f"{len(class_names)} class names {class_names}")
            return LabelSpace(problem_type or "single_label_classification", dict(enumerate(class_names)))
        n = ids[-1] + 1
        names = (model_id2label if model_id2label and len(model_id2label) == n
                 and any(v != f"LABEL_{k}" for k, v in model_id2label.items()) else {i: str(i) for i in range(n)})
        return LabelSpace(problem_type or "single_label_classification", dict(names))
    names = sorted({str(v).strip() for v, _ in labels})
    return LabelSpace(problem_type or "single_label_classification", dict(enumerate(names)))


def class_name(value: Any, names: list[str], path: Path | str, line: int, column: str) -> str:
    """A ClassLabel column's id as its class name (`names`: the column's, as the source's own features list them)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < len(names):
        raise DataError(f"{where(path, line, column)}: {value!r} is not an id of the column's ClassLabel, "
                        f"0..{len(names) - 1} ({names})")
    return names[value]


def encode_label(value: Any, space: LabelSpace, path: Path | str, line: int, column: str,
                 class_names: list[str] | None = None) -> Any:
    """A row's label as its target in `space`. With `class_names` (the source's own ClassLabel names: a datasets
    folder, Parquet or Arrow written by datasets) an id is read as that source's class and found in `space` by name,
    so a source whose classes are in another order (an eval split saved on its own) keeps its labels; a name `space`
    does not have is an error."""
    check_label(value, path, line, column)
    if space.problem_type == "regression":
        try:
            return float(value)
        except (TypeError, ValueError):
            raise DataError(f"{where(path, line, column)}: regression label must be a number, got {value!r}")
    label2id = space.label2id
    if class_names is not None:
        names = [class_name(v, class_names, path, line, column) for v in value] if isinstance(value, list) \
            else [class_name(value, class_names, path, line, column)]
        for name in names:
            if name not in label2id:
                raise DataError(f"{where(path, line, column)}: class {name!r} (its ClassLabel id {value!r}) is not "
                                f"one of the training labels {sorted(label2id)}")
        if space.problem_type != "multi_label_classification":
            return label2id[names[0]]
        vec = [0.0] * len(label2id)
        for name in names:
            vec[label2id[name]] = 1.0
        return vec
    if space.problem_type == "multi_label_classification":
        if not isinstance(value, list):
            raise DataError(f"{where(path, line, column)}: multi-label rows need a list of names, got {value!r}")
        vec = [0.0] * len(label2id)
        for name in value:
            if str(name) not in label2id:
                raise DataError(f"{where(path, line, column)}: unknown label {name!r}; known: {sorted(label2id)}")
            vec[label2id[str(name)]] = 1.0
        return vec
    # a number is an id (its class may be named "1", as a ClassLabel of star ratings is); a digit string is a name
    # when one is called that
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if _label_kind(value) == "int" and (number or str(int(float(value))) not in label2id):
        i = int(float(value))
        if not 0 <= i < len(space.id2label):
            raise DataError(f"{where(path, line, column)}: label id {i} is outside 0..{len(space.id2label) - 1}")
        return i
    name = str(value).strip()
    if name not in label2id:
        raise DataError(f"{where(path, line, column)}: unknown label {value!r}; known: {sorted(label2id)}")
    return label2id[name]


# --- encoded datasets and batching -------------------------------------------------------------------------


def compact(ids: Sequence[int], typecode: str = "i") -> Sequence[int]:
    """Token ids as an array of 4-byte ints ("i"; token type ids: 1-byte "b"): a list costs an 8-byte pointer an id
    plus a 28-byte object for every id over 256, so a large dataset's encoded ids take several times the memory.
    pad_ids and len() read either."""
    return array(typecode, ids)


@dataclass
class Features:
    """One encoded example: token ids (+ type ids) and its target."""

    input_ids: Sequence[int]  # a list, or compact()'s array
    token_type_ids: Sequence[int] | None
    target: Any
    source: tuple[str, int] = ("", 0)  # file, line
    meta: dict[str, Any] = field(default_factory=dict)  # what evaluation needs besides the target (offsets...)


@dataclass
class EncodedData:
    train: Sequence[Features]  # a list, or examples on disk (hfport/train/stored.py) for a large source
    eval: Sequence[Features]
    space: LabelSpace | None
    pad_token_id: int
    extra: dict[str, Any] = field(default_factory=dict)
    # the kind of problem where there is no label space (sentence embeddings: "pairs" or "scored-pairs"): it picks
    # the default metric from the task's record as a label space's problem_type does
    problem_type: str | None = None


def encoded_splits(encoded: Callable[[Any], Sequence[Features]], train: Any, evaluation: Any | None,
                   config: Any) -> tuple[Sequence[Features], Sequence[Features]]:
    """(train, eval) examples: `encoded` of each source, or, with no eval source, a held-out fraction of train's."""
    train_features = encoded(train)
    if evaluation is None:
        return split_off(train_features, config.eval_fraction, config.seed)
    return train_features, encoded(evaluation)


def split_off(items: Sequence[Features], fraction: float, seed: int) -> tuple[Sequence[Features], Sequence[Features]]:
    """A seeded held-out fraction (at least one example when fraction > 0). Examples on disk (a store's `select`)
    are split by a numpy permutation into two views, so no per-example Python object is made (their held-out rows
    are not the ones a list of the same examples gives)."""
    if fraction <= 0:
        return items, []
    if not isinstance(items, list):
        order = np.random.default_rng(seed).permutation(len(items))
        n_eval = max(1, round(len(items) * fraction))
        return items.select(np.sort(order[n_eval:])), items.select(np.sort(order[:n_eval]))  # type: ignore[attr-defined]
    held = held_out(len(items), fraction, seed)
    return [x for i, x in enumerate(items) if i not in held], [items[i] for i in sorted(held)]


def held_out(n: int, fraction: float, seed: int) -> set[int]:
    """The positions split_off holds out of N examples in a list (at least one when fraction > 0): a reader that
    streams its examples picks the same ones from their count alone."""
    if fraction <= 0:
        return set()
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return set(order[:max(1, round(n * fraction))])


def example_lengths(examples: Sequence[Features]) -> Sequence[int]:
    """Tokens per example: a store's from its offsets (no example read), a list's from its examples."""
    lengths = getattr(examples, "lengths", None)
    return lengths if lengths is not None else [len(x.input_ids) for x in examples]


def without_tokens(examples: Sequence[Features]) -> Iterable[Features]:
    """The examples in order for a pass that reads only targets, sources and meta: a list as it is, a store's
    records alone (its tokens left on disk)."""
    return examples if isinstance(examples, list) else examples.without_tokens()  # type: ignore[attr-defined]


def retarget(examples: Sequence[Features], encode: Callable[[Features], Any]) -> None:
    """Every example's target replaced by encode(example): in place in a list, as one array in a store (whose ENCODE
    sees no tokens: see without_tokens)."""
    if isinstance(examples, list):
        for x in examples:
            x.target = encode(x)
    else:
        examples.retarget(encode)  # type: ignore[attr-defined]


def number_in_range(r: Record, column: str, path: Path, score_range: tuple[float, float], what: str) -> float:
    """Row R's COLUMN as a number within score_range (the number is called WHAT in the error)."""
    value = field_of(r, column, path)
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise DataError(f"{where(path, r.line, column)}: expected a number, got {value!r}")
    if not math.isfinite(number):  # CSV "nan", JSON NaN/Infinity, a Parquet float NaN
        raise DataError(f"{where(path, r.line, column)}: {what} {value!r} is not a finite number (NaN or infinite); "
                        "fix the row or drop it before training")
    low, high = score_range
    if not low <= number <= high or number != number:
        raise DataError(f"{where(path, r.line, column)}: {what} {number} is outside score_range [{low}, {high}]; "
                        "set score_range to the data's scale")
    return number

MEGA_BUCKET_STEPS = 50  # optimizer steps' worth of examples sorted together: long enough that neighbours in
#                          length are close, short enough that every part of the shuffled epoch mixes in


class Batches(Sequence[np.ndarray]):
    """An epoch's global batches as two arrays, the epoch's example order (int32) and where each batch starts in it:
    4 bytes an example and 8 a batch, where a list of lists of ints held ~43. Batch b is order[starts[b]:starts[b+1]]
    (a view); a slice is a list of them; equal to another Batches or a list of lists with the same indices."""

    def __init__(self, order: np.ndarray, starts: np.ndarray):
        self.order, self.starts = order, starts

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, b: Any) -> Any:
        if isinstance(b, slice):
            return [self[k] for k in range(*b.indices(len(self)))]
        b = range(len(self))[b]  # an IndexError past the end; negative from the end
        end = self.starts[b + 1] if b + 1 < len(self) else len(self.order)
        return self.order[self.starts[b]:end]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or len(other) != len(self):
            return False
        return all(list(a) == list(b) for a, b in zip(self, other))


def _shuffled(n: int, rng: random.Random, shuffle: bool) -> np.ndarray:
    """0..n-1, shuffled by RNG as random.shuffle shuffles a list (the same swaps, on a 4-byte array)."""
    order = array("i" if n < 2**31 else "q", range(n))
    if shuffle:
        rng.shuffle(order)  # type: ignore[arg-type]
    return np.frombuffer(order, dtype=np.int32 if order.typecode == "i" else np.int64)


def epoch_batches(lengths: Sequence[int], batch_size: int, seed: int, epoch: int, *, shuffle: bool = True,
                  group_by_length: bool = False, max_tokens: int | None = None, world: int = 1,
                  grad_accum: int = 1) -> Batches:
    """Global batches of example indices for one epoch; process r trains on `batch[r::world]`.

    A pure function of (seed, epoch, lengths and the sizes), so every process builds the same batches (and takes
    the same number of steps) and a resumed run rebuilds the order it was interrupted in without saved RNG.

    `batch_size` and `max_tokens` are per process: a global batch holds at most batch_size * world examples,
    and with a budget each process's padded share, ceil(n / world) x the batch's longest length, stays within
    max_tokens. A global batch has at least `world` examples so no process is handed nothing: one example
    over the budget still forms a batch (one per process), and an epoch's (or length group's) last few
    examples, fewer than `world`, join the batch before them (at most one extra example per process).

    group_by_length: shuffle, cut into mega-buckets of MEGA_BUCKET_STEPS steps' worth of examples, sort each
    by length, cut into batches, then shuffle the order of the steps but the last (runs of grad_accum batches,
    so that accumulating k batches sees what one batch k times larger would). Without it: shuffle, then cut.
    The batches are arrays (Batches); their order is the one lists of lists had, draw for draw.
    """
    rng = random.Random(seed * 1_000_003 + epoch)
    order = _shuffled(len(lengths), rng, shuffle)
    if not group_by_length:
        return Batches(order, np.asarray(_starts(order, lengths, batch_size, max_tokens, world), dtype=np.int64))
    mega = MEGA_BUCKET_STEPS * batch_size * world * grad_accum
    starts = list(range(0, len(order), mega))
    if len(starts) > 1 and len(order) - starts[-1] < world:
        starts.pop()  # a last bucket too small to give every process an example joins the one before
    ends = starts[1:] + [len(order)]
    every = np.asarray(lengths)
    spans: list[tuple[int, int]] = []  # each batch's (start, end) in the sorted order
    for start, end in zip(starts, ends):
        bucket = order[start:end]
        order[start:end] = bucket[np.argsort(every[bucket], kind="stable")]  # stable: ties keep the shuffled order
        cuts = [start + k for k in _starts(order[start:end], lengths, batch_size, max_tokens, world)] + [end]
        spans += zip(cuts[:-1], cuts[1:])
    if not spans:
        return Batches(order, np.zeros(0, dtype=np.int64))
    steps = list(range(0, len(spans), grad_accum))  # each step's first batch
    # the last step (where a short batch or a short run of batches ends up) stays last: the loop's runs of
    # grad_accum batches then line up with steps, and the order does not depend on how the work is split
    last = steps.pop()
    if shuffle:
        rng.shuffle(steps)  # the same draws as shuffling the steps themselves: shuffle reads only the length
    runs = [spans[k:k + grad_accum] for k in steps + [last]]
    pieces = [order[a:b] for run in runs for a, b in run]
    sizes = np.fromiter((b - a for run in runs for a, b in run), dtype=np.int64, count=len(spans))
    return Batches(np.concatenate(pieces), np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64))


def _starts(order: np.ndarray, lengths: Sequence[int], batch_size: int, max_tokens: int | None,
            world: int) -> list[int]:
    """Where each batch starts in `order`: consecutive runs, each as large as batch_size and the token budget allow
    (see epoch_batches). A batch the budget closes keeps a multiple of `world` examples (the rest start the next
    one), so every process gets the same number and the processes' mean gradient is the batch's; fewer than `world`
    left at the end join the last batch."""
    starts: list[int] = []
    start = longest = 0
    for position, i in enumerate(order.tolist() if max_tokens is not None else ()):
        size, t = position - start, max(longest, lengths[i])
        full = size >= batch_size * world or math.ceil((size + 1) / world) * t > max_tokens  # type: ignore[operator]
        if full and size >= world:
            starts.append(start)
            start += size - size % world
            longest = max((lengths[j] for j in order[start:position].tolist()), default=0)
        longest = max(longest, lengths[i])
    if max_tokens is None:  # without a budget every batch is batch_size * world long, but the last
        starts = list(range(0, len(order) - len(order) % (batch_size * world), batch_size * world))
        start = starts[-1] + batch_size * world if starts else 0
    if len(order) - start >= world or (not starts and len(order) > start):
        starts.append(start)  # (fewer than world left join the last batch: no start of their own)
    return starts


def eval_batches(indices: list[int], lengths: Sequence[int], batch_size: int, max_tokens: int | None,
                 group_by_length: bool) -> list[list[int]]:
    """One process's evaluation batches over `indices`; sorted by length when grouping, so little padding
    is computed. Results carry their example index and are put back in file order before the metrics."""
    order = np.asarray(sorted(indices, key=lengths.__getitem__) if group_by_length else list(indices), dtype=np.int64)
    cuts = _starts(order, lengths, batch_size, max_tokens, world=1) + [len(order)]
    return [order[a:b].tolist() for a, b in zip(cuts[:-1], cuts[1:])]


def planned_steps(epochs: float, steps_in_epoch: Callable[[int], int]) -> int:
    """Optimizer steps in `epochs` (fractional: a part of the next epoch). Per epoch, because under a token
    budget the number of batches depends on how the epoch's shuffle fell."""
    whole = int(epochs)
    total = sum(steps_in_epoch(e) for e in range(whole))
    if epochs > whole:
        total += math.ceil((epochs - whole) * steps_in_epoch(whole))
    return total


def padding_fraction(batches: list[list[int]], lengths: list[int], world: int = 1) -> float:
    """Share of the computed (padded) tokens that are padding, each process padding its own share."""
    real = padded = 0
    for batch in batches:
        for r in range(world):
            share = [lengths[i] for i in batch[r::world]]
            if share:
                real += sum(share)
                padded += len(share) * max(share)
    return 1.0 - real / padded if padded else 0.0


def pad_ids(items: list[Features], pad_token_id: int) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask (and token_type_ids) padded to the longest example in the batch. Padded as lists and
    made into one tensor each (a slice assignment per row took 4x as long: 0.31 against 0.08 ms for 16 rows)."""
    lengths = [len(x.input_ids) for x in items]
    t = max(lengths)
    rows = zip(items, lengths)
    ids = torch.tensor([[*x.input_ids, *[pad_token_id] * (t - n)] for x, n in rows], dtype=torch.long)  # (B, T)
    mask = (torch.arange(t) < torch.tensor(lengths)[:, None]).long()  # (B, T)
    types = None
    if items[0].token_type_ids is not None:
        rows = zip(items, lengths)
        types = torch.tensor([[*x.token_type_ids, *[0] * (t - n)] for x, n in rows], dtype=torch.long)  # (B, T)
    batch = {"input_ids": ids, "attention_mask": mask}
    if types is not None:
        batch["token_type_ids"] = types
    return batch
