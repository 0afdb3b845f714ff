"""The int8 gate's kept verdicts (hfport/int8_verdicts.py): a second dtype="int8" load of the very same model reuses
the first one's verdict and calibration without judging (counted: the gate's judging calls, never time) and gives the
same int8 model; another weight, head, judged set or rule, or other code or another machine, misses it; a file not to
trust (corrupt, another key's, a value out of range, a calibration that does not give its spot statistic again) is
ignored, logged and rewritten; a kept refusal is reused as a refusal; a cache dir that cannot be written costs only
the reuse. Every test starts from an empty cache (conftest's fresh_verdicts)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import hfport
import hfport.int8
from hfport import agreement, hardware, int8_verdicts, probes
from hfport.int8 import Int8GateError, quantize_loaded
from hfport.nn import int8 as int8_nn
from hfport.nn.int8 import Int8Linear, body_linears
from tests.tiny import TOKENIZER_FILES, build_hf

# the encoder's Linear weights drawn this wide: at the init's 0.02 a tiny model's output is mostly its embeddings',
# where a damaged calibration hardly shows (measured: every static range 100x too narrow still gave a min cosine of
# 1.0000 against fp32); drawn at 0.2 the gate's least cosine is 0.9996, the spot batch's with every range 4x too
# narrow 0.74, and 3 quantization levels are refused
WIDE = 0.2


@pytest.fixture(scope="module")
def folder(tmp_path_factory, minilm_path) -> Path:
    """A tiny BERT (MiniLM's tokenizer) that int8 keeps, its encoder drawn WIDE."""
    model = build_hf("bert", "base", vocab_size=30522, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("encoder.") and p.dim() == 2:
                p.normal_(0.0, WIDE)
    out = tmp_path_factory.mktemp("wide") / "model"
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copy(minilm_path / name, out / name)
    return out


@pytest.fixture
def judged(monkeypatch) -> list[str]:
    """The gate's judging calls (hfport/int8.py's _judge: once per granularity tried), counted."""
    calls: list[str] = []
    real = hfport.int8._judge
    monkeypatch.setattr(hfport.int8, "_judge", lambda model, folder, *a: calls.append(str(folder)) or
                        real(model, folder, *a))
    return calls


def _kept(cache: Path) -> list[Path]:
    return sorted((cache / "int8").glob("*.json"))


def _groups(model) -> dict[str, str]:
    """Each int8 layer -> the first layer reading its input (SharedInput), or itself."""
    layers = {n: m for n, m in model.named_modules() if isinstance(m, Int8Linear)}
    first = {}
    return {n: first.setdefault(id(m.shared) if m.shared is not None else n, n) for n, m in layers.items()}


def _same_model(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert [(n, m.activations) for n, m in a.named_modules() if isinstance(m, Int8Linear)] == \
        [(n, m.activations) for n, m in b.named_modules() if isinstance(m, Int8Linear)]
    assert _groups(a) == _groups(b)
    ids = torch.randint(3, 30000, (4, 100))  # 400 rows: past min_rows, int8 runs
    with torch.inference_mode():
        assert torch.equal(a(ids).last_hidden_state, b(ids).last_hidden_state)


@pytest.fixture(scope="module")
def good(folder, hfport_cache) -> tuple[str, str]:
    """(file name, text) of the verdict the gate keeps for `folder` (judged once, in the session's cache), for the
    tests that start from a kept verdict: they copy it into their empty cache (`keep`)."""
    hfport.settings.use(cache_dir=hfport_cache)
    try:
        model = hfport.AutoModel.from_pretrained(folder)
        key = int8_verdicts.key(model, folder, [probes.GateData.builtin()], "mean", hfport.int8.granularities(),
                                hfport.int8.float_dtype(model))
        quantize_loaded(model, folder)
    finally:
        hfport.settings.reset()
    path = hfport_cache / "int8" / int8_verdicts.path_for(key).name
    return path.name, path.read_text()


def keep(cache: Path, good: tuple[str, str], text: str | None = None) -> Path:
    """GOOD's verdict (or TEXT in its place) kept in CACHE."""
    path = cache / "int8" / good[0]
    path.parent.mkdir(exist_ok=True)
    path.write_text(good[1] if text is None else text)
    return path


def test_a_second_load_reuses_the_verdict(folder, fresh_verdicts, judged, caplog):
    caplog.set_level("INFO", logger="hfport")
    first = hfport.AutoModel.from_pretrained(folder, dtype="int8")
    assert judged == [str(folder)] and "verdict reused" not in caplog.text
    [kept] = _kept(fresh_verdicts)
    assert json.loads(kept.read_text())["verdict"]["activations"] == "static"

    second = hfport.AutoModel.from_pretrained(folder, dtype="int8")
    assert judged == [str(folder)]  # not judged again
    assert f"int8 gate: verdict reused from {kept}" in caplog.text
    assert second.int8_gate == first.int8_gate and all(r.passed for r in second.int8_gate)
    assert second.load_report.notes[-1] == f"{first.load_report.notes[-1]} (verdict reused from {kept})"
    assert {m.activations for m in second.modules() if isinstance(m, Int8Linear)} == {"static"}
    _same_model(first, second)

    # min_rows is no part of the verdict: another one reuses it, and is the one applied
    third = quantize_loaded(hfport.AutoModel.from_pretrained(folder), folder, min_rows=7)
    assert judged == [str(folder)] and _kept(fresh_verdicts) == [kept]
    assert {m.float_below_rows for m in third.modules() if isinstance(m, Int8Linear)} == {7}


def _moved_weight(folder: Path, out: Path) -> Path:
    shutil.copytree(folder, out)
    weights = load_file(out / "model.safetensors")
    name = next(k for k in sorted(weights) if k.endswith("intermediate.dense.weight"))
    weights[name][0, 0] += 1e-3
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_a_changed_weight_or_gate_data_misses_the_verdict(folder, good, fresh_verdicts, judged, tmp_path):
    keep(fresh_verdicts, good)
    hfport.AutoModel.from_pretrained(folder, dtype="int8")
    assert judged == []  # the kept one
    moved = _moved_weight(folder, tmp_path / "moved")
    hfport.AutoModel.from_pretrained(moved, dtype="int8")
    assert judged == [str(moved)] and len(_kept(fresh_verdicts)) == 2  # judged, and kept beside the first
    data = tmp_path / "gate.txt"
    data.write_text("\n".join(t.upper() for t in probes.judged_texts()) + "\n")
    model = hfport.AutoModel.from_pretrained(folder, dtype="int8", gate_data=data)
    assert judged == [str(moved), str(folder)] and len(_kept(fresh_verdicts)) == 3
    assert [r.data for r in model.int8_gate if r.data == str(data)] == [str(data)]
    hfport.AutoModel.from_pretrained(folder, dtype="int8")
    assert len(judged) == 2  # the first still reused


def _other_tokenizer(folder: Path, tmp_path: Path) -> Path:
    shutil.copytree(folder, tmp_path / "other")
    config = tmp_path / "other" / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_max_length": 64}))
    return tmp_path / "other"


# what the verdict depends on -> a change of it, as (monkeypatch, folder, tmp_path) -> the key's arguments changed
KEYED = {
    "the weights": lambda mp, folder, tmp_path: {"model": hfport.AutoModel.from_pretrained(
        _moved_weight(folder, tmp_path / "moved"))},
    "the head": lambda mp, folder, tmp_path: {"model": hfport.AutoModelForTokenClassification.from_pretrained(
        folder, num_labels=3)},
    "the tokenizer files": lambda mp, folder, tmp_path: {"folder": _other_tokenizer(folder, tmp_path)},
    "the pooling": lambda mp, folder, tmp_path: {"pooling": "cls"},
    "the user's gate data": lambda mp, folder, tmp_path: {"datasets": [probes.GateData.builtin(), probes.GateData(
        probes.judged_texts(), origin="user")]},
    "the built-in judged set": lambda mp, folder, tmp_path: mp.setattr(probes, "GATE_MAX_LENGTH", 100),
    "the calibration texts": lambda mp, folder, tmp_path: mp.setattr(probes, "CALIBRATION_TEXTS", ["Hello."]),
    "a threshold": lambda mp, folder, tmp_path: mp.setattr(agreement, "MIN_COSINE", 0.97),
    "the outlier rule": lambda mp, folder, tmp_path: mp.setattr(int8_nn, "OUTLIER_RATIO", 6.0),
    "the quantizer's levels": lambda mp, folder, tmp_path: mp.setattr(int8_nn, "QMAX", 100),
    "the granularities": lambda mp, folder, tmp_path: {"granularities": ("tensor", "token")},
    "the float parts' dtype": lambda mp, folder, tmp_path: {"float_dtype": torch.float32},
    "hfport's version": lambda mp, folder, tmp_path: mp.setattr(int8_verdicts, "__version__", "0.0.1"),
    "hfport's code": lambda mp, folder, tmp_path: mp.setattr(int8_verdicts, "code_digest", lambda: "0" * 64),
    "torch's version": lambda mp, folder, tmp_path: mp.setattr(torch, "__version__", "2.6.0"),
    "the CPU's int8 instructions": lambda mp, folder, tmp_path: mp.setattr(hardware, "int8_isa", lambda: "DEFAULT"),
    "the CPU": lambda mp, folder, tmp_path: mp.setattr(hardware, "cpu_name", lambda: "another CPU"),
}


@pytest.mark.parametrize("what", list(KEYED))
def test_the_key_names_what_the_verdict_depends_on(what, folder, tmp_path, monkeypatch):
    args = {"model": hfport.AutoModel.from_pretrained(folder), "folder": folder,
            "datasets": [probes.GateData.builtin()], "pooling": "mean",
            "granularities": hfport.int8.granularities(), "float_dtype": torch.bfloat16}
    key = int8_verdicts.key(**args)
    assert int8_verdicts.key(**args) == key == json.loads(json.dumps(key))  # stable, and as it reads back
    with monkeypatch.context() as patch:
        changed = KEYED[what](patch, folder, tmp_path) or {}
        other = int8_verdicts.key(**{**args, **changed, "datasets": changed.get("datasets", [
            probes.GateData.builtin()])})
    assert other != key and int8_verdicts.path_for(other) != int8_verdicts.path_for(key)


def _first_layer(raw: dict) -> dict:
    return next(iter(raw["verdict"]["plan"].values()))


UNTRUSTED = {  # how a kept file goes bad -> (its edit, the warning's reason)
    "not JSON": (lambda raw: None, "not JSON: "),
    "another key's": (lambda raw: raw["key"].update(weights="0" * 64), "made for another key"),
    "no verdict": (lambda raw: raw.pop("verdict"), "no verdict"),
    "an unknown granularity": (lambda raw: raw["verdict"].update(activations="channel"), "activations 'channel'"),
    "a result without a field": (lambda raw: raw["verdict"]["results"][0].pop("bound"), "results[0]: expected"),
    "a pass with a failed set": (lambda raw: raw["verdict"]["results"][0].update(passed=False), "a failed set"),
    "a layer the model lacks": (lambda raw: raw["verdict"]["plan"].update(nope=_first_layer(raw)), "not the model's"),
    "a channel past the layer's width": (lambda raw: _first_layer(raw).update(outliers=[10 ** 6]), "outliers"),
    "a range that is not finite": (lambda raw: _first_layer(raw).update(input_range=[float("-inf"), 1.0]),
                                   "not a finite number"),
    "a range without 0": (lambda raw: _first_layer(raw).update(input_range=[0.5, 1.0]), "does not hold 0"),
    "a shared input of no layer": (lambda raw: _first_layer(raw).update(shares_input_with="nope"), "is no layer"),
    "no spot statistic": (lambda raw: raw["verdict"].update(spot=None), "spot: None"),
}


@pytest.mark.parametrize("case", list(UNTRUSTED))
def test_an_entry_not_to_trust_is_ignored(case, folder, good, fresh_verdicts, caplog):
    edit, reason = UNTRUSTED[case]
    raw = json.loads(good[1])
    edit(raw)
    path = keep(fresh_verdicts, good, good[1][:len(good[1]) // 2] if case == "not JSON" else json.dumps(raw))
    model = hfport.AutoModel.from_pretrained(folder)
    key = int8_verdicts.key(model, folder, [probes.GateData.builtin()], "mean", hfport.int8.granularities(),
                            hfport.int8.float_dtype(model))
    assert int8_verdicts.path_for(key) == path
    assert int8_verdicts.read(key, body_linears(model.body.encoder)) is None
    warning = next(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert warning.startswith(f"int8 gate: {path} ignored (") and reason in warning, warning
    keep(fresh_verdicts, good)
    assert int8_verdicts.read(key, body_linears(model.body.encoder)) is not None  # the good one is read


def test_an_ignored_entry_is_rewritten_and_then_reused(folder, good, fresh_verdicts, judged, caplog):
    path = keep(fresh_verdicts, good, "{")
    caplog.set_level("INFO", logger="hfport")
    hfport.AutoModel.from_pretrained(folder, dtype="int8")
    assert judged == [str(folder)] and f"int8 gate: {path} ignored (not JSON" in caplog.text
    assert json.loads(path.read_text()) == json.loads(good[1])  # rewritten
    hfport.AutoModel.from_pretrained(folder, dtype="int8")
    assert judged == [str(folder)] and f"int8 gate: verdict reused from {path}" in caplog.text


def test_a_calibration_that_does_not_hold_is_judged_again(folder, good, fresh_verdicts, judged, caplog):
    """A kept pass whose calibration, tried, does not give its spot statistic again (every static range 4x too
    narrow here: a file that parses and checks out) is ignored; the model it was tried on is put back as loaded
    (fp32) before the gate judges it."""
    raw = json.loads(good[1])
    for layer in raw["verdict"]["plan"].values():
        if layer["input_range"] is not None:
            layer["input_range"] = [v / 4 for v in layer["input_range"]]
    path = keep(fresh_verdicts, good, json.dumps(raw))
    caplog.set_level("INFO", logger="hfport")
    judged_again = hfport.AutoModel.from_pretrained(folder, dtype="int8")
    assert judged == [str(folder)]
    assert f"int8 gate: {path} ignored (its min cosine on the spot batch is " in caplog.text
    assert json.loads(path.read_text()) == json.loads(good[1])  # rewritten
    reused = hfport.AutoModel.from_pretrained(folder, dtype="int8")
    assert judged == [str(folder)] and f"int8 gate: verdict reused from {path}" in caplog.text
    _same_model(judged_again, reused)


def test_a_kept_refusal_is_reused(folder, fresh_verdicts, judged, monkeypatch, caplog):
    monkeypatch.setattr(int8_nn, "QMAX", 3)  # a broken quantizer: every granularity refused
    with pytest.raises(Int8GateError) as first:
        hfport.AutoModel.from_pretrained(folder, dtype="int8")
    assert len(judged) == len(hfport.int8.granularities())
    [kept] = _kept(fresh_verdicts)
    with pytest.raises(Int8GateError) as again:
        hfport.AutoModel.from_pretrained(folder, dtype="int8")
    reused = f" (verdict reused from {kept})"
    assert str(again.value) == str(first.value).replace(". Load with", f"{reused}. Load with")
    caplog.set_level("INFO", logger="hfport")
    model = hfport.AutoModel.from_pretrained(folder, dtype="auto-int8")
    assert model.dtype == torch.bfloat16 and not any(isinstance(m, Int8Linear) for m in model.modules())
    assert model.load_report.notes[-1].startswith("auto-int8 chose bf16: the int8 gate refused: activations at")
    assert model.load_report.notes[-1].endswith(reused) and not any(r.passed for r in model.int8_gate)
    assert len(judged) == len(hfport.int8.granularities())  # neither load judged again
    assert f"int8 gate: verdict reused from {kept}" in caplog.text


def test_a_cache_dir_that_cannot_be_written_costs_only_the_reuse(folder, tmp_path, judged, caplog):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    hfport.settings.use(cache_dir=blocker / "cache")  # conftest resets the settings after the test
    model = hfport.AutoModel.from_pretrained(folder, dtype="int8")
    assert any(isinstance(m, Int8Linear) for m in model.modules()) and judged == [str(folder)]
    assert "int8 gate: could not keep its verdict in" in caplog.text
