"""The OpenVINO folder: what `hfport export --format openvino` / `openvino-int8` write, and the openvino backend
serves (hfport/pipelines/openvino_backend.py).

    openvino_model.xml/.bin                  the fp32 IR (graph and weights), as optimum-intel names it
    openvino_model_qint8_quantized.xml/.bin  the int8 IR beside it (an openvino-int8 export), as sentence-transformers
                                             names its static int8 OpenVINO export
    config.json, tokenizer files, the source's sentence-transformers files   as in the ONNX folder (formats/onnx.py)
    hfport_openvino.json                     hfport's manifest: inputs, outputs, the source, what the IR was made from,
                                             each IR file's sha256 (verify checks them), `default_file` (the IR a
                                             loader opens when not told which: an int8 export's int8 IR) and
                                             `inference_precision` (the precision verify proved and the backend
                                             serves by default), and `inference_precisions`: an IR's own where it
                                             differs (an int8 IR whose gate passed it computed in bf16)
An IR is named by its .xml file; its weights are the .bin of the same stem beside it (OpenVINO's own rule).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import HfportError
from .graph_folder import GraphFolder

IR_FILE = "openvino_model.xml"  # the fp32 IR, as optimum-intel names it
QUANTIZED_IR_FILE = "openvino_model_qint8_quantized.xml"  # the int8 IR, as sentence-transformers names its export
MANIFEST = "hfport_openvino.json"
# the precision hint the IRs are verified and served in by default: OpenVINO's CPU plugin otherwise computes an fp32
# IR in bf16 on a CPU with bf16 instructions (its default INFERENCE_PRECISION_HINT there)
INFERENCE_PRECISION = "f32"
PRECISION_HINTS = ("f32", "bf16")  # the hints a manifest may record for an IR


class OpenVinoModelError(HfportError, ValueError):
    """An OpenVINO folder or IR that cannot be served as it is; the message names the file and what is wrong."""


# the folder rules every graph folder follows (formats/graph_folder.py), with the OpenVINO folder's names
OPENVINO_FOLDER = GraphFolder("OpenVINO", IR_FILE, QUANTIZED_IR_FILE, MANIFEST, ".xml", OpenVinoModelError,
                              a_graph="an IR", a_graph_file="an .xml file", file_noun="IR file", weights_suffix=".bin")
# an IR's .xml file (its .bin beside it), or a folder with openvino_model.xml and no safetensors weights
is_openvino_model = OPENVINO_FOLDER.detect
read_manifest = OPENVINO_FOLDER.read_manifest  # hfport_openvino.json as a dict, or None (an optimum-intel export)
# the IR a loader opens when not told which: the manifest's `default_file`; no manifest (an optimum-intel export):
# openvino_model.xml
default_file = OPENVINO_FOLDER.default_file
ir_file = OPENVINO_FOLDER.check_file  # an IR's file name inside the folder: an .xml name, no path


def served_precision(folder: str | os.PathLike[str], xml: str) -> str:
    """The precision hint the IR XML of FOLDER is served with by default (`precision_of` its manifest); no manifest
    (an optimum-intel export): f32."""
    return precision_of(read_manifest(folder) or {}, xml, Path(folder) / MANIFEST)


def precision_of(manifest: dict[str, Any], xml: str, where: str | os.PathLike[str]) -> str:
    """The precision hint MANIFEST (read from WHERE) records for the IR XML: its `inference_precisions` entry (an
    int8 IR the export's gate proved in bf16), else `inference_precision`, else f32. A value that is not a hint is an
    OpenVinoModelError naming the key."""
    own = manifest.get("inference_precisions") or {}
    if not isinstance(own, dict):
        raise OpenVinoModelError(f"{where}: inference_precisions must map IR files to precision hints, got {own!r}")
    key = f"inference_precisions.{xml}" if xml in own else "inference_precision"
    precision = own.get(xml, manifest.get("inference_precision", INFERENCE_PRECISION))
    if precision not in PRECISION_HINTS:
        raise OpenVinoModelError(f"{where}: {key} {precision!r} must be one of {list(PRECISION_HINTS)}")
    return precision


def weights_file(xml: str) -> str:
    """The .bin holding the weights of the IR named by XML (same stem)."""
    return OPENVINO_FOLDER.files(xml)[1]


__all__ = ["INFERENCE_PRECISION", "IR_FILE", "MANIFEST", "OPENVINO_FOLDER", "OpenVinoModelError", "PRECISION_HINTS",
           "QUANTIZED_IR_FILE", "default_file", "ir_file", "is_openvino_model", "precision_of", "read_manifest",
           "served_precision", "weights_file"]
