"""Dropout with torch's distribution and torch's arithmetic, its keep-mask drawn as `rand >= p` on the CPU.

torch's CPU dropout draws its keep-mask with bernoulli_, which took a quarter of a bf16 MiniLM fine-tune step on a
2-core AVX512 CPU (714 of 2,773 ms over three batches of 16 rows of 8..256 tokens: attention probabilities are
dropped too, H * L^2 values per sequence and layer). A uniform draw compared with p gives the same Bernoulli(1 - p)
keep-mask at under half the cost (1.9M values: 5.9 ms against 14.5 ms). Kept values are x * keep * (1 / (1 - p)),
bit for bit what torch's native_dropout_backward computes on that mask, and autograd's gradient of that product is
(grad * scale) * keep: the same values, signed zeros included (tests/test_nn_blocks.py). The masks come from torch's
generator, so a seed, checkpointing's and GradCache's replays and exact resume behave as with torch's dropout; the
values drawn differ from torch's bernoulli_, as any two libraries' dropout masks do. Other devices keep torch's
kernel (CUDA's is fused and fast).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """F.dropout(x, p, training), the mask drawn as torch.rand(x.shape) >= p on the CPU (module docstring)."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu" or p >= 1.0:
        return F.dropout(x, p, training)
    keep = torch.rand(x.shape, device=x.device) >= p  # (..) bool, P(keep) = 1 - p; float32 draws as torch.rand's
    return x * keep * (1.0 / (1.0 - p))


class Dropout(nn.Dropout):
    """nn.Dropout (same constructor, repr and module type) drawing its mask as `dropout` does."""

    def forward(self, x: Tensor) -> Tensor:
        if self.inplace:
            return super().forward(x)
        return dropout(x, self.p, self.training)
