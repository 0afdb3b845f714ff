"""pretraining: the heads a checkpoint was pre-trained with (transformers' *ForPreTraining, AutoModelForPreTraining).

BERT: masked LM + next-sentence prediction (BertForPreTraining); ALBERT: masked LM + sentence-order prediction
(AlbertForPreTraining); ELECTRA: the discriminator's replaced-token detection, one logit a token (ElectraForPreTraining,
the head people run as is to find replaced or out-of-place tokens). Other families have no such class in transformers
(its AutoModelForPreTraining gives their *ForMaskedLM: hfport's AutoModelForMaskedLM), so the record says
`every_family=False` and only the families that map this head's keys build it. A model-only head: no pipeline, no
fine-tuning task.
"""

from __future__ import annotations

from torch import Tensor, nn

from ..config import EncoderConfig
from ..heads import PreTrainingHeads, ReplacedTokenHead, SequenceClassificationHead
from ..modeling import PreTrainedEncoder
from ..outputs import PreTrainingOutput
from .fill_mask import mlm_head
from .task import Task

PAIR_LABELS = ("next_sentence_label", "sentence_order_label")  # the forward's sentence-pair label arguments


def pretraining_head(c: EncoderConfig, *, replaced_tokens: bool = False, mlm: dict | None = None,
                     pair_dropout: float = 0.0, pair_labels: int = 2, pair_output: str = "seq_relationship_logits",
                     pair_label: str = "next_sentence_label") -> nn.Module:
    """BERT's heads by default: the masked-LM head (`mlm`: fill-mask's head options) and next-sentence prediction,
    one linear layer on the pooler output. ALBERT's options give its sentence-order prediction (dropout first,
    config.num_labels outputs, named sop_logits / sentence_order_label); ELECTRA's `replaced_tokens` its discriminator
    instead of both."""
    if replaced_tokens:
        return ReplacedTokenHead(c.hidden_size, c.hidden_act)
    if pair_label not in PAIR_LABELS:
        raise ValueError(f"pair_label {pair_label!r} is not one of {list(PAIR_LABELS)}")
    pair = SequenceClassificationHead(c.hidden_size, pair_labels, pair_dropout)
    return PreTrainingHeads(mlm_head(c, **(mlm or {})), pair, pair_output, pair_label)


class EncoderForPreTraining(PreTrainedEncoder):
    task = "pretraining"
    head_factory = staticmethod(pretraining_head)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None,
                position_ids: Tensor | None = None, labels: Tensor | None = None,
                next_sentence_label: Tensor | None = None, sentence_order_label: Tensor | None = None,
                encoder_outputs: tuple[Tensor, Tensor | None] | None = None) -> PreTrainingOutput:
        """labels (B, T): BERT's and ALBERT's masked-LM targets (-100: not scored), ELECTRA's 1 where a token was
        replaced; next_sentence_label (BERT) or sentence_order_label (ALBERT), (B,): the pair's class. The loss is
        transformers': the masked-LM and pair losses summed when both labels are given (BERT, ALBERT), the binary
        cross-entropy over the real tokens (ELECTRA)."""
        given = {"next_sentence_label": next_sentence_label, "sentence_order_label": sentence_order_label}
        wrong = [name for name, value in given.items() if value is not None and name != self.head.pair_label]
        if wrong:
            takes = self.head.pair_label or "no sentence-pair label"
            raise ValueError(f"{self.family.architectures[self.task]} takes {takes}, not {wrong[0]}")
        hidden, pooled = self._body(input_ids, attention_mask, token_type_ids, position_ids, encoder_outputs)
        logits = self.head(hidden, pooled, self.body.word_embeddings.weight)  # {transformers' output name: logits}
        loss = self.head.loss(logits, labels, given.get(self.head.pair_label), attention_mask)
        return PreTrainingOutput(**logits, loss=loss)


TASK = Task(
    name="pretraining", aliases=(), model_class=EncoderForPreTraining,
    # every family's fields: a field neither side returns is skipped where outputs are compared (export/checks.py)
    outputs=("prediction_logits", "seq_relationship_logits", "sop_logits", "logits"),
    per_sequence=frozenset({"seq_relationship_logits", "sop_logits"}),  # (B, 2)
    auto_class="AutoModelForPreTraining", pipeline=None, train=None,
    pair_input=True,  # next-sentence and sentence-order prediction read a pair of segments
    # PEFT has no task type for it; no ONNX graph (graph_outputs empty: export refuses)
    output_type=PreTrainingOutput, architecture_suffix="ForPreTraining", peft_task_type=None,
    pooler=True, every_family=False)
