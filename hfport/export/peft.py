"""The two LoRA adapter formats: the adapter itself (PEFT's layout) and the adapter merged into a plain HF folder,
each with its proof.

    write_adapter / verify_adapter   the adapter folder (PEFT's format, config.json, tokenizer, a model card as peft
                          writes it: ADAPTER_CARD); proven by peft
                          loading DIR over transformers' AutoModelFor<Task> of its base (no missing or unexpected
                          adapter keys) and computing what hfport computes from SOURCE (default DIR itself), at real
                          positions, fp32 atol 1e-5 / rtol 1e-4 (export/report.py says why)
    write_merged / verify_merged     a plain HF folder with every LoRA update folded into its layer and the head
                          included; proven by transformers loading it cleanly (no missing/unexpected keys), its
                          weights equal to the merge hfport computed, and its outputs equal to the unmerged adapter
                          model's (hfport, from SOURCE)

peft and transformers are imported inside the checks only: the core never needs them.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .. import hub, lora
from ..formats.sentence_transformers import CROSS_ENCODER_KEY, copy_layout
from ..modeling import PreTrainedEncoder
from ..tasks import TASKS, load_any
from ..tokenizer import copy_tokenizer_files, has_tokenizer_files
from .card import CardFacts, CardStyle, read_json, write_card
from .checks import (check_labels, check_tokenizer, check_weights, compare_models, quiet_transformers,
                     transformers_rows)
from .common import (DTYPE_NAMES, EXPORT_DTYPES, TRANSFORMERS_AUTO, ExportError, ExportResult, Source,
                     export_config, no_tokenizer_message, resolve_source, staged, tokenizer_folder)
from .folder import ExportOptions, raise_unless_passed
from .report import VerifyReport, check_row, reporting

log = logging.getLogger("hfport")


# --- the model cards (export/card.py builds them; these are what only an adapter's card says) -------------------


def adapter_section(facts: CardFacts) -> list[str]:
    """The adapter's files and its LoRA settings, as adapter_config.json has them."""
    raw = read_json(facts.folder / lora.ADAPTER_CONFIG)
    settings = {k: raw[k] for k in ("peft_type", "r", "lora_alpha", "lora_dropout", "target_modules",
                                    "modules_to_save", "bias") if raw.get(k) is not None}
    return ["## Adapter", "", f"A LoRA adapter in PEFT's format over `{facts.base}`: `{lora.ADAPTER_CONFIG}` and "
            f"`{lora.ADAPTER_WEIGHTS}` (float32), with config.json (the head's labels) and the tokenizer.", "",
            "| setting | value |", "|---|---|", *(f"| {k} | `{json.dumps(v)}` |" for k, v in settings.items()), ""]


def adapter_use(facts: CardFacts) -> list[str]:
    """peft over transformers' head model of the base (the folder's config.json carries the head's labels)."""
    auto = TRANSFORMERS_AUTO[facts.task]
    base = facts.base or "BASE_MODEL"
    return ["## Use", "", "```python", "from peft import PeftModel",
            f"from transformers import AutoConfig, AutoTokenizer, {auto}", "",
            f'base = {auto}.from_pretrained("{base}", config=AutoConfig.from_pretrained("{facts.name}"))',
            f'model = PeftModel.from_pretrained(base, "{facts.name}")',
            f'tokenizer = AutoTokenizer.from_pretrained("{facts.name}")', "```", "",
            f'With hfport: `hfport.pipeline("{facts.task}", model="{facts.name}")` (the base is read from '
            f"{lora.ADAPTER_CONFIG}).", ""]


# peft's own cards: library peft, the base model, the adapter relation (and its base_model:adapter: tag), lora
ADAPTER_CARD = CardStyle(library="peft", tags=("lora", "transformers"), relation="adapter", use=adapter_use,
                         section=adapter_section)
MERGED_CARD = CardStyle(relation="merge")  # a plain HF folder: the base's weights with the LoRA update folded in


# --- the adapter --------------------------------------------------------------------------------------------------


def verify_adapter(dir: str | os.PathLike[str], source: Any = None, *, atol: float | None = None,
                   rtol: float | None = None, json_path: Any = None, which: str = "best",
                   label: str | None = None, base_model: str | os.PathLike[str] | None = None) -> VerifyReport:
    """peft over transformers computes, from adapter folder DIR, what hfport computes from SOURCE (default DIR).
    base_model: the base both load (default: the one DIR's adapter_config.json names). Never raises for a failed
    check: every failure is a FAIL row."""
    folder = Path(dir).expanduser()
    report = VerifyReport(label or str(folder), str(source if source is not None else folder))
    report.set_tolerances("float32", atol, rtol)
    with reporting(report, json_path):
        _verify_adapter(folder, source, which, report, base_model)
    return report


def _verify_adapter(folder: Path, source: Any, which: str, report: VerifyReport,
                    base_model: str | os.PathLike[str] | None) -> None:
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
        model = load_any(src.model, dtype=torch.float32, base_model=base_model if src.adapter else None)
        if model.task != task:
            raise ExportError(f"{src.model} holds a {model.task} model; {folder} holds a {task} adapter")
        ours, report.source = model, str(src.model)
    cfg = {"id2label": ours.config.id2label} if ours is not None and \
        ours.head is not None and TASKS[task].labels else {}
    if ours is not None and (folder / "config.json").is_file():
        with check_row(report, "labels", "id2label/label2id"):
            check_labels(report, hub.read_config(folder)[0], ours)
    theirs, batches = None, {}
    base = str(base_model) if base_model is not None else raw.get("base_model_name_or_path")
    with quiet_transformers() as transformers:
        with check_row(report, "load", f"peft over {TRANSFORMERS_AUTO[task]}"):
            theirs = load_peft(report, transformers, folder, base, task, cfg)
        with check_row(report, "tokenizer", "load"):
            tok = folder if has_tokenizer_files(folder) else Path(base or folder)
            batches = check_tokenizer(report, transformers, tok, task, hub.read_config(tok)[0]
                                      if (tok / "config.json").is_file() else {})
    if ours is not None and theirs is not None and batches:
        compare_models(report, batches, ours, theirs, task)


def load_peft(report: VerifyReport, transformers: Any, folder: Path, base: str | None, task: str,
              labels: dict[str, Any]) -> Any:
    """transformers' head model of BASE, then peft's adapter over it; None when a load row failed."""
    from peft import PeftModel

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

    with safe_open(str(folder / lora.ADAPTER_WEIGHTS), framework="pt") as f:
        saved = set(f.keys())
    wanted = set(get_peft_model_state_dict(peft_model))
    return sorted(wanted - saved), sorted(saved - wanted)


def _load_adapter_model(source: Source, what: str) -> tuple[PreTrainedEncoder, Path]:
    """SOURCE's adapter model (float32) and the folder whose tokenizer it uses."""
    if not source.adapter:
        raise ExportError(f"{source.model}: {what} applies to LoRA adapter folders (adapter_config.json); this is "
                          "a plain model")
    model = load_any(source.model, dtype=torch.float32, base_model=source.base_model)
    tok_folder = tokenizer_folder(source)
    if tok_folder is None and model.adapter is not None and model.adapter.base:
        base = Path(model.adapter.base)
        tok_folder = base if has_tokenizer_files(base) else None
    if tok_folder is None:
        raise ExportError(no_tokenizer_message(source))
    return model, tok_folder


def write_adapter(source: Source, out: Path, options: ExportOptions, *, verify: bool = False,
                  json_path: Any = None, card: CardStyle = ADAPTER_CARD) -> ExportResult:
    """The adapter of SOURCE at OUT, in PEFT's format (float32), with its config.json, tokenizer and model card."""
    if options.dtype != "fp32":
        raise ExportError("an adapter is exported in float32; pass --merge (format merged) for a merged model in "
                          "another dtype")
    model, tok_folder = _load_adapter_model(source, "the adapter format")
    with staged(out) as staging:
        lora.save_adapter(model, staging / "adapter")
        for item in (staging / "adapter").iterdir():
            item.rename(staging / item.name)
        (staging / "adapter").rmdir()
        copy_tokenizer_files(tok_folder, staging)
        result = ExportResult(out, source.model, model.family.model_type, model.task, "float32", [],
                              [lora.ADAPTER_WEIGHTS], tok_folder, format="peft")
        if verify:
            result.report = verify_adapter(staging, source.model, atol=options.atol, rtol=options.rtol,
                                           json_path=json_path, label=str(out), base_model=source.base_model)
            raise_unless_passed(result.report, out, source.model)
        write_card(staging, source, result, card)  # after verify: the card states its outcome
        result.files = sorted(p.name for p in staging.iterdir())
    return result


# --- merged -------------------------------------------------------------------------------------------------------


def write_merged(source: Source, out: Path, options: ExportOptions, *, verify: bool = False,
                 json_path: Any = None, card: CardStyle = MERGED_CARD) -> ExportResult:
    """The adapter of SOURCE folded into its base: a plain HF folder (head included) in options.dtype."""
    model, tok_folder = _load_adapter_model(source, "merge")
    dtype = EXPORT_DTYPES[options.dtype]
    with staged(out) as staging:
        plain = lora.merged(model).to(dtype)
        files = hub.save_weights(plain.hf_state_dict(), staging, hub.parse_size(options.max_shard_size))
        config = export_config(plain, plain.family.architectures[plain.task], dtype)
        marker = hub.read_config(source.model)[0].get(CROSS_ENCODER_KEY) if (source.model / "config.json").is_file() \
            else None  # peft's own adapter folders have no config.json
        if marker is not None:  # a reranker adapter's CrossEncoder marker (its activation) stays a reranker's
            config[CROSS_ENCODER_KEY] = marker
        hub.write_json_atomic(staging / "config.json", config)
        copy_tokenizer_files(tok_folder, staging)
        # an embedding or SPLADE adapter's sentence-transformers files (pooling, normalize, prompts): without them
        # SentenceTransformer and hfport would pool the merged model by their defaults, not as it was trained
        copy_layout(source.model, staging)
        result = ExportResult(out, source.model, model.family.model_type, model.task, DTYPE_NAMES[dtype], [],
                              files, tok_folder, format="merged")
        if verify:
            result.report = check_merged(staging, model, plain, str(source.model), atol=options.atol,
                                         rtol=options.rtol, json_path=json_path, label=str(out))
            raise_unless_passed(result.report, out, source.model)
        write_card(staging, source, result, card)  # after verify: the card states its outcome
        result.files = sorted(p.name for p in staging.iterdir())
    return result


def verify_merged(dir: str | os.PathLike[str], source: Any, *, atol: float | None = None, rtol: float | None = None,
                  json_path: Any = None, which: str = "best", label: str | None = None) -> VerifyReport:
    """A merged folder DIR against the adapter SOURCE it was merged from (the merge recomputed by hfport)."""
    folder = Path(dir).expanduser()
    report = VerifyReport(label or str(folder), str(source))
    models: dict[str, PreTrainedEncoder] = {}
    with check_row(report, "source", str(source)):
        if source is None:
            raise ExportError(f"{folder}: a merged folder is compared with the adapter it was merged from; give "
                              "--source (without it, verify proves it as a plain HF folder)")
        model = load_any(resolve_source(source, which).model, dtype=torch.float32)
        if not lora.has_lora(model):
            raise ExportError(f"{source}: not a LoRA adapter; a merged folder is compared with its adapter")
        dtype = {name: d for d, name in DTYPE_NAMES.items()}.get(hub.read_config(folder)[0].get("dtype"),
                                                                torch.float32)
        models.update(adapter=model, plain=lora.merged(model).to(dtype))
    if not models:
        if json_path is not None:
            report.write_json(json_path)
        return report
    return check_merged(folder, models["adapter"], models["plain"], str(source), atol=atol, rtol=rtol,
                        json_path=json_path, label=label)


def check_merged(dir: Path, adapter_model: PreTrainedEncoder, merged_model: PreTrainedEncoder, source: str, *,
                 atol: float | None = None, rtol: float | None = None, json_path: Any = None,
                 label: str | None = None) -> VerifyReport:
    """transformers loads merged folder DIR cleanly, its weights are the merge hfport computed (exactly, after the
    dtype's rounding), and it computes what the unmerged adapter model computes."""
    report = VerifyReport(label or str(dir), source)
    with reporting(report, json_path):
        raw, _ = hub.read_config(dir)
        report.set_tolerances(DTYPE_NAMES[merged_model.dtype], atol, rtol)
        task = adapter_model.task
        report.add("config", "config.json", True, detail=f"merged {raw.get('model_type')} {task}")
        with check_row(report, "labels", "id2label/label2id"):
            check_labels(report, raw, adapter_model)
        with check_row(report, "weights", "model.safetensors (merged)"):
            check_weights(report, dir, merged_model)
        theirs, batches = transformers_rows(report, dir, task, raw)
        if theirs is not None:
            compare_models(report, batches, adapter_model, theirs, task, suffix=" (merged vs adapter)")
    return report
