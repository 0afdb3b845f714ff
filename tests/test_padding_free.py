"""Padding-free execution (nn/layout.py): the default path packs a padded batch to its real tokens.

Checked here: it is the default and really skips padding (the layers see N rows, not B * T), it agrees with the
padded path at real positions (outputs, losses, every gradient) for every family and head, a sequence gives the
same result alone as inside a padded batch, padding positions come back as zeros, and masks with holes go where
they are exact. Tolerance: fp32 atol 1e-5 (the two paths differ only in matrix shapes, so in summation order).
"""

from __future__ import annotations

import pytest
import torch

import hfport
from hfport.nn import Packed, Padded, RepresentativePadding
from tests.tiny import ALL_FAMILIES, HEADS, batch, reference_qa_loss, save_hf

TOL = dict(atol=1e-5, rtol=1.3e-6)
LENGTHS = (70, 41, 41, 9)  # the two 41s form one run: a single attention call for both


def labels_for(task: str, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    mask = inputs["attention_mask"].bool()
    b, t = mask.shape
    if task == "sequence-classification":
        return {"labels": torch.randint(0, 3, (b,), generator=g)}
    if task in ("token-classification", "masked-lm"):
        high = 3 if task == "token-classification" else 50
        return {"labels": torch.randint(0, high, (b, t), generator=g).masked_fill(~mask, -100)}
    if task == "question-answering":
        return {"start_positions": torch.tensor([3, 20, 40, 1]), "end_positions": torch.tensor([9, 30, 40, 500])}
    return {}


def token_outputs(task: str, out) -> list[torch.Tensor]:
    if task == "base":
        return [out.last_hidden_state]
    if task == "question-answering":
        return [out.start_logits, out.end_logits]
    return [out.logits]


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def scalar(task: str, out, real: torch.Tensor, labels: dict[str, torch.Tensor]) -> torch.Tensor:
    if task == "question-answering":
        # over real positions: padding_free=False leaves padding logits as transformers does, and so does its loss
        return reference_qa_loss(out, labels["start_positions"], labels["end_positions"], real)
    return out.last_hidden_state[real].square().mean() if task == "base" else out.loss


@pytest.mark.parametrize("task", list(HEADS))
@pytest.mark.parametrize("family", list(ALL_FAMILIES))
def test_packed_equals_padded(family: str, task: str, tmp_path) -> None:
    save_hf(family, task, tmp_path)
    model = getattr(hfport, HEADS[task]).from_pretrained(tmp_path)
    inputs = batch(family, lengths=LENGTHS)
    real = inputs["attention_mask"].bool()
    labels = labels_for(task, inputs)

    assert model.padding_free  # the default
    packed_out = model(**inputs, **labels)
    packed_loss = scalar(task, packed_out, real, labels)
    packed_loss.backward()
    packed_grads = grads(model)
    model.zero_grad()
    model.padding_free = False
    padded_out = model(**inputs, **labels)
    padded_loss = scalar(task, padded_out, real, labels)
    padded_loss.backward()
    padded_grads = grads(model)

    for a, b in zip(token_outputs(task, packed_out), token_outputs(task, padded_out)):
        if a.dim() >= 2 and a.shape[:2] == real.shape:
            a, b = a[real], b[real]
        torch.testing.assert_close(a, b, **TOL)
    if task != "base":
        torch.testing.assert_close(packed_loss, padded_loss, **TOL)
    assert packed_grads.keys() == padded_grads.keys()
    for name in packed_grads:
        torch.testing.assert_close(packed_grads[name], padded_grads[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("family", list(ALL_FAMILIES))
def test_layers_see_only_real_tokens(family: str, tmp_path) -> None:
    """The structural proof that padding work is skipped: every feed-forward runs on N = sum(L_i) rows."""
    save_hf(family, "base", tmp_path)
    model = hfport.AutoModel.from_pretrained(tmp_path)
    rows: list[int] = []
    ffns = [m for m in model.modules() if m.__class__.__name__ in ("FeedForward", "GatedFeedForward")]
    hooks = [m.register_forward_hook(lambda mod, args, out: rows.append(args[0].shape[:-1].numel())) for m in ffns]
    inputs = batch(family, lengths=LENGTHS)
    out = model(**inputs)
    for h in hooks:
        h.remove()
    assert rows and set(rows) == {sum(LENGTHS)}, rows  # not 4 * 70
    # padding positions come back as zeros in the caller's (B, T, C) layout
    padding = ~inputs["attention_mask"].bool()
    assert out.last_hidden_state.shape[:2] == padding.shape
    assert not out.last_hidden_state[padding].any()


@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert", "albert", "deberta-v2"])
def test_a_sequence_alone_equals_it_inside_a_padded_batch(family: str, tmp_path) -> None:
    save_hf(family, "token-classification", tmp_path)
    model = hfport.AutoModelForTokenClassification.from_pretrained(tmp_path)
    inputs = batch(family, lengths=LENGTHS)
    with torch.no_grad():
        together = model(**inputs).logits
        for row, n in enumerate(LENGTHS):
            alone = model(**{k: v[row:row + 1, :n] for k, v in inputs.items()}).logits
            torch.testing.assert_close(together[row, :n], alone[0], **TOL)


def test_no_padding_and_opt_out_take_the_padded_path(tmp_path) -> None:
    save_hf("bert", "base", tmp_path)
    model = hfport.AutoModel.from_pretrained(tmp_path)
    full = batch("bert", lengths=(12, 12))
    layout = model.body.plan(full["input_ids"], full["attention_mask"])
    assert isinstance(layout, Padded) and layout.keep is None  # nothing to skip, nothing to mask
    padded = batch("bert", lengths=(12, 5))
    assert isinstance(model.body.plan(padded["input_ids"], padded["attention_mask"]), Packed)
    model.padding_free = False
    layout = model.body.plan(padded["input_ids"], padded["attention_mask"])
    assert isinstance(layout, Padded) and torch.equal(layout.keep, padded["attention_mask"].bool())


def test_holes_in_the_mask(tmp_path) -> None:
    """A mask with a hole: BERT-like families pack it (attention without relative positions is exact for any
    mask); DeBERTa keeps the padded path, since packing would shorten the relative distance across the hole."""
    for family, packs in (("bert", True), ("deberta-v2", False)):
        save_hf(family, "base", tmp_path / family)
        model = hfport.AutoModel.from_pretrained(tmp_path / family)
        inputs = batch(family, lengths=LENGTHS)
        inputs["attention_mask"][0, 10:15] = 0
        layout = model.body.plan(inputs["input_ids"], inputs["attention_mask"])
        assert isinstance(layout, Packed if packs else RepresentativePadding), layout
        real = inputs["attention_mask"].bool()
        with torch.no_grad():
            a = model(**inputs).last_hidden_state
            model.padding_free = False
            b = model(**inputs).last_hidden_state
        torch.testing.assert_close(a[real], b[real], **TOL)


def test_packed_layout() -> None:
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 1, 0]])
    packed = Packed.from_mask(mask)
    assert packed.lengths == (2, 4, 0, 2) and packed.starts == (0, 2, 6, 6)
    assert packed.runs == ((0, 1, 2), (2, 1, 4), (6, 1, 2))  # the empty sequence splits no run and has none
    assert Packed.from_mask(torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 0, 0]])).runs == \
        ((0, 2, 2), (4, 1, 3), (7, 1, 1))
    assert packed.index.tolist() == [1, 2, 4, 5, 6, 7, 12, 14]
    assert packed.positions.tolist() == [1, 2, 0, 1, 2, 3, 0, 2]  # each token's position in its padded row
    right = Packed.from_mask(torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]]))
    assert right.positions.tolist() == [0, 1, 2, 0, 1, 0]  # right padding: every sequence restarts at 0
    assert not packed.contiguous  # the last row has a hole
    assert Packed.from_mask(mask[:3]).contiguous
    x = torch.arange(4 * 4 * 2, dtype=torch.float).view(4, 4, 2).requires_grad_()
    back = packed.unpack(packed.pack(x))  # (B, T, 2): the real rows, zeros elsewhere
    torch.testing.assert_close(back, x.detach() * mask[..., None])
    back.sum().backward()
    torch.testing.assert_close(x.grad, mask[..., None].float().expand(4, 4, 2))
    assert Packed.from_mask(torch.ones(2, 3)) is None


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_training_after_inference_mode(family: str, tmp_path) -> None:
    """A model used under torch.inference_mode (as pipelines and the server do) then trained on batches of the same
    lengths: nothing cached during inference may be an inference tensor (DeBERTa's per-length relative index once
    was, and the training step failed with "Inference tensors cannot be saved for backward")."""
    save_hf(family, "sequence-classification", tmp_path / "m")
    model = hfport.AutoModelForSequenceClassification.from_pretrained(tmp_path / "m")
    inputs = batch(family)
    model.eval()
    with torch.inference_mode():
        model(**inputs)
    model.train()
    loss = model(**inputs, labels=torch.tensor([0, 1, 2])).loss
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
