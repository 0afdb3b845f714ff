"""LoRA: hfport's adapters compute what peft computes over transformers (every family and task), adapters peft
wrote load in hfport, a LoRA fine-tune writes a PEFT folder that `verify` proves, `export --merge --verify` proves
the merge, resume after SIGKILL is bit-identical, adapters over one base share its tensors (also in the server),
gradient checkpointing gives the same gradients, and bad input is refused with names."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import hfport
from hfport import lora
from hfport.export import FORMATS, detect_format
from hfport.formats.sentence_transformers import mark_cross_encoder, write_embedding_layout
from hfport.rundir import RunDir
from hfport.tokenizer import copy_tokenizer_files
from hfport.train.loop import finetune
from tests.finetuning import base_config, check_resume_after_sigkill
from tests.forked import run_cli
from tests.tiny import ALL_FAMILIES, batch, save_hf, save_random_adapter

import peft  # noqa: E402 - a dev dependency (the hfport[peft] extra): missing must fail, not skip

TASKS = {  # hfport task -> (tests/tiny head name, transformers auto class, output compared)
    "text-classification": ("sequence-classification", "AutoModelForSequenceClassification", "logits"),
    "token-classification": ("token-classification", "AutoModelForTokenClassification", "logits"),
    "question-answering": ("question-answering", "AutoModelForQuestionAnswering", "start_logits"),
    "fill-mask": ("masked-lm", "AutoModelForMaskedLM", "logits"),
    "feature-extraction": ("base", "AutoModel", "last_hidden_state"),
}
LABELS = {0: "a", 1: "b", 2: "c"}


def _labels(task: str) -> dict:
    return {"id2label": LABELS} if task in ("text-classification", "token-classification") else {}


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bases")
    out = {}
    for family in ALL_FAMILIES:
        out[family] = root / family
        save_hf(family, "base", out[family])
    return out


def _perturbed_adapter(family: str, task: str, base: Path, out: Path, targets=None):
    """An hfport model with LoRA whose A, B and head are moved off their init (save_random_adapter). Targets: the
    family's attention defaults (q, v; ModernBERT's fused Wqkv) and the feed-forward's first layer."""
    model = hfport.tasks.get(task).model_class.from_pretrained(base, **_labels(task))
    targets = list(targets or (*model.family.lora_targets, "ffn.up"))
    return save_random_adapter(model, out, base=base, seed=3, r=4, alpha=8, targets=targets).eval()


def _real(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return x[mask.bool()] if x.dim() >= 2 and x.shape[:2] == mask.shape else x


@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize("family", list(ALL_FAMILIES))
def test_adapter_equals_peft_over_transformers(family, task, bases, tmp_path):
    """The saved folder, loaded by peft over transformers and by hfport, computes what the trained model did."""
    import transformers

    folder = tmp_path / "adapter"
    ours = _perturbed_adapter(family, task, bases[family], folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == lora.PEFT_TASK_TYPES[task]
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["bias"] == "none"
    keys = load_file(str(folder / "adapter_model.safetensors")).keys()
    assert all(k.startswith("base_model.model.") for k in keys)
    assert any(k.endswith(".lora_A.weight") for k in keys) and any(k.endswith(".lora_B.weight") for k in keys)
    head, auto, out_name = TASKS[task]
    b = batch(family)
    base = getattr(transformers, auto).from_pretrained(str(bases[family]), **_labels(task))
    theirs = peft.PeftModel.from_pretrained(base, str(folder)).eval()
    from hfport.export.peft import adapter_key_problems

    assert adapter_key_problems(theirs, folder) == ([], [])
    reloaded = hfport.tasks.get(task).model_class.from_pretrained(folder)
    with torch.no_grad():
        a = getattr(ours(**b), out_name)
        c = getattr(theirs.get_base_model()(**b), out_name)  # peft's QA wrapper drops token types; see peft.py
        d = getattr(reloaded(**b), out_name)
    mask = b["attention_mask"]
    torch.testing.assert_close(_real(c, mask), _real(a, mask), atol=1e-5, rtol=1e-4)
    assert torch.equal(_real(d, mask), _real(a, mask))


@pytest.mark.parametrize("family", ["bert", "distilbert", "deberta-v2"])
def test_adapter_written_by_peft_loads_in_hfport(family, bases, tmp_path):
    """peft's own folder (no config.json, no tokenizer): hfport reads it with base_model= and num_labels."""
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(bases[family]), num_labels=3)
    targets = {"bert": ["query", "value"], "distilbert": ["q_lin", "v_lin"], "deberta-v2": ["query_proj", "value_proj"]}
    mts = ["pooler", "classifier"] if family == "deberta-v2" else None
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=16, target_modules=targets[family],
                                                         task_type="SEQ_CLS", modules_to_save=mts))
    with torch.no_grad():
        for _, p in wrapped.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    wrapped.save_pretrained(tmp_path / "peft")
    ours = hfport.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "peft", base_model=bases[family], num_labels=3)
    b = batch(family)
    with torch.no_grad():
        torch.testing.assert_close(ours(**b).logits, wrapped.eval().get_base_model()(**b).logits, atol=1e-5,
                                   rtol=1e-4)


def test_two_adapters_share_the_base_tensors(bases, tmp_path):
    base = hfport.AutoModel.from_pretrained(bases["bert"])
    _perturbed_adapter("bert", "text-classification", bases["bert"], tmp_path / "one")
    _perturbed_adapter("bert", "token-classification", bases["bert"], tmp_path / "two")
    one = hfport.AutoModelForSequenceClassification.from_pretrained(tmp_path / "one", base_model=base)
    two = hfport.AutoModelForTokenClassification.from_pretrained(tmp_path / "two", base_model=base)
    for name in ("embeddings.word.weight", "encoder.layers.0.attn.q.weight", "encoder.layers.1.ffn.down.weight"):
        ptr = base.body.get_parameter(name).data_ptr()
        assert one.body.get_parameter(name).data_ptr() == ptr == two.body.get_parameter(name).data_ptr()
    assert one.body.encoder.layers[0].attn.q.lora_A.weight.data_ptr() != \
        two.body.encoder.layers[0].attn.q.lora_A.weight.data_ptr()


def test_merge_equals_unmerged_and_leaves_shared_base_alone(bases, tmp_path):
    base = hfport.AutoModel.from_pretrained(bases["roberta"])
    before = base.body.encoder.layers[0].attn.q.weight.clone()
    _perturbed_adapter("roberta", "text-classification", bases["roberta"], tmp_path / "a")
    adapter = hfport.AutoModelForSequenceClassification.from_pretrained(tmp_path / "a", base_model=base)
    plain = lora.merged(adapter)
    assert not lora.lora_modules(plain) and plain.adapter is None
    b = batch("roberta")
    with torch.no_grad():
        torch.testing.assert_close(plain(**b).logits, adapter(**b).logits, atol=1e-5, rtol=1e-4)
    assert torch.equal(base.body.encoder.layers[0].attn.q.weight, before)


def test_merged_embedding_adapter_keeps_its_sentence_transformers_layout(tiny_bert, tmp_path):
    """An embedding adapter (a LoRA sentence-embedding run's best/: cls pooling, normalized) merged: the merged
    folder keeps modules.json, 1_Pooling and 2_Normalize, so SentenceTransformer encodes what hfport encodes with the
    adapter (without them it pooled by mean, unnormalized: a different model)."""
    from sentence_transformers import SentenceTransformer  # a dev dependency, imported where it is used

    adapter = tmp_path / "adapter"
    save_random_adapter(hfport.AutoModel.from_pretrained(tiny_bert), adapter, base=tiny_bert, seed=3, r=4, alpha=8,
                        targets=["q", "v"])
    write_embedding_layout(adapter, pooling="cls", normalize=True, hidden_size=32, max_seq_length=128)
    copy_tokenizer_files(tiny_bert, adapter)
    result = hfport.export(adapter, tmp_path / "merged", merge=True, verify=True)
    assert result.report.passed, result.report.table()
    assert {"modules.json", "1_Pooling", "2_Normalize"} <= set(result.files)
    texts = ["What is the capital of Norway?", "Shops in Chile take the peso, the national currency."]
    ours = torch.tensor(hfport.pipeline("sentence-embedding", model=adapter)(texts))
    theirs = torch.from_numpy(SentenceTransformer(str(tmp_path / "merged"), device="cpu").encode(texts))
    torch.testing.assert_close(theirs, ours.to(theirs.dtype), atol=1e-5, rtol=1e-4)


def test_merged_reranker_adapter_stays_a_cross_encoder(tiny_bert, tmp_path):
    """A reranker adapter (a LoRA text-ranking run's best/, CrossEncoder's marker in its config.json) merged is a
    CrossEncoder folder again, as the reranker's own folders are (the marker was dropped: a plain HF folder)."""
    adapter = tmp_path / "adapter"
    model = hfport.AutoModelForSequenceClassification.from_pretrained(tiny_bert, num_labels=1)
    save_random_adapter(model, adapter, base=tiny_bert, seed=3, r=4, alpha=8, targets=["q", "v"])
    mark_cross_encoder(adapter)
    copy_tokenizer_files(tiny_bert, adapter)
    result = hfport.export(adapter, tmp_path / "merged", merge=True, verify=True)
    assert result.report.passed, result.report.table()
    assert detect_format(tmp_path / "merged") is FORMATS["cross-encoder"]
    report = hfport.verify(tmp_path / "merged")  # proven as one: CrossEncoder.predict against hfport
    assert report.passed and "predict" in {r.output for r in report.rows}, report.table()


# --- a LoRA fine-tune, end to end ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_run(workdir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lora") / "run"
    # every linear layer of the encoder: on a tiny *random* base, q and v alone cannot carry the signal to the
    # pooler (measured 0.52 accuracy); on a pretrained model they do (docs/benchmarks.md)
    targets = ["q", "k", "v", "o", "ffn.up", "ffn.down"]
    finetune(base_config(workdir, out, epochs=3, lr=1e-2, lora={"r": 8, "alpha": 16, "dropout": 0.1,
                                                               "target_modules": targets},
                         gradient_checkpointing=True), progress=False)
    return out


def test_lora_finetune_writes_a_peft_folder_that_verifies(lora_run, workdir):
    best = lora_run / "best"
    assert {"adapter_config.json", "adapter_model.safetensors", "config.json", "tokenizer.json"} <= {
        p.name for p in best.iterdir()}
    assert not (best / "model.safetensors").exists()
    config = json.loads((best / "adapter_config.json").read_text())
    assert config["target_modules"][:3] == ["query", "key", "value"] and config["modules_to_save"] == ["classifier"]
    assert {"intermediate.dense", "output.dense"} <= set(config["target_modules"])
    assert config["task_type"] == "SEQ_CLS" and Path(config["base_model_name_or_path"]) == (workdir / "model").resolve()
    summary = json.loads((lora_run / "summary.json").read_text())
    assert summary["best_metric"]["accuracy"] >= 0.9, summary
    report = hfport.verify(best)
    assert report.passed, report.table()
    checks = {r.check for r in report.rows}
    assert {"config", "load", "tokenizer", "outputs", "labels"} <= checks
    model = hfport.AutoModelForSequenceClassification.from_pretrained(best)
    assert model.config.id2label == {0: "negative", 1: "positive"}
    # only LoRA and the head moved: the base's body weights are the source's, bit for bit
    source = hfport.AutoModel.from_pretrained(workdir / "model")
    assert torch.equal(model.body.encoder.layers[1].attn.q.weight, source.body.encoder.layers[1].attn.q.weight)


def test_verify_fails_closed_on_a_tampered_adapter(lora_run, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(lora_run / "best", bad)
    weights = load_file(str(bad / "adapter_model.safetensors"))
    key = next(k for k in weights if k.endswith("classifier.weight"))
    weights[key] = weights[key] + 0.5
    from safetensors.torch import save_file

    save_file(weights, str(bad / "adapter_model.safetensors"))
    report = hfport.verify(bad, lora_run / "best")
    assert not report.passed and any(r.check == "outputs" and not r.passed for r in report.rows)


def test_export_merge_verify_and_pipeline(lora_run, tmp_path):
    result = hfport.export(lora_run, tmp_path / "merged", merge=True, verify=True)
    assert result.report.passed, result.report.table()
    assert (tmp_path / "merged" / "model.safetensors").is_file()
    assert {r.output for r in result.report.rows if r.check == "outputs"} >= {"texts/logits", "pairs/logits"}, \
        result.report.table()
    texts = ["the plot was great overall", "the acting was awful overall"]
    via_adapter = hfport.pipeline("text-classification", model=lora_run / "best")(texts, top_k=None)
    via_merged = hfport.pipeline("text-classification", model=tmp_path / "merged")(texts, top_k=None)
    for x, y in zip(via_adapter, via_merged):
        assert [d["label"] for d in x] == [d["label"] for d in y]
        for d, e in zip(x, y):
            assert d["score"] == pytest.approx(e["score"], abs=1e-5)
    adapter_export = hfport.export(lora_run, tmp_path / "adapter", verify=True)  # the adapter itself, proven
    assert adapter_export.report.passed and (tmp_path / "adapter" / "adapter_config.json").is_file()


def test_a_lora_run_trains_on_from_its_adapter_folder(lora_run, workdir, tmp_path):
    """--model RUN/final of a LoRA run (the docs' way to train on from a run's weights) trains that adapter's LoRA
    layers and head on, as peft's is_trainable=True: the base stays frozen, best/ and final/ are adapters over the
    same base with the same layers, moved, and verify proves them (it said 'every parameter is frozen')."""
    start = lora_run / "final"
    out = tmp_path / "again"
    finetune(base_config(workdir, out, max_steps=2, lr=1e-2, model=str(start), eval_strategy="no"), progress=False)
    config = json.loads((out / "final" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == json.loads((start / "adapter_config.json").read_text())[
        "base_model_name_or_path"]
    before, after = (load_file(str(f / "adapter_model.safetensors")) for f in (start, out / "final"))
    assert sorted(before) == sorted(after)
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert any("lora_B" in k for k in moved) and any("classifier" in k for k in moved), sorted(moved)
    assert not (out / "final" / "model.safetensors").exists()
    report = hfport.verify(out / "final")
    assert report.passed, report.table()


def test_export_merge_of_a_plain_model_is_refused(workdir, tmp_path):
    with pytest.raises(hfport.ExportError, match="merge applies to LoRA adapter"):
        hfport.export(workdir / "model", tmp_path / "x", merge=True)


def test_a_lora_checkpoint_is_refused_naming_the_adapter_folders(lora_run, tmp_path):
    """A LoRA run's checkpoint holds the base's weights beside the LoRA layers, which a plain load does not build:
    export, evaluate and predict refuse it saying to use best/ or final/ (not 'key(s) not in the bert key map')."""
    checkpoint = RunDir(lora_run).latest_checkpoint()
    message = r"LoRA layers \(.*lora_A.*\): a checkpoint of a LoRA fine-tune.* the run's best/ or final/"
    with pytest.raises(hfport.HfportError, match=message):
        hfport.export(checkpoint, tmp_path / "out")
    with pytest.raises(hfport.HfportError, match=message):
        hfport.AutoModelForSequenceClassification.from_pretrained(checkpoint)
    assert not (tmp_path / "out").exists()


def test_lora_resume_after_sigkill_is_bit_identical(workdir, tmp_path):
    """As test_finetune's resume test, with LoRA (dropout on its input) and gradient checkpointing."""
    def config(out: Path, **kw):
        return base_config(workdir, out, max_steps=10, batch_size=8, save_steps=2, eval_strategy="steps",
                           eval_steps=5, lora={"r": 4, "dropout": 0.1, "target_modules": ["q", "v", "ffn.up"]},
                           gradient_checkpointing=True, **kw)

    rng = random.Random(99)
    check_resume_after_sigkill(config, tmp_path, "adapter_model.safetensors", [rng.randint(3, 9) for _ in range(2)])


def test_lora_flags_through_the_cli(workdir, tmp_path):
    out = run_cli("finetune", "--model", str(workdir / "model"), "--train", str(workdir / "train.jsonl"),
                  "--output-dir", str(tmp_path / "r"), "--lora-r", "4", "--lora-alpha", "8", "--lora-targets",
                  "query,attention.output.dense", "--gradient-checkpointing", "--print-config", timeout=120)
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("lora "))
    assert '"r": 4' in line and '"alpha": 8.0' in line and "attention.output.dense" in line and "(flag)" in line


# --- gradient checkpointing ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["bert", "deberta-v2"])
@pytest.mark.parametrize("with_lora", [False, True])
def test_gradient_checkpointing_gives_the_same_gradients(family, with_lora, bases):
    """Dropout on (the RNG is replayed in the recomputation), padded batch on the padding-free path."""
    grads = []
    for checkpointed in (False, True):
        torch.manual_seed(4)  # the fresh head and the LoRA init draw from it
        model = hfport.AutoModelForSequenceClassification.from_pretrained(bases[family], num_labels=3)
        if with_lora:
            lora.apply_lora(model, r=4, alpha=8, dropout=0.1, targets=["q", "v"])
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if "lora_B" in n:
                        p.normal_(0, 0.1)
        model.gradient_checkpointing_enable(checkpointed)
        model.train()
        torch.manual_seed(5)
        out = model(**batch(family), labels=torch.tensor([0, 2, 1]))
        out.loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")


# --- bad input ----------------------------------------------------------------------------------------------------


def test_targets_matching_nothing_name_what_exists(bases):
    model = hfport.AutoModelForSequenceClassification.from_pretrained(bases["bert"], num_labels=2)
    with pytest.raises(lora.LoraError, match=r"'qkv' matches no layer.*attn\.q.*'query'"):
        lora.apply_lora(model, targets=["qkv"])
    with pytest.raises(lora.LoraError, match="names the task head"):
        lora.apply_lora(model, targets=["classifier"])
    with pytest.raises(lora.LoraError, match="linear layers only"):
        lora.apply_lora(model, targets=["LayerNorm"])
    with pytest.raises(lora.LoraError, match="lora.r"):
        lora.apply_lora(model, r=0)


def test_bad_lora_config_values(workdir):
    from hfport.train.config import resolve_config

    for bad, field in (({"r": 0}, "lora.r"), ({"r": -3}, "lora.r"), ({"rank": 4}, "lora.rank")):
        with pytest.raises(hfport.ConfigError, match=field):
            resolve_config({"model": "m", "train": "t", "lora": bad}, {})
    with pytest.raises(hfport.ConfigError, match="matches no layer"):
        finetune(base_config(workdir, workdir / "never", lora={"target_modules": ["nope"]}), progress=False)
    assert not (workdir / "never" / "best").exists()


def test_adapter_over_another_base_is_refused(bases, tmp_path):
    _perturbed_adapter("bert", "text-classification", bases["bert"], tmp_path / "a")
    wider = tmp_path / "wider"
    save_hf("bert", "base", wider, hidden_size=48, num_attention_heads=4)
    with pytest.raises(lora.LoraError, match=r"hidden_size 32 \(adapter\) vs 48 \(base\)"):
        hfport.AutoModelForSequenceClassification.from_pretrained(tmp_path / "a", base_model=wider)
    with pytest.raises(lora.LoraError, match=r"model_type 'bert' \(adapter\) vs 'roberta'"):
        hfport.AutoModelForSequenceClassification.from_pretrained(tmp_path / "a", base_model=bases["roberta"])
    (tmp_path / "a" / "config.json").unlink()  # no config to compare: the tensors' shapes tell
    with pytest.raises(lora.LoraError, match="do not fit the base model"):
        hfport.AutoModelForSequenceClassification.from_pretrained(tmp_path / "a", base_model=wider, num_labels=3)


@pytest.mark.parametrize("change, message", [({"peft_type": "IA3"}, "peft_type 'IA3' is not supported"),
                                             ({"use_dora": True}, "use_dora = True is not supported"),
                                             ({"rank_pattern": {"query": 2}}, "rank_pattern"),
                                             ({"r": 0}, "r must be a positive integer")])
def test_unsupported_peft_configs_are_refused(change, message, bases, tmp_path):
    _perturbed_adapter("bert", "text-classification", bases["bert"], tmp_path / "a")
    path = tmp_path / "a" / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(lora.LoraError, match=message):
        hfport.AutoModelForSequenceClassification.from_pretrained(tmp_path / "a")
    report = hfport.verify(tmp_path / "a")
    assert not report.passed and message.split()[0] in report.table()
