"""multiple-choice: the choices of a question ranked by the model, with their probabilities.

transformers has no multiple-choice pipeline; this one reads as text-classification's does. An input is
{"question": str, "choices": [str, ...]} ("context" in place of "question", as SWAG names it); each choice is
encoded as the pair (question, choice). The result is the best choice, {"index", "choice", "score"}, or with
`top_k` (None = all) a list of them, best first; scores are the softmax over the input's choices.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
from torch import Tensor

from .base import Feature, Pipeline, PipelineInputError, check_text, positive_int, softmax_np

STEMS = ("question", "context")  # the text the choices answer or continue: one of these keys


class MultipleChoicePipeline(Pipeline):
    task = "multiple-choice"
    # top_k: 1 by default, answering one dict (the best choice); giving top_k (None = every choice) returns a sorted
    # list, as text-classification does. truncation/max_length go to the tokenizer (no truncation by default).
    defaults: ClassVar[dict[str, Any]] = {"top_k": 1, "truncation": None, "max_length": None}

    def validate(self, opts: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
        positive_int("top_k", opts["top_k"], allow_none=True)
        opts["_legacy"] = "top_k" not in given
        return opts

    single_input = (dict,)
    input_description = "a {'question' (or 'context'), 'choices'} dict or a list of them"

    def preprocess(self, item: Any, opts: dict[str, Any]) -> list[Feature]:
        if not isinstance(item, dict):
            raise PipelineInputError(f"an input must be a dict with 'question' (or 'context') and 'choices'; got "
                                     f"{type(item).__name__}")
        stems = [k for k in STEMS if k in item]
        unknown = sorted(set(item) - {*STEMS, "choices"})
        if len(stems) != 1 or "choices" not in item or unknown:
            raise PipelineInputError(f"an input must have 'choices' and one of 'question' or 'context' (and nothing "
                                     f"else); got keys {sorted(item)}")
        stem = check_text(item[stems[0]], stems[0])
        choices = item["choices"]
        if not isinstance(choices, (list, tuple)) or len(choices) < 2:
            raise PipelineInputError(f"choices must be a list of at least 2 texts, got {choices!r}")
        kwargs = {"truncation": opts["truncation"], "max_length": opts["max_length"]}
        rows = []
        for i, choice in enumerate(choices):  # one row per choice; windows make no sense for a choice: one row each
            rows.append(self.encode(stem, check_text(choice, f"choices[{i}]"), **kwargs)[0])
        return rows

    def forward(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None,
                encoder_outputs: tuple[Tensor, Tensor | None] | None = None) -> dict[str, Tensor]:
        # The batch's rows are choices of any inputs, in any order: they run as the choices of one question,
        # (1, B, T). A choice's logit depends on its own row only (the softmax over an input's choices comes in
        # postprocess), so how the rows of several inputs share a batch changes nothing.
        types = None if token_type_ids is None else token_type_ids[None]
        logits = self.model(input_ids[None], attention_mask=attention_mask[None], token_type_ids=types,
                            encoder_outputs=encoder_outputs).logits
        return {"logits": logits[0]}  # (1, B) -> (B,): one logit per row

    def postprocess(self, item: Any, features: list[Feature], opts: dict[str, Any]) -> Any:
        logits = np.array([f.outputs["logits"].item() for f in features])  # (C,), in the input's choice order
        scores = softmax_np(logits)
        choices = item["choices"]
        ranked = [{"index": i, "choice": choices[i], "score": float(s)} for i, s in enumerate(scores)]
        ranked.sort(key=lambda x: x["score"], reverse=True)
        if opts["top_k"] == 1 and opts["_legacy"]:
            return ranked[0]
        return ranked if opts["top_k"] is None else ranked[: opts["top_k"]]
