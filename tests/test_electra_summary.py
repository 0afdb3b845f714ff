"""ELECTRA's sequence summary (ElectraSequenceSummary, before ElectraForMultipleChoice's classifier): first dropout ->
[projection] -> [activation] -> last dropout, each part present or not on its own as transformers 5.23 builds it.
Every combination transformers runs loads at parity (the multiple-choice grid's batch: padded, pairs, a 70-token
row; logits, loss, every gradient): with and without the projection, with each activation or none, with a first
dropout, a projection to num_labels (which transformers runs only where num_labels equals hidden_size), negative
dropouts (transformers then applies none). In training the first dropout acts before the activation whether or not
there is a projection. What transformers fails on is refused naming the field.

Tolerance: fp32 atol 1e-5 (rtol 1.3e-6), tests/parity.py's.
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch

import hfport
from hfport.errors import ConfigError
from tests.test_multiple_choice import choice_batch
from tests.test_multiple_choice import compare as compare_choices
from tests.tiny import build_hf, save_hf

torch.set_num_threads(1)

HIDDEN = 32  # the tiny ELECTRA's hidden_size (tests/tiny.py)
# every combination of the options that change what the summary computes ("" is no activation)
COMBINATIONS = [
    {"summary_use_proj": proj, "summary_activation": act, "summary_first_dropout": first,
     **({"summary_proj_to_labels": True, "num_labels": HIDDEN} if to_labels else {})}
    for proj, act, first, to_labels in itertools.product((True, False), ("gelu", "tanh", ""), (0.0, 0.3),
                                                         (False, True))
]


@pytest.mark.parametrize("overrides", COMBINATIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_parity(overrides, tmp_path):
    compare_choices("electra", tmp_path, **overrides)


@pytest.mark.parametrize("overrides", [
    {"summary_use_proj": False, "summary_activation": "relu", "summary_last_dropout": 0.0},
    {"summary_use_proj": False, "summary_activation": "linear"},
    {"summary_first_dropout": -1.0, "summary_last_dropout": -0.5},  # transformers: no dropout at all
])
def test_parity_more(overrides, tmp_path):
    compare_choices("electra", tmp_path, **overrides)


@pytest.mark.parametrize("use_proj", [True, False])
def test_first_dropout_acts_before_the_activation_in_training(use_proj, tmp_path):
    """summary_first_dropout 1.0 zeroes the summary's input in training: the logits are then the classifier's
    answer to act(projection(0)) (or act(0) without a projection) on both sides, deterministically; the body's own
    dropouts are off."""
    import transformers

    overrides = dict(summary_use_proj=use_proj, summary_activation="tanh", summary_first_dropout=1.0,
                     summary_last_dropout=0.0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    save_hf("electra", "multiple-choice", tmp_path, **overrides)
    ref = transformers.AutoModelForMultipleChoice.from_pretrained(tmp_path).train()
    ours = hfport.AutoModelForMultipleChoice.from_pretrained(tmp_path).train()
    inputs = choice_batch("electra")
    with torch.no_grad():
        a, b = ours(**inputs).logits, ref(**inputs).logits
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert (a.max() - a.min()).item() < 1e-6  # every choice scored alike: the summary saw zeros
    ours.eval()
    with torch.no_grad():
        logits = ours(**inputs).logits
    assert (logits.max() - logits.min()).item() > 1e-3  # in eval the first dropout is off


@pytest.mark.parametrize("changes,fragment", [
    ({"summary_first_dropout": 1.5}, "field 'summary_first_dropout': 1.5 is not a probability"),
    ({"summary_last_dropout": 2}, "field 'summary_last_dropout': 2 is not a probability"),
    ({"summary_first_dropout": "x"}, "field 'summary_first_dropout' should be a number"),
    ({"summary_type": "foo"}, "field 'summary_type': 'foo' is not supported"),
    ({"summary_proj_to_labels": True, "num_labels": 3}, "field 'summary_proj_to_labels': true projects to num_labels "
                                                        "(3)"),
    ({"summary_activation": "nope"}, "field 'summary_activation': 'nope' is not supported"),
])
def test_refused_naming_the_field(changes, fragment, tmp_path):
    save_hf("electra", "multiple-choice", tmp_path)
    path = tmp_path / "config.json"
    config = {**json.loads(path.read_text()), **changes}
    if "num_labels" in changes:  # the label count lives in id2label
        config["id2label"] = {str(i): f"L{i}" for i in range(changes["num_labels"])}
        config["label2id"] = {f"L{i}": i for i in range(changes["num_labels"])}
    path.write_text(json.dumps(config))
    with pytest.raises(ConfigError) as e:
        hfport.AutoModelForMultipleChoice.from_pretrained(tmp_path)
    assert fragment in str(e.value) and str(path) in str(e.value)


def test_a_summary_without_projection_saves_what_transformers_loads(tmp_path):
    import transformers

    ref = save_hf("electra", "multiple-choice", tmp_path / "hf", summary_use_proj=False, summary_activation="tanh")
    hfport.AutoModelForMultipleChoice.from_pretrained(tmp_path / "hf").save_pretrained(tmp_path / "ours")
    back, info = transformers.AutoModelForMultipleChoice.from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    inputs = choice_batch("electra")
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(**inputs).logits, ref(**inputs).logits, atol=0, rtol=0)
    assert build_hf("electra", "multiple-choice", summary_use_proj=False).sequence_summary.summary.__class__ \
        is torch.nn.Identity  # the transformers side really has no projection
