"""Optimizer, learning-rate schedules and freezing, built from a FinetuneConfig."""

from __future__ import annotations

import inspect
import math
import re
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from .config import PLATEAU_DEFAULTS

_LAYER = re.compile(r"^body\.encoder\.(?:layers|groups)\.(\d+)\.")
# transformers' Trainer.get_decay_parameter_names, read on a parameter's HF name (lowercased), as it reads the
# transformers model's: besides everything inside a LayerNorm, no decay for biases (MPNet's relative_attention_bias
# table too) and norms (EuroBERT's RMSNorm weights)
NO_DECAY = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")


def freeze(model: Any, prefixes: list[str]) -> list[str]:
    """Freeze parameters whose hfport or HF name starts with one of `prefixes`; returns the frozen names.
    `embeddings`, `encoder.layer.0` (HF) and `body.encoder.layers.0` (hfport) all work."""
    if not prefixes:
        return []
    hf_names = model.hf_names()
    family_prefix = model.family.prefix + "."
    frozen, used = [], set()
    for name, p in model.named_parameters():
        hf = hf_names[name]
        candidates = {name, name.split(".", 1)[1], hf, hf.removeprefix(family_prefix)}
        for prefix in prefixes:
            if any(c == prefix or c.startswith(prefix.rstrip(".") + ".") for c in candidates):
                p.requires_grad_(False)
                frozen.append(name)
                used.add(prefix)
                break
    unused = [p for p in prefixes if p not in used]
    if unused:
        examples = sorted({n.split(".")[0] + "." + n.split(".")[1] for n in hf_names.values()})[:8]
        raise ConfigError(f"freeze: prefix(es) {unused} match no parameter; names look like {examples}")
    return frozen


def build_optimizer(model: nn.Module, config: Any) -> torch.optim.Optimizer:
    """AdamW (default) or SGD. No weight decay where transformers' Trainer has none (biases, norms: NO_DECAY);
    optional layer-wise lr decay (lr * decay^(distance from the top), embeddings lowest, head and pooler at the full
    lr)."""
    hf_names = model.hf_names() if hasattr(model, "hf_names") else {}
    no_decay = set()
    for module_name, module in model.named_modules():
        for pname, _ in module.named_parameters(recurse=False):
            full = f"{module_name}.{pname}" if module_name else pname
            if isinstance(module, nn.LayerNorm) or NO_DECAY.search(hf_names.get(full, full).lower()):
                no_decay.add(full)
    depths: dict[str, int] = {}
    for name, _ in model.named_parameters():
        m = _LAYER.match(name)
        depths[name] = int(m.group(1)) + 1 if m else 0 if name.startswith("body.embeddings.") else -1
    top = max(depths.values()) + 1
    groups: dict[tuple[float, float], list[nn.Parameter]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        depth = top if depths[name] < 0 else depths[name]
        lr = config.lr * config.layer_lr_decay ** (top - depth)
        wd = 0.0 if name in no_decay else config.weight_decay
        groups.setdefault((lr, wd), []).append(p)
    if not groups:
        raise ConfigError("every parameter is frozen; nothing to train")
    param_groups = [{"params": ps, "lr": lr, "weight_decay": wd} for (lr, wd), ps in groups.items()]
    fused = use_fused(config, [p for ps in groups.values() for p in ps])
    if config.optimizer == "sgd":
        return torch.optim.SGD(param_groups, lr=config.lr, momentum=config.momentum)
    extra = {"fused": True} if fused else {}  # else torch's default (foreach on GPU, the loop on CPU)
    return torch.optim.AdamW(param_groups, lr=config.lr, betas=tuple(config.adam_betas), eps=config.adam_eps,
                             **extra)


FUSED_DEVICES = {"cpu", "cuda"}  # where torch (>= 2.4) has AdamW's fused kernel


def use_fused(config: Any, params: list[nn.Parameter]) -> bool:
    """fused_optimizer: auto -> AdamW's fused kernel when every trained parameter is on one device type that has
    it (CPU or CUDA): one pass over each tensor instead of several (measured 5x faster per step on the CPU for a
    23M-parameter model, the same result to ~1e-7 after 20 steps); on -> insist, with an error naming the field;
    off -> never. transformers' Trainer also defaults to the fused AdamW."""
    choice = config.fused_optimizer
    if choice == "off":
        return False
    if config.optimizer != "adamw":
        if choice == "on":
            raise ConfigError(f"fused_optimizer: 'on' applies to the adamw optimizer, not {config.optimizer!r}; "
                              "use 'auto' or 'off'")
        return False
    devices = sorted({p.device.type for p in params})
    supported = "fused" in inspect.signature(torch.optim.AdamW).parameters
    if supported and len(devices) == 1 and devices[0] in FUSED_DEVICES:
        return True
    if choice == "on":
        why = "this torch has no fused AdamW" if not supported else f"the parameters are on {', '.join(devices)}"
        raise ConfigError(f"fused_optimizer: 'on' needs every trained parameter on one CPU or CUDA device and a "
                          f"torch with fused AdamW ({why}); use 'auto' or 'off'")
    return False


def warmup_steps(config: Any, total_steps: int) -> int:
    """transformers' TrainingArguments.get_warmup_steps: warmup_steps (below 1: a fraction of the steps), else
    warmup_ratio of the steps, rounded up."""
    given = config.warmup_steps
    if given >= 1:
        return int(given)
    return math.ceil((given if given > 0 else config.warmup_ratio) * total_steps)


def warmup_factor(step: int, warmup: int) -> float:
    """transformers' linear warmup: from 0 at step 0 to the peak at step `warmup`."""
    return step / max(1, warmup)


PLATEAU_THRESHOLD = 1e-4  # torch's ReduceLROnPlateau: a relative improvement smaller than this is a stall
PLATEAU_EPS = 1e-8  # ... and a cut smaller than this is not made


class PlateauWithWarmup:
    """Linear warmup (transformers'), then torch's ReduceLROnPlateau (mode from the metric, threshold 1e-4 relative,
    eps 1e-8, no cooldown, no floor): each group's lr is multiplied by `factor` once the eval metric has not improved
    for more than `patience` evaluations. Without warmup it steps exactly as transformers' reduce_lr_on_plateau
    schedule, whose ReduceLROnPlateau hears the same metric."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup: int, factor: float, patience: int, mode: str):
        self.optimizer, self.warmup, self.factor, self.patience, self.mode = optimizer, warmup, factor, patience, mode
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]
        self.lrs = list(self.base_lrs)  # each group's lr after the cuts so far, before the warmup's factor
        self.step_count, self.bad_evals, self.best = 0, 0, None
        self._apply()

    def _apply(self) -> None:
        warm = warmup_factor(self.step_count, self.warmup) if self.step_count < self.warmup else 1.0
        for group, lr in zip(self.optimizer.param_groups, self.lrs):
            group["lr"] = lr * warm

    def step(self) -> None:
        self.step_count += 1
        self._apply()

    def _better(self, value: float) -> bool:
        if self.best is None:
            return value == value  # nan never improves (torch: nan < inf is false)
        if self.mode == "max":
            return value > self.best * (1.0 + PLATEAU_THRESHOLD)
        return value < self.best * (1.0 - PLATEAU_THRESHOLD)

    def on_eval(self, value: float) -> None:
        if self._better(value):
            self.best, self.bad_evals = value, 0
        else:
            self.bad_evals += 1
        if self.bad_evals > self.patience:
            self.lrs = [lr * self.factor if lr - lr * self.factor > PLATEAU_EPS else lr for lr in self.lrs]
            self.bad_evals = 0
            self._apply()

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("base_lrs", "lrs", "step_count", "bad_evals", "best")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        if "cuts" in state:  # a checkpoint from before the per-group lrs: its cuts applied to the base lrs
            cuts = state.pop("cuts")
            state["lrs"] = [lr * self.factor ** cuts for lr in state["base_lrs"]]
        for k, v in state.items():
            setattr(self, k, v)
        self._apply()


def build_scheduler(optimizer: torch.optim.Optimizer, config: Any, total_steps: int, metric_mode: str) -> Any:
    """Stepped once per optimizer step (the plateau schedules also hear every eval). linear, cosine, constant and
    constant_with_warmup are transformers' curves (get_scheduler), step for step."""
    warm = warmup_steps(config, total_steps)
    if config.scheduler in PLATEAU_DEFAULTS:
        factor, patience = PLATEAU_DEFAULTS[config.scheduler]
        return PlateauWithWarmup(optimizer, warm,
                                 config.plateau_factor if config.plateau_factor is not None else factor,
                                 config.plateau_patience if config.plateau_patience is not None else patience,
                                 metric_mode)
    if config.scheduler == "one_cycle":
        return torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=[g["lr"] for g in optimizer.param_groups], total_steps=max(total_steps, 2),
            pct_start=warm / total_steps if warm else 0.3, anneal_strategy="cos")

    def factor(step: int) -> float:
        if step < warm:  # constant has none: the config refuses a warmup with it
            return warmup_factor(step, warm)
        if config.scheduler in ("constant", "constant_with_warmup"):
            return 1.0
        if config.scheduler == "cosine":  # transformers' num_cycles 0.5: half a cosine, down to 0 at the end
            progress = (step - warm) / max(1, total_steps - warm)
            return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
        return max(0.0, (total_steps - step) / max(1, total_steps - warm))  # linear, as transformers writes it

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
