"""transformers' TrainingArguments names in a fine-tune config (files, --set, the HTTP job body): the one table of
them, each stored under hfport's name with the defaulting transformers derives from it (TrainingArguments'
__post_init__, the Trainer's optimizer and scheduler), refused by name where hfport has no such thing (saying why);
and the "did you mean" of an unknown key (the closest valid names, not all of them).

What transformers derives from an option (load_best_model_at_end picks the eval loss when no metric is named;
optim sgd has no momentum) is `implied`: it sits below every value given, in any file or flag, so a value the user
names always wins, as it does in transformers."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

ANY: Any = object()  # Alias.only's default: no value is hfport's behaviour already


@dataclass(frozen=True)
class Alias:
    """A TrainingArguments name: `field` is hfport's (None: refused, `why` says why); `value` turns transformers'
    value into hfport's; `only` (with field None): the values that are hfport's behaviour already, accepted as a
    no-op (why says so), any other refused; `implied`: {hfport field: value} that transformers derives from the
    given value, used where nothing names that field; `expand` (with field None): the value as several hfport
    fields (lr_scheduler_kwargs)."""

    field: str | None
    why: str = ""
    value: Callable[[Any], Any] | None = None
    only: Any = ANY
    implied: Callable[[Any], dict[str, Any]] | None = None
    expand: Callable[[Any], dict[str, Any]] | None = None


def _optim(v: Any) -> Any:
    return {"adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_hf": "adamw"}.get(v, v)


def _optim_implies(v: Any) -> dict[str, Any]:
    # transformers builds torch's SGD with the learning rate alone (momentum only through optim_args): no momentum,
    # where hfport's own sgd defaults to 0.9
    return {"momentum": 0.0} if v == "sgd" else {}


def _metric(v: Any) -> Any:
    return v.removeprefix("eval_") if isinstance(v, str) else v  # transformers accepts both accuracy and eval_accuracy


def _mode(v: Any) -> Any:
    return ("max" if v else "min") if isinstance(v, bool) else v


def _resume(v: Any) -> Any:
    return "latest" if v is True else None if v is False else v


def _best_at_end_implies(v: Any) -> dict[str, Any]:
    # TrainingArguments.__post_init__: load_best_model_at_end without metric_for_best_model picks the eval loss
    # (minimised unless greater_is_better says otherwise), not the task's metric
    return {"metric": "loss"} if v is True else {}


SCHEDULER_KWARGS = {"factor": "plateau_factor", "patience": "plateau_patience"}  # ReduceLROnPlateau's


def _scheduler_kwargs(v: Any) -> dict[str, Any]:
    """lr_scheduler_kwargs: torch's ReduceLROnPlateau factor and patience, the scheduler options hfport has."""
    if not isinstance(v, dict):
        raise ValueError(f"lr_scheduler_kwargs: expected a mapping, got {v!r}")
    other = sorted(set(v) - set(SCHEDULER_KWARGS))
    if other:
        raise ValueError(f"lr_scheduler_kwargs: {other} have no hfport equivalent; hfport takes "
                         f"{sorted(SCHEDULER_KWARGS)} (the plateau schedules' {list(SCHEDULER_KWARGS.values())})")
    return {SCHEDULER_KWARGS[k]: value for k, value in v.items()}


ALIASES: dict[str, Alias] = {
    "learning_rate": Alias("lr"),
    "num_train_epochs": Alias("epochs"),
    "per_device_train_batch_size": Alias("batch_size"),
    "gradient_accumulation_steps": Alias("grad_accum"),
    "lr_scheduler_type": Alias("scheduler"),  # hfport's schedules carry transformers' names and meanings
    "lr_scheduler_kwargs": Alias(None, "of torch's ReduceLROnPlateau's options hfport takes factor and patience "
                                       "(plateau_factor, plateau_patience)", expand=_scheduler_kwargs),
    "metric_for_best_model": Alias("metric", value=_metric),
    "greater_is_better": Alias("metric_mode", value=_mode),
    "label_smoothing_factor": Alias("label_smoothing"),
    "adam_epsilon": Alias("adam_eps"),
    "optim": Alias("optimizer", value=_optim, implied=_optim_implies),
    "activation_checkpointing": Alias("gradient_checkpointing"),  # transformers 5's name for it
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
                                    only=(True,), implied=_best_at_end_implies),
    "save_safetensors": Alias(None, "hfport writes safetensors only", only=(True,)),
    # no hfport meaning
    "per_device_eval_batch_size": Alias(None, "hfport evaluates in batches of batch_size (and max_batch_tokens)"),
    # the values TrainingArguments.to_dict() writes by default are hfport's behaviour already: accepted
    "logging_strategy": Alias(None, "hfport logs the training loss every logging_steps optimizer steps",
                              only=("steps",)),
    "dataloader_num_workers": Alias(None, "hfport tokenizes the data once before training; there is no DataLoader",
                                    only=(0,)),
    "push_to_hub": Alias(None, "hfport uploads nothing; `hfport export` writes a folder the Hub takes",
                         only=(False,)),
    "hub_model_id": Alias(None, "hfport uploads nothing; `hfport export` writes a folder the Hub takes",
                          only=(None,)),
    "deepspeed": Alias(None, "hfport distributes with `accelerate launch` (DDP)", only=(None,)),
    "fsdp": Alias(None, "hfport distributes with `accelerate launch` (DDP)", only=("", None, [])),
    "use_cpu": Alias(None, "hfport trains on the GPU when there is one; CUDA_VISIBLE_DEVICES= keeps it on the CPU",
                     only=(False,)),
    "auto_find_batch_size": Alias(None, "set batch_size (and max_batch_tokens for a token budget)", only=(False,)),
    "eval_accumulation_steps": Alias(None, "hfport gathers evaluation rows per batch; there is nothing to "
                                           "accumulate", only=(None,)),
    "label_names": Alias(None, "the label's column is label_column (tags_column, answers_column... by task)",
                         only=(None,)),
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


def _accepted(value: Any, only: Any) -> bool:
    """VALUE is one of ONLY, by type too (push_to_hub: 0 is no False)."""
    return only is not ANY and any(value == o and type(value) is type(o) for o in only)


def translate(values: dict[str, Any], valid: Iterable[str], keep_unknown: bool = False,
              renamed: dict[str, str] | None = None, implied: dict[str, Any] | None = None) -> dict[str, Any]:
    """`values` with every alias stored under hfport's name (`renamed`, when given, gets {hfport name: the names
    given}, so an error about a value can name the key the user wrote). What transformers derives from an alias
    (Alias.implied) goes into `implied` when given, for the caller to put below every origin's values; without it,
    it fills the fields `values` leaves out. Raises ValueError naming the key: a refused alias (with why), an alias
    given beside its hfport name, or an unknown key (with the closest valid names; with keep_unknown it stays, for
    the model's own check, which reports it beside the other fields' problems)."""
    valid = set(valid)
    out = {k: v for k, v in values.items() if k in valid or (keep_unknown and k not in ALIASES)}
    unknown = sorted(k for k in values if k not in valid and k not in ALIASES)
    if unknown and not keep_unknown:
        raise ValueError("; ".join(f"unknown option {k!r}; {did_you_mean(k, valid)}" for k in unknown))
    grouped: dict[str, dict[str, Any]] = {}
    derived: dict[str, Any] = {}
    for key in (k for k in values if k in ALIASES):
        alias, value = ALIASES[key], values[key]
        if alias.implied is not None:
            derived.update(alias.implied(value))
        if alias.field is None and alias.expand is not None:
            for name, v in alias.expand(value).items():
                grouped.setdefault(name, {})[key] = v
            continue
        if alias.field is None:
            if _accepted(value, alias.only):
                continue  # hfport's behaviour already
            raise ValueError(f"{key}: transformers' option has no hfport equivalent ({alias.why})"
                             if alias.only is ANY else f"{key}={value!r}: not possible, {alias.why}")
        grouped.setdefault(alias.field, {})[key] = alias.value(value) if alias.value else value
    for name, given in grouped.items():
        if name in out:
            raise ValueError(f"{' and '.join(given)} and {name} are the same option (transformers' and hfport's "
                             "name); give one")
        if renamed is not None:
            renamed[name] = " and ".join(given)
        if name in COMBINED:
            out[name] = COMBINED[name](given)
        else:
            out[name] = next(iter(given.values()))
    if implied is not None:
        implied.update(derived)
    else:
        out = {**derived, **out}
    return out


def did_you_mean(key: str, valid: Iterable[str]) -> str:
    """"did you mean lr (transformers: learning_rate)?" from the valid names and the aliases; where nothing is
    close, where to find the options (their list is too long to print whole)."""
    valid = set(valid)
    names = {name: name for name in valid}
    names.update({a: f"{ALIASES[a].field} (transformers: {a})" for a in ALIASES if ALIASES[a].field})
    close = difflib.get_close_matches(key, list(names), n=3, cutoff=0.6)
    offered: dict[str, str] = {}  # one suggestion a field: its own name when that matched, else its alias
    for c in close:
        field = c if c in valid else ALIASES[c].field
        if field not in offered or c == field:
            offered[field] = names[c]
    return f"did you mean {', '.join(offered.values())}?" if close else \
        "the options are FinetuneConfig's fields (`hfport finetune ... --print-config` lists them)"
