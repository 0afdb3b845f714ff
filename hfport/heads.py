"""The task heads and their losses, as transformers defines them."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .nn.activations import Activation
from .nn.dropout import Dropout


class PredictionHead(nn.Module):
    """dense -> act -> LayerNorm, each bias optional: ModernBERT's prediction head, which its classification, token,
    QA and MLM heads all put on the encoder output. Given to a head as `transform=dict(act=, eps=, ...)`."""

    def __init__(self, hidden_size: int, act: str, eps: float, dense_bias: bool = True, norm_bias: bool = True):
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size, bias=dense_bias)
        self.act = Activation(act)
        self.norm = nn.LayerNorm(hidden_size, eps=eps, bias=norm_bias)

    def forward(self, x: Tensor) -> Tensor:  # (.., C) -> (.., C)
        return self.norm(self.act(self.dense(x)))


def _transform(hidden_size: int, transform: dict | None) -> PredictionHead | None:
    return PredictionHead(hidden_size, **transform) if transform is not None else None


# the sequence classifier's features: the first token's state, the real tokens' mean, or the last real token's state
# (ELECTRA's multiple-choice summary_type "last"); "late" (EuroBERT) runs the head on every token and averages its
# logits over the real tokens
POOLINGS = ("first", "mean", "lasttoken", "late")
# sentence-transformers' Pooling modes (hfport's names; formats/sentence_transformers.py maps theirs): what a sentence
# embedding can be pooled by. "cls" is "first".
SENTENCE_POOLINGS = ("mean", "cls", "max", "mean_sqrt_len", "lasttoken")


def pool(hidden: Tensor, attention_mask: Tensor | None, how: str, first_real: bool = False) -> Tensor:
    """The library's one pooling: (B, T, C) -> (B, C), over the real positions (all when there is no mask), as
    transformers' heads and sentence-transformers' Pooling compute it.

    first | cls      position 0, or with first_real each sequence's first real token (left padding)
    mean             the real tokens' mean
    max              the real tokens' maximum (padding set to -1e9 first, as sentence-transformers does)
    mean_sqrt_len    the real tokens' sum over sqrt(their count)
    lasttoken        each sequence's last real token"""
    if how in ("first", "cls"):
        if first_real and attention_mask is not None:
            first = attention_mask.int().argmax(dim=1)  # (B,)
            return hidden[torch.arange(hidden.shape[0], device=hidden.device), first]  # (B, C)
        return hidden[:, 0]  # (B, C)
    if how == "lasttoken":
        if attention_mask is None:
            return hidden[:, -1]  # (B, C)
        last = hidden.shape[1] - 1 - attention_mask.flip(1).int().argmax(dim=1)  # (B,)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]  # (B, C)
    if how not in ("mean", "max", "mean_sqrt_len"):
        raise ValueError(f"pooling={how!r}: use one of {list(SENTENCE_POOLINGS)} (or 'first' for 'cls')")
    if attention_mask is None:
        if how == "max":
            return hidden.max(dim=1).values  # (B, C)
        if how == "mean":
            return hidden.mean(dim=1)  # (B, C)
        return hidden.sum(dim=1) / math.sqrt(hidden.shape[1])  # (B, C)
    mask = attention_mask.to(hidden.dtype)[..., None]  # (B, T, 1)
    if how == "max":
        return hidden.masked_fill(mask == 0, -1e9).max(dim=1).values  # (B, C)
    counts = mask.sum(dim=1).clamp(min=1e-9)  # (B, 1)
    summed = (hidden * mask).sum(dim=1)  # (B, C)
    return summed / counts if how == "mean" else summed / counts.sqrt()  # (B, C)


class SequenceClassificationHead(nn.Module):
    """[pre-dropout -> dense -> act] [-> transform] -> dropout -> out, on the pooled features.

    BERT/ALBERT feed the pooler output straight to dropout -> out; RoBERTa, DistilBERT and DeBERTa put their
    own dense layer on the first token (`dense_act` names its activation); ModernBERT its prediction head
    (`transform`) on the first token or the mean of the real tokens (`pooling`). `project=False` keeps
    pre-dropout -> act without the dense layer (ELECTRA's sequence summary with summary_use_proj false)."""

    def __init__(self, hidden_size: int, num_labels: int, dropout: float, *, dense_act: str | None = None,
                 pre_dropout: float = 0.0, dense_size: int | None = None, transform: dict | None = None,
                 pooling: str = "first", project: bool = True):
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"pooling {pooling!r} is not one of {list(POOLINGS)}")
        dense_size = dense_size or hidden_size
        self.pooling = pooling
        self.pre_dropout = Dropout(pre_dropout)
        self.dense = nn.Linear(hidden_size, dense_size) if dense_act and project else None
        self.act = Activation(dense_act) if dense_act else None
        self.transform = _transform(hidden_size, transform)
        self.dropout = Dropout(dropout)
        self.out = nn.Linear(dense_size if self.dense is not None else hidden_size, num_labels)

    def forward(self, features: Tensor) -> Tensor:  # (B, C) -> (B, L)
        if self.act is not None:
            features = self.pre_dropout(features)
            if self.dense is not None:
                features = self.dense(features)  # (B, C) -> (B, dense_size)
            features = self.act(features)
        if self.transform is not None:
            features = self.transform(features)
        return self.out(self.dropout(features))


class TokenClassificationHead(nn.Module):
    """[transform ->] dropout -> out."""

    def __init__(self, hidden_size: int, num_labels: int, dropout: float, transform: dict | None = None):
        super().__init__()
        self.transform = _transform(hidden_size, transform)
        self.dropout = Dropout(dropout)
        self.out = nn.Linear(hidden_size, num_labels)

    def forward(self, hidden: Tensor) -> Tensor:  # (B, T, C) -> (B, T, L)
        if self.transform is not None:
            hidden = self.transform(hidden)
        return self.out(self.dropout(hidden))


class QuestionAnsweringHead(nn.Module):
    """[transform ->] dropout -> qa (2 outputs: start, end)."""

    def __init__(self, hidden_size: int, dropout: float = 0.0, transform: dict | None = None):
        super().__init__()
        self.transform = _transform(hidden_size, transform)
        self.dropout = Dropout(dropout)
        self.qa = nn.Linear(hidden_size, 2)

    def forward(self, hidden: Tensor) -> tuple[Tensor, Tensor]:  # (B, T, C) -> 2 x (B, T)
        if self.transform is not None:
            hidden = self.transform(hidden)
        start, end = self.qa(self.dropout(hidden)).split(1, dim=-1)
        return start.squeeze(-1).contiguous(), end.squeeze(-1).contiguous()


class MaskedLMHead(nn.Module):
    """dense -> act -> LayerNorm -> decoder. The decoder weight is the word embedding matrix unless the
    config unties it. Untied, BERT-style heads (`decoder_bias=True`) compute with the decoder's own bias and keep
    `bias` unused, exactly as transformers 5 does (and saves both); DistilBERT's decoder bias is `bias` itself.
    ModernBERT switches biases off: `dense_bias`, `norm_bias`, and `output_bias` (no logits bias at all)."""

    def __init__(self, hidden_size: int, embedding_size: int, vocab_size: int, act: str, eps: float,
                 tied: bool = True, decoder_bias: bool = False, *, dense_bias: bool = True, norm_bias: bool = True,
                 output_bias: bool = True, transform: bool = True):
        super().__init__()
        # transform False: the decoder reads the encoder output directly (EuroBERT's lm_head is one linear layer)
        self.dense = nn.Linear(hidden_size, embedding_size, bias=dense_bias) if transform else nn.Identity()
        self.act = Activation(act) if transform else nn.Identity()
        self.norm = nn.LayerNorm(embedding_size, eps=eps, bias=norm_bias) if transform else nn.Identity()
        self.decoder = None if tied else nn.Linear(embedding_size, vocab_size, bias=decoder_bias)
        self.bias = nn.Parameter(torch.zeros(vocab_size)) if output_bias else None

    def forward(self, hidden: Tensor, word_embeddings: Tensor) -> Tensor:  # (B, T, C) -> (B, T, V)
        weight, bias = self.output_layer(word_embeddings)  # (V, E), (V,) | None
        return F.linear(self.decoder_input(hidden), weight, bias)

    # not `transform`: other heads' `transform` is a submodule (ModernBERT's init reads head.transform.dense)
    def decoder_input(self, hidden: Tensor) -> Tensor:  # (..., C) -> (..., E): what the decoder reads
        return self.norm(self.act(self.dense(hidden)))

    def output_layer(self, word_embeddings: Tensor) -> tuple[Tensor, Tensor | None]:
        """The decoder's (V, E) weight and (V,) bias (None: no logits bias), tied or not: for callers that run the
        decoder in parts (sparse-embedding's pooled decoder)."""
        if self.decoder is None:
            return word_embeddings, self.bias
        return self.decoder.weight, self.decoder.bias if self.decoder.bias is not None else self.bias


class PreTrainingHeads(nn.Module):
    """transformers' BertPreTrainingHeads and AlbertForPreTraining's two heads: the masked-LM head on every token and
    a classifier of the sentence pair on the pooler output, BERT's next-sentence prediction (a linear layer) or
    ALBERT's sentence-order prediction (dropout -> linear). `pair_output` and `pair_label` are the names transformers
    gives that classifier's logits and labels (seq_relationship_logits / next_sentence_label, sop_logits /
    sentence_order_label)."""

    def __init__(self, mlm: MaskedLMHead, pair: SequenceClassificationHead, pair_output: str, pair_label: str):
        super().__init__()
        self.mlm = mlm
        self.pair = pair
        self.pair_output = pair_output
        self.pair_label: str | None = pair_label

    def forward(self, hidden: Tensor, pooled: Tensor, word_embeddings: Tensor) -> dict[str, Tensor]:
        """(B, T, C), (B, C) -> {"prediction_logits": (B, T, V), pair_output: (B, 2)}"""
        return {"prediction_logits": self.mlm(hidden, word_embeddings), self.pair_output: self.pair(pooled)}

    def loss(self, logits: dict[str, Tensor], labels: Tensor | None, pair_label: Tensor | None,
             attention_mask: Tensor | None) -> Tensor | None:
        """transformers' sum of the masked-LM loss and the pair's cross-entropy, computed only when both labels are
        given (one alone gives no loss there either)."""
        if labels is None or pair_label is None:
            return None
        pair = logits[self.pair_output]  # (B, 2)
        return masked_lm_loss(logits["prediction_logits"], labels) + F.cross_entropy(pair.view(-1, 2),
                                                                                     pair_label.view(-1))


class ReplacedTokenHead(nn.Module):
    """ELECTRA's discriminator (transformers' ElectraDiscriminatorPredictions): dense -> act -> one logit a token,
    positive where the token was replaced by the generator's."""

    pair_label: str | None = None  # no sentence-pair objective

    def __init__(self, hidden_size: int, act: str):
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.act = Activation(act)
        self.out = nn.Linear(hidden_size, 1)

    def forward(self, hidden: Tensor, pooled: Tensor | None, word_embeddings: Tensor) -> dict[str, Tensor]:
        """(B, T, C) -> {"logits": (B, T)}"""
        return {"logits": self.out(self.act(self.dense(hidden))).squeeze(-1)}

    def loss(self, logits: dict[str, Tensor], labels: Tensor | None, pair_label: Tensor | None,
             attention_mask: Tensor | None) -> Tensor | None:
        return replaced_token_loss(logits["logits"], labels, attention_mask) if labels is not None else None


# --- losses -------------------------------------------------------------------------------------------------


def infer_problem_type(num_labels: int, labels: Tensor) -> str:
    """transformers' rule when config.problem_type is unset."""
    if num_labels == 1:
        return "regression"
    if labels.dtype in (torch.long, torch.int):
        return "single_label_classification"
    return "multi_label_classification"


def sequence_classification_loss(logits: Tensor, labels: Tensor, problem_type: str) -> Tensor:
    num_labels = logits.shape[-1]
    if problem_type == "regression":
        if num_labels == 1:
            return F.mse_loss(logits.squeeze(), labels.squeeze().to(logits.dtype))
        return F.mse_loss(logits, labels.to(logits.dtype))
    if problem_type == "single_label_classification":
        return F.cross_entropy(logits.view(-1, num_labels), labels.view(-1))
    return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))


def token_classification_loss(logits: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)


def masked_lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)


def question_answering_loss(start_logits: Tensor, end_logits: Tensor, start_positions: Tensor,
                            end_positions: Tensor) -> Tensor:
    """Mean of start and end cross-entropy; positions outside the input are clamped to an ignored index."""
    if start_positions.dim() > 1:
        start_positions = start_positions.squeeze(-1)
    if end_positions.dim() > 1:
        end_positions = end_positions.squeeze(-1)
    ignored = start_logits.shape[1]
    start_positions = start_positions.clamp(0, ignored)
    end_positions = end_positions.clamp(0, ignored)
    start_loss = F.cross_entropy(start_logits, start_positions, ignore_index=ignored)
    end_loss = F.cross_entropy(end_logits, end_positions, ignore_index=ignored)
    return (start_loss + end_loss) / 2


def replaced_token_loss(logits: Tensor, labels: Tensor, attention_mask: Tensor | None) -> Tensor:
    """ElectraForPreTraining's: binary cross-entropy over the real tokens (every token without a mask); labels 1
    where a token was replaced."""
    if attention_mask is None:
        return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))
    real = attention_mask.view(-1, logits.shape[1]) == 1  # (B, T)
    return F.binary_cross_entropy_with_logits(logits[real], labels[real].to(logits.dtype))  # over (N,) real tokens
