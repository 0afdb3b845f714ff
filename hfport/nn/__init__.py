"""Shared building blocks; families assemble these, they never copy them."""

from .activations import ACTIVATIONS, Activation
from .attention import ATTENTION_BACKENDS, SelfAttention
from .layers import (Embeddings, Encoder, EncoderBody, EncoderLayer, FeedForward, Pooler, SharedEncoder,
                     padding_mask, positions_from_padding)

__all__ = ["ACTIVATIONS", "ATTENTION_BACKENDS", "Activation", "Embeddings", "Encoder", "EncoderBody",
           "EncoderLayer", "FeedForward", "Pooler", "SelfAttention", "SharedEncoder", "padding_mask",
           "positions_from_padding"]
