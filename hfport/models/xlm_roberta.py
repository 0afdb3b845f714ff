"""XLM-RoBERTa: RoBERTa under another model_type (its difference is the tokenizer, not the network)."""

from .roberta import roberta_family

XLM_ROBERTA = roberta_family("xlm-roberta", "XLMRoberta")
