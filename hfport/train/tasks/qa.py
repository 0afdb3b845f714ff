"""Extractive question answering: SQuAD v1/v2 JSON or flat JSONL; long contexts in doc_stride windows.

Training targets follow transformers' run_qa: each window of a context gets the answer's start/end token when
the whole answer lies inside it, else the [CLS] position (as do unanswerable questions). Evaluation decodes the
best span of every window with the QA pipeline's own functions, keeps the best across an example's windows,
and scores answer strings with SQuAD EM/F1; on v2 data the empty answer wins where the null score is higher.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from ...formats.jsonstream import JsonStream
from ...formats.tables import MAX_LINE_BYTES
from ...pipelines.qa import select_starts_ends
from ...tokenizer import TokenizerError
from ..data import (DataError, EncodedData, Features, Source, compact, data_sources, field_of, held_out,
                    in_chunks, iter_records, pad_ids, where)
from ..metrics import qa as metrics
from ..stored import collect
from . import TrainTask


@dataclass
class Example:
    question: str
    context: str
    answers: list[tuple[str, int]]  # (text, answer_start); empty: unanswerable
    source: tuple[str, int]  # file, line (0 for SQuAD JSON)
    qid: str


# --- reading ---------------------------------------------------------------------------------------------------


def _checked_answers(raw: Any, context: str, at: str, field: str) -> list[tuple[str, int]]:
    """{"text": [...], "answer_start": [...]} or [{"text", "answer_start"}, ...] -> [(text, start)], each one
    checked against the context so a shifted offset cannot train the model on the wrong span."""
    if isinstance(raw, dict):
        texts, starts = raw.get("text"), raw.get("answer_start")
        if not isinstance(texts, list) or not isinstance(starts, list) or len(texts) != len(starts):
            raise DataError(f"{at}, field '{field}': expected {{'text': [...], 'answer_start': [...]}} with lists of "
                            f"the same length, got {raw!r}")
        pairs = list(zip(texts, starts))
    elif isinstance(raw, list):
        pairs = []
        for a in raw:
            if not isinstance(a, dict) or "text" not in a or "answer_start" not in a:
                raise DataError(f"{at}, field '{field}': each answer needs 'text' and 'answer_start', got {a!r}")
            pairs.append((a["text"], a["answer_start"]))
    else:
        raise DataError(f"{at}, field '{field}': expected a list of answers or {{'text': [...], 'answer_start': "
                        f"[...]}}, got {type(raw).__name__}")
    out = []
    for text, start in pairs:
        if not isinstance(text, str) or not text or isinstance(start, bool) or not isinstance(start, int):
            raise DataError(f"{at}, field '{field}': answer text must be a non-empty string and answer_start an "
                            f"integer, got {text!r} at {start!r}")
        if start < 0 or context[start:start + len(text)] != text:  # (a negative start would slice from the end)
            found = context[max(0, start):start + len(text)]
            raise DataError(f"{at}, field '{field}': answer_start {start} does not match the text: the context has "
                            f"{found!r} there, not {text!r}")
        out.append((text, start))
    return out


def _text(value: Any, at: str, field: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{at}, field '{field}': expected non-empty text, got {value!r}")
    return value


def _paragraphs(doc: JsonStream, path: Path, a: int) -> Iterator[tuple[int, int, Any]]:
    """The paragraphs of the article object data[A], one parsed at a time."""
    seen, later = False, None
    for key in doc.members():
        if later is not None:  # yielded once the walk is past the value, so a syntax error after it comes first
            yield from later
            later = None
        if key != "paragraphs":
            continue  # title and the rest: skipped
        if seen:  # (a whole-document parse would keep the last; a stream has read the first)
            raise DataError(f"{path}, data[{a}]: 'paragraphs' appears twice")
        seen = True
        if doc.peek() == "[":
            yield from ((a, p, paragraph) for p, paragraph in doc.elements())
            continue
        later = _not_a_list(doc.value(), path, a)
    if later is not None:
        yield from later


def _not_a_list(paragraphs: Any, path: Path, a: int) -> Iterator[tuple[int, int, Any]]:
    """'paragraphs' that is not a list: walked as before (a string's or an object's first item is the error)."""
    if not isinstance(paragraphs, (str, dict)):
        raise DataError(f"{path}, data[{a}], field 'paragraphs': expected a list, got {type(paragraphs).__name__}")
    yield from ((a, p, paragraph) for p, paragraph in enumerate(paragraphs))


def squad_paragraphs(path: Path) -> Iterator[tuple[int, int, Any]]:
    """(article index, paragraph index, paragraph) of a SQuAD JSON file in file order, the file read a paragraph at
    a time: what is held is one paragraph and the read buffer, never the document. An article that is not an
    object, or has no 'paragraphs', has none; "version", "title" and the rest are passed over wherever they are."""
    found = False
    with JsonStream(path) as doc:
        if doc.peek() != "{":
            doc.expect_value()
            doc.skip()  # a valid document that is not an object is the error below; an invalid one, json's
        else:
            for key in doc.members():
                if key != "data":
                    continue
                if found:
                    raise DataError(f"{path}: 'data' appears twice")
                found = doc.peek() == "["
                if not found:
                    doc.skip()  # json's error first if the rest is not valid JSON, as a whole parse gives
                    continue
                for a in doc.items():
                    if doc.peek() == "{":
                        yield from _paragraphs(doc, path, a)
        doc.end()
    if not found:
        raise DataError(f"{path}: a SQuAD file is an object with a 'data' list")


def read_squad(path: Path) -> Iterator[Example]:
    """SQuAD JSON ({"data": [{"paragraphs": [{"context", "qas": [...]}]}]}): errors name the question's id. Streamed
    a paragraph at a time (squad_paragraphs); the encoded windows go a chunk at a time to collect()."""
    return squad_examples(squad_paragraphs(path), path)


def squad_examples(paragraphs: Iterable[tuple[int, int, Any]], path: Path) -> Iterator[Example]:
    """The checked examples of (article index, paragraph index, paragraph) triples from the SQuAD file PATH."""
    empty = True
    for a, p, paragraph in paragraphs:
        at_paragraph = f"{path}, data[{a}].paragraphs[{p}]"
        if not isinstance(paragraph, dict):
            raise DataError(f"{at_paragraph}: expected an object, got {type(paragraph).__name__}")
        context = _text(paragraph.get("context"), at_paragraph, "context")
        for q, qa in enumerate(paragraph.get("qas", [])):
            qid = str(qa.get("id", f"{a}.{p}.{q}")) if isinstance(qa, dict) else f"{a}.{p}.{q}"
            at = f"{path}, question id {qid!r}"
            if not isinstance(qa, dict):
                raise DataError(f"{at}: expected an object, got {type(qa).__name__}")
            question = _text(qa.get("question"), at, "question")
            if qa.get("is_impossible", False):
                answers = []
            elif "answers" not in qa:
                raise DataError(f"{at}, field 'answers': missing (and the question is not marked is_impossible)")
            else:
                answers = _checked_answers(qa["answers"], context, at, "answers")
            empty = False
            yield Example(question, context, answers, (str(path), 0), qid)
    if empty:
        raise DataError(f"{path}: the file has no examples")


def read_flat(path: Path, config: Any) -> Iterator[Example]:
    """JSONL (or any table): question, context, answers (an empty answer list marks an unanswerable question);
    streamed."""
    for r in iter_records(path):
        at = where(path, r.line)
        question = _text(field_of(r, config.question_column, path), at, config.question_column)
        context = _text(field_of(r, config.context_column, path), at, config.context_column)
        answers = _checked_answers(field_of(r, config.answers_column, path), context, at, config.answers_column)
        yield Example(question, context, answers, (str(path), r.line), str(r.values.get("id", r.line)))


def _is_squad(path: Path) -> bool:
    """A .json file whose first non-blank character opens an object and which is not one object per line."""
    if path.suffix.lower() != ".json" or not path.is_file():
        return False
    with open(path, "rb") as f:
        head = f.read(MAX_LINE_BYTES)
    first_line = head.lstrip().split(b"\n", 1)[0]
    try:
        obj = json.loads(first_line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return True  # a pretty-printed (or over-long single-line) document, not JSON lines
    return isinstance(obj, dict) and "data" in obj


def read_examples(path: Path, config: Any) -> Iterator[Example]:
    """A source's examples, streamed: a table's a batch of rows at a time, a SQuAD JSON file's (one JSON document,
    a file of its own) a paragraph at a time."""
    return read_squad(Path(path)) if _is_squad(path) else read_flat(path, config)


# --- windows and target positions ------------------------------------------------------------------------------


def answer_positions(offsets: list[tuple[int, int]], sequence_ids: list[int | None], answer: tuple[str, int] | None,
                     cls_index: int = 0) -> tuple[int, int]:
    """(start, end) token of the answer in one window, or (cls_index, cls_index) when it has none or the answer
    is not wholly inside the window's context tokens (run_qa's rule)."""
    if answer is None:
        return cls_index, cls_index
    start_char = answer[1]
    end_char = start_char + len(answer[0])
    context_tokens = [i for i, s in enumerate(sequence_ids) if s == 1]
    first, last = context_tokens[0], context_tokens[-1]
    if not (offsets[first][0] <= start_char and offsets[last][1] >= end_char):
        return cls_index, cls_index
    start = first
    while start <= last and offsets[start][0] <= start_char:
        start += 1
    end = last
    while end >= first and offsets[end][1] >= end_char:
        end -= 1
    return start - 1, end + 1


def encode_windows(tokenizer: Any, examples: list[Example], max_length: int, doc_stride: int,
                   path: Path, first: int = 0) -> list[Features]:
    """One Features per window: target (start, end); meta the example index (FIRST + its place in EXAMPLES), the
    char offsets of the context tokens (None elsewhere) for turning a span back into text."""
    try:
        enc = tokenizer([e.question for e in examples], [e.context for e in examples], truncation="only_second",
                        max_length=max_length, stride=doc_stride, return_overflowing_tokens=True,
                        return_offsets_mapping=True)
    except TokenizerError:
        longest = max(examples, key=lambda e: len(e.question))
        raise DataError(f"{where(path, longest.source[1] or None, 'question')}: a question leaves no room for the "
                        f"context in max_length {max_length} with doc_stride {doc_stride} (question id "
                        f"{longest.qid!r}); raise max_length or lower doc_stride") from None
    types = enc.get("token_type_ids")
    cls_id = tokenizer.cls_token_id
    out = []
    for row, k in enumerate(enc["overflow_to_sample_mapping"]):
        example = examples[k]
        ids, offsets, seq = enc["input_ids"][row], enc["offset_mapping"][row], enc.sequence_ids(row)  # (T,) each
        cls_index = ids.index(cls_id) if cls_id in ids else 0
        start, end = answer_positions(offsets, seq, example.answers[0] if example.answers else None, cls_index)
        context_offsets = [tuple(o) if s == 1 else None for o, s in zip(offsets, seq)]
        out.append(Features(compact(ids), compact(types[row], "b") if types is not None else None, (start, end),
                            example.source, {"example": first + k, "offsets": context_offsets, "cls": cls_index}))
    return out


# --- decoding --------------------------------------------------------------------------------------------------


def best_answer(windows: list[tuple[np.ndarray, np.ndarray, list[Any]]], context: str, with_null: bool,
                max_answer_len: int) -> str:
    """The best span over an example's windows, as the QA pipeline picks it (per-window softmax, start x end
    probability); "" when with_null and the null score (the [CLS] slot) beats every span.

    windows: (start logits (T,), end logits (T,), char offsets per token, None outside the context)."""
    best_text, best_score = "", -1.0
    min_null = 1_000_000.0
    for start, end, offsets in windows:
        p_mask = np.array([[0 if o is not None else 1 for o in offsets]])  # (1, T): 1 where no answer may be
        p_mask[0, 0] = 0  # the pipeline keeps [CLS] open: its probability is the null score
        attention = np.ones_like(p_mask)  # (1, T): rows are already cut to the window's length
        starts, ends, scores, min_null = select_starts_ends(start[None], end[None], p_mask, attention, min_null,
                                                            top_k=1, handle_impossible_answer=with_null,
                                                            max_answer_len=max_answer_len)
        for s, e, score in zip(starts, ends, scores):
            if offsets[s] is not None and offsets[e] is not None and score > best_score:
                best_text, best_score = context[offsets[s][0]:offsets[e][1]], float(score)
    if with_null and min_null > best_score:
        return ""
    return best_text


# --- the task --------------------------------------------------------------------------------------------------


class QuestionAnswering(TrainTask):
    name = "question-answering"
    compute_metrics = staticmethod(metrics.compute)

    def reads_own_format(self, source: Source) -> bool:
        return _is_squad(Path(source)) or super().reads_own_format(source)

    def read(self, config: Any, tokenizer: Any, model_id2label: dict[int, str] | None) -> EncodedData:
        train_path, eval_path = data_sources(config)
        # a first pass (no tokenizing) counts the examples, so a held-out split picks the ones split_off would, and
        # sees whether any is unanswerable: v2 data, where evaluation may answer "" when the null score wins
        count, with_null = 0, False
        for e in read_examples(train_path, config):
            count, with_null = count + 1, with_null or not e.answers
        # split whole examples, not windows: an example's windows must not straddle train and eval
        held_rows = held_out(count, config.eval_fraction, config.seed) if eval_path is None else set()
        evaluation = list(read_examples(eval_path, config)) if eval_path is not None else []
        settings = {"columns": [config.question_column, config.context_column, config.answers_column],
                    "max_length": config.max_length, "doc_stride": config.doc_stride,
                    "held": None if eval_path else [config.eval_fraction, config.seed]}

        def kept() -> Iterator[Example]:
            for k, e in enumerate(read_examples(train_path, config)):
                if k in held_rows:
                    evaluation.append(e)
                else:
                    yield e

        def windows() -> Iterator[list[Features]]:
            first = 0
            for chunk in in_chunks(kept()):
                yield encode_windows(tokenizer, chunk, config.max_length, config.doc_stride, train_path, first)
                first += len(chunk)

        train_features = collect(windows(), train_path, tokenizer, self.name, settings)
        if held_rows and not evaluation:  # a store written before: its examples were not read, the held-out ones are
            evaluation = [e for k, e in enumerate(read_examples(train_path, config)) if k in held_rows]
        eval_features = encode_windows(tokenizer, evaluation, config.max_length, config.doc_stride,
                                       eval_path or train_path) if evaluation else []
        for i, f in enumerate(eval_features):
            f.meta["index"] = i  # eval rows carry it so metrics can find the window's offsets
        with_null = with_null or any(not e.answers for e in evaluation)
        extra = {"contexts": [e.context for e in evaluation], "golds": [[t for t, _ in e.answers] for e in evaluation],
                 "with_null": with_null, "max_answer_length": config.max_answer_length}
        return EncodedData(train_features, eval_features, None, tokenizer.pad_token_id, extra)

    def collate(self, items: list[Features], data: EncodedData, seed: int) -> dict[str, torch.Tensor]:
        batch = pad_ids(items, data.pad_token_id)
        batch["start_positions"] = torch.tensor([x.target[0] for x in items])  # (B,)
        batch["end_positions"] = torch.tensor([x.target[1] for x in items])  # (B,)
        return batch

    def loss_options(self, data: EncodedData) -> frozenset[str]:
        return frozenset({"label_smoothing"})

    def loss(self, outputs: Any, batch: dict[str, torch.Tensor], data: EncodedData, class_weights: Any,
             label_smoothing: float) -> torch.Tensor:
        # padding positions must not draw probability: their logits go to -inf-ish before the softmax
        pad = batch["attention_mask"] == 0  # (B, T)
        start = outputs.start_logits.float().masked_fill(pad, -1e4)  # (B, T)
        end = outputs.end_logits.float().masked_fill(pad, -1e4)  # (B, T)
        return (F.cross_entropy(start, batch["start_positions"], label_smoothing=label_smoothing)
                + F.cross_entropy(end, batch["end_positions"], label_smoothing=label_smoothing)) / 2

    def eval_rows(self, outputs: Any, batch: dict[str, torch.Tensor], items: list[Features],
                  data: EncodedData) -> list[Any]:
        """(window index, start logits, end logits), each cut to the window's own length."""
        start = outputs.start_logits.float().cpu().numpy()  # (B, T)
        end = outputs.end_logits.float().cpu().numpy()  # (B, T)
        return [(x.meta["index"], start[i, :len(x.input_ids)], end[i, :len(x.input_ids)])
                for i, x in enumerate(items)]

    def metric_names(self, data: EncodedData) -> list[str]:
        # metrics reads the eval data's own windows and answers (data.eval, data.extra): its compute on one answer
        return sorted(self.compute_metrics(predictions=["a"], labels=[["a"]]))

    def metrics(self, rows: list[Any], data: EncodedData, id2label: dict[int, str]) -> dict[str, float]:
        by_example: dict[int, list[Any]] = {}
        for index, start, end in rows:
            window = data.eval[index]
            by_example.setdefault(window.meta["example"], []).append((start, end, window.meta["offsets"]))
        contexts, golds = data.extra["contexts"], data.extra["golds"]
        predictions = [best_answer(by_example.get(k, []), contexts[k], data.extra["with_null"],
                                   data.extra["max_answer_length"]) for k in range(len(contexts))]
        return self.compute_metrics(predictions=predictions, labels=golds)

