"""ELECTRA: BERT's layers under BERT's names, embeddings of embedding_size projected to hidden_size
(embeddings_project) when the two differ, no pooler; its own heads (a gelu classifier on the first token, the
generator's MLM head, a SequenceSummary before the multiple-choice classifier)."""

from __future__ import annotations

from typing import Any

from ..config import EncoderConfig, require
from ..errors import ConfigError
from ..keymap import KeyMap, params, tables
from ..nn import Embeddings, Encoder, EncoderBody
from ..nn.activations import ACTIVATIONS
from . import bert
from .family import Family, HeadOptions

# ElectraConfig's defaults (transformers 5.23) where they differ from BertConfig's
DEFAULTS = {"vocab_size": 30522, "hidden_size": 256, "num_hidden_layers": 12, "num_attention_heads": 4,
            "intermediate_size": 1024}
# ElectraSequenceSummary's summary_type -> hfport's pooling of the real tokens. transformers' "last" reads position
# T - 1 and "mean" averages every position, padding included; hfport reads the last real token and the real tokens'
# mean: the same on unpadded rows ("cls_index" without a cls_index, the only way ElectraForMultipleChoice calls it,
# is "last")
SUMMARY_POOLING = {"first": "first", "last": "lasttoken", "cls_index": "lasttoken", "mean": "mean"}


def _dropout(raw: dict[str, Any], key: str, default: float, source: str) -> float:
    """A summary dropout as ElectraSequenceSummary reads it: applied only when > 0; above 1 nn.Dropout refuses."""
    p = bert.number(raw, key, default, source) or 0.0
    if p > 1.0:
        raise ConfigError(f"{source}: field '{key}': {p} is not a probability (0 to 1); transformers' nn.Dropout "
                          "refuses it")
    return max(float(p), 0.0)


def _summary(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """The multiple-choice head's ElectraSequenceSummary fields (transformers reads them with hasattr/getattr):
    first dropout -> [projection] -> [activation] -> last dropout, each part present or not on its own."""
    kind = raw.get("summary_type", "first")
    if kind not in SUMMARY_POOLING:
        raise ConfigError(f"{source}: field 'summary_type': {kind!r} is not supported; supported: "
                          f"{sorted(SUMMARY_POOLING)} (transformers raises NotImplementedError for 'attn' and fails "
                          "on any other name)")
    act = raw.get("summary_activation", "gelu") or None  # None or "": no activation
    if act is not None and act not in ACTIVATIONS:
        raise ConfigError(f"{source}: field 'summary_activation': {act!r} is not supported; "
                          f"supported: {sorted(ACTIVATIONS)}")
    return {"summary_pooling": SUMMARY_POOLING[kind], "summary_use_proj": bool(raw.get("summary_use_proj", True)),
            "summary_proj_to_labels": bool(raw.get("summary_proj_to_labels", False)), "summary_activation": act,
            "summary_first_dropout": _dropout(raw, "summary_first_dropout", 0.0, source),
            "summary_last_dropout": _dropout(raw, "summary_last_dropout", 0.1, source)}


def electra_config(raw: dict[str, Any], source: str) -> EncoderConfig:
    for key in ("is_decoder", "add_cross_attention"):
        if raw.get(key):
            raise ConfigError(f"{source}: field '{key}': true is not supported; hfport runs ELECTRA as an encoder "
                              "(bidirectional attention, no cross-attention)")
    config = bert.bert_config(raw, source, defaults=DEFAULTS,
                              embedding_size=require(raw, "embedding_size", source) if "embedding_size" in raw
                              else 128, extra=_summary(raw, source))
    x = config.extra
    if x["summary_use_proj"] and x["summary_proj_to_labels"] and config.num_labels != config.hidden_size:
        # the projection then gives num_labels features to ElectraForMultipleChoice's classifier, a Linear over
        # hidden_size: transformers fails unless the two are equal (then it is the usual projection)
        raise ConfigError(f"{source}: field 'summary_proj_to_labels': true projects to num_labels "
                          f"({config.num_labels}) features, which ElectraForMultipleChoice's classifier (over "
                          f"hidden_size {config.hidden_size}) cannot read; transformers fails on it")
    return config


def build_body(c: EncoderConfig, pooler: bool) -> EncoderBody:
    """ElectraModel has no pooler, whatever the head: its classifiers read the first token themselves."""
    embeddings = Embeddings(c.vocab_size, c.embedding_size, c.max_position_embeddings, c.type_vocab_size,
                            c.layer_norm_eps, c.hidden_dropout, c.pad_token_id,
                            hidden_size=c.hidden_size if c.embedding_size != c.hidden_size else None)
    return EncoderBody(embeddings, Encoder([bert.bert_layer(c) for _ in range(c.num_hidden_layers)]), pooler=None)


def summary_head(c: EncoderConfig) -> dict[str, Any]:
    """SequenceSummary (first dropout -> [projection] -> [activation] -> last dropout) -> classifier, as the head's
    pre_dropout -> [dense] -> act -> dropout -> out; no activation is the identity ("linear"). summary_proj_to_labels
    projects to num_labels = hidden_size features (electra_config refuses other counts): the same layer."""
    x = c.extra
    return {"dense_act": x["summary_activation"] or "linear", "project": x["summary_use_proj"],
            "pre_dropout": x["summary_first_dropout"], "dropout": x["summary_last_dropout"],
            "pooling": x["summary_pooling"]}


HEAD_OPTIONS: HeadOptions = {
    # ElectraClassificationHead: dropout -> dense -> gelu -> dropout -> out_proj on the first token
    "text-classification": lambda c: {"dense_act": "gelu", "pre_dropout": c.classifier_dropout},
    "multiple-choice": summary_head,
    # ElectraGeneratorPredictions (dense to embedding_size -> gelu -> LayerNorm) -> generator_lm_head, whose bias is
    # the head's `bias` (tied or not)
    "fill-mask": lambda c: {"act": "gelu", "decoder_bias": False},
    # ElectraForPreTraining, the discriminator: replaced-token detection instead of BERT's MLM + next-sentence heads
    "pretraining": lambda c: {"replaced_tokens": True},
}

BODY_KEYS = KeyMap(tables(bert.EMBEDDING_KEYS, params("embeddings_project", "embeddings.project"),
                          bert.layer_keys("encoder.layer.{i}", "encoder.layers.{i}")))

HEAD_KEYS = {
    "text-classification": KeyMap({**params("classifier.dense", "dense"), **params("classifier.out_proj", "out")}),
    "token-classification": KeyMap(params("classifier", "out")),
    "question-answering": KeyMap(params("qa_outputs", "qa")),
    "multiple-choice": KeyMap({**params("sequence_summary.summary", "dense"), **params("classifier", "out")}),
    "fill-mask": KeyMap({
        **params("generator_predictions.dense", "dense"),
        **params("generator_predictions.LayerNorm", "norm"),
        "generator_lm_head.bias": "bias",
        "generator_lm_head.weight": "decoder.weight",  # tied to the word embeddings unless untied
    }),
    # ElectraForPreTraining (the discriminators users fine-tune or run as is): the replaced-token-detection head
    "pretraining": KeyMap({**params("discriminator_predictions.dense", "dense"),
                           **params("discriminator_predictions.dense_prediction", "out")}),
}

ELECTRA = Family(
    model_type="electra", prefix="electra", class_prefix="Electra", config_from_hf=electra_config,
    body_keys=BODY_KEYS, head_keys=HEAD_KEYS, body_builder=build_body, head_options=HEAD_OPTIONS)
