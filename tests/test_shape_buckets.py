"""Row buckets (nn/buckets.py): the encoder's linears see a bounded set of row counts over varied batches, and the
zero rows they add change no value and no gradient.

The bound is counted, not timed: a dispatch mode records the M of every matrix multiply the forward and backward
run (aten mm / addmm: the linears, their gradients), over many batches of varied token counts in bf16.
Equality: ROW_BUCKETS "always" against "off" in fp32, outputs, loss and every gradient, with and without gradient
checkpointing (whose backward recomputes the layers outside the body's forward). Tolerance fp32 1e-6: the zero
rows change only the matmuls' blocking, so at most the summation order of a weight gradient.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hfport
from hfport.nn import buckets
from tests.tiny import batch, save_hf

TOL = dict(atol=1e-6, rtol=1e-6)


class _MatmulDims(TorchDispatchMode):
    """Every dimension of every 2-D matmul dispatched, mm(a, b) and addmm(bias, a, b): the linears' M, K and N in
    the forward, and in the backward the input gradient's (M, N) @ (N, K) and the weight gradient's (N, M) @ (M, K)."""

    def __init__(self) -> None:
        super().__init__()
        self.dims: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func is torch.ops.aten.mm.default:
            self.dims.update((*args[0].shape, *args[1].shape))
        elif func is torch.ops.aten.addmm.default:
            self.dims.update((*args[1].shape, *args[2].shape))
        return func(*args, **(kwargs or {}))


@pytest.fixture(autouse=True)
def _auto_buckets(monkeypatch):
    """Every test here starts from "auto" (the default is "off": HFPORT_ROW_BUCKETS) and leaves the setting as found."""
    monkeypatch.setattr(buckets, "ROW_BUCKETS", "auto")


def test_bucket_sizes() -> None:
    assert [buckets.bucket(n) for n in (1, 16, 17, 128, 129, 144, 145, 256, 257, 1000)] == [
        16, 16, 32, 128, 144, 144, 160, 256, 288, 1024]
    sizes = {buckets.bucket(n) for n in range(1, 4097)}
    assert len(sizes) == 8 + 8 * 5  # 16..128, then 8 per doubling up to 4096
    assert all(buckets.bucket(n) >= n and (n <= 128 or buckets.bucket(n) <= n * 1.125) for n in range(1, 4097))


@pytest.fixture
def bert(tmp_path):
    save_hf("bert", "sequence-classification", tmp_path)
    return tmp_path


def _varied(family: str, rng: random.Random) -> dict[str, torch.Tensor]:
    lengths = tuple(rng.randint(2, 40) for _ in range(rng.randint(1, 4)))
    return batch(family, seed=rng.randint(0, 10 ** 6), lengths=lengths)


def test_bf16_matmul_rows_are_bounded(bert) -> None:
    """30 training steps of random token counts in bf16: without buckets nearly every batch brings new matmul
    shapes; with them, every matmul dimension is a weight's (hidden 32, intermediate 37, 2 labels), the head's
    batch of B <= 4 rows, or a bucket size."""
    model = hfport.AutoModelForSequenceClassification.from_pretrained(bert, dtype=torch.bfloat16)
    rng = random.Random(0)
    counter, seen_tokens = _MatmulDims(), set()
    with counter:
        for _ in range(30):
            inputs = _varied("bert", rng)
            seen_tokens.add(int(inputs["attention_mask"].sum()))
            labels = torch.zeros(inputs["input_ids"].shape[0], dtype=torch.long)
            model(**inputs, labels=labels).loss.backward()
    assert len(seen_tokens) > 20  # the batches really vary
    token_dims = counter.dims - {32, 37, 2, 1, 3, 4}
    assert token_dims <= {buckets.bucket(n) for n in range(1, 4 * 40 + 1)}, token_dims
    assert len(token_dims) <= 9  # 16..128, 144, 160: 160 tokens at most

    buckets.ROW_BUCKETS = "off"
    try:
        off = _MatmulDims()
        with off:
            inputs = _varied("bert", random.Random(3))
            model(**inputs).logits.float().sum().backward()
        assert int(inputs["attention_mask"].sum()) in off.dims  # the counter sees unbucketed M too
    finally:
        buckets.ROW_BUCKETS = "auto"


def _run(model, inputs, labels):
    model.zero_grad()
    out = model(**inputs, labels=labels)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                                     if p.grad is not None}


@pytest.mark.parametrize("family", ["bert", "modernbert", "deberta-v2"])
@pytest.mark.parametrize("checkpointed", [False, True])
def test_buckets_change_no_value(family: str, checkpointed: bool, tmp_path) -> None:
    save_hf(family, "token-classification", tmp_path)
    model = hfport.AutoModelForTokenClassification.from_pretrained(tmp_path)
    model.gradient_checkpointing_enable(checkpointed)
    model.train()  # dropout on: the zero rows must not shift the draws
    inputs = batch(family, lengths=(70, 41, 41, 9))
    labels = torch.randint(0, 3, inputs["input_ids"].shape, generator=torch.Generator().manual_seed(2))
    labels = labels.masked_fill(inputs["attention_mask"] == 0, -100)
    results = {}
    for mode in ("off", "always"):
        buckets.ROW_BUCKETS = mode
        try:
            torch.manual_seed(5)
            results[mode] = _run(model, inputs, labels)
        finally:
            buckets.ROW_BUCKETS = "auto"
    (logits_a, loss_a, grads_a), (logits_b, loss_b, grads_b) = results["off"], results["always"]
    real = inputs["attention_mask"].bool()
    torch.testing.assert_close(logits_b[real], logits_a[real], **TOL)
    torch.testing.assert_close(loss_b, loss_a, **TOL)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


def _fresh_buckets_module(monkeypatch, value: str):
    """A fresh copy of nn/buckets.py run with HFPORT_ROW_BUCKETS=`value` (the setting is read at import); the loaded
    hfport.nn.buckets is left alone."""
    import importlib.util

    monkeypatch.setenv("HFPORT_ROW_BUCKETS", value)
    spec = importlib.util.spec_from_file_location("_buckets_copy", buckets.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("value", ["on", "yes", "1"])
def test_invalid_row_buckets_setting_names_the_variable(monkeypatch, value):
    with pytest.raises(ValueError, match=rf"HFPORT_ROW_BUCKETS='{value}': expected one of auto, always, off"):
        _fresh_buckets_module(monkeypatch, value)
    assert _fresh_buckets_module(monkeypatch, " Always ").ROW_BUCKETS == "always"  # case and spaces are forgiven
