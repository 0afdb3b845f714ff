"""A LoRA adapter in PEFT's layout: the folder PeftModel.save_pretrained writes and hfport writes the same way.

    adapter_config.json        PEFT's LoraConfig (peft_type LORA, r, lora_alpha, target_modules, task_type, ...)
    adapter_model.safetensors  the LoRA tensors and the saved head modules, under PEFT_PREFIX + transformers' names
    config.json                (hfport's folders; PEFT's have none) the labels and `architectures` of the head

What the folder says is read here: detection, the config (validated: a field hfport cannot compute is refused,
named), the base it names, and its raw task facts (PEFT's task_type, config.json's architectures,
modules_to_save). Which hfport task a PEFT task_type is belongs to the task records (hfport/tasks/): nothing here
maps it.

Where transformers holds a family's modules under other names than it saves (jina-embeddings-v3: `mixer.Wqkv` is
held as `self_attn.q_proj` / `k_proj` / `v_proj`), an adapter peft made over the loaded model uses the in-memory
names: IN_MEMORY_NAMES (registered by the family's file) says which, select_in_memory reads such a folder's targets
and in_memory_lora writes the tensors back under those names.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors import safe_open
from torch import Tensor

from .. import hub
from ..nn.lora import ChunkLoraLinear, LoraError, LoraLinear

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


@dataclass(frozen=True)
class ModuleNames:
    """How transformers names a family's modules in memory where that differs from the layout it saves (its
    conversion_mapping.py): a PEFT adapter made over the loaded transformers model targets and saves the in-memory
    names. `renames` are transformers' WeightRenaming rules on a module name; `splits` its WeightConverter Chunk(dim=0)
    rules: a saved fused module (`mixer.Wqkv`) is held as modules of its equal output-row chunks (q, k, v)."""

    renames: tuple[tuple[str, str], ...] = ()  # (regex, replacement)
    splits: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (saved module's last names, its chunks' last names)

    def in_memory(self, module: str) -> tuple[str, ...]:
        """The in-memory module(s) of a saved module name: one, or one per output-row chunk of a fused module."""
        names: tuple[str, ...] = (module,)
        for leaf, parts in self.splits:
            if suffix_match(module, leaf):
                stem = module[:len(module) - len(leaf)]
                names = tuple(stem + part for part in parts)
                break
        out = []
        for name in names:
            for pattern, replacement in self.renames:
                name = re.sub(pattern, replacement, name)
            out.append(name)
        return tuple(out)


# model_type -> its in-memory names, registered by the family's file (hfport/models/) where transformers renames
IN_MEMORY_NAMES: dict[str, ModuleNames] = {}


def select_in_memory(names: ModuleNames, modules: dict[str, str], targets: str | list[str],
                     folder: str | os.PathLike[str]) -> tuple[list[str], dict[str, tuple[int, tuple[int, ...]]]]:
    """The layers (keys of `modules`: layer -> the module name transformers saves) that target_modules selects on
    transformers' in-memory names, when the folder's tensors are named so (an adapter of peft over a loaded
    transformers model); ([], {}) when they are not. A layer held in memory as row chunks (q/k/v of a fused Wqkv)
    comes with (chunks, the chunks selected): a LoRA per chunk on its rows."""
    with safe_open(str(weights_path(folder)), framework="pt") as f:
        modules_saved = {k.split(".lora_", 1)[0].removeprefix(PEFT_PREFIX) for k in f.keys() if ".lora_" in k}
    chosen: list[str] = []
    chunked: dict[str, tuple[int, tuple[int, ...]]] = {}
    named_so = False  # whether the tensors name any selected layer in memory (else: the saved names' adapter)
    for layer, saved in modules.items():
        parts = names.in_memory(saved)  # one name, or one per row chunk of a fused layer
        hit = tuple(i for i, part in enumerate(parts) if selects(targets, part))
        if hit:
            chosen.append(layer)
            if len(parts) > 1:
                chunked[layer] = (len(parts), hit)
            named_so = named_so or any(parts[i] in modules_saved for i in hit)
    return (chosen, chunked) if named_so else ([], {})


def in_memory_lora(names: ModuleNames, layers: dict[str, LoraLinear]) -> dict[str, Tensor]:
    """PEFT's keys under transformers' in-memory names for LoRA layers keyed by their saved module name (a
    ChunkLoraLinear's blocks as views of its tensors, one pair per adapted chunk)."""
    out: dict[str, Tensor] = {}
    for saved, layer in layers.items():
        parts = names.in_memory(saved)
        if isinstance(layer, ChunkLoraLinear):
            pairs = [(parts[c], *layer.block(j)) for j, c in enumerate(layer.blocks)]
        else:
            pairs = [(parts[0], layer.lora_A.weight, layer.lora_B.weight)]
        for name, a, b in pairs:
            out[f"{PEFT_PREFIX}{name}.lora_A.weight"], out[f"{PEFT_PREFIX}{name}.lora_B.weight"] = a, b
    return out


def weights_path(folder: str | os.PathLike[str]) -> Path:
    """adapter_model.safetensors, its header validated against the file size (safetensors only)."""
    path = Path(folder) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise LoraError(f"{folder}: no {ADAPTER_WEIGHTS} (safetensors only; an adapter_model.bin is not read)")
    hub.read_safetensors_header(path)
    return path


__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "IN_MEMORY_NAMES", "MLM_HEAD_MODULES", "PEFT_PREFIX", "SUPPORTED_VALUES",
           "AdapterFacts", "LoraError", "ModuleNames", "in_memory_lora", "is_adapter_folder", "read_adapter",
           "read_adapter_config", "select_in_memory", "selects", "suffix_match", "weights_path"]
