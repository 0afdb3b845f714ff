"""The parity comparison every family's test runs: a transformers model and hfport's, on the same weights and the
same (padded) batch, compared at real positions: outputs, the loss, then every parameter's gradient.

One function, `compare_models`, holds the comparison; `check` adds the usual setup (transformers and hfport both
loaded from one saved folder, the grid's labels). Each family's test builds its model (tests/tiny.py) and batch and
calls one of them. Options cover what the families' tests differ in, and nothing else: a name map for checkpoints
whose file tensors transformers splits in memory (`pieces`), DeBERTa's own tolerance, base loss and "every
parameter has a gradient" (`rtol`, `base_loss`, `every_grad`), and the padded layout's QA loss (`padding_free`).

Tolerance: fp32, atol 1e-5 (rtol 1.3e-6, torch's fp32 default) on outputs, losses and every gradient. The rtol
matters only for gradients of tensors summed over every token of the batch (token-type embeddings reach ~60 in
magnitude, where fp32 summation order alone moves the last digits: ~1e-7 relative).

Built on these: `compare_family` (one cell of the family x head grid, recorded for conftest's table),
`compare_choices` (multiple choice on (B, C, T) batches), and for pipelines `assert_close_results` (transformers'
result structure, scores within SCORE_TOL). For the graph backends (ONNX, OpenVINO) against hfport's PyTorch
pipelines: `GRAPH_PIPELINE_CASES` (each head's pipeline inputs) and `assert_same` (pipeline results within atol).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import hfport
from hfport import tasks
from tests import grid
from tests.tiny import HEADS, NUM_LABELS, OTHER_HEADS, PRETRAINING_HEADS, batch, reference_qa_loss, save_hf

ATOL, RTOL = 1e-5, 1.3e-6
SCORE_TOL = 1e-4  # pipeline scores: probabilities from float32 logits, batched (padded) vs one at a time
MINILM_MIN_COSINE = 0.99  # the real MiniLM's int8 (or sharded int8) embeddings against its fp32 ones
# task -> the Auto* class name, the same in hfport and transformers
AUTO_CLASSES = {**HEADS, **OTHER_HEADS, **PRETRAINING_HEADS}
# DeBERTa's comparison (tests/test_deberta_parity.py; test_cuda.py on a GPU) differs from the grid's in three ways:
# rtol 1e-5; the base model's loss is a mean of squares (a mean, like the task losses: a sum puts gradients near 20,
# where fp32 noise is ~1e-5); and every parameter must get a gradient (each relative-position term reaches the loss).
DEBERTA_PARITY = dict(rtol=1e-5, base_loss=lambda out, mask: out.last_hidden_state[mask.bool()].square().mean(),
                      every_grad=True)


def labels_for(task: str, inputs: dict[str, torch.Tensor], seed: int = 2,
               left: bool = False) -> dict[str, torch.Tensor]:
    """Seeded labels at real positions of `inputs` (right padded; `left`: its padding on the left)."""
    g = torch.Generator().manual_seed(seed)
    mask = inputs["attention_mask"]
    b, t = mask.shape
    if task == "sequence-classification":
        return {"labels": torch.randint(0, NUM_LABELS, (b,), generator=g)}
    if task == "token-classification":
        return {"labels": torch.randint(0, NUM_LABELS, (b, t), generator=g).masked_fill(mask == 0, -100)}
    if task == "masked-lm":
        chosen = (torch.rand(b, t, generator=g) < 0.3) & mask.bool()
        return {"labels": torch.where(chosen, inputs["input_ids"], torch.full_like(inputs["input_ids"], -100))}
    if task == "question-answering":
        lengths = mask.sum(1)
        start = torch.stack([torch.randint(0, int(n), (1,), generator=g)[0] for n in lengths])
        end = torch.minimum(start + 3, lengths - 1)
        end[0] = 10_000  # out of range: clamped to the ignored index, as transformers does
        labels = {"start_positions": start, "end_positions": end}
        if left:  # positions of real tokens, shifted by the left padding
            labels = {k: torch.minimum(v + (t - lengths), torch.tensor(t - 1)) for k, v in labels.items()}
        return labels
    return {}


def outputs_of(task: str, out) -> dict[str, torch.Tensor]:
    """The outputs the task's record names (hfport/tasks/) that `out` returns: a family's own (DistilBERT has no
    pooler_output; BertForPreTraining seq_relationship_logits, AlbertForPreTraining sop_logits)."""
    return {k: getattr(out, k) for k in tasks.get(task).outputs if getattr(out, k, None) is not None}


def real(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-level tensors restricted to real positions; sequence-level ones as they are."""
    return t[mask.bool()] if t.dim() >= 2 and t.shape[:2] == mask.shape else t


def left_padded(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same (right-padded) sequences with their padding moved to the left."""
    mask = inputs["attention_mask"]
    out = {k: torch.zeros_like(v) for k, v in inputs.items()}
    for row, n in enumerate(mask.sum(1).tolist()):
        for k, v in inputs.items():
            out[k][row, v.shape[1] - n:] = v[row, :n]
    return out


def projection_loss(out, mask: torch.Tensor) -> torch.Tensor:
    """The base model's stand-in for a task loss: a fixed random projection of the real positions, plus the
    pooler's mean where there is one (so the pooler's gradient is checked too)."""
    hidden = real(out.last_hidden_state, mask)  # (N, C)
    w = torch.randn(hidden.shape[-1], generator=torch.Generator().manual_seed(3))
    loss = (hidden @ w).mean()
    if getattr(out, "pooler_output", None) is not None:
        loss = loss + out.pooler_output.mean()
    return loss


def load_ours(task: str, folder: Path, padding_free: bool = True) -> hfport.PreTrainedEncoder:
    """hfport's model for `task` from `folder`, every tensor read (nothing initialised, nothing left over)."""
    ours = getattr(hfport, AUTO_CLASSES[task]).from_pretrained(folder)
    assert not ours.load_report.initialized and not ours.load_report.unexpected, ours.load_report.summary()
    ours.padding_free = padding_free
    return ours


def check(task: str, folder: Path, inputs: dict[str, torch.Tensor], *, ref=None, left: bool = False,
          padding_free: bool = True, **options) -> float:
    """transformers (`ref`, or loaded fresh from `folder`) against hfport loaded from `folder`, on `inputs` with
    labels_for's labels; `options` go to compare_models. The worst |diff| seen."""
    import transformers

    ref = ref if ref is not None else getattr(transformers, AUTO_CLASSES[task]).from_pretrained(folder).eval()
    ours = load_ours(task, folder, padding_free)
    return compare_models(ref, ours, inputs, task, labels=labels_for(task, inputs, left=left),
                          padding_free=padding_free, **options)


def compare_models(ref: torch.nn.Module, ours: hfport.PreTrainedEncoder, inputs: dict[str, torch.Tensor], task: str,
                   *, labels: dict[str, torch.Tensor] | None = None, name: str = "", padding_free: bool = True,
                   pieces: Callable[[str], list[str]] | None = None, atol: float = ATOL, rtol: float = RTOL,
                   base_loss: Callable[..., torch.Tensor] = projection_loss, every_grad: bool = False,
                   qa_real_positions: bool = False) -> float:
    """Both models on `inputs` (+ `labels`): outputs at real positions, the loss, every gradient. The worst |diff|.

    QA's loss is taken over real positions (tiny.reference_qa_loss) where hfport runs padding-free: there padding is
    never an answer, while transformers' loss also sums over padding logits; padded (`padding_free=False`), hfport
    scores padding as transformers does and the two losses are compared as they are, and gradients are those of the
    models' losses or, with `qa_real_positions`, of reference_qa_loss on both sides."""
    labels = labels or {}
    tol = dict(atol=atol, rtol=rtol)
    mask = inputs["attention_mask"]
    theirs_out, ours_out = ref(**inputs, **labels), ours(**inputs, **labels)
    theirs_o, ours_o = outputs_of(task, theirs_out), outputs_of(task, ours_out)
    assert theirs_o.keys() == ours_o.keys(), f"{name}: outputs {sorted(ours_o)} != transformers' {sorted(theirs_o)}"
    worst = 0.0
    for key in theirs_o:
        a, b = real(ours_o[key], mask), real(theirs_o[key].detach(), mask)
        torch.testing.assert_close(a, b, **tol, msg=lambda m, key=key: f"{name} {key}: {m}")
        worst = max(worst, (a - b).abs().max().item())

    if task == "base":
        loss_theirs, loss_ours = base_loss(theirs_out, mask), base_loss(ours_out, mask)
    elif task == "question-answering" and (padding_free or qa_real_positions):
        starts, ends = labels["start_positions"], labels["end_positions"]
        loss_theirs, reference_ours = (reference_qa_loss(out, starts, ends, mask) for out in (theirs_out, ours_out))
        # hfport's own loss: over real positions padding-free, over every position (as transformers) padded
        torch.testing.assert_close(ours_out.loss, reference_ours if padding_free else theirs_out.loss, **tol)
        loss_ours = ours_out.loss if padding_free else reference_ours
    else:
        loss_theirs, loss_ours = theirs_out.loss, ours_out.loss
    torch.testing.assert_close(loss_ours, loss_theirs, **tol, msg=lambda m: f"{name} loss: {m}")
    worst = max(worst, (loss_ours - loss_theirs).abs().item())
    loss_theirs.backward()
    loss_ours.backward()
    return max(worst, compare_gradients(ref, ours, name=name, pieces=pieces, every_grad=every_grad, **tol))


def compare_gradients(ref: torch.nn.Module, ours: hfport.PreTrainedEncoder, *, name: str = "",
                      pieces: Callable[[str], list[str]] | None = None, atol: float = ATOL, rtol: float = RTOL,
                      every_grad: bool = False) -> float:
    """Every hfport parameter's gradient against the transformers parameter(s) its saved name maps to (`pieces`:
    the in-memory tensors transformers split a file tensor into, joined along dim 0; by default the name itself).
    Each transformers parameter is matched exactly once; a parameter without a gradient on one side has none (or
    zeros) on the other, or, with `every_grad`, is an error."""
    ref_params = dict(ref.named_parameters(remove_duplicate=False))  # tied weights under every name
    names = ours.hf_names()
    pieces = pieces or (lambda hf: [hf])
    unique = {id(p) for p in ref_params.values()}
    assert sum(len(pieces(hf)) for hf in names.values()) == len(unique), \
        f"{name}: hfport and transformers hold different numbers of parameters"
    covered: set[int] = set()
    worst = 0.0
    for own, p in ours.named_parameters():
        theirs = pieces(names[own])
        assert all(n in ref_params for n in theirs), f"{name}: {own} -> {theirs} is not a transformers parameter"
        assert not covered & {id(ref_params[n]) for n in theirs}, f"{name}: {theirs} matched twice"
        covered |= {id(ref_params[n]) for n in theirs}
        grads = [ref_params[n].grad for n in theirs]
        if every_grad:
            assert p.grad is not None and all(g is not None for g in grads), f"{name}: no gradient for {own}"
        if all(g is None for g in grads):
            assert p.grad is None or not p.grad.any(), f"{name}: {own} has a gradient, {theirs} have none"
            continue
        theirs_grad = torch.cat([g if g is not None else torch.zeros_like(ref_params[n])
                                 for n, g in zip(theirs, grads)], dim=0)
        assert p.grad is not None, f"{name}: {own} has no gradient, {theirs} have"
        torch.testing.assert_close(p.grad, theirs_grad, atol=atol, rtol=rtol,
                                   msg=lambda m, own=own, theirs=theirs: f"{name} grad {own} ({theirs}): {m}")
        worst = max(worst, (p.grad - theirs_grad).abs().max().item())
    assert covered == unique, f"{name}: transformers parameters hfport does not have: " + \
        str(sorted(n for n, p in ref_params.items() if id(p) not in covered))
    return worst


def compare_family(family: str, task: str, tmp_path: Path, **overrides) -> float:
    """One cell of the parity grid: tiny.py's `family` model with the `task` head, saved in `tmp_path`, checked on
    tiny.batch; its worst |diff| goes into the grid conftest prints."""
    ref = save_hf(family, task, tmp_path, **overrides)
    inputs = batch(family, pairs=overrides.get("type_vocab_size", 2) > 1)
    worst = check(task, tmp_path, inputs, ref=ref, name=f"{family}/{task}")
    grid.record(family, task, worst)
    return worst


def choice_batch(family: str, lengths: tuple[int, ...] = (70, 41, 9, 30, 12, 50), choices: int = 3,
                 pairs: bool = True) -> dict[str, torch.Tensor]:
    """(B, C, T): B = len(lengths) / C questions whose choices have unequal lengths (one over 64 tokens)."""
    return {k: v.view(-1, choices, v.shape[-1]) for k, v in batch(family, lengths=lengths, pairs=pairs).items()}


def compare_choices(family: str, tmp_path: Path, padding_free: bool = True, **overrides) -> float:
    """transformers' *ForMultipleChoice against hfport's on choice_batch: logits, loss and every gradient."""
    task = "multiple-choice"
    ref = save_hf(family, task, tmp_path, **overrides)
    ours = load_ours(task, tmp_path, padding_free)
    assert type(ref).__name__ == ours.family.architectures[task]
    inputs = choice_batch(family, pairs=overrides.get("type_vocab_size", 2) > 1)
    with torch.no_grad():
        assert ours(**inputs).logits.shape == (2, 3)  # (B, C)
    worst = compare_models(ref, ours, inputs, task, labels={"labels": torch.tensor([2, 0])}, name=family)
    grid.record(family, task, worst)
    return worst


def _as_tied(ours: list, theirs: list) -> list:
    """OURS, a ranked list of candidates (dicts with a score: fill-mask's tokens, labels), reordered to THEIRS' order
    only where two candidates' scores tie within SCORE_TOL: a tiny random model's near-uniform scores (fill-mask
    targets a few 1e-7 apart) may rank a tie either way, on either side. Anything else is left for the comparison."""
    if not all(isinstance(x, dict) and "score" in x for x in (*ours, *theirs)):
        return ours
    out = list(ours)
    for i, want in enumerate(theirs):
        same = {k: v for k, v in want.items() if k != "score"}
        if {k: v for k, v in out[i].items() if k != "score"} == same:
            continue
        for j in range(i + 1, len(out)):
            if {k: v for k, v in out[j].items() if k != "score"} == same and \
                    abs(float(out[j]["score"]) - float(out[i]["score"])) <= SCORE_TOL:
                out[i], out[j] = out[j], out[i]
                break
    return out


def assert_close_results(ours: Any, theirs: Any, where: str = "") -> float:
    """Same structure, keys, labels, words and offsets; scores within SCORE_TOL. Returns the max score diff."""
    if isinstance(theirs, list):
        assert isinstance(ours, list) and len(ours) == len(theirs), f"{where}: {ours} vs {theirs}"
        ours = _as_tied(ours, theirs)
        return max([assert_close_results(a, b, f"{where}[{i}]") for i, (a, b) in enumerate(zip(ours, theirs))],
                   default=0.0)
    if isinstance(theirs, dict):
        assert isinstance(ours, dict) and list(ours) == list(theirs), f"{where}: keys {list(ours)} vs {list(theirs)}"
        return max([assert_close_results(ours[k], theirs[k], f"{where}.{k}") for k in theirs], default=0.0)
    if isinstance(theirs, str) or isinstance(theirs, (int,)) and not hasattr(theirs, "dtype"):
        assert ours == theirs, f"{where}: {ours!r} != {theirs!r}"
        return 0.0
    diff = abs(float(ours) - float(theirs))  # numpy/python floats
    assert diff <= SCORE_TOL, f"{where}: {ours} vs {theirs} (diff {diff:.2e} > {SCORE_TOL})"
    return diff


# --- graph backends (tests/test_onnx.py, tests/test_openvino.py) against hfport's PyTorch pipelines ----------------

TEXTS = ["The film was wonderful.", "ok", "Paris is the capital of France and a large city full of museums."]
# task -> (pipeline task, inputs, options); each test adds the feature-extraction case it serves
GRAPH_PIPELINE_CASES = {
    "text-classification": ("text-classification", TEXTS, {"top_k": None}),
    "token-classification": ("token-classification", TEXTS, {}),
    "question-answering": ("question-answering",
                           [{"question": "Who wrote it?", "context": "Herman Melville wrote Moby-Dick in 1851."},
                            {"question": "Where is Berlin?", "context": "Berlin lies in Germany, on the Spree."}],
                           {"top_k": 2}),
    "fill-mask": ("fill-mask", ["The film was [MASK].", "Paris is the [MASK] of France."], {"top_k": 3}),
}


def assert_same(a, b, atol: float) -> None:
    """Equal structure and strings; floats within atol (scores, embeddings)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k], atol)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y, atol)
    elif isinstance(a, float):
        assert abs(a - b) <= atol, (a, b)
    else:
        assert a == b
