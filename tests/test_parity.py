"""The parity matrix: every family x every head against transformers on the same weights and batch.

Outputs are compared at real (non-padding) positions only; hfport makes no promise about padding positions.
The comparison (outputs, losses, every gradient) and its tolerance, fp32 atol 1e-5 (rtol 1.3e-6), are
tests/parity.py's, shared with every family's own parity tests.
"""

from __future__ import annotations

import pytest
import torch

import hfport
from tests import grid
from tests.parity import ATOL, RTOL, compare_family, real
from tests.tiny import FAMILY_CONFIGS, HEADS, batch, save_hf

FAMILIES = list(FAMILY_CONFIGS)
TASKS = list(HEADS)


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("family", FAMILIES)
def test_parity(family, task, tmp_path):
    compare_family(family, task, tmp_path)


def test_parity_check_catches_a_nudged_weight(tmp_path, monkeypatch):
    """The comparison above must be able to fail: one weight off by 1e-3 is caught."""
    original = hfport.AutoModelForTokenClassification.from_pretrained

    def nudged(*args, **kwargs):
        model = original(*args, **kwargs)
        with torch.no_grad():
            model.body.encoder.layers[1].ffn.down.weight[0, 0] += 1e-3
        return model

    monkeypatch.setattr(hfport.AutoModelForTokenClassification, "from_pretrained", nudged)
    with pytest.raises(AssertionError):
        compare_family("distilbert", "token-classification", tmp_path)


def test_parity_check_catches_a_wrong_gradient(tmp_path, monkeypatch):
    """Outputs and loss equal, one gradient entry off by 1e-3: the gradient comparison names the parameter."""
    original = hfport.AutoModelForTokenClassification.from_pretrained

    def wrong_grad(*args, **kwargs):
        model = original(*args, **kwargs)
        weight = model.body.encoder.layers[1].ffn.down.weight
        off = torch.zeros_like(weight)
        off[0, 0] = 1e-3
        weight.register_hook(lambda grad: grad + off)
        return model

    monkeypatch.setattr(hfport.AutoModelForTokenClassification, "from_pretrained", wrong_grad)
    with pytest.raises(AssertionError, match=r"grad body\.encoder\.layers\.1\.ffn\.down\.weight"):
        compare_family("distilbert", "token-classification", tmp_path)


@pytest.mark.parametrize("act", ["gelu", "gelu_new", "relu", "silu", "swish", "gelu_fast", "gelu_pytorch_tanh",
                                 "quick_gelu", "gelu_python", "gelu_accurate", "gelu_10", "mish", "tanh",
                                 "sigmoid", "linear", "relu6", "relu2", "leaky_relu", "laplace", "hardswish"])
def test_hidden_act(act, tmp_path):
    compare_family("bert", "masked-lm", tmp_path, hidden_act=act)  # MLM: the activation runs in layers and head


@pytest.mark.parametrize("family", ["bert", "roberta", "albert", "distilbert"])
def test_untied_masked_lm(family, tmp_path):
    """tie_word_embeddings=False: a decoder of its own; BERT-style heads then use the decoder's bias."""
    compare_family(family, "masked-lm", tmp_path, tie_word_embeddings=False)


@pytest.mark.parametrize("overrides", [
    dict(type_vocab_size=1), dict(type_vocab_size=16), dict(layer_norm_eps=1e-5), dict(classifier_dropout=0.3)])
def test_bert_variants(overrides, tmp_path):
    compare_family("bert", "sequence-classification", tmp_path, **overrides)


@pytest.mark.parametrize("groups,inner,layers", [(1, 1, 2), (2, 1, 4), (1, 2, 2), (3, 2, 5)])
def test_albert_sharing(groups, inner, layers, tmp_path):
    compare_family("albert", "masked-lm", tmp_path, num_hidden_groups=groups, inner_group_num=inner,
            num_hidden_layers=layers)


def test_distilbert_sinusoidal(tmp_path):
    compare_family("distilbert", "sequence-classification", tmp_path, sinusoidal_pos_embds=True, activation="gelu")
    # a fresh hfport model starts from the same fixed table transformers builds
    from tests.tiny import build_hf

    ref = build_hf("distilbert", "base", sinusoidal_pos_embds=True)
    raw = ref.config.to_dict()
    ours = hfport.AutoModel.from_config(raw)
    torch.testing.assert_close(ours.body.embeddings.position.weight, ref.embeddings.position_embeddings.weight,
                               atol=1e-7, rtol=0)


def test_roberta_positions_from_padding(tmp_path):
    """Left padding moves RoBERTa's position ids; both implementations must agree on the real tokens."""
    ref = save_hf("roberta", "base", tmp_path)
    ours = hfport.AutoModel.from_pretrained(tmp_path)
    inputs = batch("roberta")
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    left_ids, left_mask = ids.flip(1), mask.flip(1)  # padding first
    with torch.no_grad():
        a = ours(left_ids, attention_mask=left_mask).last_hidden_state
        b = ref(input_ids=left_ids, attention_mask=left_mask).last_hidden_state
    torch.testing.assert_close(real(a, left_mask), real(b, left_mask), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("problem_type,num_labels", [("regression", 1), ("multi_label_classification", 3),
                                                     ("single_label_classification", 3), (None, 1)])
def test_sequence_losses(problem_type, num_labels, tmp_path):
    kw = {"num_labels": num_labels} | ({"problem_type": problem_type} if problem_type else {})
    ref = save_hf("bert", "sequence-classification", tmp_path, **kw)
    ours = hfport.AutoModelForSequenceClassification.from_pretrained(tmp_path)
    inputs = batch("bert")
    g = torch.Generator().manual_seed(5)
    if problem_type == "single_label_classification":
        labels = torch.randint(0, num_labels, (3,), generator=g)
    elif problem_type == "multi_label_classification":
        labels = (torch.rand(3, num_labels, generator=g) > 0.5).float()
    else:
        labels = torch.randn(3, generator=g)
    a = ours(**inputs, labels=labels)
    b = ref(**inputs, labels=labels)
    torch.testing.assert_close(a.loss, b.loss, atol=ATOL, rtol=RTOL)
    assert ours.config.problem_type == ref.config.problem_type


def test_minilm_real_checkpoint(minilm_path, tmp_path):
    """The real all-MiniLM-L6-v2 on real sentences, tokenized by its own tokenizer."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(minilm_path)
    sentences = ["The quick brown fox jumps over the lazy dog.", "hfport loads HF checkpoints directly.",
                 "A much longer sentence that keeps going so that the batch has real padding in it, and then a "
                 "few more words for good measure, because padding is where bugs hide."]
    enc = tok(sentences, ["A second segment.", "Pairs use token type ids.", "Yes."], padding=True,
              return_tensors="pt")
    ref = transformers.AutoModel.from_pretrained(minilm_path).eval()
    ours = hfport.AutoModel.from_pretrained(minilm_path)
    with torch.no_grad():
        a = ours(**enc).last_hidden_state
        b = ref(**enc).last_hidden_state
    mask = enc["attention_mask"]
    torch.testing.assert_close(real(a, mask), real(b, mask), atol=ATOL, rtol=RTOL)
    grid.record("minilm (real)", "base", (real(a, mask) - real(b, mask)).abs().max().item())

    ours.save_pretrained(tmp_path)
    back, info = transformers.AutoModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        c = back.eval()(**enc).last_hidden_state
    torch.testing.assert_close(real(c, mask), real(b, mask), atol=0, rtol=0)
