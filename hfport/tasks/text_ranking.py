"""text-ranking: a cross-encoder reranker, one relevance logit per (query, text) pair.

The model is a one-label text-classification model (EncoderForSequenceClassification, num_labels=1): its folders
are HF *ForSequenceClassification folders that sentence-transformers' CrossEncoder loads, served by the
text-classification pipeline with {"text": query, "text_pair": document} inputs (a sigmoid score). Training:
(query, text, label) rows or (query, positive, negatives) groups, with binary cross-entropy or a listwise softmax
loss (hfport/train/tasks/ranking.py).
"""

from __future__ import annotations

from .task import Columns, Task
from .text_classification import EncoderForSequenceClassification

TASK = Task(
    name="text-ranking", aliases=("reranking",), model_class=EncoderForSequenceClassification,
    outputs=("logits",), per_sequence=frozenset({"logits"}), auto_class="AutoModelForSequenceClassification",
    pipeline="hfport.pipelines.classification:TextClassificationPipeline",
    train="hfport.train.tasks.ranking:Reranking",
    columns=(Columns(("query_column", "text_column", "label_column"),  # a row a (query, text) pair
                     texts=("query_column", "text_column")),
             Columns(("query_column", "positive_column", "negatives_column"),  # a row a query's group
                     texts=("query_column", "positive_column"), lists=("negatives_column",))),
    default_metrics={None: ("ndcg@10", "max")},
    labels=True, model_task="text-classification")
