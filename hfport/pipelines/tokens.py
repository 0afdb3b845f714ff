"""token-classification (NER): a label per token, or per word / entity group, as transformers'
TokenClassificationPipeline: aggregation_strategy none | simple | first | average | max, ignore_labels, stride."""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import numpy as np
from torch import Tensor

from .base import Feature, Pipeline, check_text, softmax_np

log = logging.getLogger("hfport")

STRATEGIES = ("none", "simple", "first", "average", "max")


class TokenClassificationPipeline(Pipeline):
    task = "token-classification"
    token_outputs = ("logits",)
    # ignore_labels None means ["O"]; stride None: texts longer than model_max_length are truncated, a stride
    # splits them into overlapping windows instead (needs an aggregation strategy other than "none")
    defaults: ClassVar[dict[str, Any]] = {"aggregation_strategy": "none", "ignore_labels": None, "stride": None}
    _warned_heuristic = False

    def validate(self, opts: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
        strategy = opts["aggregation_strategy"]
        if not isinstance(strategy, str) or strategy.lower() not in STRATEGIES:
            raise ValueError(f"aggregation_strategy={strategy!r}: use one of {list(STRATEGIES)}")
        opts["aggregation_strategy"] = strategy.lower()
        if opts["ignore_labels"] is None:
            opts["ignore_labels"] = ["O"]
        stride = opts["stride"]
        if stride is not None:
            if isinstance(stride, bool) or not isinstance(stride, int) or stride < 0:
                raise ValueError(f"stride must be an integer >= 0, got {stride!r}")
            if stride >= self.tokenizer.model_max_length:
                raise ValueError(f"stride ({stride}) must be less than the tokenizer's model_max_length "
                                 f"({self.tokenizer.model_max_length})")
            if opts["aggregation_strategy"] == "none":
                raise ValueError('stride splits long texts into windows whose entities are merged: it needs '
                                 'aggregation_strategy "simple", "first", "average" or "max", not "none"')
        return opts

    def preprocess(self, item: Any, opts: dict[str, Any]) -> list[Feature]:
        return self.alone(item, opts)

    def preprocess_many(self, items: list[Any], opts: dict[str, Any]) -> list[list[Feature] | Exception]:
        return self.encode_items(items, lambda item: (check_text(item), None), **self.tokenize_kwargs(opts))

    def tokenize_kwargs(self, opts: dict[str, Any]) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if opts["stride"] is not None:  # overflowing windows, padded to one length as transformers does
            extra = {"return_overflowing_tokens": True, "padding": True, "stride": opts["stride"]}
        # transformers truncates to model_max_length (when the tokenizer has one) unless a stride asks for windows
        return {"truncation": bool(self.tokenizer.model_max_length), "return_special_tokens_mask": True,
                "return_offsets_mapping": True, **extra}

    def too_long_hint(self) -> str:
        return (f"the tokenizer's model_max_length ({self.tokenizer.model_max_length}) does not cut it to the model's "
                "size: set model_max_length in tokenizer_config.json (then stride=... splits long texts)")

    def forward(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None,
                encoder_outputs: tuple[Tensor, Tensor | None] | None = None) -> dict[str, Tensor]:
        return {"logits": self.model(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                                     encoder_outputs=encoder_outputs).logits}  # (B, T, L)

    def postprocess(self, item: str, features: list[Feature], opts: dict[str, Any]) -> list[dict[str, Any]]:
        strategy, ignore = opts["aggregation_strategy"], opts["ignore_labels"]
        entities: list[dict[str, Any]] = []
        for f in features:
            scores = softmax_np(f.outputs["logits"].numpy())  # (T, L)
            pre = self.gather_pre_entities(item, f, scores, strategy)
            grouped = self.aggregate(pre, strategy)
            entities += [e for e in grouped if e.get("entity") not in ignore and e.get("entity_group") not in ignore]
        if len(features) > 1:
            entities = aggregate_overlapping_entities(entities)
        return entities

    # --- transformers' TokenClassificationPipeline, step by step --------------------------------------------

    def gather_pre_entities(self, sentence: str, f: Feature, scores: np.ndarray, strategy: str) -> list[dict]:
        tok = self.tokenizer
        # WordPiece marks continuations ("##"): a token is a subword when its text differs from its source span.
        # Other models fall back to "does a space precede it?"
        has_prefix = bool(getattr(tok.backend_tokenizer.model, "continuing_subword_prefix", None))
        if not has_prefix and strategy in ("first", "average", "max") and not self._warned_heuristic:
            log.warning("token-classification: the tokenizer marks no subwords; words are guessed from spaces")
            self._warned_heuristic = True
        pre = []
        for idx, token_scores in enumerate(scores):
            if f.data["special_tokens_mask"][idx]:
                continue
            token_id = f.input_ids[idx]
            word = tok.convert_ids_to_tokens(token_id)
            start, end = f.data["offset_mapping"][idx]
            word_ref = sentence[start:end]
            if has_prefix:
                is_subword = len(word) != len(word_ref)
            else:
                is_subword = start > 0 and " " not in sentence[start - 1:start + 1]
            if token_id == tok.unk_token_id:
                word, is_subword = word_ref, False
            pre.append({"word": word, "scores": token_scores, "start": start, "end": end, "index": idx,
                        "is_subword": is_subword})
        return pre

    def aggregate(self, pre: list[dict], strategy: str) -> list[dict]:
        id2label = self.model.config.id2label
        if strategy in ("none", "simple"):
            entities = []
            for p in pre:
                i = int(p["scores"].argmax())
                entities.append({"entity": id2label[i], "score": float(p["scores"][i]), "index": p["index"],
                                 "word": p["word"], "start": p["start"], "end": p["end"]})
        else:
            entities = self.aggregate_words(pre, strategy)
        return entities if strategy == "none" else self.group_entities(entities)

    def aggregate_word(self, group: list[dict], strategy: str) -> dict:
        id2label = self.model.config.id2label
        word = self.tokenizer.convert_tokens_to_string([e["word"] for e in group])
        if strategy == "first":
            scores = group[0]["scores"]
        elif strategy == "max":
            scores = max(group, key=lambda e: e["scores"].max())["scores"]
        else:  # average
            scores = np.nanmean(np.stack([e["scores"] for e in group]), axis=0)
        i = int(scores.argmax())
        return {"entity": id2label[i], "score": float(scores[i]), "word": word, "start": group[0]["start"],
                "end": group[-1]["end"]}

    def aggregate_words(self, pre: list[dict], strategy: str) -> list[dict]:
        """Subwords of one word share its label: a word starts at every token that is not a subword."""
        words, group = [], None
        for e in pre:
            if group is None:
                group = [e]
            elif e["is_subword"]:
                group.append(e)
            else:
                words.append(self.aggregate_word(group, strategy))
                group = [e]
        if group is not None:
            words.append(self.aggregate_word(group, strategy))
        return words

    def group_sub_entities(self, entities: list[dict]) -> dict:
        return {"entity_group": entities[0]["entity"].split("-", 1)[-1],
                "score": float(np.mean(np.nanmean([e["score"] for e in entities]))),
                "word": self.tokenizer.convert_tokens_to_string([e["word"] for e in entities]),
                "start": entities[0]["start"], "end": entities[-1]["end"]}

    def group_entities(self, entities: list[dict]) -> list[dict]:
        """Adjacent entities with the same tag join one group, unless the next one begins a new entity (B-)."""
        groups, current = [], []
        for e in entities:
            if not current:
                current.append(e)
                continue
            bi, tag = get_tag(e["entity"])
            _, last_tag = get_tag(current[-1]["entity"])
            if tag == last_tag and bi != "B":
                current.append(e)
            else:
                groups.append(self.group_sub_entities(current))
                current = [e]
        if current:
            groups.append(self.group_sub_entities(current))
        return groups


def get_tag(name: str) -> tuple[str, str]:
    if name.startswith("B-"):
        return "B", name[2:]
    if name.startswith("I-"):
        return "I", name[2:]
    return "I", name  # no prefix: treated as a continuation, as transformers does


def aggregate_overlapping_entities(entities: list[dict]) -> list[dict]:
    """Windows overlap: of entities that overlap, keep the longest (then the higher score)."""
    if not entities:
        return entities
    entities = sorted(entities, key=lambda x: x["start"])
    kept, previous = [], entities[0]
    for e in entities:
        if previous["start"] <= e["start"] < previous["end"]:
            length, previous_length = e["end"] - e["start"], previous["end"] - previous["start"]
            if length > previous_length or (length == previous_length and e["score"] > previous["score"]):
                previous = e
        else:
            kept.append(previous)
            previous = e
    kept.append(previous)
    return kept
