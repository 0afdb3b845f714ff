"""Sentence embeddings as sentence-transformers computes them, read from the folder's own files, plus what an
embedding server needs around them (token listings, a measured batch budget).

A sentence-transformers folder says how to pool in its own files (modules.json, the Pooling module's config.json,
sentence_bert_config.json's max_seq_length, config_sentence_transformers.json's prompts), which the layout's one
reader, `formats.sentence_transformers.read_layout`, reads into a SentenceLayout. A folder without modules.json pools
by mean and does not normalize (sentence-transformers' default for a bare transformers checkpoint).

`pipeline("sentence-embedding", model=folder)` gives a SentenceEmbeddingPipeline (pipelines/sentence_embedding.py,
named here too): one vector per text (or, with output="tokens", the per-token hidden states), batched under the token
budget like every hfport pipeline. `pipeline("feature-extraction")` gives per-token states, as transformers' does.
`pool` is the library's one pooling (heads.pool): (B, T, C) hidden states and their (B, T) mask -> (B, C).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .formats.sentence_transformers import SentenceLayout, read_layout
from .heads import pool
from .pipelines.base import Feature, Pipeline
from .pipelines.sentence_embedding import POOLINGS, SentenceEmbeddingPipeline


def token_listing(tokenizer: Any, text: str, *, add_special_tokens: bool = True) -> list[dict[str, Any]]:
    """Every token of `text`: {id, text, special, start, stop} (character offsets into `text`; a special token's
    text is its own string, and its start/stop are None as it covers no characters)."""
    enc = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True,
                    return_special_tokens_mask=True)
    tokens = enc.encodings[0].tokens
    out = []
    for i, (tid, (start, stop), special) in enumerate(zip(enc["input_ids"], enc["offset_mapping"],
                                                        enc["special_tokens_mask"])):
        if special:
            out.append({"id": tid, "text": tokens[i], "special": True, "start": None, "stop": None})
        else:
            out.append({"id": tid, "text": text[start:stop], "special": False, "start": start, "stop": stop})
    return out


@dataclass
class BatchTuning:
    """The token budget picked by `tune_batch_tokens` and what was measured (padded tokens per second)."""

    chosen: int
    throughput: dict[int, float]
    seq_len: int
    skipped: dict[int, str] = field(default_factory=dict)  # budgets not tried, and why


def _activation_bytes(pipe: Pipeline, tokens: int, seq_len: int) -> int:
    """A rough peak of one forward pass under no_grad: per token the widest intermediate (the feed-forward
    inner layer), a few hidden-size buffers and one row of attention scores per head."""
    c = pipe.model.config
    per_token = c.intermediate_size + 4 * c.hidden_size + c.num_attention_heads * seq_len
    return tokens * per_token * pipe.model.dtype.itemsize


def available_bytes(device: torch.device) -> int | None:
    """Free memory where the model runs: the accelerator's free memory, or the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def tune_batch_tokens(pipe: Pipeline, budgets: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384), *,
                      seq_len: int = 128, tolerance: float = 0.10, memory_fraction: float = 0.5,
                      repeats: int = 1) -> BatchTuning:
    """Time forward passes of `pipe` at each padded-token budget on a synthetic batch of `seq_len`-token rows and
    set `pipe.max_batch_tokens` to the smallest budget within `tolerance` of the best throughput (a smaller batch
    adds less latency to each request for the same work rate). Budgets whose estimated activation memory exceeds
    `memory_fraction` of the free memory are not tried. The first pass is a warm-up and is not timed; where one
    budget is tried there is nothing to choose, and the warm-up is its only pass (its throughput that pass's, first-
    call costs included: the real MiniLM's 16384-token pass takes seconds on one core)."""
    if not budgets:
        raise ValueError("budgets: give at least one token budget")
    seq_len = min(seq_len, pipe.max_positions or seq_len)
    vocab = pipe.model.config.vocab_size
    free = available_bytes(pipe.model.device)
    limit = free * memory_fraction if free is not None else None
    with_types = "token_type_ids" in pipe.tokenizer.model_input_names

    def rows(budget: int) -> list[Feature]:
        n = max(1, budget // seq_len)
        return [Feature(item=r, input_ids=[(r * 31 + t * 7 + 5) % vocab for t in range(seq_len)],
                        attention_mask=[1] * seq_len, token_type_ids=[0] * seq_len if with_types else None)
                for r in range(n)]

    skipped: dict[int, str] = {}
    tried = []
    for budget in sorted(set(budgets)):
        need = _activation_bytes(pipe, budget, seq_len)
        if limit is not None and need > limit and tried:
            skipped[budget] = f"needs ~{need / 2**20:.0f} MiB, {limit / 2**20:.0f} MiB allowed"
            continue
        tried.append(budget)
    first = rows(tried[0])
    start = time.perf_counter()
    pipe.forward_batch(first)  # warm-up: first-call allocations and kernel choices
    throughput: dict[int, float] = {}
    if len(tried) == 1:  # nothing to choose between: the warm-up is the one pass
        throughput[tried[0]] = len(first) * seq_len / max(time.perf_counter() - start, 1e-9)
    for budget in tried if len(tried) > 1 else ():
        batch = rows(budget)
        best = math.inf
        for _ in range(repeats):
            start = time.perf_counter()
            pipe.forward_batch(batch)
            best = min(best, time.perf_counter() - start)
        throughput[budget] = len(batch) * seq_len / max(best, 1e-9)
    top = max(throughput.values())
    chosen = min(b for b, t in throughput.items() if t >= (1 - tolerance) * top)
    pipe.max_batch_tokens = chosen
    return BatchTuning(chosen=chosen, throughput=throughput, seq_len=seq_len, skipped=skipped)


__all__ = ["POOLINGS", "BatchTuning", "SentenceLayout", "SentenceEmbeddingPipeline", "pool", "read_layout",
           "token_listing", "tune_batch_tokens"]
