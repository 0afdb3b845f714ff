"""The LoRA layer and what it does to a module tree: wrap linear layers, find them, fold them back in.

Why hfport has its own LoRA layer instead of using peft for training: the layer is ~20 lines, it wraps hfport's
module names (`body.encoder.layers.{i}.attn.q`) on every layout (padded, packed), its parameters go through the same
checkpoints as any other weight (exact resume), and the core keeps no dependency on peft. PEFT's on-disk format is
hfport/formats/adapter.py's; applying, saving and loading adapters on task models is hfport/lora.py's.

    LoraLinear   y = x W^T + b + scaling * B(A(dropout(x))), W and b frozen (the base's own tensors, shared, never
                 copied); A (r x in) kaiming-uniform(a=sqrt(5)) as peft, B (out x r) zeros;
                 scaling = alpha / r (alpha / sqrt(r) with use_rslora)
    wrap         put a LoraLinear around each named linear layer of a module tree
    merged       a copy with B A folded into W (new tensors: a shared base is never written)
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import ConfigError
from .dropout import Dropout


class LoraError(ConfigError):
    """A LoRA setting, an adapter folder or an adapter/base pairing hfport cannot use; the message names it."""


class LoraLinear(nn.Linear):
    """A linear layer plus a low-rank update. `weight` and `bias` are the wrapped layer's own Parameters (kept
    under their names, so key maps and checkpoints see the layer as before); `lora_A.weight`, `lora_B.weight` are
    named as PEFT names them."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0, use_rslora: bool = False):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight  # (out, in), the same Parameter: nothing copied
        self.bias = base.bias
        kw = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_dropout = Dropout(dropout) if dropout > 0 else nn.Identity()  # peft: Identity at 0
        self.lora_A = nn.Linear(self.in_features, r, bias=False, **kw)  # (r, in)
        self.lora_B = nn.Linear(r, self.out_features, bias=False, **kw)  # (out, r)
        self.r, self.alpha, self.use_rslora = r, alpha, use_rslora
        self.scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
        self.reset_lora_parameters()

    @torch.no_grad()
    def reset_lora_parameters(self) -> None:
        if self.lora_A.weight.device.type == "meta":
            return
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # as peft (and nn.Linear's default)
        nn.init.zeros_(self.lora_B.weight)  # the update starts at zero: the model starts as the base

    def forward(self, x: Tensor) -> Tensor:  # (.., in) -> (.., out)
        out = F.linear(x, self.weight, self.bias)
        return out + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def delta_weight(self) -> Tensor:
        """scaling * B A, (out, in), computed in float32."""
        return (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scaling

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, r={self.r}, alpha={self.alpha}"


@dataclass
class AdapterInfo:
    """The adapter on a model: its settings, targets in both namings, the saved head modules and the base."""

    r: int
    alpha: float
    dropout: float
    targets: list[str]  # hfport module paths (body.encoder.layers.0.attn.q, ...)
    peft_targets: list[str]  # PEFT target_modules: shortest HF suffixes that select exactly `targets`
    modules_to_save: list[str]  # the head's HF modules (classifier, pre_classifier, cls, qa_outputs, ...)
    base: str | None = None  # base_model_name_or_path
    use_rslora: bool = False
    folder: str | None = None  # the adapter folder it was loaded from
    extra: dict[str, Any] = field(default_factory=dict)


def lora_modules(model: nn.Module) -> dict[str, LoraLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLinear)}


def has_lora(model: nn.Module) -> bool:
    return getattr(model, "adapter", None) is not None and bool(lora_modules(model))


def wrap(model: nn.Module, names: list[str], r: int, alpha: float, dropout: float, use_rslora: bool) -> None:
    """Replace each named linear layer of `model` (in place) by a LoraLinear around it."""
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, child, LoraLinear(getattr(owner, child), r, alpha, dropout, use_rslora))


@torch.no_grad()
def merged(model: nn.Module) -> nn.Module:
    """A plain copy of `model` with each LoRA update folded in: W' = W + scaling * B A (in float32, then the
    weight's dtype). New tensors: the adapter's model, and any base it shares, stay as they are."""
    if not has_lora(model):
        raise LoraError("merged: the model carries no LoRA adapter")
    out = copy.deepcopy(model)
    for name, layer in lora_modules(out).items():
        plain = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                          device=layer.weight.device, dtype=layer.weight.dtype)
        plain.weight.copy_((layer.weight.float() + layer.delta_weight()).to(layer.weight.dtype))
        if layer.bias is not None:
            plain.bias.copy_(layer.bias)
        parent, _, child = name.rpartition(".")
        setattr(out.get_submodule(parent), child, plain)
    out.adapter = None
    for p in out.parameters():
        p.requires_grad_(False)
    return out
