"""The columns of each task's training rows: the task records say which (hfport/tasks/: `columns`, one `Columns` a
shape of row the task reads, and `files`, its formats besides tables), named by the fine-tune config's column fields
(text_column, label_column, ...), each of which is also a CLI flag (--text-column, ...).

`check_columns(config)` runs first in preflight: the first row of each data source against the task's shapes. A row
that fits none is an error naming the missing columns, the flags that rename them and, when the row fits another task
(its columns by name and their values by kind: a text, a list), that task. `columns_table()` is the README's table (a
test keeps the two equal).
"""

from __future__ import annotations

from contextlib import closing
from typing import Any, Mapping

from .. import tasks
from ..tasks import Columns, Task
from .config import FinetuneConfig
from .data import DataError, Source, data_sources, where


def flag(field: str) -> str:
    """The CLI flag of a config field: text_column -> --text-column."""
    return "--" + field.replace("_", "-")


def column_fields() -> list[str]:
    """Every config field a task record names a column by, in the records' order."""
    return list(dict.fromkeys(f for t in tasks.TASKS.values() for shape in t.columns
                              for f in (*shape.required, *shape.optional)))


def shape_text(shape: Columns, names: Mapping[str, Any], code: str = "") -> str:
    """'text, label (+ --text-pair-column)': the shape's columns by their NAMES (config field -> column name), an
    optional one in brackets, a field without a name (None: not read unless set) by its flag. `code` quotes names."""
    text = ", ".join(f"{code}{names[f]}{code}" for f in shape.required if names[f] is not None)
    text += "".join(f" (+ {code}{names[f]}{code})" for f in shape.optional if names[f] is not None)
    unset = [f"{code}{flag(f)}{code}" for f in (*shape.required, *shape.optional) if names[f] is None]
    return text + (f" (+ a column named by {', '.join(unset)})" if unset else "")


def _missing(shape: Columns, row: set[str], names: Mapping[str, Any]) -> list[str]:
    """The fields of SHAPE whose columns ROW lacks (a field without a name is not read)."""
    return [f for f in shape.required if names[f] is not None and names[f] not in row]


def _used(shape: Columns, row: set[str], names: Mapping[str, Any]) -> int:
    return sum(names[f] in row for f in (*shape.required, *shape.optional) if names[f] is not None)


def _kind_fits(shape: Columns, field: str, value: Any) -> bool:
    """VALUE is of the kind SHAPE reads FIELD as: a text, a list, or (neither declared) any."""
    return ((field not in shape.texts or isinstance(value, str))
            and (field not in shape.lists or isinstance(value, list)))


def _has_shape(shape: Columns, values: Mapping[str, Any], names: Mapping[str, Any]) -> bool:
    """The row of VALUES has every column SHAPE requires, each of the columns it has holding the kind of value SHAPE
    reads there: a (query, [texts], [labels]) row has an embedding pair's column names, not its shape."""
    return not _missing(shape, set(values), names) and all(
        _kind_fits(shape, f, values[names[f]]) for f in (*shape.required, *shape.optional)
        if names[f] is not None and names[f] in values)


def fitting_tasks(values: Mapping[str, Any], names: Mapping[str, Any], other_than: str) -> list[str]:
    """The trainable tasks (other than OTHER_THAN) one of whose shapes the row of VALUES (column -> value) has, those
    using most of its columns."""
    row = set(values)
    fits: dict[str, int] = {}
    for record in tasks.TASKS.values():
        if record.train is None or record.name == other_than:
            continue
        used = [_used(s, row, names) for s in record.columns if _has_shape(s, values, names)]
        if used:
            fits[record.name] = max(used)
    best = max(fits.values(), default=0)
    return [name for name, used in fits.items() if used == best and best > 0]


def missing_columns_message(source: Source | str, line: int, values: Mapping[str, Any], record: Task,
                            names: Mapping[str, Any]) -> str | None:
    """Why the row of VALUES (SOURCE's row at LINE, column -> value) fits none of RECORD's shapes by its columns' names,
    or None when it fits one (its values are the reader's to check, naming the field)."""
    row = set(values)
    gaps = [_missing(shape, row, names) for shape in record.columns]
    if not gaps or min(map(len, gaps)) == 0:
        return None
    nearest = min(range(len(gaps)), key=lambda i: (len(gaps[i]), -_used(record.columns[i], row, names)))
    missing = gaps[nearest]
    if len(missing) == 1:
        head = f"{where(source, line, names[missing[0]])}: missing"
    else:
        head = f"{where(source, line)}: no columns {', '.join(repr(names[f]) for f in missing)}"
    shapes = " or ".join(shape_text(s, names) for s in record.columns)
    text = (f"{head}; the row has {sorted(row)}. {record.name} reads {shapes}; name the file's "
            f"column{'s' if len(missing) > 1 else ''} with {', '.join(flag(f) for f in missing)} "
            f"({', '.join(missing)} in a config file)")
    shape = record.columns[nearest]
    unused = sorted(row - {names[f] for f in (*shape.required, *shape.optional)})
    if len(missing) == 1 and len(unused) == 1 and _kind_fits(shape, missing[0], values[unused[0]]):
        text += f", e.g. {flag(missing[0])} {unused[0]}"
    fits = fitting_tasks(values, names, record.name)
    if fits:
        text += f"; the row's columns fit {' or '.join(fits)} ({' or '.join(f'--task {t}' for t in fits)})"
    return text


def check_columns(config: FinetuneConfig) -> None:
    """The first row of each data source (train, eval) has one of the task's shapes of columns; a DataError naming the
    missing columns, their flags and the tasks the row fits if not. A source in a format of the task's own (a CoNLL
    or .txt file, SQuAD JSON) is the task's reader's to check."""
    record = tasks.get(config.task)
    names = {f: getattr(config, f) for f in column_fields()}
    if config.teacher:  # distillation: a row may lack the targets its teacher stands in for (not read: None)
        names.update(dict.fromkeys(record.train_task.teacher_stands_in_for, None))
    for source in data_sources(config):
        if source is None or not record.columns or record.train_task.reads_own_format(source):
            continue
        with closing(source.records()) as rows:
            head = next(rows, None)
        if head is None:  # an empty source: the reader says so
            continue
        message = missing_columns_message(source, head.line, head.values, record, names)
        if message is not None:
            raise DataError(message)


def columns_table() -> str:
    """The README's table: each fine-tuning task's columns under their default names, the flags that rename them,
    and the other files it reads."""
    defaults = {f: FinetuneConfig.model_fields[f].default for f in column_fields()}
    lines = ["| task | a row's columns (default names) | renamed with | or a file |", "|---|---|---|---|"]
    for record in tasks.TASKS.values():
        if record.train is None:
            continue
        fields = dict.fromkeys(f for s in record.columns for f in (*s.required, *s.optional))
        shapes = "; or ".join(shape_text(s, defaults, code="`") for s in record.columns)
        lines.append(f"| {record.name} | {shapes} | {', '.join(f'`{flag(f)}`' for f in fields)} | {record.files} |")
    return "\n".join(lines)


__all__ = ["check_columns", "column_fields", "columns_table", "fitting_tasks", "flag", "missing_columns_message",
           "shape_text"]
