"""LoRA adapters: export (as the adapter, or merged into a plain HF folder) and the proof of each.

    verify_adapter(DIR)   peft loads DIR over transformers' AutoModelFor<Task> of its base (no missing or
                          unexpected adapter keys) and computes what hfport computes from SOURCE (default DIR
                          itself), at real positions, fp32 atol 1e-5 / rtol 1e-4 (export/verify.py says why)
    export_lora(...)      merge=False: the adapter folder (PEFT's format, config.json, tokenizer), verified as above;
                          merge=True: a plain HF folder with every LoRA update folded into its layer and the head
                          included, verified by transformers loading it cleanly (no missing/unexpected keys), its
                          weights equal to the merge hfport computed, and its outputs equal to the unmerged
                          adapter model's (hfport, from SOURCE)

peft and transformers are imported inside the checks only: the core never needs them.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from .. import hub, lora
from ..modeling import PreTrainedEncoder
from ..tasks import TASKS, load_any
from ..tokenizer import copy_tokenizer_files, has_tokenizer_files
from .common import DTYPE_NAMES, OUTPUTS, TRANSFORMERS_AUTO, ExportError, Source, no_tokenizer_message, \
    resolve_source, tokenizer_folder
from .verify import (TOLERANCES, VerifyFailed, VerifyReport, check_row, _check_labels, _check_tokenizer,
                     _check_weights, _compare, _load_transformers, _quiet_transformers)

log = logging.getLogger("hfport")


def verify_adapter(dir: str | Path, source: Any = None, *, atol: float | None = None, rtol: float | None = None,
                   json_path: Any = None, which: str = "best", label: str | None = None) -> VerifyReport:
    """peft over transformers computes, from adapter folder DIR, what hfport computes from SOURCE (default DIR).
    Never raises for a failed check: every failure is a FAIL row."""
    folder = Path(dir).expanduser()
    report = VerifyReport(label or str(folder), str(source if source is not None else folder))
    report.dtype = "float32"
    report.atol, report.rtol = (TOLERANCES["float32"][0] if atol is None else atol,
                                TOLERANCES["float32"][1] if rtol is None else rtol)
    try:
        with check_row(report, "verify", "run"):
            _verify_adapter(folder, source, which, report)
    finally:
        if json_path is not None:
            report.write_json(json_path)
    return report


def _verify_adapter(folder: Path, source: Any, which: str, report: VerifyReport) -> None:
    tol = f"atol={report.atol:g} rtol={report.rtol:g}"
    ctx: dict[str, Any] = {}
    with check_row(report, "config", lora.ADAPTER_CONFIG):
        raw = lora.read_adapter_config(folder)  # refuses what hfport cannot compute (IA3, DoRA, ...)
        task = lora.adapter_task(folder)
        ctx.update(raw=raw, task=task)
        report.add("config", lora.ADAPTER_CONFIG, True,
                   detail=f"LORA r={raw['r']} alpha={raw.get('lora_alpha')} {task} over "
                          f"{raw.get('base_model_name_or_path')}")
    if not ctx:
        return
    raw, task = ctx["raw"], ctx["task"]
    ours: PreTrainedEncoder | None = None
    with check_row(report, "source", str(source or folder)):
        src = resolve_source(source if source is not None else folder, which)
        ours = load_any(src.model, dtype=torch.float32)
        if ours.task != task:
            raise ExportError(f"{src.model} holds a {ours.task} model; {folder} holds a {task} adapter")
        report.source = str(src.model)
    cfg = {"id2label": ours.config.id2label} if ours is not None and \
        ours.head is not None and TASKS[task].labels else {}
    if ours is not None and (folder / "config.json").is_file():
        with check_row(report, "labels", "id2label/label2id"):
            _check_labels(report, hub.read_config(folder)[0], ours)
    theirs = None
    with _quiet_transformers() as transformers:
        with check_row(report, "load", f"peft over {TRANSFORMERS_AUTO[task]}"):
            theirs = _load_peft(report, transformers, folder, raw, task, cfg)
        batches: dict[str, Any] = {}
        with check_row(report, "tokenizer", "load"):
            tok = folder if has_tokenizer_files(folder) else Path(raw.get("base_model_name_or_path") or folder)
            batches = _check_tokenizer(report, transformers, tok, task, hub.read_config(tok)[0]
                                       if (tok / "config.json").is_file() else {})
    if ours is None or theirs is None or not batches:
        return
    for name, enc in batches.items():
        for out_name in OUTPUTS[task]:
            with check_row(report, "outputs", f"{name}/{out_name}"):
                _compare(report, name, out_name, ours, theirs, enc, task, tol)


def _load_peft(report: VerifyReport, transformers: Any, folder: Path, raw: dict[str, Any], task: str,
               labels: dict[str, Any]) -> Any:
    """transformers' head model of the base, then peft's adapter over it; None when a load row failed."""
    from peft import PeftModel

    base = raw.get("base_model_name_or_path")
    auto = getattr(transformers, TRANSFORMERS_AUTO[task])
    model = auto.from_pretrained(str(hub.resolve(base)), dtype=torch.float32, trust_remote_code=False, **labels)
    peft_model = PeftModel.from_pretrained(model, str(folder), is_trainable=False)
    missing, unexpected = adapter_key_problems(peft_model, folder)
    for kind, items in (("missing adapter keys", missing), ("unexpected adapter keys", unexpected)):
        report.add("load", kind, not items, diff=len(items), tolerance="none allowed", detail=", ".join(items[:10]))
    wrapped = sum(1 for m in peft_model.modules() if type(m).__name__ == "Linear" and hasattr(m, "lora_A"))
    report.add("load", "LoRA layers", wrapped > 0, shape=wrapped, tolerance="> 0",
               detail="" if wrapped else "peft wrapped no layer of the base")
    if not all(r.passed for r in report.rows[-3:]):
        return None
    # the transformers model with peft's layers injected: PeftModelForQuestionAnswering.forward drops
    # token_type_ids before calling it (a peft quirk), the injected model itself takes every input
    return peft_model.get_base_model().eval()


def adapter_key_problems(peft_model: Any, folder: Path) -> tuple[list[str], list[str]]:
    """(missing, unexpected): the keys peft's model would save for its adapter (its LoRA layers and its
    modules_to_save copies) against the keys in the folder's adapter_model.safetensors."""
    from peft.utils import get_peft_model_state_dict
    from safetensors import safe_open

    with safe_open(str(folder / lora.ADAPTER_WEIGHTS), framework="pt") as f:
        saved = set(f.keys())
    wanted = set(get_peft_model_state_dict(peft_model))
    return sorted(wanted - saved), sorted(saved - wanted)


def verify_merged(dir: Path, adapter_model: PreTrainedEncoder, merged_model: PreTrainedEncoder, source: str, *,
                  atol: float | None = None, rtol: float | None = None, json_path: Any = None,
                  label: str | None = None) -> VerifyReport:
    """transformers loads merged folder DIR cleanly, its weights are the merge hfport computed (exactly, after the
    dtype's rounding), and it computes what the unmerged adapter model computes."""
    report = VerifyReport(label or str(dir), source)
    try:
        with check_row(report, "verify", "run"):
            raw, _ = hub.read_config(dir)
            report.dtype = DTYPE_NAMES[merged_model.dtype]
            report.atol = TOLERANCES[report.dtype][0] if atol is None else atol
            report.rtol = TOLERANCES[report.dtype][1] if rtol is None else rtol
            task, tol = adapter_model.task, f"atol={report.atol:g} rtol={report.rtol:g}"
            report.add("config", "config.json", True, detail=f"merged {raw.get('model_type')} {task}")
            with check_row(report, "labels", "id2label/label2id"):
                _check_labels(report, raw, adapter_model)
            with check_row(report, "weights", "model.safetensors (merged)"):
                _check_weights(report, dir, merged_model)
            theirs, batches = None, {}
            with _quiet_transformers() as transformers:
                with check_row(report, "load", TRANSFORMERS_AUTO[task]):
                    theirs = _load_transformers(report, transformers, dir, task, raw)
                with check_row(report, "tokenizer", "load"):
                    batches = _check_tokenizer(report, transformers, dir, task, raw)
            if theirs is not None:
                for name, enc in batches.items():
                    for out_name in OUTPUTS[task]:
                        with check_row(report, "outputs", f"{name}/{out_name} (merged vs adapter)"):
                            _compare(report, name, out_name, adapter_model, theirs, enc, task, tol)
    finally:
        if json_path is not None:
            report.write_json(json_path)
    return report


def export_lora(source: Source, out: Path, *, merge: bool, dtype: torch.dtype, limit: int, verify: bool,
                atol: float | None, rtol: float | None, json_path: Any, replace: Any) -> Any:
    """The adapter of SOURCE at OUT: as the adapter folder (merge=False) or merged into a plain HF folder."""
    from .card import model_card
    from .common import export_config
    from .folder import ExportResult

    model = load_any(source.model, dtype=torch.float32)
    tok_folder = tokenizer_folder(source)
    if tok_folder is None and model.adapter is not None and model.adapter.base:
        base = Path(model.adapter.base)
        tok_folder = base if has_tokenizer_files(base) else None
    if tok_folder is None:
        raise ExportError(no_tokenizer_message(source))
    staging = hub.staging_dir(out)
    try:
        if merge:
            plain = lora.merged(model).to(dtype)
            files = hub.save_weights(plain.hf_state_dict(), staging, limit)
            config = export_config(plain, plain.family.architectures[plain.task], dtype)
            hub.write_json_atomic(staging / "config.json", config)
            copy_tokenizer_files(tok_folder, staging)
            (staging / "README.md").write_text(model_card(source, config, model.task, out.name), encoding="utf-8")
        else:
            if dtype != torch.float32:
                raise ExportError("an adapter is exported in float32; pass --merge for a merged model in another "
                                  "dtype")
            lora.save_adapter(model, staging / "adapter")
            for item in (staging / "adapter").iterdir():
                item.rename(staging / item.name)
            (staging / "adapter").rmdir()
            copy_tokenizer_files(tok_folder, staging)
            files = [lora.ADAPTER_WEIGHTS]
        result = ExportResult(out, source.model, model.family.model_type, model.task, DTYPE_NAMES[dtype],
                              sorted(p.name for p in staging.iterdir()), files, tok_folder)
        if verify:
            result.report = (verify_merged(staging, model, plain, str(source.model), atol=atol, rtol=rtol,
                                           json_path=json_path, label=str(out)) if merge else
                             verify_adapter(staging, source.model, atol=atol, rtol=rtol, json_path=json_path,
                                            label=str(out)))
            if not result.report.passed:
                raise VerifyFailed(f"{out}: the export does not match {source.model}; nothing was written\n"
                                   + result.report.table(), result.report)
        replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return result
