"""hfport.pipeline(task, model=...): transformers' pipelines for encoder tasks, on hfport models and tokenizers.

Tasks, with transformers' option names, defaults and output shapes:
  text-classification   top_k, function_to_apply                      (TextClassificationPipeline)
  token-classification  aggregation_strategy, ignore_labels, stride   (TokenClassificationPipeline; alias "ner")
  question-answering    top_k, doc_stride, max_answer_len, max_seq_len, max_question_len,
                        handle_impossible_answer, align_to_words       (transformers 4.57's QuestionAnsweringPipeline)
  fill-mask             top_k, targets                                 (FillMaskPipeline)
  feature-extraction    per-token hidden states; pooling="mean"|"cls", normalize=True give sentence embeddings

Backends: "torch" (hfport's models) or "onnx" (an exported ONNX folder or .onnx file run by onnxruntime on the CPU,
pipelines/onnx_backend.py). The default picks "onnx" for a .onnx file or a folder with model.onnx and no safetensors.

Inputs are batched under a token budget (`max_batch_tokens` padded tokens, and at most `batch_size` rows when
given), longest first; results come back in input order. A list input answers every item it can: an item that
cannot be answered (empty text, no mask token, too long, ...) gets `{"error", "error_type", "index"}` in its place.
A single input raises PipelineInputError instead.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..modeling import TASK_CLASSES, PreTrainedEncoder, resolve_dtype
from ..tokenizer import AutoTokenizer, PreTrainedTokenizer
from .base import DEFAULT_MAX_BATCH_TOKENS, Feature, InvalidInput, Pipeline, PipelineInputError
from .classification import TextClassificationPipeline
from .features import FeatureExtractionPipeline
from .fill_mask import FillMaskPipeline
from .onnx_backend import OnnxModel, is_onnx_model
from .qa import QuestionAnsweringPipeline
from .tokens import TokenClassificationPipeline

PIPELINES: dict[str, type[Pipeline]] = {
    cls.task: cls for cls in (TextClassificationPipeline, TokenClassificationPipeline, QuestionAnsweringPipeline,
                              FillMaskPipeline, FeatureExtractionPipeline)}
ALIASES = {"sentiment-analysis": "text-classification", "ner": "token-classification"}
BACKENDS = ("torch", "onnx")


def pipeline(task: str, model: str | os.PathLike[str] | PreTrainedEncoder, *,
             tokenizer: str | os.PathLike[str] | PreTrainedTokenizer | None = None, device: Any = None,
             dtype: Any = None, batch_size: int | None = None, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
             backend: str | None = None, **options: Any) -> Pipeline:
    """A pipeline for `task` on `model` (a folder, a repo id in the local HF cache, or a loaded hfport model).

    tokenizer: defaults to the model's folder. device/dtype: where and in what precision the model runs.
    batch_size: rows per forward pass (None: only max_batch_tokens limits a batch). Further keyword arguments are
    the task's call options, used as defaults for every call (e.g. aggregation_strategy="simple").
    backend: "torch" or "onnx" (an ONNX folder, or one .onnx file such as model_quantized.onnx in it); None picks
    "onnx" for a .onnx file or a folder with model.onnx and no safetensors."""
    name = ALIASES.get(task, task)
    if name not in PIPELINES:
        raise ValueError(f"task {task!r} is not supported; supported: {sorted(PIPELINES) + sorted(ALIASES)}")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: use one of {list(BACKENDS)}")
    cls = PIPELINES[name]
    if isinstance(model, (str, os.PathLike)) and (backend == "onnx" or (backend is None and is_onnx_model(model))):
        model_path = Path(model).expanduser()
        model = OnnxModel.from_pretrained(model_path)
        tokenizer = (model_path.parent if model_path.is_file() else model_path) if tokenizer is None else tokenizer
    if isinstance(model, OnnxModel):
        if model.task != cls.model_task:
            raise ValueError(f"{name} needs a {cls.model_task} model; {model.path} is a {model.task} graph")
        if tokenizer is None:
            raise ValueError(f"{name}: a loaded model needs tokenizer= (a folder or an hfport tokenizer)")
        if (device is not None and torch.device(device).type != "cpu") or \
                (dtype is not None and resolve_dtype(dtype) != torch.float32):
            raise ValueError(f"the onnx backend runs float32 graphs on the CPU; got device={device!r}, "
                             f"dtype={dtype!r}")
    elif isinstance(model, PreTrainedEncoder):
        if model.task != cls.model_task:
            raise ValueError(f"{name} needs a {TASK_CLASSES[cls.model_task].__name__}, got a "
                             f"{type(model).__name__} ({model.task} head)")
        if tokenizer is None:
            raise ValueError(f"{name}: a loaded model needs tokenizer= (a folder or an hfport tokenizer)")
        if device is not None or dtype is not None:
            model = model.to(device=device, dtype=resolve_dtype(dtype) if dtype is not None else None)
    elif isinstance(model, (str, os.PathLike)):
        loaded = TASK_CLASSES[cls.model_task].from_pretrained(model, dtype=dtype, device=device)
        tokenizer = model if tokenizer is None else tokenizer
        model = loaded
    else:
        raise TypeError(f"model must be a folder, a repo id, an hfport model or an OnnxModel, got "
                        f"{type(model).__name__}")
    if not isinstance(tokenizer, PreTrainedTokenizer):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    return cls(model, tokenizer, batch_size=batch_size, max_batch_tokens=max_batch_tokens, **options)


__all__ = [
    "PIPELINES",
    "Feature",
    "FeatureExtractionPipeline",
    "FillMaskPipeline",
    "InvalidInput",
    "OnnxModel",
    "Pipeline",
    "PipelineInputError",
    "QuestionAnsweringPipeline",
    "TextClassificationPipeline",
    "TokenClassificationPipeline",
    "pipeline",
]
