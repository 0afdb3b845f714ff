"""Tabular training data on disk: the kinds of source `--train`/`--eval` name, each read as a stream of rows.

    csv, tsv        a header line, then one row a line; a row is located by its line
    jsonl           one JSON object a line (.jsonl, .json, .ndjson); located by its line
    parquet         one file or a glob of them, read a record batch at a time; located by its row
    arrow           Arrow IPC, the file or the stream format (what `datasets` writes), a batch at a time; by its row
    datasets folder what `Dataset.save_to_disk` (state.json) or `DatasetDict.save_to_disk` (dataset_dict.json, a
                    folder a split) writes: its split's Arrow files; located by the split's row, as `ds[split][i]`

A file's kind is read off its suffix (FILE_KINDS) and a folder's off its marker file (FOLDER_KINDS); nothing else
asks which kind a source is. Rows are numbered from 0 as datasets, pandas and pyarrow number them; lines from 1.
A ClassLabel column's names, which datasets writes into a folder's dataset_info.json and the Arrow schema's metadata,
are read back (class_names). A UTF-8 byte-order mark opening a text file (Excel's "CSV UTF-8") is read past.
Nothing here holds a whole file: every reader yields rows as it goes, so a caller that encodes as it reads keeps
only what it encodes. Parquet and Arrow need pyarrow (the `data` extra); without it the error says what to install.
"""

from __future__ import annotations

import bisect
import codecs
import csv
import glob
import hashlib
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

from ..errors import HfportError
from ..hub import check_output_file

MAX_LINE_BYTES = 1_000_000  # a line longer than this is a broken export, not an example
BATCH_ROWS = 1024  # rows decoded from Arrow at a time: the text held at once while reading a Parquet/Arrow file
GLOB_CHARS = "*?["
INSTALL = "pip install 'hfport[data]' (pyarrow and datasets)"


class DataError(HfportError, ValueError):
    """A data file problem, located: file (and split), line or row, field."""


@dataclass
class Record:
    line: int  # a line kind: the 1-based line in the file (CSV: the line the row ends on); a row kind: the 0-based row
    values: dict[str, Any]


# --- line kinds: CSV/TSV and JSON Lines ----------------------------------------------------------------------


def decoded_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(1-based line number, text) of a UTF-8 file, a line at a time; a bad byte or an over-long line is an error
    naming the line. A UTF-8 byte-order mark (what Excel's "CSV UTF-8" and Windows editors write first) is read past;
    a UTF-16 one is an error saying so."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if number == 1:
                raw = raw.removeprefix(codecs.BOM_UTF8)
                if raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
                    raise DataError(f"{path}, line 1: UTF-16 (the file starts with its byte-order mark); save it as "
                                    "UTF-8")
            if len(raw) > MAX_LINE_BYTES:
                raise DataError(f"{path}, line {number}: the line is {len(raw):,} bytes; the limit is "
                                f"{MAX_LINE_BYTES:,}")
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}, line {number}: not UTF-8 (byte {e.start}: {raw[e.start:e.start + 1]!r})"
                                ) from e


def _jsonl_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    for number, text in decoded_lines(path):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            # json's "Invalid control character at" / "Unterminated string starting at" end where the place goes
            raise DataError(f"{path}, line {number}: not valid JSON ({e.msg.removesuffix(' at')} at column "
                            f"{e.colno})") from e
        if not isinstance(obj, dict):
            raise DataError(f"{path}, line {number}: expected a JSON object, got {type(obj).__name__}")
        yield number, obj


def _delimited_rows(path: Path, delimiter: str) -> Iterator[tuple[int, dict[str, Any]]]:
    # csv reads the decoded lines as they come (bad bytes are located before csv sees the text)
    reader = csv.reader((text for _, text in decoded_lines(path)), delimiter=delimiter)
    try:
        header = next(reader, None)
        if header is None:
            raise DataError(f"{path}: the file is empty")
        header = [h.strip() for h in header]
        for row in reader:
            number = reader.line_num  # the line the row ends on; rows rarely span lines
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) != len(header):
                raise DataError(f"{path}, line {number}: {len(row)} fields, the header has {len(header)}")
            yield number, dict(zip(header, row))
    except csv.Error as e:
        raise DataError(f"{path}, line {reader.line_num}: {e}") from e


# --- row kinds: Parquet and Arrow IPC (pyarrow, imported when one is read) -----------------------------------


def _pyarrow(path: Path | str, what: str) -> Any:
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError as e:
        raise DataError(f"{path}: reading {what} needs pyarrow, which is not installed; {INSTALL}") from e
    return pyarrow


def _batch_rows(path: Path, batches: Iterator[Any], pa: Any) -> Iterator[tuple[int, dict[str, Any]]]:
    row = 0
    while True:
        try:
            batch = next(batches, None)
        except (pa.ArrowException, OSError) as e:  # a truncated or corrupt batch further in
            raise DataError(f"{path}, row {row}: the file cannot be read on from here ({e})") from e
        if batch is None:
            return
        for values in batch.to_pylist():  # only this batch's rows become Python objects
            yield row, values
            row += 1


def _parquet_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    pa = _pyarrow(path, "Parquet")
    try:
        # pre_buffer=False: with pyarrow's default (True) the reader caches every column chunk it has read until it
        # is closed, so a pass over the file holds the whole compressed file by its end (measured in
        # docs/benchmarks.md, issue 32); without it one row group's buffers are held at a time
        file = pa.parquet.ParquetFile(path, pre_buffer=False)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({e})") from e
    with file:
        yield from _batch_rows(path, file.iter_batches(batch_size=BATCH_ROWS), pa)


def _arrow_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    pa = _pyarrow(path, "Arrow")
    with pa.OSFile(str(path)) as f:
        try:  # the IPC file format (random access, "ARROW1" magic) ...
            reader = pa.ipc.open_file(f)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        except pa.ArrowInvalid:  # ... or the stream format, which datasets writes
            f.seek(0)
            try:
                batches = pa.ipc.open_stream(f)
            except (pa.ArrowException, OSError) as e:
                raise DataError(f"{path}: not an Arrow IPC file or stream ({e})") from e
        yield from _batch_rows(path, iter(batches), pa)


def _parquet_schema(path: Path) -> Any:
    pa = _pyarrow(path, "Parquet")
    try:
        return pa.parquet.read_schema(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({e})") from e


def _arrow_schema(path: Path) -> Any:
    pa = _pyarrow(path, "Arrow")
    with pa.OSFile(str(path)) as f:
        try:
            return pa.ipc.open_file(f).schema
        except pa.ArrowInvalid:
            f.seek(0)
            try:
                return pa.ipc.open_stream(f).schema
            except (pa.ArrowException, OSError) as e:
                raise DataError(f"{path}: not an Arrow IPC file or stream ({e})") from e


def _parquet_footer(f: BinaryIO, size: int) -> int:
    """The bytes of a Parquet file's footer (its metadata: every row group's column chunks, their offsets, sizes and
    statistics) and the 8 that close the file; 0 when the file does not end as Parquet does."""
    if size < 8:
        return 0
    f.seek(size - 8)
    tail = f.read(8)
    if tail[4:] != b"PAR1":
        return 0
    return min(size, int.from_bytes(tail[:4], "little") + 8)


# --- writing: rows out (what `hfport mine` writes for a fine-tune to read) ---------------------------------------


def _write_jsonl(path: Path, columns: list[str], rows: list[dict[str, Any]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps({c: row[c] for c in columns}, ensure_ascii=False) + "\n")


def _write_parquet(path: Path, columns: list[str], rows: list[dict[str, Any]]) -> None:
    pa = _pyarrow(path, "Parquet")
    table = pa.table({c: [row[c] for row in rows] for c in columns})
    pa.parquet.write_table(table, path)


@dataclass(frozen=True)
class FileKind:
    name: str
    suffixes: tuple[str, ...]
    rows: Callable[[Path], Iterator[tuple[int, dict[str, Any]]]]  # (line or row, values), streamed
    unit: str  # "line" or "row": what a position in the file counts
    schema: Callable[[Path], Any] | None = None  # the Arrow schema, whose metadata holds datasets' features
    # (open file, size) -> how many bytes at the file's end describe all of it (Parquet's footer), hashed whole by
    # content_digest
    trailer: Callable[[BinaryIO, int], int] | None = None
    write: Callable[[Path, list[str], list[dict[str, Any]]], None] | None = None  # (path, columns, rows); None: read only


FILE_KINDS: tuple[FileKind, ...] = (
    FileKind("csv", (".csv",), lambda p: _delimited_rows(p, ","), "line"),
    FileKind("tsv", (".tsv",), lambda p: _delimited_rows(p, "\t"), "line"),
    FileKind("jsonl", (".jsonl", ".json", ".ndjson"), _jsonl_rows, "line", write=_write_jsonl),
    FileKind("parquet", (".parquet",), _parquet_rows, "row", _parquet_schema, _parquet_footer, write=_write_parquet),
    FileKind("arrow", (".arrow",), _arrow_rows, "row", _arrow_schema),
)


def writable_kind(path: str | os.PathLike[str], what: str = "the rows") -> FileKind:
    """The kind write_rows writes PATH in, checked before the work that makes the rows (a caller's first step): a
    suffix hfport writes, and a path that can become a file."""
    path = Path(path)
    kind = file_kind(path)
    if kind.write is None:
        writable = ", ".join(s for k in FILE_KINDS if k.write is not None for s in k.suffixes)
        raise DataError(f"{path}: hfport writes {writable}, not {kind.name}")
    check_output_file(path, what)
    return kind


def write_rows(path: str | os.PathLike[str], columns: list[str], rows: list[dict[str, Any]]) -> Path:
    """Write ROWS (each a dict with every one of COLUMNS) to PATH in the kind its suffix names, beside it first and
    renamed into place when complete, so a failure never leaves a half-written file. Returns the path."""
    path = Path(path)
    kind = writable_kind(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")  # its own: threads of a process write
    try:
        kind.write(staging, columns, rows)
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)
    return path


ARROW = FILE_KINDS[-1]  # what datasets' folders hold


def file_kind(path: Path) -> FileKind:
    for kind in FILE_KINDS:
        if path.suffix.lower() in kind.suffixes:
            return kind
    known = ", ".join(s for k in FILE_KINDS for s in k.suffixes)
    raise DataError(f"{path}: unknown data format {path.suffix!r}; use {known}, a glob of .parquet/.arrow files, "
                    "or a folder written by datasets' save_to_disk")


# --- a file's content, cheaply ---------------------------------------------------------------------------------

DIGEST_BLOCK = 1 << 16  # bytes read at each sampled place of a file
DIGEST_BLOCKS = 16  # places sampled: the first block, the last, and evenly between (1 MiB of a large file)


def content_digest(path: Path, trailer: Callable[[BinaryIO, int], int] | None = None) -> str:
    """A hash of a file's content that costs at most ~1 MiB of reading: the whole file when it is that small, else
    DIGEST_BLOCKS blocks (the first, the last and evenly spaced between) and, for a kind with a `trailer`, the bytes
    that describe the whole file (Parquet's footer: every column chunk's offsets, sizes and statistics). What a
    cache keyed by path, size and modification time alone misses: a file rewritten in place with the same size and
    time (a copy that keeps times, a clock of coarse resolution). A change inside an unsampled stretch of a large
    file that keeps its size, time and (Parquet) footer still goes unseen."""
    size = path.stat().st_size
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        if size <= DIGEST_BLOCK * DIGEST_BLOCKS:
            digest.update(f.read())
        else:
            for k in range(DIGEST_BLOCKS):
                f.seek((size - DIGEST_BLOCK) * k // (DIGEST_BLOCKS - 1))
                digest.update(f.read(DIGEST_BLOCK))
            n = trailer(f, size) if trailer is not None else 0
            if n:
                f.seek(size - n)
                digest.update(f.read(n))
    return digest.hexdigest()


# --- datasets folders (save_to_disk) -------------------------------------------------------------------------

DATASET_INFO = "dataset_info.json"  # beside a Dataset folder's state.json: its features (ClassLabel names)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8-sig"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: not readable JSON ({e})") from e


def _dataset_files(folder: Path) -> list[Path]:
    """A Dataset folder's Arrow files in order, as its state.json lists them."""
    state = _read_json(folder / "state.json")
    entries = state.get("_data_files") if isinstance(state, dict) else None
    if not isinstance(entries, list) or not all(isinstance(e, dict) and "filename" in e for e in entries):
        raise DataError(f"{folder / 'state.json'}: expected '_data_files', a list of {{'filename': ...}}")
    names = [e["filename"] for e in entries]
    for name in names:  # a name with a folder in it could point anywhere
        if not isinstance(name, str) or Path(name).name != name or not (folder / name).is_file():
            raise DataError(f"{folder / 'state.json'}: lists {name!r}, which is not a file in {folder}")
    return [folder / name for name in names]


def _dataset_dict_files(folder: Path, split: str, option: str) -> list[Path]:
    listing = _read_json(folder / "dataset_dict.json")
    splits = listing.get("splits") if isinstance(listing, dict) else None
    if not isinstance(splits, list):
        raise DataError(f"{folder / 'dataset_dict.json'}: expected {{'splits': [...]}}")
    if split not in splits:
        raise DataError(f"{folder}: the DatasetDict has no split {split!r}; its splits are {splits} "
                        f"(choose one with {option})")
    return _dataset_files(folder / split)


@dataclass(frozen=True)
class FolderKind:
    name: str
    marker: str  # the file save_to_disk writes at the folder's top
    files: Callable[[Path, str, str], list[Path]]  # (folder, split, the option naming it) -> its Arrow files
    has_splits: bool


FOLDER_KINDS: tuple[FolderKind, ...] = (
    FolderKind("datasets DatasetDict", "dataset_dict.json", _dataset_dict_files, True),
    FolderKind("datasets Dataset", "state.json", lambda folder, split, option: _dataset_files(folder), False),
)


def split_read(given: str | os.PathLike[str] | None, split: str | None) -> str | None:
    """The split a run read from `given`: `split` where `given` is a datasets DatasetDict folder, else None (a file, a
    glob or a single Dataset has no splits, whatever train_split says). None too once the folder is gone."""
    path = Path(given) if given else None
    if path is None or not path.is_dir():
        return None
    kind = next((k for k in FOLDER_KINDS if (path / k.marker).is_file()), None)
    return split if kind is not None and kind.has_splits else None


# --- a source: what --train or --eval names -----------------------------------------------------------------


class Source:
    """One data source: a file, a glob of Parquet/Arrow files or a datasets folder (with its split). It stands where
    a data file's path used to: str() names it in messages, `where()` locates a row in it (file, split, row), and
    `records()` streams its rows."""

    def __init__(self, given: str | os.PathLike[str], split: str = "train", split_option: str = "train_split"):
        self.path = Path(given)
        self.split: str | None = None  # a DatasetDict's split; None for everything else
        self.split_option = split_option
        self.files, self.kind = self._resolve(split)
        # the first position of each file read so far (row kinds: what locate maps back with); a reader that keeps
        # the rows' positions without reading them again (an encoded-examples store) keeps these beside them
        self.starts: list[int] = []

    def _resolve(self, split: str) -> tuple[list[Path], FileKind | None]:
        text = str(self.path)
        if any(c in text for c in GLOB_CHARS) and not self.path.exists():
            files = [Path(p) for p in sorted(glob.glob(text))]
            if not files:
                raise DataError(f"{text}: the pattern matches no file")
            kinds = {file_kind(f).name for f in files}
            kind = file_kind(files[0])
            if len(kinds) > 1 or kind.unit != "row":
                raise DataError(f"{text}: a pattern must match only .parquet or only .arrow files; it matches "
                                f"{sorted(kinds)}")
            return files, kind
        if self.path.is_dir():
            for folder in FOLDER_KINDS:
                if (self.path / folder.marker).is_file():
                    self.split = split if folder.has_splits else None
                    return folder.files(self.path, split, self.split_option), ARROW
            markers = " or ".join(f.marker for f in FOLDER_KINDS)
            raise DataError(f"{self.path}: a folder, but not one datasets' save_to_disk wrote (no {markers})")
        if not self.path.is_file():
            raise DataError(f"{self.path}: no such file")
        # a suffix no kind claims may be a task's own format (.txt texts, CoNLL): the task reads those itself, and
        # records() refuses them
        return [self.path], next((k for k in FILE_KINDS if self.path.suffix.lower() in k.suffixes), None)

    # what tasks with a format of their own (.txt, CoNLL, SQuAD JSON) ask of a path
    @property
    def suffix(self) -> str:
        return self.path.suffix

    @property
    def name(self) -> str:
        return self.path.name

    def is_file(self) -> bool:
        return self.path.is_file()

    def __fspath__(self) -> str:
        return str(self.path)

    def __str__(self) -> str:
        return f"{self.path} (split {self.split!r})" if self.split is not None else str(self.path)

    def __repr__(self) -> str:
        return f"Source({str(self)!r}, kind={self.kind.name if self.kind else None!r})"

    def records(self) -> Iterator[Record]:
        """Every row of every file in order, streamed. Row kinds number rows across the files (a datasets split's
        index); `locate` maps a number back to its file."""
        kind = self.kind or file_kind(self.path)
        self.starts = []
        position = 0
        for file in self.files:
            self.starts.append(position)
            for number, values in kind.rows(file):
                yield Record(number if kind.unit == "line" else position, values)
                position += 1
        if kind.schema is not None:
            # pyarrow's allocator (mimalloc) keeps the pages it freed: handed back once the files are read, their
            # decoded row groups do not stay in the process's RSS (262,144 rows: 30 MiB)
            _pyarrow(self.path, kind.name).default_memory_pool().release_unused()

    def class_names(self, column: str) -> list[str] | None:
        """The names of a ClassLabel column (or of a sequence of them: NER tags, multi-label) as datasets wrote its
        features: a save_to_disk folder's dataset_info.json (what load_from_disk reads), else the schema's metadata
        (Parquet and Arrow files from datasets); None when there are none. A source's ids are its own classes: two
        sources may list the same names in different orders."""
        if self.kind is None or self.kind.schema is None:
            return None
        features = None
        info = self.files[0].parent / DATASET_INFO
        if self.path.is_dir() and info.is_file():
            described = _read_json(info)
            features = described.get("features") if isinstance(described, dict) else None
        if features is None:
            metadata = self.kind.schema(self.files[0]).metadata or {}
            try:
                features = json.loads(metadata.get(b"huggingface", b"{}"))["info"]["features"]
            except (KeyError, TypeError, json.JSONDecodeError):
                return None
        feature = features.get(column) if isinstance(features, dict) else None
        while isinstance(feature, dict) and feature.get("_type") in ("Sequence", "List"):
            feature = feature.get("feature")
        while isinstance(feature, list) and len(feature) == 1:  # datasets' [ClassLabel] shorthand for a list
            feature = feature[0]
        if isinstance(feature, dict) and feature.get("_type") == "ClassLabel" and isinstance(feature.get("names"),
                                                                                               list):
            return [str(n) for n in feature["names"]]
        return None

    def fingerprint(self) -> list[list[Any]]:
        """What the source's content is, per file: [path, size, modification time (ns), content_digest]: a cache of
        what was read from it (the encoded-examples store) is keyed by it."""
        kind = self.kind
        out: list[list[Any]] = []
        for f in self.files:
            stat = f.stat()
            out.append([str(f.resolve()), stat.st_size, stat.st_mtime_ns,
                        content_digest(f, kind.trailer if kind is not None else None)])
        return out

    @property
    def unit(self) -> str:
        """What a Record's position counts: "line" (CSV, JSONL, a task's own text formats) or "row"."""
        return self.kind.unit if self.kind else "line"

    def locate(self, position: int) -> str:
        """Where `position` (a Record's line) is: 'file, line N', 'folder (split 's'), row N' or 'file, row N' (a
        glob's file and its own row)."""
        if self.unit == "line":
            return f"{self}, line {position}"
        if self.split is not None or len(self.files) == 1 or not self.starts:
            return f"{self}, row {position}"
        i = bisect.bisect_right(self.starts, position) - 1
        return f"{self.files[i]}, row {position - self.starts[i]}"


def where(path: Source | Path | str, line: int | None = None, column: str | None = None) -> str:
    """'file[, line N | row N][, field 'c']': the location every data error starts with."""
    if isinstance(path, Source) and line is not None:
        loc = path.locate(line)
    else:
        loc = str(path) + (f", line {line}" if line is not None else "")
    if column is not None:
        loc += f", field '{column}'"
    return loc
