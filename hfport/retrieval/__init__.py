"""Retrieval on sentence embeddings: embed texts for search (encode.py: the sentence-embedding pipeline, prompts as
encode_query/encode_document pick them, the vectors cached on disk by model and text: cache.py), find each query's
best corpus rows exactly (search.py: in blocks of bounded memory, or faiss), and mine hard negatives from
(anchor, positive) pairs as sentence-transformers' mine_hard_negatives does (mine.py; `hfport mine`).
`hfport evaluate` (hfport/evaluation/) ranks with the same search.
"""

from __future__ import annotations

from .cache import EmbeddingCache, model_key
from .encode import Encoder
from .mine import (OUTPUT_FORMATS, SAMPLING_STRATEGIES, MineResult, check_relevant, mine, mine_hard_negatives,
                   negative_texts, numbered_columns, read_corpus, read_negatives, read_pairs)
from .search import faiss_available, top_k

__all__ = ["EmbeddingCache", "Encoder", "MineResult", "OUTPUT_FORMATS", "SAMPLING_STRATEGIES", "check_relevant",
           "faiss_available", "mine", "mine_hard_negatives", "model_key", "negative_texts", "numbered_columns",
           "read_corpus", "read_negatives", "read_pairs", "top_k"]
