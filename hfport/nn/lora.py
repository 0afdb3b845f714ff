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
                 (or none: the base) under the Route it is given; the adapters' A/B live in an AdapterTable, never
                 in the layer
    AdapterTable slot -> {layer path -> (A, B, scaling)}, and per layer every adapter side by side (A stacked, B
                 scaled and concatenated): an immutable snapshot, rebuilt (never edited) when an adapter is added or
                 removed, so a forward pass in flight keeps the table it started with
    Route        one forward pass's routing: which slot each row of the batch takes. An argument: the body takes it
                 (EncoderBody.forward's `adapters`), binds it to the batch's layout (`Route.on`: a packed batch is
                 its real tokens, a row a segment of the token axis) and the layout carries it to every layer, whose
                 linear calls go through `routed(layer, x, adapters)`. Nothing is kept per thread.
Per layer the update takes one of two forms, chosen per forward pass and layer by a cost rule (Route._segmented):
- segments: a mixed batch comes sorted by adapter within each length (Pipeline.forward_batch), so the rows of one
  adapter are a few contiguous runs of the layer input (tokens in the packed layout); per run,
  y[run] += (x[run] A_k^T) B_k^T on views (one split of x and y per layer). Each row pays its own adapter's rank
  only; two kernels per run.
- stacked: u = x A_cat^T (every present adapter's columns in one matmul), u *= mask (each row keeps its own
  adapter's columns: a (rows, R) 0/1 matrix built once per forward pass and layout of columns), y += u B_cat^T.
  Three kernels whatever the runs, but every row pays every present adapter's rank R (~2 R / in of the base).
scripts/bench_mixed.py (MiniLM, loadtest's 8 adapters: ranks 4-16, 2-3 targets; 8 and 16 short texts; one thread,
interleaved, medians of 30; base / mixed forward-pass time): fp32 stacked 0.83x / 0.88x, with the rule (segments
everywhere) 0.89x / 0.92x; bf16 stacked 0.78x / 0.80x, the rule the same (it keeps stacked on all but ffn.up: bf16
small matmuls cost ~60-100 us a layer whatever the form, so bf16 mixing costs ~36 such calls a pass). Grouping rows
by index_select / index_add per adapter per layer (the first form) was ~1200 small kernels a pass.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import ConfigError
from .dropout import Dropout
from .packed import PackedLinear, linear


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
        self.prepacked = False  # the base product on the packed weight (nn/packed.py: set by pack_linears)
        self.reset_lora_parameters()

    @torch.no_grad()
    def reset_lora_parameters(self) -> None:
        if self.lora_A.weight.device.type == "meta":
            return
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # as peft (and nn.Linear's default)
        nn.init.zeros_(self.lora_B.weight)  # the update starts at zero: the model starts as the base

    def base(self, x: Tensor) -> Tensor:  # (.., in) -> (.., out): x W^T + b
        return linear(self, x) if self.prepacked else F.linear(x, self.weight, self.bias)

    def forward(self, x: Tensor) -> Tensor:  # (.., in) -> (.., out)
        return self.base(x) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def delta_weight(self) -> Tensor:
        """scaling * B A, (out, in), computed in float32."""
        return (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scaling

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, r={self.r}, alpha={self.alpha}"
                + (", prepacked=True" if self.prepacked else ""))


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
        return self.base(x) + F.linear(self.lora_A(self.lora_dropout(x)), self.masked_B()) * self.scaling

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


class LayerAdapters(NamedTuple):
    """Every adapter of a table on one layer, side by side: one matmul gives every adapter's x A^T."""

    A: Tensor  # (R, in): the adapters' A stacked, R the sum of their ranks (ranks may differ)
    B: Tensor  # (out, R): their B side by side, each times its scaling
    owner: Tensor  # (R,) long: the slot of each column; layers whose adapters have equal ranks share one tensor
    spans: dict[int, tuple[int, int]]  # slot -> its columns [start, end)
    parts: dict[int, tuple[Tensor, Tensor]]  # slot -> its (A^T (in, r), B^T (r, out)): views, for a run of its rows


@torch.no_grad()
def _side_by_side(layer: dict[int, LoraWeights], owners: dict[tuple, Tensor]) -> LayerAdapters:
    slots = sorted(layer)
    ranks = tuple((s, layer[s].A.shape[0]) for s in slots)
    A = torch.cat([layer[s].A for s in slots])  # (R, in)
    B = torch.cat([(layer[s].B.float() * layer[s].scaling).to(layer[s].B.dtype) for s in slots], dim=1)  # (out, R)
    if ranks not in owners:
        owners[ranks] = torch.cat([torch.full((r,), s, dtype=torch.long, device=A.device) for s, r in ranks])  # (R,)
    bounds = torch.tensor([0] + [r for _, r in ranks]).cumsum(0).tolist()
    spans = {s: (bounds[i], bounds[i + 1]) for i, s in enumerate(slots)}
    parts = {s: (A[b:e].t(), B[:, b:e].t()) for s, (b, e) in spans.items()}
    return LayerAdapters(A, B, owners[ranks], spans, parts)


class AdapterTable:
    """The adapters a shared body serves: slot (>= 1; 0 is the base) -> layer path -> LoraWeights, and per layer all
    of them side by side (LayerAdapters, in the weights' dtype). Immutable: adding or removing an adapter builds a
    new table (once per change, never per request), so a forward pass in flight keeps the table it started with."""

    def __init__(self, adapters: dict[int, dict[str, LoraWeights]] | None = None):
        self.adapters = dict(adapters or {})
        by_layer: dict[str, dict[int, LoraWeights]] = {}
        for slot, layers in self.adapters.items():
            for path, w in layers.items():
                by_layer.setdefault(path, {})[slot] = w
        owners: dict[tuple, Tensor] = {}
        self.layers = {path: _side_by_side(ws, owners) for path, ws in by_layer.items()}

    def with_adapter(self, slot: int, weights: dict[str, LoraWeights]) -> AdapterTable:
        return AdapterTable({**self.adapters, slot: weights})

    def without(self, slot: int) -> AdapterTable:
        return AdapterTable({s: w for s, w in self.adapters.items() if s != slot})


class MixedLinear(nn.Linear):
    """A base linear layer (its own weight and bias Parameters, shared) that adds each row's adapter update under the
    Route it is given; without one it is the plain layer. `path` is its name in the body."""

    def __init__(self, base: nn.Linear, path: str):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias  # the same Parameters: nothing copied
        self.path = path
        self.prepacked = isinstance(base, PackedLinear)  # the base product as the layer it replaces computed it
        self.train(base.training)  # a body serving in eval mode stays in it (packed products run only there)

    def forward(self, x: Tensor, adapters: Route | None = None) -> Tensor:  # (.., in) -> (.., out)
        out = linear(self, x) if self.prepacked else F.linear(x, self.weight, self.bias)
        layer = adapters.table.layers.get(self.path) if adapters is not None else None
        if layer is None:  # no routing, or no adapter wraps this layer
            return out
        flat_x = x.reshape(-1, self.in_features)  # (M, in): M rows of this layer's input (tokens or sequences)
        plan = adapters.plan(layer, flat_x.shape[0])
        if plan is None:  # no row takes an adapter of this layer
            return out
        update(plan, layer, flat_x, out.view(-1, self.out_features))  # the updates land in `out`
        return out

    def extra_repr(self) -> str:
        return super().extra_repr() + f", path={self.path!r}" + (", prepacked=True" if self.prepacked else "")


def routed(layer: nn.Module, x: Tensor, adapters: Route | None) -> Tensor:
    """layer(x), (.., in) -> (.., out); a MixedLinear under a mixed batch's Route also adds each row's update. Every
    linear call of the encoder's blocks goes through here with its layout's `adapters`."""
    if adapters is not None and isinstance(layer, MixedLinear):
        return layer(x, adapters)
    return layer(x)


def update(plan: Plan | Segments, layer: LayerAdapters, x: Tensor, out: Tensor) -> None:
    """out += each row's adapter update, x (M, in), out (M, out)."""
    if isinstance(plan, Segments):  # each adapter's rows come in a few runs: its own rank only, on its rows
        if len(plan.sizes) > 1:
            xs = x.split_with_sizes(plan.sizes)  # (m_i, in) views, one per run of equal slots
            outs = out.split_with_sizes(plan.sizes)  # (m_i, out) views into `out`
        else:  # every row one adapter (an adapter served alone)
            xs, outs = (x,), (out,)
        for i, slot in plan.runs:
            At, Bt = layer.parts[slot]  # (in, r), (r, out)
            outs[i].addmm_(xs[i] @ At, Bt)  # (m_i, r) @ (r, out) added into the run's rows
        return
    cols, mask = plan
    if isinstance(cols, slice):  # one adapter's columns: views, nothing copied
        A, B = layer.A[cols], layer.B[:, cols]  # (r, in), (out, r)
    elif cols is not None:  # the columns of the adapters present in this batch
        A, B = layer.A.index_select(0, cols), layer.B.index_select(1, cols)  # (R_p, in), (out, R_p)
    else:
        A, B = layer.A, layer.B  # (R, in), (out, R)
    u = x @ A.t()  # (M, R_p): every present adapter's x A^T in one matmul
    if mask is not None:
        u.mul_(mask)  # each row keeps its own adapter's columns (none: the base)
    out.addmm_(u, B.t())  # (M, out)


class Plan(NamedTuple):
    """How a layer input's rows take a layer's adapters: which columns (None: all, a slice: one adapter's) and the
    (M, R_p) 0/1 mask keeping each row's own adapter's columns (None: every row takes the columns kept)."""

    cols: Tensor | slice | None
    mask: Tensor | None


# How an adapted layer computes a mixed batch: "auto" (the cost rule in Route._make_plan), "segments" or "stacked".
MIXED_LORA = "auto"
# The cost rule's fixed costs, in multiply-adds, by dtype: one run of rows in the segment form (two small matmul
# calls and the loop around them), and the stacked form's three calls. Measured on one core of a 2-core CPU (AMD
# EPYC, AVX512-BF16; best of 7 x 200, other work running): per run ~8 us in fp32, ~38 us in bf16 (oneDNN's bf16
# matmuls of a few rows or columns carry a large fixed cost); the stacked form ~11 us fp32, ~45 us bf16; against
# ~50k (fp32) and ~90k (bf16) multiply-adds a us on the stacked form's shapes. float16, not measured, is taken as
# bf16. What the rule then picks at MiniLM's shapes, as measured there: fp32 segments on every layer (2-7x less
# time than stacked); bf16 stacked for 6 runs of 12 tokens on q (87 us against 236 us) and 2 runs of rank 8 (k,
# ffn.down: 51 / 73 us, 78 / 93 us), segments for 2 runs of rank 16 on ffn.up (98 / 113 us) and any long run (2
# runs of 125 tokens: 187 / 780 us).
RUN_COST = {torch.float32: 400_000, torch.bfloat16: 3_400_000, torch.float16: 3_400_000}
STACKED_COST = {torch.float32: 550_000, torch.bfloat16: 4_000_000, torch.float16: 4_000_000}


class Segments(NamedTuple):
    """How a layer input's rows take a layer's adapters when they come in runs of equal slots (a batch sorted by
    adapter): the rows cut into those runs (`sizes`, one split: views, nothing copied), and of each run that takes an
    adapter of this layer its index among them and that adapter's slot."""

    sizes: list[int]
    runs: tuple[tuple[int, int], ...]


class Route:
    """One forward pass's routing: each batch row's slot, the per-token slots once bound to the batch's layout (`on`),
    their runs of equal slots, and per layout of columns and layer width a Plan or Segments (built once per forward
    pass, not per layer: the layers share owner tensors)."""

    def __init__(self, table: AdapterTable, slots: Tensor, tokens: Tensor | None = None):
        self.table, self.slots = table, slots  # slots: (B,) long, 0 = the base
        self.tokens = tokens  # (N,) or (B, T): the slot of each row of the layout (None: not bound to one)
        self.present = sorted(set(slots.tolist()) - {0})
        self._plans: dict[tuple[int, int, int], Plan | Segments | None] = {}
        self._runs: dict[int, list[tuple[int, int, int]]] = {}

    def on(self, layout: Any) -> Route:
        """This routing bound to a batch's layout (nn/layout.py): the batch rows' slots as the slots of its rows."""
        b = self.slots.shape[0]
        keep = getattr(layout, "keep", None)
        width = layout.positions.shape[-1] if keep is None else keep.shape[1]
        batch = b if keep is None else keep.shape[0]
        slots = self.slots.repeat_interleave(batch // b) if batch != b else self.slots  # multiple choice: B x C rows
        tokens = layout.pack(slots[:, None, None].expand(batch, width, 1)).squeeze(-1)  # (N,) or (B, T)
        return Route(self.table, self.slots, tokens)

    def row_slots(self, count: int) -> Tensor:
        """(count,) the slot of each row of a layer input with `count` rows: the tokens of the layout, or the
        sequences (a pooler's input)."""
        index = self.slots if count == self.slots.shape[0] else self.tokens
        if index is None or index.numel() != count:
            # rows that are no sequence's (DeBERTa's relative-position table through the shared key layer): one
            # adapter's batch applies it to them; a mixed batch cannot, one table would serve all
            if len(set(self.slots.tolist())) > 1:
                raise MixingError(f"mixed adapters: a layer input of {count} rows belongs to no one row of "
                                  f"the batch ({self.slots.shape[0]} sequences)")
            return self.slots[:1].expand(count)
        return index.reshape(-1)

    def runs(self, count: int) -> list[tuple[int, int, int]]:
        """(start, end, slot) of each run of equal slots along the `count` rows of a layer input, in order."""
        if count not in self._runs:
            rows = self.row_slots(count)  # (M,)
            edges = ((rows[1:] != rows[:-1]).nonzero().squeeze(1) + 1).tolist()
            starts, ends = [0, *edges], [*edges, count]
            slots = rows[starts].tolist()
            self._runs[count] = list(zip(starts, ends, slots))
        return self._runs[count]

    def plan(self, layer: LayerAdapters, count: int) -> Plan | Segments | None:
        # the owner tensor lives as long as the table this route holds; in + out: the form chosen depends on them
        key = (id(layer.owner), count, layer.A.shape[1] + layer.B.shape[0])
        if key not in self._plans:
            self._plans[key] = self._make_plan(layer, count)
        return self._plans[key]

    def _make_plan(self, layer: LayerAdapters, count: int) -> Plan | Segments | None:
        present = [s for s in self.present if s in layer.spans]
        if not present:
            return None
        if self._segmented(layer, count):
            all_runs = self.runs(count)
            runs = tuple((i, s) for i, (_, _, s) in enumerate(all_runs) if s in layer.spans)
            return Segments([e - b for b, e, _ in all_runs], runs)
        rows = self.row_slots(count)  # (M,)
        if len(present) == len(layer.spans):
            cols, owner = None, layer.owner  # (R,)
        elif len(present) == 1:
            cols = slice(*layer.spans[present[0]])
            owner = layer.owner[cols]  # (r,)
        else:
            cols = torch.cat([torch.arange(*layer.spans[s], device=rows.device) for s in present])  # (R_p,)
            owner = layer.owner.index_select(0, cols)  # (R_p,)
        hit = rows[:, None] == owner[None, :]  # (M, R_p)
        return Plan(cols, None if bool(hit.all()) else hit.to(layer.A.dtype))

    def _segmented(self, layer: LayerAdapters, count: int) -> bool:
        """Whether the segment form costs less than the stacked one on this layer (MIXED_LORA: or as it says). In
        multiply-adds, with w = in + out: segments sum over runs m_i r_i w + RUN_COST, the stacked form
        M R_p w (every row times every present adapter's rank) + STACKED_COST. In fp32 segments win unless runs
        are many and short (a pooler's input over many adapters); in bf16 only for few or long runs."""
        if MIXED_LORA != "auto":
            return MIXED_LORA == "segments"
        if layer.A.device.type != "cpu":  # RUN_COST is a CPU's; on an accelerator kernel launches dominate a
            return False  # layer's few small matmuls (not measured here): the form with the fewest
        width = layer.A.shape[1] + layer.B.shape[0]  # in + out
        run = RUN_COST.get(layer.A.dtype, RUN_COST[torch.bfloat16])
        fixed = STACKED_COST.get(layer.A.dtype, STACKED_COST[torch.bfloat16])
        rank = {s: e - b for s, (b, e) in layer.spans.items()}
        runs = [(e - b, rank[s]) for b, e, s in self.runs(count) if s in rank]
        segments = sum(m * r * width + run for m, r in runs)
        stacked = count * sum(rank[s] for s in self.present if s in rank) * width + fixed
        return segments <= stacked


def install_mixed(body: nn.Module, paths: list[str]) -> None:
    """Make the named linear layers of `body` MixedLinear (in place; the same Parameters, so the base computes as
    before). All or none: every layer is checked before the first is replaced."""
    todo = []
    for path in paths:
        parent, _, child = path.rpartition(".")
        owner = body.get_submodule(parent)
        layer = getattr(owner, child)
        if isinstance(layer, MixedLinear):
            continue
        if type(layer) not in (nn.Linear, PackedLinear):
            raise LoraError(f"mixed adapters: {path} is a {type(layer).__name__}, not a plain linear layer")
        todo.append((owner, child, layer, path))
    for owner, child, layer, path in todo:
        setattr(owner, child, MixedLinear(layer, path))
