"""question-answering: extractive answers, with the semantics of transformers 4.57's QuestionAnsweringPipeline
(transformers 5 removed it). tests/fixtures/qa_reference.json holds that version's outputs, made by
scripts/make_qa_fixtures.py, and the tests compare against them.

A long context is split into windows of max_seq_len tokens that overlap by doc_stride; every window proposes its
best spans (start/end probabilities multiplied, at most max_answer_len tokens, inside the context), answers with the
same text (case-insensitive) add up their scores, and the top_k best come back. As in 4.57 with a fast tokenizer,
max_question_len is accepted but not applied: the question is never truncated.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
from torch import Tensor

from ..tokenizer import TokenizerError
from .base import Feature, Pipeline, PipelineInputError, check_text, positive_int


def decode_spans(start: np.ndarray, end: np.ndarray, topk: int, max_answer_len: int,
                 undesired_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The topk (start, end) pairs by start_prob * end_prob with 0 <= end - start < max_answer_len, both inside
    the allowed tokens. start, end: (1, T) probabilities."""
    if start.ndim == 1:
        start = start[None]
    if end.ndim == 1:
        end = end[None]
    outer = np.matmul(np.expand_dims(start, -1), np.expand_dims(end, 1))  # (1, T, T)
    candidates = np.tril(np.triu(outer), max_answer_len - 1)  # end >= start and end - start < max_answer_len
    scores_flat = candidates.flatten()
    if topk == 1:
        idx_sort = [np.argmax(scores_flat)]
    elif len(scores_flat) < topk:
        idx_sort = np.argsort(-scores_flat)
    else:
        idx = np.argpartition(-scores_flat, topk)[0:topk]
        idx_sort = idx[np.argsort(-scores_flat[idx])]
    starts, ends = np.unravel_index(idx_sort, candidates.shape)[1:]
    desired = np.isin(starts, undesired_tokens.nonzero()) & np.isin(ends, undesired_tokens.nonzero())
    starts, ends = starts[desired], ends[desired]
    return starts, ends, candidates[0, starts, ends]


def select_starts_ends(start: np.ndarray, end: np.ndarray, p_mask: np.ndarray, attention_mask: np.ndarray,
                       min_null_score: float = 1000000, top_k: int = 1, handle_impossible_answer: bool = False,
                       max_answer_len: int = 15) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Softmax over the allowed tokens of one window, the null score from the first token, then decode_spans.
    start, end: (1, T) logits; p_mask: (1, T), 1 where no answer may be."""
    undesired_tokens = np.abs(np.array(p_mask) - 1)  # 1 where an answer may be (the name is 4.57's)
    if attention_mask is not None:
        undesired_tokens = undesired_tokens & attention_mask
    undesired_tokens_mask = undesired_tokens == 0.0
    start = np.where(undesired_tokens_mask, -10000.0, start)
    end = np.where(undesired_tokens_mask, -10000.0, end)
    start = np.exp(start - start.max(axis=-1, keepdims=True))
    start = start / start.sum()
    end = np.exp(end - end.max(axis=-1, keepdims=True))
    end = end / end.sum()
    if handle_impossible_answer:
        min_null_score = min(min_null_score, (start[0, 0] * end[0, 0]).item())
    start[0, 0] = end[0, 0] = 0.0  # the first token ([CLS]) is the "no answer" slot, never a span
    starts, ends, scores = decode_spans(start, end, top_k, max_answer_len, undesired_tokens)
    return starts, ends, scores, min_null_score


class QuestionAnsweringPipeline(Pipeline):
    task = "question-answering"
    token_outputs = ("start_logits", "end_logits")
    # max_seq_len None: min(model_max_length, 384); doc_stride None: min(max_seq_len // 2, 128)
    defaults: ClassVar[dict[str, Any]] = {"top_k": 1, "doc_stride": None, "max_answer_len": 15, "max_seq_len": None,
                                          "max_question_len": 64, "handle_impossible_answer": False,
                                          "align_to_words": True, "padding": "do_not_pad"}

    def validate(self, opts: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
        positive_int("top_k", opts["top_k"])
        positive_int("max_answer_len", opts["max_answer_len"])
        positive_int("max_question_len", opts["max_question_len"])
        if opts["max_seq_len"] is None:
            opts["max_seq_len"] = min(self.tokenizer.model_max_length, 384)
        positive_int("max_seq_len", opts["max_seq_len"])
        if opts["doc_stride"] is None:
            opts["doc_stride"] = min(opts["max_seq_len"] // 2, 128)
        positive_int("doc_stride", opts["doc_stride"])
        if opts["doc_stride"] > opts["max_seq_len"]:
            raise ValueError(f"doc_stride ({opts['doc_stride']}) is larger than max_seq_len ({opts['max_seq_len']})")
        return opts

    def __call__(self, *args: Any, question: Any = None, context: Any = None, **options: Any) -> Any:
        if args:
            if len(args) == 2 and all(isinstance(a, str) for a in args):
                inputs: Any = {"question": args[0], "context": args[1]}
            elif len(args) == 1:
                inputs = args[0]
            else:
                raise ValueError("question-answering takes question=..., context=..., a {'question', 'context'} "
                                 "dict, or a list of them")
        elif question is not None and context is not None:
            if isinstance(question, str) and isinstance(context, str):
                inputs = {"question": question, "context": context}
            elif isinstance(question, list) and isinstance(context, str):
                inputs = [{"question": q, "context": context} for q in question]
            elif isinstance(question, list) and isinstance(context, list):
                if len(question) != len(context):
                    raise ValueError(f"{len(question)} questions but {len(context)} contexts")
                inputs = [{"question": q, "context": c} for q, c in zip(question, context)]
            else:
                raise ValueError("question and context must be strings, or lists (a list of questions may share "
                                 "one context)")
        else:
            raise ValueError("question-answering needs question=... and context=...")
        return super().__call__(inputs, **options)

    def normalize(self, inputs: Any, opts: dict[str, Any]) -> tuple[list[Any], bool]:
        items = [inputs] if isinstance(inputs, dict) else list(inputs) if isinstance(inputs, (list, tuple)) else None
        if items is None:
            raise ValueError(f"question-answering inputs must be dicts with 'question' and 'context', got "
                             f"{type(inputs).__name__}")
        return items, len(items) == 1  # 4.57 answers a one-example list like a single example

    def sample_inputs(self, texts: list[str], pairs: list[tuple[str, str]]) -> list[Any]:
        """Each pair as a question and its context (texts alone are no question-answering input)."""
        return [{"question": question, "context": context} for question, context in pairs]

    def preprocess(self, item: Any, opts: dict[str, Any]) -> list[Feature]:
        if not isinstance(item, dict) or not {"question", "context"} <= set(item):
            raise PipelineInputError("needs a dict with keys 'question' and 'context'")
        question = check_text(item["question"], "question")
        context = check_text(item["context"], "context")
        if len(context.strip()) < len(question.strip()):
            raise PipelineInputError(f"the context ({len(context.strip())} characters) is shorter than the question "
                                     f"({len(question.strip())} characters); question and context swapped?")
        question_first = self.tokenizer.padding_side == "right"
        max_seq_len, doc_stride = opts["max_seq_len"], opts["doc_stride"]
        try:
            rows = self.encode(question if question_first else context, context if question_first else question,
                               padding=opts["padding"], truncation="only_second" if question_first else "only_first",
                               max_length=max_seq_len, stride=doc_stride, return_overflowing_tokens=True,
                               return_offsets_mapping=True, return_special_tokens_mask=True)
        except TokenizerError:
            n = len(self.tokenizer(question, add_special_tokens=False)["input_ids"])
            raise PipelineInputError(
                f"the question takes {n} tokens: with max_seq_len={max_seq_len} and doc_stride={doc_stride} no "
                "window has room for the context; shorten the question, raise max_seq_len or lower doc_stride"
            ) from None
        cls_id = self.tokenizer.cls_token_id
        for f in rows:
            # 1 where no answer may be: everything but the context (all 0 when the context comes first, as 4.57)
            p_mask = [int(s != 1) if question_first else 0 for s in f.data["encoding"].sequence_ids]
            if cls_id is not None:
                p_mask = [0 if t == cls_id else m for t, m in zip(f.input_ids, p_mask)]
            f.data["p_mask"] = p_mask
        return rows

    def too_long_hint(self) -> str:
        return "lower max_seq_len (windows are at most max_seq_len tokens)"

    def forward(self, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None,
                encoder_outputs: tuple[Tensor, Tensor | None] | None = None) -> dict[str, Tensor]:
        out = self.model(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                         encoder_outputs=encoder_outputs)
        return {"start_logits": out.start_logits, "end_logits": out.end_logits}  # (B, T) each

    def postprocess(self, item: dict[str, str], features: list[Feature], opts: dict[str, Any]) -> Any:
        top_k, align = opts["top_k"], opts["align_to_words"]
        context = item["context"]
        question_first = self.tokenizer.padding_side == "right"
        min_null_score = 1000000.0  # large and positive
        answers: list[dict[str, Any]] = []
        for f in features:
            start = f.outputs["start_logits"].numpy()[None]  # (1, T)
            end = f.outputs["end_logits"].numpy()[None]  # (1, T)
            p_mask = np.array(f.data["p_mask"])[None]  # (1, T)
            attention_mask = np.array(f.attention_mask)[None]  # (1, T)
            pre_topk = top_k * 2 + 10 if align else top_k  # aligning to words may merge candidates
            starts, ends, scores, min_null_score = select_starts_ends(
                start, end, p_mask, attention_mask, min_null_score, pre_topk, opts["handle_impossible_answer"],
                opts["max_answer_len"])
            enc = f.data["encoding"]
            offset = 0
            if self.tokenizer.padding_side == "left":
                offset = sum(1 for t in f.input_ids if t == self.tokenizer.pad_token_id)
            sequence_index = 1 if question_first else 0
            for s, e, score in zip(starts, ends, scores):
                start_index, end_index = get_indices(enc, int(s) - offset, int(e) - offset, sequence_index, align)
                target = context[start_index:end_index]
                same = next((a for a in answers if a["answer"].lower() == target.lower()), None)
                if same is not None:
                    same["score"] += score.item()
                else:
                    answers.append({"score": score.item(), "start": start_index, "end": end_index,
                                    "answer": target})
        if opts["handle_impossible_answer"]:
            answers.append({"score": min_null_score, "start": 0, "end": 0, "answer": ""})
        answers = sorted(answers, key=lambda x: x["score"], reverse=True)[:top_k]
        return answers[0] if len(answers) == 1 else answers


def get_indices(enc: Any, s: int, e: int, sequence_index: int, align_to_words: bool) -> tuple[int, int]:
    """Character span of tokens s..e: whole words when align_to_words, else the tokens' own offsets."""
    if align_to_words:
        try:
            start_word = enc.token_to_word(s)
            end_word = enc.token_to_word(e)
            return (enc.word_to_chars(start_word, sequence_index=sequence_index)[0],
                    enc.word_to_chars(end_word, sequence_index=sequence_index)[1])
        except (TypeError, ValueError, IndexError, OverflowError):
            pass  # a token with no word (a special token): 4.57 falls back to the offsets
    return enc.offsets[s][0], enc.offsets[e][1]
