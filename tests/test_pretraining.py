"""The pre-training heads: pretraining (BertForPreTraining: masked LM + next-sentence prediction; AlbertForPreTraining:
masked LM + sentence-order prediction; ElectraForPreTraining: replaced-token detection) and next-sentence-prediction
(BertForNextSentencePrediction), against transformers on padded batches of pairs with a long row: outputs, losses
with labels and every gradient at real positions (fp32, tests/parity.py's 1e-5); tied decoders; cross-loading with
the other heads; hfport's save read back by transformers into the same class."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import hfport
from hfport import tasks
from hfport.errors import ConfigError
from hfport.registry import FAMILIES
from tests import grid
from tests.parity import compare_models, load_ours, outputs_of, real
from tests.tiny import batch, save_hf, save_with_tokenizer

PT, NSP = "pretraining", "next-sentence-prediction"
# (family, task) -> the transformers class the checkpoint is
CLASSES = {("bert", PT): "BertForPreTraining", ("albert", PT): "AlbertForPreTraining",
           ("electra", PT): "ElectraForPreTraining", ("bert", NSP): "BertForNextSentencePrediction"}
CASES = list(CLASSES)
PAIR_LABEL = {"bert": "next_sentence_label", "albert": "sentence_order_label"}


def pretraining_labels(family: str, task: str, inputs: dict[str, torch.Tensor], seed: int = 2) -> dict:
    """Seeded labels as each class takes them: masked-LM targets at ~30% of the real positions (-100 elsewhere) and
    the pair's class (BERT, ALBERT); ELECTRA's replaced-token flags (0/1, at padding too: its loss must skip them);
    next-sentence prediction's pair class as `labels`."""
    g = torch.Generator().manual_seed(seed)
    mask = inputs["attention_mask"]
    b, t = mask.shape
    pair = torch.tensor([0, 1, 1])[:b]
    if task == NSP:
        return {"labels": pair}
    if family == "electra":
        return {"labels": torch.randint(0, 2, (b, t), generator=g)}
    chosen = (torch.rand(b, t, generator=g) < 0.3) & mask.bool()
    mlm = torch.where(chosen, inputs["input_ids"], torch.full_like(inputs["input_ids"], -100))
    return {"labels": mlm, PAIR_LABEL[family]: pair}


def compare(family: str, task: str, folder: Path, *, padding_free: bool = True, inputs: dict | None = None,
            **overrides) -> float:
    ref = save_hf(family, task, folder, **overrides)
    assert type(ref).__name__ == CLASSES[family, task]
    ours = load_ours(task, folder, padding_free)  # every tensor read: nothing fresh, nothing unused
    assert ours.family.architectures[task] == CLASSES[family, task]
    # rows of 70, 41, 9 tokens; two segments each where the model has two token types
    inputs = inputs if inputs is not None else batch(family, pairs=overrides.get("type_vocab_size", 2) > 1)
    worst = compare_models(ref, ours, inputs, task, labels=pretraining_labels(family, task, inputs),
                           name=f"{family}/{task}", padding_free=padding_free)
    grid.record(family, task, worst)
    return worst


# --- parity with transformers --------------------------------------------------------------------------------------


@pytest.mark.parametrize("family,task", CASES)
def test_parity_with_transformers(family, task, tmp_path):
    compare(family, task, tmp_path)


@pytest.mark.parametrize("family,task", CASES)
def test_parity_on_the_padded_layout(family, task, tmp_path):
    compare(family, task, tmp_path, padding_free=False)


@pytest.mark.parametrize("family,overrides", [
    ("bert", {"tie_word_embeddings": False}),  # a decoder of its own, with its own bias
    ("albert", {"tie_word_embeddings": False}),
    ("bert", {"type_vocab_size": 1, "hidden_act": "gelu_new"}),
    ("albert", {"classifier_dropout_prob": 0.3, "hidden_act": "relu"}),  # SOP's dropout (off in eval)
    ("electra", {"embedding_size": 32, "hidden_act": "relu"}),  # no embeddings_project; the discriminator's act
])
def test_parity_head_variants(family, overrides, tmp_path):
    compare(family, PT, tmp_path, **overrides)


def test_sentence_pair_dropout_is_transformers(tmp_path):
    """ALBERT's sentence-order classifier drops classifier_dropout_prob first; BERT's next-sentence layer drops
    nothing (dropout is off in the parity tests' eval mode, so its rate is checked here)."""
    albert = save_hf("albert", PT, tmp_path / "albert", classifier_dropout_prob=0.3)
    assert load_ours(PT, tmp_path / "albert").head.pair.dropout.p == albert.sop_classifier.dropout.p == 0.3
    save_hf("bert", PT, tmp_path / "bert", hidden_dropout_prob=0.2)
    assert load_ours(PT, tmp_path / "bert").head.pair.dropout.p == 0.0


def test_electra_loss_without_an_attention_mask(tmp_path):
    """Without a mask transformers' BCE runs over every position (its other branch): unpadded rows, no mask."""
    inputs = batch("electra", lengths=(40, 40))
    del inputs["attention_mask"]
    ref = save_hf("electra", PT, tmp_path)
    ours = load_ours(PT, tmp_path)
    labels = {"labels": torch.randint(0, 2, (2, 40), generator=torch.Generator().manual_seed(0))}
    a, b = ours(**inputs, **labels), ref(**inputs, **labels)
    torch.testing.assert_close(a.loss, b.loss.detach(), atol=1e-5, rtol=1.3e-6)
    torch.testing.assert_close(a.logits, b.logits.detach(), atol=1e-5, rtol=1.3e-6)


def test_outputs_and_losses_are_transformers_fields(tmp_path):
    """Each class's output fields and nothing else; a loss only where transformers gives one (BERT and ALBERT: both
    labels, one alone gives none)."""
    for (family, task), name in CLASSES.items():
        folder = tmp_path / name
        ref = save_hf(family, task, folder)
        ours = load_ours(task, folder)
        inputs = batch(family)
        labels = pretraining_labels(family, task, inputs)
        with torch.no_grad():
            out, theirs = ours(**inputs, **labels), ref(**inputs, **labels)
        assert set(out.keys()) == {k for k, v in theirs.items() if v is not None}, (name, out.keys(), theirs.keys())
        assert set(outputs_of(task, out)) == set(out.keys()) - {"loss"}
        if family in PAIR_LABEL and task == PT:
            for alone in ({"labels": labels["labels"]}, {PAIR_LABEL[family]: labels[PAIR_LABEL[family]]}):
                assert ours(**inputs, **alone).loss is None and ref(**inputs, **alone).loss is None


def test_a_pair_label_the_head_does_not_have_is_refused(tmp_path):
    inputs = batch("bert")
    save_hf("bert", PT, tmp_path / "bert")
    save_hf("electra", PT, tmp_path / "electra")
    bert, electra = (hfport.AutoModelForPreTraining.from_pretrained(tmp_path / f) for f in ("bert", "electra"))
    with pytest.raises(ValueError, match="BertForPreTraining takes next_sentence_label, not sentence_order_label"):
        bert(**inputs, sentence_order_label=torch.tensor([0, 1, 0]))
    with pytest.raises(ValueError, match="ElectraForPreTraining takes no sentence-pair label, not next_sentence_"):
        electra(**inputs, next_sentence_label=torch.tensor([0, 1, 0]))


# --- loading: tied decoders, other heads, load_any ----------------------------------------------------------------


@pytest.mark.parametrize("family", ["bert", "albert"])
def test_the_tied_decoder_is_the_word_embedding_matrix(family, tmp_path):
    """As transformers ties it: the MLM decoder is the word embeddings (an edit to one shows in the logits), its bias
    the head's bias; the folder transformers saved holds neither decoder tensor, and loading reports none."""
    ref = save_hf(family, PT, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert not [k for k in f.keys() if "decoder" in k]
    ours = load_ours(PT, tmp_path)
    assert ours.head.mlm.decoder is None
    inputs = batch(family)
    with torch.no_grad():
        ours.get_input_embeddings().weight[5] += 1.0
        ref.get_input_embeddings().weight[5] += 1.0  # transformers' decoder row 5 moves with it
        a, b = ours(**inputs).prediction_logits, ref(**inputs).prediction_logits
    mask = inputs["attention_mask"]
    torch.testing.assert_close(real(a, mask), real(b, mask), atol=1e-5, rtol=1.3e-6)


def test_a_pretraining_checkpoint_loads_into_each_of_its_heads(tmp_path):
    """BertForPreTraining's weights feed the MLM head (next-sentence keys unused) and the next-sentence head (MLM
    keys unused), each computing what transformers' class computes from the same folder; load_any picks the class
    config.json names, with no note."""
    import transformers

    ref = save_hf("bert", PT, tmp_path)
    inputs = batch("bert")
    mask = inputs["attention_mask"]
    with torch.no_grad():
        full = ref(**inputs)
    mlm = hfport.AutoModelForMaskedLM.from_pretrained(tmp_path)
    assert not mlm.load_report.initialized
    assert sorted(mlm.load_report.unexpected) == ["bert.pooler.dense.bias", "bert.pooler.dense.weight",
                                                  "cls.seq_relationship.bias", "cls.seq_relationship.weight"]
    nsp = hfport.AutoModelForNextSentencePrediction.from_pretrained(tmp_path)
    assert not nsp.load_report.initialized
    assert sorted(nsp.load_report.unexpected) == sorted(
        k for k in transformers.BertForPreTraining.from_pretrained(tmp_path).state_dict()
        if k.startswith("cls.predictions.") and "decoder" not in k)
    with torch.no_grad():
        torch.testing.assert_close(real(mlm(**inputs).logits, mask), real(full.prediction_logits, mask),
                                   atol=1e-5, rtol=1.3e-6)
        torch.testing.assert_close(nsp(**inputs).logits, full.seq_relationship_logits, atol=1e-5, rtol=1.3e-6)
    loaded = hfport.load_any(tmp_path)
    assert isinstance(loaded, hfport.AutoModelForPreTraining) and not loaded.load_report.notes


def test_electra_discriminator_through_load_any_and_a_classifier(tmp_path):
    save_hf("electra", PT, tmp_path)
    model = hfport.load_any(tmp_path)
    assert model.task == PT and not model.load_report.unexpected and not model.load_report.initialized
    classifier = hfport.AutoModelForSequenceClassification.from_pretrained(tmp_path, num_labels=2)
    assert sorted(classifier.load_report.unexpected) == sorted(
        f"discriminator_predictions.{m}.{p}" for m in ("dense", "dense_prediction") for p in ("weight", "bias"))


def test_a_masked_lm_checkpoint_into_pretraining_initialises_only_what_it_lacks(tmp_path):
    """BertForMaskedLM has no pooler and no next-sentence head: both start fresh and are reported, as transformers
    reports them missing; the MLM head loads."""
    save_hf("bert", "masked-lm", tmp_path)
    model = hfport.AutoModelForPreTraining.from_pretrained(tmp_path)
    assert sorted(model.load_report.initialized) == ["body.pooler.dense.bias", "body.pooler.dense.weight",
                                                     "head.pair.out.bias", "head.pair.out.weight"]
    assert not model.load_report.unexpected


def test_families_without_the_head_refuse_it(tmp_path):
    """transformers has no RobertaForPreTraining (its AutoModelForPreTraining gives RobertaForMaskedLM) nor an
    ALBERT or ELECTRA next-sentence class: hfport refuses, naming the classes the family has."""
    save_hf("roberta", "masked-lm", tmp_path / "roberta")
    with pytest.raises(ConfigError, match=r"'roberta' has no pretraining model.*RobertaForMaskedLM"):
        hfport.AutoModelForPreTraining.from_pretrained(tmp_path / "roberta")
    save_hf("albert", PT, tmp_path / "albert")
    with pytest.raises(ConfigError, match=r"'albert' has no next-sentence-prediction model.*AlbertForPreTraining"):
        hfport.AutoModelForNextSentencePrediction.from_pretrained(tmp_path / "albert")
    assert {f.model_type for f in FAMILIES.values() if PT in f.architectures} == {"bert", "albert", "electra"}
    assert {f.model_type for f in FAMILIES.values() if NSP in f.architectures} == {"bert"}


# --- saving: transformers reads hfport's folder into the same class -----------------------------------------------


@pytest.mark.parametrize("family,task", CASES)
@pytest.mark.parametrize("tied", [True, False])
def test_save_pretrained_round_trip(family, task, tied, tmp_path):
    """Loaded and fresh models: transformers reads hfport's folder with no missing or unexpected key into the class
    config.json names (the checkpoint's), and computes the same outputs as the source."""
    import transformers

    ref = save_hf(family, task, tmp_path / "src", tie_word_embeddings=tied)
    auto = getattr(hfport, tasks.get(task).auto_class)
    auto.from_pretrained(tmp_path / "src").save_pretrained(tmp_path / "out")
    auto.from_config(ref.config.to_dict()).save_pretrained(tmp_path / "fresh")
    for name in ("out", "fresh"):
        back, info = getattr(transformers, tasks.get(task).auto_class).from_pretrained(
            tmp_path / name, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], (name, info)
        assert type(back).__name__ == CLASSES[family, task]
        assert json.loads((tmp_path / name / "config.json").read_text())["architectures"] == [CLASSES[family, task]]
    back = getattr(transformers, CLASSES[family, task]).from_pretrained(tmp_path / "out").eval()
    inputs = batch(family)
    with torch.no_grad():
        a, b = outputs_of(task, back(**inputs)), outputs_of(task, ref(**inputs))
    assert a.keys() == b.keys()
    mask = inputs["attention_mask"]
    for key in a:  # the same weights: equal at the real positions
        torch.testing.assert_close(real(a[key], mask), real(b[key], mask), atol=0, rtol=0)


# --- no pipeline: the heads load, pipelines serve the body ----------------------------------------------------------


def test_records_are_model_only(tmp_path, minilm_path):
    """No pipeline for them (a clear error naming the class that loads them); a folder of one serves as its body
    does, so fill-mask still runs on a BertForPreTraining folder (its MLM head is whole)."""
    for task in (PT, NSP):
        record = tasks.get(task)
        assert record.pipeline is None and record.train is None and not record.every_family
        assert task not in tasks.PIPELINE_TASKS and task in tasks.MODEL_TASKS
        with pytest.raises(ValueError, match=f"{task} has no pipeline: load the model with hfport.{record.auto_class}"):
            hfport.pipeline(task, model=tmp_path)
    folder = tmp_path / "bert"
    save_with_tokenizer("bert", PT, folder, minilm_path, vocab_size=30522)
    assert hfport.model_task(folder) == "feature-extraction"
    assert len(hfport.pipeline("fill-mask", model=folder)("the [MASK] was good", top_k=2)) == 2


def test_export_verifies_against_transformers_and_claims_no_pipeline(tmp_path, minilm_path):
    """`hfport export` of a pre-training folder keeps its head (load_any) and its verify passes against
    transformers' AutoModelForPreTraining on every output the class returns; the card names no pipeline tag, since
    transformers has no pipeline for the head."""
    source = tmp_path / "src"
    save_with_tokenizer("albert", PT, source, minilm_path, vocab_size=30522)
    result = hfport.export(source, tmp_path / "out", verify=True)
    assert result.task == PT and result.report.passed, result.report.table()
    compared = {r.output for r in result.report.rows if r.check == "outputs"}
    assert compared == {f"{b}/{o}" for b in ("texts", "pairs") for o in ("prediction_logits", "sop_logits")}
    card = (tmp_path / "out" / "README.md").read_text()
    front = card.split("---")[1]
    assert "pipeline_tag" not in front and "pretraining (no pipeline: `AutoModelForPreTraining` loads it)" in card
