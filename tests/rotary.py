"""The rotary families' comparison with transformers (tests/test_rotary_families.py, test_head_dim.py, test_cuda.py):
the names transformers gives a checkpoint's tensors in memory (it renames and splits GTE's, NomicBERT's and
jina-embeddings-v3's fused file tensors on load; hfport reads and writes the files' names), their batches (token types
where the model has them, optional left padding) and `check`, tests/parity.py's check with those names."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from tests import parity
from tests.parity import left_padded
from tests.tiny import HEADS, batch

# transformers' conversion_mapping for these model types, file name -> in-memory name(s): (pattern, replacement,
# the pieces a fused file tensor was chunked into, in order)
RENAMES = {
    "gte": [(r"encoder\.layer\.", "layers."), (r"attention\.o_proj", "self_attn.o_proj"),
            (r"attn_ln", "post_attention_layernorm"), (r"mlp_ln", "post_mlp_layernorm"),
            (r"lm_head\.norm", "lm_head.layer_norm")],
    "nomic_bert": [(r"encoder\.layers\.", "layers."), (r"emb_ln", "embeddings.LayerNorm"),
                   (r"attn\.out_proj", "self_attn.o_proj"), (r"fc11", "up_proj"), (r"fc12", "gate_proj"),
                   (r"fc2", "down_proj"), (r"norm1", "post_attention_layernorm"), (r"norm2", "post_mlp_layernorm")],
    "eurobert": [],  # transformers writes EuroBERT under its module names
    "jina_embeddings_v3": [(r"encoder\.layers\.", "layers."), (r"emb_ln", "embeddings.LayerNorm"),
                           (r"mixer\.out_proj", "self_attn.o_proj"), (r"norm1", "post_attention_layernorm"),
                           (r"norm2", "post_mlp_layernorm")],
}
FUSED = {
    "gte": [(r"attention\.qkv_proj", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
            (r"mlp\.up_gate_proj", ["mlp.up_proj", "mlp.gate_proj"])],
    "nomic_bert": [(r"attn\.Wqkv", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"])],
    "eurobert": [],
    "jina_embeddings_v3": [(r"mixer\.Wqkv", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"])],
}


def in_memory(family: str, file_name: str) -> list[str]:
    """The transformers parameter(s) a file key becomes when transformers loads it."""
    name = file_name
    for pattern, replacement in RENAMES[family]:
        name = re.sub(pattern, replacement, name)
    for pattern, pieces in FUSED[family]:
        if re.search(pattern, name):
            return [re.sub(pattern, piece, name) for piece in pieces]
    return [name]


def inputs_for(family: str, lengths: tuple[int, ...] = (70, 41, 9), left: bool = False,
               type_vocab_size: int = 2) -> dict[str, torch.Tensor]:
    """tiny.batch with token types where the model has them (a second segment where it has two) and, optionally,
    the padding on the left."""
    inputs = batch(family, lengths=lengths)
    mask = inputs["attention_mask"]
    if type_vocab_size > 0:
        types = torch.zeros_like(mask)
        for row, n in enumerate(mask.sum(1).tolist()):
            types[row, n // 2:n] = int(type_vocab_size > 1)
        inputs["token_type_ids"] = types
    return left_padded(inputs) if left else inputs


def check(family: str, task: str, folder: Path, *, left: bool = False, padding_free: bool = True,
          lengths: tuple[int, ...] = (70, 41, 9)) -> float:
    """hfport vs transformers from the same folder (tests/parity.py): outputs at real positions, the loss, every
    gradient, transformers' fused tensors' gradients joined as its loader split them. transformers is loaded fresh:
    dynamic rope keeps no state."""
    import transformers

    ref = getattr(transformers, HEADS[task]).from_pretrained(folder).eval()
    inputs = inputs_for(family, lengths, left, getattr(ref.config, "type_vocab_size", 0))
    return parity.check(task, folder, inputs, ref=ref, left=left, padding_free=padding_free, name=f"{family}/{task}",
                        pieces=lambda hf: in_memory(family, hf))
