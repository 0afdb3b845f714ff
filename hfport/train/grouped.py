"""Rows gathered by a key with bounded memory: the external grouping a reader needs when an example is made of rows
that may lie anywhere in the file (a ranking query's candidates).

Two passes over one read of the source. The first keeps each row's value (in a list, or for a large source in a
temporary encoded-examples store on disk, hfport/formats/encoded.py) and numbers each key in the order of its first
row; the second reads each key's values back, one group at a time. What memory holds besides a list's values: a
dict entry a distinct key (its 63-bit hash, not its text) and 16 bytes a row (its group's number and its place in
the grouped order), never the rows' text. A source already sorted by key is read back in file order, a chunk at a
time; any other is read back a row at a time (positioned reads). The temporary store lives under the cache dir
(`$HFPORT_CACHE_DIR/spill/`) and is removed when the groups have been read (or on an error).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from array import array
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from ..formats.encoded import JSON, write_store
from ..hardware import cache_path
from .data import in_chunks

SPILL_ROWS = 1024  # rows written to the temporary store at a time: the text held at once while spilling
SPILL_DIR = "spill"  # under the cache dir, not the system's temp dir, which may be memory (tmpfs)


def gathered(rows: Iterable[tuple[int, Any]], spill: bool) -> Iterator[list[Any]]:
    """The values of ROWS, (key, value) pairs, gathered by key: a list per key, the keys in the order of their first
    row, each list in row order. SPILL: the values (JSON-able) wait on disk, else in memory."""
    numbers: dict[int, int] = {}
    group_of = array("q")  # each row's group number

    def values() -> Iterator[list[Any]]:  # pass 1: number the keys as the rows go by
        for chunk in in_chunks(rows, SPILL_ROWS):
            group_of.extend(numbers.setdefault(key, len(numbers)) for key, _ in chunk)
            yield [value for _, value in chunk]

    with _held(values(), spill) as (every, one):
        sizes = np.bincount(np.frombuffer(group_of, np.int64), minlength=len(numbers))  # (G,) rows a group
        numbers.clear()
        yield from _groups(_in_group_order(group_of, every, one), sizes)


@contextmanager
def _held(chunks: Iterator[list[Any]], spill: bool) -> Iterator[tuple[Callable[[], Iterator[Any]],
                                                                       Callable[[int], Any]]]:
    """Every chunk's values kept, as (every value in order, value i): in a list, or SPILL in a temporary store
    (removed on the way out, also after an error)."""
    if not spill:
        held = [v for chunk in chunks for v in chunk]
        yield (lambda: iter(held)), held.__getitem__
        return
    folder = Path(tempfile.mkdtemp(prefix=f"rows-{os.getpid()}-", dir=_spill_root()))
    store = None
    try:
        store = write_store(folder / "rows", {"value": JSON}, ([{"value": v} for v in chunk] for chunk in chunks),
                            "rows")
        yield (lambda: store.values("value")), (lambda i: store.row(i)["value"])
    finally:
        if store is not None:
            store.close()
        shutil.rmtree(folder, ignore_errors=True)


def _spill_root() -> Path:
    """The spill folder, without what a process killed outright (no `finally`) left there: a folder is named by its
    process id, and one whose process is gone is removed."""
    root = cache_path().parent / SPILL_DIR
    root.mkdir(parents=True, exist_ok=True)
    for left in root.glob("rows-*-*"):
        pid = left.name.split("-")[1]
        if pid.isdigit() and not _running(int(pid)):
            shutil.rmtree(left, ignore_errors=True)
    return root


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: running
        pass
    return True


def _in_group_order(group_of: array, every: Callable[[], Iterator[Any]], one: Callable[[int], Any]) -> Iterator[Any]:
    """Every row's value, the groups one after another (each in row order)."""
    groups = np.frombuffer(group_of, np.int64)  # (R,)
    if np.all(groups[1:] >= groups[:-1]):  # already grouped: read in file order
        return every()
    order = np.argsort(groups, kind="stable")  # (R,): stable keeps each group's rows in file order
    return (one(int(i)) for i in order)


def _groups(values: Iterator[Any], sizes: np.ndarray) -> Iterator[list[Any]]:
    for size in sizes.tolist():
        yield [next(values) for _ in range(size)]
