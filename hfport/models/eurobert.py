"""EuroBERT (EuroBERT-210m / 610m / 2.1B): a Llama-style encoder. Pre-norm layers with RMSNorm and a final norm, no
embedding norm, rotary positions, grouped-query attention (num_key_value_heads), a SwiGLU feed-forward (gate_proj,
up_proj, down_proj), optional biases (attention_bias, mlp_bias), no dropout but attention's. Heads as transformers
5.23 has them: a one-layer lm_head, a token classifier, and a sequence classifier dense -> gelu -> classifier on
the first token ("bos"), the real tokens' mean ("mean"), or on every token with the logits averaged ("late").
The config mapping follows transformers 5.23's EuroBertConfig.
"""

from __future__ import annotations

from typing import Any

from ..config import EncoderConfig, head_fields
from ..errors import ConfigError
from ..keymap import KeyMap, params, tables
from ..nn import (Embeddings, Encoder, EncoderBody, EncoderLayer, RMSNorm, Rotary, SelfAttention,
                  SplitGatedFeedForward)
from ..nn.activations import ACTIVATIONS
from .family import Family, HeadOptions
from .gte import _NONE, _NUMBER, TASKS, check_shapes, head_width, rope, typed

# EuroBertConfig's typed fields and defaults (use_cache and pretraining_tp change nothing an encoder computes)
FIELDS: dict[str, tuple[tuple[type, ...], Any]] = {
    "vocab_size": ((int,), 128256), "hidden_size": ((int,), 768), "intermediate_size": ((int,), 3072),
    "num_hidden_layers": ((int,), 12), "num_attention_heads": ((int,), 12), "num_key_value_heads": ((int, _NONE), None),
    "hidden_act": ((str,), "silu"), "max_position_embeddings": ((int,), 8192), "initializer_range": ((float,), 0.02),
    "rms_norm_eps": ((float,), 1e-5), "pad_token_id": ((int, _NONE), 128001), "tie_word_embeddings": ((bool,), False),
    "attention_bias": ((bool,), False), "attention_dropout": (_NUMBER, 0.0), "mlp_bias": ((bool,), False),
    "head_dim": ((int, _NONE), None), "classifier_pooling": ((str,), "late"),
}
DEFAULT_THETA = 10_000.0  # PreTrainedConfig's default rope_theta (EuroBertConfig sets none of its own)
POOLING = {"bos": "first", "mean": "mean", "late": "late"}  # classifier_pooling -> the classifier's pooling option


def eurobert_config(raw: dict[str, Any], source: str) -> EncoderConfig:
    v = {key: typed(raw, key, FIELDS, source, "EuroBertConfig") for key in FIELDS}
    hidden, heads = v["hidden_size"], v["num_attention_heads"]
    if v["hidden_act"] not in ACTIVATIONS:
        raise ConfigError(f"{source}: field 'hidden_act': {v['hidden_act']!r} is not supported; supported: "
                          f"{sorted(ACTIVATIONS)}")
    if v["classifier_pooling"] not in POOLING:
        raise ConfigError(f"{source}: field 'classifier_pooling' expected one of {list(POOLING)}, got "
                          f"{v['classifier_pooling']!r}")
    if heads > 0 and hidden % heads:  # EuroBertConfig.validate_architecture, whatever head_dim says
        raise ConfigError(f"{source}: field 'num_attention_heads': hidden_size {hidden} is not a multiple of "
                          f"num_attention_heads {heads}, which transformers' EuroBertConfig refuses")
    head_dim = head_width(raw, v, source, "EuroBertConfig")
    check_shapes(v, source)
    kv_heads = v["num_key_value_heads"] or heads
    if kv_heads <= 0 or heads % kv_heads:
        raise ConfigError(f"{source}: field 'num_key_value_heads': {kv_heads} must divide num_attention_heads "
                          f"({heads})")
    theta, scaling = rope(raw, source, DEFAULT_THETA, head_dim, v["max_position_embeddings"])
    extra = {"rope_theta": theta, "rope_scaling": scaling, "kv_heads": kv_heads,
             "pooling": POOLING[v["classifier_pooling"]],
             **{k: v[k] for k in ("attention_bias", "mlp_bias")}}
    return EncoderConfig(
        model_type="eurobert", vocab_size=v["vocab_size"], hidden_size=hidden,
        num_hidden_layers=v["num_hidden_layers"], num_attention_heads=heads,
        intermediate_size=v["intermediate_size"], hidden_act=v["hidden_act"],
        max_position_embeddings=v["max_position_embeddings"], type_vocab_size=0, layer_norm_eps=v["rms_norm_eps"],
        pad_token_id=v["pad_token_id"], initializer_range=v["initializer_range"], hidden_dropout=0.0,
        attention_dropout=v["attention_dropout"], classifier_dropout=0.0, head_dim=head_dim,
        tie_word_embeddings=v["tie_word_embeddings"], extra=extra, **head_fields(raw), raw=raw, source=source)


# --- the body -----------------------------------------------------------------------------------------------


def eurobert_layer(c: EncoderConfig) -> EncoderLayer:
    """Pre-norm: x = x + attn(rms(x)); x = x + ffn(rms(x)); no residual dropout."""
    x = c.extra
    attn = SelfAttention(c.hidden_size, c.num_attention_heads, c.attention_dropout, bias=x["attention_bias"],
                         rotary=Rotary(c.head_dim, x["rope_theta"], x["rope_scaling"]), kv_heads=x["kv_heads"],
                         head_dim=c.head_dim)
    ffn = SplitGatedFeedForward(c.hidden_size, c.intermediate_size, c.hidden_act, gate_bias=x["mlp_bias"],
                                down_bias=x["mlp_bias"])
    return EncoderLayer(attn, ffn, RMSNorm(c.hidden_size, c.layer_norm_eps), RMSNorm(c.hidden_size, c.layer_norm_eps),
                        norm_first=True)


def build_body(c: EncoderConfig, pooler: bool) -> EncoderBody:
    embeddings = Embeddings(c.vocab_size, c.hidden_size, 0, 0, c.layer_norm_eps, 0.0, c.pad_token_id,
                            norm=False)  # the token embedding only: no positions table, no norm, no dropout
    encoder = Encoder([eurobert_layer(c) for _ in range(c.num_hidden_layers)],
                      norm=RMSNorm(c.hidden_size, c.layer_norm_eps))
    return EncoderBody(embeddings, encoder, pooler=None)


# --- heads --------------------------------------------------------------------------------------------------

HEAD_OPTIONS: HeadOptions = {
    # dense -> nn.GELU() (exact) -> classifier, no dropout, on the pooled features or (late) on every token
    "text-classification": lambda c: {"dense_act": "gelu", "dropout": 0.0, "pooling": c.extra["pooling"]},
    "token-classification": lambda c: {"dropout": 0.0},
    # lm_head: one linear layer, its bias (mlp_bias) the head's `bias` whether the weight is tied or not
    "fill-mask": lambda c: {"transform": False, "decoder_bias": False, "output_bias": c.extra["mlp_bias"]},
}

# --- names --------------------------------------------------------------------------------------------------

LAYER = ("layers.{i}", "encoder.layers.{i}")
BODY_KEYS = KeyMap(tables(
    params("embed_tokens", "embeddings.word", ("weight",)),
    params(f"{LAYER[0]}.input_layernorm", f"{LAYER[1]}.attn_norm", ("weight",)),
    params(f"{LAYER[0]}.self_attn.q_proj", f"{LAYER[1]}.attn.q"),
    params(f"{LAYER[0]}.self_attn.k_proj", f"{LAYER[1]}.attn.k"),
    params(f"{LAYER[0]}.self_attn.v_proj", f"{LAYER[1]}.attn.v"),
    params(f"{LAYER[0]}.self_attn.o_proj", f"{LAYER[1]}.attn.o"),
    params(f"{LAYER[0]}.post_attention_layernorm", f"{LAYER[1]}.ffn_norm", ("weight",)),
    params(f"{LAYER[0]}.mlp.gate_proj", f"{LAYER[1]}.ffn.gate"),
    params(f"{LAYER[0]}.mlp.up_proj", f"{LAYER[1]}.ffn.up"),
    params(f"{LAYER[0]}.mlp.down_proj", f"{LAYER[1]}.ffn.down"),
    params("norm", "encoder.norm", ("weight",)),
    {"rotary_emb.inv_freq": None, "rotary_emb.original_inv_freq": None},  # buffers an older save may carry
))

HEAD_KEYS = {
    "text-classification": KeyMap(tables(params("dense", "dense"), params("classifier", "out"))),
    "token-classification": KeyMap(params("classifier", "out")),
    "fill-mask": KeyMap({"lm_head.weight": "decoder.weight",  # tied to embed_tokens if tie_word_embeddings
                         "lm_head.bias": "bias"}),
}

EUROBERT = Family(
    model_type="eurobert", prefix="model", class_prefix="EuroBert", config_from_hf=eurobert_config,
    body_keys=BODY_KEYS, head_keys=HEAD_KEYS, body_builder=build_body, head_options=HEAD_OPTIONS, tasks=TASKS,
    pooler={"feature-extraction": False, "text-classification": False})  # EuroBertModel has no pooler
