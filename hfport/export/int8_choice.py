"""dtype="auto-int8" on a model folder, through hfport.pipeline(): the fastest int8 path that passes its gate, chosen
by measurement among the paths installed, and said. pipeline() sits a floor below the exporters, so `choose` is handed
down to it (hfport.pipelines' INT8_CHOOSER, installed when this module is imported: hfport.export imports it), as
hfport.int8 hands its loader to modeling.

The paths (INT8_PATHS, in this order):
    torch      hfport's own engine, the encoder's Linear layers in int8 (hfport/int8.py, its gate)
    onnx       an onnx-int8 export of the folder (export/onnx.py, its verify and gate), run by onnxruntime
    openvino   an openvino-int8 export (export/openvino.py, its verify and gate), run by OpenVINO
A graph path takes part only where its runtime and exporter import (the `onnx` / `openvino` extras) and where it can
serve the call (pipeline() asks for it only on the CPU, for a task with a graph, without adapters); `paths` narrows
the set (the server keeps to "torch": its models share bodies and serve adapters).

Each graph path is exported into the cache (<cache_dir>/int8-paths/<key>/<format>/; the key: the folder's files as
read, the task, the gate data, hfport's version and source digest, torch's and the runtimes' versions, the CPU's name
and int8 instructions). An export its verify refuses (the int8 gate included) is out, with the reason kept. The
paths that passed are timed on the same inputs (measured_inputs(): the user's gate data where given, their own
workload; else the gate's built-in short texts and pairs, as the task's inputs) in both ways a served model is called:
in batches of 32 through the pipeline each path serves (texts/s, the best of MEASURE_PASSES passes after a warm-up),
and one text at a time (one_text_ms: a query by itself). The path with the highest `score`, the geometric mean of
the two speeds, serves: both count by their ratios, so a path twice as fast on one text outweighs one 1.2x as fast
in batches (all-MiniLM-L6-v2 on a 2-core EPYC: hfport's engine measured up to ~10% faster than the OpenVINO IR in
batches of short texts on some runs, and less than half as fast on one). Its figures are written to
choice.json beside the exports and logged; a later load with the same key reads that choice instead of exporting and
timing again (a choice whose folder is gone is made again). One process at a time makes a key's choice (_choosing: a
lock file beside choice.json); another loading the same folder meanwhile waits, then reads it. When every path is
refused, the torch path's own answer serves: bf16, as dtype="auto-int8" on the model. Making a choice that exports
graphs shows a progress bar (minutes for a real model; none at the quiet verbosity).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from .. import hardware, hub, pipelines, probes
from ..errors import ExportError, ItemError
from ..formats.encoded import FolderLock
from ..int8_verdicts import code_digest, files_digest
from ..settings import settings
from ..version import __version__
from .registry import export
from .report import VerifyFailed

log = logging.getLogger("hfport")

FOLDER = "int8-paths"  # under the setting cache_dir
CHOICE_FILE = "choice.json"
LOCK_FILE = ".choosing.lock"  # beside it: held by the process making the choice (_choosing)
FORMAT = 2  # bumped when choice.json's layout changes (2: one_text_ms)
MEASURE_PASSES = 3
SINGLE_TEXTS = 16  # the texts one_text_ms times alone, each its best of MEASURE_PASSES calls
# the most inputs timed in batches: a user's gate data may hold thousands, each timed MEASURE_PASSES + 1 times per path
# (minutes a path for a BERT-base shape); an even sample over their order keeps their mix of lengths
MAX_MEASURED = 512


@dataclass(frozen=True)
class Int8Path:
    """One way to serve a model in int8: its export format (None: hfport's engine) and what must import for it."""

    name: str
    format: str | None
    requires: tuple[str, ...] = ()

    def installed(self) -> bool:
        return all(importlib.util.find_spec(module) is not None for module in self.requires)


INT8_PATHS = (Int8Path("torch", None), Int8Path("onnx", "onnx-int8", ("onnxruntime", "onnx")),
              Int8Path("openvino", "openvino-int8", ("openvino", "nncf", "onnx")))
PATH_NAMES = tuple(p.name for p in INT8_PATHS)


@dataclass
class Int8Choice:
    """What auto-int8 chose and why: the path serving, its folder (a graph export; None: the torch engine, or the
    bf16 fallback when `path` is None), each timed path's texts/s in batches (`measured`) and milliseconds for one
    text alone (`one_text_ms`), and each refused path's reason."""

    path: str | None
    folder: str | None = None
    measured: dict[str, float] = field(default_factory=dict)
    one_text_ms: dict[str, float] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)

    def score(self, name: str) -> float:
        """NAME's rank: the geometric mean of its texts/s in batches and its one-text calls per second (module
        docstring)."""
        ms = self.one_text_ms.get(name)
        return math.sqrt(self.measured[name] * 1000.0 / ms) if ms else self.measured[name]

    def line(self) -> str:
        """One line for the log and the model's load notes."""
        ranked = sorted(self.measured, key=self.score, reverse=True)
        timed = ", ".join(f"{name} {self.measured[name]:.0f}" + (f" / {self.one_text_ms[name]:.1f} ms"
                                                                   if name in self.one_text_ms else "")
                          for name in ranked)
        refused = "; ".join(f"{name}: {why}" for name, why in self.refused.items())
        head = f"auto-int8 chose {self.path}" if self.path else "auto-int8: no int8 path passed its gate"
        return (head + (f" (texts/s in batches / one text: {timed})" if timed else "")
                + (f"; refused {refused}" if refused else ""))


def measured_inputs(pipe: Any, gate_data: str | os.PathLike[str] | None = None) -> list[Any]:
    """What every path is timed on: PIPE's task inputs (Pipeline.sample_inputs: texts and passages, questions with
    their contexts, masked texts) made of the user's GATE_DATA, their own workload (the paths rank differently by
    length, since hfport's engine is padding-free and a graph pads each batch to its longest row); else of the int8
    gate's built-in short texts and pairs (4-50 tokens: queries and sentences). Only inputs PIPE prepares are kept (a
    text past its input limit would fail at once and time nothing; gate data with none it takes: the built-in
    ones), at most MAX_MEASURED of them, every k-th."""
    if gate_data is not None:
        data = probes.read_gate_data(gate_data)
        texts, pairs = data.texts, data.pairs
    else:
        texts, pairs = probes.judged_texts(), probes.judged_pairs()
    inputs = pipe.sample_inputs(texts, pairs)
    failed = pipe.prepare(inputs).failed
    fit = [item for i, item in enumerate(inputs) if i not in failed]
    if not fit and gate_data is not None:  # none of the user's inputs fits: the built-in ones
        return measured_inputs(pipe)
    step = max(1, math.ceil(len(fit) / MAX_MEASURED))
    return fit[::step]  # at most MAX_MEASURED, spread over all of them


def texts_per_second(pipe: Any, texts: list[Any], passes: int = MEASURE_PASSES) -> float:
    """TEXTS (PIPE's inputs: measured_inputs) through PIPE: one warm-up pass, then the best of PASSES passes, in
    inputs/s. An input that fails (an ItemError in place of its answer) would be timed as nothing: an ExportError."""
    failed = [r for r in pipe.predict(texts) if isinstance(r, ItemError)]
    if failed:
        raise ExportError(f"{len(failed)} of the {len(texts)} timed inputs failed ({failed[0].message}): the paths "
                          "cannot be timed on them")
    best = min(_timed(pipe, texts) for _ in range(passes))
    return len(texts) / best


def one_text_ms(pipe: Any, texts: list[Any], passes: int = MEASURE_PASSES, count: int = SINGLE_TEXTS) -> float:
    """The first COUNT of TEXTS through PIPE one at a time, a query by itself: each text's best of PASSES calls after
    a warm-up call, the median over the texts, in milliseconds."""
    best = []
    for text in texts[:count]:
        pipe.predict([text])  # warm-up: this length's first call
        best.append(min(_timed(pipe, [text]) for _ in range(passes)))
    return statistics.median(best) * 1000.0


def _timed(pipe: Any, texts: list[str]) -> float:
    start = time.perf_counter()
    pipe.predict(texts)
    return time.perf_counter() - start


def choice_key(folder: Path, task: str, gate_data: str | os.PathLike[str] | None, paths: Sequence[str]) -> str:
    """The cache key of a choice (the module docstring lists what it covers): the folder's files (weights, config,
    tokenizer, sentence-transformers files) and the gate data's, by int8_verdicts' files_digest."""
    files = tuple(sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                         if p.is_file() and not p.name.startswith(".")))
    gate = Path(gate_data).expanduser() if gate_data is not None else None
    key = {"format": FORMAT, "folder": files_digest(folder, files), "task": task, "paths": list(paths),
           "gate_data": files_digest(gate.parent, (gate.name,)) if gate is not None else "builtin",
           "hfport": [__version__, code_digest()], "torch": torch.__version__,
           "runtimes": {name: _version(name) for name in ("onnxruntime", "openvino", "nncf", "onnx")},
           "cpu": [hardware.cpu_name(), hardware.int8_isa()]}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _version(module: str) -> str:
    try:
        return importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:  # not installed: part of the key as such
        return "-"


def read_choice(where: Path) -> Int8Choice | None:
    """The choice kept at WHERE, or None (missing, unreadable, another layout, or its graph folder gone)."""
    try:
        raw = json.loads((where / CHOICE_FILE).read_text(encoding="utf-8"))
        choice = Int8Choice(raw["path"], raw.get("folder"), dict(raw.get("measured") or {}),
                            dict(raw.get("one_text_ms") or {}), dict(raw.get("refused") or {}))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if choice.path not in (None, *PATH_NAMES) or (choice.folder is not None and not Path(choice.folder).is_dir()):
        return None
    return choice


def choose(folder: str | os.PathLike[str], task: str, *, load_torch: Callable[[], Any],
           open_graph: Callable[[Path], Any], make_pipeline: Callable[[Any], Any],
           gate_data: str | os.PathLike[str] | None = None,
           paths: Sequence[str] | None = None) -> tuple[Int8Choice, Any]:
    """(the choice, the model it serves) for FOLDER as TASK. LOAD_TORCH: the torch path's int8 model (raises
    Int8GateError when its gate refuses); OPEN_GRAPH: a graph folder opened for serving; MAKE_PIPELINE: a model ->
    the pipeline it is timed through. PATHS: the paths allowed (default: every one installed)."""
    unknown = set(paths or ()) - set(PATH_NAMES)
    if unknown:
        raise ValueError(f"int8_paths {sorted(unknown)}: use some of {list(PATH_NAMES)}")
    if gate_data is not None:  # a bad file is named once, up front: not as every path's refusal after its export
        probes.read_gate_data(gate_data)
    source = hub.resolve(folder)
    allowed = [p for p in INT8_PATHS if p.installed() and (paths is None or p.name in paths)]
    where = Path(settings().cache_dir) / FOLDER / choice_key(source, task, gate_data, [p.name for p in allowed])[:32]
    kept = read_choice(where)
    if kept is None:
        where.mkdir(parents=True, exist_ok=True)
        with _choosing(where):
            kept = read_choice(where)  # made by the process this one waited for
            if kept is None:
                return _choose(source, where, allowed, load_torch, open_graph, make_pipeline, gate_data)
    log.info("%s: %s (kept in %s)", source, kept.line(), where)
    return kept, _serve(kept, load_torch, open_graph)


@contextmanager
def _choosing(where: Path) -> Iterator[None]:
    """Held while this process makes the choice kept at WHERE (an flock, dropped by the kernel if the holder dies):
    another process making the same one waits, then reads it, instead of exporting into the same folders, timing
    under the other's load and serving a choice of its own."""
    lock = FolderLock(where / LOCK_FILE)
    if not lock.acquire(exclusive=True):
        log.info("%s: process %s is making this auto-int8 choice; waiting for it", where, lock.holder())
        lock.acquire(exclusive=True, wait=math.inf)
    lock.note_holder()
    try:
        yield
    finally:
        lock.release()


def _choose(source: Path, where: Path, allowed: list[Int8Path], load_torch: Callable[[], Any],
            open_graph: Callable[[Path], Any], make_pipeline: Callable[[Any], Any],
            gate_data: str | os.PathLike[str] | None) -> tuple[Int8Choice, Any]:
    """choose()'s measurement, no choice being kept at WHERE: the ALLOWED paths exported, gated and timed; the
    choice written there and logged."""
    choice, models = Int8Choice(None), {}
    quiet = not log.isEnabledFor(logging.WARNING)  # HFPORT_VERBOSITY=quiet / -q: no bar
    bar = tqdm(allowed, desc="auto-int8: exporting and gating the int8 paths", unit="path",
               disable=quiet or all(p.format is None for p in allowed))
    for path in bar:
        bar.set_postfix_str(path.name)
        try:
            if path.format is None:
                models[path.name] = load_torch()
            else:
                out = where / path.format
                export(source, out, format=path.format, force=True,
                       **({"gate_data": str(gate_data)} if gate_data is not None else {}))
                models[path.name] = open_graph(out)
        except ExportError as e:  # Int8GateError and VerifyFailed are ExportErrors: the gate or the proof refused
            choice.refused[path.name] = refusal(e)
    pipes = {name: make_pipeline(model) for name, model in models.items()}
    texts = measured_inputs(next(iter(pipes.values())), gate_data) if pipes else []
    for name, pipe in pipes.items():
        choice.measured[name] = round(texts_per_second(pipe, texts), 1)
        choice.one_text_ms[name] = round(one_text_ms(pipe, texts), 2)
    if choice.measured:
        choice.path = max(choice.measured, key=choice.score)
        fmt = next(p.format for p in INT8_PATHS if p.name == choice.path)
        choice.folder = str(where / fmt) if fmt is not None else None
    hub.write_json_atomic(where / CHOICE_FILE, asdict(choice))
    log.info("%s: %s", source, choice.line())
    return choice, models.get(choice.path) if choice.path is not None else None


def refusal(error: ExportError) -> str:
    """A refused path's reason in one line: the error's first line and, for a verify that failed (whose first line
    only says so), its failed rows (at most three: e.g. the int8 gate's statistic against its bound)."""
    line = str(error).strip().splitlines()[0]
    if isinstance(error, VerifyFailed) and error.report.failures:
        rows = error.report.failures
        line += " (failed: " + "; ".join(f"{r.check} {r.output}, {r.tolerance or 'no tolerance'}" for r in rows[:3]) \
            + (f"; {len(rows) - 3} more" if len(rows) > 3 else "") + ")"
    return line[:600]


def _serve(choice: Int8Choice, load_torch: Callable[[], Any], open_graph: Callable[[Path], Any]) -> Any:
    """The model CHOICE serves: its graph folder opened, else the torch path (None: the caller's bf16 fallback)."""
    if choice.folder is not None:
        return open_graph(Path(choice.folder))
    return load_torch() if choice.path == "torch" else None


pipelines.INT8_CHOOSER = choose  # every pipeline(dtype="auto-int8") on a folder weighs the paths through it

__all__ = ["INT8_PATHS", "Int8Choice", "Int8Path", "PATH_NAMES", "choose", "measured_inputs", "one_text_ms",
           "read_choice", "texts_per_second"]
