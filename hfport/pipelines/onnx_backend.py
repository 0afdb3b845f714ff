"""ONNX Runtime as a pipeline backend: an ONNX folder (model.onnx, config.json, tokenizer files; the layout
`hfport export --format onnx` and optimum write) served by the same pipelines as the PyTorch models.

`OnnxModel` stands where a PreTrainedEncoder stands: called as `model(input_ids, attention_mask=...,
token_type_ids=...)` it returns the same output dataclasses (hfport/outputs.py) with torch tensors, and it has the
`config`, `family`, `task`, `device`, `dtype` and `load_report` (its `source`: the folder, whose
sentence-transformers files the embedding pipelines read) the pipelines read, so no pipeline branches on the backend.

A folder serves the graph its manifest names (`default_file`: an int8 export's int8 graph; formats/onnx.py), or the
one `file=` names.

The graphs compute padded batches (the exporter traces hfport's padded path: the padding-free one is
data-dependent): values at padding positions are outside the contract, exactly as for the PyTorch models.
onnxruntime is imported only when a model is opened, so hfport imports without the `onnx` extra.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .. import hub
from ..config import EncoderConfig
# the ONNX folder's names (formats/onnx.py); QUANTIZED_FILE and is_onnx_model are named here for the backend's users
from ..formats.onnx import (ONNX_FILE, QUANTIZED_FILE, OnnxModelError, default_file, graph_file,  # noqa: F401
                            is_onnx_model)
from ..modeling import LoadReport, on_meta, task_of
from ..registry import Family, get_family
from ..tasks import TASKS

INSTALL_HINT = "pip install 'hfport[onnx]'"

DYNAMIC_AXES = ("batch_size", "sequence_length")  # the names of the two input axes, as optimum names them


def require_onnxruntime() -> Any:
    try:
        import onnxruntime
    except ImportError as e:
        raise OnnxModelError(f"the ONNX backend needs onnxruntime ({e}); {INSTALL_HINT}") from e
    return onnxruntime


def graph_inputs(config: EncoderConfig) -> list[str]:
    """The inputs a graph for this config takes: token types only where the model has more than one (optimum's
    layout: a RoBERTa / XLM-R graph, one token type, has no token_type_ids input)."""
    return ["input_ids", "attention_mask", *(["token_type_ids"] if config.type_vocab_size > 1 else [])]


def read_folder_config(folder: Path) -> tuple[dict[str, Any], Family, EncoderConfig, str]:
    """(raw config.json, family, EncoderConfig, task) of an ONNX folder: the head from `architectures`."""
    raw, source = hub.read_config(folder)
    family = get_family(raw.get("model_type"), source)
    config = family.config_from_hf(raw, source)
    return raw, family, config, task_of(family, raw.get("architectures") or [])


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
    want_in = graph_inputs(config)
    have_in = [i.name for i in session.get_inputs()]
    # graphs hfport exported before the layout above fed RoBERTa's one token type too (zeros): still served
    legacy = config.type_vocab_size == 1 and sorted(have_in) == sorted([*want_in, "token_type_ids"])
    if sorted(have_in) != sorted(want_in) and not legacy:
        raise OnnxModelError(f"{path}: graph inputs {have_in} do not match config.json, which implies {want_in} "
                             f"(type_vocab_size {config.type_vocab_size})")
    if not TASKS[task].graph_outputs:
        raise OnnxModelError(f"{path}: config.json's architectures make it a {task} model; hfport has no ONNX graph "
                             f"for {task}")
    outputs = {o.name: o for o in session.get_outputs()}
    for name, (rank, field) in TASKS[task].graph_outputs.items():
        if name not in outputs:
            raise OnnxModelError(f"{path}: the graph has no output {name!r} (it has {sorted(outputs)}); config.json's "
                                 f"architectures make it a {task} model, whose graph returns "
                                 f"{list(TASKS[task].graph_outputs)}")
        shape = outputs[name].shape
        if len(shape) != rank:
            raise OnnxModelError(f"{path}: output {name!r} has rank {len(shape)} ({shape}); a {task} graph's has "
                                 f"rank {rank}")
        if field is not None and isinstance(shape[-1], int) and shape[-1] != getattr(config, field):
            raise OnnxModelError(f"{path}: output {name!r} has last axis {shape[-1]}, but config.json's {field} is "
                                 f"{getattr(config, field)}")


class OnnxModel:
    """An ONNX graph with the calling convention and facts of an hfport task model (CPU, float32 in and out)."""

    def __init__(self, path: Path, session: Any, config: EncoderConfig, family: Family, task: str):
        self.path = path
        self.session = session
        self.config = config
        self.family = family
        self.task = task
        self.inputs = [i.name for i in session.get_inputs()]
        self.outputs = list(TASKS[task].graph_outputs)
        # what the pipelines read of a loaded model's origin: the folder (its sentence-transformers files) and the graph
        self.load_report = LoadReport(str(path.parent), notes=[f"onnx graph {path.name}"])
        # The module tree on the meta device (no memory): what the pipelines read about the model's layout, such
        # as the position table's size, comes from the same code as for the PyTorch model.
        with on_meta():
            self.body = family.build_body(config, task)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], *, file: str | None = None,
                        threads: int | None = None) -> OnnxModel:
        """PATH: an ONNX folder or a .onnx file whose folder holds config.json. A folder serves the graph its manifest
        names (formats/onnx.py's default_file: an int8 export's model_quantized.onnx, else model.onnx), or `file`,
        another graph in it (file="model.onnx": the fp32 graph of an int8 export)."""
        p = Path(path).expanduser()
        if p.is_file():
            if file is not None:
                raise OnnxModelError(f"{p}: file={file!r} picks a graph of an ONNX folder; {p.name} is a graph already")
            folder, graph = p.parent, p
        elif p.is_dir():
            folder, graph = p, p / (default_file(p) if file is None else graph_file(file, p))
        else:
            raise OnnxModelError(f"{p}: no such ONNX folder or file")
        _, family, config, task = read_folder_config(folder)
        session = open_session(graph, threads)
        check_signature(session, config, task, graph)
        return cls(graph, session, config, family, task)

    def __repr__(self) -> str:
        return f"OnnxModel({self.path}, {self.family.model_type}, {self.task})"

    # --- what a PreTrainedEncoder offers the pipelines ----------------------------------------------------

    def eval(self) -> OnnxModel:
        return self

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32  # inputs and outputs; an int8 graph quantizes inside

    def parameters(self) -> Iterator[Tensor]:
        return iter(())

    def buffers(self) -> Iterator[Tensor]:
        """One meta tensor the size of the graph file: lets memory accounting that sums parameters and buffers
        (the server's model cache) count what the session holds, without allocating it."""
        yield torch.empty(self.path.stat().st_size, dtype=torch.uint8, device="meta")

    def __call__(self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None,
                 position_ids: Tensor | None = None, encoder_outputs: Any = None) -> Any:
        if position_ids is not None:
            raise ValueError("the ONNX graph computes its own position ids; position_ids cannot be given")
        if encoder_outputs is not None:  # what a mixed-adapter batch hands a head; the onnx backend serves no adapters
            raise ValueError("the ONNX graph runs whole; encoder_outputs cannot be given")
        ids = np.ascontiguousarray(input_ids.detach().cpu().numpy(), dtype=np.int64)  # (B, T)
        feeds = {"input_ids": ids,
                 "attention_mask": np.ones_like(ids) if attention_mask is None else
                 np.ascontiguousarray(attention_mask.detach().cpu().numpy(), dtype=np.int64)}  # (B, T)
        if "token_type_ids" in self.inputs:  # absent: segment 0, as the PyTorch model does
            feeds["token_type_ids"] = np.zeros_like(ids) if token_type_ids is None else \
                np.ascontiguousarray(token_type_ids.detach().cpu().numpy(), dtype=np.int64)  # (B, T)
        try:
            arrays = self.session.run(self.outputs, feeds)
        except Exception as e:  # noqa: BLE001 - ORT's pybind errors are not RuntimeError; the pipeline retries those
            raise RuntimeError(f"{self.path}: onnxruntime failed ({type(e).__name__}: {e})") from e
        return TASKS[self.task].output_type(**{n: torch.from_numpy(a) for n, a in zip(self.outputs, arrays)})

    forward = __call__

