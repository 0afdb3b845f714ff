"""`verify(dir, source)` is the proof that an export computes what hfport computes, and fails closed: every check
that cannot run counts as a failure.
    load       transformers' AutoModelFor<head> loads DIR (never trust_remote_code) with no missing, unexpected or
               mismatched keys, as the class config.json names;
    labels     DIR's id2label / label2id / num_labels equal the source model's;
    weights    every tensor in DIR equals the source's tensor rounded to DIR's dtype, bit for bit;
    tokenizer  the exported tokenizer gives the same ids, masks and token types in transformers and in hfport;
    outputs    hfport's model from SOURCE and transformers' model from DIR run the same probe batches (texts of
               different lengths with padding; question/context pairs where the tokenizer returns token types or
               the head is QA); every output is compared at atol/rtol: logits, start/end logits,
               last_hidden_state and pooler_output. Per-token outputs are compared at real (unpadded) positions
               only: what a model puts at padding is not part of its contract;
    sentence-transformers  for a folder in its layout (export/sentence_transformers.py): SentenceTransformer(DIR)
               .encode() against hfport's pooled embeddings (cosine >= 0.99999 and max abs diff <= atol), or
               CrossEncoder(DIR).predict() against hfport's one-label scores (<= atol).

Both models run in float32 on the CPU, so the comparison isolates what the export changed. Tolerances
(|transformers - hfport| <= atol + rtol * |hfport|, element-wise), with the max abs diffs measured on the real
all-MiniLM-L6-v2 (6 layers, hidden 384) and on the tiny test models:
    float32    atol 1e-5, rtol 1e-4: the same weights; only the two implementations' summation order differs
               (MiniLM 2.6e-6; tiny models <= 1e-6).
    float16    atol 1e-2, rtol 1e-2: each weight is rounded to 11 significant bits (unit roundoff 2^-11 ~ 4.9e-4);
               the rounding errors of hundreds of products per output add up layer by layer (MiniLM 3.1e-3).
    bfloat16   atol 5e-2, rtol 5e-2: 8 significant bits (unit roundoff 2^-8 ~ 3.9e-3), eight times coarser
               (MiniLM 2.8e-2 on last_hidden_state). Deeper models drift further: pass looser values if needed.
The `weights` check stays exact at every dtype, so a tampered tensor is caught even where the output tolerance is
loose. transformers is imported here only, inside verify().
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .. import hub
from ..modeling import PreTrainedEncoder, resolve_dtype, task_of
from ..registry import get_family
from ..tasks import TASKS, load_any
from .common import DTYPE_NAMES, OUTPUTS, TRANSFORMERS_AUTO, ExportError, resolve_source
from .sentence_transformers import verify_rows as verify_st

# (atol, rtol) by the dtype DIR's weights are stored in; the module docstring says why
TOLERANCES: dict[str, tuple[float, float]] = {"float32": (1e-5, 1e-4), "float16": (1e-2, 1e-2),
                                              "bfloat16": (5e-2, 5e-2)}
MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
PROBE_TEXTS = ["The film was wonderful.",
               ("Paris is the capital of France, and Berlin is the capital of Germany; both cities are large, old "
                "and full of museums."),
               "ok",
               "Who wrote Moby-Dick? Herman Melville wrote it in 1851."]
PROBE_PAIRS = [("Who wrote the book?", "Herman Melville wrote Moby-Dick in 1851, a long time ago."),
               ("Where is Berlin?", "Berlin is in Germany."),
               ("What is the capital of France, the country west of Germany?", "Paris.")]
PROBE_MAX_LENGTH = 64


@dataclass
class Row:
    check: str  # load | labels | weights | tokenizer | outputs
    output: str
    shape: str = ""
    max_abs_diff: float | None = None
    tolerance: str = ""
    passed: bool = False
    detail: str = ""


@dataclass
class VerifyReport:
    dir: str
    source: str
    dtype: str | None = None
    atol: float | None = None
    rtol: float | None = None
    rows: list[Row] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(r.passed for r in self.rows)

    @property
    def failures(self) -> list[Row]:
        return [r for r in self.rows if not r.passed]

    def add(self, check: str, output: str, passed: bool, *, shape: Any = "", diff: float | None = None,
            tolerance: str = "", detail: str = "") -> Row:
        shape = "x".join(map(str, shape)) if isinstance(shape, (tuple, list, torch.Size)) else str(shape)
        row = Row(check, output, shape, diff, tolerance, bool(passed), detail)
        self.rows.append(row)
        return row

    def to_dict(self) -> dict[str, Any]:
        rows = []
        for r in self.rows:
            d = asdict(r)
            if d["max_abs_diff"] is not None and not math.isfinite(d["max_abs_diff"]):
                d["max_abs_diff"] = str(d["max_abs_diff"])  # JSON has no NaN/inf
            rows.append(d)
        return {"dir": self.dir, "source": self.source, "dtype": self.dtype, "atol": self.atol, "rtol": self.rtol,
                "passed": self.passed, "failures": len(self.failures), "rows": rows}

    def write_json(self, path: str | os.PathLike[str]) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        hub.write_json_atomic(path, self.to_dict())

    def table(self) -> str:
        header = ("check", "output", "shape", "max abs diff", "tolerance", "result")
        body = [(r.check, r.output, r.shape, "" if r.max_abs_diff is None else f"{r.max_abs_diff:.3g}",
                 r.tolerance, "PASS" if r.passed else "FAIL") for r in self.rows]
        widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
        lines = ["  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip() for line in (header, *body)]
        lines.insert(1, "  ".join("-" * w for w in widths))
        for r in self.failures:
            if r.detail:
                lines.append(f"FAIL {r.check} {r.output}: {r.detail}")
        n, bad = len(self.rows), len(self.failures)
        verdict = (f"PASS: {n} checks, {self.dir} matches {self.source}" if self.passed else
                   f"FAIL: {bad} of {n} checks failed" if n else "FAIL: no check ran")
        return "\n".join([*lines, verdict])


class VerifyFailed(ExportError):
    """`export(verify=True)` found the export does not match its source; DIR was not written."""

    def __init__(self, message: str, report: VerifyReport):
        super().__init__(message)
        self.report = report


@contextmanager
def check_row(report: VerifyReport, check: str, output: str) -> Iterator[None]:
    """A check that raises is a failed row naming the exception: verify fails closed."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - every failure must become a FAIL row, never a pass
        report.add(check, output, False, detail=f"{type(e).__name__}: {e}")


@contextmanager
def _quiet_transformers() -> Iterator[Any]:
    import transformers
    from transformers.utils import logging as tlog

    verbosity, bars = tlog.get_verbosity(), tlog.is_progress_bar_enabled()
    tlog.set_verbosity_error()
    tlog.disable_progress_bar()
    try:
        yield transformers
    finally:
        tlog.set_verbosity(verbosity)
        if bars:
            tlog.enable_progress_bar()


def _dir_dtype(folder: Path, raw: dict[str, Any]) -> str:
    name = raw.get("dtype") or raw.get("torch_dtype")
    if name is None:
        entries = hub.Checkpoint.open(folder).entries.values()
        floats = {e["dtype"] for e in entries if e["dtype"] in ("F32", "F16", "BF16")}
        name = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(floats.pop()) if len(floats) == 1 \
            else "float32"
    return DTYPE_NAMES.get(resolve_dtype(name), "float32")


def verify(dir: str | os.PathLike[str], source: str | os.PathLike[str] | None = None, *, atol: float | None = None,
           rtol: float | None = None, json_path: str | os.PathLike[str] | None = None, which: str = "best",
           label: str | None = None) -> VerifyReport:
    """Check that transformers loads DIR cleanly and computes what hfport computes from SOURCE.

    atol/rtol default by DIR's dtype (TOLERANCES; the module docstring gives the reasons). Never raises for a
    failed check: the report says FAIL and names what failed. json_path: also write the report there."""
    folder = Path(dir).expanduser()
    from .. import lora

    if lora.is_adapter_folder(folder):  # a LoRA adapter: peft over transformers (export/peft.py)
        from .peft import verify_adapter

        return verify_adapter(folder, source, atol=atol, rtol=rtol, json_path=json_path, which=which, label=label)
    if source is None:
        raise ExportError("verify: SOURCE is needed (what DIR was exported from); only an adapter folder is "
                          "compared with itself")
    report = VerifyReport(label or str(folder), str(source))
    try:
        with check_row(report, "verify", "run"):  # anything not caught by one check (transformers missing, say)
            _verify(folder, source, which, atol, rtol, report)
    finally:
        if json_path is not None:
            report.write_json(json_path)
    return report


def _verify(folder: Path, source_arg: Any, which: str, atol: float | None, rtol: float | None,
            report: VerifyReport) -> None:
    ctx: dict[str, Any] = {}
    with check_row(report, "config", "config.json"):
        if not folder.is_dir():
            raise ExportError(f"{folder}: no such folder")
        raw, cfg_source = hub.read_config(folder)
        family = get_family(raw.get("model_type"), cfg_source)
        if not raw.get("architectures"):
            raise ExportError(f"{cfg_source}: no 'architectures' entry; transformers' head cannot be chosen")
        task = task_of(family, raw["architectures"])
        if family.architectures.get(task) != raw["architectures"][0]:
            raise ExportError(f"{cfg_source}: architectures {raw['architectures']} is not a "
                              f"{family.model_type} class hfport knows ({sorted(family.architectures.values())})")
        report.dtype = _dir_dtype(folder, raw)
        default_atol, default_rtol = TOLERANCES[report.dtype]
        report.atol = default_atol if atol is None else atol
        report.rtol = default_rtol if rtol is None else rtol
        ctx.update(raw=raw, family=family, task=task)
        report.add("config", "config.json", True, detail=f"{family.model_type} {task} {report.dtype}")
    if not ctx:
        return
    raw, task = ctx["raw"], ctx["task"]
    tol = f"atol={report.atol:g} rtol={report.rtol:g}"

    with check_row(report, "source", str(source_arg)):
        src = resolve_source(source_arg, which)
        ours = load_any(src.model, dtype=torch.float32)
        if ours.task != task:
            raise ExportError(f"{src.model} holds a {ours.task} model; {folder} holds a {task} model")
        ctx["ours"] = ours
        report.source = str(src.model)
    ours: PreTrainedEncoder | None = ctx.get("ours")

    if ours is not None:
        with check_row(report, "labels", "id2label/label2id"):
            _check_labels(report, raw, ours)
        with check_row(report, "weights", "model.safetensors"):
            _check_weights(report, folder, ours)

    theirs = None
    with _quiet_transformers() as transformers:
        with check_row(report, "load", TRANSFORMERS_AUTO[task]):
            theirs = _load_transformers(report, transformers, folder, task, raw)
        batches: dict[str, dict[str, Tensor]] = {}
        with check_row(report, "tokenizer", "load"):
            batches = _check_tokenizer(report, transformers, folder, task, raw)
    if ours is not None:  # a sentence-transformers folder (embeddings, cross-encoder): its own loader agrees too
        with check_row(report, "sentence-transformers", "load"):
            verify_st(report, folder, raw, ours, Path(report.source), PROBE_TEXTS, PROBE_PAIRS)
    if ours is None or theirs is None or not batches:
        return
    for name, enc in batches.items():
        for out_name in OUTPUTS[task]:
            with check_row(report, "outputs", f"{name}/{out_name}"):
                _compare(report, name, out_name, ours, theirs, enc, task, tol)


def _check_labels(report: VerifyReport, raw: dict[str, Any], ours: PreTrainedEncoder) -> None:
    theirs_id2label = {int(k): v for k, v in (raw.get("id2label") or {}).items()}
    theirs_label2id = {str(k): int(v) for k, v in (raw.get("label2id") or {}).items()}
    wrong = []
    if theirs_id2label != ours.config.id2label:
        wrong.append(f"id2label {theirs_id2label} != source {ours.config.id2label}")
    if theirs_label2id != ours.config.label2id:
        wrong.append(f"label2id {theirs_label2id} != source {ours.config.label2id}")
    num = raw.get("num_labels", len(theirs_id2label))
    if num != ours.config.num_labels:
        wrong.append(f"num_labels {num} != source {ours.config.num_labels}")
    if ours.config.problem_type is not None and raw.get("problem_type") != ours.config.problem_type:
        wrong.append(f"problem_type {raw.get('problem_type')!r} != source {ours.config.problem_type!r}")
    report.add("labels", "id2label/label2id", not wrong, shape=len(theirs_id2label), tolerance="equal",
               detail="; ".join(wrong))


def _check_weights(report: VerifyReport, folder: Path, ours: PreTrainedEncoder) -> None:
    """Every tensor in DIR equals the source's tensor rounded to the stored dtype, and the key sets agree."""
    ckpt = hub.Checkpoint.open(folder)
    expected = ours.hf_state_dict()
    extra = sorted(set(ckpt.keys()) - set(expected))
    missing = sorted(set(expected) - set(ckpt.keys()))
    worst, differing = 0.0, []
    for key, tensor in ckpt.tensors(sorted(set(ckpt.keys()) & set(expected))):
        ref = expected[key]
        if tuple(tensor.shape) != tuple(ref.shape):
            differing.append(f"{key} shape {list(tensor.shape)} != source {list(ref.shape)}")
            continue
        rounded = ref.to(tensor.dtype)
        if not torch.equal(tensor, rounded):
            diff = (tensor.float() - rounded.float()).abs().max().item()
            differing.append(f"{key} (max abs diff {diff:.3g})")  # the first word names the tensor
            worst = max(worst, diff) if math.isfinite(diff) else math.inf
    problems = [*(f"not in the source model: {k}" for k in extra[:5]), *(f"missing: {k}" for k in missing[:5]),
                *differing[:5]]
    output = "model.safetensors" if not differing else f"model.safetensors: {differing[0].split(' ')[0]}"
    report.add("weights", output, not problems, shape=f"{len(ckpt.keys())} tensors", diff=worst,
               tolerance="exact (source rounded to the stored dtype)",
               detail="; ".join(problems) + (f" ({len(differing)} tensors differ)" if len(differing) > 1 else ""))


def _load_transformers(report: VerifyReport, transformers: Any, folder: Path, task: str, raw: dict[str, Any]) -> Any:
    auto = getattr(transformers, TRANSFORMERS_AUTO[task])
    try:
        model, info = auto.from_pretrained(str(folder), output_loading_info=True, dtype=torch.float32,
                                           trust_remote_code=False)
    except ValueError as e:
        if "Unrecognized configuration class" in str(e):
            raise ExportError(f"transformers has no {TRANSFORMERS_AUTO[task]} for model_type "
                              f"{raw.get('model_type')!r}: {e}") from e
        raise
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        items = sorted(map(str, info.get(kind) or []))
        report.add("load", kind.replace("_", " "), not items, diff=len(items), tolerance="none allowed",
                   detail=", ".join(items[:10]))
    arch = raw["architectures"][0]
    report.add("load", f"class {type(model).__name__}", type(model).__name__ == arch, tolerance=f"== {arch}",
               detail=f"transformers built {type(model).__name__}, config.json names {arch}")
    if not report.rows[-1].passed or any(not r.passed for r in report.rows[-5:]):
        return None  # a model with re-initialised weights would only add noise to the output rows
    return model.eval()


def _check_tokenizer(report: VerifyReport, transformers: Any, folder: Path, task: str,
                     raw: dict[str, Any]) -> dict[str, dict[str, Tensor]]:
    """Encode the probe batches with hfport's and transformers' tokenizer; returns hfport's encodings."""
    from ..tokenizer import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(folder)
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    max_length = min(PROBE_MAX_LENGTH, int(raw.get("max_position_embeddings", 512)) - 2)
    kwargs = {"padding": True, "truncation": True, "max_length": max_length, "return_tensors": "pt"}
    probes: dict[str, tuple[Any, ...]] = {"texts": (PROBE_TEXTS,)}
    if "token_type_ids" in ours.model_input_names or TASKS[task].pair_input:
        probes["pairs"] = ([q for q, _ in PROBE_PAIRS], [c for _, c in PROBE_PAIRS])
    out = {}
    for name, args in probes.items():
        a, b = ours(*args, **kwargs), theirs(*args, **kwargs)
        keys_a, keys_b = set(a.keys()), set(b.keys())
        if keys_a != keys_b:
            report.add("tokenizer", f"{name}/fields", False, tolerance="equal",
                       detail=f"hfport returns {sorted(keys_a)}, transformers {sorted(keys_b)}")
        for key in sorted(keys_a & keys_b):
            x, y = a[key], b[key]
            same = tuple(x.shape) == tuple(y.shape) and torch.equal(x, y)
            diff = (x - y).abs().max().item() if tuple(x.shape) == tuple(y.shape) else None
            report.add("tokenizer", f"{name}/{key}", same, shape=tuple(x.shape), diff=diff, tolerance="exact",
                       detail="" if same else f"hfport {list(x.shape)} vs transformers {list(y.shape)}")
        out[name] = {k: v for k, v in a.items() if k in MODEL_INPUTS}
    return out


@torch.inference_mode()
def _compare(report: VerifyReport, batch: str, name: str, ours: PreTrainedEncoder, theirs: Any,
             enc: dict[str, Tensor], task: str, tol: str) -> None:
    inputs = TASKS[task].model_inputs(enc)  # (1, B, T) where the model takes choices: the rows as one question's
    a = getattr(theirs(**inputs), name, None)  # transformers, from DIR
    b = getattr(ours(**inputs), name, None)  # hfport, from SOURCE: the reference
    if a is None and b is None:
        return  # neither has it (DistilBERT has no pooler)
    if a is None or b is None:
        report.add("outputs", f"{batch}/{name}", False, tolerance=tol,
                   detail=f"only {'hfport' if a is None else 'transformers'} returns {name}")
        return
    shape = tuple(a.shape)
    if shape != tuple(b.shape):
        report.add("outputs", f"{batch}/{name}", False, shape=shape, tolerance=tol,
                   detail=f"transformers {list(a.shape)} vs hfport {list(b.shape)}")
        return
    a, b = a.float(), b.float()
    per_token = TASKS[task].per_token(name)
    if per_token:  # real positions only: (B, T, ...) -> (N, ...)
        real = enc["attention_mask"].bool()
        a, b = a[real], b[real]
    diff = (a - b).abs().max().item() if a.numel() else 0.0
    ok = bool(torch.isclose(a, b, atol=report.atol, rtol=report.rtol).all())
    if not math.isfinite(diff):
        ok = False
    report.add("outputs", f"{batch}/{name}", ok, shape=shape, diff=diff, tolerance=tol,
               detail="" if ok else f"transformers' output from the export differs from hfport's from the source "
                                    f"(max abs diff {diff:.3g}" + (", real positions" if per_token else "") + ")")
