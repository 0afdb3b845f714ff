"""The export formats: one record a format (its name, what it writes, its options, its writer, its verify, and
whether a folder is one of its own), and the two entry points that dispatch through them:

    export(src, out, format="hf", **options)   write SRC in that format at OUT (staged, verified before it appears)
    verify(dir, source=None)                   prove DIR with the verify of the format it is (or `format=`)

The CLI's `--format` choices and help, the HTTP export jobs and `hfport verify` read FORMATS; adding a format is a
module with its writer and verify plus one record here (its `card`: what its model card adds). Detection asks the
formats in FORMATS' order, the most specific first (an ONNX folder also has a config.json; an embedding folder is
also an HF folder).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from .. import hub, lora
from ..errors import HfportError
from ..pipelines.onnx_backend import QUANTIZED_FILE, is_onnx_model
from ..rundir import RunDir
from .card import PLAIN, CardStyle
from .common import ExportError, ExportResult, FormatOptions, check_out, resolve_source
from .folder import ExportOptions, SentenceTransformersOptions, verify_folder, write_folder
from .onnx import ONNX_CARD, OnnxOptions, write_onnx
from .onnx_verify import verify_onnx
from .openvino import OPENVINO_CARD, OpenVinoOptions, write_openvino
from .openvino_verify import verify_openvino
from .peft import ADAPTER_CARD, MERGED_CARD, verify_adapter, verify_merged, write_adapter, write_merged
from .report import VerifyReport
from .sentence_formats import embedding_layout, reranker_marker
from .sparse_format import sparse_layout, verify_sparse
from ..formats.openvino import QUANTIZED_IR_FILE, is_openvino_model
from ..formats.sentence_transformers import has_embedding_layout, has_sparse_layout, is_cross_encoder

# (source, out, options, *, verify, json_path) -> ExportResult
Writer = Callable[..., ExportResult]
# (dir, source, *, which, json_path, label, **its verify options) -> VerifyReport
Verifier = Callable[..., VerifyReport]


@dataclass(frozen=True)
class ExportFormat:
    name: str
    writes: str  # one line: what OUT holds (CLI help, OpenAPI, error messages)
    options: type[FormatOptions]  # its options (pydantic; unknown ones are errors)
    write: Writer
    verify: Verifier
    detect: Callable[[Path], bool] | None = None  # is a folder one of its own (None: its output is another's)
    verify_options: tuple[str, ...] = ("atol", "rtol")  # keywords its verify takes besides which/json_path/label
    adapter_format: str | None = None  # a LoRA adapter source is written in this format instead
    adapter_verify: str | None = None  # a folder of this format checked against an adapter SOURCE: that format's
    always_verified: bool = False  # the writer proves the folder whatever `verify` says
    quantized: dict[str, str] = field(default_factory=dict)  # `--quantize` value -> the format that writes it
    card: CardStyle = PLAIN  # what its model card adds (library, tags, its files, how to use it): export/card.py

    def option_names(self) -> list[str]:
        return list(self.options.model_fields)


def _config(folder: Path) -> dict[str, Any]:
    try:
        return hub.read_config(folder)[0] if (folder / "config.json").is_file() else {}
    except (OSError, ValueError, json.JSONDecodeError):
        return {}  # a broken config.json: the HF format's verify says what is wrong with it


def _is_onnx(folder: Path) -> bool:
    return folder.is_dir() and is_onnx_model(folder)


def _is_openvino(folder: Path) -> bool:
    return folder.is_dir() and is_openvino_model(folder)


FORMATS: dict[str, ExportFormat] = {f.name: f for f in (
    ExportFormat("onnx-int8", "model.onnx (fp32) + model_quantized.onnx (int8, dynamic quantization), config.json, "
                 "tokenizer, hfport_onnx.json", OnnxOptions, partial(write_onnx, quantize="int8"), verify_onnx,
                 detect=lambda p: _is_onnx(p) and (p / QUANTIZED_FILE).is_file(),
                 verify_options=("atol", "rtol", "min_agreement", "min_cosine", "gate_data"), always_verified=True,
                 card=ONNX_CARD),
    ExportFormat("onnx", "model.onnx (fp32, the layout optimum writes), config.json, tokenizer, hfport_onnx.json",
                 OnnxOptions, write_onnx, verify_onnx, detect=_is_onnx,
                 verify_options=("atol", "rtol", "min_agreement", "min_cosine", "gate_data"), always_verified=True,
                 quantized={"int8": "onnx-int8"}, card=ONNX_CARD),
    ExportFormat("openvino-int8", "openvino_model.xml/.bin (fp32 IR) + openvino_model_qint8_quantized.xml/.bin (int8, "
                 "NNCF static quantization), config.json, tokenizer, hfport_openvino.json", OpenVinoOptions,
                 partial(write_openvino, quantize="int8"), verify_openvino,
                 detect=lambda p: _is_openvino(p) and (p / QUANTIZED_IR_FILE).is_file(),
                 verify_options=("atol", "rtol", "min_agreement", "min_cosine", "gate_data"), always_verified=True,
                 card=OPENVINO_CARD),
    ExportFormat("openvino", "openvino_model.xml/.bin (the fp32 OpenVINO IR, made from hfport's ONNX graph), "
                 "config.json, tokenizer, hfport_openvino.json", OpenVinoOptions, write_openvino, verify_openvino,
                 detect=_is_openvino, verify_options=("atol", "rtol", "min_agreement", "min_cosine", "gate_data"),
                 always_verified=True, quantized={"int8": "openvino-int8"}, card=OPENVINO_CARD),
    ExportFormat("peft", "a LoRA adapter in PEFT's format (adapter_config.json, adapter_model.safetensors), "
                 "config.json, tokenizer", ExportOptions, write_adapter, verify_adapter,
                 detect=lora.is_adapter_folder, card=ADAPTER_CARD),
    ExportFormat("merged", "a LoRA adapter merged into its base: a plain HF folder transformers loads",
                 ExportOptions, write_merged, verify_merged, card=MERGED_CARD),
    ExportFormat("sparse-encoder", "an HF masked-LM folder + modules.json, 1_SpladePooling: what SparseEncoder loads "
                 "(SPLADE)", ExportOptions, partial(write_folder, layout=sparse_layout, prove=verify_sparse),
                 verify_sparse,
                 detect=lambda p: (p / "config.json").is_file() and has_sparse_layout(p)),
    ExportFormat("sentence-transformers", "an HF folder of the bare encoder + modules.json, 1_Pooling, "
                 "2_Normalize: what SentenceTransformer loads", SentenceTransformersOptions,
                 partial(write_folder, layout=embedding_layout), verify_folder,
                 detect=lambda p: (p / "config.json").is_file() and has_embedding_layout(p)),
    ExportFormat("cross-encoder", "an HF folder of a one-label classifier with CrossEncoder's marker: a reranker "
                 "CrossEncoder loads", ExportOptions, partial(write_folder, layout=reranker_marker), verify_folder,
                 detect=lambda p: is_cross_encoder(_config(p))),
    ExportFormat("hf", "a folder transformers loads: config.json, model.safetensors, tokenizer, README.md (an "
                 "adapter source stays an adapter: peft)", ExportOptions, write_folder, verify_folder,
                 detect=lambda p: (p / "config.json").is_file(), adapter_format="peft",
                 adapter_verify="merged"),
)}
DEFAULT_FORMAT = "hf"


def get_format(name: str) -> ExportFormat:
    """The format record NAME; an ExportError listing the formats otherwise."""
    try:
        return FORMATS[name]
    except (KeyError, TypeError):
        raise ExportError(f"format {name!r}: expected one of {list(FORMATS)}") from None


def detect_format(folder: str | os.PathLike[str]) -> ExportFormat | None:
    """The first format (in FORMATS' order) that says FOLDER is one of its own; None when none does."""
    path = Path(folder).expanduser()
    if not path.is_dir():
        return None
    return next((f for f in FORMATS.values() if f.detect is not None and f.detect(path)), None)


def formats_help() -> str:
    """One line a format, for the CLI's --format help and the HTTP schema's description."""
    return "; ".join(f"{f.name}: {f.writes}" for f in FORMATS.values())


def export(src: str | os.PathLike[str], out: str | os.PathLike[str], *, format: str = DEFAULT_FORMAT,
           force: bool = False, verify: bool = False, json_path: str | os.PathLike[str] | None = None,
           merge: bool = False, base_model: str | os.PathLike[str] | None = None, **options: Any) -> ExportResult:
    """Write SRC at OUT in FORMAT (FORMATS), with the format's OPTIONS (ExportOptions for the weight folders:
    which, dtype, max_shard_size, atol, rtol; OnnxOptions for ONNX, OpenVinoOptions for OpenVINO); with verify=True,
    prove it against SRC before OUT appears (the ONNX and OpenVINO formats always do). An existing OUT is only
    replaced with force.

    A LoRA adapter source exported as "hf" stays an adapter ("peft"); merge=True is format "merged". base_model: an
    adapter source's base folder (default: the one its adapter_config.json names), loaded by the export and its
    verify alike."""
    fmt = get_format(format)
    if merge:
        if fmt.name not in (DEFAULT_FORMAT, "merged"):
            raise ExportError(f"merge: folds a LoRA adapter into an HF folder (format merged), not format {fmt.name}")
        fmt = FORMATS["merged"]
    opts = fmt.options.of(**options)
    source = resolve_source(src, opts.which)
    if base_model is not None:
        if not source.adapter:
            raise ExportError(f"base_model: {source.model} is a plain model, not a LoRA adapter over a base")
        source.base_model = Path(base_model).expanduser()
    target = Path(out).expanduser()
    check_out(source, target, force)
    if fmt.adapter_format is not None and source.adapter:
        fmt = FORMATS[fmt.adapter_format]
    result = fmt.write(source, target, opts, verify=verify, json_path=json_path, card=fmt.card)
    result.format = fmt.name
    return result


def verify(dir: str | os.PathLike[str], source: str | os.PathLike[str] | None = None, *, format: str | None = None,
           which: str = "best", json_path: str | os.PathLike[str] | None = None, label: str | None = None,
           **checks: Any) -> VerifyReport:
    """Prove DIR with its format's verify: against SOURCE (what it was exported from), or, without it, against
    hfport's own load of what DIR names (an adapter's base, an ONNX folder's recorded source, the folder itself).
    FORMAT: the format's name, else the one DIR says it is. CHECKS: the verify's options (atol, rtol; an ONNX
    folder's min_agreement, min_cosine, gate_data). Never raises for a failed check: a folder no format recognises
    is a FAIL row. json_path: also write the report there. DIR may be a fine-tune output folder: its best/ (or
    WHICH) is proven."""
    folder = Path(dir).expanduser()
    if RunDir.is_run(folder):  # a fine-tune output folder stands for its best/ (final/), as export takes it
        try:
            folder = resolve_source(folder, which).model
        except HfportError as e:  # a run without that model: a FAIL row, like any check that cannot run
            report = VerifyReport(label or str(folder), str(source if source is not None else folder))
            report.add("format", str(folder), False, detail=str(e))
            if json_path is not None:
                report.write_json(json_path)
            return report
    fmt = get_format(format) if format is not None else detect_format(folder)
    given = {k: v for k, v in checks.items() if v is not None}
    if fmt is not None and format is None and fmt.adapter_verify is not None and source is not None:
        try:
            if resolve_source(source, which).adapter:  # an HF folder from an adapter: the merge of it
                fmt = FORMATS[fmt.adapter_verify]
        except HfportError:
            pass  # the format's own verify reports the source it cannot resolve
    if fmt is not None:
        unknown = sorted(set(given) - set(fmt.verify_options))
        if unknown:
            raise ExportError(f"{', '.join(unknown)}: not an option of the {fmt.name} verify (it takes "
                              f"{', '.join(fmt.verify_options)})")
        return fmt.verify(folder, source, which=which, json_path=json_path, label=label, **given)
    report = VerifyReport(label or str(folder), str(source if source is not None else folder))
    what = "no such folder" if not folder.is_dir() else "not a folder in any format hfport verifies"
    report.add("format", str(folder), False, detail=f"{folder}: {what} ({', '.join(FORMATS)}: a config.json, an "
                                                   "adapter_config.json, a model.onnx or an openvino_model.xml)")
    if json_path is not None:
        report.write_json(json_path)
    return report
