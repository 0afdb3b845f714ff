"""What users actually feed a fine-tune: files as Excel, pandas and datasets write them. Each is read as it means,
or refused before training with an error naming file, line (row) and field; never trained into a silent wrong model.

- a UTF-8 byte-order mark (Excel's "CSV UTF-8") is read past; UTF-16 is refused saying so.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest

from hfport.train.config import read_config_file
from hfport.train.data import DataError
from hfport.train.preflight import preflight

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
