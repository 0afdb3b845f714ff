"""Model outputs, with transformers' field names. Attribute access, and `out["logits"]` as well."""

from __future__ import annotations

from dataclasses import dataclass, fields

from torch import Tensor


class _Output:
    def __getitem__(self, key: str) -> Tensor | None:
        return getattr(self, key)

    def keys(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]  # type: ignore[arg-type]


@dataclass
class BaseModelOutput(_Output):
    last_hidden_state: Tensor
    pooler_output: Tensor | None = None


@dataclass
class SequenceClassifierOutput(_Output):
    logits: Tensor
    loss: Tensor | None = None


@dataclass
class TokenClassifierOutput(_Output):
    logits: Tensor
    loss: Tensor | None = None


@dataclass
class QuestionAnsweringOutput(_Output):
    start_logits: Tensor
    end_logits: Tensor
    loss: Tensor | None = None


@dataclass
class MaskedLMOutput(_Output):
    logits: Tensor
    loss: Tensor | None = None


@dataclass
class MultipleChoiceModelOutput(_Output):
    logits: Tensor  # (B, C): one score per choice
    loss: Tensor | None = None


@dataclass
class PreTrainingOutput(_Output):
    """transformers' *ForPreTraining outputs, one record for the three: a family's fields are set, the others None
    (`keys()` lists the set ones, as transformers' output lists its own). BertForPreTrainingOutput: prediction_logits,
    seq_relationship_logits; AlbertForPreTrainingOutput: prediction_logits, sop_logits; ElectraForPreTrainingOutput:
    logits."""

    prediction_logits: Tensor | None = None  # (B, T, V): the masked-LM head's
    seq_relationship_logits: Tensor | None = None  # (B, 2): next-sentence prediction (BERT)
    sop_logits: Tensor | None = None  # (B, 2): sentence-order prediction (ALBERT)
    logits: Tensor | None = None  # (B, T): one replaced-token logit a token (ELECTRA's discriminator)
    loss: Tensor | None = None


@dataclass
class NextSentencePredictorOutput(_Output):
    logits: Tensor  # (B, 2): 0 the second sentence follows the first, 1 it is a random one
    loss: Tensor | None = None
