"""GTE and NomicBERT against transformers 5.23's Gte* and NomicBert* classes: every head transformers has (base,
sequence / token classification, masked LM), padded batches with pairs and a 70-token row, right and left padding,
padding-free and padded, outputs at real positions, losses and every gradient; the rope variants (default, linear,
dynamic: NomicBERT's tiny config has max_position_embeddings 32, so its dynamic scaling acts on the 70- and
41-token rows); refusals naming the field; saving back to what transformers loads.

transformers 5.23 writes these models in their original layouts (GTE's fused qkv_proj / up_gate_proj, NomicBERT's
Wqkv / fc11 / fc12) and renames them only in memory; hfport reads and writes the files' names. Gradients are
compared by joining transformers' in-memory q/k/v (up/gate) gradients the way its loader split the file's tensor.

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
from tests import parity
from tests.parity import ATOL, RTOL, left_padded, outputs_of
from tests.tiny import (HEADS, ROTARY_CONFIGS, ROTARY_EXTRA_HEADS, ROTARY_HEADS, batch, build_hf, save_hf,
                        save_with_tokenizer)

FAMILIES = list(ROTARY_CONFIGS)
# (family, head) for every head transformers has in each family
GRID = [(f, t) for f in FAMILIES for t in (*ROTARY_HEADS, *ROTARY_EXTRA_HEADS.get(f, ()))]

# transformers' conversion_mapping for these model types, file name -> in-memory name(s): (pattern, replacement,
# the pieces a fused file tensor was chunked into, in order)
RENAMES = {
    "gte": [(r"encoder\.layer\.", "layers."), (r"attention\.o_proj", "self_attn.o_proj"),
            (r"attn_ln", "post_attention_layernorm"), (r"mlp_ln", "post_mlp_layernorm"),
            (r"lm_head\.norm", "lm_head.layer_norm")],
    "nomic_bert": [(r"encoder\.layers\.", "layers."), (r"emb_ln", "embeddings.LayerNorm"),
                   (r"attn\.out_proj", "self_attn.o_proj"), (r"fc11", "up_proj"), (r"fc12", "gate_proj"),
                   (r"fc2", "down_proj"), (r"norm1", "post_attention_layernorm"), (r"norm2", "post_mlp_layernorm")],
    "eurobert": [],  # transformers writes EuroBERT under its module names
    "jina_embeddings_v3": [(r"encoder\.layers\.", "layers."), (r"emb_ln", "embeddings.LayerNorm"),
                           (r"mixer\.out_proj", "self_attn.o_proj"), (r"norm1", "post_attention_layernorm"),
                           (r"norm2", "post_mlp_layernorm")],
}
FUSED = {
    "gte": [(r"attention\.qkv_proj", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
            (r"mlp\.up_gate_proj", ["mlp.up_proj", "mlp.gate_proj"])],
    "nomic_bert": [(r"attn\.Wqkv", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"])],
    "eurobert": [],
    "jina_embeddings_v3": [(r"mixer\.Wqkv", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"])],
}


def in_memory(family: str, file_name: str) -> list[str]:
    """The transformers parameter(s) a file key becomes when transformers loads it."""
    name = file_name
    for pattern, replacement in RENAMES[family]:
        name = re.sub(pattern, replacement, name)
    for pattern, pieces in FUSED[family]:
        if re.search(pattern, name):
            return [re.sub(pattern, piece, name) for piece in pieces]
    return [name]


def inputs_for(family: str, lengths: tuple[int, ...] = (70, 41, 9), left: bool = False,
               type_vocab_size: int = 2) -> dict[str, torch.Tensor]:
    """tiny.batch with token types where the model has them (a second segment where it has two) and, optionally,
    the padding on the left."""
    inputs = batch(family, lengths=lengths)
    mask = inputs["attention_mask"]
    if type_vocab_size > 0:
        types = torch.zeros_like(mask)
        for row, n in enumerate(mask.sum(1).tolist()):
            types[row, n // 2:n] = int(type_vocab_size > 1)
        inputs["token_type_ids"] = types
    return left_padded(inputs) if left else inputs


def check(family: str, task: str, folder: Path, *, left: bool = False, padding_free: bool = True,
          lengths: tuple[int, ...] = (70, 41, 9)) -> float:
    """hfport vs transformers from the same folder (tests/parity.py): outputs at real positions, the loss, every
    gradient, transformers' fused tensors' gradients joined as its loader split them. transformers is loaded fresh:
    dynamic rope keeps no state."""
    import transformers

    ref = getattr(transformers, HEADS[task]).from_pretrained(folder).eval()
    inputs = inputs_for(family, lengths, left, getattr(ref.config, "type_vocab_size", 0))
    return parity.check(task, folder, inputs, ref=ref, left=left, padding_free=padding_free, name=f"{family}/{task}",
                        pieces=lambda hf: in_memory(family, hf))


# --- the grid -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family,task", GRID)
@pytest.mark.parametrize("layout", ["padding-free", "padded", "left padding"])
def test_parity(family: str, task: str, layout: str, tmp_path) -> None:
    """Left padding: poolers and sequence classifiers read position 0, a padding token in transformers; only the
    padded layout (padding_free=False) reproduces a padding position's value, so those heads run padded there."""
    save_hf(family, task, tmp_path)
    left = layout == "left padding"
    check(family, task, tmp_path, left=left,
          padding_free=layout == "padding-free" or (left and task not in ("sequence-classification", "base")))


ROPES = {
    "default": {"rope_type": "default", "rope_theta": 300.0},
    "linear": {"rope_type": "linear", "factor": 3.0, "rope_theta": 300.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 300.0},
}


@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("family", FAMILIES)
def test_rope_types(family: str, rope: str, tmp_path) -> None:
    """max_position_embeddings 32 < the 70-token row, so dynamic scaling changes the base."""
    save_hf(family, "masked-lm", tmp_path, rope_parameters=ROPES[rope], max_position_embeddings=32)
    check(family, "masked-lm", tmp_path)


VARIANTS = {
    "gte": {"no token types": dict(type_vocab_size=0), "silu, eps": dict(hidden_act="silu", layer_norm_eps=1e-5),
            "classifier dropout": dict(classifier_dropout=0.3)},
    "nomic_bert": {"gelu, eps": dict(hidden_act="gelu", layer_norm_eps=1e-5),
                   "one token type": dict(type_vocab_size=1)},
    "jina_embeddings_v3": {"one token type, relu": dict(type_vocab_size=1, hidden_act="relu"),
                           "classifier dropout, dynamic rope": dict(classifier_dropout=0.2, max_position_embeddings=32,
                                                                    rope_parameters={"rope_type": "dynamic",
                                                                                     "factor": 2.0})},
    "eurobert": {"bos pooling": dict(classifier_pooling="bos"), "mean pooling": dict(classifier_pooling="mean"),
                 "no biases, one kv head each": dict(attention_bias=False, mlp_bias=False, num_key_value_heads=4),
                 "one kv head, gelu, eps": dict(num_key_value_heads=1, hidden_act="gelu", rms_norm_eps=1e-6)},
}


@pytest.mark.parametrize("family,variant", [(f, v) for f in FAMILIES for v in VARIANTS[f]])
def test_variants(family: str, variant: str, tmp_path) -> None:
    overrides = VARIANTS[family][variant]
    for task in ("sequence-classification", "masked-lm"):
        save_hf(family, task, tmp_path / task, **overrides)
        check(family, task, tmp_path / task)


@pytest.mark.parametrize("family", FAMILIES)
def test_decoder_tied_the_other_way(family: str, tmp_path) -> None:
    """GTE and NomicBERT tie the decoder to the word embeddings by default, EuroBERT does not: each the other way."""
    tied = not ROTARY_CONFIGS[family][1].get("tie_word_embeddings", family != "eurobert")
    ref = save_hf(family, "masked-lm", tmp_path, tie_word_embeddings=tied)
    assert (ref.get_output_embeddings().weight is ref.get_input_embeddings().weight) == tied
    check(family, "masked-lm", tmp_path)


def test_dynamic_rope_depends_on_the_batch(tmp_path) -> None:
    """NomicBERT's dynamic scaling (max_position_embeddings 32): a 41-token row alone gets a base scaled for 41
    positions, next to a 70-token row one scaled for 70; hfport follows transformers on each batch. Queries and
    keys are scaled up (x30) so attention is far from uniform and the positions show in the outputs."""
    import transformers

    ref = build_hf("nomic_bert", "base")
    with torch.no_grad():
        for layer in ref.layers:
            layer.self_attn.q_proj.weight.mul_(30.0)
            layer.self_attn.k_proj.weight.mul_(30.0)
    ref.save_pretrained(tmp_path)
    ours = hfport.AutoModel.from_pretrained(tmp_path)
    together = inputs_for("nomic_bert", (70, 41))
    alone = {k: v[1:, :41] for k, v in together.items()}
    with torch.no_grad():
        ours_together = ours(**together).last_hidden_state[1, :41]
        ours_alone = ours(**alone).last_hidden_state[0]
        theirs_together = transformers.AutoModel.from_pretrained(tmp_path).eval()(**together).last_hidden_state[1, :41]
        theirs_alone = transformers.AutoModel.from_pretrained(tmp_path).eval()(**alone).last_hidden_state[0]
    assert (ours_together - ours_alone).abs().max() > 1e-2  # the longest row moves the others
    torch.testing.assert_close(ours_alone, theirs_alone, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(ours_together, theirs_together, atol=ATOL, rtol=RTOL)


# --- refusals -----------------------------------------------------------------------------------------------

def edited(family: str, tmp_path: Path, **changes: Any) -> Path:
    folder = tmp_path / "edited"
    save_hf(family, "base", folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


REFUSED = [
    ("gte", "rope_parameters.rope_type", dict(rope_parameters={"rope_type": "yarn", "factor": 2.0,
                                                                "rope_theta": 10.0})),
    ("nomic_bert", "rope_parameters.rope_type", dict(rope_parameters={"rope_type": "longrope", "rope_theta": 10.0})),
    ("nomic_bert", "rope_parameters.factor", dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 10.0})),
    ("gte", "rope_parameters.partial_rotary_factor",
     dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5, "rope_theta": 9.0})),
    ("nomic_bert", "head_dim", dict(head_dim=5)),  # odd: rotary turns channel pairs (test_head_dim.py: the rest)
    ("nomic_bert", "type_vocab_size", dict(type_vocab_size=0)),
    ("nomic_bert", "hidden_dropout_prob", dict(hidden_dropout_prob=0)),  # NomicBertConfig: float only
    ("gte", "hidden_act", dict(hidden_act="nope")),
    ("gte", "vocab_size", dict(vocab_size=99.0)),
    ("gte", "pad_token_id", dict(pad_token_id=500)),
    ("eurobert", "classifier_pooling", dict(classifier_pooling="max")),
    ("eurobert", "num_key_value_heads", dict(num_key_value_heads=3)),
    ("eurobert", "head_dim", dict(head_dim=0)),
    ("eurobert", "rope_parameters.rope_type", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 10.0})),
]


@pytest.mark.parametrize("family,field,changes", REFUSED, ids=[f"{f}-{k}" for f, k, _ in REFUSED])
def test_refused_naming_the_field(family: str, field: str, changes: dict, tmp_path) -> None:
    folder = edited(family, tmp_path, **changes)
    with pytest.raises(ConfigError, match=re.escape(f"'{field}'")):
        hfport.AutoModel.from_pretrained(folder)


@pytest.mark.parametrize("family", FAMILIES)
def test_no_head_transformers_lacks(family: str, tmp_path) -> None:
    save_hf(family, "base", tmp_path)
    lacking = [hfport.AutoModelForMultipleChoice]
    if "question-answering" not in ROTARY_EXTRA_HEADS.get(family, ()):
        lacking.append(hfport.AutoModelForQuestionAnswering)
    for cls in lacking:
        with pytest.raises(ConfigError, match="has no .* model in transformers"):
            cls.from_pretrained(tmp_path)


# --- saving back --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family,task", GRID)
def test_save_pretrained_loads_in_transformers(family: str, task: str, tmp_path) -> None:
    """hfport's folder has transformers' file names (the same keys transformers writes) and loads there with
    nothing missing or unexpected, giving the same outputs."""
    import transformers
    from safetensors import safe_open

    ref = save_hf(family, task, tmp_path / "hf")
    ours = getattr(hfport, HEADS[task]).from_pretrained(tmp_path / "hf")
    ours.save_pretrained(tmp_path / "ours")
    keys = {p: set(safe_open(str(tmp_path / p / "model.safetensors"), "pt").keys()) for p in ("hf", "ours")}
    assert keys["ours"] == keys["hf"]
    back, info = getattr(transformers, HEADS[task]).from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    inputs = inputs_for(family, type_vocab_size=getattr(ref.config, "type_vocab_size", 0))
    with torch.no_grad():
        for key, value in outputs_of(task, ref(**inputs)).items():
            torch.testing.assert_close(outputs_of(task, back.eval()(**inputs))[key], value, atol=0, rtol=0)


# --- end to end: a sentence-transformers folder served through /embed --------------------------------------

def test_nomic_sentence_transformers_folder_served_through_embed(minilm_path, serve_models, tmp_path) -> None:
    """A tiny NomicBERT with BERT's tokenizer (MiniLM's WordPiece), mean pooling, normalized, and nomic-embed's
    prompts, saved by sentence-transformers itself: hfport's sentence-embedding pipeline and a served /embed (TEI)
    both equal SentenceTransformer.encode(prompt_name=...) on it. The texts stay under the tiny model's 32
    max_position_embeddings: sentence-transformers 6 caps max_seq_length there when the folder does not name one, which
    hfport's layout reader does not (yet) do; the dynamic scaling past 32 is covered by the grid above."""
    import httpx

    from sentence_transformers import SentenceTransformer, models

    plain = tmp_path / "plain"
    save_with_tokenizer("nomic_bert", "base", plain, minilm_path, vocab_size=30522)
    body = models.Transformer(str(plain), max_seq_length=64)
    st = SentenceTransformer(modules=[body, models.Pooling(32, "mean"), models.Normalize()], device="cpu",
                             prompts={"query": "search_query: ", "document": "search_document: "})
    folder = tmp_path / "st"
    st.save(str(folder))
    texts = ["What is the capital of Peru?", "The cat sat on the mat.",
             "A much longer sentence about rotary position embeddings, batches and their longest rows, going on."]
    theirs = SentenceTransformer(str(folder), device="cpu")
    pipe = hfport.pipeline("sentence-embedding", model=folder)
    for prompt in ("query", "document"):
        want = theirs.encode(texts, prompt_name=prompt, convert_to_numpy=True)  # (N, C)
        torch.testing.assert_close(torch.tensor(pipe(texts, prompt_name=prompt)), torch.tensor(want), atol=1e-5,
                                   rtol=0)
    srv = serve_models({"nomic": folder})
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as client:
            r = client.post("/embed", json={"inputs": texts, "prompt_name": "query"})
            assert r.status_code == 200, r.text
            want = theirs.encode(texts, prompt_name="query", convert_to_numpy=True)
            torch.testing.assert_close(torch.tensor(r.json()), torch.tensor(want), atol=1e-5, rtol=0)
    finally:
        srv.stop()


# --- fine-tuning into the folders sentence-transformers loads -------------------------------------------------

# each family once, for what its checkpoints are used for (embedders, rerankers), to keep the file fast (GTE's,
# NomicBERT's and EuroBERT's other task passed too when written)
FINETUNES = [("nomic_bert", "sentence-embedding", "embed"), ("jina_embeddings_v3", "sentence-embedding", "embed"),
             ("gte", "text-ranking", "rerank"), ("eurobert", "text-ranking", "rerank")]


@pytest.mark.parametrize("family,task,train", FINETUNES)
def test_finetune_and_verify_with_sentence_transformers(family: str, task: str, train: str, minilm_path,
                                                        tmp_path) -> None:
    """A few steps of `hfport finetune --task sentence-embedding | text-ranking` from a tiny base model of the
    family (MiniLM's tokenizer beside it); the best folder verifies: transformers loads it cleanly and computes what
    hfport computes, and sentence-transformers (SentenceTransformer / CrossEncoder) encodes or scores as hfport does.
    The text-ranking head is new (GTE's and NomicBERT's with their pooler, fresh)."""
    from hfport.export import verify

    data = Path(__file__).resolve().parents[1] / "examples" / "data"
    base = tmp_path / "base"
    save_with_tokenizer(family, "base", base, minilm_path, vocab_size=30522)
    config = hfport.FinetuneConfig(model=str(base), task=task, train=str(data / f"{train}_train.jsonl"),
                                   eval=str(data / f"{train}_eval.jsonl"), output_dir=str(tmp_path / "run"),
                                   batch_size=8, lr=1e-3, logging_steps=1, seed=3, max_length=48, precision="fp32",
                                   max_steps=4)
    summary = hfport.finetune(config, progress=False)
    assert summary["final_eval"], summary
    report = verify(tmp_path / "run" / "best", tmp_path / "run")
    assert report.passed, report.table()
    st_outputs = {r.output for r in report.rows if r.check == "sentence-transformers" and r.passed}
    # SentenceTransformer.encode / CrossEncoder.predict ran on the folder and agreed with hfport
    assert ("encode/values" if task == "sentence-embedding" else "predict") in st_outputs, report.table()
