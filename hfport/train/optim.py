"""Optimizer, learning-rate schedules and freezing, built from a FinetuneConfig."""

from __future__ import annotations

import inspect
import math
import re
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError

_LAYER = re.compile(r"^body\.encoder\.(?:layers|groups)\.(\d+)\.")


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
    """AdamW (default) or SGD. No weight decay on biases and LayerNorm weights; optional layer-wise lr decay
    (lr * decay^(distance from the top), embeddings lowest, head and pooler at the full lr)."""
    no_decay = set()
    for module_name, module in model.named_modules():
        for pname, _ in module.named_parameters(recurse=False):
            full = f"{module_name}.{pname}" if module_name else pname
            if isinstance(module, nn.LayerNorm) or pname == "bias":
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
    return config.warmup_steps if config.warmup_steps > 0 else math.ceil(config.warmup_ratio * total_steps)


class PlateauWithWarmup:
    """Linear warmup, then the lr is cut by `factor` whenever the eval metric stalls for `patience` evals."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup: int, factor: float, patience: int, mode: str):
        self.optimizer, self.warmup, self.factor, self.patience, self.mode = optimizer, warmup, factor, patience, mode
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]
        self.step_count, self.cuts, self.bad_evals, self.best = 0, 0, 0, None
        self._apply()

    def _apply(self) -> None:
        warm = min(1.0, (self.step_count + 1) / self.warmup) if self.warmup else 1.0
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * warm * self.factor ** self.cuts

    def step(self) -> None:
        self.step_count += 1
        self._apply()

    def on_eval(self, value: float) -> None:
        better = self.best is None or (value > self.best if self.mode == "max" else value < self.best)
        if better:
            self.best, self.bad_evals = value, 0
        else:
            self.bad_evals += 1
            if self.bad_evals > self.patience:
                self.cuts, self.bad_evals = self.cuts + 1, 0
                self._apply()

    def get_last_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("base_lrs", "step_count", "cuts", "bad_evals", "best")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            setattr(self, k, v)
        self._apply()


def build_scheduler(optimizer: torch.optim.Optimizer, config: Any, total_steps: int, metric_mode: str) -> Any:
    """Stepped once per optimizer step (plateau also hears every eval)."""
    warm = warmup_steps(config, total_steps)
    if config.scheduler == "plateau":
        return PlateauWithWarmup(optimizer, warm, config.plateau_factor, config.plateau_patience, metric_mode)
    if config.scheduler == "one_cycle":
        return torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=[g["lr"] for g in optimizer.param_groups], total_steps=max(total_steps, 2),
            pct_start=warm / total_steps if warm else 0.3, anneal_strategy="cos")

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm  # the first step already trains at a small, non-zero lr
        if config.scheduler == "constant":
            return 1.0
        progress = (step - warm) / max(1, total_steps - warm)
        if config.scheduler == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return max(0.0, 1.0 - progress)  # linear

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
