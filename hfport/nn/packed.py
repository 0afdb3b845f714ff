"""Prepacked Linear layers for CPU inference: an nn.Linear in eval mode with autograd off runs its fp32 or bf16
product through oneDNN on a weight reordered once into oneDNN's blocked layout (torch.ops.mkldnn's
_reorder_linear_weight / _linear_pointwise, the pair torch's inductor CPU backend uses for frozen Linears).

Why: F.linear reorders nothing ahead of time (fp32: a BLAS call; bf16: oneDNN on the plain weight, re-laid out as it
goes), which costs most on short inputs. Measured per call (a loop over the two ops against F.linear, one thread,
its CPU time, a loaded 2-core AVX512-BF16 EPYC): bf16 1.2-1.45x faster at 14 rows (384 -> 1536: 165 -> 115-126 us),
~1.1x at 64, 1.01-1.16x at 256 and 1024; fp32 1.2-1.65x at every row count (768 -> 3072 at 256 rows: 15.5 -> 11.8
ms). A bf16 MiniLM forward pass of one short text spends 77% of its time in these products.

How it hooks in: `install(model)` sets, on each plain nn.Linear under the model, an instance-level `forward`
(functools.partial(packed_forward, layer), as accelerate's hooks do) instead of swapping or subclassing modules:
the layer keeps its type (`type(layer) is nn.Linear` checks in nn/lora.py and nn/int8.py still find it), its
Parameters, state_dict and `.weight` (LoRA wrapping, merging, int8 quantization, exports and save_pretrained read
the plain weight as before), and a deepcopy or pickle of the model copies the partial bound to the copy. A call in
the shared blocks instead would have to reach every Linear call site (attention and feed-forward variants, pooler,
every head) and stay reached as families are added; the override covers each plain Linear a model has, at once.
LoraLinear and MixedLinear compute their base product through `linear(self, x)`, so adapters keep the gain (a LoRA
layer's own small A and B stay plain: `install`).
from_pretrained installs it on every model it loads (modeling.py); HFPORT_PACKED_LINEAR=off installs nothing and
makes `linear` plain F.linear.

When the packed weight is used (else F.linear, unchanged): the switch is not off, the layer is in eval mode, autograd
is off (torch.no_grad / inference_mode), no CPU autocast, not traced / compiled / ONNX-exported, weight and input on
the CPU in the same dtype, fp32 or bf16, and oneDNN present (torch.backends.mkldnn.is_available(); a first call that
raises turns packing off for the process, logged once). The packed weight is built at the first such call and kept
on the weight tensor (an attribute, so not in state_dict; layers sharing a Parameter share it; a deepcopy or pickle
drops it). It is rebuilt when the weight changes (data_ptr, _version: any in-place update, dtype, device), so
a model trained then evaluated, or cast, never computes with a stale copy; and it is dropped (never built) at the
first forward pass in train mode or with grad on, so fine-tuning holds no packed copies.

Memory: the packed copy sits beside the plain weight (which LoRA, int8, exports and saving still read), so the
Linear weights are held twice once inference has run (a MiniLM pipeline's RSS after its first call: fp32 +44 MiB,
bf16 +22 MiB over HFPORT_PACKED_LINEAR=off; BERT-base fp32 would be ~+340 MB). And oneDNN
caches one primitive per (row count, weight shape) (~1 MB each measured for 384 -> 1536): fp32's F.linear (BLAS)
caches nothing, so packed fp32 calls pad their rows up to `padded_rows` (at most 12.5% extra rows above 128, 15
below) to keep that set bounded; bf16 calls do not (F.linear's bf16 calls go through oneDNN and cache per row count
already).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import ConfigError

log = logging.getLogger("hfport")

MODES = ("auto", "off")
ENV = "HFPORT_PACKED_LINEAR"
DTYPES = (torch.float32, torch.bfloat16)


def mode() -> str:
    """HFPORT_PACKED_LINEAR: "auto" (default: pack where the module docstring says) or "off"; else a ConfigError."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ConfigError(f"{ENV}={os.environ[ENV]!r}: expected one of {', '.join(MODES)}")
    return value


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


def _packable(layer: nn.Linear, x: Tensor) -> bool:
    """The conditions of the module docstring, cheapest first (grad and training decide most calls in training)."""
    w = layer.weight
    if layer.training or torch.is_grad_enabled():
        return False
    if x.device.type != "cpu" or w.device.type != "cpu" or x.dtype != w.dtype or w.dtype not in DTYPES:
        return False
    if layer.bias is not None and layer.bias.dtype != w.dtype:
        return False
    if torch.is_autocast_enabled("cpu") or torch.jit.is_tracing() or torch.compiler.is_compiling():
        return False
    onnx = sys.modules.get("torch.onnx")  # loaded by an export; not imported here for nothing
    if onnx is not None and onnx.is_in_onnx_export():
        return False
    # a shape error is F.linear's to raise (it names the shapes), not a reason to turn packing off
    return x.dim() >= 1 and x.shape[-1] == w.shape[1] > 0 and x.numel() > 0 and _onednn() and mode() == "auto"


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


def _compute(layer: nn.Linear, x: Tensor) -> Tensor:
    """x (.., in) -> (.., out) through the packed weight."""
    k = layer.weight.shape[1]
    rows = x.reshape(-1, k)  # (M, in)
    m = rows.shape[0]
    target = padded_rows(m) if m and x.dtype == torch.float32 else m
    if target != m:
        rows = torch.cat([rows, rows.new_zeros(target - m, k)])  # (M', in): the zero rows are sliced off below
    packed = _packed_weight(layer.weight)
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, layer.bias, "none", [], "")  # (M', out)
    return out[:m].reshape(*x.shape[:-1], out.shape[-1])  # (.., out)


def drop(layer: nn.Module) -> None:
    """Forget the packed copy of the layer's weight (training, or a weight about to change)."""
    weight = getattr(layer, "weight", None)
    if weight is not None and weight.__dict__.get(ATTR) is not None:
        weight.__dict__[ATTR] = None


def linear(layer: nn.Linear, x: Tensor) -> Tensor:
    """F.linear(x, layer.weight, layer.bias), through the packed weight where the module docstring says."""
    if torch.compiler.is_compiling():  # first: dynamo cannot trace the cache on the weight's __dict__ (nor needs it)
        return F.linear(x, layer.weight, layer.bias)
    if not _packable(layer, x):
        if layer.training or torch.is_grad_enabled():
            drop(layer)
        return F.linear(x, layer.weight, layer.bias)
    try:
        return _compute(layer, x)
    except RuntimeError as e:  # an op this torch build lacks or refuses: packing off for the process, said once
        _State.usable = False
        drop(layer)
        log.warning("packed Linear layers off (%s): %s", type(e).__name__, e)
        return F.linear(x, layer.weight, layer.bias)


class _Weights(NamedTuple):
    """What `linear` reads of a layer, for callers that hold a float weight outside an nn.Linear."""
    weight: Tensor
    bias: Tensor | None
    training: bool = False


def linear_weights(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """F.linear(x, weight, bias) at inference, through the packed weight where the module docstring says: for a float
    weight held beside other things (nn/int8.py's calls of few rows)."""
    return linear(_Weights(weight, bias), x)


def packed_forward(layer: nn.Linear, x: Tensor) -> Tensor:
    """The forward `install` gives a plain nn.Linear: x (.., in) -> (.., out)."""
    return linear(layer, x)


def installed(layer: nn.Module) -> bool:
    forward = layer.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func is packed_forward


def install(model: nn.Module) -> int:
    """Give each plain nn.Linear under MODEL the packed forward (unless HFPORT_PACKED_LINEAR=off) -> how many."""
    if mode() == "off":
        return 0
    # a LoRA layer's own A and B stay plain: apply_lora adds them after loading, so they run unpacked in the model
    # that saves an adapter; packing them where an adapter folder is loaded would make the reloaded model differ
    inner = {id(sub) for m in model.modules() if isinstance(m, nn.Linear) and type(m) is not nn.Linear
             for sub in m.modules() if sub is not m}
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear and id(module) not in inner and not installed(module):
            module.forward = functools.partial(packed_forward, module)
            count += 1
    return count


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
