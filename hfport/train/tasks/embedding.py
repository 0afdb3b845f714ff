"""Sentence embeddings: the bare encoder + pooling, trained on text pairs as sentence-transformers trains them.

Data (JSONL/CSV; the column names are config fields):
  (anchor, positive)              pairs; loss mnrl: in-batch negatives (MultipleNegativesRankingLoss)
  (anchor, positive, negative)    triplets; the negative (a text or a list of texts) is a hard negative for mnrl
  (anchor, positive, negative_1, ..., negative_n)  n-tuples, as sentence-transformers' mine_hard_negatives (and
                                  `hfport mine`) write them: the numbered columns are the hard negatives
  (sentence1, sentence2, score)   scored pairs; loss cosent (CoSENTLoss), scores within score_range
The format is the first row's: a file whose first row has the negative column must have it in every row.

A batch is encoded as its distinct texts, once each (B examples -> U <= B*k texts in one forward pass). Dropping
duplicates is also how the loss keeps them from being each other's negatives (see `mnrl_loss`).

In-batch negatives and accumulation: with grad_accum > 1 each micro-batch is its own loss with its own negatives, so
the negatives per anchor are batch_size - 1 (+ hard ones), not batch_size * grad_accum - 1. To score a large batch
against all of its negatives with bounded memory, use a large batch_size with mini_batch_size (GradCache, below).
Matryoshka (matryoshka_dims, matryoshka_weights): sentence-transformers' MatryoshkaLoss, the loss summed over the
embeddings' first n values, renormalized, for each n (weighted); evaluation reports every n as dim_<n>_<metric>
beside the full size's metrics, and best/ and final/ record the dimensions (config_sentence_transformers.json).
Several processes: each scores its own share of the global batch's negatives, unless gather_across_devices is on;
then every process's embeddings are gathered (gradients flow back to the process that computed them) and each
anchor is scored against the whole global micro-batch, texts repeated across processes counted once, equal to one
process with the global batch.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ... import hub
from ...errors import ConfigError
from ...formats.sentence_transformers import has_embedding_layout, read_st_pooling, write_embedding_layout
from ...heads import pool
from ...retrieval import check_relevant, negative_texts, numbered_columns
from ..data import (DataError, EncodedData, Features, Record, Source, compact, data_sources, field_of, in_chunks,
                    iter_records, number_in_range, pad_ids, split_off, text_id, where)
from ..distill import margin_mse, squared_error

from ..metrics import retrieval as metrics
from ..stored import collect
from . import TrainTask

LOSSES = {"pairs": ("mnrl",), "scored-pairs": ("cosent",)}  # the data's kind -> the losses that fit it
DEFAULT_SCALE = 20.0  # of cosine similarities (sentence-transformers' MNRL and CoSENT default)


# --- the losses -------------------------------------------------------------------------------------------------


def cosine_matrix(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(N, C), (M, C) -> (N, M) cosine similarities (sentence-transformers' cos_sim)."""
    return F.normalize(a, p=2, dim=-1) @ F.normalize(b, p=2, dim=-1).T


def mnrl_loss(embeddings: torch.Tensor, index: torch.Tensor, scale: float, own: slice = slice(None),
              similarity: Any = None) -> torch.Tensor:
    """MultipleNegativesRankingLoss over a batch of distinct texts.

    embeddings (U, C): one row per distinct text of the batch; index (B, K): row of each example's anchor (column 0),
    positive (1) and hard negatives (2..; -1 where an example has fewer). Each anchor is scored against every
    distinct positive and negative text of the batch (cosine x scale) and must pick its own positive (cross-entropy).
    `own`: the examples whose anchors this call scores (a process's share of a gathered global batch; default all).
    `similarity`: (N, C), (M, C) -> (N, M); cosine by default (SparseMultipleNegativesRankingLoss: the dot product).

    Duplicates: a text that appears twice is one candidate, so an example's positive repeated as another's is not a
    negative of itself; and where two examples share an anchor, each one's positive is masked out of the other's
    negatives (both are relevant to that anchor).

    Every text is a column, those that are no candidate (anchors only) at -inf, so no shape depends on the data:
    the GPU never has to report how many candidates there are (the same softmax over the same candidates, in the
    same order, as over the distinct candidates alone).
    """
    u = embeddings.shape[0]
    anchors, positives = index[:, 0], index[:, 1]  # (B,), (B,)
    slots = index[:, 1:]  # (B, K-1); -1: no such negative
    named = torch.zeros(u + 1, dtype=torch.bool, device=index.device)  # (U + 1,): the last row takes the -1s
    named[torch.where(slots >= 0, slots, u).flatten()] = True
    scores = (similarity or cosine_matrix)(embeddings[anchors[own]], embeddings) * scale  # (b, U)
    same_anchor = anchors[own, None] == anchors[None, :]  # (b, B)
    other = same_anchor & (positives[None, :] != positives[own, None])  # (b, B): j's positive is also relevant to i
    # (b, U): texts that are no candidate, and positives relevant to i through another example of its anchor
    relevant = torch.zeros(scores.shape, dtype=torch.long, device=index.device).scatter_reduce_(
        1, positives[None, :].expand_as(other), other.long(), "amax")
    mask = relevant.bool() | ~named[None, :u]
    return F.cross_entropy(scores.masked_fill(mask, float("-inf")), positives[own])


def shrink(embeddings: torch.Tensor, dim: int) -> torch.Tensor:
    """(U, C) -> (U, dim): the first `dim` values, L2-renormalized (sentence-transformers' Matryoshka shrink)."""
    return F.normalize(embeddings[..., :dim], p=2, dim=-1)


def matryoshka_loss(loss: Any, embeddings: torch.Tensor, dims: list[int], weights: list[float]) -> torch.Tensor:
    """MatryoshkaLoss: sum over n of weight_n * loss(the embeddings shrunk to n values). `loss`: (U, n) -> ()."""
    return sum(w * loss(shrink(embeddings, d)) for d, w in zip(dims, weights))  # type: ignore[return-value]


def cosent_loss(embeddings: torch.Tensor, index: torch.Tensor, scores: torch.Tensor, scale: float) -> torch.Tensor:
    """CoSENTLoss (sentence-transformers'): log(1 + sum over pairs (i, j) with score_i < score_j of
    exp(scale * (cos_i - cos_j))). embeddings (U, C); index (B, 2) rows of sentence1/sentence2; scores (B,)."""
    a, b = embeddings[index[:, 0]], embeddings[index[:, 1]]  # (B, C) each
    cos = F.cosine_similarity(a, b, dim=-1) * scale  # (B,)
    diff = cos[:, None] - cos[None, :]  # (B, B)
    lower = (scores[:, None] < scores[None, :]).to(diff.dtype)  # (B, B): pairs that should be ordered the other way
    diff = diff - (1 - lower) * 1e12
    return torch.logsumexp(torch.cat([diff.new_zeros(1), diff.flatten()]), dim=0)


# --- negatives across processes (gather_across_devices) ----------------------------------------------------------


def _gather_padded(tensor: torch.Tensor, fill: float) -> list[torch.Tensor]:
    """Every process's `tensor` (same rank, any shape), in rank order: all_gather needs one shape, so each is padded
    to the largest with `fill` and cut back after."""
    world = dist.get_world_size()
    shape = torch.tensor(tensor.shape, device=tensor.device)  # (D,)
    shapes = [torch.empty_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape)
    sizes = [tuple(s.tolist()) for s in shapes]
    largest = [max(dims) for dims in zip(*sizes)]
    padded = tensor.new_full(largest, fill)
    padded[tuple(slice(0, n) for n in tensor.shape)] = tensor
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded.contiguous())
    return [p[tuple(slice(0, n) for n in size)] for p, size in zip(parts, sizes)]


class _GatherRows(torch.autograd.Function):
    """(U_r, C) on each process -> (U_1 + ... + U_W, C) on every one. Backward: every process's loss reads every
    row, so each row's gradient is summed over the processes (an all-reduce) and each process keeps its own rows'."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor) -> torch.Tensor:
        parts = _gather_padded(local, 0.0)
        ctx.start, ctx.rows = sum(len(p) for p in parts[:dist.get_rank()]), len(local)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()  # (U_total, C)
        dist.all_reduce(grad)
        return grad[ctx.start:ctx.start + ctx.rows]


def gather_batch(embeddings: torch.Tensor, text_ids: torch.Tensor,
                 index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, slice]:
    """The global batch from every process's share: (embeddings (U_total, C), index (B_total, K) into them, this
    process's examples). A text held by several processes is one candidate, as in one process's batch: every
    index points at its first row (the other copies, equal, get no gradient; DDP sums parameter gradients anyway).

    embeddings (U, C), text_ids (U,): the text each row encodes; index (B, K) as in mnrl_loss."""
    rows = _GatherRows.apply(embeddings)  # (U_total, C)
    id_parts = _gather_padded(text_ids, -1)  # [(U_r,)]
    ids = torch.cat(id_parts)  # (U_total,)
    _, inverse = torch.unique(ids, return_inverse=True)  # (U_total,): each row's distinct text
    position = torch.arange(len(ids), device=ids.device)  # (U_total,)
    first = torch.full((int(inverse.max()) + 1,), len(ids), device=ids.device).scatter_reduce(
        0, inverse, position, "amin")  # (distinct,): each distinct text's first row
    indexes = _gather_padded(index, -1)  # [(B_r, K_r)]
    width = max(i.shape[1] for i in indexes)
    merged, offset = [], 0
    for local, texts in zip(indexes, id_parts):
        padded = local.new_full((local.shape[0], width), -1)  # (B_r, K)
        padded[:, :local.shape[1]] = local
        merged.append(torch.where(padded >= 0, first[inverse[(padded + offset).clamp(min=0)]], -1))  # (B_r, K)
        offset += len(texts)
    start = sum(len(i) for i in indexes[:dist.get_rank()])
    return rows, torch.cat(merged), slice(start, start + len(index))


def gathered(embeddings: torch.Tensor, batch: dict[str, torch.Tensor],
             data: EncodedData) -> tuple[torch.Tensor, torch.Tensor, slice]:
    """(embeddings, index, own) for an in-batch loss: with gather_across_devices, while training under several
    processes, the global micro-batch's (gather_batch); else this process's batch as it is. Evaluation never gathers:
    its batches are each process's own, and their counts may differ between processes."""
    if data.extra.get("gather") and torch.is_grad_enabled() and dist.is_initialized() and dist.get_world_size() > 1:
        return gather_batch(embeddings, batch["text_ids"], batch["labels"])
    return embeddings, batch["labels"], slice(None)


# --- reading ----------------------------------------------------------------------------------------------------


def _text(record: Record, column: str, path: Path) -> str:
    value = field_of(record, column, path)
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where(path, record.line, column)}: expected non-empty text, got {value!r}")
    return value


def _negatives(record: Record, column: str, path: Path) -> list[str]:
    return negative_texts(field_of(record, column, path), path, record.line, column)


Row = tuple[list[str], "float | None", int]  # (texts, score, line)


def read_examples(path: Path, config: Any) -> tuple[str, bool, Iterator[Row]]:
    """(kind, hard negatives, the rows streamed as (texts, score, line)): kind "pairs" (texts = anchor, positive,
    negatives...) or "scored-pairs" (texts = sentence1, sentence2; score within score_range). The first row decides
    the kind, and whether every row has hard negatives."""
    records = iter_records(path)
    head = next(records)
    first = head.values
    scored = config.loss == "cosent" or (config.loss is None and config.sentence1_column in first
                                         and config.anchor_column not in first)
    if not scored and config.anchor_column not in first:
        raise DataError(f"{where(path, head.line)}: neither an anchor column ({config.anchor_column!r}, for "
                        f"pairs and triplets) nor a sentence1 column ({config.sentence1_column!r}, for scored pairs); "
                        f"the row has {sorted(first)}")
    # n-tuples: negative_1, negative_2, ... (the columns with that name and the following numbers)
    numbered = [] if config.negative_column in first else numbered_columns(first, config.negative_column)
    triplets = not scored and (config.negative_column in first or bool(numbered))

    def rows() -> Iterator[Row]:
        for r in itertools.chain([head], records):
            if scored:
                texts = [_text(r, config.sentence1_column, path), _text(r, config.sentence2_column, path)]
                yield texts, number_in_range(r, config.score_column, path, config.score_range, "score"), r.line
                continue
            texts = [_text(r, config.anchor_column, path), _text(r, config.positive_column, path)]
            check_relevant(path, r)  # a labeled-pair file's negatives would train as positives
            if triplets:  # a triplet file: every row has its negative (field_of names a missing one)
                texts += ([_text(r, column, path) for column in numbered] if numbered
                          else _negatives(r, config.negative_column, path))
            yield texts, None, r.line

    return ("scored-pairs" if scored else "pairs"), triplets, rows()


def encode_examples(path: Path, rows: Iterable[Row], tokenizer: Any, max_length: int) -> Iterator[list[Features]]:
    """Examples encoded a chunk at a time (yielded as they are encoded), each distinct text of a chunk tokenized
    once; the target is the score (None for pairs), meta the texts' numbers, tokens and type ids."""
    for chunk in in_chunks(rows):
        distinct = list(dict.fromkeys(t for texts, _, _ in chunk for t in texts))
        number = {t: i for i, t in enumerate(distinct)}
        enc = tokenizer(distinct, truncation=True, max_length=max_length)
        types = enc.get("token_type_ids")
        out = []
        for texts, score, line in chunk:
            ids = [number[t] for t in texts]
            longest = max(ids, key=lambda i: len(enc["input_ids"][i]))  # what length grouping sorts by
            out.append(Features(compact(enc["input_ids"][longest]), None, score, (str(path), line),
                                {"ids": [text_id(t) for t in texts], "tokens": [enc["input_ids"][i] for i in ids],
                                 "types": [types[i] for i in ids] if types is not None else None}))
        yield out


def pooling_defaults(config: Any, source: Path) -> tuple[str, bool]:
    """--pooling/--normalize, else the base model's sentence-transformers config, else mean and no normalisation."""
    base = read_st_pooling(source) if has_embedding_layout(source) else ("mean", False)
    return config.pooling or base[0], base[1] if config.normalize is None else config.normalize


# --- the task ---------------------------------------------------------------------------------------------------


class SentenceEmbedding(TrainTask):
    name = "sentence-embedding"
    compute_metrics = staticmethod(metrics.compute)
    default_scale = DEFAULT_SCALE

    def read(self, config: Any, tokenizer: Any, model_id2label: dict[int, str] | None) -> EncodedData:
        train_path, eval_path = data_sources(config)
        kind, hard_negatives, train = read_examples(train_path, config)
        if eval_path is not None:
            eval_kind, _, evaluation = read_examples(eval_path, config)
            if eval_kind != kind:
                raise DataError(f"{eval_path}: {eval_kind} rows, but {train_path} holds {kind}; evaluate on the "
                                "kind of data the model trains on")
        loss = config.loss or LOSSES[kind][0]
        if loss not in LOSSES[kind]:
            raise ConfigError(f"loss {loss!r} does not fit {kind} data ({train_path}); use one of {list(LOSSES[kind])}"
                              + ("" if loss in ("mnrl", "cosent") else " (bce and listwise are text-ranking losses)"))
        if config.gather_across_devices and loss != "mnrl":
            raise ConfigError(f"gather_across_devices shares in-batch negatives across processes: it is for the mnrl "
                              f"loss, not {loss!r}")
        if loss == "mnrl" and config.batch_size == 1 and not hard_negatives:
            raise ConfigError("batch_size 1 gives no in-batch negatives: each anchor would be scored against its "
                              "own positive only; use batch_size >= 2 (the larger, the more negatives)")
        source = hub.resolve(config.model)
        pooling, normalize = pooling_defaults(config, source)
        raw, _ = hub.read_config(source)
        dims = list(config.matryoshka_dims or [])
        too_large = [d for d in dims if d > int(raw.get("hidden_size") or 0)]
        if too_large:
            raise ConfigError(f"matryoshka_dims {too_large}: larger than the model's embeddings "
                              f"({raw.get('hidden_size')} values)")

        settings = {"columns": [config.anchor_column, config.positive_column, config.negative_column,
                                config.sentence1_column, config.sentence2_column, config.score_column],
                    "kind": kind, "score_range": config.score_range, "max_length": config.max_length}

        def encoded(path: Source, rows: Iterator[Row]) -> Sequence[Features]:
            return collect(encode_examples(path, rows, tokenizer, config.max_length), path, tokenizer, self.name,
                           settings)

        train_features = encoded(train_path, train)
        if eval_path is None:
            train_features, eval_features = split_off(train_features, config.eval_fraction, config.seed)
        else:
            eval_features = encoded(eval_path, evaluation)
        extra = {"loss": loss, "scale": config.scale or self.default_scale, "pooling": pooling, "normalize": normalize,
                 "mini_batch_size": config.mini_batch_size, "gather": config.gather_across_devices,
                 "triplets": hard_negatives,
                 "hidden_size": raw.get("hidden_size"), "matryoshka_dims": dims,
                 "matryoshka_weights": list(config.matryoshka_weights or [1.0] * len(dims)),
                 "max_length": min(config.max_length, int(raw.get("max_position_embeddings", config.max_length)))}
        return EncodedData(train_features, eval_features, None, tokenizer.pad_token_id, extra, problem_type=kind)

    def collate(self, items: list[Features], data: EncodedData, seed: int) -> dict[str, torch.Tensor]:
        """The batch's distinct texts, padded (U, T), and `labels` (B, K): each example's texts as rows of them."""
        rows: dict[int, int] = {}
        texts: list[Features] = []
        width = max(len(x.meta["ids"]) for x in items)
        index = torch.full((len(items), width), -1, dtype=torch.long)  # (B, K)
        for b, x in enumerate(items):
            for k, number in enumerate(x.meta["ids"]):  # the text's number (data.text_id)
                if number not in rows:
                    rows[number] = len(texts)
                    types = x.meta["types"][k] if x.meta["types"] is not None else None
                    texts.append(Features(x.meta["tokens"][k], types, None))
                index[b, k] = rows[number]
        batch = pad_ids(texts, data.pad_token_id)
        batch["labels"] = index
        batch["text_ids"] = torch.tensor(list(rows), dtype=torch.long)  # (U,): the text of each row, by number
        if data.problem_type == "scored-pairs":
            batch["scores"] = torch.tensor([x.target for x in items], dtype=torch.float)  # (B,)
        return batch

    def forward(self, model: Any, batch: dict[str, torch.Tensor], data: EncodedData) -> torch.Tensor:
        """(U, C) embeddings of the batch's distinct texts. With mini_batch_size and gradients on, GradCache: each
        chunk runs without keeping its activations (torch.utils.checkpoint), the loss sees every embedding, and the
        backward pass re-runs one chunk at a time with its embeddings' gradient."""
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids") if k in batch}

        def embed(*tensors: torch.Tensor) -> torch.Tensor:
            return self.embed(model, data, dict(zip(inputs, tensors)))

        chunk = data.extra.get("mini_batch_size")
        n = batch["input_ids"].shape[0]
        if not chunk or n <= chunk or not torch.is_grad_enabled():
            return embed(*inputs.values())
        parts = []
        for start in range(0, n, chunk):
            sub = [t[start:start + chunk] for t in inputs.values()]
            longest = int(sub[list(inputs).index("attention_mask")].sum(1).max())  # trim the chunk's own padding
            sub = [t[:, :longest] for t in sub]
            parts.append(checkpoint(embed, *sub, use_reentrant=False))  # (n_chunk, C)
        return torch.cat(parts)  # (U, C)

    def embed(self, model: Any, data: EncodedData, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """(n, T) inputs -> (n, C) embeddings: the encoder's states pooled (and normalized) as the run says."""
        hidden = model(**inputs).last_hidden_state  # (n, T, C)
        out = pool(hidden, inputs["attention_mask"], data.extra["pooling"])  # (n, C)
        return F.normalize(out, p=2, dim=-1) if data.extra["normalize"] else out

    def write_model_files(self, folder: Path, data: EncodedData) -> None:
        """best/ and final/ in the sentence-transformers layout: the pooling and normalisation the run trained with."""
        write_embedding_layout(folder, pooling=data.extra["pooling"], normalize=data.extra["normalize"],
                               hidden_size=data.extra["hidden_size"], max_seq_length=data.extra["max_length"],
                               matryoshka_dims=data.extra.get("matryoshka_dims", ()))

    def loss(self, outputs: Any, batch: dict[str, torch.Tensor], data: EncodedData, class_weights: Any,
             label_smoothing: float) -> torch.Tensor:
        embeddings = outputs.float()  # (U, C)
        scale, index, own = data.extra["scale"], batch["labels"], slice(None)
        if data.extra["loss"] == "cosent":
            def loss(e: torch.Tensor) -> torch.Tensor:
                return cosent_loss(e, index, batch["scores"], scale)
        else:
            embeddings, index, own = gathered(embeddings, batch, data)  # own anchors, the negatives of all

            def loss(e: torch.Tensor) -> torch.Tensor:
                return mnrl_loss(e, index, scale, own)
        if data.extra.get("matryoshka_dims"):
            return matryoshka_loss(loss, embeddings, data.extra["matryoshka_dims"], data.extra["matryoshka_weights"])
        return loss(embeddings)

    def loss_count(self, batch: dict[str, torch.Tensor], data: EncodedData, class_weights: Any) -> Any:
        return batch["labels"].shape[0]  # the examples (anchors), not the distinct texts encoded

    # distillation (hfport/train/distill.py): the teacher's embeddings of every text (MSE), or for rows with hard
    # negatives its dot-product scores of the positive and the negatives (MarginMSE)

    distillable = True

    def teacher_data(self, data: EncodedData, teacher: Path) -> EncodedData:
        """The teacher embeds as its own sentence-transformers config says (else mean pooling, not normalized), in
        one pass per batch."""
        pooling, normalize = read_st_pooling(teacher) if has_embedding_layout(teacher) else ("mean", False)
        return dataclasses.replace(data, extra={**data.extra, "pooling": pooling, "normalize": normalize,
                                                "mini_batch_size": None})

    def teacher_targets(self, outputs: Any, batch: dict[str, torch.Tensor], items: list[Features],
                        data: EncodedData) -> list[np.ndarray]:
        """Per example: the dot products of its anchor with its positive and negatives (k,) (triplets), else the
        embeddings of its texts (k, C)."""
        embeddings, index = outputs.float(), batch["labels"]  # (U, C), (B, K)
        out = []
        for b, x in enumerate(items):
            texts = embeddings[index[b, :len(x.meta["ids"])]]  # (k, C)
            out.append((texts[1:] @ texts[0] if data.extra["triplets"] else texts).cpu().numpy())
        return out

    def distill_terms(self, outputs: Any, batch: dict[str, torch.Tensor], teacher: torch.Tensor, data: EncodedData,
                      temperature: float, companion: Any) -> tuple[torch.Tensor, torch.Tensor]:
        embeddings, index = outputs.float(), batch["labels"]  # (U, C), (B, K)
        valid = index >= 0  # (B, K): a row with fewer texts is padded with -1
        texts = embeddings[index.clamp(min=0)]  # (B, K, C)
        rows = torch.arange(len(index), device=index.device)  # (B,)
        if data.extra["triplets"]:  # MarginMSELoss, its default similarity (the dot product)
            scores = (texts[:, 1:] @ texts[:, 0, :, None]).squeeze(-1)  # (B, K-1)
            target = scores.new_zeros(scores.shape).masked_scatter(valid[:, 1:], teacher)  # (B, K-1)
            return margin_mse(scores, target, valid[:, 1:]), rows
        if companion is not None:  # to the teacher's width (sentence-transformers' MSELoss projection_dim)
            texts = companion(texts).float()  # (B, K, C_teacher)
        target = texts.new_zeros(texts.shape).masked_scatter(valid[..., None], teacher)  # (B, K, C_teacher)
        per_text = squared_error(texts, target)  # (B, K)
        return (per_text * valid).sum(-1) / valid.sum(-1), rows  # (B,): the mean over the row's texts

    def distill_units(self, batch: dict[str, torch.Tensor], data: EncodedData) -> Any:
        return batch["labels"].shape[0]  # the examples

    def distill_companion(self, data: EncodedData, teacher_width: int, seed: int) -> torch.nn.Module | None:
        """A student narrower or wider than the teacher learns its embeddings through nn.Linear(student, teacher)
        (initialised as torch does, from SEED, the global generator untouched), as sentence-transformers' MSELoss
        with projection_dim; margins are scores, of any width."""
        width = data.extra["hidden_size"]
        if data.extra["triplets"] or width == teacher_width:
            return None
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return torch.nn.Linear(width, teacher_width)

    def unused_modules(self, model: Any) -> list[str]:
        """The encoder's pooler: the embedding pools last_hidden_state itself. Frozen, it keeps the source's weights,
        so best/ and final/ stay complete BertModel-style folders."""
        return ["body.pooler"] if getattr(model.body, "pooler", None) is not None else []

    def eval_rows(self, outputs: Any, batch: dict[str, torch.Tensor], items: list[Features],
                  data: EncodedData) -> list[Any]:
        """(text ids, their embeddings (k, C), score) per example."""
        embeddings = outputs.float().cpu().numpy()  # (U, C)
        index = batch["labels"].cpu().numpy()  # (B, K)
        return [(x.meta["ids"], embeddings[index[b, :len(x.meta["ids"])]], x.target, x.source)
                for b, x in enumerate(items)]

    def sample_rows(self, data: EncodedData) -> list[Any]:
        width = max([2, *(data.extra.get("matryoshka_dims") or ())])  # every matryoshka dimension can be cut off
        near, far = np.eye(2, width)[[0, 0]], np.eye(2, width)  # (2, C): an anchor and its positive
        return [((0, 2), near, 1.0, ("sample", 1)), ((1, 3), far, 0.0, ("sample", 2))]

    def metrics(self, rows: list[Any], data: EncodedData, id2label: dict[int, str]) -> dict[str, float]:
        """The full embeddings' metrics, and with matryoshka_dims each dimension's as dim_<n>_<metric>."""
        out = self.metrics_at(rows, data, None)
        for dim in data.extra.get("matryoshka_dims") or ():
            out |= {f"dim_{dim}_{k}": v for k, v in self.metrics_at(rows, data, dim).items()}
        return out

    def metrics_at(self, rows: list[Any], data: EncodedData, dim: int | None) -> dict[str, float]:
        """Metrics of the embeddings' first `dim` values (all: None); cosine renormalizes them, as shrink does."""
        if dim is not None:
            rows = [(r[0], r[1][:, :dim], *r[2:]) for r in rows]
        if data.problem_type == "scored-pairs":
            a = np.stack([r[1][0] for r in rows])  # (N, C)
            b = np.stack([r[1][1] for r in rows])  # (N, C)
            cos = (a * b).sum(-1) / np.clip(np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1), 1e-12, None)
            return metrics.correlation_metrics(cos, [r[2] for r in rows])
        return retrieval_from_rows(rows)


def retrieval_from_rows(rows: list[Any]) -> dict[str, float]:
    """The eval file as a retrieval benchmark ranked by cosine similarity (retrieval_sets)."""
    queries, corpus, relevant, names = retrieval_sets(rows)
    return metrics.retrieval_metrics(np.stack(queries), np.stack(corpus), relevant, names)


def retrieval_sets(rows: list[Any]) -> tuple[list[Any], list[Any], list[list[int]], list[str]]:
    """(the queries' vectors, the corpus's vectors, each query's relevant corpus rows, the queries' sources): the
    eval file as a retrieval benchmark, each text's vector as eval_rows kept it. Its distinct anchors are the queries,
    its distinct positive and negative texts the corpus, and each anchor's positives (over every row it appears in)
    its relevant documents."""
    corpus: dict[int, int] = {}  # text id -> corpus row
    corpus_vectors, queries, query_vectors, relevant, names = [], {}, [], [], []
    for ids, vectors, _, source in rows:
        for k in range(1, len(ids)):
            if ids[k] not in corpus:
                corpus[ids[k]] = len(corpus_vectors)
                corpus_vectors.append(vectors[k])
        if ids[0] not in queries:
            queries[ids[0]] = len(query_vectors)
            query_vectors.append(vectors[0])
            relevant.append(set())
            names.append(f"{source[0]}:{source[1]}")
        relevant[queries[ids[0]]].add(corpus[ids[1]])
    return query_vectors, corpus_vectors, [sorted(r) for r in relevant], names
