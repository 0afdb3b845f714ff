"""feature-extraction: the bare encoder (transformers' AutoModel); no head."""

from __future__ import annotations

from torch import Tensor

from ..config import EncoderConfig
from ..modeling import PreTrainedEncoder
from ..outputs import BaseModelOutput
from .task import Task


class EncoderModel(PreTrainedEncoder):
    task = "feature-extraction"

    @staticmethod
    def head_factory(config: EncoderConfig) -> None:
        return None

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, token_type_ids: Tensor | None = None,
                position_ids: Tensor | None = None, encoder_outputs: tuple[Tensor, Tensor | None] | None = None) -> BaseModelOutput:
        hidden, pooled = self._body(input_ids, attention_mask, token_type_ids, position_ids, encoder_outputs)
        return BaseModelOutput(last_hidden_state=hidden, pooler_output=pooled)


TASK = Task(
    name="feature-extraction", aliases=("base",), model_class=EncoderModel,
    outputs=("last_hidden_state", "pooler_output"), per_sequence=frozenset({"pooler_output"}),  # (B, C)
    auto_class="AutoModel", pipeline="hfport.pipelines.features:FeatureExtractionPipeline", train=None,
    output_type=BaseModelOutput, architecture_suffix="Model", peft_task_type="FEATURE_EXTRACTION",
    # pooler_output is not exported: optimum's feature-extraction graphs return last_hidden_state alone, and
    # sentence embeddings pool it
    graph_outputs={"last_hidden_state": (3, "hidden_size")}, agreement="cosine", pooler=True)
