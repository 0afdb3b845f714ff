"""Prepacked Linear layers for CPU inference: an nn.Linear in eval mode with autograd off runs its fp32 or bf16
product through oneDNN on a weight reordered once into oneDNN's blocked layout (torch.ops.mkldnn's
_reorder_linear_weight / _linear_pointwise, the pair torch's inductor CPU backend uses for frozen Linears).

Why: F.linear reorders nothing ahead of time (fp32: a BLAS call; bf16: oneDNN on the plain weight, re-laid out as it
goes), which costs most on short inputs. Measured per call (a loop over the two ops against F.linear, one thread,
its CPU time, a loaded 2-core AVX512-BF16 EPYC): bf16 1.2-1.45x faster at 14 rows (384 -> 1536: 165 -> 115-126 us),
~1.1x at 64, 1.01-1.16x at 256 and 1024; fp32 1.2-1.65x at every row count (768 -> 3072 at 256 rows: 15.5 -> 11.8
ms). A bf16 MiniLM forward pass of one short text spends 77% of its time in these products.

How it is applied: `pack_linears(model)` puts a PackedLinear in place of each plain nn.Linear under a model bound
for inference (hfport/inference.py's `for_inference`, which pipelines apply; never from_pretrained, never a training
model). A PackedLinear is an nn.Linear subclass holding the very same weight and bias Parameters under the same names,
so state_dict, save_pretrained, exports, LoRA wrapping and int8 quantization read the plain weight as before, and
`repr(model)` shows which layers are packed. Layers that compute a float product of their own (LoraLinear,
MixedLinear, Int8Linear's calls of few rows) declare `prepacked` (False by default); pack_linears sets it, and they
then run that product through `linear` (a LoRA layer's own small A and B stay plain: `pack_linears`).

When a packed layer uses its packed weight (else F.linear, unchanged): the layer is in eval mode, autograd
is off (torch.no_grad / inference_mode), no CPU autocast, not traced / compiled / ONNX-exported, weight and input on
the CPU in the same dtype, fp32 or bf16, and oneDNN present (torch.backends.mkldnn.is_available(); a first call that
raises turns packing off for the process, logged once). The packed weight is built at the first such call and kept
on the weight tensor (an attribute, so not in state_dict; layers sharing a Parameter share it; a deepcopy or pickle
drops it). It is rebuilt when the weight changes (data_ptr, _version: any in-place update, dtype, device), so
a model trained then evaluated, or cast, never computes with a stale copy; and it is dropped (never built) at the
first forward pass in train mode or with grad on, so fine-tuning holds no packed copies.

Memory: the packed copy sits beside the plain weight (which LoRA, int8, exports and saving still read), so the
Linear weights are held twice once inference has run (a MiniLM pipeline's RSS after its first call: fp32 +44 MiB,
bf16 +22 MiB over the unpacked model; BERT-base fp32 would be ~+340 MB). And oneDNN
caches one primitive per (row count, weight shape) (~1 MB each measured for 384 -> 1536): fp32's F.linear (BLAS)
caches nothing, so packed fp32 calls pad their rows up to `padded_rows` (at most 12.5% extra rows above 128, 15
below) to keep that set bounded; bf16 calls do not (F.linear's bf16 calls go through oneDNN and cache per row count
already).
"""

from __future__ import annotations

import logging
import sys
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn


log = logging.getLogger("hfport")

DTYPES = (torch.float32, torch.bfloat16)


class _State:
    usable: bool | None = None  # None: not probed yet; False: no oneDNN, or a call raised


def _onednn() -> bool:
    if _State.usable is None:
        _State.usable = torch.backends.mkldnn.is_available()
    return _State.usable


class _Key(NamedTuple):
    ptr: int
    version: int
    dtype: torch.dtype
    device: torch.device
    shape: torch.Size


def _key(weight: Tensor) -> _Key:
    # an inference tensor (made under inference_mode) has no version counter; it can change in place only inside
    # inference_mode, which hfport's loading and training never do to weights
    version = -1 if weight.is_inference() else weight._version
    return _Key(weight.data_ptr(), version, weight.dtype, weight.device, weight.shape)


class Packed:
    """A weight's packed copy and the key of the weight it was built from. Held on the weight tensor itself
    (`weight._hfport_packed`), so every layer sharing that Parameter (adapters over one base, MixedLinear) shares
    one copy. Copies of it are empty: oneDNN's opaque tensors cannot be deep-copied or pickled, and a copied
    weight is another tensor anyway."""

    def __init__(self, key: _Key | None = None, tensor: Tensor | None = None):
        self.key = key
        self.tensor = tensor  # oneDNN's blocked layout, (out, in) logically

    def __deepcopy__(self, memo: dict) -> Packed:
        return Packed()

    def __reduce__(self) -> tuple:
        return Packed, ()


ATTR = "_hfport_packed"


def _packable(weight: Tensor, bias: Tensor | None, x: Tensor) -> bool:
    """The conditions of the module docstring but train mode and grad (`linear` reads those first), cheapest first.
    One short text calls this ~40 times a forward pass, so every check is a plain attribute or a C call: the
    tensors' `is_cpu`, not `.device.type` (builds a device object); the tracer's state straight from torch._C."""
    if not (x.is_cpu and weight.is_cpu) or x.dtype != weight.dtype or weight.dtype not in DTYPES:
        return False
    if bias is not None and bias.dtype != weight.dtype:
        return False
    if torch.is_autocast_enabled("cpu") or torch._C._get_tracing_state() is not None:
        return False
    onnx = sys.modules.get("torch.onnx")  # loaded by an export; not imported here for nothing
    if onnx is not None and onnx.is_in_onnx_export():
        return False
    # a shape error is F.linear's to raise (it names the shapes), not a reason to turn packing off
    return x.dim() >= 1 and x.shape[-1] == weight.shape[1] > 0 and x.numel() > 0 and _onednn()


def _packed_weight(weight: Tensor) -> Tensor:
    """WEIGHT's packed copy, built (or rebuilt, after any change to the weight) here."""
    key = _key(weight)
    cache = weight.__dict__.get(ATTR)
    if cache is None or cache.key != key:
        weight.__dict__[ATTR] = None  # the stale copy goes before the new one is built: never both at once
        cache = Packed(key, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None))  # (out, in), blocked
        weight.__dict__[ATTR] = cache
    return cache.tensor


FINE_STEP, FINE_MAX = 16, 128  # padded row counts: multiples of FINE_STEP up to FINE_MAX, then 8 steps per doubling


def padded_rows(rows: int) -> int:
    """The row count a packed fp32 call pads ROWS up to: 16, 32, .., 128, then 144, 160, .., 256, 288, 320, .., 512,
    576, .. (a bounded set of oneDNN primitives over varied token counts; module docstring)."""
    if rows <= FINE_MAX:
        return max(FINE_STEP, -(-rows // FINE_STEP) * FINE_STEP)
    step = 1 << ((rows - 1).bit_length() - 4)  # 1/8 of the power of two below rows
    return -(-rows // step) * step


def _compute(weight: Tensor, bias: Tensor | None, x: Tensor) -> Tensor:
    """x (.., in) -> (.., out) through the packed weight. oneDNN's op takes x with any leading axes and keeps them,
    so a bf16 call with 2+ axes goes in as it is (no reshape, no slice: one op); fp32 calls pad their rows
    (`padded_rows`) and 1-D inputs get a row axis, so those run on (M, in)."""
    packed = _packed_weight(weight)
    if x.dtype != torch.float32 and x.dim() >= 2:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")  # (.., out)
    k = weight.shape[1]
    rows = x.reshape(-1, k)  # (M, in)
    m = rows.shape[0]
    target = padded_rows(m) if x.dtype == torch.float32 else m
    if target != m:
        rows = torch.cat([rows, rows.new_zeros(target - m, k)])  # (M', in): the zero rows are sliced off below
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")  # (M', out)
    return out[:m].reshape(*x.shape[:-1], out.shape[-1])  # (.., out)


def drop(layer: nn.Module) -> None:
    """Forget the packed copy of the layer's weight (training, or a weight about to change)."""
    weight = getattr(layer, "weight", None)
    if weight is not None and weight.__dict__.get(ATTR) is not None:
        weight.__dict__[ATTR] = None


def linear(layer: nn.Linear, x: Tensor) -> Tensor:
    """F.linear(x, layer.weight, layer.bias), through the packed weight where the module docstring says. The weight
    and bias are read off the layer once (each read of an nn.Module attribute goes through its __getattr__)."""
    weight, bias = layer.weight, layer.bias
    if torch.compiler.is_compiling():  # first: dynamo cannot trace the cache on the weight's __dict__ (nor needs it)
        return F.linear(x, weight, bias)
    if layer.training or torch.is_grad_enabled():
        if weight.__dict__.get(ATTR) is not None:
            weight.__dict__[ATTR] = None  # a fine-tune holds no packed copies
        return F.linear(x, weight, bias)
    if not _packable(weight, bias, x):
        return F.linear(x, weight, bias)
    try:
        return _compute(weight, bias, x)
    except RuntimeError as e:  # an op this torch build lacks or refuses: packing off for the process, said once
        _State.usable = False
        drop(layer)
        log.warning("packed Linear layers off (%s): %s", type(e).__name__, e)
        return F.linear(x, weight, bias)


class _Weights(NamedTuple):
    """What `linear` reads of a layer, for callers that hold a float weight outside an nn.Linear."""
    weight: Tensor
    bias: Tensor | None
    training: bool = False


def linear_weights(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """F.linear(x, weight, bias) at inference, through the packed weight where the module docstring says: for a float
    weight held beside other things (nn/int8.py's calls of few rows)."""
    return linear(_Weights(weight, bias), x)


class PackedLinear(nn.Linear):
    """An nn.Linear whose inference product runs on its weight prepacked for oneDNN (module docstring): the same
    weight and bias Parameters as the layer it replaces (shared, never copied), under the same names."""

    def __init__(self, base: nn.Linear):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.train(base.training)

    def forward(self, x: Tensor) -> Tensor:  # (.., in) -> (.., out)
        return linear(self, x)


def pack_linears(model: nn.Module) -> int:
    """Put a PackedLinear in place of each plain nn.Linear under MODEL (a module held in several places, ALBERT's
    shared layers, is replaced everywhere by one PackedLinear) and set `prepacked` on the layers that declare it ->
    how many layers now compute packed. A LoRA layer's own A and B stay plain: the model that trained and saved an
    adapter ran them unpacked, and the model that loads it should compute the same."""
    inner = {id(sub) for m in model.modules() if isinstance(m, nn.Linear) and type(m) is not nn.Linear
             for sub in m.modules() if sub is not m}
    replace: dict[int, PackedLinear] = {}
    for module in model.modules():
        if type(module) is nn.Linear and id(module) not in inner and id(module) not in replace:
            replace[id(module)] = PackedLinear(module)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in replace:
                setattr(parent, name, replace[id(child)])
    flagged = 0
    for module in model.modules():
        if getattr(module, "prepacked", None) is False:
            module.prepacked = True
            flagged += 1
    return len(replace) + flagged


def _held(weight: Tensor) -> Tensor | None:
    cache = weight.__dict__.get(ATTR)
    return cache.tensor if cache is not None else None


def cached(layer: nn.Module) -> Tensor | None:
    """The packed copy of the layer's weight held now (None: none)."""
    return _held(layer.weight)


def packed_bytes(weight: Tensor) -> int:
    """Bytes held by WEIGHT's packed copy now (0: none): what a server's memory budget must count beside the
    weight itself once inference ran. oneDNN's blocked layout holds the same elements (its few padding bytes are
    not counted)."""
    return weight.numel() * weight.element_size() if _held(weight) is not None else 0
