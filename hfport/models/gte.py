"""GTE (gte-multilingual-base, mGTE): BERT's post-LN layer with rotary positions instead of a position table, a
gated feed-forward (act(gate) * up, gate and up without biases, down with one) and no pooler on the base model.
The config mapping follows transformers 5.23's GteConfig; NomicBERT (nomic_bert.py) is the same body without
biases, and reuses the pieces here.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from ..config import EncoderConfig, head_fields
from ..errors import ConfigError
from ..keymap import KeyMap, params, tables
from ..nn import (Embeddings, Encoder, EncoderBody, EncoderLayer, FusedQKV, GatedFeedForward, Pooler, RopeScaling,
                  Rotary, SelfAttention, layer_norm)
from ..nn.activations import ACTIVATIONS
from .family import Family, HeadOptions

_NUMBER = (int, float)
_NONE = type(None)
# GteConfig's typed fields (a strict dataclass: a bool is not an int, an int is not a float) and defaults
FIELDS: dict[str, tuple[tuple[type, ...], Any]] = {
    "vocab_size": ((int,), 250048), "hidden_size": ((int,), 768), "num_hidden_layers": ((int,), 12),
    "num_attention_heads": ((int,), 12), "intermediate_size": ((int,), 3072), "hidden_act": ((str,), "gelu"),
    "hidden_dropout_prob": (_NUMBER, 0.1), "attention_probs_dropout_prob": (_NUMBER, 0.0),
    "max_position_embeddings": ((int,), 8192), "type_vocab_size": ((int,), 1), "initializer_range": ((float,), 0.02),
    "layer_norm_eps": ((float,), 1e-12), "pad_token_id": ((int, _NONE), 1),
    "classifier_dropout": ((*_NUMBER, _NONE), None), "tie_word_embeddings": ((bool,), True),
}
DEFAULT_THETA = 160_000.0  # GteConfig.default_theta
# rope_type -> what hfport computes; transformers' other types (yarn, longrope, llama3) are refused by name
ROPE_TYPES = ("default", "linear", "dynamic")


def typed(raw: dict[str, Any], key: str, fields: dict[str, tuple[tuple[type, ...], Any]], source: str,
          config_class: str) -> Any:
    """A config field checked as transformers' strict config class checks it."""
    kinds, default = fields[key]
    value = raw.get(key, default)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = " or ".join("null" if k is _NONE else k.__name__ for k in kinds)
        raise ConfigError(f"{source}: field '{key}' expected {names}, got {type(value).__name__} ({value!r}), "
                          f"as transformers' {config_class} refuses it")
    return value


def rope(raw: dict[str, Any], source: str, default_theta: float, head_dim: int,
         max_positions: int) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from `rope_parameters`, or the older `rope_theta` / `rope_scaling`, as transformers'
    PreTrainedConfig standardizes them. Scaled types other than linear and dynamic are refused, naming the field."""
    given = raw.get("rope_parameters")
    field_name = "rope_parameters"
    if given is None and raw.get("rope_scaling") is not None:
        given, field_name = raw["rope_scaling"], "rope_scaling"
    if given is None:
        given = {}
    if not isinstance(given, dict):
        raise ConfigError(f"{source}: field '{field_name}' should be a mapping, got {given!r}")
    rope_type = given.get("rope_type", given.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{source}: field '{field_name}.rope_type': {rope_type!r} is not supported; hfport "
                          f"computes {list(ROPE_TYPES)}")
    theta = given.get("rope_theta", raw.get("rope_theta", default_theta))
    if isinstance(theta, bool) or not isinstance(theta, _NUMBER):
        raise ConfigError(f"{source}: field '{field_name}.rope_theta' should be a number, got {theta!r}")
    if rope_type == "default":
        return float(theta), None  # transformers' default RoPE reads no other key (partial_rotary_factor neither)
    factor = given.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, _NUMBER) or factor < 1.0:
        raise ConfigError(f"{source}: field '{field_name}.factor': rope_type {rope_type!r} needs a number >= 1, "
                          f"got {factor!r}")
    partial = given.get("partial_rotary_factor", 1.0)
    if partial != 1.0:  # transformers' scaled tables then cover part of the head and its attention fails
        raise ConfigError(f"{source}: field '{field_name}.partial_rotary_factor': {partial!r} is not supported; "
                          "rotary embeddings here cover the whole head (1.0)")
    return float(theta), RopeScaling(rope_type, float(factor), max_positions)


def check_shapes(v: dict[str, Any], source: str) -> None:
    """What every rotary family here refuses alike: a pad_token_id outside the vocabulary (the token embedding's
    padding row must exist)."""
    pad = v["pad_token_id"]
    if pad is not None and not -v["vocab_size"] <= pad < v["vocab_size"]:
        raise ConfigError(f"{source}: field 'pad_token_id': {pad} is outside the vocabulary (vocab_size "
                          f"{v['vocab_size']}); the token embedding's padding row must exist")


def head_width(raw: dict[str, Any], v: dict[str, Any], source: str, config_class: str) -> int | None:
    """Each attention head's width as these families' transformers attention reads it: config.json's head_dim,
    else hidden_size // num_attention_heads, floored (q, k and v project to heads x head_dim and o back to
    hidden_size, so the two need not divide). None where num_attention_heads is not positive (EncoderConfig names
    it). Refused, naming the field, where transformers fails: a head_dim that is not a positive even integer
    (rotary embeddings turn a head's channels in pairs; transformers' rope validation refuses an odd width), and
    an explicit null where the config class does not declare head_dim (GteConfig, JinaEmbeddingsV3Config: their
    attention reads getattr(config, "head_dim") as the width and fails on None)."""
    hidden, heads = v["hidden_size"], v["num_attention_heads"]
    if "head_dim" in raw and raw["head_dim"] is None and "head_dim" not in v:
        raise ConfigError(f"{source}: field 'head_dim': null is not a width; transformers' {config_class} model "
                          "reads it as one and fails. Leave it out for hidden_size // num_attention_heads")
    given = raw.get("head_dim")
    if given is None:
        if isinstance(heads, bool) or not isinstance(heads, int) or heads <= 0:
            return None
        given = hidden // heads
    if isinstance(given, bool) or not isinstance(given, int) or given <= 0 or given % 2:
        where = "" if "head_dim" in raw else f" (hidden_size {hidden} // num_attention_heads {heads})"
        raise ConfigError(f"{source}: field 'head_dim': {given!r}{where} is not a positive even integer; rotary "
                          f"embeddings turn a head's channels in pairs, and transformers' {config_class} refuses it")
    return given


def rotary_config(raw: dict[str, Any], source: str, *, fields: dict[str, tuple[tuple[type, ...], Any]],
                  config_class: str, default_theta: float, min_type_vocab: int) -> EncoderConfig:
    """GTE's and NomicBERT's configs: BertConfig's names, rotary positions instead of a position table."""
    v = {key: typed(raw, key, fields, source, config_class) for key in fields}
    hidden, heads = v["hidden_size"], v["num_attention_heads"]
    if v["hidden_act"] not in ACTIVATIONS:
        raise ConfigError(f"{source}: field 'hidden_act': {v['hidden_act']!r} is not supported; supported: "
                          f"{sorted(ACTIVATIONS)}")
    head_dim = head_width(raw, v, source, config_class)
    check_shapes(v, source)
    if v["type_vocab_size"] < min_type_vocab:
        raise ConfigError(f"{source}: field 'type_vocab_size': {v['type_vocab_size']} is below {min_type_vocab}; "
                          f"transformers' {config_class} model looks up token type 0")
    theta, scaling = rope(raw, source, default_theta, head_dim, v["max_position_embeddings"])
    return EncoderConfig(
        model_type=raw["model_type"], vocab_size=v["vocab_size"], hidden_size=hidden,
        num_hidden_layers=v["num_hidden_layers"], num_attention_heads=heads,
        intermediate_size=v["intermediate_size"], hidden_act=v["hidden_act"],
        max_position_embeddings=v["max_position_embeddings"], type_vocab_size=v["type_vocab_size"],
        layer_norm_eps=v["layer_norm_eps"], pad_token_id=v["pad_token_id"], initializer_range=v["initializer_range"],
        hidden_dropout=v["hidden_dropout_prob"], attention_dropout=v["attention_probs_dropout_prob"],
        classifier_dropout=v["classifier_dropout"], tie_word_embeddings=v["tie_word_embeddings"], head_dim=head_dim,
        extra={"rope_theta": theta, "rope_scaling": scaling}, **head_fields(raw), raw=raw, source=source)


def gte_config(raw: dict[str, Any], source: str) -> EncoderConfig:
    return rotary_config(raw, source, fields=FIELDS, config_class="GteConfig", default_theta=DEFAULT_THETA,
                         min_type_vocab=0)


# --- the body -----------------------------------------------------------------------------------------------


def rotary_attention(c: EncoderConfig, bias: bool) -> SelfAttention:
    """Attention with one fused q/k/v projection (the checkpoints' qkv_proj / Wqkv, q first) and rotary positions."""
    return SelfAttention(c.hidden_size, c.num_attention_heads, c.attention_dropout, bias=bias, head_dim=c.head_dim,
                         rotary=Rotary(c.head_dim, c.extra["rope_theta"], c.extra["rope_scaling"]),
                         qkv=FusedQKV(c.hidden_size, bias=bias, attention_size=c.attention_size))


def post_ln_layer(c: EncoderConfig, attn: nn.Module, ffn: nn.Module) -> EncoderLayer:
    """Post-LN (as BERT): x = norm(x + dropout(attn(x))); x = norm(x + dropout(ffn(x)))."""
    return EncoderLayer(attn, ffn, layer_norm(c.hidden_size, c.layer_norm_eps),
                        layer_norm(c.hidden_size, c.layer_norm_eps),
                        attn_out_dropout=c.hidden_dropout, ffn_out_dropout=c.hidden_dropout)


def gte_layer(c: EncoderConfig) -> EncoderLayer:
    # up_gate_proj holds (up, gate) without bias, the activation on gate; dropout on the gated product; down has a bias
    ffn = GatedFeedForward(c.hidden_size, c.intermediate_size, c.hidden_act, c.hidden_dropout, bias=False,
                           activated=1, down_bias=True)
    return post_ln_layer(c, rotary_attention(c, bias=True), ffn)


def body_builder(layer: Callable[[EncoderConfig], EncoderLayer]) -> Callable[[EncoderConfig, bool], EncoderBody]:
    def build_body(c: EncoderConfig, pooler: bool) -> EncoderBody:
        embeddings = Embeddings(c.vocab_size, c.hidden_size, 0, c.type_vocab_size, c.layer_norm_eps,
                                c.hidden_dropout, c.pad_token_id)  # no position table: rotary positions instead
        encoder = Encoder([layer(c) for _ in range(c.num_hidden_layers)])
        return EncoderBody(embeddings, encoder, Pooler(c.hidden_size) if pooler else None)
    return build_body


# --- names: the layout transformers 5.23 writes (and the original checkpoints have): fused q/k/v, BERT's
# encoder.layer; transformers renames them to its module names (q_proj, ...) only in memory -------------------

LAYER = ("encoder.layer.{i}", "encoder.layers.{i}")
BODY_KEYS = KeyMap(tables(
    params("embeddings.word_embeddings", "embeddings.word", ("weight",)),
    params("embeddings.token_type_embeddings", "embeddings.token_type", ("weight",)),
    params("embeddings.LayerNorm", "embeddings.norm"),
    params(f"{LAYER[0]}.attention.qkv_proj", f"{LAYER[1]}.attn.qkv.proj"),
    params(f"{LAYER[0]}.attention.o_proj", f"{LAYER[1]}.attn.o"),
    params(f"{LAYER[0]}.attn_ln", f"{LAYER[1]}.attn_norm"),
    params(f"{LAYER[0]}.mlp.up_gate_proj", f"{LAYER[1]}.ffn.up"),
    params(f"{LAYER[0]}.mlp.down_proj", f"{LAYER[1]}.ffn.down"),
    params(f"{LAYER[0]}.mlp_ln", f"{LAYER[1]}.ffn_norm"),
    params("pooler.dense", "pooler.dense"),
    # non-persistent buffers an older save may carry
    {"rotary_emb.inv_freq": None, "rotary_emb.original_inv_freq": None, "embeddings.position_ids": None,
     "embeddings.token_type_ids": None},
))

HEAD_KEYS = {
    "text-classification": KeyMap(params("classifier", "out")),
    "token-classification": KeyMap(params("classifier", "out")),
    "fill-mask": KeyMap(tables(params("lm_head.dense", "dense"), params("lm_head.norm", "norm"),
                               {"lm_head.decoder.weight": "decoder.weight",  # tied to the word embeddings unless untied
                                "lm_head.decoder.bias": "bias"})),
}
# GteLMHead: dense -> gelu (fixed, whatever hidden_act says) -> LayerNorm -> decoder with its own bias, which is
# the head's `bias` whether the decoder weight is tied or not
HEAD_OPTIONS: HeadOptions = {"fill-mask": lambda c: {"act": "gelu", "decoder_bias": False}}
# transformers' GTE and NomicBERT classes: no question answering, no multiple choice
TASKS = ("feature-extraction", "text-classification", "token-classification", "fill-mask")
# the fused q/k/v projection: LoRA adapts query, key and value together by default, as for ModernBERT's Wqkv
LORA_TARGETS = ("attn.qkv.proj",)
# GteModel's pooler is off unless a head asks for it (GteForSequenceClassification does)
POOLER = {"feature-extraction": False}

GTE = Family(
    model_type="gte", prefix="gte", class_prefix="Gte", config_from_hf=gte_config, body_keys=BODY_KEYS,
    head_keys=HEAD_KEYS, body_builder=body_builder(gte_layer), head_options=HEAD_OPTIONS, pooler=POOLER, tasks=TASKS,
    lora_targets=LORA_TARGETS)
