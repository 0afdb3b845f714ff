"""jina-embeddings-v3 (the transformers-native `jinaai/jina-embeddings-v3-hf`): XLM-RoBERTa with rotary positions
instead of a position table, a fused q/k/v projection (`mixer.Wqkv`), BERT's post-LN layer and feed-forward, and
RoBERTa's heads under RoBERTa's names. The body reuses GTE's pieces (gte.py), the heads RoBERTa's (roberta.py).

Its task adapters (retrieval.query, text-matching, ...) are LoRA weights outside this model: transformers 5.23's
config has no `lora_adaptations`, so a task is a PEFT adapter over the base. peft over transformers' model names the
modules as transformers holds them in memory (`layers.{i}.self_attn.q_proj`, ...; IN_MEMORY_NAMES below): hfport
reads those names too, a LoRA on q, k or v becoming a LoRA on its rows of the fused `mixer.Wqkv` (hfport/lora.py).
"""

from __future__ import annotations

from typing import Any

from ..config import EncoderConfig
from ..formats.adapter import IN_MEMORY_NAMES, ModuleNames
from ..keymap import KeyMap, params, tables
from ..nn import EncoderLayer, FeedForward
from .family import Family
from .gte import (_NONE, _NUMBER, LORA_TARGETS, body_builder, post_ln_layer, rotary_attention,
                  rotary_config)
from .roberta import HEAD_KEYS, HEAD_OPTIONS, POOLER

# JinaEmbeddingsV3Config's typed fields and defaults (use_cache changes nothing an encoder computes)
FIELDS: dict[str, tuple[tuple[type, ...], Any]] = {
    "vocab_size": ((int,), 250002), "hidden_size": ((int,), 1024), "num_hidden_layers": ((int,), 24),
    "num_attention_heads": ((int,), 16), "intermediate_size": ((int,), 4096), "hidden_act": ((str,), "gelu"),
    "hidden_dropout_prob": (_NUMBER, 0.1), "attention_probs_dropout_prob": (_NUMBER, 0.1),
    "max_position_embeddings": ((int,), 8194), "type_vocab_size": ((int,), 1), "initializer_range": ((float,), 0.02),
    "layer_norm_eps": ((float,), 1e-5), "pad_token_id": ((int, _NONE), 1),
    "classifier_dropout": ((*_NUMBER, _NONE), None), "tie_word_embeddings": ((bool,), True),
}
DEFAULT_THETA = 20_000.0  # JinaEmbeddingsV3Config.default_theta


def jina_config(raw: dict[str, Any], source: str) -> EncoderConfig:
    return rotary_config(raw, source, fields=FIELDS, config_class="JinaEmbeddingsV3Config",
                         default_theta=DEFAULT_THETA, min_type_vocab=1)


def jina_layer(c: EncoderConfig) -> EncoderLayer:
    ffn = FeedForward(c.hidden_size, c.intermediate_size, c.hidden_act)  # fc1 -> act -> fc2, with biases
    return post_ln_layer(c, rotary_attention(c, bias=True), ffn)


# the layout transformers 5.23 writes (jina's original names; transformers renames them in memory only)
LAYER = ("encoder.layers.{i}", "encoder.layers.{i}")
BODY_KEYS = KeyMap(tables(
    params("embeddings.word_embeddings", "embeddings.word", ("weight",)),
    params("embeddings.token_type_embeddings", "embeddings.token_type", ("weight",)),
    params("emb_ln", "embeddings.norm"),
    params(f"{LAYER[0]}.mixer.Wqkv", f"{LAYER[1]}.attn.qkv.proj"),
    params(f"{LAYER[0]}.mixer.out_proj", f"{LAYER[1]}.attn.o"),
    params(f"{LAYER[0]}.norm1", f"{LAYER[1]}.attn_norm"),
    params(f"{LAYER[0]}.mlp.fc1", f"{LAYER[1]}.ffn.up"),
    params(f"{LAYER[0]}.mlp.fc2", f"{LAYER[1]}.ffn.down"),
    params(f"{LAYER[0]}.norm2", f"{LAYER[1]}.ffn_norm"),
    params("pooler.dense", "pooler.dense"),
    {"rotary_emb.inv_freq": None, "rotary_emb.original_inv_freq": None, "embeddings.position_ids": None,
     "embeddings.token_type_ids": None},  # non-persistent buffers an older save may carry
))

# transformers has no multiple-choice class for it
TASKS = ("feature-extraction", "text-classification", "token-classification", "question-answering", "fill-mask")

JINA_EMBEDDINGS_V3 = Family(
    model_type="jina_embeddings_v3", prefix="roberta", class_prefix="JinaEmbeddingsV3", config_from_hf=jina_config,
    body_keys=BODY_KEYS, head_keys={t: k for t, k in HEAD_KEYS.items() if t in TASKS},
    body_builder=body_builder(jina_layer), head_options=HEAD_OPTIONS, pooler=POOLER, tasks=TASKS,
    lora_targets=LORA_TARGETS)

# transformers' conversion_mapping.py for this model_type, on the linear layers: what PEFT adapters over
# JinaEmbeddingsV3Model name (q/k/v are equal row chunks of the saved Wqkv, in that order)
IN_MEMORY_NAMES[JINA_EMBEDDINGS_V3.model_type] = ModuleNames(
    renames=((r"(^|\.)encoder\.layers\.", r"\1layers."), (r"\.mixer\.out_proj$", ".self_attn.o_proj")),
    splits=(("mixer.Wqkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),))
