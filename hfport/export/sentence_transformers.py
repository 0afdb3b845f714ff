"""The sentence-transformers layout: its one writer, its reader, and its proof.

An embedding model folder is an HF folder (config.json, weights, tokenizer) plus the files sentence-transformers
reads to build its module chain Transformer -> Pooling [-> Normalize]:
    modules.json                 the chain: each module's class and sub-folder
    sentence_bert_config.json    max_seq_length (ST truncates there) and do_lower_case
    1_Pooling/config.json        which pooling (pooling_mode_cls_token / _mean_tokens / _max_tokens booleans)
    2_Normalize/                 present (empty) when embeddings are L2-normalised
    config_sentence_transformers.json  the similarity function (cosine) and versions
This is the classic layout (sentence-transformers 2.x-5.x writes it, 6.x still reads it, and so do text-embeddings-
inference and other servers), so one folder serves them all.

A reranker (cross-encoder) folder is a one-label HF sequence-classification folder whose config.json carries
`"sentence_transformers": {"activation_fn": "torch.nn.modules.activation.Sigmoid"}`: CrossEncoder's own marker
(sentence-transformers >= 4), read by its `predict()` to put a sigmoid on the logit, as hfport's
text-classification pipeline does for one label.

`verify_rows` is the proof (called by export/verify.py): sentence-transformers loads DIR and its `encode()` /
`predict()` equals hfport's embeddings / scores from SOURCE. sentence-transformers is imported there only.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np

from .. import hub
from ..formats.sentence_transformers import (ALL_FLAGS, CROSS_ENCODER_KEY, MODULE_TYPES, MODULES, NORMALIZE_DIR,
                                             POOLING_DIR, POOLING_FLAGS, POOLING_MODES, SIGMOID, ST_CONFIG,
                                             ST_MODEL_CONFIG, SentenceTransformersError, has_embedding_layout,
                                             is_cross_encoder, read_layout, read_max_seq_length, read_st_pooling)

# cosine similarity of encode() to hfport's embedding, per text, at least this (and the max abs diff within verify's
# atol), by the dtype DIR's weights are stored in. sentence-transformers computes in that dtype, hfport in float32
# from the source: float32 differs by summation order only; fp16/bf16 add weight and activation rounding (measured on
# the real MiniLM: lowest cosine 0.99983 at bf16), so their floors are looser.
MIN_COSINE = {"float32": 0.99999, "float16": 0.9995, "bfloat16": 0.999}


# --- writing ----------------------------------------------------------------------------------------------------


def write_embedding_layout(folder: str | Path, *, pooling: str, normalize: bool, hidden_size: int,
                           max_seq_length: int, prompts: dict[str, str] | None = None,
                           default_prompt_name: str | None = None, include_prompt: bool = True) -> list[str]:
    """Add the sentence-transformers files to an HF folder (its config and weights already there). Returns the names
    written. Each file is written whole (write_json_atomic), and a folder from an earlier save is replaced."""
    if pooling not in POOLING_MODES:
        raise SentenceTransformersError(f"pooling {pooling!r}: expected one of {list(POOLING_MODES)}")
    folder = Path(folder)
    modules = [{"idx": 0, "name": "0", "path": "", "type": MODULE_TYPES["transformer"]},
               {"idx": 1, "name": "1", "path": POOLING_DIR, "type": MODULE_TYPES["pooling"]}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": NORMALIZE_DIR, "type": MODULE_TYPES["normalize"]})
    hub.write_json_atomic(folder / MODULES, modules)
    hub.write_json_atomic(folder / ST_CONFIG, {"max_seq_length": int(max_seq_length), "do_lower_case": False})
    (folder / POOLING_DIR).mkdir(exist_ok=True)
    flags = {flag: False for flag in ALL_FLAGS}
    flags[POOLING_FLAGS[pooling]] = True
    hub.write_json_atomic(folder / POOLING_DIR / "config.json",
                          {"word_embedding_dimension": int(hidden_size), **flags, "include_prompt": include_prompt})
    if normalize:
        (folder / NORMALIZE_DIR).mkdir(exist_ok=True)
    elif (folder / NORMALIZE_DIR).exists():
        shutil.rmtree(folder / NORMALIZE_DIR)
    hub.write_json_atomic(folder / ST_MODEL_CONFIG, {"model_type": "SentenceTransformer",
                                                     "prompts": dict(prompts or {}),
                                                     "default_prompt_name": default_prompt_name,
                                                     "similarity_fn_name": "cosine"})
    return [MODULES, ST_CONFIG, f"{POOLING_DIR}/config.json", ST_MODEL_CONFIG] + ([NORMALIZE_DIR] if normalize
                                                                                  else [])


def mark_cross_encoder(folder: str | Path) -> None:
    """Put CrossEncoder's marker into a one-label classification folder's config.json (see the module docstring)."""
    path = Path(folder) / "config.json"
    raw, _ = hub.read_config(Path(folder))
    if raw.get("num_labels", len(raw.get("id2label") or {})) != 1:
        raise SentenceTransformersError(f"{path}: a cross-encoder has one label; this config has "
                                        f"{len(raw.get('id2label') or {})}")
    raw[CROSS_ENCODER_KEY] = {"activation_fn": SIGMOID}
    hub.write_json_atomic(path, raw)


def copy_layout(source: str | Path, out: str | Path) -> list[str]:
    """Copy an embedding folder's sentence-transformers files to OUT (an export of its weights); [] when SOURCE has
    none. The files are re-written from what the reader understood, so OUT never carries a module hfport did not
    check (a Dense layer, say, which `read_st_pooling` refuses)."""
    if not has_embedding_layout(source):
        return []
    pooling, normalize = read_st_pooling(source)
    layout = read_layout(source)
    raw, _ = hub.read_config(Path(source))
    return write_embedding_layout(out, pooling=pooling, normalize=normalize, hidden_size=raw["hidden_size"],
                                  max_seq_length=layout.max_seq_length or raw.get("max_position_embeddings", 512),
                                  prompts=layout.prompts, default_prompt_name=layout.default_prompt_name,
                                  include_prompt=layout.include_prompt)


# --- the proof --------------------------------------------------------------------------------------------------


def verify_rows(report: Any, folder: Path, raw: dict[str, Any], ours: Any, source_model: Path, texts: list[str],
                pairs: list[tuple[str, str]]) -> None:
    """Rows of export/verify.py's report for a sentence-transformers folder: SentenceTransformer(DIR).encode() against
    hfport's embeddings (pooling as SOURCE declares it), or CrossEncoder(DIR).predict() against hfport's scores.
    Adds nothing for a folder that is neither. Raises (-> a FAIL row) when sentence-transformers is missing."""
    embedding, cross = has_embedding_layout(folder), is_cross_encoder(raw)
    if not embedding and not cross:
        return
    try:
        import sentence_transformers
    except ImportError as e:
        raise SentenceTransformersError("the folder is a sentence-transformers model, and proving it needs the "
                                        "sentence-transformers package: pip install sentence-transformers") from e
    if embedding:
        _verify_embeddings(report, sentence_transformers, folder, ours, source_model, texts)
    if cross:
        _verify_cross_encoder(report, sentence_transformers, folder, ours, source_model, pairs)


def _verify_embeddings(report: Any, st: Any, folder: Path, ours: Any, source_model: Path, texts: list[str]) -> None:
    from ..pipelines.features import FeatureExtractionPipeline
    from ..tokenizer import AutoTokenizer

    declared = read_st_pooling(folder)
    reference = read_st_pooling(source_model) if has_embedding_layout(source_model) else declared
    report.add("sentence-transformers", "pooling", declared == reference, tolerance="equal",
               detail=f"DIR declares {declared}, the source {reference}")
    pooling, normalize = reference
    model = st.SentenceTransformer(str(folder), device="cpu", trust_remote_code=False)
    report.add("sentence-transformers", f"load ({len(model)} modules)", True)
    theirs = model.encode(texts, convert_to_numpy=True, batch_size=len(texts)).astype(np.float64)  # (N, C)
    pipe = FeatureExtractionPipeline(ours, AutoTokenizer.from_pretrained(folder), pooling=pooling,
                                     normalize=normalize, return_tensors=True)
    max_length = read_max_seq_length(folder)
    mine = np.stack([v.double().numpy() for v in pipe(texts, truncation=True, max_length=max_length)])  # (N, C)
    _embedding_rows(report, "encode", theirs, mine)


def _embedding_rows(report: Any, name: str, theirs: np.ndarray, mine: np.ndarray) -> None:
    if theirs.shape != mine.shape:
        report.add("sentence-transformers", name, False, shape=theirs.shape,
                   detail=f"sentence-transformers {list(theirs.shape)} vs hfport {list(mine.shape)}")
        return
    cosine = (theirs * mine).sum(-1) / (np.linalg.norm(theirs, axis=-1) * np.linalg.norm(mine, axis=-1))  # (N,)
    diff = float(np.abs(theirs - mine).max())
    worst = float(cosine.min())
    floor = MIN_COSINE.get(report.dtype or "float32", MIN_COSINE["float32"])
    report.add("sentence-transformers", f"{name}/cosine", bool(worst >= floor), shape=theirs.shape,
               diff=1.0 - worst, tolerance=f"cosine >= {floor}",
               detail=f"lowest cosine {worst:.8f} between sentence-transformers' and hfport's embedding")
    ok = bool(np.isfinite(diff) and diff <= report.atol)
    report.add("sentence-transformers", f"{name}/values", ok, shape=theirs.shape, diff=diff,
               tolerance=f"atol={report.atol:g}", detail="" if ok else f"max abs diff {diff:.3g}")


def _verify_cross_encoder(report: Any, st: Any, folder: Path, ours: Any, source_model: Path,
                          pairs: list[tuple[str, str]]) -> None:
    from ..pipelines.classification import TextClassificationPipeline
    from ..tokenizer import AutoTokenizer

    model = st.CrossEncoder(str(folder), device="cpu", trust_remote_code=False)
    activation = type(model.activation_fn).__name__
    report.add("sentence-transformers", "CrossEncoder activation", activation == "Sigmoid", tolerance="Sigmoid",
               detail=f"CrossEncoder applies {activation}; hfport's one-label pipeline applies a sigmoid")
    theirs = np.asarray(model.predict(pairs, convert_to_numpy=True, batch_size=len(pairs)),
                        dtype=np.float64).reshape(-1)  # (N,)
    pipe = TextClassificationPipeline(ours, AutoTokenizer.from_pretrained(folder))
    mine = np.asarray([r["score"] for r in pipe([{"text": q, "text_pair": d} for q, d in pairs])], dtype=np.float64)
    if theirs.shape != mine.shape:
        report.add("sentence-transformers", "predict", False, shape=theirs.shape,
                   detail=f"sentence-transformers {list(theirs.shape)} vs hfport {list(mine.shape)}")
        return
    diff = float(np.abs(theirs - mine).max())
    ok = bool(np.isfinite(diff) and diff <= report.atol)
    report.add("sentence-transformers", "predict", ok, shape=theirs.shape, diff=diff, tolerance=f"atol={report.atol:g}",
               detail="" if ok else f"CrossEncoder.predict differs from hfport's scores (max abs diff {diff:.3g})")
