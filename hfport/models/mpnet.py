"""MPNet: BERT's post-LN layer (no token types) whose attention adds a T5-style bucketed relative bias shared by
every layer, RoBERTa's positions counted from the padding, and RoBERTa's heads (the MLM head's gelu, the
classifier's dense + tanh on <s>)."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from ..config import EncoderConfig
from ..errors import ConfigError
from ..keymap import KeyMap, params, tables
from ..nn import Embeddings, EncoderBody, Layout, Padded, Pooler
from ..nn.bucketed import BucketedRelativeBias
from . import bert, roberta
from .family import Family, HeadOptions

# MPNetEmbeddings hard-codes its padding index to 1, whatever config.pad_token_id says: word row 1 gets no gradient
# and positions count from 2
PADDING_IDX = 1
# MPNetEncoder.compute_position_bias is called with its default num_buckets=32 (and max_distance 128) whatever
# relative_attention_num_buckets says; that field only sizes the table
BUCKETS, MAX_DISTANCE = 32, 128
DEFAULTS = {"vocab_size": 30527, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
            "intermediate_size": 3072, "pad_token_id": 1}


def mpnet_config(raw: dict[str, Any], source: str) -> EncoderConfig:
    """MPNetConfig's fields; it has no token types and no classifier_dropout (its heads use hidden_dropout_prob)."""
    rows = raw.get("relative_attention_num_buckets", 32)
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < BUCKETS:
        raise ConfigError(f"{source}: field 'relative_attention_num_buckets': {rows!r} is not supported; MPNet "
                          f"buckets distances into {BUCKETS} buckets whatever the table's size, so it needs an integer "
                          f">= {BUCKETS} (transformers indexes past a smaller table)")
    c = bert.bert_config(raw, source, defaults=DEFAULTS, extra={"relative_attention_num_buckets": rows})
    c.type_vocab_size = 0  # MPNetEmbeddings has no token-type table; a type_vocab_size in config.json is unused
    c.classifier_dropout = c.hidden_dropout  # classifier_dropout is no MPNet field: its heads never read it
    return c


class MPNetEncoder(nn.Module):
    """A stack of BERT layers given one bucketed relative bias, computed from the table they share."""

    packs_holes = False  # distances count padded positions in transformers: a hole in the mask shifts them
    padded_layout = Padded  # padded keys masked, padded queries attend to the real keys, as transformers

    def __init__(self, c: EncoderConfig):
        super().__init__()
        self.layers = nn.ModuleList(bert.bert_layer(c) for _ in range(c.num_hidden_layers))
        self.relative = BucketedRelativeBias(c.extra["relative_attention_num_buckets"], c.num_attention_heads,
                                             BUCKETS, MAX_DISTANCE)

    def forward(self, x: Tensor, layout: Layout) -> Tensor:  # the layout's rows (.., C) -> (.., C)
        bias = self.relative.for_layout(layout)
        for layer in self.layers:
            x = layer(x, layout, bias=bias)
        return x


def build_body(c: EncoderConfig, pooler: bool) -> EncoderBody:
    embeddings = Embeddings(c.vocab_size, c.hidden_size, c.max_position_embeddings, 0, c.layer_norm_eps,
                            c.hidden_dropout, PADDING_IDX, positions_offset_by_padding=True)
    return EncoderBody(embeddings, MPNetEncoder(c), Pooler(c.hidden_size) if pooler else None)


def layer_keys(hf: str, ours: str) -> dict[str, str]:
    return tables(
        params(f"{hf}.attention.attn.q", f"{ours}.attn.q"), params(f"{hf}.attention.attn.k", f"{ours}.attn.k"),
        params(f"{hf}.attention.attn.v", f"{ours}.attn.v"), params(f"{hf}.attention.attn.o", f"{ours}.attn.o"),
        params(f"{hf}.attention.LayerNorm", f"{ours}.attn_norm"),
        params(f"{hf}.intermediate.dense", f"{ours}.ffn.up"), params(f"{hf}.output.dense", f"{ours}.ffn.down"),
        params(f"{hf}.output.LayerNorm", f"{ours}.ffn_norm"))


BODY_KEYS = KeyMap(tables(
    params("embeddings.word_embeddings", "embeddings.word", ("weight",)),
    params("embeddings.position_embeddings", "embeddings.position", ("weight",)),
    params("embeddings.LayerNorm", "embeddings.norm"),
    {"embeddings.position_ids": None},  # a buffer older versions saved
    layer_keys("encoder.layer.{i}", "encoder.layers.{i}"),
    params("encoder.relative_attention_bias", "encoder.relative.table", ("weight",)),
    params("pooler.dense", "pooler.dense")))

HEAD_OPTIONS: HeadOptions = {
    # MPNetClassificationHead: dropout -> dense -> tanh -> dropout -> out_proj on <s>, both dropouts hidden_dropout
    "text-classification": lambda c: {"dense_act": "tanh", "pre_dropout": c.hidden_dropout},
    "fill-mask": lambda c: {"act": "gelu"},  # MPNetLMHead uses exact gelu whatever hidden_act says
    "multiple-choice": lambda c: {"dropout": c.hidden_dropout},  # pooler -> dropout -> classifier
}

MPNET = Family(
    model_type="mpnet", prefix="mpnet", class_prefix="MPNet", config_from_hf=mpnet_config, body_keys=BODY_KEYS,
    head_keys=roberta.HEAD_KEYS, body_builder=build_body, head_options=HEAD_OPTIONS, pooler=roberta.POOLER)
