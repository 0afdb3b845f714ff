"""feature-extraction: per-token hidden states, as transformers' FeatureExtractionPipeline returns them, on every
folder (a sentence-transformers folder too: its Pooling is not applied here); or sentence embeddings when asked with
pooling="mean"|"cls"|"max"|"mean_sqrt_len"|"lasttoken" (+ normalize=True): sentence-transformers' Pooling + Normalize.

Sentence embeddings pooled as a folder's sentence-transformers files say are the "sentence-embedding" pipeline's
(pipelines/sentence_embedding.py).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from ..heads import SENTENCE_POOLINGS, pool
from .base import Feature, Pipeline, check_text

POOLINGS = (None, *SENTENCE_POOLINGS)  # None: per-token states (transformers' feature-extraction)


class FeatureExtractionPipeline(Pipeline):
    task = "feature-extraction"
    token_outputs = ("last_hidden_state",)
    # truncation/max_length/tokenize_kwargs go to the tokenizer; return_tensors gives tensors instead of lists
    defaults: ClassVar[dict[str, Any]] = {"truncation": None, "max_length": None, "tokenize_kwargs": None,
                                          "return_tensors": False, "pooling": None, "normalize": False}

    def validate(self, opts: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
        if opts["pooling"] not in POOLINGS:
            raise ValueError(f"pooling={opts['pooling']!r}: use one of {list(POOLINGS)}")
        if opts["normalize"] and opts["pooling"] is None:
            raise ValueError("normalize=True normalizes sentence embeddings: give pooling='mean', 'cls' or 'max' too")
        kwargs = dict(opts["tokenize_kwargs"] or {})
        allowed = {"truncation", "max_length", "padding", "add_special_tokens", "stride"}
        if set(kwargs) - allowed:
            raise ValueError(f"tokenize_kwargs: unknown {sorted(set(kwargs) - allowed)}; valid: {sorted(allowed)}")
        for name in ("truncation", "max_length"):
            if opts[name] is not None:
                if name in kwargs:
                    raise ValueError(f"{name} given twice (as an option and in tokenize_kwargs)")
                kwargs[name] = opts[name]
        opts["_tokenize"] = kwargs
        return opts

    def preprocess(self, item: Any, opts: dict[str, Any]) -> list[Feature]:
        return self.alone(item, opts)

    def preprocess_many(self, items: list[Any], opts: dict[str, Any]) -> list[list[Feature] | Exception]:
        encoded = self.encode_items(items, lambda item: (check_text(item), None), **opts["_tokenize"])
        return [rows if isinstance(rows, Exception) else rows[:1] for rows in encoded]

    def forward(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None,
                encoder_outputs: tuple[Tensor, Tensor | None] | None = None) -> dict[str, Tensor]:
        out = self.model(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                         encoder_outputs=encoder_outputs)
        return {"last_hidden_state": out.last_hidden_state}  # (B, T, C)

    def postprocess(self, item: str, features: list[Feature], opts: dict[str, Any]) -> Any:
        f = features[0]
        hidden = f.outputs["last_hidden_state"]  # (T, C), this row's own tokens
        if opts["pooling"] is None:
            out = hidden[None]  # (1, T, C): transformers keeps the batch axis of one
        else:
            mask = torch.tensor(f.attention_mask)[None]  # (1, T)
            out = pool(hidden[None], mask, opts["pooling"])[0]  # (C,)
            if opts["normalize"]:
                out = F.normalize(out, p=2, dim=-1)
        return out if opts["return_tensors"] else out.tolist()
