"""BERT: the reference layout. RoBERTa, XLM-R and ALBERT reuse its pieces."""

from __future__ import annotations

from typing import Any

from torch import nn

from ..config import EncoderConfig, head_fields, require
from ..errors import ConfigError
from ..keymap import KeyMap, params, tables, under
from ..nn import Embeddings, Encoder, EncoderBody, EncoderLayer, FeedForward, Pooler, SelfAttention, layer_norm
from .family import Family

SIZE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


def number(raw: dict[str, Any], key: str, default: float | None, source: str) -> float | None:
    value = raw.get(key, default)
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ConfigError(f"{source}: field '{key}' should be a number, got {value!r}")
    return value


def bert_config(original: dict[str, Any], source: str, *, defaults: dict[str, Any] | None = None,
                **family_fields: Any) -> EncoderConfig:
    """BertConfig's fields and defaults; a family may change defaults and add fields (ALBERT's groups)."""
    raw = {**(defaults or {}), **original}
    position_type = raw.get("position_embedding_type", "absolute")
    if position_type not in ("absolute", None):
        raise ConfigError(f"{source}: field 'position_embedding_type': {position_type!r} is not supported; only "
                          "'absolute' (transformers 5 removed relative_key and relative_key_query too)")
    sizes = {k: require(raw, k, source) for k in SIZE_FIELDS}
    return EncoderConfig(
        model_type=raw["model_type"], **sizes,
        hidden_act=require(raw, "hidden_act", source, str) if "hidden_act" in raw else "gelu",
        max_position_embeddings=raw.get("max_position_embeddings", 512),
        type_vocab_size=raw.get("type_vocab_size", 2),
        layer_norm_eps=number(raw, "layer_norm_eps", 1e-12, source),
        pad_token_id=raw.get("pad_token_id", 0),
        initializer_range=number(raw, "initializer_range", 0.02, source),
        hidden_dropout=number(raw, "hidden_dropout_prob", 0.1, source),
        attention_dropout=number(raw, "attention_probs_dropout_prob", 0.1, source),
        classifier_dropout=number(raw, "classifier_dropout", None, source),
        tie_word_embeddings=raw.get("tie_word_embeddings", True),
        **head_fields(raw), raw=original, source=source, **family_fields)


def bert_layer(c: EncoderConfig, *, attn: nn.Module | None = None, attn_out_dropout: float | None = None,
               ffn_out_dropout: float | None = None) -> EncoderLayer:
    """BERT's post-LN layer from its parts; DistilBERT and ALBERT change a residual dropout, DeBERTa the attention.
    The parts are built in transformers' order (attention, its norm, feed-forward, its norm)."""
    attn = attn if attn is not None else SelfAttention(c.hidden_size, c.num_attention_heads, c.attention_dropout)
    attn_norm = layer_norm(c.hidden_size, c.layer_norm_eps)
    ffn = FeedForward(c.hidden_size, c.intermediate_size, c.hidden_act)
    return EncoderLayer(attn, ffn, attn_norm, layer_norm(c.hidden_size, c.layer_norm_eps),
                        attn_out_dropout=c.hidden_dropout if attn_out_dropout is None else attn_out_dropout,
                        ffn_out_dropout=c.hidden_dropout if ffn_out_dropout is None else ffn_out_dropout)


def bert_embeddings(c: EncoderConfig, *, positions_offset_by_padding: bool = False) -> Embeddings:
    return Embeddings(c.vocab_size, c.embedding_size, c.max_position_embeddings, c.type_vocab_size, c.layer_norm_eps,
                      c.hidden_dropout, c.pad_token_id, positions_offset_by_padding=positions_offset_by_padding)


def build_body(c: EncoderConfig, pooler: bool) -> EncoderBody:
    encoder = Encoder([bert_layer(c) for _ in range(c.num_hidden_layers)])
    return EncoderBody(bert_embeddings(c), encoder, Pooler(c.hidden_size) if pooler else None)


def layer_keys(hf: str, ours: str) -> dict[str, str]:
    """The BERT names of one encoder layer; ALBERT's and DistilBERT's differ, RoBERTa's do not."""
    return tables(
        params(f"{hf}.attention.self.query", f"{ours}.attn.q"),
        params(f"{hf}.attention.self.key", f"{ours}.attn.k"),
        params(f"{hf}.attention.self.value", f"{ours}.attn.v"),
        params(f"{hf}.attention.output.dense", f"{ours}.attn.o"),
        params(f"{hf}.attention.output.LayerNorm", f"{ours}.attn_norm"),
        params(f"{hf}.intermediate.dense", f"{ours}.ffn.up"),
        params(f"{hf}.output.dense", f"{ours}.ffn.down"),
        params(f"{hf}.output.LayerNorm", f"{ours}.ffn_norm"),
    )


EMBEDDING_KEYS = tables(
    params("embeddings.word_embeddings", "embeddings.word", ("weight",)),
    params("embeddings.position_embeddings", "embeddings.position", ("weight",)),
    params("embeddings.token_type_embeddings", "embeddings.token_type", ("weight",)),
    params("embeddings.LayerNorm", "embeddings.norm"),
    {"embeddings.position_ids": None, "embeddings.token_type_ids": None},  # buffers older versions saved
)

BODY_KEYS = KeyMap(tables(EMBEDDING_KEYS, layer_keys("encoder.layer.{i}", "encoder.layers.{i}"),
                          params("pooler.dense", "pooler.dense")))

MLM_KEYS = {
    **params("cls.predictions.transform.dense", "dense"),
    **params("cls.predictions.transform.LayerNorm", "norm"),
    "cls.predictions.bias": "bias",
    "cls.predictions.decoder.bias": "decoder.bias",  # tied: a copy of the bias older versions saved
    "cls.predictions.decoder.weight": "decoder.weight",  # tied to the word embeddings unless untied
}

# One line per task hfport knows (hfport/tasks/); the heads themselves take the tasks' default options.
HEAD_KEYS = {
    "text-classification": KeyMap(params("classifier", "out")),
    "token-classification": KeyMap(params("classifier", "out")),
    "question-answering": KeyMap(params("qa_outputs", "qa")),
    "multiple-choice": KeyMap(params("classifier", "out")),
    "fill-mask": KeyMap(MLM_KEYS),
    # BertForPreTraining (bert-base-uncased and friends): the MLM head + next-sentence prediction
    "pretraining": KeyMap({**under(MLM_KEYS, "mlm."), **params("cls.seq_relationship", "pair.out")}),
    "next-sentence-prediction": KeyMap(params("cls.seq_relationship", "out")),
}


BERT = Family(
    model_type="bert", prefix="bert", class_prefix="Bert", config_from_hf=bert_config,
    body_keys=BODY_KEYS, head_keys=HEAD_KEYS, body_builder=build_body)
