"""EncoderConfig: one dataclass for every family, filled by the family's mapping from config.json."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError
from .nn.activations import ACTIVATIONS

PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")


def available_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # non-POSIX: no cheap answer, don't block
        return 1 << 62


@dataclass
class EncoderConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    hidden_act: str = "gelu"
    max_position_embeddings: int = 512
    type_vocab_size: int = 2  # 0: the family has no token types
    layer_norm_eps: float = 1e-12
    pad_token_id: int | None = 0
    initializer_range: float = 0.02
    embedding_size: int | None = None  # None: same as hidden_size (ALBERT and DeBERTa factorise)
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    classifier_dropout: float | None = None  # None: hidden_dropout
    num_hidden_groups: int = 1  # ALBERT layer sharing
    inner_group_num: int = 1
    tie_word_embeddings: bool = True
    # the width of one attention head; None: hidden_size // num_attention_heads. Only the families whose transformers
    # attention reads config.head_dim set it (GTE, NomicBERT, EuroBERT, jina-embeddings-v3): their heads may be
    # wider or narrower than that, q/k/v projecting to num_attention_heads * head_dim and o back to hidden_size
    head_dim: int | None = None
    # head metadata, as transformers keeps it
    num_labels: int = 2
    id2label: dict[int, str] = field(default_factory=dict)
    label2id: dict[str, int] = field(default_factory=dict)
    problem_type: str | None = None
    # family-specific settings (e.g. DeBERTa's relative attention) and the untouched source config.json
    extra: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict, repr=False)
    source: str = "config.json"  # where the values came from, for error messages

    def __post_init__(self) -> None:
        if self.embedding_size is None:
            self.embedding_size = self.hidden_size
        if self.classifier_dropout is None:
            self.classifier_dropout = self.hidden_dropout
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "max_position_embeddings", "embedding_size",
                     "num_hidden_groups", "inner_group_num"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise self.error(name, f"must be a positive integer, got {value!r}")
        if isinstance(self.type_vocab_size, bool) or not isinstance(self.type_vocab_size, int) or self.type_vocab_size < 0:
            raise self.error("type_vocab_size", f"must be an integer >= 0, got {self.type_vocab_size!r}")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise self.error("num_attention_heads",
                                 f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads "
                                 f"{self.num_attention_heads}")
            self.head_dim = self.hidden_size // self.num_attention_heads
        elif isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) or self.head_dim <= 0:
            raise self.error("head_dim", f"must be a positive integer, got {self.head_dim!r}")
        if self.hidden_act not in ACTIVATIONS:
            raise self.error("hidden_act", f"{self.hidden_act!r} is not supported; supported: {sorted(ACTIVATIONS)}")
        if self.problem_type is not None and self.problem_type not in PROBLEM_TYPES:
            raise self.error("problem_type", f"{self.problem_type!r} is not one of {list(PROBLEM_TYPES)}")
        self.set_labels(id2label=self.id2label or None, label2id=self.label2id or None, strict=False)
        self.check_size()

    def set_labels(self, num_labels: int | None = None, id2label: dict[Any, str] | None = None,
                   label2id: dict[str, Any] | None = None, problem_type: str | None = None,
                   strict: bool = True, given_by: str | None = None) -> None:
        """Label metadata as transformers derives it: id2label wins, else num_labels makes LABEL_i names. GIVEN_BY:
        what the values came from when not config.json (a call's arguments), named in the errors instead of it."""
        error = self.error if given_by is None else \
            (lambda name, message: ConfigError(f"{given_by}: argument {name}: {message}"))
        if id2label is not None:
            try:
                self.id2label = {int(k): str(v) for k, v in id2label.items()}
            except (TypeError, ValueError) as e:
                raise error("id2label", f"keys must be integers: {e}") from e
            if sorted(self.id2label) != list(range(len(self.id2label))):
                raise error("id2label", f"ids must be 0..{len(self.id2label) - 1}, got {sorted(self.id2label)}")
            if num_labels is not None and num_labels != len(self.id2label):
                raise error("num_labels", f"{num_labels} disagrees with id2label ({len(self.id2label)} labels)")
            self.num_labels = len(self.id2label)
        else:
            n = self.num_labels if num_labels is None else num_labels
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise error("num_labels", f"must be a positive integer, got {n!r}")
            if n != len(self.id2label):  # a new label count gets transformers' LABEL_i names
                self.id2label = {i: f"LABEL_{i}" for i in range(n)}
            self.num_labels = n
        derived = {v: k for k, v in self.id2label.items()}
        if label2id is not None and strict:
            try:
                given = {str(k): int(v) for k, v in label2id.items()}
            except (TypeError, ValueError) as e:
                raise error("label2id", f"values must be integers: {e}") from e
            if given != derived:
                raise error("label2id", f"{given} does not invert id2label {self.id2label}")
        # transformers keeps an inconsistent label2id from old configs as is; hfport derives it from id2label
        self.label2id = derived
        if problem_type is not None:
            if problem_type not in PROBLEM_TYPES:
                raise error("problem_type", f"{problem_type!r} is not one of {list(PROBLEM_TYPES)}")
            self.problem_type = problem_type

    @property
    def attention_size(self) -> int:
        """The width q, k and v project to (all heads side by side): hidden_size unless head_dim says otherwise."""
        return self.num_attention_heads * self.head_dim

    def error(self, field_name: str, message: str) -> ConfigError:
        return ConfigError(f"{self.source}: field '{field_name}': {message}")

    def estimated_parameters(self) -> int:
        """An upper-bound-ish count, computed before anything is allocated."""
        h, i, e = self.hidden_size, self.intermediate_size, self.embedding_size
        unique_layers = self.num_hidden_groups * self.inner_group_num if self.num_hidden_groups > 1 or \
            self.inner_group_num > 1 else self.num_hidden_layers
        embeddings = (self.vocab_size + self.max_position_embeddings + self.type_vocab_size) * e + e * h
        layer = 4 * h * self.attention_size + 2 * h * i
        return embeddings + unique_layers * layer + 2 * h * h + self.vocab_size

    def check_size(self, bytes_per_param: int = 4) -> None:
        need = self.estimated_parameters() * bytes_per_param
        have = available_memory_bytes()
        if need > have:
            raise ConfigError(
                f"{self.source}: the sizes ask for about {need / 2**30:.1f} GiB of weights "
                f"(hidden_size={self.hidden_size}, num_hidden_layers={self.num_hidden_layers}, "
                f"vocab_size={self.vocab_size}, intermediate_size={self.intermediate_size}) but this machine has "
                f"{have / 2**30:.1f} GiB; refusing before allocating anything")

    def to_hf_dict(self, architecture: str | None = None) -> dict[str, Any]:
        """The source config.json with the head metadata brought up to date."""
        out = dict(self.raw)
        if architecture:
            out["architectures"] = [architecture]
        out["id2label"] = {str(k): v for k, v in self.id2label.items()}
        out["label2id"] = dict(self.label2id)
        out["num_labels"] = self.num_labels
        if self.problem_type is not None:
            out["problem_type"] = self.problem_type
        return out


def require(raw: dict[str, Any], key: str, source: str, kind: type | tuple[type, ...] = int) -> Any:
    """A required config.json field, with an error naming the file and the field."""
    if key not in raw:
        raise ConfigError(f"{source}: required field '{key}' is missing")
    value = raw[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"{source}: field '{key}' should be {getattr(kind, '__name__', kind)}, got {value!r}")
    return value


def head_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The label metadata transformers keeps in every config."""
    out: dict[str, Any] = {}
    if raw.get("id2label"):
        out["id2label"] = raw["id2label"]
    elif isinstance(raw.get("num_labels"), int):
        out["num_labels"] = raw["num_labels"]
    if raw.get("label2id"):
        out["label2id"] = raw["label2id"]
    if raw.get("problem_type"):
        out["problem_type"] = raw["problem_type"]
    return out
