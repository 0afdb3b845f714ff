"""What writes every graph folder (export/onnx.py: an ONNX folder, export/openvino.py: an OpenVINO one): the options
the int8 gate adds, and `write_graph_folder`, the one sequence both writers run around their own graph step.

    refuse early   thresholds and gate data checked, the model loaded (a head without graph outputs is refused), the
                   tokenizer found (the folder needs it to be verified and served)
    in a staged folder (common.staged: a hidden sibling of OUT, renamed into place only if every check passed)
                   the format's graphs (its `write` step), config.json, the tokenizer files, the source's
                   sentence-transformers files (pooling, normalize: what the embedding pipelines read), the manifest
                   (format, default_file: an int8 export's int8 graph, how the graphs were made and are served
                   (the format's `serving` step: OpenVINO's precision per IR), inputs, outputs, the source, each
                   graph file's sha256), then the proof (export/graph_verify.py) and the model card
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import Field, ValidationInfo, field_validator

from .. import hub
from ..formats.sentence_transformers import copy_layout
from ..modeling import PreTrainedEncoder
from ..pipelines.graph import graph_inputs
from ..tasks import TASKS
from ..tokenizer import TOKENIZER_FILES
from .card import CardFacts, CardStyle, write_card
from .common import (ExportError, ExportResult, FormatOptions, Source, check_out, export_config, no_tokenizer_message,
                     resolve_source, staged, tokenizer_folder)
from .folder import load_exportable, raise_unless_passed
from .graph_verify import GATE_CHECK, GraphVerify, sha256, verify_graphs
from .onnx_agreement import MIN_AGREEMENT, MIN_COSINE, check_thresholds, threshold_problem
from .probes import GateData, read_gate_data


class GateOptions(FormatOptions):
    """The int8 gate's options, which every graph format takes (its own options extend these)."""

    min_agreement: float = Field(MIN_AGREEMENT, description="int8: the least task-level agreement with fp32")
    min_cosine: float = Field(MIN_COSINE, description="int8: the least cosine with fp32 over the judged texts "
                                                      "(embeddings, pooled as the model pools)")
    gate_data: str | None = Field(None, description="int8: the texts the gate judges, a file with one text a line "
                                                    "or JSONL with text / text_pair (at least 64; default: the "
                                                    "built-in judged set)")

    @field_validator("min_agreement", "min_cosine")
    @classmethod
    def _fraction(cls, value: float, info: ValidationInfo) -> float:
        # here, not only at export time: an HTTP export job's options are checked when it is submitted
        problem = threshold_problem(info.field_name, value)
        if problem is not None:
            raise ValueError(problem)
        return value


@dataclass
class Graphs:
    """What a format's graph step wrote into the staged folder, and what the manifest says of it."""

    names: list[str]  # the graphs written, fp32 first (their weights files follow from the folder's record)
    made: dict[str, Any] = field(default_factory=dict)  # how: the exporter and opset, or the converter
    details: dict[str, Any] = field(default_factory=dict)  # the optimized graph's and the quantization's entries


# (model, tokenizer folder, staged folder) -> the graphs written there
GraphStep = Callable[[PreTrainedEncoder, Path, Path], Graphs]
# (staged folder, source model folder, the gate's data, (min agreement, min cosine)) -> the manifest's serving entries
Serving = Callable[[Path, Path, GateData, tuple[float, float]], dict[str, Any]]


def export_graphs(write: Callable[..., ExportResult], options: GateOptions, src: str | os.PathLike[str],
                  out: str | os.PathLike[str], *, force: bool, quantize: str | None,
                  json_path: str | os.PathLike[str] | None) -> ExportResult:
    """export_onnx / export_openvino: SRC resolved, OUT checked (an existing one only replaced with FORCE), then the
    format's WRITE."""
    source = resolve_source(src, options.which)
    target = Path(out).expanduser()
    check_out(source, target, force)
    return write(source, target, options, quantize=quantize, json_path=json_path)


def write_graph_folder(fmt: GraphVerify, source: Source, out: Path, options: GateOptions, write: GraphStep, *,
                       quantize: str | None, json_path: str | os.PathLike[str] | None, card: CardStyle,
                       result: Callable[..., ExportResult], serving: Serving | None = None,
                       no_graph: str = "graph") -> ExportResult:
    """SOURCE's model as a FMT folder at OUT (the module docstring has the steps), verified before OUT appears
    (VerifyFailed if not). WRITE: the format's graphs; RESULT: its ExportResult class; SERVING: the manifest's
    entries on how the folder is served (OpenVINO's inference precisions), asked once the staged folder holds
    everything but the manifest; NO_GRAPH: what a head without graph outputs lacks, in its error."""
    check_thresholds(options.min_agreement, options.min_cosine)
    gate_data = read_gate_data(options.gate_data) if options.gate_data is not None else GateData.builtin()
    model = load_exportable(source)
    if not TASKS[model.task].graph_outputs:
        raise ExportError(f"{source.model}: hfport has no {no_graph} for {model.task} models")
    tok_folder = tokenizer_folder(source)
    if tok_folder is None:
        raise ExportError(no_tokenizer_message(source) + f"; the {fmt.folder.kind} folder needs them to be verified "
                          "and served")
    name = fmt.export_format + ("-int8" if quantize else "")
    with staged(out) as staging:
        graphs = write(model, tok_folder, staging)
        files = [f for graph in graphs.names for f in fmt.folder.files(graph)]
        config = export_config(model, model.family.architectures[model.task], torch.float32)
        hub.write_json_atomic(staging / "config.json", config)
        for tok_file in TOKENIZER_FILES:
            if (tok_folder / tok_file).is_file():
                shutil.copyfile(tok_folder / tok_file, staging / tok_file)
        copy_layout(source.model, staging)  # an embedding model pools and normalizes as its source did
        served = serving(staging, source.model, gate_data, (options.min_agreement, options.min_cosine)) \
            if serving is not None else {}
        hub.write_json_atomic(staging / fmt.folder.manifest, {
            "format": name, "default_file": fmt.folder.quantized_file if quantize else fmt.folder.graph_file,
            **served, "hfport_version": config["hfport_version"], **graphs.made, "padded": True,
            "inputs": graph_inputs(model.config), "outputs": list(TASKS[model.task].graph_outputs),
            "source": str(source.model.resolve()), **graphs.details,
            "sha256": {f: sha256(staging / f) for f in files}})
        done = result(out, source.model, model.family.model_type, model.task, "float32", [], files, tok_folder,
                      format=name)
        del model
        done.report = verify_graphs(fmt, staging, source.model, min_agreement=options.min_agreement,
                                    min_cosine=options.min_cosine, json_path=json_path, label=str(out),
                                    gate_data=gate_data)
        raise_unless_passed(done.report, out, source.model, f"{fmt.folder.kind} export")
        write_card(staging, source, done, card)  # after verify: the card states its outcome and the gate's
        done.files = sorted(p.name for p in staging.iterdir())
    return done


def gate_lines(facts: CardFacts) -> list[str]:
    """The card's table of the int8 gate's rows (int8 against fp32 on the judged texts), when verify ran one."""
    gate = [r for r in facts.report.rows if r.check == GATE_CHECK] if facts.report is not None else []
    if not gate:
        return []
    return ["", "The int8 gate (int8 against fp32 on judged texts apart from the calibration ones):", "",
            "| measured | over | bound | result |", "|---|---|---|---|",
            *(f"| {r.output} | {r.shape} | {r.tolerance} | {'pass' if r.passed else 'FAIL'} |" for r in gate)]


__all__ = ["GateOptions", "GraphStep", "Graphs", "Serving", "export_graphs", "gate_lines", "write_graph_folder"]
