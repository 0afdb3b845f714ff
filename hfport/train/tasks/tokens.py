"""Token classification (NER, POS...): JSONL with token and tag lists, or CoNLL files; entity-level metrics.

Tags belong to words; the model sees sub-tokens. Each word's tag goes to its first sub-token (or, with
`label_all_subtokens`, to all of them, a B- tag turning into I- after the first, as transformers' run_ner
does); special tokens and the other sub-tokens get -100, which the loss ignores. Evaluation always scores
one tag per word (the first sub-token's), so the entity counts do not depend on how words split.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ...errors import ConfigError
from ...formats.tables import decoded_lines
from ..data import (DataError, EncodedData, Features, LabelSpace, Source, compact, data_sources, encoded_splits,
                    field_of, in_chunks, iter_records, pad_ids, where)
from ..distill import kl_divergence, teacher_label_space
from ..metrics import tokens as metrics
from ..stored import collect
from . import TrainTask

log = logging.getLogger("hfport.train")

IGNORE = -100
CONLL_SUFFIXES = (".conll", ".txt")


# --- reading ---------------------------------------------------------------------------------------------------


class Sentence:
    """One example: words, their tags, and where each tag was read (for errors that point at it)."""

    def __init__(self, tokens: list[str], tags: list[str] | None, line: int, tag_lines: list[int], tag_field: str):
        self.tokens, self.tags, self.line = tokens, tags, line
        self.tag_lines = tag_lines  # the line each tag came from (CoNLL: one per token; JSONL: the record's)
        self.tag_field = tag_field


def read_conll(path: Path) -> list[Sentence]:
    """Every sentence of a CoNLL file (iter_conll), in a list."""
    return list(iter_conll(path))


def iter_conll(path: Path) -> Iterator[Sentence]:
    """One token per line, its tag in the last column; a blank line ends a sentence; -DOCSTART- lines skipped.
    Streamed, a sentence at a time."""
    tokens: list[str] = []
    tags: list[str] = []
    lines: list[int] = []
    empty = True
    for number, text in decoded_lines(path):
        columns = text.split()
        if not columns or columns[0] == "-DOCSTART-":
            if tokens:
                yield Sentence(tokens, tags, lines[0], lines, "tag")
                empty, tokens, tags, lines = False, [], [], []
            continue
        if len(columns) < 2:
            raise DataError(f"{where(path, number, 'tag')}: expected a token and a tag (whitespace-separated), "
                            f"got {text.strip()!r}")
        tokens.append(columns[0])
        tags.append(columns[-1])
        lines.append(number)
    if tokens:
        yield Sentence(tokens, tags, lines[0], lines, "tag")
    elif empty:
        raise DataError(f"{path}: the file has no examples")


def read_jsonl(path: Path, tokens_column: str, tags_column: str, optional_tags: bool = False) -> Iterator[Sentence]:
    """OPTIONAL_TAGS (with a teacher): a row without tags (or null) is a sentence without tags (tags None)."""
    for r in iter_records(path):
        tokens = field_of(r, tokens_column, path, list)
        if not tokens:
            raise DataError(f"{where(path, r.line, tokens_column)}: the token list is empty")
        for k, token in enumerate(tokens):
            # a blank word would get no sub-token, and its tag nowhere to go
            if not isinstance(token, str) or not token.strip():
                raise DataError(f"{where(path, r.line, tokens_column)}: token {k} must be a non-empty string, "
                                f"got {token!r}")
        if optional_tags and r.values.get(tags_column) is None:
            yield Sentence(tokens, None, r.line, [], tags_column)
            continue
        tags = field_of(r, tags_column, path, list)
        if len(tokens) != len(tags):
            raise DataError(f"{where(path, r.line, tags_column)}: {len(tags)} tags for {len(tokens)} tokens")
        for k, tag in enumerate(tags):
            if isinstance(tag, bool) or not isinstance(tag, (str, int)) or (isinstance(tag, str) and not tag.strip()):
                raise DataError(f"{where(path, r.line, tags_column)}: tag {k} must be a name or an id, got {tag!r}")
        yield Sentence(tokens, [str(t).strip() for t in tags], r.line, [r.line] * len(tags), tags_column)


def read_sentences(path: Path, config: Any) -> Iterator[Sentence]:
    """A source's sentences, streamed (CoNLL or a table of token and tag lists)."""
    if path.suffix.lower() in CONLL_SUFFIXES:
        if not path.is_file():
            raise DataError(f"{path}: no such file")
        return iter_conll(path)
    optional = bool(getattr(config, "teacher", None))  # with a teacher a sentence may have no tags
    return read_jsonl(path, config.tokens_column, config.tags_column, optional_tags=optional)


def tag_space(tags: Iterable[str], model_id2label: dict[int, str] | None,
              class_names: list[str] | None = None) -> tuple[LabelSpace, dict[str, int]]:
    """(label space, tag as written -> id). Tag names are sorted; integer tags (a datasets export) keep their
    ids, named by the column's ClassLabel names when the data has them (every class, used or not), else by the
    model's labels when it has as many non-default ones, else by the ids themselves."""
    names = sorted(set(tags))
    if all(t.isdigit() for t in names):
        n = max(int(t) for t in names) + 1
        if class_names and n <= len(class_names):
            return LabelSpace(None, dict(enumerate(class_names))), {str(i): i for i in range(len(class_names))}
        tag_ids = {str(i): i for i in range(n)}
        if model_id2label and len(model_id2label) == n and any(v != f"LABEL_{k}" for k, v in model_id2label.items()):
            return LabelSpace(None, dict(model_id2label)), tag_ids
        return LabelSpace(None, {i: str(i) for i in range(n)}), tag_ids
    return LabelSpace(None, dict(enumerate(names))), {name: i for i, name in enumerate(names)}


# --- alignment -------------------------------------------------------------------------------------------------


def align_labels(word_ids: list[int | None], word_labels: list[int], label_all_subtokens: bool = False,
                 b_to_i: dict[int, int] | None = None) -> tuple[list[int], list[int]]:
    """(labels per sub-token, positions of each word's first sub-token).

    word_ids: the tokenizer's word index per token (None for special tokens); word_labels: one id per word.
    Sub-tokens after a word's first get -100, or with label_all_subtokens the word's label (B- -> I- via b_to_i)."""
    labels, first = [], []
    previous = None
    for position, word in enumerate(word_ids):
        if word is None:
            labels.append(IGNORE)
        elif word != previous:
            labels.append(word_labels[word])
            first.append(position)
        elif label_all_subtokens:
            label = word_labels[word]
            labels.append((b_to_i or {}).get(label, label))
        else:
            labels.append(IGNORE)
        previous = word
    return labels, first


def _b_to_i(id2label: dict[int, str]) -> dict[int, int]:
    """B-X id -> I-X id, where the tag set has both."""
    label2id = {v: k for k, v in id2label.items()}
    return {i: label2id["I-" + name[2:]] for i, name in id2label.items()
            if name.startswith("B-") and "I-" + name[2:] in label2id}


def _class_tags(s: Sentence, names: list[str], path: Path) -> None:
    """A sentence's tags, ids of its source's ClassLabel (a datasets folder, Parquet or Arrow written by datasets),
    as that source's class names."""
    for k, (tag, line) in enumerate(zip(s.tags, s.tag_lines)):
        if not tag.isdigit() or int(tag) >= len(names):
            raise DataError(f"{where(path, line, s.tag_field)}: tag {k}, {tag!r}, is not an id of the column's "
                            f"ClassLabel, 0..{len(names) - 1} ({names})")
        s.tags[k] = names[int(tag)]


def encode_sentences(path: Path, config: Any, tokenizer: Any, label2id: dict[str, int],
                     b_to_i: dict[int, int], class_names: list[str] | None = None) -> Iterator[list[Features]]:
    """A source's sentences tokenized a chunk at a time (yielded as they are encoded), targets aligned to the
    sub-tokens; an unknown tag is an error naming its line before its chunk is encoded. With `class_names` (the
    source's own ClassLabel names) a tag id is that source's class, looked up in `label2id` by name."""
    cut = total = 0
    for chunk in in_chunks(read_sentences(path, config)):
        for s in chunk:
            if class_names is not None and s.tags is not None:
                _class_tags(s, class_names, path)
            for tag, line in zip(s.tags or (), s.tag_lines):
                if tag not in label2id:
                    raise DataError(f"{where(path, line, s.tag_field)}: unknown tag {tag!r}; the training tags are "
                                    f"{sorted(label2id)}")
        enc = tokenizer([s.tokens for s in chunk], is_split_into_words=True, truncation=True,
                        max_length=config.max_length)
        types = enc.get("token_type_ids")
        out = []
        for i, s in enumerate(chunk):
            cut += len(s.tokens) - 1 not in enc.word_ids(i)
            word_labels = [IGNORE] * len(s.tokens) if s.tags is None else [label2id[t] for t in s.tags]
            labels, first = align_labels(enc.word_ids(i), word_labels, config.label_all_subtokens, b_to_i)
            out.append(Features(compact(enc["input_ids"][i]), compact(types[i], "b") if types is not None else None,
                                labels, (str(path), s.line), {"first": first}))
        total += len(chunk)
        yield out
    if cut:  # their last words are neither trained on nor scored
        log.warning("%s: %d of %d sentences are longer than max_length %d tokens and were cut", path, cut, total,
                    config.max_length)


# --- the task --------------------------------------------------------------------------------------------------


class TokenClassification(TrainTask):
    name = "token-classification"
    compute_metrics = staticmethod(metrics.compute)

    def read(self, config: Any, tokenizer: Any, model_id2label: dict[int, str] | None) -> EncodedData:
        if config.class_weights == "balanced":
            # the loop's "balanced" counts one label per example; per-token counts would need the task's own
            raise ConfigError("class_weights 'balanced' is for sequence classification; for token classification "
                              "pass one weight per tag, in id2label order")
        train_path, eval_path = data_sources(config)
        # the tag set needs every training sentence: a first pass keeps only the distinct tags (and checks every row)
        tags = {t for s in read_sentences(train_path, config) for t in s.tags or ()}
        teacher = teacher_label_space(config)  # with a teacher, its tags in its order
        space, label2id = (LabelSpace(None, teacher.id2label), teacher.label2id) if teacher else tag_space(
            tags, model_id2label, train_path.class_names(config.tags_column))
        settings = {"tokens": config.tokens_column, "tags": config.tags_column, "max_length": config.max_length,
                    "label_all_subtokens": config.label_all_subtokens, "label2id": label2id}

        def encoded(path: Source) -> Sequence[Features]:
            # a source's ClassLabel ids are its own classes, found among the training tags by name (an eval split
            # saved on its own may list them in another order)
            names = path.class_names(config.tags_column)
            mapping = space.label2id if names is not None else label2id
            chunks = encode_sentences(path, config, tokenizer, mapping, _b_to_i(space.id2label), names)
            return collect(chunks, path, tokenizer, self.name, {**settings, "label2id": mapping, "class_names": names})

        train, evaluation = encoded_splits(encoded, train_path, eval_path, config)
        return EncodedData(train, evaluation, space, tokenizer.pad_token_id)

    def collate(self, items: list[Features], data: EncodedData, seed: int) -> dict[str, torch.Tensor]:
        batch = pad_ids(items, data.pad_token_id)
        labels = torch.full_like(batch["input_ids"], IGNORE)  # (B, T): padding is ignored too
        for i, x in enumerate(items):
            labels[i, :len(x.target)] = torch.tensor(x.target)
        batch["labels"] = labels
        # (n, 2): (row, position) of every word's first sub-token, the positions evaluation (and distillation) read
        batch["word_starts"] = torch.tensor([[i, p] for i, x in enumerate(items) for p in x.meta["first"]],
                                            dtype=torch.long).reshape(-1, 2)
        return batch

    def loss(self, outputs: Any, batch: dict[str, torch.Tensor], data: EncodedData, class_weights: Any,
             label_smoothing: float) -> torch.Tensor:
        logits = outputs.logits.float()  # (B, T, L)
        weight = class_weights.to(logits.device) if class_weights is not None else None
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), weight=weight,  # (B*T, L), (B*T,)
                               ignore_index=IGNORE, label_smoothing=label_smoothing)

    def loss_options(self, data: EncodedData) -> frozenset[str]:
        return frozenset({"label_smoothing", "class_weights"})

    def loss_count(self, batch: dict[str, torch.Tensor], data: EncodedData, class_weights: Any) -> Any:
        """The labelled sub-tokens; with class weights, the sum of their weights (what the weighted mean divides
        by)."""
        labels = batch["labels"]  # (B, T)
        if class_weights is None:
            return (labels != IGNORE).sum()  # ()
        labelled = labels != IGNORE  # (B, T); weights gathered at every position, 0 where unlabelled (no
        # boolean index: its size would be read from the GPU)
        return (class_weights.to(labels.device)[labels.clamp(min=0)] * labelled).sum()  # ()

    # distillation (hfport/train/distill.py): the teacher's logits at each word's first sub-token

    distillable = True
    teacher_stands_in_for = ("tags_column",)

    def teacher_targets(self, outputs: Any, batch: dict[str, torch.Tensor], items: list[Features],
                        data: EncodedData) -> list[np.ndarray]:
        logits = outputs.logits.float().cpu().numpy()  # (B, T, L)
        return [logits[i, x.meta["first"]] for i, x in enumerate(items)]  # (W_i, L) each

    def distill_terms(self, outputs: Any, batch: dict[str, torch.Tensor], teacher: torch.Tensor, data: EncodedData,
                      temperature: float, companion: Any) -> tuple[torch.Tensor, torch.Tensor]:
        rows, positions = batch["word_starts"].unbind(-1)  # (n,) each
        logits = outputs.logits.float()[rows, positions]  # (n, L)
        return kl_divergence(logits, teacher.view_as(logits), temperature), rows

    def labelled(self, batch: dict[str, torch.Tensor], data: EncodedData) -> torch.Tensor | None:
        return (batch["labels"] != IGNORE).any(-1)  # (B,): a sentence without tags has none

    def distill_units(self, batch: dict[str, torch.Tensor], data: EncodedData) -> Any:
        return batch["word_starts"].shape[0]

    def eval_rows(self, outputs: Any, batch: dict[str, torch.Tensor], items: list[Features],
                  data: EncodedData) -> list[Any]:
        """(predicted ids, gold ids) at each word's first sub-token: small, whatever the vocabulary of tags."""
        predicted = outputs.logits.argmax(-1).cpu().numpy()  # (B, T)
        rows = []
        for i, x in enumerate(items):
            first = x.meta["first"]
            rows.append((predicted[i, first], np.asarray(x.target)[first]))
        return rows

    def sample_rows(self, data: EncodedData) -> list[Any]:
        every_tag = np.arange(len(data.space.id2label))  # one word of each tag: every entity type reports its f1
        return [(every_tag, every_tag)]

    def metrics(self, rows: list[Any], data: EncodedData, id2label: dict[int, str]) -> dict[str, float]:
        return self.compute_metrics(predictions=[r[0] for r in rows], labels=[r[1] for r in rows],
                               id2label=id2label)

