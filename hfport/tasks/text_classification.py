"""text-classification: one label (or several, or a value) per sequence, from the first token or the pooler."""

from __future__ import annotations

from torch import Tensor

from ..config import EncoderConfig
from ..heads import SequenceClassificationHead, infer_problem_type, pool, sequence_classification_loss
from ..modeling import PreTrainedEncoder
from ..outputs import SequenceClassifierOutput
from .task import Columns, Task


def classification_head(c: EncoderConfig, *, dropout: float | None = None, dense_act: str | None = None,
                        pre_dropout: float = 0.0, dense_size: int | None = None, transform: dict | None = None,
                        pooling: str = "first") -> SequenceClassificationHead:
    """BERT's head by default (dropout -> out on the pooler output); a family's options add the dense layer
    RoBERTa, DistilBERT and DeBERTa put before it, or ModernBERT's prediction head (`transform`) and pooling."""
    return SequenceClassificationHead(c.hidden_size, c.num_labels, c.classifier_dropout if dropout is None else dropout,
                                      dense_act=dense_act, pre_dropout=pre_dropout, dense_size=dense_size,
                                      transform=transform, pooling=pooling)


class EncoderForSequenceClassification(PreTrainedEncoder):
    task = "text-classification"
    head_factory = staticmethod(classification_head)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None,
                position_ids: Tensor | None = None, labels: Tensor | None = None,
                encoder_outputs: tuple[Tensor, Tensor | None] | None = None) -> SequenceClassifierOutput:
        hidden, pooled = self._body(input_ids, attention_mask, token_type_ids, position_ids, encoder_outputs)
        if self.head.pooling == "late":  # EuroBERT: the head on every token, its logits averaged over real tokens
            logits = pool(self.head(hidden), attention_mask, "mean")  # (B, T, L) -> (B, L)
        else:
            if pooled is None:
                # "first": padding-free, padding positions hold zeros, so a left-padded sequence is read at its
                # first real token; padding_free=False reads position 0 as transformers does
                pooled = pool(hidden, attention_mask, self.head.pooling, first_real=self.padding_free)  # (B, C)
            logits = self.head(pooled)  # (B, L)
        loss = None
        if labels is not None:
            if self.config.problem_type is None:  # transformers records the inferred type in the config
                self.config.problem_type = infer_problem_type(self.config.num_labels, labels)
            loss = sequence_classification_loss(logits, labels, self.config.problem_type)
        return SequenceClassifierOutput(logits=logits, loss=loss)


TASK = Task(
    name="text-classification", aliases=("sequence-classification", "sentiment-analysis"),
    model_class=EncoderForSequenceClassification, outputs=("logits",), per_sequence=frozenset({"logits"}),  # (B, L)
    auto_class="AutoModelForSequenceClassification",
    pipeline="hfport.pipelines.classification:TextClassificationPipeline",
    train="hfport.train.tasks.classification:SequenceClassification",
    columns=(Columns(("text_column", "label_column", "text_pair_column"), texts=("text_column", "text_pair_column")),),
    default_metrics={None: ("accuracy", "max"), "single_label_classification": ("accuracy", "max"),
                     # subset accuracy is harsh with many labels; micro F1 credits each label that is right
                     "multi_label_classification": ("f1_micro", "max"),
                     "regression": ("mse", "min")},
    labels=True,
    output_type=SequenceClassifierOutput, architecture_suffix="ForSequenceClassification", peft_task_type="SEQ_CLS",
    graph_outputs={"logits": (2, "num_labels")}, agreement="labels", pooler=True)
