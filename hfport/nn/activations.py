"""Activations by their config.json names, computed exactly as transformers computes them."""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _gelu_tanh_python(x: Tensor) -> Tensor:  # gelu_new: BERT/GPT's tanh form, written out
    return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * torch.pow(x, 3.0))))


def _gelu_fast(x: Tensor) -> Tensor:
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def _laplace(x: Tensor, mu: float = 0.707107, sigma: float = 0.282095) -> Tensor:
    return 0.5 * (1.0 + torch.erf((x - mu).div(sigma * math.sqrt(2.0))))


ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "gelu": F.gelu,
    "gelu_python": lambda x: x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0))),
    "gelu_new": _gelu_tanh_python,
    "gelu_accurate": _gelu_tanh_python,
    "gelu_python_tanh": _gelu_tanh_python,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": _gelu_fast,
    "gelu_10": lambda x: torch.clip(F.gelu(x), -10, 10),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu,
    "relu6": F.relu6,
    "relu2": lambda x: torch.square(F.relu(x)),
    "leaky_relu": F.leaky_relu,
    "silu": F.silu,
    "swish": F.silu,
    "mish": F.mish,
    "hardswish": F.hardswish,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "linear": lambda x: x,
    "laplace": _laplace,
    "sqrtsoftplus": lambda x: F.softplus(x).sqrt(),
}
# Not offered: "prelu" and "xielu" carry learnable parameters of their own, which no encoder checkpoint of these
# families uses; asking for them is a config error that lists the names above.


class Activation(torch.nn.Module):
    """A named activation as a module, so it shows up in `print(model)`."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self.fn = ACTIVATIONS[name]

    def forward(self, x: Tensor) -> Tensor:
        return self.fn(x)

    def extra_repr(self) -> str:
        return self.name
