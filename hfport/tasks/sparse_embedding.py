"""sparse-embedding (SPLADE): a masked-LM model whose logits become one vocabulary-sized, mostly-zero vector per text,
as sentence-transformers' SparseEncoder (Transformer fill-mask -> SpladePooling) computes it:

    weights = log(1 + relu(logits))         (B, T, V); activation "log1p_relu" takes log(1 + .) once more
    vector  = max (or sum) of weights over the real tokens   (B, V)

The model is fill-mask's (EncoderForMaskedLM): a run's best/ and final/ are BertForMaskedLM-style folders in the
SparseEncoder layout (hfport/formats/sentence_transformers.py), which `hfport.pipeline("sparse-embedding")` pools as
the folder says. Training: (anchor, positive[, negative]) rows with sentence-transformers' SpladeLoss semantics
(hfport/train/tasks/sparse.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .fill_mask import EncoderForMaskedLM
from .task import Task

HEAD_TOKENS = 2048  # padded tokens per pass of the MLM head: bounds the (rows, T, V) logits (2048 x 30522 fp32: 250 MB)


def sparse_vectors(model: EncoderForMaskedLM, input_ids: Tensor, attention_mask: Tensor,
                   token_type_ids: Tensor | None = None, strategy: str = "max", activation: str = "relu",
                   head_tokens: int = HEAD_TOKENS) -> Tensor:
    """(B, T) inputs -> (B, V) SPLADE vectors: the encoder once, then the MLM head and the pooling over chunks of
    rows, so the vocabulary-sized logits of a large batch never exist at once (the values are the same)."""
    hidden, _ = model._body(input_ids, attention_mask, token_type_ids, None)  # (B, T, C)
    rows = max(1, head_tokens // max(1, hidden.shape[1]))
    parts = []
    for start in range(0, hidden.shape[0], rows):
        logits = model.head(hidden[start:start + rows], model.body.word_embeddings.weight)  # (b, T, V)
        parts.append(splade_pool(logits, attention_mask[start:start + rows], strategy, activation))  # (b, V)
    return torch.cat(parts)  # (B, V)


def splade_pool(logits: Tensor, attention_mask: Tensor, strategy: str = "max", activation: str = "relu") -> Tensor:
    """(B, T, V) MLM logits, (B, T) mask -> (B, V) SPLADE weights over the real tokens (SpladePooling's math).

    Max pooling takes the max of the logits first and transforms the (B, V) result: log1p and relu are monotone, so
    max_t f(x_t) = f(max_t x_t) and the (B, T, V) transform is never materialised. Padding is -inf before the max
    (relu sends it to 0, where sentence-transformers' multiply-by-mask sends it too); without gradients the logits are
    overwritten there (the caller's tensor: pass a copy to keep it)."""
    if strategy == "max":
        padding = ~attention_mask[..., None].bool()  # (B, T, 1)
        # in place where no gradient needs the logits (inference): no second (B, T, V) tensor
        masked = logits.masked_fill(padding, float("-inf")) if logits.requires_grad else \
            logits.masked_fill_(padding, float("-inf"))  # (B, T, V)
        pooled = masked.amax(dim=1)  # (B, V)
        return _activate(pooled, activation)  # (B, V)
    if strategy != "sum":
        raise ValueError(f"pooling_strategy={strategy!r}: use 'max' or 'sum'")
    weights = _activate(logits, activation) * attention_mask[..., None].to(logits.dtype)  # (B, T, V)
    return weights.sum(dim=1)  # (B, V)


def _activate(x: Tensor, activation: str) -> Tensor:
    if activation not in ("relu", "log1p_relu"):
        raise ValueError(f"activation_function={activation!r}: use 'relu' or 'log1p_relu'")
    out = torch.log1p(torch.relu(x))
    return torch.log1p(out) if activation == "log1p_relu" else out


TASK = Task(
    name="sparse-embedding", aliases=("splade", "sparse-embeddings"), model_class=EncoderForMaskedLM,
    outputs=("logits",), per_sequence=frozenset(), auto_class="AutoModelForMaskedLM",
    pipeline="hfport.pipelines.sparse_embedding:SparseEmbeddingPipeline",
    train="hfport.train.tasks.sparse:SparseEmbedding",
    # pairs/triplets are scored as retrieval by dot product of the sparse vectors
    default_metrics={None: ("ndcg@10", "max"), "pairs": ("ndcg@10", "max")},
    model_task="fill-mask")
