"""ModernBERT's own variants against transformers' ModernBert* classes (the parity grid in test_parity.py covers the
default tiny config for every head): biases on and off, mean pooling, untied and bias-free decoders, activations,
layer patterns and windows, the older rope keys, left padding, masks with holes; then refusals (what transformers
refuses, hfport refuses for the same field; what hfport does not compute is named), saving back to transformers,
the tokenizer, pipelines, a fine-tune and an export with verify.

Tolerance: fp32 atol 1e-5 (rtol 1.3e-6) on outputs at real positions, losses and every gradient, tests/parity.py's.
Batches have 70-, 41- and 9-token sequences against a 16-token local window (8 tokens each side).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import hfport
from hfport.errors import ConfigError
from tests import parity
from tests.parity import ATOL, RTOL, assert_close_results, left_padded, outputs_of, real
from tests.tiny import HEADS, batch, build_hf, save_hf

TASKS = list(HEADS)


def check(task: str, folder: Path, *, left: bool = False, padding_free: bool = True, hole: bool = False,
          lengths: tuple[int, ...] = (70, 41, 9), ref=None) -> float:
    """hfport vs transformers from the same folder (tests/parity.py): outputs at real positions, the loss, every
    gradient; `hole`: a 5-token hole inside the longest row's mask. Padded QA is checked twice: gradients of the
    models' losses (padding scored, as transformers does) and of the loss over real positions."""
    inputs = batch("modernbert", lengths=lengths)
    if left:
        inputs = left_padded(inputs)
    if hole:
        inputs["attention_mask"][0, 20:25] = 0
    worst = parity.check(task, folder, inputs, ref=ref, left=left, padding_free=padding_free, name=task)
    if task == "question-answering" and not padding_free:
        worst = max(worst, parity.check(task, folder, inputs, left=left, padding_free=False, name=task,
                                        qa_real_positions=True))
    return worst


# --- variants ---------------------------------------------------------------------------------------------------

ALL_BIASES = dict(attention_bias=True, mlp_bias=True, norm_bias=True, classifier_bias=True)
VARIANTS = {
    "all biases": ALL_BIASES,
    "no decoder bias": dict(decoder_bias=False),
    "mean pooling": dict(classifier_pooling="mean"),
    "activations": dict(hidden_activation="gelu_pytorch_tanh", classifier_activation="silu", norm_eps=1e-6),
    "every layer sliding, odd window": dict(layer_types=["sliding_attention"] * 3, local_attention=7),
    "sliding first": dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "rope bases": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 500.0},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}}),
}


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variants(variant: str, task: str, tmp_path) -> None:
    save_hf("modernbert", task, tmp_path, **VARIANTS[variant])
    check(task, tmp_path)


@pytest.mark.parametrize("decoder_bias", [True, False])
def test_untied_decoder(decoder_bias: bool, tmp_path) -> None:
    ref = save_hf("modernbert", "masked-lm", tmp_path, tie_word_embeddings=False, decoder_bias=decoder_bias)
    assert ref.decoder.weight is not ref.model.embeddings.tok_embeddings.weight
    check("masked-lm", tmp_path)
    ours = hfport.AutoModelForMaskedLM.from_pretrained(tmp_path)
    assert ours.head.decoder is not None and (ours.head.bias is not None) == decoder_bias


@pytest.mark.parametrize("padding_free", [True, False])
@pytest.mark.parametrize("task", TASKS)
def test_left_padding(task: str, padding_free: bool, tmp_path) -> None:
    """Left padding shifts every position id; rotary scores and the window depend on differences only. With cls
    pooling transformers reads position 0, a padding token: padding_free=False does too (below); padding-free
    reads the first real token (test_cls_pooling_reads_the_first_real_token)."""
    overrides = {**ALL_BIASES, "classifier_pooling": "mean"} if task == "sequence-classification" and padding_free \
        else ALL_BIASES
    save_hf("modernbert", task, tmp_path, **overrides)
    check(task, tmp_path, left=True, padding_free=padding_free)


def test_cls_pooling_reads_the_first_real_token(tmp_path) -> None:
    ref = save_hf("modernbert", "sequence-classification", tmp_path)
    ours = hfport.AutoModelForSequenceClassification.from_pretrained(tmp_path)
    inputs = batch("modernbert")
    with torch.no_grad():
        right = ref(**inputs).logits
        left = ours(**left_padded(inputs)).logits
    torch.testing.assert_close(left, right, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("padding_free", [True, False])
def test_mask_with_a_hole_and_no_padding(padding_free: bool, tmp_path) -> None:
    """A hole keeps its width in the window (distances are between positions), as in transformers."""
    save_hf("modernbert", "token-classification", tmp_path, **ALL_BIASES)
    check("token-classification", tmp_path, hole=True, padding_free=padding_free)
    check("token-classification", tmp_path, lengths=(70, 70), padding_free=padding_free)  # nothing padded


def test_older_rope_keys(tmp_path) -> None:
    """Checkpoints from before transformers 5 carry global_rope_theta / local_rope_theta /
    global_attn_every_n_layers instead of rope_parameters / layer_types (ModernBERT-base's config.json does)."""
    save_hf("modernbert", "masked-lm", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ("layer_types", "rope_parameters"):
        config.pop(key)
    config |= {"global_rope_theta": 900.0, "local_rope_theta": 30.0, "global_attn_every_n_layers": 2,
               "reference_compile": None, "repad_logits_with_grad": False, "position_embedding_type": "absolute"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    ours = hfport.AutoModelForMaskedLM.from_pretrained(tmp_path)
    assert ours.config.extra["layer_types"] == ["full_attention", "sliding_attention", "full_attention"]
    assert ours.config.extra["rope_theta"] == {"full_attention": 900.0, "sliding_attention": 30.0}
    attn = [layer.attn for layer in ours.body.encoder.layers]
    assert [(a.window, a.rotary.theta) for a in attn] == [(None, 900.0), (16, 30.0), (None, 900.0)]
    check("masked-lm", tmp_path)


# --- refusals ---------------------------------------------------------------------------------------------------

def edited(tmp_path: Path, **changes: Any) -> Path:
    folder = tmp_path / "edited"
    if not folder.exists():
        save_hf("modernbert", "base", folder)
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is ...:
            config.pop(key, None)
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    return folder


# transformers refuses these (its config, its model or its forward), for the field named
REFUSED_BY_BOTH = [
    ("norm_bias", dict(norm_bias="yes")),
    ("vocab_size", dict(vocab_size=99.0)),
    ("norm_eps", dict(norm_eps=1)),
    ("local_attention", dict(local_attention="7")),
    ("classifier_pooling", dict(classifier_pooling="max")),
    ("layer_types", dict(layer_types=["full_attention"])),
    ("layer_types", dict(layer_types=["full_attention", "chunked_attention", "full_attention"])),
    ("global_attn_every_n_layers", dict(layer_types=..., global_attn_every_n_layers=0)),
    ("hidden_act", dict(hidden_activation="nope")),
    ("classifier_activation", dict(classifier_activation="nope")),
    ("num_attention_heads", dict(num_attention_heads=5)),
    ("head_dim", dict(head_dim=4)),
    ("rope_parameters.sliding_attention", dict(rope_parameters={"full_attention": {"rope_type": "default"},
                                                                "sliding_attention": None})),
    ("rope_parameters", dict(rope_parameters={"full_attention": {"rope_type": "default"}},
                             rope_scaling={"rope_type": "default"})),
]


@pytest.mark.parametrize("field,changes", REFUSED_BY_BOTH, ids=[f"{f}-{i}" for i, (f, _) in enumerate(REFUSED_BY_BOTH)])
def test_refused_as_transformers_refuses(field: str, changes: dict, tmp_path) -> None:
    import transformers

    folder = edited(tmp_path, **changes)
    with pytest.raises(Exception):  # its config class, its model constructor or its first forward
        transformers.ModernBertForSequenceClassification.from_pretrained(folder)(**batch("modernbert"))
    with pytest.raises(ConfigError) as e:
        hfport.AutoModelForSequenceClassification.from_pretrained(folder)
    assert "config.json" in str(e.value) and field in str(e.value), str(e.value)


NOT_COMPUTED = [  # transformers accepts these; hfport names what it does not compute
    ("rope_scaling", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    ("rope_parameters.full_attention", dict(rope_parameters={
        "full_attention": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
]


@pytest.mark.parametrize("field,changes", NOT_COMPUTED)
def test_refused_what_hfport_does_not_compute(field: str, changes: dict, tmp_path) -> None:
    import transformers

    folder = edited(tmp_path, **changes)
    transformers.ModernBertModel.from_pretrained(folder)  # accepted there
    with pytest.raises(ConfigError, match=f"config.json: field '{field}': rope_type"):
        hfport.AutoModel.from_pretrained(folder)


def test_sparse_prediction_refused_for_the_mlm_head_only(tmp_path) -> None:
    folder = edited(tmp_path, sparse_prediction=True)
    hfport.AutoModel.from_pretrained(folder)  # no MLM head: nothing changes
    with pytest.raises(ConfigError, match="field 'sparse_prediction'"):
        hfport.AutoModelForMaskedLM.from_pretrained(folder)


def test_accepted_configs_are_not_refused(tmp_path) -> None:
    """Keys transformers ignores or accepts without effect load: a rotary factor the default RoPE does not read, a
    layer type left out of rope_parameters, rope_type default spelled out in rope_scaling, older bookkeeping keys,
    head_dim equal to hidden / heads."""
    rope = {"full_attention": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}
    folder = edited(tmp_path, head_dim=8, reference_compile=True, deterministic_flash_attn=True, rope_parameters=rope)
    check("base", folder)
    folder = edited(tmp_path, rope_parameters=..., rope_scaling={"rope_type": "default"})
    check("base", folder)


# --- saving back --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides", [{}, dict(tie_word_embeddings=False, decoder_bias=False, **ALL_BIASES)])
def test_saved_folders_load_in_transformers(overrides: dict, tmp_path) -> None:
    import transformers

    for task in TASKS:
        save_hf("modernbert", task, tmp_path / task, **overrides)
        ours = getattr(hfport, HEADS[task]).from_pretrained(tmp_path / task)
        ours.save_pretrained(tmp_path / f"{task}-out")
        back, info = getattr(transformers, HEADS[task]).from_pretrained(tmp_path / f"{task}-out",
                                                                        output_loading_info=True)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), (task, info)
        ref = transformers.AutoConfig.from_pretrained(tmp_path / task)
        assert back.config.layer_types == ref.layer_types and back.config.rope_parameters == ref.rope_parameters
        inputs = batch("modernbert")
        with torch.no_grad():
            a, b = outputs_of(task, back.eval()(**inputs)), outputs_of(task, ours(**inputs))
        for key in a:
            mask = inputs["attention_mask"]
            torch.testing.assert_close(real(a[key], mask), real(b[key], mask), atol=ATOL, rtol=RTOL)


def test_fresh_model_init_follows_transformers() -> None:
    """from_config: truncated normals cut at initializer_cutoff_factor std, "out" projections scaled down."""
    raw = build_hf("modernbert", "base").config.to_dict()
    model = hfport.AutoModelForSequenceClassification.from_config(raw)
    c = model.config
    layer = model.body.encoder.layers[1]
    out_std = c.initializer_range / (2.0 * c.num_hidden_layers) ** 0.5
    assert layer.attn.o.weight.abs().max() <= 2.0 * out_std + 1e-7
    assert layer.attn.qkv.proj.weight.abs().max() <= 2.0 * c.initializer_range + 1e-7
    assert model.head.out.weight.abs().max() <= 2.0 * c.hidden_size ** -0.5 + 1e-7
    assert model.head.out.weight.std() > 0.5 * c.hidden_size ** -0.5  # not the default 0.02


# --- tokenizer, pipelines, fine-tune, export ---------------------------------------------------------------------

SPECIALS = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]  # ModernBERT's, in its order (ids 50280-50284 there)
CORPUS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France; Berlin is in Germany.",
          "Herman Melville wrote Moby-Dick in 1851.", "Straße, café, naïve: accents and ümlauts.",
          "Hugging Face builds tokenizers, models and pipelines!"] * 20


def modernbert_tokenizer(folder: Path) -> dict[str, int]:
    """A small byte-level BPE in ModernBERT's layout: tokenizer.json with [CLS] A [SEP] (B [SEP]) templates and
    tokenizer_config.json naming PreTrainedTokenizerFast (no slow files). Returns the special token ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=330, special_tokens=SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens([AddedToken("[MASK]", lstrip=True, special=True)])
    ids = {t: tok.token_to_id(t) for t in SPECIALS}
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0", pair="[CLS]:0 $A:0 [SEP]:0 $B:0 [SEP]:0",
        special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_input_names": ["input_ids", "attention_mask"],
        "clean_up_tokenization_spaces": True, "model_max_length": 96, "cls_token": "[CLS]", "sep_token": "[SEP]",
        "pad_token": "[PAD]", "mask_token": "[MASK]", "unk_token": "[UNK]"}))
    return ids


def model_folder(root: Path, task: str, **overrides: Any) -> Path:
    folder = root / task
    ids = modernbert_tokenizer(folder)
    labels = {"sequence-classification": {0: "neg", 1: "pos"},
              "token-classification": {0: "O", 1: "B-LOC", 2: "I-LOC"}}.get(task)
    extra = {"id2label": labels, "label2id": {v: k for k, v in labels.items()}} if labels else {}
    save_hf("modernbert", task, folder, vocab_size=330, pad_token_id=ids["[PAD]"], cls_token_id=ids["[CLS]"],
            bos_token_id=ids["[CLS]"], sep_token_id=ids["[SEP]"], eos_token_id=ids["[SEP]"], **extra, **overrides)
    return folder


TEXTS = ["Paris is the capital of France.", "The quick brown fox jumps over the lazy dog near Berlin!", "Moby"]


def test_tokenizer_matches_transformers(tmp_path) -> None:
    import transformers

    modernbert_tokenizer(tmp_path)
    ours, theirs = hfport.AutoTokenizer.from_pretrained(tmp_path), transformers.AutoTokenizer.from_pretrained(tmp_path)
    for args, kwargs in [((TEXTS,), {}), ((TEXTS, TEXTS[::-1]), {"padding": True}),
                         ((TEXTS,), {"truncation": True, "max_length": 6}), ((["a [MASK] b"],), {})]:
        a, b = ours(*args, **kwargs), theirs(*args, **kwargs)
        assert list(a.keys()) == list(b.keys()) == ["input_ids", "attention_mask"]
        assert a["input_ids"] == b["input_ids"] and a["attention_mask"] == b["attention_mask"], (args, kwargs)
    assert ours.pad_token_id == theirs.pad_token_id and ours.mask_token_id == theirs.mask_token_id


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("modernbert")
    return {task: model_folder(root, task) for task in TASKS}


def test_pipelines(folders) -> None:
    import transformers

    for task, name in (("sequence-classification", "text-classification"),
                       ("token-classification", "token-classification"), ("masked-lm", "fill-mask")):
        ours = hfport.pipeline(name, model=folders[task])
        theirs = transformers.pipeline(name, model=str(folders[task]), device="cpu")
        texts = [t.replace("capital", "[MASK]").replace("fox", "[MASK]") for t in TEXTS[:2]] if task == "masked-lm" \
            else TEXTS
        assert_close_results(ours(texts), theirs(texts), name)
    ours = hfport.pipeline("feature-extraction", model=folders["base"])
    theirs = transformers.pipeline("feature-extraction", model=str(folders["base"]), device="cpu")
    for a, b in zip(ours(TEXTS), theirs(TEXTS)):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=1e-4)
    qa = hfport.pipeline("question-answering", model=folders["question-answering"])
    context = "Herman Melville wrote Moby-Dick in 1851 in the United States."
    answers = qa(question="Who wrote Moby-Dick?", context=context, top_k=3)
    assert len(answers) == 3 and answers[0]["score"] >= answers[1]["score"] >= answers[2]["score"]
    for a in answers:
        assert context[a["start"]:a["end"]] == a["answer"] and a["answer"]


def test_finetune_export_and_verify(folders, tmp_path) -> None:
    from hfport.export import export
    from hfport.train.config import FinetuneConfig
    from hfport.train.loop import finetune

    with open(tmp_path / "train.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "label"])
        for i in range(24):
            writer.writerow([TEXTS[i % 3], "pos" if i % 3 == 0 else "neg"])
    summary = finetune(FinetuneConfig(model=str(folders["base"]), task="text-classification",
                                      train=str(tmp_path / "train.csv"), output_dir=str(tmp_path / "run"),
                                      max_steps=3, batch_size=8, eval_fraction=0.25), progress=False)
    assert summary["config"]["task"] == "text-classification" and "accuracy" in summary["best_metric"]
    result = export(tmp_path / "run", tmp_path / "out", verify=True)
    assert result.report.passed, result.report.table()
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "modernbert" and config["architectures"] == ["ModernBertForSequenceClassification"]
