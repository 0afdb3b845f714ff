"""The Family record: everything hfport knows about one config.json model_type, as data."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from torch import nn

from ..config import EncoderConfig
from ..errors import ConfigError
from ..keymap import KeyMap

# task -> a function of the config giving keyword options for that task's head factory (hfport/tasks/)
HeadOptions = dict[str, Callable[[EncoderConfig], dict[str, Any]]]


class TaskFacts(Protocol):
    """What a family reads of a model task's record (hfport/tasks/task.py: Task)."""

    name: str
    architecture_suffix: str | None  # transformers' class name is the family's class prefix + this
    pooler: bool  # the head reads the pooler's output, unless a family says otherwise
    every_family: bool  # every family has this head; False: those whose head_keys map it (the pre-training heads)


# The model tasks' records by canonical name, each registered by its record as hfport.tasks loads
# (Task.__post_init__). The families sit below the tasks and never import them; they read the tasks' facts here.
MODEL_TASK_RECORDS: dict[str, TaskFacts] = {}


def register_task(record: TaskFacts) -> None:
    if record.name in MODEL_TASK_RECORDS and MODEL_TASK_RECORDS[record.name] is not record:
        raise ValueError(f"task {record.name!r} is registered twice")
    MODEL_TASK_RECORDS[record.name] = record


@dataclass(frozen=True)
class Family:
    model_type: str
    prefix: str  # transformers' base_model_prefix: head checkpoints store the body under "<prefix>."
    class_prefix: str  # transformers' class names: this + the task's suffix ("Bert" + "ForSequenceClassification")
    config_from_hf: Callable[[dict[str, Any], str], EncoderConfig]
    body_keys: KeyMap
    head_keys: dict[str, KeyMap]  # task -> table of the head's own keys
    body_builder: Callable[[EncoderConfig, bool], nn.Module]  # (config, pooler: whether to build the pooler)
    # how this family's heads differ from the task's defaults (RoBERTa's dense layer before the classifier,
    # DeBERTa's ContextPooler, the MLM activation...); a task absent here uses the defaults
    head_options: HeadOptions = field(default_factory=dict)
    # task -> whether its head reads the pooler, where this family's head differs from the task's record
    # (RobertaForSequenceClassification has its own dense layer on <s> and no pooler)
    pooler: dict[str, bool] = field(default_factory=dict)
    # the linear layers LoRA adapts when the user names none (hfport names): attention's query and value by default
    lora_targets: tuple[str, ...] = ("attn.q", "attn.v")
    ignored_keys: KeyMap = field(default_factory=lambda: KeyMap({}))  # pre-training heads hfport never loads
    after_init: Callable[[nn.Module, EncoderConfig], None] | None = None  # a family's own fresh-init values
    # a family whose head names depend on the config (DeBERTa's two MLM layouts) picks the head's table here
    select_head_keys: Callable[[EncoderConfig, str], KeyMap | None] | None = None
    # the model tasks transformers has a class for in this family (None: every task every family has, and those of
    # the others whose head this family's head_keys map); another task is refused
    tasks: tuple[str, ...] | None = None

    def has_task(self, task: str) -> bool:
        """Whether transformers has a class for this model task in this family: the ones `tasks` lists, else every
        task whose record says every family has it (the general heads) and the others (BertForPreTraining,
        BertForNextSentencePrediction, ...) where this family's head_keys map the head."""
        if self.tasks is not None:
            return task in self.tasks
        return MODEL_TASK_RECORDS[task].every_family or task in self.head_keys

    @property
    def architectures(self) -> dict[str, str]:
        """task -> transformers class name written to config.json, for every model task this family builds."""
        return {name: self.class_prefix + record.architecture_suffix for name, record in MODEL_TASK_RECORDS.items()
                if record.architecture_suffix is not None and self.has_task(name)}

    def build_body(self, config: EncoderConfig, task: str) -> nn.Module:
        """The encoder for `task`'s model: with the pooler where that task's head reads it in this family."""
        if not self.has_task(task):
            raise ConfigError(f"{config.source}: model_type {self.model_type!r} has no {task} model in transformers "
                              f"(its classes: {', '.join(self.architectures.values())}); hfport builds those only")
        return self.body_builder(config, self.pooler.get(task, MODEL_TASK_RECORDS[task].pooler))

    def head_map(self, config: EncoderConfig, task: str) -> KeyMap | None:
        return self.select_head_keys(config, task) if self.select_head_keys else self.head_keys.get(task)

    def options_for(self, config: EncoderConfig, task: str) -> dict[str, Any]:
        """The keyword options this family gives `task`'s head factory."""
        options = self.head_options.get(task)
        return options(config) if options else {}
