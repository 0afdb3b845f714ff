"""`preflight(config)`: everything a fine-tune checks before it trains, shared by `finetune()` and the server.

It validates the config, resolves the model folder, loads its tokenizer, reads the labels the checkpoint already
has, and reads and encodes the data files with the task's readers, so a bad file fails here, naming file, line and
field, before any output is written or any job is queued.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from .. import hub
from ..errors import ConfigError
from ..modeling import folder_max_positions
from ..tokenizer import AutoTokenizer
from .columns import check_columns
from .config import FinetuneConfig, resolve_config
from .data import DataError, EncodedData
from .distill import check_student_layers, distilled
from .tasks import TrainTask, get_task

log = logging.getLogger("hfport.train")


@dataclass
class Preflight:
    """What the checks produced; the loop trains on exactly this."""

    config: FinetuneConfig
    source: Path  # the resolved model folder
    tokenizer: Any  # hfport.PreTrainedTokenizer
    task: TrainTask
    data: EncodedData
    model_labels: dict[int, str] | None  # the checkpoint's id2label, if it has one


def preflight(config: FinetuneConfig | dict[str, Any], *, world: int = 1) -> Preflight:
    """Check a fine-tune before it runs. `world`: processes that will train (each takes a share of a batch).

    Raises ConfigError (bad options), ModelNotFoundError, TokenizerError, DataError (file, line, field)."""
    config = as_config(config)
    check_columns(config)  # the first row of each file: a file with other column names fails here, saying which flag
    config = fit_max_length(config)
    source = hub.resolve(config.model)
    tokenizer = AutoTokenizer.from_pretrained(source)
    check_student_layers(config, source)
    task = distilled(get_task(config.task), config, tokenizer)  # with a teacher: checked, and its wrapper
    labels = model_labels(source)
    data = task.read(config, tokenizer, labels)
    check_loss_options(config, task, data)
    check_metric(config, task, data)
    if len(data.train) < config.batch_size * world:
        raise DataError(f"{config.train}: {len(data.train)} training examples, fewer than one batch "
                        f"(batch_size {config.batch_size} x {world} process(es)); lower batch_size (--batch-size)")
    return Preflight(config, source, tokenizer, task, data, labels)


def fit_max_length(config: FinetuneConfig) -> FinetuneConfig:
    """CONFIG with max_length within the model's position table (examples are cut at max_length tokens; a longer
    one fails inside the embeddings). The default lowered to the table's size, as transformers' example scripts cut
    max_seq_length at the tokenizer's model_max_length; a max_length the user gave above it is refused. Reads
    config.json alone (no weights), so a run calls it before comparing a resume's config with the checkpoint's."""
    limit = folder_max_positions(hub.resolve(config.model))
    if limit is None or config.max_length <= limit:
        return config
    if "max_length" in config.model_fields_set:
        raise ConfigError(f"max_length {config.max_length}: the model {config.model} holds {limit} positions (its "
                          f"config.json's max_position_embeddings); set max_length to {limit} or less (hfport "
                          f"finetune --set max_length={limit})")
    log.info("max_length: %d, the positions of %s (the default, %d, is more than it holds)", limit, config.model,
             config.max_length)
    lowered = config.model_copy(update={"max_length": limit})
    try:  # the rules between fields (question answering's doc_stride < max_length) on the lowered value
        FinetuneConfig.model_validate(lowered.model_dump())
    except ValidationError as e:
        raise ConfigError(f"max_length lowered to {limit}, the positions of {config.model}: "
                          + "; ".join(err["msg"] for err in e.errors())) from e
    return lowered


def check_loss_options(config: FinetuneConfig, task: TrainTask, data: EncodedData) -> None:
    """A loss option set where the task's loss ignores it is refused: the run would silently train without it."""
    given = {"label_smoothing": config.label_smoothing != 0.0, "class_weights": config.class_weights is not None}
    ignored = [name for name, on in given.items() if on and name not in task.loss_options(data)]
    if ignored:
        problem = getattr(data.space, "problem_type", None)
        what = f"{config.task}" + (f" with problem_type {problem}" if problem else "")
        raise ConfigError(f"{', '.join(f'{n}={getattr(config, n)!r}' for n in ignored)}: the loss of {what} does not "
                          "use it (label_smoothing and class_weights apply to cross-entropy over labels); remove it")


def check_metric(config: FinetuneConfig, task: TrainTask, data: EncodedData) -> None:
    """The metric that picks best/ (and early stopping) must be one evaluation computes on this data: a misspelt one
    is refused here, before the model loads, not at the first evaluation after the training work."""
    problem = data.space.problem_type if data.space is not None else data.problem_type
    metric, _ = config.default_metric(problem)
    names = ["loss", *task.metric_names(data)]  # the loop adds the eval loss to the task's metrics
    if metric not in names:
        what = f"{config.task}" + (f" with problem_type {problem}" if problem else "")
        raise ConfigError(f"metric {metric!r} (the config field metric; transformers: metric_for_best_model): "
                          f"evaluation of {what} on this data computes {', '.join(names)}")


def as_config(config: FinetuneConfig | dict[str, Any]) -> FinetuneConfig:
    """A FinetuneConfig from itself or a dict of options (unknown or bad options: ConfigError listing them)."""
    if isinstance(config, FinetuneConfig):
        return config
    if not isinstance(config, dict):
        raise TypeError(f"config must be a FinetuneConfig or a dict, got {type(config).__name__}")
    return resolve_config(config, {}, "config")[0]


def model_labels(folder: Path) -> dict[int, str] | None:
    """id2label from a model folder's config.json (None when it has none)."""
    raw, _ = hub.read_config(folder)
    labels = raw.get("id2label")
    return {int(k): v for k, v in labels.items()} if isinstance(labels, dict) else None
