"""RoBERTa: BERT whose position ids count from pad_token_id + 1, with its own classification and LM heads."""

from __future__ import annotations

from ..config import EncoderConfig
from ..heads import SequenceClassificationHead
from ..keymap import KeyMap, params
from ..nn import Encoder, EncoderBody, Pooler
from ..registry import Family, register
from . import bert


def build_body(c: EncoderConfig, task: str) -> EncoderBody:
    embeddings = bert.bert_embeddings(c, positions_offset_by_padding=True)
    encoder = Encoder([bert.bert_layer(c) for _ in range(c.num_hidden_layers)])
    return EncoderBody(embeddings, encoder, Pooler(c.hidden_size) if task == "base" else None)


def build_head(c: EncoderConfig, task: str):
    if task == "sequence-classification":  # dropout -> dense -> tanh -> dropout -> out_proj on <s>
        return SequenceClassificationHead(c.hidden_size, c.num_labels, c.classifier_dropout, dense_act="tanh",
                                          pre_dropout=c.classifier_dropout)
    return bert.build_head(c, task, mlm_act="gelu")  # RobertaLMHead uses exact gelu whatever hidden_act says


HEAD_KEYS = {
    "sequence-classification": KeyMap({**params("classifier.dense", "dense"), **params("classifier.out_proj", "out")}),
    "token-classification": KeyMap(params("classifier", "out")),
    "question-answering": KeyMap(params("qa_outputs", "qa")),
    "masked-lm": KeyMap({
        **params("lm_head.dense", "dense"),
        **params("lm_head.layer_norm", "norm"),
        "lm_head.bias": "bias",
        "lm_head.decoder.bias": "decoder.bias",
        "lm_head.decoder.weight": "decoder.weight",
    }),
}


def roberta_family(model_type: str, class_prefix: str) -> Family:
    return Family(model_type=model_type, prefix="roberta", architectures=bert.architectures(class_prefix),
                  config_from_hf=bert.bert_config, body_keys=bert.BODY_KEYS, head_keys=HEAD_KEYS,
                  build_body=build_body, build_head=build_head)


ROBERTA = register(roberta_family("roberta", "Roberta"))
