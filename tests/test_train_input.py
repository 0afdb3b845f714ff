"""What users actually feed a fine-tune: files as Excel, pandas and datasets write them. Each is read as it means,
or refused before training with an error naming file, line (row) and field; never trained into a silent wrong model.

- a target no model can learn (NaN or infinite: CSV "nan", JSONL NaN/Infinity, a Parquet float NaN; a blank label
  cell, which would be a class named '') is refused, for every task that reads a label or a score;
- a source's ClassLabel ids are its own classes: an eval source that lists them in another order (a datasets folder
  or split, Parquet written by datasets) is mapped to the training labels by name, and a class the training labels
  lack is refused;
- a UTF-8 byte-order mark (Excel's "CSV UTF-8") is read past; UTF-16 is refused saying so;
- the encoded-examples cache notices a file rewritten in place with the same size and modification time.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import hfport
import hfport.settings
from hfport.errors import ConfigError
from hfport.formats.tables import DIGEST_BLOCK, DIGEST_BLOCKS, Source, content_digest
from hfport.train.config import read_config_file
from hfport.train.data import DataError
from hfport.train.preflight import preflight
from hfport.train import stored as store_module
from hfport.train.stored import StoredExamples

TEXTS = ["the film was great", "an awful plot", "a lovely ending", "a dreadful cast", "what a wonderful score",
         "terrible pacing", "great acting", "awful dialogue"]
NAMES = ["negative", "positive"]
SENTIMENT = [1, 0, 1, 0, 1, 0, 1, 0]  # TEXTS' classes as ids of NAMES


def sentiment_names() -> list[str]:
    return [NAMES[i] for i in SENTIMENT]


def write_csv(path: Path, header: list[str], rows: list[list[Any]], encoding: str = "utf-8",
              delimiter: str = ",") -> Path:
    with open(path, "w", encoding=encoding, newline="") as f:
        writer = csv.writer(f, delimiter=delimiter)
        writer.writerow(header)
        writer.writerows(rows)
    return path


def write_jsonl(path: Path, rows: list[dict[str, Any]], encoding: str = "utf-8") -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding=encoding)  # json writes NaN as NaN
    return path


def options(model: Path, train: Path | str, evaluation: Path | str | None = None, **extra: Any) -> dict[str, Any]:
    return {"model": str(model), "train": str(train), "eval": str(evaluation) if evaluation else None,
            "output_dir": "unused", "max_length": 16, "batch_size": 2, **extra}


# --- 2. targets no model can learn ----------------------------------------------------------------------------


def rows_with(label_at_4: Any, others: list[Any]) -> list[dict[str, Any]]:
    labels = list(others)
    labels[3] = label_at_4
    return [{"text": t, "label": v} for t, v in zip(TEXTS, labels)]


FLOATS = [0.5, 1.5, 2.0, 0.0, 3.5, 1.0, 2.5, 0.25]  # regression targets
CLASSES = ["pos", "neg", "pos", "neg", "pos", "neg", "pos", "neg"]


@pytest.mark.parametrize("kind, bad, others, message", [
    ("csv", "nan", FLOATS, r"'nan' is not a finite number"),
    ("csv", "NaN", FLOATS, r"'NaN' is not a finite number"),
    ("csv", "inf", FLOATS, r"'inf' is not a finite number"),
    ("csv", "-Infinity", FLOATS, r"'-Infinity' is not a finite number"),
    ("csv", "", CLASSES, r"the label is blank \(''\)"),
    ("csv", "  ", CLASSES, r"the label is blank"),
    ("jsonl", float("nan"), FLOATS, r"nan is not a finite number"),
    ("jsonl", float("inf"), FLOATS, r"inf is not a finite number"),
    ("jsonl", float("nan"), [0, 1, 1, 0, 1, 0, 0, 1], r"nan is not a finite number"),  # ids: would be regression
    ("jsonl", "", CLASSES, r"the label is blank"),
    ("jsonl", ["pos", ""], [["pos"], ["neg"]] * 4, r"item 1 of the list, '', is not a label name"),
    ("jsonl", ["pos", None], [["pos"], ["neg"]] * 4, r"item 1 of the list, None, is not a label name"),
    ("parquet", float("nan"), FLOATS, r"nan is not a finite number"),
])
def test_a_target_no_model_can_learn_is_refused_naming_file_line_and_field(tiny_bert, tmp_path, kind, bad, others,
                                                                           message):
    rows = rows_with(bad, others)
    if kind == "csv":
        path, at = write_csv(tmp_path / "train.csv", ["text", "label"], [[r["text"], r["label"]] for r in rows]), \
            "line 5"
    elif kind == "jsonl":
        path, at = write_jsonl(tmp_path / "train.jsonl", rows), "line 4"
    else:
        path, at = tmp_path / "train.parquet", "row 3"
        pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(DataError, match=rf"^{path}, {at}, field 'label': {message}"):
        preflight(options(tiny_bert, path))


def test_an_eval_target_no_model_can_learn_is_refused(tiny_bert, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", rows_with(1.0, FLOATS))
    evaluation = write_jsonl(tmp_path / "eval.jsonl", rows_with(float("nan"), FLOATS))
    with pytest.raises(DataError, match=rf"^{evaluation}, line 4, field 'label': nan is not a finite number"):
        preflight(options(tiny_bert, train, evaluation))
    with pytest.raises(DataError, match=r"eval.csv, line 5, field 'label': 'inf' is not a finite number"):
        preflight(options(tiny_bert, train, write_csv(tmp_path / "eval.csv", ["text", "label"],
                                                      [[r["text"], r["label"]] for r in rows_with("inf", FLOATS)]),
                          problem_type="regression"))


@pytest.mark.parametrize("task, row, column", [
    ("text-ranking", {"query": "q", "text": "t", "label": float("nan")}, "label"),
    ("sentence-embedding", {"sentence1": "a", "sentence2": "b", "score": float("nan")}, "score"),
    ("sentence-embedding", {"sentence1": "a", "sentence2": "b", "score": "Infinity"}, "score"),
])
def test_a_score_no_model_can_learn_is_refused(tiny_bert, tmp_path, task, row, column):
    good = {k: (0.5 if k == column else v) for k, v in row.items()}
    path = write_jsonl(tmp_path / "train.jsonl", [good, good, row, good])
    with pytest.raises(DataError, match=rf"^{path}, line 3, field '{column}': {column} .* is not a finite number"):
        preflight(options(tiny_bert, path, task=task, score_range=[-1e300, 1e300]))


@pytest.mark.parametrize("task, row, column, message", [
    ("token-classification", {"tokens": ["a", "b"], "tags": ["O", float("nan")]}, "tags", r"tag 1 must be a name or"),
    ("token-classification", {"tokens": ["a", "b"], "tags": ["O", ""]}, "tags", r"tag 1 must be a name or"),
    ("multiple-choice", {"context": "c", "choices": ["x", "y"], "label": float("nan")}, "label",
     r"expected the index of the right choice"),
    ("question-answering", {"question": "q?", "context": "abc", "answers": {"text": ["b"],
                                                                             "answer_start": [float("nan")]}},
     "answers", r"answer_start an integer"),
])
def test_the_other_targets_refuse_nan_and_blanks_too(tiny_bert, tmp_path, task, row, column, message):
    """Tags, choice indices and answer starts are names or integers, so a NaN or a blank never gets in (refused on
    main too: this keeps it so)."""
    good = {"token-classification": {"tokens": ["a", "b"], "tags": ["O", "B-X"]},
            "multiple-choice": {"context": "c", "choices": ["x", "y"], "label": 1},
            "question-answering": {"question": "q?", "context": "abc", "answers": {"text": ["b"],
                                                                                    "answer_start": [1]}}}[task]
    path = write_jsonl(tmp_path / "train.jsonl", [good, good, row, good])
    with pytest.raises(DataError, match=rf"^{path}, line 3, field '{column}': .*{message}"):
        preflight(options(tiny_bert, path, task=task, doc_stride=4))


# --- 3. an eval source's own ClassLabel order --------------------------------------------------------------------


def eval_names(checked: Any) -> list[Any]:
    """Each eval example's target named by the run's labels (a list of names for multi-label)."""
    id2label = checked.data.space.id2label
    out = []
    for x in checked.data.eval:
        target = x.target
        out.append([id2label[i] for i, on in enumerate(target) if on] if isinstance(target, list)
                   else id2label[target])
    return out


def classlabel_dataset(texts: list[str], names_of_rows: list[Any], names: list[str], column: str = "label",
                       sequence: bool = False) -> datasets.Dataset:
    """Rows whose `column` holds the ids, in `names`, of the classes `names_of_rows` names."""
    label = datasets.ClassLabel(names=names)
    feature = datasets.Sequence(label) if sequence else label
    ids = [[names.index(n) for n in row] if sequence else names.index(row) for row in names_of_rows]
    return datasets.Dataset.from_dict({"text": texts, column: ids},
                                      features=datasets.Features({"text": datasets.Value("string"), column: feature}))


def save_folder(ds: datasets.Dataset, path: Path) -> Path:
    ds.save_to_disk(str(path))
    return path


def save_parquet(ds: datasets.Dataset, path: Path) -> Path:
    ds.to_parquet(str(path))
    return path


@pytest.mark.parametrize("writer", [save_folder, save_parquet])
def test_an_eval_source_with_its_classes_in_another_order_keeps_its_labels(tiny_bert, tmp_path, writer):
    """The eval source's ClassLabel lists ["positive", "negative"]: read in the training source's id space, every
    eval label would flip (and accuracy read 1 - accuracy)."""
    train = writer(classlabel_dataset(TEXTS, sentiment_names(), NAMES), tmp_path / "train.parquet")
    evaluation = writer(classlabel_dataset(TEXTS, sentiment_names(), NAMES[::-1]), tmp_path / "eval.parquet")
    checked = preflight(options(tiny_bert, train, evaluation))
    assert checked.data.space.id2label == dict(enumerate(NAMES))
    assert eval_names(checked) == sentiment_names()


def test_a_datasetdict_split_with_its_own_class_order_keeps_its_labels(tiny_bert, tmp_path):
    """Each split of a DatasetDict folder has its own features (dataset_info.json): validation's order is its own."""
    splits = datasets.DatasetDict({"train": classlabel_dataset(TEXTS, sentiment_names(), NAMES),
                                   "validation": classlabel_dataset(TEXTS, sentiment_names(), NAMES[::-1])})
    splits.save_to_disk(str(tmp_path / "dsdict"))
    checked = preflight(options(tiny_bert, tmp_path / "dsdict", tmp_path / "dsdict"))
    assert eval_names(checked) == sentiment_names()


def test_an_eval_source_with_names_from_a_table_of_names(tiny_bert, tmp_path):
    """Training labels written as names (JSONL), eval as a datasets ClassLabel: the eval ids are named by their own
    source and found by name."""
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": t, "label": n} for t, n in zip(TEXTS, sentiment_names())])
    evaluation = save_folder(classlabel_dataset(TEXTS, sentiment_names(), NAMES[::-1]), tmp_path / "eval")
    assert eval_names(preflight(options(tiny_bert, train, evaluation))) == sentiment_names()


def test_an_eval_class_the_training_labels_lack_is_refused(tiny_bert, tmp_path):
    train = save_folder(classlabel_dataset(TEXTS, sentiment_names(), NAMES), tmp_path / "train")
    names = sentiment_names()
    names[2] = "neutral"
    evaluation = save_folder(classlabel_dataset(TEXTS, names, ["neutral", "positive", "negative"]), tmp_path / "eval")
    with pytest.raises(DataError, match=rf"^{evaluation}, row 2, field 'label': class 'neutral' \(its ClassLabel id 0\) "
                                        r"is not one of the training labels \['negative', 'positive'\]"):
        preflight(options(tiny_bert, train, evaluation))


def test_multi_label_classlabels_are_mapped_by_name(tiny_bert, tmp_path):
    """A sequence of ClassLabels (multi-label): the training labels are the column's class names (not their ids as
    text), and an eval source in another order keeps its labels."""
    rows = [["sport"], ["news", "sport"], ["art"], ["news"], ["art", "sport"], ["news"], ["sport"], ["art"]]
    train = save_folder(classlabel_dataset(TEXTS, rows, ["art", "news", "sport"], sequence=True), tmp_path / "train")
    evaluation = save_folder(classlabel_dataset(TEXTS, rows, ["sport", "art", "news"], sequence=True),
                             tmp_path / "eval")
    checked = preflight(options(tiny_bert, train, evaluation))
    assert checked.data.space.problem_type == "multi_label_classification"
    assert checked.data.space.id2label == {0: "art", 1: "news", 2: "sport"}
    assert eval_names(checked) == [sorted(r) for r in rows]


def test_token_tags_of_an_eval_source_in_another_order_keep_their_names(tiny_bert, tmp_path):
    tags = ["O", "B-PER", "I-PER"]
    sentences = [(["anna", "smith", "sings"], ["B-PER", "I-PER", "O"]), (["it", "rains"], ["O", "O"]),
                 (["bob", "runs"], ["B-PER", "O"]), (["we", "saw", "carl"], ["O", "O", "B-PER"])]

    def folder(names: list[str], path: Path) -> Path:
        feature = datasets.Features({"tokens": datasets.Sequence(datasets.Value("string")),
                                     "tags": datasets.Sequence(datasets.ClassLabel(names=names))})
        return save_folder(datasets.Dataset.from_dict(
            {"tokens": [s for s, _ in sentences], "tags": [[names.index(t) for t in ts] for _, ts in sentences]},
            features=feature), path)

    checked = preflight(options(tiny_bert, folder(tags, tmp_path / "train"), folder(tags[::-1], tmp_path / "eval"),
                                task="token-classification"))
    id2label = checked.data.space.id2label
    assert id2label == dict(enumerate(tags))
    got = [[id2label[t] for t in x.target if t != -100] for x in checked.data.eval]
    assert got == [ts for _, ts in sentences]


# --- 4. byte-order marks --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["csv", "tsv", "jsonl"])
def test_utf8_with_a_byte_order_mark_is_read(tiny_bert, tmp_path, kind):
    """Excel's "CSV UTF-8" and Windows editors start the file with U+FEFF: the first column is still 'text'."""
    rows = [{"text": t, "label": n} for t, n in zip(TEXTS, sentiment_names())]
    if kind == "jsonl":
        plain, marked = (write_jsonl(tmp_path / f"{name}.jsonl", rows, encoding) for name, encoding in
                         (("plain", "utf-8"), ("marked", "utf-8-sig")))
    else:
        delimiter = "," if kind == "csv" else "\t"
        plain, marked = (write_csv(tmp_path / f"{name}.{kind}", ["text", "label"],
                                   [[r["text"], r["label"]] for r in rows], encoding, delimiter)
                         for name, encoding in (("plain", "utf-8"), ("marked", "utf-8-sig")))
    assert marked.read_bytes().startswith(b"\xef\xbb\xbf")
    want, got = preflight(options(tiny_bert, plain)), preflight(options(tiny_bert, marked))
    assert [(list(x.input_ids), x.target) for x in got.data.train] == \
        [(list(x.input_ids), x.target) for x in want.data.train]


def test_conll_and_config_files_with_a_byte_order_mark_are_read(tiny_bert, tmp_path):
    encoded = []
    for name, encoding in (("plain", "utf-8"), ("marked", "utf-8-sig")):
        conll = tmp_path / f"{name}.conll"
        conll.write_text("anna B-PER\nsings O\n\nbob B-PER\nruns O\n", encoding=encoding)
        checked = preflight(options(tiny_bert, conll, task="token-classification", eval_fraction=0.0))
        assert sorted(checked.data.space.id2label.values()) == ["B-PER", "O"]
        encoded.append([(list(x.input_ids), x.target) for x in checked.data.train])
    assert encoded[1] == encoded[0]  # the first word is "anna", not "\ufeffanna"
    for name, text in (("run.yaml", "learning_rate: 0.001\n"), ("run.json", '{"learning_rate": 0.001}')):
        (tmp_path / name).write_text(text, encoding="utf-8-sig")
        assert read_config_file(tmp_path / name) == {"learning_rate": 0.001}


def test_utf16_is_refused_saying_so(tiny_bert, tmp_path):
    path = write_csv(tmp_path / "train.csv", ["text", "label"], [[t, 1] for t in TEXTS], encoding="utf-16")
    with pytest.raises(DataError, match=rf"^{path}, line 1: UTF-16 .*save it as UTF-8"):
        preflight(options(tiny_bert, path))


# --- 6. the encoded-examples cache and in-place rewrites ---------------------------------------------------------


def test_a_file_rewritten_in_place_with_the_same_size_and_time_is_encoded_again(tiny_bert, tmp_path, monkeypatch):
    hfport.settings.use(cache_dir=tmp_path / "cache")
    monkeypatch.setattr(store_module, "STREAM_BYTES", 0)  # every source goes to the store
    path = tmp_path / "train.csv"
    labels = sentiment_names()
    write_csv(path, ["text", "label"], [[t, n] for t, n in zip(TEXTS, labels)])
    first = preflight(options(tiny_bert, path, eval_fraction=0.0))
    assert isinstance(first.data.train, StoredExamples)
    stat = path.stat()
    swapped = ["positive" if n == "negative" else "negative" for n in labels]  # same lengths: same size
    write_csv(path, ["text", "label"], [[t, n] for t, n in zip(TEXTS, swapped)])
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # a copy that keeps times; a coarse clock
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)
    again = preflight(options(tiny_bert, path, eval_fraction=0.0))
    names = again.data.space.id2label
    assert [names[x.target] for x in again.data.train] == swapped
    assert len(list((tmp_path / "cache" / "encoded").iterdir())) >= 2  # a second store, not the stale one


def test_the_content_digest_samples_a_large_file_and_reads_parquets_footer(tmp_path):
    size = DIGEST_BLOCK * DIGEST_BLOCKS * 4
    path = tmp_path / "big.csv"
    data = bytearray(os.urandom(size))
    path.write_bytes(data)
    before = content_digest(path)
    step = (size - DIGEST_BLOCK) // (DIGEST_BLOCKS - 1)
    for at in (0, size - 1, step * 7 + 5):  # the first block, the last, a sampled one between
        changed = bytearray(data)
        changed[at] ^= 0xFF
        path.write_bytes(changed)
        assert content_digest(path) != before, at
    # a Parquet file's footer is read whole, wherever its row groups' statistics end up
    table = pa.Table.from_pylist([{"text": os.urandom(64).hex(), "label": i % 7} for i in range(40000)])
    parquet = tmp_path / "big.parquet"
    pq.write_table(table, parquet, row_group_size=1000)
    kind = Source(parquet).kind
    footer = kind.trailer(open(parquet, "rb"), parquet.stat().st_size)
    assert parquet.stat().st_size > DIGEST_BLOCK * DIGEST_BLOCKS and footer > 8
    raw = bytearray(parquet.read_bytes())
    plain = content_digest(parquet, kind.trailer)
    raw[len(raw) - footer + 1] ^= 0x01  # a byte of the footer's metadata
    parquet.write_bytes(raw)
    assert content_digest(parquet, kind.trailer) != plain


# --- max_length against the model's position table ------------------------------------------------------------


def test_the_default_max_length_is_lowered_to_the_models_positions(tiny_bert, tmp_path):
    """tiny_bert holds 128 positions; the default max_length is 256. A 300-word text was cut at 256 tokens and the
    first batch holding it failed inside the embeddings (IndexError); it is cut at 128 now, as transformers' scripts
    cut max_seq_length at the model's length."""
    long_text = " ".join(["word"] * 300)
    path = write_jsonl(tmp_path / "train.jsonl", [{"text": t, "label": i % 2}
                                                  for i, t in enumerate([long_text, *TEXTS[:7]])])
    opts = {k: v for k, v in options(tiny_bert, path).items() if k != "max_length"}  # the default
    checked = preflight(opts)
    assert checked.config.max_length == 128
    assert max(len(e.input_ids) for e in checked.data.train) == 128
    summary = hfport.finetune({**opts, "output_dir": str(tmp_path / "run"), "max_steps": 2, "eval_strategy": "no",
                               "save_strategy": "no"}, progress=False)
    assert summary["steps"] == 2


def test_a_max_length_above_the_models_positions_is_refused(tiny_bert, tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [{"text": t, "label": i % 2} for i, t in enumerate(TEXTS[:8])])
    with pytest.raises(ConfigError, match=r"max_length 300: the model .* holds 128 positions .*max_length=128"):
        preflight(options(tiny_bert, path, max_length=300))
    assert not (tmp_path / "run").exists()
