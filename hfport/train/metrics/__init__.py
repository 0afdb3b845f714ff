"""Evaluation metrics, one module a task, plus metric history and early stopping (stopping.py).

classification.py (text-classification), tokens.py (token-classification), qa.py (question-answering),
mlm.py (fill-mask), retrieval.py (sentence-embedding, text-ranking); each has a `compute` that its training task (hfport/train/tasks/) calls.

Pure functions over numpy arrays / Python lists (torch CPU tensors work too: they go through `np.asarray`).
No sklearn or seqeval at run time; the tests cross-check against both where they are installed.

Conventions
- Argument order is always `(predictions, labels)` (the order of transformers' `EvalPrediction`), not
  sklearn's `(y_true, y_pred)`.
- Every score is a fraction in [0, 1], SQuAD included (the official script prints 100x).
- Zero division is 0, as sklearn's `zero_division=0`: a label with no true and no predicted items scores
  precision = recall = F1 = 0 and still counts in macro averages.
- Empty inputs raise ValueError naming the argument; inputs of different lengths raise ValueError naming
  both lengths.
- R² follows sklearn's `r2_score`: a constant target scores 1.0 if predicted exactly, else 0.0.

Keys of `compute_metrics` (a flat `dict[str, float]`; tasks by any of their names, e.g. the old
sequence-classification and masked-lm). The f1/<...> keys are stable across evals only for a
fixed label set: pass num_labels or label_names for classification; entity types are those seen in the data.
- text-classification / single_label_classification:
  accuracy, f1_macro, f1_micro, precision_macro, precision_micro, recall_macro, recall_micro, f1/<label>
- text-classification / multi_label_classification:
  exact_match and accuracy (both subset accuracy, as sklearn's accuracy_score), f1_macro, f1_micro,
  precision_macro, precision_micro, recall_macro, recall_micro, f1/<label>
- text-classification / regression: mse, mae, r2
- token-classification: precision, recall, f1 (entity level, micro), accuracy (token level), f1/<entity type>
- question-answering: exact_match, f1
- sentence-embedding (pairs, triplets) / text-ranking: mrr@10, ndcg@10, recall@1, recall@10 (retrieval.py; its
  ranked_metrics also gives InformationRetrievalEvaluator's accuracy@k, precision@k and map@k, as `hfport evaluate`);
  sentence-embedding with scored pairs (problem_type "scored-pairs"): spearman, pearson
- fill-mask: loss, perplexity; accuracy (over non-ignored positions) when predictions and labels are given
  (without `loss`, the loss is computed from the logits, every masked token weighing the same)
`<label>` is the label name when names are given, else the label id as a string.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ...tasks import get as task_record
from .base import ArrayLike, Mode
from .classification import (PROBLEM_TYPES, accuracy, classification_metrics, confusion_matrix, infer_problem_type,
                             multilabel_metrics, multilabel_per_class_metrics, multilabel_per_label_f1,
                             per_class_metrics, per_label_f1, precision_recall_f1, regression_metrics)
from .mlm import masked_accuracy, masked_lm_loss, perplexity
from .retrieval import IR_CUTOFFS, correlation_metrics, ranked_metrics, ranking_metrics, retrieval_metrics
from .qa import normalize_answer, squad_exact_match, squad_f1, squad_metrics
from .stopping import EarlyStopping, MetricHistory, Point
from .tokens import Entity, entity_f1_per_type, get_entities, tags_from_ids, token_classification_metrics


def compute_metrics(task: str, problem_type: str | None = None, *, predictions: Any = None, labels: Any = None,
                    num_labels: int | None = None, label_names: Sequence[str] | None = None,
                    id2label: Mapping[int, str] | Sequence[str] | None = None, threshold: float = 0.0,
                    loss: float | None = None) -> dict[str, float]:
    """The task's metrics as a flat dict; keys are listed in the module docstring. The task's record
    (hfport/tasks/) names its training task, whose `compute_metrics` this is.

    - text-classification: predictions = logits (or ids / 0-1 matrix / values), labels as the loss takes
      them; `problem_type` None is inferred with transformers' rule (`infer_problem_type`).
    - token-classification: tag-string sequences, or id arrays / logits with -100 ignored plus `id2label`
      (or `label_names`, the names in id order).
    - question-answering: predictions = answer strings, labels = gold answer lists (empty = no answer).
    - fill-mask: `loss` = mean eval loss, or (..., V) logits and labels to compute it from (token-weighted);
      with predictions and labels, also masked-token accuracy.
    """
    return task_record(task).train_task.compute_metrics(
        problem_type, predictions=predictions, labels=labels, num_labels=num_labels, label_names=label_names,
        id2label=id2label, threshold=threshold, loss=loss)


__all__ = ["IR_CUTOFFS", "PROBLEM_TYPES", "ArrayLike", "EarlyStopping", "Entity", "MetricHistory", "Mode", "Point",
           "accuracy", "classification_metrics", "compute_metrics", "confusion_matrix", "multilabel_per_class_metrics",
           "per_class_metrics", "ranked_metrics", "correlation_metrics", "entity_f1_per_type", "get_entities", "infer_problem_type",
           "masked_accuracy", "masked_lm_loss", "multilabel_metrics", "multilabel_per_label_f1",
           "normalize_answer", "per_label_f1", "perplexity", "precision_recall_f1", "ranking_metrics", "regression_metrics", "retrieval_metrics",
           "squad_exact_match", "squad_f1", "squad_metrics", "tags_from_ids", "token_classification_metrics"]
