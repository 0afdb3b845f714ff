"""DeBERTa-v2/v3: BERT's post-LN layer whose attention adds a disentangled relative-position bias (c2p, p2c),
embeddings normalised after an optional projection, an optional convolution after the first layer (v2-xlarge),
a ContextPooler in the classification head and two MLM head layouts."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn

from ..config import EncoderConfig, head_fields
from ..errors import ConfigError
from ..keymap import KeyMap, params, tables
from ..nn import Activation, EncoderBody, Layout, RepresentativePadding, SelfAttention, SequenceBias
from ..nn.activations import ACTIVATIONS
from ..nn.dropout import Dropout
from ..nn.layout import Rows
from ..nn.lora import Route, routed
from ..nn.relative import RelativeIndex, RelativeIndexCache, disentangled_bias, gathered_bias, relative_rows
from .bert import bert_layer, number
from .family import Family, HeadOptions

# DebertaV2Config's defaults (transformers 5.23), where they differ from EncoderConfig's or are DeBERTa's own.
DEFAULTS: dict[str, Any] = {
    "vocab_size": 128100, "hidden_size": 1536, "num_hidden_layers": 24, "num_attention_heads": 24,
    "intermediate_size": 6144, "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1,
    "max_position_embeddings": 512, "type_vocab_size": 0, "initializer_range": 0.02, "layer_norm_eps": 1e-7,
    "relative_attention": False, "max_relative_positions": -1, "pad_token_id": 0, "position_biased_input": True,
    "pos_att_type": None, "pooler_dropout": 0.0, "pooler_hidden_act": "gelu", "legacy": True,
    "tie_word_embeddings": True,
    # not DebertaV2Config fields: the modeling code reads them with getattr and these defaults
    "position_buckets": -1, "share_att_key": False, "norm_rel_ebd": "none", "conv_kernel_size": 0,
    "conv_groups": 1, "conv_act": "tanh", "cls_dropout": None,
}
ATT_TYPES = ("c2p", "p2c")
# the relative-embedding window (W, C) for the batch's longest length, its RelativeIndex, and length -> index;
# traceable: the whole table (2 * span, C), None, None
Relative = tuple[Tensor, RelativeIndex | None, Callable[[int], RelativeIndex] | None]


def _typed(raw: dict[str, Any], key: str, kind: type, source: str) -> Any:
    """transformers' strict config types (a bool is not an int)."""
    value = raw[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{source}: field '{key}' should be {kind.__name__}, got {value!r}")
    return value


def pos_att_types(value: Any, source: str) -> tuple[str, ...]:
    """A list, or the older "p2c|c2p" string, lower-cased and stripped as transformers does. Names other than
    c2p/p2c are kept and, as in transformers, have no effect."""
    if value is None:
        return ()
    if isinstance(value, str):
        return tuple(x.strip() for x in value.lower().split("|"))
    if isinstance(value, (list, tuple)) and all(isinstance(x, str) for x in value):
        return tuple(value)
    raise ConfigError(f"{source}: field 'pos_att_type' should be a string, a list of strings or null, got {value!r}")


def deberta_config(original: dict[str, Any], source: str) -> EncoderConfig:
    raw = {**DEFAULTS, **original}
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "max_position_embeddings", "type_vocab_size", "max_relative_positions", "position_buckets",
                "conv_kernel_size", "conv_groups"):
        _typed(raw, key, int, source)
    for key in ("relative_attention", "position_biased_input", "legacy", "tie_word_embeddings"):
        _typed(raw, key, bool, source)
    for key in ("hidden_act", "pooler_hidden_act", "conv_act", "norm_rel_ebd"):
        _typed(raw, key, str, source)
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    head_size = raw.get("attention_head_size", hidden // heads if heads else 0)
    if heads and hidden % heads == 0 and head_size * heads != hidden:  # transformers fails on the first forward
        raise ConfigError(f"{source}: field 'attention_head_size': {head_size} x {heads} heads must equal "
                          f"hidden_size {hidden} (the attention output projection is hidden_size wide)")
    conv = raw["conv_kernel_size"]
    if conv > 0:
        if conv % 2 == 0:  # padding (k - 1) // 2 shortens the sequence: transformers fails in ConvLayer
            raise ConfigError(f"{source}: field 'conv_kernel_size': {conv} is even; the convolution would shorten "
                              "the sequence (transformers fails on the first forward)")
        if raw["conv_groups"] < 1 or hidden % raw["conv_groups"]:  # nn.Conv1d refuses it in transformers too
            raise ConfigError(f"{source}: field 'conv_groups': {raw['conv_groups']} does not divide hidden_size "
                              f"{hidden}")
        if raw["conv_act"] not in ACTIVATIONS:
            raise ConfigError(f"{source}: field 'conv_act': {raw['conv_act']!r} is not supported; "
                              f"supported: {sorted(ACTIVATIONS)}")
    max_rel = raw["max_relative_positions"]
    if max_rel < 1:  # -1 (the default) means "as far as absolute positions go"
        max_rel = raw["max_position_embeddings"]
    buckets = raw["position_buckets"]
    cls_dropout = number(raw, "cls_dropout", None, source)
    hidden_dropout = number(raw, "hidden_dropout_prob", 0.1, source)
    extra = {
        "relative_attention": raw["relative_attention"],
        "max_relative_positions": max_rel,
        "position_buckets": buckets,
        "pos_ebd_size": buckets if buckets > 0 else max_rel,  # the table has 2 * pos_ebd_size rows
        "pos_att_type": pos_att_types(raw["pos_att_type"], source),
        "share_att_key": bool(raw["share_att_key"]),  # not a typed field in transformers: any truthy value
        "position_biased_input": raw["position_biased_input"],
        "norm_rel_ebd": tuple(x.strip() for x in raw["norm_rel_ebd"].lower().split("|")),
        "conv_kernel_size": conv, "conv_groups": raw["conv_groups"], "conv_act": raw["conv_act"],
        "pooler_hidden_act": raw["pooler_hidden_act"], "pooler_dropout": number(raw, "pooler_dropout", 0.0, source),
        "pooler_hidden_size": _typed(raw, "pooler_hidden_size", int, source) if "pooler_hidden_size" in raw
        else hidden,
        "legacy": raw["legacy"],
    }
    return EncoderConfig(
        model_type="deberta-v2", vocab_size=raw["vocab_size"], hidden_size=hidden,
        num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=heads,
        intermediate_size=raw["intermediate_size"], hidden_act=raw["hidden_act"],
        max_position_embeddings=raw["max_position_embeddings"],
        type_vocab_size=max(raw["type_vocab_size"], 0),  # transformers: no token types unless > 0
        layer_norm_eps=number(raw, "layer_norm_eps", 1e-7, source), pad_token_id=raw["pad_token_id"],
        initializer_range=number(raw, "initializer_range", 0.02, source),
        embedding_size=_typed(raw, "embedding_size", int, source) if raw.get("embedding_size") is not None else None,
        hidden_dropout=hidden_dropout,
        attention_dropout=number(raw, "attention_probs_dropout_prob", 0.1, source),
        classifier_dropout=hidden_dropout if cls_dropout is None else cls_dropout,
        tie_word_embeddings=raw["tie_word_embeddings"], extra=extra, **head_fields(raw), raw=original, source=source)


# --- modules ------------------------------------------------------------------------------------------------


class DebertaEmbeddings(nn.Module):
    """word (+ absolute position) (+ token type) -> projection to hidden_size -> LayerNorm -> dropout.

    Unlike BERT/ALBERT the LayerNorm runs after the projection, on hidden_size. Padded positions are zeroed by
    the padded layout (RepresentativePadding.embed), where the mask is known; the packed layout has none."""

    def __init__(self, c: EncoderConfig):
        super().__init__()
        e = c.embedding_size
        self.word = nn.Embedding(c.vocab_size, e, padding_idx=c.pad_token_id)
        self.position = nn.Embedding(c.max_position_embeddings, e) if c.extra["position_biased_input"] else None
        self.token_type = nn.Embedding(c.type_vocab_size, e) if c.type_vocab_size > 0 else None
        self.project = nn.Linear(e, c.hidden_size, bias=False) if e != c.hidden_size else None
        self.norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.dropout = Dropout(c.hidden_dropout)

    def position_ids(self, input_ids: Tensor) -> Tensor:
        return torch.arange(input_ids.shape[1], device=input_ids.device)[None, :]  # (1, T)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None = None,
                position_ids: Tensor | None = None, adapters: Route | None = None) -> Tensor:
        x = self.word(input_ids)  # (B, T, E)
        if self.position is not None:
            x = x + self.position(self.position_ids(input_ids) if position_ids is None else position_ids)
        if self.token_type is not None:
            x = x + (self.token_type.weight[0] if token_type_ids is None else self.token_type(token_type_ids))
        if self.project is not None:
            x = routed(self.project, x, adapters)  # (B, T, C)
        return self.dropout(self.norm(x))  # (B, T, C)


class DisentangledAttention(SelfAttention):
    """SelfAttention plus DeBERTa's relative-position score terms, supplied as its per-sequence bias callback.

    Scores are (q.k + c2p + p2c) / sqrt(D * (1 + number of position terms)), as transformers scales them (also
    when relative_attention is off but pos_att_type is set). The query is scaled once, up front."""

    def __init__(self, c: EncoderConfig):
        types = c.extra["pos_att_type"]
        head_dim = c.hidden_size // c.num_attention_heads
        super().__init__(c.hidden_size, c.num_attention_heads, c.attention_dropout,
                         scale=(head_dim * (1 + sum(t in types for t in ATT_TYPES))) ** -0.5, scale_query=True)
        relative = c.extra["relative_attention"]
        self.c2p = relative and "c2p" in types
        self.p2c = relative and "p2c" in types
        self.share_att_key = c.extra["share_att_key"]
        unshared = relative and not self.share_att_key
        self.pos_k = nn.Linear(c.hidden_size, c.hidden_size) if unshared and self.c2p else None
        self.pos_q = nn.Linear(c.hidden_size, c.hidden_size) if unshared and self.p2c else None
        self.pos_dropout = Dropout(c.hidden_dropout)
        # relative_rows' arguments, for the traceable path
        self.rel_args = (c.extra["pos_ebd_size"], c.extra["position_buckets"], c.extra["max_relative_positions"])

    def forward(self, x: Tensor, layout: Layout, rel: Relative | None = None) -> Tensor:
        """x: the layout's rows; rel: the relative-embedding window, its index and the per-length index lookup."""
        return super().forward(x, layout, bias=self.relative_bias(rel, layout.adapters))

    def relative_bias(self, rel: Relative | None, adapters: Route | None = None) -> SequenceBias | None:
        """The c2p / p2c bias of a sequence of length L, from the table window projected once per layer (each
        length's rows lie inside the longest length's window); adapters: the layout's (the table's rows are no
        sequence's: a mixed batch cannot route them, nn/lora.py's MixingError)."""
        if rel is None or not (self.c2p or self.p2c):
            return None
        table, index, lengths_index = rel
        table = self.pos_dropout(table)  # (W, C): one dropout draw per layer, as transformers
        # (W, C) each, or None
        key_table = routed(self.k if self.share_att_key else self.pos_k, table, adapters) if self.c2p else None
        query_table = routed(self.q if self.share_att_key else self.pos_q, table, adapters) if self.p2c else None
        if index is None:  # traceable: the whole table, rows from the runtime length
            return self._traced_bias(key_table, query_table)

        def bias(q: Tensor, k: Tensor) -> Tensor:  # (G, H, L, D) each, q scaled -> (G, H, L, L)
            sub = lengths_index(q.shape[2])
            offset = sub.lo - index.lo  # 0 for the longest length
            pos_key = self._layout(key_table, sub.c2p_rows + offset if offset else sub.c2p_rows) \
                if key_table is not None else None  # (H, 2L - 1, D)
            pos_query = self._layout(query_table, sub.p2c_rows + offset if offset else sub.p2c_rows) * self.scale \
                if query_table is not None else None  # (H, 2L - 1, D)
            return disentangled_bias(q, k, pos_key, pos_query)

        return bias

    def _traced_bias(self, key_table: Tensor | None, query_table: Tensor | None) -> SequenceBias:
        """The same bias from tensor ops only (DebertaEncoder.traceable): (2 * span, C) projected tables."""
        pos_key = self._heads(key_table) if key_table is not None else None  # (H, 2 * span, D)
        pos_query = self._heads(query_table) * self.scale if query_table is not None else None  # (H, 2 * span, D)

        def bias(q: Tensor, k: Tensor) -> Tensor:  # (B, H, T, D) each, q scaled -> (B, H, T, T)
            c2p_rows, p2c_rows = relative_rows(q, *self.rel_args)  # (T, T) each
            return gathered_bias(q, k, pos_key, pos_query, c2p_rows, p2c_rows)

        return bias

    def _heads(self, projected: Tensor) -> Tensor:
        return projected.view(-1, self.num_heads, self.head_dim).transpose(0, 1)  # (W, C) -> (H, W, D)

    def _layout(self, projected: Tensor, rows: Tensor) -> Tensor:
        """(W, C) projected table -> (H, 2L - 1, D) laid out by distance."""
        return Rows.apply(projected, rows, False).view(-1, self.num_heads, self.head_dim).transpose(0, 1)


class ConvLayer(nn.Module):
    """DeBERTa-v2-xlarge's convolution over the embeddings, added to the first layer's output."""

    def __init__(self, c: EncoderConfig):
        super().__init__()
        kernel = c.extra["conv_kernel_size"]
        self.conv = nn.Conv1d(c.hidden_size, c.hidden_size, kernel, padding=(kernel - 1) // 2,
                              groups=c.extra["conv_groups"])
        self.act = Activation(c.extra["conv_act"])
        self.norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.dropout = Dropout(c.hidden_dropout)

    def forward(self, embedded: Tensor, residual: Tensor, keep: Tensor | None) -> Tensor:
        out = self.conv(embedded.transpose(1, 2)).transpose(1, 2)  # (B, T, C)
        if keep is not None:
            out = out.masked_fill(~keep[..., None], 0.0)
        out = self.norm(residual + self.act(self.dropout(out)))  # (B, T, C)
        return out if keep is None else out * keep[..., None]


class DebertaEncoder(nn.Module):
    """Layers sharing one relative-embedding table (optionally LayerNorm-ed), the conv after layer 0.

    `traceable = True` (set by the ONNX exporter) computes the relative terms from tensor ops on the runtime length
    (relative_rows / gathered_bias) instead of the per-length window and cache, whose Python values a tracer would
    fix to the traced length. Same values; eager runs keep the faster window."""

    packs_holes = False  # relative distances of packed tokens would skip a hole in the mask
    padded_layout = RepresentativePadding  # transformers masks (query, key) pairs, not keys only

    def __init__(self, c: EncoderConfig):
        super().__init__()
        x = c.extra
        self.layers = nn.ModuleList(bert_layer(c, attn=DisentangledAttention(c)) for _ in range(c.num_hidden_layers))
        span = x["pos_ebd_size"]
        self.rel_embeddings = nn.Embedding(2 * span, c.hidden_size) if x["relative_attention"] else None
        self.rel_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps) if "layer_norm" in x["norm_rel_ebd"] \
            else None
        self.conv = ConvLayer(c) if x["conv_kernel_size"] > 0 else None
        self.uses_positions = x["relative_attention"] and any(t in x["pos_att_type"] for t in ATT_TYPES)
        self.positions = RelativeIndexCache(span, x["position_buckets"], x["max_relative_positions"])
        self.traceable = False

    def relative(self, length: int, device: torch.device) -> Relative | None:
        if not self.uses_positions:
            return None
        if self.traceable:
            table = self.rel_embeddings.weight  # (2 * span, C)
            return (self.rel_norm(table) if self.rel_norm is not None else table), None, None
        index = self.positions.get(length, device)
        table = self.rel_embeddings.weight[index.lo: index.lo + index.width]  # (W, C): only reachable rows
        return (self.rel_norm(table) if self.rel_norm is not None else table), index, \
            lambda n: self.positions.get(n, device)

    def forward(self, x: Tensor, layout: Layout) -> Tensor:
        """x: the layout's rows (.., C). The convolution alone needs the padded (B, T) layout: its window reads
        neighbours, and padding neighbours are zeros as in transformers."""
        rel = self.relative(layout.max_length, x.device)
        embedded = x
        for i, layer in enumerate(self.layers):
            x = layer(x, layout, rel=rel)  # (.., C)
            if i == 0 and self.conv is not None:
                out = self.conv(layout.unpack(embedded), layout.unpack(x), layout.keep)  # (B, T, C)
                x = layout.pack(out)  # (.., C)
        return x


def build_body(c: EncoderConfig, pooler: bool) -> EncoderBody:
    return EncoderBody(DebertaEmbeddings(c), DebertaEncoder(c), pooler=None)  # the ContextPooler is the head's


def context_pooler(c: EncoderConfig) -> dict[str, Any]:
    """The classifier's ContextPooler (dropout -> dense -> act on token 0) -> dropout -> out."""
    x = c.extra
    if x["pooler_hidden_size"] != c.hidden_size:
        raise c.error("pooler_hidden_size", f"{x['pooler_hidden_size']} differs from hidden_size "
                      f"{c.hidden_size}; transformers' classifier reads hidden_size features and fails")
    if x["pooler_hidden_act"] not in ACTIVATIONS:
        raise c.error("pooler_hidden_act", f"{x['pooler_hidden_act']!r} is not supported; "
                      f"supported: {sorted(ACTIVATIONS)}")
    return {"dense_act": x["pooler_hidden_act"], "pre_dropout": x["pooler_dropout"],
            "dense_size": x["pooler_hidden_size"]}


def mlm_head(c: EncoderConfig) -> dict[str, Any]:
    if not c.extra["legacy"] and c.embedding_size != c.hidden_size:
        raise c.error("legacy", f"false needs embedding_size == hidden_size ({c.embedding_size} != "
                      f"{c.hidden_size}): that head multiplies hidden states by the word embeddings directly")
    # legacy: dense hidden -> embedding_size, decoder tied unless untied; the newer head is always tied
    return {"tied": c.tie_word_embeddings or not c.extra["legacy"], "decoder_bias": False}


HEAD_OPTIONS: HeadOptions = {
    "text-classification": context_pooler,
    "multiple-choice": context_pooler,
    "token-classification": lambda c: {"dropout": c.hidden_dropout},
    "fill-mask": mlm_head,
}


@torch.no_grad()
def after_init(model: nn.Module, c: EncoderConfig) -> None:
    """transformers initialises Conv1d like Linear; init_module leaves it at PyTorch's default."""
    for module in model.modules():
        if isinstance(module, nn.Conv1d):
            module.weight.normal_(0.0, c.initializer_range)
            module.bias.zero_()


# --- names --------------------------------------------------------------------------------------------------

LAYER = ("encoder.layer.{i}", "encoder.layers.{i}")
BODY_KEYS = KeyMap(tables(
    params("embeddings.word_embeddings", "embeddings.word", ("weight",)),
    params("embeddings.position_embeddings", "embeddings.position", ("weight",)),
    params("embeddings.token_type_embeddings", "embeddings.token_type", ("weight",)),
    params("embeddings.embed_proj", "embeddings.project", ("weight",)),
    params("embeddings.LayerNorm", "embeddings.norm"),
    {"embeddings.position_ids": None},  # a buffer older versions saved
    params(f"{LAYER[0]}.attention.self.query_proj", f"{LAYER[1]}.attn.q"),
    params(f"{LAYER[0]}.attention.self.key_proj", f"{LAYER[1]}.attn.k"),
    params(f"{LAYER[0]}.attention.self.value_proj", f"{LAYER[1]}.attn.v"),
    params(f"{LAYER[0]}.attention.self.pos_key_proj", f"{LAYER[1]}.attn.pos_k"),
    params(f"{LAYER[0]}.attention.self.pos_query_proj", f"{LAYER[1]}.attn.pos_q"),
    params(f"{LAYER[0]}.attention.output.dense", f"{LAYER[1]}.attn.o"),
    params(f"{LAYER[0]}.attention.output.LayerNorm", f"{LAYER[1]}.attn_norm"),
    params(f"{LAYER[0]}.intermediate.dense", f"{LAYER[1]}.ffn.up"),
    params(f"{LAYER[0]}.output.dense", f"{LAYER[1]}.ffn.down"),
    params(f"{LAYER[0]}.output.LayerNorm", f"{LAYER[1]}.ffn_norm"),
    params("encoder.rel_embeddings", "encoder.rel_embeddings", ("weight",)),
    params("encoder.LayerNorm", "encoder.rel_norm"),
    params("encoder.conv.conv", "encoder.conv.conv"),
    params("encoder.conv.LayerNorm", "encoder.conv.norm"),
))

# The MLM head in its two layouts. transformers' default (legacy=True) is cls.predictions.*; legacy=False and the
# original Microsoft checkpoints use lm_predictions.lm_head.*. Both load into the same head (the same function when
# embedding_size == hidden_size); saving writes the layout the config's `legacy` asks for.
_CLS_MLM = {
    **params("cls.predictions.transform.dense", "dense"),
    **params("cls.predictions.transform.LayerNorm", "norm"),
    "cls.predictions.bias": "bias",
    "cls.predictions.decoder.bias": "bias",  # tied to cls.predictions.bias
    "cls.predictions.decoder.weight": "decoder.weight",  # tied to the word embeddings unless untied
}
_LM_PREDICTIONS_MLM = {
    **params("lm_predictions.lm_head.dense", "dense"),
    **params("lm_predictions.lm_head.LayerNorm", "norm"),
    "lm_predictions.lm_head.bias": "bias",
}
MLM_KEYS = KeyMap({**_CLS_MLM, **_LM_PREDICTIONS_MLM})
MLM_KEYS_NEW = KeyMap({**_LM_PREDICTIONS_MLM, **_CLS_MLM})
# Untied (tie_word_embeddings false), transformers' decoder keeps its own bias and cls.predictions.bias goes unused.
MLM_KEYS_UNTIED = KeyMap({
    **params("cls.predictions.transform.dense", "dense"),
    **params("cls.predictions.transform.LayerNorm", "norm"),
    "cls.predictions.decoder.weight": "decoder.weight",
    "cls.predictions.decoder.bias": "bias",
    "cls.predictions.bias": None,
    **_LM_PREDICTIONS_MLM,
})

HEAD_KEYS = {
    "text-classification": KeyMap({**params("pooler.dense", "dense"), **params("classifier", "out")}),
    "token-classification": KeyMap(params("classifier", "out")),
    "question-answering": KeyMap(params("qa_outputs", "qa")),
    "multiple-choice": KeyMap({**params("pooler.dense", "dense"), **params("classifier", "out")}),
    "fill-mask": MLM_KEYS,
}

# The replaced-token-detection head of DeBERTa-v3 pre-training checkpoints.
IGNORED_KEYS = KeyMap(tables(params("mask_predictions.dense", "unused.dense"),
                             params("mask_predictions.LayerNorm", "unused.norm"),
                             params("mask_predictions.classifier", "unused.classifier")))


def select_head_keys(c: EncoderConfig, task: str) -> KeyMap | None:
    """The MLM head's table follows the config's layout; every other head has one table."""
    mlm = MLM_KEYS if c.tie_word_embeddings else MLM_KEYS_UNTIED
    layouts = {**HEAD_KEYS, "fill-mask": mlm if c.extra["legacy"] else MLM_KEYS_NEW}
    return layouts.get(task)


DEBERTA_V2 = Family(
    model_type="deberta-v2", prefix="deberta", class_prefix="DebertaV2",
    config_from_hf=deberta_config, body_keys=BODY_KEYS, head_keys=HEAD_KEYS, body_builder=build_body,
    head_options=HEAD_OPTIONS, ignored_keys=IGNORED_KEYS, after_init=after_init, select_head_keys=select_head_keys)
