"""What every graph backend's model shares (onnx_backend.py: onnxruntime, openvino_backend.py: OpenVINO): a compiled
graph that stands where a PreTrainedEncoder stands, and the record the pipeline dispatches through.

`GraphModel`, called as `model(input_ids, attention_mask=..., token_type_ids=...)`, returns the same output
dataclasses (hfport/outputs.py) with torch tensors, and has the `config`, `family`, `task`, `device`, `dtype` and
`load_report` (its `source`: the folder, whose sentence-transformers files the embedding pipelines read) the
pipelines read, so no pipeline branches on the backend. A backend subclasses it with `run`: int64 feeds in, the
task's graph outputs out as float32 arrays.

`GraphBackend` is one backend's record: whether a path is one of its folders or graph files (`detect`), and how
to open one (`load`); hfport.pipeline() picks the backend through hfport/pipelines/backends.py's table.

The graphs compute padded batches (the exporter traces hfport's padded path: the padding-free one is
data-dependent): values at padding positions are outside the contract, exactly as for the PyTorch models.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .. import hub
from ..config import EncoderConfig
from ..modeling import INT8_DTYPES, LoadReport, on_meta, resolve_dtype, task_of
from ..registry import Family, get_family
from ..tasks import TASKS


class GraphModel:
    """A graph with the calling convention and facts of an hfport task model (CPU, float32 in and out)."""

    runtime = "the graph runtime"  # named in errors: "onnxruntime", "OpenVINO"

    int8_files: tuple[str, ...] = ()  # the format's quantized graph files (a backend's subclass names them)

    def __init__(self, path: Path, config: EncoderConfig, family: Family, task: str, inputs: list[str],
                 files: list[Path], note: str):
        self.path = path  # the graph file served (model.onnx, openvino_model.xml, ...)
        self.config = config
        self.family = family
        self.task = task
        self.inputs = inputs  # the graph's input names
        self.outputs = list(TASKS[task].graph_outputs)
        self.files = files  # what the runtime holds in memory: the graph and its weights
        # what the pipelines read of a loaded model's origin: the folder (its sentence-transformers files) and the graph
        self.load_report = LoadReport(str(path.parent), notes=[note])
        # The module tree on the meta device (no memory): what the pipelines read about the model's layout, such
        # as the position table's size, comes from the same code as for the PyTorch model.
        with on_meta():
            self.body = family.build_body(config, task)

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """The graph's outputs (self.outputs, in order) on FEEDS (self.inputs as int64 (B, T) arrays)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path}, {self.family.model_type}, {self.task})"

    # --- what a PreTrainedEncoder offers the pipelines ----------------------------------------------------

    def eval(self) -> GraphModel:
        return self

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32  # inputs and outputs; an int8 graph quantizes inside

    @property
    def dtype_name(self) -> str:
        """"int8" for a quantized graph (the int8 file of an ONNX or OpenVINO folder), else "float32"."""
        return "int8" if self.path.name in self.int8_files else "float32"

    def parameters(self) -> Iterator[Tensor]:
        return iter(())

    def buffers(self) -> Iterator[Tensor]:
        """One meta tensor the size of the graph's files: lets memory accounting that sums parameters and buffers
        (the server's model cache) count what the runtime holds, without allocating it."""
        yield torch.empty(sum(f.stat().st_size for f in self.files), dtype=torch.uint8, device="meta")

    def __call__(self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None,
                 position_ids: Tensor | None = None, encoder_outputs: Any = None) -> Any:
        if position_ids is not None:
            raise ValueError(f"the {self.runtime} graph computes its own position ids; position_ids cannot be given")
        if encoder_outputs is not None:  # what a mixed-adapter batch hands a head; a graph serves no adapters
            raise ValueError(f"the {self.runtime} graph runs whole; encoder_outputs cannot be given")
        ids = np.ascontiguousarray(input_ids.detach().cpu().numpy(), dtype=np.int64)  # (B, T)
        feeds = {"input_ids": ids,
                 "attention_mask": np.ones_like(ids) if attention_mask is None else
                 np.ascontiguousarray(attention_mask.detach().cpu().numpy(), dtype=np.int64)}  # (B, T)
        if "token_type_ids" in self.inputs:  # absent: segment 0, as the PyTorch model does
            feeds["token_type_ids"] = np.zeros_like(ids) if token_type_ids is None else \
                np.ascontiguousarray(token_type_ids.detach().cpu().numpy(), dtype=np.int64)  # (B, T)
        try:
            arrays = self.run(feeds)
        except Exception as e:  # noqa: BLE001 - runtimes raise their own pybind classes; the pipeline retries these
            raise RuntimeError(f"{self.path}: {self.runtime} failed ({type(e).__name__}: {e})") from e
        return TASKS[self.task].output_type(**{n: torch.from_numpy(a) for n, a in zip(self.outputs, arrays)})

    forward = __call__


def graph_inputs(config: EncoderConfig) -> list[str]:
    """The inputs a graph for this config takes: token types only where the model has more than one (optimum's
    layout: a RoBERTa / XLM-R graph, one token type, has no token_type_ids input)."""
    return ["input_ids", "attention_mask", *(["token_type_ids"] if config.type_vocab_size > 1 else [])]


def read_folder_config(folder: Path) -> tuple[dict[str, Any], Family, EncoderConfig, str]:
    """(raw config.json, family, EncoderConfig, task) of a graph folder (ONNX, OpenVINO): the head from
    `architectures`."""
    raw, source = hub.read_config(folder)
    family = get_family(raw.get("model_type"), source)
    config = family.config_from_hf(raw, source)
    return raw, family, config, task_of(family, raw.get("architectures") or [])


def check_io(have_in: list[str], outputs: dict[str, list[Any]], config: EncoderConfig, task: str, path: Path,
             error: type[Exception]) -> None:
    """A graph's inputs (names) and outputs (name -> shape, an int where an axis is fixed) are the ones config.json
    implies: names, ranks and the fixed last axis; ERROR (the backend's) names what differs."""
    want_in = graph_inputs(config)
    # graphs hfport exported before the layout above fed RoBERTa's one token type too (zeros): still served
    legacy = config.type_vocab_size == 1 and sorted(have_in) == sorted([*want_in, "token_type_ids"])
    if sorted(have_in) != sorted(want_in) and not legacy:
        raise error(f"{path}: graph inputs {have_in} do not match config.json, which implies {want_in} "
                    f"(type_vocab_size {config.type_vocab_size})")
    if not TASKS[task].graph_outputs:
        raise error(f"{path}: config.json's architectures make it a {task} model; hfport has no graph for {task}")
    for name, (rank, field) in TASKS[task].graph_outputs.items():
        if name not in outputs:
            raise error(f"{path}: the graph has no output {name!r} (it has {sorted(outputs)}); config.json's "
                        f"architectures make it a {task} model, whose graph returns {list(TASKS[task].graph_outputs)}")
        shape = outputs[name]
        if len(shape) != rank:
            raise error(f"{path}: output {name!r} has rank {len(shape)} ({shape}); a {task} graph's has rank {rank}")
        if field is not None and isinstance(shape[-1], int) and shape[-1] != getattr(config, field):
            raise error(f"{path}: output {name!r} has last axis {shape[-1]}, but config.json's {field} is "
                        f"{getattr(config, field)}")


def graph_dtype(dtype: Any, backend: str, runs: tuple[torch.dtype, ...] = (torch.float32,)) -> torch.dtype:
    """The precision a graph backend computes in for the pipeline's DTYPE: None and "auto" (the exported graph's
    own, float32) are float32; a dtype the backend cannot run (int8 quantizes a PyTorch model as it loads: a graph's
    int8 is its exported int8 file) is a ValueError naming what it runs."""
    if dtype is None or dtype == "auto":
        return torch.float32
    resolved = None if isinstance(dtype, str) and dtype in INT8_DTYPES else resolve_dtype(dtype)
    if resolved not in runs:
        names = " or ".join(str(d).removeprefix("torch.") for d in runs)
        raise ValueError(f"the {backend} backend runs {names} graphs on the CPU; got dtype={dtype!r}")
    return resolved


@dataclass(frozen=True)
class GraphBackend:
    """One graph backend: `detect(path)`: is PATH one of its folders or graph files; `load(path, file=, dtype=)`:
    the GraphModel serving it (`file`: another graph of the folder; `dtype`: the pipeline's dtype, which the backend
    maps to the precision it computes in or refuses)."""

    name: str
    serves: str  # one line for errors and help: what folders it serves
    detect: Callable[[str | os.PathLike[str]], bool]
    load: Callable[..., GraphModel]


__all__ = ["GraphBackend", "GraphModel", "check_io", "graph_dtype", "graph_inputs", "read_folder_config"]
