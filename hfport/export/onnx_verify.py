"""`verify_onnx(dir, source)`: the proof of an ONNX folder (export/onnx.py writes it), failing closed: the checks of
every graph folder (export/graph_verify.py) with ONNX's graphs, runtime and tolerance.

The calibration texts (export/probes.py, through DIR's tokenizer, padded batches) are compared at real positions:
    graph      each graph loads in onnxruntime, its inputs/outputs match config.json, its axes are dynamic;
    files      each graph's sha256 equals the one recorded at export; a missing hfport_onnx.json is a FAIL;
    fp32       model.onnx (and model_optimized.onnx) against hfport's model from SOURCE, and against transformers'
               (not installed: a FAIL row saying what to install): |onnx - reference| <= atol + rtol * |reference|,
               atol = rtol = 1e-4 by default: onnxruntime fuses LayerNorm/GELU/MatMul+Add and sums in its own order
               (max abs diff on all-MiniLM-L6-v2: ~3e-6);
    int8       model_quantized.onnx against model.onnx by what the head means (export/onnx_agreement.py), on the
               judged texts (export/probes.py): the built-in set, 64 short texts and pairs and 64 long ones up to the
               model's max length (never the calibration texts the quantizer read), or the user's (`gate_data`,
               --gate-data FILE, cut only at the model's max length), at least `min_agreement` (default 0.99) or
               `min_cosine` (0.98, the least cosine over the texts), each set by itself.
Probes feed only the inputs the model takes: a config with one token type (RoBERTa, XLM-R) gets no token type ids,
whatever its tokenizer returns. SOURCE defaults to the one hfport_onnx.json records. When no source is given and the
recorded one cannot be reached (the folder was copied to another machine), the fp32 rows compare hfport's own load
of DIR (the ONNX backend its pipelines serve) with onnxruntime running model.onnx directly, and the report names
that reference: the graph is then not compared with a PyTorch model. A --source that cannot be loaded is a FAIL row.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..formats.onnx import ONNX_FOLDER
from ..pipelines.onnx_backend import INSTALL_HINT, OnnxModel, check_signature, open_session, read_folder_config
from ..tasks import TASKS
from .common import ExportError
from .graph_verify import GraphVerify, feeds, verify_graphs
from .onnx_fusion import OPTIMIZED_FILE
from .report import VerifyReport

FP32_TOLERANCE = (1e-4, 1e-4)  # (atol, rtol); the module docstring says why


def require_onnx() -> tuple[Any, Any]:
    """(onnx, onnxruntime), or an ExportError saying how to install them."""
    try:
        import onnx
        import onnxruntime
    except ImportError as e:
        raise ExportError(f"ONNX export needs the onnx and onnxruntime packages ({e}); {INSTALL_HINT}") from e
    return onnx, onnxruntime


class RawGraph:
    """model.onnx run by onnxruntime directly (its own session, feeds built here): the reference for hfport's ONNX
    backend when no PyTorch source can be reached."""

    def __init__(self, path: Path, task: str):
        self.session = open_session(path)
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.outputs = list(TASKS[task].graph_outputs)

    def __call__(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None) -> Any:
        enc = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None:
            enc["token_type_ids"] = token_type_ids
        arrays = self.session.run(self.outputs, feeds(enc, self.inputs))
        return {name: torch.from_numpy(a) for name, a in zip(self.outputs, arrays)}


def load_graph(path: Path, config: Any, task: str) -> tuple[OnnxModel, list[str]]:
    """The graph loaded in onnxruntime with the signature config.json implies (else an OnnxModelError), and its
    inputs whose batch or sequence axis is fixed."""
    session = open_session(path)
    check_signature(session, config, task, path)
    fixed = [f"{i.name} {i.shape}" for i in session.get_inputs()
             if len(i.shape) != 2 or any(isinstance(d, int) for d in i.shape)]
    _, family, cfg, _ = read_folder_config(path.parent)
    return OnnxModel(path, session, cfg, family, task), fixed


ONNX_GRAPHS = GraphVerify(ONNX_FOLDER, export_format="onnx", row="graph", tolerance=FP32_TOLERANCE,
                          runtime="onnxruntime", backend="ONNX", require=require_onnx, load=load_graph,
                          loads="loads; inputs/outputs as config.json; dynamic axes", direct=RawGraph,
                          also_fp32=((OPTIMIZED_FILE, "fp32 optimized"),))


def verify_onnx(dir: str | os.PathLike[str], source: str | os.PathLike[str] | None = None,
                **options: Any) -> VerifyReport:
    """Check the ONNX folder DIR against SOURCE (default: the source its hfport_onnx.json records); OPTIONS (which,
    atol, rtol, min_agreement, min_cosine, json_path, label, gate_data) as graph_verify.verify_graphs. Never raises
    for a failed check: the report says FAIL and names what failed."""
    return verify_graphs(ONNX_GRAPHS, dir, source, **options)
