"""The HF folder format: SRC as a folder transformers loads, and the proof that it computes what SRC computes.

`write_folder(source, out, options)` gives OUT the layout transformers writes: config.json (the source config with
the trained head's metadata and the hfport version), model.safetensors (or shards + index) under transformers' key
names, the tokenizer files, and a README.md model card. A layout step adds a format's own files (the
sentence-transformers formats, export/sentence_formats.py); the plain format keeps a source's sentence-transformers
layout. Everything is written into a hidden sibling folder (hfport/staging.py) and renamed into place at the end, so
no failure (a full disk included) leaves a half-written OUT; with verify=True the staged folder is proven before the
rename.

`verify_folder(dir, source)`: transformers loads DIR cleanly and computes what hfport computes from SOURCE
(export/checks.py has the checks, export/report.py the tolerances); a folder in a sentence-transformers format also
gets its own loader's rows. Without SOURCE, DIR itself is the source: transformers' load of DIR against hfport's
load of the same folder. Both models run in float32 on the CPU, so the comparison isolates what the export changed;
the `weights` check stays exact at every dtype, so a tampered tensor is caught even where the output tolerance is
loose. Fails closed: every check that cannot run counts as a failure.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, field_validator

from .. import hub
from ..modeling import PreTrainedEncoder, task_of
from ..registry import get_family
from ..tasks import load_any
from ..tokenizer import copy_tokenizer_files
from .card import PLAIN, CardStyle, write_card
from .checks import (PROBE_PAIRS, PROBE_TEXTS, check_labels, check_weights, compare_models, folder_dtype,
                     transformers_rows)
from .common import (DTYPE_NAMES, EXPORT_DTYPES, ExportError, ExportResult, FormatOptions, Source,
                     export_config, no_tokenizer_message, resolve_source, staged, tokenizer_folder)
from .report import VerifyFailed, VerifyReport, check_row, reporting
from .sentence_formats import keep_layout, sentence_rows

log = logging.getLogger("hfport")

# (staged folder, source, the loaded model, the options): adds a format's files (the card reads what it wrote)
LayoutStep = Callable[[Path, Source, PreTrainedEncoder, Any], None]


class ExportOptions(FormatOptions):
    """How to export a folder of weights (the HF folder, adapter and sentence-transformers formats): the options
    `hfport export`, `hfport.export()` and the server's export jobs share.

    (Where to write, whether to replace it, verify and the report path are the caller's, not options.)"""

    dtype: Literal["fp32", "fp16", "bf16"] = Field("fp32", description="the dtype the weights are stored in")
    max_shard_size: int | str = Field("5GB", description="shard the weights above this size (bytes, or '500MB')")
    atol: float | None = Field(None, description="verify's absolute tolerance (default by dtype)")
    rtol: float | None = Field(None, description="verify's relative tolerance (default by dtype)")

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype(cls, v: Any) -> Any:
        if v not in EXPORT_DTYPES:
            raise ValueError(f"dtype {v!r}: expected one of {list(EXPORT_DTYPES)}")
        return v

    @field_validator("max_shard_size")
    @classmethod
    def _size(cls, v: int | str) -> int | str:
        try:
            limit = hub.parse_size(v)
        except (ValueError, AttributeError) as e:
            raise ValueError(f"max_shard_size {v!r}: expected bytes or a size like '500MB', '2GB'") from e
        if limit <= 0:
            raise ValueError(f"max_shard_size {v!r}: must be positive")
        return v


class SentenceTransformersOptions(ExportOptions):
    """The sentence-transformers embedding format: ExportOptions, and how the folder pools (default: as the source's
    layout says, else mean pooling without normalizing)."""

    pooling: Literal["mean", "cls", "max"] | None = Field(None, description="mean | cls | max (default: the "
                                                                            "source's)")
    normalize: bool | None = Field(None, description="L2-normalise the embeddings (default: the source's)")


def load_exportable(source: Source) -> PreTrainedEncoder:
    """SRC's model in float32, refused when hfport would have to initialise weights or some are NaN/inf."""
    model = load_any(source.model, dtype=torch.float32)
    report = model.load_report
    if report is not None and report.initialized:
        raise ExportError(f"{source.model}: lacks weights the {model.family.architectures.get(model.task)} model "
                          f"needs ({', '.join(report.initialized[:8])}); hfport would initialise them randomly, so "
                          "the export would not be the trained model")
    if report is not None and report.nonfinite:
        raise ExportError(f"{source.model}: NaN or inf values in {len(report.nonfinite)} weight(s): "
                          f"{', '.join(report.nonfinite[:8])}; refusing to export a broken model")
    if report is not None and report.unexpected:
        log.warning("%s: not exported (the %s head does not use them): %s", source.model, model.task,
                    ", ".join(report.unexpected[:8]))
    if model.family.architectures.get(model.task) is None:
        raise ExportError(f"{source.model}: the {model.family.model_type} family has no transformers class for "
                          f"the {model.task} head")
    return model


def write_folder(source: Source, out: Path, options: ExportOptions, *, verify: bool = False,
                 json_path: str | os.PathLike[str] | None = None, layout: LayoutStep = keep_layout,
                 card: CardStyle = PLAIN, prove: Callable[..., VerifyReport] | None = None) -> ExportResult:
    """SOURCE as an HF folder at OUT (plus LAYOUT's files, and the model card with CARD's format bits); with
    verify=True, proven by PROVE (the format's verify; default verify_folder) before OUT appears."""
    if source.adapter:
        raise ExportError(f"{source.model}: a LoRA adapter; export it as the adapter (format peft) or merged "
                          "(format merged)")
    limit = hub.parse_size(options.max_shard_size)
    model = load_exportable(source)
    architecture = model.family.architectures[model.task]
    tok_folder = tokenizer_folder(source)
    if tok_folder is None:
        raise ExportError(no_tokenizer_message(source))
    torch_dtype = EXPORT_DTYPES[options.dtype]
    task = model.task
    model = model.to(torch_dtype)

    with staged(out) as staging:
        files = hub.save_weights(model.hf_state_dict(), staging, limit)
        config = export_config(model, architecture, torch_dtype)
        hub.write_json_atomic(staging / "config.json", config)
        copy_tokenizer_files(tok_folder, staging)
        layout(staging, source, model, options)
        del model  # verify loads the source afresh, in float32
        result = ExportResult(out, source.model, config["model_type"], task, DTYPE_NAMES[torch_dtype], [], files,
                              tok_folder)
        if verify:
            result.report = (prove or verify_folder)(staging, source.model, atol=options.atol, rtol=options.rtol,
                                                     json_path=json_path, label=str(out))
            raise_unless_passed(result.report, out, source.model)
        write_card(staging, source, result, card)  # after verify: the card states its outcome
        result.files = sorted(p.name for p in staging.iterdir())
    return result


def raise_unless_passed(report: VerifyReport, out: Path, source: Path, what: str = "export") -> None:
    if not report.passed:
        raise VerifyFailed(f"{out}: the {what} does not match {source}; nothing was written\n" + report.table(),
                           report)


def verify_folder(dir: str | os.PathLike[str], source: str | os.PathLike[str] | None = None, *,
                  atol: float | None = None, rtol: float | None = None,
                  json_path: str | os.PathLike[str] | None = None, which: str = "best",
                  label: str | None = None) -> VerifyReport:
    """transformers loads DIR cleanly and computes what hfport computes from SOURCE (default: DIR itself).

    atol/rtol default by DIR's dtype (report.TOLERANCES). Never raises for a failed check: the report says FAIL and
    names what failed. json_path: also write the report there."""
    folder = Path(dir).expanduser()
    report = VerifyReport(label or str(folder), str(source if source is not None else folder))
    with reporting(report, json_path):
        _verify_folder(folder, source if source is not None else folder, which, atol, rtol, report)
    return report


def _read_head(folder: Path, report: VerifyReport, atol: float | None, rtol: float | None) -> tuple[dict, str] | None:
    """DIR's config.json and task (a config row), and the report's dtype and tolerances; None when it failed."""
    with check_row(report, "config", "config.json"):
        if not folder.is_dir():
            raise ExportError(f"{folder}: no such folder")
        raw, cfg_source = hub.read_config(folder)
        family = get_family(raw.get("model_type"), cfg_source)
        if not raw.get("architectures"):
            raise ExportError(f"{cfg_source}: no 'architectures' entry; transformers' head cannot be chosen")
        task = task_of(family, raw["architectures"])
        if family.architectures.get(task) != raw["architectures"][0]:
            raise ExportError(f"{cfg_source}: architectures {raw['architectures']} is not a "
                              f"{family.model_type} class hfport knows ({sorted(family.architectures.values())})")
        report.set_tolerances(folder_dtype(folder, raw), atol, rtol)
        report.add("config", "config.json", True, detail=f"{family.model_type} {task} {report.dtype}")
        return raw, task
    return None


def _verify_folder(folder: Path, source_arg: Any, which: str, atol: float | None, rtol: float | None,
                   report: VerifyReport) -> None:
    head = _read_head(folder, report, atol, rtol)
    if head is None:
        return
    raw, task = head
    ours: PreTrainedEncoder | None = None
    with check_row(report, "source", str(source_arg)):
        src = resolve_source(source_arg, which)
        model = load_any(src.model, dtype=torch.float32)
        if model.task != task:
            raise ExportError(f"{src.model} holds a {model.task} model; {folder} holds a {task} model")
        ours, report.source = model, str(src.model)
    if ours is not None:
        with check_row(report, "labels", "id2label/label2id"):
            check_labels(report, raw, ours)
        with check_row(report, "weights", "model.safetensors"):
            check_weights(report, folder, ours)
    theirs, batches = transformers_rows(report, folder, task, raw)
    if ours is not None:  # a sentence-transformers folder (embeddings, cross-encoder): its own loader agrees too
        with check_row(report, "sentence-transformers", "load"):
            sentence_rows(report, folder, raw, ours, Path(report.source), PROBE_TEXTS, PROBE_PAIRS)
    if ours is not None and theirs is not None and batches:
        compare_models(report, batches, ours, theirs, task)
