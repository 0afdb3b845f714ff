"""The Task record: everything hfport knows about one task, in one place.

A task file (hfport/tasks/<task>.py) defines the task's model class (its forward and head factory) and one
Task record naming the rest: the names users know, the outputs, transformers' auto class, the pipeline, the
training task, the default metric per problem type. Whatever asks "which task?" reads a record.

The pipeline and the training task sit above the model code (they import it), so the record names them as
"module:Class" and imports them on first use. The families sit below (the task models import them): a model
task's record registers itself with them (hfport/models/family.py: MODEL_TASK_RECORDS), and they read its class-name
suffix and pooler use there, so no family keeps a table of tasks' facts.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from ..models.family import MODEL_TASK_RECORDS, register_task

if TYPE_CHECKING:
    from torch import nn

    from ..config import EncoderConfig
    from ..modeling import PreTrainedEncoder
    from ..models.family import Family

Metric = tuple[str, str]  # (metric name, "max" | "min")


@dataclass(frozen=True)
class Columns:
    """One shape of training row a task reads, by the fine-tune config fields that name its columns
    (hfport/train/config.py: text_column, label_column, ...; each is also the CLI flag --text-column, ...). A row has
    every `required` column (a field whose value is None, text_pair_column by default, is not read) and may have the
    `optional` ones. `texts` are the fields whose value is one text (a JSON string; every CSV cell is one) and `lists`
    those whose value is a list (JSONL, Parquet, Arrow): a row whose columns hold other kinds of value has the names of
    this shape but not the shape (a labeled list's `positive` is a list of texts, no pair's positive), so no hint
    points a user at it. A field in neither takes more than one kind (a label: a number, a name or a list)."""

    required: tuple[str, ...]
    optional: tuple[str, ...] = ()
    texts: tuple[str, ...] = ()
    lists: tuple[str, ...] = ()


def _load(reference: str) -> Any:
    module, _, name = reference.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True, eq=False)
class Task:
    name: str  # canonical: transformers' pipeline tag (a head without a pipeline: its Auto class's, "pretraining")
    aliases: tuple[str, ...]  # other names accepted on input (hfport's old names, transformers' pipeline aliases)
    model_class: type[PreTrainedEncoder]  # its `head_factory` builds the head from a family's options
    outputs: tuple[str, ...]  # the model output fields transformers returns too (export/verify compare them)
    per_sequence: frozenset[str]  # outputs shaped (B, ...); every other output is per token, (B, T, ...)
    auto_class: str  # transformers' Auto class that loads this head
    pipeline: str | None  # "module:Class" of the pipeline; None: a model-only head (pretraining), loaded, not served
    train: str | None  # "module:Class" of the training task (reader, collation, loss, metrics); None: not trainable
    # the rows the training task reads from a table (CSV/TSV, JSONL, Parquet, Arrow, datasets folder), one Columns a
    # shape it accepts: the README's table, the CLI's column flags and the missing-column error read these
    columns: tuple[Columns, ...] = ()
    files: str = ""  # files of its own format the training task reads besides tables (a CoNLL file, SQuAD JSON)
    # problem type (None: the task has none, or it is not known yet) -> the metric that picks the best model
    default_metrics: dict[str | None, Metric] = field(default_factory=dict)
    labels: bool = False  # the head is sized by config.id2label (classification heads)
    pair_input: bool = False  # its inputs are text pairs (question, context): probes and exports feed pairs
    masked_input: bool = False  # its inputs carry the tokenizer's mask token (fill-mask): probes mask a word
    choice_axis: bool = False  # its inputs are (B, C, T), C choices per question (multiple-choice)
    # a task that trains another task's model names that task here: sentence-embedding trains the bare encoder
    # (feature-extraction) and text-ranking a one-label text-classification head, so their checkpoints are plain
    # transformers folders (BertModel, BertForSequenceClassification) and the families need no tables for them.
    # Such a task leaves the facts below at their defaults: they are its model task's (`model_record`).
    model_task: str | None = None
    # --- facts the loaders, exporters and gates read (one place, no side tables) ---
    output_type: type | None = None  # the model's output record (hfport/outputs.py): what an ONNX graph's arrays fill
    # transformers' class name is the family's prefix + this suffix ("Bert" + "ForSequenceClassification")
    architecture_suffix: str | None = None
    peft_task_type: str | None = None  # PEFT's task_type for an adapter of this task (None: PEFT has none)
    # ONNX graph outputs under transformers' names: name -> (rank, the config field the last axis equals, or None)
    graph_outputs: dict[str, tuple[int, str | None]] = field(default_factory=dict)
    agreement: str | None = None  # how the int8/verify gate judges this head: labels | tags | spans | top_k | cosine
    pooler: bool = False  # transformers builds this head's body with the pooler (BERT; a family may say otherwise)
    # transformers has this head in every encoder family; False (the pre-training heads): only the families whose
    # HEAD_KEYS map it build it (hfport/models/family.py: Family.has_task)
    every_family: bool = True

    def __post_init__(self) -> None:
        if self.model_class.task != (self.model_task or self.name):
            raise ValueError(f"task {self.name!r}: its model class {self.model_class.__name__} says "
                             f"{self.model_class.task!r}")
        if self.model_task is None:  # a model task: the families read its class-name suffix and pooler use
            register_task(self)

    @property
    def model_record(self) -> Task:
        """The record of the task whose model this one trains (itself for a model task): its output type,
        architecture suffix, PEFT task type, ONNX graph outputs, agreement kind and pooler use apply here too."""
        return MODEL_TASK_RECORDS[self.model_task] if self.model_task else self  # type: ignore[return-value]

    @property
    def checkpoint_task(self) -> str:
        """The task whose model this task trains and serves (itself, unless `model_task` says otherwise)."""
        return self.model_task or self.name

    def build_head(self, config: EncoderConfig, family: Family) -> nn.Module | None:
        """The task's head, with the options `family` gives it."""
        return self.model_class.head_factory(config, **family.options_for(config, self.name))

    def model_inputs(self, encoded: dict[str, Any]) -> dict[str, Any]:
        """A (B, T) batch of probe rows as this task's model takes them: with a choice axis, one question whose
        C = B choices are the rows, (1, B, T)."""
        return {k: v[None] for k, v in encoded.items()} if self.choice_axis else encoded

    def per_token(self, output: str) -> bool:
        return output not in self.per_sequence

    def default_metric(self, problem_type: str | None = None) -> Metric:
        metric = self.default_metrics.get(problem_type) or self.default_metrics.get(None)
        if metric is None:
            raise ValueError(f"{self.name} has no metrics (it is not a fine-tuning task)")
        return metric

    @cached_property
    def pipeline_class(self) -> type:
        if self.pipeline is None:
            raise ValueError(f"{self.name} has no pipeline: load the model with hfport.{self.auto_class} and call it")
        return _load(self.pipeline)

    @cached_property
    def train_task(self) -> Any:
        """The training task (one instance); ValueError for a task hfport does not fine-tune."""
        if self.train is None:
            raise ValueError(f"{self.name} is not a fine-tuning task")
        return _load(self.train)()
