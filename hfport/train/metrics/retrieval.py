"""Retrieval and ranking metrics (sentence-embedding and text-ranking), and rank correlation for scored pairs.

Every query ranks its candidates by score, highest first (ties keep the candidates' order). With gains g (a
candidate's relevance: 1/0 for retrieval, the label for graded reranker data) and relevant = g > 0:
    accuracy@k   1 if a relevant candidate is in the top k, else 0
    precision@k  relevant candidates in the top k / k
    recall@k     relevant candidates in the top k / relevant candidates
    mrr@k        1 / rank of the first relevant candidate within the top k, else 0
    ndcg@k       DCG@k / ideal DCG@k, DCG = sum over the top k of g_i / log2(i + 1) (i = 1-based rank)
    map@k        the sum of precision@i over the ranks i <= k holding a relevant candidate / min(k, relevant count)
averaged over queries, as sentence-transformers' InformationRetrievalEvaluator computes them (binary gains there;
IR_CUTOFFS are its defaults). `ranked_metrics` computes them from each query's ranked list (the top of a search over
a large corpus is enough: the ideal DCG and the relevant count come from the relevant candidates given apart);
`ranking_metrics` ranks every candidate first. Training's evaluation reports CUTOFFS, `hfport evaluate` IR_CUTOFFS.
A query with no relevant candidate has no defined score: it is an error naming the query.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .base import ArrayLike, _array, _same_length

CUTOFFS = {"mrr": (10,), "ndcg": (10,), "recall": (1, 10)}  # what fine-tuning's evaluation reports
# sentence-transformers' InformationRetrievalEvaluator defaults, in the order it reports them
IR_CUTOFFS = {"accuracy": (1, 3, 5, 10), "precision": (1, 3, 5, 10), "recall": (1, 3, 5, 10), "ndcg": (10,),
              "mrr": (10,), "map": (100,)}


def _query_metrics(ranked: np.ndarray, ideal: np.ndarray, cutoffs: dict[str, tuple[int, ...]],
                   totals: dict[str, float]) -> None:
    """Add one query's values to TOTALS. ranked (N,): the gains of its candidates in rank order, best first (at least
    the top max(k)); ideal (R,): the gains of all its relevant candidates."""
    hits = ranked > 0  # (N,)
    n_relevant = len(ideal)
    first = int(np.argmax(hits)) if hits.any() else len(hits)  # 0-based rank of the first relevant candidate
    discounts = 1.0 / np.log2(np.arange(2, max(len(ranked), len(ideal)) + 2))  # (max(N, R),)
    for k in cutoffs.get("accuracy", ()):
        totals[f"accuracy@{k}"] += 1.0 if first < k else 0.0
    for k in cutoffs.get("precision", ()):
        totals[f"precision@{k}"] += float(hits[:k].sum()) / k
    for k in cutoffs.get("mrr", ()):
        totals[f"mrr@{k}"] += 1.0 / (first + 1) if first < k else 0.0
    for k in cutoffs.get("ndcg", ()):
        dcg = float((ranked[:k] * discounts[:len(ranked[:k])]).sum())
        best = np.sort(ideal)[::-1][:k]
        totals[f"ndcg@{k}"] += dcg / float((best * discounts[:len(best)]).sum())
    for k in cutoffs.get("recall", ()):
        totals[f"recall@{k}"] += float(hits[:k].sum()) / float(n_relevant)
    for k in cutoffs.get("map", ()):
        top = hits[:k]
        precisions = np.cumsum(top)[top] / (np.flatnonzero(top) + 1.0)  # precision at each relevant rank
        totals[f"map@{k}"] += float(precisions.sum()) / min(k, n_relevant)


def ranked_metrics(ranked: Sequence[ArrayLike], ideal: Sequence[ArrayLike],
                   cutoffs: dict[str, tuple[int, ...]] = IR_CUTOFFS,
                   names: Sequence[str] | None = None) -> dict[str, float]:
    """The means over queries of the metrics CUTOFFS names ({"ndcg": (10,), ...}; keys "<metric>@<k>").
    ranked[q]: query q's candidates' gains in rank order, best first (the top max(k) suffice); ideal[q]: the gains of
    all of q's relevant candidates (one per relevant document for binary relevance)."""
    _same_length(ranked, ideal, "ranked", "ideal")
    if not ranked:
        raise ValueError("ranked is empty: no query to rank")
    totals = {f"{m}@{k}": 0.0 for m, ks in cutoffs.items() for k in ks}
    for q, (r, g) in enumerate(zip(ranked, ideal)):
        name = names[q] if names is not None else f"query {q}"
        g = np.asarray(g, dtype=np.float64)
        if not (g > 0).any():
            raise ValueError(f"{name}: no relevant document; every evaluation query needs one (a positive, or a "
                             "label above the low end of score_range)")
        _query_metrics(np.asarray(r, dtype=np.float64), g[g > 0], cutoffs, totals)
    return {name: value / len(ranked) for name, value in totals.items()}


def ranking_metrics(scores: Sequence[ArrayLike], gains: Sequence[ArrayLike],
                    names: Sequence[str] | None = None,
                    cutoffs: dict[str, tuple[int, ...]] = CUTOFFS) -> dict[str, float]:
    """Each query ranks all its candidates by score (ties keep their order), then ranked_metrics: by default MRR@10,
    NDCG@10, Recall@1, Recall@10. scores[q] and gains[q] are (N_q,) for query q; names[q] (default "query q") names a
    query in errors."""
    _same_length(scores, gains, "scores", "gains")
    if not scores:
        raise ValueError("scores is empty: no query to rank")
    ranked, ideal = [], []
    for q, (s, g) in enumerate(zip(scores, gains)):
        name = names[q] if names is not None else f"query {q}"
        s, g = _array(s, f"scores of {name}").astype(np.float64), _array(g, f"gains of {name}").astype(np.float64)
        if s.shape != g.shape or s.ndim != 1:
            raise ValueError(f"{name}: scores {s.shape} and gains {g.shape} must be the same (N,) shape")
        if not (g > 0).any():
            raise ValueError(f"{name}: no relevant document among its {len(g)} candidates; every evaluation query "
                             "needs one (a positive, or a label above the low end of score_range)")
        ranked.append(g[np.argsort(-s, kind="stable")])  # (N,) best first
        ideal.append(g[g > 0])
    return ranked_metrics(ranked, ideal, cutoffs, names)


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
