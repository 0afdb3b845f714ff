"""question-answering: extractive QA, a start and an end logit per token."""

from __future__ import annotations

import torch
from torch import Tensor

from ..config import EncoderConfig
from ..heads import QuestionAnsweringHead, question_answering_loss
from ..modeling import PreTrainedEncoder
from ..outputs import QuestionAnsweringOutput
from .task import Columns, Task


def qa_head(c: EncoderConfig, *, dropout: float = 0.0, transform: dict | None = None) -> QuestionAnsweringHead:
    """dropout -> qa; `transform`: a prediction head before (ModernBERT)."""
    return QuestionAnsweringHead(c.hidden_size, dropout, transform)


class EncoderForQuestionAnswering(PreTrainedEncoder):
    task = "question-answering"
    head_factory = staticmethod(qa_head)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None,
                position_ids: Tensor | None = None, start_positions: Tensor | None = None,
                end_positions: Tensor | None = None, encoder_outputs: tuple[Tensor, Tensor | None] | None = None
                ) -> QuestionAnsweringOutput:
        hidden, _ = self._body(input_ids, attention_mask, token_type_ids, position_ids, encoder_outputs)
        start, end = self.head(hidden)  # (B, T) each
        # Padding-free (the default), an answer never starts or ends on padding: those logits go to the dtype's
        # minimum. padding_free=False computes padding positions as transformers does and leaves their logits
        # as they come, as transformers does (its logits and loss then match at every position).
        if attention_mask is not None and self.padding_free:
            padding = ~attention_mask.bool()  # (B, T)
            start = start.masked_fill(padding, torch.finfo(start.dtype).min)
            end = end.masked_fill(padding, torch.finfo(end.dtype).min)
        loss = None
        if start_positions is not None and end_positions is not None:
            loss = question_answering_loss(start, end, start_positions, end_positions)
        return QuestionAnsweringOutput(start_logits=start, end_logits=end, loss=loss)


TASK = Task(
    name="question-answering", aliases=(), model_class=EncoderForQuestionAnswering,
    outputs=("start_logits", "end_logits"), per_sequence=frozenset(), auto_class="AutoModelForQuestionAnswering",
    pipeline="hfport.pipelines.qa:QuestionAnsweringPipeline", train="hfport.train.tasks.qa:QuestionAnswering",
    columns=(Columns(("question_column", "context_column", "answers_column"),
                     texts=("question_column", "context_column")),), files="SQuAD JSON (.json)",
    default_metrics={None: ("f1", "max")},  # SQuAD token F1
    pair_input=True,
    output_type=QuestionAnsweringOutput, architecture_suffix="ForQuestionAnswering", peft_task_type="QUESTION_ANS",
    graph_outputs={"start_logits": (2, None), "end_logits": (2, None)}, agreement="spans")
