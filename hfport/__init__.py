"""hfport: lean PyTorch encoders that load HF checkpoints and match transformers numerically."""

from .config import EncoderConfig
from .errors import CheckpointError, ConfigError, HfportError, ModelNotFoundError
from .export import ExportError, ExportResult, VerifyReport, export, verify
from .modeling import LoadReport, PreTrainedEncoder
from .tasks import (AutoModel, AutoModelForMaskedLM, AutoModelForQuestionAnswering, AutoModelForSequenceClassification,
                    AutoModelForTokenClassification, EncoderForMaskedLM, EncoderForQuestionAnswering,
                    EncoderForSequenceClassification, EncoderForTokenClassification, EncoderModel, load_any)
from .pipelines import pipeline
from .registry import supported
from .tokenizer import AutoTokenizer, BatchEncoding, PreTrainedTokenizer, TokenizerError
from .train.config import FinetuneConfig
from .train.loop import finetune

__version__ = "0.1.0"

__all__ = ["AutoModel", "AutoModelForMaskedLM", "AutoModelForQuestionAnswering", "AutoModelForSequenceClassification",
           "AutoModelForTokenClassification", "CheckpointError", "ConfigError", "EncoderConfig", "EncoderForMaskedLM",
           "EncoderForQuestionAnswering", "EncoderForSequenceClassification", "EncoderForTokenClassification",
           "EncoderModel", "HfportError", "LoadReport", "ModelNotFoundError", "PreTrainedEncoder", "load_any",
           "supported", "__version__",
           # tokenizers and pipelines
           "AutoTokenizer", "BatchEncoding", "PreTrainedTokenizer", "TokenizerError", "pipeline",
           # fine-tuning
           "FinetuneConfig", "finetune",
           # export to an HF folder, with proof
           "ExportError", "ExportResult", "VerifyReport", "export", "verify"]
