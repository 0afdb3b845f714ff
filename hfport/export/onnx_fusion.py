"""The onnxruntime-fused fp32 graph (model_optimized.onnx, optimum's name for what its ORTOptimizer writes), and the
activation statistics behind the int8 graph: which input channels leave the int8 path (split_outliers) and which
MatMuls stay fp32 (activation_errors).

Fusing is what makes the int8 graph fast: profiled on a fine-tuned all-MiniLM-L6-v2 (16 rows of 8-256 tokens), the
int8 graph made from the plain model.onnx spent ~47% of its time in attention's unfused pieces (the mask Where,
the NaN guard torch's SDPA export adds after Softmax, Add, Softmax, two batched MatMuls, Transposes) and ~34% in
the quantized projections. Two steps:
  1. the trace itself emits onnxruntime's MultiHeadAttention (com.microsoft) for every attention call that has
     only a key-padding mask: the kernel is swapped for `ort_attention` while tracing, exactly as DeBERTa's
     `traceable` switch is. onnxruntime's own pattern matcher cannot find attention in hfport's graphs (its
     patterns are transformers' BERT exports), which is why the trace emits it rather than a pass matching it.
     Calls with a score bias (DeBERTa) or a mask that is not a key-padding mask (local windows) keep the
     portable SDPA pieces.
  2. onnxruntime.transformers' optimizer fuses Add + LayerNormalization into SkipLayerNormalization and
     Add + Gelu into BiasGelu. EmbedLayerNormalization stays off: it assumes BERT's position ids, which RoBERTa's
     offset ones are not; the exact GELU stays exact.
model.onnx remains the portable graph (standard ONNX ops only); model_optimized.onnx runs on onnxruntime only.
Both are checked against hfport at the same fp32 tolerance.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.attention import ATTENTION_BACKENDS, SelfAttention, sdpa_attention
from ..nn.int8 import MAX_OUTLIERS, OUTLIER_RATIO, outlier_channels

OPTIMIZED_FILE = "model_optimized.onnx"  # as optimum's ORTOptimizer names it
FUSED_BACKEND = "onnxruntime"  # the kernel name registered while tracing
CONTRIB_DOMAIN = "com.microsoft"


class _MultiHeadAttention(torch.autograd.Function):
    """Eager: SDPA with a key-padding mask. Traced: one com.microsoft MultiHeadAttention node."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, keep: Tensor, heads: int, width: int,
                scale: float) -> Tensor:
        b, t, c = q.shape  # (B, T, C) each; keep (B, T) int32, 1 = attend

        def split(x: Tensor) -> Tensor:
            return x.view(b, t, heads, c // heads).transpose(1, 2)  # (B, H, T, D)

        out = F.scaled_dot_product_attention(split(q), split(k), split(v), attn_mask=keep.bool()[:, None, None, :],
                                             scale=scale)  # (B, H, T, D)
        return out.transpose(1, 2).reshape(b, t, c)  # (B, T, C)

    @staticmethod
    def symbolic(g: Any, q: Any, k: Any, v: Any, keep: Any, heads: int, width: int, scale: float) -> Any:
        # the optional bias input cannot be left empty from a symbolic (the TorchScript exporter asserts), and
        # key_padding_mask comes after it: a zero bias, added inside the kernel
        bias = g.op("Constant", value_t=torch.zeros(3 * width))
        out = g.op(f"{CONTRIB_DOMAIN}::MultiHeadAttention", q, k, v, bias, keep, num_heads_i=heads, scale_f=scale)
        # (B, T, C) as q: ONNX shape inference knows no contrib op, and without a type the exporter warns at every
        # attention call that the graph's shapes may be wrong
        out.setType(q.type())
        return out


def ort_attention(q: Tensor, k: Tensor, v: Tensor, *, mask: Tensor | None, bias: Tensor | None, dropout_p: float,
                  scale: float) -> Tensor:
    """An attention backend (nn/attention.py's signature) that traces into MultiHeadAttention where it can."""
    g, h, length, d = q.shape  # (G, H, L, D)
    if bias is not None or dropout_p or mask is None or tuple(mask.shape) != (g, 1, 1, length):
        return sdpa_attention(q, k, v, mask=mask, bias=bias, dropout_p=dropout_p, scale=scale)

    def merge(x: Tensor) -> Tensor:
        return x.transpose(1, 2).reshape(g, length, h * d)  # (G, L, C)

    keep = mask[:, 0, 0, :].to(torch.int32)  # (G, L)
    out = _MultiHeadAttention.apply(merge(q), merge(k), merge(v), keep, int(h), int(h * d), float(scale))
    return out.view(g, length, h, d).transpose(1, 2)  # (G, H, L, D)


@contextmanager
def attention_backend(model: nn.Module, backend: str | None) -> Iterator[None]:
    """While tracing: every SelfAttention of `model` runs BACKEND, a name in nn/attention.py's ATTENTION_BACKENDS
    (restored afterwards; None: each keeps its own)."""
    modules = [m for m in model.modules() if isinstance(m, SelfAttention)] if backend is not None else []
    before = [m.backend for m in modules]
    try:
        for m in modules:
            m.backend = backend
        yield
    finally:
        for m, name in zip(modules, before):
            m.backend = name


@contextmanager
def fused_attention(model: nn.Module) -> Iterator[None]:
    """While tracing: every SelfAttention of `model` runs `ort_attention` (registered for the trace only)."""
    had = FUSED_BACKEND in ATTENTION_BACKENDS
    ATTENTION_BACKENDS[FUSED_BACKEND] = ort_attention
    try:
        with attention_backend(model, FUSED_BACKEND):
            yield
    finally:
        if not had:
            del ATTENTION_BACKENDS[FUSED_BACKEND]


def optimize_graph(src: Path, dst: Path, num_heads: int, hidden_size: int) -> dict[str, int]:
    """Fuse SkipLayerNormalization and BiasGelu into the graph at `src` (already carrying MultiHeadAttention);
    write `dst`. Returns the count of each fused op in `dst`."""
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    options = FusionOptions("bert")
    options.enable_attention = False  # emitted by the trace (module docstring)
    options.enable_embed_layer_norm = False  # BERT's position ids only
    options.enable_gelu_approximation = False
    quiet = logging.getLogger()  # the optimizer logs through the root logger
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # opt_level 0: the Python fusions only; no onnxruntime session passes, whose output can be specific to
            # this machine's CPU
            model = optimize_model(str(src), model_type="bert", num_heads=num_heads, hidden_size=hidden_size,
                                   opt_level=0, optimization_options=options)
            model.save_model_to_file(str(dst))
    finally:
        quiet.setLevel(level)
    counts: dict[str, int] = {}
    for node in model.model.graph.node:
        if node.domain == CONTRIB_DOMAIN:
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def _token_rows(model: Any, names: list[str], feeds: list[dict[str, np.ndarray]]) -> Iterator[tuple[str, Any, Any]]:
    """Runs `model` (an onnx.ModelProto, left as it is) on each of `feeds` with the tensors `names` as its outputs,
    with as many threads as torch has: yields (name, x, real) per feed and name, `x` the tensor's token rows and
    `real` the mask of its real tokens: x (B, T, C) with the feed's (B, T) mask, or x (N, C) with an all-True (N,) mask
    where the rows are a layout's (between the feed's real tokens and all its B * T positions: DeBERTa's real tokens
    plus one representative row of each padded sequence, which hold transformers' values at padding positions); x is
    None where it is not token rows (ModernBERT's rotary angles, a pooled (B, C) batch, DeBERTa's relative table)."""
    import onnx
    import onnxruntime as ort

    if not names:
        return
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    del probe.graph.output[:]  # only the named tensors are needed
    probe.graph.output.extend(onnx.ValueInfoProto(name=name) for name in names)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = torch.get_num_threads()  # as open_session: what the caller gave torch
    session = ort.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
    for feed in feeds:
        real = feed["attention_mask"].astype(bool)  # (B, T)
        for name, x in zip(names, session.run(names, feed)):
            if x.ndim == 3 and x.shape[:2] == real.shape:
                yield name, x, real
            elif x.ndim == 2 and real.sum() <= x.shape[0] <= real.size:
                yield name, x, np.ones(x.shape[0], bool)  # (N, C) rows, every one counted
            else:
                yield name, None, real


def activation_errors(path: Path, feeds: list[dict[str, np.ndarray]]) -> dict[str, float]:
    """For each MatMul with a constant weight in the graph at `path`: the relative L2 error that dynamic
    quantization's per-tensor uint8 activation scale puts on its input, over the real tokens of `feeds` (each
    batch quantized on its own, as at run time). What decides which MatMuls stay fp32 in the int8 graph."""
    import onnx

    model = onnx.load(str(path))
    weights = {i.name for i in model.graph.initializer}
    matmuls = [n for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in weights]
    inputs = sorted({n.input[0] for n in matmuls})
    noise = {name: 0.0 for name in inputs}
    signal = {name: 0.0 for name in inputs}
    for name, x, real in _token_rows(model, inputs, feeds):
        if x is None:  # not token rows: never quantized
            noise[name], signal[name] = float("inf"), 1.0
            continue
        lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)  # the quantizer's range includes 0
        step = (hi - lo) / 255 or 1.0
        zero = np.round(-lo / step)
        back = (np.clip(np.round(x / step) + zero, 0, 255) - zero) * step
        noise[name] += float(np.square((x - back)[real]).sum())
        signal[name] += float(np.square(x[real]).sum())
    return {n.name: (noise[n.input[0]] / signal[n.input[0]]) ** 0.5 if signal[n.input[0]] else 0.0 for n in matmuls}


def _weight_matmuls(model: Any) -> list[Any]:
    """The nodes of `model` (an onnx.ModelProto) that multiply their input by a constant 2-D initializer: MatMuls,
    and the Gemms a linear layer on (N, C) rows traces to (DeBERTa's layers, poolers and heads) with that weight as
    their B (A not transposed, alpha 1; the bias C adds after)."""
    weights = {i.name: i for i in model.graph.initializer}

    def gemm(node: Any) -> bool:
        attrs = {a.name: a for a in node.attribute}
        return node.op_type == "Gemm" and ("transA" not in attrs or attrs["transA"].i == 0) and (
            "alpha" not in attrs or attrs["alpha"].f == 1.0)

    return [node for node in model.graph.node if (node.op_type == "MatMul" or gemm(node))
            and node.input[1] in weights and len(weights[node.input[1]].dims) == 2]


def _transposed(node: Any) -> bool:
    """Whether the weight of `node` (one of _weight_matmuls') is stored (C_out, C_in): a Gemm's transB."""
    return any(a.name == "transB" and a.i == 1 for a in node.attribute)


def weight_matmuls(path: Path) -> list[str]:
    """The names of the MatMuls (and Gemms) with a constant 2-D weight in the graph at `path`: what split_outliers
    can split."""
    import onnx

    return [node.name for node in _weight_matmuls(onnx.load(str(path)))]


def split_outliers(src: Path, dst: Path, feeds: list[dict[str, np.ndarray]], ratio: float = OUTLIER_RATIO,
                   max_channels: int = MAX_OUTLIERS, scope: Callable[[str], bool] | None = None,
                   ) -> tuple[list[str], dict[str, list[int]]]:
    """LLM.int8()-style outlier decomposition (Dettmers et al. 2022) for dynamic quantization, written to `dst`.

    For each input X of MatMuls with constant weights (Q/K/V share theirs; a Gemm counts as its weight's MatMul, its
    bias staying with the int8 part): the input channels whose largest |value| over the real tokens of `feeds`
    exceeds `ratio` times the median channel's (at most `max_channels`, the largest first) leave the int8 path:
    hfport's one outlier rule, nn/int8.py's `outlier_channels`, which the engine's int8 layers use too. Each such
    MatMul X.W becomes
        (X * inlier_mask) . W_inliers   (the int8 candidate: W's outlier rows zeroed, so neither the per-tensor
                                         activation scale nor the weight's per-channel scale sees the outliers)
      + Gather(X, outliers) . W[outliers]   (a fp32 MatMul of width <= max_channels)
    which is X.W exactly in fp32. Returns (the fp32 side MatMuls' names, to keep out of quantization; the split
    channels per input). Inputs that are not token rows (ModernBERT's rotary angles) are left alone, and so are the
    inputs whose MatMuls are not all in `scope` (a predicate on the MatMul node's name; None: every MatMul)."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(src))
    weights = {i.name: i for i in model.graph.initializer}
    groups: dict[str, list[Any]] = {}
    for node in _weight_matmuls(model):
        groups.setdefault(node.input[0], []).append(node)
    if scope is not None:
        groups = {x: group for x, group in groups.items() if all(scope(n.name) for n in group)}
    peaks = _channel_peaks(model, list(groups), feeds)
    nodes = list(model.graph.node)
    side: list[str] = []
    split: dict[str, list[int]] = {}
    for x, group in groups.items():
        peak = peaks.get(x)
        if peak is None or any(weights[n.input[1]].dims[int(_transposed(n))] != len(peak) for n in group):
            continue
        out = outlier_channels(torch.from_numpy(peak), ratio, max_channels).tolist()
        if not out:
            continue
        split[x] = out
        mask = np.ones(len(peak), np.float32)
        mask[out] = 0.0
        model.graph.initializer.extend([numpy_helper.from_array(mask, f"{x}/inlier_mask"),
                                        numpy_helper.from_array(np.array(out, np.int64), f"{x}/outlier_index")])
        first = min(nodes.index(n) for n in group)
        new = [helper.make_node("Mul", [x, f"{x}/inlier_mask"], [f"{x}/inliers"], name=f"{x}/Inliers"),
               helper.make_node("Gather", [x, f"{x}/outlier_index"], [f"{x}/outliers"], name=f"{x}/Outliers",
                                axis=-1)]  # (B, T, k) or (N, k)
        adds = []
        for n in group:
            stored = numpy_helper.to_array(weights[n.input[1]])
            w = stored.T if _transposed(n) else stored  # (C_in, C_out)
            rows = w[out]  # (k, C_out)
            w = w.copy()
            w[out] = 0.0
            # new initializers per node: a weight can be shared by MatMuls on other inputs (ALBERT's layers)
            inliers = np.ascontiguousarray(w.T) if _transposed(n) else w  # as the node reads it
            model.graph.initializer.extend([numpy_helper.from_array(inliers, f"{n.name}/inlier_weight"),
                                            numpy_helper.from_array(rows, f"{n.name}/outlier_weight")])
            y = n.output[0]
            n.input[0], n.input[1], n.output[0] = f"{x}/inliers", f"{n.name}/inlier_weight", f"{y}/inlier_part"
            side.append(f"{n.name}/Outliers")
            new.append(helper.make_node("MatMul", [f"{x}/outliers", f"{n.name}/outlier_weight"],
                                        [f"{y}/outlier_part"], name=side[-1]))
            adds.append((n, helper.make_node("Add", [f"{y}/inlier_part", f"{y}/outlier_part"], [y],
                                             name=f"{n.name}/AddOutliers")))
        nodes[first:first] = new  # before the group's first MatMul: X exists there
        for n, add in adds:
            nodes.insert(nodes.index(n) + 1, add)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    used = {name for n in nodes for name in n.input}
    kept = [i for i in model.graph.initializer if i.name in used or i.name not in weights]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)  # the replaced weights no longer feed anything
    onnx.save(model, str(dst))
    return side, split


def _channel_peaks(model: Any, inputs: list[str], feeds: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The largest |value| of each channel (last axis) of each tensor in `inputs`, over the real tokens of `feeds`;
    tensors that are not token rows are left out."""
    peaks: dict[str, np.ndarray] = {}
    skip: set[str] = set()
    for name, x, real in _token_rows(model, inputs, feeds):
        if x is None:
            skip.add(name)
            continue
        peak = np.abs(x[real]).max(0)  # (C,)
        peaks[name] = np.maximum(peaks[name], peak) if name in peaks else peak
    return {name: p for name, p in peaks.items() if name not in skip}
