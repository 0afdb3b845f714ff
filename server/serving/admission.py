"""Admission: what a request must pass before it reaches a model (a model it names that can serve it, input count,
input size, a bound on waiting requests), and how each protocol words a refusal. The checks are one; the words are
each protocol's own, given where the refusal is raised: a table of Answers that the native, TEI and OpenAI routes pass
to `served` and `infer` (an Answer subclass may raise the protocol's own error class: routes/openai.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import ApiError
from ..settings import Settings


@dataclass(frozen=True)
class Answer:
    """One refusal as a protocol answers it. `error_type` and `message` are str.format templates over the facts
    the core passes: field, index, part (blank: "" or an input's field, ".text_pair"), count, chars, limit, pending,
    seconds, model, known (the registered models, worded), reason, dimensions, allowed, error, error_kind."""

    status: int
    error_type: str
    message: str

    def error(self, headers: dict[str, str] | None = None, **facts: Any) -> ApiError:
        return ApiError(self.status, self.message.format(**facts), self.error_type.format(**facts), headers)


# the refusals about the model a request names, in hfport's words (which TEI's routes share)
NO_MODEL = Answer(400, "Validation", "no model: name one with the x-model header, or start the server with --model")
UNKNOWN_MODEL = Answer(404, "ModelNotFound", "no model named {model!r}; {known}")
DEFAULT_GONE = Answer(400, "Validation", "no model: the default model {model!r} (the first --model) is no longer "
                                         "registered; name one with the x-model header, or register a model as "
                                         "{model!r} again; {known}")
UNSERVABLE = Answer(424, "Backend", "model {model!r} {reason}")
UNTRAINED_DIMENSIONS = Answer(422, "Validation", "dimensions={dimensions}: model {model!r} was trained for dimensions "
                                                 "{allowed} (the server refuses others: HFPORT_STRICT_DIMENSIONS)")


@dataclass(frozen=True)
class Answers:
    """A protocol's answers to every way the serving core refuses a request or a model fails it."""

    empty: Answer  # no inputs
    too_many: Answer  # more than predict_max_inputs inputs
    too_long: Answer  # an input over predict_max_chars characters (all its text fields)
    overloaded: Answer  # predict_max_pending requests already waiting (sent with Retry-After)
    timeout: Answer  # no answer within predict_timeout_s
    backend: Answer  # the model failed (an HfportError)
    options: Answer  # the pipeline refused an option (a ValueError or TypeError: dimensions, prompt_name, ...)
    blank: Answer | None = None  # a whitespace-only text, alone or in an input's fields; None: the pipeline gets it
    no_model: Answer = NO_MODEL  # the request names no model and the server has no default
    default_gone: Answer = DEFAULT_GONE  # the request names no model and the default was unregistered since
    unknown_model: Answer = UNKNOWN_MODEL  # no model registered under the name
    unservable: Answer = UNSERVABLE  # the model cannot load, or cannot serve the route (its kind)
    dimensions: Answer = UNTRAINED_DIMENSIONS  # HFPORT_STRICT_DIMENSIONS: not one the model was trained for


def characters(item: Any) -> int:
    """The characters of an input's text fields (a text, a {text, text_pair} object, a list of them)."""
    if isinstance(item, str):
        return len(item)
    if isinstance(item, dict):
        return sum(characters(v) for v in item.values())
    if isinstance(item, list):
        return sum(characters(v) for v in item)
    return 0


def check_inputs(items: list[Any], settings: Settings, answers: Answers, field: str = "inputs") -> None:
    """Refuse an empty request, too many inputs, or an input too long (or blank, where the protocol refuses it)."""
    if not items:
        raise answers.empty.error(field=field)
    if len(items) > settings.predict_max_inputs:
        raise answers.too_many.error(field=field, count=len(items), limit=settings.predict_max_inputs)
    for i, item in enumerate(items):
        chars = characters(item)
        if chars > settings.predict_max_chars:
            raise answers.too_long.error(field=field, index=i, chars=chars, limit=settings.predict_max_chars)
        if answers.blank is not None and (part := blank_part(item)) is not None:
            raise answers.blank.error(field=field, index=i, part=part)


def blank_part(item: Any) -> str | None:
    """Which text of an input is empty or whitespace: "" (the text itself), ".text_pair" (a field of a {text,
    text_pair} or {question, context} object); None: none is."""
    if isinstance(item, str):
        return None if item.strip() else ""
    if isinstance(item, dict):
        return next((f".{key}" for key, value in item.items() if isinstance(value, str) and not value.strip()), None)
    return None
