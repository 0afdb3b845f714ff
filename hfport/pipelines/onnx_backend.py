"""ONNX Runtime as a pipeline backend: an ONNX folder (model.onnx, config.json, tokenizer files; the layout
`hfport export --format onnx` and optimum write) served by the same pipelines as the PyTorch models.

`OnnxModel` is a GraphModel (pipelines/graph.py: what stands where a PreTrainedEncoder stands) run by an
onnxruntime CPU session. A folder serves the graph its manifest names (`default_file`: an int8 export's int8 graph;
formats/onnx.py), or the one `file=` names. onnxruntime is imported only when a model is opened, so hfport imports
without the `onnx` extra.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import EncoderConfig
# the ONNX folder's names (formats/onnx.py); ONNX_FILE is named here for the backend's users
from ..formats.onnx import ONNX_FILE, ONNX_FOLDER, QUANTIZED_FILE, OnnxModelError, is_onnx_model  # noqa: F401
from ..registry import Family
# graph_inputs and read_folder_config are named here for the backend's users too
from .graph import (GraphBackend, GraphModel, check_io, graph_dtype, graph_inputs,  # noqa: F401
                    read_folder_config)

INSTALL_HINT = "pip install 'hfport[onnx]'"

DYNAMIC_AXES = ("batch_size", "sequence_length")  # the names of the two input axes, as optimum names them


def require_onnxruntime() -> Any:
    try:
        import onnxruntime
    except ImportError as e:
        raise OnnxModelError(f"the ONNX backend needs onnxruntime ({e}); {INSTALL_HINT}") from e
    return onnxruntime


def open_session(path: Path, threads: int | None = None) -> Any:
    """An onnxruntime CPU session for the graph at `path`; a file ORT cannot load is an OnnxModelError naming it."""
    ort = require_onnxruntime()
    if not path.is_file():
        raise OnnxModelError(f"{path}: no such ONNX file")
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only: ORT's warnings about unused initializers are noise here
    # as many threads as torch uses (what the PyTorch backend gets); ORT's defaults already are ORT_ENABLE_ALL
    # graph optimizations and sequential execution
    options.intra_op_num_threads = torch.get_num_threads() if threads is None else threads
    try:
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - ORT raises its own pybind classes (InvalidProtobuf, Fail, ...)
        text = str(e)
        why = ("the file is truncated or not an ONNX model" if "Protobuf parsing failed" in text or
               "INVALID_PROTOBUF" in text else
               "it needs an opset this onnxruntime cannot run" if "opset" in text.lower() else
               "onnxruntime cannot load it")
        raise OnnxModelError(f"{path}: {why} ({type(e).__name__}: {text.strip()[:400]})") from e


def check_signature(session: Any, config: EncoderConfig, task: str, path: Path) -> None:
    """The graph's inputs and outputs are the ones config.json implies: names, ranks and the fixed last axis."""
    check_io([i.name for i in session.get_inputs()], {o.name: list(o.shape) for o in session.get_outputs()}, config,
             task, path, OnnxModelError)


class OnnxModel(GraphModel):
    """An ONNX graph run by an onnxruntime CPU session, with the calling convention and facts of an hfport task
    model (CPU, float32 in and out)."""

    runtime = "onnxruntime"
    int8_files = (QUANTIZED_FILE,)

    def __init__(self, path: Path, session: Any, config: EncoderConfig, family: Family, task: str):
        self.session = session
        super().__init__(path, config, family, task, [i.name for i in session.get_inputs()], [path],
                         f"onnx graph {path.name}")

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], *, file: str | None = None,
                        threads: int | None = None) -> OnnxModel:
        """PATH: an ONNX folder or a .onnx file whose folder holds config.json. A folder serves the graph its manifest
        names (formats/onnx.py's default_file: an int8 export's model_quantized.onnx, else model.onnx), or `file`,
        another graph in it (file="model.onnx": the fp32 graph of an int8 export)."""
        folder, graph = ONNX_FOLDER.locate(path, file)
        _, family, config, task = read_folder_config(folder)
        session = open_session(graph, threads)
        check_signature(session, config, task, graph)
        return cls(graph, session, config, family, task)

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        return self.session.run(self.outputs, feeds)


def load(path: str | os.PathLike[str], *, file: str | None = None, dtype: Any = None) -> OnnxModel:
    """The pipeline's loader: the graphs are float32 (an int8 graph quantizes inside), so dtype is None, "auto" or
    float32."""
    graph_dtype(dtype, "onnx")
    return OnnxModel.from_pretrained(path, file=file)


BACKEND = GraphBackend("onnx", "an ONNX folder (model.onnx, no safetensors) or a .onnx file, run by onnxruntime",
                       is_onnx_model, load)
