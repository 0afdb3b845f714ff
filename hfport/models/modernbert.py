"""ModernBERT (also Ettin, mmBERT): pre-LN layers without a first attention norm, a final norm, a fused q/k/v
projection, GeGLU feed-forwards, rotary positions with a base per layer type, local (sliding-window) attention on
"sliding_attention" layers, optional biases everywhere, and a prediction head (dense -> act -> norm) under every
task head. Everything here composes nn/ blocks; the config mapping follows transformers 5.23's ModernBertConfig.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..config import EncoderConfig, head_fields
from ..errors import ConfigError
from ..keymap import KeyMap, params, tables
from ..nn import (Embeddings, Encoder, EncoderBody, EncoderLayer, FusedQKV, GatedFeedForward, Rotary, SelfAttention,
                  layer_norm)
from ..nn.activations import ACTIVATIONS
from .family import Family, HeadOptions

FULL, SLIDING = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)
DEFAULT_THETA = {FULL: 160_000.0, SLIDING: 10_000.0}  # ModernBertConfig.default_theta
_NUMBER = (int, float)
# ModernBertConfig's typed fields (a strict dataclass: a bool is not an int, an int is not a float) and defaults
FIELDS: dict[str, tuple[tuple[type, ...], Any]] = {
    "vocab_size": ((int,), 50368), "hidden_size": ((int,), 768), "intermediate_size": ((int,), 1152),
    "num_hidden_layers": ((int,), 22), "num_attention_heads": ((int,), 12), "hidden_activation": ((str,), "gelu"),
    "max_position_embeddings": ((int,), 8192), "initializer_range": ((float,), 0.02),
    "initializer_cutoff_factor": ((float,), 2.0), "norm_eps": ((float,), 1e-5), "norm_bias": ((bool,), False),
    "pad_token_id": ((int, type(None)), 50283), "attention_bias": ((bool,), False),
    "attention_dropout": (_NUMBER, 0.0), "local_attention": ((int,), 128), "embedding_dropout": (_NUMBER, 0.0),
    "mlp_bias": ((bool,), False), "mlp_dropout": (_NUMBER, 0.0), "decoder_bias": ((bool,), True),
    "classifier_pooling": ((str,), "cls"), "classifier_dropout": (_NUMBER, 0.0), "classifier_bias": ((bool,), False),
    "classifier_activation": ((str,), "gelu"), "deterministic_flash_attn": ((bool,), False),
    "sparse_prediction": ((bool,), False), "sparse_pred_ignore_index": ((int,), -100),
    "tie_word_embeddings": ((bool,), True),
}
POOLING = {"cls": "first", "mean": "mean"}  # classifier_pooling -> the sequence classifier's pooling option


def _typed(raw: dict[str, Any], key: str, source: str) -> Any:
    kinds, default = FIELDS[key]
    value = raw.get(key, default)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
        raise ConfigError(f"{source}: field '{key}' expected {names}, got {type(value).__name__} ({value!r}), "
                          "as transformers' ModernBertConfig refuses it")
    return value


def layer_types(raw: dict[str, Any], layers: int, source: str) -> list[str]:
    """`layer_types`, or the older `global_attn_every_n_layers` (every n-th layer global, from layer 0)."""
    given = raw.get("layer_types")
    if given is None:
        every = raw.get("global_attn_every_n_layers", 3)
        if isinstance(every, bool) or not isinstance(every, _NUMBER) or every == 0:
            raise ConfigError(f"{source}: field 'global_attn_every_n_layers' must be a non-zero number, got {every!r}")
        return [SLIDING if bool(i % every) else FULL for i in range(layers)]
    if not isinstance(given, list) or not all(isinstance(t, str) for t in given):
        raise ConfigError(f"{source}: field 'layer_types' should be a list of strings, got {given!r}")
    if len(given) != layers:
        raise ConfigError(f"{source}: field 'layer_types': `num_hidden_layers` ({layers}) must be equal to the "
                          f"number of `layer_types` ({len(given)})")
    unknown = sorted(set(given) - set(LAYER_TYPES))
    if unknown:
        raise ConfigError(f"{source}: field 'layer_types': {unknown} not supported; ModernBERT computes "
                          f"{list(LAYER_TYPES)} (transformers' model has no rotary or mask for others)")
    return list(given)


def rope_thetas(raw: dict[str, Any], source: str) -> dict[str, float]:
    """The rotary base per layer type, resolved as ModernBertConfig does: `rope_parameters` first, then the older
    `global_rope_theta` / `local_rope_theta`, then the defaults; `rope_scaling` applies to both types. Only the
    default (unscaled) RoPE is computed: any other rope_type is refused, naming the field."""
    given = raw.get("rope_parameters")
    if given is not None and not isinstance(given, dict):
        raise ConfigError(f"{source}: field 'rope_parameters' should be a mapping of layer type to parameters, "
                          f"got {given!r}")
    rope = {k: dict(v) if isinstance(v, dict) else v for k, v in (given or {}).items()}
    extra_keys = sorted(set(rope) - set(LAYER_TYPES))
    if extra_keys:
        raise ConfigError(f"{source}: field 'rope_parameters': keys {extra_keys} are not layer types; expected "
                          f"{list(LAYER_TYPES)}")
    scaling = raw.get("rope_scaling")
    old = {FULL: "global_rope_theta", SLIDING: "local_rope_theta"}
    thetas = {}
    for kind in LAYER_TYPES:
        params_ = rope.get(kind, {"rope_type": "default"})
        if not isinstance(params_, dict):  # transformers' strict config refuses a null entry too
            raise ConfigError(f"{source}: field 'rope_parameters.{kind}' should be a mapping, got {params_!r}")
        if scaling is not None:
            if given is not None and kind not in rope:  # transformers updates both entries and fails (KeyError)
                raise ConfigError(f"{source}: field 'rope_parameters' lacks '{kind}', which 'rope_scaling' "
                                  "applies to (transformers fails on it)")
            if not isinstance(scaling, dict):
                raise ConfigError(f"{source}: field 'rope_scaling' should be a mapping, got {scaling!r}")
            params_.update(scaling)
        field_name = "rope_scaling" if scaling is not None else f"rope_parameters.{kind}"
        rope_type = params_.get("rope_type", params_.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"{source}: field '{field_name}': rope_type {rope_type!r} is not supported; hfport "
                              "computes the default (unscaled) RoPE only")
        theta = params_.get("rope_theta", raw.get(old[kind], DEFAULT_THETA[kind]))
        if isinstance(theta, bool) or not isinstance(theta, _NUMBER):
            where = f"rope_parameters.{kind}.rope_theta" if "rope_theta" in params_ else old[kind]
            raise ConfigError(f"{source}: field '{where}' should be a number, got {theta!r}")
        thetas[kind] = float(theta)
    return thetas


def modernbert_config(raw: dict[str, Any], source: str) -> EncoderConfig:
    v = {key: _typed(raw, key, source) for key in FIELDS}
    if v["classifier_pooling"] not in POOLING:
        raise ConfigError(f"{source}: field 'classifier_pooling' expected one of ('cls', 'mean'), got "
                          f"{v['classifier_pooling']!r}")
    if v["classifier_activation"] not in ACTIVATIONS:
        raise ConfigError(f"{source}: field 'classifier_activation': {v['classifier_activation']!r} is not "
                          f"supported; supported: {sorted(ACTIVATIONS)}")
    hidden, heads = v["hidden_size"], v["num_attention_heads"]
    if raw.get("head_dim") and heads > 0 and hidden % heads == 0 and raw["head_dim"] != hidden // heads:
        # transformers sizes the rotary tables by head_dim (null or 0: hidden_size // heads) but the heads by
        # hidden_size // heads: any other width fails there
        raise ConfigError(f"{source}: field 'head_dim': {raw['head_dim']!r} differs from hidden_size // "
                          f"num_attention_heads ({hidden // heads}); ModernBERT's heads are hidden_size // heads wide")
    pad = v["pad_token_id"]
    if pad is not None and not -v["vocab_size"] <= pad < v["vocab_size"]:
        raise ConfigError(f"{source}: field 'pad_token_id': {pad} is outside the vocabulary (vocab_size "
                          f"{v['vocab_size']}); the token embedding's padding row must exist")
    extra = {
        "layer_types": layer_types(raw, v["num_hidden_layers"], source), "rope_theta": rope_thetas(raw, source),
        "pooling": POOLING[v["classifier_pooling"]],
        **{k: v[k] for k in ("local_attention", "attention_bias", "mlp_bias", "norm_bias", "decoder_bias",
                             "classifier_bias", "classifier_activation", "embedding_dropout", "mlp_dropout",
                             "sparse_prediction", "initializer_cutoff_factor")},
    }
    return EncoderConfig(
        model_type="modernbert", vocab_size=v["vocab_size"], hidden_size=hidden,
        num_hidden_layers=v["num_hidden_layers"], num_attention_heads=heads, intermediate_size=v["intermediate_size"],
        hidden_act=v["hidden_activation"],
        max_position_embeddings=v["max_position_embeddings"], type_vocab_size=0, layer_norm_eps=v["norm_eps"],
        pad_token_id=pad, initializer_range=v["initializer_range"], hidden_dropout=v["embedding_dropout"],
        attention_dropout=v["attention_dropout"], classifier_dropout=v["classifier_dropout"],
        tie_word_embeddings=v["tie_word_embeddings"], extra=extra, **head_fields(raw), raw=raw, source=source)


# --- the body -----------------------------------------------------------------------------------------------


def modernbert_layer(c: EncoderConfig, i: int) -> EncoderLayer:
    x = c.extra
    kind = x["layer_types"][i]
    attn = SelfAttention(c.hidden_size, c.num_attention_heads, c.attention_dropout, bias=x["attention_bias"],
                         window=x["local_attention"] if kind == SLIDING else None,
                         rotary=Rotary(c.head_dim, x["rope_theta"][kind]),
                         qkv=FusedQKV(c.hidden_size, bias=x["attention_bias"]))
    attn_norm = nn.Identity() if i == 0 else layer_norm(c.hidden_size, c.layer_norm_eps, x["norm_bias"])
    ffn = GatedFeedForward(c.hidden_size, c.intermediate_size, c.hidden_act, x["mlp_dropout"], x["mlp_bias"])
    # transformers' out_drop after Wo uses attention_dropout; the feed-forward has no residual dropout
    return EncoderLayer(attn, ffn, attn_norm, layer_norm(c.hidden_size, c.layer_norm_eps, x["norm_bias"]),
                        norm_first=True, attn_out_dropout=c.attention_dropout)


def build_body(c: EncoderConfig, pooler: bool) -> EncoderBody:
    x = c.extra
    embeddings = Embeddings(c.vocab_size, c.hidden_size, 0, 0, c.layer_norm_eps, x["embedding_dropout"],
                            c.pad_token_id, norm_bias=x["norm_bias"])  # no position table: rotary instead
    encoder = Encoder([modernbert_layer(c, i) for i in range(c.num_hidden_layers)],
                      norm=layer_norm(c.hidden_size, c.layer_norm_eps, x["norm_bias"]))
    return EncoderBody(embeddings, encoder, pooler=None)


# --- heads: every task head starts with ModernBertPredictionHead ---------------------------------------------


def prediction_head(c: EncoderConfig) -> dict[str, Any]:
    x = c.extra
    return {"act": x["classifier_activation"], "eps": c.layer_norm_eps, "dense_bias": x["classifier_bias"],
            "norm_bias": x["norm_bias"]}


def qa_options(c: EncoderConfig) -> dict[str, Any]:
    if c.num_labels != 2:  # transformers' QA classifier has num_labels outputs, split into start and end
        raise c.error("num_labels", f"{c.num_labels}: ModernBertForQuestionAnswering needs 2 (start, end)")
    return {"transform": prediction_head(c), "dropout": c.classifier_dropout}


def mlm_options(c: EncoderConfig) -> dict[str, Any]:
    x = c.extra
    if x["sparse_prediction"]:
        raise c.error("sparse_prediction", "true is not supported: transformers then returns logits only at the "
                      "labelled positions, flattened; hfport's fill-mask model returns (B, T, V) logits. Set it to "
                      "false (the loss is the same)")
    # the decoder's bias is the head's `bias` whether the decoder weight is tied or not; no bias at all unless
    # decoder_bias
    return {"act": x["classifier_activation"], "decoder_bias": False, "dense_bias": x["classifier_bias"],
            "norm_bias": x["norm_bias"], "output_bias": x["decoder_bias"]}


def classifier_options(c: EncoderConfig) -> dict[str, Any]:
    """the prediction head on the first real token or the mean (classifier_pooling) -> dropout -> classifier"""
    return {"transform": prediction_head(c), "pooling": c.extra["pooling"], "dropout": c.classifier_dropout}


HEAD_OPTIONS: HeadOptions = {
    "text-classification": classifier_options,
    "multiple-choice": classifier_options,
    "token-classification": lambda c: {"transform": prediction_head(c), "dropout": c.classifier_dropout},
    "question-answering": qa_options,
    "fill-mask": mlm_options,
}


@torch.no_grad()
def after_init(model: nn.Module, c: EncoderConfig) -> None:
    """transformers' ModernBERT init for a fresh model: truncated normals (cut at +-cutoff std), "out"
    projections scaled by 1 / sqrt(2 * layers), the classifier at hidden_size ** -0.5."""
    cutoff = c.extra["initializer_cutoff_factor"]
    std = {"in": c.initializer_range, "out": c.initializer_range / math.sqrt(2.0 * c.num_hidden_layers),
           "final": c.hidden_size ** -0.5}

    def init(module: nn.Module | None, kind: str) -> None:
        if module is None:
            return
        s = std[kind]
        nn.init.trunc_normal_(module.weight, 0.0, s, -cutoff * s, cutoff * s)
        if getattr(module, "bias", None) is not None:
            module.bias.zero_()

    init(model.body.embeddings.word, "in")
    for layer in model.body.encoder.layers:
        init(layer.attn.qkv.proj, "in")
        init(layer.attn.o, "out")
        init(layer.ffn.up, "in")
        init(layer.ffn.down, "out")
    head = model.head
    if head is None:
        return
    init(getattr(head, "transform", None) and head.transform.dense, "out")
    if hasattr(head, "decoder"):  # MLM: its dense layer is the prediction head's, its decoder an "out" projection
        init(head.dense, "out")
        init(head.decoder, "out")
    init(getattr(head, "out", None) or getattr(head, "qa", None), "final")


# --- names --------------------------------------------------------------------------------------------------

LAYER = ("layers.{i}", "encoder.layers.{i}")
BODY_KEYS = KeyMap(tables(
    params("embeddings.tok_embeddings", "embeddings.word", ("weight",)),
    params("embeddings.norm", "embeddings.norm"),
    params(f"{LAYER[0]}.attn_norm", f"{LAYER[1]}.attn_norm"),
    params(f"{LAYER[0]}.attn.Wqkv", f"{LAYER[1]}.attn.qkv.proj"),
    params(f"{LAYER[0]}.attn.Wo", f"{LAYER[1]}.attn.o"),
    params(f"{LAYER[0]}.mlp_norm", f"{LAYER[1]}.ffn_norm"),
    params(f"{LAYER[0]}.mlp.Wi", f"{LAYER[1]}.ffn.up"),
    params(f"{LAYER[0]}.mlp.Wo", f"{LAYER[1]}.ffn.down"),
    params("final_norm", "encoder.norm"),
))

_PREDICTION = tables(params("head.dense", "transform.dense"), params("head.norm", "transform.norm"))
HEAD_KEYS = {
    "text-classification": KeyMap(tables(_PREDICTION, params("classifier", "out"))),
    "token-classification": KeyMap(tables(_PREDICTION, params("classifier", "out"))),
    "question-answering": KeyMap(tables(_PREDICTION, params("classifier", "qa"))),
    "multiple-choice": KeyMap(tables(_PREDICTION, params("classifier", "out"))),
    "fill-mask": KeyMap(tables(params("head.dense", "dense"), params("head.norm", "norm"),
                               {"decoder.weight": "decoder.weight",  # tied to tok_embeddings unless untied
                                "decoder.bias": "bias"})),
}

MODERNBERT = Family(
    model_type="modernbert", prefix="model", class_prefix="ModernBert",
    config_from_hf=modernbert_config, body_keys=BODY_KEYS, head_keys=HEAD_KEYS, body_builder=build_body,
    head_options=HEAD_OPTIONS, after_init=after_init,
    lora_targets=("attn.qkv.proj",))  # the fused Wqkv: LoRA adapts query, key and value together (peft's choice too)
