"""Staged writes: a folder is written beside its target under a hidden name and renamed into place only when the
writer has finished, so no failure (a full disk, a crash, a failed verify) leaves a half-written target.

    with staged(out) as folder:      # folder: a fresh hidden sibling of out
        write everything into folder  # raising here removes it; out is left as it was
    # out is now the finished folder (an old out was moved aside, and restored if the rename failed)

One helper for every writer that publishes a folder: the exports (hfport/export/), and, by its options, the
writers that publish into a folder in place (`merge=True`: model and adapter saves, whose target may hold other
files) or under a fixed staging name a crash can leave behind for the next run to sweep (`name=`, with `fsync=True`
so the data is on disk before the rename makes it visible: the checkpoint writer's needs).
Standard library only: the lowest floor.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def staging_dir(target: Path, name: str | None = None) -> Path:
    """A fresh sibling of TARGET to write into: `.<target>.<random>.tmp`, or NAME (a leftover of that name from a
    killed writer is removed first)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if name is not None:
        staging = target.parent / name
        shutil.rmtree(staging, ignore_errors=True)
    else:
        staging = target.parent / f".{target.name}.{uuid.uuid4().hex[:12]}.tmp"
    staging.mkdir()  # plain mkdir, not mkdtemp: a new target gets the umask's mode, not 0700
    return staging


def replace_folder(staging: Path, target: Path) -> None:
    """Rename the finished STAGING to TARGET; an old TARGET is moved aside first and restored if that fails."""
    if not target.exists():
        os.replace(staging, target)
        return
    aside = target.parent / f".{target.name}.{uuid.uuid4().hex[:12]}.old"
    os.replace(target, aside)
    try:
        os.replace(staging, target)
    except BaseException:
        os.replace(aside, target)
        raise
    shutil.rmtree(aside, ignore_errors=True)


def merge_folder(staging: Path, target: Path, stale: tuple[str, ...] = ()) -> None:
    """Move the finished STAGING's files into TARGET (a rename when TARGET is new), keeping TARGET's other files,
    except those matching a STALE pattern that this write did not produce (weights of an earlier save in another
    layout, say)."""
    if not target.exists():
        os.replace(staging, target)
        return
    written = {item.name for item in staging.iterdir()}
    for item in staging.iterdir():
        os.replace(item, target / item.name)
    shutil.rmtree(staging, ignore_errors=True)
    for pattern in stale:
        for old in target.glob(pattern):
            if old.name not in written:
                old.unlink()


def fsync_files(folder: Path) -> None:
    """Flush every file in FOLDER to disk (before a rename makes it visible)."""
    for item in folder.iterdir():
        if item.is_file():
            with open(item, "rb") as fh:
                os.fsync(fh.fileno())


@contextmanager
def staged(target: Path, *, name: str | None = None, merge: bool = False, stale: tuple[str, ...] = (),
           fsync: bool = False) -> Iterator[Path]:
    """A staging folder beside TARGET; when the body returns it becomes TARGET (replacing it whole, or with
    merge=True moved in file by file). If the body or the rename raises, the staging folder is removed and TARGET
    is left as it was."""
    target = Path(target)
    staging = staging_dir(target, name)
    try:
        yield staging
        if fsync:
            fsync_files(staging)
        if merge:
            merge_folder(staging, target, stale)
        else:
            replace_folder(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
