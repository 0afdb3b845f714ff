"""OpenVINO as a pipeline backend: an OpenVINO folder (openvino_model.xml/.bin, config.json, tokenizer files; the
layout `hfport export --format openvino` writes, formats/openvino.py) served by the same pipelines as the PyTorch
models.

`OpenVinoModel` is a GraphModel (pipelines/graph.py) run by OpenVINO's CPU plugin. A folder serves the IR its
manifest names (`default_file`: an openvino-int8 export's int8 IR), or the one `file=` names.

Precision: OpenVINO computes an fp32 IR (and the float parts of an int8 one) in bf16 by default on a CPU with bf16
instructions. The backend sets INFERENCE_PRECISION_HINT itself: for dtype None or "auto", the precision the folder's
manifest records for the IR, which the export's verify proved (formats/openvino.py's served_precision: f32 for the
fp32 IR; bf16 for an int8 IR whose gate passed it computed in bf16; f32 without a manifest); f32 for dtype=float32;
bf16 for dtype="bfloat16" (OpenVINO's own default there, for an fp32 IR not proved by verify; a CPU without bf16
computes f32).

openvino is imported only when a model is opened, so hfport imports without the `openvino` extra.
"""

from __future__ import annotations

import os
import queue
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import EncoderConfig
from ..formats.openvino import (INFERENCE_PRECISION, IR_FILE, OPENVINO_FOLDER, PRECISION_HINTS, QUANTIZED_IR_FILE,
                                OpenVinoModelError, is_openvino_model, served_precision, weights_file)
from ..registry import Family
from .graph import GraphBackend, GraphModel, check_io, graph_dtype, read_folder_config

INSTALL_HINT = "pip install 'hfport[openvino]'"
# the pipeline's explicit dtype -> OpenVINO's INFERENCE_PRECISION_HINT (None and "auto": the manifest's, the module
# docstring says why)
PRECISIONS = {torch.float32: INFERENCE_PRECISION, torch.bfloat16: "bf16"}


def require_openvino() -> Any:
    try:
        import openvino
    except ImportError as e:
        raise OpenVinoModelError(f"the OpenVINO backend needs openvino ({e}); {INSTALL_HINT}") from e
    return openvino


def read_ir(path: Path) -> Any:
    """The IR at PATH (its .bin beside it) as an openvino.Model; a file OpenVINO cannot read is an
    OpenVinoModelError naming it."""
    ov = require_openvino()
    if not path.is_file() or not Path(weights_file(str(path))).is_file():
        raise OpenVinoModelError(f"{path}: no such OpenVINO IR (an .xml file with its .bin beside it)")
    try:
        return ov.Core().read_model(str(path), weights_file(str(path)))
    except Exception as e:  # noqa: BLE001 - OpenVINO raises RuntimeError with its C++ trace for every reason
        raise OpenVinoModelError(f"{path}: OpenVINO cannot read it ({type(e).__name__}: "
                                 f"{str(e).strip().splitlines()[-1][:400]})") from e


def compile_ir(model: Any, path: Path, precision: str = INFERENCE_PRECISION, threads: int | None = None) -> Any:
    """MODEL compiled for the CPU in PRECISION ("f32" or "bf16"), with as many threads as torch uses (what the
    PyTorch backend gets) and the latency hint (one caller at a time: the pipeline's batches)."""
    ov = require_openvino()
    config = {"INFERENCE_PRECISION_HINT": precision, "PERFORMANCE_HINT": "LATENCY",
              "INFERENCE_NUM_THREADS": torch.get_num_threads() if threads is None else threads}
    try:
        return ov.Core().compile_model(model, "CPU", config)
    except Exception as e:  # noqa: BLE001 - as read_ir
        raise OpenVinoModelError(f"{path}: OpenVINO cannot compile it for the CPU ({type(e).__name__}: "
                                 f"{str(e).strip().splitlines()[-1][:400]})") from e


def _shape(partial: Any) -> list[Any]:
    """An OpenVINO PartialShape as a list: an int where the axis is fixed, None where it is dynamic."""
    if partial.rank.is_dynamic:
        return []
    return [d.get_length() if d.is_static else None for d in partial]


def check_signature(model: Any, config: EncoderConfig, task: str, path: Path) -> None:
    """The IR's inputs and outputs are the ones config.json implies: names, ranks and the fixed last axis."""
    check_io([i.get_any_name() for i in model.inputs],
             {name: _shape(o.get_partial_shape()) for o in model.outputs for name in o.get_names()}, config, task,
             path, OpenVinoModelError)


class OpenVinoModel(GraphModel):
    """An OpenVINO IR compiled for the CPU, with the calling convention and facts of an hfport task model (float32
    in and out; `precision`: what it computes in)."""

    runtime = "OpenVINO"
    int8_files = (QUANTIZED_IR_FILE,)

    def __init__(self, path: Path, compiled: Any, config: EncoderConfig, family: Family, task: str, precision: str):
        self.compiled = compiled
        self.precision = precision
        # infer requests are not safe to share between threads: each call takes an idle one (or makes one)
        self._idle: queue.SimpleQueue[Any] = queue.SimpleQueue()
        super().__init__(path, config, family, task, [i.get_any_name() for i in compiled.inputs],
                         [path.parent / f for f in OPENVINO_FOLDER.files(path.name)],
                         f"openvino IR {path.name} ({precision})")

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], *, file: str | None = None, precision: str | None = None,
                        threads: int | None = None) -> OpenVinoModel:
        """PATH: an OpenVINO folder or an IR's .xml file whose folder holds config.json. A folder serves the IR its
        manifest names (formats/openvino.py's default_file: an int8 export's int8 IR, else openvino_model.xml), or
        `file`, another IR in it (file="openvino_model.xml": the fp32 IR of an int8 export). PRECISION: OpenVINO's
        INFERENCE_PRECISION_HINT, "f32" or "bf16"; None: the one the manifest records for the IR (what verify
        proved)."""
        if precision is not None and precision not in PRECISION_HINTS:
            raise OpenVinoModelError(f"precision {precision!r}: expected one of {list(PRECISION_HINTS)}")
        folder, xml = OPENVINO_FOLDER.locate(path, file)
        precision = precision or served_precision(folder, xml.name)
        _, family, config, task = read_folder_config(folder)
        model = read_ir(xml)
        check_signature(model, config, task, xml)
        return cls(xml, compile_ir(model, xml, precision, threads), config, family, task, precision)

    def __repr__(self) -> str:
        return f"OpenVinoModel({self.path}, {self.family.model_type}, {self.task}, {self.precision})"

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        try:
            request = self._idle.get_nowait()
        except queue.Empty:
            request = self.compiled.create_infer_request()
        try:
            request.infer({name: feeds[name] for name in self.inputs})
            # copies: the request's output memory is reused by its next call
            return [request.get_tensor(name).data.copy() for name in self.outputs]
        finally:
            self._idle.put(request)


def load(path: str | os.PathLike[str], *, file: str | None = None, dtype: Any = None) -> OpenVinoModel:
    """The pipeline's loader: dtype None or "auto" computes in the precision the manifest records for the IR (what
    verify proved), float32 in f32, bfloat16 in bf16."""
    resolved = graph_dtype(dtype, "openvino", tuple(PRECISIONS))  # refuses what OpenVINO cannot run
    return OpenVinoModel.from_pretrained(
        path, file=file, precision=None if dtype is None or dtype == "auto" else PRECISIONS[resolved])


BACKEND = GraphBackend("openvino", f"an OpenVINO folder ({IR_FILE}, no safetensors) or an IR's .xml file, run by "
                       "OpenVINO", is_openvino_model, load)

__all__ = ["BACKEND", "INSTALL_HINT", "OpenVinoModel", "PRECISIONS", "compile_ir", "read_ir", "require_openvino"]
