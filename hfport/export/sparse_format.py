"""The SparseEncoder format (SPLADE): a masked-LM HF folder plus sentence-transformers' sparse files (modules.json:
Transformer fill-mask -> SpladePooling; formats/sentence_transformers.py owns the layout). Here: the layout step the
HF folder writer (export/folder.py) adds, and the verify: the HF folder's rows (transformers' load, weights, logits)
plus the proof through sentence-transformers' own loader:
    sparse-encoder/pooling   DIR's SpladePooling options equal the source's (its layout, else SpladePooling's defaults)
    sparse-encoder/support   SparseEncoder(DIR).encode() has the same nonzero entries as hfport's sparse-embedding
                             pipeline on the source model
    sparse-encoder/values    and the same values (the report's tolerance; hfport's vectors are the reference)
sentence-transformers is imported inside the rows only: the core never needs it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..formats.sentence_transformers import (SentenceTransformersError, SparseLayout, has_sparse_layout,
                                            read_sparse_layout, write_sparse_layout)
from ..modeling import PreTrainedEncoder
from ..pipelines import SparseEmbeddingPipeline
from ..tasks import load_any
from ..tokenizer import AutoTokenizer
from .checks import PROBE_TEXTS
from .common import ExportError, Source
from .folder import verify_folder
from .report import VerifyReport, check_row, compare, reporting

SPARSE_TASK = "fill-mask"  # the masked-LM model a SparseEncoder folder holds
CHECK = "sparse-encoder"


def source_layout(folder: Path) -> SparseLayout:
    """A folder's SpladePooling: its SparseEncoder files, else SpladePooling's defaults (max, relu)."""
    return read_sparse_layout(folder) if has_sparse_layout(folder) else SparseLayout()


def sparse_layout(staging: Path, source: Source, model: PreTrainedEncoder, options: Any) -> None:
    """The SparseEncoder format: the masked-LM model with modules.json and 1_SpladePooling as the source's layout says
    (else max pooling of relu); the card lists it as a SparseEncoder (export/card.py reads the layout)."""
    if model.task != SPARSE_TASK:
        raise ExportError(f"{source.model}: a SparseEncoder folder holds a masked-LM model ({SPARSE_TASK}); this is a "
                          f"{model.task} model")
    layout = source_layout(source.model)
    write_sparse_layout(staging, max_seq_length=layout.max_seq_length or model.config.max_position_embeddings,
                        pooling_strategy=layout.pooling_strategy, activation=layout.activation,
                        prompts=layout.prompts, default_prompt_name=layout.default_prompt_name)


def verify_sparse(dir: str | os.PathLike[str], source: str | os.PathLike[str] | None = None, *,
                  atol: float | None = None, rtol: float | None = None,
                  json_path: str | os.PathLike[str] | None = None, which: str = "best",
                  label: str | None = None) -> VerifyReport:
    """The HF folder's verify (export/folder.py), then SparseEncoder(DIR).encode() against hfport's sparse vectors
    of the source. Never raises for a failed check; json_path: also write the report there."""
    folder = Path(dir).expanduser()
    report = verify_folder(folder, source, atol=atol, rtol=rtol, which=which, label=label)
    with reporting(report, json_path):
        with check_row(report, CHECK, "encode"):
            encode_rows(report, folder, Path(report.source))
    return report


def encode_rows(report: VerifyReport, folder: Path, source_model: Path) -> None:
    try:
        from sentence_transformers import SparseEncoder
    except ImportError as e:
        raise SentenceTransformersError("the folder is a SparseEncoder model, and proving it needs the "
                                        "sentence-transformers package: pip install sentence-transformers") from e
    declared, reference = read_sparse_layout(folder), source_layout(source_model)
    options = (declared.pooling_strategy, declared.activation)
    wanted = (reference.pooling_strategy, reference.activation)
    report.add(CHECK, "pooling", options == wanted, tolerance="equal",
               detail=f"DIR pools {options}, the source {wanted}")
    encoder = SparseEncoder(str(folder), device="cpu", trust_remote_code=False)
    theirs = encoder.encode(PROBE_TEXTS, convert_to_tensor=True, batch_size=len(PROBE_TEXTS))
    theirs = theirs.to_dense().double()  # (N, V)
    ours = load_any(source_model, dtype=torch.float32)
    pipe = SparseEmbeddingPipeline(ours, AutoTokenizer.from_pretrained(folder))
    mine = torch.zeros_like(theirs)  # (N, V)
    for row, entries in enumerate(pipe(PROBE_TEXTS, truncate=True)):
        for e in entries:
            mine[row, e["index"]] = e["value"]
    differ = int(((mine != 0) != (theirs != 0)).sum())
    report.add(CHECK, "support", differ == 0, shape=tuple(theirs.shape), tolerance="equal",
               detail=f"{differ} entries nonzero in one and zero in the other; "
                      f"{int((mine != 0).sum())} nonzeros in hfport's vectors")
    compare(report, CHECK, "values", theirs, mine, rtol=0.0,
            what="SparseEncoder.encode (hfport's sparse vectors are the reference)")
