"""ALBERT: factorised embeddings (embedding_size -> hidden_size) and layers shared in groups; no dropout after
the feed-forward."""

from __future__ import annotations

from typing import Any

from ..config import EncoderConfig, require
from ..keymap import KeyMap, params, tables, under
from ..nn import EncoderBody, Embeddings, Pooler, SharedEncoder
from . import bert
from .family import Family, HeadOptions


def albert_config(raw: dict[str, Any], source: str) -> EncoderConfig:
    defaults = {"hidden_act": "gelu_new", "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
                "classifier_dropout": raw.get("classifier_dropout_prob", 0.1)}
    return bert.bert_config(raw, source, defaults=defaults,
                            embedding_size=require(raw, "embedding_size", source) if "embedding_size" in raw else 128,
                            num_hidden_groups=raw.get("num_hidden_groups", 1),
                            inner_group_num=raw.get("inner_group_num", 1))


def build_body(c: EncoderConfig, pooler: bool) -> EncoderBody:
    embeddings = Embeddings(c.vocab_size, c.embedding_size, c.max_position_embeddings, c.type_vocab_size,
                            c.layer_norm_eps, c.hidden_dropout, c.pad_token_id, hidden_size=c.hidden_size)

    groups = [[bert.bert_layer(c, ffn_out_dropout=0.0) for _ in range(c.inner_group_num)]
              for _ in range(c.num_hidden_groups)]
    return EncoderBody(embeddings, SharedEncoder(groups, c.num_hidden_layers),
                       Pooler(c.hidden_size) if pooler else None)


LAYER = ("encoder.albert_layer_groups.{g}.albert_layers.{j}", "encoder.groups.{g}.layers.{j}")
BODY_KEYS = KeyMap(tables(
    bert.EMBEDDING_KEYS,
    params("encoder.embedding_hidden_mapping_in", "embeddings.project"),
    params(f"{LAYER[0]}.attention.query", f"{LAYER[1]}.attn.q"),
    params(f"{LAYER[0]}.attention.key", f"{LAYER[1]}.attn.k"),
    params(f"{LAYER[0]}.attention.value", f"{LAYER[1]}.attn.v"),
    params(f"{LAYER[0]}.attention.dense", f"{LAYER[1]}.attn.o"),
    params(f"{LAYER[0]}.attention.LayerNorm", f"{LAYER[1]}.attn_norm"),
    params(f"{LAYER[0]}.ffn", f"{LAYER[1]}.ffn.up"),
    params(f"{LAYER[0]}.ffn_output", f"{LAYER[1]}.ffn.down"),
    params(f"{LAYER[0]}.full_layer_layer_norm", f"{LAYER[1]}.ffn_norm"),
    params("pooler", "pooler.dense")))

MLM_KEYS = {**params("predictions.dense", "dense"), **params("predictions.LayerNorm", "norm"),
            "predictions.bias": "bias", "predictions.decoder.bias": "decoder.bias",
            "predictions.decoder.weight": "decoder.weight"}

HEAD_KEYS = {
    "text-classification": KeyMap(params("classifier", "out")),
    "token-classification": KeyMap(params("classifier", "out")),
    "question-answering": KeyMap(params("qa_outputs", "qa")),
    "multiple-choice": KeyMap(params("classifier", "out")),
    "fill-mask": KeyMap(MLM_KEYS),
    # AlbertForPreTraining (albert-base-v2 and friends): the MLM head + sentence-order prediction
    "pretraining": KeyMap({**under(MLM_KEYS, "mlm."), **params("sop_classifier.classifier", "pair.out")}),
}

HEAD_OPTIONS: HeadOptions = {
    # AlbertSOPHead: dropout(classifier_dropout_prob) -> classifier to num_labels outputs, named as its loss names them
    "pretraining": lambda c: {"pair_dropout": c.classifier_dropout, "pair_labels": c.num_labels,
                              "pair_output": "sop_logits", "pair_label": "sentence_order_label"},
}

ALBERT = Family(
    model_type="albert", prefix="albert", class_prefix="Albert", config_from_hf=albert_config,
    body_keys=BODY_KEYS, head_keys=HEAD_KEYS, body_builder=build_body, head_options=HEAD_OPTIONS)
