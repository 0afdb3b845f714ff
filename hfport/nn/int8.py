"""Int8Linear: an nn.Linear run on the CPU's int8 instructions, weights int8 symmetric per output channel (scale = the
row's |max| / 127), activations quantized in one of three ways (`activations`):

  "static": as "tensor", at a uint8 scale and zero point calibrated once (`static_range`: the range of the layer's
      calibration inputs, its outlier channels left out) and kept as buffers (`input_scale`, `input_zero_point`):
      a call computes no range of its input, only the quantization pass, clamped (values beyond the calibrated
      range saturate). Only for layers whose range is stable over the calibration batches (STABLE_RATIO); the
      others stay "tensor" (`quantize_linears`). What it saves per call is the range pass (torch.aminmax over the
      input, and two host reads of its result); the quantization pass itself remains (eager torch has no kernel
      that fuses it into the LayerNorm or attention before: scripts/bench_int8_static.py --ops measures each).

  "tensor" (the fast one): one asymmetric uint8 scale and zero point for the whole packed token matrix (its min and
      max), through oneDNN's int8 Linear (torch.ops.onednn.qlinear_pointwise, the kernel torch's x86 inductor
      int8 path uses) on a weight packed once for it: the dequantization, bias and cast to the input's dtype run
      inside the kernel, so besides the product only the input's quantization passes remain. uint8 x int8 is what
      VNNI's vpdpbusd multiplies natively (an int8 x int8 product needs a +128 shift and a compensation pass).
  "token": symmetric int8 per token (per row of the packed token matrix: the padding-free path's (N, C) rows are all
      real tokens, so no padding widens a scale) through torch._int_mm (int8 x int8 -> int32), dequantized by the
      token's scale times the channel's scale, plus the bias. Finer, slower (two dequantization passes over the
      (M, N) product); where oneDNN's op is missing, or where "tensor" fails the gate (hfport/int8.py).

Measured on a 2-core Zen 4 EPYC (AVX512-VNNI/BF16; scripts/bench_int8_linear.py, one thread timed by its CPU time,
a loaded machine): the kernels alone run at ~400-430 GOP/s (_int_mm) and ~370-410 (oneDNN uint8) against fp32's ~90
and bf16's ~190 GFLOP/s, i.e. both reach the int8 units (4.4x fp32, VNNI's 4x the MACs per instruction); whole
Int8Linear calls at M=2048 tokens run at 250-330 GOP/s ("tensor") and 237-256 ("token"), the rest being the
quantization passes. On two threads _int_mm did not always split its work (a 768-side product: the calling
thread's CPU time per call 2.2 ms on one thread, 2.0 on two; fp32 9.9 -> 5.2), oneDNN's op did (M=2048, 768 ->
3072: 24 -> 12 ms): why "tensor" comes first.

Outlier channels (LLM.int8()): a few input channels whose values dwarf the others (MiniLM: the LayerNorm outputs'
dim 99 up to ~28 beside typical peaks ~1.5) would set the scale and crush the rest to a handful of levels. Such
channels, named at quantization (`outliers`, found on calibration activations by `outlier_channels`: hfport's one
outlier rule, which the ONNX int8 quantizer calls too, export/onnx_fusion.py), are taken out of the int8 product and
go through a small float matmul beside it; their int8 weight rows are zero.

torch.ao.quantization's dynamic Linear is deprecated in this torch (its removal announced), hence these two ops.

Small calls in float: an int8 call costs the input's quantization passes and ~10 small ops on top of the product,
~100-150 us whatever the row count, where a bf16 Linear of a few rows costs ~50-90 us whole. Measured per call
(bf16 body, outliers on, best of 3 x 200 calls, us int8 / bf16 F.linear with packing, quiet 2-core EPYC):
  two threads: 384->384 M=1 226/88, M=64 214/86, M=128 241/132, M=512 435/435; 384->1536 M=64 393/221, M=128
               389/433; 1536->384 M=64 414/272, M=128 567/436, M=512 1177/1412
  one thread:  384->1536 M=16 217/135, M=64 372/391, M=128 571/744; 1536->384 M=64 395/398, M=128 642/730
So a layer given `float_below_rows` > 0 (`keep_float`; dtype="int8" loads with hfport/int8.py's min_rows, default
FLOAT_BELOW_ROWS) also keeps its float weight (a non-persistent buffer in the body's float dtype: saved nowhere, cast
with the model) and runs calls of fewer rows than that as a plain float Linear (prepacked where the inference step
set `prepacked`: nn/packed.py), closer to fp32 than int8 is. MiniLM classification, two threads, 9 interleaved
rounds (median ms a call, int8 always / with the float path / the bf16 model): one short text 9.10 / 6.40 / 6.05; 4
texts 14.4 / 12.8 / 13.2; 16 texts (~290 tokens: int8) and bench.py's batches unchanged. The gate judges int8
itself: it quantizes with no float weight kept, and keeps them once int8 passed.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import packed

QMAX = 127  # symmetric int8: -127..127 (no -128, so a negated value keeps its magnitude)
EPS = 1e-12  # a zero row or token gets a tiny scale instead of a division by zero (its values stay 0)
# an input channel is an outlier when its calibration |max| exceeds OUTLIER_RATIO x the median channel's; at most
# MAX_OUTLIERS per layer: the ONNX int8 graph's rule, with its measurements (export/onnx.py's docstring; MiniLM's
# outliers are 10-20x the median), for the engine and the ONNX quantizer alike (`outlier_channels`)
OUTLIER_RATIO = 4.0
MAX_OUTLIERS = 8
U8_MARGIN = 1e-5  # relative widening of the per-tensor uint8 range (quantize_tensor_u8)
# "static" activations: a layer's calibrated range is stable when every calibration batch's own range (its width,
# outlier channels left out) is at least 1 / STABLE_RATIO of the range over all of them; a layer whose range moves
# more between batches quantizes each call's input at its own range ("tensor")
STABLE_RATIO = 2.0
# elements per block of quantize_tensor_u8's fp32 arithmetic (1 MiB of fp32: Zen 4's L2 per core). Measured on a
# bf16 2120 x 1536 / 2120 x 384 input (one thread, CPU time, medians of 9 interleaved rounds): blocks of 2**16
# 1.92 / 0.45 ms, 2**18 1.60 / 0.41, 2**19 1.59 / 0.37 (each block costs four ops: fewer blocks, less overhead)
QUANT_BLOCK = 1 << 18
# activation quantization granularities, fastest first (module docstring); "static" falls back to "tensor" per layer
ACTIVATIONS = ("static", "tensor", "token")
# calls of fewer rows than this run an int8 layer's kept float weight (module docstring): what dtype="int8" loads with
FLOAT_BELOW_ROWS = 128


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-row int8: x (M, K) float -> (x_q (M, K) int8, scale (M, 1) fp32), x ~= x_q * scale."""
    amax = x.abs().amax(dim=1, keepdim=True).float().clamp_min(EPS)  # (M, 1)
    # multiply by the reciprocal (one pass); |x * 127 / amax| <= 127 up to one rounding, so no clamp is needed
    q = (x * (QMAX / amax)).round_().to(torch.int8)  # (M, K)
    return q, amax / QMAX


def outlier_channels(amax: Tensor, ratio: float = OUTLIER_RATIO, limit: int = MAX_OUTLIERS) -> Tensor:
    """hfport's int8 outlier rule, for Int8Linear and the ONNX int8 graph alike: the input channels whose
    calibration |max| (K,) exceeds RATIO x the median channel's (the mean of the two middle ones for even K, as
    numpy's), the largest LIMIT -> (k,) int64 indices, sorted."""
    threshold = ratio * torch.quantile(amax.double(), 0.5).clamp_min(EPS)
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


def onednn_int8_available() -> bool:
    """Whether this torch has oneDNN's int8 Linear ("tensor" activations); absent on builds without oneDNN."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")


def u8_params(lo: float, hi: float) -> tuple[float, int]:
    """The uint8 scale and zero point of the range [LO, HI] (LO <= 0 <= HI): 255 levels widened by U8_MARGIN."""
    scale = max(hi - lo, EPS) / 255 * (1 + U8_MARGIN)
    return scale, min(255, max(0, round(-lo / scale)))


def quantize_tensor_u8(x: Tensor, outliers: Tensor | None = None,
                       params: tuple[float, int] | None = None) -> tuple[Tensor, float, int]:
    """Asymmetric per-tensor uint8: x (M, K) float -> (x_u8 (M, K), scale, zero point), x ~= (x_u8 - zp) * scale.
    The range always holds 0, so zero stays exact. OUTLIERS (k,) input channels are left out of the range; their
    columns of x_u8 saturate at 0 or 255 (Int8Linear multiplies them by zero weight rows). PARAMS: a static (scale,
    zero point) instead of x's own range (no range pass; values beyond it saturate).

    The arithmetic runs in fp32 whatever x's dtype (bf16 cannot hold v / scale + zp to a half: 8 bits), a block of
    rows at a time (QUANT_BLOCK elements) in one reused fp32 buffer: it stays in cache and in the allocator's memory.
    One (M, K) fp32 copy of a 2373 x 1536 bf16 input instead made MiniLM's down-projection quantization cost ~14 ms
    a call (fresh pages from the allocator every call), against ~2 ms in blocks (one thread, CPU time)."""
    m, k = x.shape
    rows = max(1, QUANT_BLOCK // max(k, 1))
    if params is None:
        lo, hi = 0.0, 0.0
        # the range without the outlier channels: over the column spans between them (strided views, no copy)
        cuts = [-1, *sorted(outliers.tolist()), k] if outliers is not None else [-1, k]
        for a, b in zip(cuts, cuts[1:]):
            if b > a + 1:
                s_lo, s_hi = torch.aminmax(x[:, a + 1:b])  # (M, b - a - 1) view
                lo, hi = min(lo, float(s_lo)), max(hi, float(s_hi))
        # 255 levels widened by U8_MARGIN: v / scale + zp then lies strictly inside (-0.5, 255.5), so adding 0.5 and
        # truncating (the uint8 cast) rounds half up and never leaves 0..255: no clamp pass (but for outlier columns)
        scale, zp = u8_params(lo, hi)
    else:
        scale, zp = params
    clamp = params is not None or (outliers is not None and len(outliers) > 0)
    q = torch.empty(m, k, dtype=torch.uint8, device=x.device)  # (M, K)
    half = torch.tensor(zp + 0.5)
    # one fp32 buffer for every block: a fresh 1 MiB temporary per block risks what freshly mapped pages cost (glibc
    # returns and remaps memory of that size depending on its state: fp32 attention scores of 1.2-2 MiB ran 2.7-4.9x
    # slower in a loop here for that reason)
    buffer = torch.empty(min(rows, m), k, device=x.device)  # (rows, K) fp32
    for start in range(0, m, rows):
        block = x[start:start + rows]  # (rows, K) view
        out = buffer[:len(block)]
        if x.dtype != torch.float32:
            block = out.copy_(block)  # the arithmetic in fp32
        block = torch.add(half, block, alpha=1.0 / scale, out=out)  # x itself is never written
        if clamp:
            block.clamp_(0.0, 255.0)  # the outlier columns (and, static, any value) may lie outside the range
        # the cast truncates: zp + 0.5 + v / scale rounded half up. fp32 -> int32 in the block's own memory, then
        # int32 -> uint8: 1.8 ms for a 2373 x 1536 input against 3.2 ms through torch's fp32 -> uint8 copy
        q[start:start + rows].copy_(block.view(torch.int32).copy_(block))
    return q, scale, zp


class Int8Linear(nn.Module):
    """y = x W^T + b with W int8 per output channel and x quantized per `activations` ("tensor" or "token");
    `outliers` input channels in float."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, n_outliers: int = 0,
                 activations: str = "token"):
        super().__init__()
        if activations not in ACTIVATIONS:
            raise ValueError(f"Int8Linear: activations must be one of {ACTIVATIONS}, got {activations!r}")
        self.in_features, self.out_features, self.activations = in_features, out_features, activations
        # (K, N): _int_mm's right operand, kept transposed and contiguous once (a transposed view of (N, K) is
        # what the kernel would otherwise pack on every call)
        self.register_buffer("weight_t", torch.zeros(in_features, out_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.ones(out_features))  # (N,) fp32
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)  # (N,) fp32
        self.register_buffer("outliers", torch.zeros(n_outliers, dtype=torch.long))  # (k,) input channels
        self.register_buffer("outlier_weight_t", torch.zeros(n_outliers, out_features))  # (k, N) fp32
        # "static": the calibrated uint8 scale and zero point of the input (0 and 0 otherwise: computed per call)
        self.register_buffer("input_scale", torch.zeros(()))  # () fp32
        self.register_buffer("input_zero_point", torch.zeros((), dtype=torch.long))  # () int64
        # (N, K) the float layer's weight for calls of few rows (keep_float; module docstring), else None
        self.register_buffer("float_weight", None, persistent=False)
        self.float_below_rows = 0
        self.prepacked = False  # calls of few rows on the packed float weight (nn/packed.py: set by pack_linears)
        self.shared: SharedInput | None = None
        # "tensor": oneDNN's packed copy of weight_t (an opaque tensor, not a buffer: it cannot be saved or copied),
        # made on first use and again whenever weight_t changes (load_state_dict, .to): keyed by its storage/version
        self._packed: tuple[tuple[int, int], Tensor, Tensor] | None = None

    def _apply(self, fn, recurse: bool = True) -> Int8Linear:
        """model.to(...) casts the float buffers with the model's float parts (bias and the outlier weights follow
        a bf16 body, so the outlier product runs in bf16 with no per-call cast), but the channel scales stay fp32:
        they are oneDNN's fp32 dequantization factors, and bf16's 8 bits would move each output channel by up to
        0.4%. Only their device follows."""
        scale, input_scale = self.weight_scale, self.input_scale
        super()._apply(fn, recurse)
        self.weight_scale = scale.to(self.weight_scale.device)
        self.input_scale = input_scale.to(self.input_scale.device)  # a static input scale stays fp32 too
        return self

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_packed"] = None  # deepcopy/pickle: the opaque packed weight is remade on first use
        return state

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, outliers: Tensor | None = None, activations: str = "token",
                    float_below_rows: int = 0, input_range: tuple[float, float] | None = None) -> Int8Linear:
        """LINEAR's weights quantized per output channel; the OUTLIERS input channels (k,) kept fp32 beside.
        FLOAT_BELOW_ROWS > 0: also LINEAR's weight itself, for calls of fewer rows (`keep_float`). "static"
        ACTIVATIONS take INPUT_RANGE (lo, hi), the calibrated range of the input without its outlier channels."""
        if (activations == "static") != (input_range is not None):
            raise ValueError(f"Int8Linear: activations 'static' needs the calibrated input_range and only it takes "
                             f"one; got activations={activations!r}, input_range={input_range!r}")
        w = linear.weight.detach().float()  # (N, K)
        idx = (outliers if outliers is not None else torch.zeros(0, dtype=torch.long)).to(w.device, torch.long)
        out = cls(linear.in_features, linear.out_features, linear.bias is not None, len(idx), activations)
        out = out.to(w.device)
        out.outliers.copy_(idx)
        out.outlier_weight_t.copy_(w[:, idx].t())  # (k, N)
        w = w.index_fill(1, idx, 0.0)  # the int8 part never sees the outlier channels: their scale stays honest
        q, scale = quantize_rows(w)  # (N, K) int8, (N, 1)
        out.weight_t.copy_(q.t())
        out.weight_scale.copy_(scale.flatten())
        if linear.bias is not None:
            out.bias.copy_(linear.bias.detach().float())
        if input_range is not None:
            scale, zp = u8_params(min(0.0, input_range[0]), max(0.0, input_range[1]))
            out.input_scale.fill_(scale)
            out.input_zero_point.fill_(zp)
        out.keep_float(linear.weight, float_below_rows)
        return out

    @torch.no_grad()
    def keep_float(self, weight: Tensor, rows: int) -> None:
        """Calls of fewer than ROWS rows run WEIGHT (N, K), the float layer's, kept as a non-persistent buffer in the
        dtype of this layer's float parts (module docstring); ROWS 0: int8 for every call, no float weight kept."""
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
            raise ValueError(f"int8 min_rows (float_below_rows): expected a row count >= 0 (0: int8 for every "
                             f"call), got {rows!r}")
        self.float_weight = weight.detach().to(self.outlier_weight_t.dtype).clone() if rows else None  # (N, K)
        self.float_below_rows = rows

    def packed(self) -> tuple[Tensor, Tensor]:
        """(oneDNN's packed weight, its zero points (N,) int64 zeros), made once per weight_t."""
        w = self.weight_t
        key = (w.data_ptr(), -1 if w.is_inference() else w._version)  # inference tensors keep no version count
        if self._packed is None or self._packed[0] != key:
            packed = torch.ops.onednn.qlinear_prepack(self.weight_t.t().contiguous(), None)  # from (N, K)
            self._packed = (key, packed, torch.zeros(self.out_features, dtype=torch.long))
        return self._packed[1], self._packed[2]

    def quantize_input(self, x: Tensor) -> tuple[Tensor, Tensor | float, Tensor | int | None, Tensor | None]:
        """x (..., K) -> (x_q (M, K), its scale, its zero point ("tensor"; None for "token"), the outlier channels'
        values (M, k) in x's dtype or None). "token": int8 and scale (M, 1) fp32; "tensor": uint8, float, int."""
        entry = self.shared.last if self.shared is not None else None
        if entry is not None and entry[0] is x:
            entry[4][0] -= 1
            if entry[4][0] <= 0:
                self.shared.last = None
            return entry[1], entry[2][0], entry[2][1], entry[3]
        x2 = x.reshape(-1, self.in_features)  # (M, K)
        kept = x2[:, self.outliers] if len(self.outliers) else None  # (M, k): the outlier channels
        if self.activations == "static":  # no range pass: the calibrated one
            q, scale, zp = quantize_tensor_u8(x2, self.outliers, self.static_params())
        elif self.activations == "tensor":  # the outlier channels left out of the range inside (no copy of x)
            q, scale, zp = quantize_tensor_u8(x2, self.outliers)
        else:
            if kept is not None:
                x2 = x2.index_fill(1, self.outliers, 0.0)  # (M, K): a copy, the caller's x untouched
            (q, scale), zp = quantize_rows(x2.float()), None  # (M, K) int8, (M, 1)
        if self.shared is not None:
            self.shared.last = (x, q, (scale, zp), kept, [self.shared.readers - 1])
        return q, scale, zp, kept

    def static_params(self) -> tuple[float, int]:
        """The calibrated (scale, zero point) of "static" activations, as the kernels take them."""
        return float(self.input_scale), int(self.input_zero_point)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape  # (..., K)
        if self.float_weight is not None and x.numel() < self.float_below_rows * self.in_features:
            # few rows: the float layer (module docstring); the bias follows the float parts' dtype like the weight
            weight, bias = self.float_weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype)
            return packed.linear_weights(x, weight, bias) if self.prepacked else F.linear(x, weight, bias)
        q, scale, zp, kept = self.quantize_input(x)
        if self.activations != "token":
            weight, weight_zp = self.packed()
            # (M, N) in x's dtype: (q - zp) * scale @ (W_q * channel scale)^T + bias, all inside the kernel
            y = torch.ops.onednn.qlinear_pointwise(q, scale, zp, weight, self.weight_scale, weight_zp, self.bias,
                                                   1.0, 0, x.dtype, "none", [], "")
        else:
            y = self._token_product(q, scale)
            y = y.to(x.dtype)
        if kept is not None:
            y.addmm_(kept.to(y.dtype), self.outlier_weight_t.to(y.dtype))  # (M, k) @ (k, N): the float part
        return y.reshape(*shape[:-1], self.out_features)

    def _token_product(self, q: Tensor, scale: Tensor) -> Tensor:
        """"token": q (M, K) int8, scale (M, 1) -> (M, N) fp32, dequantized, plus the bias."""
        acc = torch._int_mm(q, self.weight_t)  # (M, N) int32
        # dequantize in two passes, in the int32 product's own memory (same size as fp32): no second (M, N)
        # allocation, whose fresh pages made the dequantization of a 2048 x 3072 product vary from 7 to 40 ms on one
        # thread here, depending on the allocator's state.
        # int32 x token scale -> fp32 (one pass, each element read before it is written), then x channel scale
        # + bias (addcmul)
        y = torch.mul(acc, scale, out=acc.view(torch.float32))  # (M, N) fp32
        if self.bias is not None:
            return torch.addcmul(self.bias, y, self.weight_scale, out=y)
        return y.mul_(self.weight_scale)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"outliers={len(self.outliers)}, activations={self.activations}"
                + (", input_scale={:.4g}, input_zero_point={}".format(*self.static_params())
                   if self.activations == "static" else "")
                + (f", float_below_rows={self.float_below_rows}" if self.float_weight is not None else "")
                + (", prepacked=True" if self.prepacked else ""))


def reference_forward(layer: Int8Linear, x: Tensor) -> Tensor:
    """What Int8Linear computes, in float64 with no int8 kernel: the same quantization, multiplied out. For tests
    and for reading; (..., K) -> (..., N) float64."""
    x2 = x.reshape(-1, layer.in_features)  # (M, K)
    kept = x2[:, layer.outliers].double()  # (M, k)
    x2 = x2.index_fill(1, layer.outliers, 0.0)
    if layer.activations != "token":
        q, scale, zp = quantize_tensor_u8(x2, params=layer.static_params() if layer.activations == "static" else None)
        xq = (q.double() - zp) * scale  # (M, K)
    else:
        q, scale = quantize_rows(x2.float())
        xq = q.double() * scale.double()
    y = (xq @ layer.weight_t.double()) * layer.weight_scale.double()  # (M, N)
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
        # exactly nn.Linear (or its packed form): a LoRA layer is not swapped
        if type(module) in (nn.Linear, packed.PackedLinear) and id(module) not in seen:
            seen.add(id(module))
            out[name] = module
    return out


class InputPeaks:
    """Per-input-channel |max| of each Linear's inputs over the forward passes run inside `with InputPeaks(...)`:
    the calibration that `outlier_channels` reads, {name: (K,) fp32}; and each pass's per-channel minimum and
    maximum, {name: [(lo (K,), hi (K,)) per pass]}, that `static_range` reads."""

    def __init__(self, linears: dict[str, nn.Linear]):
        self.linears = linears
        self.peaks: dict[str, Tensor] = {}
        self.ranges: dict[str, list[tuple[Tensor, Tensor]]] = {}
        self.handles: list = []

    def _hook(self, name: str):
        def record(module: nn.Module, args: tuple[Tensor, ...]) -> None:
            lo, hi = torch.aminmax(args[0].detach().reshape(-1, args[0].shape[-1]).float(), dim=0)  # (K,) each
            x = torch.maximum(lo.abs(), hi)  # (K,)
            self.peaks[name] = torch.maximum(self.peaks[name], x) if name in self.peaks else x
            self.ranges.setdefault(name, []).append((lo, hi))
        return record

    def __enter__(self) -> InputPeaks:
        self.handles = [m.register_forward_pre_hook(self._hook(n)) for n, m in self.linears.items()]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()


def static_range(ranges: list[tuple[Tensor, Tensor]], outliers: Tensor | None,
                 stable: float = STABLE_RATIO) -> tuple[float, float] | None:
    """The calibrated input range (lo <= 0 <= hi) of a layer over its calibration passes' per-channel RANGES
    [(lo (K,), hi (K,))], the OUTLIERS channels left out; None where it is unstable: some pass's own range is
    narrower than 1 / STABLE of the whole (that layer's inputs then get their own range each call)."""
    if not ranges:
        return None
    keep = torch.ones_like(ranges[0][0], dtype=torch.bool)  # (K,)
    if outliers is not None:
        keep[outliers] = False
    spans = [(min(0.0, float(lo[keep].min())), max(0.0, float(hi[keep].max()))) for lo, hi in ranges]
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    if min(b - a for a, b in spans) * stable < hi - lo:
        return None
    return lo, hi


def swap_linears(root: nn.Module, replace: dict[int, nn.Module]) -> None:
    """Put replace[id(child)] in place of each child module of ROOT's tree that it names (shared modules stay
    shared: every parent that holds one gets the same replacement)."""
    for parent in list(root.modules()):
        for child_name, child in list(parent.named_children()):
            if id(child) in replace:
                setattr(parent, child_name, replace[id(child)])


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """What calibration decided for one Linear, all that quantizing it needs besides its weights (and all that
    hfport/int8_verdicts.py keeps of a calibration): its OUTLIERS input channels, its calibrated INPUT_RANGE (lo, hi)
    for "static" activations (None: each call's own range), and SHARES_INPUT_WITH, the first layer of its group
    that reads one input (q, k and v: quantized once, SharedInput; None: a group of one)."""

    outliers: tuple[int, ...] = ()
    input_range: tuple[float, float] | None = None
    shares_input_with: str | None = None


def plan_layers(linears: dict[str, nn.Linear], peaks: dict[str, Tensor] | None = None, activations: str = "token",
                ranges: dict[str, list[tuple[Tensor, Tensor]]] | None = None) -> dict[str, LayerPlan]:
    """Each of LINEARS' LayerPlan from a calibration: the outlier channels from PEAKS (the calibration |max| per
    input channel by name; none without), and for "static" ACTIVATIONS the stable range of its calibration RANGES
    (InputPeaks.ranges; `static_range`). Layers under one parent with the same peaks read one input."""
    firsts: dict[tuple, str] = {}  # (parent, calibration peaks) -> the group's first layer
    plans = {}
    for name in linears:
        idx = outlier_channels(peaks[name]) if peaks and name in peaks else None
        span = static_range((ranges or {}).get(name, []), idx) if activations == "static" else None
        group = firsts.setdefault((name.rpartition(".")[0], tuple(peaks[name].tolist())), name) \
            if peaks and name in peaks else None
        plans[name] = LayerPlan(tuple(idx.tolist()) if idx is not None else (), span, group)
    sizes = Counter(p.shares_input_with for p in plans.values())
    return {n: p if sizes[p.shares_input_with] > 1 else dataclasses.replace(p, shares_input_with=None)
            for n, p in plans.items()}


def quantize_linears(root: nn.Module, peaks: dict[str, Tensor] | None = None,
                     activations: str = "token", float_below_rows: int = 0,
                     ranges: dict[str, list[tuple[Tensor, Tensor]]] | None = None,
                     plan: dict[str, LayerPlan] | None = None) -> dict[int, nn.Linear]:
    """Every nn.Linear under ROOT swapped for an Int8Linear with ACTIVATIONS' granularity, once, as PLAN says (a
    LayerPlan by name; default: `plan_layers` on PEAKS and RANGES): its outlier channels, and for "static" its
    calibrated range, where it has one (the others quantize per "tensor"). -> {id(Int8Linear): the nn.Linear it
    replaced}, for `swap_linears` to put the float layers back. FLOAT_BELOW_ROWS > 0: each keeps its float weight
    too, for calls of fewer rows (module docstring)."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"int8 activations must be one of {ACTIVATIONS}, got {activations!r}")
    linears = body_linears(root)
    plan = plan_layers(linears, peaks, activations, ranges) if plan is None else plan
    if plan.keys() != linears.keys():
        raise ValueError(f"int8 plan: its layers {sorted(plan.keys() ^ linears.keys())} are not both the plan's "
                         "and the model's")
    replace, originals = {}, {}
    groups: dict[str, list[Int8Linear]] = {}  # the group's first layer -> the layers that read one input
    for name, linear in linears.items():
        layer = plan[name]
        span = layer.input_range if activations == "static" else None
        kind = "tensor" if activations == "static" and span is None else activations
        idx = torch.tensor(layer.outliers, dtype=torch.long)
        q = Int8Linear.from_linear(linear, idx, kind, float_below_rows, span)
        if layer.shares_input_with is not None:
            groups.setdefault(layer.shares_input_with, []).append(q)
        replace[id(linear)], originals[id(q)] = q, linear
    for members in groups.values():
        if len(members) > 1:
            shared = SharedInput(len(members))
            for q in members:
                q.shared = shared
    swap_linears(root, replace)
    return originals
