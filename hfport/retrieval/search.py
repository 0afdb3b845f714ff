"""Exact top-k search: each query's k highest-scoring corpus rows, in blocks.

The scores are inner products of the rows given (normalize them first for cosine similarity). A block of queries is
scored against a block of the corpus at a time and merged into the running top k, so memory is bounded by the block
(query_block x corpus_block scores), never by queries x corpus; sentence-transformers' mine_hard_negatives with
use_faiss=False holds faiss_batch_size (16384) x corpus scores at once. With faiss installed (the `faiss` extra:
faiss-cpu), use_faiss=True searches a flat inner-product index instead (exact too); None picks it for corpora of
FAISS_MIN_CORPUS rows and more, where its kernels beat a matmul and topk per block.

Results are best first; a corpus of fewer than k rows pads each query's list with score -inf and index -1, as
sentence-transformers' mine_hard_negatives does. Scores that tie exactly may come in either order.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from torch import Tensor

BLOCK_BYTES = 256 * 2**20  # the scores of one query block against one corpus block, float32
QUERY_BLOCK = 1024  # queries scored together
FAISS_MIN_CORPUS = 1_000_000  # use_faiss=None: faiss (when installed) from this corpus size on
FAISS_INSTALL = "pip install 'hfport[faiss]' (faiss-cpu)"


def faiss_available() -> bool:
    try:
        import faiss  # noqa: F401
    except ImportError:
        return False
    return True


def _padded(scores: Tensor, indices: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(Q, k') -> (Q, k): a short result padded with -inf scores and -1 indices."""
    missing = k - scores.shape[1]
    if missing <= 0:
        return scores, indices
    return (torch.cat([scores, scores.new_full((scores.shape[0], missing), -float("inf"))], dim=1),
            torch.cat([indices, indices.new_full((indices.shape[0], missing), -1)], dim=1))


def exact_top_k(queries: Tensor, corpus: Tensor, k: int, *, query_block: int = QUERY_BLOCK,
                block_bytes: int = BLOCK_BYTES, progress: Callable[[int], None] | None = None) -> tuple[Tensor, Tensor]:
    """(scores (Q, k), indices (Q, k)): queries (Q, C) against corpus (D, C) by inner product, a block at a time."""
    n, dim = corpus.shape
    corpus_block = max(k, block_bytes // (4 * max(1, min(query_block, len(queries)))))
    top_scores, top_indices = [], []
    for start in range(0, len(queries), query_block):
        q = queries[start:start + query_block]  # (b, C)
        best = q.new_empty((len(q), 0))  # (b, <=k): the running top k
        best_idx = torch.empty((len(q), 0), dtype=torch.long, device=q.device)
        for c0 in range(0, n, corpus_block):
            scores = q @ corpus[c0:c0 + corpus_block].T  # (b, d)
            block, block_idx = torch.topk(scores, k=min(k, scores.shape[1]), dim=1)  # (b, k'): the block's best
            del scores  # the block's scores go before the merge: memory holds one (b, d) block at a time
            merged = torch.cat([best, block], dim=1)  # (b, <=2k)
            merged_idx = torch.cat([best_idx, block_idx + c0], dim=1)  # (b, <=2k)
            best, where = torch.topk(merged, k=min(k, merged.shape[1]), dim=1)  # (b, k) best first
            best_idx = merged_idx.gather(1, where)
        top_scores.append(best)
        top_indices.append(best_idx)
        if progress is not None:
            progress(len(q))
    return _padded(torch.cat(top_scores), torch.cat(top_indices), k)


def faiss_top_k(queries: Tensor, corpus: Tensor, k: int, *, query_block: int = 16384,
                progress: Callable[[int], None] | None = None) -> tuple[Tensor, Tensor]:
    """The same search through a faiss IndexFlatIP (exact inner products)."""
    try:
        import faiss
    except ImportError as e:
        raise ImportError(f"use_faiss=True needs faiss, which is not installed; {FAISS_INSTALL}") from e
    index = faiss.IndexFlatIP(corpus.shape[1])
    index.add(np.ascontiguousarray(corpus.cpu().numpy(), dtype=np.float32))
    scores, indices = [], []
    for start in range(0, len(queries), query_block):
        q = np.ascontiguousarray(queries[start:start + query_block].cpu().numpy(), dtype=np.float32)
        s, i = index.search(q, k)  # (b, k) each; missing results: index -1
        scores.append(torch.from_numpy(s))
        indices.append(torch.from_numpy(i).long())
        if progress is not None:
            progress(len(q))
    scores_t, indices_t = torch.cat(scores), torch.cat(indices)
    scores_t[indices_t == -1] = -float("inf")
    return scores_t.to(queries.device), indices_t.to(queries.device)


def top_k(queries: Tensor, corpus: Tensor, k: int, *, use_faiss: bool | None = None, query_block: int = QUERY_BLOCK,
          block_bytes: int = BLOCK_BYTES, progress: Callable[[int], None] | None = None) -> tuple[Tensor, Tensor]:
    """(scores (Q, k), indices (Q, k)) of each query's k highest inner products with the corpus rows, best first.
    use_faiss: True (faiss must be installed), False (blocked exact search), None (faiss for a corpus of
    FAISS_MIN_CORPUS rows or more when it is installed). `progress(n)` is called as each block of n queries is done."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    if queries.shape[-1] != corpus.shape[-1]:
        raise ValueError(f"queries have {queries.shape[-1]} dimensions, the corpus {corpus.shape[-1]}")
    if use_faiss is None:
        use_faiss = len(corpus) >= FAISS_MIN_CORPUS and faiss_available()
    if use_faiss:
        return faiss_top_k(queries, corpus, k, progress=progress)
    return exact_top_k(queries, corpus, k, query_block=query_block, block_bytes=block_bytes, progress=progress)
