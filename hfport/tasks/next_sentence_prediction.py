"""next-sentence-prediction: whether the second segment of a pair follows the first (transformers'
*ForNextSentencePrediction, AutoModelForNextSentencePrediction): BERT's pre-training classifier alone, one linear
layer on the pooler output, two logits (0: it follows, 1: a random sentence). BERT is the one family hfport has with
such a class, so the record says `every_family=False`. A model-only head: no pipeline, no fine-tuning task.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from ..config import EncoderConfig
from ..heads import SequenceClassificationHead
from ..modeling import PreTrainedEncoder
from ..outputs import NextSentencePredictorOutput
from .task import Task


def next_sentence_head(c: EncoderConfig, *, dropout: float = 0.0) -> SequenceClassificationHead:
    """BertOnlyNSPHead: a linear layer to 2 outputs on the pooler output, no dropout."""
    return SequenceClassificationHead(c.hidden_size, 2, dropout)


class EncoderForNextSentencePrediction(PreTrainedEncoder):
    task = "next-sentence-prediction"
    head_factory = staticmethod(next_sentence_head)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None,
                position_ids: Tensor | None = None, labels: Tensor | None = None,
                encoder_outputs: tuple[Tensor, Tensor | None] | None = None) -> NextSentencePredictorOutput:
        """labels (B,): 0 where the second segment follows the first, 1 where it is a random one."""
        _, pooled = self._body(input_ids, attention_mask, token_type_ids, position_ids, encoder_outputs)
        logits = self.head(pooled)  # (B, 2)
        loss = F.cross_entropy(logits.view(-1, 2), labels.view(-1)) if labels is not None else None
        return NextSentencePredictorOutput(logits=logits, loss=loss)


TASK = Task(
    name="next-sentence-prediction", aliases=(), model_class=EncoderForNextSentencePrediction,
    outputs=("logits",), per_sequence=frozenset({"logits"}),  # (B, 2)
    auto_class="AutoModelForNextSentencePrediction", pipeline=None, train=None,
    pair_input=True,
    output_type=NextSentencePredictorOutput, architecture_suffix="ForNextSentencePrediction", peft_task_type=None,
    pooler=True, every_family=False)
