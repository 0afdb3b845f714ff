"""fill-mask: masked language modelling, the pre-training head (transformers' *ForMaskedLM)."""

from __future__ import annotations

from torch import Tensor

from ..config import EncoderConfig
from ..heads import MaskedLMHead, masked_lm_loss
from ..modeling import PreTrainedEncoder
from ..outputs import MaskedLMOutput
from .task import Columns, Task


def mlm_head(c: EncoderConfig, *, act: str | None = None, tied: bool | None = None, decoder_bias: bool = True,
             **biases: bool) -> MaskedLMHead:
    """BERT's head by default: the config's activation, decoder tied unless the config unties it, an untied
    decoder with its own bias. RoBERTa fixes the activation; DistilBERT's and DeBERTa's decoders use `bias`;
    ModernBERT turns biases off (`biases`: dense_bias, norm_bias, output_bias)."""
    return MaskedLMHead(c.hidden_size, c.embedding_size, c.vocab_size, act or c.hidden_act, c.layer_norm_eps,
                        tied=c.tie_word_embeddings if tied is None else tied, decoder_bias=decoder_bias, **biases)


class EncoderForMaskedLM(PreTrainedEncoder):
    task = "fill-mask"
    head_factory = staticmethod(mlm_head)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None,
                position_ids: Tensor | None = None, labels: Tensor | None = None,
                encoder_outputs: tuple[Tensor, Tensor | None] | None = None) -> MaskedLMOutput:
        hidden, _ = self._body(input_ids, attention_mask, token_type_ids, position_ids, encoder_outputs)
        logits = self.head(hidden, self.body.word_embeddings.weight)  # (B, T, V)
        loss = masked_lm_loss(logits, labels) if labels is not None else None
        return MaskedLMOutput(logits=logits, loss=loss)


TASK = Task(
    name="fill-mask", aliases=("masked-lm",), model_class=EncoderForMaskedLM, outputs=("logits",),
    per_sequence=frozenset(), auto_class="AutoModelForMaskedLM", pipeline="hfport.pipelines.fill_mask:FillMaskPipeline",
    train="hfport.train.tasks.mlm:MaskedLM", columns=(Columns(("text_column",), texts=("text_column",)),),
    files=".txt (a text a line)",
    default_metrics={None: ("perplexity", "min")}, masked_input=True,
    output_type=MaskedLMOutput, architecture_suffix="ForMaskedLM", graph_outputs={"logits": (3, "vocab_size")},
    agreement="top_k")
