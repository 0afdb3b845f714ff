"""Encoded examples on disk: a large source's Features written to an encoded-examples store
(hfport/formats/encoded.py) as they are encoded, and read back one example at a time while training.

A task's reader yields its Features a chunk at a time; `collect` keeps them in a list when the source is small and
writes them to a store when its files hold STREAM_BYTES or more, so memory does not grow with the file: what stays per
example is its length (int32) and, once the label space is known, its target.
The store lives in hfport's cache dir (the setting cache_dir: `$HFPORT_CACHE_DIR/encoded/`, as hardware.json) under
a hash of what the encoding depends on: the source files' paths, sizes, modification times and a sampled hash of
their content (Source.fingerprint), the tokenizer, the task and its settings. A later run on the same data reuses
it; a change to any of those encodes again. Processes that read the same source at once (the ranks of `accelerate
launch`) share one store: the first writes it, the others wait for it and open it (hfport/formats/encoded.py's
locks). After a store is written, the least recently used others are evicted while the stores hold more than the
setting store_max_bytes ($HFPORT_STORE_MAX_BYTES), never one a running process has open.

`StoredExamples` is a map-style sequence of Features like the list it replaces: the loop indexes it, `len()` counts
it, iteration streams it in order, `lengths` gives every example's token count without reading the tokens, and
`select` is a view (a held-out split).
"""

from __future__ import annotations

import hashlib
import itertools
import json
from array import array
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from ..formats.encoded import JSON, Store, StoreBusy, evict, open_or_write, write_store
from ..formats.tables import Source
from ..hardware import cache_path
from ..settings import settings as library_settings
from .data import Features

# A source this large (its files' bytes) is encoded into a store: below it, the examples fit in memory as a list
# (~800 B each at typical lengths). A module constant, not a setting: scripts/bench_data_rss.py compares both paths
# on one file by setting it (--stream-bytes), and the tests force the store path with 0.
STREAM_BYTES = 256 * 2**20
# How long a process waits for another that is writing the same store (a rank of a multi-process launch): long enough
# to encode tens of GB of text at a few MB/s on one core, short enough that a stuck writer fails the job the same day
STORE_WAIT_S = 2 * 3600
_ARRAYS = {"int32": "i", "uint16": "H", "int8": "b"}  # store dtype -> array typecode (what compact() makes)
_EMPTY = np.zeros(0, np.int32)


def source_bytes(source: Source) -> int:
    return sum(f.stat().st_size for f in source.files)


def is_large(source: Source) -> bool:
    """Whether SOURCE's examples go to a store (and what a reader gathers on the way waits on disk too)."""
    return source_bytes(source) >= STREAM_BYTES


def store_key(source: Source, tokenizer: Any, task: str, settings: dict[str, Any]) -> str:
    """A hash of everything the encoded examples depend on."""
    files = source.fingerprint()  # path, size, time and a sampled hash of the content: an in-place rewrite shows
    text = json.dumps({"files": files, "split": source.split, "tokenizer": tokenizer_digest(tokenizer), "task": task,
                       "settings": settings}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def tokenizer_digest(tokenizer: Any) -> str:
    """A hash of how a tokenizer encodes: its backend's JSON without the truncation and padding a call last
    configured (they are call settings; the encode settings are keyed on their own)."""
    backend = {k: v for k, v in json.loads(tokenizer.backend_tokenizer.to_str()).items()
               if k not in ("truncation", "padding")}
    return hashlib.sha256(json.dumps(backend, sort_keys=True).encode()).hexdigest()


def store_folder(key: str) -> Path:
    return cache_path().parent / "encoded" / key[:32]


class StoredExamples(Sequence[Features]):
    """Features read from a store: example i with positioned reads, targets from `targets` once set."""

    def __init__(self, store: Store, index: np.ndarray | None = None, targets: np.ndarray | None = None):
        self.store, self.index, self.targets = store, index, targets
        self.name = store.extra["source"]

    def __len__(self) -> int:
        return len(self.index) if self.index is not None else len(self.store)

    def _features(self, row: dict[str, Any], target: Any) -> Features:
        ids = array(_ARRAYS[self.store.fields["input_ids"]], row["input_ids"].tobytes())
        types = array("b", row["token_type_ids"].tobytes()) if "token_type_ids" in row else None
        record = row["record"]
        return Features(ids, types, record["t"] if target is None else target, (self.name, record["l"]),
                        record["m"])

    def _target(self, i: int) -> Any:
        return None if self.targets is None else self.targets[i].tolist()

    def __getitem__(self, i: int) -> Features:  # type: ignore[override]
        if not -len(self) <= i < len(self):
            raise IndexError(f"example {i} of {len(self)}")
        i %= len(self)
        row = int(self.index[i]) if self.index is not None else i
        return self._features(self.store.row(row), self._target(row))

    def __iter__(self) -> Iterator[Features]:
        """Every example in order; without a view, read field by field a chunk at a time (no read per example)."""
        if self.index is not None:
            yield from (self[i] for i in range(len(self)))
            return
        fields = list(self.store.fields)
        for i, values in enumerate(zip(*(self.store.values(f) for f in fields))):
            yield self._features(dict(zip(fields, values)), self._target(i))

    def without_tokens(self) -> Iterator[Features]:
        """Every example in order with its target, source and meta but no tokens (empty ids): only the records are
        read, for passes over the labels."""
        if self.index is not None:
            yield from self
            return
        for i, record in enumerate(self.store.values("record")):
            yield self._features({"input_ids": _EMPTY, "record": record}, self._target(i))

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per example (int32), from the offsets alone."""
        every = self.store.lengths("input_ids")
        return every[self.index] if self.index is not None else every

    def select(self, rows: Sequence[int]) -> StoredExamples:
        """A view of these examples (positions in this sequence), in the order given."""
        rows = np.asarray(rows, dtype=np.int64)
        return StoredExamples(self.store, self.index[rows] if self.index is not None else rows, self.targets)

    def retarget(self, encode: Callable[[Features], Any]) -> None:
        """Every example's target replaced by encode(example), kept as one array (a row per example). ENCODE sees the
        example's target, source and meta, not its tokens (`without_tokens`)."""
        if self.index is not None:
            raise ValueError("retarget the whole store, before taking views of it")
        chunks, chunk = [], []
        for x in self.without_tokens():
            chunk.append(encode(x))
            if len(chunk) == 65_536:
                chunks.append(np.asarray(chunk))
                chunk = []
        if chunk:  # an empty array is float64: left out, it cannot turn integer targets into floats
            chunks.append(np.asarray(chunk))
        self.targets = np.concatenate(chunks) if chunks else None


def _fields(first: Features, vocab: int) -> dict[str, str]:
    fields = {"input_ids": "uint16" if vocab <= 2**16 else "int32"}  # half the bytes for most vocabularies
    if first.token_type_ids is not None:
        fields["token_type_ids"] = "int8"
    fields["record"] = JSON
    return fields


def _rows(chunks: Iterable[list[Features]]) -> Iterator[list[dict[str, Any]]]:
    """Each chunk's Features as the store's rows: the ids, the type ids and a JSON record of the rest."""
    for chunk in chunks:
        yield [{"input_ids": x.input_ids, "token_type_ids": x.token_type_ids,
                "record": {"t": x.target, "l": x.source[1], "m": x.meta}} for x in chunk]


def collect(chunks: Iterable[list[Features]], source: Source, tokenizer: Any, task: str,
            settings: dict[str, Any]) -> list[Features] | StoredExamples:
    """The encoded examples of SOURCE, from its reader's chunks: a list for a small source, a store (reused when one
    was written for the same data, tokenizer and settings, by an earlier run or another process of this one) for a
    large one."""
    if not is_large(source):
        return [x for chunk in chunks for x in chunk]
    key = store_key(source, tokenizer, task, settings)
    folder = store_folder(key)

    def write():
        it = iter(chunks)
        first = next(it, [])
        fields = _fields(first[0], len(tokenizer)) if first else {"input_ids": "int32", "record": JSON}
        return write_store(folder, fields, _rows(itertools.chain([first], it)), key,
                           lambda: {"source": str(source), "starts": source.starts})

    try:
        store, wrote = open_or_write(folder, key, write, STORE_WAIT_S)
    except StoreBusy as e:
        raise StoreBusy(f"{source}: {e}") from e
    if wrote:
        evict(folder.parent, library_settings().store_max_bytes, keep=folder)
    else:
        source.starts = store.extra["starts"]  # a glob's errors name the file and its row, as when it was read
    return StoredExamples(store)
