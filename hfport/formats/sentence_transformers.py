"""The sentence-transformers layout: its file names, flags and markers, and its one reader.

An embedding model folder is an HF folder (config.json, weights, tokenizer) plus the files sentence-transformers
reads to build its module chain Transformer -> Pooling [-> Normalize]:
    modules.json                 the chain: each module's class and sub-folder
    sentence_bert_config.json    max_seq_length (ST truncates there) and do_lower_case
    1_Pooling/config.json        which pooling (pooling_mode_cls_token / _mean_tokens / _max_tokens booleans, or the
                                 `pooling_mode` string sentence-transformers >= 6 writes), include_prompt
    2_Normalize/                 present (empty) when embeddings are L2-normalised
    config_sentence_transformers.json  the similarity function (cosine), prompts and the default prompt name
A reranker (cross-encoder) folder is a one-label HF sequence-classification folder whose config.json carries
`"sentence_transformers": {"activation_fn": "torch.nn.modules.activation.Sigmoid"}`: CrossEncoder's own marker
(sentence-transformers >= 4), read by its `predict()` to put a sigmoid on the logit.

`read_layout` is the one reader (serving, export, training and verify all use it) and `write_embedding_layout` /
`mark_cross_encoder` / `copy_layout` the one writer (training's best/ and final/, export); the proof, with
sentence-transformers' own loaders, is hfport/export/sentence_formats.py's.
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
ST_CONFIG = "sentence_bert_config.json"
ST_MODEL_CONFIG = "config_sentence_transformers.json"
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
CROSS_ENCODER_KEY = "sentence_transformers"
SIGMOID = "torch.nn.modules.activation.Sigmoid"


class SentenceTransformersError(ConfigError):
    """A sentence-transformers folder hfport cannot read (or write)."""


def is_cross_encoder(raw: dict[str, Any]) -> bool:
    return isinstance(raw.get(CROSS_ENCODER_KEY), dict)


def has_embedding_layout(folder: str | Path) -> bool:
    return (Path(folder) / MODULES).is_file()


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
    source: str = "default (no modules.json)"


def read_layout(folder: str | Path) -> SentenceLayout:
    """The one reader of the sentence-transformers layout (serving, export, training and verify all use it).

    Modules are matched by class name: sentence-transformers 6 writes `...sentence_transformer.modules.pooling.Pooling`
    where older versions wrote `...models.Pooling`. Pooling is read from the `pooling_mode` string (>= 6) or the
    classic flags. A chain hfport does not compute (a Dense layer, weighted-mean pooling, two poolings) is an error
    naming it, never a silent default. A folder without modules.json pools by mean and does not normalize
    (sentence-transformers' own default for a bare transformers checkpoint)."""
    folder = Path(folder)
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
        extra |= {"prompts": dict(prompts), "default_prompt_name": default}
    if not has_embedding_layout(folder):
        return SentenceLayout(**extra)
    modules = _read_json(folder / MODULES)
    if not isinstance(modules, list) or not all(isinstance(m, dict) and isinstance(m.get("type"), str)
                                                for m in modules):
        raise SentenceTransformersError(f"{folder / MODULES}: expected a list of modules with a 'type' each")
    kinds = [m["type"].rsplit(".", 1)[-1] for m in modules]
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


# --- writing ----------------------------------------------------------------------------------------------------


def write_embedding_layout(folder: str | Path, *, pooling: str, normalize: bool, hidden_size: int,
                           max_seq_length: int, prompts: dict[str, str] | None = None,
                           default_prompt_name: str | None = None, include_prompt: bool = True) -> list[str]:
    """Add the sentence-transformers files to an HF folder (its config and weights already there). Returns the names
    written. Each file is written whole (write_json_atomic), and a folder from an earlier save is replaced."""
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
    hub.write_json_atomic(folder / ST_MODEL_CONFIG, {"model_type": "SentenceTransformer",
                                                     "prompts": dict(prompts or {}),
                                                     "default_prompt_name": default_prompt_name,
                                                     "similarity_fn_name": "cosine"})
    return [MODULES, ST_CONFIG, f"{POOLING_DIR}/config.json", ST_MODEL_CONFIG] + ([NORMALIZE_DIR] if normalize
                                                                                  else [])


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
    """Copy an embedding folder's sentence-transformers files to OUT (an export of its weights); [] when SOURCE has
    none. The files are re-written from what the reader understood, so OUT never carries a module hfport did not
    check (a Dense layer, say, which `read_st_pooling` refuses)."""
    if not has_embedding_layout(source):
        return []
    pooling, normalize = read_st_pooling(source)
    layout = read_layout(source)
    raw, _ = hub.read_config(Path(source))
    return write_embedding_layout(out, pooling=pooling, normalize=normalize, hidden_size=raw["hidden_size"],
                                  max_seq_length=layout.max_seq_length or raw.get("max_position_embeddings", 512),
                                  prompts=layout.prompts, default_prompt_name=layout.default_prompt_name,
                                  include_prompt=layout.include_prompt)


