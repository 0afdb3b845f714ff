"""DeBERTa-v2/v3 parity with transformers: outputs, losses and every gradient, for five heads and several config
variants, on a padded batch whose longest row (70) is longer than the bucketed range."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from huggingface_hub.errors import StrictDataclassFieldValidationError
from safetensors.torch import load_file, save_file

import hfport
from hfport.models.deberta_v2 import DEBERTA_V2
from tests import grid
from tests.parity import DEBERTA_PARITY, compare_models, load_ours, outputs_of
from tests.tiny import HEADS

TOL = dict(atol=1e-5, rtol=DEBERTA_PARITY["rtol"])
VOCAB = 99
LENGTHS = (70, 41, 9)
BASE = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
            max_position_embeddings=128, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)

VARIANTS = {
    # DeBERTa-v3: log buckets (8: length 70 reaches the log-spaced range), both terms from a
    # "p2c|c2p" string, shared projections, LayerNorm-ed relative table, no absolute positions
    "v3": dict(relative_attention=True, position_buckets=8, pos_att_type="p2c|c2p", share_att_key=True,
               norm_rel_ebd="layer_norm", position_biased_input=False, max_relative_positions=-1),
    # DeBERTa-v2-xlarge: the conv after layer 0, own pos_key_proj, no buckets, max_relative_positions -1 -> 128
    # (no clamping at length 70), c2p only as a list
    "v2-xlarge": dict(relative_attention=True, conv_kernel_size=3, conv_act="gelu", conv_groups=2, share_att_key=False,
                      max_relative_positions=-1, pos_att_type=["c2p"], norm_rel_ebd="layer_norm|none"),
    # no relative attention, but pos_att_type still widens the scale (as in transformers); absolute positions,
    # token types, factorised embeddings, another pooler activation and pooler/cls dropout
    "absolute": dict(relative_attention=False, position_biased_input=True, type_vocab_size=2, embedding_size=16,
                     pos_att_type=["c2p", "p2c"], pooler_hidden_act="tanh", pooler_dropout=0.2, cls_dropout=0.3),
    # p2c only, own pos_query_proj, clamped (max_relative_positions 20 < 70), no LayerNorm on the table
    "p2c-clamped": dict(relative_attention=True, pos_att_type=["p2c"], max_relative_positions=20,
                        share_att_key=False, norm_rel_ebd="none", type_vocab_size=-1),
    # both terms unshared; buckets 256 leave length 70 in the exact range
    "both-unshared": dict(relative_attention=True, pos_att_type=["c2p", "p2c"], position_buckets=256,
                          max_relative_positions=512, share_att_key=False, hidden_act="gelu_new"),
}


def hf_model(task: str, seed: int = 0, **overrides):
    config = transformers.DebertaV2Config(**{**BASE, **overrides})
    if task in ("sequence-classification", "token-classification"):
        config.id2label = {i: f"L{i}" for i in range(3)}
        config.label2id = {f"L{i}": i for i in range(3)}
    torch.manual_seed(seed)
    model = getattr(transformers, HEADS[task]).from_config(config)
    with torch.no_grad():  # transformers zeroes biases and LayerNorm shifts: random values exercise every term
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.02)
            # at the 0.02 init, scores are ~1e-3 and a wrong relative-position term can hide under the tolerance:
            # O(1) scores and relative terms make every one of them count
            if "rel_embeddings" in name:
                p.normal_(0.0, 1.0)
            elif name.endswith(("query_proj.weight", "key_proj.weight")):
                p.normal_(0.0, 0.1)
    return model.eval()


def make_batch(task: str, with_types: bool, seed: int = 1) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b, t = len(LENGTHS), max(LENGTHS)
    ids = torch.randint(3, VOCAB, (b, t), generator=g)
    mask = torch.zeros(b, t, dtype=torch.long)
    for row, n in enumerate(LENGTHS):
        mask[row, :n] = 1
    real = mask.bool()
    inputs = {"input_ids": ids.masked_fill(~real, 0), "attention_mask": mask}
    if with_types:
        types = torch.zeros(b, t, dtype=torch.long)
        for row, n in enumerate(LENGTHS):
            types[row, n // 2:n] = 1
        inputs["token_type_ids"] = types
    if task == "sequence-classification":
        inputs["labels"] = torch.tensor([2, 0, 1])
    elif task in ("token-classification", "masked-lm"):
        high = 3 if task == "token-classification" else VOCAB
        labels = torch.randint(0, high, (b, t), generator=g)
        keep = real & (torch.rand(b, t, generator=g) < 0.5)
        inputs["labels"] = labels.masked_fill(~keep, -100)
    elif task == "question-answering":
        inputs["start_positions"] = torch.tensor([5, 40, 2])
        inputs["end_positions"] = torch.tensor([60, 40, 500])  # 500: outside the input, ignored after clamping
    return inputs, real


LABELS = ("labels", "start_positions", "end_positions")


def split_labels(inputs: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    return {k: v for k, v in inputs.items() if k not in LABELS}, {k: v for k, v in inputs.items() if k in LABELS}


@pytest.mark.parametrize("task", list(HEADS))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_parity(variant: str, task: str, tmp_path: Path) -> None:
    overrides = VARIANTS[variant]
    theirs = hf_model(task, **overrides)
    theirs.save_pretrained(tmp_path / "hf")
    ours = load_ours(task, tmp_path / "hf")
    inputs, labels = split_labels(make_batch(task, with_types=overrides.get("type_vocab_size", 0) > 0)[0])
    worst = compare_models(theirs, ours, inputs, task, labels=labels, name=f"{variant}/{task}", **DEBERTA_PARITY)
    grid.record(f"deberta:{variant}", task, worst)

    # hfport's save_pretrained output reloads in transformers with nothing missing or left over, same outputs
    ours.save_pretrained(tmp_path / "ours")
    back, info = getattr(transformers, HEADS[task]).from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        again, want = outputs_of(task, back.eval()(**inputs)), outputs_of(task, theirs(**inputs))
    assert again.keys() == want.keys()
    for field in want:
        torch.testing.assert_close(again[field], want[field], **TOL)


@pytest.mark.parametrize("layout", ["left", "holes"])
@pytest.mark.parametrize("task", ["base", "token-classification"])
def test_padding_layouts(layout: str, task: str, tmp_path: Path) -> None:
    """Left padding (padding-free: packed real tokens, per-sequence attention) and a mask with a hole inside a
    sequence (not one contiguous run, so relative distances need the padded (B, T, T) path): same as
    transformers."""
    theirs = hf_model(task, **VARIANTS["v3"])
    theirs.save_pretrained(tmp_path)
    ours = load_ours(task, tmp_path)
    inputs, _ = make_batch(task, with_types=False)
    if layout == "left":
        inputs = {k: v.flip(1) for k, v in inputs.items()}
    else:
        inputs["attention_mask"][0, 10:15] = 0
        if "labels" in inputs:
            inputs["labels"][0, 10:15] = -100
    inputs, labels = split_labels(inputs)
    compare_models(theirs, ours, inputs, task, labels=labels, name=f"{layout}/{task}", **DEBERTA_PARITY)


def test_relative_positions_cached_per_length() -> None:
    model = hfport.AutoModel.from_config({**BASE, "model_type": "deberta-v2", **VARIANTS["v3"]}).eval()
    cache = model.body.encoder.positions
    ids = torch.randint(3, VOCAB, (2, 12))
    model(ids)
    first = cache.get(12, ids.device)
    model(torch.randint(3, VOCAB, (1, 12)))
    assert cache.get(12, ids.device) is first and len(cache._cache) == 1


@pytest.mark.parametrize("length, span, buckets, max_position", [
    (300, 256, 256, 512),  # DeBERTa-v3's own setting, past the exact range
    (70, 8, 8, 128), (70, 20, -1, 20), (9, 128, -1, 128), (1, 8, 8, 128)])
def test_relative_rows_match_transformers(length: int, span: int, buckets: int, max_position: int) -> None:
    """Each query-key pair reads the same table row as transformers' c2p / p2c gathers."""
    from transformers.models.deberta_v2.modeling_deberta_v2 import build_relative_position

    from hfport.nn.relative import RelativeIndex

    x = torch.zeros(1, length, 1)
    rel = build_relative_position(x, x, bucket_size=buckets, max_position=max_position)[0]  # (T, T)
    c2p = torch.clamp(rel + span, 0, 2 * span - 1)  # transformers' c2p_pos
    p2c = torch.clamp(-rel + span, 0, 2 * span - 1).T  # its p2c_pos, transposed back to (query, key)
    index = RelativeIndex.build(length, span, buckets, max_position, torch.device("cpu"))
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    assert torch.equal(index.c2p_rows[j - i + length - 1] + index.lo, c2p)
    assert torch.equal(index.p2c_rows[i - j + length - 1] + index.lo, p2c)


@pytest.mark.parametrize("length", [1, 2, 7])
def test_disentangled_bias_against_gather(length: int) -> None:
    """The diagonal-shift bias equals a per-pair gather, and its hand-written backward passes gradcheck."""
    from hfport.nn.relative import _DisentangledBias, diagonal_shift

    g = torch.Generator().manual_seed(length)
    w = 2 * length - 1
    c2p, p2c = (torch.randn(2, 3, length, w, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    index = (j - i + length - 1).expand(2, 3, length, length)
    expected = c2p.gather(-1, index) + p2c.gather(-1, index).transpose(-1, -2)
    torch.testing.assert_close(diagonal_shift(c2p) + diagonal_shift(p2c).transpose(-1, -2), expected)
    override = torch.rand(2, 1, length, length, generator=g) < 0.3
    fill = torch.randn(2, 1, length, length, generator=g, dtype=torch.float64)
    for args in [(c2p, p2c, None, None), (c2p, None, override, fill), (None, p2c, override, fill),
                 (c2p, p2c, override, fill)]:
        assert torch.autograd.gradcheck(_DisentangledBias.apply, args)


def test_rejected_configs_name_file_and_field(tmp_path: Path) -> None:
    hf_model("base").save_pretrained(tmp_path)
    config_path = tmp_path / "config.json"
    original = json.loads(config_path.read_text())
    for field, value in [("pos_att_type", 5), ("relative_attention", "yes"), ("max_relative_positions", 1.5),
                         ("pos_att_type", ["c2p", 3])]:
        with pytest.raises(StrictDataclassFieldValidationError, match=field):  # transformers refuses it too
            transformers.DebertaV2Config(**{**BASE, field: value})
        config_path.write_text(json.dumps({**original, field: value}))
        with pytest.raises(hfport.ConfigError, match=rf"config\.json.*'{field}'"):
            hfport.AutoModel.from_pretrained(tmp_path)
    # a size transformers refuses for the same reason
    config_path.write_text(json.dumps({**original, "hidden_size": 30}))
    with pytest.raises(ValueError, match="not a multiple"):
        transformers.DebertaV2Model(transformers.DebertaV2Config(**{**BASE, "hidden_size": 30}))
    with pytest.raises(hfport.ConfigError, match=r"config\.json.*num_attention_heads.*not a multiple"):
        hfport.AutoModel.from_pretrained(tmp_path)


def test_accepted_odd_configs_load(tmp_path: Path) -> None:
    """Combinations transformers takes are never refused: unknown pos_att_type names, bucket 0, relative
    attention with no terms."""
    for i, extra in enumerate([dict(relative_attention=True, pos_att_type="C2P | p2p"),
                               dict(relative_attention=True, position_buckets=0, max_relative_positions=0),
                               dict(relative_attention=True, pos_att_type=[])]):
        theirs = hf_model("base", **extra)
        theirs.save_pretrained(tmp_path / str(i))
        ours = hfport.AutoModel.from_pretrained(tmp_path / str(i))
        inputs, real = make_batch("base", with_types=False)
        with torch.no_grad():
            torch.testing.assert_close(ours(**inputs).last_hidden_state[real],
                                       theirs(**inputs).last_hidden_state[real], **TOL)


def test_masked_lm_layouts(tmp_path: Path) -> None:
    """legacy=False writes lm_predictions.lm_head.*, the names of the original Microsoft checkpoints: they load
    (also under a legacy config, which is how those checkpoints ship), the v3 RTD head is skipped, and saving
    writes the layout the config asks for."""
    theirs = hf_model("masked-lm", legacy=False, **VARIANTS["v3"])
    theirs.save_pretrained(tmp_path / "new")
    weights = load_file(tmp_path / "new" / "model.safetensors")
    assert any(k.startswith("lm_predictions.lm_head.") for k in weights)
    inputs, real = make_batch("masked-lm", with_types=False)
    expected = theirs(**inputs)

    ours = hfport.AutoModelForMaskedLM.from_pretrained(tmp_path / "new")
    got = ours(**inputs)
    torch.testing.assert_close(got.logits[real], expected.logits[real], **TOL)
    torch.testing.assert_close(got.loss, expected.loss, **TOL)
    ours.save_pretrained(tmp_path / "new-ours")
    assert set(load_file(tmp_path / "new-ours" / "model.safetensors")) == set(weights)

    # an original checkpoint: lm_predictions names, no `legacy` in config.json, plus the RTD head
    old = tmp_path / "original"
    old.mkdir()
    config = json.loads((tmp_path / "new" / "config.json").read_text())
    config.pop("legacy")
    (old / "config.json").write_text(json.dumps(config))
    extra = {"mask_predictions.dense.weight": torch.zeros(32, 32), "mask_predictions.dense.bias": torch.zeros(32),
             "mask_predictions.LayerNorm.weight": torch.ones(32), "mask_predictions.LayerNorm.bias": torch.zeros(32),
             "mask_predictions.classifier.weight": torch.zeros(1, 32), "mask_predictions.classifier.bias": torch.zeros(1)}
    save_file({**weights, **extra}, old / "model.safetensors", metadata={"format": "pt"})
    legacy = hfport.AutoModelForMaskedLM.from_pretrained(old)
    assert not legacy.load_report.initialized
    assert sorted(legacy.load_report.unexpected) == sorted(extra)
    with torch.no_grad():
        torch.testing.assert_close(legacy(**inputs).logits[real], expected.logits[real], **TOL)
    legacy.save_pretrained(tmp_path / "as-legacy")  # legacy config: transformers' cls.predictions layout
    back, info = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "as-legacy", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(**inputs).logits[real], expected.logits[real], **TOL)


def test_untied_masked_lm(tmp_path: Path) -> None:
    """tie_word_embeddings false: transformers' decoder has its own weight and bias (cls.predictions.bias is
    then unused, so hfport does not save it and transformers reports it missing, with no effect on outputs)."""
    theirs = hf_model("masked-lm", tie_word_embeddings=False, **VARIANTS["absolute"])
    theirs.save_pretrained(tmp_path / "hf")
    ours = hfport.AutoModelForMaskedLM.from_pretrained(tmp_path / "hf")
    assert not ours.load_report.initialized
    inputs, real = make_batch("masked-lm", with_types=True)
    expected, got = theirs(**inputs), ours(**inputs)
    torch.testing.assert_close(got.logits[real], expected.logits[real], **TOL)
    torch.testing.assert_close(got.loss, expected.loss, **TOL)
    ours.save_pretrained(tmp_path / "ours")
    back, info = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert info["missing_keys"] == {"cls.predictions.bias"} and not info["unexpected_keys"]
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(**inputs).logits[real], expected.logits[real], **TOL)


def test_from_config_matches_transformers_init_shapes() -> None:
    config = {**BASE, "model_type": "deberta-v2", **VARIANTS["v2-xlarge"]}
    ours = hfport.AutoModelForSequenceClassification.from_config(config, num_labels=3)
    theirs = hf_model("sequence-classification", **VARIANTS["v2-xlarge"])
    names = ours.hf_names()
    shapes = {n: tuple(p.shape) for n, p in theirs.named_parameters()}
    assert {names[n]: tuple(p.shape) for n, p in ours.named_parameters()} == shapes
    conv = ours.body.encoder.conv.conv
    assert conv.bias.abs().max() == 0 and 0.01 < conv.weight.std() < 0.03  # initialised as transformers does
    assert DEBERTA_V2.model_type in hfport.supported()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_traceable_path_equals_eager(variant: str, tmp_path: Path) -> None:
    """The encoder's traceable path (relative rows from tensor ops on the runtime length, what the ONNX export
    traces) equals the eager padded path (per-length window and cache) at real positions, at two lengths."""
    hf_model("base", **VARIANTS[variant]).save_pretrained(tmp_path)
    ours = hfport.AutoModel.from_pretrained(tmp_path).eval()
    ours.body.padding_free = False
    inputs, real = make_batch("base", with_types=VARIANTS[variant].get("type_vocab_size", 0) > 0)
    short = {k: v[1:, :41] for k, v in inputs.items()}  # (2, 41): another length, padded
    for batch, keep in [(inputs, real), (short, real[1:, :41])]:
        with torch.no_grad():
            eager = ours(**batch).last_hidden_state
            ours.body.encoder.traceable = True
            traced = ours(**batch).last_hidden_state
            ours.body.encoder.traceable = False
        torch.testing.assert_close(traced[keep], eager[keep], **TOL)
        assert not keep.all()  # the padded layout, as traced
