"""The four task heads and their losses, as transformers defines them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .nn.activations import Activation


class SequenceClassificationHead(nn.Module):
    """[pre-dropout -> dense -> act] -> dropout -> out.

    BERT/ALBERT feed the pooler output straight to dropout -> out; RoBERTa, DistilBERT and DeBERTa put their
    own dense layer on the first token (`dense_act` names its activation)."""

    def __init__(self, hidden_size: int, num_labels: int, dropout: float, *, dense_act: str | None = None,
                 pre_dropout: float = 0.0, dense_size: int | None = None):
        super().__init__()
        dense_size = dense_size or hidden_size
        self.pre_dropout = nn.Dropout(pre_dropout)
        self.dense = nn.Linear(hidden_size, dense_size) if dense_act else None
        self.act = Activation(dense_act) if dense_act else None
        self.dropout = nn.Dropout(dropout)
        self.out = nn.Linear(dense_size if dense_act else hidden_size, num_labels)

    def forward(self, features: Tensor) -> Tensor:  # (B, C) -> (B, L)
        if self.dense is not None:
            features = self.act(self.dense(self.pre_dropout(features)))
        return self.out(self.dropout(features))


class TokenClassificationHead(nn.Module):
    def __init__(self, hidden_size: int, num_labels: int, dropout: float):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.out = nn.Linear(hidden_size, num_labels)

    def forward(self, hidden: Tensor) -> Tensor:  # (B, T, C) -> (B, T, L)
        return self.out(self.dropout(hidden))


class QuestionAnsweringHead(nn.Module):
    def __init__(self, hidden_size: int, dropout: float = 0.0):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.qa = nn.Linear(hidden_size, 2)

    def forward(self, hidden: Tensor) -> tuple[Tensor, Tensor]:  # (B, T, C) -> 2 x (B, T)
        start, end = self.qa(self.dropout(hidden)).split(1, dim=-1)
        return start.squeeze(-1).contiguous(), end.squeeze(-1).contiguous()


class MaskedLMHead(nn.Module):
    """dense -> act -> LayerNorm -> decoder. The decoder weight is the word embedding matrix unless the
    config unties it. Untied, BERT-style heads (`decoder_bias=True`) compute with the decoder's own bias and keep
    `bias` unused, exactly as transformers 5 does (and saves both); DistilBERT's decoder bias is `bias` itself."""

    def __init__(self, hidden_size: int, embedding_size: int, vocab_size: int, act: str, eps: float,
                 tied: bool = True, decoder_bias: bool = False):
        super().__init__()
        self.dense = nn.Linear(hidden_size, embedding_size)
        self.act = Activation(act)
        self.norm = nn.LayerNorm(embedding_size, eps=eps)
        self.decoder = None if tied else nn.Linear(embedding_size, vocab_size, bias=decoder_bias)
        self.bias = nn.Parameter(torch.zeros(vocab_size))

    def forward(self, hidden: Tensor, word_embeddings: Tensor) -> Tensor:  # (B, T, C) -> (B, T, V)
        x = self.norm(self.act(self.dense(hidden)))  # (B, T, E)
        if self.decoder is None:
            return F.linear(x, word_embeddings, self.bias)
        return F.linear(x, self.decoder.weight, self.decoder.bias if self.decoder.bias is not None else self.bias)


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
