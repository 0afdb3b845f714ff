"""The parity matrix: every family x every head against transformers on the same weights and batch.

Outputs are compared at real (non-padding) positions only; hfport makes no promise about padding positions.
Tolerance: fp32, atol 1e-5 (rtol 1.3e-6, torch's fp32 default) on outputs, losses and every gradient. The rtol
matters only for gradients of tensors summed over every token of the batch (token-type embeddings reach ~60 in
magnitude, where fp32 summation order alone moves the last digits: ~1e-7 relative).
"""

from __future__ import annotations

import pytest
import torch

import hfport
from tests import grid
from tests.tiny import FAMILY_CONFIGS, HEADS, NUM_LABELS, batch, reference_qa_loss, save_hf

ATOL, RTOL = 1e-5, 1.3e-6
FAMILIES = list(FAMILY_CONFIGS)
TASKS = list(HEADS)


def labels_for(task: str, inputs: dict[str, torch.Tensor], seed: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = inputs["attention_mask"]
    b, t = mask.shape
    if task == "sequence-classification":
        return {"labels": torch.randint(0, NUM_LABELS, (b,), generator=g)}
    if task == "token-classification":
        return {"labels": torch.randint(0, NUM_LABELS, (b, t), generator=g).masked_fill(mask == 0, -100)}
    if task == "masked-lm":
        chosen = (torch.rand(b, t, generator=g) < 0.3) & mask.bool()
        return {"labels": torch.where(chosen, inputs["input_ids"], torch.full_like(inputs["input_ids"], -100))}
    if task == "question-answering":
        lengths = mask.sum(1)
        start = torch.stack([torch.randint(0, int(n), (1,), generator=g)[0] for n in lengths])
        end = torch.minimum(start + 3, lengths - 1)
        end[0] = 10_000  # out of range: clamped to the ignored index, as transformers does
        return {"start_positions": start, "end_positions": end}
    return {}


def outputs_of(task: str, out) -> dict[str, torch.Tensor]:
    if task == "base":
        keys = ["last_hidden_state", "pooler_output"]
    elif task == "question-answering":
        keys = ["start_logits", "end_logits"]
    else:
        keys = ["logits"]
    return {k: getattr(out, k) for k in keys if getattr(out, k, None) is not None}


def real(t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token-level tensors restricted to real positions; sequence-level ones as they are."""
    return t[mask.bool()] if t.dim() >= 2 and t.shape[:2] == mask.shape else t


def compare(family: str, task: str, tmp_path, **overrides) -> float:
    ref = save_hf(family, task, tmp_path, **overrides)
    ours = getattr(hfport, HEADS[task]).from_pretrained(tmp_path)
    assert not ours.load_report.initialized and not ours.load_report.unexpected, ours.load_report.summary()
    inputs = batch(family, pairs=overrides.get("type_vocab_size", 2) > 1)
    labels = labels_for(task, inputs)
    mask = inputs["attention_mask"]

    theirs_out = ref(**inputs, **labels)
    ours_out = ours(**inputs, **labels)
    worst = 0.0
    theirs_o, ours_o = outputs_of(task, theirs_out), outputs_of(task, ours_out)
    assert theirs_o.keys() == ours_o.keys()
    for key in theirs_o:
        a, b = real(ours_o[key], mask), real(theirs_o[key].detach(), mask)
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=lambda m: f"{family}/{task} {key}: {m}")
        worst = max(worst, (a - b).abs().max().item())

    if task == "base":  # no task loss: a fixed random projection of the real positions
        g = torch.Generator().manual_seed(3)
        w = torch.randn(ref.config.hidden_size, generator=g)
        loss_theirs = (real(theirs_out.last_hidden_state, mask) @ w).mean()
        loss_ours = (real(ours_out.last_hidden_state, mask) @ w).mean()
        if getattr(theirs_out, "pooler_output", None) is not None:  # so the pooler's gradient is checked too
            loss_theirs = loss_theirs + theirs_out.pooler_output.mean()
            loss_ours = loss_ours + ours_out.pooler_output.mean()
    else:
        loss_theirs, loss_ours = theirs_out.loss, ours_out.loss
        if task == "question-answering":  # over real positions (see reference_qa_loss)
            loss_theirs = reference_qa_loss(theirs_out, labels["start_positions"], labels["end_positions"], mask)
        torch.testing.assert_close(loss_ours, loss_theirs, atol=ATOL, rtol=RTOL)
        worst = max(worst, (loss_ours - loss_theirs).abs().item())
    loss_theirs.backward()
    loss_ours.backward()

    ref_params = dict(ref.named_parameters(remove_duplicate=False))  # tied weights under every name
    names = ours.hf_names()
    seen = set()
    for name, p in ours.named_parameters():
        hf = names[name]
        assert hf in ref_params, f"{family}/{task}: {name} -> {hf} is not a transformers parameter"
        theirs_grad = ref_params[hf].grad
        if theirs_grad is None:
            assert p.grad is None or not p.grad.any(), f"{family}/{task}: {name} has a gradient, {hf} has none"
            continue
        torch.testing.assert_close(p.grad, theirs_grad, atol=ATOL, rtol=RTOL,
                                   msg=lambda m: f"{family}/{task} grad {name} ({hf}): {m}")
        worst = max(worst, (p.grad - theirs_grad).abs().max().item())
        seen.add(hf)
    unique = {id(p): n for n, p in ref_params.items()}  # one name per tensor
    assert len(names) == len(unique), "hfport and transformers hold different numbers of parameters"
    assert {id(ref_params[n]) for n in seen} == {i for i, n in unique.items() if ref_params[n].grad is not None}, \
        "gradient sets differ"
    grid.record(family, task, worst)
    return worst


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("family", FAMILIES)
def test_parity(family, task, tmp_path):
    compare(family, task, tmp_path)


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
        compare("distilbert", "token-classification", tmp_path)


@pytest.mark.parametrize("act", ["gelu", "gelu_new", "relu", "silu", "swish", "gelu_fast", "gelu_pytorch_tanh",
                                 "quick_gelu", "gelu_python", "gelu_accurate", "gelu_10", "mish", "tanh",
                                 "sigmoid", "linear", "relu6", "relu2", "leaky_relu", "laplace", "hardswish"])
def test_hidden_act(act, tmp_path):
    compare("bert", "masked-lm", tmp_path, hidden_act=act)  # MLM: the activation runs in layers and head


@pytest.mark.parametrize("family", ["bert", "roberta", "albert", "distilbert"])
def test_untied_masked_lm(family, tmp_path):
    """tie_word_embeddings=False: a decoder of its own; BERT-style heads then use the decoder's bias."""
    compare(family, "masked-lm", tmp_path, tie_word_embeddings=False)


@pytest.mark.parametrize("overrides", [
    dict(type_vocab_size=1), dict(type_vocab_size=16), dict(layer_norm_eps=1e-5), dict(classifier_dropout=0.3)])
def test_bert_variants(overrides, tmp_path):
    compare("bert", "sequence-classification", tmp_path, **overrides)


@pytest.mark.parametrize("groups,inner,layers", [(1, 1, 2), (2, 1, 4), (1, 2, 2), (3, 2, 5)])
def test_albert_sharing(groups, inner, layers, tmp_path):
    compare("albert", "masked-lm", tmp_path, num_hidden_groups=groups, inner_group_num=inner,
            num_hidden_layers=layers)


def test_distilbert_sinusoidal(tmp_path):
    compare("distilbert", "sequence-classification", tmp_path, sinusoidal_pos_embds=True, activation="gelu")
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
