"""feature-extraction: per-token hidden states as transformers' FeatureExtractionPipeline returns them, or
sentence embeddings with pooling="mean"|"cls"|"max" (+ normalize=True): sentence-transformers' Pooling + Normalize.

A model folder in the sentence-transformers layout (modules.json; hfport/export/sentence_transformers.py reads it)
gives the defaults: its pooling and normalisation, unless the caller passes `pooling`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from .base import Feature, Pipeline, check_text

POOLINGS = (None, "mean", "cls", "max")


def pool_embeddings(hidden: Tensor, attention_mask: Tensor, mode: str) -> Tensor:
    """Sentence embeddings as sentence-transformers' Pooling computes them: hidden (B, T, C), attention_mask (B, T)
    -> (B, C). mean: over attended tokens; cls: the first token; max: over attended tokens (padding set to -1e9
    first, as sentence-transformers does)."""
    if mode == "cls":
        return hidden[:, 0]  # (B, C)
    mask = attention_mask[..., None].to(hidden.dtype)  # (B, T, 1)
    if mode == "mean":
        return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)  # (B, C)
    if mode == "max":
        return hidden.masked_fill(mask == 0, -1e9).max(dim=1).values  # (B, C)
    raise ValueError(f"pooling={mode!r}: use one of {list(POOLINGS[1:])}")


class FeatureExtractionPipeline(Pipeline):
    task = "feature-extraction"
    token_outputs = ("last_hidden_state",)
    # truncation/max_length/tokenize_kwargs go to the tokenizer; return_tensors gives tensors instead of lists
    defaults: ClassVar[dict[str, Any]] = {"truncation": None, "max_length": None, "tokenize_kwargs": None,
                                          "return_tensors": False, "pooling": None, "normalize": False}

    def __init__(self, model: Any, tokenizer: Any, **kwargs: Any):
        # a sentence-transformers folder says how its embeddings are pooled: the defaults when no pooling is given
        from ..export.sentence_transformers import has_embedding_layout, read_layout

        folder = Path(model.config.source).parent
        self.folder_defaults = {}
        if has_embedding_layout(folder):
            layout = read_layout(folder)
            self.folder_defaults = {"pooling": layout.pooling, "normalize": layout.normalize}
        super().__init__(model, tokenizer, **kwargs)

    def validate(self, opts: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
        if "pooling" not in given and self.folder_defaults:  # pooling=None asks for per-token states
            opts["pooling"] = self.folder_defaults["pooling"]
            if "normalize" not in given:
                opts["normalize"] = self.folder_defaults["normalize"]
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
        return self.encode(check_text(item), **opts["_tokenize"])[:1]

    def forward(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None) -> dict[str, Tensor]:
        out = self.model(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        return {"last_hidden_state": out.last_hidden_state}  # (B, T, C)

    def postprocess(self, item: str, features: list[Feature], opts: dict[str, Any]) -> Any:
        f = features[0]
        hidden = f.outputs["last_hidden_state"]  # (T, C), this row's own tokens
        if opts["pooling"] is None:
            out = hidden[None]  # (1, T, C): transformers keeps the batch axis of one
        else:
            mask = torch.tensor(f.attention_mask)[None]  # (1, T)
            out = pool_embeddings(hidden[None], mask, opts["pooling"])[0]  # (C,)
            if opts["normalize"]:
                out = F.normalize(out, p=2, dim=-1)
        return out if opts["return_tensors"] else out.tolist()
