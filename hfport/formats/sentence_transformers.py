"""The sentence-transformers layout: its file names, flags and markers, and its one reader.

An embedding model folder is an HF folder (config.json, weights, tokenizer) plus the files sentence-transformers
reads to build its module chain Transformer -> Pooling [-> Normalize]:
    modules.json                 the chain: each module's class and sub-folder
    sentence_bert_config.json    max_seq_length (ST truncates there) and do_lower_case
    1_Pooling/config.json        which pooling (pooling_mode_cls_token / _mean_tokens / _max_tokens booleans, or the
                                 `pooling_mode` string sentence-transformers >= 6 writes), include_prompt
    2_Normalize/                 present (empty) when embeddings are L2-normalised
    config_sentence_transformers.json  the similarity function (cosine), prompts and the default prompt name
A sparse (SPLADE) folder, as sentence-transformers' SparseEncoder saves it, is a masked-LM HF folder (BertForMaskedLM)
whose chain is Transformer (transformer_task "fill-mask"; MLMTransformer before sentence-transformers 5.4) ->
SpladePooling:
    1_SpladePooling/config.json  pooling_strategy (max | sum) and activation_function (relu | log1p_relu)
    config_sentence_transformers.json  model_type "SparseEncoder", prompts
Any other sparse chain (SparseStaticEmbedding, a Router, SparseAutoEncoder) is refused by name.
Matryoshka dimensions: sentence-transformers 6.2 keeps them nowhere but its model card, so hfport records a model's
trained dimensions as `matryoshka_dims` in config_sentence_transformers.json (sentence-transformers ignores keys it
does not know) and reads them back into SentenceLayout.matryoshka_dims.
A reranker (cross-encoder) folder is a one-label HF sequence-classification folder whose config.json carries
`"sentence_transformers": {"activation_fn": "torch.nn.modules.activation.Sigmoid"}`: CrossEncoder's own marker
(sentence-transformers >= 4), read by its `predict()` to put a sigmoid on the logit.

`read_layout` / `read_sparse_layout` are the readers (serving, export, training and verify all use them) and
`write_embedding_layout` / `write_sparse_layout` / `mark_cross_encoder` / `copy_layout` the writers (training's best/
and final/, export); the proof, with sentence-transformers' own loaders, is hfport/export/sentence_formats.py's (and
sparse_format.py's).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import hub
from ..errors import ConfigError

MODULES = "modules.json"
MATRYOSHKA_KEY = "matryoshka_dims"  # hfport's key in config_sentence_transformers.json (see the module docstring)
ST_CONFIG = "sentence_bert_config.json"
ST_MODEL_CONFIG = "config_sentence_transformers.json"
SIMILARITY_FNS = ("cosine", "dot", "euclidean", "manhattan")  # sentence-transformers' SimilarityFunction values
POOLING_DIR = "1_Pooling"
NORMALIZE_DIR = "2_Normalize"
POOLING_MODES = ("mean", "cls", "max")
# hfport's pooling name -> the classic 1_Pooling/config.json flag (sentence-transformers 6 reads these too)
POOLING_FLAGS = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens",
                 "max": "pooling_mode_max_tokens"}
ALL_FLAGS = (*POOLING_FLAGS.values(), "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens",
             "pooling_mode_lasttoken")  # every classic flag, written false but the chosen one
MODULE_TYPES = {"transformer": "sentence_transformers.models.Transformer",
                "pooling": "sentence_transformers.models.Pooling",
                "normalize": "sentence_transformers.models.Normalize"}
SPLADE_DIR = "1_SpladePooling"
SPARSE_MODULE_TYPES = {"transformer": "sentence_transformers.base.modules.transformer.Transformer",
                       "splade": "sentence_transformers.sparse_encoder.modules.splade_pooling.SpladePooling"}
# SpladePooling's options and the values sentence-transformers accepts (its defaults first)
SPLADE_POOLINGS = ("max", "sum")
SPLADE_ACTIVATIONS = ("relu", "log1p_relu")
# module classes that only a SparseEncoder chain has: a folder naming one is a sparse folder
SPARSE_MODULES = ("MLMTransformer", "SpladePooling", "SparseStaticEmbedding", "SparseAutoEncoder", "CSRSparsity")
SPARSE_MODEL_TYPE = "SparseEncoder"
CROSS_ENCODER_KEY = "sentence_transformers"
SIGMOID = "torch.nn.modules.activation.Sigmoid"


class SentenceTransformersError(ConfigError):
    """A sentence-transformers folder hfport cannot read (or write)."""


def is_cross_encoder(raw: dict[str, Any]) -> bool:
    return isinstance(raw.get(CROSS_ENCODER_KEY), dict)


def has_embedding_layout(folder: str | Path) -> bool:
    """A dense sentence-transformers folder (a sparse one has modules.json too: has_sparse_layout)."""
    return (Path(folder) / MODULES).is_file() and not has_sparse_layout(folder)


def has_sparse_layout(folder: str | Path) -> bool:
    """A SparseEncoder folder: its config_sentence_transformers.json says so, or modules.json names a sparse module.
    Unreadable files answer False here; the readers name what is wrong with them."""
    folder = Path(folder)
    if not (folder / MODULES).is_file():
        return False
    try:
        config = json.loads((folder / ST_MODEL_CONFIG).read_text(encoding="utf-8")) \
            if (folder / ST_MODEL_CONFIG).is_file() else {}
        modules = json.loads((folder / MODULES).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    if isinstance(config, dict) and config.get("model_type") == SPARSE_MODEL_TYPE:
        return True
    return isinstance(modules, list) and any(isinstance(m, dict) and isinstance(m.get("type"), str)
                                             and m["type"].rsplit(".", 1)[-1] in SPARSE_MODULES for m in modules)


# --- reading ----------------------------------------------------------------------------------------------------


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SentenceTransformersError(f"{path}: cannot be read as JSON ({e})") from e


# sentence-transformers' pooling names -> hfport's (hfport.heads.pool computes each): the `pooling_mode` string
# that sentence-transformers >= 6 writes, and the classic pooling_mode_* flag of each
ST_POOLINGS = {"cls": "cls", "mean": "mean", "max": "max", "mean_sqrt_len_tokens": "mean_sqrt_len",
               "lasttoken": "lasttoken"}
CLASSIC_POOLING_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                         "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                         "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}


@dataclass(frozen=True)
class SentenceLayout:
    """What a folder's sentence-transformers files say about its embeddings; `source` says where it was read."""

    pooling: str = "mean"  # hfport's name, see ST_POOLINGS
    normalize: bool = False
    max_seq_length: int | None = None
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    include_prompt: bool = True  # False: a prompt's tokens (and the leading special token) are not pooled
    matryoshka_dims: tuple[int, ...] = ()  # the prefix sizes the model was trained for (hfport's record; () unknown)
    similarity_fn_name: str = "cosine"  # SIMILARITY_FNS: how the model's embeddings are compared (its `similarity`)
    source: str = "default (no modules.json)"


def _read_common(folder: Path) -> dict[str, Any]:
    """What dense and sparse folders keep alike: max_seq_length (sentence_bert_config.json, or the tokenizer's
    model_max_length for sentence-transformers >= 6), prompts and the default prompt name, and hfport's record of the
    Matryoshka dimensions (config_sentence_transformers.json)."""
    extra: dict[str, Any] = {}
    st_config = folder / ST_CONFIG
    if st_config.is_file():
        raw = _read_json(st_config)
        length = raw.get("max_seq_length")
        tokenizer_config = folder / "tokenizer_config.json"
        if length is None and "modality_config" in raw and tokenizer_config.is_file():
            # sentence-transformers >= 6 keeps it as the tokenizer's model_max_length
            length = _read_json(tokenizer_config).get("model_max_length")
        if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 1):
            raise SentenceTransformersError(f"{st_config}: max_seq_length must be a positive integer, got {length!r}")
        extra["max_seq_length"] = length
    prompts_file = folder / ST_MODEL_CONFIG
    if prompts_file.is_file():
        raw = _read_json(prompts_file)
        prompts = raw.get("prompts") or {}
        if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
            raise SentenceTransformersError(f"{prompts_file}: prompts must be an object of strings, got {prompts!r}")
        default = raw.get("default_prompt_name")
        if default is not None and default not in prompts:
            raise SentenceTransformersError(f"{prompts_file}: default_prompt_name {default!r} is not one of the "
                                            f"prompts {sorted(prompts)}")
        dims = raw.get(MATRYOSHKA_KEY)
        if dims is not None and (not isinstance(dims, list) or not dims or not all(
                isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims)):
            raise SentenceTransformersError(f"{prompts_file}: {MATRYOSHKA_KEY} must be a list of positive integers, "
                                            f"got {dims!r}")
        extra |= {"prompts": dict(prompts), "default_prompt_name": default,
                  "matryoshka_dims": tuple(dims) if dims else ()}
    return extra


def _read_similarity(folder: Path) -> dict[str, Any]:
    """config_sentence_transformers.json's similarity_fn_name (sentence-transformers' default: cosine)."""
    config = folder / ST_MODEL_CONFIG
    name = _read_json(config).get("similarity_fn_name") if config.is_file() else None
    if name is None:
        return {}
    if name not in SIMILARITY_FNS:
        raise SentenceTransformersError(f"{config}: similarity_fn_name {name!r}; sentence-transformers' are "
                                        f"{list(SIMILARITY_FNS)}")
    return {"similarity_fn_name": name}


def _read_modules(folder: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """modules.json's entries and each one's class name (sentence-transformers 6 writes
    `...sentence_transformer.modules.pooling.Pooling` where older versions wrote `...models.Pooling`)."""
    modules = _read_json(folder / MODULES)
    if not isinstance(modules, list) or not all(isinstance(m, dict) and isinstance(m.get("type"), str)
                                                for m in modules):
        raise SentenceTransformersError(f"{folder / MODULES}: expected a list of modules with a 'type' each")
    return modules, [m["type"].rsplit(".", 1)[-1] for m in modules]


def read_layout(folder: str | Path) -> SentenceLayout:
    """The one reader of the dense sentence-transformers layout (serving, export, training and verify all use it).

    Modules are matched by class name. Pooling is read from the `pooling_mode` string (>= 6) or the classic flags. A
    chain hfport does not compute (a Dense layer, weighted-mean pooling, two poolings) is an error naming it, never a
    silent default; a SparseEncoder folder is an error saying so (read_sparse_layout reads it). A folder without
    modules.json pools by mean and does not normalize (sentence-transformers' own default for a bare transformers
    checkpoint)."""
    folder = Path(folder)
    if has_sparse_layout(folder):
        raise SentenceTransformersError(f"{folder / MODULES}: a sparse (SparseEncoder) model; it gives sparse "
                                        "vocabulary-sized vectors (task sparse-embedding), not dense embeddings")
    extra = _read_common(folder) | _read_similarity(folder)
    if not has_embedding_layout(folder):
        return SentenceLayout(**extra)
    modules, kinds = _read_modules(folder)
    unknown = [m["type"] for m, kind in zip(modules, kinds) if kind not in ("Transformer", "Pooling", "Normalize")]
    if unknown:
        raise SentenceTransformersError(f"{folder / MODULES}: module(s) {unknown} are not ones hfport computes "
                                        "(Transformer, Pooling and Normalize are)")
    poolings = [m for m, kind in zip(modules, kinds) if kind == "Pooling"]
    if len(poolings) != 1:
        raise SentenceTransformersError(f"{folder / MODULES}: expected one Pooling module, found {len(poolings)}")
    pooling_file = folder / str(poolings[0].get("path") or "") / "config.json"
    if not pooling_file.is_file():
        raise SentenceTransformersError(f"{folder / MODULES}: the Pooling module's config {pooling_file} is missing")
    config = _read_json(pooling_file)
    mode = config.get("pooling_mode")
    modes = ([mode] if isinstance(mode, str) else list(mode) if isinstance(mode, list)
             else [name for flag, name in CLASSIC_POOLING_FLAGS.items() if config.get(flag)])
    if len(modes) != 1 or modes[0] not in ST_POOLINGS:
        raise SentenceTransformersError(f"{pooling_file}: pooling {modes or 'none'}; hfport computes exactly one of "
                                        f"{list(ST_POOLINGS)}")
    include_prompt = config.get("include_prompt", True)
    if not isinstance(include_prompt, bool):
        raise SentenceTransformersError(f"{pooling_file}: include_prompt must be true or false, got {include_prompt!r}")
    return SentenceLayout(pooling=ST_POOLINGS[modes[0]], normalize="Normalize" in kinds, include_prompt=include_prompt,
                          source=f"{folder / MODULES} ({', '.join(kinds)})", **extra)


def read_st_pooling(folder: str | Path) -> tuple[str, bool]:
    """(pooling, normalize) of a sentence-transformers folder, for what writes this layout again (export, training):
    one of the poolings write_embedding_layout writes ("mean" | "cls" | "max")."""
    layout = read_layout(folder)
    if layout.pooling not in POOLING_MODES:
        raise SentenceTransformersError(f"{Path(folder) / MODULES}: pooling {layout.pooling!r} is served but not "
                                        f"exported or trained by hfport (those write one of {list(POOLING_MODES)})")
    return layout.pooling, layout.normalize


def read_max_seq_length(folder: str | Path) -> int | None:
    return read_layout(folder).max_seq_length


@dataclass(frozen=True)
class SparseLayout:
    """What a SparseEncoder folder's files say: SpladePooling's options, the input limit and the prompts."""

    pooling_strategy: str = "max"  # SPLADE_POOLINGS
    activation: str = "relu"  # SPLADE_ACTIVATIONS
    max_seq_length: int | None = None
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    source: str = "default (SpladePooling's defaults)"
    include_prompt: bool = True  # SpladePooling pools every real token, a prompt's included
    pooling: str = "splade"  # what TEI's /info names this pooling


def read_sparse_layout(folder: str | Path) -> SparseLayout:
    """The one reader of the SparseEncoder layout: exactly Transformer (fill-mask; or the older MLMTransformer) ->
    SpladePooling. Any other chain, an unknown transformer_task, pooling_strategy or activation_function is an error
    naming it (and what hfport computes)."""
    folder = Path(folder)
    modules, kinds = _read_modules(folder)
    if kinds not in (["Transformer", "SpladePooling"], ["MLMTransformer", "SpladePooling"]):
        raise SentenceTransformersError(f"{folder / MODULES}: sparse modules {kinds}; hfport computes exactly "
                                        "Transformer (fill-mask) or MLMTransformer, then SpladePooling")
    st_config = folder / ST_CONFIG
    task = _read_json(st_config).get("transformer_task", "fill-mask") if st_config.is_file() else "fill-mask"
    if task != "fill-mask":
        raise SentenceTransformersError(f"{st_config}: transformer_task {task!r}; a SPLADE model's transformer is "
                                        "a masked-LM head (fill-mask)")
    pooling_file = folder / str(modules[1].get("path") or "") / "config.json"
    config = _read_json(pooling_file) if pooling_file.is_file() else {}
    if not isinstance(config, dict):
        raise SentenceTransformersError(f"{pooling_file}: expected an object")
    strategy = config.get("pooling_strategy", SPLADE_POOLINGS[0])
    activation = config.get("activation_function", SPLADE_ACTIVATIONS[0])
    if strategy not in SPLADE_POOLINGS:
        raise SentenceTransformersError(f"{pooling_file}: pooling_strategy {strategy!r}; use one of "
                                        f"{list(SPLADE_POOLINGS)}")
    if activation not in SPLADE_ACTIVATIONS:
        raise SentenceTransformersError(f"{pooling_file}: activation_function {activation!r}; use one of "
                                        f"{list(SPLADE_ACTIVATIONS)}")
    extra = _read_common(folder)
    extra.pop("matryoshka_dims", None)  # a dense embedding's; vocabulary vectors are not cut
    return SparseLayout(pooling_strategy=strategy, activation=activation,
                        source=f"{folder / MODULES} ({', '.join(kinds)})", **extra)


# --- writing ----------------------------------------------------------------------------------------------------


def write_embedding_layout(folder: str | Path, *, pooling: str, normalize: bool, hidden_size: int,
                           max_seq_length: int, prompts: dict[str, str] | None = None,
                           default_prompt_name: str | None = None, include_prompt: bool = True,
                           matryoshka_dims: tuple[int, ...] | list[int] = ()) -> list[str]:
    """Add the sentence-transformers files to an HF folder (its config and weights already there). Returns the names
    written. Each file is written whole (write_json_atomic), and a folder from an earlier save is replaced.
    matryoshka_dims: the prefix sizes the model was trained for, recorded under MATRYOSHKA_KEY (none: no key)."""
    if pooling not in POOLING_MODES:
        raise SentenceTransformersError(f"pooling {pooling!r}: expected one of {list(POOLING_MODES)}")
    folder = Path(folder)
    modules = [{"idx": 0, "name": "0", "path": "", "type": MODULE_TYPES["transformer"]},
               {"idx": 1, "name": "1", "path": POOLING_DIR, "type": MODULE_TYPES["pooling"]}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": NORMALIZE_DIR, "type": MODULE_TYPES["normalize"]})
    hub.write_json_atomic(folder / MODULES, modules)
    hub.write_json_atomic(folder / ST_CONFIG, {"max_seq_length": int(max_seq_length), "do_lower_case": False})
    (folder / POOLING_DIR).mkdir(exist_ok=True)
    flags = {flag: False for flag in ALL_FLAGS}
    flags[POOLING_FLAGS[pooling]] = True
    hub.write_json_atomic(folder / POOLING_DIR / "config.json",
                          {"word_embedding_dimension": int(hidden_size), **flags, "include_prompt": include_prompt})
    if normalize:
        (folder / NORMALIZE_DIR).mkdir(exist_ok=True)
    elif (folder / NORMALIZE_DIR).exists():
        shutil.rmtree(folder / NORMALIZE_DIR)
    dims = {MATRYOSHKA_KEY: [int(d) for d in matryoshka_dims]} if matryoshka_dims else {}
    hub.write_json_atomic(folder / ST_MODEL_CONFIG, {"model_type": "SentenceTransformer",
                                                     "prompts": dict(prompts or {}),
                                                     "default_prompt_name": default_prompt_name,
                                                     "similarity_fn_name": "cosine", **dims})
    return [MODULES, ST_CONFIG, f"{POOLING_DIR}/config.json", ST_MODEL_CONFIG] + ([NORMALIZE_DIR] if normalize
                                                                                  else [])


def write_sparse_layout(folder: str | Path, *, max_seq_length: int, pooling_strategy: str = "max",
                        activation: str = "relu", prompts: dict[str, str] | None = None,
                        default_prompt_name: str | None = None) -> list[str]:
    """Add the SparseEncoder files to a masked-LM HF folder, as sentence-transformers 6 saves them: modules.json
    (Transformer -> SpladePooling), sentence_bert_config.json (transformer_task fill-mask, and max_seq_length, which
    sentence-transformers reads as the tokenizer's limit), 1_SpladePooling/config.json and
    config_sentence_transformers.json (model_type SparseEncoder; dot-product similarity). Returns the names written."""
    if pooling_strategy not in SPLADE_POOLINGS or activation not in SPLADE_ACTIVATIONS:
        raise SentenceTransformersError(f"SpladePooling({pooling_strategy!r}, {activation!r}): pooling_strategy is "
                                        f"one of {list(SPLADE_POOLINGS)}, activation one of {list(SPLADE_ACTIVATIONS)}")
    folder = Path(folder)
    hub.write_json_atomic(folder / MODULES, [
        {"idx": 0, "name": "0", "path": "", "type": SPARSE_MODULE_TYPES["transformer"]},
        {"idx": 1, "name": "1", "path": SPLADE_DIR, "type": SPARSE_MODULE_TYPES["splade"]}])
    hub.write_json_atomic(folder / ST_CONFIG, {"max_seq_length": int(max_seq_length), "do_lower_case": False,
                                               "transformer_task": "fill-mask"})
    (folder / SPLADE_DIR).mkdir(exist_ok=True)
    hub.write_json_atomic(folder / SPLADE_DIR / "config.json", {"pooling_strategy": pooling_strategy,
                                                                "activation_function": activation,
                                                                "embedding_dimension": None})
    hub.write_json_atomic(folder / ST_MODEL_CONFIG, {"model_type": SPARSE_MODEL_TYPE, "prompts": dict(prompts or {}),
                                                     "default_prompt_name": default_prompt_name,
                                                     "similarity_fn_name": "dot"})
    return [MODULES, ST_CONFIG, f"{SPLADE_DIR}/config.json", ST_MODEL_CONFIG]


def mark_cross_encoder(folder: str | Path) -> None:
    """Put CrossEncoder's marker into a one-label classification folder's config.json (see the module docstring)."""
    path = Path(folder) / "config.json"
    raw, _ = hub.read_config(Path(folder))
    if raw.get("num_labels", len(raw.get("id2label") or {})) != 1:
        raise SentenceTransformersError(f"{path}: a cross-encoder has one label; this config has "
                                        f"{len(raw.get('id2label') or {})}")
    raw[CROSS_ENCODER_KEY] = {"activation_fn": SIGMOID}
    hub.write_json_atomic(path, raw)


def copy_layout(source: str | Path, out: str | Path) -> list[str]:
    """Copy an embedding (dense or sparse) folder's sentence-transformers files to OUT (an export of its weights); []
    when SOURCE has none. The files are re-written from what the reader understood, so OUT never carries a module
    hfport did not check (a Dense layer, say, which `read_st_pooling` refuses)."""
    raw, _ = hub.read_config(Path(source)) if (Path(source) / MODULES).is_file() else ({}, None)
    if has_sparse_layout(source):
        sparse = read_sparse_layout(source)
        return write_sparse_layout(out, max_seq_length=sparse.max_seq_length or raw.get("max_position_embeddings", 512),
                                   pooling_strategy=sparse.pooling_strategy, activation=sparse.activation,
                                   prompts=sparse.prompts, default_prompt_name=sparse.default_prompt_name)
    if not has_embedding_layout(source):
        return []
    pooling, normalize = read_st_pooling(source)
    layout = read_layout(source)
    return write_embedding_layout(out, pooling=pooling, normalize=normalize, hidden_size=raw["hidden_size"],
                                  max_seq_length=layout.max_seq_length or raw.get("max_position_embeddings", 512),
                                  prompts=layout.prompts, default_prompt_name=layout.default_prompt_name,
                                  include_prompt=layout.include_prompt, matryoshka_dims=layout.matryoshka_dims)


