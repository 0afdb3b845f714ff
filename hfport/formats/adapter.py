"""A LoRA adapter in PEFT's layout: the folder PeftModel.save_pretrained writes and hfport writes the same way.

    adapter_config.json        PEFT's LoraConfig (peft_type LORA, r, lora_alpha, target_modules, task_type, ...)
    adapter_model.safetensors  the LoRA tensors and the saved head modules, under PEFT_PREFIX + transformers' names
    config.json                (hfport's folders; PEFT's have none) the labels and `architectures` of the head

What the folder says is read here: detection, the config (validated: a field hfport cannot compute is refused,
named), the base it names, and its raw task facts (PEFT's task_type, config.json's architectures,
modules_to_save). Which hfport task a PEFT task_type is belongs to the task records (hfport/tasks/): nothing here
maps it.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import hub
from ..nn.lora import LoraError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PeftModel -> LoraModel -> the transformers model
# PEFT config fields hfport computes only at these values (anything else changes the computation): refused, named
SUPPORTED_VALUES: dict[str, tuple[Any, ...]] = {
    "use_dora": (False, None), "bias": ("none", None), "lora_bias": (False, None), "fan_in_fan_out": (False, None),
    "layers_to_transform": (None,), "layers_pattern": (None, [], ""), "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None), "layer_replication": (None,), "target_parameters": (None, []),
    "trainable_token_indices": (None,), "exclude_modules": (None, [], ""), "use_qalora": (False, None),
    "megatron_config": (None,), "use_bdlora": (None, False), "alora_invocation_tokens": (None,)}
# the top-level module names transformers gives a masked-LM head (BERT's cls, RoBERTa's lm_head, DistilBERT's
# vocab_projector, DeBERTa's lm_predictions): PEFT has no masked-LM task_type, so an adapter that saves one of these
# is a fill-mask adapter
MLM_HEAD_MODULES = ("cls", "vocab_projector", "lm_predictions")


def is_adapter_folder(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def read_adapter_config(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """adapter_config.json, refused (naming the field) where hfport cannot compute what PEFT would. The task_type is
    checked against the tasks hfport has by hfport.lora.read_adapter_config (the task records know them)."""
    path = Path(folder) / ADAPTER_CONFIG
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoraError(f"{path}: cannot be read ({e})") from e
    if not isinstance(raw, dict):
        raise LoraError(f"{path}: expected a JSON object")
    if raw.get("peft_type") != "LORA":
        raise LoraError(f"{path}: peft_type {raw.get('peft_type')!r} is not supported; hfport computes LORA adapters "
                        "only")
    for name, allowed in SUPPORTED_VALUES.items():
        if name in raw and raw[name] not in allowed:
            raise LoraError(f"{path}: {name} = {raw[name]!r} is not supported (hfport computes plain LoRA: "
                            f"{name} must be {allowed[0]!r})")
    r = raw.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
        raise LoraError(f"{path}: r must be a positive integer, got {r!r}")
    targets = raw.get("target_modules")
    if not (isinstance(targets, str) or (isinstance(targets, list) and targets and
                                         all(isinstance(t, str) for t in targets))):
        raise LoraError(f"{path}: target_modules must be a list of module names or a regex, got {targets!r}")
    return raw


@dataclass(frozen=True)
class AdapterFacts:
    """What an adapter folder says about its task and base, as written (no hfport task names)."""

    config: dict[str, Any]  # adapter_config.json, validated
    task_type: str | None  # PEFT's task_type (None: a plain PeftModel)
    modules_to_save: list[str]  # the head modules saved whole
    base: str | None  # base_model_name_or_path (None or "" when not recorded)
    model_config: dict[str, Any] | None = None  # config.json beside it (hfport's folders), or None
    model_config_source: str = ""
    architectures: list[Any] = field(default_factory=list)  # config.json's architectures ([] when absent)

    @property
    def saves_mlm_head(self) -> bool:
        return any("lm_head" in m or m in MLM_HEAD_MODULES for m in self.modules_to_save)


def read_adapter(folder: str | os.PathLike[str]) -> AdapterFacts:
    """The adapter folder's config and raw task facts (its config.json, when present, read too)."""
    folder = Path(folder)
    raw = read_adapter_config(folder)
    model_config, source = (hub.read_config(folder) if (folder / "config.json").is_file() else (None, ""))
    return AdapterFacts(config=raw, task_type=raw.get("task_type"), modules_to_save=list(raw.get("modules_to_save")
                                                                                          or []),
                        base=raw.get("base_model_name_or_path"), model_config=model_config,
                        model_config_source=source,
                        architectures=list((model_config or {}).get("architectures") or []))


def suffix_match(name: str, target: str) -> bool:
    """PEFT's rule for a target_modules entry: the module's name is it, or ends with '.' + it."""
    return name == target or name.endswith("." + target)


def selects(target_modules: str | list[str], module: str) -> bool:
    """Whether PEFT wraps `module` (a transformers module name) under target_modules: a regex (full match) or a
    list of names matched by suffix_match."""
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, module) is not None
    return any(suffix_match(module, t) for t in target_modules)


def weights_path(folder: str | os.PathLike[str]) -> Path:
    """adapter_model.safetensors, its header validated against the file size (safetensors only)."""
    path = Path(folder) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise LoraError(f"{folder}: no {ADAPTER_WEIGHTS} (safetensors only; an adapter_model.bin is not read)")
    hub.read_safetensors_header(path)
    return path


__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "MLM_HEAD_MODULES", "PEFT_PREFIX", "SUPPORTED_VALUES", "AdapterFacts",
           "LoraError", "is_adapter_folder", "read_adapter", "read_adapter_config", "selects", "suffix_match",
           "weights_path"]
