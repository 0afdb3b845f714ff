"""SQuAD JSON read a paragraph at a time (hfport/formats/jsonstream.py, hfport/train/tasks/qa.py read_squad): the
same examples in the same order as parsing the file whole, on v1/v2 shapes, keys in any order, any whitespace,
escapes and non-ASCII text, any read block size; the same error for bad input, JSON errors at the file's line and
column; and memory that holds a paragraph, not the document."""

from __future__ import annotations

import json
import random
import re
import tracemalloc
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from hfport.formats import jsonstream
from hfport.formats.jsonstream import JsonStream
from hfport.train.data import DataError
from hfport.train.tasks.qa import Example, read_squad, squad_examples

WORDS = ["river", "Köln", "naïve", "東京", "emoji 🙂", "tab\there", 'quote "q"', "back\\slash", "plain", "ß"]


def read_squad_whole(path: Path) -> Iterator[Example]:
    """The reader as it was before streaming (json.loads on the whole file), kept as the oracle."""
    raw = path.read_bytes()
    try:
        top = json.loads(raw.decode("utf-8-sig"))  # a byte-order mark read past
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 (byte offset {e.start}: {raw[e.start:e.start + 1]!r})") from e
    except json.JSONDecodeError as e:
        raise DataError(f"{path}, line {e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from e
    if not isinstance(top, dict) or not isinstance(top.get("data"), list):
        raise DataError(f"{path}: a SQuAD file is an object with a 'data' list")
    # the same per-question checks (qa.squad_examples) over the paragraphs of the whole parse: what differs is the walk
    yield from squad_examples(((a, p, paragraph) for a, article in enumerate(top["data"])
                               for p, paragraph in enumerate(article.get("paragraphs", [])
                                                             if isinstance(article, dict) else [])), path)


def outcome(reader: Callable[[Path], Iterator[Example]], path: Path) -> tuple[list[Example], str | None]:
    """The examples read and the error that stopped the reading (None: read to the end)."""
    out: list[Example] = []
    try:
        for e in reader(path):
            out.append(e)
    except DataError as e:
        return out, str(e)
    return out, None


def paragraph(rng: random.Random, k: int, v2: bool, words: int = 12) -> dict[str, Any]:
    context = " ".join(rng.choice(WORDS) for _ in range(words))
    qas = []
    for q in range(rng.randint(1, 3)):
        word = rng.choice(context.split(" "))
        qa: dict[str, Any] = {"question": f"where is {word}?", "id": f"q{k}.{q}",
                              "answers": [{"answer_start": context.index(word), "text": word}]}
        if v2:
            impossible = rng.random() < 0.3
            qa.update(is_impossible=impossible, answers=[] if impossible else qa["answers"])
            if impossible:
                qa["plausible_answers"] = [{"text": word, "answer_start": context.index(word)}]
        if rng.random() < 0.3:
            qa = dict(reversed(list(qa.items())))  # keys in any order
        qas.append(qa)
    return {"qas": qas, "context": context} if rng.random() < 0.5 else {"context": context, "qas": qas}


def squad(seed: int, v2: bool, articles: int = 3, paragraphs: int = 4) -> dict[str, Any]:
    rng = random.Random(seed)
    data = []
    for a in range(articles):
        ps = [paragraph(rng, a * 100 + p, v2) for p in range(paragraphs)]
        article = {"title": f"T{a} ü", "paragraphs": ps, "extra": {"nested": [1, 2.5, None, True, {"x": []}]}}
        data.append(dict(reversed(list(article.items()))) if a % 2 else article)
    return {"data": data, "version": "v2.0" if v2 else "1.1"}


def documents() -> dict[str, str]:
    """Valid files, as text: both shapes, keys before and after "data", whitespace and escapes of every kind."""
    v1, v2 = squad(1, False), squad(2, True)
    odd = squad(3, True)
    odd["data"][1:1] = [7, "not an article", {"title": "no paragraphs"}, {"paragraphs": []}]
    big = squad(4, False, articles=1, paragraphs=2)
    big["data"][0]["paragraphs"][1] = paragraph(random.Random(5), 9, False, words=12_000)  # ~120 kB
    return {
        "v1 compact": json.dumps(v1, separators=(",", ":")),
        "v2 indented": json.dumps(v2, indent=2),
        "v2 raw unicode": json.dumps(v2, ensure_ascii=False, indent="\t"),
        "version first": json.dumps({"version": "1.1", **v1}),
        "top keys around": json.dumps({"a": [[], {}], "data": v1["data"], "z": {"data2": [1]}, "version": "x"}),
        "crlf and blanks": "\r\n  " + json.dumps(v2, indent=1).replace("\n", "\r\n \t") + " \n\r\n",
        "escaped keys": json.dumps(v1).replace('"data"', '"d\\u0061ta"').replace('"paragraphs"', '"p\\u0061ragraphs"'),
        "odd articles": json.dumps(odd),
        "paragraph bigger than a block": json.dumps(big, ensure_ascii=False),
        "one line per paragraph": json.dumps(v1).replace('}, {"', '},\n{"'),
    }


@pytest.fixture
def block(monkeypatch) -> Callable[[int], None]:
    return lambda size: monkeypatch.setattr(jsonstream, "BLOCK_BYTES", size)


@pytest.mark.parametrize("size", [1, 3, 64, 4096, jsonstream.BLOCK_BYTES])
def test_streamed_examples_equal_the_whole_parse(tmp_path, block, size):
    block(size)
    longest = 0
    for name, text in documents().items():
        path = tmp_path / f"{name}.json"
        path.write_text(text, encoding="utf-8")
        expected, error = outcome(read_squad_whole, path)
        assert error is None and len(expected) >= 2, (name, error)
        assert outcome(read_squad, path) == (expected, None), name
        longest = max([longest] + [len(e.context.encode()) for e in expected])
    assert longest > jsonstream.BLOCK_BYTES  # the big paragraph: larger than the read block


def mutations(text: str, n: int, seed: int) -> Iterator[str]:
    """Single-character damage anywhere: deleted, replaced or inserted (JSON punctuation, quotes, letters)."""
    rng = random.Random(seed)
    alphabet = '{}[],:"\\ \n0aétu'
    for _ in range(n):
        i = rng.randrange(len(text))
        kind = rng.randrange(3)
        if kind == 0:
            yield text[:i] + text[i + 1:]
        elif kind == 1:
            yield text[:i] + rng.choice(alphabet) + text[i + 1:]
        else:
            yield text[:i] + rng.choice(alphabet) + text[i:]


@pytest.mark.parametrize("shape", ["v2 indented", "v1 compact", "crlf and blanks"])
def test_every_error_is_the_whole_parses(tmp_path, block, shape):
    """A damaged file: the same message (JSON errors at the same line and column, or the same field error) as the
    whole parse gives; where the damage leaves valid SQuAD, the same examples.

    One exception, as with any reader that goes in file order: where the damage turns a paragraph into a value of
    the wrong shape and the JSON breaks only further on (a '[' put before a paragraph's '{' makes it a list, and
    the array's closing ']' then ends the wrong array), the paragraph's own error comes first."""
    block(7)  # many block boundaries: a cut value must never read as an error, nor an error as a cut value
    text = documents()[shape]
    path = tmp_path / "damaged.json"
    errors, shape_first = set(), 0
    for damaged in mutations(text, 250, seed=len(shape)):
        path.write_text(damaged, encoding="utf-8")
        expected, error = outcome(read_squad_whole, path)
        got, got_error = outcome(read_squad, path)
        if got_error != error:
            assert "not valid JSON" in error and re.search(r"paragraphs\[\d+\]: expected an object, got", got_error)
            shape_first += 1
            continue
        # an error: either reader may have yielded the examples before the damage first
        assert got == expected if error is None else got[:len(expected)] == expected[:len(got)]
        errors.add((error or "").split(": ", 1)[-1].split(" (")[0])
    assert len(errors) >= 5, errors  # the damage reached both JSON and SQuAD checks
    assert shape_first <= 3  # (about 1 in 2,000 damaged files, measured over 16,200)


@pytest.mark.parametrize("text, message", [
    ("", r"line 1: not valid JSON \(Expecting value at column 1\)"),
    ('\ufeff{"data": []}', r"the file has no examples"),  # the byte-order mark read past
    ('\ufeff{"data": [}', r"line 1: not valid JSON \(Expecting value at column 11\)"),  # columns after it
    ('{"version": "1.1"}', r"a SQuAD file is an object with a 'data' list"),
    ('{"data": {"title": "t"}}', r"a SQuAD file is an object with a 'data' list"),
    ('[{"data": []}]', r"a SQuAD file is an object with a 'data' list"),
    ('{"data": []}', r"the file has no examples"),
    ('{"data": [{"paragraphs": [{"context": "abc", "qas": []}]}]}\n\n  x', r"line 3: not valid JSON \(Extra data at "
                                                                            r"column 3\)"),
    ('{"data": [{"paragraphs": [{"context": "abc",\n "qas": [}]}]}', r"line 2: not valid JSON \(Expecting value at "
                                                                    r"column 10\)"),
    ('{"data": [{"paragraphs": [{"qas": []}]}]}', r"data\[0\]\.paragraphs\[0\], field 'context'"),
    ('{"data": [{"paragraphs": [{"context": "abc", "qas": [{"id": "x7", "question": "q?"}]}]}]}',
     r"question id 'x7', field 'answers': missing"),
])
def test_bad_files_name_file_and_place(tmp_path, block, text, message):
    block(5)
    path = tmp_path / "bad.json"
    path.write_text(text, encoding="utf-8")
    _, error = outcome(read_squad_whole, path)
    assert error is not None and error.startswith(str(path))
    assert outcome(read_squad, path)[1] == error
    with pytest.raises(DataError, match=message):
        list(read_squad(path))


def test_bad_utf8_names_the_files_byte_offset(tmp_path, block):
    block(4)
    raw = json.dumps(squad(6, False), ensure_ascii=False).encode()
    for at in (3, 41, len(raw) - 9):  # inside a block and across a boundary: the file's offset either way
        path = tmp_path / "bytes.json"
        path.write_bytes(raw[:at] + b"\xff" + raw[at:])
        error = outcome(read_squad_whole, path)[1]
        assert error == f"{path}: not UTF-8 (byte offset {at}: b'\\xff')"
        assert outcome(read_squad, path)[1] == error
    path.write_bytes(raw + "é".encode()[:1])  # a character cut by the end of the file
    assert outcome(read_squad, path)[1] == outcome(read_squad_whole, path)[1] == (
        f"{path}: not UTF-8 (byte offset {len(raw)}: b'\\xc3')")


def test_duplicate_members_are_refused(tmp_path):
    """A whole parse keeps a repeated key's last value; a stream has already read the first, so it says so."""
    path = tmp_path / "twice.json"
    path.write_text('{"data": [], "version": "1", "data": []}')
    with pytest.raises(DataError, match=r"twice.json: 'data' appears twice"):
        list(read_squad(path))
    path.write_text('{"data": [{"paragraphs": [], "paragraphs": []}]}')
    with pytest.raises(DataError, match=r"twice.json, data\[0\]: 'paragraphs' appears twice"):
        list(read_squad(path))
    path.write_text('{"data": [{"paragraphs": 3}]}')  # (the whole parse failed with a TypeError here)
    with pytest.raises(DataError, match=r"data\[0\], field 'paragraphs': expected a list, got int"):
        list(read_squad(path))


def test_walk_skips_what_the_caller_leaves(tmp_path, block):
    block(2)
    path = tmp_path / "doc.json"
    path.write_text('{"a": {"b": [1, {"c": "d"}]}, "e": [10, 20, 30], "f": "g"}')
    with JsonStream(path) as doc:
        seen = []
        for key in doc.members():
            if key == "e":
                seen += [doc.value() for _ in doc.items() if _ != 1]  # element 1 left: skipped
            else:
                seen.append(key)
        doc.end()
    assert seen == ["a", 10, 30, "f"]


def test_memory_holds_a_paragraph_not_the_document(tmp_path):
    """Reading a ~2.3 MB file (one article, as the test helpers write) peaks at a read buffer and a paragraph, far
    below the file (the whole parse held the text and the parsed document: about ten times the file)."""
    doc = squad(7, True, articles=1, paragraphs=6000)
    path = tmp_path / "large.json"
    path.write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")
    del doc
    size = path.stat().st_size
    assert size > 2_000_000, size
    tracemalloc.start()
    try:
        n = sum(1 for _ in read_squad(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    print(f"file {size / 1e6:.1f} MB, {n} examples: peak {peak / 1e6:.2f} MB")
    assert n > 10_000
    assert peak < size / 6, (peak, size)
