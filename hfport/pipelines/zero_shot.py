"""zero-shot-classification: labels chosen at call time, scored by a text-classification model trained on NLI, as
transformers' ZeroShotClassificationPipeline scores them.

Each text is paired with one hypothesis per candidate label (`hypothesis_template` with the label in it: "This
example is {}."); the model classifies each (text, hypothesis) pair, and the *entailment* logit says how well the
label fits. Scores are a softmax over the labels' entailment logits, or with `multi_label=True` (and always for a
single label) each label's own softmax of entailment against contradiction. The result is transformers':
{"sequence", "labels", "scores"}, labels best first; a list of them for a list of texts.

The entailment label is found by name in config.json's label2id, as transformers finds it (the first label starting
with "entail"). Where there is none, transformers warns and reads the last logit; hfport refuses the model instead:
its scores would come from whatever that label means.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
from torch import Tensor

from ..tokenizer import TokenizerError
from .base import Feature, Pipeline, check_bool, check_text

DEFAULT_TEMPLATE = "This example is {}."


def entailment_id(label2id: dict[str, int]) -> int | None:
    """The id of the first label whose name starts with "entail" (any case), as transformers reads it; None if none."""
    return next((i for name, i in label2id.items() if name.lower().startswith("entail")), None)


def parse_labels(labels: Any) -> list[str]:
    """candidate_labels as transformers takes them: a list of labels, or one string of comma-separated labels."""
    if isinstance(labels, str):
        labels = [label.strip() for label in labels.split(",") if label.strip()]
    if not isinstance(labels, (list, tuple)) or not labels:
        raise ValueError(f"candidate_labels: give a list of labels or a comma-separated string of them, got "
                         f"{labels!r}")
    for i, label in enumerate(labels):
        check_text(label, f"candidate_labels[{i}]")
    return list(labels)


class ZeroShotClassificationPipeline(Pipeline):
    task = "zero-shot-classification"
    model_task = "text-classification"
    defaults: ClassVar[dict[str, Any]] = {"candidate_labels": None, "hypothesis_template": DEFAULT_TEMPLATE,
                                          "multi_label": False}

    def __init__(self, model: Any, tokenizer: Any, **kwargs: Any):
        super().__init__(model, tokenizer, **kwargs)
        config = self.model.config
        found = entailment_id(config.label2id)
        if found is None:
            raise ValueError(
                f"{self.task}: {getattr(config, 'source', 'the model')} has no entailment label (label2id: "
                f"{dict(config.label2id)}); the pipeline reads the logit of the label whose name starts with "
                "'entail', as transformers does. Give a model fine-tuned on NLI, with its labels named in "
                "config.json's id2label/label2id (e.g. contradiction, neutral, entailment)")
        self.entailment = found
        self.contradiction = -1 if found == 0 else 0  # transformers' choice: the first label, else the last

    def __call__(self, inputs: Any = None, candidate_labels: Any = None, *, adapter: Any = None,
                 **options: Any) -> Any:
        """As transformers' call: the labels also come second, by position (`classifier(text, ["a", "b"])`)."""
        if candidate_labels is not None:
            options["candidate_labels"] = candidate_labels
        return super().__call__(inputs, adapter=adapter, **options)

    def validate(self, opts: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
        if opts["candidate_labels"] is None:
            raise ValueError(f"{self.task}: give candidate_labels (a list, or a comma-separated string)")
        opts["candidate_labels"] = parse_labels(opts["candidate_labels"])
        template = opts["hypothesis_template"]
        if not isinstance(template, str) or template.format(opts["candidate_labels"][0]) == template:
            raise ValueError(f"hypothesis_template={template!r}: it must hold {{}} where the label goes, e.g. "
                             f"{DEFAULT_TEMPLATE!r}")
        check_bool("multi_label", opts["multi_label"])
        return opts

    @classmethod
    def check_sample_options(cls, options: dict[str, Any]) -> None:
        """dtype="auto-int8" times each int8 path on zero-shot calls, which need the labels asked for: the
        pipeline's candidate_labels (given to pipeline())."""
        if options.get("candidate_labels") is None:
            raise ValueError(f"{cls.task} with dtype='auto-int8': give candidate_labels= to pipeline() (the labels "
                             "your calls ask for), so the int8 paths are timed on the calls you will make")

    def sample_inputs(self, texts: list[str], pairs: list[tuple[str, str]]) -> list[Any]:
        self.check_sample_options(self.options)
        return texts + [second for _, second in pairs]

    def preprocess_many(self, items: list[Any], opts: dict[str, Any]) -> list[list[Feature] | Exception]:
        labels = opts["candidate_labels"]
        hypotheses = [opts["hypothesis_template"].format(label) for label in labels]
        out: list[list[Feature] | Exception] = []
        for item in items:
            try:
                text = check_text(item)
            except Exception as e:  # noqa: BLE001 - this item fails alone
                out.append(e)
                continue
            # transformers truncates the text only (never the hypothesis) to the tokenizer's model_max_length; where
            # the hypothesis alone is too long for that, it tokenizes without truncation (check_length then refuses
            # a row the model cannot take)
            rows = self.encode_many([text] * len(labels), hypotheses, truncation="only_first")
            if any(isinstance(r, TokenizerError) for r in rows):
                rows = self.encode_many([text] * len(labels), hypotheses)
            error = next((r for r in rows if isinstance(r, Exception)), None)
            out.append(error if error is not None else [r[0] for r in rows])  # one row per label, in label order
        return out

    def forward(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None,
                encoder_outputs: tuple[Tensor, Tensor | None] | None = None) -> dict[str, Tensor]:
        return {"logits": self.model(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                                     encoder_outputs=encoder_outputs).logits}  # (B, L): one row a (text, label)

    def postprocess(self, item: Any, features: list[Feature], opts: dict[str, Any]) -> Any:
        labels = opts["candidate_labels"]
        logits = np.stack([f.outputs["logits"].numpy() for f in features])  # (N, L), N candidate labels
        if opts["multi_label"] or len(labels) == 1:  # each label alone: entailment against contradiction
            pair = logits[:, [self.contradiction, self.entailment]]  # (N, 2)
            scores = (np.exp(pair) / np.exp(pair).sum(-1, keepdims=True))[:, 1]  # (N,)
        else:  # the labels compete: a softmax over their entailment logits
            entail = logits[:, self.entailment]  # (N,)
            scores = np.exp(entail) / np.exp(entail).sum()
        order = list(reversed(scores.argsort()))  # transformers' order, ties included
        return {"sequence": item, "labels": [labels[i] for i in order], "scores": [float(scores[i]) for i in order]}
