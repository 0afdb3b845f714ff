"""The ONNX folder: what `hfport export --format onnx` (and optimum) write, and the onnx backend serves.

    model.onnx             the fp32 graph, as optimum names it
    model_quantized.onnx   the int8 graph beside it (when exported with --quantize int8)
    config.json, tokenizer files   as in the HF folder it came from (architectures name the head)
    hfport_onnx.json       hfport's manifest: opset, inputs, outputs, the source it was made from, each graph's
                           sha256 (verify checks the graphs against it) and `default_file`, the graph a loader opens
                           when not told which (an int8 export: model_quantized.onnx)
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..errors import HfportError

ONNX_FILE = "model.onnx"  # the fp32 graph, as optimum names it
QUANTIZED_FILE = "model_quantized.onnx"  # the int8 graph beside it
MANIFEST = "hfport_onnx.json"


class OnnxModelError(HfportError, ValueError):
    """An ONNX folder or graph that cannot be served as it is; the message names the file and what is wrong."""


def is_onnx_model(path: str | os.PathLike[str]) -> bool:
    """A .onnx file, or a folder with model.onnx and no safetensors weights: what the onnx backend serves."""
    p = Path(path).expanduser()
    if p.is_file():
        return p.suffix == ".onnx"
    return p.is_dir() and (p / ONNX_FILE).is_file() and not any(p.glob("*.safetensors"))


def read_manifest(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """hfport_onnx.json as a dict, or None when the folder has none (an optimum export, say)."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise OnnxModelError(f"{path}: cannot be read as JSON ({e})") from e
    if not isinstance(manifest, dict):
        raise OnnxModelError(f"{path}: the top level must be a JSON object")
    return manifest


def default_file(folder: str | os.PathLike[str]) -> str:
    """The graph of an ONNX folder a loader opens when not told which: the manifest's `default_file`; a manifest
    written before that key: the int8 graph when it records one (an int8 export), else model.onnx; no manifest (an
    optimum export): model.onnx, as optimum's loaders."""
    manifest = read_manifest(folder)
    if manifest is None:
        return ONNX_FILE
    if "default_file" not in manifest:
        return QUANTIZED_FILE if manifest.get("quantization") else ONNX_FILE
    return graph_file(manifest["default_file"], Path(folder) / MANIFEST, "default_file")


def graph_file(name: object, where: str | os.PathLike[str], what: str = "file") -> str:
    """NAME checked as a graph's file name inside an ONNX folder: a .onnx name, no path (a folder may only serve its
    own graphs)."""
    if not isinstance(name, str) or Path(name).name != name or name in (".", "..") or Path(name).suffix != ".onnx":
        raise OnnxModelError(f"{where}: {what} {name!r} must name a .onnx file in the folder, e.g. {ONNX_FILE!r} or "
                             f"{QUANTIZED_FILE!r}")
    return name


__all__ = ["MANIFEST", "ONNX_FILE", "QUANTIZED_FILE", "OnnxModelError", "default_file", "graph_file", "is_onnx_model",
           "read_manifest"]
