"""The OpenVINO formats (fp32, and int8 beside it): the writer of an OpenVINO folder (formats/openvino.py), made from
hfport's own ONNX graph.

`export_openvino(src, out)` writes OUT with
    openvino_model.xml/.bin   the fp32 IR: hfport's ONNX graph (export/onnx.py's `trace`: the padded path, standard
                              ONNX ops, opset 17, dynamic batch and sequence axes) converted by openvino.convert_model
                              and saved with compress_to_fp16=False (fp16 weights would be another model);
    openvino_model_qint8_quantized.xml/.bin   with quantize="int8": NNCF's static post-training quantization
                              (nncf.quantize, model_type TRANSFORMER: int8 weights per output channel, int8
                              activations at ranges fixed on the calibration texts, fast bias correction) of that
                              graph, calibrated on the calibration texts and pairs (hfport/probes.py), each its own
                              unpadded sample, never the texts the gate judges. Three rules on top of NNCF's defaults,
                              measured on all-MiniLM-L6-v2 (the gate's least cosine over its short texts / pairs /
                              long texts / long pairs, f32 inference):
                                NNCF's defaults (SmoothQuant alpha 0.95, the attention MatMuls quantized too)
                                  0.893 / 0.989 / 0.939 / 0.948: below the gate's 0.98;
                                the attention's two activation x activation MatMuls kept fp32 (their long rows'
                                  softmax weights fall below one uint8 step) 0.894 / 0.989 / 0.971 / 0.987;
                                  with SmoothQuant alphas 0.5-0.9 instead 0.918-0.984 on the texts, not monotone;
                                and hfport's outlier split instead of SmoothQuant (export/onnx_fusion.py's
                                  split_outliers, nn/int8.py's rule: each weight MatMul's outlier input channels
                                  through a small fp32 MatMul beside the int8 one, exact in fp32; read off the same
                                  calibration texts) 0.9945 / 0.9977 / 0.9976 / 0.9964.
                              Where the split applies is tried in OUTLIER_SCOPES' order until the gate passes (a
                              failed try is written again with the next scope; a scope that selects none of the
                              traced graph's weight MatMuls is skipped with a warning): the feed-forward's MatMuls
                              first, then every weight MatMul. Each side MatMul costs a pass over its output, and the
                              feed-forward scope keeps the split off attention's q/k/v/o inputs, where MiniLM's gate
                              does not need it. On all-MiniLM-L6-v2 (the gate's rows as above; least cosine against
                              transformers fp32 on 1,000 real texts of 8-120 words, scripts/bench_cpu_peers.py's):
                                the feed-forward only (12 of the 19 split inputs) 0.9882 / 0.9973 / 0.9968 / 0.9964,
                                  1,000 texts 0.9924: what is written;
                                every weight MatMul 0.9922 / 0.9974 / 0.9972 / 0.9970, 1,000 texts 0.9847;
                                the down MatMuls only 0.9794 (fails) / 0.9952 / 0.9947 / 0.9953;
                                no split (plain static int8) 0.9663 (fails) / 0.9899 / 0.9913 / 0.9921.
                              The task head's MatMuls stay fp32 too (a small share of the work but for a masked-LM
                              decoder): its static int8 input error lands on the logits unaveraged; on the tiny
                              random QA model of tests/test_openvino.py an int8 head flipped 1 of the 41 long pairs'
                              spans fp32 decides (span agreement 0.9756 < 0.99), an fp32 head none;
    config.json, the tokenizer files, the source's sentence-transformers files (pooling, normalize: what the embedding
    pipelines read), README.md, and hfport_openvino.json (the manifest: inputs, outputs, the source, what the IRs
    were made from and how, each IR file's sha256, `default_file`: the IR the folder serves, an int8 export's int8
    IR, `inference_precision`: f32, what verify proved and the backend serves by default, and the int8 IR's own
    precision: `int8_precision`).
The int8 IR's precision: where OpenVINO computes bf16 on this CPU, the int8 IR computed in bf16 (its float parts:
attention, norms, the fp32-kept MatMuls) is judged by the int8 gate against the fp32 IR in f32, as the f32 one is;
passing, the manifest records bf16 for it (`inference_precisions`), the backend serves it so by default and verify
judges it so too. On all-MiniLM-L6-v2 (the gate's rows as above) bf16 0.9891 / 0.9972 / 0.9967 / 0.9969 against f32's
0.9882 / 0.9973 / 0.9968 / 0.9964. Speed, the same folder served both ways in one process, 7 interleaved rounds on a
2-core EPYC: bf16 / f32 1.077x [1.021-1.186] in texts/s over scripts/bench_cpu_peers.py's 1,000 texts (batches of
32); one short text no faster (f32 / bf16 latency 0.94x [0.68-1.46]). A CPU without bf16 records f32 (bf16 not
judged).
Written into a hidden sibling folder, verified there (export/openvino_verify.py: the fp32 IR against hfport and
transformers, the int8 IR through the int8 gate), and renamed into place only if every check passed.

Needs the `openvino` extra (openvino, nncf, and onnx for the graph it converts); not optimum-intel, whose
transformers pin hfport cannot take.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ..formats.openvino import (INFERENCE_PRECISION, IR_FILE, QUANTIZED_IR_FILE, OpenVinoModelError, read_manifest,
                                served_precision)
from ..modeling import PreTrainedEncoder
from ..nn.int8 import MAX_OUTLIERS, OUTLIER_RATIO
from ..nn.layers import FeedForward, GatedFeedForward, SplitGatedFeedForward
from ..pipelines.graph import graph_inputs, read_folder_config
from ..pipelines.openvino_backend import INSTALL_HINT, OpenVinoModel
from .card import CardFacts, CardStyle
from .common import ExportError, ExportResult, Source
from .graph_export import GateOptions, Graphs, export_graphs, gate_lines, write_graph_folder
from .graph_verify import GATE_CHECK, feeds, int8_rows, pooling_of, probe_batches
from .onnx import DEFAULT_OPSET, in_traced_scope, trace, traced_scope
from .onnx_agreement import MIN_AGREEMENT, MIN_COSINE, GateContext
from .onnx_fusion import split_outliers, weight_matmuls
from .openvino_verify import OPENVINO_GRAPHS, load_ir
from .probes import GateData
from .report import VerifyFailed, VerifyReport

log = logging.getLogger("hfport")

QUANTIZE = ("int8",)
# attention traced with the mask added to the scores: OpenVINO's converter makes it one ScaledDotProductAttention op
# (nn/attention.py's additive_attention), which NNCF leaves float and the CPU plugin runs fused
TRACED_ATTENTION = "additive"
BF16 = "bf16"  # OpenVINO's precision hint for bf16, the int8 IR's where its gate passes it (serving_precisions)
# the traced head's node names (head_matmuls): they follow module paths (export/onnx.py's traced_scope)
HEAD_SCOPE = "/model/head/"


@dataclass(frozen=True)
class OutlierScope:
    """Where the int8 IR's outlier split applies: the MatMuls inside MODULES (None: every weight MatMul)."""

    name: str  # in the manifest, the card and the log
    modules: tuple[type[torch.nn.Module], ...] | None

    def matmuls(self, model: PreTrainedEncoder) -> Callable[[str], bool] | None:
        """A predicate on the traced graph's MatMul names: inside one of MODEL's MODULES (None: every one)."""
        if self.modules is None:
            return None
        scopes = [traced_scope(model, path) for path, m in model.named_modules() if isinstance(m, self.modules)]
        return lambda node: any(in_traced_scope(node, scope) for scope in scopes)


class EmptyScope(ExportError):
    """An outlier scope that selects none of the traced graph's weight MatMuls: write_openvino says so and tries the
    next one (a family whose feed-forward is a module the scope does not name, or whose trace names it otherwise)."""


# tried in this order until the int8 gate passes (the module docstring has the measurements)
OUTLIER_SCOPES = (OutlierScope("the feed-forward MatMuls", (FeedForward, GatedFeedForward, SplitGatedFeedForward)),
                  OutlierScope("every weight MatMul", None))


def require_openvino_export(quantize: str | None) -> tuple[Any, Any]:
    """(openvino, nncf or None), or an ExportError saying how to install them; the graph is traced to ONNX first,
    so the onnx package too."""
    try:
        import onnx  # noqa: F401 - only: is it installed? (the trace and the outlier split write ONNX)
        import openvino
        nncf = None
        if quantize is not None:
            import nncf
    except ImportError as e:
        raise ExportError(f"OpenVINO export needs the openvino, nncf and onnx packages ({e}); {INSTALL_HINT}") from e
    return openvino, nncf


class OpenVinoOptions(GateOptions):
    """How to export an OpenVINO folder (formats openvino and openvino-int8). The IRs are always verified."""


IR_ROLES = {IR_FILE: "fp32", QUANTIZED_IR_FILE: "int8 (NNCF static quantization): the CPU serving IR"}


def openvino_section(facts: CardFacts) -> list[str]:
    """The IRs (which one is int8), how the int8 IR was made, and what its gate measured against the fp32 IR."""
    manifest = read_manifest(facts.folder) or {}
    sums = manifest.get("sha256") or {}
    lines = ["## OpenVINO IRs", "", f"Converted from {manifest.get('converted_from')} by OpenVINO "
             f"{manifest.get('openvino_version')}; padded batches (inputs "
             + ", ".join(f"`{i}`" for i in manifest.get("inputs", [])) + "; outputs "
             + ", ".join(f"`{o}`" for o in manifest.get("outputs", [])) + "); verified and served with "
             f"INFERENCE_PRECISION_HINT={manifest.get('inference_precision')}"
             + (f", the int8 IR with {manifest['int8_precision']}" if manifest.get("int8_precision") else "") + ".",
             "",
             "| file | IR | sha256 |", "|---|---|---|"]
    lines += [f"| `{name}` | {IR_ROLES.get(str(Path(name).with_suffix('.xml')), '')} | `{digest[:16]}...` |"
              for name, digest in sums.items()]
    quantization = manifest.get("quantization")
    if quantization:
        outliers = sum(map(len, (quantization.get("outlier_channels") or {}).values()))
        lines += ["", f"`{QUANTIZED_IR_FILE}` is the int8 IR: {quantization.get('method')}; {outliers} outlier input "
                  f"channels of {quantization.get('outlier_scope', 'every weight MatMul')} in fp32 "
                  f"({quantization.get('outlier_rule')}); "
                  f"{len(quantization.get('kept_fp32') or [])} MatMuls kept fp32 ({quantization.get('keep_rule')})."]
    return lines + gate_lines(facts) + [""]


def openvino_use(facts: CardFacts) -> list[str]:
    """OpenVINO's runtime directly, and hfport's openvino backend."""
    default = QUANTIZED_IR_FILE if (facts.folder / QUANTIZED_IR_FILE).is_file() else IR_FILE
    return ["## Use", "", "```python", "import openvino as ov", "",
            f'compiled = ov.Core().compile_model("{facts.name}/{default}", "CPU",',
            f'                                   {{"INFERENCE_PRECISION_HINT": '
            f'"{served_precision(facts.folder, default)}"}})',
            "```", "", f'With hfport: `hfport.pipeline("{facts.task}", model="{facts.name}")` (the openvino backend'
            + (f", the int8 IR; `file=\"{IR_FILE}\"` for fp32)." if default != IR_FILE else ")."), ""]


OPENVINO_CARD = CardStyle(library="transformers", tags=("openvino",), use=openvino_use, section=openvino_section)


@dataclass
class OpenVinoExportResult(ExportResult):
    @property
    def irs(self) -> list[str]:
        """openvino_model.xml (+ openvino_model_qint8_quantized.xml)."""
        return [w for w in self.weights if w.endswith(".xml")]


def export_openvino(src: str | os.PathLike[str], out: str | os.PathLike[str], *, which: str = "best",
                    quantize: str | None = None, force: bool = False, min_agreement: float = MIN_AGREEMENT,
                    min_cosine: float = MIN_COSINE, json_path: str | os.PathLike[str] | None = None,
                    gate_data: str | os.PathLike[str] | None = None) -> OpenVinoExportResult:
    """Write SRC as an OpenVINO folder at OUT, verified against SRC before OUT appears (VerifyFailed if not).
    (`hfport.export(src, out, format="openvino" | "openvino-int8", ...)` is the same through the format registry.)"""
    options = OpenVinoOptions.of(which=which, min_agreement=min_agreement, min_cosine=min_cosine,
                                 gate_data=None if gate_data is None else str(gate_data))
    return export_graphs(write_openvino, options, src, out, force=force, quantize=quantize, json_path=json_path)


def write_openvino(source: Source, out: Path, options: OpenVinoOptions, *, quantize: str | None = None,
                   verify: bool = True, json_path: str | os.PathLike[str] | None = None,
                   card: CardStyle = OPENVINO_CARD) -> OpenVinoExportResult:
    """SOURCE's model as an OpenVINO folder at OUT (+ the int8 IR with quantize="int8"), always verified: an IR is a
    new computation, never a copy of the weights, so `verify` cannot turn the proof off."""
    if quantize is not None and quantize not in QUANTIZE:
        raise ExportError(f"quantize {quantize!r}: expected one of {list(QUANTIZE)} or None")
    ov, nncf = require_openvino_export(quantize)
    scopes = OUTLIER_SCOPES if quantize is not None else OUTLIER_SCOPES[-1:]
    for i, scope in enumerate(scopes):
        try:
            return write_graph_folder(OPENVINO_GRAPHS, source, out, options,
                                      partial(_write_irs, ov, nncf, quantize=quantize, scope=scope),
                                      quantize=quantize, json_path=json_path, card=card, result=OpenVinoExportResult,
                                      serving=partial(serving_precisions, ov))
        except EmptyScope as e:
            if i + 1 == len(scopes):
                raise
            log.warning("%s: %s; splitting outliers in %s instead", out, e, scopes[i + 1].name)
        except VerifyFailed as e:
            failed = e.report.failures
            if i + 1 == len(scopes) or not all(r.check == GATE_CHECK for r in failed):
                raise
            log.info("%s: the int8 IR with outliers split in %s fails the int8 gate (%s); writing it again with "
                     "outliers split in %s", out, scope.name, "; ".join(r.output for r in failed), scopes[i + 1].name)
    raise AssertionError("unreachable: the last scope returns or raises")


def _write_irs(ov: Any, nncf: Any, model: PreTrainedEncoder, tok_folder: Path, staging: Path, *,
               quantize: str | None, scope: OutlierScope) -> Graphs:
    """openvino_model.xml/.bin, and the int8 IR as asked, from hfport's ONNX graph (traced into the staged folder,
    never left there), with the manifest's entries: the converter, and the quantization's."""
    traced = staging / ".traced-model.onnx"  # hfport's ONNX graph, the IRs' source; never left in OUT
    try:
        trace(model, tok_folder, traced, DEFAULT_OPSET, backend=TRACED_ATTENTION)
        irs = [IR_FILE]
        ov.save_model(ov.convert_model(str(traced)), str(staging / IR_FILE), compress_to_fp16=False)
        quantization = None
        if quantize is not None:
            quantization = quantize_ir(ov, nncf, traced, staging / QUANTIZED_IR_FILE, model, tok_folder, scope)
            irs.append(QUANTIZED_IR_FILE)
    finally:
        traced.unlink(missing_ok=True)
    return Graphs(irs, made={"openvino_version": ov.__version__,
                             "converted_from": f"hfport's ONNX graph (torch.onnx TorchScript exporter, torch "
                                               f"{torch.__version__}, opset {DEFAULT_OPSET})"},
                  details={"quantization": quantization})


def serving_precisions(ov: Any, staging: Path, source: Path, data: GateData,
                       bounds: tuple[float, float]) -> dict[str, Any]:
    """The manifest's serving entries: f32 for the IRs (what verify proves), and for the int8 IR bf16 where OpenVINO
    computes bf16 on this CPU and the int8 gate passes the int8 IR computed in it against the fp32 IR in f32
    (`int8_precision` says which and why; the module docstring has the measurements)."""
    entries: dict[str, Any] = {"inference_precision": INFERENCE_PRECISION}
    if not (staging / QUANTIZED_IR_FILE).is_file():
        return entries
    if "BF16" not in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
        return {**entries, "int8_precision": f"{INFERENCE_PRECISION}: OpenVINO computes no bf16 on this CPU"}
    try:
        _, _, config, task = read_folder_config(staging)
        fp32, _ = load_ir(staging / IR_FILE, config, task)
        bf16 = OpenVinoModel.from_pretrained(staging, file=QUANTIZED_IR_FILE, precision=BF16)
    except OpenVinoModelError as e:  # an IR that does not load: verify's rows say so and refuse the folder
        return {**entries, "int8_precision": f"{INFERENCE_PRECISION}: bf16 not judged ({e})"}
    judged = VerifyReport(str(staging), str(source))
    int8_rows(judged, bf16, fp32, GateContext(config, pooling_of(staging, str(source))), task, bounds, data,
              variant=BF16)
    rows = "; ".join(f"{r.output}{'' if r.passed else ' FAIL'}" for r in judged.rows)
    if not judged.passed:
        log.info("%s: the int8 IR computed in bf16 fails the int8 gate (%s); it is served in f32", source, rows)
        return {**entries, "int8_precision": f"{INFERENCE_PRECISION}: bf16 fails the int8 gate ({rows})"}
    return {**entries, "inference_precisions": {QUANTIZED_IR_FILE: BF16},
            "int8_precision": f"{BF16}: passes the int8 gate ({rows})"}


def activation_matmuls(ir: Any) -> list[str]:
    """The MatMuls of IR whose inputs are both activations (attention's scores and weighted sum): no constant
    weight to quantize per channel, and softmax weights below one uint8 step on long rows (the module docstring)."""
    return [op.get_friendly_name() for op in ir.get_ops() if op.get_type_name() == "MatMul"
            and all(op.input_value(i).get_node().get_type_name() != "Constant" for i in range(2))]


def head_matmuls(ir: Any) -> list[str]:
    """The task head's MatMuls (the module docstring says why they stay fp32), found by the trace's node names,
    which follow module paths: export/onnx.py's traced wrapper holds the task model as `model`, whose head is
    `head` in every task."""
    return [op.get_friendly_name() for op in ir.get_ops()
            if op.get_type_name() == "MatMul" and op.get_friendly_name().startswith(HEAD_SCOPE)]


def calibration_samples(batches: dict[str, dict[str, Any]], inputs: list[str]) -> list[dict[str, Any]]:
    """The calibration batches (export/graph_verify.py's probe_batches: the calibration texts and pairs) as NNCF
    samples: each row its own (1, T) feed of its real tokens only (a padded batch would put padding positions into
    the activation ranges)."""
    samples = []
    for enc in batches.values():
        for row, real in enumerate(enc["attention_mask"].bool()):  # real: (T,)
            samples.append(feeds({k: v[row:row + 1, real] for k, v in enc.items()}, inputs))
    return samples


def quantize_ir(ov: Any, nncf: Any, traced: Path, dst: Path, model: PreTrainedEncoder, tok_folder: Path,
                scope: OutlierScope) -> dict[str, Any]:
    """The int8 IR at DST from the ONNX graph TRACED: the outlier split within SCOPE (fp32 side MatMuls), then
    NNCF's static quantization with the side and attention MatMuls kept fp32 and SmoothQuant off (the module
    docstring says why). Returns the manifest's quantization entry; EmptyScope where SCOPE selects none of TRACED's
    weight MatMuls."""
    from nncf.quantization.advanced_parameters import AdvancedQuantizationParameters, AdvancedSmoothQuantParameters

    in_scope = scope.matmuls(model)
    candidates = weight_matmuls(traced)
    selected = [n for n in candidates if in_scope is None or in_scope(n)]
    if in_scope is not None and not selected:
        raise EmptyScope(f"{scope.name} select none of the {len(candidates)} weight MatMuls of the traced "
                         f"{model.family.model_type} graph")
    if not selected:
        log.warning("the traced %s graph has no weight MatMul: the int8 IR has no outlier split",
                    model.family.model_type)
    inputs = graph_inputs(model.config)
    batches = probe_batches(tok_folder, model.task, model.config)
    samples = calibration_samples(batches, inputs)
    probes = [feeds(enc, inputs) for enc in batches.values()]  # the outlier rule reads the padded batches' real tokens
    split = dst.parent / f".split-{traced.name}"  # the int8 IR's fp32 source: never written to OUT
    try:
        side, outliers = split_outliers(traced, split, probes, scope=in_scope)
        ir = ov.convert_model(str(split))
    finally:
        split.unlink(missing_ok=True)
    names = {op.get_friendly_name() for op in ir.get_ops()}
    keep = activation_matmuls(ir) + head_matmuls(ir) + [n for n in side if n in names]
    nncf_log = logging.getLogger("nncf")
    level = nncf_log.level
    nncf_log.setLevel(logging.ERROR)
    try:
        # NNCF draws progress bars on stdout: the CLI's stdout is the export's own
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            quantized = nncf.quantize(
                ir, nncf.Dataset(samples), model_type=nncf.ModelType.TRANSFORMER, subset_size=len(samples),
                ignored_scope=nncf.IgnoredScope(names=keep),
                advanced_parameters=AdvancedQuantizationParameters(
                    smooth_quant_alphas=AdvancedSmoothQuantParameters(matmul=-1)))
    except Exception as e:  # noqa: BLE001 - NNCF raises its own and the runtime's errors; each is an export failure
        raise ExportError(f"nncf could not quantize the {model.family.model_type} {model.task} model: "
                          f"{type(e).__name__}: {str(e)[:400]}") from e
    finally:
        nncf_log.setLevel(level)
    ov.save_model(quantized, str(dst), compress_to_fp16=False)
    return {"type": "int8", "method": f"nncf {nncf.__version__} static post-training quantization (model_type "
                                      "transformer, SmoothQuant off, fast bias correction)",
            "calibration": f"{len(samples)} calibration texts and pairs (hfport/probes.py), one unpadded row a sample",
            "outlier_channels": outliers,
            "outlier_rule": f"input channels with calibration |max| > {OUTLIER_RATIO:g} x the median channel's (at "
                            f"most {MAX_OUTLIERS} per input) in a fp32 MatMul",
            "outlier_scope": scope.name if selected else "no MatMul (the traced graph has no weight MatMul)",
            "kept_fp32": keep,
            "keep_rule": "attention's activation x activation MatMuls, the task head's MatMuls and the outlier MatMuls"}
