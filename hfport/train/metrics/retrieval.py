"""Retrieval and ranking metrics (sentence-embedding and text-ranking), and rank correlation for scored pairs.

Every query ranks its candidates by score, highest first (ties keep the candidates' order). With gains g (a
candidate's relevance: 1/0 for retrieval, the label for graded reranker data) and relevant = g > 0:
    mrr@k      1 / rank of the first relevant candidate within the top k, else 0
    ndcg@k     DCG@k / ideal DCG@k, DCG = sum over the top k of g_i / log2(i + 1) (i = 1-based rank)
    recall@k   relevant candidates in the top k / relevant candidates
averaged over queries, as sentence-transformers' InformationRetrievalEvaluator computes them (binary gains there).
A query with no relevant candidate has no defined score: it is an error naming the query.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .base import ArrayLike, _array, _same_length

CUTOFFS = {"mrr": (10,), "ndcg": (10,), "recall": (1, 10)}


def ranking_metrics(scores: Sequence[ArrayLike], gains: Sequence[ArrayLike],
                    names: Sequence[str] | None = None) -> dict[str, float]:
    """Mean MRR@10, NDCG@10, Recall@1, Recall@10 over queries; scores[q] and gains[q] are (N_q,) for query q.
    names[q] (default "query q") names a query in errors."""
    _same_length(scores, gains, "scores", "gains")
    if not scores:
        raise ValueError("scores is empty: no query to rank")
    totals = {f"{m}@{k}": 0.0 for m, ks in CUTOFFS.items() for k in ks}
    for q, (s, g) in enumerate(zip(scores, gains)):
        name = names[q] if names is not None else f"query {q}"
        s, g = _array(s, f"scores of {name}").astype(np.float64), _array(g, f"gains of {name}").astype(np.float64)
        if s.shape != g.shape or s.ndim != 1:
            raise ValueError(f"{name}: scores {s.shape} and gains {g.shape} must be the same (N,) shape")
        relevant = g > 0
        if not relevant.any():
            raise ValueError(f"{name}: no relevant document among its {len(g)} candidates; every evaluation query "
                             "needs one (a positive, or a label above the low end of score_range)")
        order = np.argsort(-s, kind="stable")  # (N,) best first
        ranked = g[order]
        hits = relevant[order]
        first = int(np.argmax(hits))  # 0-based rank of the first relevant candidate
        for k in CUTOFFS["mrr"]:
            totals[f"mrr@{k}"] += 1.0 / (first + 1) if first < k else 0.0
        discounts = 1.0 / np.log2(np.arange(2, len(g) + 2))  # (N,)
        for k in CUTOFFS["ndcg"]:
            dcg = float((ranked[:k] * discounts[:k]).sum())
            ideal = np.sort(g)[::-1][:k]
            totals[f"ndcg@{k}"] += dcg / float((ideal * discounts[:len(ideal)]).sum())
        for k in CUTOFFS["recall"]:
            totals[f"recall@{k}"] += float(hits[:k].sum()) / float(relevant.sum())
    return {name: value / len(scores) for name, value in totals.items()}


def retrieval_metrics(query_embeddings: ArrayLike, corpus_embeddings: ArrayLike, relevant: Sequence[Sequence[int]],
                      names: Sequence[str] | None = None) -> dict[str, float]:
    """Each query (Q, C) ranks the whole corpus (D, C) by cosine similarity; relevant[q] lists its documents' rows."""
    queries = _array(query_embeddings, "query_embeddings").astype(np.float64)
    corpus = _array(corpus_embeddings, "corpus_embeddings").astype(np.float64)
    _same_length(queries, relevant, "query_embeddings", "relevant")
    queries = queries / np.clip(np.linalg.norm(queries, axis=-1, keepdims=True), 1e-12, None)
    corpus = corpus / np.clip(np.linalg.norm(corpus, axis=-1, keepdims=True), 1e-12, None)
    sims = queries @ corpus.T  # (Q, D)
    gains = []
    for q, docs in enumerate(relevant):
        g = np.zeros(len(corpus))
        g[list(docs)] = 1.0
        gains.append(g)
    return ranking_metrics(list(sims), gains, names)


def _ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks, ties given their average rank (scipy.stats.rankdata's 'average')."""
    order = np.argsort(x, kind="stable")
    sorted_x = x[order]
    ranks = np.empty(len(x))
    start = 0
    for end in range(1, len(x) + 1):
        if end == len(x) or sorted_x[end] != sorted_x[start]:
            ranks[order[start:end]] = (start + end + 1) / 2.0  # the mean of ranks start+1 .. end
            start = end
    return ranks


def _pearson(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a - a.mean(), b - b.mean()
    denominator = float(np.sqrt((a * a).sum() * (b * b).sum()))
    return float((a * b).sum()) / denominator if denominator > 0 else 0.0  # a constant side: no correlation


def correlation_metrics(predictions: ArrayLike, labels: ArrayLike) -> dict[str, float]:
    """Spearman and Pearson correlation of predicted similarities with gold scores (0 when either is constant)."""
    pred, true = _array(predictions, "predictions").astype(np.float64), _array(labels, "labels").astype(np.float64)
    _same_length(pred, true)
    return {"spearman": _pearson(_ranks(pred), _ranks(true)), "pearson": _pearson(pred, true)}


def compute(problem_type: str | None = None, *, predictions: ArrayLike = None, labels: ArrayLike = None,
            **unused: object) -> dict[str, float]:
    """compute_metrics of sentence-embedding and text-ranking. problem_type "scored-pairs": predictions are pair
    similarities and labels gold scores (spearman, pearson); else predictions[q] are query q's candidate scores and
    labels[q] their gains (mrr@10, ndcg@10, recall@1, recall@10)."""
    if problem_type == "scored-pairs":
        return correlation_metrics(predictions, labels)
    if predictions is None or labels is None:
        raise ValueError("predictions and labels are required")
    return ranking_metrics(list(predictions), list(labels))
