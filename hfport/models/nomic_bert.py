"""NomicBERT (nomic-embed-text-v1 / v1.5): GTE's body (gte.py) without any bias in attention or the feed-forward
(SwiGLU with the default silu), no dropout inside the feed-forward, always token types, and BERT's MLM head under
BERT's names (cls.predictions.*). The config mapping follows transformers 5.23's NomicBertConfig.

nomic-embed-text-v1.5 scales its rotary frequencies dynamically (rope_type "dynamic"): past
max_position_embeddings the base grows with the batch's longest row, so one row's values depend on the other rows
of its batch. hfport computes it as transformers does for the same batch; padding-free, "the batch's longest row"
is the longest real row (transformers reads the padded width, the same unless the batch is padded wider).
"""

from __future__ import annotations

from typing import Any

from ..config import EncoderConfig
from ..keymap import KeyMap, params, tables
from ..nn import EncoderLayer, SplitGatedFeedForward
from .family import Family
from .gte import (_NONE, LORA_TARGETS, POOLER, TASKS, body_builder, post_ln_layer, rotary_attention,
                  rotary_config)

# NomicBertConfig's typed fields and defaults (its dropouts are float only: an int is refused, unlike GteConfig)
FIELDS: dict[str, tuple[tuple[type, ...], Any]] = {
    "vocab_size": ((int,), 30528), "hidden_size": ((int,), 768), "num_hidden_layers": ((int,), 12),
    "num_attention_heads": ((int,), 12), "intermediate_size": ((int,), 3072), "hidden_act": ((str,), "silu"),
    "hidden_dropout_prob": ((float,), 0.0), "attention_probs_dropout_prob": ((float,), 0.0),
    "max_position_embeddings": ((int,), 2048), "type_vocab_size": ((int,), 2), "initializer_range": ((float,), 0.02),
    "layer_norm_eps": ((float,), 1e-12), "pad_token_id": ((int,), 0), "classifier_dropout": ((float, _NONE), None),
    "tie_word_embeddings": ((bool,), True), "head_dim": ((int, _NONE), None),
}
DEFAULT_THETA = 1000.0  # NomicBertConfig.default_theta


def nomic_bert_config(raw: dict[str, Any], source: str) -> EncoderConfig:
    return rotary_config(raw, source, fields=FIELDS, config_class="NomicBertConfig", default_theta=DEFAULT_THETA,
                         min_type_vocab=1)


def nomic_bert_layer(c: EncoderConfig) -> EncoderLayer:
    # fc11 (up) and fc12 (gate) are two projections: down(act(fc12(x)) * fc11(x)), no biases, no inner dropout
    ffn = SplitGatedFeedForward(c.hidden_size, c.intermediate_size, c.hidden_act)
    return post_ln_layer(c, rotary_attention(c, bias=False), ffn)


# the layout transformers 5.23 writes (nomic's original names; transformers renames them in memory only)
LAYER = ("encoder.layers.{i}", "encoder.layers.{i}")
BODY_KEYS = KeyMap(tables(
    params("embeddings.word_embeddings", "embeddings.word", ("weight",)),
    params("embeddings.token_type_embeddings", "embeddings.token_type", ("weight",)),
    params("emb_ln", "embeddings.norm"),
    params(f"{LAYER[0]}.attn.Wqkv", f"{LAYER[1]}.attn.qkv.proj", ("weight",)),
    params(f"{LAYER[0]}.attn.out_proj", f"{LAYER[1]}.attn.o", ("weight",)),
    params(f"{LAYER[0]}.norm1", f"{LAYER[1]}.attn_norm"),
    params(f"{LAYER[0]}.mlp.fc11", f"{LAYER[1]}.ffn.up", ("weight",)),
    params(f"{LAYER[0]}.mlp.fc12", f"{LAYER[1]}.ffn.gate", ("weight",)),
    params(f"{LAYER[0]}.mlp.fc2", f"{LAYER[1]}.ffn.down", ("weight",)),
    params(f"{LAYER[0]}.norm2", f"{LAYER[1]}.ffn_norm"),
    params("pooler.dense", "pooler.dense"),
    {"rotary_emb.inv_freq": None, "rotary_emb.original_inv_freq": None, "embeddings.position_ids": None,
     "embeddings.token_type_ids": None},  # non-persistent buffers an older save may carry
))


HEAD_KEYS = {
    "text-classification": KeyMap(params("classifier", "out")),
    "token-classification": KeyMap(params("classifier", "out")),
    "fill-mask": KeyMap({
        **params("cls.predictions.transform.dense", "dense"),
        **params("cls.predictions.transform.layer_norm", "norm"),
        "cls.predictions.bias": "bias",
        "cls.predictions.decoder.bias": "decoder.bias",  # tied to cls.predictions.bias unless untied
        "cls.predictions.decoder.weight": "decoder.weight",  # tied to the word embeddings unless untied
    }),
}

NOMIC_BERT = Family(
    model_type="nomic_bert", prefix="nomic_bert", class_prefix="NomicBert", config_from_hf=nomic_bert_config,
    body_keys=BODY_KEYS, head_keys=HEAD_KEYS, body_builder=body_builder(nomic_bert_layer), pooler=POOLER, tasks=TASKS,
    lora_targets=LORA_TARGETS)
