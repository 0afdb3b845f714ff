"""dtype="int8" (and "auto-int8"): an fp32 model's encoder Linear layers quantized at load, held to the int8 gate.

`quantize_loaded(model, folder)` (modeling's INT8_LOADER, installed on import):
  1. calibration: the fp32 model runs the calibration texts (hfport/probes.py) and records each encoder Linear's
     per-input-channel |max|; channels that dwarf the median (nn/int8.py: OUTLIER_RATIO, at most MAX_OUTLIERS a
     layer) stay fp32 beside the int8 product;
  2. every nn.Linear under the body's encoder becomes an Int8Linear (nn/int8.py: weights per output channel,
     activations per tensor through oneDNN's fused int8 Linear, at the uint8 scale calibrated in step 1 ("static",
     where the layer's range is stable over the calibration batches; else each call's own range) or each call's
     own ("tensor"), or per token through torch._int_mm),
     keeping its float weight for calls of fewer than `min_rows` rows (default 128, nn/int8.py: FLOAT_BELOW_ROWS),
     where int8's fixed costs make it slower than the float layer (nn/int8.py's docstring has the numbers; 0: int8
     always).
     Embeddings, norms, attention's softmax and products, the pooler and the task heads stay float: bf16 where the
     CPU's bf16 is native (what dtype="auto" picks: hfport/hardware.py), else fp32 (`float_dtype`). The int8 kernel
     writes its output in that dtype (the cast fused), so a bf16 body passes bf16 from layer to layer; outputs
     reach pipeline users in fp32, as dtype="auto"'s do. Measured on the real MiniLM, one forward pass over 128
     short texts (2373 tokens; one thread, CPU time, a loaded 2-core EPYC): int8 with fp32 float parts 358 ms,
     with bf16 ones 268 ms, the bf16 model 345 ms; embedding least cosine against fp32 over 800 held-out
     sentences 0.9960 with fp32 float parts, 0.9966 with bf16 ones (over the gate's 64 judged texts 0.9918 and
     0.9902; bf16 alone 0.9999);
  3. the gate (hfport/agreement.py, the ONNX export's rules and thresholds): int8 against fp32 on the built-in
     judged texts and pairs (never the calibration ones), short and long ones up to the model's max length (at most
     GATE_MAX_LENGTH tokens; hfport/probes.py says why), and on the user's `gate_data` cut only at the model's max
     length, each set by itself, by the task's agreement kind, int8 at every call size (quantized with no float
     weight kept; the float weights for calls of few rows are kept once int8 passed). Each activation granularity
     this torch has is tried in turn, fastest first (`granularities`); the first that passes is kept. None passing:
     an Int8GateError saying by how much, or with "auto-int8" the float layers back and the model in bf16 (logged,
     and noted in the load report).
The gate's verdicts are kept on the model as `model.int8_gate` (a list of GateResult), and on disk
(hfport/int8_verdicts.py: under the setting cache_dir, keyed by the weights, the task, the judged sets, the rules,
hfport's and torch's versions and the CPU), with the passing calibration: a later int8 load of the very same model
skips steps 1 and 3 ("int8 gate: verdict reused from <path>" in the log and the load report), once the kept
statistic on the spot batch (the first GATE_CHUNK built-in judged texts) is found again.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from . import int8_verdicts, modeling
from .agreement import MIN_AGREEMENT, MIN_COSINE, Gate, GateContext, gate_for, items, passes, verdict
from .errors import ConfigError, ExportError
from .formats.sentence_transformers import has_embedding_layout, read_layout
from .hardware import auto_dtype
from .int8_verdicts import GateResult, KeptVerdict
from .modeling import PreTrainedEncoder
from .nn.int8 import ACTIVATIONS, FLOAT_BELOW_ROWS, InputPeaks, Int8Linear, LayerPlan, body_linears, \
    onednn_int8_available, plan_layers, quantize_linears, swap_linears
from .probes import CALIBRATION_PAIRS, CALIBRATION_TEXTS, GATE_CHUNK, PROBE_MAX_LENGTH, GateData, encode, \
    gate_batches, judged_pairs, judged_texts, read_gate_data
from .tasks import TASKS
from .tokenizer import AutoTokenizer, has_tokenizer_files

log = logging.getLogger("hfport")
FALLBACK_DTYPE = torch.bfloat16  # what "auto-int8" runs in when the gate refuses int8


class Int8GateError(ExportError):
    """The int8 model moved the fp32 answers past the gate's threshold (the message says which and by how much)."""


def _max_length(config: Any) -> int:
    """The calibration batches' cut (their texts are short)."""
    return min(PROBE_MAX_LENGTH, config.max_position_embeddings - 2)  # room for RoBERTa's position offset


@torch.inference_mode()
def _outputs(model: PreTrainedEncoder, enc: dict[str, Tensor], task: str) -> dict[str, Tensor]:
    """The task's judged outputs (the record's graph outputs) on one batch, in fp32."""
    out = model(enc["input_ids"], attention_mask=enc["attention_mask"], token_type_ids=enc.get("token_type_ids"))
    return {name: out[name].float() for name in TASKS[task].graph_outputs}


def _calibrate(model: PreTrainedEncoder, folder: Path) -> InputPeaks:
    """Each encoder Linear's per-input-channel |max| over the calibration texts and pairs, and each batch's
    per-channel range, by name (nn/int8.py: InputPeaks)."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    batches = encode(tokenizer, model.task, model.config, CALIBRATION_TEXTS, CALIBRATION_PAIRS,
                     _max_length(model.config))
    with InputPeaks(body_linears(model.body.encoder)) as peaks:
        for enc in batches.values():
            _outputs(model, enc, model.task)
    return peaks


def _pooling(folder: Path) -> str:
    return read_layout(folder).pooling if has_embedding_layout(folder) else "mean"


Batches = dict[str, list[dict[str, Tensor]]]  # "<origin>/<kind>" -> the judged batches
Reference = dict[str, list[Tensor]]  # the same keys -> fp32's judged items per batch


def _batches(model: PreTrainedEncoder, folder: Path, datasets: list[GateData]) -> Batches:
    """Every data set as the gate's batches (hfport/probes.py: gate_batches), tokenized once."""
    return {f"{data.origin}/{kind}": encs for data in datasets
            for kind, encs in gate_batches(folder, model.task, model.config, data).items()}


def _gate(model: PreTrainedEncoder, folder: Path) -> tuple[Gate, GateContext]:
    return gate_for(TASKS[model.task].agreement, model.config), GateContext(model.config, _pooling(folder))


def _reference(model: PreTrainedEncoder, folder: Path, batches: Batches) -> Reference:
    """fp32's judged items on every batch: only the items are kept (fill-mask's logits are (rows, T, vocab))."""
    gate, ctx = _gate(model, folder)
    return {key: [items(gate, _outputs(model, enc, model.task), enc, ctx, reference=True) for enc in encs]
            for key, encs in batches.items()}


def _tokens(encs: list[dict[str, Tensor]]) -> tuple[int, int]:
    lengths = torch.cat([enc["attention_mask"].sum(1) for enc in encs])  # (rows,)
    return int(lengths.min()), int(lengths.max())


def _judge(model: PreTrainedEncoder, folder: Path, batches: Batches, reference: Reference) -> list[GateResult]:
    """The gate's verdict per data set and kind: MODEL's outputs (int8) against REFERENCE (fp32, same keys)."""
    gate, ctx = _gate(model, folder)
    bound = MIN_COSINE if gate.threshold == "cosine" else MIN_AGREEMENT
    results = []
    for key, encs in batches.items():
        chunks = [(items(gate, _outputs(model, enc, model.task), enc, ctx), f) for enc, f in zip(encs, reference[key])]
        judged = verdict(gate, chunks, ctx)
        ok, tolerance = passes(gate, judged, MIN_AGREEMENT, MIN_COSINE)
        origin, _, kind = key.rpartition("/")
        results.append(GateResult(origin, kind, tolerance, judged.value, judged.items, bound, ok, _tokens(encs)))
    return results


def _check_loadable(model: PreTrainedEncoder, folder: Path) -> None:
    if TASKS[model.task].agreement is None:
        raise ConfigError(f"{folder}: dtype 'int8' has no gate for a {model.task} head (its task record names no "
                          "agreement kind); load it with dtype='bfloat16' or 'auto'")
    if model.device.type != "cpu":
        raise ConfigError(f"{folder}: dtype 'int8' runs on the CPU's int8 instructions; got device {model.device}")
    if not has_tokenizer_files(folder):
        raise ConfigError(f"{folder}: dtype 'int8' calibrates and judges on texts and needs the folder's tokenizer "
                          "files")


def granularities() -> tuple[str, ...]:
    """The activation granularities int8 can run here, fastest first (nn/int8.py: ACTIVATIONS)."""
    return tuple(a for a in ACTIVATIONS if a == "token" or onednn_int8_available())


def float_dtype(model: PreTrainedEncoder) -> torch.dtype:
    """The dtype of an int8 model's float parts: bf16 where dtype="auto" would run an fp32 checkpoint in bf16 (the
    CPU's measured bf16 matmul is native: hfport/hardware.py), else fp32."""
    return auto_dtype(torch.float32, model.device)


def quantize(model: PreTrainedEncoder, folder: str | os.PathLike[str], activations: str | None = None,
             peaks: dict[str, Tensor] | InputPeaks | None = None, dtype: torch.dtype | None = None,
             min_rows: int = FLOAT_BELOW_ROWS, plan: dict[str, LayerPlan] | None = None) -> dict[int, Any]:
    """Steps 1-2 of the module docstring without the gate: MODEL's encoder Linear layers in int8 with ACTIVATIONS'
    granularity (default: the fastest here), calibrated on the calibration texts through FOLDER's tokenizer (or
    PEAKS, a calibration already made: an InputPeaks, or its peaks alone, with which "static" layers run "tensor"
    for want of ranges; or PLAN, what a calibration decided per layer: nn/int8.py's plan_layers), each keeping its
    float weight for calls of fewer than MIN_ROWS rows (0: none), then its float parts cast to DTYPE (default
    `float_dtype`). -> {id(Int8Linear): the nn.Linear it replaced, untouched fp32}. For benchmarks
    (scripts/bench.py) and experiments, not for serving."""
    activations = activations or granularities()[0]
    if plan is None:
        peaks = peaks if peaks is not None else _calibrate(model, Path(folder))
        ranges = peaks.ranges if isinstance(peaks, InputPeaks) else None
        peaks = peaks.peaks if isinstance(peaks, InputPeaks) else peaks
        plan = plan_layers(body_linears(model.body.encoder), peaks, activations, ranges)
    originals = quantize_linears(model.body.encoder, activations=activations, float_below_rows=min_rows, plan=plan)
    model.to(dtype or float_dtype(model))  # the Int8Linears keep their int8 weights and fp32 scales
    return originals


def keep_float(model: PreTrainedEncoder, originals: dict[int, Any], min_rows: int) -> None:
    """Each Int8Linear of MODEL runs calls of fewer than MIN_ROWS rows on the weight of the float layer it replaced
    (ORIGINALS, from `quantize`), in the model's float dtype (nn/int8.py: Int8Linear.keep_float)."""
    for module in model.body.encoder.modules():
        if isinstance(module, Int8Linear):
            module.keep_float(originals[id(module)].weight, min_rows)


class _Spot:
    """The gate's statistic on its spot batch, the first GATE_CHUNK built-in judged texts (pairs for a task on pairs):
    fp32's items taken at construction, int8's by `value`. A kept verdict is used only where its spot statistic is
    found again (hfport/int8_verdicts.py)."""

    def __init__(self, model: PreTrainedEncoder, folder: Path):
        self.task, (self.gate, self.ctx) = model.task, _gate(model, folder)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        batches = encode(tokenizer, model.task, model.config, judged_texts()[:GATE_CHUNK], judged_pairs()[:GATE_CHUNK],
                         _max_length(model.config))
        self.enc = next(iter(batches.values()))
        self.reference = items(self.gate, _outputs(model, self.enc, self.task), self.enc, self.ctx, reference=True)

    def value(self, model: PreTrainedEncoder) -> float:
        int8 = items(self.gate, _outputs(model, self.enc, self.task), self.enc, self.ctx)
        return verdict(self.gate, [(int8, self.reference)], self.ctx).value


# a kept verdict's spot statistic, found again: the same int8 on the same rows (only the float parts' summation order
# may differ, with the thread count: ~1e-6 of a cosine), where a damaged calibration moves it by far more
SPOT_TOLERANCE = 1e-3


def quantize_loaded(model: PreTrainedEncoder, folder: str | os.PathLike[str], *, fallback: bool = False,
                    gate_data: str | os.PathLike[str] | None = None,
                    min_rows: int = FLOAT_BELOW_ROWS) -> PreTrainedEncoder:
    """MODEL (fp32, just loaded from FOLDER) with its encoder's Linear layers in int8, if the gate passes; else an
    Int8GateError, or with FALLBACK the model in bf16. Calls of fewer than MIN_ROWS rows run the float weights (0:
    int8 always). The module docstring has the steps; a verdict kept for this very model and gate is reused
    (hfport/int8_verdicts.py)."""
    if isinstance(min_rows, bool) or not isinstance(min_rows, int) or min_rows < 0:
        raise ValueError(f"int8 min_rows: expected a row count >= 0 (0: int8 for every call), got {min_rows!r}")
    folder = Path(folder)
    try:
        _check_loadable(model, folder)
    except ConfigError as e:
        if not fallback:
            raise
        return _fallback(model, folder, f"int8 cannot load here: {e}")
    datasets = [GateData.builtin()] + ([read_gate_data(gate_data)] if gate_data is not None else [])
    key = int8_verdicts.key(model, folder, datasets, _pooling(folder), granularities(), float_dtype(model))
    spot = _Spot(model, folder)
    kept = int8_verdicts.read(key, body_linears(model.body.encoder))
    if kept is not None and (reused := _reuse(model, folder, kept, spot, min_rows, fallback)) is not None:
        return reused
    batches = _batches(model, folder, datasets)
    reference = _reference(model, folder, batches)  # fp32
    peaks = _calibrate(model, folder)
    refused = []
    for activations in granularities():
        plan = plan_layers(body_linears(model.body.encoder), peaks.peaks, activations, peaks.ranges)
        originals = quantize(model, folder, activations, plan=plan, min_rows=0)  # judged int8 at every call size
        results = _judge(model, folder, batches, reference)
        model.int8_gate = results
        if all(r.passed for r in results):
            int8_verdicts.write(key, KeptVerdict(activations, results, refused, plan, spot.value(model)))
            return _passed(model, folder, originals, activations, min_rows, "")
        swap_linears(model.body.encoder, originals)  # the float layers back, for the next try or the fallback
        refused.append(f"{_activations_line(None, activations)}: " + "; ".join(
            f"{r.line()} ({r.value - r.bound:+.4f} against the bound {r.bound:g})" for r in results if not r.passed))
        log.info("%s: int8 with %s", folder, refused[-1])
    int8_verdicts.write(key, KeptVerdict(None, results, refused))
    return _refused(model, folder, refused, fallback)


def _passed(model: PreTrainedEncoder, folder: Path, originals: dict[int, Any], activations: str, min_rows: int,
            reused: str) -> PreTrainedEncoder:
    """The end of a load whose int8 passed its gate (REUSED: where its kept verdict came from, else "")."""
    keep_float(model, originals, min_rows)  # from here on, calls of few rows run the float weights
    how, report = _activations_line(model, activations), "; ".join(r.line() for r in model.int8_gate)
    log.info("%s: int8 (%d Linear layers, %s) passed its gate: %s%s", folder, len(originals), how, report, reused)
    model.load_report.notes.append(f"int8: {len(originals)} encoder Linear layers, {how}, float parts in "
                                   f"{str(model.dtype).removeprefix('torch.')}; gate passed: {report}{reused}")
    return model


def _refused(model: PreTrainedEncoder, folder: Path, refused: list[str], fallback: bool,
             reused: str = "") -> PreTrainedEncoder:
    """The end of a load whose int8 every granularity's gate refused: an Int8GateError, or with FALLBACK bf16."""
    failed = " | ".join(refused)
    if not fallback:
        raise Int8GateError(f"{folder}: int8 refused by its gate: {failed}{reused}. Load with dtype='auto-int8' to "
                            "fall back to bf16, or 'bfloat16' / 'float32'")
    return _fallback(model, folder, f"the int8 gate refused: {failed}{reused}")


def _tensors(model: PreTrainedEncoder) -> list[tuple[torch.nn.Module, str, Tensor, bool]]:
    """Every parameter's and buffer's tensor of MODEL as it is now: a cast (model.to) replaces them, these stay."""
    return [(m, name, t.data if is_param else t, is_param) for m in model.modules()
            for is_param, named in ((True, m.named_parameters(recurse=False)), (False, m.named_buffers(recurse=False)))
            for name, t in named]


def _restore(tensors: list[tuple[torch.nn.Module, str, Tensor, bool]]) -> None:
    for module, name, t, is_param in tensors:
        if is_param:
            getattr(module, name).data = t
        else:
            setattr(module, name, t)


def _reuse(model: PreTrainedEncoder, folder: Path, kept: KeptVerdict, spot: _Spot, min_rows: int,
           fallback: bool) -> PreTrainedEncoder | None:
    """MODEL as the verdict KEPT for it says, without judging: a refusal as it is; a pass quantized with its kept
    calibration, where its spot statistic is found again. None (the model untouched, fp32): judge it again."""
    reused = f" (verdict reused from {kept.path})"
    if kept.activations is None:
        log.info("int8 gate: verdict reused from %s", kept.path)
        model.int8_gate = kept.results
        return _refused(model, folder, kept.refused, fallback, reused)
    fp32 = _tensors(model)
    originals = quantize(model, folder, kept.activations, plan=kept.plan, min_rows=0)
    value = spot.value(model)
    if abs(value - kept.spot) > SPOT_TOLERANCE:
        log.warning("int8 gate: %s ignored (its %s on the spot batch is %.4f here, %.4f kept); the gate runs and "
                    "rewrites it", kept.path, spot.gate.name, value, kept.spot)
        swap_linears(model.body.encoder, originals)
        _restore(fp32)
        return None
    log.info("int8 gate: verdict reused from %s", kept.path)
    model.int8_gate = kept.results
    return _passed(model, folder, originals, kept.activations, min_rows, reused)


def _activations_line(model: PreTrainedEncoder | None, activations: str) -> str:
    """How ACTIVATIONS quantizes, for logs and notes: "static" names how many of MODEL's layers got a calibrated
    scale (the others, unstable, run "tensor")."""
    if activations != "static":
        return f"activations per {activations}"
    if model is None:
        return "activations at static scales"
    kinds = [m.activations for m in model.body.encoder.modules() if isinstance(m, Int8Linear)]
    return f"activations at static scales ({kinds.count('static')} of {len(kinds)} layers; the rest per tensor)"


def _fallback(model: PreTrainedEncoder, folder: Path, why: str) -> PreTrainedEncoder:
    """auto-int8's answer where int8 is refused: the float model in bf16, the reason logged and noted."""
    log.warning("%s: auto-int8 chose bf16: %s", folder, why)
    model.load_report.notes.append(f"auto-int8 chose bf16: {why}")
    return model.to(FALLBACK_DTYPE)


modeling.INT8_LOADER = quantize_loaded  # every from_pretrained(dtype="int8") loads through it
