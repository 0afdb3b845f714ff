"""`verify_openvino(dir, source)`: the proof of an OpenVINO folder (export/openvino.py writes it), failing closed: the
checks of every graph folder (export/graph_verify.py, as export/onnx_verify.py proves an ONNX folder) with OpenVINO's
IRs, runtime and tolerance.

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
               Where the manifest records another precision for the int8 IR (`inference_precisions`: bf16, what the
               backend then serves by default), the int8 IR computed in it is judged by the gate too (rows "(bf16)").
SOURCE defaults to the one hfport_openvino.json records; when no source is given and it cannot be reached, the fp32
rows compare hfport's openvino backend with OpenVINO running openvino_model.xml directly, and the report says so.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..formats.openvino import OPENVINO_FOLDER, precision_of
from ..pipelines.graph import read_folder_config
from ..pipelines.openvino_backend import OpenVinoModel, check_signature, compile_ir, read_ir, require_openvino
from ..tasks import TASKS
from .graph_verify import GraphVerify, verify_graphs
from .report import VerifyReport

FP32_TOLERANCE = (1e-5, 1e-5)  # (atol, rtol); the module docstring says why


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


def load_ir(path: Path, config: Any, task: str) -> tuple[OpenVinoModel, list[str]]:
    """The IR read and compiled (f32) in OpenVINO with the signature config.json implies (else an
    OpenVinoModelError), and its inputs whose batch or sequence axis is fixed."""
    model = read_ir(path)
    check_signature(model, config, task, path)
    fixed = [f"{i.get_any_name()} {i.get_partial_shape()}" for i in model.inputs
             if i.get_partial_shape().rank.is_dynamic or len(i.get_partial_shape()) != 2
             or any(d.is_static for d in i.get_partial_shape())]
    _, family, cfg, _ = read_folder_config(path.parent)
    return OpenVinoModel(path, compile_ir(model, path), cfg, family, task, "f32"), fixed


def served_int8(int8: OpenVinoModel, manifest: dict[str, Any] | None) -> tuple[str, OpenVinoModel] | None:
    """(precision, the int8 IR compiled in it) where the manifest records for it another precision than the f32
    verify compiles in (formats/openvino.py's precision_of); else None."""
    if manifest is None:
        return None
    precision = precision_of(manifest, int8.path.name, int8.path.parent / OPENVINO_FOLDER.manifest)
    if precision == int8.precision:
        return None
    return precision, OpenVinoModel(int8.path, compile_ir(read_ir(int8.path), int8.path, precision), int8.config,
                                    int8.family, int8.task, precision)


OPENVINO_GRAPHS = GraphVerify(OPENVINO_FOLDER, export_format="openvino", row="IR", tolerance=FP32_TOLERANCE,
                              runtime="OpenVINO", backend="OpenVINO", require=require_openvino, load=load_ir,
                              loads="reads and compiles (f32); inputs/outputs as config.json; dynamic axes",
                              direct=RawIR, served=served_int8)


def verify_openvino(dir: str | os.PathLike[str], source: str | os.PathLike[str] | None = None,
                    **options: Any) -> VerifyReport:
    """Check the OpenVINO folder DIR against SOURCE (default: the source its hfport_openvino.json records); OPTIONS
    (which, atol, rtol, min_agreement, min_cosine, json_path, label, gate_data) as graph_verify.verify_graphs. Never
    raises for a failed check: the report says FAIL and names what failed."""
    return verify_graphs(OPENVINO_GRAPHS, dir, source, **options)
