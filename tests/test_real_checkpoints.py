"""Checkpoints as they are published, not as save_pretrained writes them today: extra heads' weights beside the
task's own, a custom `architectures` class name, and weights only in pickled pytorch_model.bin files (single or
sharded), which `hfport convert` turns into safetensors on request and no loading path ever reads.

The checkpoint is a tiny seeded BertForMaskedLM built here with transformers, plus three extra heads' tensors."""

from __future__ import annotations

import json
import logging
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from torch.testing import assert_close
from typer.testing import CliRunner

import hfport
from hfport.cli import app
from tests import tiny

PARITY = dict(rtol=1e-5, atol=1e-5)  # hfport's forward vs transformers' on the same weights, float32
EXACT = dict(rtol=0.0, atol=0.0)
EXTRA = {  # three heads a published checkpoint carried besides its MLM head; no hfport or transformers class uses them
    "cls.chain.weight": (5, 32), "cls.chain.bias": (5,),
    "cls.graft.weight": (2, 32), "cls.graft.bias": (2,),
    "cls.species.weight": (7, 32), "cls.species.bias": (7,),
}
CUSTOM_ARCH = "MyBertForEverything"
TIED = {"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",  # transformers' _tied_weights_keys
        "cls.predictions.decoder.bias": "cls.predictions.bias"}
OTHER_FILES = {"vocab.txt": "[PAD]\n[UNK]\n", "special_tokens_map.json": '{"unk_token": "[UNK]"}',
               "README.md": "# a model\n"}
MLM = hfport.AutoModelForMaskedLM
SEQ = hfport.AutoModelForSequenceClassification


class _WritesMarker:
    """Unpickling this object calls open(marker, 'w'): proof of whether a pickle was run."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _extra_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {k: torch.randn(shape, generator=g) for k, shape in EXTRA.items()}


def _set_architectures(folder: Path, architectures: list[str]) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": architectures}))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> dict[str, Path]:
    """Read-only folders of one checkpoint: safetensors, pytorch_model.bin only, and .bin in two shards + index.
    The .bin state dict is the model's own (tied weights share storage, as torch.save keeps them) + extras."""
    root = tmp_path_factory.mktemp("real")
    model = tiny.build_hf("bert", "masked-lm", num_hidden_layers=3)
    safe = root / "safe"
    model.save_pretrained(safe)
    state = load_file(str(safe / "model.safetensors"))
    save_file({**state, **_extra_tensors()}, str(safe / "model.safetensors"), metadata={"format": "pt"})
    _set_architectures(safe, [CUSTOM_ARCH])

    full = {**model.state_dict(), **_extra_tensors()}
    assert full["cls.predictions.decoder.weight"].data_ptr() == full["bert.embeddings.word_embeddings.weight"].data_ptr()
    pickled = root / "bin"
    pickled.mkdir()
    shutil.copy(safe / "config.json", pickled)
    for name, text in OTHER_FILES.items():
        (pickled / name).write_text(text)
    torch.save(full, pickled / "pytorch_model.bin")
    (pickled / "training_args.bin").write_bytes(pickle.dumps({"lr": 1e-3}))  # a pickle convert must not copy

    sharded = root / "bin-sharded"
    sharded.mkdir()
    shutil.copy(safe / "config.json", sharded)
    names = list(full)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]  # embeddings in one, the decoder in the other
    weight_map = {}
    for i, part in enumerate(halves):
        shard = f"pytorch_model-0000{i + 1}-of-00002.bin"
        torch.save({k: full[k] for k in part}, sharded / shard)
        weight_map.update(dict.fromkeys(part, shard))
    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return {"safe": safe, "bin": pickled, "sharded": sharded}


def _batch() -> dict[str, torch.Tensor]:
    return tiny.batch("bert", lengths=(33, 20, 7))  # padded, with token types


def _assert_real_close(ours: torch.Tensor, theirs: torch.Tensor, mask: torch.Tensor, **tol) -> None:
    real = mask.bool()
    assert_close(ours[real], theirs[real], **tol)


def _same_report(folder: Path, ours_cls, theirs_cls) -> None:
    """hfport's LoadReport says what transformers' loading info says, for the same folder and task."""
    theirs, info = theirs_cls.from_pretrained(folder, output_loading_info=True)
    ours = ours_cls.from_pretrained(folder)
    hf = ours.hf_names()
    assert set(ours.load_report.unexpected) == set(info["unexpected_keys"]), (ours.load_report.summary(), info)
    assert {hf[n] for n in ours.load_report.initialized} == set(info["missing_keys"]), (ours.load_report.summary(),
                                                                                         info)
    assert not ours.load_report.mismatched and not info["mismatched_keys"]


def _convert(src: Path, out: Path, *extra: str):
    return CliRunner().invoke(app, ["convert", str(src), "--out", str(out), *extra])


# --- (a) extra heads' keys load as unused ---------------------------------------------------------------------


def test_extra_heads_are_unused_and_logits_match(ckpt, caplog):
    with caplog.at_level(logging.WARNING, logger="hfport"):
        ours = MLM.from_pretrained(ckpt["safe"])
    report = ours.load_report
    assert sorted(report.unexpected) == sorted(EXTRA), report.summary()
    assert not report.initialized and not report.mismatched
    warned = [r.getMessage() for r in caplog.records if "unused checkpoint keys" in r.getMessage()]
    assert len(warned) == 1 and all(k in warned[0] for k in EXTRA), caplog.text
    assert all(k in report.summary() for k in EXTRA)

    theirs, info = transformers.AutoModelForMaskedLM.from_pretrained(ckpt["safe"], output_loading_info=True)
    assert set(info["unexpected_keys"]) == set(EXTRA) and not info["missing_keys"]
    inputs = _batch()
    with torch.no_grad():
        got = ours(**inputs).logits  # (B, T, V)
        want = theirs.eval()(**inputs).logits
    _assert_real_close(got, want, inputs["attention_mask"], **PARITY)
    _same_report(ckpt["safe"], MLM, transformers.AutoModelForMaskedLM)
    _same_report(ckpt["safe"], SEQ, transformers.AutoModelForSequenceClassification)


# --- (b) an unknown key inside what the model computes is still an error -------------------------------------


@pytest.mark.parametrize("key, shape", [
    ("bert.encoder.layer.0.attention.self.extra.weight", (32, 32)),
    ("bert.embeddings.foo", (4,)),
    ("cls.predictions.transform.extra.weight", (32,)),  # inside the MLM head this model computes
])
def test_unknown_key_inside_is_refused(ckpt, tmp_path, key, shape):
    folder = shutil.copytree(ckpt["safe"], tmp_path / "m")
    state = load_file(str(folder / "model.safetensors"))
    save_file({**state, key: torch.zeros(shape)}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(hfport.CheckpointError) as e:
        MLM.from_pretrained(folder)
    msg = str(e.value)
    assert str(folder) in msg and key in msg and "not in the bert key map" in msg, msg
    assert not any(k in msg for k in EXTRA), msg  # the extra heads are not what is wrong


def test_inside_depends_on_what_the_task_computes(ckpt, tmp_path):
    """The pooler is part of the base model, not of the MLM model; the MLM head is part of neither base nor
    sequence classification. An unknown key under a part the task does not build is unused, as in transformers."""
    folder = shutil.copytree(ckpt["safe"], tmp_path / "m")
    state = load_file(str(folder / "model.safetensors"))
    extra = {"bert.pooler.extra.weight": torch.zeros(3), "cls.predictions.transform.extra.weight": torch.zeros(3)}
    save_file({**state, **extra}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    pooler_key, head_key = extra
    with pytest.raises(hfport.CheckpointError, match="cls.predictions.transform.extra.weight"):
        MLM.from_pretrained(folder)
    for cls in (hfport.AutoModel, SEQ):  # both build the pooler
        with pytest.raises(hfport.CheckpointError) as e:
            cls.from_pretrained(folder)
        assert pooler_key in str(e.value) and head_key not in str(e.value), str(e.value)
    save_file({**state, head_key: torch.zeros(3)}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert head_key in SEQ.from_pretrained(folder).load_report.unexpected
    save_file({**state, pooler_key: torch.zeros(3)}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert pooler_key in MLM.from_pretrained(folder).load_report.unexpected


# --- (c) pickle-only folders are refused, pointing to `hfport convert` ----------------------------------------


def test_bin_only_folders_are_refused_naming_convert(ckpt, tmp_path, monkeypatch):
    def no_unpickling(*args, **kwargs):
        raise AssertionError("a loading path called torch.load")

    monkeypatch.setattr(torch, "load", no_unpickling)
    for name in ("bin", "sharded"):
        for load in (MLM.from_pretrained, hfport.AutoModel.from_pretrained, hfport.load_any):
            with pytest.raises(hfport.CheckpointError) as e:
                load(ckpt[name])
            msg = str(e.value)
            assert str(ckpt[name]) in msg and "hfport convert" in msg and "never unpickles" in msg, msg
            assert "use_safetensors=False" not in msg  # the old, lossy advice


# --- (d) hfport convert keeps every tensor; the result loads the same way in both libraries ---------------------


def test_convert_single_bin_keeps_every_tensor(ckpt, tmp_path):
    out = tmp_path / "out"
    result = _convert(ckpt["bin"], out)
    assert result.exit_code == 0, result.output
    source = torch.load(ckpt["bin"] / "pytorch_model.bin", weights_only=True)
    written = load_file(str(out / "model.safetensors"))
    assert set(source) - set(written) == set(TIED) and set(written) <= set(source)  # exactly the tied aliases
    assert len(written) == len(source) - len(TIED)
    for key, tensor in written.items():
        assert_close(tensor, source[key], **EXACT)
    for alias, kept in TIED.items():
        assert f"{alias} -> {kept}" in result.output
    # the same names transformers' own save_pretrained wrote for this model
    assert set(written) == set(load_file(str(ckpt["safe"] / "model.safetensors")))
    assert json.loads((out / "config.json").read_text()) == json.loads((ckpt["bin"] / "config.json").read_text())
    for name, text in OTHER_FILES.items():
        assert (out / name).read_text() == text
    assert not (out / "training_args.bin").exists() and not (out / "pytorch_model.bin").exists()
    assert "training_args.bin" in result.output  # named as not copied
    assert not list(tmp_path.glob(".out.*"))  # no staging folder left

    _same_report(out, MLM, transformers.AutoModelForMaskedLM)
    _same_report(out, SEQ, transformers.AutoModelForSequenceClassification)
    ours = MLM.from_pretrained(out)
    theirs = transformers.AutoModelForMaskedLM.from_pretrained(out).eval()
    inputs = _batch()
    with torch.no_grad():
        _assert_real_close(ours(**inputs).logits, theirs(**inputs).logits, inputs["attention_mask"], **PARITY)
        reference = MLM.from_pretrained(ckpt["safe"])(**inputs).logits
    assert_close(ours(**inputs).logits.detach(), reference, **EXACT)  # the same weights as the safetensors copy


def test_convert_sharded_bin(ckpt, tmp_path):
    out = tmp_path / "out"
    result = _convert(ckpt["sharded"], out, "--max-shard-size", "20KB")
    assert result.exit_code == 0, result.output
    source = {}
    for shard in sorted(ckpt["sharded"].glob("pytorch_model-*.bin")):
        source.update(torch.load(shard, weights_only=True))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (out / "model.safetensors").exists()
    written = {}
    for shard in shards:
        written.update(load_file(str(out / shard)))
    # the decoder weight sits in another shard than the embeddings: a separate copy, not shared storage, so kept;
    # its bias alias shares storage with cls.predictions.bias in the same shard and is written once
    assert set(source) - set(written) == {"cls.predictions.decoder.bias"} and set(written) <= set(source)
    for key, tensor in written.items():
        assert_close(tensor, source[key], **EXACT)
    _same_report(out, MLM, transformers.AutoModelForMaskedLM)
    inputs = _batch()
    with torch.no_grad():
        reference = MLM.from_pretrained(ckpt["safe"])(**inputs).logits
        assert_close(MLM.from_pretrained(out)(**inputs).logits, reference, **EXACT)


def test_convert_refuses_a_non_empty_out_and_a_safetensors_folder(ckpt, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = _convert(ckpt["bin"], out)
    assert result.exit_code != 0 and "not empty" in result.output and "--overwrite" in result.output
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert _convert(ckpt["bin"], out, "--overwrite").exit_code == 0 and (out / "model.safetensors").is_file()
    result = _convert(ckpt["safe"], tmp_path / "again")
    assert result.exit_code != 0 and "already holds safetensors" in result.output
    assert not (tmp_path / "again").exists()


# --- (e) an unknown architectures name falls back to the base model, saying so -------------------------------


def test_load_any_custom_architecture_falls_back_to_base(ckpt, caplog):
    with caplog.at_level(logging.WARNING, logger="hfport"):
        model = hfport.load_any(ckpt["safe"])
    assert model.task == "feature-extraction" and isinstance(model, hfport.EncoderModel)
    notes = model.load_report.notes
    assert len(notes) == 1 and CUSTOM_ARCH in notes[0] and "base model" in notes[0], notes
    assert "AutoModelForMaskedLM" not in notes[0] and "AutoModelFor<Task>" in notes[0]
    assert any(CUSTOM_ARCH in r.getMessage() for r in caplog.records), caplog.text
    assert CUSTOM_ARCH in model.load_report.summary()
    # the head comes from what the caller asks for; the custom name never blocks it
    assert MLM.from_pretrained(ckpt["safe"]).load_report.notes == []


def test_load_any_known_architecture_has_no_note(ckpt, tmp_path):
    folder = shutil.copytree(ckpt["safe"], tmp_path / "m")
    _set_architectures(folder, ["BertForMaskedLM"])
    model = hfport.load_any(folder)
    assert model.task == "fill-mask" and model.load_report.notes == []


# --- (f) a pickle that would run code is refused by convert, and nothing runs ----------------------------------


@pytest.mark.parametrize("layout", ["torch-zip", "raw-pickle", "second-shard"])
def test_convert_refuses_malicious_pickle(ckpt, tmp_path, layout):
    marker = tmp_path / "PWNED"
    probe = tmp_path / "probe"  # the payload really does write its marker when unpickled by plain pickle
    pickle.loads(pickle.dumps(_WritesMarker(probe))).close()
    assert probe.exists()

    folder = tmp_path / "evil"
    folder.mkdir()
    shutil.copy(ckpt["bin"] / "config.json", folder)
    payload = {"bert.embeddings.word_embeddings.weight": torch.zeros(2), "x": _WritesMarker(marker)}
    if layout == "torch-zip":
        bad = folder / "pytorch_model.bin"
        torch.save(payload, bad)
    elif layout == "raw-pickle":
        bad = folder / "pytorch_model.bin"
        # torch's legacy format is protocol 2; no tensor in it, as plain pickle stores one through another global
        bad.write_bytes(pickle.dumps({"x": payload["x"]}, protocol=2))
    else:  # the first shard is fine: nothing of it may be written either
        torch.save({"a": torch.zeros(2)}, folder / "pytorch_model-00001-of-00002.bin")
        bad = folder / "pytorch_model-00002-of-00002.bin"
        torch.save(payload, bad)
        (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": {
            "a": "pytorch_model-00001-of-00002.bin", "x": "pytorch_model-00002-of-00002.bin"}}))
    out = tmp_path / "out"
    result = _convert(folder, out)
    assert result.exit_code != 0
    text = " ".join(result.output.split())  # the CLI wraps long lines
    assert str(bad) in text and "restricted loader" in text and "open" in text, result.output  # names the object
    assert not marker.exists(), "convert ran the pickle's payload"
    assert not out.exists() and not list(tmp_path.glob(".out.*"))  # nothing half-written
