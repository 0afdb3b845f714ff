"""sparse-embedding (SPLADE): a masked-LM model whose logits become one vocabulary-sized, mostly-zero vector per text,
as sentence-transformers' SparseEncoder (Transformer fill-mask -> SpladePooling) computes it:

    weights = log(1 + relu(logits))         (B, T, V); activation "log1p_relu" takes log(1 + .) once more
    vector  = max (or sum) of weights over the real tokens   (B, V)

The model is fill-mask's (EncoderForMaskedLM): a run's best/ and final/ are BertForMaskedLM-style folders in the
SparseEncoder layout (hfport/formats/sentence_transformers.py), which `hfport.pipeline("sparse-embedding")` pools as
the folder says. Training: (anchor, positive[, negative]) rows with sentence-transformers' SpladeLoss semantics
(hfport/train/tasks/sparse.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .fill_mask import EncoderForMaskedLM
from .task import Columns, Task

BLOCK = 1 << 20  # logits per decoder pass (tokens x vocabulary columns): 4 MB in fp32, cache-sized, whatever the batch
# logits per call of a model that returns them whole (an ONNX graph): 64 MB in fp32. The pipeline's max_batch_tokens
# (16384) bounds hidden states; as (T, V) logits per row it would be 2 GB at MiniLM's 30522-token vocabulary
CALL_LOGITS = 1 << 24


@torch.no_grad()  # inference: training pools the whole logits with gradients (splade_pool)
def sparse_vectors(model: EncoderForMaskedLM | Any, input_ids: Tensor, attention_mask: Tensor,
                   token_type_ids: Tensor | None = None, strategy: str = "max", activation: str = "relu",
                   block: int = BLOCK, encoder_outputs: tuple[Tensor, Tensor | None] | None = None) -> Tensor:
    """(B, T) inputs -> (B, V) fp32 SPLADE vectors, SpladePooling's values computed with less work (inference).

    `model` is hfport's masked-LM module, pooled by its decoder as below, or any other masked-LM model (an ONNX
    graph on onnxruntime, hfport/pipelines/onnx_backend.py's OnnxModel), which is called as every model is and whose
    whole (B, T, V) logits are pooled (`logits_vectors`).

    The MLM head runs on the real tokens only (padding is pooled to nothing anyway), and its decoder in blocks of
    vocabulary columns, each pooled per sequence as soon as it is made: the (tokens, V) logits never exist at once.
    Max pooling takes the max of the logits and transforms the (B, V) result: x -> log1p(relu(x)) is
    non-decreasing, so max_t f(x_t) = f(max_t x_t), exactly (rounding is monotone too). The bias stays inside the
    decoder's product (fused, free): in bf16 the product is accumulated in fp32 and rounded once, bias included, so a
    logit near zero (where the support is decided) is rounded near zero, not at the size of the bias; adding the
    bias after a bf16 max rounds at |x| ~ |b|: support Jaccard against fp32 0.949 instead of 0.973 (SparseEncoder's
    own bf16: 0.974), measured by scripts/bench_sparse.py --tiny on 48 texts.
    In bf16 the max is bf16 and the activation fp32. Sum pooling needs each token's activation, per block.
    encoder_outputs: the body's outputs when already computed (a mixed-adapter batch's)."""
    if strategy not in ("max", "sum"):
        raise ValueError(f"pooling_strategy={strategy!r}: use 'max' or 'sum'")
    if not isinstance(model, EncoderForMaskedLM):  # a graph keeps its body and head inside: its logits are all it gives
        return logits_vectors(model, input_ids, attention_mask, token_type_ids, strategy, activation)
    hidden, _ = model._body(input_ids, attention_mask, token_type_ids, None, encoder_outputs)  # (B, T, C)
    keep = attention_mask.bool()  # (B, T)
    x = model.head.decoder_input(hidden[keep])  # (N, E): the real tokens, sequence by sequence
    weight, bias = model.head.output_layer(model.body.word_embeddings.weight)  # (V, E), (V,) | None
    runs = _runs(keep.sum(dim=1).tolist())
    vocab = weight.shape[0]
    fill = float("-inf") if strategy == "max" else 0.0
    pooled = torch.full((keep.shape[0], vocab), fill, dtype=torch.float32, device=x.device)  # (B, V)
    columns = max(256, min(vocab, block // max(1, x.shape[0])))
    for c in range(0, vocab, columns):
        logits = F.linear(x, weight[c:c + columns], bias[c:c + columns] if bias is not None else None)  # (N, v)
        if strategy == "sum":
            logits = _activate(logits.float(), activation, inplace=True)  # (N, v)
        for row, count, length, first in runs:
            part = logits[first:first + count * length].view(count, length, -1)  # (count, L, v)
            reduced = part.amax(dim=1) if strategy == "max" else part.sum(dim=1, dtype=torch.float32)  # (count, v)
            pooled[row:row + count, c:c + columns] = reduced
    return pooled if strategy == "sum" else _activate(pooled, activation, inplace=True)  # (B, V); -inf -> 0


@torch.no_grad()  # inference, as sparse_vectors
def logits_vectors(model: Any, input_ids: Tensor, attention_mask: Tensor, token_type_ids: Tensor | None = None,
                   strategy: str = "max", activation: str = "relu", budget: int = CALL_LOGITS) -> Tensor:
    """(B, T) inputs -> (B, V) fp32 SPLADE vectors from a masked-LM model called as
    `model(input_ids, attention_mask=, token_type_ids=)`, which returns `.logits` (B, T, V), pooled by splade_pool.
    The rows go in groups of at most `budget` logits (at least one row a call), so one call's logits stay bounded
    whatever the batch. Values at padding positions (a padded graph's) are never pooled: splade_pool masks them."""
    rows = max(1, budget // max(1, input_ids.shape[1] * model.config.vocab_size))
    parts = []
    for r in range(0, input_ids.shape[0], rows):
        mask = attention_mask[r:r + rows]  # (b, T)
        types = token_type_ids[r:r + rows] if token_type_ids is not None else None
        logits = model(input_ids[r:r + rows], attention_mask=mask, token_type_ids=types).logits  # (b, T, V)
        parts.append(splade_pool(logits.float(), mask, strategy, activation))  # (b, V)
    return torch.cat(parts)  # (B, V)


def _runs(lengths: list[int]) -> list[tuple[int, int, int, int]]:
    """(first row, rows, length, first token) of each run of consecutive rows with the same number of real tokens:
    one reduction per run (a length-sorted batch has few). Rows without real tokens keep the fill."""
    out: list[tuple[int, int, int, int]] = []
    first = 0
    for row, n in enumerate(lengths):
        if n and out and out[-1][2] == n and out[-1][0] + out[-1][1] == row:
            out[-1] = (out[-1][0], out[-1][1] + 1, n, out[-1][3])
        elif n:
            out.append((row, 1, n, first))
        first += n
    return out


def splade_pool(logits: Tensor, attention_mask: Tensor, strategy: str = "max", activation: str = "relu") -> Tensor:
    """(B, T, V) MLM logits, (B, T) mask -> (B, V) SPLADE weights over the real tokens (SpladePooling's math).

    Max pooling takes the max of the logits first and transforms the (B, V) result: log1p and relu are monotone, so
    max_t f(x_t) = f(max_t x_t) and the (B, T, V) transform is never materialised. Padding is -inf before the max
    (relu sends it to 0, where sentence-transformers' multiply-by-mask sends it too); without gradients the logits are
    overwritten there (the caller's tensor: pass a copy to keep it)."""
    if strategy == "max":
        padding = ~attention_mask[..., None].bool()  # (B, T, 1)
        # in place where no gradient needs the logits (inference): no second (B, T, V) tensor
        masked = logits.masked_fill(padding, float("-inf")) if logits.requires_grad else \
            logits.masked_fill_(padding, float("-inf"))  # (B, T, V)
        pooled = masked.amax(dim=1)  # (B, V)
        return _activate(pooled, activation)  # (B, V)
    if strategy != "sum":
        raise ValueError(f"pooling_strategy={strategy!r}: use 'max' or 'sum'")
    weights = _activate(logits, activation) * attention_mask[..., None].to(logits.dtype)  # (B, T, V)
    return weights.sum(dim=1)  # (B, V)


def _activate(x: Tensor, activation: str, inplace: bool = False) -> Tensor:
    """log(1 + relu(x)) (log1p_relu: log1p once more); inplace overwrites x (a tensor no gradient needs)."""
    if activation not in ("relu", "log1p_relu"):
        raise ValueError(f"activation_function={activation!r}: use 'relu' or 'log1p_relu'")
    if inplace:
        out = torch.log1p_(torch.relu_(x))
        return torch.log1p_(out) if activation == "log1p_relu" else out
    out = torch.log1p(torch.relu(x))
    return torch.log1p(out) if activation == "log1p_relu" else out


TASK = Task(
    name="sparse-embedding", aliases=("splade", "sparse-embeddings"), model_class=EncoderForMaskedLM,
    outputs=("logits",), per_sequence=frozenset(), auto_class="AutoModelForMaskedLM",
    pipeline="hfport.pipelines.sparse_embedding:SparseEmbeddingPipeline",
    train="hfport.train.tasks.sparse:SparseEmbedding",
    columns=(Columns(("anchor_column", "positive_column"), optional=("negative_column",),  # pairs, triplets
                     texts=("anchor_column", "positive_column")),),
    # pairs/triplets are scored as retrieval by dot product of the sparse vectors
    default_metrics={None: ("ndcg@10", "max"), "pairs": ("ndcg@10", "max")},
    model_task="fill-mask")
