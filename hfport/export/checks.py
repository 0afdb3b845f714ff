"""The checks the formats' verifies share (each adds rows to a VerifyReport; report.py holds the report and the one
output comparison):
    load       transformers' AutoModelFor<head> loads DIR (never trust_remote_code) with no missing, unexpected or
               mismatched keys, as the class config.json names;
    labels     DIR's id2label / label2id / num_labels equal the source model's;
    weights    every tensor in DIR equals the source's tensor rounded to DIR's dtype, bit for bit;
    tokenizer  the exported tokenizer gives the same ids, masks and token types in transformers and in hfport;
    outputs    hfport's model from SOURCE and transformers' model from DIR run the same probe batches (texts of
               different lengths with padding; question/context pairs where the tokenizer returns token types or
               the head is QA); every output the task names is compared (report.compare), per-token outputs at
               real (unpadded) positions only.
transformers is imported inside the checks only (quiet_transformers): the core never needs it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .. import hub
from ..modeling import PreTrainedEncoder, resolve_dtype
from ..tasks import TASKS
from ..tokenizer import AutoTokenizer
from .common import DTYPE_NAMES, TRANSFORMERS_AUTO, ExportError
from .report import VerifyReport, check_row, compare

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


@contextmanager
def quiet_transformers() -> Iterator[Any]:
    """transformers, with its warnings and progress bars off for the duration."""
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


def folder_dtype(folder: Path, raw: dict[str, Any]) -> str:
    """The dtype DIR's weights are stored in: config.json's, else the one float dtype its tensors share."""
    name = raw.get("dtype") or raw.get("torch_dtype")
    if name is None:
        entries = hub.Checkpoint.open(folder).entries.values()
        floats = {e["dtype"] for e in entries if e["dtype"] in ("F32", "F16", "BF16")}
        name = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}.get(floats.pop()) if len(floats) == 1 \
            else "float32"
    return DTYPE_NAMES.get(resolve_dtype(name), "float32")


def check_labels(report: VerifyReport, raw: dict[str, Any], ours: PreTrainedEncoder) -> None:
    """DIR's labels as transformers reads them (a config without id2label gets LABEL_0..LABEL_{n-1}, n = num_labels
    or 2) equal the source model's."""
    default = {i: f"LABEL_{i}" for i in range(int(raw.get("num_labels", 2)))}
    theirs_id2label = {int(k): v for k, v in (raw.get("id2label") or default).items()}
    theirs_label2id = {str(k): int(v) for k, v in (raw.get("label2id") or
                                                   {v: k for k, v in theirs_id2label.items()}).items()}
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


def check_weights(report: VerifyReport, folder: Path, ours: PreTrainedEncoder) -> None:
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


def load_transformers(report: VerifyReport, transformers: Any, folder: Path, task: str, raw: dict[str, Any]) -> Any:
    """transformers' head model from DIR, with load rows; None when a row failed (re-initialised weights would only
    add noise to the output rows)."""
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
    if any(not r.passed for r in report.rows[-5:]):
        return None
    return model.eval()


def transformers_rows(report: VerifyReport, folder: Path, task: str, raw: dict[str, Any]) -> tuple[Any, dict]:
    """transformers' model from FOLDER and the probe batches its tokenizer makes (checked against hfport's), each
    under its own row: (None, {}) where a row could not run, which the row records as a FAIL."""
    theirs, batches = None, {}
    with quiet_transformers() as transformers:
        with check_row(report, "load", TRANSFORMERS_AUTO[task]):
            theirs = load_transformers(report, transformers, folder, task, raw)
        with check_row(report, "tokenizer", "load"):
            batches = check_tokenizer(report, transformers, folder, task, raw)
    return theirs, batches


def check_tokenizer(report: VerifyReport, transformers: Any, folder: Path, task: str,
                    raw: dict[str, Any]) -> dict[str, dict[str, Tensor]]:
    """Encode the probe batches with hfport's and transformers' tokenizer; returns hfport's encodings."""
    ours = AutoTokenizer.from_pretrained(folder)
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    max_length = min(PROBE_MAX_LENGTH, int(raw.get("max_position_embeddings", 512)) - 2)
    kwargs = {"padding": True, "truncation": True, "max_length": max_length, "return_tensors": "pt"}
    # a model with one token type (RoBERTa, XLM-R) is fed none, whatever the tokenizer returns: a WordPiece
    # tokenizer's segment 1 would index past its one-row table
    one_type = "type_vocab_size" in raw and int(raw["type_vocab_size"]) <= 1
    inputs = [k for k in MODEL_INPUTS if not (one_type and k == "token_type_ids")]
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
        out[name] = {k: v for k, v in a.items() if k in inputs}
    return out


@torch.inference_mode()
def compare_models(report: VerifyReport, batches: dict[str, dict[str, Tensor]], ours: PreTrainedEncoder,
                   theirs: Any, task: str, suffix: str = "") -> None:
    """Every output the task names, on every probe batch: transformers' model from DIR against hfport's (the
    reference), per-token outputs at real positions. An output neither returns is skipped (DistilBERT has no
    pooler); one only one side returns fails. SUFFIX names the pair in a row that could not run."""
    record = TASKS[task]
    for batch, enc in batches.items():
        runs: dict[str, Any] = {}
        inputs = record.model_inputs(enc)  # (1, B, T) where the model takes choices: the rows as one question's
        with check_row(report, "outputs", f"{batch}/forward{suffix}"):
            runs.update(got=theirs(**inputs), ref=ours(**inputs))
        if not runs:
            continue
        got_all, ref_all = runs["got"], runs["ref"]
        for name in record.outputs:
            with check_row(report, "outputs", f"{batch}/{name}{suffix}"):
                got, ref = getattr(got_all, name, None), getattr(ref_all, name, None)
                if got is None and ref is None:
                    continue
                compare(report, "outputs", f"{batch}/{name}", got, ref,
                        real=enc["attention_mask"] if record.per_token(name) else None,
                        what="transformers' output from the export (hfport's from the source is the reference)")
