"""The ONNX folder: what `hfport export --format onnx` (and optimum) write, and the onnx backend serves.

    model.onnx             the fp32 graph, as optimum names it
    model_quantized.onnx   the int8 graph beside it (when exported with --quantize int8)
    config.json, tokenizer files   as in the HF folder it came from (architectures name the head)
    hfport_onnx.json       hfport's manifest: opset, inputs, outputs, the source it was made from, each graph's
                           sha256 (verify checks the graphs against it) and `default_file`, the graph a loader opens
                           when not told which (an int8 export: model_quantized.onnx)
"""

from __future__ import annotations

from ..errors import HfportError
from .graph_folder import GraphFolder

ONNX_FILE = "model.onnx"  # the fp32 graph, as optimum names it
QUANTIZED_FILE = "model_quantized.onnx"  # the int8 graph beside it
MANIFEST = "hfport_onnx.json"


class OnnxModelError(HfportError, ValueError):
    """An ONNX folder or graph that cannot be served as it is; the message names the file and what is wrong."""


# the folder rules every graph folder follows (formats/graph_folder.py), with the ONNX folder's names
ONNX_FOLDER = GraphFolder("ONNX", ONNX_FILE, QUANTIZED_FILE, MANIFEST, ".onnx", OnnxModelError, a_graph="a graph",
                          a_graph_file="a .onnx file", file_noun="file", quantization_names_default=True)
is_onnx_model = ONNX_FOLDER.detect  # a .onnx file, or a folder with model.onnx and no safetensors weights
read_manifest = ONNX_FOLDER.read_manifest  # hfport_onnx.json as a dict, or None (an optimum export, say)
# the graph a loader opens when not told which: the manifest's `default_file`; a manifest written before that key: the
# int8 graph when it records one (an int8 export), else model.onnx; no manifest (an optimum export): model.onnx
default_file = ONNX_FOLDER.default_file
graph_file = ONNX_FOLDER.check_file  # a graph's file name inside the folder: a .onnx name, no path


__all__ = ["MANIFEST", "ONNX_FILE", "ONNX_FOLDER", "QUANTIZED_FILE", "OnnxModelError", "default_file", "graph_file",
           "is_onnx_model", "read_manifest"]
