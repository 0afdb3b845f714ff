"""AutoTokenizer: the `tokenizers` library behind the call signature of transformers' fast tokenizers.

A folder's tokenizer.json is loaded as is with `tokenizers.Tokenizer.from_file`; tokenizer_config.json and
special_tokens_map.json give the special tokens, model_max_length, padding/truncation sides and the model input
names. Calling the tokenizer sets the backend's truncation and padding from the call's arguments (and clears them
when not asked for: a tokenizer.json may have some baked in), encodes the batch, and flattens overflowing windows
into extra rows with `overflow_to_sample_mapping`, exactly as transformers' fast tokenizers do.

Fallback (documented): a folder with only the slow files (vocab.txt; vocab.json + merges.txt; spiece.model,
sentencepiece.bpe.model, spm.model) has no tokenizer.json to load. Then transformers' AutoTokenizer, which converts
those files into a `tokenizers` pipeline, is asked once for its backend; everything after that runs through hfport.
transformers is only imported on that path.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Encoding, Tokenizer

from . import hub
from .errors import HfportError

log = logging.getLogger("hfport")

TOKENIZER_FILE = "tokenizer.json"
SLOW_FILES = ("vocab.txt", "vocab.json", "merges.txt", "spiece.model", "sentencepiece.bpe.model", "spm.model")
# every file of a tokenizer folder as transformers writes it: what model folders, run outputs and exports carry
TOKENIZER_FILES = (TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   *SLOW_FILES)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
VERY_LARGE_INTEGER = int(1e30)  # transformers' "no limit" model_max_length
LARGE_INTEGER = int(1e20)
PADDING = ("longest", "max_length", "do_not_pad")
TRUNCATION = ("longest_first", "only_first", "only_second", "do_not_truncate")
# model_input_names of transformers' (5.x) tokenizer classes, keyed by tokenizer_config.json's tokenizer_class
# ("...Fast" names map to the same entry); a "model_input_names" entry in that file overrides this table. Note that
# transformers 5 drops token_type_ids for ALBERT, which 4.x returned.
_IDS_MASK = ["input_ids", "attention_mask"]
MODEL_INPUT_NAMES = {
    "BertTokenizer": ["input_ids", "token_type_ids", "attention_mask"],
    "DebertaV2Tokenizer": ["input_ids", "attention_mask", "token_type_ids"],
    "DebertaTokenizer": ["input_ids", "attention_mask", "token_type_ids"],
    **{name: _IDS_MASK for name in ("RobertaTokenizer", "XLMRobertaTokenizer", "DistilBertTokenizer",
                                    "AlbertTokenizer", "CamembertTokenizer", "MPNetTokenizer")},
}
DEFAULT_INPUT_NAMES = ["input_ids", "token_type_ids", "attention_mask"]


class TokenizerError(HfportError, ValueError):
    """A tokenizer folder that cannot be read, or a call with arguments that do not fit together."""


def has_tokenizer_files(folder: str | os.PathLike[str]) -> bool:
    """Whether `folder` holds a tokenizer AutoTokenizer can load (tokenizer.json or slow vocab files)."""
    return any((Path(folder) / name).is_file() for name in (TOKENIZER_FILE, *SLOW_FILES))


def copy_tokenizer_files(source: str | os.PathLike[str], target: str | os.PathLike[str]) -> list[str]:
    """Copy the tokenizer files `source` has (of TOKENIZER_FILES) into `target`; returns the names copied."""
    source, target = Path(source), Path(target)
    copied = [name for name in TOKENIZER_FILES if (source / name).is_file()]
    for name in copied:
        shutil.copyfile(source / name, target / name)
    return copied


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json stores a special token as a string or as an AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: the top level must be a JSON object")
    return data


class BatchEncoding(dict):
    """transformers' BatchEncoding: a dict of lists (or tensors) plus the `tokenizers` Encoding of each row."""

    def __init__(self, data: dict[str, Any], encodings: list[Encoding] | None = None):
        super().__init__(data)
        self.encodings = encodings

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __getitem__(self, key: str | int) -> Any:
        if isinstance(key, int):  # row i's Encoding, as transformers does
            if self.encodings is None:
                raise KeyError("integer indexing needs the encodings of a fast tokenizer")
            return self.encodings[key]
        return super().__getitem__(key)

    def tokens(self, batch_index: int = 0) -> list[str]:
        return self.encodings[batch_index].tokens

    def word_ids(self, batch_index: int = 0) -> list[int | None]:
        return self.encodings[batch_index].word_ids

    def sequence_ids(self, batch_index: int = 0) -> list[int | None]:
        return self.encodings[batch_index].sequence_ids

    def to(self, device: str | torch.device) -> BatchEncoding:
        for k, v in self.items():
            if isinstance(v, torch.Tensor):
                self[k] = v.to(device)
        return self


class PreTrainedTokenizer:
    """A `tokenizers.Tokenizer` plus the settings transformers keeps beside it."""

    def __init__(self, backend: Tokenizer, *, special_tokens: dict[str, str | None], model_max_length: int,
                 model_input_names: list[str], padding_side: str = "right", truncation_side: str = "right",
                 clean_up_tokenization_spaces: bool = False, pad_token_type_id: int = 0,
                 name_or_path: str = "", tokenizer_class: str | None = None):
        self._tokenizer = backend
        self.special_tokens = dict(special_tokens)
        self.model_max_length = model_max_length
        self.model_input_names = list(model_input_names)
        if padding_side not in ("right", "left") or truncation_side not in ("right", "left"):
            raise TokenizerError(f"{name_or_path}: padding_side/truncation_side must be 'right' or 'left', got "
                                 f"{padding_side!r}/{truncation_side!r}")
        self.padding_side = padding_side
        self.truncation_side = truncation_side
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        self.pad_token_type_id = pad_token_type_id
        self.name_or_path = name_or_path
        self.tokenizer_class = tokenizer_class
        # Named special tokens the backend does not know yet become special added tokens, as transformers adds them
        known = {t.content for t in backend.get_added_tokens_decoder().values()}
        missing = [t for t in self.special_tokens.values() if t is not None and t not in known]
        if missing:
            backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(missing)])

    # --- facts --------------------------------------------------------------------------------------------

    @property
    def backend_tokenizer(self) -> Tokenizer:
        return self._tokenizer

    is_fast = True

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    def _special(self, name: str) -> str | None:
        return self.special_tokens.get(name)

    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self._tokenizer.token_to_id(token)

    bos_token = property(lambda self: self._special("bos_token"))
    eos_token = property(lambda self: self._special("eos_token"))
    unk_token = property(lambda self: self._special("unk_token"))
    sep_token = property(lambda self: self._special("sep_token"))
    pad_token = property(lambda self: self._special("pad_token"))
    cls_token = property(lambda self: self._special("cls_token"))
    mask_token = property(lambda self: self._special("mask_token"))
    bos_token_id = property(lambda self: self._special_id("bos_token"))
    eos_token_id = property(lambda self: self._special_id("eos_token"))
    unk_token_id = property(lambda self: self._special_id("unk_token"))
    sep_token_id = property(lambda self: self._special_id("sep_token"))
    pad_token_id = property(lambda self: self._special_id("pad_token"))
    cls_token_id = property(lambda self: self._special_id("cls_token"))
    mask_token_id = property(lambda self: self._special_id("mask_token"))

    @property
    def all_special_ids(self) -> list[int]:
        ids = [self._tokenizer.token_to_id(t) for t in self.special_tokens.values() if t is not None]
        return list(dict.fromkeys(i for i in ids if i is not None))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name_or_path={self.name_or_path!r}, vocab_size={len(self)}, "
                f"model_max_length={self.model_max_length}, special_tokens={self.special_tokens})")

    # --- loading ------------------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path_or_repo_id: str | os.PathLike[str], *, revision: str | None = None,
                        cache_dir: str | os.PathLike[str] | None = None) -> PreTrainedTokenizer:
        folder = hub.resolve(path_or_repo_id, revision=revision, cache_dir=cache_dir)
        config = _read_json(folder / "tokenizer_config.json")
        special_map = _read_json(folder / "special_tokens_map.json")
        tokenizer_file = folder / TOKENIZER_FILE
        fallback = None
        if tokenizer_file.is_file():
            try:
                backend = Tokenizer.from_file(str(tokenizer_file))
            except Exception as e:  # the tokenizers library raises a bare Exception on a bad file
                raise TokenizerError(f"{tokenizer_file}: the tokenizers library cannot read it: {e}") from e
        elif any((folder / name).is_file() for name in SLOW_FILES):
            fallback = _convert_slow(folder)
            backend = fallback.backend_tokenizer
        else:
            raise TokenizerError(f"{folder}: no {TOKENIZER_FILE} and none of the slow tokenizer files "
                                 f"({', '.join(SLOW_FILES)})")

        special: dict[str, str | None] = {}
        for name in SPECIAL_TOKEN_NAMES:
            value = _token_content(config.get(name))
            if value is None:
                value = _token_content(special_map.get(name))
            if value is None and fallback is not None:  # the transformers class' own defaults
                value = getattr(fallback, name, None)
            special[name] = value
        max_len = config.get("model_max_length")
        if fallback is not None and max_len is None:
            max_len = fallback.model_max_length
        if not isinstance(max_len, (int, float)) or isinstance(max_len, bool) or max_len <= 0:
            max_len = VERY_LARGE_INTEGER
        tokenizer_class = config.get("tokenizer_class")
        input_names = config.get("model_input_names")
        if input_names is None and fallback is not None:
            input_names = list(fallback.model_input_names)
        if input_names is None:
            input_names = MODEL_INPUT_NAMES.get(str(tokenizer_class or "").removesuffix("Fast"), DEFAULT_INPUT_NAMES)
        return cls(backend, special_tokens=special, model_max_length=int(max_len), model_input_names=input_names,
                   padding_side=config.get("padding_side", "right"),
                   truncation_side=config.get("truncation_side", "right"),
                   clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
                   name_or_path=str(path_or_repo_id), tokenizer_class=tokenizer_class)

    # --- encoding -----------------------------------------------------------------------------------------

    def _strategies(self, padding: Any, truncation: Any, max_length: int | None,
                    pad_to_multiple_of: int | None) -> tuple[str, str, int | None]:
        """transformers' _get_padding_truncation_strategies, on strings."""
        if max_length is not None and padding is False and truncation is None:
            truncation = "longest_first"  # max_length alone turns truncation on
        if padding is True:
            pad = "longest"
        elif padding is False or padding is None:
            pad = "do_not_pad"
        elif padding in PADDING:
            pad = padding
        else:
            raise TokenizerError(f"padding={padding!r}: use True, False or one of {list(PADDING)}")
        if truncation is True:
            trunc = "longest_first"
        elif truncation is False or truncation is None:
            trunc = "do_not_truncate"
        elif truncation in TRUNCATION:
            trunc = truncation
        else:
            raise TokenizerError(f"truncation={truncation!r}: use True, False or one of {list(TRUNCATION)}")
        if max_length is None:
            if pad == "max_length":
                if self.model_max_length > LARGE_INTEGER:
                    pad = "do_not_pad"
                else:
                    max_length = self.model_max_length
            if trunc != "do_not_truncate":
                if self.model_max_length > LARGE_INTEGER:
                    trunc = "do_not_truncate"
                else:
                    max_length = self.model_max_length
        if pad != "do_not_pad" and (self.pad_token is None or self.pad_token_id is None):
            raise TokenizerError(f"{self.name_or_path}: asked to pad but the tokenizer has no pad_token")
        if (trunc != "do_not_truncate" and pad != "do_not_pad" and pad_to_multiple_of is not None
                and max_length is not None and max_length % pad_to_multiple_of):
            raise TokenizerError(f"truncation length {max_length} is not a multiple of pad_to_multiple_of "
                                 f"{pad_to_multiple_of}")
        return pad, trunc, max_length

    def _configure(self, pad: str, trunc: str, max_length: int | None, stride: int,
                   pad_to_multiple_of: int | None, padding_side: str | None) -> None:
        """Set the backend's truncation and padding for this call; clear what the call does not ask for."""
        backend = self._tokenizer
        if trunc == "do_not_truncate":
            if backend.truncation is not None:
                backend.no_truncation()
        else:
            backend.enable_truncation(max_length, stride=stride, strategy=trunc, direction=self.truncation_side)
        if pad == "do_not_pad":
            if backend.padding is not None:
                backend.no_padding()
        else:
            backend.enable_padding(length=max_length if pad == "max_length" else None,
                                   direction=padding_side or self.padding_side, pad_id=self.pad_token_id,
                                   pad_type_id=self.pad_token_type_id, pad_token=self.pad_token,
                                   pad_to_multiple_of=pad_to_multiple_of)

    def __call__(self, text: str | Sequence[str] | Sequence[Sequence[str]],
                 text_pair: str | Sequence[str] | Sequence[Sequence[str]] | None = None, *,
                 add_special_tokens: bool = True, padding: bool | str = False, truncation: bool | str | None = None,
                 max_length: int | None = None, stride: int = 0, is_split_into_words: bool = False,
                 pad_to_multiple_of: int | None = None, padding_side: str | None = None,
                 return_tensors: str | None = None, return_token_type_ids: bool | None = None,
                 return_attention_mask: bool | None = None, return_overflowing_tokens: bool = False,
                 return_special_tokens_mask: bool = False, return_offsets_mapping: bool = False,
                 return_length: bool = False) -> BatchEncoding:
        """Encode one text, one pair, or a batch of them, as transformers' fast tokenizers do."""
        if return_tensors not in (None, "pt"):
            raise TokenizerError(f"return_tensors={return_tensors!r}: hfport returns lists (None) or 'pt' tensors")
        _check_text(text, "text", is_split_into_words)
        if text_pair is not None:
            _check_text(text_pair, "text_pair", is_split_into_words)
        if is_split_into_words:
            batched = isinstance(text, (list, tuple)) and bool(text) and isinstance(text[0], (list, tuple))
        else:
            batched = isinstance(text, (list, tuple))
        if batched:
            if isinstance(text_pair, str):
                raise TokenizerError("a batch of texts needs text_pair as a list of the same length, not a string")
            if text_pair is not None and len(text) != len(text_pair):
                raise TokenizerError(f"batch length of text ({len(text)}) does not match text_pair ({len(text_pair)})")
            inputs = list(zip(text, text_pair)) if text_pair is not None else list(text)
        else:
            inputs = [(text, text_pair)] if text_pair else [text]
        pad, trunc, max_length = self._strategies(padding, truncation, max_length, pad_to_multiple_of)
        self._configure(pad, trunc, max_length, stride, pad_to_multiple_of, padding_side)
        try:
            encodings = self._tokenizer.encode_batch(inputs, add_special_tokens=add_special_tokens,
                                                     is_pretokenized=is_split_into_words)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # Rust errors, and Rust panics (pyo3's PanicException is a BaseException)
            raise TokenizerError(f"{self.name_or_path}: cannot encode with truncation={trunc!r}, "
                                 f"max_length={max_length}, stride={stride}: {e}") from e

        with_types = "token_type_ids" in self.model_input_names if return_token_type_ids is None \
            else return_token_type_ids
        with_mask = "attention_mask" in self.model_input_names if return_attention_mask is None \
            else return_attention_mask
        data: dict[str, list[Any]] = {"input_ids": []}
        if with_types:
            data["token_type_ids"] = []
        if with_mask:
            data["attention_mask"] = []
        if return_special_tokens_mask:
            data["special_tokens_mask"] = []
        if return_offsets_mapping:
            data["offset_mapping"] = []
        if return_length:
            data["length"] = []
        rows: list[Encoding] = []
        sample_of_row: list[int] = []
        for i, encoding in enumerate(encodings):
            windows = [encoding] + list(encoding.overflowing) if return_overflowing_tokens else [encoding]
            for e in windows:  # each overflowing window becomes a row of its own
                rows.append(e)
                sample_of_row.append(i)
                data["input_ids"].append(e.ids)
                if with_types:
                    data["token_type_ids"].append(e.type_ids)
                if with_mask:
                    data["attention_mask"].append(e.attention_mask)
                if return_special_tokens_mask:
                    data["special_tokens_mask"].append(e.special_tokens_mask)
                if return_offsets_mapping:
                    data["offset_mapping"].append(e.offsets)
                if return_length:
                    data["length"].append(len(e.ids))
        if return_overflowing_tokens:
            data["overflow_to_sample_mapping"] = sample_of_row
        if return_tensors == "pt":
            data = {k: _to_tensor(k, v) for k, v in data.items()}
        elif not batched and not return_overflowing_tokens:  # one input: no batch dimension
            data = {k: v[0] for k, v in data.items()}
        return BatchEncoding(data, rows)

    def encode(self, text: str, text_pair: str | None = None, **kwargs: Any) -> list[int]:
        return self(text, text_pair, **kwargs)["input_ids"]

    def tokenize(self, text: str, pair: str | None = None, add_special_tokens: bool = False) -> list[str]:
        return self(text, pair, add_special_tokens=add_special_tokens).encodings[0].tokens

    # --- decoding -----------------------------------------------------------------------------------------

    def convert_ids_to_tokens(self, ids: int | Iterable[int], skip_special_tokens: bool = False) -> str | list[str]:
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._tokenizer.id_to_token(int(i)) for i in ids if int(i) not in skip]

    def convert_tokens_to_ids(self, tokens: str | Iterable[str]) -> int | list[int]:
        if isinstance(tokens, str):
            found = self._tokenizer.token_to_id(tokens)
            return self.unk_token_id if found is None else found
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        decoder = self._tokenizer.decoder
        return decoder.decode(tokens) if decoder is not None else " ".join(tokens)

    def decode(self, token_ids: int | Iterable[int] | torch.Tensor, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.tolist()
        ids = [int(token_ids)] if isinstance(token_ids, int) else [int(i) for i in token_ids]
        text = self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        clean = self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None \
            else clean_up_tokenization_spaces
        # transformers skips the clean-up for BPE models: it was written for WordPiece and corrupts BPE output
        if clean and type(self._tokenizer.model).__name__ != "BPE":
            text = clean_up_tokenization(text)
        return text

    def batch_decode(self, sequences: Iterable[Iterable[int]], **kwargs: Any) -> list[str]:
        return [self.decode(s, **kwargs) for s in sequences]


def clean_up_tokenization(text: str) -> str:
    """transformers' clean-up of spaces before punctuation and in English contractions."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
                 (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


def _check_text(value: Any, name: str, split_into_words: bool) -> None:
    ok = isinstance(value, str) or (isinstance(value, (list, tuple)) and (
        not value or isinstance(value[0], str) or (isinstance(value[0], (list, tuple)) and (
            not value[0] or isinstance(value[0][0], str)))))
    if not ok:
        raise TokenizerError(f"{name} must be a str, a list of str, or (is_split_into_words=True) a list of lists "
                             f"of str; got {type(value).__name__}")


def _to_tensor(key: str, rows: list[Any]) -> torch.Tensor:
    if key == "overflow_to_sample_mapping" or key == "length":
        return torch.tensor(rows, dtype=torch.long)
    lengths = {len(r) for r in rows}
    if len(lengths) > 1:
        raise TokenizerError(f"cannot make one tensor of {key}: the rows have lengths {sorted(lengths)}; pass "
                             "padding=True (and truncation=True for over-long inputs)")
    return torch.tensor(rows, dtype=torch.long)


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a missing parent package ("google")
        return False


def _convert_slow(folder: Path) -> Any:
    """The documented fallback: transformers converts the slow vocabulary files into a `tokenizers` pipeline."""
    try:
        import transformers
    except ImportError as e:
        raise TokenizerError(f"{folder}: has no {TOKENIZER_FILE}; converting its slow tokenizer files needs "
                             "transformers (pip install transformers), or save a tokenizer.json once") from e
    spm_files = [name for name in SLOW_FILES if name.endswith(".model") and (folder / name).is_file()]
    if spm_files:
        lacking = [pkg for pkg, mod in (("sentencepiece", "sentencepiece"), ("protobuf", "google.protobuf"))
                   if not _importable(mod)]
        if lacking:
            raise TokenizerError(f"{folder}: has no {TOKENIZER_FILE}; converting {spm_files[0]} needs "
                                 f"{' and '.join(lacking)} (pip install {' '.join(lacking)})")
    log.info("%s: no %s; converting the slow tokenizer files with transformers", folder, TOKENIZER_FILE)
    try:
        return transformers.AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:
        raise TokenizerError(f"{folder}: transformers could not convert the slow tokenizer files: {e}") from e


class AutoTokenizer:
    """`AutoTokenizer.from_pretrained(folder_or_repo_id)`: the one tokenizer class, for every family."""

    @staticmethod
    def from_pretrained(path_or_repo_id: str | os.PathLike[str], **kwargs: Any) -> PreTrainedTokenizer:
        return PreTrainedTokenizer.from_pretrained(path_or_repo_id, **kwargs)
