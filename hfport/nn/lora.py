"""The LoRA layer and what it does to a module tree: wrap linear layers, find them, fold them back in.

Why hfport has its own LoRA layer instead of using peft for training: the layer is ~20 lines, it wraps hfport's
module names (`body.encoder.layers.{i}.attn.q`) on every layout (padded, packed), its parameters go through the same
checkpoints as any other weight (exact resume), and the core keeps no dependency on peft. PEFT's on-disk format is
hfport/formats/adapter.py's; applying, saving and loading adapters on task models is hfport/lora.py's.

    LoraLinear   y = x W^T + b + scaling * B(A(dropout(x))), W and b frozen (the base's own tensors, shared, never
                 copied); A (r x in) kaiming-uniform(a=sqrt(5)) as peft, B (out x r) zeros;
                 scaling = alpha / r (alpha / sqrt(r) with use_rslora)
    ChunkLoraLinear  a LoRA per output-row chunk of a fused layer (PEFT's q_proj/k_proj/v_proj on a fused qkv):
                 one LoraLinear with a block-diagonal B
    wrap         put a LoraLinear around each named linear layer of a module tree
    merged       a copy with B A folded into W (new tensors: a shared base is never written)

Mixed-adapter batches (serving many adapters over one base in one forward pass; inference only):
    MixedLinear  a base linear layer that adds, to each row of its input, the LoRA update of that row's adapter
                 (or none: the base); the adapters' A/B live in an AdapterTable, never in the layer
    AdapterTable slot -> {layer path -> (A, B, scaling)}: an immutable snapshot, replaced (never edited) when an
                 adapter is added or removed, so a forward pass in flight keeps the table it started with
    replaying    the body's output of a mixed batch, handed to each adapter's head on its rows (no second pass)
    routing      while a body runs: which slot each row of the batch takes. Set per thread (a server runs several
                 batches at once); the encoder's pre-hook turns the per-row slots into per-token ones through the
                 batch's layout (a packed batch is its real tokens: a row is a segment of the token axis)
Per layer the update is grouped per adapter over the rows: gather the rows of one adapter, x_a A^T B^T * scaling,
index_add back (two small matmuls per adapter present; ranks may differ). The other way, gathering each token's A
and B for a batched matmul, reads r x (in + out) weights per token instead of per adapter and needs one rank for
all: simpler kept, and the row index of each adapter is computed once per forward pass (Route), not per layer.
"""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import ConfigError
from .dropout import Dropout


class LoraError(ConfigError):
    """A LoRA setting, an adapter folder or an adapter/base pairing hfport cannot use; the message names it."""


class LoraLinear(nn.Linear):
    """A linear layer plus a low-rank update. `weight` and `bias` are the wrapped layer's own Parameters (kept
    under their names, so key maps and checkpoints see the layer as before); `lora_A.weight`, `lora_B.weight` are
    named as PEFT names them."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0, use_rslora: bool = False):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight  # (out, in), the same Parameter: nothing copied
        self.bias = base.bias
        kw = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_dropout = Dropout(dropout) if dropout > 0 else nn.Identity()  # peft: Identity at 0
        self.lora_A = nn.Linear(self.in_features, r, bias=False, **kw)  # (r, in)
        self.lora_B = nn.Linear(r, self.out_features, bias=False, **kw)  # (out, r)
        self.r, self.alpha, self.use_rslora = r, alpha, use_rslora
        self.scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
        self.reset_lora_parameters()

    @torch.no_grad()
    def reset_lora_parameters(self) -> None:
        if self.lora_A.weight.device.type == "meta":
            return
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # as peft (and nn.Linear's default)
        nn.init.zeros_(self.lora_B.weight)  # the update starts at zero: the model starts as the base

    def forward(self, x: Tensor) -> Tensor:  # (.., in) -> (.., out)
        out = F.linear(x, self.weight, self.bias)
        return out + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def delta_weight(self) -> Tensor:
        """scaling * B A, (out, in), computed in float32."""
        return (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scaling

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, r={self.r}, alpha={self.alpha}"


class ChunkLoraLinear(LoraLinear):
    """LoRAs on output-row chunks of a fused projection: what PEFT adapters on transformers' q_proj/k_proj/v_proj
    are on a fused q/k/v layer. One LoRA of rank r per adapted chunk (`blocks`: which of `chunks` equal row chunks),
    held as one LoraLinear of rank r x len(blocks) whose B is block-diagonal: A stacks the chunks' A (rows j r..),
    B's block (chunk c's rows, columns j r..) is chunk c's B, the rest is masked to zero (forward and gradient), so
    B A is exactly each chunk's B_c A_c on its rows and zero on a chunk not adapted. scaling is per chunk: alpha / r."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float, use_rslora: bool, chunks: int,
                 blocks: tuple[int, ...]):
        if base.out_features % chunks:
            raise LoraError(f"a fused layer of {base.out_features} output rows does not split into {chunks} chunks")
        super().__init__(base, r * len(blocks), alpha, dropout, use_rslora)
        self.r, self.chunks, self.blocks = r, chunks, tuple(blocks)
        self.scaling = alpha / math.sqrt(r) if use_rslora else alpha / r  # each chunk's own LoRA of rank r
        rows = base.out_features // chunks
        mask = torch.zeros(base.out_features, r * len(blocks), device=base.weight.device, dtype=base.weight.dtype)
        for j, c in enumerate(self.blocks):
            mask[c * rows:(c + 1) * rows, j * r:(j + 1) * r] = 1  # (out, r k): chunk c's rows read block j
        self.register_buffer("block_mask", mask, persistent=False)
        with torch.no_grad():
            self.lora_B.weight.mul_(mask)

    def block(self, j: int) -> tuple[Tensor, Tensor]:
        """Views of block j's A (r, in) and B (out / chunks, r): what PEFT saves for chunk blocks[j]."""
        rows, r, c = self.out_features // self.chunks, self.r, self.blocks[j]
        return self.lora_A.weight[j * r:(j + 1) * r], self.lora_B.weight[c * rows:(c + 1) * rows, j * r:(j + 1) * r]

    def masked_B(self) -> Tensor:  # (out, r k), zero off the diagonal blocks
        return self.lora_B.weight * self.block_mask

    def forward(self, x: Tensor) -> Tensor:  # (.., in) -> (.., out)
        out = F.linear(x, self.weight, self.bias)
        return out + F.linear(self.lora_A(self.lora_dropout(x)), self.masked_B()) * self.scaling

    def delta_weight(self) -> Tensor:
        return (self.masked_B().float() @ self.lora_A.weight.float()) * self.scaling


@dataclass
class AdapterInfo:
    """The adapter on a model: its settings, targets in both namings, the saved head modules and the base."""

    r: int
    alpha: float
    dropout: float
    targets: list[str]  # hfport module paths (body.encoder.layers.0.attn.q, ...)
    peft_targets: list[str]  # PEFT target_modules: shortest HF suffixes that select exactly `targets`
    modules_to_save: list[str]  # the head's HF modules (classifier, pre_classifier, cls, qa_outputs, ...)
    base: str | None = None  # base_model_name_or_path
    use_rslora: bool = False
    folder: str | None = None  # the adapter folder it was loaded from
    extra: dict[str, Any] = field(default_factory=dict)


def lora_modules(model: nn.Module) -> dict[str, LoraLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLinear)}


def has_lora(model: nn.Module) -> bool:
    return getattr(model, "adapter", None) is not None and bool(lora_modules(model))


def wrap(model: nn.Module, names: list[str], r: int, alpha: float, dropout: float, use_rslora: bool,
         chunked: dict[str, tuple[int, tuple[int, ...]]] | None = None) -> None:
    """Replace each named linear layer of `model` (in place) by a LoraLinear around it; a name in `chunked`
    (-> (chunks, adapted chunks)) by a ChunkLoraLinear."""
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent)
        base = getattr(owner, child)
        if chunked and name in chunked:
            layer: LoraLinear = ChunkLoraLinear(base, r, alpha, dropout, use_rslora, *chunked[name])
        else:
            layer = LoraLinear(base, r, alpha, dropout, use_rslora)
        setattr(owner, child, layer)


@torch.no_grad()
def merged(model: nn.Module) -> nn.Module:
    """A plain copy of `model` with each LoRA update folded in: W' = W + scaling * B A (in float32, then the
    weight's dtype). New tensors: the adapter's model, and any base it shares, stay as they are."""
    if not has_lora(model):
        raise LoraError("merged: the model carries no LoRA adapter")
    out = copy.deepcopy(model)
    for name, layer in lora_modules(out).items():
        plain = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                          device=layer.weight.device, dtype=layer.weight.dtype)
        plain.weight.copy_((layer.weight.float() + layer.delta_weight()).to(layer.weight.dtype))
        if layer.bias is not None:
            plain.bias.copy_(layer.bias)
        parent, _, child = name.rpartition(".")
        setattr(out.get_submodule(parent), child, plain)
    out.adapter = None
    for p in out.parameters():
        p.requires_grad_(False)
    return out


# --- mixed-adapter batches ----------------------------------------------------------------------------------------


class MixingError(LoraError):
    """A body that cannot run rows of different adapters in one pass (an adapted layer sees rows of no one
    sequence); AdapterSet then runs that batch one adapter at a time."""


class LoraWeights(NamedTuple):
    """One adapter's update on one layer: scaling * x A^T B^T."""

    A: Tensor  # (r, in)
    B: Tensor  # (out, r)
    scaling: float


AdapterTable = dict[int, dict[str, LoraWeights]]  # slot (>= 1; 0 is the base) -> layer path -> weights


class MixedLinear(nn.Linear):
    """A base linear layer (its own weight and bias Parameters, shared) that adds each row's adapter update while a
    routing is active on this thread; without one it is the plain layer. `path` is its name in the body."""

    def __init__(self, base: nn.Linear, path: str):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias  # the same Parameters: nothing copied
        self.path = path

    def forward(self, x: Tensor) -> Tensor:  # (.., in) -> (.., out)
        out = F.linear(x, self.weight, self.bias)
        route = _state.route
        if route is None:
            return out
        flat_x = x.reshape(-1, self.in_features)  # (R, in): R rows of this layer's input (tokens or sequences)
        flat = out.view(-1, self.out_features)  # (R, out), a view: updates land in `out`
        for slot, rows in route.rows_for(flat_x.shape[0]):
            w = route.table[slot].get(self.path)
            if w is None:  # this adapter does not wrap this layer
                continue
            if rows is None:  # every row takes this adapter
                flat.add_((flat_x @ w.A.t()) @ w.B.t(), alpha=w.scaling)  # (R, out)
            else:
                delta = (flat_x.index_select(0, rows) @ w.A.t()) @ w.B.t()  # (R_a, out)
                flat.index_add_(0, rows, delta, alpha=w.scaling)
        return out


class Route:
    """One forward pass's routing: each batch row's slot, and the per-token slots once the layout is known."""

    def __init__(self, table: AdapterTable, slots: Tensor):
        self.table, self.slots = table, slots  # slots: (B,) long, 0 = the base
        self.tokens: Tensor | None = None  # (N,) or (B, T): the slot of each row of the layout
        self._rows: dict[int, list[tuple[int, Tensor | None]]] = {}

    def rows_for(self, count: int) -> list[tuple[int, Tensor | None]]:
        """(slot, rows of a layer input with `count` rows that take it, None for all), for the slots present;
        the rows are the tokens of the layout, or the sequences (a pooler's input)."""
        if count not in self._rows:
            index = self.slots if count == self.slots.shape[0] else self.tokens
            if index is None or index.numel() != count:
                # rows that are no sequence's (DeBERTa's relative-position table through the shared key layer):
                # one adapter's batch applies it to them; a mixed batch cannot, one table would serve all
                present = set(self.slots.tolist())
                if len(present) > 1:
                    raise MixingError(f"mixed adapters: a layer input of {count} rows belongs to no one row of "
                                      f"the batch ({self.slots.shape[0]} sequences)")
                self._rows[count] = [(present.pop(), None)]
                return self._rows[count]
            index = index.reshape(-1)
            groups = []
            for slot in sorted(set(index.tolist()) - {0}):
                hit = index == slot
                groups.append((slot, None if bool(hit.all()) else hit.nonzero().squeeze(1)))
            self._rows[count] = groups
        return self._rows[count]


class _State(threading.local):
    route: Route | None = None


_state = _State()


@contextmanager
def routing(table: AdapterTable, slots: Tensor | None) -> Iterator[Route | None]:
    """Run the body under `table` with batch row i taking adapter slots[i] (0: the base) on this thread; None: every
    row the base (the plain layers, no routing)."""
    outer = _state.route
    _state.route = Route(table, slots) if slots is not None else None
    try:
        yield _state.route
    finally:
        _state.route = outer


def route_tokens(module: nn.Module, args: tuple[Any, ...]) -> None:
    """The encoder's forward pre-hook: the layout in args[1] turns the batch rows' slots into its rows' slots."""
    route = _state.route
    if route is None:
        return
    layout = args[1]
    b = route.slots.shape[0]
    keep = getattr(layout, "keep", None)
    width = layout.positions.shape[-1] if keep is None else keep.shape[1]
    batch = b if keep is None else keep.shape[0]
    slots = route.slots.repeat_interleave(batch // b) if batch != b else route.slots  # multiple choice: B x C rows
    route.tokens = layout.pack(slots[:, None, None].expand(batch, width, 1)).squeeze(-1)  # (N,) or (B, T)
    route._rows.clear()


def install_mixed(body: nn.Module, paths: list[str]) -> None:
    """Make the named linear layers of `body` MixedLinear (in place; the same Parameters, so the base computes as
    before), and hook its encoder once so routes learn the layout."""
    for path in paths:
        parent, _, child = path.rpartition(".")
        owner = body.get_submodule(parent)
        layer = getattr(owner, child)
        if isinstance(layer, MixedLinear):
            continue
        if isinstance(layer, LoraLinear) or type(layer) is not nn.Linear:
            raise LoraError(f"mixed adapters: {path} is a {type(layer).__name__}, not a plain linear layer")
        setattr(owner, child, MixedLinear(layer, path))
    if not getattr(body.encoder, "_routes_tokens", False):
        body.encoder.register_forward_pre_hook(route_tokens)
        body.encoder._routes_tokens = True


_replay = threading.local()  # .value: (input_ids, (hidden, pooled)) a mixed batch computed on this thread


@contextmanager
def replaying(input_ids: Tensor, outputs: tuple[Tensor, Tensor | None]) -> Iterator[None]:
    """While inside: a model of an AdapterSet asked for the body's output on exactly `input_ids` (the same tensor
    object) gets `outputs` instead of running the body again (a mixed batch's heads, split after one body pass)."""
    outer = getattr(_replay, "value", None)
    _replay.value = (input_ids, outputs)
    try:
        yield
    finally:
        _replay.value = outer


def replay_of(input_ids: Tensor) -> tuple[Tensor, Tensor | None] | None:
    """The outputs `replaying` holds for exactly this tensor, else None."""
    replay = getattr(_replay, "value", None)
    return replay[1] if replay is not None and replay[0] is input_ids else None
