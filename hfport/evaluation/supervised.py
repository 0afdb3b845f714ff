"""Evaluation the way fine-tuning evaluates: the task's own reader (hfport/train/tasks/), batches, forward pass,
evaluation rows and metrics, on a whole data file, with the model's own head and labels.

The data is read as a fine-tune reads its --eval file (every check, every error naming file, line and field); its
labels are then put in the model's label space by name (or by id, for data that gives ids), so a model whose labels
are ordered otherwise than the file's sorted names is scored on what it means. A label the model does not have is
an error naming it and the model's labels. A folder without the task's head (a base model, as `--compare BASE`
names it) gets a fresh head for the data's labels, as `finetune --eval-before` evaluates the base. The numbers equal
a fine-tune's evaluation lines on the same model and file (the loss too: the mean of each batch's loss, weighted by
its examples).

Per task, besides the metrics (DETAILS, keyed by the task's name): classification's per-class table and confusion
matrix (single-label; the table only for multi-label), token classification's per-type F1, the reranker's recall@k
and accuracy@k curves. The reranker's metrics are sentence-transformers' InformationRetrievalEvaluator set after
reranking each query's candidates (RERANKED_METRICS), of which fine-tuning reports mrr@10, ndcg@10, recall@1 and
recall@10, equal here.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from .. import hub, tasks
from ..errors import ConfigError
from ..formats.tables import DataError
from ..pipelines import check_dtype
from ..tokenizer import AutoTokenizer, has_tokenizer_files
from ..train.amp import float32_outputs
from ..train.config import FinetuneConfig, resolve_config
from ..train.data import EncodedData, LabelSpace, eval_batches, example_lengths, retarget, without_tokens
from ..train.metrics import (IR_CUTOFFS, confusion_matrix, multilabel_per_class_metrics, per_class_metrics,
                             ranked_metrics, ranking_metrics)
from .result import EvalResult

CURVE_KS = (1, 2, 3, 5, 10, 20, 50, 100)  # the recall@k and accuracy@k curves' points
# the fine-tune options that say how to read and encode evaluation data (FinetuneConfig's names; nothing that names
# a path or trains): what `evaluate` takes besides its own arguments. eval_split: a DatasetDict folder's split
OPTIONS = (*(f for f in FinetuneConfig.model_fields if f.endswith("_column")), "problem_type", "max_length",
           "label_all_subtokens", "doc_stride", "max_answer_length", "score_range", "loss", "scale", "pooling",
           "normalize", "matryoshka_dims", "mlm_probability", "max_batch_tokens", "group_by_length", "seed",
           "eval_split")


def label_map(data_labels: dict[int, str], model_labels: dict[int, str], where: str) -> dict[int, int]:
    """data label id -> model label id: by name where the model has every name, else by id where the data's names are
    the ids themselves ("0", "1", ...) and the model has them; otherwise an error naming what the model lacks."""
    by_name = {name: i for i, name in model_labels.items()}
    if all(name in by_name for name in data_labels.values()):
        return {i: by_name[name] for i, name in data_labels.items()}
    if all(name.isdigit() and int(name) in model_labels for name in data_labels.values()):
        return {i: int(name) for i, name in data_labels.items()}
    missing = sorted(name for name in data_labels.values() if name not in by_name)
    raise DataError(f"{where}: label(s) {missing} are not the model's; its labels are "
                    f"{[model_labels[i] for i in sorted(model_labels)]} (or give their ids)")


def _remap(target: Any, mapping: dict[int, int], problem_type: str | None, width: int) -> Any:
    """A target in the model's label ids: a class id, a multi-label 0/1 vector, or per-token ids (-100 kept)."""
    if problem_type == "multi_label_classification":
        out = [0.0] * width
        for i, v in enumerate(target):
            out[mapping[i]] = v
        return out
    if isinstance(target, (int, np.integer)):
        return mapping[int(target)]
    return [mapping[t] if t >= 0 else t for t in target]


LABELLED = ("text-classification", "token-classification")  # tasks whose targets are ids of the model's labels


def to_model_labels(data: EncodedData, model_labels: dict[int, str], where: str) -> None:
    """Put the evaluation examples' targets in the model's label space (in place) and make it data.space."""
    space = data.space
    if space is None or space.problem_type == "regression" or space.id2label == model_labels:
        return
    mapping = label_map(space.id2label, model_labels, where)
    if any(k != v for k, v in mapping.items()):
        retarget(data.eval, lambda x: _remap(x.target, mapping, space.problem_type, len(model_labels)))
    data.space = LabelSpace(space.problem_type, dict(model_labels))


# --- the details beside the metrics, per task --------------------------------------------------------------------


def _classification_details(rows: list[Any], data: EncodedData, names: list[str]) -> dict[str, Any]:
    predictions, labels = np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])
    if data.space.problem_type == "single_label_classification":
        classes, matrix = confusion_matrix(predictions, labels, label_names=names)
        return {"per_class": per_class_metrics(predictions, labels, label_names=names),
                "confusion": {"labels": classes, "matrix": matrix.tolist()}}
    if data.space.problem_type == "multi_label_classification":
        return {"per_class": multilabel_per_class_metrics(predictions, labels, label_names=names)}
    return {}


def _per_type_details(metrics: dict[str, float]) -> dict[str, Any]:
    return {"per_class": {k.split("/", 1)[1]: {"f1": v} for k, v in metrics.items() if k.startswith("f1/")}}


def _reranked(rows: list[Any]) -> tuple[list[np.ndarray], list[np.ndarray], list[str]]:
    """(each query's candidate gains ranked by the model's scores, its relevant gains, its name)."""
    ranked = [r[1][np.argsort(-r[0], kind="stable")] for r in rows]
    return ranked, [r[1][r[1] > 0] for r in rows], [r[2] for r in rows]


def reranked_metrics(rows: list[Any]) -> dict[str, float]:
    """InformationRetrievalEvaluator's metrics of each query's candidates ranked by the reranker."""
    return ranking_metrics([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], cutoffs=IR_CUTOFFS)


def curves(ranked: list[np.ndarray], ideal: list[np.ndarray], names: list[str] | None = None) -> dict[str, Any]:
    """recall@k and accuracy@k at CURVE_KS: the charts' curves."""
    values = ranked_metrics(ranked, ideal, {"recall": CURVE_KS, "accuracy": CURVE_KS}, names)
    return {m: {k: values[f"{m}@{k}"] for k in CURVE_KS} for m in ("recall", "accuracy")}


# task -> (rows, data, the model's label names, metrics) -> details
DETAILS: dict[str, Callable[[list[Any], EncodedData, list[str], dict[str, float]], dict[str, Any]]] = {
    "text-classification": lambda rows, data, names, metrics: _classification_details(rows, data, names),
    "token-classification": lambda rows, data, names, metrics: _per_type_details(metrics),
    "text-ranking": lambda rows, data, names, metrics: {"curves": curves(*_reranked(rows))},
}
# task -> (rows) -> metrics, where evaluation reports more than fine-tuning's evaluation does
METRICS: dict[str, Callable[[list[Any]], dict[str, float]]] = {"text-ranking": reranked_metrics}


# --- the run -----------------------------------------------------------------------------------------------------


def load(record: Any, model: str | os.PathLike[str], dtype: str | None, device: Any,
         **labels: Any) -> tuple[Any, Any]:
    """(model, tokenizer) of a folder (or an adapter folder over its base), as the pipelines load them. LABELS
    (id2label, problem_type): a fresh head for them, as fine-tuning builds its model."""
    loaded = record.model_class.from_pretrained(model, dtype=check_dtype(dtype) if dtype is not None else None,
                                                device=device, **labels)
    adapter = loaded.adapter
    source = model if adapter is None or has_tokenizer_files(model) or not isinstance(
        adapter.base, (str, os.PathLike)) else adapter.base
    return loaded.eval(), AutoTokenizer.from_pretrained(hub.resolve(source))


def evaluate_supervised(model: str | os.PathLike[str], data: str, task: str, *, corpus: str | None = None,
                        dtype: str | None = None, device: Any = None, batch_size: int | None = None,
                        cache: Any = None, progress: bool = True, **options: Any) -> EvalResult:
    """MODEL's metrics on DATA through TASK's fine-tuning reader and evaluation. OPTIONS: the fine-tune options that
    say how to read the data (text_column, label_column, max_length, eval_split, ...; FinetuneConfig's names).
    corpus and cache are sentence-embedding's (a corpus here is an error; nothing is cached)."""
    record = tasks.get(task)
    if corpus is not None:
        raise ConfigError(f"corpus: distractors are for sentence-embedding evaluation, not {record.name}")
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConfigError(f"{record.name} evaluation: unknown option(s) {unknown}; valid: {list(OPTIONS)}")
    loaded, tokenizer = load(record, model, dtype, device)
    # the file is read as a fine-tune reads its --eval (a DatasetDict folder: the eval_split on both sides)
    values = {"model": str(model), "task": record.name, "train": str(data), "eval": str(data), **options}
    if "eval_split" in options:
        values["train_split"] = options["eval_split"]
    if batch_size is not None:
        values["batch_size"] = batch_size
    config, _ = resolve_config(values, {}, "evaluate options")
    train_task = record.train_task
    encoded = train_task.read(config, tokenizer, dict(loaded.config.id2label))
    if not len(encoded.eval):
        raise DataError(f"{data}: no examples to evaluate")
    untrained = any(name.startswith("head.") for name in loaded.load_report.initialized)
    if untrained and encoded.space is not None:
        # a folder without the task's head (a base model, a fine-tune's --compare baseline): its head is built for the
        # data's labels as `finetune` builds it (drawn after the run's seed), so these are the figures
        # `finetune --eval-before` records at step 0, not an error about the default head's two labels
        loaded = fresh_head(record, model, dtype, device, encoded.space, config.seed)
    if record.name in LABELLED:
        to_model_labels(encoded, dict(loaded.config.id2label), str(data))
    rows, loss = eval_rows(train_task, loaded, encoded, config, progress)
    labels = dict(loaded.config.id2label)
    metric_fn = METRICS.get(record.name)
    metrics = metric_fn(rows) if metric_fn else train_task.metrics(rows, encoded, labels)
    names = [labels[i] for i in range(len(labels))]
    details = DETAILS[record.name](rows, encoded, names, metrics) if record.name in DETAILS else {}
    problem = encoded.space.problem_type if encoded.space else encoded.problem_type
    facts = {"dtype": str(loaded.dtype), "problem_type": problem,
             "labels": names if record.labels and len(names) > 1 else None,
             **({"head": "untrained (initialised fresh)"} if untrained else {})}
    return EvalResult(str(model), record.name, _count(encoded), {"loss": loss, **metrics}, details, facts)


def fresh_head(record: Any, model: str | os.PathLike[str], dtype: str | None, device: Any, space: LabelSpace,
               seed: int) -> Any:
    """MODEL with a fresh head for the data's label space, drawn as fine-tuning draws it (loop.build_model, after
    set_seed(seed)); the caller's random state is left as it was."""
    labels: dict[str, Any] = {"id2label": space.id2label, "ignore_mismatched_sizes": True}
    if space.problem_type:
        labels["problem_type"] = space.problem_type
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return load(record, model, dtype, device, **labels)[0]


def _count(data: EncodedData) -> int:
    """What the metrics average over: a question's windows count once."""
    examples = {x.meta.get("example", i) for i, x in enumerate(without_tokens(data.eval))}
    return len(examples)


@torch.no_grad()
def eval_rows(train_task: Any, model: Any, data: EncodedData, config: Any, progress: bool) -> tuple[list[Any], float]:
    """(the task's evaluation rows in file order, the mean loss), as Trainer.evaluate computes them on one process."""
    batches = eval_batches(list(range(len(data.eval))), example_lengths(data.eval), config.batch_size,
                           config.max_batch_tokens, config.group_by_length)
    rows: list[tuple[int, float, Any]] = []
    start = 0  # examples before this batch: the batch's corruption seed (fill-mask), as the loop seeds it
    bar = tqdm(total=len(data.eval), desc="evaluating", unit="example", disable=not progress, dynamic_ncols=True)
    try:
        for idx in batches:
            items = [data.eval[i] for i in idx]
            batch = train_task.collate(items, data, seed=config.seed + start)
            batch = {k: v.to(model.device) for k, v in batch.items()}
            start += len(idx)
            outputs = float32_outputs(train_task.forward(model, batch, data))
            loss = float(train_task.loss(outputs, batch, data, None, 0.0))
            rows += [(i, loss, row) for i, row in zip(idx, train_task.eval_rows(outputs, batch, items, data))]
            bar.update(len(idx))
    except RuntimeError as e:
        raise ConfigError(f"the model failed on the data: {e}") from e
    finally:
        bar.close()
    rows.sort(key=lambda r: r[0])
    return [r[2] for r in rows], sum(r[1] for r in rows) / len(rows)
