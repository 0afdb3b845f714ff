"""sentence-embedding evaluation as sentence-transformers' InformationRetrievalEvaluator computes it.

The data's (query, positive) rows make the benchmark: the distinct queries are the queries, every distinct positive
joins the corpus, and so do the rows' hard negatives (a triplet or n-tuple file's, as fine-tuning reads them, so the
figures agree with a fine-tune's evaluation of the same file) and a corpus file's texts, as distractors; each query's
relevant documents are its positives over all its rows. Queries and corpus are embedded as the evaluator embeds them
(encode_query / encode_document's prompts: hfport/retrieval/encode.py; cached on disk by model and text), each
query's top 100 found by exact search (hfport/retrieval/search.py) under the model's similarity function (cosine or
dot), ties ranked by corpus order, and the metrics computed with fine-tuning's ranked_metrics at the evaluator's
cutoffs, named as it names them: <similarity>_accuracy@k, _precision@k, _recall@k (k = 1, 3, 5, 10), _ndcg@10,
_mrr@10, _map@100.

Scored pairs (sentence1, sentence2, score: what a fine-tune trains with CoSENT) are no benchmark of queries: they are
evaluated as the fine-tune evaluates them (spearman and pearson of the cosines against the scores; supervised.py).
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..errors import ConfigError
from ..formats.tables import Source
from ..retrieval import Encoder, read_corpus, read_negatives, read_pairs, top_k
from ..train.config import FinetuneConfig
from ..train.metrics import IR_CUTOFFS, ranked_metrics
from .result import EvalResult
from .supervised import CURVE_KS, curves, evaluate_supervised
from .supervised import OPTIONS as SUPERVISED_OPTIONS

SIMILARITIES = ("cosine", "dot")
SCORED_OPTIONS = ("sentence1_column", "sentence2_column", "score_column", "score_range")  # scored_pairs'
OPTIONS = ("anchor_column", "positive_column", "negative_column", "corpus_column", "query_prompt_name", "query_prompt",
           "corpus_prompt_name", "corpus_prompt", "use_faiss", "eval_split", *SCORED_OPTIONS)
EVAL_SPLIT = FinetuneConfig.model_fields["eval_split"].default  # a DatasetDict's split, as every evaluation reads it


def eval_source(data: str, options: dict[str, Any]) -> Source:
    """DATA as evaluate reads it: a DatasetDict folder's eval_split (default "validation", as fine-tuning's --eval and
    every other task's evaluation read it), never its training split."""
    return Source(data, options.get("eval_split", EVAL_SPLIT), "eval_split (evaluate --set eval_split=...)")


def scored_pairs(data: str, options: dict[str, Any]) -> bool:
    """Whether DATA holds scored pairs as a sentence-embedding fine-tune reads them: its first row has the sentence1
    and score columns and no anchor column, and no anchor_column is named. Such a file is evaluated as the fine-tune
    evaluates it (spearman, pearson), not read by position as (query, positive) rows, where a pair scored 0 (not
    alike at all) would count as relevant."""
    if options.get("anchor_column") is not None:
        return False
    records = eval_source(data, options).records()
    first = next(records, None)
    records.close()
    return first is not None and "anchor" not in first.values and all(
        options.get(f"{name}_column", name) in first.values for name in ("sentence1", "score"))


def retrieval_benchmark(queries: Sequence[str], positives: Sequence[str],
                        distractors: Sequence[str] = ()) -> tuple[list[str], list[str], list[list[int]]]:
    """(distinct queries, corpus, each query's relevant corpus rows) from (query, positive) rows and distractors."""
    corpus = list(dict.fromkeys([*positives, *distractors]))
    row = {text: i for i, text in enumerate(corpus)}
    distinct = list(dict.fromkeys(queries))
    number = {q: i for i, q in enumerate(distinct)}
    relevant: list[dict[int, None]] = [{} for _ in distinct]
    for q, p in zip(queries, positives):
        relevant[number[q]][row[p]] = None
    return distinct, corpus, [list(r) for r in relevant]


def ranked_hits(query_emb: torch.Tensor, corpus_emb: torch.Tensor, relevant: list[list[int]], similarity: str,
                k: int, use_faiss: bool | None, progress: bool, device: Any = "cpu") -> list[np.ndarray]:
    """Each query's top k as 0/1 gains in rank order: best score first, ties by corpus row (the evaluator's order)."""
    if similarity == "cosine":
        query_emb, corpus_emb = F.normalize(query_emb, p=2, dim=-1), F.normalize(corpus_emb, p=2, dim=-1)
    bar = tqdm(total=len(query_emb), desc="searching", unit="query", disable=not progress, dynamic_ncols=True)
    try:
        scores, indices = top_k(query_emb.to(device), corpus_emb.to(device), min(k, len(corpus_emb)),
                                use_faiss=use_faiss, progress=bar.update)  # (Q, k) each, where the model runs
    finally:
        bar.close()
    scores_np, indices_np = scores.cpu().numpy(), indices.cpu().numpy()
    out = []
    for q, rel in enumerate(relevant):
        order = np.lexsort((indices_np[q], -scores_np[q]))  # by score, then by corpus row
        hits = set(rel)
        out.append(np.array([1.0 if i in hits else 0.0 for i in indices_np[q][order]]))
    return out


def evaluate_retrieval(model: str | os.PathLike[str] | Encoder, data: str, task: str, *, corpus: str | None = None,
                       dtype: str | None = None, device: Any = None, batch_size: int | None = None,
                       cache: bool | str | os.PathLike[str] = True, progress: bool = True,
                       **options: Any) -> EvalResult:
    """MODEL's retrieval metrics on DATA's (query, positive) rows (+ CORPUS's distractors). MODEL: a folder or repo id,
    or an Encoder already loaded. OPTIONS: OPTIONS' names
    (the anchor/positive columns as fine-tuning names them, the corpus file's text column, the prompts, use_faiss)."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConfigError(f"sentence-embedding evaluation: unknown option(s) {unknown}; valid: {list(OPTIONS)}")
    if scored_pairs(data, options):
        unused = sorted(set(options) - set(SUPERVISED_OPTIONS))
        if corpus is not None or unused:
            raise ConfigError(f"{data}: scored pairs (sentence1, sentence2, score), evaluated by the correlation of "
                              f"their cosines with the scores; {'corpus' if corpus is not None else unused} is for "
                              "(query, positive) rows")
        return evaluate_supervised(model.folder if isinstance(model, Encoder) else model, data, task, dtype=dtype,
                                   device=device, batch_size=batch_size, progress=progress, **options)
    scored_only = sorted(set(options) & set(SCORED_OPTIONS))
    if scored_only:
        raise ConfigError(f"{scored_only}: for scored pairs (sentence1, sentence2, score); {data} is read as "
                          "(query, positive) rows")
    source = eval_source(data, options)
    queries, positives, _, _ = read_pairs(source, options.get("anchor_column"), options.get("positive_column"))
    # a triplet file's negatives are documents of the corpus, relevant to no query they are not a positive of, as in
    # the fine-tune's evaluation of the same file
    negatives = read_negatives(source, options.get("negative_column", "negative"))
    distractors = read_corpus(corpus, options.get("corpus_column", "text")) if corpus is not None else []
    queries, corpus_texts, relevant = retrieval_benchmark(queries, positives, [*negatives, *distractors])
    encoder = model if isinstance(model, Encoder) else Encoder(model, device=device, dtype=dtype,
                                                              batch_size=batch_size, cache=cache, progress=progress)
    model = encoder.folder if isinstance(model, Encoder) else model
    similarity = encoder.similarity_fn_name
    if similarity not in SIMILARITIES:
        raise ConfigError(f"the model compares embeddings by {similarity!r}; evaluation ranks by "
                          f"{' or '.join(SIMILARITIES)} similarity")
    query_prompt = encoder.prompt("query", options.get("query_prompt_name"), options.get("query_prompt"))
    corpus_prompt = encoder.prompt("document", options.get("corpus_prompt_name"), options.get("corpus_prompt"))
    corpus_emb = torch.from_numpy(encoder.encode(corpus_texts, corpus_prompt, "embedding the corpus"))
    query_emb = torch.from_numpy(encoder.encode(queries, query_prompt, "embedding the queries"))
    k = max(max(ks) for ks in (*IR_CUTOFFS.values(), CURVE_KS))
    ranked = ranked_hits(query_emb, corpus_emb, relevant, similarity, k, options.get("use_faiss"), progress,
                         encoder.device)
    ideal = [np.ones(len(r)) for r in relevant]
    names = [f"query {q!r}" for q in queries]
    metrics = {f"{similarity}_{name}": value for name, value in ranked_metrics(ranked, ideal, IR_CUTOFFS,
                                                                               names).items()}
    facts = {"dtype": str(encoder.pipe.model.dtype), "similarity": similarity, "queries": len(queries),
             "corpus": len(corpus_texts), "distractors": len(corpus_texts) - len(set(positives)),
             "query_prompt": query_prompt, "corpus_prompt": corpus_prompt}
    return EvalResult(str(model), task, len(queries), metrics, {"curves": curves(ranked, ideal, names)}, facts)
