"""An experiment, not an engine path: would a fused int8 feed-forward lift hfport's int8 engine on MiniLM?

    python scripts/bench_int8_fused_ffn.py [--texts 1000] [--batch-size 32] [--rounds 9] [--threads 2]

oneDNN's int8 Linear can write its output as uint8 at a static scale with GELU fused (qlinear_pointwise(...,
torch.uint8, "gelu")): the down projection's input directly, with no GELU pass and no quantization pass between the
two products. Every FeedForward of the real all-MiniLM-L6-v2, quantized as dtype="int8" quantizes it (static scales,
bf16 float parts, float weights for calls of < 128 rows), is replaced by one of two timing models:

  bound   up -> uint8 with GELU -> down, the outlier channels dropped: a wrong model (its cosine says so), the bound
          of what the fusion can earn
  carried what carrying the outliers would cost: the up projection's input widened by EXTRA uint8 columns (an outlier
          value split into saturated copies of the range's end plus one rounded remainder; the copies' weights are
          zero here: the cost, not the math), and the down projection's outlier channels recomputed in float from
          the up projection's input (a (M, C) @ (C, k) product, GELU, and (M, k) @ (k, C) added)

and timed against hfport's bf16 and its int8 engine as it is, every model over every batch each round, the order
rotating (bench_int8_static.py's harness). Printed: texts/s median, the ratio to bf16 per round (median [range]) and
the least cosine of mean-pooled embeddings against fp32. docs/benchmarks.md has a quiet run's figures and why the
fusion was not built.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_int8_static as B  # noqa: E402

from hfport.nn.int8 import FLOAT_BELOW_ROWS, quantize_tensor_u8  # noqa: E402
from hfport.nn.layers import FeedForward  # noqa: E402

EXTRA = 16  # uint8 columns added for the up projection's outlier channels (MiniLM: 3-5 outliers of up to ~6 ranges)


class Bound(torch.nn.Module):
    """up -> uint8 with GELU (one oneDNN call) -> down; outliers dropped (module docstring)."""

    def __init__(self, ff: FeedForward):
        super().__init__()
        self.up, self.down = ff.up, ff.down
        self.mid = ff.down.static_params()  # the down projection's calibrated input scale and zero point

    def small(self, x: torch.Tensor) -> bool:
        return x.numel() < FLOAT_BELOW_ROWS * self.up.in_features

    def forward(self, x: torch.Tensor, adapters=None) -> torch.Tensor:
        if self.small(x):
            return self.down(F.gelu(self.up(x)))
        shape = x.shape  # (.., C)
        q, s, z, _ = self.up.quantize_input(x)  # (M, C) uint8
        w, wz = self.up.packed()
        h = torch.ops.onednn.qlinear_pointwise(q, s, z, w, self.up.weight_scale, wz, self.up.bias,
                                               self.mid[0], self.mid[1], torch.uint8, "gelu", [], "none")  # (M, I)
        return self.product_down(h, x).reshape(*shape[:-1], -1)

    def product_down(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        w, wz = self.down.packed()
        return torch.ops.onednn.qlinear_pointwise(h, self.mid[0], self.mid[1], w, self.down.weight_scale, wz,
                                                  self.down.bias, 1.0, 0, x.dtype, "none", [], "")  # (M, C)


class Carried(Bound):
    """Bound plus what carrying the outliers costs (module docstring): timing only."""

    def __init__(self, ff: FeedForward):
        super().__init__(ff)
        c, i = ff.up.in_features, ff.up.out_features
        wide = torch.zeros(i, c + EXTRA, dtype=torch.int8)  # (I, C + EXTRA)
        wide[:, :c] = ff.up.weight_t.t()
        self.wide = torch.ops.onednn.qlinear_prepack(wide, None)
        self.wide_zp = torch.zeros(i, dtype=torch.long)
        k = len(ff.down.outliers)
        self.up_rows = torch.randn(k, c).bfloat16()  # (k, C): the up projection's rows of the down's outliers
        self.up_bias = torch.randn(k).bfloat16()

    def forward(self, x: torch.Tensor, adapters=None) -> torch.Tensor:
        if self.small(x):
            return self.down(F.gelu(self.up(x)))
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # (M, C)
        m, c = x2.shape
        s, z = self.up.static_params()
        q = torch.empty(m, c + EXTRA, dtype=torch.uint8)  # (M, C + EXTRA)
        q[:, :c] = quantize_tensor_u8(x2, self.up.outliers, (s, z))[0]
        kept = x2[:, self.up.outliers].float()  # (M, k)
        copies = EXTRA // max(1, kept.shape[1])
        top, bottom = (255 - z) * s, -z * s  # the range's ends, exact levels
        steps = torch.arange(copies)  # (n,)
        split = ((kept[:, :, None] - steps * top).clamp(0, top)
                 + (kept[:, :, None] - steps * bottom).clamp(bottom, 0))  # (M, k, n)
        q[:, c:c + split[0].numel()] = (split.reshape(m, -1) / s + z + 0.5).to(torch.uint8)
        h = torch.ops.onednn.qlinear_pointwise(q, s, z, self.wide, self.up.weight_scale, self.wide_zp, self.up.bias,
                                               self.mid[0], self.mid[1], torch.uint8, "gelu", [], "none")  # (M, I)
        floats = F.gelu(F.linear(x2, self.up_rows, self.up_bias))  # (M, k): the down's outlier inputs
        y = self.product_down(h, x)
        return y.addmm_(floats, self.down.outlier_weight_t).reshape(*shape[:-1], -1)


def swapped(model: torch.nn.Module, kind: type) -> torch.nn.Module:
    out = copy.deepcopy(model)
    for module in list(out.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, FeedForward):
                setattr(module, name, kind(child))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--texts", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=0)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    folder = B.minilm_folder()
    encs = B.batches(folder, B.texts(a.texts), a.batch_size)
    models = B.variants("minilm", folder)
    ref = B.embed(models.pop("fp32"), encs)
    models.pop("int8 tensor")
    models["fused, outliers dropped (bound)"] = swapped(models["int8 static"], Bound)
    models["fused, outliers carried (cost)"] = swapped(models["int8 static"], Carried)
    B.compare(models, ref, encs, a.texts, a.rounds)

if __name__ == "__main__":
    main()
