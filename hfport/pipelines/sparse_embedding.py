"""sparse-embedding (SPLADE): one vocabulary-sized, mostly-zero vector per text, as sentence-transformers'
SparseEncoder.encode computes it from a folder it saved (Transformer fill-mask -> SpladePooling; the folder's
1_SpladePooling/config.json picks max or sum pooling and the activation, hfport/formats/sentence_transformers.py's
read_sparse_layout). A masked-LM folder without the SparseEncoder files pools as SpladePooling's defaults (max, relu).
An ONNX folder exported from such a model (its graph returns the MLM logits; the export copies the SparseEncoder files)
pools the graph's logits the same way (tasks/sparse_embedding.py: sparse_vectors, logits_vectors).

A result is TEI's sparse shape: the nonzero entries, in index order, as [{"index": token id, "value": weight}, ...]
(what TEI's /embed_sparse answers per text; `output="dict"` gives {token id: weight} instead). max_active_dims keeps
the largest n entries, as encode() does. TEI's POST /embed_sparse serves through this pipeline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from ..formats.sentence_transformers import SparseLayout, read_sparse_layout
from ..tasks.sparse_embedding import sparse_vectors
from .base import Feature, positive_int
from .sentence_embedding import TextEmbeddingPipeline

OUTPUTS = ("sparse", "dict")


class SparseEmbeddingPipeline(TextEmbeddingPipeline):
    """task "sparse-embedding": a sparse vector per text, pooled as the folder's SpladePooling says.

    Options: truncate (cut inputs longer than max_input_length instead of failing them), truncation_direction
    ("right"|"left"), prompt_name (a prefix from the folder's prompts), max_active_dims (keep the n largest weights),
    output ("sparse": [{"index", "value"}] by index; "dict": {index: value}). An item is a text or a list of token
    ids (used as given)."""

    task = "sparse-embedding"
    model_task = "fill-mask"  # the masked-LM model; the SPLADE pooling is this pipeline's
    defaults: ClassVar[dict[str, Any]] = {"truncate": False, "truncation_direction": "right", "prompt_name": None,
                                          "max_active_dims": None, "output": "sparse"}

    def __init__(self, model: Any, tokenizer: Any, **kwargs: Any):
        super().__init__(model, tokenizer, **kwargs)
        self.dimension = model.config.vocab_size

    @staticmethod
    def read_folder_layout(folder: Path | None) -> SparseLayout:
        return read_sparse_layout(folder) if folder is not None and (folder / "modules.json").is_file() \
            else SparseLayout()

    def validate(self, opts: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
        positive_int("max_active_dims", opts["max_active_dims"], allow_none=True)
        if opts["output"] not in OUTPUTS:
            raise ValueError(f"output={opts['output']!r}: use one of {list(OUTPUTS)}")
        return self.validate_inputs(opts)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None,
                encoder_outputs: tuple[Tensor, Tensor | None] | None = None) -> dict[str, Tensor]:
        vectors = sparse_vectors(self.model, input_ids, attention_mask, token_type_ids,
                                 self.sentence.pooling_strategy, self.sentence.activation,
                                 encoder_outputs=encoder_outputs)  # (B, V)
        return {"sparse": vectors}

    def postprocess(self, item: Any, features: list[Feature], opts: dict[str, Any]) -> Any:
        vector = features[0].outputs["sparse"]  # (V,)
        if opts["max_active_dims"] is not None and opts["max_active_dims"] < vector.shape[0]:
            top = torch.topk(vector, opts["max_active_dims"])  # the n largest, as encode(max_active_dims=n)
            vector = torch.zeros_like(vector).scatter_(0, top.indices, top.values)  # (V,)
        index = vector.nonzero().squeeze(-1)  # (N,) ascending
        values = vector[index].tolist()
        if opts["output"] == "dict":
            return dict(zip(index.tolist(), values))
        return [{"index": i, "value": v} for i, v in zip(index.tolist(), values)]
