"""The inference step: what a model bound for CPU inference gets, applied by the code that serves it and by nothing
else. Pipelines apply it to their model (Pipeline.__init__), so the server's model cache, which builds pipelines,
gets it too; from_pretrained never does (a loaded model may be fine-tuned next), and training never sees it.

    for_inference(model, packed_linear=True)   eval mode; with packed_linear, nn/packed.py's PackedLinear in place of
                                               each plain nn.Linear (and `prepacked` set on the LoRA, mixed-adapter
                                               and int8 layers' own float products): `repr(model)` shows them
    inference_steps(model)                     what the step did to a model, read off its modules (`hfport info`)

Each step stays while a same-run A/B on whole-model inference shows it earns its lines on a default path
(scripts/bench_engine_ab.py; the table in docs/benchmarks.md). A pipeline's other engine choice, row shards, splits a
batch rather than changing the model: pipelines/shards.py.
"""

from __future__ import annotations

from torch import nn

from .nn.packed import PackedLinear, pack_linears


def for_inference(model: nn.Module, *, packed_linear: bool = True) -> nn.Module:
    """MODEL in eval mode with the inference steps asked for applied in place (module docstring) -> MODEL."""
    model.eval()
    if packed_linear:
        pack_linears(model)
    return model


def inference_steps(model: nn.Module) -> dict[str, int]:
    """{step: how many layers it reaches} for the steps applied to MODEL: "packed_linear" counts PackedLinear layers
    and the layers computing their own float product prepacked (LoRA, mixed adapters, int8's calls of few rows)."""
    modules = {id(m): m for m in model.modules()}.values()  # a shared module once
    packed = sum(isinstance(m, PackedLinear) or getattr(m, "prepacked", False) is True for m in modules)
    return {"packed_linear": packed} if packed else {}
