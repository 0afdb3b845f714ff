"""`hfport evaluate`: a model's metrics on labelled data in the formats fine-tuning reads, computed with the same
functions fine-tuning's evaluation uses (hfport/train/metrics/), so the numbers agree with a run's eval lines.

    text-classification   accuracy, f1/precision/recall macro and micro, f1/<label> (mse, mae, r2 for regression);
                          a per-class table (precision, recall, f1, support) and the confusion matrix
    token-classification  seqeval's entity precision, recall and F1, token accuracy, f1/<entity type>
    question-answering    SQuAD's exact_match and f1
    text-ranking          each query's candidates reranked: InformationRetrievalEvaluator's accuracy@k, precision@k,
                          recall@k (k = 1, 3, 5, 10), ndcg@10, mrr@10, map@100; recall@k curves
    sentence-embedding    (query, positive) rows as an InformationRetrievalEvaluator benchmark: every positive (and
                          a triplet file's negatives) joins the corpus, `corpus=` adds distractors; cosine_ndcg@10,
                          ... as sentence-transformers names and computes them (hfport/evaluation/retrieval.py);
                          recall@k curves. Scored pairs (sentence1, sentence2, score): fine-tuning's spearman, pearson
    any other task hfport fine-tunes (fill-mask, multiple-choice, sparse-embedding): its fine-tuning evaluation
(the supervised ones through supervised.py: the task's own reader, batches and evaluation rows, and a `loss`).
`compare=` evaluates a second model on the same data, side by side (before and after a fine-tune); `json_path=`
writes the figures as JSON and `report_path=` a self-contained report.html with the charts (report.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .. import hub, tasks
from ..errors import ConfigError
from ..rundir import RunDir
from .report import render_report, write_report
from .result import EvalResult, Evaluation
from .retrieval import OPTIONS as RETRIEVAL_OPTIONS
from .retrieval import evaluate_retrieval
from .supervised import OPTIONS as SUPERVISED_OPTIONS
from .supervised import evaluate_supervised


@dataclass(frozen=True)
class Evaluator:
    """How a task is evaluated: `run(model, data, task, **arguments and options)` and the options it takes."""

    run: Callable[..., EvalResult]
    options: tuple[str, ...]


SUPERVISED = Evaluator(evaluate_supervised, SUPERVISED_OPTIONS)  # every task through its fine-tuning evaluation
# the tasks evaluated otherwise
EVALUATORS: dict[str, Evaluator] = {"sentence-embedding": Evaluator(evaluate_retrieval, RETRIEVAL_OPTIONS)}


def evaluator(task: str) -> Evaluator:
    """The evaluation of TASK (any of its names); an error listing the tasks hfport evaluates."""
    record = tasks.get(task)
    if record.name in EVALUATORS:
        return EVALUATORS[record.name]
    if record.train is None:
        raise ValueError(f"{record.name}: hfport evaluates {tasks.names_help(trainable_only=True)}")
    return SUPERVISED


def check_options(task: str, options: dict[str, Any]) -> None:
    """The options TASK's evaluation takes (ConfigError naming the others and the valid ones); what a caller that
    queues an evaluation (the server) checks first."""
    valid = evaluator(task).options
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ConfigError(f"{tasks.get(task).name} evaluation: unknown option(s) {unknown}; valid: {list(valid)}")


def model_folder(model: str | os.PathLike[str]) -> str:
    """MODEL as a folder to load: a fine-tune's run folder is its best/ (as `hfport export` takes it)."""
    return str(RunDir.model_folder(model))


def evaluate(model: str | os.PathLike[str], data: str | os.PathLike[str], *, task: str,
             corpus: str | os.PathLike[str] | None = None, compare: str | os.PathLike[str] | None = None,
             json_path: str | os.PathLike[str] | None = None, report_path: str | os.PathLike[str] | None = None,
             dtype: str | None = None, device: Any = None, batch_size: int | None = None,
             cache: bool | str | os.PathLike[str] = True, progress: bool = True, **options: Any) -> Evaluation:
    """TASK's metrics of MODEL (and of COMPARE, the same way) on DATA; a model is a folder, a repo id in the local HF
    cache or a fine-tune's run folder (its best/). corpus: sentence-embedding's distractors (a
    .txt file of one text a line, or a data file with a `text` column). dtype: as `hfport predict --dtype`.
    OPTIONS: how to read the data, by fine-tuning's option names (text_column, label_column, anchor_column,
    max_length, ...; sentence-embedding also takes the query/corpus prompts and use_faiss)."""
    record = tasks.get(task)
    run = evaluator(record.name).run
    check_options(record.name, options)
    for path, what in ((json_path, "the figures"), (report_path, "the report")):
        if path is not None:  # a path that cannot be written fails now, not after the evaluation
            hub.check_output_file(path, what)
    kwargs: dict[str, Any] = {"corpus": str(corpus) if corpus is not None else None, "dtype": dtype, "device": device,
                              "batch_size": batch_size, "cache": cache, "progress": progress, **options}
    folders = [model_folder(m) for m in ([model] if compare is None else [model, compare])]
    for folder in folders:  # a --compare model that is not there fails now, not after the first model's evaluation
        hub.resolve(folder)
    results = [run(folder, str(data), record.name, **kwargs) for folder in folders]
    evaluation = Evaluation(record.name, str(data), results, str(corpus) if corpus is not None else None)
    if json_path is not None:
        evaluation.write_json(json_path)
    if report_path is not None:
        write_report(evaluation, Path(report_path))
    return evaluation


__all__ = ["EVALUATORS", "EvalResult", "Evaluation", "Evaluator", "check_options", "evaluate", "evaluator",
           "render_report", "write_report"]
