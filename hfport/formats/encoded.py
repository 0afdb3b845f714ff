"""The encoded-examples store: a folder of examples written once, a chunk at a time, and read back one example at a
time with positioned reads, so a training set far larger than memory is held on disk, not in Python objects.

    manifest.json       {"format": 1, "count": N, "fields": {name: dtype}, "key": ..., "extra": {...}}; written last
    <field>.bin         every example's values of that field, one after another (an array field: its numpy
                        dtype's bytes; a "json" field: UTF-8 JSON, tuples kept as {"__tuple__": [...]})
    <field>.idx         int64 offsets, N + 1 of them: example i's values are [idx[i], idx[i + 1]) of .bin

A store is published whole (hfport/staging.py: written beside its place, renamed when complete), and `open_store`
checks the manifest against every file's size before it trusts a folder, so a store a crash cut short is never
read: the caller encodes again. Reads are `os.pread`s of two offsets and one run of values; nothing maps or loads a
whole file, so the process's memory does not grow with the store (`lengths` reads the offsets a chunk at a time
and keeps one int32 per example).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from ..staging import staged

FORMAT = 1
MANIFEST = "manifest.json"
JSON = "json"  # a field of JSON values, one per example
OFFSET = np.dtype("<i8")
CHUNK = 1 << 16  # offsets read at a time by lengths() and values(): 512 KiB


class StoreError(ValueError):
    """A store folder that is not a complete store of this format."""


def _tagged(value: Any) -> Any:
    """JSON-able VALUE with tuples tagged (JSON has only lists) and arrays (array.array, numpy) as lists."""
    if isinstance(value, tuple):
        return {"__tuple__": [_tagged(v) for v in value]}
    if isinstance(value, list):
        return [_tagged(v) for v in value]
    if isinstance(value, dict):
        return {k: _tagged(v) for k, v in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    if hasattr(value, "tolist"):  # array.array, numpy arrays
        return value.tolist()
    return value


def _untagged(obj: dict[str, Any]) -> Any:
    return tuple(obj["__tuple__"]) if len(obj) == 1 and "__tuple__" in obj else obj


class StoreWriter:
    """Appends examples (dicts of field -> value) to the files of a staging folder; `fields` maps each name to a
    numpy dtype (a sequence of numbers a row) or JSON."""

    def __init__(self, folder: Path, fields: dict[str, str]):
        self.folder, self.fields, self.count = folder, dict(fields), 0
        self._bin = {f: open(folder / f"{f}.bin", "wb") for f in fields}
        self._idx = {f: open(folder / f"{f}.idx", "wb") for f in fields}
        self._end = dict.fromkeys(fields, 0)  # the next offset of each field, in its units (values or bytes)
        for f in fields:
            self._idx[f].write(np.zeros(1, OFFSET).tobytes())

    def append(self, rows: list[dict[str, Any]]) -> None:
        """Write ROWS (every field present in each) at the end of the store."""
        for f, dtype in self.fields.items():
            if dtype == JSON:
                blobs = [json.dumps(_tagged(r[f]), separators=(",", ":")).encode() for r in rows]
                sizes = [len(b) for b in blobs]
                self._bin[f].write(b"".join(blobs))
            else:
                arrays = [np.asarray(r[f], dtype=dtype) for r in rows]
                sizes = [a.size for a in arrays]
                self._bin[f].write(np.concatenate(arrays).astype(dtype, copy=False).tobytes() if arrays else b"")
            ends = self._end[f] + np.cumsum(sizes, dtype=OFFSET)
            self._idx[f].write(ends.tobytes())
            if len(ends):
                self._end[f] = int(ends[-1])
        self.count += len(rows)

    def close(self, key: str, extra: dict[str, Any] | None = None) -> None:
        for handle in (*self._bin.values(), *self._idx.values()):
            handle.close()
        manifest = {"format": FORMAT, "count": self.count, "fields": self.fields, "key": key, "extra": extra or {}}
        (self.folder / MANIFEST).write_text(json.dumps(manifest), encoding="utf-8")

    def abort(self) -> None:
        for handle in (*self._bin.values(), *self._idx.values()):
            handle.close()


def write_store(target: Path, fields: dict[str, str], chunks: Iterable[list[dict[str, Any]]], key: str,
                extra: Callable[[], dict[str, Any]] | None = None) -> Store:
    """A store at TARGET of every chunk's rows, published whole when the last chunk is in (see the module
    docstring); an error while reading the chunks leaves no store. EXTRA, called once every chunk is in, gives the
    manifest's "extra" (what the reader learnt while the rows went by). Returns it opened."""
    with staged(target, fsync=True) as folder:
        writer = StoreWriter(folder, fields)
        try:
            for rows in chunks:
                writer.append(rows)
        except BaseException:
            writer.abort()
            raise
        writer.close(key, extra() if extra else None)
    return Store(target)


def open_store(folder: Path, key: str) -> Store | None:
    """The store at FOLDER if it is complete and was written for KEY; None (and a broken one removed) otherwise."""
    if not folder.is_dir():
        return None
    try:
        store = Store(folder)
    except StoreError:
        shutil.rmtree(folder, ignore_errors=True)
        return None
    if store.key != key:
        store.close()
        return None
    return store


class Store:
    """A complete store, read an example at a time (`row`), a field's lengths at once (`lengths`), or a field's
    values in order (`values`)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        try:
            manifest = json.loads((self.folder / MANIFEST).read_text(encoding="utf-8"))
            self.count, self.fields, self.key = manifest["count"], dict(manifest["fields"]), manifest["key"]
            self.extra: dict[str, Any] = manifest["extra"]
            if manifest["format"] != FORMAT:
                raise StoreError(f"{folder}: store format {manifest['format']}, this hfport reads {FORMAT}")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise StoreError(f"{folder}: not a complete store ({e})") from e
        self._fd: dict[str, tuple[int, int]] = {}
        try:
            for f in self.fields:
                self._fd[f] = (os.open(self.folder / f"{f}.idx", os.O_RDONLY),
                               os.open(self.folder / f"{f}.bin", os.O_RDONLY))
                self._check(f)
        except (OSError, StoreError) as e:
            self.close()
            raise StoreError(f"{folder}: not a complete store ({e})") from e

    def _check(self, f: str) -> None:
        """Every file as long as the manifest and the last offset say: a store cut short is refused."""
        idx, data = self._fd[f]
        if os.fstat(idx).st_size != (self.count + 1) * OFFSET.itemsize:
            raise StoreError(f"{f}.idx holds {os.fstat(idx).st_size} bytes for {self.count} examples")
        end = int(np.frombuffer(os.pread(idx, OFFSET.itemsize, self.count * OFFSET.itemsize), OFFSET)[0])
        if os.fstat(data).st_size != end * self._itemsize(f):
            raise StoreError(f"{f}.bin holds {os.fstat(data).st_size} bytes, its offsets end at {end}")

    def _itemsize(self, f: str) -> int:
        return 1 if self.fields[f] == JSON else np.dtype(self.fields[f]).itemsize

    def close(self) -> None:
        for idx, data in self._fd.values():
            os.close(idx)
            os.close(data)
        self._fd = {}

    def __len__(self) -> int:
        return self.count

    def _span(self, f: str, i: int) -> tuple[int, int]:
        start, end = np.frombuffer(os.pread(self._fd[f][0], 2 * OFFSET.itemsize, i * OFFSET.itemsize), OFFSET)
        return int(start), int(end)

    def _decode(self, f: str, raw: bytes) -> Any:
        dtype = self.fields[f]
        if dtype == JSON:
            return json.loads(raw, object_hook=_untagged)
        return np.frombuffer(raw, dtype=dtype)

    def row(self, i: int) -> dict[str, Any]:
        """Example I's fields: numpy arrays (read-only views of their bytes) and JSON values."""
        if not 0 <= i < self.count:
            raise IndexError(f"example {i} of a store of {self.count}")
        out = {}
        for f in self.fields:
            start, end = self._span(f, i)
            size = self._itemsize(f)
            out[f] = self._decode(f, os.pread(self._fd[f][1], (end - start) * size, start * size))
        return out

    def offset_chunks(self, f: str) -> Iterator[np.ndarray]:
        """FIELD's offsets, CHUNK + 1 at a time (consecutive chunks share their boundary offset)."""
        idx = self._fd[f][0]
        for first in range(0, self.count, CHUNK):
            n = min(CHUNK, self.count - first) + 1
            yield np.frombuffer(os.pread(idx, n * OFFSET.itemsize, first * OFFSET.itemsize), OFFSET)

    def lengths(self, f: str) -> np.ndarray:
        """Each example's number of values in FIELD, int32, one per example (the offsets are never held whole)."""
        out = np.empty(self.count, np.int32)
        for k, offsets in enumerate(self.offset_chunks(f)):
            out[k * CHUNK:k * CHUNK + len(offsets) - 1] = np.diff(offsets)
        return out

    def values(self, f: str) -> Iterator[Any]:
        """FIELD's value of every example in order, read a chunk of examples at a time."""
        data = self._fd[f][1]
        size = self._itemsize(f)
        for offsets in self.offset_chunks(f):
            start = int(offsets[0])
            raw = os.pread(data, (int(offsets[-1]) - start) * size, start * size)
            for a, b in zip(offsets[:-1], offsets[1:]):
                yield self._decode(f, raw[(int(a) - start) * size:(int(b) - start) * size])
