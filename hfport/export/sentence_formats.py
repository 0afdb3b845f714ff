"""The two sentence-transformers formats, each an HF folder plus its own files (formats/sentence_transformers.py
owns the layout): the dense embedding folder (modules.json, 1_Pooling, 2_Normalize) and the reranker (CrossEncoder's
marker in config.json). Here: the layout step each adds to the HF folder writer (export/folder.py), and the rows each
adds to its verify:
    encode     SentenceTransformer(DIR).encode() against hfport's sentence-embedding pipeline on the source model,
               pooled as the source declares (cosine per text >= MIN_COSINE[dtype], and max abs diff <= atol);
    predict    CrossEncoder(DIR).predict() against hfport's one-label text-classification scores (<= atol).
sentence-transformers is imported inside the rows only: the core never needs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..modeling import PreTrainedEncoder
from ..pipelines import SentenceEmbeddingPipeline, TextClassificationPipeline
from ..tokenizer import AutoTokenizer
from .common import ExportError, Source
from .report import VerifyReport, compare
from ..formats.sentence_transformers import (SentenceTransformersError, copy_layout, has_embedding_layout,
                                            is_cross_encoder, mark_cross_encoder, read_layout, read_st_pooling,
                                            write_embedding_layout)

# cosine similarity of encode() to hfport's embedding, per text, at least this (and the max abs diff within verify's
# atol), by the dtype DIR's weights are stored in. sentence-transformers computes in that dtype, hfport in float32
# from the source: float32 differs by summation order only; fp16/bf16 add weight and activation rounding (measured on
# the real MiniLM: lowest cosine 0.99983 at bf16), so their floors are looser.
MIN_COSINE = {"float32": 0.99999, "float16": 0.9995, "bfloat16": 0.999}
EMBEDDING_TASK = "feature-extraction"  # the bare encoder an embedding folder holds
RERANKER_TASK = "text-classification"  # with one label


# --- the layout steps (called with the staged folder, its config.json already written) ------------------------


def keep_layout(staging: Path, source: Source, model: PreTrainedEncoder, options: Any) -> None:
    """The HF folder format: a source in the sentence-transformers layout keeps it (its config, and so a reranker's
    marker, is kept anyway)."""
    copy_layout(source.model, staging)


def embedding_layout(staging: Path, source: Source, model: PreTrainedEncoder, options: Any) -> None:
    """The sentence-transformers format: the bare encoder with modules.json, pooling and normalize as the options
    say, else as the source's layout says, else mean pooling without normalizing (sentence-transformers' default)."""
    if model.task != EMBEDDING_TASK:
        raise ExportError(f"{source.model}: a sentence-transformers embedding folder holds the bare encoder "
                          f"({EMBEDDING_TASK}); this is a {model.task} model")
    pooling, normalize = read_st_pooling(source.model) if has_embedding_layout(source.model) else ("mean", False)
    layout = read_layout(source.model)
    write_embedding_layout(staging, pooling=options.pooling or pooling,
                           normalize=normalize if options.normalize is None else options.normalize,
                           hidden_size=model.config.hidden_size,
                           max_seq_length=layout.max_seq_length or model.config.max_position_embeddings,
                           prompts=layout.prompts, default_prompt_name=layout.default_prompt_name,
                           include_prompt=layout.include_prompt, matryoshka_dims=layout.matryoshka_dims)


def reranker_marker(staging: Path, source: Source, model: PreTrainedEncoder, options: Any) -> None:
    """The reranker format: a one-label text-classification model, with CrossEncoder's marker in config.json."""
    if model.task != RERANKER_TASK or model.config.num_labels != 1:
        raise ExportError(f"{source.model}: a CrossEncoder reranker is a one-label {RERANKER_TASK} model; this is a "
                          f"{model.task} model with {model.config.num_labels} label(s)")
    mark_cross_encoder(staging)


# --- the rows ---------------------------------------------------------------------------------------------------


def sentence_rows(report: VerifyReport, folder: Path, raw: dict[str, Any], ours: PreTrainedEncoder,
                  source_model: Path, texts: list[str], pairs: list[tuple[str, str]]) -> None:
    """Rows for a folder in either sentence-transformers format: encode() for an embedding folder, predict() for a
    reranker. Adds nothing for a folder that is neither. Raises (-> a FAIL row) when sentence-transformers is
    missing."""
    embedding, cross = has_embedding_layout(folder), is_cross_encoder(raw)
    if not embedding and not cross:
        return
    try:
        import sentence_transformers
    except ImportError as e:
        raise SentenceTransformersError("the folder is a sentence-transformers model, and proving it needs the "
                                        "sentence-transformers package: pip install sentence-transformers") from e
    if embedding:
        encode_rows(report, sentence_transformers, folder, ours, source_model, texts)
    if cross:
        predict_rows(report, sentence_transformers, folder, ours, pairs)


def encode_rows(report: VerifyReport, st: Any, folder: Path, ours: PreTrainedEncoder, source_model: Path,
                texts: list[str]) -> None:
    declared = read_st_pooling(folder)
    reference = read_st_pooling(source_model) if has_embedding_layout(source_model) else declared
    report.add("sentence-transformers", "pooling", declared == reference, tolerance="equal",
               detail=f"DIR declares {declared}, the source {reference}")
    pooling, normalize = reference
    model = st.SentenceTransformer(str(folder), device="cpu", trust_remote_code=False)
    report.add("sentence-transformers", f"load ({len(model)} modules)", True)
    theirs = torch.from_numpy(model.encode(texts, convert_to_numpy=True, batch_size=len(texts))).double()  # (N, C)
    pipe = SentenceEmbeddingPipeline(ours, AutoTokenizer.from_pretrained(folder))
    mine = torch.tensor(pipe(texts, pooling=pooling, normalize=normalize, truncate=True),
                        dtype=torch.float64)  # (N, C)
    if theirs.shape == mine.shape:
        cosine = torch.nn.functional.cosine_similarity(theirs, mine, dim=-1)  # (N,)
        worst = float(cosine.min())
        floor = MIN_COSINE.get(report.dtype or "float32", MIN_COSINE["float32"])
        report.add("sentence-transformers", "encode/cosine", worst >= floor, shape=tuple(theirs.shape),
                   diff=1.0 - worst, tolerance=f"cosine >= {floor}",
                   detail=f"lowest cosine {worst:.8f} between sentence-transformers' and hfport's embedding")
    compare(report, "sentence-transformers", "encode/values", theirs, mine, rtol=0.0,
            what="SentenceTransformer.encode (hfport's embeddings are the reference)")


def predict_rows(report: VerifyReport, st: Any, folder: Path, ours: PreTrainedEncoder,
                 pairs: list[tuple[str, str]]) -> None:
    model = st.CrossEncoder(str(folder), device="cpu", trust_remote_code=False)
    activation = type(model.activation_fn).__name__
    report.add("sentence-transformers", "CrossEncoder activation", activation == "Sigmoid", tolerance="Sigmoid",
               detail=f"CrossEncoder applies {activation}; hfport's one-label pipeline applies a sigmoid")
    theirs = torch.as_tensor(model.predict(pairs, convert_to_numpy=True, batch_size=len(pairs)),
                             dtype=torch.float64).reshape(-1)  # (N,)
    pipe = TextClassificationPipeline(ours, AutoTokenizer.from_pretrained(folder))
    mine = torch.tensor([r["score"] for r in pipe([{"text": q, "text_pair": d} for q, d in pairs])],
                        dtype=torch.float64)  # (N,)
    compare(report, "sentence-transformers", "predict", theirs, mine, rtol=0.0,
            what="CrossEncoder.predict (hfport's scores are the reference)")
