"""What every exported graph folder shares (formats/onnx.py: an ONNX folder, formats/openvino.py: an OpenVINO one):
one `GraphFolder` record per format names its files, and the record's methods are the folder rules they both follow.

    detect        a graph file of the format (with the weights file beside it where the format keeps one), or a
                  folder holding the fp32 graph and no safetensors weights
    read_manifest hfport's manifest as a dict, None when the folder has none (an optimum export)
    default_file  the graph a loader opens when not told which: the manifest's `default_file`, else the fp32 graph
    check_file    a name given for a graph of the folder: the format's suffix, no path
    locate        a path (a folder or one graph file) and `file=` as (folder, graph file)
    files         a graph's files on disk: the graph, and its weights file where the format keeps one apart
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class GraphFolder:
    """One graph folder format: its file names, its manifest, its error class and the words its errors use."""

    kind: str  # "ONNX", "OpenVINO": the format in errors
    graph_file: str  # the fp32 graph (model.onnx, openvino_model.xml)
    quantized_file: str  # the int8 graph beside it
    manifest: str  # hfport's manifest (hfport_onnx.json, hfport_openvino.json)
    suffix: str  # a graph file's suffix (".onnx", ".xml")
    error: type[Exception]  # the format's error class (OnnxModelError, OpenVinoModelError)
    a_graph: str  # "a graph", "an IR": what one graph is called in errors
    a_graph_file: str  # "a .onnx file", "an .xml file"
    file_noun: str  # "file", "IR file": a graph file, in "no such ONNX folder or file"
    weights_suffix: str | None = None  # ".bin": the graph's weights beside it, same stem (OpenVINO's own rule)
    # a manifest written before `default_file` existed names an int8 export by its `quantization` entry (ONNX only:
    # every hfport_openvino.json has default_file)
    quantization_names_default: bool = False

    def files(self, name: str) -> list[str]:
        """The files of the graph NAME: the graph, and its weights beside it where the format keeps them apart."""
        return [name] + ([str(Path(name).with_suffix(self.weights_suffix))] if self.weights_suffix else [])

    def detect(self, path: str | os.PathLike[str]) -> bool:
        """A graph file of the format (its weights beside it), or a folder with the fp32 graph and no safetensors
        weights: what the format's backend serves."""
        p = Path(path).expanduser()
        if p.is_file():
            return p.suffix == self.suffix and all((p.parent / f).is_file() for f in self.files(p.name))
        return p.is_dir() and (p / self.graph_file).is_file() and not any(p.glob("*.safetensors"))

    def read_manifest(self, folder: str | os.PathLike[str]) -> dict[str, Any] | None:
        """The manifest as a dict, or None when the folder has none (an optimum export, say)."""
        path = Path(folder) / self.manifest
        if not path.is_file():
            return None
        try:
            manifest = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self.error(f"{path}: cannot be read as JSON ({e})") from e
        if not isinstance(manifest, dict):
            raise self.error(f"{path}: the top level must be a JSON object")
        return manifest

    def default_file(self, folder: str | os.PathLike[str]) -> str:
        """The graph a loader opens when not told which: the manifest's `default_file`; a manifest written before
        that key: the fp32 graph (ONNX: the int8 graph when it records one); no manifest (an optimum export): the
        fp32 graph, as optimum's loaders."""
        manifest = self.read_manifest(folder)
        if manifest is None:
            return self.graph_file
        if "default_file" not in manifest:
            return self.quantized_file if self.quantization_names_default and manifest.get("quantization") \
                else self.graph_file
        return self.check_file(manifest["default_file"], Path(folder) / self.manifest, "default_file")

    def check_file(self, name: object, where: str | os.PathLike[str], what: str = "file") -> str:
        """NAME checked as a graph's file name inside the folder: the format's suffix, no path (a folder may only
        serve its own graphs)."""
        if not isinstance(name, str) or Path(name).name != name or name in (".", "..") or \
                Path(name).suffix != self.suffix:
            raise self.error(f"{where}: {what} {name!r} must name {self.a_graph_file} in the folder, e.g. "
                             f"{self.graph_file!r} or {self.quantized_file!r}")
        return name

    def locate(self, path: str | os.PathLike[str], file: str | None) -> tuple[Path, Path]:
        """(folder, graph file) for PATH, a folder (the graph `file` names, else its default_file) or one graph
        file of it (then `file` must be None)."""
        p = Path(path).expanduser()
        if p.is_file():
            if file is not None:
                raise self.error(f"{p}: file={file!r} picks {self.a_graph} of an {self.kind} folder; {p.name} is "
                                 f"{self.a_graph} already")
            return p.parent, p
        if p.is_dir():
            return p, p / (self.default_file(p) if file is None else self.check_file(file, p))
        raise self.error(f"{p}: no such {self.kind} folder or {self.file_noun}")


__all__ = ["GraphFolder"]
