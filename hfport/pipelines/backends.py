"""The pipeline backends: "torch" (hfport's own models) and the graph backends, one record each (pipelines/graph.py's
GraphBackend: detect, load), in the order hfport.pipeline() asks them whether a path is theirs.

    onnx       an ONNX folder or .onnx file, run by onnxruntime (onnx_backend.py; the `onnx` extra)
    openvino   an OpenVINO folder or IR .xml file, run by OpenVINO (openvino_backend.py; the `openvino` extra)

A new graph runtime is a module with its GraphModel subclass and loader, and one line here.
"""

from __future__ import annotations

import os

from . import onnx_backend, openvino_backend
from .graph import GraphBackend

TORCH = "torch"
GRAPH_BACKENDS: dict[str, GraphBackend] = {b.name: b for b in (onnx_backend.BACKEND, openvino_backend.BACKEND)}
BACKENDS = (TORCH, *GRAPH_BACKENDS)


def graph_backend(model: str | os.PathLike[str], backend: str | None) -> GraphBackend | None:
    """The graph backend that serves MODEL (a path): BACKEND when it names one, else (None) the first whose
    `detect` claims the path; None for the torch backend. An unknown BACKEND is a ValueError listing them."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: use one of {list(BACKENDS)}")
    if backend is not None:
        return GRAPH_BACKENDS.get(backend)
    return next((b for b in GRAPH_BACKENDS.values() if b.detect(model)), None)


__all__ = ["BACKENDS", "GRAPH_BACKENDS", "TORCH", "graph_backend"]
