"""zero-shot-classification: labels given at call time, scored by an NLI text-classification model
(hfport/pipelines/zero_shot.py). It serves text-classification's model and trains nothing of its own: an NLI model is
fine-tuned as text-classification on (premise, hypothesis, label) rows."""

from __future__ import annotations

from .task import Task
from .text_classification import EncoderForSequenceClassification

TASK = Task(
    name="zero-shot-classification", aliases=(), model_class=EncoderForSequenceClassification,
    outputs=("logits",), per_sequence=frozenset({"logits"}), auto_class="AutoModelForSequenceClassification",
    pipeline="hfport.pipelines.zero_shot:ZeroShotClassificationPipeline", train=None,
    labels=True, model_task="text-classification")
