"""The encoded-examples cache shared by processes (hfport/formats/encoded.py's locks, hfport/train/stored.py's
collect): two processes that read the same large source at once (the ranks of `accelerate launch`) write one store
and read identical examples; a writer killed with SIGKILL mid-write leaves no store that is read as complete, and its
staging folder is swept; once the stores hold more than the setting store_max_bytes the least recently used are evicted,
never one that is open nor the one just written; a process stuck writing makes the others fail with an error naming
it.

The processes are plain subprocesses running this file (`python tests/test_store_cache.py ...`): the store does not
depend on a process group, so no gloo is needed. stored.STREAM_BYTES = 0 forces every source onto the store.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import hfport.settings  # noqa: E402
from hfport import AutoTokenizer  # noqa: E402
from hfport.errors import SettingsError  # noqa: E402
from hfport.formats.encoded import (LEFTOVER, StoreBusy, build_lock, folder_bytes, open_store,  # noqa: E402
                                    use_lock)
from hfport.formats.tables import Source  # noqa: E402
from hfport.train import stored as stored_module  # noqa: E402
from hfport.train.stored import StoredExamples, collect, store_folder, store_key  # noqa: E402
from hfport.train.tasks.classification import encode_rows  # noqa: E402

TASK, SETTINGS = "text-classification", {"case": "cache"}
OPTIONS = SimpleNamespace(text_column="text", text_pair_column=None, label_column="label", max_length=16)
WORDS = ["the", "river", "ran", "past", "an", "old", "town", "where", "birds", "sang", "every", "day"]


def write_rows(path: Path, n: int, seed: int) -> Path:
    lines = [{"text": " ".join(WORDS[(seed + i + k) % len(WORDS)] for k in range(3 + i % 5)), "label": i % 2}
             for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def chunks(data: Path, tokenizer: Any, size: int = 5) -> Iterator[list]:
    """The classification reader's Features, SIZE at a time (several chunks from a tiny file)."""
    every = [x for chunk in encode_rows(Source(data), OPTIONS, tokenizer) for x in chunk]
    for i in range(0, len(every), size):
        yield every[i:i + size]


def plain(x: Any) -> list:
    return [list(x.input_ids), x.target, list(x.source), x.meta]


def stored(data: Path, tokenizer: Any, feed: Iterator[list] | None = None):
    return collect(feed if feed is not None else chunks(data, tokenizer), Source(data), tokenizer, TASK, SETTINGS)


def drive(mode: str, tokenizer_dir: str, data: str, out: str) -> None:
    """A process of the tests below. Its reader marks OUT.encoding when collect starts consuming it, then
    `wait`: waits for OUT's folder's `go` file before the rest of its chunks, and writes the examples it got to OUT;
    `die`: sleeps after its first chunk (the test kills it with SIGKILL)."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    stored_module.STREAM_BYTES = 0  # every source onto the store (this process's own copy of the module)
    tokenizer, data_path, out_path = AutoTokenizer.from_pretrained(tokenizer_dir), Path(data), Path(out)

    def feed() -> Iterator[list]:
        it = chunks(data_path, tokenizer)
        yield next(it)
        Path(f"{out}.encoding").write_text(str(os.getpid()))
        if mode == "die":
            time.sleep(120)
        deadline = time.monotonic() + 60
        while not (out_path.parent / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        yield from it

    got = stored(data_path, tokenizer, feed())
    out_path.write_text(json.dumps({"examples": [plain(x) for x in got], "stored": isinstance(got, StoredExamples)}))


def launch(mode: str, tokenizer_dir: Path, data: Path, out: Path, cache: Path) -> subprocess.Popen:
    env = {**os.environ, "HFPORT_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    log = open(f"{out}.log", "w")
    return subprocess.Popen([sys.executable, __file__, mode, str(tokenizer_dir), str(data), str(out)], env=env,
                            stdout=log, stderr=subprocess.STDOUT)


def wait_for(check, what: str, procs: list[subprocess.Popen], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        dead = [p for p in procs if p.poll() is not None]
        assert not dead and time.monotonic() < deadline, f"{what}: not seen (exited: {[p.args for p in dead]})"
        time.sleep(0.02)


def read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def cache_entries(cache: Path) -> set[str]:
    return {p.name for p in (cache / "encoded").iterdir()}


if __name__ == "__main__":
    drive(*sys.argv[1:])
    sys.exit(0)

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    hfport.settings.use(cache_dir=tmp_path / "cache")  # conftest resets the settings after the test
    monkeypatch.setattr(stored_module, "STREAM_BYTES", 0)
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def tokenizer(minilm_path):
    return AutoTokenizer.from_pretrained(minilm_path)


def test_two_processes_write_one_store_and_read_the_same_examples(tmp_path, cache, minilm_path, tokenizer):
    """Two processes started together on one source: the first to take the build lock writes the store and holds at
    its second chunk; the other waits for it instead of encoding (its reader is never consumed) and logs the
    writer's pid; once the writer finishes both read identical examples, equal to the in-memory list, and the cache
    holds one store and its lock files."""
    data = write_rows(tmp_path / "train.jsonl", 23, 0)
    outs = [tmp_path / "a.json", tmp_path / "b.json"]
    procs = [launch("wait", minilm_path, data, out, cache) for out in outs]
    marker, log = (lambda out: Path(f"{out}.encoding")), (lambda out: read(Path(f"{out}.log")))
    try:
        wait_for(lambda: any(marker(o).exists() for o in outs), "a writer", procs)
        writer = next(k for k, o in enumerate(outs) if marker(o).exists())
        waiter = outs[1 - writer]
        wait_for(lambda: "is encoding this store; waiting" in log(waiter) or marker(waiter).exists(), "a waiter",
                 procs)
        (tmp_path / "go").touch()
        assert all(p.wait(60) == 0 for p in procs), log(waiter)
    finally:
        for p in procs:
            p.kill() if p.poll() is None else None
    assert not marker(waiter).exists()  # the waiter never encoded: the store was written once
    assert f"process {procs[writer].pid} is encoding this store" in log(waiter)
    got_a, got_b = (json.loads(out.read_text()) for out in outs)
    assert got_a["stored"] and got_b["stored"] and len(got_a["examples"]) == 23
    want = [plain(x) for chunk in chunks(data, tokenizer) for x in chunk]
    assert got_a["examples"] == got_b["examples"] == json.loads(json.dumps(want))
    name = store_folder(store_key(Source(data), tokenizer, TASK, SETTINGS)).name
    assert cache_entries(cache) == {name, f"{name}.lock", f".{name}.build"}


def test_a_writer_killed_mid_write_leaves_no_complete_store(tmp_path, cache, minilm_path, tokenizer):
    """SIGKILL after the first chunk: the store's folder does not exist (only its staging folder, its files begun),
    so it is never opened as complete; the next run encodes it again, whole, and sweeps the staging folder."""
    data = write_rows(tmp_path / "train.jsonl", 17, 1)
    folder = store_folder(store_key(Source(data), tokenizer, TASK, SETTINGS))
    proc = launch("die", minilm_path, data, tmp_path / "k.json", cache)
    try:
        wait_for(lambda: Path(f"{tmp_path / 'k.json'}.encoding").exists(), "writer encoding", [proc])
        time.sleep(0.1)  # past the first chunk's write
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    left = [p for p in folder.parent.iterdir() if LEFTOVER.match(p.name)]
    assert len(left) == 1 and (left[0] / "input_ids.idx").exists() and not (left[0] / "manifest.json").exists()
    assert not folder.exists() and open_store(folder, "any") is None
    got = stored(data, tokenizer)
    assert isinstance(got, StoredExamples)
    assert [plain(x) for x in got] == [plain(x) for chunk in chunks(data, tokenizer) for x in chunk]
    assert cache_entries(cache) == {folder.name, f"{folder.name}.lock", f".{folder.name}.build"}  # swept


def test_least_recently_used_stores_are_evicted(tmp_path, cache, tokenizer, monkeypatch, caplog):
    """Four stores (oldest first: A free, B open, C free) and then D written under a cap of 1.5 stores: A and C go
    (logged), B stays because it is open (its use lock is held; another open file of the lock conflicts even in
    this process, as in another), D stays because it was just written. Closed, B goes at the next write; cap 0 never
    evicts."""
    sources = {n: write_rows(tmp_path / f"{n}.jsonl", 20, i) for i, n in enumerate("ABCDEF")}
    opened = {n: stored(sources[n], tokenizer) for n in "ABC"}
    folders = {n: opened[n].store.folder for n in "ABC"}
    for n in "AC":
        opened[n].store.close()
    for age, n in enumerate("CBA"):  # last used: A three hours ago, B two, C one
        os.utime(use_lock(folders[n]).path, (time.time() - 3600 * (age + 1),) * 2)
    size = folder_bytes(folders["A"])
    hfport.settings.use(store_max_bytes=int(size * 1.5))
    with caplog.at_level(logging.INFO, logger="hfport"):
        d = stored(sources["D"], tokenizer)
    assert sorted(p for p in cache_entries(cache) if not p.startswith(".") and not p.endswith(".lock")) == \
        sorted([folders["B"].name, d.store.folder.name])
    assert not use_lock(folders["A"]).path.exists() and not build_lock(folders["C"]).path.exists()
    evicted = [r.getMessage() for r in caplog.records if r.getMessage().startswith("evicted")]
    assert len(evicted) == 2 and str(folders["A"]) in evicted[0] and str(folders["C"]) in evicted[1]
    assert [plain(x) for x in opened["B"]] == [plain(x) for c in chunks(sources["B"], tokenizer) for x in c]
    opened["B"].store.close()
    d.store.close()
    hfport.settings.use(store_max_bytes=0)
    stored(sources["E"], tokenizer)
    assert folders["B"].exists()  # no cap: nothing evicted
    hfport.settings.use(store_max_bytes=int(size * 1.5))
    f = stored(sources["F"], tokenizer)
    assert sorted(p for p in cache_entries(cache) if not p.startswith(".") and not p.endswith(".lock")) == \
        [f.store.folder.name]  # B, D and E closed: all older than F, over the cap


def test_a_stuck_writer_makes_the_others_fail_naming_it(tmp_path, cache, tokenizer, monkeypatch):
    """The build lock held (as a writer holds it) past STORE_WAIT_S: the error names the source, the store and the
    holder's pid; the waiting reader never encoded anything, and the lock files stay the
    writer's."""
    data = write_rows(tmp_path / "train.jsonl", 12, 2)
    folder = store_folder(store_key(Source(data), tokenizer, TASK, SETTINGS))
    folder.parent.mkdir(parents=True)
    user, writer = use_lock(folder), build_lock(folder)  # what a writer holds: the use lock shared, the build lock
    assert user.acquire(exclusive=False) and writer.acquire(exclusive=True)
    writer.note_holder()
    monkeypatch.setattr(stored_module, "STORE_WAIT_S", 0.3)
    consumed = []

    def feed():
        consumed.append(1)
        yield from chunks(data, tokenizer)

    try:
        with pytest.raises(StoreBusy, match=rf"train.jsonl: .*{folder.name}: process {os.getpid()} has been "
                                            r"writing this store for more than 0 s \(a stuck writer"):
            stored(data, tokenizer, feed())
    finally:
        assert user.path.exists() and writer.path.exists()  # the failed waiter left the writer's lock files
        writer.release()
        user.release()
    assert not consumed and not folder.exists()
    got = stored(data, tokenizer)  # the writer gone, the next run writes it
    assert len(got) == 12


def test_a_bad_cap_names_the_variable(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setenv("HFPORT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HFPORT_STORE_MAX_BYTES", "20G")
    hfport.settings.reset()  # read the environment again (the fixture set the settings in code)
    with pytest.raises(SettingsError, match=r"HFPORT_STORE_MAX_BYTES='20G': input should be a valid integer.*"
                                            r"\(accepted: int >= 0\)"):
        stored(write_rows(tmp_path / "train.jsonl", 8, 3), tokenizer)
