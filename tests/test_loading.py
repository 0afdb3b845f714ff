"""How hfport finds, reads, checks and writes checkpoints: local folders, the HF cache, sharded and legacy
safetensors, base <-> head loading, label overrides, dtypes, saving, and every refusal with its message.

All checkpoints are tiny random models written by transformers' own save_pretrained (tests/tiny.py)."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import resource
import shutil
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from torch.testing import assert_close

import hfport
from hfport import hub
from tests import tiny

EXACT = dict(rtol=0.0, atol=0.0)  # the same weights reached two ways
PARITY = dict(rtol=1e-5, atol=1e-5)  # hfport's forward vs transformers' on the same weights, float32
SEQ = hfport.AutoModelForSequenceClassification
COMMIT_A, COMMIT_B = "a" * 40, "b" * 40


# --- helpers ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    """Read-only HF folders shared by the module; tests that change one copy it first (`clone`)."""
    root = tmp_path_factory.mktemp("ckpts")
    tiny.save_hf("bert", "base", root / "base")
    tiny.save_hf("bert", "sequence-classification", root / "seq")  # 3 labels, L0..L2
    torch.manual_seed(0)
    pretraining = transformers.BertForPreTraining(tiny.hf_config("bert")).eval()
    pretraining.save_pretrained(root / "pretraining")
    return {"base": root / "base", "seq": root / "seq", "pretraining": root / "pretraining"}


def clone(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rewrite_tensors(path: Path, edit) -> None:
    """Load a safetensors file, let `edit` change the dict, write it back (as transformers would lay it out)."""
    state = load_file(str(path))
    edit(state)
    save_file(state, str(path), metadata={"format": "pt"})


def split_file(path: Path) -> tuple[int, dict, bytes]:
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    return n, json.loads(blob[8:8 + n]), blob[8 + n:]


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], **tol) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert_close(a[k], b[k], **(tol or EXACT), msg=lambda m, k=k: f"{k}: {m}")


def real_positions(hidden: torch.Tensor, batch: dict) -> torch.Tensor:
    """(B, T, C) -> (N, C): padding positions are not part of hfport's contract (it returns zeros there)."""
    mask = batch.get("attention_mask")
    return hidden if mask is None else hidden[mask.bool()]


def hf_hidden(folder: Path, cls=None, **batch) -> torch.Tensor:
    model = (cls or transformers.AutoModel).from_pretrained(folder).eval()
    with torch.no_grad():
        return real_positions(model(**batch).last_hidden_state, batch)


def ours_hidden(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return real_positions(model(**batch).last_hidden_state, batch)


def make_cache(cache: Path, repo_id: str, snapshots: dict[str, Path], main: str) -> Path:
    """The layout huggingface_hub writes: blobs by hash, snapshots of symlinks into them, refs/main."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(main)
    for commit, folder in snapshots.items():
        snap = repo / "snapshots" / commit
        snap.mkdir(parents=True)
        for f in folder.iterdir():
            digest = hashlib.sha256(f.read_bytes()).hexdigest()
            shutil.copyfile(f, repo / "blobs" / digest)
            (snap / f.name).symlink_to(Path("..", "..", "blobs", digest))
    return repo


@pytest.fixture
def no_network(monkeypatch):
    """Fail on any socket connection and record every snapshot_download call."""
    import huggingface_hub

    calls, connects = [], []
    real = huggingface_hub.snapshot_download

    def recording(*args, **kwargs):
        calls.append(kwargs.get("local_files_only", False))
        return real(*args, **kwargs)

    def refuse(self, address):
        connects.append(address)
        raise OSError(f"test: network access to {address} refused")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", recording)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    return calls, connects


def stray_files(*folders: Path) -> list[str]:
    """Temporary names a save may leave: dot-files, *.tmp, staging folders."""
    return [str(p) for folder in folders for p in folder.iterdir()
            if p.name.startswith(".") or p.name.endswith(".tmp")]


# --- 1. local folders and the load report -------------------------------------------------------------------------


def test_local_folder_load_and_report(ckpts):
    model = hfport.AutoModel.from_pretrained(ckpts["base"])
    report = model.load_report
    keys = load_file(str(ckpts["base"] / "model.safetensors"))
    assert report.source == str(ckpts["base"])
    assert report.loaded == sorted(n for n, _ in model.named_parameters())
    assert len(report.loaded) == len(keys) == 39
    assert report.initialized == report.missing == []
    assert report.unexpected == [] and report.mismatched == []
    assert not model.training  # from_pretrained hands back an eval-mode model, as transformers does
    batch = tiny.batch("bert")
    assert_close(ours_hidden(model, batch), hf_hidden(ckpts["base"], **batch), **PARITY)
    # the report names real tensors: the loaded word embeddings are the file's
    assert_close(model.body.embeddings.word.weight, keys["embeddings.word_embeddings.weight"], **EXACT)


def test_report_lists_fresh_pooler(ckpts, tmp_path):
    """A checkpoint without the pooler (e.g. a masked-LM one) loads; the pooler is reported as initialised."""
    folder = clone(ckpts["base"], tmp_path / "m")
    rewrite_tensors(folder / "model.safetensors", lambda s: [s.pop(k) for k in list(s) if k.startswith("pooler.")])
    report = hfport.AutoModel.from_pretrained(folder).load_report
    assert report.initialized == ["body.pooler.dense.weight", "body.pooler.dense.bias"]
    assert "body.pooler.dense.weight" not in report.loaded and report.unexpected == []
    assert "initialized fresh (2)" in report.summary()


# --- 2. repo ids in the local HF cache ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cache(ckpts, tmp_path_factory) -> Path:
    """org/tiny: main -> the base checkpoint; COMMIT_B -> the same model saved in shards (other seed)."""
    root = tmp_path_factory.mktemp("hub")
    sharded = root / "sharded-src"
    tiny.build_hf("bert", "base", seed=5).save_pretrained(sharded, max_shard_size="20KB")
    cache = root / "cache"
    make_cache(cache, "org/tiny", {COMMIT_A: ckpts["base"], COMMIT_B: sharded}, main=COMMIT_A)
    return cache


def test_repo_id_from_cache_dir(ckpts, cache, no_network):
    calls, connects = no_network
    model = hfport.AutoModel.from_pretrained("org/tiny", cache_dir=cache)
    snapshot = cache / "models--org--tiny" / "snapshots" / COMMIT_A
    assert model.load_report.source == str(snapshot)
    assert_same_params(params(model), params(hfport.AutoModel.from_pretrained(ckpts["base"])))
    assert calls and all(calls), "every hub lookup must be local_files_only"
    assert connects == []


def test_repo_id_revision_and_sharded_symlinked_snapshot(cache, no_network):
    """A pinned revision picks its snapshot; shards that are symlinks into blobs/ are inside the folder."""
    model = hfport.AutoModel.from_pretrained("org/tiny", cache_dir=cache, revision=COMMIT_B)
    expected = tiny.build_hf("bert", "base", seed=5)
    batch = tiny.batch("bert")
    with torch.no_grad():
        assert_close(ours_hidden(model, batch), real_positions(expected(**batch).last_hidden_state, batch), **PARITY)
    assert no_network[1] == []


def test_repo_id_from_default_cache_and_load_any(ckpts, cache, monkeypatch, no_network):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))  # what HF_HUB_CACHE in the environment sets
    model = hfport.AutoModel.from_pretrained("org/tiny")
    assert model.load_report.source.startswith(str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache.parent / "elsewhere"))
    anyway = hfport.load_any("org/tiny", cache_dir=cache)  # load_any passes cache_dir on to the lookup
    assert type(anyway) is hfport.EncoderModel
    assert_same_params(params(anyway), params(model))
    assert no_network[1] == []


def test_repo_id_through_hf_hub_cache_env(cache):
    """The environment variable a user sets, in a fresh interpreter (huggingface_hub reads it at import)."""
    code = ("import hfport; m = hfport.AutoModel.from_pretrained('org/tiny'); print(m.load_report.source)")
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parents[1])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(cache / "models--org--tiny" / "snapshots" / COMMIT_A)


@pytest.mark.parametrize("repo_id", ["org/absent", "absent"])
def test_repo_id_not_in_cache(cache, no_network, repo_id):
    calls, connects = no_network
    with pytest.raises(hfport.ModelNotFoundError) as e:
        hfport.AutoModel.from_pretrained(repo_id, cache_dir=cache)
    msg = str(e.value)
    assert repo_id in msg and str(cache) in msg and "HF_HUB_OFFLINE" in msg and "downloaded" in msg
    assert calls == [True], "one local-only lookup, no download attempt"
    assert connects == []


def test_download_when_online_fetches_no_pickles(monkeypatch, tmp_path):
    """Without HF_HUB_OFFLINE a cache miss becomes a download of config, tokenizer and safetensors files only;
    a failed download is a ModelNotFoundError that says so."""
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    asked = []

    def fake(repo_id, **kwargs):
        asked.append(kwargs)
        if kwargs.get("local_files_only"):
            raise LocalEntryNotFoundError("not cached")
        raise OSError("no route to host")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    with pytest.raises(hfport.ModelNotFoundError, match="org/remote: .*the download failed: no route to host"):
        hfport.AutoModel.from_pretrained("org/remote", cache_dir=tmp_path, revision="v1")
    assert [a.get("local_files_only", False) for a in asked] == [True, False]
    patterns = set(asked[1]["allow_patterns"])
    assert {"*.safetensors", "*.json"} <= patterns <= {"*.safetensors", "*.json", "*.txt", "*.model", "*.md"}
    assert asked[1]["revision"] == "v1" and asked[1]["cache_dir"] == tmp_path


@pytest.mark.parametrize("given", ["./no/such/folder", "a/b/c"])
def test_missing_local_path(tmp_path, given, no_network):
    with pytest.raises(hfport.ModelNotFoundError, match="no such folder") as e:
        hfport.AutoModel.from_pretrained(given)
    assert given in str(e.value)
    assert no_network == ([], [])


def test_file_instead_of_folder(ckpts):
    with pytest.raises(hfport.ModelNotFoundError, match="is a file; give the folder that holds config.json"):
        hfport.AutoModel.from_pretrained(ckpts["base"] / "model.safetensors")


# --- 3. sharded safetensors ---------------------------------------------------------------------------------------


def test_sharded_hf_checkpoint_matches_single_file(ckpts, tmp_path):
    model = tiny.build_hf("bert", "base")  # the same seed as ckpts["base"]
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    index = json.loads((tmp_path / "sharded" / hub.SAFE_INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (tmp_path / "sharded" / hub.SAFE_WEIGHTS).exists()
    sharded = hfport.AutoModel.from_pretrained(tmp_path / "sharded")
    single = hfport.AutoModel.from_pretrained(ckpts["base"])
    assert_same_params(params(sharded), params(single))
    assert sharded.load_report.loaded == single.load_report.loaded


def test_hfport_sharded_save_loads_in_transformers(ckpts, tmp_path):
    ours = SEQ.from_pretrained(ckpts["seq"])
    ours.save_pretrained(tmp_path / "out", max_shard_size="20KB")
    index = json.loads((tmp_path / "out" / hub.SAFE_INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards == sorted(p.name for p in (tmp_path / "out").glob("model-*.safetensors"))
    total = sum(t.numel() * t.element_size() for s in shards for t in load_file(str(tmp_path / "out" / s)).values())
    assert index["metadata"]["total_size"] == total
    theirs, info = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "out",
                                                                                   output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    batch = tiny.batch("bert")
    with torch.no_grad():
        assert_close(ours(**batch).logits, theirs.eval()(**batch).logits, **PARITY)
    assert_same_params(params(SEQ.from_pretrained(tmp_path / "out")), params(ours))


# --- 4. legacy LayerNorm names --------------------------------------------------------------------------------------


def test_legacy_gamma_beta_names(ckpts, tmp_path):
    folder = clone(ckpts["seq"], tmp_path / "legacy")

    def rename(state):
        for key in [k for k in state if ".LayerNorm." in k]:
            state[key.replace(".weight", ".gamma").replace(".bias", ".beta")] = state.pop(key)

    rewrite_tensors(folder / "model.safetensors", rename)
    keys = list(load_file(str(folder / "model.safetensors")))
    assert sum(k.endswith(".gamma") for k in keys) == 5 and not any("LayerNorm.weight" in k for k in keys)
    legacy, modern = SEQ.from_pretrained(folder), SEQ.from_pretrained(ckpts["seq"])
    assert_same_params(params(legacy), params(modern))
    assert legacy.load_report.unexpected == [] and legacy.load_report.initialized == []


# --- 5. base <-> head ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_base_checkpoint_into_fresh_head(tmp_path, family):
    """Body keys without the family prefix land in the body; the head is new and initialised like transformers."""
    std = 0.1  # not the 0.02 default, so the test sees that initializer_range is honoured
    tiny.save_hf(family, "base", tmp_path / "base", initializer_range=std)
    model = SEQ.from_pretrained(tmp_path / "base", num_labels=40)
    base = hfport.AutoModel.from_pretrained(tmp_path / "base")
    report = model.load_report
    head = sorted(n for n, _ in model.named_parameters() if n.startswith("head."))
    assert sorted(report.initialized) == head and len(head) == (2 if family == "bert" else 4)
    assert all(n.startswith("body.") for n in report.loaded) and report.mismatched == []
    body = {k: v for k, v in params(model).items() if k.startswith("body.")}
    assert_same_params(body, {k: v for k, v in params(base).items() if k in body})
    assert model.config.num_labels == 40 and model.head.out.weight.shape == (40, 32)
    for name, p in model.head.named_parameters():
        if name.endswith("bias"):
            assert_close(p, torch.zeros_like(p), **EXACT)
        else:
            assert abs(p.std().item() - std) < 0.15 * std, name
            assert abs(p.mean().item()) < 0.2 * std, name
    if family == "roberta":  # RobertaForSequenceClassification has no pooler: the base pooler is unused
        assert sorted(report.unexpected) == ["pooler.dense.bias", "pooler.dense.weight"]
    else:
        assert report.unexpected == [] and "body.pooler.dense.weight" in report.loaded


def test_head_checkpoint_into_base(ckpts):
    model = hfport.AutoModel.from_pretrained(ckpts["seq"])
    assert sorted(model.load_report.unexpected) == ["classifier.bias", "classifier.weight"]
    assert model.load_report.initialized == []
    full = SEQ.from_pretrained(ckpts["seq"])
    assert_same_params(params(model), {k: v for k, v in params(full).items() if k.startswith("body.")})
    reference = transformers.AutoModelForSequenceClassification.from_pretrained(ckpts["seq"]).eval()
    batch = tiny.batch("bert")
    with torch.no_grad():
        assert_close(ours_hidden(model, batch), real_positions(reference.bert(**batch).last_hidden_state, batch),
                     **PARITY)


def test_pretraining_checkpoint_into_sequence_classification(ckpts):
    keys = load_file(str(ckpts["pretraining"] / "model.safetensors"))
    assert "cls.seq_relationship.weight" in keys
    model = SEQ.from_pretrained(ckpts["pretraining"], num_labels=2)
    report = model.load_report
    assert sorted(report.unexpected) == sorted(k for k in keys if k.startswith("cls."))
    assert report.initialized == ["head.out.weight", "head.out.bias"]
    assert_close(model.body.encoder.layers[1].attn.q.weight, keys["bert.encoder.layer.1.attention.self.query.weight"],
                 **EXACT)
    reference = transformers.BertForPreTraining.from_pretrained(ckpts["pretraining"]).eval()
    batch = tiny.batch("bert")
    with torch.no_grad():
        ours = model.body(batch["input_ids"], attention_mask=batch["attention_mask"],
                          token_type_ids=batch["token_type_ids"])[0]
        assert_close(real_positions(ours, batch), real_positions(reference.bert(**batch).last_hidden_state, batch),
                     **PARITY)


# --- 6. label overrides and saving them ---------------------------------------------------------------------------


def test_label_overrides_land_in_config_and_saved_folder(ckpts, tmp_path):
    labels = {0: "neg", 1: "neu", 2: "pos"}
    model = SEQ.from_pretrained(ckpts["seq"], id2label=labels, label2id={"neg": 0, "neu": 1, "pos": 2},
                                problem_type="multi_label_classification")
    assert model.config.id2label == labels and model.config.label2id == {"neg": 0, "neu": 1, "pos": 2}
    assert model.config.num_labels == 3 and model.config.problem_type == "multi_label_classification"
    model.save_pretrained(tmp_path / "out")
    source = json.loads((ckpts["seq"] / "config.json").read_text())
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    changed = {"id2label", "label2id", "num_labels", "problem_type", "architectures", "dtype"}
    assert {k: v for k, v in saved.items() if k not in changed} == {k: v for k, v in source.items() if k not in changed}
    assert saved["id2label"] == {"0": "neg", "1": "neu", "2": "pos"} and saved["num_labels"] == 3
    assert saved["problem_type"] == "multi_label_classification"
    assert saved["architectures"] == ["BertForSequenceClassification"] and saved["dtype"] == "float32"
    theirs, info = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "out",
                                                                                   output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert theirs.config.id2label == labels and theirs.config.problem_type == "multi_label_classification"
    batch = tiny.batch("bert")
    with torch.no_grad():
        assert_close(model(**batch).logits, theirs.eval()(**batch).logits, **PARITY)


def test_num_labels_on_base_checkpoint_saved_as_head(ckpts, tmp_path):
    model = SEQ.from_pretrained(ckpts["base"], num_labels=5, problem_type="regression")
    assert model.config.id2label == {i: f"LABEL_{i}" for i in range(5)}
    assert model.config.label2id == {f"LABEL_{i}": i for i in range(5)}
    model.save_pretrained(tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert json.loads((ckpts["base"] / "config.json").read_text())["architectures"] == ["BertModel"]
    assert saved["architectures"] == ["BertForSequenceClassification"] and saved["num_labels"] == 5
    assert saved["problem_type"] == "regression"
    theirs, info = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "out",
                                                                                   output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert theirs.config.num_labels == 5
    batch = tiny.batch("bert")
    with torch.no_grad():
        assert_close(model(**batch).logits, theirs.eval()(**batch).logits, **PARITY)
    assert type(hfport.load_any(tmp_path / "out")) is hfport.EncoderForSequenceClassification


def test_same_num_labels_keeps_checkpoint_label_names(ckpts):
    model = SEQ.from_pretrained(ckpts["seq"], num_labels=3)
    assert model.config.id2label == {0: "L0", 1: "L1", 2: "L2"} and model.load_report.initialized == []


@pytest.mark.parametrize("kwargs, field", [
    (dict(num_labels=4, id2label={0: "a", 1: "b"}), "num_labels"),
    (dict(id2label={0: "a", 2: "b"}), "id2label"),
    (dict(id2label={0: "a", 1: "b"}, label2id={"a": 1, "b": 0}), "label2id"),
    (dict(problem_type="ranking"), "problem_type"),
    (dict(num_labels=0), "num_labels"),
])
def test_bad_label_overrides(ckpts, kwargs, field):
    # the bad value is the call's, not config.json's: the error names the call and the argument
    with pytest.raises(hfport.ConfigError, match=f"argument {field}: ") as e:
        SEQ.from_pretrained(ckpts["seq"], **kwargs)
    assert f"from_pretrained({str(ckpts['seq'])!r})" in str(e.value)
    assert "config.json" not in str(e.value)


# --- 7. refusals: weights that do not fit -------------------------------------------------------------------------


def test_head_shape_mismatch(ckpts):
    with pytest.raises(hfport.CheckpointError) as e:
        SEQ.from_pretrained(ckpts["seq"], num_labels=5)
    msg = str(e.value)
    assert str(ckpts["seq"]) in msg and "classifier.weight: checkpoint [3, 32] vs model [5, 32]" in msg
    assert "classifier.bias" in msg
    assert "num_labels=5 asks for a head of 5 labels, the checkpoint's has 3 labels: pass " \
           "ignore_mismatched_sizes=True to start that head fresh (to fine-tune it), or leave the labels out" in msg


def test_a_config_that_disagrees_with_its_head_says_what_to_do_on_every_path(minilm_path, tmp_path):
    """A folder whose config.json names 5 labels over a 3-label head (an edited config, another model's): no caller
    asked for other labels, so the error says to correct config.json, and that a head of another size is trained:
    `hfport finetune` starts one fresh (proved below), as from_pretrained does with ignore_mismatched_sizes=True. It
    tells no path to pass that keyword to itself: predict, evaluate, info, export and serve take no such option (a
    fresh head would answer at random), nor does pipeline(); the old hint told every one of them to."""
    from typer.testing import CliRunner

    from hfport.cli import app
    from tests.data import DATA

    folder = tmp_path / "model"
    tiny.save_with_tokenizer("bert", "sequence-classification", folder, minilm_path, vocab_size=30522)  # 3 labels
    config = json.loads((folder / "config.json").read_text())
    config["id2label"], config["label2id"] = {str(i): f"T{i}" for i in range(5)}, {f"T{i}": i for i in range(5)}
    (folder / "config.json").write_text(json.dumps(config))
    remedy = ("config.json names 5 labels, the checkpoint's head has 3 labels: to load the trained head, correct "
              "config.json's id2label and label2id to its labels; a head of another size is trained, not loaded: "
              "`hfport finetune` and hfport.finetune() start one fresh from this folder, as from_pretrained does "
              "with ignore_mismatched_sizes=True for a training loop of your own")
    for load in (lambda: hfport.AutoModelForSequenceClassification.from_pretrained(folder),
                 lambda: hfport.pipeline("text-classification", model=folder)):
        with pytest.raises(hfport.CheckpointError) as e:
            load()
        assert remedy in str(e.value) and "classifier.weight: checkpoint [3, 32] vs model [5, 32]" in str(e.value)
        assert "pass ignore_mismatched_sizes" not in str(e.value)
    for command in (["predict", str(folder), "--task", "text-classification", "fine"],
                    ["evaluate", str(folder), "--task", "text-classification", "--data", str(DATA / "topics_eval.csv")],
                    ["info", str(folder)], ["export", str(folder), "--out", str(tmp_path / "out")]):
        run = CliRunner().invoke(app, command)
        assert run.exit_code == 1 and remedy in " ".join(run.stderr.split()), (command[0], run.output)
        assert "pass ignore_mismatched_sizes" not in run.output, command[0]
    run = CliRunner().invoke(app, ["finetune", "--model", str(folder), "--train", str(DATA / "topics_train.csv"),
                                   "--output-dir", str(tmp_path / "run"), "--max-steps", "1", "--batch-size", "4",
                                   "--save-strategy", "no", "--set", "eval_fraction=0.1", "-q"])
    assert run.exit_code == 0, run.output  # what the message promises: a head for the data's labels, fresh
    trained = json.loads((tmp_path / "run" / "final" / "config.json").read_text())
    assert len(trained["id2label"]) not in (3, 5)


def test_head_shape_mismatch_ignored(ckpts):
    model = SEQ.from_pretrained(ckpts["seq"], num_labels=5, ignore_mismatched_sizes=True)
    report = model.load_report
    assert sorted(report.mismatched) == [("classifier.bias", (3,), (5,)), ("classifier.weight", (3, 32), (5, 32))]
    assert sorted(report.initialized) == ["head.out.bias", "head.out.weight"]
    assert "head.out.weight" not in report.loaded
    assert model.head.out.weight.shape == (5, 32) and torch.all(model.head.out.bias == 0)
    body = SEQ.from_pretrained(ckpts["seq"])
    assert_close(model.body.encoder.layers[0].ffn.up.weight, body.body.encoder.layers[0].ffn.up.weight, **EXACT)


def test_body_shape_mismatch_is_never_ignored(ckpts, tmp_path):
    folder = clone(ckpts["base"], tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": 100}))
    with pytest.raises(hfport.CheckpointError) as e:
        hfport.AutoModel.from_pretrained(folder, ignore_mismatched_sizes=True)
    assert "embeddings.word_embeddings.weight: checkpoint [99, 32] vs model [100, 32]" in str(e.value)


def test_missing_body_weight(ckpts, tmp_path):
    for src, key in ((ckpts["base"], "encoder.layer.1.attention.self.query.weight"),
                     (ckpts["seq"], "bert.encoder.layer.1.attention.self.query.weight")):
        folder = clone(src, tmp_path / src.name)
        rewrite_tensors(folder / "model.safetensors", lambda s: s.pop(key))
        for cls in (hfport.AutoModel, SEQ):
            with pytest.raises(hfport.CheckpointError) as e:
                cls.from_pretrained(folder)
            msg = str(e.value)
            assert str(folder) in msg and "lacks body weights (1)" in msg
            assert key in msg, msg  # the name the user can find in their file


def test_unknown_key(ckpts, tmp_path):
    folder = clone(ckpts["seq"], tmp_path / "m")
    rewrite_tensors(folder / "model.safetensors",
                    lambda s: s.update({"bert.encoder.layer.0.attention.self.rotary.weight": torch.zeros(4)}))
    with pytest.raises(hfport.CheckpointError) as e:
        SEQ.from_pretrained(folder)
    msg = str(e.value)
    assert str(folder) in msg and "not in the bert key map" in msg
    assert "bert.encoder.layer.0.attention.self.rotary.weight" in msg


class _WritesMarker:
    """Unpickling this object calls open(marker, 'w'): proof of whether a file was unpickled."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_only_folder_is_refused_unopened(ckpts, tmp_path):
    # the payload really does write its marker when unpickled
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(_WritesMarker(probe))).close()
    assert probe.exists()

    folder = tmp_path / "pickled"
    folder.mkdir()
    shutil.copy(ckpts["base"] / "config.json", folder)
    marker = tmp_path / "UNPICKLED"
    (folder / "pytorch_model.bin").write_bytes(pickle.dumps({"weights": _WritesMarker(marker)}))
    for cls in (hfport.AutoModel, SEQ):
        with pytest.raises(hfport.CheckpointError) as e:
            cls.from_pretrained(folder)
        msg = str(e.value)
        assert str(folder) in msg and "pytorch_model.bin" in msg and "never unpickles" in msg
        assert f"hfport convert {folder} --out" in msg and "model.safetensors" in msg  # the lossless, explicit step
    with pytest.raises(hfport.CheckpointError):
        hfport.load_any(folder)
    assert not marker.exists(), "hfport unpickled pytorch_model.bin"


def test_folder_without_weights(ckpts, tmp_path):
    folder = tmp_path / "empty"
    folder.mkdir()
    shutil.copy(ckpts["base"] / "config.json", folder)
    with pytest.raises(hfport.CheckpointError, match="no model.safetensors or model.safetensors.index.json"):
        hfport.AutoModel.from_pretrained(folder)


# --- 7. refusals: damaged safetensors -----------------------------------------------------------------------------


def _truncate(path: Path) -> None:
    blob = path.read_bytes()
    path.write_bytes(blob[: len(blob) // 2])


def _too_short(path: Path) -> None:
    path.write_bytes(b"\x01\x02\x03")


def _header_too_long(path: Path) -> None:
    blob = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 2 * len(blob)) + blob[8:])


def _header_not_json(path: Path) -> None:
    n, _, data = split_file(path)
    path.write_bytes(struct.pack("<Q", n) + b"{" * n + data)


def _unknown_dtype(path: Path) -> None:
    n, header, data = split_file(path)
    header["encoder.layer.0.output.dense.weight"]["dtype"] = "F33"
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _overlapping_tensors(path: Path) -> None:  # passes hfport's per-entry checks; the safetensors reader refuses
    n, header, data = split_file(path)
    header["embeddings.LayerNorm.bias"]["data_offsets"] = header["embeddings.LayerNorm.weight"]["data_offsets"]
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _trailing_bytes(path: Path) -> None:
    path.write_bytes(path.read_bytes() + b"\0" * 64)


@pytest.mark.parametrize("damage, expected", [
    (_truncate, "the file is truncated"),
    (_too_short, "truncated (3 bytes); not a safetensors file"),
    (_header_too_long, "is larger than the file"),
    (_header_not_json, "the header is not JSON"),
    (_unknown_dtype, "tensor 'encoder.layer.0.output.dense.weight': unknown dtype 'F33'"),
    (_overlapping_tensors, "cannot be read"),
    (_trailing_bytes, "cannot be read"),
], ids=lambda v: getattr(v, "__name__", "")[1:] or None)
def test_damaged_safetensors(ckpts, tmp_path, damage, expected):
    folder = clone(ckpts["base"], tmp_path / "m")
    damage(folder / "model.safetensors")
    with pytest.raises(hfport.CheckpointError) as e:
        hfport.AutoModel.from_pretrained(folder)
    msg = str(e.value)
    assert str(folder / "model.safetensors") in msg and expected in msg, msg


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("sh") / "sharded"
    tiny.build_hf("bert", "base").save_pretrained(folder, max_shard_size="20KB")
    return folder


@pytest.mark.parametrize("edit, expected", [
    (lambda i: {**i, "weight_map": {**i["weight_map"], "pooler.dense.bias": "model-00099-of-00099.safetensors"}},
     "shard 'model-00099-of-00099.safetensors' is missing"),
    (lambda i: {**i, "weight_map": {**i["weight_map"], "pooler.dense.bias": "../model.safetensors"}},
     "shard '../model.safetensors' lies outside the folder"),
    (lambda i: {**i, "weight_map": {**i["weight_map"], "extra.weight": i["weight_map"]["pooler.dense.bias"]}},
     "tensors listed but not in their shard: ['extra.weight']"),
    (lambda i: {"metadata": {}}, "not a safetensors index"),
    (lambda i: {**i, "weight_map": list(i["weight_map"])}, "'weight_map' must map tensor names to shard file names"),
])
def test_damaged_index(sharded, tmp_path, edit, expected):
    folder = clone(sharded, tmp_path / "m")
    index = folder / hub.SAFE_INDEX
    index.write_text(json.dumps(edit(json.loads(index.read_text()))))
    with pytest.raises(hfport.CheckpointError) as e:
        hfport.AutoModel.from_pretrained(folder)
    assert str(index) in str(e.value) and expected in str(e.value), str(e.value)


# --- 7. refusals: config.json -------------------------------------------------------------------------------------


class Text(str):
    """Returned by a config edit: the whole new text of config.json (anything else edits the dict in place)."""


def _with_config(src: Path, dst: Path, edit) -> Path:
    folder = clone(src, dst)
    config = json.loads((folder / "config.json").read_text())
    new = edit(config)
    (folder / "config.json").write_text(new if isinstance(new, Text) else json.dumps(config))
    return folder


@pytest.mark.parametrize("edit, expected", [
    (lambda c: c.pop("hidden_size"), "required field 'hidden_size' is missing"),
    (lambda c: c.pop("model_type"), "required field 'model_type' is missing; supported: "),
    (lambda c: Text("{not json"), "not valid JSON"),
    (lambda c: Text("[1, 2]"), "the top level must be a JSON object"),
    (lambda c: c.update(num_hidden_layers="2"), "field 'num_hidden_layers' should be int, got '2'"),
    (lambda c: c.update(num_attention_heads=5), "hidden_size 32 is not a multiple of num_attention_heads 5"),
    (lambda c: c.update(hidden_act="swishy"), "field 'hidden_act': 'swishy' is not supported; supported: ["),
    (lambda c: c.update(position_embedding_type="relative_key"),
     "field 'position_embedding_type': 'relative_key' is not supported"),
], ids=["no-hidden_size", "no-model_type", "not-json", "not-object", "string-size", "heads", "hidden_act",
        "relative_key"])
def test_bad_config(ckpts, tmp_path, edit, expected):
    folder = _with_config(ckpts["base"], tmp_path / "m", edit)
    with pytest.raises(hfport.ConfigError) as e:
        hfport.AutoModel.from_pretrained(folder)
    msg = str(e.value)
    assert str(folder / "config.json") in msg and expected in msg, msg
    if "hidden_act" in expected:
        assert "'gelu'" in msg and "'relu'" in msg and "'gelu_new'" in msg
    if "model_type" in expected:
        assert str(hfport.supported()) in msg


def test_unknown_model_type_lists_supported(ckpts, tmp_path):
    folder = _with_config(ckpts["base"], tmp_path / "m", lambda c: c.update(model_type="gpt2"))
    with pytest.raises(hfport.ConfigError) as e:
        hfport.AutoModel.from_pretrained(folder)
    msg = str(e.value)
    assert str(folder / "config.json") in msg and "model_type 'gpt2' is not supported" in msg
    for name in ("albert", "bert", "distilbert", "roberta", "xlm-roberta"):
        assert f"'{name}'" in msg
    with pytest.raises(hfport.ConfigError, match="model_type 'gpt2' is not supported"):
        hfport.load_any(folder)


@pytest.mark.parametrize("field, value", [("hidden_size", 10**9), ("vocab_size", 10**12),
                                          ("num_hidden_layers", 10**8)])
def test_absurd_sizes_refused_before_allocating(ckpts, tmp_path, monkeypatch, field, value):
    folder = _with_config(ckpts["base"], tmp_path / "m", lambda c: c.update({field: value}))

    def unreachable(*args, **kwargs):
        raise AssertionError("the size check must come before building the model or reading weights")

    monkeypatch.setattr(hfport.PreTrainedEncoder, "__init__", unreachable)
    monkeypatch.setattr(hub.Checkpoint, "open", unreachable)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    with pytest.raises(hfport.ConfigError) as e:  # "quickly": nothing is built or read (the patches above)
        hfport.AutoModel.from_pretrained(folder)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 100 * 1024
    msg = str(e.value)
    assert str(folder / "config.json") in msg and f"{field}={value}" in msg and "refusing before allocating" in msg


# --- 8. dtype and device ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, expected", [("float16", torch.float16), ("bfloat16", torch.bfloat16),
                                             (torch.bfloat16, torch.bfloat16), ("auto", "auto"),
                                             (None, torch.float32)])
def test_dtype(ckpts, dtype, expected):
    if expected == "auto":  # an fp32 checkpoint: bf16 on a CPU measured to have native bf16 (test_bf16.py)
        from hfport.hardware import cpu_capabilities

        expected = torch.bfloat16 if cpu_capabilities().bf16_native else torch.float32
    model = SEQ.from_pretrained(ckpts["seq"], dtype=dtype)
    reference = params(SEQ.from_pretrained(ckpts["seq"]))
    assert model.dtype == expected and {p.dtype for p in model.parameters()} == {expected}
    assert_same_params(params(model), {k: v.to(expected) for k, v in reference.items()})
    with torch.no_grad():
        logits = model(**tiny.batch("bert")).logits
    assert logits.dtype == expected and torch.isfinite(logits).all()


def test_dtype_auto_follows_checkpoint(tmp_path):
    hf = tiny.build_hf("bert", "sequence-classification").to(torch.bfloat16)
    hf.save_pretrained(tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    model = SEQ.from_pretrained(tmp_path / "bf16", dtype="auto")
    assert model.dtype == torch.bfloat16
    assert_close(model.head.out.weight, hf.classifier.weight, **EXACT)
    assert_close(model.body.embeddings.word.weight, hf.bert.embeddings.word_embeddings.weight, **EXACT)
    # saved back in the dtype it has
    model.save_pretrained(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["dtype"] == "bfloat16"
    assert load_file(str(tmp_path / "again" / "model.safetensors"))["classifier.weight"].dtype == torch.bfloat16


def test_dtype_auto_reads_legacy_torch_dtype(ckpts, tmp_path):
    def legacy(c):
        c.pop("dtype")
        c["torch_dtype"] = "float16"  # what transformers 4 wrote

    folder = _with_config(ckpts["base"], tmp_path / "m", legacy)
    assert hfport.AutoModel.from_pretrained(folder, dtype="auto").dtype == torch.float16


def test_bad_dtype(ckpts):  # int8 is a way of loading now (tests/test_int8.py); int4 is not
    with pytest.raises(ValueError, match="dtype 'int4' is not one of .*'int8' or 'auto-int8'"):
        hfport.AutoModel.from_pretrained(ckpts["base"], dtype="int4")


def test_device_cpu(ckpts):
    model = hfport.AutoModel.from_pretrained(ckpts["base"], device="cpu")
    assert model.device == torch.device("cpu") and all(p.device.type == "cpu" for p in model.parameters())
    batch = tiny.batch("bert")
    assert_close(ours_hidden(model, batch), hf_hidden(ckpts["base"], **batch), **PARITY)


# --- 9. saving into existing folders ------------------------------------------------------------------------------


def test_resave_switches_layout_without_leftovers(ckpts, tmp_path):
    model = SEQ.from_pretrained(ckpts["seq"])
    target = clone(ckpts["seq"], tmp_path / "out")  # an existing folder: single file + extra files
    (target / "tokenizer.json").write_text("{}")

    model.save_pretrained(target, max_shard_size="20KB")
    shards = sorted(p.name for p in target.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and (target / hub.SAFE_INDEX).is_file()
    assert not (target / hub.SAFE_WEIGHTS).exists(), "the old single file would shadow the new shards"
    assert (target / "tokenizer.json").read_text() == "{}"
    assert stray_files(target, tmp_path) == []
    assert_same_params(params(SEQ.from_pretrained(target)), params(model))

    model.save_pretrained(target)
    names = sorted(p.name for p in target.iterdir())
    assert names == ["config.json", "model.safetensors", "tokenizer.json"], names
    assert stray_files(target, tmp_path) == []
    assert_same_params(params(SEQ.from_pretrained(target)), params(model))
    _, info = transformers.AutoModelForSequenceClassification.from_pretrained(target, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_save_into_new_folder_honours_umask(ckpts, tmp_path):
    umask = os.umask(0o022)
    os.umask(umask)
    hfport.AutoModel.from_pretrained(ckpts["base"]).save_pretrained(tmp_path / "new" / "model")
    mode = (tmp_path / "new" / "model").stat().st_mode & 0o777
    assert mode == 0o777 & ~umask, oct(mode)  # not tempfile.mkdtemp's 0o700
    assert stray_files(tmp_path / "new", tmp_path / "new" / "model") == []


def test_failed_save_leaves_folder_as_it_was(ckpts, tmp_path, monkeypatch):
    target = clone(ckpts["seq"], tmp_path / "out")
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    model = SEQ.from_pretrained(ckpts["seq"], num_labels=5, ignore_mismatched_sizes=True)
    written = []

    def failing(tensors, filename, metadata=None):
        if written:
            raise OSError("disk full")
        written.append(filename)
        save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr(hub, "save_file", failing)
    with pytest.raises(OSError, match="disk full"):
        model.save_pretrained(target, max_shard_size="20KB")
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert stray_files(target, tmp_path) == []


@pytest.mark.parametrize("family", ["bert", "distilbert", "albert", "deberta-v2", "modernbert"])
def test_get_input_embeddings_is_the_word_table(family, tmp_path):
    """transformers' accessor: the same word-embedding values as transformers' model, and the table itself (a
    change through it changes the model)."""
    from tests import tiny

    hf = tiny.save_hf(family, "base", tmp_path / "m")
    ours = hfport.AutoModel.from_pretrained(tmp_path / "m")
    table = ours.get_input_embeddings()
    assert isinstance(table, torch.nn.Embedding)
    torch.testing.assert_close(table.weight, hf.get_input_embeddings().weight, rtol=0, atol=0)
    assert table is ours.body.word_embeddings


def test_loading_skips_the_modules_initialisers(tmp_path):
    """from_pretrained builds on the meta device without running the modules' initialisers (on meta they compute
    nothing, and torch's Python normal_ there costs the first load ~1 s); a head the checkpoint lacks still gets
    transformers' initialisation (normal, std initializer_range), and modules built outside are initialised."""
    from hfport.modeling import on_meta

    with on_meta():
        layer, emb = torch.nn.Linear(4, 4), torch.nn.Embedding(10, 4)
    assert layer.weight.is_meta and emb.weight.is_meta
    tiny.save_hf("bert", "base", tmp_path / "base")
    model = hfport.AutoModelForSequenceClassification.from_pretrained(tmp_path / "base", num_labels=3)
    head = model.head.out.weight  # (3, C), not in the checkpoint
    std = model.config.initializer_range
    assert torch.isfinite(head).all() and 0.5 * std < float(head.std()) < 1.5 * std
    assert float(torch.nn.Embedding(1000, 8).weight.std()) > 0.5  # outside: torch's N(0, 1) as usual


def test_json_written_by_many_writers_at_once_is_always_whole(tmp_path):
    """hub.write_json_atomic from several threads at once onto one file (auto-int8's choice, a verdict, a run's state
    written by two processes): each write lands whole, none fails, and no temporary file is left."""
    import json
    import threading

    target = tmp_path / "state.json"
    errors: list[BaseException] = []

    def write(n: int) -> None:
        try:
            for i in range(150):
                hfport.hub.write_json_atomic(target, {"writer": n, "i": i, "pad": "x" * 2000})
                json.loads(target.read_text(encoding="utf-8"))
        except BaseException as e:  # noqa: BLE001 - collected, asserted below
            errors.append(e)

    threads = [threading.Thread(target=write, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def _temp_name_writers(tmp_path: Path) -> dict[str, tuple[Path, object]]:
    """The writers that publish one file by writing it beside itself and renaming it: {name: (the file, write(n))}."""
    from hfport import hardware
    from hfport.formats.tables import write_rows

    hfport.settings.use(cache_dir=tmp_path / "cache")  # conftest resets the settings after the test
    cpu = {"cpu": "cpu", "cores": 1, "torch": "2", "threads": 1, "measured_at": "now"}
    return {
        "hub.write_json_atomic": (tmp_path / "state.json",
                                  lambda n: hub.write_json_atomic(tmp_path / "state.json", {"n": n})),
        "hardware._write_cache": (tmp_path / "cache" / hardware.CACHE_FILE,
                                  lambda n: hardware._write_cache(hardware.Capabilities(**cpu, peaks={"n": n}))),
        "tables.write_rows": (tmp_path / "rows.jsonl",
                              lambda n: write_rows(tmp_path / "rows.jsonl", ["n"], [{"n": n}])),
    }


@pytest.mark.parametrize("writer", ["hub.write_json_atomic", "hardware._write_cache", "tables.write_rows"])
def test_a_second_writer_between_a_write_and_its_rename_breaks_neither(writer, tmp_path, monkeypatch, caplog):
    """A second writer of the same file (another thread: two models measuring the CPU at once, two mine calls onto
    one file) that writes and renames whole between this one's write and its rename: both land whole, neither fails
    nor warns, and no temporary file is left (a temporary name of the process's pid let the second take the first's
    file, whose rename then found it gone). A rename that fails leaves no temporary file either."""
    target, write = _temp_name_writers(tmp_path)[writer]
    real_replace, seen = os.replace, []

    def second_writer_first(src, dst, *args, **kwargs):
        if not seen:
            seen.append(src)
            write(202)
        real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", second_writer_first)
    with caplog.at_level("WARNING"):
        write(101)
    monkeypatch.setattr(os, "replace", real_replace)
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text
    assert "101" in target.read_text() and "202" not in target.read_text()  # the last rename's, whole
    assert [p.name for p in target.parent.iterdir()] == [target.name]

    def disk_full(src, dst, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    try:
        write(303)
    except OSError:
        pass  # raised by the writers whose caller decides; the CPU cache only logs it (measured again next time)
    monkeypatch.setattr(os, "replace", real_replace)
    assert [p.name for p in target.parent.iterdir()] == [target.name] and "303" not in target.read_text()
