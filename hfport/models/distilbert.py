"""DistilBERT: BERT's layer under other names and field names, no token types, no pooler, no dropout after
attention, optionally sinusoidal (frozen-at-init) position embeddings."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..config import EncoderConfig, head_fields, require
from ..keymap import KeyMap, params, tables
from ..nn import Embeddings, Encoder, EncoderBody
from .bert import bert_layer, number
from .family import Family, HeadOptions

EPS = 1e-12  # DistilBERT hard-codes its LayerNorm epsilon


def distilbert_config(raw: dict[str, Any], source: str) -> EncoderConfig:
    dropout = number(raw, "dropout", 0.1, source)
    return EncoderConfig(
        model_type="distilbert", vocab_size=require(raw, "vocab_size", source), hidden_size=require(raw, "dim", source),
        num_hidden_layers=require(raw, "n_layers", source), num_attention_heads=require(raw, "n_heads", source),
        intermediate_size=require(raw, "hidden_dim", source),
        hidden_act=require(raw, "activation", source, str) if "activation" in raw else "gelu",
        max_position_embeddings=raw.get("max_position_embeddings", 512), type_vocab_size=0, layer_norm_eps=EPS,
        pad_token_id=raw.get("pad_token_id", 0), initializer_range=number(raw, "initializer_range", 0.02, source),
        hidden_dropout=dropout, attention_dropout=number(raw, "attention_dropout", 0.1, source),
        classifier_dropout=dropout, tie_word_embeddings=raw.get("tie_word_embeddings", True),
        extra={"qa_dropout": number(raw, "qa_dropout", 0.1, source),
               "seq_classif_dropout": number(raw, "seq_classif_dropout", 0.2, source),
               "sinusoidal_pos_embds": bool(raw.get("sinusoidal_pos_embds", False))},
        **head_fields(raw), raw=raw, source=source)


def build_body(c: EncoderConfig, pooler: bool) -> EncoderBody:
    """DistilBERT has no pooler: its classifiers read the first token through their own pre_classifier."""
    embeddings = Embeddings(c.vocab_size, c.hidden_size, c.max_position_embeddings, 0, EPS, c.hidden_dropout,
                            c.pad_token_id)
    layers = [bert_layer(c, attn_out_dropout=0.0) for _ in range(c.num_hidden_layers)]  # layer_norm_eps is EPS
    return EncoderBody(embeddings, Encoder(layers), pooler=None)


def first_token_classifier(c: EncoderConfig) -> dict[str, Any]:
    """pre_classifier -> ReLU -> dropout -> classifier on [CLS]"""
    return {"dense_act": "relu", "dropout": c.extra["seq_classif_dropout"]}


HEAD_OPTIONS: HeadOptions = {
    "text-classification": first_token_classifier,
    "multiple-choice": first_token_classifier,
    "token-classification": lambda c: {"dropout": c.hidden_dropout},
    "question-answering": lambda c: {"dropout": c.extra["qa_dropout"]},
    "fill-mask": lambda c: {"decoder_bias": False},  # vocab_projector's bias is the head's `bias` itself
}


def sinusoidal_table(n_pos: int, dim: int) -> torch.Tensor:
    """The fixed sin/cos table DistilBERT starts from when sinusoidal_pos_embds is set."""
    pos = torch.arange(n_pos, dtype=torch.float64)[:, None]  # (P, 1)
    rates = torch.tensor([1.0 / math.pow(10000, 2 * (j // 2) / dim) for j in range(dim)], dtype=torch.float64)
    angles = pos * rates[None, :]  # (P, D)
    table = torch.empty(n_pos, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angles[:, 0::2])
    table[:, 1::2] = torch.cos(angles[:, 1::2])
    return table.float()


@torch.no_grad()
def after_init(model: torch.nn.Module, c: EncoderConfig) -> None:
    if c.extra["sinusoidal_pos_embds"]:
        weight = model.body.embeddings.position.weight
        weight.copy_(sinusoidal_table(c.max_position_embeddings, c.hidden_size))


def layer_keys(hf: str, ours: str) -> dict[str, str]:
    return tables(
        params(f"{hf}.attention.q_lin", f"{ours}.attn.q"), params(f"{hf}.attention.k_lin", f"{ours}.attn.k"),
        params(f"{hf}.attention.v_lin", f"{ours}.attn.v"), params(f"{hf}.attention.out_lin", f"{ours}.attn.o"),
        params(f"{hf}.sa_layer_norm", f"{ours}.attn_norm"), params(f"{hf}.ffn.lin1", f"{ours}.ffn.up"),
        params(f"{hf}.ffn.lin2", f"{ours}.ffn.down"), params(f"{hf}.output_layer_norm", f"{ours}.ffn_norm"))


BODY_KEYS = KeyMap(tables(
    params("embeddings.word_embeddings", "embeddings.word", ("weight",)),
    params("embeddings.position_embeddings", "embeddings.position", ("weight",)),
    params("embeddings.LayerNorm", "embeddings.norm"),
    {"embeddings.position_ids": None},
    layer_keys("transformer.layer.{i}", "encoder.layers.{i}")))

HEAD_KEYS = {
    "text-classification": KeyMap({**params("pre_classifier", "dense"), **params("classifier", "out")}),
    "token-classification": KeyMap(params("classifier", "out")),
    "question-answering": KeyMap(params("qa_outputs", "qa")),
    "multiple-choice": KeyMap({**params("pre_classifier", "dense"), **params("classifier", "out")}),
    "fill-mask": KeyMap({**params("vocab_transform", "dense"), **params("vocab_layer_norm", "norm"),
                         "vocab_projector.bias": "bias", "vocab_projector.weight": "decoder.weight"}),
}

DISTILBERT = Family(
    model_type="distilbert", prefix="distilbert", class_prefix="DistilBert",
    config_from_hf=distilbert_config, body_keys=BODY_KEYS, head_keys=HEAD_KEYS, body_builder=build_body,
    head_options=HEAD_OPTIONS, after_init=after_init)
