"""transformers' TrainingArguments names in a fine-tune config (files, --set, the HTTP job body): the one table of
them, each stored under hfport's name, refused by name where hfport has no such thing (saying why); and the
"did you mean" of an unknown key (the closest valid names, not all of them)."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Alias:
    """A TrainingArguments name: `field` is hfport's (None: refused, `why` says why); `value` turns transformers'
    value into hfport's; `only` (with field None): the one value that is hfport's behaviour already, accepted as a
    no-op (why says so), any other refused."""

    field: str | None
    why: str = ""
    value: Callable[[Any], Any] | None = None
    only: Any = None


def _scheduler(v: Any) -> Any:
    # hfport's schedules all warm up first (warmup_steps/warmup_ratio); the rest of transformers' names are refused
    # by the field's own check, which lists hfport's
    return {"constant_with_warmup": "constant", "reduce_lr_on_plateau": "plateau"}.get(v, v)


def _optim(v: Any) -> Any:
    return {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_hf": "adamw"}.get(v, v)


def _metric(v: Any) -> Any:
    return v.removeprefix("eval_") if isinstance(v, str) else v  # transformers accepts both accuracy and eval_accuracy


def _mode(v: Any) -> Any:
    return ("max" if v else "min") if isinstance(v, bool) else v


def _resume(v: Any) -> Any:
    return "latest" if v is True else None if v is False else v


ALIASES: dict[str, Alias] = {
    "learning_rate": Alias("lr"),
    "num_train_epochs": Alias("epochs"),
    "per_device_train_batch_size": Alias("batch_size"),
    "gradient_accumulation_steps": Alias("grad_accum"),
    "lr_scheduler_type": Alias("scheduler", value=_scheduler),
    "metric_for_best_model": Alias("metric", value=_metric),
    "greater_is_better": Alias("metric_mode", value=_mode),
    "label_smoothing_factor": Alias("label_smoothing"),
    "adam_epsilon": Alias("adam_eps"),
    "optim": Alias("optimizer", value=_optim),
    "evaluation_strategy": Alias("eval_strategy"),
    "torch_compile": Alias("compile"),
    "overwrite_output_dir": Alias("overwrite"),
    "resume_from_checkpoint": Alias("resume", value=_resume),
    # several names, one field: merged by COMBINED below
    "bf16": Alias("precision"),
    "fp16": Alias("precision"),
    "adam_beta1": Alias("adam_betas"),
    "adam_beta2": Alias("adam_betas"),
    # what hfport always does
    "load_best_model_at_end": Alias(None, "hfport always keeps the best model in best/ and the last in final/",
                                    only=True),
    "save_safetensors": Alias(None, "hfport writes safetensors only", only=True),
    # no hfport meaning
    "per_device_eval_batch_size": Alias(None, "hfport evaluates in batches of batch_size (and max_batch_tokens)"),
    "logging_strategy": Alias(None, "hfport logs the training loss every logging_steps optimizer steps"),
    "dataloader_num_workers": Alias(None, "hfport tokenizes the data once before training; there is no DataLoader"),
    "push_to_hub": Alias(None, "hfport uploads nothing; `hfport export` writes a folder the Hub takes"),
    "hub_model_id": Alias(None, "hfport uploads nothing; `hfport export` writes a folder the Hub takes"),
    "deepspeed": Alias(None, "hfport distributes with `accelerate launch` (DDP)"),
    "fsdp": Alias(None, "hfport distributes with `accelerate launch` (DDP)"),
    "use_cpu": Alias(None, "hfport trains on the GPU when there is one; CUDA_VISIBLE_DEVICES= keeps it on the CPU"),
    "auto_find_batch_size": Alias(None, "set batch_size (and max_batch_tokens for a token budget)"),
    "eval_accumulation_steps": Alias(None, "hfport gathers evaluation rows per batch; there is nothing to "
                                           "accumulate"),
    "label_names": Alias(None, "the label's column is label_column (tags_column, answers_column... by task)"),
}


def _precision(given: dict[str, Any]) -> Any:
    """bf16/fp16 as transformers reads them: the one that is true; both false (or one false alone) is fp32."""
    on = [k for k, v in given.items() if v]
    if len(on) > 1:
        raise ValueError("bf16 and fp16 are both true; choose one")
    return on[0] if on else "fp32"


def _betas(given: dict[str, Any]) -> Any:
    return (given.get("adam_beta1", 0.9), given.get("adam_beta2", 0.999))  # transformers' defaults for the other


COMBINED: dict[str, Callable[[dict[str, Any]], Any]] = {"precision": _precision, "adam_betas": _betas}


def translate(values: dict[str, Any], valid: Iterable[str], keep_unknown: bool = False,
              renamed: dict[str, str] | None = None) -> dict[str, Any]:
    """`values` with every alias stored under hfport's name (`renamed`, when given, gets {hfport name: the names
    given}, so an error about a value can name the key the user wrote). Raises ValueError naming the key: a refused
    alias (with why), an alias given beside its hfport name, or an unknown key (with the closest valid names; with
    keep_unknown it stays, for the model's own check, which reports it beside the other fields' problems)."""
    valid = set(valid)
    out = {k: v for k, v in values.items() if k in valid or (keep_unknown and k not in ALIASES)}
    unknown = sorted(k for k in values if k not in valid and k not in ALIASES)
    if unknown and not keep_unknown:
        raise ValueError("; ".join(f"unknown option {k!r}; {did_you_mean(k, valid)}" for k in unknown))
    grouped: dict[str, dict[str, Any]] = {}
    for key in (k for k in values if k in ALIASES):
        alias, value = ALIASES[key], values[key]
        if alias.field is None:
            if alias.only is not None and value == alias.only:
                continue  # hfport's behaviour already
            raise ValueError(f"{key}: transformers' option has no hfport equivalent ({alias.why})"
                             if alias.only is None else f"{key}={value!r}: not possible, {alias.why}")
        if alias.field in out:
            raise ValueError(f"{key} and {alias.field} are the same option (transformers' and hfport's name); "
                             "give one")
        grouped.setdefault(alias.field, {})[key] = alias.value(value) if alias.value else value
    for name, given in grouped.items():
        if renamed is not None:
            renamed[name] = " and ".join(given)
        if name in COMBINED:
            out[name] = COMBINED[name](given)
        else:
            out[name] = next(iter(given.values()))
    return out


def did_you_mean(key: str, valid: Iterable[str]) -> str:
    """"did you mean lr (transformers: learning_rate)?" from the valid names and the aliases; where nothing is
    close, where to find the options (their list is too long to print whole)."""
    valid = set(valid)
    names = {name: name for name in valid}
    names.update({a: f"{ALIASES[a].field} (transformers: {a})" for a in ALIASES if ALIASES[a].field})
    close = difflib.get_close_matches(key, list(names), n=3, cutoff=0.6)
    return f"did you mean {', '.join(dict.fromkeys(names[c] for c in close))}?" if close else \
        "the options are FinetuneConfig's fields (`hfport finetune ... --print-config` lists them)"
