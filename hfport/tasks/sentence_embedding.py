"""sentence-embedding: fine-tune the bare encoder + a pooling (mean, cls or max; optionally L2-normalised) into a
sentence-embedding model, as sentence-transformers trains one.

The model is feature-extraction's (EncoderModel): a run's best/ and final/ are HF BertModel-style folders in the
sentence-transformers layout (hfport/formats/sentence_transformers.py), which `hfport.pipeline("sentence-embedding")`
pools as the folder says ("feature-extraction" keeps transformers' meaning: token states). Training: (anchor,
positive[, negative]) rows with in-batch negatives, or (sentence1, sentence2, score) rows with CoSENT
(hfport/train/tasks/embedding.py).
"""

from __future__ import annotations

from .feature_extraction import EncoderModel
from .task import Columns, Task

TASK = Task(
    name="sentence-embedding", aliases=("sentence-similarity", "sentence-embeddings"), model_class=EncoderModel,
    outputs=("last_hidden_state", "pooler_output"), per_sequence=frozenset({"pooler_output"}),
    auto_class="AutoModel", pipeline="hfport.pipelines.sentence_embedding:SentenceEmbeddingPipeline",
    train="hfport.train.tasks.embedding:SentenceEmbedding",
    columns=(Columns(("anchor_column", "positive_column"), optional=("negative_column",),  # pairs, triplets
                     texts=("anchor_column", "positive_column")),  # a negative: a text or a list of them
             Columns(("sentence1_column", "sentence2_column", "score_column"),  # scored pairs
                     texts=("sentence1_column", "sentence2_column"))),
    # problem types of the data: pairs/triplets are scored as retrieval, scored pairs by rank correlation
    default_metrics={None: ("ndcg@10", "max"), "pairs": ("ndcg@10", "max"), "scored-pairs": ("spearman", "max")},
    model_task="feature-extraction")
