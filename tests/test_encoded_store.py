"""Encoded examples on disk (hfport/formats/encoded.py, hfport/train/stored.py): every task's encoded fields
round-trip through the store; a store cut short is never reused; a large source (here: any, stored.STREAM_BYTES = 0)
encodes into a store with the same checks and errors, and fine-tunes to the same weights and metrics as the
in-memory path (fp32, same seed), with exact resume."""

from __future__ import annotations

import json
import os
import random
import subprocess
import tracemalloc
from array import array
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

import hfport.settings
from hfport import AutoTokenizer
from hfport.formats.encoded import Store, StoreError, open_store, write_store
from hfport.formats.tables import Source
from hfport.tasks import TASKS
from hfport.train.config import FinetuneConfig
from hfport.train.data import DataError
from hfport.train.loop import finetune
from hfport.train.preflight import preflight
from hfport.train import grouped
from hfport.train import stored as store_module
from hfport.train.stored import StoredExamples, collect
from hfport.train.tasks import get_task
from hfport.train.tasks.ranking import read_groups
from tests.test_data_sources import sentiment_rows
from tests.test_finetune_tasks import mlm_lines, ner_rows, qa_rows, squad_v2
from tests.tiny import save_with_tokenizer

torch.set_num_threads(1)
EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "data"


@pytest.fixture(autouse=True)
def cache(tmp_path) -> Path:
    hfport.settings.use(cache_dir=tmp_path / "cache")  # conftest resets the settings after the test
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def root(tmp_path_factory, minilm_path) -> Path:
    root = tmp_path_factory.mktemp("stored")
    save_with_tokenizer("bert", "base", root / "model", minilm_path, vocab_size=30522)
    pq.write_table(pa.Table.from_pylist(sentiment_rows(40, seed=0)), root / "train.parquet", row_group_size=9)
    pq.write_table(pa.Table.from_pylist(sentiment_rows(16, seed=1)), root / "eval.parquet")
    jsonl = {"ner.jsonl": ner_rows(12, 0), "qa.jsonl": qa_rows(8, 0)}
    for name, rows in jsonl.items():
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "mlm.txt").write_text(mlm_lines(12, 0))
    (root / "squad.json").write_text(json.dumps(squad_v2(10, 0), indent=1))
    pq.write_table(pa.Table.from_pylist(qa_rows(10, 1)), root / "qa.parquet", row_group_size=3)
    rank_rows = scored_rows(EXAMPLES / "rerank_train.jsonl")
    (root / "rank_rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rank_rows))
    rng = random.Random(0)
    colors = ["red", "blue", "green", "yellow"]
    questions = []
    for _ in range(10):
        choices = rng.sample(colors, 4)
        questions.append({"context": f"the ball is {choices[1]}, so its color is", "choices": choices, "label": 1})
    (root / "choices.jsonl").write_text("".join(json.dumps(r) + "\n" for r in questions))
    return root


def scored_rows(groups: Path, seed: int = 0) -> list[dict]:
    """A group file's candidates as (query, text, label) rows, shuffled: a query's rows lie anywhere in the file."""
    rows = []
    for line in groups.read_text().splitlines():
        g = json.loads(line)
        rows.append({"query": g["query"], "text": g["positive"], "label": 1})
        rows += [{"query": g["query"], "text": n, "label": 0} for n in g["negatives"]]
    random.Random(seed).shuffle(rows)
    return rows


# every trainable task: its data and options
TASK_DATA = {
    "text-classification": ("train.parquet", {"text_pair_column": "pair"}),
    "token-classification": ("ner.jsonl", {}),
    "question-answering": ("qa.jsonl", {"max_length": 32, "doc_stride": 8}),
    "fill-mask": ("mlm.txt", {}),
    "sentence-embedding": (str(EXAMPLES / "embed_train.jsonl"), {}),
    "sparse-embedding": (str(EXAMPLES / "embed_train.jsonl"), {}),
    "text-ranking": (str(EXAMPLES / "rerank_train.jsonl"), {}),
    "multiple-choice": ("choices.jsonl", {}),
}


def config(root: Path, train: str, **options: Any) -> FinetuneConfig:
    values = dict(model=str(root / "model"), train=str(root / train), output_dir=str(root / "runs" / "x"),
                  max_length=48, batch_size=4, seed=3, precision="fp32")
    return FinetuneConfig(**{**values, **options})


def plain(value: Any) -> Any:
    """Arrays (array.array, numpy) as lists, everything else as it is (tuples stay tuples)."""
    if isinstance(value, (array, np.ndarray)):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def fields(x: Any) -> tuple:
    return (plain(x.input_ids), plain(x.token_type_ids), plain(x.target), plain(x.source), plain(x.meta))


def test_every_trainable_task_is_covered():
    assert {t.name for t in TASKS.values() if t.train} == set(TASK_DATA)


@pytest.mark.parametrize("task", TASK_DATA)
def test_every_tasks_encoded_fields_round_trip(root, task, monkeypatch):
    """The task's own reader's Features (targets, sources, meta: nested lists, tuples, None, strings), written to
    a store and read back by index and in order, are equal field by field, with their types."""
    train, options = TASK_DATA[task]
    cfg = config(root, train, task=task, eval_fraction=0.0, **options)
    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    want = list(get_task(task).read(cfg, tokenizer, None).train)
    monkeypatch.setattr(store_module, "STREAM_BYTES", 0)
    source = Source(cfg.train)
    got = collect([want[:3], want[3:]], source, tokenizer, task, {"case": 1})
    assert isinstance(got, StoredExamples) and len(got) == len(want)
    for i in (0, len(want) - 1, -1):
        assert fields(got[i]) == fields(want[i])
    for a, b in zip(got, want, strict=True):
        assert fields(a) == fields(b)
        assert type(a.target) is type(b.target)
    assert list(got.lengths) == [len(x.input_ids) for x in want]
    view = got.select([2, 0])
    assert [fields(x) for x in view] == [fields(want[2]), fields(want[0])]


def small_store(folder: Path, key: str = "k") -> Store:
    rows = [{"ids": [1, 2, 3], "meta": {"span": (1, 2), "none": None}}, {"ids": [], "meta": {"q": "why"}}]
    return write_store(folder, {"ids": "int32", "meta": "json"}, [rows[:1], rows[1:]], key)


def test_a_store_cut_short_is_not_reused(tmp_path):
    store = small_store(tmp_path / "s")
    assert store.row(0)["meta"] == {"span": (1, 2), "none": None} and len(store.row(1)["ids"]) == 0
    store.close()
    assert open_store(tmp_path / "s", "other key") is None  # written for other data: not this one's
    assert open_store(tmp_path / "s", "k") is not None
    with open(tmp_path / "s" / "ids.bin", "r+b") as f:  # a crash after the manifest: a file cut short
        f.truncate(4)
    with pytest.raises(StoreError, match="ids.bin holds 4 bytes"):
        Store(tmp_path / "s")
    assert open_store(tmp_path / "s", "k") is None and not (tmp_path / "s").exists()  # removed, to be rebuilt
    small_store(tmp_path / "t")
    (tmp_path / "t" / "manifest.json").unlink()  # the manifest is written last: without it, never complete
    assert open_store(tmp_path / "t", "k") is None


def test_a_failed_encode_leaves_no_store(tmp_path):
    def chunks():
        yield [{"ids": [1], "meta": 1}]
        raise DataError("row 7 is bad")

    with pytest.raises(DataError):
        write_store(tmp_path / "s", {"ids": "int32", "meta": "json"}, chunks(), "k")
    assert list(tmp_path.iterdir()) == []  # neither the store nor its staging folder


def test_errors_still_name_file_row_and_column(root, tmp_path, monkeypatch, cache):
    monkeypatch.setattr(store_module, "STREAM_BYTES", 0)
    rows = sentiment_rows(30, seed=5)
    rows[17]["text"] = "  "
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "bad.parquet", row_group_size=8)
    with pytest.raises(DataError, match=r"bad.parquet, row 17, field 'text': expected non-empty text"):
        preflight(config(root, str(tmp_path / "bad.parquet"), text_pair_column="pair"))
    assert not (cache / "encoded").exists() or not any((cache / "encoded").iterdir())
    rows[17]["text"], rows[21]["label"] = "fine", "unheard-of"
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "eval.parquet")
    with pytest.raises(DataError, match=r"eval.parquet, row 21, field 'label': unknown label 'unheard-of'"):
        preflight(config(root, "train.parquet", eval=str(tmp_path / "eval.parquet")))


def run(root: Path, out: Path, **options: Any) -> dict:
    cfg = config(root, "train.parquet", eval=str(root / "eval.parquet"), text_pair_column="pair",
                 output_dir=str(out), lr=1e-3, logging_steps=1, eval_strategy="steps", eval_steps=4,
                 group_by_length=True, **options)
    return finetune(cfg, progress=False)


def test_store_trains_like_the_list(root, tmp_path, monkeypatch, cache):
    """A small source keeps its examples in a list; forced onto the store, the same fine-tune (fp32, same seed, length
    grouping, evaluations) ends with identical weights and metrics, and a second run reuses the store."""
    small = preflight(config(root, "train.parquet", eval=str(root / "eval.parquet"), text_pair_column="pair"))
    assert isinstance(small.data.train, list) and not (cache / "encoded").exists()
    listed = run(root, tmp_path / "list", max_steps=8)
    monkeypatch.setattr(store_module, "STREAM_BYTES", 0)
    pre = preflight(config(root, "train.parquet", eval=str(root / "eval.parquet"), text_pair_column="pair"))
    assert isinstance(pre.data.train, StoredExamples) and isinstance(pre.data.eval, StoredExamples)
    stores = lambda: [p for p in (cache / "encoded").iterdir() if p.is_dir()]  # noqa: E731 (beside: lock files)
    written = {p: (p / "manifest.json").stat().st_mtime_ns for p in stores()}
    stored = run(root, tmp_path / "store", max_steps=8)
    assert {p: (p / "manifest.json").stat().st_mtime_ns for p in stores()} == written
    assert len(written) == 2  # train and eval, reused by the run's own preflight
    assert stored["final_eval"] == listed["final_eval"]
    a = load_file(tmp_path / "list" / "final" / "model.safetensors")
    b = load_file(tmp_path / "store" / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_store_resume_is_exact(root, tmp_path, monkeypatch):
    """Stopped at a checkpoint and resumed, a run over the store ends with the weights and eval of an unbroken one."""
    monkeypatch.setattr(store_module, "STREAM_BYTES", 0)
    common = dict(scheduler="constant", save_steps=3)
    whole = run(root, tmp_path / "whole", max_steps=6, **common)
    run(root, tmp_path / "cut", max_steps=3, **common)
    resumed = run(root, tmp_path / "cut", max_steps=6, resume="latest", **common)
    assert resumed["steps"] == 6 and resumed["final_eval"] == whole["final_eval"]
    a = load_file(tmp_path / "whole" / "final" / "model.safetensors")
    b = load_file(tmp_path / "cut" / "final" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def glob_of(folder: Path, *parts: list[dict]) -> str:
    """PARTS as Parquet files p-0, p-1, ... in FOLDER; the glob that names them."""
    folder.mkdir()
    for i, part in enumerate(parts):
        pq.write_table(pa.Table.from_pylist(part), folder / f"p-{i}.parquet")
    return str(folder / "p-*.parquet")


def test_a_reused_store_still_names_a_globs_file_and_row(root, tmp_path, monkeypatch):
    """Label errors come after encoding, on every run: from a reused store too they name the glob's file and its own
    row."""
    monkeypatch.setattr(store_module, "STREAM_BYTES", 0)
    rows = sentiment_rows(30, seed=6)
    for r in rows[12:]:  # the second file's labels are numbers (a Parquet column has one type)
        r["label"] = 1.5
    parts = glob_of(tmp_path / "parts", rows[:12], rows[12:])
    for _ in range(2):  # encoded into the store, then read back from it
        with pytest.raises(DataError, match=r"mixed label types: name \(.*p-0.parquet, row 0\) and float "
                                            r"\(.*p-1.parquet, row 0\)"):
            preflight(config(root, parts))


# every other task through the store: (task, train, eval (None: a held-out fraction), options); the tasks whose
# held-out split is picked from the example count alone (QA's examples) hold out from the store as from the list
STREAMED = {
    "token-classification": ("token-classification", "ner.jsonl", "ner.jsonl", {}),
    "question-answering": ("question-answering", "qa.jsonl", None,
                           {"max_length": 32, "doc_stride": 8, "eval_fraction": 0.25}),
    "question-answering squad-json": ("question-answering", "squad.json", None,
                                      {"max_length": 32, "doc_stride": 8, "eval_fraction": 0.25}),
    "question-answering parquet": ("question-answering", "qa.parquet", "qa.jsonl",
                                   {"max_length": 32, "doc_stride": 8}),
    "fill-mask": ("fill-mask", "mlm.txt", "mlm.txt", {}),
    "sentence-embedding": ("sentence-embedding", str(EXAMPLES / "embed_train.jsonl"),
                           str(EXAMPLES / "embed_eval.jsonl"), {}),
    "text-ranking": ("text-ranking", str(EXAMPLES / "rerank_train.jsonl"), str(EXAMPLES / "rerank_eval.jsonl"), {}),
    "text-ranking scored-rows": ("text-ranking", "rank_rows.jsonl", str(EXAMPLES / "rerank_eval.jsonl"),
                                 {"loss": "listwise"}),
    "multiple-choice": ("multiple-choice", "choices.jsonl", "choices.jsonl", {}),
}


@pytest.mark.parametrize("case", STREAMED)
def test_each_task_trains_from_the_store_like_the_list(root, tmp_path, monkeypatch, cache, case):
    """Each task's reader yields chunks into collect(): forced onto the store (STREAM_BYTES = 0), the same
    fine-tune (fp32, same seed, length grouping) ends with identical weights and eval metrics."""
    task, train, evaluation, options = STREAMED[case]
    values = dict(task=task, eval=str(root / evaluation) if evaluation else None, lr=1e-3, max_steps=4,
                  eval_strategy="steps", eval_steps=4, group_by_length=True, **options)

    def fine_tune(out: Path) -> dict:
        return finetune(config(root, train, output_dir=str(out), **values), progress=False)

    listed = fine_tune(tmp_path / "list")
    assert not (cache / "encoded").exists()
    monkeypatch.setattr(store_module, "STREAM_BYTES", 0)
    pre = preflight(config(root, train, output_dir=str(tmp_path / "pre"), **values))
    assert isinstance(pre.data.train, StoredExamples) and len(pre.data.train) > 0
    stored = fine_tune(tmp_path / "store")
    assert listed["final_eval"] and stored["final_eval"] == listed["final_eval"]
    a = load_file(tmp_path / "list" / "final" / "model.safetensors")
    b = load_file(tmp_path / "store" / "final" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not (cache / "spill").exists() or not any((cache / "spill").iterdir())  # gathered rows removed


@pytest.mark.parametrize("spill", [False, True])
@pytest.mark.parametrize("layout", ["interleaved", "sorted"])
def test_gathered_groups_rows_by_key_in_first_row_order(cache, spill, layout, monkeypatch):
    """Rows gathered by key (train/grouped.py), in memory or spilled to disk, a file sorted by key or not: a list per
    key in the order of its first row, each in row order; nothing left in the spill folder, also after an error; a
    folder a killed process left there is removed, a running one's kept."""
    monkeypatch.setattr(grouped, "SPILL_ROWS", 7)
    gone = subprocess.Popen(["true"])
    gone.wait()
    for pid in (gone.pid, os.getpid()):  # what a killed process left (removed), what a live one uses (kept)
        (cache / "spill" / f"rows-{pid}-x" / "rows").mkdir(parents=True)
    rng = random.Random(4)
    keys = [rng.randrange(9) for _ in range(100)]
    if layout == "sorted":
        keys.sort(key=lambda k: (k + 5) % 9)  # grouped, the groups not in key order
    rows = [(k, [f"row {i}", k, i * 0.5]) for i, k in enumerate(keys)]
    want: dict[int, list] = {}
    for k, value in rows:
        want.setdefault(k, []).append(value)
    assert list(grouped.gathered(iter(rows), spill)) == list(want.values())

    def broken():
        yield from rows[:20]
        raise DataError("row 20 is bad")

    with pytest.raises(DataError, match="row 20 is bad"):
        list(grouped.gathered(broken(), spill))
    kept = {p.name for p in (cache / "spill").iterdir()}
    assert kept == ({f"rows-{os.getpid()}-x"} if spill else {f"rows-{gone.pid}-x", f"rows-{os.getpid()}-x"})


def test_ranking_rows_are_gathered_with_bounded_memory(root, tmp_path, cache, monkeypatch):
    """(query, text, label) rows of a large source, a query's rows spread over the file: reading its groups holds
    one group and a chunk of rows, not the file's text (the whole read held every row before its first group)."""
    monkeypatch.setattr(store_module, "STREAM_BYTES", 0)
    monkeypatch.setattr(grouped, "SPILL_ROWS", 64)
    rng = random.Random(7)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    rows = [{"query": f"query {i % 50}", "text": " ".join(rng.choice(words) for _ in range(60)), "label": i % 2}
            for i in range(3000)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = config(root, str(path), task="text-ranking")
    tracemalloc.start()
    try:
        sizes = [len(g.texts) for g in read_groups(Source(path), cfg)]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert sizes == [60] * 50
    assert peak < path.stat().st_size / 4, (peak, path.stat().st_size)


@pytest.mark.parametrize("task, rows, bad, fragment", [
    ("question-answering", qa_rows(12, 2), ("answers", {"text": ["red"], "answer_start": [0]}),
     r"p-1.parquet, row 2, field 'answers': answer_start 0 does not match the text"),
    ("text-ranking", scored_rows(EXAMPLES / "rerank_eval.jsonl")[:12], ("label", 1.5),
     r"p-1.parquet, row 2, field 'label': label 1.5 is outside score_range"),
])
def test_a_globs_errors_name_the_file_and_row_from_the_store_path(root, tmp_path, monkeypatch, task, rows, bad,
                                                                   fragment):
    """QA and ranking rows forced onto the store path still name the glob's file and its own row."""
    monkeypatch.setattr(store_module, "STREAM_BYTES", 0)
    rows[8][bad[0]] = bad[1]  # the second file's row 2
    parts = glob_of(tmp_path / "parts", rows[:6], rows[6:])
    with pytest.raises(DataError, match=fragment):
        preflight(config(root, parts, task=task, max_length=32, doc_stride=8))
