"""Prepacked Linear layers (hfport/nn/packed.py), applied by the inference step (hfport/inference.py): at inference a
PackedLinear equals F.linear (fp32 within 1e-5: another kernel's summation order; bf16 within one bf16 rounding of the
output), for 1-D, 2-D and 3-D inputs; training and grad-on calls never build or use the packed copy; a changed weight
is never served stale; from_pretrained never packs, pipelines do (`packed_linear=`), in place and visibly (repr,
inference_steps), keeping state_dict names and shared Parameters; LoRA, mixed adapters and int8 still work over
packed layers."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hfport
from hfport.nn import lora as nn_lora
from hfport.nn import packed
from hfport.nn.int8 import Int8Linear, quantize_linears
from tests.tiny import make_adapter, save_hf
from tests.tiny_tokenizers import make_folder

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="packing needs oneDNN")

# fp32: oneDNN and BLAS sum in other orders (|diff| ~3e-7 at K=64 here); bf16: both round the fp32 sum to bf16, so
# at most one bf16 step (2^-8 relative) apart
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=2 ** -8)}


def _layer(dtype: torch.dtype, bias: bool = True) -> packed.PackedLinear:
    torch.manual_seed(0)
    return packed.PackedLinear(nn.Linear(64, 48, bias=bias).to(dtype).eval())


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("packed"), "bert", "sequence-classification")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64,), (5, 64), (2, 3, 64), (130, 64)])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_equals_f_linear(dtype, shape, bias):
    layer = _layer(dtype, bias)
    x = torch.randn(*shape).to(dtype)
    with torch.inference_mode():
        out = layer(x)  # (.., 48)
    assert packed.cached(layer) is not None  # the packed path ran (F.linear builds nothing)
    assert out.shape == (*shape[:-1], 48) and out.dtype == dtype
    torch.testing.assert_close(out, F.linear(x, layer.weight.detach(), None if layer.bias is None
                                             else layer.bias.detach()), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_training_and_grad_never_build_or_keep_the_copy(dtype):
    layer = _layer(dtype)
    x = torch.randn(4, 64).to(dtype)
    layer.train()
    with torch.no_grad():
        layer(x)  # train mode, grad off
    assert packed.cached(layer) is None
    layer.eval()
    y = layer(x)  # eval mode, grad on
    assert packed.cached(layer) is None and y.requires_grad
    with torch.no_grad():
        layer(x)
    assert packed.cached(layer) is not None
    layer.train()
    out = layer(x)  # the first training call drops the copy: a fine-tune holds none
    assert packed.cached(layer) is None
    out.float().sum().backward()
    assert layer.weight.grad is not None


def test_autocast_and_other_dtypes_go_through_f_linear():
    layer = _layer(torch.float32)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(torch.randn(3, 64))
    assert out.dtype == torch.bfloat16 and packed.cached(layer) is None
    with torch.no_grad():
        with pytest.raises(RuntimeError):  # a dtype mismatch is F.linear's own error, not a silent cast
            layer(torch.randn(3, 64, dtype=torch.float64))
        with pytest.raises(RuntimeError):  # so is a shape mismatch
            layer(torch.randn(3, 63))


def test_changed_weight_is_never_served_stale():
    layer = _layer(torch.float32)
    x = torch.randn(6, 64)
    with torch.no_grad():
        layer(x)
        layer.weight.mul_(-2.0)  # in place: _version moves
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), **TOL[torch.float32])
        layer.weight = nn.Parameter(torch.randn(48, 64))  # another tensor
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), **TOL[torch.float32])
        layer.load_state_dict({"weight": torch.ones(48, 64), "bias": torch.zeros(48)})
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), **TOL[torch.float32])
    layer.to(torch.bfloat16)  # cast: another dtype and data
    with torch.no_grad():
        xb = x.bfloat16()
        torch.testing.assert_close(layer(xb), F.linear(xb, layer.weight, layer.bias), **TOL[torch.bfloat16])


def _logits(model, enc) -> torch.Tensor:
    with torch.inference_mode():
        return model(**enc).logits


def test_from_pretrained_never_packs_and_the_inference_step_does(folder):
    """A loaded model may be fine-tuned next: its Linear layers are plain nn.Linear. for_inference swaps each for a
    PackedLinear holding the same Parameters (state_dict unchanged, repr and inference_steps show it)."""
    model = hfport.AutoModelForSequenceClassification.from_pretrained(folder)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert linears and all(type(m) is nn.Linear for m in linears.values())
    assert "forward" not in vars(next(iter(linears.values())))  # no instance-level forward either
    assert hfport.inference_steps(model) == {}
    state = model.state_dict()
    assert hfport.for_inference(model) is model and not model.training
    for name, old in linears.items():
        new = model.get_submodule(name)
        assert type(new) is packed.PackedLinear and new.weight is old.weight and new.bias is old.bias
    assert model.state_dict().keys() == state.keys()
    assert all(model.state_dict()[k] is v or torch.equal(model.state_dict()[k], v) for k, v in state.items())
    assert "PackedLinear(in_features=" in repr(model)
    assert hfport.inference_steps(model) == {"packed_linear": len(linears)}
    hfport.for_inference(model)  # a second time: nothing more to do
    assert hfport.inference_steps(model) == {"packed_linear": len(linears)}


def test_shared_layers_stay_shared(tmp_path):
    """ALBERT's layers are one module used at every depth: packed once, still one module."""
    save_hf("albert", "base", tmp_path)
    model = hfport.AutoModel.from_pretrained(tmp_path)
    before = {id(m) for m in model.modules() if type(m) is nn.Linear}
    hfport.for_inference(model)
    after = [m for m in model.modules() if isinstance(m, packed.PackedLinear)]
    assert len({id(m) for m in after}) == len(before) > 0


def test_train_a_step_then_evaluate_equals_the_unpacked_model(folder):
    model = hfport.for_inference(hfport.AutoModelForSequenceClassification.from_pretrained(folder))
    plain = copy.deepcopy(model)  # the packed copies stay behind (oneDNN's can't be copied)
    linears = [m for m in model.modules() if isinstance(m, packed.PackedLinear)]
    keys = set(model.state_dict())
    enc = {"input_ids": torch.tensor([[2, 5, 9, 11, 3], [2, 7, 3, 0, 0]]),
           "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])}
    before = _logits(model, enc)
    assert all(packed.cached(m) is not None for m in linears)
    assert all(packed.cached(m) is None for m in plain.modules() if isinstance(m, nn.Linear))
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    loss = model(**enc, labels=torch.tensor([0, 1])).loss
    assert all(packed.cached(m) is None for m in linears)  # dropped in the training forward, before backward
    loss.backward()
    optimizer.step()
    model.eval()
    after = _logits(model, enc)
    assert (after - before).abs().max() > 1e-3  # the step moved the outputs: a stale copy would not
    unpacked = copy.deepcopy(model)
    packed_modules = {n for n, m in unpacked.named_modules() if isinstance(m, packed.PackedLinear)}
    for name in packed_modules:  # the same weights, every layer through F.linear
        parent, _, child = name.rpartition(".")
        layer = unpacked.get_submodule(name)
        plain_layer = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
        plain_layer.weight, plain_layer.bias = layer.weight, layer.bias
        setattr(unpacked.get_submodule(parent), child, plain_layer)
    torch.testing.assert_close(after, _logits(unpacked, enc), atol=1e-5, rtol=1e-5)
    assert set(model.state_dict()) == keys  # nothing of the packing in the state_dict
    layer = pickle.loads(pickle.dumps(linears[0]))  # the packed copy stays behind
    assert type(layer) is packed.PackedLinear and packed.cached(layer) is None


def test_pipeline_packs_and_adapters_and_int8_still_work(folder, tmp_path):
    adapter = make_adapter(folder, tmp_path / "a", "text-classification", 4, ["q", "ffn.up"], 1)
    texts = ["a short text", "and another one, longer than the first", "third"]

    def run(packed_linear: bool) -> tuple[list, hfport.Pipeline]:
        pipe = hfport.pipeline("text-classification", model=folder, packed_linear=packed_linear)
        pipe.add_adapter("a", adapter)  # mixed adapters: MixedLinear over the shared (packed) Parameters
        plain = pipe(texts, top_k=None, function_to_apply="none")
        mixed = pipe(texts, adapter=["a", None, "a"], top_k=None, function_to_apply="none")
        return [[d["score"] for d in r] for r in plain + mixed], pipe

    got, pipe = run(True)
    mixed_layers = [m for m in pipe.model.body.modules() if isinstance(m, nn_lora.MixedLinear)]
    assert mixed_layers and all(m.prepacked and packed.cached(m) is not None for m in mixed_layers)
    assert any(isinstance(m, packed.PackedLinear) for m in pipe.adapters["a"].model.head.modules())
    want, pipe = run(False)
    assert hfport.inference_steps(pipe.model) == {}
    assert not any(packed.cached(m) is not None for m in pipe.model.modules() if isinstance(m, nn.Linear))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=0)
    model = hfport.for_inference(hfport.AutoModelForSequenceClassification.from_pretrained(folder))
    enc = {"input_ids": torch.tensor([[2, 5, 9, 3]])}
    _logits(model, enc)  # packed copies built
    quantize_linears(model.body.encoder)  # int8 swaps the plain layers, packed or not
    assert any(isinstance(m, Int8Linear) for m in model.modules())
    assert not any(isinstance(m, packed.PackedLinear) for m in model.body.encoder.modules())
    assert _logits(model, enc).isfinite().all()


def test_an_adapter_folder_pipeline_packs_the_base_product_only(folder, tmp_path):
    """A LoRA adapter's pipeline: each LoraLinear computes its base product packed (prepacked, shown by repr), its own
    A and B stay plain (as in the model that trained and saved it), and the scores equal the unpacked pipeline's."""
    adapter = make_adapter(folder, tmp_path / "a", "text-classification", 4, ["q", "v"], 1)
    texts = ["a short text", "and another one, longer than the first"]
    pipes = {flag: hfport.pipeline("text-classification", model=adapter, tokenizer=folder, packed_linear=flag)
             for flag in (True, False)}
    loras = [m for m in pipes[True].model.modules() if isinstance(m, nn_lora.LoraLinear)]
    assert loras and all(m.prepacked and type(m.lora_A) is nn.Linear and type(m.lora_B) is nn.Linear for m in loras)
    assert "prepacked=True" in repr(loras[0])
    assert not any(m.prepacked for m in pipes[False].model.modules() if isinstance(m, nn_lora.LoraLinear))
    got, want = (torch.tensor([[d["score"] for d in r] for r in pipes[f](texts, top_k=None, function_to_apply="none")])
                 for f in (True, False))
    assert all(packed.cached(m) is not None for m in loras)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_shared_parameters_share_one_packed_copy():
    a = _layer(torch.float32)
    b = packed.PackedLinear(a)  # the same Parameters, as two adapters over one base, or MixedLinear
    with torch.no_grad():
        a(torch.randn(2, 64))
        b(torch.randn(2, 64))
    assert packed.cached(a) is packed.cached(b)


def test_a_failing_first_call_turns_packing_off(monkeypatch):
    layer = _layer(torch.float32)
    monkeypatch.setattr(packed._State, "usable", None)  # restored after the test
    monkeypatch.setattr(packed, "_compute", lambda *args: (_ for _ in ()).throw(RuntimeError("no such op")))
    x = torch.randn(3, 64)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    assert packed._State.usable is False and packed.cached(layer) is None


def test_real_minilm_fp32_packed_equals_transformers(minilm_path):
    """Inference through the packed layers (the parity grid's outputs run with grad on, so unpacked): a padded batch
    of real texts, a pair among them, within the parity tolerance of transformers (measured 2.6e-6; unpacked 2.0e-6)."""
    import transformers

    tok = hfport.AutoTokenizer.from_pretrained(minilm_path)
    texts = ["The quick brown fox jumps over the lazy dog.", "hi",
             "Serving latency matters most for short texts in small batches, where the matmuls are thin."]
    enc = dict(tok(texts, ["a pair's second text", "", "and a third"], padding=True, return_tensors="pt"))
    mask = enc["attention_mask"].bool()
    ours = hfport.for_inference(hfport.AutoModel.from_pretrained(minilm_path, dtype=torch.float32))
    theirs = transformers.AutoModel.from_pretrained(str(minilm_path)).eval()
    with torch.inference_mode():
        got = ours(**enc).last_hidden_state[mask]  # (real tokens, C)
        want = theirs(**enc).last_hidden_state[mask]
    assert all(packed.cached(m) is not None for m in ours.body.encoder.modules() if isinstance(m, nn.Linear))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_server_memory_counts_packed_copies(tiny_bert):
    """The server's model cache budget (weight_bytes) counts a Linear weight's packed copy once inference built
    it: without it the budget undercounts a served model by up to its Linear weights."""
    import hfport
    from server.serving import weight_bytes

    pipe = hfport.pipeline("feature-extraction", model=tiny_bert, dtype="float32")
    before = weight_bytes(pipe)
    linears = [m for m in pipe.model.modules() if isinstance(m, packed.PackedLinear)]
    pipe(["a short text", "and another one"])
    built = [m for m in linears if hfport.packed_bytes(m.weight) > 0]
    assert built, "inference built no packed copy"
    assert weight_bytes(pipe) == before + sum(m.weight.numel() * m.weight.element_size() for m in built)


def test_torch_compile_traces_packed_layers(tiny_bert):
    """torch.compile (dynamo) traces a packed model's Linear layers, in training and at inference: the packed path
    steps aside while compiling (its cache on the weight's __dict__ is not traceable)."""
    model = hfport.for_inference(hfport.AutoModel.from_pretrained(tiny_bert))
    assert any(isinstance(m, packed.PackedLinear) for m in model.modules())
    ids = torch.tensor([[101, 2023, 2003, 102], [101, 2054, 102, 0]])
    mask = (ids != 0).long()
    compiled = torch.compile(model, backend="eager", fullgraph=False)
    model.train()
    compiled(input_ids=ids, attention_mask=mask).last_hidden_state.sum().backward()
    model.eval()
    with torch.no_grad():
        got = compiled(input_ids=ids, attention_mask=mask).last_hidden_state
        want = model(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fp32_padded_row_counts():
    """Packed fp32 calls pad their rows to a bounded set of sizes (oneDNN keeps a primitive per row count)."""
    assert [packed.padded_rows(n) for n in (1, 16, 17, 128, 129, 144, 145, 256, 257, 1000)] == [
        16, 16, 32, 128, 144, 144, 160, 256, 288, 1024]
    sizes = {packed.padded_rows(n) for n in range(1, 4097)}
    assert len(sizes) == 8 + 8 * 5  # 16..128, then 8 per doubling up to 4096
    assert all(packed.padded_rows(n) >= n and (n <= 128 or packed.padded_rows(n) <= n * 1.125) for n in range(1, 4097))


def test_cli_info_names_the_inference_steps(folder):
    """`hfport info` says what a pipeline over the model runs: its PackedLinear layers and the row-shard rule for
    its dtype."""
    import json

    from typer.testing import CliRunner

    from hfport.cli import app
    from hfport.pipelines import shards

    linears = sum(isinstance(m, nn.Linear) for m in hfport.AutoModelForSequenceClassification.from_pretrained(
        folder).modules())
    result = CliRunner().invoke(app, ["info", str(folder), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["inference"] == {"packed_linear": f"{linears} layers",
                                                      "row_shards": shards.describe("auto", torch.float32)}
    text = CliRunner().invoke(app, ["info", str(folder)]).output
    assert f"inference     packed_linear {linears} layers; row_shards auto: batches of" in text, text


def _ops(layer: nn.Module, x: torch.Tensor) -> list[str]:
    """The operators one inference call of LAYER dispatches itself (not those an operator runs inside), the packed copy
    built before."""
    with torch.inference_mode():
        layer(x)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            layer(x)
    return [e.name for e in prof.events() if e.cpu_parent is None]


def test_a_bf16_call_is_one_onednn_op():
    # one short text calls ~40 linears a forward pass: a bf16 call hands its (.., in) input to oneDNN as it is, with
    # no reshape to (M, in) and back and no slice (the op keeps the leading axes), so its cost is the product alone
    layer = _layer(torch.bfloat16)
    assert _ops(layer, torch.randn(1, 11, 64).to(torch.bfloat16)) == ["mkldnn::_linear_pointwise"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_contiguous_inputs_equal_f_linear(dtype):
    layer = _layer(dtype)
    for x in (torch.randn(3, 64, 5).to(dtype).transpose(1, 2), torch.randn(2, 3, 4, 64).to(dtype)[:, :, ::2],
              torch.randn(7, 64).to(dtype)[::2]):
        with torch.inference_mode():
            out = layer(x)
        assert packed.cached(layer) is not None and out.shape == (*x.shape[:-1], 48)
        torch.testing.assert_close(out, F.linear(x, layer.weight.detach(), layer.bias.detach()), **TOL[dtype])
