"""Tasks as records, one file a task: the names users know (transformers' pipeline tags, plus aliases), the
model class and its head factory, outputs, transformers' auto class, the pipeline, the training task and the
default metric per problem type. Everything that asks "which task?" reads TASKS.

Adding a task: a file here with its model class and Task record, a line in TASKS below, and in each family
(hfport/models/) a line in HEAD_KEYS (+ head options where that family's head differs from the default). A task that
trains another task's model (sentence-embedding trains the bare encoder, text-ranking a one-label classifier) names
it in `model_task` and needs no family lines. A head only some families have (`every_family=False`: the
pre-training heads) gets HEAD_KEYS lines in those families only.

Adapter folders (PEFT's layout, hfport/formats/adapter.py) get their task here too: `adapter_task` reads config.json's
architectures, else maps PEFT's task_type through the records' `peft_task_type`.
"""

from __future__ import annotations

import difflib
import logging
import os
from typing import Any

from .. import hub
from ..formats import adapter
from ..modeling import BASE_TASK, PreTrainedEncoder, task_of
from ..nn.lora import LoraError
from ..registry import get_family
from . import (feature_extraction, fill_mask, multiple_choice, next_sentence_prediction, pretraining,
               question_answering, sentence_embedding, sparse_embedding, text_classification, text_ranking,
               token_classification, zero_shot_classification)
from .feature_extraction import EncoderModel
from .fill_mask import EncoderForMaskedLM
from .multiple_choice import EncoderForMultipleChoice
from .next_sentence_prediction import EncoderForNextSentencePrediction
from .pretraining import EncoderForPreTraining
from .question_answering import EncoderForQuestionAnswering
from .task import Columns, Task
from .text_classification import EncoderForSequenceClassification
from .token_classification import EncoderForTokenClassification

log = logging.getLogger("hfport")

TASKS: dict[str, Task] = {t.name: t for t in (
    feature_extraction.TASK, text_classification.TASK, token_classification.TASK, question_answering.TASK,
    fill_mask.TASK, multiple_choice.TASK, pretraining.TASK, next_sentence_prediction.TASK, sentence_embedding.TASK,
    text_ranking.TASK, sparse_embedding.TASK, zero_shot_classification.TASK)}
ALIASES: dict[str, str] = {alias: t.name for t in TASKS.values() for alias in t.aliases}
TASK_CLASSES: dict[str, type[PreTrainedEncoder]] = {name: t.model_class for name, t in TASKS.items()}
# the tasks whose models the families build (their heads, architectures): a training-only task such as
# sentence-embedding trains one of these (its record's model_task)
MODEL_TASKS: tuple[str, ...] = tuple(name for name, t in TASKS.items() if t.model_task is None)
# the tasks a pipeline serves (predict, the server): all but the model-only heads (pretraining,
# next-sentence-prediction)
PIPELINE_TASKS: tuple[str, ...] = tuple(name for name, t in TASKS.items() if t.pipeline is not None)

# transformers' names for the same classes
AutoModel = EncoderModel
AutoModelForSequenceClassification = EncoderForSequenceClassification
AutoModelForTokenClassification = EncoderForTokenClassification
AutoModelForQuestionAnswering = EncoderForQuestionAnswering
AutoModelForMaskedLM = EncoderForMaskedLM
AutoModelForMultipleChoice = EncoderForMultipleChoice
AutoModelForPreTraining = EncoderForPreTraining
AutoModelForNextSentencePrediction = EncoderForNextSentencePrediction

# PEFT's task_type of each task whose model the families build, read off the records (the one truth); PEFT has none
# for some (fill-mask: a plain PeftModel, task_type null)
PEFT_TASK_TYPES: dict[str, str | None] = {name: TASKS[name].peft_task_type for name in MODEL_TASKS}
TASKS_OF_PEFT: dict[str, str] = {v: k for k, v in PEFT_TASK_TYPES.items() if v is not None}


class UnknownTaskError(ValueError):
    pass


def names_help(trainable_only: bool = False, pipelines_only: bool = True) -> str:
    """'a | b | c (aliases: x = a, ...)': for --help texts and errors. The tasks a pipeline serves (what predict and
    the server take), the trainable ones, or with pipelines_only=False every task (the model-only heads too)."""
    tasks = [t for t in TASKS.values()
             if (t.train if trainable_only else t.pipeline or not pipelines_only)]
    aliases = [f"{alias} = {t.name}" for t in tasks for alias in t.aliases]
    return " | ".join(t.name for t in tasks) + (f" (aliases: {', '.join(aliases)})" if aliases else "")


def get(name: Any) -> Task:
    """The record of a task by any of its names; an unknown name is an error naming the closest ones and listing them
    all."""
    task = TASKS.get(ALIASES.get(name, name)) if isinstance(name, str) else None
    if task is None:
        hint = did_you_mean(name) if isinstance(name, str) else ""
        raise UnknownTaskError(f"task {name!r} is not supported; {hint}valid tasks: "
                               f"{names_help(pipelines_only=False)}")
    return task


def did_you_mean(name: str) -> str:
    """"did you mean 'text-classification'? " for a mistyped task name (any case, _ for -): the closest of the names
    and aliases; "" when none is close."""
    close = difflib.get_close_matches(name.strip().lower().replace("_", "-"), [*TASKS, *ALIASES], n=1, cutoff=0.6)
    if not close:
        return ""
    alias = f" (= {ALIASES[close[0]]})" if close[0] in ALIASES else ""
    return f"did you mean {close[0]!r}{alias}? "


def canonical(name: Any) -> str:
    return get(name).name


def load_any(path_or_repo_id: str | os.PathLike[str], **kwargs: Any) -> PreTrainedEncoder:
    """Load with the head the checkpoint's config.json names in `architectures` (the base model if none).

    A class name hfport does not know (a custom `MyBertForEverything`, `RobertaForCausalLM`) never blocks
    loading: the base model is loaded, and a warning and `load_report.notes` say so."""
    folder = hub.resolve(path_or_repo_id, revision=kwargs.get("revision"), cache_dir=kwargs.get("cache_dir"))
    if adapter.is_adapter_folder(folder):  # a LoRA adapter (PEFT's format): its task from its config, base from it
        return TASKS[adapter_task(folder)].model_class.from_pretrained(folder, **kwargs)
    raw, source = hub.read_config(folder)
    family = get_family(raw.get("model_type"), source)
    architectures = raw.get("architectures") or []
    task = task_of(family, architectures)
    model = TASKS[task].model_class.from_pretrained(folder, **kwargs)
    if architectures and family.architectures[task] not in architectures:
        note = (f"{source}: architectures {architectures} names no {family.model_type} class hfport has "
                f"({', '.join(family.architectures.values())}); loaded the base model "
                f"({family.architectures[task]}). For a head, load with its AutoModelFor<Task> class.")
        log.warning("%s", note)
        model.load_report.notes.append(note)
    return model


def read_adapter_config(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """adapter_config.json (formats/adapter.py validates it), its task_type one of a task hfport has."""
    return _known_task_type(folder, adapter.read_adapter_config(folder))


def _known_task_type(folder: str | os.PathLike[str], raw: dict[str, Any]) -> dict[str, Any]:
    if raw.get("task_type") not in (*TASKS_OF_PEFT, None):
        raise LoraError(f"{os.path.join(folder, adapter.ADAPTER_CONFIG)}: task_type {raw.get('task_type')!r} is not "
                        f"an encoder task hfport has; supported: {sorted(TASKS_OF_PEFT)} or null (fill-mask)")
    return raw


def adapter_task(folder: str | os.PathLike[str]) -> str:
    """The task of an adapter folder: its config.json's architectures when present, else PEFT's task_type (through
    the records); a plain PeftModel (task_type null) is a fill-mask adapter when it saves a masked-LM head, else the
    bare encoder's."""
    facts = adapter.read_adapter(folder)
    _known_task_type(folder, facts.config)
    if facts.architectures:
        config = facts.model_config or {}
        return task_of(get_family(config.get("model_type"), facts.model_config_source), facts.architectures)
    if facts.task_type is None:
        return fill_mask.TASK.name if facts.saves_mlm_head else BASE_TASK
    return TASKS_OF_PEFT[facts.task_type]


__all__ = ["ALIASES", "Columns", "MODEL_TASKS", "PIPELINE_TASKS", "AutoModel", "AutoModelForMaskedLM",
           "AutoModelForMultipleChoice", "AutoModelForNextSentencePrediction", "AutoModelForPreTraining",
           "AutoModelForQuestionAnswering",
           "AutoModelForSequenceClassification", "AutoModelForTokenClassification", "TASKS", "TASK_CLASSES",
           "EncoderForMaskedLM", "EncoderForMultipleChoice", "EncoderForNextSentencePrediction",
           "EncoderForPreTraining", "EncoderForQuestionAnswering",
           "EncoderForSequenceClassification", "EncoderForTokenClassification", "EncoderModel", "PEFT_TASK_TYPES",
           "TASKS_OF_PEFT", "Task", "UnknownTaskError", "adapter_task", "canonical", "get", "load_any", "names_help",
           "read_adapter_config"]
