"""hfport: lean PyTorch encoders that load HF checkpoints and match transformers numerically.

The public API is the names below, plus these submodules: hfport.errors (exceptions, ItemError), hfport.train
(finetune, preflight, FinetuneConfig, resolve_config, the monitor's readers), hfport.export (export, verify and their
options and results), hfport.rundir (RunDir, RunSummary), hfport.lora (LoRA adapters in PEFT's format: apply, save,
load, merge), hfport.pipelines, hfport.tasks (the task records: names, aliases, model classes), hfport.embeddings
(sentence-transformers folders: pooling, prompts, batch budgets), hfport.verbosity (HFPORT_VERBOSITY, log
set-up), hfport.settings (the library's settings, its HFPORT_* variables; the base class of the server's),
hfport.retrieval (embedding search with an on-disk embedding cache, hard-negative mining: `mine`) and
hfport.evaluation (`evaluate`: a task's metrics on labelled data, JSON and report.html); `resolve_model` finds a local
folder or a repo id in the local HF cache. The CLI and the server use nothing
else; the server takes every name it needs from the top-level namespace.
"""

from . import int8, lora, tasks, verbosity
from .config import EncoderConfig
from .embeddings import token_listing, tune_batch_tokens
from .errors import CheckpointError, ConfigError, HfportError, ItemError, ModelNotFoundError
from .evaluation import EvalResult, Evaluation, evaluate
from .export import ExportError, ExportOptions, ExportResult, VerifyReport, export, verify
from .hub import resolve as resolve_model
from .inference import for_inference, inference_steps
from .modeling import LoadReport, PreTrainedEncoder
from .nn.packed import packed_bytes
from .pipelines import SentenceEmbeddingPipeline, TextClassificationPipeline, model_task, pipeline
from .pipelines.shards import set_num_threads_here
from .registry import supported
from .retrieval import MineResult, mine, mine_hard_negatives
from .rundir import RunDir, RunSummary
from .tasks import (AutoModel, AutoModelForMaskedLM, AutoModelForMultipleChoice, AutoModelForNextSentencePrediction,
                    AutoModelForPreTraining, AutoModelForQuestionAnswering, AutoModelForSequenceClassification,
                    AutoModelForTokenClassification, EncoderForMaskedLM, EncoderForMultipleChoice,
                    EncoderForNextSentencePrediction, EncoderForPreTraining, EncoderForQuestionAnswering,
                    EncoderForSequenceClassification, EncoderForTokenClassification, EncoderModel, load_any)
from .tokenizer import AutoTokenizer, BatchEncoding, PreTrainedTokenizer, TokenizerError
from .train.config import FinetuneConfig
from .train.loop import finetune
from .train.monitor import PERF
from .version import __version__

__all__ = ["AutoModel", "AutoModelForMaskedLM", "AutoModelForMultipleChoice", "AutoModelForNextSentencePrediction",
           "AutoModelForPreTraining", "AutoModelForQuestionAnswering",
           "AutoModelForSequenceClassification", "AutoModelForTokenClassification", "CheckpointError", "ConfigError",
           "EncoderConfig", "EncoderForMaskedLM", "EncoderForMultipleChoice", "EncoderForNextSentencePrediction",
           "EncoderForPreTraining", "EncoderForQuestionAnswering", "EncoderForSequenceClassification",
           "EncoderForTokenClassification",
           "EncoderModel", "HfportError", "LoadReport", "ModelNotFoundError", "PreTrainedEncoder", "load_any",
           "supported", "__version__", "resolve_model",
           # the task records (names, aliases, model classes, pipelines): tasks.TASKS, tasks.get, tasks.canonical
           "tasks",
           # tokenizers and pipelines
           "AutoTokenizer", "BatchEncoding", "PreTrainedTokenizer", "TokenizerError", "pipeline", "model_task",
           "ItemError",
           # serving: pick a pipeline's token budget by measurement
           "tune_batch_tokens",
           # the inference step pipelines apply to their model (hfport/inference.py), and what it did to a model
           "for_inference", "inference_steps",
           # a weight's packed inference copy (nn/packed.py), which a memory budget counts beside the weight
           "packed_bytes",
           # a thread's own intra-op thread count, the process's left alone (a server's predict threads)
           "set_num_threads_here",
           # what a server tells apart and lists: the embedding and classification pipelines, a text's tokens
           "SentenceEmbeddingPipeline", "TextClassificationPipeline", "token_listing",
           # -q/-v verbosity: verbosity.configure(level, format), verbosity.from_env(default)
           "verbosity",
           # fine-tuning and its run folder
           "FinetuneConfig", "finetune", "RunDir", "RunSummary", "lora",
           # the event type of metrics.jsonl's speed/ETA/memory lines
           "PERF",
           # export to an HF folder, with proof
           "ExportError", "ExportOptions", "ExportResult", "VerifyReport", "export", "verify",
           # hard negatives for (anchor, positive) pairs, as sentence-transformers' mine_hard_negatives
           "MineResult", "mine", "mine_hard_negatives",
           # a task's metrics on labelled data (two models side by side), as fine-tuning's evaluation computes them
           "EvalResult", "Evaluation", "evaluate"]
