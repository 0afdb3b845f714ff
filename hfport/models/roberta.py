"""RoBERTa: BERT whose position ids count from pad_token_id + 1, with its own classification and LM heads."""

from __future__ import annotations

from ..config import EncoderConfig
from ..keymap import KeyMap, params
from ..nn import Encoder, EncoderBody, Pooler
from . import bert
from .family import Family, HeadOptions

def build_body(c: EncoderConfig, pooler: bool) -> EncoderBody:
    embeddings = bert.bert_embeddings(c, positions_offset_by_padding=True)
    encoder = Encoder([bert.bert_layer(c) for _ in range(c.num_hidden_layers)])
    return EncoderBody(embeddings, encoder, Pooler(c.hidden_size) if pooler else None)


POOLER = {"text-classification": False}  # RobertaForSequenceClassification has its own dense layer on <s> instead


HEAD_OPTIONS: HeadOptions = {
    # dropout -> dense -> tanh -> dropout -> out_proj on <s>
    "text-classification": lambda c: {"dense_act": "tanh", "pre_dropout": c.classifier_dropout},
    "fill-mask": lambda c: {"act": "gelu"},  # RobertaLMHead uses exact gelu whatever hidden_act says
    "multiple-choice": lambda c: {"dropout": c.hidden_dropout},  # pooler -> dropout(hidden_dropout_prob) -> out
}

HEAD_KEYS = {
    "text-classification": KeyMap({**params("classifier.dense", "dense"), **params("classifier.out_proj", "out")}),
    "token-classification": KeyMap(params("classifier", "out")),
    "question-answering": KeyMap(params("qa_outputs", "qa")),
    "multiple-choice": KeyMap(params("classifier", "out")),
    "fill-mask": KeyMap({
        **params("lm_head.dense", "dense"),
        **params("lm_head.layer_norm", "norm"),
        "lm_head.bias": "bias",
        "lm_head.decoder.bias": "decoder.bias",
        "lm_head.decoder.weight": "decoder.weight",
    }),
}


def roberta_family(model_type: str, class_prefix: str) -> Family:
    return Family(model_type=model_type, prefix="roberta", class_prefix=class_prefix,
                  config_from_hf=bert.bert_config, body_keys=bert.BODY_KEYS, head_keys=HEAD_KEYS,
                  body_builder=build_body, head_options=HEAD_OPTIONS, pooler=POOLER)


ROBERTA = roberta_family("roberta", "Roberta")
