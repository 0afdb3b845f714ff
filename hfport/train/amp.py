"""Mixed precision around one optimizer step: which autocast a run gets (mixed_precision), the model's outputs in fp32
for the loss (float32_outputs), the gradients unscaled and clipped by their global norm (clip_grad_norm), and whether
the loss scaler skipped the update (LossScale).

fp16 on a GPU runs with accelerate's loss scaler (a GradScaler): backward scales the loss up so small gradients
survive fp16, clip_grad_norm unscales them first, and the optimizer's step (accelerate's wrapper: the scaler's step,
then its update) skips the update when a gradient is inf or nan and halves the scale. The loop then leaves the
scheduler alone for that step, as transformers' Trainer does, and counts it. bf16 and fp32 have no scaler and never
skip.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import torch
from accelerate.utils import DistributedType

from ..errors import ConfigError
from ..hardware import cpu_capabilities

log = logging.getLogger("hfport.train")


def mixed_precision(choice: str) -> str:
    """accelerate's mixed_precision for the run. auto: bf16 where the GPU supports it, fp16 (with loss scaling) on
    older GPUs; on the CPU bf16 autocast where bf16 is native (a measured matmul speed-up, hardware.py), else fp32.
    Weights and optimizer state stay fp32 either way; autocast covers the forward pass only."""
    if torch.cuda.is_available():
        if choice == "auto":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}[choice]
    if choice == "fp16":
        # accelerate would quietly run fp32: no CPU autocast to fp16 and no loss scaler there
        raise ConfigError("precision: 'fp16' needs a CUDA GPU; on the CPU use 'bf16', 'fp32' or 'auto'")
    if choice == "fp32":
        return "no"
    cpu = cpu_capabilities()
    if choice == "auto":
        return "bf16" if cpu.bf16_native else "no"
    if not cpu.bf16_native:
        log.warning("precision: 'bf16' on a CPU without native bf16: its matmul measured %.2fx fp32's speed here "
                    "(%.0f vs %.0f GFLOP/s), so this run will be slower than fp32; 'auto' picks fp32 on this CPU",
                    cpu.bf16_speedup, cpu.peaks["bfloat16"], cpu.peaks["float32"])
    return "bf16"


def float32_outputs(outputs: Any) -> Any:
    """The model's outputs with every floating tensor in fp32, so the loss is computed in fp32 whatever autocast
    produced (a no-op for fp32 outputs: .float() returns the same tensor). A task's forward may return a bare tensor
    (sentence embeddings)."""
    if torch.is_tensor(outputs):
        return outputs.float() if outputs.is_floating_point() else outputs
    return dataclasses.replace(outputs, **{f.name: v.float() for f in dataclasses.fields(outputs)
                                           if torch.is_tensor(v := getattr(outputs, f.name)) and v.is_floating_point()})


# Devices whose values Python reads without waiting for queued work (the CPU computes as it is asked): there the
# clipping decision reads the norm; anywhere else the norm stays on the device.
FREE_READS = frozenset({"cpu"})


def clip_grad_norm(accelerator: Any, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """accelerate's clip_grad_norm_ (unscale, global norm, scale by min(1, max_norm / (norm + 1e-6))), without the
    scaling pass when that factor is exactly 1.0: multiplying by 1.0 changes no bit, and skipping it saves a read and a
    write of every gradient (~90 MB for MiniLM) on each step whose norm is under the limit. torch's own arithmetic
    decides, so the gradients are identical either way. FSDP, DeepSpeed and XLA keep accelerate's own path.

    On a GPU the norm stays there: deciding to skip would wait for it, so the factor is applied on the device
    (torch's clip_grads_with_norm_, clamped to 1.0: the same bits), and max_norm = inf (no clipping) skips it."""
    if accelerator.distributed_type not in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
        return accelerator.clip_grad_norm_(params, max_norm)
    accelerator.unscale_gradients()  # fp16 loss scaling; a no-op otherwise
    total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])  # () fp32
    if total.device.type not in FREE_READS:
        if not math.isinf(max_norm):
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total
    coef = (max_norm / (total + 1e-6)).item()  # torch's clip_coef: clamped to 1.0, the multiply is a no-op
    if not coef >= 1.0:  # a NaN norm scales too, as torch does (every gradient becomes NaN)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


class LossScale:
    """Whether the loss scaler skipped the optimizer step just taken: keep the scale before the step, compare after
    it. The scaler halves its scale after a step it skipped (inf or nan gradients) and never lowers it otherwise, so
    a lower scale means a skip. accelerate's own flag (`accelerator.optimizer_step_was_skipped`) watches whether the
    optimizer's step method was called, which an optimizer that takes the scale itself (the fused AdamW, hfport's
    default) always is: on overflow it reports no skip (accelerate issue #4242). Without a scaler nothing is ever
    skipped and nothing is read.

    The scale before is a copy on the device (GradScaler's _get_scale_async: get_scale() would wait for a GPU), so
    the comparison after the step is the step's one wait: the schedule needs its answer before the next step."""

    def __init__(self, scaler: Any):
        self.scaler = scaler
        self.before: torch.Tensor | None = None

    def read(self) -> None:
        """Before the optimizer step."""
        scale = self.scaler._get_scale_async() if self.scaler is not None else None  # () on the device, or None
        self.before = scale.clone() if scale is not None else None

    def skipped(self) -> bool:
        """After the optimizer step (and the scaler's update, which accelerate's step includes)."""
        return self.before is not None and bool(self.scaler._get_scale_async() < self.before)
