"""The int8 gate: how far an int8 model (model_quantized.onnx, or hfport's own int8 engine: hfport/int8.py) may move
the fp32 answers, judged by what each head means. Used by export (export/onnx_verify.py) and by loading with
dtype="int8", so it sits below both.

Each task record names its kind (`Task.agreement`); a kind is a Gate: `items` takes one side's outputs on one chunk
of the judged texts (int8's, or fp32's with what only the reference decides) to the items it judges, small next to
the outputs (fill-mask: the top-k ids at the masked positions, not (rows, T, vocab) logits), so a gate keeps fp32's
items of every chunk and not its outputs; the chunks' items are joined, and `judge` turns them into a Verdict held
to its threshold:
    labels   the decided label per text (argmax, or each label's logit > 0 where labels are independent); a
             one-label head (num_labels 1: a regression, a reranker's relevance score) is judged as `scores`
    scores   Spearman rank correlation of the scores >= min_agreement, with fp32 near ties (SCORE_TIE) not counted
             against it, and relative L2 error ||int8 - fp32|| / ||fp32|| <= MAX_SCORE_ERROR: a rank statistic
             alone passes `0.2 x + 3` (same order, other values), an error alone passes a reorder of close scores
    tags     the decided tag per real token
    spans    identical argmax start and end (question answering), where fp32 decides both
    top_k    top-5 overlap at masked positions (fill-mask)
    cosine   the least cosine over the texts between int8 and fp32 embeddings pooled as the model pools (its
             sentence-transformers 1_Pooling, else mean), >= min_cosine: a mean hides one broken text
Label, tag and span agreement count only the items fp32 decides (NEAR_TIE says why); scores forgive swaps within
fp32 near ties.
The judged texts are never the calibration texts (hfport/probes.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .heads import pool
from .errors import ExportError

MIN_AGREEMENT = 0.99
# the least cosine over the judged texts (not the mean: one broken text is a broken model). all-MiniLM-L6-v2's int8
# graph, mean pooling, over the 64 built-in judged texts: least 0.9899 (a two-word text: int8's error weighs most
# on few tokens), mean 0.9974; over the 64 pairs: least 0.9977. A damaged graph falls far lower (its CLS state
# negated: ~0 or below under CLS pooling)
MIN_COSINE = 0.98
# label and tag agreement count only the items on which fp32 decides: its two most probable labels at least this far
# apart in probability. On a near tie there is no answer to keep: int8's rounding (mean relative logit error ~0.03 on
# MiniLM) moves it either way, so one out-of-domain probe text a classifier scores 0.35 / 0.32 failed whole exports
# (a seed-7 MiniLM topic head: "She plays the violin beautifully."). A broken graph flips decided items and fails.
NEAR_TIE = 0.05
# scores: fp32 scores closer than SCORE_TIE x their standard deviation are a near tie, whose order int8 may swap
# (the same reason as NEAR_TIE: int8 moves MiniLM's logits by ~3% of their size); ties are grouped from the lowest
# score up, each group at most that wide, so a chain of close scores never becomes one big tie
SCORE_TIE = 0.05
# scores: the relative L2 error int8 may add (MiniLM's mean relative logit error is ~0.03, the module docstring of
# export/onnx.py has the measurements); `0.2 x + 3` is off by far more
MAX_SCORE_ERROR = 0.1
TOP_K = 5  # fill-mask: the candidates a user sees


@dataclass(frozen=True)
class GateContext:
    config: Any  # the folder's EncoderConfig: num_labels, problem_type
    pooling: str = "mean"  # embeddings: how the model pools (hfport.heads.pool's names)


@dataclass(frozen=True)
class Verdict:
    value: float  # the statistic held to the threshold
    items: int  # what it counts
    ties: int = 0  # fp32 near ties left out (labels, tags) or left alike (scores)
    error: float | None = None  # scores: the relative L2 error, held to MAX_SCORE_ERROR


# (one side's outputs, the batch, the context, whether it is the reference (fp32) side) -> that side's items
Items = Callable[[dict[str, Tensor], dict[str, Tensor], GateContext, bool], Tensor]
Judge = Callable[[Tensor, Tensor, GateContext], Verdict]


@dataclass(frozen=True)
class Gate:
    name: str  # the statistic's name in the report
    threshold: str  # which bound applies: "agreement" (min_agreement) or "cosine" (min_cosine)
    items: Items
    judge: Judge


def fp32_decides(b: Tensor) -> Tensor:
    """Where fp32 (logits b, (..., L)) makes a decision: its two most probable labels at least NEAR_TIE apart in
    softmax probability. (..., L) -> (...,) bool."""
    top = b.softmax(-1).topk(2, dim=-1).values  # (..., 2)
    return top[..., 0] - top[..., 1] >= NEAR_TIE


def agreement(same: Tensor, decisive: Tensor) -> Verdict:
    """Agreement over the decisive items, their number, the near ties left out. When fp32 decides none, all count:
    a graph is never passed for want of items."""
    if not decisive.any():
        decisive = torch.ones_like(decisive)
    return Verdict(same[decisive].float().mean().item(), int(decisive.sum()), int((~decisive).sum()))


def one_label(config: Any) -> bool:
    """A head with one output that is a score, not a label's logit: regression, or a reranker's relevance."""
    return config.num_labels == 1 and config.problem_type != "multi_label_classification"


def _logits(out, enc, ctx, reference) -> Tensor:
    return out["logits"]  # (B, L)


def _judge_labels(a: Tensor, b: Tensor, ctx: GateContext) -> Verdict:
    """The predicted label per text: argmax, or each label's logit > 0 where labels are independent (multi-label);
    texts on which fp32 is a near tie are left out (NEAR_TIE says why)."""
    if ctx.config.problem_type == "multi_label_classification" or ctx.config.num_labels == 1:
        decisive = (torch.sigmoid(b) - 0.5).abs() >= NEAR_TIE / 2  # (B, L) per label
        same = (((a > 0) == (b > 0)) | ~decisive).all(dim=1)  # the decided labels all agree
        return agreement(same, decisive.any(dim=1))
    return agreement(a.argmax(-1) == b.argmax(-1), fp32_decides(b))


def _scores(out, enc, ctx, reference) -> Tensor:
    return out["logits"][:, 0]  # (B,)


def ranks(x: Tensor) -> Tensor:
    """0..n-1 by value (n,) -> (n,) float; exact ties (measure zero for model scores) in index order."""
    out = torch.empty_like(x, dtype=torch.float64)
    out[x.argsort(stable=True)] = torch.arange(len(x), dtype=torch.float64)
    return out


def _judge_scores(a: Tensor, b: Tensor, ctx: GateContext) -> Verdict:
    """Spearman between int8 scores A and fp32 scores B (n,), where within each fp32 near-tie group int8's values
    are put in fp32's order first (a swap there is not counted; SCORE_TIE), and the relative L2 error."""
    a, b = a.double(), b.double()
    order = b.argsort(stable=True)  # (n,) fp32 ascending
    margin = SCORE_TIE * b.std().item() if len(b) > 1 else 0.0
    fixed = a.clone()
    tied, start = 0, 0
    for i in range(1, len(b) + 1):  # groups [start, i): each at most `margin` wide, from the lowest score up
        if i == len(b) or b[order[i]] - b[order[start]] > margin:
            group = order[start:i]
            if len(group) > 1:  # int8's values of the group, in fp32's order
                fixed[group] = a[group].sort().values
                tied += len(group)
            start = i
    x, y = ranks(fixed), ranks(b)
    x, y = x - x.mean(), y - y.mean()
    rho = (x @ y / (x.norm() * y.norm())).item() if len(b) > 1 else 1.0  # Spearman: Pearson on ranks
    error = ((a - b).norm() / b.norm().clamp_min(1e-12)).item()
    return Verdict(rho, len(b), tied, error)


def _tags(out, enc, ctx, reference) -> Tensor:
    return out["logits"][enc["attention_mask"].bool()]  # (N, L): the real tokens


def _judge_tags(a: Tensor, b: Tensor, ctx: GateContext) -> Verdict:
    return agreement(a.argmax(-1) == b.argmax(-1), fp32_decides(b))


def _spans(out, enc, ctx, reference) -> Tensor:
    """The (start, end) argmax over real tokens, (B, 2); fp32's with a third column: 1 where fp32 decides both
    (NEAR_TIE between its two most probable starts, and ends), (B, 3)."""
    real = enc["attention_mask"].bool()  # (B, T)
    logits = [out[k].masked_fill(~real, float("-inf")) for k in ("start_logits", "end_logits")]  # each (B, T)
    spans = [x.argmax(-1) for x in logits]  # (B,) each
    if reference:
        spans.append((fp32_decides(logits[0]) & fp32_decides(logits[1])).long())
    return torch.stack(spans, dim=1)  # (B, 2) | (B, 3)


def _judge_spans(a: Tensor, b: Tensor, ctx: GateContext) -> Verdict:
    """Identical start and end, over the rows where fp32 decides both (NEAR_TIE says why)."""
    return agreement((a == b[:, :2]).all(dim=1), b[:, 2].bool())


def _top_k(out, enc, ctx, reference) -> Tensor:
    logits = out["logits"][enc["masked"]]  # (M, V): the masked positions
    return logits.topk(min(TOP_K, logits.shape[-1])).indices  # (M, k)


def _judge_overlap(a: Tensor, b: Tensor, ctx: GateContext) -> Verdict:
    overlap = [len(set(x.tolist()) & set(y.tolist())) / a.shape[1] for x, y in zip(a, b)]
    return Verdict(sum(overlap) / len(overlap), len(overlap))


def _pooled(out, enc, ctx, reference) -> Tensor:
    return pool(out["last_hidden_state"], enc["attention_mask"], ctx.pooling)  # (B, C)


def _judge_cosine(a: Tensor, b: Tensor, ctx: GateContext) -> Verdict:
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)  # (B,)
    return Verdict(cos.min().item(), len(cos))  # the least: one broken text is a broken model


# the task record's agreement kind -> its gate ("scores": a one-label head's, chosen by gate_for)
GATES: dict[str, Gate] = {
    "labels": Gate("label agreement", "agreement", _logits, _judge_labels),
    "scores": Gate("Spearman", "agreement", _scores, _judge_scores),
    "tags": Gate("tag agreement", "agreement", _tags, _judge_tags),
    "spans": Gate("span agreement", "agreement", _spans, _judge_spans),
    "top_k": Gate(f"top-{TOP_K} overlap", "agreement", _top_k, _judge_overlap),
    "cosine": Gate("min cosine", "cosine", _pooled, _judge_cosine),
}


def gate_for(kind: str, config: Any) -> Gate:
    """The gate of a task's agreement kind for this config (a one-label classifier is judged by its scores)."""
    return GATES["scores" if kind == "labels" and one_label(config) else kind]


def items(gate: Gate, outputs: dict[str, Tensor], enc: dict[str, Tensor], ctx: GateContext,
          reference: bool = False) -> Tensor:
    """What GATE judges of one side's OUTPUTS on the batch ENC (REFERENCE: the fp32 side)."""
    return gate.items(outputs, enc, ctx, reference)


def verdict(gate: Gate, chunks: list[tuple[Tensor, Tensor]], ctx: GateContext) -> Verdict:
    """GATE's verdict over the chunks' (int8 items, fp32 items), joined first."""
    return gate.judge(torch.cat([a for a, _ in chunks]), torch.cat([b for _, b in chunks]), ctx)


def measure(gate: Gate, chunks: list[tuple[dict[str, Tensor], dict[str, Tensor], dict[str, Tensor]]],
            ctx: GateContext) -> Verdict:
    """GATE's verdict over the chunks (int8 outputs, fp32 outputs, batch)."""
    return verdict(gate, [(items(gate, q, enc, ctx), items(gate, f, enc, ctx, reference=True))
                          for q, f, enc in chunks], ctx)


def passes(gate: Gate, verdict: Verdict, min_agreement: float, min_cosine: float) -> tuple[bool, str]:
    """(whether VERDICT passes, the bound as the report's tolerance)."""
    bound = min_cosine if gate.threshold == "cosine" else min_agreement
    tolerance = f"{gate.name} >= {bound:g}"
    ok = verdict.value >= bound
    if verdict.error is not None:
        tolerance += f", relative error <= {MAX_SCORE_ERROR:g}"
        ok = ok and verdict.error <= MAX_SCORE_ERROR
    return ok, tolerance


def threshold_problem(name: str, value: Any) -> str | None:
    """What is wrong with threshold NAME's VALUE (it must be a fraction in (0, 1]), or None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        return f"{name} {value!r}: expected a fraction in (0, 1], e.g. 0.99"
    return None


def check_thresholds(min_agreement: float, min_cosine: float) -> None:
    """Both thresholds are fractions in (0, 1]; an ExportError names a bad one."""
    for name, value in (("min_agreement", min_agreement), ("min_cosine", min_cosine)):
        problem = threshold_problem(name, value)
        if problem is not None:
            raise ExportError(problem)
