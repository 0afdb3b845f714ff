"""Shared building blocks; families assemble these, they never copy them."""

from .activations import ACTIVATIONS, Activation
from .attention import ATTENTION_BACKENDS, FusedQKV, SelfAttention
from .dropout import Dropout, dropout
from .layers import (Embeddings, Encoder, EncoderBody, EncoderLayer, FeedForward, GatedFeedForward, Pooler,
                     RMSNorm, SharedEncoder, SplitGatedFeedForward, layer_norm)
from .layout import Layout, Packed, Padded, RepresentativePadding, SequenceBias, padding_mask
from .positions import RopeScaling, Rotary, positions_from_padding

__all__ = ["ACTIVATIONS", "ATTENTION_BACKENDS", "Activation", "Dropout", "Embeddings", "Encoder", "EncoderBody",
           "EncoderLayer", "FeedForward", "FusedQKV", "GatedFeedForward", "Layout", "Packed", "Padded", "Pooler",
           "RMSNorm", "RepresentativePadding", "RopeScaling", "Rotary", "SelfAttention", "SequenceBias",
           "SharedEncoder", "SplitGatedFeedForward", "dropout", "layer_norm", "padding_mask", "positions_from_padding"]
