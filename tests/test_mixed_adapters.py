"""Mixed-adapter batches: rows naming different LoRA adapters over one base (and rows of the base itself) run
through one forward pass of the shared body, each row with its own adapter, each adapter's head on its own rows.
Per row the result equals that adapter served alone and peft over transformers (fp32 1e-5), in the library
(`pipeline(..., adapters=)`, `adapter=` per call) and on every serving route; registering or removing an adapter
never reloads the base or pauses serving; an adapter over another base never mixes; an unknown target module is
an error naming the adapter and the module."""

from __future__ import annotations

import json
import re
import shutil
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import hfport
from hfport import lora
from hfport.nn import lora as nn_lora
from tests.tiny import ALL_FAMILIES, batch, make_adapter, save_hf
from tests.tiny_tokenizers import make_folder

import peft  # noqa: E402 - a dev dependency: missing must fail, not skip

TEXTS = ["the plot was great and the acting even better", "awful", "the ending was lovely overall, I think",
         "a b c d e f g h i j k", "not bad", "the last one is the longest of all the texts in this small batch"]


def count_body_calls(body: torch.nn.Module) -> list[int]:
    """A list that grows by one row count per forward pass of `body` (the hook stays: each test builds its own)."""
    calls: list[int] = []
    body.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    return calls


# --- the library -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """A tiny BERT classifier and three classification adapters over it: other ranks, targets and label sets."""
    root = tmp_path_factory.mktemp("mixed-tiny")
    base = make_folder(root, "bert", "sequence-classification")
    task = "text-classification"
    return {
        "base": base,
        "a": make_adapter(base, root / "a", task, 2, ["q", "v"], 1, id2label={0: "x", 1: "y"}),
        "b": make_adapter(base, root / "b", task, 4, ["k", "ffn.up"], 2, id2label={0: "p", 1: "q", 2: "r"}),
        "c": make_adapter(base, root / "c", task, 8, ["o", "ffn.down", "q", "pooler.dense"], 3,
                          id2label={0: "m", 1: "n", 2: "o", 3: "z"}),
    }


def _scores(result: list[dict]) -> dict[str, float]:
    return {d["label"]: d["score"] for d in result}


def _peft_logits(base: Path, folder: Path, labels: int, ids: list[int], types: list[int]) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(base), num_labels=labels, ignore_mismatched_sizes=True)
    theirs = model if folder == base else peft.PeftModel.from_pretrained(model, str(folder)).get_base_model()
    with torch.no_grad():
        return theirs.eval()(input_ids=torch.tensor([ids]), token_type_ids=torch.tensor([types])).logits[0]


@pytest.mark.parametrize(("padding_free", "form"), [(True, "segments"), (False, "segments"), (True, "stacked")])
def test_mixed_batch_equals_each_adapter_alone_and_peft(tiny, padding_free, form, monkeypatch):
    monkeypatch.setattr(nn_lora, "MIXED_LORA", form)  # each form of the adapted layers (the cost rule picks one)
    pipe = hfport.pipeline("text-classification", model=tiny["base"],
                           adapters={name: tiny[name] for name in "abc"})
    pipe.model.padding_free = padding_free  # the shared body: packed (a row is a segment of tokens) or padded
    calls = count_body_calls(pipe.model.body)
    names = ["a", None, "b", "c", "a", "b"]
    mixed = pipe(TEXTS, adapter=names, top_k=None, function_to_apply="none")
    assert calls == [len(TEXTS)]  # one forward pass of the body for every row and every adapter
    alone = {name: hfport.pipeline("text-classification", model=tiny[name]) for name in "abc"}
    alone[None] = hfport.pipeline("text-classification", model=tiny["base"])
    worst = 0.0
    for text, name, got in zip(TEXTS, names, mixed):
        want = _scores(alone[name]([text], top_k=None, function_to_apply="none")[0])
        assert _scores(got).keys() == want.keys()  # each row read by its own head and labels
        worst = max(worst, *(abs(_scores(got)[k] - want[k]) for k in want))
        enc = pipe.tokenizer(text, return_token_type_ids=True)
        folder = tiny[name] if name else tiny["base"]
        theirs = _peft_logits(tiny["base"], folder, len(want), enc["input_ids"], enc["token_type_ids"])
        labels = alone[name].model.config.id2label
        ours = torch.tensor([_scores(got)[labels[i]] for i in range(len(labels))])
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    assert worst <= 1e-5, worst


def test_adapter_per_call_and_by_name(tiny):
    pipe = hfport.pipeline("text-classification", model=tiny["base"], adapters={"a": tiny["a"]})
    pipe.add_adapter("b", tiny["b"])
    one = pipe(TEXTS[0], adapter="b", top_k=None)
    assert {d["label"] for d in one} == {"p", "q", "r"}
    assert pipe(TEXTS, top_k=1) == hfport.pipeline("text-classification", model=tiny["base"])(TEXTS, top_k=1)
    with pytest.raises(ValueError, match=r"adapter 'nope' is not loaded; adapters: \['a', 'b'\]"):
        pipe(TEXTS, adapter="nope")
    with pytest.raises(ValueError, match="2 names for 6 inputs"):
        pipe(TEXTS, adapter=["a", "b"])
    body = pipe.model.body
    pipe.remove_adapter("a")
    assert pipe.model.body is body and sorted(pipe.adapters) == ["b"]
    with pytest.raises(ValueError, match="adapter 'a' is not loaded"):
        pipe(TEXTS, adapter="a")


def test_unknown_target_module_names_the_adapter_and_the_module(tiny, tmp_path):
    folder = tmp_path / "bad"
    shutil.copytree(tiny["a"], folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    config["target_modules"] = [*config["target_modules"], "qkv_proj"]
    (folder / "adapter_config.json").write_text(json.dumps(config))
    pipe = hfport.pipeline("text-classification", model=tiny["base"])
    with pytest.raises(lora.LoraError, match=r"adapter 'bad' .*target module 'qkv_proj' is not a layer"):
        pipe.add_adapter("bad", folder)


def _break_adapter(good: Path, out: Path, how: str) -> Path:
    """A copy of the adapter folder GOOD broken in one way a folder on disk can be."""
    folder = Path(shutil.copytree(good, out))
    config_file = folder / "adapter_config.json"
    config = json.loads(config_file.read_text())
    if how == "no adapter_config.json":
        config_file.unlink()
    elif how == "adapter_config.json not JSON":
        config_file.write_text('{"r": 4, "target_modules": ')
    elif how == "unknown target module":
        config_file.write_text(json.dumps({**config, "target_modules": [*config["target_modules"], "qkv_proj"]}))
    elif how == "rank mismatch":
        config_file.write_text(json.dumps({**config, "r": 2 * config["r"]}))
    elif how == "another base":  # its own config.json: trained over a base of other sizes
        own = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**own, "intermediate_size": own["intermediate_size"] * 2}))
    elif how == "tokenizer.json not JSON":  # read after the LoRA weights loaded
        (folder / "tokenizer.json").write_text("{")
    return folder


BROKEN_ADAPTERS = ["no adapter_config.json", "adapter_config.json not JSON", "unknown target module", "rank mismatch",
                   "another base", "tokenizer.json not JSON"]


def _mixed_layers(body: torch.nn.Module) -> list[str]:
    return sorted(name for name, m in body.named_modules() if isinstance(m, nn_lora.MixedLinear))


@pytest.mark.parametrize("how", BROKEN_ADAPTERS)
def test_a_failed_adapter_load_leaves_the_base_and_its_adapters_as_they_were(tiny, tmp_path, monkeypatch, how):
    """add_adapter with a broken folder raises and changes nothing: over a base without adapters, the base gets no
    AdapterSet; over one with an adapter, the set's slots and table, the shared body's layers, the adapters' pipelines
    and every output stay as they were, also when the failing load reuses a loaded adapter's name; and nothing of
    the failed adapter stays referenced (its model is collected). The tokenizer case failed after the LoRA weights
    were installed: they stayed in the table (and a reused name served them under the old head)."""
    import gc
    import weakref

    made: list[weakref.ref] = []  # every model load_adapter made (weakly: the test holds none of them)
    failed: list[weakref.ref] = []  # those of loads that failed
    load_adapter = lora.load_adapter
    monkeypatch.setattr(lora, "load_adapter", lambda *a, **k: made.append(weakref.ref(m := load_adapter(*a, **k)))
                        or m)

    def fails(pipe: hfport.pipelines.Pipeline, name: str) -> None:
        start = len(made)
        with pytest.raises((hfport.HfportError, ValueError)):
            pipe.add_adapter(name, bad)
        failed.extend(made[start:])

    bad = _break_adapter(tiny["b"], tmp_path / "bad", how)
    plain = hfport.pipeline("text-classification", model=tiny["base"])
    want = plain(TEXTS, top_k=None)
    fails(plain, "b")
    assert plain.model.adapter_set is None and plain.adapters == {} and _mixed_layers(plain.model.body) == []
    assert plain(TEXTS, top_k=None) == want

    pipe = hfport.pipeline("text-classification", model=tiny["base"], adapters={"a": tiny["a"]})
    shared = pipe.model.adapter_set
    before = (dict(shared.slots), shared.table, _mixed_layers(pipe.model.body), dict(pipe.adapters))
    want = [pipe(TEXTS, top_k=None), pipe(TEXTS, adapter="a", top_k=None)]
    for name in ("b", "a"):  # a new name, and a loaded adapter's name (a load of it replaces it only when it works)
        fails(pipe, name)
        assert pipe.model.adapter_set is shared
        assert (dict(shared.slots), shared.table, _mixed_layers(pipe.model.body), dict(pipe.adapters)) == before
        assert [pipe(TEXTS, top_k=None), pipe(TEXTS, adapter="a", top_k=None)] == want
    gc.collect()
    assert all(ref() is None for ref in failed), "a failed adapter's model is still referenced"


def test_an_adapter_whose_pipeline_fails_is_not_installed(tmp_path, monkeypatch):
    """The adapter's own pipeline can fail after its weights loaded (a sentence-embedding adapter folder whose
    modules.json names a module hfport does not compute): its LoRA weights stayed in the shared body's table under a
    slot of their own, with no pipeline to serve them. Now the set installs an adapter only once its pipeline is
    built: slots, table and layers stay as they were, the base and its adapter answer as before, and the failed
    adapter's model is collected."""
    import gc
    import weakref

    base = make_folder(tmp_path, "bert", "feature-extraction")
    good = make_adapter(base, tmp_path / "good", "feature-extraction", 2, ["q", "v"], 1)
    bad = make_adapter(base, tmp_path / "bad", "feature-extraction", 4, ["k", "ffn.up"], 2)
    (bad / "modules.json").write_text(json.dumps([{"idx": 0, "name": "0", "path": "", "type": "my.CustomModule"}]))
    pipe = hfport.pipeline("sentence-embedding", model=base, adapters={"good": good})
    shared = pipe.model.adapter_set
    before = (dict(shared.slots), shared.table, _mixed_layers(pipe.model.body), dict(pipe.adapters))
    want = [pipe(TEXTS), pipe(TEXTS, adapter="good")]
    made: list[weakref.ref] = []
    load_adapter = lora.load_adapter
    monkeypatch.setattr(lora, "load_adapter", lambda *a, **k: made.append(weakref.ref(m := load_adapter(*a, **k)))
                        or m)
    for name in ("bad", "good"):
        with pytest.raises(hfport.HfportError, match="my.CustomModule"):
            pipe.add_adapter(name, bad)
    assert len(made) == 2  # both got as far as a loaded model
    assert (dict(shared.slots), shared.table, _mixed_layers(pipe.model.body), dict(pipe.adapters)) == before
    assert [pipe(TEXTS), pipe(TEXTS, adapter="good")] == want
    gc.collect()
    assert all(ref() is None for ref in made), "a failed adapter's model is still referenced"


def test_adapters_over_a_base_without_the_tasks_head(tmp_path):
    """Predict's documented way (`pipeline(task, model=base, adapters=...)`) over a base encoder that has no
    text-classification head of its own, each adapter bringing its head: it loads and answers through its adapters,
    and every call that would answer with the base's own (random) head is refused, naming the adapters; so is a
    base loaded with allow_untrained_head=True (never to answer with it)."""
    from hfport.errors import UntrainedHeadError

    base = make_folder(tmp_path, "bert", "feature-extraction")
    folder = make_adapter(base, tmp_path / "a", "text-classification", 2, ["q", "v"], 1, id2label={0: "x", 1: "y"})
    pipe = hfport.pipeline("text-classification", model=base, adapters={"a": folder})
    alone = hfport.pipeline("text-classification", model=folder)
    assert pipe(TEXTS, adapter="a", top_k=None) == alone(TEXTS, top_k=None)
    refusal = r"hold no text-classification head.*name one with adapter= \(adapters: \['a'\]\)"
    for call in (lambda: pipe(TEXTS), lambda: pipe(TEXTS, adapter=["a", None, "a", "a", "a", "a"]),
                 lambda: pipe.predict(TEXTS), lambda: pipe.prepare(TEXTS)):
        with pytest.raises(UntrainedHeadError, match=refusal):
            call()
    server_base = hfport.pipeline("text-classification", model=base, allow_untrained_head=True)
    with pytest.raises(UntrainedHeadError, match="adapters: \\[\\]"):
        server_base(TEXTS[0])
    server_base.add_adapter("a", folder)
    assert server_base(TEXTS[0], adapter="a") == alone(TEXTS[0])


@pytest.mark.parametrize("padding_free", [True, False])
@pytest.mark.parametrize("family", list(ALL_FAMILIES))
def test_every_family_and_layout_routes_rows_to_their_adapters(family, padding_free, tmp_path):
    """The body once over a padded batch (packed, padded, DeBERTa's representative padding, ALBERT's shared
    layers), rows with two adapters of other ranks and targets and one base row: each row's real positions equal
    that adapter alone (hfport's LoraLinear, proven equal to peft in test_lora.py) at fp32 1e-5."""
    base_dir = tmp_path / "base"
    save_hf(family, "base", base_dir)
    base = hfport.AutoModel.from_pretrained(base_dir)
    wide = [*base.family.lora_targets, "ffn.up", "ffn.down"]
    folders = [make_adapter(base_dir, tmp_path / "one", "feature-extraction", 2, list(base.family.lora_targets), 1),
               make_adapter(base_dir, tmp_path / "two", "feature-extraction", 6, wide, 2)]
    shared = lora.AdapterSet(base)
    for i, folder in enumerate(folders):
        shared.load(f"a{i}", folder, hfport.EncoderModel)
    base.padding_free = padding_free
    b = batch(family)
    slots = torch.tensor([shared.slots["a0"], 0, shared.slots["a1"]])  # (B,)
    with torch.no_grad():
        hidden, _ = shared.run_body(slots, b["input_ids"], b["attention_mask"], b.get("token_type_ids"))
    mask = b["attention_mask"].bool()
    for row, folder in enumerate([folders[0], None, folders[1]]):
        alone = hfport.AutoModel.from_pretrained(folder or base_dir)
        alone.padding_free = padding_free
        with torch.no_grad():
            want = alone(**{k: v[row:row + 1] for k, v in b.items()}).last_hidden_state[0]  # (T, C)
        torch.testing.assert_close(hidden[row][mask[row]], want[mask[row]], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adapters_absent_from_a_batch_are_left_out_and_bf16_rounds_as_alone(tiny, tmp_path, dtype):
    """A layer's adapters sit side by side; a batch computes only the columns of the adapters it holds: all of them,
    a subset (gathered), one (a slice) for some rows or for every row, none (the base). Each row equals its adapter
    alone (LoraLinear) at fp32 1e-5; in bf16 the mixed pass rounds otherwise (scaling folded into B, one matmul for
    all adapters), so its error against fp32 is bounded by the adapter alone's bf16 error (times 1.5; measured: at
    most equal on this model) instead of an absolute tolerance."""
    task = "text-classification"
    folders = {n: tiny[n] for n in "abc"} | {
        "d": make_adapter(tiny["base"], tmp_path / "d", task, 3, ["q", "k"], 4, id2label={0: "u", 1: "w"})}
    cls = hfport.AutoModelForSequenceClassification
    base = cls.from_pretrained(tiny["base"], dtype=dtype)
    shared = lora.AdapterSet(base)
    for name, folder in folders.items():
        shared.load(name, folder, cls)
    assert {s: e - b for s, (b, e) in shared.table.layers["encoder.layers.0.attn.q"].spans.items()} == {
        shared.slots["a"]: 2, shared.slots["c"]: 8, shared.slots["d"]: 3}  # ranks differ on one layer
    b = batch("bert")
    inputs = {k: torch.cat([v, v[2:3]]) for k, v in b.items()}  # 4 rows: the last repeats the shortest
    mask = inputs["attention_mask"].bool()
    expected: dict[tuple[str | None, torch.dtype], torch.Tensor] = {}

    def alone(name: str | None, row: int, dt: torch.dtype) -> torch.Tensor:  # (T_row, C) float32
        if (name, dt, row) not in expected:
            model = cls.from_pretrained(folders[name] if name else tiny["base"], dtype=dt)
            with torch.no_grad():
                hidden, _ = model.body(**{k: v[row:row + 1] for k, v in inputs.items()})
            expected[name, dt, row] = hidden[0][mask[row]].float()
        return expected[name, dt, row]

    for names in (["a", "b", "c", "d"], ["a", None, "d", "a"], ["c", None, "c", None], ["b", "b", "b", "b"],
                  [None, None, None, None]):
        slots = torch.tensor([shared.slots[n] if n else 0 for n in names])  # (B,)
        with torch.no_grad():
            hidden, _ = shared.run_body(slots, inputs["input_ids"], inputs["attention_mask"], inputs["token_type_ids"])
        for row, name in enumerate(names):
            got = hidden[row][mask[row]].float()  # (T_row, C)
            if dtype == torch.float32:
                torch.testing.assert_close(got, alone(name, row, dtype), atol=1e-5, rtol=1e-4)
            else:
                ref = alone(name, row, torch.float32)
                own = (alone(name, row, dtype) - ref).abs().max()
                assert (got - ref).abs().max() <= 1.5 * own, (names, row)


@pytest.mark.parametrize("padding_free", [True, False])
def test_segment_form_equals_stacked_form(tiny, padding_free, monkeypatch):
    """The two forms of a mixed batch's adapted layers (nn/lora.py: per run of rows its adapter's rank only, or
    every present adapter's columns masked) give the same hidden states and pooler outputs (fp32 1e-6), on rows
    sorted by adapter (few runs) and unsorted (a run per row), with base rows and an adapter on the pooler."""
    cls = hfport.AutoModelForSequenceClassification
    base = cls.from_pretrained(tiny["base"])
    base.padding_free = padding_free
    shared = lora.AdapterSet(base)
    for name in "abc":
        shared.load(name, tiny[name], cls)
    b = batch("bert", lengths=(70, 41, 41, 9, 9, 9, 30, 41))
    for names in (["a", "a", "b", "b", "c", None, "c", "a"], ["c", "a", None, "b", "a", "c", "b", "c"]):
        slots = torch.tensor([shared.slots[n] if n else 0 for n in names])  # (B,)
        out = {}
        for form in ("segments", "stacked"):
            monkeypatch.setattr(nn_lora, "MIXED_LORA", form)
            with torch.no_grad():
                out[form] = shared.run_body(slots, b["input_ids"], b["attention_mask"], b["token_type_ids"])
        mask = b["attention_mask"].bool()
        torch.testing.assert_close(out["segments"][0][mask], out["stacked"][0][mask], atol=1e-6, rtol=0)
        torch.testing.assert_close(out["segments"][1], out["stacked"][1], atol=1e-6, rtol=0)


def test_cost_rule_takes_segments_for_long_runs_and_stacked_for_many_short_ones():
    """Route's choice per layer (MiniLM's width, 8 adapters of rank 8): in fp32 a batch sorted by adapter (a few
    runs of tokens) computes each adapter's rank on its own rows; a pooler's input of one row per run over the 8
    adapters computes the stacked form; in bf16 runs must be longer to take segments."""
    table = nn_lora.AdapterTable({s: {"q": nn_lora.LoraWeights(torch.randn(8, 384), torch.randn(384, 8), 2.0)}
                                  for s in range(1, 9)})
    layer = table.layers["q"]
    route = nn_lora.Route(table, torch.arange(1, 9))  # 8 rows, each its own adapter
    route.tokens = torch.arange(1, 9).repeat_interleave(40)  # (320,): 40 tokens a row, sorted: 8 runs
    plan = route.plan(layer, 320)
    assert isinstance(plan, nn_lora.Segments) and plan.sizes == [40] * 8 and len(plan.runs) == 8
    route = nn_lora.Route(table, torch.arange(1, 9).repeat(8))  # 64 sequences, adapters interleaved
    assert isinstance(route.plan(layer, 64), nn_lora.Plan)  # 64 runs of one row: stacked
    # bf16: a small matmul's fixed cost is ~5x fp32's (RUN_COST), so the same 8 runs of 40 tokens take the stacked
    # form, and only runs long enough to pay for their calls take segments
    half = nn_lora.AdapterTable({s: {"q": nn_lora.LoraWeights(w.A.bfloat16(), w.B.bfloat16(), 2.0)}
                                 for s, layers in table.adapters.items() for w in layers.values()})
    for tokens, form in ((40, nn_lora.Plan), (400, nn_lora.Segments)):
        route = nn_lora.Route(half, torch.arange(1, 9))
        route.tokens = torch.arange(1, 9).repeat_interleave(tokens)  # (8 tokens,): sorted, 8 runs
        assert isinstance(route.plan(half.layers["q"], 8 * tokens), form), tokens


def test_a_mixed_call_sorts_rows_by_adapter_within_each_length(tiny):
    """Pipeline.forward_batch hands the body its rows longest first and, within a length, by adapter: each
    adapter's rows of a length are one run (what the segment form computes per run)."""
    pipe = hfport.pipeline("text-classification", model=tiny["base"], adapters={n: tiny[n] for n in "abc"})
    seen: list[tuple[list[int], list[int]]] = []
    pipe.model.body.encoder.register_forward_pre_hook(
        lambda module, args: seen.append((args[1].adapters.slots.tolist(), module_lengths(args[1]))))
    texts = ["one two", "one two", "three", "one two", "three", "one two"]
    names = ["c", "a", "b", "a", None, "c"]
    pipe(texts, adapter=names, top_k=None)
    (slots, lengths), = seen  # one forward pass
    keys = list(zip([-n for n in lengths], slots))
    assert keys == sorted(keys) and len(set(slots)) == 4 and len(set(lengths)) == 2, (slots, lengths)


def test_the_route_is_an_argument_not_thread_state(tiny):
    """A mixed batch's routing is passed to the body (EncoderBody.forward's `adapters`) and carried by the layout:
    the body run on another thread with the Route given computes each row's adapter, as run_body does here, and a
    call without it on this thread meanwhile is the plain base."""
    from concurrent.futures import ThreadPoolExecutor

    cls = hfport.AutoModelForSequenceClassification
    base = cls.from_pretrained(tiny["base"])
    shared = lora.AdapterSet(base)
    for name in "abc":
        shared.load(name, tiny[name], cls)
    b = batch("bert", lengths=(70, 41, 9, 30))
    slots = torch.tensor([shared.slots["a"], 0, shared.slots["c"], shared.slots["b"]])  # (B,)
    mask = b["attention_mask"].bool()
    with torch.no_grad():
        want, want_pooled = shared.run_body(slots, b["input_ids"], b["attention_mask"], b["token_type_ids"])
        with ThreadPoolExecutor(1) as worker:
            got, got_pooled = worker.submit(lambda: shared.body(**b, adapters=nn_lora.Route(shared.table, slots))
                                            ).result(timeout=120)
        plain, _ = shared.body(**b)
        alone, _ = base.body(**b)  # the base model's own call: slot 0, no route
    torch.testing.assert_close(got[mask], want[mask], atol=0, rtol=0)
    torch.testing.assert_close(got_pooled, want_pooled, atol=0, rtol=0)
    torch.testing.assert_close(plain[mask], alone[mask], atol=0, rtol=0)
    assert (want[0][mask[0]] - plain[0][mask[0]]).abs().max() > 1e-4  # row 0's adapter did change it


def test_a_head_takes_the_body_outputs_as_an_argument(tiny):
    """What a mixed batch hands each adapter's head: `encoder_outputs`, used instead of running the body (which is
    not called), giving the model's own outputs."""
    model = hfport.AutoModelForSequenceClassification.from_pretrained(tiny["a"])
    b = batch("bert", lengths=(41, 9))
    calls = count_body_calls(model.body)
    with torch.no_grad():
        want = model(**b).logits
        outputs = model.body(b["input_ids"], b["attention_mask"], b["token_type_ids"])
        assert len(calls) == 2
        got = model(**b, encoder_outputs=outputs).logits
    assert len(calls) == 2  # the body did not run again
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def module_lengths(layout) -> list[int]:
    keep = getattr(layout, "keep", None)
    return keep.sum(1).tolist() if keep is not None else [layout.positions.shape[-1]] * layout.positions.shape[0]


# --- the real MiniLM: sentence embeddings ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def minilm(tmp_path_factory, minilm_path) -> dict[str, Path]:
    """The real all-MiniLM-L6-v2 (in an allowed dir) and three embedding adapters, two reranker adapters over it."""
    root = tmp_path_factory.mktemp("mixed-minilm")
    base = root / "minilm"
    shutil.copytree(minilm_path, base)
    fe, tc = "feature-extraction", "text-classification"
    return {
        "base": base, "root": root,
        "e1": make_adapter(base, root / "e1", fe, 2, ["q", "v"], 11),
        "e2": make_adapter(base, root / "e2", fe, 4, ["k", "ffn.up"], 12),
        "e3": make_adapter(base, root / "e3", fe, 8, ["q", "o", "ffn.down"], 13),
        "r1": make_adapter(base, root / "r1", tc, 4, ["q", "v"], 14, num_labels=1),
        "r2": make_adapter(base, root / "r2", tc, 2, ["k"], 15, num_labels=1),
    }


def _peft_embeddings(base: Path, folder: Path | None, texts: list[str]) -> torch.Tensor:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(base))
    model = transformers.AutoModel.from_pretrained(str(base))
    model = model if folder is None else peft.PeftModel.from_pretrained(model, str(folder)).get_base_model()
    enc = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model.eval()(**enc).last_hidden_state  # (B, T, C)
    mask = enc["attention_mask"][..., None].float()
    return F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)  # (B, C): mean pooling, as MiniLM


def test_minilm_mixed_embeddings_equal_peft(minilm):
    names = ["e1", None, "e2", "e3", "e1", None]
    pipe = hfport.pipeline("sentence-embedding", model=minilm["base"],
                           adapters={n: minilm[n] for n in ("e1", "e2", "e3")})
    calls = count_body_calls(pipe.model.body)
    got = torch.tensor(pipe(TEXTS, adapter=names, normalize=True))
    assert calls == [len(TEXTS)]
    for name in ("e1", "e2", "e3", None):
        rows = [i for i, n in enumerate(names) if n == name]
        want = _peft_embeddings(minilm["base"], minilm[name] if name else None, [TEXTS[i] for i in rows])
        torch.testing.assert_close(got[rows], want, atol=1e-5, rtol=0)


# --- the server ----------------------------------------------------------------------------------------------------

def _app(tmp_path: Path, minilm: dict, **settings):
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.settings import Settings

    # a 512-token warm-up (the default budget's 16384-token pass takes seconds on MiniLM)
    app = create_app(Settings(data_dir=tmp_path / "data", allowed_dirs=[minilm["root"]], batch_token_budgets=[512],
                              predict_dtype="float32", **settings), run_worker=False)
    return app, TestClient(app)


def _register(c, minilm: dict, names: tuple[str, ...]) -> None:
    assert c.post("/models", json={"name": "minilm", "path": str(minilm["base"])}).status_code == 201
    for name in names:
        r = c.post("/models", json={"name": name, "path": str(minilm[name]), "base": "minilm"})
        assert r.status_code == 201, r.text


def _concurrently(calls: dict) -> dict:
    out: dict = {}
    threads = [threading.Thread(target=lambda k=k, f=f: out.__setitem__(k, f())) for k, f in calls.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_server_mixes_adapters_on_every_route(minilm, tmp_path):
    app, client = _app(tmp_path, minilm, batch_max_wait_ms=300)
    texts = TEXTS[:3]
    with client as c:
        _register(c, minilm, ("e1", "e2", "e3", "r1", "r2"))
        models = ("e1", "e2", "e3", "minilm")
        for model in models:  # load each first, so the timed round below is only batching
            assert c.post("/embed", json={"inputs": "x"}, headers={"x-model": model}).status_code == 200
        calls = {("embed", m): lambda m=m: c.post("/embed", json={"inputs": texts}, headers={"x-model": m})
                 for m in models}
        calls |= {("openai", m): lambda m=m: c.post("/v1/embeddings", json={"input": texts, "model": m})
                  for m in models}
        calls |= {("root", m): lambda m=m: c.post("/", json={"inputs": texts}, headers={"x-model": m})
                  for m in models}
        calls |= {("rerank", m): lambda m=m: c.post("/rerank", json={"query": "what", "texts": texts,
                                                                     "raw_scores": True}, headers={"x-model": m})
                  for m in ("r1", "r2")}
        calls |= {("predict", m): lambda m=m: c.post("/predict", json={"model": m, "inputs": texts, "parameters": {
            "top_k": None, "function_to_apply": "none"}}) for m in ("r1", "r2")}
        answers = _concurrently(calls)
        metrics = c.get("/metrics").text
    for key, r in answers.items():
        assert r.status_code == 200, (key, r.text)
    for model in models:
        folder = None if model == "minilm" else minilm[model]
        want = _peft_embeddings(minilm["base"], folder, texts)
        torch.testing.assert_close(torch.tensor(answers["embed", model].json()), want, atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(answers["root", model].json()), want, atol=1e-5, rtol=0)
        openai = [d["embedding"] for d in answers["openai", model].json()["data"]]
        torch.testing.assert_close(torch.tensor(openai), want, atol=1e-5, rtol=0)
    for model in ("r1", "r2"):
        alone = hfport.pipeline("text-classification", model=minilm[model])
        want = [s[0]["score"] for s in alone([{"text": "what", "text_pair": t} for t in texts], top_k=None,
                                             function_to_apply="none")]
        ranks = {r["index"]: r["score"] for r in answers["rerank", model].json()}
        assert [ranks[i] for i in range(len(texts))] == pytest.approx(want, abs=1e-5)
        scores = [o[0]["score"] for o in answers["predict", model].json()["outputs"]]
        want = [s[0]["score"] for s in alone(texts, top_k=None, function_to_apply="none")]
        assert scores == pytest.approx(want, abs=1e-5)
    # some merged batch held more than one adapter: the histogram's sum exceeds its count
    total = {k: float(v) for k, v in re.findall(r'^hfport_batch_adapters_(sum|count)\{model="minilm"\} (\S+)$',
                                                metrics, re.M)}
    assert total["sum"] > total["count"], metrics


def test_register_and_remove_while_serving_never_reload_the_base(minilm, tmp_path):
    app, client = _app(tmp_path, minilm, batch_max_wait_ms=5)
    with client as c:
        _register(c, minilm, ("e1",))
        assert c.post("/embed", json={"inputs": TEXTS}, headers={"x-model": "e1"}).status_code == 200
        shared = app.state.model_service.cache.adapter_set(str(minilm["base"]))
        base, body = shared.base, shared.body
        stop, codes = threading.Event(), []

        def serve() -> None:  # the base and an adapter keep answering while others come and go
            while not stop.is_set():
                for model in ("minilm", "e1"):
                    codes.append(c.post("/embed", json={"inputs": TEXTS[:2]}, headers={"x-model": model}).status_code)

        worker = threading.Thread(target=serve)
        worker.start()
        try:
            for round_ in range(2):
                for name in ("e2", "e3"):
                    r = c.post("/models", json={"name": name, "path": str(minilm[name]), "base": "minilm"})
                    assert r.status_code == 201, r.text
                    r = c.post("/embed", json={"inputs": TEXTS[:2]}, headers={"x-model": name})
                    assert r.status_code == 200, r.text
                    assert c.delete(f"/models/{name}").status_code == 200
        finally:
            stop.set()
            worker.join()
        assert codes and set(codes) == {200}, codes
        assert shared.base is base and shared.body is body  # never reloaded
        assert app.state.model_service.cache.adapter_set(str(minilm["base"])) is shared
        assert sorted(shared.slots) == ["e1"]  # the removed adapters left the table
        want = _peft_embeddings(minilm["base"], minilm["e1"], TEXTS[:2])
        got = c.post("/embed", json={"inputs": TEXTS[:2]}, headers={"x-model": "e1"}).json()
        torch.testing.assert_close(torch.tensor(got), want, atol=1e-5, rtol=0)


def test_an_adapter_over_another_base_is_never_mixed(minilm, tmp_path):
    other = minilm["root"] / "other-base"
    if not other.exists():
        shutil.copytree(minilm["base"], other)
    over_other = minilm["root"] / "e1-other"
    if not over_other.exists():
        shutil.copytree(minilm["e1"], over_other)  # e1 itself, registered over a copy of its base
    app, client = _app(tmp_path, minilm, batch_max_wait_ms=200)
    with client as c:
        _register(c, minilm, ("e1",))
        assert c.post("/models", json={"name": "other", "path": str(other)}).status_code == 201
        r = c.post("/models", json={"name": "e1-other", "path": str(over_other), "base": "other"})
        assert r.status_code == 201, r.text
        answers = _concurrently({m: lambda m=m: c.post("/embed", json={"inputs": TEXTS}, headers={"x-model": m})
                                 for m in ("e1", "e1-other")})
        service = app.state.model_service
        leaders = {id(b.pipe) for b in service._batchers.values()}
        assert len(leaders) == 2  # one batcher per base: rows over different bases never share a pass
        sets = [service.cache.adapter_set(str(f)) for f in (minilm["base"], other)]
        assert sets[0] is not sets[1] and sets[0].body is not sets[1].body
    assert answers["e1"].status_code == answers["e1-other"].status_code == 200
    torch.testing.assert_close(torch.tensor(answers["e1"].json()), torch.tensor(answers["e1-other"].json()),
                               atol=1e-5, rtol=0)


def test_unknown_target_module_is_a_tei_error(minilm, tmp_path):
    folder = minilm["root"] / "bad-targets"
    if not folder.exists():
        shutil.copytree(minilm["e1"], folder)
        config = json.loads((folder / "adapter_config.json").read_text())
        config["target_modules"] = [*config["target_modules"], "Wqkv"]
        (folder / "adapter_config.json").write_text(json.dumps(config))
    app, client = _app(tmp_path, minilm)
    with client as c:
        _register(c, minilm, ())
        assert c.post("/models", json={"name": "bad", "path": str(folder), "base": "minilm"}).status_code == 201
        r = c.post("/embed", json={"inputs": TEXTS}, headers={"x-model": "bad"})
        ok = c.post("/embed", json={"inputs": TEXTS}, headers={"x-model": "minilm"})
    assert r.status_code == 424, r.text
    body = r.json()
    assert body["error_type"] == "Backend" and "adapter 'bad'" in body["error"] and "'Wqkv'" in body["error"]
    assert ok.status_code == 200  # the base serves on


def test_model_cache_counts_a_base_and_its_adapters_as_one_model(tiny, tmp_path, monkeypatch):
    """Adapters over one base stay loaded while the group fits model_cache_mb (each loaded once: a cache that evicted
    them one by one reloaded an adapter on nearly every request of a round-robin load); another model of the base's
    size evicts the whole group."""
    import asyncio

    from server.serving import ModelRecord, ModelService, weight_bytes
    from server.settings import Settings

    loads: list[str] = []
    load = lora.AdapterSet.load
    monkeypatch.setattr(lora.AdapterSet, "load", lambda self, name, *a: loads.append(name) or load(self, name, *a))
    task, base = "text-classification", str(tiny["base"])
    records = [ModelRecord("base", base, task)] + [ModelRecord(n, str(tiny[n]), task, base=base) for n in "abc"]
    other = shutil.copytree(tiny["base"], tmp_path / "other")

    async def serve(service: ModelService) -> None:
        for _ in range(3):
            for record in records:
                out = await service.predict(record, ["some text"], {})
                assert "error" not in out[0], out
        assert loads == ["a", "b", "c"]  # each adapter loaded once
        assert [r.name for r in service.cache.records()] == ["base", "a", "b", "c"]
        await service.predict(ModelRecord("other", str(other), task), ["some text"], {})
        assert [r.name for r in service.cache.records()] == ["other"]  # the group went together

    # the models' folders are allowed dirs: the cache reads only files inside them
    one = weight_bytes(hfport.pipeline(task, model=base, dtype=Settings().predict_dtype))  # as the service loads it
    service = ModelService(Settings(data_dir=tmp_path / "d", allowed_dirs=[tiny["base"].parent, tmp_path],
                                    model_cache_mb=1.5 * one / 2**20, batch_token_budgets=[512]))
    try:
        asyncio.run(serve(service))
    finally:
        service.close()
