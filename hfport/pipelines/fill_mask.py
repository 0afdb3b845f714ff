"""fill-mask: the top_k tokens for each mask token, as transformers' FillMaskPipeline (targets, several masks)."""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import torch
from torch import Tensor

from .base import Feature, Pipeline, PipelineInputError, attempt, check_text, positive_int

log = logging.getLogger("hfport")


class FillMaskPipeline(Pipeline):
    task = "fill-mask"
    token_outputs = ("logits",)
    defaults: ClassVar[dict[str, Any]] = {"top_k": 5, "targets": None}

    def validate(self, opts: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
        positive_int("top_k", opts["top_k"])
        if self.tokenizer.mask_token_id is None:
            raise ValueError(f"fill-mask: the tokenizer {self.tokenizer.name_or_path} has no mask_token")
        opts["_target_ids"] = self.target_ids(opts["targets"]) if opts["targets"] is not None else None
        return opts

    def target_ids(self, targets: str | list[str]) -> list[int]:
        """Vocabulary ids of the targets; a target outside the vocabulary stands for its first token."""
        if isinstance(targets, str):
            targets = [targets]
        if not isinstance(targets, (list, tuple)) or not all(isinstance(t, str) for t in targets):
            raise ValueError(f"targets must be a string or a list of strings, got {targets!r}")
        vocab = self.tokenizer.get_vocab()
        ids = []
        for target in targets:
            found = vocab.get(target)
            if found is None:
                pieces = self.tokenizer(target, add_special_tokens=False, return_attention_mask=False,
                                        return_token_type_ids=False, max_length=1, truncation=True)["input_ids"]
                if not pieces:
                    log.warning("fill-mask: target %r is not in the vocabulary and has no tokens; ignored", target)
                    continue
                found = pieces[0]
                log.warning("fill-mask: target %r is not in the vocabulary; using %r", target,
                            self.tokenizer.convert_ids_to_tokens(found))
            ids.append(found)
        ids = list(set(ids))  # transformers' order: a set's, then by score
        if not ids:
            raise ValueError(f"targets {targets!r}: none of them maps to a token")
        return ids

    def sample_inputs(self, texts: list[str], pairs: list[tuple[str, str]]) -> list[Any]:
        """The texts and passages, each with its middle word masked where it holds no mask token yet (a text
        without one is no fill-mask input)."""
        mask, out = self.tokenizer.mask_token, []
        for text in super().sample_inputs(texts, pairs):
            words = text.split()
            if mask not in text and words:
                words[len(words) // 2] = mask
                text = " ".join(words)
            out.append(text)
        return out

    def preprocess(self, item: Any, opts: dict[str, Any]) -> list[Feature]:
        return self.alone(item, opts)

    def preprocess_many(self, items: list[Any], opts: dict[str, Any]) -> list[list[Feature] | Exception]:
        encoded = self.encode_items(items, lambda item: (check_text(item), None))
        return [rows if isinstance(rows, Exception) else attempt(self.with_mask, rows) for rows in encoded]

    def with_mask(self, rows: list[Feature]) -> list[Feature]:
        if self.tokenizer.mask_token_id not in rows[0].input_ids:
            raise PipelineInputError(f"no mask token ({self.tokenizer.mask_token}) in the text")
        return rows

    def too_long_hint(self) -> str:
        return "shorten the text around the mask"

    def forward(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None,
                encoder_outputs: tuple[Tensor, Tensor | None] | None = None) -> dict[str, Tensor]:
        return {"logits": self.model(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                                     encoder_outputs=encoder_outputs).logits}  # (B, T, V)

    def postprocess(self, item: str, features: list[Feature], opts: dict[str, Any]) -> Any:
        tok = self.tokenizer
        target_ids = opts["_target_ids"]
        top_k = opts["top_k"] if target_ids is None else min(opts["top_k"], len(target_ids))
        input_ids = torch.tensor(features[0].input_ids)  # (T,)
        masked = torch.nonzero(input_ids == tok.mask_token_id, as_tuple=False).squeeze(-1)  # (M,)
        probs = features[0].outputs["logits"][masked].softmax(dim=-1)  # (M, V)
        if target_ids is not None:
            probs = probs[..., target_ids]  # (M, len(targets))
        values, predictions = probs.topk(top_k)  # (M, k)
        single = values.shape[0] == 1
        result = []
        for i, (vals, preds) in enumerate(zip(values.tolist(), predictions.tolist())):
            row = []
            for v, p in zip(vals, preds):
                token = target_ids[p] if target_ids is not None else p
                tokens = input_ids.clone()
                tokens[masked[i]] = token
                if tok.pad_token_id is not None:
                    tokens = tokens[tokens != tok.pad_token_id]
                # with several masks the others stay in the sequence, so special tokens are kept (as transformers)
                row.append({"score": v, "token": token, "token_str": tok.decode([token]),
                            "sequence": tok.decode(tokens.tolist(), skip_special_tokens=single)})
            result.append(row)
        return result[0] if single else result

    def assemble(self, results: list[Any], items: list[Any], single: bool, opts: dict[str, Any]) -> Any:
        if single or len(results) == 1:  # transformers unwraps a one-element list too
            return results[0]
        return results
