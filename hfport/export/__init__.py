"""Export: writers per format, each with its proof.

  folder.py   export(src, out): an HF folder transformers loads (config, safetensors, tokenizer, model card)
  card.py     the model card (README.md) from the config and the run's RunSummary
  verify.py   verify(dir, source): transformers loads DIR and computes what hfport computes from SOURCE
  sentence_transformers.py  the sentence-transformers layout (modules.json, 1_Pooling, 2_Normalize; the
              CrossEncoder marker): its writer, its one reader (read_layout, which serving uses too) and its
              verify rows
  common.py   what formats share: ExportError, where SRC's model is (resolve_source, through RunDir), dtype and
              task tables

A new format is a module here (its writer and its verify) re-exported below.
"""

from .card import model_card
from .common import (DTYPE_NAMES, EXPORT_DTYPES, OUTPUTS, PIPELINE_TAGS, TRANSFORMERS_AUTO, WHICH, ExportError,
                     Source, resolve_source)
from .folder import ExportOptions, ExportResult, export
from .sentence_transformers import read_st_pooling, write_embedding_layout
from .verify import TOLERANCES, Row, VerifyFailed, VerifyReport, verify

__all__ = ["DTYPE_NAMES", "EXPORT_DTYPES", "OUTPUTS", "PIPELINE_TAGS", "TOLERANCES", "TRANSFORMERS_AUTO", "WHICH",
           "ExportError", "ExportOptions", "ExportResult", "Row", "Source", "VerifyFailed", "VerifyReport", "export",
           "model_card", "read_st_pooling", "resolve_source", "verify", "write_embedding_layout"]
