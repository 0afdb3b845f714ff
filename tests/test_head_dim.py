"""Attention heads of another width than hidden_size // num_attention_heads: the families whose transformers
attention reads config.head_dim (GTE, NomicBERT, EuroBERT, jina-embeddings-v3: q, k and v project to heads x
head_dim, o back to hidden_size) load at parity with transformers 5.23 for every head transformers has, padded and
padding-free, left padded, with pairs and a 70-token row: outputs at real positions, losses and every gradient. Each
width transformers runs is taken (wider, narrower, hidden_size not a multiple of the heads, with and without
head_dim); what it refuses (an odd or non-positive width, EuroBERT's hidden_size that the heads do not divide,
GTE's explicit null) is refused naming the field. ModernBERT reads head_dim only for its rotary tables: null, 0 and
hidden_size // heads load, any other width (transformers fails on it) is refused. A family that does not read
head_dim (BERT) ignores it, as transformers does. The folders save back to what transformers loads, and a NomicBERT
with wide heads exports to ONNX and verifies.

Tolerance: fp32 atol 1e-5 (rtol 1.3e-6), tests/parity.py's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import hfport
from hfport.errors import ConfigError
from tests.parity import ATOL, RTOL
from tests.test_rotary_families import check, inputs_for
from tests.tiny import HEADS, ROTARY_EXTRA_HEADS, ROTARY_HEADS, save_hf, save_with_tokenizer

torch.set_num_threads(1)  # tiny models on shared cores

FAMILIES = ("gte", "nomic_bert", "eurobert", "jina_embeddings_v3")
# the tiny configs' hidden_size is 32 with 4 heads (8 wide); every width below is one transformers runs
WIDTHS: dict[str, dict[str, Any]] = {
    "wider": dict(head_dim=16),  # q/k/v 64 wide, o 64 -> 32
    "narrower": dict(head_dim=6),  # 24 wide
    "heads not dividing hidden": dict(hidden_size=36, num_attention_heads=8),  # 36 // 8 = 4, floored
    "heads not dividing hidden, head_dim given": dict(hidden_size=36, num_attention_heads=8, head_dim=10),
}
# EuroBERT's config refuses a hidden_size its heads do not divide (EuroBertConfig.validate_architecture); its
# grouped-query attention instead, with wide heads: 4 query heads on 1 key/value head
FAMILY_WIDTHS = {
    family: {name: w for name, w in WIDTHS.items() if family != "eurobert" or "hidden_size" not in w}
    | ({"wider, one kv head": dict(head_dim=16, num_key_value_heads=1)} if family == "eurobert" else {})
    for family in FAMILIES
}
GRID = [(f, w, t) for f in FAMILIES for w in FAMILY_WIDTHS[f]
        for t in (*ROTARY_HEADS, *ROTARY_EXTRA_HEADS.get(f, ()))]


@pytest.mark.parametrize("family,width,task", GRID)
def test_parity(family: str, width: str, task: str, tmp_path) -> None:
    ref = save_hf(family, task, tmp_path, **FAMILY_WIDTHS[family][width])
    want = ref.config.head_dim if getattr(ref.config, "head_dim", None) else 36 // 8
    ours = getattr(hfport, HEADS[task]).from_pretrained(tmp_path)
    assert ours.config.head_dim == want and ours.body.encoder.layers[0].attn.head_dim == want
    check(family, task, tmp_path)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", ["padded", "left padding"])
def test_parity_padded_and_left(family: str, layout: str, tmp_path) -> None:
    """The padded layout (padding_free=False) and left padding with wide heads: the base model and the MLM (left
    padded, the base model's pooler reads position 0, a padding token: only the padded layout reproduces it)."""
    left = layout == "left padding"
    for task in ("base", "masked-lm"):
        save_hf(family, task, tmp_path / task, head_dim=16)
        check(family, task, tmp_path / task, left=left, padding_free=left and task != "base")


@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_loads_in_transformers(family: str, tmp_path) -> None:
    """head_dim travels in config.json: transformers reads hfport's folder with nothing missing and the same
    outputs."""
    import transformers

    ref = save_hf(family, "masked-lm", tmp_path / "hf", head_dim=16)
    hfport.AutoModelForMaskedLM.from_pretrained(tmp_path / "hf").save_pretrained(tmp_path / "ours")
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["head_dim"] == 16
    back, info = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    inputs = inputs_for(family, type_vocab_size=getattr(ref.config, "type_vocab_size", 0))
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(**inputs).logits, ref(**inputs).logits, atol=0, rtol=0)


def _edited(family: str, folder: Path, **changes: Any) -> Path:
    """A saved tiny base model whose config.json is then edited (values transformers' config classes would refuse
    at construction, as a hand-written config.json can hold them)."""
    save_hf(family, "base", folder)
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return folder


# what transformers refuses: its rope validation (an odd width), its attention (a width of 0 or below, a float, or
# GTE's / jina's null read as a width), EuroBertConfig.validate_architecture, NomicBertConfig's and
# EuroBertConfig's typed head_dim (a bool)
REFUSED = [
    *[(f, "head_dim", dict(head_dim=5)) for f in FAMILIES],
    *[(f, "head_dim", dict(head_dim=0)) for f in FAMILIES],
    ("gte", "head_dim", dict(head_dim=-2)),
    ("jina_embeddings_v3", "head_dim", dict(head_dim=16.0)),
    ("nomic_bert", "head_dim", dict(head_dim=True)),
    ("eurobert", "head_dim", dict(head_dim=True)),
    ("gte", "head_dim", dict(head_dim=None)),
    ("jina_embeddings_v3", "head_dim", dict(head_dim=None)),
    ("nomic_bert", "head_dim", dict(hidden_size=28, head_dim=None)),  # derived 28 // 4 = 7: odd
    ("eurobert", "num_attention_heads", dict(hidden_size=36, num_attention_heads=8, head_dim=8)),
    ("modernbert", "head_dim", dict(head_dim=16)),
    ("modernbert", "head_dim", dict(head_dim=6)),
]


@pytest.mark.parametrize("family,field,changes", REFUSED, ids=[f"{f}-{k}-{c}" for f, k, c in REFUSED])
def test_refused_naming_the_field(family: str, field: str, changes: dict, tmp_path) -> None:
    folder = _edited(family, tmp_path, **changes)
    with pytest.raises(ConfigError, match=re.escape(f"'{field}'")) as e:
        hfport.AutoModel.from_pretrained(folder)
    assert str(folder / "config.json") in str(e.value)


@pytest.mark.parametrize("head_dim", [None, 0, 8])
def test_modernbert_takes_the_widths_transformers_runs(head_dim, tmp_path) -> None:
    """ModernBERT's rotary tables read head_dim (null or 0: hidden_size // heads), its heads hidden_size // heads:
    the three values that agree load at parity."""
    import transformers

    folder = _edited("modernbert", tmp_path, head_dim=head_dim)
    ref = transformers.AutoModel.from_pretrained(folder).eval()
    ours = hfport.AutoModel.from_pretrained(folder)
    inputs = inputs_for("modernbert", type_vocab_size=0)
    with torch.no_grad():
        a, b = ours(**inputs).last_hidden_state, ref(**inputs).last_hidden_state
    real = inputs["attention_mask"].bool()
    torch.testing.assert_close(a[real], b[real], atol=ATOL, rtol=RTOL)


def test_families_that_do_not_read_head_dim_ignore_it(tmp_path) -> None:
    """BERT's attention is hidden_size // heads wide whatever config.json says about head_dim (transformers' too)."""
    import transformers

    folder = _edited("bert", tmp_path, head_dim=16)
    ours = hfport.AutoModel.from_pretrained(folder)
    assert ours.config.head_dim == 8 and ours.body.encoder.layers[0].attn.q.out_features == 32
    ref = transformers.AutoModel.from_pretrained(folder).eval()
    inputs = inputs_for("bert", type_vocab_size=3)
    real = inputs["attention_mask"].bool()
    with torch.no_grad():
        a, b = ours(**inputs), ref(**inputs)
    torch.testing.assert_close(a.last_hidden_state[real], b.last_hidden_state[real], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(a.pooler_output, b.pooler_output, atol=ATOL, rtol=RTOL)


def test_wide_heads_export_to_onnx_and_verify(minilm_path, tmp_path) -> None:
    """The traced graph (onnxruntime's fused attention included) carries the attention width, not hidden_size."""
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from hfport.export.onnx import export_onnx

    save_with_tokenizer("nomic_bert", "base", tmp_path / "src", minilm_path, vocab_size=30522, head_dim=16)
    result = export_onnx(tmp_path / "src", tmp_path / "out", quantize="int8")
    assert result.report.passed, result.report.table()
