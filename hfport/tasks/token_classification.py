"""token-classification: one label per token (NER, POS...)."""

from __future__ import annotations

from torch import Tensor

from ..config import EncoderConfig
from ..heads import TokenClassificationHead, token_classification_loss
from ..modeling import PreTrainedEncoder
from ..outputs import TokenClassifierOutput
from .task import Columns, Task


def token_head(c: EncoderConfig, *, dropout: float | None = None, transform: dict | None = None
               ) -> TokenClassificationHead:
    """dropout -> out; `transform`: a prediction head before (ModernBERT)."""
    return TokenClassificationHead(c.hidden_size, c.num_labels, c.classifier_dropout if dropout is None else dropout,
                                   transform)


class EncoderForTokenClassification(PreTrainedEncoder):
    task = "token-classification"
    head_factory = staticmethod(token_head)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None,
                position_ids: Tensor | None = None, labels: Tensor | None = None,
                encoder_outputs: tuple[Tensor, Tensor | None] | None = None) -> TokenClassifierOutput:
        hidden, _ = self._body(input_ids, attention_mask, token_type_ids, position_ids, encoder_outputs)
        logits = self.head(hidden)  # (B, T, L)
        loss = token_classification_loss(logits, labels) if labels is not None else None
        return TokenClassifierOutput(logits=logits, loss=loss)


TASK = Task(
    name="token-classification", aliases=("ner",), model_class=EncoderForTokenClassification, outputs=("logits",),
    per_sequence=frozenset(), auto_class="AutoModelForTokenClassification",
    pipeline="hfport.pipelines.tokens:TokenClassificationPipeline",
    train="hfport.train.tasks.tokens:TokenClassification",
    columns=(Columns(("tokens_column", "tags_column"), lists=("tokens_column", "tags_column")),),
    files="CoNLL (.conll, .txt: a word and its tag a line)",
    default_metrics={None: ("f1", "max")},  # entity-level micro F1
    labels=True,
    output_type=TokenClassifierOutput, architecture_suffix="ForTokenClassification", peft_task_type="TOKEN_CLS",
    graph_outputs={"logits": (3, "num_labels")}, agreement="tags")
