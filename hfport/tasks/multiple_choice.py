"""multiple-choice: one score per choice, the choices of a question ranked against each other (transformers'
*ForMultipleChoice, SWAG-style data).

Inputs carry a choice axis, (B, C, T): each row is the question (or context) paired with one choice. The rows
run through the encoder as B * C sequences and the family's sequence-classification path with one output, so
every family's head is its classifier's shape (BERT/ALBERT: pooler -> dropout -> out; RoBERTa: the same, without
its classifier's dense layer; DistilBERT: first token -> pre_classifier -> ReLU -> dropout -> out; DeBERTa:
ContextPooler -> dropout -> out; ModernBERT: prediction head on the first real token or the mean -> dropout ->
out). The logits are reshaped to (B, C) and the loss is the cross-entropy over the choices.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from ..config import EncoderConfig
from ..heads import SequenceClassificationHead, pool
from ..modeling import PreTrainedEncoder
from ..outputs import MultipleChoiceModelOutput
from .task import Columns, Task


def multiple_choice_head(c: EncoderConfig, *, dropout: float | None = None, dense_act: str | None = None,
                         pre_dropout: float = 0.0, dense_size: int | None = None, transform: dict | None = None,
                         pooling: str = "first", project: bool = True) -> SequenceClassificationHead:
    """BERT's head by default (dropout -> a one-output linear layer on the pooler output); a family's options add
    the layers its classifier puts before (as text-classification's head factory; `project`: see
    SequenceClassificationHead)."""
    return SequenceClassificationHead(c.hidden_size, 1, c.classifier_dropout if dropout is None else dropout,
                                      dense_act=dense_act, pre_dropout=pre_dropout, dense_size=dense_size,
                                      transform=transform, pooling=pooling, project=project)


def _flat(x: Tensor | None) -> Tensor | None:
    return None if x is None else x.reshape(-1, x.shape[-1])  # (B, C, T) -> (B * C, T)


class EncoderForMultipleChoice(PreTrainedEncoder):
    task = "multiple-choice"
    head_factory = staticmethod(multiple_choice_head)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None,
                position_ids: Tensor | None = None, labels: Tensor | None = None,
                encoder_outputs: tuple[Tensor, Tensor | None] | None = None) -> MultipleChoiceModelOutput:
        """input_ids (B, C, T): C choices per question; labels (B,): the index of the right choice; encoder_outputs:
        the body's (B * C, T, C) and (B * C, C) on the flattened choices, when already computed."""
        choices = input_ids.shape[1]
        mask = _flat(attention_mask)  # (B * C, T)
        hidden, pooled = self._body(_flat(input_ids), mask, _flat(token_type_ids), _flat(position_ids),
                                    encoder_outputs)
        if pooled is None:  # as text-classification: a left-padded row is read at its first real token
            pooled = pool(hidden, mask, self.head.pooling, first_real=self.padding_free)  # (B * C, H)
        logits = self.head(pooled).view(-1, choices)  # (B * C, 1) -> (B, C)
        loss = F.cross_entropy(logits, labels.view(-1)) if labels is not None else None
        return MultipleChoiceModelOutput(logits=logits, loss=loss)


TASK = Task(
    name="multiple-choice", aliases=(), model_class=EncoderForMultipleChoice,
    outputs=("logits",), per_sequence=frozenset({"logits"}),  # (B, C)
    auto_class="AutoModelForMultipleChoice",
    pipeline="hfport.pipelines.multiple_choice:MultipleChoicePipeline",
    train="hfport.train.tasks.multiple_choice:MultipleChoice",
    # the choices: a list, or in a CSV cell the list's JSON text
    columns=(Columns(("context_column", "choices_column", "label_column"), texts=("context_column",)),
             Columns(("question_column", "choices_column", "label_column"), texts=("question_column",))),
    default_metrics={None: ("accuracy", "max")},
    choice_axis=True,
    # PEFT has no multiple-choice task type: an adapter's task_type is null and config.json's architectures
    # name the head. No ONNX graph: its inputs would need the choice axis (graph_outputs empty: export refuses).
    output_type=MultipleChoiceModelOutput, architecture_suffix="ForMultipleChoice", peft_task_type=None,
    pooler=True)
