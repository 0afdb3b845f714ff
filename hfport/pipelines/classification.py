"""text-classification: a label and score per text (or text pair), as transformers' TextClassificationPipeline."""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor

from .base import Feature, Pipeline, PipelineInputError, check_text, positive_int, sigmoid_np, softmax_np

FUNCTIONS = ("default", "sigmoid", "softmax", "none")


class TextClassificationPipeline(Pipeline):
    task = "text-classification"
    # top_k: 1 by default with transformers' "legacy" output (one dict); giving top_k (None = all labels) returns a
    # sorted list. truncation/max_length go to the tokenizer (no truncation by default, as in transformers).
    defaults: ClassVar[dict[str, Any]] = {"top_k": 1, "function_to_apply": None, "truncation": None, "max_length": None}

    def validate(self, opts: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
        positive_int("top_k", opts["top_k"], allow_none=True)
        fn = opts["function_to_apply"]
        if fn is not None:
            if not isinstance(fn, str) or fn.lower() not in FUNCTIONS:
                raise ValueError(f"function_to_apply={fn!r}: use one of {list(FUNCTIONS)}")
            opts["function_to_apply"] = None if fn.lower() == "default" else fn.lower()
        opts["_legacy"] = "top_k" not in given  # transformers' output shape depends on whether top_k was given
        return opts

    single_input = (str, dict)
    input_description = "a text, a {'text', 'text_pair'} dict, or a list of them"

    def text_of(self, item: Any) -> tuple[str, str | None]:
        """An item's text and its pair (None: a text alone)."""
        if isinstance(item, dict):
            unknown = sorted(set(item) - {"text", "text_pair"})
            if "text" not in item or unknown:
                raise PipelineInputError(f"a pair must be a dict with keys 'text' and 'text_pair'; got {sorted(item)}")
            text = check_text(item["text"], "text")
            pair = item.get("text_pair")
            if pair is not None:
                check_text(pair, "text_pair")
            return text, pair
        if isinstance(item, (list, tuple)):
            raise PipelineInputError("a text pair must be given as {'text': ..., 'text_pair': ...}, not a list")
        return check_text(item), None

    def preprocess(self, item: Any, opts: dict[str, Any]) -> list[Feature]:
        return self.alone(item, opts)

    def preprocess_many(self, items: list[Any], opts: dict[str, Any]) -> list[list[Feature] | Exception]:
        return self.encode_items(items, self.text_of, truncation=opts["truncation"], max_length=opts["max_length"])

    def forward(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None,
                encoder_outputs: tuple[Tensor, Tensor | None] | None = None) -> dict[str, Tensor]:
        return {"logits": self.model(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                                     encoder_outputs=encoder_outputs).logits}  # (B, L)

    def postprocess(self, item: Any, features: list[Feature], opts: dict[str, Any]) -> Any:
        config = self.model.config
        fn = opts["function_to_apply"]
        if fn is None:  # transformers' default: from problem_type, else from the number of labels
            if config.problem_type == "regression":
                fn = "none"
            elif config.problem_type == "multi_label_classification" or config.num_labels == 1:
                fn = "sigmoid"
            else:
                fn = "softmax"
        logits = features[0].outputs["logits"].numpy()  # (L,)
        scores = softmax_np(logits) if fn == "softmax" else sigmoid_np(logits) if fn == "sigmoid" else logits
        if opts["top_k"] == 1 and opts["_legacy"]:
            return {"label": config.id2label[int(scores.argmax())], "score": float(scores.max())}
        ranked = [{"label": config.id2label[i], "score": float(s)} for i, s in enumerate(scores)]
        ranked.sort(key=lambda x: x["score"], reverse=True)
        return ranked if opts["top_k"] is None else ranked[: opts["top_k"]]

    def assemble(self, results: list[Any], items: list[Any], single: bool, opts: dict[str, Any]) -> Any:
        if single:  # transformers wraps a single string's one-label result in a list, but not a single pair's
            return [results[0]] if opts["_legacy"] and isinstance(items[0], str) else results[0]
        return results
