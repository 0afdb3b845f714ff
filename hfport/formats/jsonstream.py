"""A large JSON document read a piece at a time: the file in blocks, an object's members or an array's elements
walked in turn, each value parsed by the standard library's decoder when the caller asks for it.

    with JsonStream(path) as doc:
        if doc.peek() == "{":
            for key in doc.members():         # after each key the caller reads its value or leaves it (skipped)
                if key == "data" and doc.peek() == "[":
                    for i, row in doc.elements():  # one element parsed at a time (items(): walk into each)
                        ...
        doc.end()                             # nothing but whitespace may follow

Memory holds the value being parsed and a read buffer of a block or so, not the document. A bad document gets
json's own message at json's own position (the walk repeats json.decoder's JSONObject/JSONArray checks, and each
value is parsed by json itself), turned into the file's line and column, as json.loads on the whole file gives
(checked against json.loads on damaged documents, Python 3.10 to 3.13). Being a stream, it finds a problem when
the walk gets there: what a caller does with the values before it is the caller's.
"""

from __future__ import annotations

import codecs
import json
import re
import sys
from pathlib import Path
from typing import Any, Iterator

from .tables import DataError

BLOCK_BYTES = 1 << 15  # read at a time; a value longer than the buffer grows it (doubling) until it parses
# a parse error this close to the buffer's end may only be the block boundary cutting a value ("tru", "12", "\u00"),
# and a number ending there may go on: read more and parse again; nearer the middle the error is the document's
_TAIL = 16
_WHITESPACE = re.compile(r"[ \t\n\r]*")  # json's whitespace (json.decoder.WHITESPACE)
_VALUE_STARTS = frozenset('{["-0123456789tfnNI')  # what json's scanner can start a value with
_TRAILING_COMMA = sys.version_info >= (3, 13)  # json names a trailing comma itself from 3.13 on


class JsonStream:
    """One JSON document, read forward from a file; see the module's docstring."""

    def __init__(self, path: Path | str, block_bytes: int | None = None):
        self.path = Path(path)
        self._block = block_bytes or BLOCK_BYTES
        self._file = open(self.path, "rb")
        self._utf8 = codecs.getincrementaldecoder("utf-8")()
        self._decoder = json.JSONDecoder()
        self._buf, self._pos, self._eof = "", 0, False
        self._bytes = 0  # bytes read from the file so far
        self._base = 0  # the file's character offset of _buf[0]
        self._line, self._line_start = 1, 0  # the line of _buf[0] (1-based) and where that line starts
        try:
            self._read(0)
            # a byte-order mark (Windows editors write one) is no part of the document: read past, as json.loads
            # reads the file decoded as utf-8-sig (columns on line 1 count from after it)
            self._buf = self._buf.removeprefix("\ufeff")
        except DataError:
            self._file.close()
            raise

    def __enter__(self) -> JsonStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()

    # --- reading the file --------------------------------------------------------------------------------------

    def _read(self, at_least: int) -> bool:
        """Drops what has been read, appends a block (or AT_LEAST bytes); False at the end of the file."""
        if self._pos:
            done = self._buf.count("\n", 0, self._pos)
            if done:
                self._line += done
                self._line_start = self._base + self._buf.rfind("\n", 0, self._pos) + 1
            self._base += self._pos
            self._buf, self._pos = self._buf[self._pos:], 0
        raw = self._file.read(max(self._block, at_least))
        held = len(self._utf8.getstate()[0])  # an incomplete character's bytes from the last block
        try:
            text = self._utf8.decode(raw, final=not raw)
        except UnicodeDecodeError as e:  # e.start counts from the held bytes: the file's offset as a whole read's
            at = self._bytes - held + e.start
            raise DataError(f"{self.path}: not UTF-8 (byte offset {at}: {e.object[e.start:e.start + 1]!r})") from e
        self._bytes += len(raw)
        self._eof = not raw
        self._buf += text
        return bool(raw)

    def _error(self, msg: str, pos: int) -> DataError:
        """json's message for a problem at _buf[POS], at the file's line and column (json's columns: characters,
        1-based)."""
        line = self._line + self._buf.count("\n", 0, pos)
        newline = self._buf.rfind("\n", 0, pos)
        column = pos - newline if newline >= 0 else self._base + pos - self._line_start + 1
        return DataError(f"{self.path}, line {line}: not valid JSON ({msg} at column {column})")

    def peek(self) -> str:
        """The next character that is not whitespace ("" at the end of the file), not consumed."""
        while True:
            self._pos = _WHITESPACE.match(self._buf, self._pos).end()
            if self._pos < len(self._buf) or not self._read(0):
                return self._buf[self._pos:self._pos + 1]

    def _offset(self) -> int:
        return self._base + self._pos

    # --- values ------------------------------------------------------------------------------------------------

    def value(self) -> Any:
        """The next value, parsed whole by json (a string, a number, an object, an array, ...)."""
        self.peek()
        while True:
            try:
                value, end = self._decoder.raw_decode(self._buf, self._pos)
                # a number near the buffer's end may go on in the next block ("2." parses as 2 there)
                if len(self._buf) - end > _TAIL or self._eof:
                    self._pos = end
                    return value
            except json.JSONDecodeError as e:
                cut = e.msg.startswith("Unterminated string") or len(self._buf) - e.pos <= _TAIL
                if self._eof or not cut:
                    raise self._error(e.msg, e.pos) from None
            # read at least as much as is held of the value: a long value is parsed O(1) times over, not once a block
            self._read(len(self._buf) - self._pos)

    def expect_value(self) -> None:
        """json's 'Expecting value' error here unless a value can start here (nothing is consumed)."""
        if not self.peek() or self.peek() not in _VALUE_STARTS:
            raise self._error("Expecting value", self._pos)

    def _open(self, bracket: str, close: str) -> bool:
        """Consumes BRACKET; True (and the CLOSE consumed too) when the container is empty."""
        if self.peek() != bracket:
            raise ValueError(f"{self.path}: expected {bracket!r} next, not {self.peek()!r}")
        self._pos += 1
        if self.peek() == close:
            self._pos += 1
            return True
        return False

    def _next(self, close: str) -> bool:
        """After a member or an element: True at the container's CLOSE, False past the ',' before another (both
        consumed); json's own errors otherwise."""
        if self.peek() == close:
            self._pos += 1
            return True
        if self.peek() != ",":
            raise self._error("Expecting ',' delimiter", self._pos)
        if _TRAILING_COMMA:  # look past the comma without consuming it: a read drops only what is consumed
            while True:
                after = _WHITESPACE.match(self._buf, self._pos + 1).end()
                if after < len(self._buf) or not self._read(0):
                    break
            if self._buf[after:after + 1] == close:
                raise self._error(f"Illegal trailing comma before end of {'object' if close == '}' else 'array'}",
                                  self._pos)
        self._pos += 1
        return False

    def members(self) -> Iterator[str]:
        """The keys of the object that comes next, in file order. After each key the caller reads the member's
        value (value(), members(), items(), elements(), skip()) or leaves it, and the walk skips it when it goes
        on."""
        if self._open("{", "}"):
            return
        while True:
            if self.peek() != '"':
                raise self._error("Expecting property name enclosed in double quotes", self._pos)
            key = self.value()
            if self.peek() != ":":
                raise self._error("Expecting ':' delimiter", self._pos)
            self._pos += 1
            self.peek()
            before = self._offset()
            yield key
            if self._offset() == before:
                self.skip()
            if self._next("}"):
                return

    def items(self) -> Iterator[int]:
        """The indices of the array that comes next; after each the caller reads the element or leaves it, as
        with members()."""
        if self._open("[", "]"):
            return
        index = 0
        while True:
            self.peek()  # (the caller's peek() must not read as having taken the element)
            before = self._offset()
            yield index
            if self._offset() == before:
                self.skip()
            if self._next("]"):
                return
            index += 1

    def elements(self) -> Iterator[tuple[int, Any]]:
        """(index, value) of the array that comes next, each element parsed whole. An element is yielded once what
        follows it is known to be a ',' or the array's end, so a caller's complaint about an element never hides
        a syntax error that cut it short (`["context": ...` is the string "context", then a bad ':')."""
        if self._open("[", "]"):
            return
        index = 0
        while True:
            value = self.value()
            closed = self._next("]")
            yield index, value
            if closed:
                return
            index += 1

    def skip(self) -> None:
        """Passes over the next value, an array an element at a time (so a huge one is never held whole)."""
        if self.peek() == "[":
            for _ in self.items():
                pass
        elif self.peek() == "{":
            for _ in self.members():
                pass
        else:
            self.value()

    def end(self) -> None:
        """json's 'Extra data' error unless only whitespace is left."""
        if self.peek():
            raise self._error("Extra data", self._pos)
