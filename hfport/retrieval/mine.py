"""Hard-negative mining: (anchor, positive) pairs -> rows with hard negatives, as sentence-transformers'
`util.mine_hard_negatives` makes them, with its options and their meanings, on hfport's embeddings.

Every distinct positive (and every text of an optional corpus) is a candidate; the distinct anchors are the queries.
Both are embedded (normalized; queries with the query prompt, the corpus with the document prompt: encode.py) and each
query's range_max + max_positives best candidates are found by exact search (search.py: in blocks, or faiss). Then,
in sentence-transformers' order:
  - a reranker (a text-ranking model), when a score filter is set, rescores the candidates and the positives
  - the query's own positives are dropped (unless include_positives)
  - absolute_margin drops candidates scoring above (the query's lowest positive score - margin); relative_margin those
    above (lowest positive - |lowest positive| x margin); max_score those above it, min_score those below it
  - the range_max best left are ranked; the first range_min are skipped; of the rest, sampling_strategy "top" keeps
    the num_negatives best, "random" num_negatives drawn at random (from the ones the filters left, where there are
    enough) and put back in score order
Output formats, with sentence-transformers' columns (the anchor and positive columns keep the input's names):
  triplet       (anchor, positive, negative): a row per negative found, for each of the query's positives
  n-tuple       (anchor, positive, negative_1, ..., negative_n): a row per (query, positive) with all n found
  labeled-pair  (anchor, positive, label): each positive with label 1, then each negative with label 0 (text-ranking)
  labeled-list  (anchor, [positive, negatives...], labels [1, 0, ...])
output_scores adds the scores (triplet, n-tuple: `scores`; labeled-pair: `score` instead of `label`; labeled-list:
`scores` instead of `labels`). include_positives keeps positives among the candidates and forces n-tuple, as
sentence-transformers does (a ranking from the first stage, for reranker evaluation data).

Random sampling draws with `random.Random(seed)` exactly the calls sentence-transformers makes on the global `random`
module (`sample(range(options), k)` per query, in query order), so seed=s picks what sentence-transformers picks after
`random.seed(s)`.

Where hfport differs on purpose: a reranker given without a score filter (max_score, min_score, absolute_margin,
relative_margin) is an error here; sentence-transformers accepts it and never uses it.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..errors import ItemError
from ..formats.tables import DataError, Source, decoded_lines, where, writable_kind, write_rows
from ..pipelines import Pipeline, pipeline
from ..rundir import RunDir
from .encode import Encoder
from .search import top_k

log = logging.getLogger("hfport.retrieval")

OUTPUT_FORMATS = ("triplet", "n-tuple", "labeled-pair", "labeled-list")
SAMPLING_STRATEGIES = ("top", "random")
SIMILARITIES = ("cosine", "dot")  # on normalized embeddings both are the inner product mining ranks by


@dataclass
class MineResult:
    """The mined rows (dicts with `columns`), and what sentence-transformers prints about them (`stats`)."""

    columns: list[str]
    rows: list[dict[str, Any]]
    stats: dict[str, Any] = field(default_factory=dict)

    def write(self, path: str | os.PathLike[str]) -> Path:
        """JSONL (.jsonl) or Parquet (.parquet), as `hfport finetune` reads them."""
        return write_rows(path, self.columns, self.rows)

    def summary(self) -> str:
        """sentence-transformers' table of positive and negative scores, and what was skipped or missing."""
        s = self.stats
        lines = [f"{'Metric':<6} {'Positive':>14} {'Negative':>14} {'Difference':>14}",
                 f"{'Count':<6} {s['positive']['count']:>14,} {s['negative']['count']:>14,}"]
        for name in ("mean", "median", "std", "min", "25%", "50%", "75%", "max"):
            lines.append(f"{name.capitalize():<6} " + " ".join(
                f"{s[part].get(name, float('nan')):>14.4f}" for part in ("positive", "negative", "difference")))
        for name, counter in s["skipped"].items():
            lines.append(f"Skipped {counter['skipped']:,} potential negatives ({counter['ratio']:.2%}) due to the "
                         f"{name} of {s['options'][name]}.")
        if s["missing"] > 0:
            lines.append(f"Could not find enough negatives for {s['missing']} samples "
                         f"({s['missing'] / s['possible']:.2%}); consider range_max, range_min and the filters.")
        return "\n".join(lines)


def _score_summary(scores: torch.Tensor) -> dict[str, float]:
    """sentence-transformers' statistics of a score vector (torch.median: the lower median; std unbiased)."""
    out: dict[str, float] = {"count": int(scores.numel())}
    if scores.numel() == 0:
        return out
    x = scores.float()
    out |= {"mean": float(x.mean()), "median": float(x.median()), "std": float(x.std()) if x.numel() > 1 else 0.0,
            "min": float(x.min()), "25%": float(torch.quantile(x, 0.25)), "50%": float(torch.quantile(x, 0.5)),
            "75%": float(torch.quantile(x, 0.75)), "max": float(x.max())}
    return out


def check_options(num_negatives: int, range_min: int, range_max: int | None, sampling_strategy: str,
                  output_format: str, max_positives: int, filtered: bool) -> int:
    """The options checked as sentence-transformers checks them; returns range_max (its default: range_min +
    num_negatives + max_positives, or 10 x num_negatives with a score filter, which drops candidates)."""
    if sampling_strategy not in SAMPLING_STRATEGIES:
        raise ValueError(f"sampling_strategy {sampling_strategy!r}: use one of {list(SAMPLING_STRATEGIES)}")
    if output_format not in OUTPUT_FORMATS:
        raise ValueError(f"output_format {output_format!r}: use one of {list(OUTPUT_FORMATS)}")
    if isinstance(num_negatives, bool) or not isinstance(num_negatives, int) or num_negatives < 1:
        raise ValueError(f"num_negatives must be at least 1, got {num_negatives!r}")
    if range_max is None:
        range_max = range_min + num_negatives * (10 if filtered else 1) + max_positives
    if range_min < 0:
        raise ValueError(f"range_min must be non-negative, got {range_min}")
    if range_min >= range_max:
        raise ValueError(f"range_min must be smaller than range_max, got range_min={range_min} and "
                         f"range_max={range_max}")
    if num_negatives > range_max - range_min:
        raise ValueError(f"cannot mine {num_negatives} negatives per query: only {range_max - range_min} candidates "
                         f"remain after skipping the first range_min={range_min} of range_max={range_max}; lower "
                         "num_negatives or range_min, or raise range_max")
    return range_max


@dataclass
class Candidates:
    """Each distinct query's best corpus rows (the search's, then the filters'), and its positives."""

    queries: list[str]  # the distinct anchors, in order
    corpus: list[str]  # the distinct candidate texts: the corpus given (or the positives), then the positives
    positive_indices: list[list[int]]  # each query's distinct positives' corpus rows, in the order of the pairs
    scores: torch.Tensor  # (Q, k) best first until rescored or filtered; -inf: no candidate (padding, filtered)
    indices: torch.Tensor  # (Q, k) corpus rows; -1: padding of a corpus smaller than k
    positive_scores: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # (P,): each (query, positive)

    @property
    def n_positives(self) -> list[int]:
        return [len(p) for p in self.positive_indices]

    @property
    def pair_queries(self) -> list[str]:
        """Each (query, positive) pair's query, the pairs grouped by query."""
        return [q for q, ps in zip(self.queries, self.positive_indices) for _ in ps]

    @property
    def pair_positives(self) -> list[str]:
        return [self.corpus[i] for ps in self.positive_indices for i in ps]


def find_candidates(anchors: Sequence[str], positives: Sequence[str], corpus: Sequence[str] | None,
                    encoder: Encoder, k: int, query_prompt: str, corpus_prompt: str, use_faiss: bool | None,
                    progress: bool) -> Candidates:
    """Embed the distinct queries and candidates (normalized, as normalize_embeddings=True) and find each query's k
    best by inner product; each pair's positive score beside them."""
    texts = list(dict.fromkeys([*(corpus if corpus is not None else positives), *positives]))
    row = {text: i for i, text in enumerate(texts)}
    queries = list(dict.fromkeys(anchors))
    number = {q: i for i, q in enumerate(queries)}
    if len(queries) != len(anchors):
        log.info("found %d unique queries out of %d", len(queries), len(anchors))
    positive_indices: list[list[int]] = [[] for _ in queries]
    for a, p in zip(anchors, positives):
        if row[p] not in positive_indices[number[a]]:
            positive_indices[number[a]].append(row[p])
    corpus_emb = F.normalize(torch.from_numpy(encoder.encode(texts, corpus_prompt, "embedding the corpus")),
                             p=2, dim=-1)  # (D, C)
    query_emb = F.normalize(torch.from_numpy(encoder.encode(queries, query_prompt, "embedding the queries")),
                            p=2, dim=-1)  # (Q, C)
    device = encoder.device  # the search runs where the model does (a GPU's matmuls), then back
    bar = tqdm(total=len(queries), desc="searching", unit="query", disable=not progress, dynamic_ncols=True)
    try:
        scores, indices = top_k(query_emb.to(device), corpus_emb.to(device), k, use_faiss=use_faiss,
                                progress=bar.update)  # (Q, k) each
    finally:
        bar.close()
    found = Candidates(queries, texts, positive_indices, scores.cpu(), indices.cpu())
    pair_query = [q for q, ps in enumerate(positive_indices) for _ in ps]
    flat = [i for ps in positive_indices for i in ps]
    found.positive_scores = (query_emb[pair_query] * corpus_emb[flat]).sum(-1)  # (P,)
    return found


RERANK_QUERIES = 32  # queries whose candidate pairs go to the reranker in one call (its batches span them)


def rerank(found: Candidates, reranker: Pipeline, progress: bool) -> None:
    """The reranker's scores (its sigmoid, as CrossEncoder.predict gives them) in place of the candidates' and the
    positives' (padding stays -inf)."""

    def score(pairs: list[tuple[str, str]]) -> list[float]:
        results = reranker.predict([{"text": q, "text_pair": t} for q, t in pairs], top_k=None,
                                   function_to_apply="sigmoid", truncation=True)
        for (q, t), r in zip(pairs, results):
            if isinstance(r, ItemError):
                raise ValueError(f"reranking query {q[:80]!r} with {t[:80]!r}: {r.message}")
        return [r[0]["score"] for r in results]

    rows = found.indices.tolist()
    scores = torch.full(found.scores.shape, -float("inf"))  # (Q, k)
    bar = tqdm(total=len(rows), desc="reranking", unit="query", disable=not progress, dynamic_ncols=True)
    try:
        for start in range(0, len(rows), RERANK_QUERIES):
            places = [(q, j) for q in range(start, min(start + RERANK_QUERIES, len(rows)))
                      for j, i in enumerate(rows[q]) if i >= 0]
            values = score([(found.queries[q], found.corpus[rows[q][j]]) for q, j in places])
            for (q, j), v in zip(places, values):
                scores[q, j] = v
            bar.update(min(RERANK_QUERIES, len(rows) - start))
    finally:
        bar.close()
    found.scores = scores
    found.positive_scores = torch.tensor(score(list(zip(found.pair_queries, found.pair_positives))))


def apply_filters(found: Candidates, include_positives: bool, absolute_margin: float | None,
                  relative_margin: float | None, max_score: float | None,
                  min_score: float | None) -> dict[str, dict[str, float]]:
    """Drop (score -inf) padding, the query's own positives (unless include_positives), and what the margins and
    score bounds exclude, in sentence-transformers' order; returns {filter: {skipped, ratio}} as it counts them."""
    scores, indices = found.scores, found.indices
    scores[indices == -1] = -float("inf")
    if not include_positives:
        own = torch.stack([torch.isin(indices[q], torch.tensor(ps)) for q, ps in enumerate(found.positive_indices)])
        scores[own] = -float("inf")  # (Q, k)
    skipped: dict[str, dict[str, float]] = {}
    candidates = scores.numel()

    def drop(name: str, removed: torch.Tensor, counted: bool) -> None:
        nonlocal candidates
        scores[removed] = -float("inf")
        n = int(removed.sum())
        if n:
            skipped[name] = {"skipped": n, "ratio": n / candidates}
            candidates -= n if counted else 0  # the score bounds' ratios are of the margins' remainder

    if absolute_margin is not None or relative_margin is not None:
        # the query's lowest positive score: with several positives the margin holds against the hardest one
        starts = np.cumsum([0, *found.n_positives[:-1]]).tolist()
        lowest = torch.stack([found.positive_scores[s:s + n].min()
                              for s, n in zip(starts, found.n_positives)])  # (Q,)
        if absolute_margin is not None:
            drop("absolute_margin", scores + absolute_margin > lowest[:, None], True)
        if relative_margin is not None:
            drop("relative_margin", scores > (lowest - lowest.abs() * relative_margin)[:, None], True)
    if max_score is not None:
        drop("max_score", scores > max_score, False)
    if min_score is not None:
        drop("min_score", scores < min_score, False)
    return skipped


def select(found: Candidates, range_min: int, range_max: int, num_negatives: int, sampling_strategy: str,
           seed: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(corpus rows, scores), (Q, num_negatives) each, best first: the range_max best left, the first range_min
    skipped, then the best ("top") or a random draw ("random": the calls sentence-transformers makes on `random`)."""
    batch = torch.arange(len(found.queries)).unsqueeze(-1)  # (Q, 1)
    scores, local = torch.topk(found.scores, k=range_max, dim=1)  # (Q, range_max) best first
    indices = found.indices[batch, local][:, range_min:]
    scores = scores[:, range_min:]
    if sampling_strategy == "top":
        return indices[:, :num_negatives], scores[:, :num_negatives]
    rng = random.Random(seed)
    options = (indices.size(1) - scores.isinf().sum(1)).clamp(min=num_negatives)  # (Q,): where enough are left
    sampled = [rng.sample(range(int(n)), k=num_negatives) for n in options]
    indices, scores = indices[batch, sampled], scores[batch, sampled]
    scores, local = scores.sort(dim=1, descending=True)
    return indices[batch, local], scores


def mine_hard_negatives(anchors: Sequence[str], positives: Sequence[str], model: Any, *,
                        corpus: Sequence[str] | None = None, reranker: Any = None, anchor_column: str = "anchor",
                        positive_column: str = "positive", range_min: int = 0, range_max: int | None = None,
                        max_score: float | None = None, min_score: float | None = None,
                        absolute_margin: float | None = None, relative_margin: float | None = None,
                        num_negatives: int = 3, sampling_strategy: str = "top", query_prompt_name: str | None = None,
                        query_prompt: str | None = None, corpus_prompt_name: str | None = None,
                        corpus_prompt: str | None = None, include_positives: bool = False,
                        output_format: str = "triplet", output_scores: bool = False, seed: int | None = None,
                        use_faiss: bool | None = None, dtype: str | None = None, device: Any = None,
                        batch_size: int | None = None, cache: bool | str | os.PathLike[str] = True,
                        progress: bool = True) -> MineResult:
    """Hard negatives for (anchors[i], positives[i]) pairs, as sentence-transformers' mine_hard_negatives (see the
    module docstring for the steps and formats). model: a sentence-embedding folder or repo id (or an Encoder);
    reranker: a text-ranking folder, a fine-tune's run folder (its best/) or a pipeline, that rescores the candidates
    when a score filter is set. dtype: as `hfport predict --dtype`; cache: the corpus's and queries' embeddings kept
    on disk (True: hfport's cache dir; a folder; False); use_faiss: see search.top_k; seed: random sampling's seed."""
    if len(anchors) != len(positives):
        raise ValueError(f"{len(anchors)} anchors but {len(positives)} positives")
    if not anchors:
        raise ValueError("no (anchor, positive) pairs to mine negatives for")
    if include_positives and output_format != "n-tuple":
        log.warning('include_positives: output_format is set to "n-tuple" so that the ranking order is kept')
        output_format = "n-tuple"
    bounds = (absolute_margin, relative_margin, max_score, min_score)
    if min_score is not None and max_score is not None and min_score > max_score:
        raise ValueError(f"min_score {min_score} is above max_score {max_score}: every candidate would be dropped")
    if reranker is not None and all(v is None for v in bounds):
        raise ValueError("a reranker rescores the candidates for the score filters (max_score, min_score, "
                         "absolute_margin, relative_margin); give one of them (sentence-transformers would ignore the "
                         "reranker)")
    max_positives = max(Counter(anchors).values())  # rows per anchor, duplicates included (its groupby count)
    range_max = check_options(num_negatives, range_min, range_max, sampling_strategy, output_format, max_positives,
                              filtered=any(v is not None for v in bounds[:3]) or
                              (reranker is not None and min_score is not None))
    encoder = model if isinstance(model, Encoder) else Encoder(model, device=device, dtype=dtype,
                                                              batch_size=batch_size, cache=cache, progress=progress)
    if encoder.similarity_fn_name not in SIMILARITIES:
        raise ValueError(f"the model compares embeddings by {encoder.similarity_fn_name!r}; mining ranks by "
                         f"{' or '.join(SIMILARITIES)} similarity")
    found = find_candidates(anchors, positives, corpus, encoder, range_max + max_positives,  # room for positives
                            encoder.prompt("query", query_prompt_name, query_prompt),
                            encoder.prompt("document", corpus_prompt_name, corpus_prompt), use_faiss, progress)
    if reranker is not None:
        rerank(found, reranker if isinstance(reranker, Pipeline) else pipeline(  # a run: its best/, as the model's
            "text-ranking", model=RunDir.model_folder(reranker), device=device, batch_size=batch_size), progress)
    skipped = apply_filters(found, include_positives, *bounds)
    indices, negative_scores = select(found, range_min, range_max, num_negatives, sampling_strategy, seed)
    columns, rows, kept, differences, possible = _format(output_format, output_scores, anchor_column,
                                                         positive_column, found, len(anchors), indices,
                                                         negative_scores, num_negatives)
    options = dict(zip(("absolute_margin", "relative_margin", "max_score", "min_score"), bounds)) | {
        "range_min": range_min, "range_max": range_max, "num_negatives": num_negatives,
        "sampling_strategy": sampling_strategy, "output_format": output_format}
    stats = {"queries": len(found.queries), "corpus": len(found.corpus), "options": options, "skipped": skipped,
             "positive": _score_summary(found.positive_scores), "negative": _score_summary(kept),
             "difference": _score_summary(differences), "possible": possible, "missing": possible - len(rows)}
    return MineResult(columns, rows, stats)


def _format(output_format: str, output_scores: bool, anchor_column: str, positive_column: str, found: Candidates,
            n_rows: int, indices: torch.Tensor, negative_scores: torch.Tensor,
            num_negatives: int) -> tuple[list[str], list[dict[str, Any]], torch.Tensor, torch.Tensor, int]:
    """(columns, rows, the negatives' scores, positive - negative differences, the rows possible) in OUTPUT_FORMAT,
    row for row as sentence-transformers builds them. N_ROWS: the input's (anchor, positive) rows."""
    queries, corpus, positive_scores = found.queries, found.corpus, found.positive_scores
    pair_queries, pair_positives = found.pair_queries, found.pair_positives
    n_queries = len(queries)
    per_pair = torch.repeat_interleave(torch.arange(n_queries), torch.tensor(found.n_positives))  # (P,)
    pair_indices, pair_scores = indices[per_pair], negative_scores[per_pair]  # (P, n) each
    found_mask = pair_scores != -float("inf")  # (P, n)
    rows: list[dict[str, Any]] = []
    if output_format == "triplet":
        columns = [anchor_column, positive_column, "negative"] + (["scores"] if output_scores else [])
        for p, (query, positive) in enumerate(zip(pair_queries, pair_positives)):
            for j in range(num_negatives):
                if found_mask[p, j]:
                    row = {anchor_column: query, positive_column: positive,
                           "negative": corpus[int(pair_indices[p, j])]}
                    if output_scores:
                        row["scores"] = [float(positive_scores[p]), float(pair_scores[p, j])]
                    rows.append(row)
        kept = pair_scores[found_mask]
        return (columns, rows, kept, positive_scores[:, None].expand_as(pair_scores)[found_mask] - kept,
                found_mask.numel())
    if output_format == "labeled-pair":
        columns = [anchor_column, positive_column, "score" if output_scores else "label"]
        p = 0
        for q in range(n_queries):
            for i in found.positive_indices[q]:
                rows.append({anchor_column: queries[q], positive_column: corpus[i],
                             columns[2]: float(positive_scores[p]) if output_scores else 1})
                p += 1
            for i, s in zip(indices[q].tolist(), negative_scores[q].tolist()):
                if s != -float("inf"):
                    rows.append({anchor_column: queries[q], positive_column: corpus[i],
                                 columns[2]: s if output_scores else 0})
        kept = pair_scores[found_mask]
        return (columns, rows, kept, positive_scores[:, None].expand_as(pair_scores)[found_mask] - kept,
                n_queries * num_negatives + n_rows)
    if output_format == "n-tuple":
        complete = found_mask.all(dim=1)  # (P,): a row only where all n negatives were found
        columns = [anchor_column, positive_column, *(f"negative_{i}" for i in range(1, num_negatives + 1))]
        columns += ["scores"] if output_scores else []
        for p in torch.nonzero(complete).flatten().tolist():
            row = {anchor_column: pair_queries[p], positive_column: pair_positives[p]}
            row |= {f"negative_{j + 1}": corpus[i] for j, i in enumerate(pair_indices[p].tolist())}
            if output_scores:
                row["scores"] = [float(positive_scores[p]), *pair_scores[p].tolist()]
            rows.append(row)
        kept = pair_scores[complete]
        return (columns, rows, kept.flatten(), (positive_scores[complete][:, None] - kept).flatten(),
                len(complete))
    # labeled-list
    columns = [anchor_column, positive_column, "scores" if output_scores else "labels"]
    for p in range(len(pair_queries)):
        keep = found_mask[p]
        if not keep.any():
            continue
        texts = [pair_positives[p], *(corpus[i] for i in pair_indices[p][keep].tolist())]
        values = ([float(positive_scores[p]), *pair_scores[p][keep].tolist()] if output_scores
                  else [1] + [0] * int(keep.sum()))
        rows.append({anchor_column: pair_queries[p], positive_column: texts, columns[2]: values})
    kept = pair_scores[found_mask]
    return (columns, rows, kept, positive_scores[:, None].expand_as(pair_scores)[found_mask] - kept,
            len(found_mask))


# --- reading pairs and corpora from files -------------------------------------------------------------------------

LABEL_COLUMN = "label"  # labeled-pair's: 1 beside a query's positive, 0 beside each mined negative
SCORE_COLUMN = "score"  # scored pairs' (sentence1, sentence2, score: CoSENT's data), as fine-tuning names it


def check_relevant(source: Source | Path | str, record: Any) -> None:
    """A row read as an (anchor, positive) pair whose `label` says the pair is not relevant (a number <= 0: a mined
    negative of a labeled-pair file, a qrels judgement of 0) is an error: read as a pair, its text would count as a
    positive (a relevant document in evaluate, a positive in mining and in an embedding fine-tune)."""
    value = record.values.get(LABEL_COLUMN)
    try:
        irrelevant = value is not None and float(value) <= 0  # CSV's "0" too
    except (TypeError, ValueError):  # a label that is no number (a class name) says nothing about relevance
        return
    if irrelevant:
        raise DataError(f"{where(source, record.line, LABEL_COLUMN)}: {value!r} marks a pair that is not relevant "
                        "(as `hfport mine --output-format labeled-pair` labels its negatives), but every row is read "
                        "as an (anchor, positive) pair, its text a positive; keep only the relevant rows, or read the "
                        "file as text-ranking data (query_column=anchor, text_column=positive)")


def read_pairs(data: str | os.PathLike[str] | Source, anchor_column: str | None = None,
               positive_column: str | None = None) -> tuple[list[str], list[str], str, str]:
    """(anchors, positives, the anchor column, the positive column) of a data file (CSV/TSV, JSONL, Parquet, Arrow, a
    datasets folder: its "train" split, or the Source's). Columns as sentence-transformers picks them: the named ones,
    else "anchor"/"positive" when the file has them, else its first and second columns."""
    source = data if isinstance(data, Source) else Source(data)
    anchors: list[str] = []
    positives: list[str] = []
    for record in source.records():
        if not anchors:
            names = list(record.values)
            if len(names) < 2:
                raise DataError(f"{where(source, record.line)}: (anchor, positive) rows need two columns; the row has "
                                f"{names}")
            guessed = [role for role, given in (("anchor", anchor_column), ("positive", positive_column))
                       if given is None and role not in names]
            if guessed and SCORE_COLUMN in names:  # by position, a low-scored pair would be taken as a positive
                raise DataError(f"{where(source, record.line)}: the row has a {SCORE_COLUMN!r} column ({names}): scored "
                                "pairs, whose score says how alike the two texts are, not (anchor, positive) pairs; "
                                "name the columns (anchor_column= / positive_column=) to read them as pairs all the "
                                "same")
            anchor_column = anchor_column or ("anchor" if "anchor" in names else names[0])
            positive_column = positive_column or ("positive" if "positive" in names else names[1])
            if guessed:  # by position, as sentence-transformers reads them: said, since a wrong file still "works"
                log.warning("%s has no %s column: read (anchor, positive) from its columns %r, %r (anchor_column= / "
                            "positive_column= name others)", data, " or ".join(repr(r) for r in guessed),
                            anchor_column, positive_column)
        for column, out in ((anchor_column, anchors), (positive_column, positives)):
            value = record.values.get(column)
            if column not in record.values:
                raise DataError(f"{where(source, record.line, column)}: missing; the row has {sorted(record.values)}")
            if not isinstance(value, str) or not value.strip():
                raise DataError(f"{where(source, record.line, column)}: expected non-empty text, got {value!r}")
            out.append(value)
        check_relevant(source, record)
    if not anchors:
        raise DataError(f"{source}: the file has no (anchor, positive) rows")
    return anchors, positives, anchor_column, positive_column  # type: ignore[return-value]


def numbered_columns(names: Iterable[str], column: str = "negative") -> list[str]:
    """COLUMN_1, COLUMN_2, ... of a row with NAMES, up to the first missing number: the negatives of an n-tuple row
    (`output_format="n-tuple"`), as fine-tuning and evaluate read them back."""
    names = set(names)
    return list(itertools.takewhile(names.__contains__, (f"{column}_{i}" for i in itertools.count(1))))


def read_negatives(data: str | os.PathLike[str] | Source, negative_column: str = "negative") -> list[str]:
    """The hard negatives of DATA's rows, read as a sentence-embedding fine-tune reads them: a NEGATIVE_COLUMN (a text
    or a list of texts) or numbered ones (negative_1, ...); the first row says which, and every row then has them.
    [] for a file of pairs."""
    source = data if isinstance(data, Source) else Source(data)
    columns: list[str] | None = None
    negatives: list[str] = []
    for record in source.records():
        if columns is None:
            columns = ([negative_column] if negative_column in record.values
                       else numbered_columns(record.values, negative_column))
            if not columns:
                return []
        for column in columns:
            if column not in record.values:
                raise DataError(f"{where(source, record.line, column)}: missing; the row has {sorted(record.values)} "
                                "(the first row has it: every row needs its negatives)")
            negatives.extend(negative_texts(record.values[column], source, record.line, column))
    return negatives


def negative_texts(value: Any, source: Source | Path | str, line: int, column: str) -> list[str]:
    """A row's negatives field (one text or a list of texts) as its texts; an empty list or a text that is empty or
    no string is a DataError naming file, line and field. Shared with the sentence-embedding fine-tune's reader."""
    texts = value if isinstance(value, list) else [value]
    if not texts:
        raise DataError(f"{where(source, line, column)}: an empty list of negatives")
    for text in texts:
        if not isinstance(text, str) or not text.strip():
            raise DataError(f"{where(source, line, column)}: expected non-empty text (or a list of them), got "
                            f"{text!r}")
    return texts


def read_corpus(path: str | os.PathLike[str], column: str = "text") -> list[str]:
    """A corpus file's texts: a .txt file's non-empty lines (UTF-8, a byte-order mark read past as for every text
    file: left on the first text, it would make a positive there a distinct text, free to be mined as a negative), or
    a data file's `column` (CSV/TSV, JSONL, Parquet, Arrow, a datasets folder). A file without a text is an error: a
    corpus named but empty is a mistake (a wrong or unfinished file), not "no distractors" to go on without."""
    path = Path(path)
    if path.suffix.lower() == ".txt":
        try:
            texts = [line.rstrip("\r\n") for _, line in decoded_lines(path) if line.strip()]
        except OSError as e:
            raise DataError(f"{path}: {e.strerror or e}") from e
    else:
        source = Source(path)
        texts = []
        for record in source.records():
            value = record.values.get(column)
            if column not in record.values:
                raise DataError(f"{where(source, record.line, column)}: missing; the row has {sorted(record.values)} "
                                "(a corpus file is one text a line (.txt) or has a text column: corpus_column, "
                                "`mine --corpus-column`, `evaluate --set corpus_column=...`, names another)")
            if not isinstance(value, str) or not value.strip():
                raise DataError(f"{where(source, record.line, column)}: expected non-empty text, got {value!r}")
            texts.append(value)
    if not texts:
        raise DataError(f"{path}: the corpus file has no texts (a .txt file: one text a line; a data file: a "
                        f"{column!r} column)")
    return texts


def mine(model: Any, data: str | os.PathLike[str] | Iterable[tuple[str, str]], *,
         corpus: str | os.PathLike[str] | Sequence[str] | None = None, out: str | os.PathLike[str] | None = None,
         anchor_column: str | None = None, positive_column: str | None = None, corpus_column: str = "text",
         split: str = "train", **options: Any) -> MineResult:
    """`hfport mine`: hard negatives for the (anchor, positive) rows of DATA (a data file, a datasets folder (a
    DatasetDict's SPLIT), or (anchor, positive) tuples) from the positives and an optional CORPUS (a .txt file of one
    text a line, a data file with a `text` column, or a list of texts); written to OUT (.jsonl or .parquet) when
    given. OPTIONS: mine_hard_negatives'."""
    if out is not None:
        writable_kind(out, "the mined rows")  # a path that cannot be written fails now, not after the mining
    if isinstance(data, (str, os.PathLike)):
        anchors, positives, anchor_column, positive_column = read_pairs(Source(data, split, "split (mine --split)"),
                                                                         anchor_column, positive_column)
    else:
        pairs = list(data)
        anchors, positives = [a for a, _ in pairs], [p for _, p in pairs]
        anchor_column, positive_column = anchor_column or "anchor", positive_column or "positive"
    texts = read_corpus(corpus, corpus_column) if isinstance(corpus, (str, os.PathLike)) else corpus
    result = mine_hard_negatives(anchors, positives, model, corpus=texts, anchor_column=anchor_column,
                                 positive_column=positive_column, **options)
    if out is not None:
        if not result.rows:  # an empty file would only fail later, in the fine-tune that reads it
            raise ValueError(nothing_mined(result, out))
        result.write(out)
    return result


def nothing_mined(result: MineResult, out: str | os.PathLike[str]) -> str:
    """Why a mining found no row, for the error that writes nothing to OUT."""
    s = result.stats
    options = s["options"]
    why = (f"{s['queries']} queries among {s['corpus']} candidate texts (the corpus and the positives), "
           f"num_negatives {options['num_negatives']}, range_min {options['range_min']}, range_max "
           f"{options['range_max']}")
    if options["output_format"] == "n-tuple":
        why += " (n-tuple: a row only where all num_negatives are found)"
    if s["skipped"]:
        why += "; the filters dropped " + ", ".join(f"{c['skipped']:,} by {name} {options[name]}"
                                                   for name, c in s["skipped"].items())
    return (f"{out}: nothing written, no row was mined: {why}. Lower num_negatives or range_min, loosen the "
            "filters or give a larger corpus")
