"""Shared building blocks; families assemble these, they never copy them."""

from .activations import ACTIVATIONS, Activation
from .attention import ATTENTION_BACKENDS, SelfAttention
from .layers import (Embeddings, Encoder, EncoderBody, EncoderLayer, FeedForward, Pooler, SharedEncoder,
                     padding_mask, positions_from_padding)
from .unpad import Packed

__all__ = ["ACTIVATIONS", "ATTENTION_BACKENDS", "Activation", "Embeddings", "Encoder", "EncoderBody",
           "EncoderLayer", "FeedForward", "Packed", "Pooler", "SelfAttention", "SharedEncoder", "padding_mask",
           "positions_from_padding"]
