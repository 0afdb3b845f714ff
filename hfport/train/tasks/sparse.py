"""Sparse embeddings (SPLADE): a masked-LM model + SpladePooling, trained on the sentence-embedding pair/triplet data
(embedding.py reads and collates it) with sentence-transformers' SpladeLoss:

    loss = SparseMultipleNegativesRankingLoss   in-batch ranking of the dot products of the sparse vectors (scale 1)
         + query_regularizer_weight    * FLOPS(queries)      FLOPS(X) = sum over the vocabulary of (mean_rows X)^2
         + document_regularizer_weight * FLOPS(documents)    documents: every example's positive and negatives

The regularizers push weights to zero across the batch, so the vectors stay sparse. Evaluation ranks the eval file's
corpus by dot product (ndcg@10, mrr@10, recall@k) and reports the average nonzeros of the query and corpus vectors
(query_active_dims, corpus_active_dims, as sentence-transformers' SparseInformationRetrievalEvaluator names them).
best/ and final/ are BertForMaskedLM-style folders in the SparseEncoder layout.

Several processes: as sentence-embedding (embedding.py), each scores its own share of the global batch, its
regularizers over its own texts, unless gather_across_devices is on; then every process's vectors are gathered
(embedding.gather_batch: gradients flow back to the process that computed them, a text repeated across processes is
one candidate) and each anchor is ranked against the whole global micro-batch, and the FLOPS regularizers average
over the global batch's queries and documents too: equal to one process with the global batch (tested in fp32).
sentence-transformers differs there: its SpladeLoss regularizes the embeddings before its ranking loss gathers them,
so each process's FLOPS is over its own share and DDP averages those; the mean of squared local means is not the
squared global mean, so its regularizer's strength changes with the number of processes. We follow one process.

Memory of the gather: every process holds the global micro-batch's (U_total, V) fp32 vectors, a second copy while
all_gather's buffers are cut back, and in the backward pass their gradient and its all-reduced copy: ~4 x U_total x V
x 4 bytes at peak. 8 processes x 32 triplets (96 texts each, 768 in all) x 30522: 94 MB a copy, ~0.4 GB at peak; the
logits each process computes anyway, (U, T, V) fp32, are T times one copy of its own share (96 x 256 tokens: 3 GB).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ... import hub
from ...errors import ConfigError
from ...formats.sentence_transformers import has_sparse_layout, read_sparse_layout, write_sparse_layout
from ...tasks.sparse_embedding import splade_pool
from ..data import EncodedData
from ..metrics import retrieval as metrics
from .embedding import SentenceEmbedding, gathered, mnrl_loss, retrieval_sets

SPARSE_SCALE = 1.0  # SparseMultipleNegativesRankingLoss's default: dot products of sparse vectors are not bounded


def dot_matrix(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(N, V), (M, V) -> (N, M) dot products (sentence-transformers' dot_score)."""
    return a @ b.T


def flops(vectors: torch.Tensor) -> torch.Tensor:
    """FlopsLoss: (N, V) -> () the sum over the vocabulary of each weight's squared mean over the rows."""
    return torch.sum(torch.mean(vectors, dim=0) ** 2)


def splade_loss(vectors: torch.Tensor, index: torch.Tensor, scale: float, query_weight: float,
                document_weight: float, own: slice = slice(None)) -> torch.Tensor:
    """SpladeLoss(SparseMultipleNegativesRankingLoss) over a batch of distinct texts.

    vectors (U, V): one sparse vector per distinct text; index (B, K) as in mnrl_loss (anchor, positive, negatives;
    -1 where an example has fewer). The regularizers see each example's texts as sentence-transformers' columns do:
    the B anchors, and the positives and negatives of every example (a text repeated across examples counts again).
    `own`: the examples whose anchors this call ranks (a process's share of a gathered global batch); the
    regularizers are over every example of `index`, the same value on every process."""
    ranking = mnrl_loss(vectors, index, scale, own, similarity=dot_matrix)
    documents = index[:, 1:]  # (B, K-1)
    queries = vectors[index[:, 0]]  # (B, V)
    return ranking + query_weight * flops(queries) + document_weight * flops(vectors[documents[documents >= 0]])


def densify(parts: list[tuple[np.ndarray, np.ndarray, int]]) -> np.ndarray:
    """[(indices, values, width)] -> (N, width) float64 rows."""
    out = np.zeros((len(parts), parts[0][2]))  # (N, V)
    for row, (indices, values, _) in enumerate(parts):
        out[row, indices] = values
    return out


class SparseEmbedding(SentenceEmbedding):
    name = "sparse-embedding"
    default_scale = SPARSE_SCALE
    distillable = False  # sentence-embedding's teacher hooks are for dense vectors

    def read(self, config: Any, tokenizer: Any, model_id2label: dict[int, str] | None) -> EncodedData:
        given = {name: getattr(config, name) for name in ("pooling", "normalize", "matryoshka_dims")
                 if getattr(config, name) not in (None, False)}
        if given:
            raise ConfigError(f"{sorted(given)}: sentence-embedding options; sparse-embedding pools as SpladePooling "
                              "(the base model's 1_SpladePooling config, else max over log(1 + relu(logits)))")
        if config.loss not in (None, "mnrl"):
            raise ConfigError(f"loss {config.loss!r}: sparse-embedding trains with SpladeLoss, whose ranking loss is "
                              "mnrl's (in-batch negatives); leave loss unset or mnrl")
        data = super().read(config, tokenizer, model_id2label)
        if data.problem_type != "pairs":
            raise ConfigError(f"{config.train}: {data.problem_type} rows; sparse-embedding trains on (anchor, "
                              "positive[, negative]) rows with SpladeLoss")
        source = hub.resolve(config.model)
        layout = read_sparse_layout(source) if has_sparse_layout(source) else None
        data.extra |= {"strategy": layout.pooling_strategy if layout else "max",
                       "activation": layout.activation if layout else "relu",
                       "query_weight": config.query_regularizer_weight,
                       "document_weight": config.document_regularizer_weight}
        return data

    def embed(self, model: Any, data: EncodedData, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """(n, T) inputs -> (n, V) SPLADE vectors (through the model's forward, so a wrapped model's hooks run)."""
        logits = model(**inputs).logits  # (n, T, V)
        return splade_pool(logits.float(), inputs["attention_mask"], data.extra["strategy"], data.extra["activation"])

    def write_model_files(self, folder: Path, data: EncodedData) -> None:
        """best/ and final/ in the SparseEncoder layout, pooled as the run trained."""
        write_sparse_layout(folder, max_seq_length=data.extra["max_length"], pooling_strategy=data.extra["strategy"],
                            activation=data.extra["activation"])

    def loss(self, outputs: Any, batch: dict[str, torch.Tensor], data: EncodedData, class_weights: Any,
             label_smoothing: float) -> torch.Tensor:
        vectors, index, own = gathered(outputs.float(), batch, data)  # (U, V) or with gather (U_total, V)
        return splade_loss(vectors, index, data.extra["scale"], data.extra["query_weight"],
                           data.extra["document_weight"], own)

    def eval_rows(self, outputs: Any, batch: dict[str, torch.Tensor], items: list[Any],
                  data: EncodedData) -> list[Any]:
        """(text ids, each text's nonzeros as (indices, values), score, source) per example: a vocabulary-sized
        vector is mostly zeros, and rows are kept (and gathered across processes) until the metrics."""
        vectors = outputs.float().cpu()  # (U, V)
        index = batch["labels"].cpu()  # (B, K)
        width = vectors.shape[1]
        out = []
        for b, x in enumerate(items):
            texts = []
            for row in index[b, :len(x.meta["ids"])].tolist():
                nonzero = vectors[row].nonzero().squeeze(-1)  # (N,)
                texts.append((nonzero.numpy(), vectors[row, nonzero].numpy(), width))
            out.append((x.meta["ids"], texts, x.target, x.source))
        return out

    def sample_rows(self, data: EncodedData) -> list[Any]:
        one = (np.array([0]), np.array([1.0]), 2)  # a text's nonzeros (indices, values) and the vector's width
        return [((0, 1), [one, one], 0.0, ("sample", 1))]

    def metrics(self, rows: list[Any], data: EncodedData, id2label: dict[int, str]) -> dict[str, float]:
        """Retrieval by dot product over the eval file (embedding.retrieval_sets), and the average nonzeros."""
        query_parts, corpus_parts, relevant, names = retrieval_sets(rows)
        queries, corpus = densify(query_parts), densify(corpus_parts)  # (Q, V), (D, V): the distinct texts only
        scores = queries @ corpus.T  # (Q, D)
        gains = [np.isin(np.arange(len(corpus)), docs).astype(np.float64) for docs in relevant]
        out = metrics.ranking_metrics(list(scores), gains, names)
        return out | {"query_active_dims": float((queries != 0).sum(-1).mean()),
                      "corpus_active_dims": float((corpus != 0).sum(-1).mean())}
