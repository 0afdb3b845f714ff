"""The shared encoder blocks: embeddings, feed-forward, the post-LN layer, encoders, pooler."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .activations import Activation
from .attention import SelfAttention
from .unpad import Packed


def padding_mask(attention_mask: Tensor | None) -> Tensor | None:
    """(B, T) 1/0 mask -> boolean key mask (B, 1, 1, T), or None when nothing is padded."""
    if attention_mask is None:
        return None
    mask = attention_mask.bool()
    if bool(mask.all()):
        return None  # lets SDPA take its unmasked fast path
    return mask[:, None, None, :]


def positions_from_padding(input_ids: Tensor, pad_token_id: int) -> Tensor:
    """RoBERTa's position ids: real tokens count from pad_token_id + 1, padding stays at pad_token_id."""
    real = input_ids.ne(pad_token_id).long()  # (B, T)
    return torch.cumsum(real, dim=1) * real + pad_token_id


class Embeddings(nn.Module):
    """word + position (+ token type) -> LayerNorm -> dropout (-> projection to hidden_size, ALBERT)."""

    def __init__(self, vocab_size: int, dim: int, max_positions: int, type_vocab_size: int, eps: float,
                 dropout: float, pad_token_id: int | None, hidden_size: int | None = None,
                 positions_offset_by_padding: bool = False):
        super().__init__()
        self.word = nn.Embedding(vocab_size, dim, padding_idx=pad_token_id)
        # RoBERTa's padding positions all sit at pad_token_id: that row gets no gradient, as in transformers
        self.position = nn.Embedding(max_positions, dim,
                                     padding_idx=pad_token_id if positions_offset_by_padding else None)
        self.token_type = nn.Embedding(type_vocab_size, dim) if type_vocab_size > 0 else None
        self.norm = nn.LayerNorm(dim, eps=eps)
        self.dropout = nn.Dropout(dropout)
        self.project = nn.Linear(dim, hidden_size) if hidden_size is not None else None
        self.pad_token_id = pad_token_id
        self.positions_offset_by_padding = positions_offset_by_padding

    def position_ids(self, input_ids: Tensor) -> Tensor:
        """The default positions of a padded (B, T) batch: (B, T) for RoBERTa, (1, T) otherwise."""
        if self.positions_offset_by_padding:
            return positions_from_padding(input_ids, self.pad_token_id)  # (B, T)
        return torch.arange(input_ids.shape[1], device=input_ids.device)[None, :]  # (1, T)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None = None,
                position_ids: Tensor | None = None) -> Tensor:
        if position_ids is None:
            position_ids = self.position_ids(input_ids)
        x = self.word(input_ids) + self.position(position_ids)  # (B, T, E)
        if self.token_type is not None:
            if token_type_ids is None:
                x = x + self.token_type.weight[0]
            else:
                x = x + self.token_type(token_type_ids)
        x = self.dropout(self.norm(x))
        return self.project(x) if self.project is not None else x  # (B, T, C)


class FeedForward(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, act: str):
        super().__init__()
        self.up = nn.Linear(hidden_size, intermediate_size)
        self.act = Activation(act)
        self.down = nn.Linear(intermediate_size, hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(self.act(self.up(x)))  # (B, T, C)


class EncoderLayer(nn.Module):
    """Post-LN transformer layer. The two residual dropouts are separate because families differ:
    DistilBERT has none after attention, ALBERT none after the feed-forward."""

    def __init__(self, hidden_size: int, num_heads: int, intermediate_size: int, act: str, eps: float,
                 attention_dropout: float, attn_out_dropout: float, ffn_out_dropout: float,
                 attn: SelfAttention | None = None):
        super().__init__()
        # a family may pass an attention that adds its own score terms (DeBERTa's relative-position bias)
        self.attn = attn if attn is not None else SelfAttention(hidden_size, num_heads, attention_dropout)
        self.attn_norm = nn.LayerNorm(hidden_size, eps=eps)
        self.ffn = FeedForward(hidden_size, intermediate_size, act)
        self.ffn_norm = nn.LayerNorm(hidden_size, eps=eps)
        self.attn_dropout = nn.Dropout(attn_out_dropout)
        self.ffn_dropout = nn.Dropout(ffn_out_dropout)

    def forward(self, x: Tensor, mask: Tensor | Packed | None, **attn_kwargs) -> Tensor:
        """x: (B, T, C), or packed (N, C) when mask is a Packed layout; every step but attention is per token."""
        x = self.attn_norm(x + self.attn_dropout(self.attn(x, mask, **attn_kwargs)))  # (B, T, C) | (N, C)
        return self.ffn_norm(x + self.ffn_dropout(self.ffn(x)))  # (B, T, C) | (N, C)


class Encoder(nn.Module):
    """A stack of distinct layers."""

    packs_holes = True  # attention over packed tokens is exact for any mask (no relative positions)

    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: Tensor, mask: Tensor | Packed | None) -> Tensor:
        for layer in self.layers:
            x = layer(x, mask)
        return x


class LayerGroup(nn.Module):
    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)


class SharedEncoder(nn.Module):
    """ALBERT: num_layers steps, each running every layer of one of the shared groups in turn."""

    packs_holes = True

    def __init__(self, groups: list[list[nn.Module]], num_layers: int):
        super().__init__()
        self.groups = nn.ModuleList(LayerGroup(g) for g in groups)
        self.num_layers = num_layers

    def forward(self, x: Tensor, mask: Tensor | Packed | None) -> Tensor:
        n_groups = len(self.groups)
        for i in range(self.num_layers):
            group = self.groups[int(i / (self.num_layers / n_groups))]  # same rounding as transformers
            for layer in group.layers:
                x = layer(x, mask)
        return x


class Pooler(nn.Module):
    """tanh(dense(first token)): BERT's and ALBERT's pooled output."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden: Tensor) -> Tensor:
        return torch.tanh(self.dense(hidden[:, 0]))  # (B, C)


class EncoderBody(nn.Module):
    """embeddings -> encoder (-> pooler): the base model every head sits on.

    Padding-free by default: a batch with padding is packed to its real tokens before the embeddings and
    unpacked after the encoder, with zeros at padding positions (nn/unpad.py). `padding_free = False` runs the
    padded (B, T) path instead, which also reproduces transformers' values at padding positions."""

    def __init__(self, embeddings: nn.Module, encoder: nn.Module, pooler: nn.Module | None):
        super().__init__()
        self.embeddings = embeddings
        self.encoder = encoder
        self.pooler = pooler
        self.padding_free = True

    def plan(self, attention_mask: Tensor | None) -> Packed | None:
        """The packed layout this batch runs in, or None for the padded path."""
        if not self.padding_free or attention_mask is None:
            return None
        packed = Packed.from_mask(attention_mask)
        if packed is None or not (packed.contiguous or self.encoder.packs_holes):
            return None  # nothing padded, or relative positions that a hole in the mask would shift
        return packed

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None,
                position_ids: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        packed = self.plan(attention_mask)
        if packed is None:
            x = self.embeddings(input_ids, token_type_ids, position_ids)  # (B, T, C)
            x = self.encoder(x, padding_mask(attention_mask))  # (B, T, C)
        else:
            # positions are computed in the padded layout (RoBERTa's count from the ids), then packed with the ids
            if position_ids is None:
                position_ids = self.embeddings.position_ids(input_ids)  # (B|1, T)
            position_ids = packed.pack(position_ids.expand_as(input_ids))[None]  # (1, N)
            token_type_ids = packed.pack(token_type_ids)[None] if token_type_ids is not None else None  # (1, N)
            x = self.embeddings(packed.pack(input_ids)[None], token_type_ids, position_ids)[0]  # (N, C)
            x = packed.unpack(self.encoder(x, packed))  # (B, T, C), zeros at padding
        return x, self.pooler(x) if self.pooler is not None else None

    @property
    def word_embeddings(self) -> nn.Embedding:
        return self.embeddings.word
