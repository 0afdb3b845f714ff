"""The ONNX formats (fp32, and int8 beside it): the writer of an ONNX folder (the layout optimum writes).

`export_onnx(src, out)` writes OUT with
    model.onnx            the fp32 graph: inputs input_ids, attention_mask (+ token_type_ids where the config has a
                          token-type table), outputs under transformers' names (last_hidden_state, logits,
                          start_logits/end_logits), dynamic batch_size and sequence_length axes;
    model_optimized.onnx  with optimize=True or quantize: the same model traced with onnxruntime's fused
                          MultiHeadAttention and fused SkipLayerNormalization / BiasGelu (onnx_fusion.py), the name
                          optimum's ORTOptimizer writes; it runs on onnxruntime only, model.onnx stays portable;
    model_quantized.onnx  with quantize="int8": onnxruntime's dynamic quantization of model_optimized.onnx (int8
                          weights per output channel, activations quantized per batch at run time), the CPU serving
                          graph. One per-tensor uint8 activation scale is crushed by outlier channels (MiniLM: hidden
                          dim 99 of the LayerNorm outputs up to ~28 beside typical channel peaks ~1.5, a few GELU
                          units up to ~25), and these are per channel, not per token (every token hits them). So
                          first, LLM.int8()-style, each weight MatMul's input channels whose probe |max| exceeds
                          OUTLIER_RATIO x the median channel's (at most MAX_OUTLIERS) go through a small fp32 MatMul
                          beside the int8 one (exact in fp32; onnx_fusion.split_outliers); then a MatMul whose
                          remaining input one scale still crushes (relative L2 error > KEEP_FP32_ERROR on the probe
                          texts) stays fp32 (on MiniLM: none). Both rules read the calibration texts only
                          (export/probes.py), never the texts the gate judges. Measured on four
                          MiniLM topic classifiers fine-tuned here (seeds 42, 7, 123 with bf16 autocast, 42 in fp32),
                          int8 vs fp32 over the 800 unique sentences of examples/data (the 80 in-domain eval: 100% in
                          every variant; 400 are near-tied geography facts), label agreement / mean relative logit
                          error: every MatMul plainly int8 97.4-98.9% / 0.055-0.061; the previous rule alone
                          (MiniLM's first three FFN down projections fp32) 98.25-98.9% / 0.038-0.046; the split
                          98.75-99.25% / 0.026-0.032, with no MatMul left fp32 and the int8 graph ~5% faster on one
                          thread (padded batches of 8-256 tokens). Weight rounding alone (fp32 activations) costs
                          0.012 and flips 7 of the 800 on seed 42: the near ties cap what int8 can agree on. Tried
                          and dropped: SmoothQuant's channel migration (seed 42, alpha 0.3-1.0: at best 0.041 at 0.7,
                          most alphas worse than plain int8); per-tensor weights 94% (100%);
    config.json, the tokenizer files, the source's sentence-transformers files (pooling, normalize: what the embedding
    pipelines read), and hfport_onnx.json (opset, inputs, outputs, the source it was made from, each graph's sha256
    and `default_file`, the graph the folder serves: an int8 export's int8 graph).
Everything is written into a hidden sibling folder, verified there, and renamed into place only if every check
passed, so a failed or rejected export leaves nothing at OUT (an existing OUT is only replaced with `force`).

The graph is traced with torch.onnx's TorchScript exporter (dynamo=False) from hfport's padded path
(padding_free = False): the padding-free path's layout depends on the mask's values, which a graph cannot keep, and
the dynamo exporter needs onnxscript and refuses hfport's data-dependent Python branches that the tracer simply
fixes to the masked path (the trace batch is padded on purpose). Graphs therefore compute padded batches; values
at padding positions are outside the contract, as for every hfport model. Every family traces, DeBERTa-v2/v3
included: its eager padded path keeps a per-length relative-position window and cache in Python, which a trace
would fix to one length, so modules with a `traceable` switch (DebertaEncoder) are switched on for the trace and
compute the same values from tensor ops on the runtime length (nn/relative.py: relative_rows, gathered_bias). A
module that still computed shape-dependent values in Python would trace into a graph onnxruntime refuses or that
is wrong at the probe lengths (which differ from the traced one): verify says so and nothing is written.


The proof (export/onnx_verify.py) runs on the staged folder: fp32 against hfport and transformers at real positions,
int8 against fp32 by what the head means (export/onnx_agreement.py) on judged texts apart from the calibration ones
(export/probes.py; `gate_data`: the user's); every check that cannot run is a failed row.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from pydantic import Field
from torch import Tensor, nn

from ..modeling import PreTrainedEncoder
from ..nn.int8 import MAX_OUTLIERS, OUTLIER_RATIO
# MANIFEST and verify_onnx are named here for the format's users (the ONNX folder's manifest and its proof)
from ..formats.onnx import MANIFEST, ONNX_FILE, QUANTIZED_FILE, read_manifest  # noqa: F401
from ..pipelines.onnx_backend import DYNAMIC_AXES, graph_inputs
from ..tasks import TASKS
from ..tokenizer import AutoTokenizer
from .card import CardFacts, CardStyle
from .common import TRANSFORMERS_AUTO, ExportError, ExportResult, Source
from .graph_export import GateOptions, Graphs, export_graphs, gate_lines, write_graph_folder
from .graph_verify import PROBE_TEXTS, feeds, max_length, probe_batches
from .onnx_agreement import MIN_AGREEMENT, MIN_COSINE
from .onnx_fusion import (CONTRIB_DOMAIN, OPTIMIZED_FILE, activation_errors, attention_backend, fused_attention,
                          optimize_graph, split_outliers)
from .onnx_verify import ONNX_GRAPHS, require_onnx, verify_onnx  # noqa: F401

log = logging.getLogger("hfport")

DEFAULT_OPSET = 17  # LayerNormalization is a single op from 17; every onnxruntime >= 1.14 runs it
QUANTIZE = ("int8",)
# a MatMul stays fp32 in the int8 graph when per-tensor uint8 quantization of its input loses more than this
# fraction of the input's L2 norm on the probe texts (the module docstring has the measurements)
KEEP_FP32_ERROR = 0.065
# before that: an input channel of a weight MatMul whose largest |value| on the probe texts exceeds OUTLIER_RATIO
# times the median channel's (at most MAX_OUTLIERS per input, the largest) goes through a small fp32 MatMul beside
# the int8 one (onnx_fusion.split_outliers; the module docstring has the measurements): nn/int8.py's rule, the one
# the engine's int8 layers use too


class OnnxOptions(GateOptions):
    """How to export an ONNX folder (formats onnx and onnx-int8). The graphs are always verified."""

    opset: int = Field(DEFAULT_OPSET, description="the ONNX opset (14 to the newest the onnx package knows)")
    optimize: bool = Field(False, description="also write model_optimized.onnx, the graph with onnxruntime's fused "
                                              "attention and norms (always with int8: it is made from it)")
    per_channel: bool = Field(True, description="int8: one weight scale per output channel")


# what each graph is, in the card (optimum's file names)
GRAPH_ROLES = {ONNX_FILE: "fp32, portable (any ONNX runtime)",
               OPTIMIZED_FILE: "fp32 with onnxruntime's fused attention and norms (onnxruntime only)",
               QUANTIZED_FILE: "int8 (dynamic quantization): the CPU serving graph"}


def onnx_section(facts: CardFacts) -> list[str]:
    """The graphs (which one is int8), the opset and how the int8 graph was made, and the agreement its gate
    measured against the fp32 graph on the judged texts."""
    manifest = read_manifest(facts.folder) or {}
    sums = manifest.get("sha256") or {}
    lines = ["## ONNX graphs", "", f"Opset {manifest.get('opset')}, {manifest.get('exporter')}; padded batches "
             "(inputs " + ", ".join(f"`{i}`" for i in manifest.get("inputs", [])) + "; outputs "
             + ", ".join(f"`{o}`" for o in manifest.get("outputs", [])) + ").", "",
             "| file | graph | sha256 |", "|---|---|---|"]
    lines += [f"| `{name}` | {GRAPH_ROLES.get(name, '')} | `{digest[:16]}...` |" for name, digest in sums.items()]
    quantization = manifest.get("quantization")
    if quantization:
        outliers = sum(map(len, (quantization.get("outlier_channels") or {}).values()))
        lines += ["", f"`{QUANTIZED_FILE}` is the int8 graph: {quantization.get('weights')} weights "
                  f"({'per output channel' if quantization.get('per_channel') else 'per tensor'}), made from "
                  f"`{quantization.get('from')}`; {outliers} outlier input channels in fp32 "
                  f"({quantization.get('outlier_rule')}), "
                  f"{len(quantization.get('kept_fp32') or {})} MatMuls kept fp32 ({quantization.get('keep_rule')})."]
    return lines + gate_lines(facts) + [""]


def onnx_use(facts: CardFacts) -> list[str]:
    """optimum's ORTModel class for the head (the int8 graph by its file name), and hfport's onnx backend."""
    auto = TRANSFORMERS_AUTO[facts.task]
    ort = "ORTModelForFeatureExtraction" if auto == "AutoModel" else "ORT" + auto.removeprefix("Auto")
    int8 = (facts.folder / QUANTIZED_FILE).is_file()
    return ["## Use", "", "```python", f"from optimum.onnxruntime import {ort}",
            "from transformers import AutoTokenizer", "", f'tokenizer = AutoTokenizer.from_pretrained("{facts.name}")',
            f'model = {ort}.from_pretrained("{facts.name}")  # {ONNX_FILE}, fp32',
            *([f'int8 = {ort}.from_pretrained("{facts.name}", file_name="{QUANTIZED_FILE}")'] if int8 else []),
            "```", "", f'With hfport: `hfport.pipeline("{facts.task}", model="{facts.name}")` (the onnx backend'
            + (f", the int8 graph; `file=\"{ONNX_FILE}\"` for fp32)." if int8 else ")."), ""]


# optimum's ONNX exports on the Hub: transformers' library with the onnx tag
ONNX_CARD = CardStyle(library="transformers", tags=("onnx",), use=onnx_use, section=onnx_section)


@dataclass
class OnnxExportResult(ExportResult):
    opset: int = DEFAULT_OPSET

    @property
    def graphs(self) -> list[str]:
        """model.onnx (+ model_optimized.onnx, model_quantized.onnx)."""
        return self.weights

    def to_dict(self) -> dict[str, Any]:
        return super().to_dict() | {"opset": self.opset}


class _Graph(nn.Module):
    """The task model with positional inputs and a tuple of named outputs: what the tracer records."""

    def __init__(self, model: PreTrainedEncoder, outputs: list[str]):
        super().__init__()
        self.model = model
        self.outputs = outputs

    def forward(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None):
        out = self.model(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        return tuple(out[name] for name in self.outputs)


def traced_scope(model: nn.Module, path: str) -> tuple[str, ...]:
    """The steps that `trace` puts before the node names of MODEL's submodule at PATH (a named_modules path): "model"
    (_Graph's), then a step for each module on the path that runs a forward of its own, named as the TorchScript
    exporter names a module: its qualified name from the last attribute name on ("layers.0"). A container
    (ModuleList, ALBERT's layer groups) is never called and gives no step: ALBERT's body.encoder.groups.0.layers.1.ffn
    traces as model/body/encoder/layers.1/ffn."""
    atoms = path.split(".")
    steps = ["model"]
    module = model
    for i, atom in enumerate(atoms):
        module = getattr(module, atom)
        if type(module).forward is not nn.Module.forward:  # a container's is nn.Module's: never called
            start = max(j for j in range(i + 1) if not atoms[j].isdigit())
            steps.append(".".join(atoms[start:i + 1]))
    return tuple(steps)


def in_traced_scope(node: str, scope: tuple[str, ...]) -> bool:
    """Whether the traced node named NODE ("/model/body/.../MatMul") lies under SCOPE (traced_scope's steps). A module
    called again names its nodes with a count after a step ("ffn/up_1/MatMul", "attn_1/MatMul": ALBERT's shared
    layers), which is under the same scope."""
    steps = node.strip("/").split("/")[:-1]  # the last step is the node's own name
    return len(steps) >= len(scope) and all(
        step == want or (step.startswith(want + "_") and step[len(want) + 1:].isdigit())
        for step, want in zip(steps, scope))


def export_onnx(src: str | os.PathLike[str], out: str | os.PathLike[str], *, which: str = "best",
                opset: int = DEFAULT_OPSET, quantize: str | None = None, optimize: bool = False,
                per_channel: bool = True, force: bool = False, min_agreement: float = MIN_AGREEMENT,
                min_cosine: float = MIN_COSINE, json_path: str | os.PathLike[str] | None = None,
                gate_data: str | os.PathLike[str] | None = None) -> OnnxExportResult:
    """Write SRC as an ONNX folder at OUT, verified against SRC before OUT appears (VerifyFailed if not).
    (`hfport.export(src, out, format="onnx" | "onnx-int8", ...)` is the same through the format registry.)"""
    if quantize is not None and quantize not in QUANTIZE:
        raise ExportError(f"quantize {quantize!r}: expected one of {list(QUANTIZE)} or None")
    options = OnnxOptions.of(which=which, opset=opset, optimize=optimize, per_channel=per_channel,
                             min_agreement=min_agreement, min_cosine=min_cosine,
                             gate_data=None if gate_data is None else str(gate_data))
    return export_graphs(write_onnx, options, src, out, force=force, quantize=quantize, json_path=json_path)


def write_onnx(source: Source, out: Path, options: OnnxOptions, *, quantize: str | None = None,
               verify: bool = True, json_path: str | os.PathLike[str] | None = None,
               card: CardStyle = ONNX_CARD) -> OnnxExportResult:
    """SOURCE's model as an ONNX folder at OUT (+ the int8 graph with quantize="int8"), always verified: an ONNX
    graph is a new computation, never a copy of the weights, so `verify` cannot turn the proof off."""
    onnx, _ = require_onnx()
    opset = options.opset
    if isinstance(opset, bool) or not isinstance(opset, int) or not 14 <= opset <= onnx.defs.onnx_opset_version():
        raise ExportError(f"opset {opset!r}: expected an integer from 14 (scaled dot-product attention) to "
                          f"{onnx.defs.onnx_opset_version()} (the newest this onnx package knows)")
    return write_graph_folder(ONNX_GRAPHS, source, out, options,
                              partial(_write_graphs, options=options, quantize=quantize),
                              quantize=quantize, json_path=json_path, card=card,
                              result=partial(OnnxExportResult, opset=opset), no_graph="ONNX graph")


def _write_graphs(model: PreTrainedEncoder, tok_folder: Path, staging: Path, options: OnnxOptions,
                  quantize: str | None) -> Graphs:
    """model.onnx, and model_optimized.onnx / model_quantized.onnx as asked, with the manifest's entries: opset and
    exporter, the optimized graph's and the quantization's."""
    trace(model, tok_folder, staging / ONNX_FILE, options.opset)
    graphs = [ONNX_FILE]
    fused: dict[str, int] = {}
    if options.optimize or quantize is not None:  # the int8 graph is made from the fused one (onnx_fusion.py)
        traced = staging / f".traced-{OPTIMIZED_FILE}"
        trace(model, tok_folder, traced, options.opset, fused=True)
        fused = optimize_graph(traced, staging / OPTIMIZED_FILE, model.config.num_attention_heads,
                               model.config.hidden_size)
        traced.unlink()
        graphs.append(OPTIMIZED_FILE)
    quantization = None
    if quantize is not None:
        probes = probe_batches(tok_folder, model.task, model.config)
        kept_fp32, outliers = _quantize(staging / OPTIMIZED_FILE, staging / QUANTIZED_FILE, options.per_channel,
                                        [feeds(enc, graph_inputs(model.config)) for enc in probes.values()])
        graphs.append(QUANTIZED_FILE)
        quantization = {"type": quantize, "weights": "QInt8", "per_channel": options.per_channel,
                        "from": OPTIMIZED_FILE, "outlier_channels": outliers,
                        "outlier_rule": f"input channels with probe |max| > {OUTLIER_RATIO:g} x the median "
                                        f"channel's (at most {MAX_OUTLIERS} per input) in a fp32 MatMul",
                        "kept_fp32": kept_fp32, "keep_rule": f"input activation error > {KEEP_FP32_ERROR}"}
    return Graphs(graphs, made={"opset": options.opset, "exporter": "torch.onnx TorchScript exporter "
                                                                  f"(torch {torch.__version__})"},
                  details={"optimized": {"file": OPTIMIZED_FILE, "fused": fused} if fused else None,
                           "quantization": quantization})

@torch.no_grad()
def trace(model: PreTrainedEncoder, tok_folder: Path, path: Path, opset: int, fused: bool = False,
          backend: str | None = None) -> None:
    """Trace the padded path on a padded two-row batch of real text into `path`; fused: attention as onnxruntime's
    MultiHeadAttention where it can be (onnx_fusion.py); backend: else every attention traced with this kernel of
    nn/attention.py's ATTENTION_BACKENDS (None: the model's own)."""
    tokenizer = AutoTokenizer.from_pretrained(tok_folder)
    inputs = graph_inputs(model.config)
    enc = tokenizer([PROBE_TEXTS[1], PROBE_TEXTS[0]], padding=True, truncation=True,
                    max_length=max_length(model.config.max_position_embeddings), return_tensors="pt")
    args = [enc["input_ids"], enc["attention_mask"]]
    if "token_type_ids" in inputs:
        args.append(enc.get("token_type_ids", torch.zeros_like(enc["input_ids"])))
    if bool(enc["attention_mask"].all()):  # the tracer keeps the branch it sees: it must see padding
        raise ExportError(f"{tok_folder}: the tokenizer did not pad the trace batch; cannot trace the masked path")
    graph_outputs = TASKS[model.task].graph_outputs
    outputs = list(graph_outputs)
    axes = dict(enumerate(DYNAMIC_AXES))
    dynamic = {name: axes for name in inputs} | {
        name: {i: axes[i] for i in range(min(graph_outputs[name][0], 2))} for name in outputs}
    previous = model.body.padding_free
    model.body.padding_free = False
    # modules with a `traceable` switch (DeBERTa's encoder) compute from tensor ops what they otherwise keep in
    # Python per length; the trace must not fix one length
    switches = [m for m in model.modules() if isinstance(getattr(m, "traceable", None), bool)]
    switched = [m.traceable for m in switches]
    for m in switches:
        m.traceable = True
    graph = _Graph(model, outputs).eval()
    try:
        with warnings.catch_warnings(), (fused_attention(model) if fused else attention_backend(model, backend)):
            # the tracer warns about every Python branch on a tensor (padding_mask's `mask.all()`, ...): the padded
            # trace batch fixes each one to the masked path, which is the one the graph must hold
            warnings.simplefilter("ignore")
            torch.onnx.export(graph, tuple(args), str(path), dynamo=False, input_names=inputs, output_names=outputs,
                              opset_version=opset, dynamic_axes=dynamic, do_constant_folding=True,
                              custom_opsets={CONTRIB_DOMAIN: 1} if fused else None)
    except Exception as e:  # noqa: BLE001 - torch raises many kinds here; each is an export failure to report
        raise ExportError(f"torch.onnx could not export the {model.family.model_type} {model.task} model at opset "
                          f"{opset}: {type(e).__name__}: {str(e)[:400]}") from e
    finally:
        model.body.padding_free = previous
        for m, value in zip(switches, switched):
            m.traceable = value
        model.eval()


def _quantize(src: Path, dst: Path, per_channel: bool,
              probes: list[dict[str, Any]]) -> tuple[dict[str, float], dict[str, list[int]]]:
    """Dynamic int8 quantization: int8 weights (symmetric), activations quantized per batch at run time. First the
    outlier input channels leave the int8 path (split_outliers: exact in fp32); then MatMuls whose remaining input
    one per-tensor uint8 scale still crushes (relative error on the probe texts above KEEP_FP32_ERROR) stay fp32
    (the module docstring says why). Returns (the kept nodes with their errors, the split channels per input)."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    split = dst.parent / f".split-{src.name}"  # the int8 graph's fp32 source: never written to OUT
    try:
        side, outliers = split_outliers(src, split, probes)
        keep = {name: round(err, 4) for name, err in activation_errors(split, probes).items()
                if err > KEEP_FP32_ERROR and name not in side}
        quiet = logging.getLogger()  # the quantizer logs advice through the root logger
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                # DefaultTensorType: shape inference cannot type the outputs of contrib ops (MultiHeadAttention)
                quantize_dynamic(str(split), str(dst), weight_type=QuantType.QInt8, per_channel=per_channel,
                                 nodes_to_exclude=list(keep) + side,
                                 extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
        finally:
            quiet.setLevel(level)
    finally:
        split.unlink(missing_ok=True)
    return keep, outliers
