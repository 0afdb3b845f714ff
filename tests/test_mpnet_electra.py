"""MPNet, ELECTRA and CamemBERT beyond the parity grid (tests/test_parity.py and test_multiple_choice.py run them
at their tiny.py shapes): their config options honoured or refused by name, MPNet's bucketed bias against
transformers' bucket function and over left padding and holes, ELECTRA's SequenceSummary variants, save_pretrained
folders transformers loads with no missing or unexpected key, ELECTRA discriminator checkpoints, tokenizers in the
families' layouts, and MPNet end to end (sentence-embedding fine-tune -> sentence-transformers folder verified by
sentence-transformers -> served through TEI's /embed and OpenAI's embeddings).

Tolerance: fp32 1e-5 absolute (rtol 1.3e-6), the grid's (tests/parity.py says why the rtol)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import hfport
from hfport.errors import ConfigError
from hfport.nn.bucketed import relative_bucket
from tests.parity import ATOL, RTOL, choice_batch, compare_choices, compare_family, compare_models, load_ours, real
from tests.tiny import HEADS, OTHER_HEADS, batch, hf_config, save_hf
from tests.tiny_tokenizers import build_camembert_tokenizer, build_mpnet_tokenizer, check_parity

torch.set_num_threads(1)
FAMILIES = ("mpnet", "electra", "camembert")


# --- MPNet's bucketed relative bias ---------------------------------------------------------------------------


def test_buckets_are_transformers_buckets():
    from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

    ids = torch.arange(300)
    relative = ids[None, :] - ids[:, None]  # (T, T): key - query, past max_distance both ways
    for buckets, distance in ((32, 128), (64, 256)):
        theirs = MPNetEncoder.relative_position_bucket(relative, num_buckets=buckets, max_distance=distance)
        assert torch.equal(relative_bucket(relative, buckets, distance), theirs)
    assert int(relative_bucket(relative).max()) == 31 and int(relative_bucket(relative).min()) == 0


def test_a_larger_bucket_table_is_honoured(tmp_path):
    """transformers buckets into 32 whatever relative_attention_num_buckets says: a 40-row table's rows 32..39
    are never read (no gradient on either side)."""
    compare_family("mpnet", "base", tmp_path, relative_attention_num_buckets=40)


def test_a_smaller_bucket_table_is_refused(tmp_path):
    save_hf("mpnet", "base", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["relative_attention_num_buckets"] = 16
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="field 'relative_attention_num_buckets': 16 is not supported"):
        hfport.AutoModel.from_pretrained(tmp_path)


def layouts(family: str) -> dict[str, dict[str, torch.Tensor]]:
    """The grid's batch right-padded, left-padded, and with a hole in one row's mask (a padded token inside)."""
    right = batch(family)
    left = {k: v.flip(1) for k, v in right.items()}
    holes = {k: v.clone() for k, v in right.items()}
    holes["attention_mask"][1, 5] = 0
    return {"right": right, "left": left, "holes": holes}


@pytest.mark.parametrize("padding_free", [True, False])
@pytest.mark.parametrize("layout", ["right", "left", "holes"])
@pytest.mark.parametrize("family", FAMILIES)
def test_layouts_match_transformers(family, layout, padding_free, tmp_path):
    """Right, left and holed masks, padding-free and padded. MPNet's bias depends on distances counted over the
    padded row: equal at real tokens for left padding; a hole shifts distances, so such a batch runs in the padded
    layout (as transformers counts them)."""
    ref = save_hf(family, "token-classification", tmp_path)
    ours = load_ours("token-classification", tmp_path, padding_free)
    inputs = layouts(family)[layout]
    mask = inputs["attention_mask"]
    labels = torch.randint(0, 3, mask.shape, generator=torch.Generator().manual_seed(4)).masked_fill(mask == 0, -100)
    compare_models(ref, ours, inputs, "token-classification", labels={"labels": labels}, padding_free=padding_free,
                   name=f"{family}/{layout}")
    if family == "mpnet":
        assert ours.body.encoder.relative.table.weight.grad[:32].abs().sum() > 0


def test_mpnet_sequences_past_the_bucket_range(tmp_path):
    """A 200-token sequence: distances past max_distance 128 land in the last bucket of each direction; outputs
    and the shared table's gradient equal transformers'."""
    ref = save_hf("mpnet", "base", tmp_path, max_position_embeddings=260)
    ours = hfport.AutoModel.from_pretrained(tmp_path)
    inputs = batch("mpnet", lengths=(200, 13), pairs=False)
    mask = inputs["attention_mask"]
    w = torch.randn(32, generator=torch.Generator().manual_seed(3))
    a, b = ours(**inputs).last_hidden_state, ref(**inputs).last_hidden_state
    torch.testing.assert_close(real(a, mask), real(b, mask).detach(), atol=ATOL, rtol=RTOL)
    (real(a, mask) @ w).mean().backward()
    (real(b, mask) @ w).mean().backward()
    grad = ours.body.encoder.relative.table.weight.grad
    torch.testing.assert_close(grad, ref.encoder.relative_attention_bias.weight.grad, atol=ATOL, rtol=RTOL)
    assert grad[15].abs().sum() > 0 and grad[31].abs().sum() > 0  # the far buckets, both directions


def test_mpnet_gradient_checkpointing_gives_the_same_gradients(tmp_path):
    """The bias callback travels through torch.utils.checkpoint with the layer: dropout on, same masks replayed."""
    save_hf("mpnet", "sequence-classification", tmp_path)
    inputs, labels = batch("mpnet"), torch.tensor([0, 2, 1])
    grads = []
    for checkpointed in (False, True):
        model = hfport.AutoModelForSequenceClassification.from_pretrained(tmp_path).train()
        model.gradient_checkpointing_enable(checkpointed)
        torch.manual_seed(7)
        model(**inputs, labels=labels).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=ATOL, rtol=RTOL, msg=name)


def test_mpnet_ignores_token_types_and_classifier_dropout(tmp_path):
    """MPNet has no token-type table (type_vocab_size in config.json is unused) and its heads use
    hidden_dropout_prob whatever classifier_dropout says (transformers never reads it)."""
    save_hf("mpnet", "sequence-classification", tmp_path, type_vocab_size=2, classifier_dropout=0.7)
    ours = hfport.AutoModelForSequenceClassification.from_pretrained(tmp_path)
    assert ours.body.embeddings.token_type is None
    assert ours.head.dropout.p == ours.head.pre_dropout.p == ours.config.hidden_dropout == 0.1


# --- the families' options against transformers -----------------------------------------------------------------


@pytest.mark.parametrize("family,task,overrides", [
    ("electra", "sequence-classification", {"embedding_size": 32}),  # no embeddings_project
    ("electra", "masked-lm", {"tie_word_embeddings": False}),
    ("mpnet", "masked-lm", {"tie_word_embeddings": False}),
    ("camembert", "masked-lm", {"tie_word_embeddings": False}),
    ("electra", "token-classification", {"hidden_act": "gelu_new", "layer_norm_eps": 1e-5}),
    ("mpnet", "sequence-classification", {"hidden_act": "relu", "layer_norm_eps": 1e-5}),
])
def test_family_options(family, task, overrides, tmp_path):
    compare_family(family, task, tmp_path, **overrides)


def test_electra_without_projection_has_no_project_key(tmp_path):
    save_hf("electra", "base", tmp_path, embedding_size=32)
    assert hfport.AutoModel.from_pretrained(tmp_path).body.embeddings.project is None


# ELECTRA's SequenceSummary: "first" is exact on padded batches (the grid); the others read padding positions in
# transformers ("last": position T - 1, "mean": every position), so they are compared on unpadded rows
SUMMARIES = [
    {"summary_type": "first", "summary_activation": "tanh", "summary_first_dropout": 0.2},
    {"summary_type": "first", "summary_activation": "linear"},
    {"summary_type": "first", "summary_activation": ""},  # no activation
    {"summary_type": "first", "summary_use_proj": False, "summary_activation": ""},
    {"summary_type": "last"}, {"summary_type": "mean"}, {"summary_type": "cls_index"},
]


@pytest.mark.parametrize("overrides", SUMMARIES, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_electra_sequence_summary(overrides, tmp_path):
    if overrides["summary_type"] == "first":
        compare_choices("electra", tmp_path, **overrides)
        return
    ref = save_hf("electra", "multiple-choice", tmp_path, **overrides)
    ours = hfport.AutoModelForMultipleChoice.from_pretrained(tmp_path)
    inputs = choice_batch("electra", lengths=(20,) * 6)  # unpadded
    labels = torch.tensor([1, 2])
    a, b = ours(**inputs, labels=labels), ref(**inputs, labels=labels)
    torch.testing.assert_close(a.logits, b.logits.detach(), atol=ATOL, rtol=RTOL)
    a.loss.backward()
    b.loss.backward()
    torch.testing.assert_close(ours.head.dense.weight.grad, ref.sequence_summary.summary.weight.grad, atol=ATOL,
                               rtol=RTOL)
    # on padded rows hfport reads the real tokens (the last one, or their mean): padding-free does not change it
    padded = choice_batch("electra")
    ours.padding_free = False
    with torch.no_grad():
        expected = ours(**padded).logits
    ours.padding_free = True
    with torch.no_grad():
        torch.testing.assert_close(ours(**padded).logits, expected, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("family,changes,fragment", [
    ("electra", {"summary_type": "attn"}, "field 'summary_type': 'attn' is not supported"),
    ("electra", {"summary_proj_to_labels": True}, "field 'summary_proj_to_labels': true projects to num_labels (2)"),
    ("electra", {"summary_activation": "swishy"}, "field 'summary_activation': 'swishy' is not supported"),
    ("electra", {"is_decoder": True}, "field 'is_decoder': true is not supported"),
    ("electra", {"add_cross_attention": True}, "field 'add_cross_attention': true is not supported"),
    # a *ForCausalLM / BertLMHeadModel checkpoint: refused by every family on BERT's config, not run bidirectionally
    ("bert", {"is_decoder": True}, "field 'is_decoder': true is not supported"),
    ("roberta", {"is_decoder": True, "architectures": ["RobertaForCausalLM"]}, "field 'is_decoder'"),
    ("xlm-roberta", {"add_cross_attention": True}, "field 'add_cross_attention': true is not supported"),
    ("camembert", {"is_decoder": True}, "field 'is_decoder': true is not supported"),
    ("mpnet", {"relative_attention_num_buckets": "32"}, "field 'relative_attention_num_buckets'"),
])
def test_refused_options_are_named(family, changes, fragment, tmp_path):
    save_hf(family, "base", tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    with pytest.raises(ConfigError) as e:
        hfport.AutoModel.from_pretrained(tmp_path)
    assert fragment in str(e.value) and str(path) in str(e.value)


# --- checkpoints both ways ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_loads_in_transformers_with_every_key(family, tmp_path):
    """Loaded and fresh models of every head: transformers reads hfport's folder with zero missing or unexpected
    keys, under the architecture transformers names, and computes the same outputs."""
    import transformers

    inputs = batch(family)
    mask = inputs["attention_mask"]
    for head, auto in {**HEADS, **OTHER_HEADS}.items():
        src, out, fresh = tmp_path / f"{head}-src", tmp_path / f"{head}-out", tmp_path / f"{head}-fresh"
        ref = save_hf(family, head, src)
        ours_class = getattr(hfport, auto)
        ours_class.from_pretrained(src).save_pretrained(out)
        ours_class.from_config(ref.config.to_dict()).save_pretrained(fresh)
        for folder in (out, fresh):
            back, info = getattr(transformers, auto).from_pretrained(folder, output_loading_info=True)
            assert not info["missing_keys"] and not info["unexpected_keys"], (family, head, folder.name, info)
            assert type(back).__name__ == json.loads((folder / "config.json").read_text())["architectures"][0]
        if head == "multiple-choice":
            continue
        back = getattr(transformers, auto).from_pretrained(out).eval()
        with torch.no_grad():
            a, b = back(**inputs), ref(**inputs)
        key = "start_logits" if head == "question-answering" else "last_hidden_state" if head == "base" else "logits"
        torch.testing.assert_close(real(getattr(a, key), mask), real(getattr(b, key), mask), atol=0, rtol=0)


def test_electra_discriminator_checkpoints_load(tmp_path):
    """ElectraForPreTraining (the discriminators users fine-tune): its replaced-token-detection head is known and
    unused (reported as transformers reports it), the body loads whole; a classifier on it initialises only its own
    head."""
    import transformers

    config = hf_config("electra")
    torch.manual_seed(0)
    ref = transformers.ElectraForPreTraining(config).eval()
    ref.save_pretrained(tmp_path)
    base = hfport.AutoModel.from_pretrained(tmp_path)
    assert not base.load_report.initialized, base.load_report.summary()
    assert sorted(base.load_report.unexpected) == sorted(
        f"discriminator_predictions.{m}.{p}" for m in ("dense", "dense_prediction") for p in ("weight", "bias"))
    inputs = batch("electra")
    with torch.no_grad():
        a, b = base(**inputs).last_hidden_state, ref.electra(**inputs).last_hidden_state
    torch.testing.assert_close(real(a, inputs["attention_mask"]), real(b, inputs["attention_mask"]), atol=ATOL,
                               rtol=RTOL)
    classifier = hfport.AutoModelForSequenceClassification.from_pretrained(tmp_path, num_labels=2)
    assert sorted(classifier.load_report.initialized) == sorted(
        f"head.{m}.{p}" for m in ("dense", "out") for p in ("weight", "bias"))


def test_camembert_is_roberta_under_its_own_names(tmp_path):
    save_hf("camembert", "sequence-classification", tmp_path)
    ours = hfport.AutoModelForSequenceClassification.from_pretrained(tmp_path)
    assert ours.family.architectures["fill-mask"] == "CamembertForMaskedLM"
    assert ours.hf_names()["body.embeddings.position.weight"] == "roberta.embeddings.position_embeddings.weight"


# --- tokenizers in the families' layouts ----------------------------------------------------------------------


@pytest.mark.parametrize("family", ["mpnet", "camembert"])
def test_family_tokenizer_matches_transformers(family, tmp_path):
    folder = (build_mpnet_tokenizer if family == "mpnet" else build_camembert_tokenizer)(tmp_path / family)
    check_parity(folder)
    ours = hfport.AutoTokenizer.from_pretrained(folder)
    assert ours.model_input_names == ["input_ids", "attention_mask"]  # no token types, as the models
    if family == "mpnet":
        assert (ours.cls_token_id, ours.pad_token_id, ours.sep_token_id) == (0, 1, 2)  # padding_idx 1


# --- end to end: fine-tune, export, verify with sentence-transformers, serve ---------------------------------------

DATA = Path(__file__).resolve().parents[1] / "examples" / "data"
QUERIES = ["What money do people pay with in Vietnam?", "Where is Berlin?", "ok"]


def cli(*args: str) -> None:
    from typer.testing import CliRunner

    from hfport.cli import app

    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, (result.output, result.exception)


def service(tmp_path: Path, models: dict[str, Path]):
    """An in-process service (fp32, no job worker) with `models` registered."""
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.settings import Settings

    client = TestClient(create_app(Settings(data_dir=tmp_path / "data", allowed_dirs=[tmp_path],
                                            batch_token_budgets=[], predict_dtype="float32"), run_worker=False))
    client.__enter__()
    for name, path in models.items():
        r = client.post("/models", json={"name": name, "path": str(path)})
        assert r.status_code == 201, r.text
    return client


def test_mpnet_sentence_embedding_end_to_end(tmp_path):
    """`hfport finetune --task sentence-embedding` on an MPNet base (its own tokenizer), `hfport export --verify`
    (sentence-transformers encodes the folder and agrees), then the folder served: TEI's /embed and OpenAI's
    embeddings answer what SentenceTransformer.encode answers, with the folder's pooling and normalization."""
    from sentence_transformers import SentenceTransformer

    base = build_mpnet_tokenizer(tmp_path / "base")
    save_hf("mpnet", "base", base, vocab_size=len(hfport.AutoTokenizer.from_pretrained(base)),
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    run, out = tmp_path / "run", tmp_path / "export"
    cli("finetune", "--model", str(base), "--task", "sentence-embedding", "--train", str(DATA / "embed_train.jsonl"),
        "--eval", str(DATA / "embed_eval.jsonl"), "--output-dir", str(run), "--max-steps", "4", "--batch-size", "8",
        "--lr", "1e-3", "--precision", "fp32", "--set", "pooling=mean", "--set", "normalize=true", "-q")
    cli("export", str(run), "--out", str(out), "--verify", "-q")
    assert {"modules.json", "1_Pooling", "2_Normalize"} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "config.json").read_text())["architectures"] == ["MPNetModel"]
    want = SentenceTransformer(str(out), device="cpu").encode(QUERIES, convert_to_tensor=True)  # (B, C), unit
    assert torch.allclose(want.norm(dim=-1), torch.ones(len(QUERIES)), atol=1e-5)
    client = service(tmp_path, {"mpnet": out})
    try:
        embed = client.post("/embed", json={"inputs": QUERIES}, headers={"x-model": "mpnet"})
        assert embed.status_code == 200, embed.text
        openai = client.post("/v1/embeddings", json={"input": QUERIES, "model": "mpnet"})
        assert openai.status_code == 200, openai.text
    finally:
        client.__exit__(None, None, None)
    torch.testing.assert_close(torch.tensor(embed.json()), want, atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.tensor([d["embedding"] for d in openai.json()["data"]]), want, atol=ATOL, rtol=0)


def test_electra_reranker_end_to_end(tmp_path, minilm_path):
    """`hfport finetune --task text-ranking` on an ELECTRA base (BERT's WordPiece, as ELECTRA ships), exported and
    verified with sentence-transformers' CrossEncoder, then served through TEI's /rerank with CrossEncoder's scores."""
    import shutil

    from sentence_transformers import CrossEncoder

    base = tmp_path / "base"
    save_hf("electra", "base", base, vocab_size=30522)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(minilm_path / name, base / name)
    run, out = tmp_path / "run", tmp_path / "export"
    cli("finetune", "--model", str(base), "--task", "text-ranking", "--train", str(DATA / "rerank_train.jsonl"),
        "--eval", str(DATA / "rerank_eval.jsonl"), "--output-dir", str(run), "--max-steps", "4", "--batch-size", "8",
        "--lr", "1e-3", "--precision", "fp32", "-q")
    cli("export", str(run), "--out", str(out), "--verify", "-q")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["ElectraForSequenceClassification"]
    texts = ["Hanoi is the capital of Vietnam.", "Berlin lies on the Spree.", "The dong is Vietnam's currency."]
    want = CrossEncoder(str(out), device="cpu").predict([(QUERIES[0], t) for t in texts])  # sigmoid scores
    client = service(tmp_path, {"electra": out})
    try:
        r = client.post("/rerank", json={"query": QUERIES[0], "texts": texts}, headers={"x-model": "electra"})
        assert r.status_code == 200, r.text
    finally:
        client.__exit__(None, None, None)
    got = {x["index"]: x["score"] for x in r.json()}
    torch.testing.assert_close(torch.tensor([got[i] for i in range(len(texts))]), torch.tensor(want), atol=ATOL,
                               rtol=0)
