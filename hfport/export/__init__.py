"""Export: a registry of formats (registry.py), each a writer and its proof, and `export` / `verify` dispatching
through it. The floors, bottom up (each imports only from below):

  common.py     what formats share: ExportError, ExportResult, FormatOptions, where SRC's model is (resolve_source,
                through RunDir), where OUT may go, the staged write (hfport/staging.py), dtype and task tables
  report.py     VerifyReport and its rows, the fail-closed row guard, tolerances, the one output comparison
  checks.py     the checks verifies share: transformers' load, labels, weights, tokenizer, model outputs
  card.py       the model card every format writes after verify (one builder; CardStyle: what a format adds)
  sentence_formats.py  the sentence-transformers formats' layout steps and encode()/predict() rows
  folder.py     format hf: the HF folder (ExportOptions, write_folder, verify_folder)
  peft.py       formats peft and merged: a LoRA adapter as itself or folded into its base
  sparse_format.py  format sparse-encoder: the SparseEncoder (SPLADE) layout step and its verify
  probes.py     the calibration texts, the int8 gate's judged texts (built in, or --gate-data) apart from them
  onnx_agreement.py, onnx_fusion.py, onnx_verify.py, onnx.py   formats onnx and onnx-int8
  openvino.py, openvino_verify.py   formats openvino and openvino-int8 (from onnx.py's graph)
  graph_verify.py   the checks both graph folders run (a GraphVerify record a format)
  registry.py   FORMATS (one record a format), detect_format, export, verify
  int8_choice.py  dtype="auto-int8" through pipeline(): the fastest int8 path installed that passes its gate

A new format is a module with its writer and its verify, and one record in registry.py.
"""

from .card import model_card
from .common import (DTYPE_NAMES, EXPORT_DTYPES, OUTPUTS, PIPELINE_TAGS, TRANSFORMERS_AUTO, WHICH, ExportError,
                     ExportResult, FormatOptions, Source, resolve_source)
from .folder import ExportOptions, SentenceTransformersOptions
from .onnx import OnnxOptions
from .openvino import OpenVinoOptions
from .registry import DEFAULT_FORMAT, FORMATS, ExportFormat, detect_format, export, formats_help, get_format, verify
from . import int8_choice  # noqa: F401 - hands pipeline() its auto-int8 chooser (int8_choice.py)
from .report import TOLERANCES, Row, VerifyFailed, VerifyReport
from ..formats.sentence_transformers import read_st_pooling, write_embedding_layout

__all__ = ["DEFAULT_FORMAT", "DTYPE_NAMES", "EXPORT_DTYPES", "FORMATS", "OUTPUTS", "PIPELINE_TAGS", "TOLERANCES",
           "TRANSFORMERS_AUTO", "WHICH", "ExportError", "ExportFormat", "ExportOptions", "ExportResult",
           "FormatOptions", "OnnxOptions", "OpenVinoOptions", "Row", "SentenceTransformersOptions", "Source",
           "VerifyFailed", "VerifyReport", "detect_format", "export", "formats_help", "get_format", "model_card",
           "read_st_pooling", "resolve_source", "verify", "write_embedding_layout"]
