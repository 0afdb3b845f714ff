"""Training data from Parquet (one file or a glob), Arrow IPC (file and stream format) and datasets' save_to_disk
folders (Dataset and DatasetDict with splits): each encodes exactly as the same rows in JSONL, trains, and a bad
source (missing column, missing split, wrong type) is an error naming file, split, row and field before training.
Over HTTP the same sources go by path, confined to the allowed dirs; without pyarrow the error says what to install."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hfport.formats.tables import Source
from hfport.train.config import FinetuneConfig
from hfport.train.data import DataError, read_records
from hfport.train.loop import finetune
from hfport.train.preflight import preflight
from tests.test_finetune_tasks import write_jsonl
from tests.tiny import save_with_tokenizer

WORDS = {"positive": ["great", "wonderful", "lovely"], "negative": ["awful", "terrible", "dreadful"]}


def sentiment_rows(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        label = rng.choice(["negative", "positive"])
        thing = rng.choice(["film", "plot", "ending"])
        filler = " ".join(rng.choice(["and", "so", "then"]) for _ in range(rng.randint(0, 6)))
        rows.append({"text": f"the {thing} was {rng.choice(WORDS[label])} {filler}".strip(),
                     "pair": f"a remark about the {thing}", "label": label})
    return rows


def write_arrow(path: Path, rows: list[dict[str, Any]], stream: bool) -> Path:
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(path), "wb") as sink:
        writer = pa.ipc.new_stream if stream else pa.ipc.new_file
        with writer(sink, table.schema) as w:
            for batch in table.to_batches(max_chunksize=7):  # several batches: rows are numbered across them
                w.write_batch(batch)
    return path


@pytest.fixture(scope="module")
def root(tmp_path_factory, minilm_path) -> Path:
    """A tiny random BERT with MiniLM's tokenizer; the same train/eval rows in every source kind."""
    root = tmp_path_factory.mktemp("sources")
    save_with_tokenizer("bert", "base", root / "model", minilm_path, vocab_size=30522)
    train, evaluation = sentiment_rows(40, seed=0), sentiment_rows(16, seed=1)
    write_jsonl(root / "train.jsonl", train)
    write_jsonl(root / "eval.jsonl", evaluation)
    pq.write_table(pa.Table.from_pylist(train), root / "train.parquet", row_group_size=9)
    pq.write_table(pa.Table.from_pylist(evaluation), root / "eval.parquet")
    (root / "parts").mkdir()
    for i, part in enumerate((train[:15], train[15:])):
        pq.write_table(pa.Table.from_pylist(part), root / "parts" / f"train-{i}.parquet")
    write_arrow(root / "train.arrow", train, stream=True)
    write_arrow(root / "eval.arrow", evaluation, stream=False)
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(train),
                                   "validation": datasets.Dataset.from_list(evaluation),
                                   "test": datasets.Dataset.from_list(evaluation[:4])})
    splits.save_to_disk(str(root / "dsdict"), num_shards={"train": 3, "validation": 1, "test": 1})
    datasets.Dataset.from_list(train).save_to_disk(str(root / "ds_train"))
    return root


SOURCES = {  # kind: (train, eval, extra options)
    "parquet": ("train.parquet", "eval.parquet", {}),
    "parquet glob": ("parts/train-*.parquet", "eval.parquet", {}),
    "arrow": ("train.arrow", "eval.arrow", {}),
    "DatasetDict": ("dsdict", "dsdict", {}),
    "Dataset": ("ds_train", "dsdict", {"eval_split": "validation"}),
}


def config(root: Path, train: str, evaluation: str | None, **options: Any) -> FinetuneConfig:
    return FinetuneConfig(model=str(root / "model"), train=str(root / train),
                          eval=str(root / evaluation) if evaluation else None, output_dir=str(root / "runs" / "x"),
                          max_length=32, batch_size=8, seed=3, **options)


def encoded(pre: Any) -> list[tuple[Any, ...]]:
    return [(list(x.input_ids), list(x.token_type_ids or []), x.target) for x in pre.data.train + pre.data.eval]


@pytest.mark.parametrize("kind", SOURCES)
@pytest.mark.parametrize("pair", [False, True])
def test_each_source_encodes_like_jsonl(root, kind, pair):
    train, evaluation, options = SOURCES[kind]
    extra = {"text_pair_column": "pair"} if pair else {}
    want = preflight(config(root, "train.jsonl", "eval.jsonl", **extra))
    got = preflight(config(root, train, evaluation, **options, **extra))
    assert len(got.data.train) == 40 and len(got.data.eval) == 16
    assert encoded(got) == encoded(want)
    assert got.data.space == want.data.space
    # without eval: the same seeded held-out fraction as the JSONL's
    held_want = preflight(config(root, "train.jsonl", None, **extra))
    held_got = preflight(config(root, train, None, **options, **extra))
    assert encoded(held_got) == encoded(held_want)


def test_rows_are_numbered_across_batches_files_and_shards(root):
    """A row kind's positions are rows from 0, counted across record batches, row groups, a glob's files and a
    split's shards (what ds[split][i] is); locate() maps a glob's position back to its file and its own row."""
    jsonl = [r.values for r in read_records(root / "train.jsonl")]
    for given, split in (("train.parquet", "train"), ("train.arrow", "train"), ("dsdict", "train"),
                         ("parts/train-*.parquet", "train"), ("dsdict", "test")):
        source = Source(root / given, split)
        records = read_records(source)
        assert [r.line for r in records] == list(range(len(records)))
        if split == "train":
            assert [r.values for r in records] == jsonl
    glob = Source(root / "parts/train-*.parquet")
    read_records(glob)
    assert glob.locate(3) == f"{root / 'parts/train-0.parquet'}, row 3"
    assert glob.locate(17) == f"{root / 'parts/train-1.parquet'}, row 2"
    assert Source(root / "dsdict", "test").locate(2) == f"{root / 'dsdict'} (split 'test'), row 2"


@pytest.mark.parametrize("kind", ["DatasetDict", "parquet glob"])
def test_a_source_trains(root, kind, tmp_path):
    train, evaluation, options = SOURCES[kind]
    run = config(root, train, evaluation, **options).model_copy(update={"output_dir": str(tmp_path / "run"),
                                                                        "max_steps": 3, "lr": 1e-3})
    summary = finetune(run, progress=False)
    assert summary["steps"] == 3 and summary["train_examples"] == 40 and summary["eval_examples"] == 16
    assert (tmp_path / "run" / "best" / "config.json").is_file()
    assert "eval_accuracy" in summary["final_eval"]


# --- bad input: errors name file, split, row and field, before anything is written ------------------------------


def refused(root: Path, train: str, evaluation: str | None = None, **options: Any) -> str:
    run = config(root, train, evaluation, **options)
    with pytest.raises(DataError) as info:
        finetune(run, progress=False)
    assert not Path(run.output_dir).exists()  # refused before training: no run folder
    return str(info.value)


def test_parquet_missing_a_column(root, tmp_path):
    rows = [{"text": r["text"]} for r in sentiment_rows(20, seed=4)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "nolabel.parquet")
    message = refused(root, str(tmp_path / "nolabel.parquet"))
    assert message.startswith(f"{tmp_path / 'nolabel.parquet'}, row 0, field 'label': missing; the row has ['text']. "
                              "text-classification reads text, label")


def test_dataset_folder_without_the_split(root):
    message = refused(root, "dsdict", "dsdict", eval_split="dev")
    assert message == (f"{root / 'dsdict'}: the DatasetDict has no split 'dev'; its splits are "
                       "['train', 'validation', 'test'] (choose one with eval_split (--eval-split))")
    message = refused(root, "dsdict", train_split="training")
    assert "no split 'training'; its splits are ['train', 'validation', 'test']" in message
    assert "train_split (--train-split)" in message


def test_a_column_of_the_wrong_type(root, tmp_path):
    rows = sentiment_rows(30, seed=5)
    numbers = [{**r, "text": i} for i, r in enumerate(rows)]  # a text column of ints (Arrow: one type a column)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows), "validation": datasets.Dataset.from_list(
        numbers)}).save_to_disk(str(tmp_path / "bad"))
    message = refused(root, str(tmp_path / "bad"), str(tmp_path / "bad"))
    assert message == f"{tmp_path / 'bad'} (split 'validation'), row 0, field 'text': expected non-empty text, got 0"
    # a glob names the file and its own row; a null is named as None
    (tmp_path / "parts").mkdir()
    pq.write_table(pa.Table.from_pylist(rows[:10]), tmp_path / "parts" / "a.parquet")
    nulls = [{**r, "label": None if i == 4 else r["label"]} for i, r in enumerate(rows[10:20])]
    pq.write_table(pa.Table.from_pylist(nulls), tmp_path / "parts" / "b.parquet")
    message = refused(root, str(tmp_path / "parts" / "*.parquet"))
    assert message == f"{tmp_path / 'parts' / 'b.parquet'}, row 4, field 'label': unusable label None"


def test_sources_that_are_not_data(root, tmp_path):
    (tmp_path / "folder").mkdir()
    assert "not one datasets' save_to_disk wrote (no dataset_dict.json or state.json)" in refused(
        root, str(tmp_path / "folder"))
    assert refused(root, str(tmp_path / "*.parquet")) == f"{tmp_path / '*.parquet'}: the pattern matches no file"
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really")
    assert "broken.parquet: not a readable Parquet file" in refused(root, str(tmp_path / "broken.parquet"))
    (tmp_path / "broken.arrow").write_bytes(b"\x00" * 16)
    assert "broken.arrow: not an Arrow IPC file or stream" in refused(root, str(tmp_path / "broken.arrow"))
    whole = write_arrow(tmp_path / "cut.arrow", sentiment_rows(40, seed=9), stream=True).read_bytes()
    (tmp_path / "cut.arrow").write_bytes(whole[:int(len(whole) * 0.6)])  # stops in the 4th batch of 7 rows
    assert ", row 21: the file cannot be read on from here" in refused(root, str(tmp_path / "cut.arrow"))
    flags = [{**r, "label": i % 2 == 0} for i, r in enumerate(sentiment_rows(20, seed=10))]
    write_jsonl(tmp_path / "b.jsonl", [{**r, "label": 0} for r in flags[:3]] + flags[3:])  # False == 0: kept apart
    assert refused(root, str(tmp_path / "b.jsonl")).endswith("line 4, field 'label': unusable label False")
    (tmp_path / "data.xlsx").write_bytes(b"x")
    assert "unknown data format '.xlsx'" in refused(root, str(tmp_path / "data.xlsx"))


def test_without_pyarrow_the_error_says_what_to_install(root, monkeypatch):
    for name in ("pyarrow", "pyarrow.parquet", "pyarrow.ipc"):
        monkeypatch.setitem(sys.modules, name, None)  # `import pyarrow` now raises ImportError
    message = refused(root, "train.parquet")
    assert message == (f"{root / 'train.parquet'}: reading Parquet needs pyarrow, which is not installed; "
                       "pip install 'hfport[data]' (pyarrow and datasets)")
    assert "reading Arrow needs pyarrow" in refused(root, "dsdict")
    assert len(read_records(root / "train.jsonl")) == 40  # CSV/JSONL need nothing more


# --- HTTP: the same sources by path, confined to the allowed dirs ----------------------------------------------


def test_finetune_job_takes_sources_by_path(root, tmp_path):
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.settings import Settings

    app = create_app(Settings(data_dir=tmp_path / "d", allowed_dirs=[root]), run_worker=False)
    base = {"model": str(root / "model"), "max_length": 32, "batch_size": 8, "max_steps": 2}
    with TestClient(app) as c:
        r = c.post("/jobs/finetune", json={"config": {**base, "train": str(root / "dsdict"),
                                                      "eval": str(root / "dsdict"), "eval_split": "test"}})
        assert r.status_code == 202, r.text
        stored = c.get(f"/jobs/{r.json()['id']}").json()["config"]
        assert (stored["train"], stored["train_split"], stored["eval_split"]) == (
            str(root / "dsdict"), "train", "test")
        r = c.post("/jobs/finetune", json={"config": {**base, "train": str(root / "parts" / "train-*.parquet")}})
        assert r.status_code == 202, r.text
        assert c.get(f"/jobs/{r.json()['id']}").json()["config"]["train"] == str(root / "parts" / "train-*.parquet")
        r = c.post("/jobs/finetune", json={"config": {**base, "train": str(root / "dsdict"), "train_split": "dev"}})
        assert r.status_code == 422 and r.json()["error_type"] == "DataError", r.text
        assert "no split 'dev'; its splits are ['train', 'validation', 'test']" in r.json()["error"]
        outside = tmp_path / "outside"
        outside.mkdir()
        pq.write_table(pa.Table.from_pylist(sentiment_rows(20, 6)), outside / "x.parquet")
        for path in (outside, outside / "*.parquet"):
            r = c.post("/jobs/finetune", json={"config": {**base, "train": str(path)}})
            assert r.status_code == 403 and r.json()["error_type"] == "PathNotAllowed", r.text
        # a glob's match, or a file in a datasets folder, that leads out
        for link, train in ((root / "parts" / "escape.parquet", root / "parts" / "*.parquet"),
                            (root / "dsdict" / "train" / "escape.arrow", root / "dsdict")):
            link.symlink_to(outside / "x.parquet")
            try:
                r = c.post("/jobs/finetune", json={"config": {**base, "train": str(train)}})
                assert r.status_code == 403 and r.json()["error_type"] == "PathNotAllowed", r.text
            finally:
                link.unlink()


def test_other_tasks_read_the_same_sources(root, tmp_path):
    """Token classification from a DatasetDict whose tags are ClassLabel ids (as datasets' NER sets keep them)
    encodes as the same rows in JSONL, its tags named by the ClassLabel's names (JSONL's ids name themselves)."""
    rng = random.Random(8)
    rows = [{"tokens": [rng.choice(["John", "lives", "in", "Paris", "today"]) for _ in range(rng.randint(2, 7))]}
            for _ in range(24)]
    for r in rows:
        r["tags"] = [1 if t in ("John", "Paris") else 0 for t in r["tokens"]]
    write_jsonl(tmp_path / "ner.jsonl", rows)
    features = datasets.Features({"tokens": datasets.Sequence(datasets.Value("string")),
                                  "tags": datasets.Sequence(datasets.ClassLabel(names=["O", "B-X"]))})
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows, features=features)}).save_to_disk(
        str(tmp_path / "ner"))
    options = {"task": "token-classification", "eval_fraction": 0.25}
    want = preflight(config(root, str(tmp_path / "ner.jsonl"), None, **options))
    got = preflight(config(root, str(tmp_path / "ner"), None, **options))
    assert len(got.data.train) == 18 and encoded(got) == encoded(want)
    assert got.data.space.id2label == {0: "O", 1: "B-X"} and want.data.space.id2label == {0: "0", 1: "1"}


def test_cli_split_options(root):
    from typer.testing import CliRunner

    from hfport.cli import app

    result = CliRunner().invoke(app, ["finetune", "--model", str(root / "model"), "--train", str(root / "dsdict"),
                                      "--eval", str(root / "dsdict"), "--eval-split", "test", "--print-config"])
    assert result.exit_code == 0, result.output
    shown = {line.split()[0]: line.split()[1] for line in result.stdout.splitlines()}
    assert shown["train_split"] == '"train"' and shown["eval_split"] == '"test"'


def test_classlabel_names_become_the_labels(root, tmp_path):
    """A ClassLabel column's names (datasets keeps them in the schema's metadata: save_to_disk folders, Parquet and
    Arrow it writes) name the label ids, every class included (also one no training row uses); a number stays an id
    when the classes are named by digits (star ratings)."""
    rows = sentiment_rows(24, seed=11)
    stars = datasets.ClassLabel(names=["1", "2", "3"])
    features = datasets.Features({"text": datasets.Value("string"), "pair": datasets.Value("string"),
                                  "label": stars})
    ids = [{**r, "label": 1 + (r["label"] == "positive")} for r in rows]  # ids 1 and 2: class "1" never occurs
    ds = datasets.Dataset.from_list(ids, features=features)
    ds.save_to_disk(str(tmp_path / "stars"))
    ds.to_parquet(str(tmp_path / "stars.parquet"))
    for given in ("stars", "stars.parquet"):
        pre = preflight(config(root, str(tmp_path / given), None, eval_fraction=0.25))
        assert pre.data.space.id2label == {0: "1", 1: "2", 2: "3"}, given
        targets = sorted(x.target for x in pre.data.train + pre.data.eval)
        assert targets == sorted(r["label"] for r in ids), given  # ids as written, not looked up as names
    assert Source(tmp_path / "stars").class_names("text") is None
    assert Source(root / "train.jsonl").class_names("label") is None
