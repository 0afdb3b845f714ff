"""hfport.pipeline(task, model=...): transformers' pipelines for encoder tasks, on hfport models and tokenizers.

Tasks, with transformers' option names, defaults and output shapes:
  text-classification   top_k, function_to_apply                      (TextClassificationPipeline)
  token-classification  aggregation_strategy, ignore_labels, stride   (TokenClassificationPipeline)
  question-answering    top_k, doc_stride, max_answer_len, max_seq_len, max_question_len,
                        handle_impossible_answer, align_to_words       (transformers 4.57's QuestionAnsweringPipeline)
  fill-mask             top_k, targets                                 (FillMaskPipeline)
  zero-shot-classification  candidate_labels, hypothesis_template, multi_label: an NLI text-classification model
                        scores labels given at call time                (ZeroShotClassificationPipeline)
  multiple-choice       top_k; {"question" (or "context"), "choices"} inputs, the choices ranked  (hfport's own)
  feature-extraction    per-token hidden states on every folder, as transformers' pipeline returns them (a
                        sentence-transformers folder too); pooling="mean"|"cls"|"max"|..., normalize=True give
                        sentence embeddings
A task may be named by an alias too ("sentiment-analysis", "ner", hfport's old "sequence-classification", ...):
hfport/tasks/ holds the names and which pipeline class each task uses.
  sentence-embedding    one vector per text, pooled as the folder's sentence-transformers files say; truncate,
                        dimensions, prompt_name (hfport.embeddings.SentenceEmbeddingPipeline; alias
                        "sentence-embeddings", "sentence-similarity")
  sparse-embedding      SPLADE: a vocabulary-sized sparse vector per text, [{"index", "value"}] of its nonzeros (TEI's
                        shape), pooled as the folder's SparseEncoder files say; truncate, prompt_name, max_active_dims
                        (alias "splade")
  text-ranking          a cross-encoder: text-classification's pipeline over (query, text) pairs

Backends: "torch" (hfport's models) or a graph backend (pipelines/backends.py): "onnx" (an exported ONNX folder or
.onnx file run by onnxruntime on the CPU, pipelines/onnx_backend.py) and "openvino" (an exported OpenVINO folder or
IR .xml file run by OpenVINO on the CPU, pipelines/openvino_backend.py). The default picks the graph backend whose
folder it is (model.onnx, or openvino_model.xml, and no safetensors), else "torch". A graph folder runs the graph its
manifest names (an int8 export: its int8 graph), or `file=` another of its graphs (file="model.onnx" or
"openvino_model.xml": the fp32 one).

Adapters: `adapters={"name": folder, ...}` loads LoRA adapters (PEFT's folders) over the model, sharing its body; a
call's `adapter="name"` (or a list with a name or None per input) picks each input's adapter, and inputs of
different adapters share forward passes (pipelines/base.py: Pipeline.add_adapter).

Inputs are batched under a token budget (`max_batch_tokens` padded tokens, and at most `batch_size` rows when
given), longest first; results come back in input order. A list input answers every item it can: an item that
cannot be answered (empty text, no mask token, too long, ...) gets an `hfport.ItemError` in its place (rendered by
the CLI and the HTTP API as `{"error", "error_type", "index"}`). A single input raises PipelineInputError instead
(InputTooLongError for one longer than the model takes).

truncation= (transformers' spelling) and truncate= (TEI's and sentence-transformers') are one option: every pipeline
that cuts long inputs takes both.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .. import hub, tasks
from ..errors import ItemError, UntrainedHeadError
from ..formats.adapter import is_adapter_folder
from ..formats.sentence_transformers import has_sparse_layout
from ..hardware import device_name, resolve_device
from ..modeling import BASE_TASK, INT8_DTYPES, PreTrainedEncoder, resolve_dtype, task_of
from ..registry import get_family
from ..tokenizer import AutoTokenizer, PreTrainedTokenizer, has_tokenizer_files
from .backends import BACKENDS, graph_backend
from .base import (DEFAULT_MAX_BATCH_TOKENS, Feature, InputTooLongError, InvalidInput, Pipeline, PipelineInputError,
                   Prepared, check_bool, pack_rows)
from .classification import TextClassificationPipeline
from .features import FeatureExtractionPipeline
from .fill_mask import FillMaskPipeline
from .graph import GraphModel
from .onnx_backend import OnnxModel
from .openvino_backend import OpenVinoModel
from .qa import QuestionAnsweringPipeline
from .sentence_embedding import SentenceEmbeddingPipeline
from .sparse_embedding import SparseEmbeddingPipeline
from .tokens import TokenClassificationPipeline
from .zero_shot import ZeroShotClassificationPipeline

# How dtype="auto-int8" weighs the graph exports against hfport's engine (hfport/export/int8_choice.py's choose): the
# exporters are a floor above the pipelines, so it is handed down, as modeling's INT8_LOADER is, and installed when
# hfport.export is imported (hfport's __init__ imports it, so every pipeline() has it).
INT8_CHOOSER: Callable[..., tuple[Any, Any]] | None = None
MEASURE_BATCH = 32  # rows per batch of the pipelines auto-int8 times


class _Pipelines(Mapping[str, type[Pipeline]]):
    """Task name -> its pipeline class, read off the task records when asked (a record names its pipeline as
    "module:Class", imported on first use, so building this at import would import every pipeline module from here).
    The model-only heads (pretraining, next-sentence-prediction) have none."""

    def __getitem__(self, name: str) -> type[Pipeline]:
        if name not in tasks.PIPELINE_TASKS:
            raise KeyError(name)
        return tasks.TASKS[name].pipeline_class

    def __iter__(self) -> Iterator[str]:
        return iter(tasks.PIPELINE_TASKS)

    def __len__(self) -> int:
        return len(tasks.PIPELINE_TASKS)


PIPELINES: Mapping[str, type[Pipeline]] = _Pipelines()


def pipeline(task: str, model: str | os.PathLike[str] | PreTrainedEncoder, *,
             tokenizer: str | os.PathLike[str] | PreTrainedTokenizer | None = None, device: Any = None,
             dtype: Any = None, batch_size: int | None = None, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
             backend: str | None = None, base_model: Any = None,
             adapters: Mapping[str, str | os.PathLike[str]] | None = None,
             gate_data: str | os.PathLike[str] | None = None, file: str | None = None, packed_linear: bool = True,
             row_shards: str | int = "auto", int8_paths: Sequence[str] | None = None,
             allow_untrained_head: bool = False, **options: Any) -> Pipeline:
    """A pipeline for `task` on `model` (a folder, a repo id in the local HF cache, or a loaded hfport model).

    tokenizer: defaults to the model's folder. device/dtype: where and in what precision the model runs; device
    "auto" is the first CUDA device when there is one, else the CPU ("cpu", "cuda", "cuda:N" or a torch.device;
    None: the CPU for a folder, where it is for a loaded model).
    batch_size: rows per forward pass (None: only max_batch_tokens limits a batch). Further keyword arguments are
    the task's call options, used as defaults for every call (e.g. aggregation_strategy="simple").
    backend: "torch", "onnx" (an ONNX folder, or one .onnx file such as model_quantized.onnx in it) or "openvino"
    (an OpenVINO folder, or one IR .xml file in it); None picks the graph backend whose folder or file it is, else
    "torch". A graph runs on the CPU; dtype None/"auto" computes in the graph's own precision (float32; an OpenVINO
    folder's int8 IR in the bf16 its manifest records where the export's gate passed it so), float32 in float32 (the
    OpenVINO backend also runs dtype="bfloat16": OpenVINO's bf16 inference precision).
    file: the graph of an ONNX or OpenVINO folder to run (default: the one its manifest names; an int8 export's int8
    graph).
    adapters: {name: adapter folder} served over `model` (its body shared, not reloaded); pick one per call with
    `adapter=`.
    dtype="int8" / "auto-int8" (a folder only): the encoder's Linear layers in int8, held to the int8 gate on built-in
    texts and `gate_data` (a file; hfport/int8.py); "auto-int8" falls back to bf16 where the gate refuses. On a
    folder served on the CPU without adapters, "auto-int8" also weighs the graph runtimes installed: the folder is
    exported as onnx-int8 and openvino-int8 into the cache (each behind its own gate), every int8 path that passes is
    timed in batches and one input alone, and the fastest on both together serves, said in the log and the model's
    load notes (hfport/export/int8_choice.py; kept for the next load). int8_paths: the paths it may choose from
    ("torch", "onnx", "openvino"; default: all installed).
    packed_linear: the pipeline's model computes its Linear layers on prepacked weights (hfport/inference.py; applied
    in place, also to a model given loaded). row_shards: "auto", "off" or a count: a batch's rows split over worker
    threads (pipelines/shards.py; "auto" shards fp32 models only, where it was measured to pay).
    A folder whose weights lack the task's head is refused (UntrainedHeadError: its answers would come from random
    weights), unless `adapters` are given or allow_untrained_head=True (a server's base that adapters bringing their
    own heads join, `add_adapter`): then the pipeline loads, answers through its adapters, and refuses every call that
    would answer with the base's own head."""
    record = tasks.get(task)
    name, cls = record.name, record.pipeline_class  # a model-only head's record says what loads it instead
    check_bool("packed_linear", packed_linear)  # before the model loads: "no" is truthy and would turn it on
    check_bool("allow_untrained_head", allow_untrained_head)
    auto = isinstance(device, str) and device.strip().lower() == "auto"  # an ONNX graph then runs on the CPU
    device = resolve_device(device) if device is not None else None
    graph = graph_backend(model, backend) if isinstance(model, (str, os.PathLike)) else None
    untrained: UntrainedHeadError | None = None  # a folder's missing task head: the pipeline never answers with it
    if backend is not None and backend not in BACKENDS:  # a loaded model with an unknown backend name
        raise ValueError(f"backend {backend!r}: use one of {list(BACKENDS)}")
    if graph is not None:
        if device is not None and device.type != "cpu" and not auto:
            raise ValueError(f"the {graph.name} backend runs graphs on the CPU; got device={device!r}")
        model_path = Path(model).expanduser()
        model = graph.load(model_path, file=file, dtype=dtype)
        tokenizer = (model_path.parent if model_path.is_file() else model_path) if tokenizer is None else tokenizer
    elif file is not None:
        raise ValueError(f"file={file!r} picks a graph of an ONNX folder (or an OpenVINO folder's IR); {model!r} is "
                         "not one on a graph backend")
    if isinstance(model, GraphModel):
        if model.task != record.checkpoint_task:
            raise ValueError(f"{name} needs a {record.checkpoint_task} model; {model.path} is a {model.task} graph")
        if tokenizer is None:
            raise ValueError(f"{name}: a loaded model needs tokenizer= (a folder or an hfport tokenizer)")
        if graph is None and ((device is not None and device.type != "cpu" and not auto) or
                              dtype not in (None, "auto", "float32", torch.float32)):
            raise ValueError(f"a loaded {type(model).__name__} runs as it was opened, on the CPU; got "
                             f"device={device!r}, dtype={dtype!r} (give its folder to choose the precision)")
    elif isinstance(model, PreTrainedEncoder):
        if model.task != record.checkpoint_task:
            raise ValueError(f"{name} needs a {record.model_class.__name__}, got a "
                             f"{type(model).__name__} ({model.task} head)")
        if tokenizer is None:
            raise ValueError(f"{name}: a loaded model needs tokenizer= (a folder or an hfport tokenizer)")
        if device is not None or dtype is not None:
            dtype = resolve_dtype(dtype, model.config, device or model.device) if dtype is not None else None
            model = model.to(device=device, dtype=dtype)
    elif isinstance(model, (str, os.PathLike)):
        loaded = None
        if dtype == "auto-int8" and _weighs_graphs(record, model, device, base_model, adapters, int8_paths):
            cls.check_sample_options(options)  # before any export: the paths are timed on this task's calls
            if not isinstance(tokenizer, PreTrainedTokenizer):  # read once: the timed pipelines and this one share it
                tokenizer = AutoTokenizer.from_pretrained(model if tokenizer is None else tokenizer)
            loaded = _auto_int8(record, cls, model, tokenizer, gate_data, int8_paths, packed_linear, row_shards,
                                options)
        if loaded is None:
            loaded = record.model_class.from_pretrained(model, dtype=dtype, device=device, base_model=base_model,
                                                        gate_data=gate_data)
        untrained = untrained_head_error(loaded, model, name)
        if untrained is not None and not (allow_untrained_head or adapters):
            raise untrained
        if tokenizer is None:  # an adapter folder without tokenizer files (as PEFT writes them): the base's
            adapter = loaded.adapter
            tokenizer = model if adapter is None or has_tokenizer_files(model) or not isinstance(
                adapter.base, (str, os.PathLike)) else adapter.base
        model = loaded
    else:
        raise TypeError(f"model must be a folder, a repo id, an hfport model or a graph model (OnnxModel, "
                        f"OpenVinoModel), got "
                        f"{type(model).__name__}")
    if not isinstance(tokenizer, PreTrainedTokenizer):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    pipe = cls(model, tokenizer, batch_size=batch_size, max_batch_tokens=max_batch_tokens,
               packed_linear=packed_linear, row_shards=row_shards, **options)
    pipe.untrained_head = untrained
    if adapters:
        if isinstance(model, GraphModel):
            raise ValueError(f"adapters: the {model.runtime} backend runs a fixed graph; serve adapters on the torch "
                             "backend")
        for adapter_name, folder in adapters.items():
            pipe.add_adapter(adapter_name, folder)
    return pipe


def refuse_untrained_head(loaded: Any, model: str | os.PathLike[str], name: str) -> None:
    """Raise untrained_head_error's error, if any."""
    error = untrained_head_error(loaded, model, name)
    if error is not None:
        raise error


def untrained_head_error(loaded: Any, model: str | os.PathLike[str], name: str) -> UntrainedHeadError | None:
    """An UntrainedHeadError where LOADED's task head was initialised fresh (absent from MODEL's weights: a base
    model asked for a task it was never trained for), as the exporters refuse it: a pipeline would answer with random
    weights, and transformers' pipelines only warn; or where MODEL's config.json names another task's head whose
    weights loaded as this one's. An adapter's load is left alone (its head may come with it)."""
    report = loaded.load_report
    if getattr(loaded, "adapter", None) is not None:
        return None
    fresh = [n for n in (report.initialized if report is not None else []) if n.startswith("head.")]
    if fresh:
        return UntrainedHeadError(
            f"{model}: its weights hold no {loaded.task} head ({', '.join(fresh[:4])} missing), so a {name} pipeline "
            f"would answer with randomly initialised weights. Fine-tune it for {loaded.task} first (hfport "
            "finetune), give a folder that holds that head, or ask for a task that needs none (feature-extraction, "
            "sentence-embedding)")
    # another task's head whose weights carry the same names and shapes (a token classifier's `classifier` read as a
    # sequence classifier's) loads without a gap, as in transformers: its answers would be that head's, misread
    trained = tasks.get(model_task(model)).checkpoint_task
    if loaded.task != BASE_TASK and trained not in (BASE_TASK, loaded.task):
        return UntrainedHeadError(
            f"{model}: config.json's architectures name a {trained} model, so its head weights were trained for "
            f"{trained}, not {loaded.task}; a {name} pipeline would answer with them misread. Ask for {trained}, or "
            f"fine-tune it for {loaded.task} first (hfport finetune)")
    return None


def _weighs_graphs(record: tasks.Task, model: str | os.PathLike[str], device: torch.device | None,
                   base_model: Any, adapters: Any, paths: Sequence[str] | None) -> bool:
    """Whether dtype="auto-int8" weighs the graph paths for this call: a model folder of this task's own head, with a
    graph, served on the CPU without adapters, and a graph path allowed."""
    if (device is not None and device.type != "cpu") or base_model is not None or adapters:
        return False
    if paths is not None and not set(paths) - {"torch"}:
        return False
    folder = hub.resolve(model)
    if is_adapter_folder(folder) or not tasks.TASKS[record.checkpoint_task].graph_outputs:
        return False
    return tasks.get(model_task(folder)).checkpoint_task == record.checkpoint_task


def _auto_int8(record: tasks.Task, cls: type[Pipeline], model: str | os.PathLike[str],
               tokenizer: PreTrainedTokenizer, gate_data: str | os.PathLike[str] | None, paths: Sequence[str] | None,
               packed_linear: bool, row_shards: str | int, options: dict[str, Any]) -> Any:
    """The model dtype="auto-int8" serves after weighing every int8 path (INT8_CHOOSER); None: none passed its gate
    (the caller's from_pretrained then answers with bf16). Each path is timed through a pipeline with the caller's
    options (zero-shot's candidate_labels make its calls)."""
    if INT8_CHOOSER is None:
        raise RuntimeError("dtype='auto-int8' weighs the graph exports through hfport.export: import hfport")

    def load_torch() -> PreTrainedEncoder:
        return record.model_class.from_pretrained(model, dtype="int8", gate_data=gate_data)

    def open_graph(folder: Path) -> GraphModel:
        backend = graph_backend(folder, None)
        assert backend is not None, folder  # an export of a graph format
        return backend.load(folder, file=None, dtype=None)

    def timed_pipeline(loaded: Any) -> Pipeline:
        return cls(loaded, tokenizer, batch_size=MEASURE_BATCH, packed_linear=packed_linear,
                   row_shards=row_shards, **options)

    choice, loaded = INT8_CHOOSER(model, record.checkpoint_task, load_torch=load_torch, open_graph=open_graph,
                                  make_pipeline=timed_pipeline, gate_data=gate_data, paths=paths)
    if loaded is not None:
        loaded.load_report.notes.append(choice.line())
    return loaded


def check_dtype(dtype: str) -> str:
    """DTYPE's canonical name when pipeline(model=<folder>, dtype=...) takes it: "auto", "int8", "auto-int8" or a
    torch dtype's name, an alias as torch names the dtype ("bf16", "torch.bfloat16": "bfloat16"); else a ValueError
    naming the choices."""
    if dtype in ("auto", *INT8_DTYPES):
        return dtype
    return str(resolve_dtype(dtype)).removeprefix("torch.")


def check_device(device: str) -> str:
    """DEVICE when pipeline(device=...) takes it on this machine ("auto", "cpu", "cuda", "cuda:N"), else a
    ValueError naming the choices and the CUDA devices this process sees."""
    resolve_device(device)
    return device


def model_task(model: str | os.PathLike[str]) -> str:
    """The pipeline task of a model folder's head (or of a repo id in the local HF cache), read from config.json's
    `architectures`: the task `pipeline(task, model=...)` serves it with by default (a base model, or a model-only
    head such as BertForPreTraining: feature-extraction; a masked-LM folder in sentence-transformers' SparseEncoder
    layout: sparse-embedding, what its files say it is).
    """
    folder = hub.resolve(model)
    if is_adapter_folder(folder):
        task = tasks.adapter_task(folder)
    elif has_sparse_layout(folder):
        return tasks.get("sparse-embedding").name
    else:
        raw, source = hub.read_config(folder)
        task = task_of(get_family(raw.get("model_type"), source), raw.get("architectures") or [])  # canonical = tag
    return task if task in tasks.PIPELINE_TASKS else BASE_TASK  # a model-only head: its body serves


__all__ = [
    "PIPELINES",
    "check_device",
    "check_dtype",
    "device_name",
    "graph_backend",
    "Feature",
    "FeatureExtractionPipeline",
    "FillMaskPipeline",
    "InputTooLongError",
    "InvalidInput",
    "ItemError",
    "OnnxModel",
    "OpenVinoModel",
    "Pipeline",
    "PipelineInputError",
    "Prepared",
    "SentenceEmbeddingPipeline",
    "SparseEmbeddingPipeline",
    "QuestionAnsweringPipeline",
    "TextClassificationPipeline",
    "TokenClassificationPipeline",
    "ZeroShotClassificationPipeline",
    "model_task",
    "pack_rows",
    "pipeline",
    "refuse_untrained_head",
]
