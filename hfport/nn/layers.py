"""The shared encoder blocks: embeddings, feed-forwards (plain, gated), the encoder layer (post- or pre-LN, its
parts injected), encoders, pooler, and the body that runs them in a layout (nn/layout.py)."""

from __future__ import annotations

import torch
from dataclasses import replace

from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .activations import Activation
from .dropout import Dropout
from .layout import Layout, Packed, Padded
from .lora import Route, routed
from .positions import positions_from_padding


def layer_norm(size: int, eps: float, bias: bool = True) -> nn.LayerNorm:
    """LayerNorm, with or without its bias (ModernBERT's norm_bias=False)."""
    return nn.LayerNorm(size, eps=eps, bias=bias)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in float32 and cast back before the weight, as transformers'
    Llama-style RMSNorm (EuroBERT) does."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)  # (.., C) float32
        return self.weight * normed.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class Embeddings(nn.Module):
    """word (+ absolute position) (+ token type) -> LayerNorm -> dropout (-> projection to hidden_size, ALBERT).

    max_positions 0: no position table (positions then come from rotary embeddings or a relative bias).
    norm False: no LayerNorm (EuroBERT's embeddings go straight to the first layer's norm)."""

    def __init__(self, vocab_size: int, dim: int, max_positions: int, type_vocab_size: int, eps: float,
                 dropout: float, pad_token_id: int | None, hidden_size: int | None = None,
                 positions_offset_by_padding: bool = False, norm_bias: bool = True, norm: bool = True):
        super().__init__()
        self.word = nn.Embedding(vocab_size, dim, padding_idx=pad_token_id)
        # RoBERTa's padding positions all sit at pad_token_id: that row gets no gradient, as in transformers
        self.position = nn.Embedding(max_positions, dim, padding_idx=pad_token_id if positions_offset_by_padding
                                     else None) if max_positions > 0 else None
        self.token_type = nn.Embedding(type_vocab_size, dim) if type_vocab_size > 0 else None
        self.norm = layer_norm(dim, eps, norm_bias) if norm else nn.Identity()
        self.dropout = Dropout(dropout)
        self.project = nn.Linear(dim, hidden_size) if hidden_size is not None else None
        self.pad_token_id = pad_token_id
        self.positions_offset_by_padding = positions_offset_by_padding

    def position_ids(self, input_ids: Tensor) -> Tensor:
        """The default positions of a padded (B, T) batch: (B, T) for RoBERTa, (1, T) otherwise."""
        if self.positions_offset_by_padding:
            return positions_from_padding(input_ids, self.pad_token_id)  # (B, T)
        return torch.arange(input_ids.shape[1], device=input_ids.device)[None, :]  # (1, T)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None = None,
                position_ids: Tensor | None = None, adapters: Route | None = None) -> Tensor:
        if position_ids is None:
            position_ids = self.position_ids(input_ids)
        x = self.word(input_ids)  # (B, T, E)
        if self.position is not None:
            x = x + self.position(position_ids)
        if self.token_type is not None:
            if token_type_ids is None:
                x = x + self.token_type.weight[0]
            else:
                x = x + self.token_type(token_type_ids)
        x = self.dropout(self.norm(x))
        return routed(self.project, x, adapters) if self.project is not None else x  # (B, T, C)


class FeedForward(nn.Module):
    """up -> act -> down."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool = True):
        super().__init__()
        self.up = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.act = Activation(act)
        self.down = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: Tensor, adapters: Route | None = None) -> Tensor:
        return routed(self.down, self.act(routed(self.up, x, adapters)), adapters)  # (.., C)


class GatedFeedForward(nn.Module):
    """up to 2 * I, split into two halves -> act(one half) * the other -> dropout -> down.

    ModernBERT's GeGLU (Wi, Wo): halves (input, gate), the activation on the first (activated=0). GTE's up_gate_proj
    holds (up, gate), the activation on the second (activated=1), with no bias on up_gate but one on down
    (down_bias overrides `bias` for the down projection)."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, dropout: float = 0.0, bias: bool = True,
                 *, activated: int = 0, down_bias: bool | None = None):
        super().__init__()
        self.up = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.act = Activation(act)
        self.dropout = Dropout(dropout)
        self.down = nn.Linear(intermediate_size, hidden_size, bias=bias if down_bias is None else down_bias)
        self.activated = activated

    def forward(self, x: Tensor, adapters: Route | None = None) -> Tensor:
        halves = routed(self.up, x, adapters).chunk(2, dim=-1)  # (.., I) each
        gated = self.act(halves[self.activated]) * halves[1 - self.activated]  # (.., I)
        return routed(self.down, self.dropout(gated), adapters)  # (.., C)


class SplitGatedFeedForward(nn.Module):
    """act(gate(x)) * up(x) -> dropout -> down, gate and up as two projections: NomicBERT's fc12 / fc11 / fc2 and
    the Llama-style MLP (gate_proj, up_proj, down_proj). The checkpoints keep the two apart, so one fused
    projection (GatedFeedForward) would need a key map that splits tensors; two projections keep names one to one."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, dropout: float = 0.0, *,
                 gate_bias: bool = False, down_bias: bool = False):
        super().__init__()
        self.gate = nn.Linear(hidden_size, intermediate_size, bias=gate_bias)
        self.up = nn.Linear(hidden_size, intermediate_size, bias=gate_bias)
        self.act = Activation(act)
        self.dropout = Dropout(dropout)
        self.down = nn.Linear(intermediate_size, hidden_size, bias=down_bias)

    def forward(self, x: Tensor, adapters: Route | None = None) -> Tensor:
        gated = self.act(routed(self.gate, x, adapters)) * routed(self.up, x, adapters)  # (.., I)
        return routed(self.down, self.dropout(gated), adapters)  # (.., C)


class EncoderLayer(nn.Module):
    """attention + feed-forward, each with a residual and a norm; the parts are given, not chosen inside.

    norm_first False (post-LN, BERT): x = attn_norm(x + attn(x)); x = ffn_norm(x + ffn(x)).
    norm_first True (pre-LN, ModernBERT): x = x + attn(attn_norm(x)); x = x + ffn(ffn_norm(x)); pass
    attn_norm=nn.Identity() for a first layer without one. The two residual dropouts are separate because families
    differ: DistilBERT has none after attention, ALBERT none after the feed-forward."""

    def __init__(self, attn: nn.Module, ffn: nn.Module, attn_norm: nn.Module, ffn_norm: nn.Module, *,
                 norm_first: bool = False, attn_out_dropout: float = 0.0, ffn_out_dropout: float = 0.0):
        super().__init__()
        self.attn = attn
        self.attn_norm = attn_norm
        self.ffn = ffn
        self.ffn_norm = ffn_norm
        self.attn_dropout = Dropout(attn_out_dropout)
        self.ffn_dropout = Dropout(ffn_out_dropout)
        self.norm_first = norm_first
        self.checkpointed = False  # gradient checkpointing (PreTrainedEncoder.gradient_checkpointing_enable)

    def forward(self, x: Tensor, layout: Layout, **attn_kwargs) -> Tensor:
        if self.checkpointed and self.training and torch.is_grad_enabled():
            # non-reentrant: works with the layout object and keyword arguments; the RNG state is preserved by
            # default, so the recomputation draws the same dropout masks
            return checkpoint(self._forward, x, layout, use_reentrant=False, **attn_kwargs)
        return self._forward(x, layout, **attn_kwargs)

    def _forward(self, x: Tensor, layout: Layout, **attn_kwargs) -> Tensor:
        """x: the layout's rows, (B, T, C) or (N, C); every step but attention is per token."""
        if self.norm_first:
            x = x + self.attn_dropout(self.attn(self.attn_norm(x), layout, **attn_kwargs))  # (.., C)
            return x + self.ffn_dropout(self.ffn(self.ffn_norm(x), layout.adapters))  # (.., C)
        x = self.attn_norm(x + self.attn_dropout(self.attn(x, layout, **attn_kwargs)))  # (.., C)
        return self.ffn_norm(x + self.ffn_dropout(self.ffn(x, layout.adapters)))  # (.., C)


class Encoder(nn.Module):
    """A stack of distinct layers (then an optional final norm, pre-LN families')."""

    packs_holes = True  # attention over packed tokens is exact for any mask (no relative positions)
    padded_layout = Padded  # the layout of the padded path: padded keys masked

    def __init__(self, layers: list[nn.Module], norm: nn.Module | None = None):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.norm = norm

    def forward(self, x: Tensor, layout: Layout) -> Tensor:
        for layer in self.layers:
            x = layer(x, layout)
        return x if self.norm is None else self.norm(x)


class LayerGroup(nn.Module):
    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)


class SharedEncoder(nn.Module):
    """ALBERT: num_layers steps, each running every layer of one of the shared groups in turn."""

    packs_holes = True
    padded_layout = Padded

    def __init__(self, groups: list[list[nn.Module]], num_layers: int):
        super().__init__()
        self.groups = nn.ModuleList(LayerGroup(g) for g in groups)
        self.num_layers = num_layers

    def forward(self, x: Tensor, layout: Layout) -> Tensor:
        n_groups = len(self.groups)
        for i in range(self.num_layers):
            group = self.groups[int(i / (self.num_layers / n_groups))]  # same rounding as transformers
            for layer in group.layers:
                x = layer(x, layout)
        return x


class Pooler(nn.Module):
    """tanh(dense(first token)): BERT's and ALBERT's pooled output."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden: Tensor, adapters: Route | None = None) -> Tensor:
        return torch.tanh(routed(self.dense, hidden[:, 0], adapters))  # (B, C)


class EncoderBody(nn.Module):
    """embeddings -> encoder (-> pooler): the base model every head sits on, run in the layout `plan` picks.

    Padding-free by default: a batch with padding runs as Packed rows (its real tokens only) and is unpacked after
    the encoder, with zeros at padding positions. `padding_free = False` runs the encoder's padded layout instead,
    which also reproduces transformers' values at padding positions."""

    def __init__(self, embeddings: nn.Module, encoder: nn.Module, pooler: nn.Module | None):
        super().__init__()
        self.embeddings = embeddings
        self.encoder = encoder
        self.pooler = pooler
        self.padding_free = True

    def plan(self, input_ids: Tensor, attention_mask: Tensor | None = None,
             position_ids: Tensor | None = None) -> Layout:
        """The layout this batch runs in. Position ids are computed in the padded layout (RoBERTa's count from the
        ids) and travel with the layout's rows."""
        if position_ids is None:
            position_ids = self.embeddings.position_ids(input_ids)  # (B|1, T)
        if self.padding_free and attention_mask is not None:
            packed = Packed.from_mask(attention_mask, position_ids)
            # nothing padded, or relative positions that a hole in the mask would shift: the padded layout
            if packed is not None and (packed.contiguous or self.encoder.packs_holes):
                return packed
            if packed is None:  # nothing padded, as Packed read off the mask (on a GPU: not read twice)
                attention_mask = None
        return self.encoder.padded_layout.from_mask(attention_mask, position_ids)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None,
                position_ids: Tensor | None = None, adapters: Route | None = None) -> tuple[Tensor, Tensor | None]:
        """adapters: a mixed-adapter batch's routing (nn/lora.py's Route: row i takes adapter adapters.slots[i]),
        which the layout carries to every layer; None: the plain layers."""
        layout = self.plan(input_ids, attention_mask, position_ids)
        if adapters is not None:
            layout = replace(layout, adapters=adapters.on(layout))  # the routing bound to the layout's rows
        x = layout.embed(self.embeddings, input_ids, token_type_ids)  # the layout's rows (.., C)
        x = layout.unpack(self.encoder(x, layout))  # (B, T, C)
        return x, self.pooler(x, layout.adapters) if self.pooler is not None else None

    @property
    def word_embeddings(self) -> nn.Embedding:
        return self.embeddings.word
