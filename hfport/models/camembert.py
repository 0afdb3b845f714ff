"""CamemBERT: RoBERTa under another model_type (transformers' CamemBERT classes are RoBERTa's, renamed; the
difference is the SentencePiece tokenizer, not the network)."""

from .roberta import roberta_family

CAMEMBERT = roberta_family("camembert", "Camembert")
