"""`verify_openvino(dir, source)`: the proof of an OpenVINO folder (export/openvino.py writes it), failing closed, as
export/onnx_verify.py proves an ONNX folder and with its pieces.

Every IR is compiled for the CPU with INFERENCE_PRECISION_HINT f32 (formats/openvino.py's INFERENCE_PRECISION: what
the openvino backend serves by default; OpenVINO's own default on a CPU with bf16 instructions is bf16, which would
move MiniLM's fp32 outputs by ~1e-3). The calibration texts (hfport/probes.py, through DIR's tokenizer, padded
batches) are compared at real positions:
    IR         each IR reads and compiles in OpenVINO, its inputs/outputs match config.json, its axes are dynamic;
    files      each IR file's (.xml and .bin) sha256 equals the one recorded at export; a missing
               hfport_openvino.json is a FAIL;
    fp32       openvino_model.xml against hfport's model from SOURCE, and against transformers' (not installed: a
               FAIL row saying what to install): |IR - reference| <= atol + rtol * |reference|, atol = rtol = 1e-5
               by default (FP32_TOLERANCE: OpenVINO fuses and sums in its own order; max abs diff on
               all-MiniLM-L6-v2 4.5e-6 against hfport, 5.0e-6 against transformers);
    int8       openvino_model_qint8_quantized.xml against openvino_model.xml through the int8 gate
               (hfport/agreement.py), the ONNX int8 export's: by what the head means, on the judged texts (never the
               calibration ones), short and long, or the user's `gate_data`; a gate that cannot run is a FAIL row.
SOURCE defaults to the one hfport_openvino.json records; when no source is given and it cannot be reached, the fp32
rows compare hfport's openvino backend with OpenVINO running openvino_model.xml directly, and the report says so.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..formats.openvino import IR_FILE, MANIFEST, QUANTIZED_IR_FILE, OpenVinoModelError, weights_file
from ..pipelines.graph import read_folder_config
from ..pipelines.openvino_backend import OpenVinoModel, check_signature, compile_ir, read_ir, require_openvino
from ..tasks import TASKS
from .common import ExportError
from .onnx_agreement import MIN_AGREEMENT, MIN_COSINE, GateContext, check_thresholds
from .onnx_verify import (Direct, check_recorded, compare_references, int8_rows, pooling_of, probe_batches,
                          read_recorded_manifest, references, run)
from .probes import GateData, read_gate_data
from .report import VerifyReport, check_row, reporting

FP32_TOLERANCE = (1e-5, 1e-5)  # (atol, rtol); the module docstring says why
GATE_CHECK = "int8 vs fp32"  # the int8 gate's rows, as the ONNX export's


class RawIR:
    """openvino_model.xml compiled and run by OpenVINO directly (its own request, feeds built here): the reference
    for hfport's openvino backend when no PyTorch source can be reached."""

    def __init__(self, path: Path, task: str):
        self.compiled = require_openvino().Core().compile_model(str(path), "CPU",
                                                                {"INFERENCE_PRECISION_HINT": "f32"})
        self.inputs = [i.get_any_name() for i in self.compiled.inputs]
        self.outputs = list(TASKS[task].graph_outputs)

    def __call__(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None) -> Any:
        enc = {"input_ids": input_ids, "attention_mask": attention_mask,
               "token_type_ids": torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids}
        result = self.compiled({name: enc[name].numpy() for name in self.inputs})
        return {name: torch.from_numpy(result[name].copy()) for name in self.outputs}


def verify_openvino(dir: str | os.PathLike[str], source: str | os.PathLike[str] | None = None, *,
                    which: str = "best", atol: float | None = None, rtol: float | None = None,
                    min_agreement: float = MIN_AGREEMENT, min_cosine: float = MIN_COSINE,
                    json_path: str | os.PathLike[str] | None = None, label: str | None = None,
                    gate_data: str | os.PathLike[str] | GateData | None = None) -> VerifyReport:
    """Check the OpenVINO folder DIR against SOURCE (default: the source its hfport_openvino.json records). Never
    raises for a failed check: the report says FAIL and names what failed. json_path: also write the report there.
    gate_data: the texts the int8 gate judges (default the built-in judged set, hfport/probes.py)."""
    folder = Path(dir).expanduser()
    report = VerifyReport(label or str(folder), str(source) if source is not None else "")
    report.set_tolerances("float32", atol, rtol, FP32_TOLERANCE)
    with reporting(report, json_path):
        check_thresholds(min_agreement, min_cosine)
        require_openvino()
        data = gate_data if isinstance(gate_data, GateData) else \
            read_gate_data(gate_data) if gate_data is not None else GateData.builtin()
        _verify(folder, source, which, (min_agreement, min_cosine), data, report)
    return report


def _verify(folder: Path, source_arg: Any, which: str, bounds: tuple[float, float], data: GateData,
            report: VerifyReport) -> None:
    if not folder.is_dir():
        raise ExportError(f"{folder}: no such folder")
    ctx: dict[str, Any] = {}
    with check_row(report, "config", "config.json"):
        _, family, config, task = read_folder_config(folder)
        ctx.update(config=config, task=task)
        report.add("config", "config.json", True, detail=f"{family.model_type} {task}")
    if not ctx:
        return
    config, task = ctx["config"], ctx["task"]
    manifest = read_recorded_manifest(folder, report, MANIFEST, "openvino")
    irs: dict[str, OpenVinoModel] = {}
    for name in (IR_FILE, QUANTIZED_IR_FILE):
        if name != IR_FILE and not (folder / name).is_file():
            continue
        with check_row(report, "IR", name):
            irs[name] = check_ir(report, folder / name, config, task)
        if manifest is not None:
            check_recorded(report, folder, manifest, [name, weights_file(name)])
    if IR_FILE not in irs:
        return
    against = references(folder, source_arg, manifest, which, task, report,
                         Direct(folder / IR_FILE, "OpenVINO", "OpenVINO", lambda: RawIR(folder / IR_FILE, task)),
                         MANIFEST)
    batches: dict[str, dict[str, Tensor]] = {}
    with check_row(report, "tokenizer", "probes"):
        batches = probe_batches(folder, task, config)
        report.add("tokenizer", "probes", True, shape=f"{len(batches)} batches",
                   detail=", ".join(f"{k} {tuple(v['input_ids'].shape)}" for k, v in batches.items()))
    if not batches:
        return
    fp32 = {name: run(irs[IR_FILE], enc, task) for name, enc in batches.items()}
    compare_references(report, {"fp32": fp32}, against, batches, task)
    if QUANTIZED_IR_FILE in irs:
        with check_row(report, GATE_CHECK, "gate"):
            gate_ctx = GateContext(config, pooling_of(folder, report.source))
            int8_rows(report, irs[QUANTIZED_IR_FILE], irs[IR_FILE], gate_ctx, task, bounds, data)


def check_ir(report: VerifyReport, path: Path, config: Any, task: str) -> OpenVinoModel:
    """Reads and compiles (f32) in OpenVINO with the signature config.json implies, and dynamic batch and sequence
    axes."""
    model = read_ir(path)
    check_signature(model, config, task, path)
    static = [f"{i.get_any_name()} {i.get_partial_shape()}" for i in model.inputs
              if i.get_partial_shape().rank.is_dynamic or len(i.get_partial_shape()) != 2
              or any(d.is_static for d in i.get_partial_shape())]
    if static:
        raise OpenVinoModelError(f"{path}: inputs with fixed axes ({'; '.join(static)}); the IR must take any batch "
                                 "size and sequence length")
    report.add("IR", path.name, True, shape=f"{len(model.inputs)} inputs",
               tolerance="reads and compiles (f32); inputs/outputs as config.json; dynamic axes")
    _, family, cfg, _ = read_folder_config(path.parent)
    return OpenVinoModel(path, compile_ir(model, path), cfg, family, task, "f32")
