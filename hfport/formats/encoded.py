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

Stores shared by processes (a cache folder; `open_or_write`, `evict`) carry two lock files beside each store
folder NAME, both `flock`s, which the kernel drops when their holder exits (kill -9 included):

    NAME.lock           shared while a process has the store open (or is writing it), exclusive to remove it;
                        its mtime is the store's last use (touched at every open), the order `evict` removes in
    .NAME.build         exclusive while one process writes the store: the others wait, then open what it wrote;
                        it holds the writer's pid, for the error a waiter that gives up raises
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from ..staging import staged

FORMAT = 1
MANIFEST = "manifest.json"
JSON = "json"  # a field of JSON values, one per example
OFFSET = np.dtype("<i8")
CHUNK = 1 << 16  # offsets read at a time by lengths() and values(): 512 KiB
# what staging (hfport/staging.py) leaves beside a target NAME when its writer dies: NAME's staging folder, or the old
# NAME moved aside by a replace
LEFTOVER = re.compile(r"^\.(?P<name>.+)\.[0-9a-f]{12}\.(tmp|old)$")
log = logging.getLogger("hfport")


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


def open_store(folder: Path, key: str, repair: bool = True) -> Store | None:
    """The store at FOLDER if it is complete and was written for KEY; None otherwise (and, with REPAIR, a broken one
    removed: only a caller that may write the store repairs it, under the build lock when stores are shared)."""
    if not folder.is_dir():
        return None
    try:
        store = Store(folder)
    except StoreError:
        if repair:
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
        self.lock: FolderLock | None = None  # the shared use lock of a store in a shared folder, held until close
        self._fd: dict[str, tuple[int, int]] = {}
        try:
            manifest = json.loads((self.folder / MANIFEST).read_text(encoding="utf-8"))
            self.count, self.fields, self.key = manifest["count"], dict(manifest["fields"]), manifest["key"]
            self.extra: dict[str, Any] = manifest["extra"]
            if manifest["format"] != FORMAT:
                raise StoreError(f"{folder}: store format {manifest['format']}, this hfport reads {FORMAT}")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise StoreError(f"{folder}: not a complete store ({e})") from e
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
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def __del__(self) -> None:  # a store dropped unclosed: its files and its lock (evict() may take it) go with it
        self.close()

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


# --- stores shared by processes: lock files, one writer, eviction ------------------------------------------------


class FolderLock:
    """An flock on PATH (created when missing), held through one open file: two opens conflict even in one process,
    and the kernel drops the lock when its holder dies."""

    def __init__(self, path: Path):
        self.path, self.fd = Path(path), -1

    def acquire(self, exclusive: bool, wait: float = 0.0) -> bool:
        """Take the lock, trying for up to WAIT seconds; False when it stayed busy. A lock file removed while this
        waited (its store evicted) is not the lock any more: the new file at PATH is locked instead."""
        mode = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
        deadline, pause = time.monotonic() + wait, 0.01
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except PermissionError:  # a cache others wrote, read-only to this user: flock needs no write access
                fd = os.open(self.path, os.O_RDONLY)
            try:
                fcntl.flock(fd, mode)
            except BlockingIOError:
                os.close(fd)
                if time.monotonic() >= deadline:
                    return False
                time.sleep(pause)
                pause = min(2 * pause, 0.5)
                continue
            if self._current(fd):
                self.fd = fd
                return True
            os.close(fd)

    def _current(self, fd: int) -> bool:
        try:
            here, held = os.stat(self.path), os.fstat(fd)
        except FileNotFoundError:
            return False
        return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def note_holder(self) -> None:
        """Write this process's id into the lock file, for the error of a process that waits on it."""
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, str(os.getpid()).encode(), 0)

    def holder(self) -> str:
        try:
            return self.path.read_text().strip() or "?"
        except OSError:
            return "?"


def use_lock(folder: Path) -> FolderLock:
    return FolderLock(folder.parent / f"{folder.name}.lock")


def build_lock(folder: Path) -> FolderLock:
    return FolderLock(folder.parent / f".{folder.name}.build")


class StoreBusy(StoreError):
    """Another process held a store's lock longer than this one would wait."""


def open_or_write(target: Path, key: str, write: Callable[[], Store], wait: float) -> tuple[Store, bool]:
    """The store at TARGET written for KEY, opened under its shared use lock (held until the store is closed, so no
    other process evicts it), or written by WRITE (which returns it opened) when there is none. One process at a
    time writes (the build lock): the others wait up to WAIT seconds for it, then open what it wrote. Returns the
    store and whether this call wrote it. A failed write leaves neither the store nor its lock files."""
    target.parent.mkdir(parents=True, exist_ok=True)
    use = use_lock(target)
    if not use.acquire(exclusive=False, wait=wait):
        raise StoreBusy(f"{target}: still locked by a process removing it after {wait:.0f} s")
    try:
        store, wrote = open_store(target, key, repair=False), False
        if store is None:
            store, wrote = _write_once(target, key, write, wait)
    except BaseException:
        use.release()
        _tidy(target)
        raise
    store.lock = use
    with contextlib.suppress(PermissionError):  # another user's store, read-only here: its order stays its owner's
        os.utime(use.path)  # the last use, for evict()'s order
    return store, wrote


def _write_once(target: Path, key: str, write: Callable[[], Store], wait: float) -> tuple[Store, bool]:
    """Under the build lock: the store another process wrote while this one waited, or WRITE's."""
    build = build_lock(target)
    if not build.acquire(exclusive=True):
        log.info("%s: process %s is encoding this store; waiting for it (up to %.0f s)", target, build.holder(), wait)
        if not build.acquire(exclusive=True, wait=wait):
            raise StoreBusy(f"{target}: process {build.holder()} has been writing this store for more than "
                            f"{wait:.0f} s (a stuck writer: stop it and run again)")
    try:
        store = open_store(target, key)  # a broken or stale one is removed: only a writer repairs
        if store is not None:
            return store, False
        build.note_holder()
        return write(), True
    finally:
        build.release()


def _tidy(target: Path) -> None:
    """TARGET's lock files removed when it has no store and no process holds them (after a failed write)."""
    lock = use_lock(target)
    if not target.exists() and lock.acquire(exclusive=True):
        _remove(target, lock)


def _remove(target: Path, lock: FolderLock) -> None:
    """TARGET, its leftovers and its lock files removed; LOCK (its use lock) is held exclusively, so no process has it
    open or is writing it, and no process takes its build lock (that comes after the use lock)."""
    shutil.rmtree(target, ignore_errors=True)
    for leftover in target.parent.glob(f".{glob.escape(target.name)}.*"):
        if LEFTOVER.match(leftover.name):
            shutil.rmtree(leftover, ignore_errors=True)
    build_lock(target).path.unlink(missing_ok=True)
    lock.path.unlink(missing_ok=True)
    lock.release()


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())


def sweep(root: Path) -> list[Path]:
    """Remove what killed writers left under ROOT: the staging folders (and old stores moved aside) of stores no
    process is writing (their build lock is free), and the lock files of stores that do not exist and no process
    holds. Returns the folders removed."""
    names = {m["name"] for p in root.iterdir() if (m := LEFTOVER.match(p.name))}
    names |= {p.name[:-len(".lock")] for p in root.glob("*.lock") if not (root / p.name[:-len(".lock")]).exists()}
    removed: list[Path] = []
    for name in sorted(names):
        use, build = use_lock(root / name), build_lock(root / name)
        if not use.acquire(exclusive=False):  # being evicted
            continue
        if build.acquire(exclusive=True):  # the build lock after the use lock, as a writer takes them
            leftovers = [p for p in root.glob(f".{glob.escape(name)}.*") if LEFTOVER.match(p.name)]
            for p in leftovers:
                shutil.rmtree(p, ignore_errors=True)
                log.info("removed %s, left by a writer that did not finish", p)
            removed += leftovers
            build.release()
        use.release()
        _tidy(root / name)
    return removed


def last_used(folder: Path) -> float:
    """When a store was last opened: its use lock's mtime (its manifest's for a store without one)."""
    for path in (use_lock(folder).path, folder / MANIFEST, folder):
        try:
            return path.stat().st_mtime
        except FileNotFoundError:
            continue
    return 0.0


def evict(root: Path, cap: int, keep: Path) -> list[Path]:
    """Sweep ROOT (see sweep()), then remove its least recently used stores until they hold at most CAP bytes
    (0: no cap), never KEEP (the store just written) nor one a process has open. Returns the removed stores."""
    sweep(root)
    stores = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    sizes = {p: folder_bytes(p) for p in stores}
    total = sum(sizes.values())
    evicted: list[Path] = []
    for folder in sorted(stores, key=last_used):
        if cap <= 0 or total <= cap:
            break
        lock = use_lock(folder)
        if folder == keep or not lock.acquire(exclusive=True):
            continue
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(last_used(folder)))
        _remove(folder, lock)
        total -= sizes[folder]
        evicted.append(folder)
        log.info("evicted encoded store %s (%.1f MiB, last used %s): the stores held more than %.1f MiB",
                 folder, sizes[folder] / 2**20, used, cap / 2**20)
    return evicted
