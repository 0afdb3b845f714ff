"""Int8Linear: an nn.Linear run on the CPU's int8 instructions (torch._int_mm, int8 x int8 -> int32).

Weights are quantized once, symmetric per output channel (scale = the row's |max| / 127); activations are quantized
at run time, symmetric per token (per row of the packed token matrix: the padding-free path's (N, C) rows are all
real tokens, so no padding widens a scale). The int32 product is dequantized by the token's scale times the
channel's scale, plus the bias.

Outlier channels (LLM.int8(), as export/onnx.py does for the ONNX graph): a few input channels whose values dwarf
the others (MiniLM: the LayerNorm outputs' dim 99 up to ~28 beside typical peaks ~1.5) would set every token's
scale and crush the rest to a handful of levels. Such channels, named at quantization (`outliers`, found on
calibration activations by `outlier_channels`), are taken out of the int8 product and go through a small fp32
matmul beside it; their int8 weight rows are zero.

torch.ao.quantization's dynamic Linear is deprecated in this torch (its removal announced), hence _int_mm.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

QMAX = 127  # symmetric int8: -127..127 (no -128, so a negated value keeps its magnitude)
EPS = 1e-12  # a zero row or token gets a tiny scale instead of a division by zero (its values stay 0)
# an input channel is an outlier when its calibration |max| exceeds OUTLIER_RATIO x the median channel's; at most
# MAX_OUTLIERS per layer (export/onnx.py's rule and numbers: MiniLM's outliers are 10-20x the median)
OUTLIER_RATIO = 6.0
MAX_OUTLIERS = 8


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-row int8: x (M, K) float -> (x_q (M, K) int8, scale (M, 1) fp32), x ~= x_q * scale."""
    amax = x.abs().amax(dim=1, keepdim=True).float().clamp_min(EPS)  # (M, 1)
    # multiply by the reciprocal (one pass); |x * 127 / amax| <= 127 up to one rounding, so no clamp is needed
    q = (x * (QMAX / amax)).round_().to(torch.int8)  # (M, K)
    return q, amax / QMAX


def outlier_channels(amax: Tensor, ratio: float = OUTLIER_RATIO, limit: int = MAX_OUTLIERS) -> Tensor:
    """Input channels whose calibration |max| (K,) exceeds RATIO x the median channel's, the largest LIMIT -> (k,)
    int64 indices, sorted."""
    threshold = ratio * amax.median().clamp_min(EPS)
    above = (amax > threshold).nonzero().flatten()  # (k',)
    if len(above) > limit:
        above = above[amax[above].topk(limit).indices]
    return above.sort().values


class SharedInput:
    """The last input an Int8Linear quantized, for its siblings that read the same tensor next (attention's q, k and
    v projections: one quantization instead of three). Layers share one where their calibration inputs were the
    same tensor (equal peaks under one parent: `quantize_linears`); a hit needs the very same tensor object, which
    the entry holds, so its id cannot be reused; after the group's last reader the entry is dropped, so no
    activations outlive the forward pass. The entry is one tuple, written and read whole: threads sharing a model
    at worst recompute."""

    __slots__ = ("last", "readers")

    def __init__(self, readers: int) -> None:
        self.readers = readers  # the layers that read each input
        # (x, x_q, scale, outlier values, [reads left])
        self.last: tuple[Tensor, Tensor, Tensor, Tensor | None, list[int]] | None = None


class Int8Linear(nn.Module):
    """y = x W^T + b with W int8 per output channel and x int8 per token; `outliers` input channels in fp32."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, n_outliers: int = 0):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        # (K, N): _int_mm's right operand, kept transposed and contiguous once (a transposed view of (N, K) is
        # what the kernel would otherwise pack on every call)
        self.register_buffer("weight_t", torch.zeros(in_features, out_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.ones(out_features))  # (N,) fp32
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)  # (N,) fp32
        self.register_buffer("outliers", torch.zeros(n_outliers, dtype=torch.long))  # (k,) input channels
        self.register_buffer("outlier_weight_t", torch.zeros(n_outliers, out_features))  # (k, N) fp32
        self.shared: SharedInput | None = None

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, outliers: Tensor | None = None) -> Int8Linear:
        """LINEAR's weights quantized per output channel; the OUTLIERS input channels (k,) kept fp32 beside."""
        w = linear.weight.detach().float()  # (N, K)
        idx = (outliers if outliers is not None else torch.zeros(0, dtype=torch.long)).to(w.device, torch.long)
        out = cls(linear.in_features, linear.out_features, linear.bias is not None, len(idx)).to(w.device)
        out.outliers.copy_(idx)
        out.outlier_weight_t.copy_(w[:, idx].t())  # (k, N)
        w = w.index_fill(1, idx, 0.0)  # the int8 part never sees the outlier channels: their scale stays honest
        q, scale = quantize_rows(w)  # (N, K) int8, (N, 1)
        out.weight_t.copy_(q.t())
        out.weight_scale.copy_(scale.flatten())
        if linear.bias is not None:
            out.bias.copy_(linear.bias.detach().float())
        return out

    def quantize_input(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """x (..., K) -> (x_q (M, K) int8, scale (M, 1), the outlier channels' values (M, k) fp32 or None)."""
        entry = self.shared.last if self.shared is not None else None
        if entry is not None and entry[0] is x:
            entry[4][0] -= 1
            if entry[4][0] <= 0:
                self.shared.last = None
            return entry[1], entry[2], entry[3]
        x2 = x.reshape(-1, self.in_features).float()  # (M, K)
        kept = None
        if len(self.outliers):
            kept = x2[:, self.outliers]  # (M, k) fp32: the outlier channels
            x2 = x2.index_fill(1, self.outliers, 0.0)  # (M, K): a copy, the caller's x untouched
        q, scale = quantize_rows(x2)  # (M, K) int8, (M, 1)
        if self.shared is not None:
            self.shared.last = (x, q, scale, kept, [self.shared.readers - 1])
        return q, scale, kept

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape  # (..., K)
        q, scale, kept = self.quantize_input(x)
        acc = torch._int_mm(q, self.weight_t)  # (M, N) int32
        # dequantize in two passes, in the int32 product's own memory (same size as fp32): no second (M, N)
        # allocation, whose fresh pages made the dequantization of a 2048 x 3072 product vary from 7 to 40 ms on one
        # thread here, depending on the allocator's state.
        # int32 x token scale -> fp32 (one pass, each element read before it is written), then x channel scale
        # + bias (addcmul)
        y = torch.mul(acc, scale, out=acc.view(torch.float32))  # (M, N) fp32
        if self.bias is not None:
            y = torch.addcmul(self.bias, y, self.weight_scale, out=y)
        else:
            y.mul_(self.weight_scale)
        if kept is not None:
            y.addmm_(kept, self.outlier_weight_t)  # (M, k) @ (k, N): the fp32 part
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"outliers={len(self.outliers)}")


def reference_forward(layer: Int8Linear, x: Tensor) -> Tensor:
    """What Int8Linear computes, in float64 with no int8 kernel: the same quantization, multiplied out. For tests
    and for reading; (..., K) -> (..., N)."""
    x2 = x.reshape(-1, layer.in_features).double()  # (M, K)
    kept = x2[:, layer.outliers]  # (M, k)
    x2 = x2.index_fill(1, layer.outliers, 0.0)
    amax = x2.abs().amax(dim=1, keepdim=True).float().clamp_min(EPS).double()  # (M, 1), as quantize_rows rounds it
    q = (x2.float() * (QMAX / amax.float())).round().double()  # (M, K) integers
    y = (q @ layer.weight_t.double()) * (amax / QMAX) * layer.weight_scale.double()  # (M, N)
    if layer.bias is not None:
        y = y + layer.bias.double()
    y = y + kept @ layer.outlier_weight_t.double()
    return y.reshape(*x.shape[:-1], layer.out_features)


def body_linears(root: nn.Module) -> dict[str, nn.Linear]:
    """Every nn.Linear under ROOT (the encoder's layers: attention projections, feed-forward), by module type, each
    shared module once (ALBERT's layers are shared across depth): qualified name -> module."""
    seen: set[int] = set()
    out = {}
    for name, module in root.named_modules():
        if type(module) is nn.Linear and id(module) not in seen:  # exactly nn.Linear: a LoRA layer is not swapped
            seen.add(id(module))
            out[name] = module
    return out


class InputPeaks:
    """Per-input-channel |max| of each Linear's inputs over the forward passes run inside `with InputPeaks(...)`:
    the calibration that `outlier_channels` reads. {name: (K,) fp32}."""

    def __init__(self, linears: dict[str, nn.Linear]):
        self.linears = linears
        self.peaks: dict[str, Tensor] = {}
        self.handles: list = []

    def _hook(self, name: str):
        def record(module: nn.Module, args: tuple[Tensor, ...]) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(0).float()  # (K,)
            self.peaks[name] = torch.maximum(self.peaks[name], x) if name in self.peaks else x
        return record

    def __enter__(self) -> InputPeaks:
        self.handles = [m.register_forward_pre_hook(self._hook(n)) for n, m in self.linears.items()]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()


def swap_linears(root: nn.Module, replace: dict[int, nn.Module]) -> None:
    """Put replace[id(child)] in place of each child module of ROOT's tree that it names (shared modules stay
    shared: every parent that holds one gets the same replacement)."""
    for parent in list(root.modules()):
        for child_name, child in list(parent.named_children()):
            if id(child) in replace:
                setattr(parent, child_name, replace[id(child)])


def quantize_linears(root: nn.Module, peaks: dict[str, Tensor] | None = None) -> dict[int, nn.Linear]:
    """Every nn.Linear under ROOT swapped for an Int8Linear, once (the outlier channels from PEAKS, the calibration
    |max| per input channel by name; none without). -> {id(Int8Linear): the nn.Linear it replaced}, for
    `swap_linears` to put the float layers back."""
    linears = body_linears(root)
    replace, originals = {}, {}
    groups: dict[tuple, list[Int8Linear]] = {}  # (parent, calibration peaks) -> the layers that read one input
    for name, linear in linears.items():
        idx = outlier_channels(peaks[name]) if peaks and name in peaks else None
        q = Int8Linear.from_linear(linear, idx)
        if peaks and name in peaks:
            groups.setdefault((name.rpartition(".")[0], tuple(peaks[name].tolist())), []).append(q)
        replace[id(linear)], originals[id(q)] = q, linear
    for members in groups.values():
        if len(members) > 1:
            shared = SharedInput(len(members))
            for q in members:
                q.shared = shared
    swap_linears(root, replace)
    return originals
