"""Export to an ONNX folder (the layout optimum writes) and prove it, failing closed.

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
                          texts) stays fp32 (on MiniLM: none). Both rules read the probe texts only. Measured on four
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
    config.json, the tokenizer files, and hfport_onnx.json (opset, inputs, outputs, the source it was made from and
    each graph's sha256).
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

`verify_onnx(dir, source)` runs the probe texts (`PROBE_TEXTS`, `PROBE_PAIRS`, through DIR's tokenizer, padded
batches) and compares at real positions:
    graph      each graph loads in onnxruntime, its inputs/outputs match config.json, its axes are dynamic;
    files      each graph's sha256 equals the one recorded at export (when hfport_onnx.json is there);
    fp32       model.onnx against hfport's model from SOURCE, and against transformers' (when installed):
               |onnx - reference| <= atol + rtol * |reference|, atol = rtol = 1e-4 by default: onnxruntime fuses
               LayerNorm/GELU/MatMul+Add and sums in its own order (max abs diff on all-MiniLM-L6-v2: ~3e-6);
    int8       model_quantized.onnx against model.onnx at the task level: label agreement (text
               classification), tag agreement over real tokens (token classification), both over the items fp32
               decides (top two probabilities at least NEAR_TIE apart; the near ties left out are reported),
               identical argmax start and end (question answering), top-5 overlap at masked positions
               (fill-mask), cosine of mean-pooled embeddings (feature extraction, the mean over the probe texts);
               at least `min_agreement` (default 0.99) or `min_cosine` (0.99).
Every check that cannot run is a failed row. SOURCE defaults to the one hfport_onnx.json records.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .. import hub
from ..modeling import PreTrainedEncoder
from ..tasks import TASKS, load_any
from .common import (TRANSFORMERS_AUTO, ExportError, export_config, no_tokenizer_message, resolve_source, staged,
                     tokenizer_folder)
from .onnx_fusion import (CONTRIB_DOMAIN, OPTIMIZED_FILE, activation_errors, fused_attention, optimize_graph,
                          split_outliers)
from .verify import VerifyFailed, VerifyReport, check_row
from ..formats.onnx import MANIFEST, ONNX_FILE, QUANTIZED_FILE
from ..pipelines.onnx_backend import (DYNAMIC_AXES, GRAPH_OUTPUTS, INSTALL_HINT, OnnxModel, OnnxModelError,
                                     check_signature, graph_inputs, open_session, read_folder_config)
from ..tokenizer import TOKENIZER_FILES, AutoTokenizer

log = logging.getLogger("hfport")

DEFAULT_OPSET = 17  # LayerNormalization is a single op from 17; every onnxruntime >= 1.14 runs it
QUANTIZE = ("int8",)
FP32_TOLERANCE = (1e-4, 1e-4)  # (atol, rtol); the module docstring says why
MIN_AGREEMENT = 0.99
# label and tag agreement count only the items on which fp32 decides: its two most probable labels at least this far
# apart in probability. On a near tie there is no answer to keep: int8's rounding (mean relative logit error ~0.03 on
# MiniLM) moves it either way, so one out-of-domain probe text a classifier scores 0.35 / 0.32 failed whole exports
# (a seed-7 MiniLM topic head: "She plays the violin beautifully."). A broken graph flips decided items and fails.
NEAR_TIE = 0.05
MIN_COSINE = 0.99
TOP_K = 5  # fill-mask: the candidates a user sees
# a MatMul stays fp32 in the int8 graph when per-tensor uint8 quantization of its input loses more than this
# fraction of the input's L2 norm on the probe texts (the module docstring has the measurements)
KEEP_FP32_ERROR = 0.065
# before that: an input channel of a weight MatMul whose largest |value| on the probe texts exceeds OUTLIER_RATIO
# times the median channel's (at most MAX_OUTLIERS per input, the largest) goes through a small fp32 MatMul beside
# the int8 one (onnx_fusion.split_outliers; the module docstring has the measurements)
OUTLIER_RATIO = 4.0
MAX_OUTLIERS = 8
PROBE_TEXTS = [
    "The film was wonderful.",
    "I would not recommend this restaurant to anyone; the service was slow and the food was cold.",
    "ok",
    "Marie Curie was born in Warsaw in 1867 and later moved to Paris, where she studied physics and chemistry.",
    "The committee will meet again next Tuesday to discuss the budget.",
    "What a terrible, awful, disappointing day!",
    "Shares of the company rose three percent after the quarterly report.",
    ("The old lighthouse keeper walked along the rocky shore every evening, watching the ships pass by and writing "
     "long letters to his sister in New York about the weather, the birds and the quiet life on the island."),
    "She plays the violin beautifully.",
    "Please send the invoice to the accounting department before Friday.",
]
PROBE_PAIRS = [
    ("Who wrote the novel?", "Herman Melville wrote Moby-Dick in 1851, a long time ago."),
    ("Where is Berlin?", "Berlin is the capital of Germany and lies on the river Spree."),
    ("When did the war end?", "The war ended in 1945, after six years of fighting across Europe and Asia."),
    ("What colour is the sky?", "On a clear day the sky is blue."),
    ("How many legs does a spider have?", "Spiders have eight legs, while insects have six."),
]
PROBE_MAX_LENGTH = 96


def require_onnx() -> tuple[Any, Any]:
    """(onnx, onnxruntime), or an ExportError saying how to install them."""
    try:
        import onnx
        import onnxruntime
    except ImportError as e:
        raise ExportError(f"ONNX export needs the onnx and onnxruntime packages ({e}); {INSTALL_HINT}") from e
    return onnx, onnxruntime


# --- export -------------------------------------------------------------------------------------------------


@dataclass
class OnnxExportResult:
    out: Path
    source: Path  # the model folder that was exported
    family: str
    task: str
    opset: int
    files: list[str]  # everything in OUT
    graphs: list[str]  # model.onnx (+ model_quantized.onnx)
    report: VerifyReport | None = None


class _Graph(nn.Module):
    """The task model with positional inputs and a tuple of named outputs: what the tracer records."""

    def __init__(self, model: PreTrainedEncoder, outputs: list[str]):
        super().__init__()
        self.model = model
        self.outputs = outputs

    def forward(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None):
        out = self.model(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        return tuple(out[name] for name in self.outputs)


def export_onnx(src: str | os.PathLike[str], out: str | os.PathLike[str], *, which: str = "best",
                opset: int = DEFAULT_OPSET, quantize: str | None = None, optimize: bool = False,
                per_channel: bool = True,
                force: bool = False, min_agreement: float = MIN_AGREEMENT, min_cosine: float = MIN_COSINE,
                json_path: str | os.PathLike[str] | None = None) -> OnnxExportResult:
    """Write SRC as an ONNX folder at OUT, verified against SRC before OUT appears (VerifyFailed if not)."""
    onnx, _ = require_onnx()
    if isinstance(opset, bool) or not isinstance(opset, int) or not 14 <= opset <= onnx.defs.onnx_opset_version():
        raise ExportError(f"opset {opset!r}: expected an integer from 14 (scaled dot-product attention) to "
                          f"{onnx.defs.onnx_opset_version()} (the newest this onnx package knows)")
    if quantize is not None and quantize not in QUANTIZE:
        raise ExportError(f"quantize {quantize!r}: expected one of {list(QUANTIZE)} or None")
    _check_thresholds(min_agreement, min_cosine)
    source = resolve_source(src, which)
    out = Path(out).expanduser()
    _check_out(source.model, out, force)

    model = load_any(source.model, dtype=torch.float32)
    report = model.load_report
    if report is not None and (report.initialized or report.nonfinite):
        raise ExportError(f"{source.model}: " + (f"lacks weights the model needs ({', '.join(report.initialized[:8])})"
                                                 if report.initialized else
                                                 f"NaN or inf values in {', '.join(report.nonfinite[:8])}")
                          + "; refusing to export it")
    architecture = model.family.architectures.get(model.task)
    if architecture is None:
        raise ExportError(f"{source.model}: the {model.family.model_type} family has no transformers class for the "
                          f"{model.task} head")
    tok_folder = _tokenizer_folder(source)

    with staged(out) as staging:
        _trace(model, tok_folder, staging / ONNX_FILE, opset)
        graphs = [ONNX_FILE]
        fused: dict[str, int] = {}
        if optimize or quantize is not None:  # the int8 graph is made from the fused one (onnx_fusion.py says why)
            traced = staging / f".traced-{OPTIMIZED_FILE}"
            _trace(model, tok_folder, traced, opset, fused=True)
            fused = optimize_graph(traced, staging / OPTIMIZED_FILE, model.config.num_attention_heads,
                                   model.config.hidden_size)
            traced.unlink()
            graphs.append(OPTIMIZED_FILE)
        if quantize is not None:
            probes = _probe_batches(tok_folder, model.task, model.config)
            kept_fp32, outliers = _quantize(staging / OPTIMIZED_FILE, staging / QUANTIZED_FILE, per_channel,
                                            [_feeds(enc, graph_inputs(model.config)) for enc in probes.values()])
            graphs.append(QUANTIZED_FILE)
        config = export_config(model, architecture, torch.float32)
        hub.write_json_atomic(staging / "config.json", config)
        for name in TOKENIZER_FILES:
            if (tok_folder / name).is_file():
                shutil.copyfile(tok_folder / name, staging / name)
        inputs = graph_inputs(model.config)
        hub.write_json_atomic(staging / MANIFEST, {
            "format": "onnx", "hfport_version": config["hfport_version"], "opset": opset,
            "exporter": f"torch.onnx TorchScript exporter (torch {torch.__version__})", "padded": True,
            "inputs": inputs, "outputs": list(GRAPH_OUTPUTS[model.task]), "source": str(source.model.resolve()),
            "optimized": {"file": OPTIMIZED_FILE, "fused": fused} if fused else None,
            "quantization": {"type": quantize, "weights": "QInt8", "per_channel": per_channel, "from": OPTIMIZED_FILE,
                             "outlier_channels": outliers,
                             "outlier_rule": f"input channels with probe |max| > {OUTLIER_RATIO:g} x the median "
                                             f"channel's (at most {MAX_OUTLIERS} per input) in a fp32 MatMul",
                             "kept_fp32": kept_fp32, "keep_rule": f"input activation error > {KEEP_FP32_ERROR}"}
            if quantize else None,
            "sha256": {name: _sha256(staging / name) for name in graphs}})
        result = OnnxExportResult(out, source.model, model.family.model_type, model.task, opset,
                                  sorted(p.name for p in staging.iterdir()), graphs)
        del model
        result.report = verify_onnx(staging, source.model, min_agreement=min_agreement, min_cosine=min_cosine,
                                    json_path=json_path, label=str(out))
        if not result.report.passed:
            raise VerifyFailed(f"{out}: the ONNX export does not match {source.model}; nothing was written\n"
                               + result.report.table(), result.report)
    return result


def _check_thresholds(min_agreement: float, min_cosine: float) -> None:
    for name, value in (("min_agreement", min_agreement), ("min_cosine", min_cosine)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
            raise ExportError(f"{name} {value!r}: expected a fraction in (0, 1], e.g. 0.99")


def _check_out(model: Path, out: Path, force: bool) -> None:
    model_r, out_r = model.resolve(), out.resolve()
    if out_r == model_r or model_r in out_r.parents or out_r in model_r.parents:
        raise ExportError(f"--out {out} overlaps the source {model}; choose a folder outside it")
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out}: exists and is not a folder")
    if out.exists() and not force:
        raise ExportError(f"{out}: already exists; pass --force (force=True) to replace it")


def _tokenizer_folder(source: Any) -> Path:
    """The model folder, a fine-tune run's final/ or best/, or the run's base model: whichever has tokenizer files."""
    folder = tokenizer_folder(source)
    if folder is None:
        raise ExportError(no_tokenizer_message(source) + "; the ONNX folder needs them to be verified and served")
    return folder


@torch.no_grad()
def _trace(model: PreTrainedEncoder, tok_folder: Path, path: Path, opset: int, fused: bool = False) -> None:
    """Trace the padded path on a padded two-row batch of real text into `path`; fused: attention as onnxruntime's
    MultiHeadAttention where it can be (onnx_fusion.py)."""
    tokenizer = AutoTokenizer.from_pretrained(tok_folder)
    inputs = graph_inputs(model.config)
    enc = tokenizer([PROBE_TEXTS[1], PROBE_TEXTS[0]], padding=True, truncation=True,
                    max_length=_max_length(model.config.max_position_embeddings), return_tensors="pt")
    args = [enc["input_ids"], enc["attention_mask"]]
    if "token_type_ids" in inputs:
        args.append(enc.get("token_type_ids", torch.zeros_like(enc["input_ids"])))
    if bool(enc["attention_mask"].all()):  # the tracer keeps the branch it sees: it must see padding
        raise ExportError(f"{tok_folder}: the tokenizer did not pad the trace batch; cannot trace the masked path")
    outputs = list(GRAPH_OUTPUTS[model.task])
    axes = dict(enumerate(DYNAMIC_AXES))
    dynamic = {name: axes for name in inputs} | {
        name: {i: axes[i] for i in range(min(GRAPH_OUTPUTS[model.task][name][0], 2))} for name in outputs}
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
        with warnings.catch_warnings(), (fused_attention(model) if fused else nullcontext()):
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
        side, outliers = split_outliers(src, split, probes, OUTLIER_RATIO, MAX_OUTLIERS)
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


def _feeds(enc: dict[str, Tensor], inputs: list[str]) -> dict[str, Any]:
    """A probe batch as onnxruntime feeds for a graph with these inputs."""
    return {name: (enc[name] if name in enc else torch.zeros_like(enc["input_ids"])).numpy() for name in inputs}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _max_length(max_positions: int) -> int:
    return min(PROBE_MAX_LENGTH, max_positions - 2)  # room for RoBERTa's position offset


# --- verify -------------------------------------------------------------------------------------------------


def verify_onnx(dir: str | os.PathLike[str], source: str | os.PathLike[str] | None = None, *, which: str = "best",
                atol: float | None = None, rtol: float | None = None, min_agreement: float = MIN_AGREEMENT,
                min_cosine: float = MIN_COSINE, json_path: str | os.PathLike[str] | None = None,
                label: str | None = None) -> VerifyReport:
    """Check the ONNX folder DIR against SOURCE (default: the source its hfport_onnx.json records). Never raises
    for a failed check: the report says FAIL and names what failed. json_path: also write the report there."""
    folder = Path(dir).expanduser()
    report = VerifyReport(label or str(folder), str(source) if source is not None else "", dtype="float32")
    report.atol, report.rtol = (FP32_TOLERANCE[0] if atol is None else atol,
                                FP32_TOLERANCE[1] if rtol is None else rtol)
    try:
        with check_row(report, "verify", "run"):
            _check_thresholds(min_agreement, min_cosine)
            require_onnx()
            _verify(folder, source, which, min_agreement, min_cosine, report)
    finally:
        if json_path is not None:
            report.write_json(json_path)
    return report


def _verify(folder: Path, source_arg: Any, which: str, min_agreement: float, min_cosine: float,
            report: VerifyReport) -> None:
    if not folder.is_dir():
        raise ExportError(f"{folder}: no such folder")
    ctx: dict[str, Any] = {}
    with check_row(report, "config", "config.json"):
        raw, family, config, task = read_folder_config(folder)
        ctx.update(raw=raw, config=config, task=task)
        report.add("config", "config.json", True, detail=f"{family.model_type} {task}")
    if not ctx:
        return
    task = ctx["task"]
    manifest = None
    if (folder / MANIFEST).is_file():
        with check_row(report, "files", MANIFEST):
            manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
            if not isinstance(manifest, dict):
                raise ExportError(f"{folder / MANIFEST}: the top level must be a JSON object")

    graphs: dict[str, OnnxModel] = {}
    for name in (ONNX_FILE, OPTIMIZED_FILE, QUANTIZED_FILE):
        if name != ONNX_FILE and not (folder / name).is_file():
            continue
        with check_row(report, "graph", name):
            graphs[name] = _check_graph(report, folder / name, ctx["config"], task)
        if manifest is not None:
            with check_row(report, "files", name):
                want = (manifest.get("sha256") or {}).get(name)
                have = _sha256(folder / name)
                report.add("files", name, have == want, tolerance="sha256 as recorded at export",
                           detail="" if have == want else f"sha256 {have[:16]}... differs from the recorded "
                                                          f"{str(want)[:16]}...: the graph changed after export")
    if ONNX_FILE not in graphs:
        return

    with check_row(report, "source", str(source_arg or "")):
        if source_arg is None:
            recorded = (manifest or {}).get("source")
            if not recorded:
                raise ExportError(f"{folder}: no --source given and no source recorded in {MANIFEST}; give "
                                  "--source (the folder it was exported from)")
            source_arg = recorded
        src = resolve_source(source_arg, which)
        ours = load_any(src.model, dtype=torch.float32)
        if ours.task != task:
            raise ExportError(f"{src.model} holds a {ours.task} model; {folder} holds a {task} graph")
        report.source = str(src.model)
        ctx.update(ours=ours, source=src.model)
    batches: dict[str, dict[str, Tensor]] = {}
    with check_row(report, "tokenizer", "probes"):
        batches = _probe_batches(folder, task, ctx["config"])
        report.add("tokenizer", "probes", True, shape=f"{len(batches)} batches",
                   detail=", ".join(f"{k} {tuple(v['input_ids'].shape)}" for k, v in batches.items()))
    if not batches:
        return
    fp32 = graphs[ONNX_FILE]
    onnx_out = {name: _run(fp32, enc, task) for name, enc in batches.items()}
    tol = f"atol={report.atol:g} rtol={report.rtol:g}"

    if "ours" in ctx:
        # each fp32 graph: the portable one, and the onnxruntime-fused one when there is one
        outs = {"fp32": onnx_out} | ({"fp32 optimized": {name: _run(graphs[OPTIMIZED_FILE], enc, task)
                                                          for name, enc in batches.items()}}
                                     if OPTIMIZED_FILE in graphs else {})
        refs = {name: _run(ctx["ours"], enc, task) for name, enc in batches.items()}
        for label, got in outs.items():
            _compare_all(report, f"{label} vs hfport", got, refs, batches, task, tol)
        with check_row(report, "fp32 vs transformers", "load"):
            theirs = _load_transformers(ctx["source"], task)
            if theirs is not None:
                refs = {name: _run(theirs, enc, task) for name, enc in batches.items()}
                for label, got in outs.items():
                    _compare_all(report, f"{label} vs transformers", got, refs, batches, task, tol)

    if QUANTIZED_FILE in graphs:
        agree, threshold, what = AGREEMENT[task]
        for name, enc in batches.items():
            with check_row(report, "int8 vs fp32", f"{name}/{what}"):
                value, n, ties = agree(_run(graphs[QUANTIZED_FILE], enc, task), onnx_out[name], enc, ctx["config"])
                bound = min_cosine if threshold == "cosine" else min_agreement
                items = f"{n} items" + (f" ({ties} fp32 near tie{'s' * (ties > 1)} left out)" if ties else "")
                report.add("int8 vs fp32", f"{name}/{what} {value:.4f}", value >= bound, shape=items,
                           diff=1.0 - value, tolerance=f"{threshold} >= {bound:g}",
                           detail=f"{what} {value:.4f} over {items} is below {bound:g}: the int8 graph changes "
                                  "the model's answers")


def _check_graph(report: VerifyReport, path: Path, config: Any, task: str) -> OnnxModel:
    """Loads in onnxruntime with the signature config.json implies, and dynamic batch and sequence axes."""
    session = open_session(path)
    check_signature(session, config, task, path)
    static = [f"{i.name} {i.shape}" for i in session.get_inputs()
              if len(i.shape) != 2 or any(isinstance(d, int) for d in i.shape)]
    if static:
        raise OnnxModelError(f"{path}: inputs with fixed axes ({'; '.join(static)}); the graph must take any batch "
                             "size and sequence length")
    report.add("graph", path.name, True, shape=f"{len(session.get_inputs())} inputs",
               tolerance="loads; inputs/outputs as config.json; dynamic axes")
    _, family, cfg, _ = read_folder_config(path.parent)
    return OnnxModel(path, session, cfg, family, task)


def _probe_batches(folder: Path, task: str, config: Any) -> dict[str, dict[str, Tensor]]:
    """The probe texts through DIR's tokenizer as padded batches (pairs for QA and two-segment models)."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    kwargs = {"padding": True, "truncation": True, "max_length": _max_length(config.max_position_embeddings),
              "return_tensors": "pt"}
    record = TASKS[task]
    probes: dict[str, tuple[Any, ...]] = {}
    if not record.pair_input:
        probes["texts"] = (PROBE_TEXTS,)
    if record.pair_input or "token_type_ids" in tokenizer.model_input_names:
        probes["pairs"] = ([q for q, _ in PROBE_PAIRS], [c for _, c in PROBE_PAIRS])
    out = {}
    for name, args in probes.items():
        enc = tokenizer(*args, **kwargs)
        batch = {k: enc[k] for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc}
        if record.masked_input:  # one word masked in each row, where a user of fill-mask puts it
            if tokenizer.mask_token_id is None:
                raise ExportError(f"{folder}: the tokenizer has no mask token; fill-mask cannot be probed")
            ids = batch["input_ids"].clone()
            lengths = batch["attention_mask"].sum(1)  # (B,)
            for row, n in enumerate(lengths.tolist()):
                ids[row, max(1, n // 2)] = tokenizer.mask_token_id  # a real token, never [CLS]
            batch["input_ids"] = ids
            batch["masked"] = ids.eq(tokenizer.mask_token_id)
        out[name] = batch
    return out


@torch.inference_mode()
def _run(model: Any, enc: dict[str, Tensor], task: str) -> dict[str, Tensor]:
    """The task's graph outputs from an ONNX, hfport or transformers model on one probe batch."""
    out = model(enc["input_ids"], attention_mask=enc["attention_mask"], token_type_ids=enc.get("token_type_ids"))
    return {name: out[name].float() for name in GRAPH_OUTPUTS[task]}


def _compare_all(report: VerifyReport, check: str, got: dict[str, dict[str, Tensor]],
                 refs: dict[str, dict[str, Tensor]], batches: dict[str, dict[str, Tensor]], task: str,
                 tol: str) -> None:
    for batch, outputs in got.items():
        for name, rank_field in GRAPH_OUTPUTS[task].items():
            with check_row(report, check, f"{batch}/{name}"):
                a, b = outputs[name], refs[batch].get(name)
                if b is None or a.shape != b.shape:
                    raise ExportError(f"shape {list(a.shape)} vs reference {None if b is None else list(b.shape)}")
                shape = tuple(a.shape)
                if rank_field[0] == 3 or name in ("start_logits", "end_logits"):  # per token: real positions only
                    real = batches[batch]["attention_mask"].bool()
                    a, b = a[real], b[real]
                diff = (a - b).abs().max().item() if a.numel() else 0.0
                ok = bool(torch.isclose(a, b, atol=report.atol, rtol=report.rtol).all()) and diff == diff
                report.add(check, f"{batch}/{name}", ok, shape=shape, diff=diff, tolerance=tol,
                           detail=f"the graph's {name} differs from the reference (max abs diff {diff:.3g} at real "
                                  "positions)")


def _load_transformers(folder: Path, task: str) -> Any:
    """transformers' model from the source folder, or None when transformers is not installed."""
    try:
        import transformers
        from transformers.utils import logging as tlog
    except ImportError:
        log.info("transformers is not installed: the fp32 graph is checked against hfport only")
        return None
    verbosity = tlog.get_verbosity()
    tlog.set_verbosity_error()
    try:
        auto = getattr(transformers, TRANSFORMERS_AUTO[task])
        model, info = auto.from_pretrained(str(folder), output_loading_info=True, dtype=torch.float32,
                                           trust_remote_code=False)
    finally:
        tlog.set_verbosity(verbosity)
    missing = sorted(map(str, info.get("missing_keys") or []))
    if missing:
        raise ExportError(f"transformers initialised weights the source lacks ({', '.join(missing[:5])}): no "
                          "reference")
    return model.eval()


# --- int8 agreement, by task: (int8 outputs, fp32 outputs, batch, config) -> (agreement, items) ----------------


def fp32_decides(b: Tensor) -> Tensor:
    """Where fp32 (logits b, (..., L)) makes a decision: its two most probable labels at least NEAR_TIE apart in
    softmax probability. (..., L) -> (...,) bool."""
    top = b.softmax(-1).topk(2, dim=-1).values  # (..., 2)
    return top[..., 0] - top[..., 1] >= NEAR_TIE


def _agreement(same: Tensor, decisive: Tensor) -> tuple[float, int, int]:
    """(agreement over the decisive items, their number, the near ties left out). When fp32 decides none, all count:
    a graph is never passed for want of items."""
    if not decisive.any():
        decisive = torch.ones_like(decisive)
    return same[decisive].float().mean().item(), int(decisive.sum()), int((~decisive).sum())


def _labels(q: dict[str, Tensor], f: dict[str, Tensor], enc: dict[str, Tensor],
            config: Any) -> tuple[float, int, int]:
    """The predicted label per text: argmax, or each label's logit > 0 where labels are independent (multi-label,
    one output); texts on which fp32 is a near tie are left out (NEAR_TIE says why)."""
    a, b = q["logits"], f["logits"]  # (B, L)
    if config.problem_type == "multi_label_classification" or config.num_labels == 1:
        decisive = (torch.sigmoid(b) - 0.5).abs() >= NEAR_TIE / 2  # (B, L) per label
        same = (((a > 0) == (b > 0)) | ~decisive).all(dim=1)  # the decided labels all agree
        return _agreement(same, decisive.any(dim=1))
    return _agreement(a.argmax(-1) == b.argmax(-1), fp32_decides(b))


def _tags(q: dict[str, Tensor], f: dict[str, Tensor], enc: dict[str, Tensor], config: Any) -> tuple[float, int, int]:
    real = enc["attention_mask"].bool()  # (B, T)
    a, b = q["logits"][real], f["logits"][real]  # (N, L)
    return _agreement(a.argmax(-1) == b.argmax(-1), fp32_decides(b))


def _spans(q: dict[str, Tensor], f: dict[str, Tensor], enc: dict[str, Tensor], config: Any) -> tuple[float, int, int]:
    real = enc["attention_mask"].bool()  # (B, T)

    def best(x: Tensor) -> Tensor:
        return x.masked_fill(~real, float("-inf")).argmax(-1)  # (B,)

    same = (best(q["start_logits"]) == best(f["start_logits"])) & (best(q["end_logits"]) == best(f["end_logits"]))
    return same.float().mean().item(), len(same), 0


def _top_k(q: dict[str, Tensor], f: dict[str, Tensor], enc: dict[str, Tensor], config: Any) -> tuple[float, int, int]:
    masked = enc["masked"]  # (B, T)
    k = min(TOP_K, q["logits"].shape[-1])
    a, b = q["logits"][masked].topk(k).indices, f["logits"][masked].topk(k).indices  # (M, k)
    overlap = [len(set(x.tolist()) & set(y.tolist())) / k for x, y in zip(a, b)]
    return sum(overlap) / len(overlap), len(overlap), 0


def _cosine(q: dict[str, Tensor], f: dict[str, Tensor], enc: dict[str, Tensor], config: Any) -> tuple[float, int, int]:
    mask = enc["attention_mask"][..., None].float()  # (B, T, 1)

    def pooled(x: Tensor) -> Tensor:
        return (x * mask).sum(1) / mask.sum(1).clamp(min=1e-9)  # (B, C): sentence-transformers' mean pooling

    cos = torch.nn.functional.cosine_similarity(pooled(q["last_hidden_state"]), pooled(f["last_hidden_state"]), dim=-1)
    return cos.mean().item(), len(cos), 0  # (B,) -> the mean, as agreement is a mean


# task -> (measure: (value, items counted, fp32 near ties left out), which threshold applies, its name in the report)
AGREEMENT: dict[str, tuple[Callable[..., tuple[float, int, int]], str, str]] = {
    "text-classification": (_labels, "agreement", "label agreement"),
    "token-classification": (_tags, "agreement", "tag agreement"),
    "question-answering": (_spans, "agreement", "span agreement"),
    "fill-mask": (_top_k, "agreement", f"top-{TOP_K} overlap"),
    "feature-extraction": (_cosine, "cosine", "mean cosine"),
}
assert set(AGREEMENT) == set(GRAPH_OUTPUTS)
