"""Rerankers (text-ranking): a cross-encoder scores each (query, text) pair with one logit.

Data (JSONL/CSV; the column names are config fields):
  (query, text, label)            rows; a query's rows (wherever they are in the file) form its group, in the order
                                  of its first row. Labels lie in score_range (default [0, 1]: 1 relevant, 0 not;
                                  graded values allowed)
  (query, positive, negatives)    groups: one relevant text and a list of non-relevant ones (JSONL)
One example is one query with its candidates (batch_size counts queries). Losses:
  bce       binary cross-entropy on every pair, the label scaled to [0, 1] by score_range (CrossEncoder's default)
  listwise  softmax cross-entropy over each query's candidates against its labels normalised to sum to 1
Evaluation ranks each query's candidates by the model's score: MRR@10, NDCG@10 (the label as gain), Recall@1/@10.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ...errors import ConfigError
from ...formats.sentence_transformers import mark_cross_encoder
from ..data import (DataError, EncodedData, Features, LabelSpace, Record, Source, compact, data_sources, encoded_splits,
                    field_of, in_chunks, iter_records, number_in_range, pad_ids, source, text_id, where,
                    without_tokens)
from ..distill import squared_error
from ..grouped import gathered
from ..metrics import retrieval as metrics
from ..stored import collect, is_large
from . import TrainTask

LOSSES = ("bce", "listwise")


class Group:
    """One query and its candidates: texts, labels (in score_range) and the line each came from."""

    def __init__(self, query: str, line: int):
        self.query, self.line = query, line
        self.texts: list[str] = []
        self.labels: list[float] = []
        self.lines: list[int] = []


def _text(record: Record, column: str, path: Path) -> str:
    value = field_of(record, column, path)
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where(path, record.line, column)}: expected non-empty text, got {value!r}")
    return value


def _group_row(r: Record, config: Any, path: Path) -> Group:
    """A row with its query, positive and list of negatives: one example of its own, even if its query repeats."""
    low, high = config.score_range
    group = Group(_text(r, config.query_column, path), r.line)
    negatives = field_of(r, config.negatives_column, path)
    if not isinstance(negatives, list):
        raise DataError(f"{where(path, r.line, config.negatives_column)}: expected a list of texts, got "
                        f"{type(negatives).__name__}")
    candidates = [(_text(r, config.positive_column, path), high)]
    for n in negatives:
        if not isinstance(n, str) or not n.strip():
            raise DataError(f"{where(path, r.line, config.negatives_column)}: expected non-empty texts, got {n!r}")
        candidates.append((n, low))
    for text, label in candidates:
        group.texts.append(text)
        group.labels.append(label)
        group.lines.append(r.line)
    return group


def _scored_rows(records: Iterator[Record], config: Any, path: Path) -> Iterator[tuple[int, list[Any]]]:
    """(query's number, [query, text, label, line]) of each (query, text, label) row, checked."""
    for r in records:
        query = _text(r, config.query_column, path)
        text = _text(r, config.text_column, path)
        label = number_in_range(r, config.label_column, path, config.score_range, "label")
        yield text_id(query), [query, text, label, r.line]


def read_groups(path: Path | Source, config: Any) -> Iterator[Group]:
    """A source's groups: group rows (query, positive, negatives) streamed, one a row; (query, text, label) rows
    gathered by query, in the order of each query's first row (hfport/train/grouped.py: a large source's rows wait
    on disk, not in memory, until their query's group is read back)."""
    records = iter_records(path)
    head = next(records)
    records = itertools.chain([head], records)
    if config.negatives_column in head.values:
        yield from (_group_row(r, config, path) for r in records)
        return
    for rows in gathered(_scored_rows(records, config, path), spill=is_large(source(path))):
        query, _, _, line = rows[0]
        group = Group(query, line)
        for other, text, label, at in rows:
            if other != query:  # two queries with one 63-bit hash: never seen, but never merged unnoticed
                raise DataError(f"{where(path, at, config.query_column)}: query {other!r} has the hash of query "
                                f"{query!r} ({where(path, line)}); rename one of them")
            group.texts.append(text)
            group.labels.append(label)
            group.lines.append(at)
        yield group


def encode_groups(path: Path, config: Any, tokenizer: Any) -> Iterator[list[Features]]:
    """A source's groups encoded a chunk at a time (yielded as they are encoded): a (query, candidate) row each,
    the target the candidates' gains in [0, 1]."""
    low, high = config.score_range
    for chunk in in_chunks(read_groups(path, config)):
        out = []
        for g in chunk:
            enc = tokenizer([g.query] * len(g.texts), text_pair=g.texts, truncation=True,
                            max_length=config.max_length)
            types = enc.get("token_type_ids")
            longest = max(range(len(g.texts)), key=lambda i: len(enc["input_ids"][i]))
            gains = [(label - low) / (high - low) for label in g.labels]  # in [0, 1]
            out.append(Features(compact(enc["input_ids"][longest]), None, gains, (str(path), g.line),
                                {"tokens": enc["input_ids"], "types": types, "query": g.query}))
        yield out


class Reranking(TrainTask):
    name = "text-ranking"
    compute_metrics = staticmethod(metrics.compute)

    def read(self, config: Any, tokenizer: Any, model_id2label: dict[int, str] | None) -> EncodedData:
        loss = config.loss or "bce"
        if loss not in LOSSES:
            raise ConfigError(f"loss {loss!r} is not a text-ranking loss; use one of {list(LOSSES)} (mnrl and cosent "
                              "train sentence embeddings)")
        low, high = config.score_range
        train_path, eval_path = data_sources(config)
        settings = {"columns": [config.query_column, config.text_column, config.label_column,
                                config.positive_column, config.negatives_column],
                    "score_range": config.score_range, "max_length": config.max_length}

        def encoded(path: Source) -> Sequence[Features]:
            return collect(encode_groups(path, config, tokenizer), path, tokenizer, self.name, settings)

        train_features, eval_features = encoded_splits(encoded, train_path, eval_path, config)
        if loss == "listwise":
            for x in without_tokens(train_features):
                if len(x.target) < 2 or not any(x.target):
                    raise DataError(f"{where(x.source[0], x.source[1], config.query_column)}: the listwise loss needs "
                                    f"each query to have a relevant text and another candidate; query "
                                    f"{x.meta['query']!r} has {len(x.target)} candidate(s), "
                                    f"{sum(1 for t in x.target if t > 0)} relevant")
        for x in without_tokens(eval_features):  # an evaluation query with nothing relevant has no rank to score
            if not any(t > 0 for t in x.target):
                raise DataError(f"{where(x.source[0], x.source[1], config.query_column)}: evaluation query "
                                f"{x.meta['query']!r} has no relevant document among its {len(x.target)} "
                                f"candidate(s) (a label above {low})")
        # one label: the checkpoint is a one-logit sequence classifier, as sentence-transformers' CrossEncoder
        return EncodedData(train_features, eval_features, LabelSpace(None, {0: "LABEL_0"}), tokenizer.pad_token_id,
                           {"loss": loss})

    def collate(self, items: list[Features], data: EncodedData, seed: int) -> dict[str, torch.Tensor]:
        """Every candidate pair of the batch's queries, padded (N, T); labels (N,) in [0, 1]; groups (N,): each
        pair's query; positions (N,): its place among the query's candidates; slots (G, W) bool: the candidates'
        places per query, laid out on the host so the loss learns its (G, W) shape without reading the GPU."""
        pairs = [Features(ids, x.meta["types"][i] if x.meta["types"] is not None else None, None)
                 for x in items for i, ids in enumerate(x.meta["tokens"])]
        batch = pad_ids(pairs, data.pad_token_id)
        batch["labels"] = torch.tensor([g for x in items for g in x.target], dtype=torch.float)  # (N,)
        batch["groups"] = torch.tensor([b for b, x in enumerate(items) for _ in x.target], dtype=torch.long)  # (N,)
        batch["positions"] = torch.tensor([i for x in items for i in range(len(x.target))], dtype=torch.long)  # (N,)
        slots = torch.zeros(len(items), max(len(x.target) for x in items), dtype=torch.bool)  # (G, W)
        for b, x in enumerate(items):
            slots[b, :len(x.target)] = True
        batch["slots"] = slots
        return batch

    def loss(self, outputs: Any, batch: dict[str, torch.Tensor], data: EncodedData, class_weights: Any,
             label_smoothing: float) -> torch.Tensor:
        logits = outputs.logits.float().squeeze(-1)  # (N,)
        labels = batch["labels"]  # (N,)
        if data.extra["loss"] == "bce":
            return F.binary_cross_entropy_with_logits(logits, labels)
        groups, position = batch["groups"], batch["positions"]  # (N,), (N,)
        shape = batch["slots"].shape  # (G, W): a shape, no read from the GPU
        scores = logits.new_full(shape, float("-inf"))  # (G, W): padding never wins the softmax
        target = logits.new_zeros(shape)  # (G, W)
        scores[groups, position] = logits
        target[groups, position] = labels
        relevant = target.sum(-1, keepdim=True)  # (G, 1): a group with nothing relevant has no target distribution
        keep = relevant[:, 0] > 0  # (G,)
        target = target / relevant.clamp(min=torch.finfo(target.dtype).tiny)  # (G, W): 0 where nothing is relevant
        log_p = F.log_softmax(scores, dim=-1).masked_fill(target == 0, 0.0)  # 0 * -inf padding -> 0
        # the mean over the groups with a target (none: 0, with no gradient), as a sum over all of them: the rows
        # without one add exact zeros, and no boolean index makes the GPU report how many there are
        return -(target * log_p).sum(-1).sum() / keep.sum().clamp(min=1)

    def loss_count(self, batch: dict[str, torch.Tensor], data: EncodedData, class_weights: Any) -> Any:
        """bce: the pairs; listwise: the queries with a relevant candidate (the groups its mean is over)."""
        labels, groups = batch["labels"], batch["groups"]  # (N,), (N,)
        if data.extra["loss"] == "bce":
            return labels.shape[0]
        relevant = labels.new_zeros(batch["slots"].shape[0]).index_add_(0, groups, labels)  # (G,)
        return (relevant > 0).sum()  # ()

    # distillation (hfport/train/distill.py): a reranker teacher's logit for every pair (MSE, CrossEncoder's MSELoss)

    distillable = True

    def teacher_targets(self, outputs: Any, batch: dict[str, torch.Tensor], items: list[Features],
                        data: EncodedData) -> list[np.ndarray]:
        logits = outputs.logits.float().squeeze(-1).cpu().numpy()  # (N,)
        groups = batch["groups"].cpu().numpy()  # (N,)
        return [logits[groups == b] for b in range(len(items))]

    def distill_terms(self, outputs: Any, batch: dict[str, torch.Tensor], teacher: torch.Tensor, data: EncodedData,
                      temperature: float, companion: Any) -> tuple[torch.Tensor, torch.Tensor]:
        logits = outputs.logits.float()  # (N, 1)
        return squared_error(logits, teacher.view_as(logits)), batch["groups"]  # (N,), (N,)

    def eval_rows(self, outputs: Any, batch: dict[str, torch.Tensor], items: list[Features],
                  data: EncodedData) -> list[Any]:
        logits = outputs.logits.float().squeeze(-1).cpu().numpy()  # (N,)
        groups = batch["groups"].cpu().numpy()  # (N,)
        return [(logits[groups == b], np.asarray(x.target), f"{x.source[0]}:{x.source[1]}")
                for b, x in enumerate(items)]

    def sample_rows(self, data: EncodedData) -> list[Any]:
        return [(np.array([1.0, 0.0]), np.array([1.0, 0.0]), "sample:1")]  # a query's (N,) scores, (N,) gains

    def metrics(self, rows: list[Any], data: EncodedData, id2label: dict[int, str]) -> dict[str, float]:
        return metrics.ranking_metrics([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])

    def write_model_files(self, folder: Path, data: EncodedData) -> None:
        mark_cross_encoder(folder)  # CrossEncoder puts a sigmoid on the logit, as hfport's pipeline does
