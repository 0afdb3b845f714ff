"""What proves every graph folder (export/onnx_verify.py: an ONNX folder, export/openvino_verify.py: an OpenVINO one),
failing closed: one `GraphVerify` record per format (its folder's names, the runtime, how one graph is loaded and
checked, the fp32 tolerance) and `verify_graphs`, the one sequence of checks both run.

The calibration texts (export/probes.py, through DIR's tokenizer, padded batches) are compared at real positions:
    config     config.json names a family and a head hfport serves as a graph;
    files      hfport's manifest is there (missing: a FAIL row) and each graph file's sha256 (the graph and, where
               the format keeps them apart, its weights) equals the one recorded at export;
    graph/IR   each graph loads in its runtime with the inputs/outputs config.json implies (the format's `load`) and
               dynamic batch and sequence axes;
    fp32       the fp32 graph (and the format's other fp32 graphs: ONNX's model_optimized.onnx), run by hfport's graph
               backend, against hfport's model from SOURCE and against transformers' (not installed: a FAIL row
               saying what to install): |graph - reference| <= atol + rtol * |reference| (the format's tolerance);
    int8       the int8 graph against the fp32 one by what the head means (export/onnx_agreement.py), on the judged
               texts (export/probes.py; `gate_data`: the user's), never the calibration ones.
Probes feed only the inputs the model takes. SOURCE defaults to the one the manifest records; when no source is given
and the recorded one cannot be reached (the folder was copied to another machine), the fp32 rows compare hfport's
backend with the runtime running the fp32 graph directly (the format's `direct`), and the report names that
reference: the graph is then not compared with a PyTorch model. A --source that cannot be loaded is a FAIL row.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .. import lora
from ..formats.graph_folder import GraphFolder
from ..formats.sentence_transformers import has_embedding_layout, read_layout
from ..pipelines.graph import GraphModel, read_folder_config
from ..tasks import TASKS, load_any
from ..tokenizer import AutoTokenizer
from .checks import quiet_transformers
from .common import TRANSFORMERS_AUTO, ExportError, Source, resolve_source
from .onnx_agreement import MIN_AGREEMENT, MIN_COSINE, GateContext, check_thresholds, gate_for, items, passes
from .onnx_agreement import verdict as judge
from .peft import load_peft
from .probes import (CALIBRATION_PAIRS, CALIBRATION_TEXTS, PROBE_MAX_LENGTH, GateData, encode, gate_batches,
                     read_gate_data)
from .report import VerifyReport, check_row, compare, reporting

# the fp32 rows compare on the calibration texts (the fp32 graph is fitted to nothing); the int8 gate judges others
PROBE_TEXTS, PROBE_PAIRS = CALIBRATION_TEXTS, CALIBRATION_PAIRS
GATE_CHECK = "int8 vs fp32"  # the int8 gate's rows in the report (the model cards list them)


@dataclass(frozen=True)
class GraphVerify:
    """How one graph folder format is proven: what verify_graphs asks of it."""

    folder: GraphFolder  # the folder's file names and manifest (formats/)
    export_format: str  # "onnx", "openvino": `hfport export --format` named when the manifest is missing
    row: str  # "graph", "IR": the report's check for each graph loaded
    tolerance: tuple[float, float]  # fp32 (atol, rtol) by default
    runtime: str  # "onnxruntime", "OpenVINO": the runtime, in the direct reference's rows
    backend: str  # "ONNX", "OpenVINO": hfport's backend, in the direct reference's rows
    require: Callable[[], Any]  # the runtime, or an error saying what to install
    # (graph path, config, task) -> (the graph served by hfport's backend, its inputs with a fixed batch or sequence
    # axis); raises when it does not load with the inputs and outputs config.json implies
    load: Callable[[Path, Any, str], tuple[GraphModel, list[str]]]
    loads: str  # what a graph's row proves, in the report
    direct: Callable[[Path, str], Any]  # (fp32 graph, task) -> the runtime running it directly, called as a model
    also_fp32: tuple[tuple[str, str], ...] = ()  # (file, report label): other fp32 graphs, compared as the first
    # (int8 graph as `load` made it, the manifest) -> (label, the int8 graph as the folder serves it by default) where
    # that differs (OpenVINO: computed in the bf16 its manifest records), judged by the gate too; else None
    served: Callable[[GraphModel, dict[str, Any] | None], tuple[str, GraphModel] | None] | None = None

    @property
    def fp32(self) -> dict[str, str]:
        """Each fp32 graph's file -> its label in the report ("fp32", ...)."""
        return {self.folder.graph_file: "fp32", **dict(self.also_fp32)}


def verify_graphs(fmt: GraphVerify, dir: str | os.PathLike[str], source: str | os.PathLike[str] | None = None, *,
                  which: str = "best", atol: float | None = None, rtol: float | None = None,
                  min_agreement: float = MIN_AGREEMENT, min_cosine: float = MIN_COSINE,
                  json_path: str | os.PathLike[str] | None = None, label: str | None = None,
                  gate_data: str | os.PathLike[str] | GateData | None = None) -> VerifyReport:
    """Check the FMT folder DIR against SOURCE (default: the source its manifest records). Never raises for a failed
    check: the report says FAIL and names what failed. json_path: also write the report there. gate_data: the texts
    the int8 gate judges (a file: one text a line, or JSONL with text / text_pair; default the built-in judged set,
    export/probes.py)."""
    folder = Path(dir).expanduser()
    report = VerifyReport(label or str(folder), str(source) if source is not None else "")
    report.set_tolerances("float32", atol, rtol, fmt.tolerance)
    with reporting(report, json_path):
        check_thresholds(min_agreement, min_cosine)
        fmt.require()
        data = gate_data if isinstance(gate_data, GateData) else \
            read_gate_data(gate_data) if gate_data is not None else GateData.builtin()
        _verify(fmt, folder, source, which, (min_agreement, min_cosine), data, report)
    return report


def _verify(fmt: GraphVerify, folder: Path, source_arg: Any, which: str, bounds: tuple[float, float],
            data: GateData, report: VerifyReport) -> None:
    if not folder.is_dir():
        raise ExportError(f"{folder}: no such folder")
    ctx: dict[str, Any] = {}
    with check_row(report, "config", "config.json"):
        _, family, config, task = read_folder_config(folder)
        ctx.update(config=config, task=task)
        report.add("config", "config.json", True, detail=f"{family.model_type} {task}")
    if not ctx:
        return
    config, task = ctx["config"], ctx["task"]
    manifest = read_recorded_manifest(folder, report, fmt.folder.manifest, fmt.export_format)
    graphs = _graphs(fmt, folder, config, task, manifest, report)
    fp32_file, int8_file = fmt.folder.graph_file, fmt.folder.quantized_file
    if fp32_file not in graphs:
        return
    against = references(fmt, folder, source_arg, manifest, which, task, report)
    batches: dict[str, dict[str, Tensor]] = {}
    with check_row(report, "tokenizer", "probes"):
        batches = probe_batches(folder, task, config)
        report.add("tokenizer", "probes", True, shape=f"{len(batches)} batches",
                   detail=", ".join(f"{k} {tuple(v['input_ids'].shape)}" for k, v in batches.items()))
    if not batches:
        return
    # each fp32 graph (ONNX: the portable one, and the onnxruntime-fused one when there is one)
    outs = {label: {name: run(graphs[file], enc, task) for name, enc in batches.items()}
            for file, label in fmt.fp32.items() if file in graphs}
    compare_references(report, outs, against, batches, task)
    if int8_file in graphs:
        with check_row(report, GATE_CHECK, "gate"):
            gate_ctx = GateContext(config, pooling_of(folder, report.source))
            int8_rows(report, graphs[int8_file], graphs[fp32_file], gate_ctx, task, bounds, data)
        served = fmt.served(graphs[int8_file], manifest) if fmt.served is not None else None
        if served is not None:
            with check_row(report, GATE_CHECK, f"gate ({served[0]})"):
                int8_rows(report, served[1], graphs[fp32_file], gate_ctx, task, bounds, data, variant=served[0])


def _graphs(fmt: GraphVerify, folder: Path, config: Any, task: str, manifest: dict[str, Any] | None,
            report: VerifyReport) -> dict[str, GraphModel]:
    """Each graph in DIR that loads with the signature config.json implies (+ its files' recorded sha256)."""
    graphs: dict[str, GraphModel] = {}
    for name in (*fmt.fp32, fmt.folder.quantized_file):
        if name != fmt.folder.graph_file and not (folder / name).is_file():
            continue
        with check_row(report, fmt.row, name):
            graph, fixed = fmt.load(folder / name, config, task)
            if fixed:
                raise fmt.folder.error(f"{folder / name}: inputs with fixed axes ({'; '.join(fixed)}); the {fmt.row} "
                                       "must take any batch size and sequence length")
            report.add(fmt.row, name, True, shape=f"{len(graph.inputs)} inputs", tolerance=fmt.loads)
            graphs[name] = graph
        if manifest is not None:
            check_recorded(report, folder, manifest, fmt.folder.files(name))
    return graphs


def read_recorded_manifest(folder: Path, report: VerifyReport, name: str,
                           export_format: str) -> dict[str, Any] | None:
    """The folder's manifest NAME as recorded at export; missing or unreadable: a FAIL row (nothing then says the
    graphs are the ones exported)."""
    if not (folder / name).is_file():
        report.add("files", name, False, tolerance="present",
                   detail=f"{folder / name} is missing: the graphs' recorded sha256 and source cannot be "
                          f"checked; export the folder again with hfport export --format {export_format}")
        return None
    with check_row(report, "files", name):
        manifest = json.loads((folder / name).read_text(encoding="utf-8"))
        if not isinstance(manifest, dict):
            raise ExportError(f"{folder / name}: the top level must be a JSON object")
        return manifest
    return None


def references(fmt: GraphVerify, folder: Path, source_arg: Any, manifest: dict[str, Any] | None, which: str,
               task: str, report: VerifyReport) -> dict[str, Any]:
    """What the fp32 graphs (run by hfport's graph backend) are compared with, each a loader: hfport's model from
    SOURCE and transformers', or, with no source given and the recorded one out of reach, the runtime running the
    fp32 graph directly (the format's `direct`)."""
    recorded = (manifest or {}).get("source")
    if source_arg is None and not (recorded and Path(recorded).exists()):
        path = folder / fmt.folder.graph_file
        why = f"the recorded source {recorded} is gone" if recorded else f"no source in {fmt.folder.manifest}"
        report.source = f"{path} run by {fmt.runtime} directly ({why}; no PyTorch model compared)"
        report.add("source", f"none reachable ({why}): hfport's {fmt.backend} backend vs {fmt.runtime}", True,
                   detail=report.source)
        return {fmt.runtime: lambda: fmt.direct(path, task)}
    loaders: dict[str, Any] = {}
    with check_row(report, "source", str(source_arg or recorded)):
        src = resolve_source(source_arg if source_arg is not None else recorded, which)
        ours = load_any(src.model, dtype=torch.float32)
        if ours.task != task:
            raise ExportError(f"{src.model} holds a {ours.task} model; {folder} holds a {task} graph")
        report.source = str(src.model)
        loaders = {"hfport": lambda: ours, "transformers": lambda: _load_transformers(src, task, ours, report)}
    return loaders


def max_length(max_positions: int) -> int:
    return min(PROBE_MAX_LENGTH, max_positions - 2)  # room for RoBERTa's position offset


def probe_batches(folder: Path, task: str, config: Any) -> dict[str, dict[str, Tensor]]:
    """The calibration texts through DIR's tokenizer as padded batches (pairs for QA and two-segment tokenizers),
    with only the inputs the model takes (probes.encode)."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    pairs = TASKS[task].pair_input or "token_type_ids" in tokenizer.model_input_names
    return encode(tokenizer, task, config, PROBE_TEXTS, PROBE_PAIRS if pairs else None,
                  max_length(config.max_position_embeddings))


def feeds(enc: dict[str, Tensor], inputs: list[str]) -> dict[str, Any]:
    """A probe batch as onnxruntime feeds for a graph with these inputs."""
    return {name: (enc[name] if name in enc else torch.zeros_like(enc["input_ids"])).numpy() for name in inputs}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@torch.inference_mode()
def run(model: Any, enc: dict[str, Tensor], task: str) -> dict[str, Tensor]:
    """The task's graph outputs from an ONNX, hfport or transformers model on one probe batch."""
    out = model(enc["input_ids"], attention_mask=enc["attention_mask"], token_type_ids=enc.get("token_type_ids"))
    return {name: out[name].float() for name in TASKS[task].graph_outputs}


def check_recorded(report: VerifyReport, folder: Path, manifest: dict[str, Any], names: list[str]) -> None:
    """A FAIL row for each of the files NAMES whose sha256 is not the one the manifest recorded at export."""
    for name in names:
        with check_row(report, "files", name):
            want = (manifest.get("sha256") or {}).get(name)
            have = sha256(folder / name)
            report.add("files", name, have == want, tolerance="sha256 as recorded at export",
                       detail="" if have == want else f"sha256 {have[:16]}... differs from the recorded "
                                                      f"{str(want)[:16]}...: the file changed after export")


def compare_references(report: VerifyReport, outs: dict[str, dict[str, dict[str, Tensor]]],
                       against: dict[str, Any], batches: dict[str, dict[str, Tensor]], task: str) -> None:
    """Each graph's outputs OUTS ({label: {batch: outputs}}) against each reference's (references())."""
    for name, load in against.items():
        with check_row(report, f"fp32 vs {name}", "load"):
            reference = load()
            refs = {batch: run(reference, enc, task) for batch, enc in batches.items()}
            for label, got in outs.items():
                compare_all(report, f"{label} vs {name}", got, refs, batches, task)


def compare_all(report: VerifyReport, check: str, got: dict[str, dict[str, Tensor]],
                 refs: dict[str, dict[str, Tensor]], batches: dict[str, dict[str, Tensor]], task: str) -> None:
    for batch, outputs in got.items():
        for name, (rank, _) in TASKS[task].graph_outputs.items():
            with check_row(report, check, f"{batch}/{name}"):
                per_token = rank == 3 or TASKS[task].per_token(name)  # start/end logits are per token at rank 2
                compare(report, check, f"{batch}/{name}", outputs[name], refs[batch].get(name),
                        real=batches[batch]["attention_mask"] if per_token else None,
                        what=f"the graph's {name}")


def pooling_of(folder: Path, source: str) -> str:
    """How an embedding model pools: its sentence-transformers layout (in DIR, else in its source), else mean."""
    for where in (folder, Path(source)):
        if where.is_dir() and has_embedding_layout(where):
            return read_layout(where).pooling
    return "mean"


def int8_rows(report: VerifyReport, int8: GraphModel, fp32: GraphModel, ctx: GateContext, task: str,
              bounds: tuple[float, float], data: GateData, variant: str = "") -> None:
    """The int8 gate (export/onnx_agreement.py) on the judged texts (never the calibration ones), one row a kind
    of input (texts, pairs, long texts, long pairs); VARIANT: how INT8 runs when not as loaded ("bf16"), in the rows'
    names."""
    gate = gate_for(TASKS[task].agreement, ctx.config)
    chunks = gate_batches(int8.path.parent, task, ctx.config, data)
    for chunk, encs in chunks.items():
        name = f"{chunk} ({variant})" if variant else chunk
        with check_row(report, GATE_CHECK, f"{name}/{gate.name}"):
            # each chunk's items at once: the outputs of every chunk together (fill-mask's (rows, T, vocab)) are large
            verdict = judge(gate, [(items(gate, run(int8, enc, task), enc, ctx),
                                    items(gate, run(fp32, enc, task), enc, ctx, reference=True)) for enc in encs], ctx)
            ok, tolerance = passes(gate, verdict, *bounds)
            lengths = torch.cat([enc["attention_mask"].sum(1) for enc in encs])  # (rows,) tokens
            counted = f"{verdict.items} items of {int(lengths.min())}-{int(lengths.max())} tokens" + \
                (f" ({verdict.ties} fp32 near ties)" if verdict.ties else "")
            error = f", relative error {verdict.error:.4f}" if verdict.error is not None else ""
            pooled = f", {ctx.pooling} pooling" if gate.threshold == "cosine" else ""
            report.add(GATE_CHECK, f"{name}/{gate.name} {verdict.value:.4f}", ok, shape=counted,
                       diff=verdict.error if verdict.error is not None else 1.0 - verdict.value,
                       tolerance=tolerance,
                       detail=f"{gate.name} {verdict.value:.4f}{error} over {counted} of {data.origin}{pooled}" +
                              ("" if ok else f" fails {tolerance}: the int8 graph changes the model's answers"))


def _load_transformers(src: Source, task: str, ours: Any, report: VerifyReport) -> Any:
    """transformers' model from the source folder (a LoRA adapter's: peft's adapter over transformers' model of its
    base, as the peft format's verify loads it); without transformers installed, an ExportError (a FAIL row: the
    graph would be compared with hfport only) saying what to install."""
    folder = src.model
    try:
        import transformers  # noqa: F401 - only: is it installed?
    except ImportError as e:
        raise ExportError(f"transformers is not installed ({e}): the graph cannot be compared with transformers' "
                          "model; pip install transformers (or 'hfport[dev]') and verify again") from e
    if src.adapter:
        base = src.base_model or lora.read_adapter_config(folder).get("base_model_name_or_path")
        labels = {"id2label": ours.config.id2label} if ours.head is not None and TASKS[task].labels else {}
        with quiet_transformers() as transformers:
            model = load_peft(report, transformers, folder, str(base) if base else None, task, labels)
        if model is None:
            raise ExportError(f"peft did not load the adapter {folder} over {base} (the load rows say why): no "
                              "reference")
        return model
    with quiet_transformers() as transformers:
        auto = getattr(transformers, TRANSFORMERS_AUTO[task])
        model, info = auto.from_pretrained(str(folder), output_loading_info=True, dtype=torch.float32,
                                           trust_remote_code=False)
    missing = sorted(map(str, info.get("missing_keys") or []))
    if missing:
        raise ExportError(f"transformers initialised weights the source lacks ({', '.join(missing[:5])}): no "
                          "reference")
    return model.eval()


__all__ = ["GATE_CHECK", "PROBE_PAIRS", "PROBE_TEXTS", "GraphVerify", "check_recorded", "feeds", "max_length",
           "probe_batches", "read_recorded_manifest", "references", "run", "sha256", "verify_graphs"]
