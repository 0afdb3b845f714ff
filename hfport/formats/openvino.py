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
                                             serves by default)
An IR is named by its .xml file; its weights are the .bin of the same stem beside it (OpenVINO's own rule).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..errors import HfportError

IR_FILE = "openvino_model.xml"  # the fp32 IR, as optimum-intel names it
QUANTIZED_IR_FILE = "openvino_model_qint8_quantized.xml"  # the int8 IR, as sentence-transformers names its export
MANIFEST = "hfport_openvino.json"
# the precision hint the IRs are verified and served in by default: OpenVINO's CPU plugin otherwise computes an fp32
# IR in bf16 on a CPU with bf16 instructions (its default INFERENCE_PRECISION_HINT there)
INFERENCE_PRECISION = "f32"


class OpenVinoModelError(HfportError, ValueError):
    """An OpenVINO folder or IR that cannot be served as it is; the message names the file and what is wrong."""


def weights_file(xml: str) -> str:
    """The .bin holding the weights of the IR named by XML (same stem)."""
    return str(Path(xml).with_suffix(".bin"))


def is_openvino_model(path: str | os.PathLike[str]) -> bool:
    """An IR's .xml file, or a folder with openvino_model.xml and no safetensors weights: what the openvino backend
    serves."""
    p = Path(path).expanduser()
    if p.is_file():
        return p.suffix == ".xml" and p.with_suffix(".bin").is_file()
    return p.is_dir() and (p / IR_FILE).is_file() and not any(p.glob("*.safetensors"))


def read_manifest(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """hfport_openvino.json as a dict, or None when the folder has none (an optimum-intel export, say)."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise OpenVinoModelError(f"{path}: cannot be read as JSON ({e})") from e
    if not isinstance(manifest, dict):
        raise OpenVinoModelError(f"{path}: the top level must be a JSON object")
    return manifest


def default_file(folder: str | os.PathLike[str]) -> str:
    """The IR of an OpenVINO folder a loader opens when not told which: the manifest's `default_file`; no manifest
    (an optimum-intel export): openvino_model.xml."""
    manifest = read_manifest(folder)
    if manifest is None or "default_file" not in manifest:
        return IR_FILE
    return ir_file(manifest["default_file"], Path(folder) / MANIFEST, "default_file")


def ir_file(name: object, where: str | os.PathLike[str], what: str = "file") -> str:
    """NAME checked as an IR's file name inside an OpenVINO folder: an .xml name, no path (a folder may only serve its
    own IRs)."""
    if not isinstance(name, str) or Path(name).name != name or name in (".", "..") or Path(name).suffix != ".xml":
        raise OpenVinoModelError(f"{where}: {what} {name!r} must name an .xml file in the folder, e.g. {IR_FILE!r} or "
                                 f"{QUANTIZED_IR_FILE!r}")
    return name


__all__ = ["INFERENCE_PRECISION", "IR_FILE", "MANIFEST", "OpenVinoModelError", "QUANTIZED_IR_FILE", "default_file",
           "ir_file", "is_openvino_model", "read_manifest", "weights_file"]
