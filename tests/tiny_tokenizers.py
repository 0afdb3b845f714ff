"""Tiny trained tokenizers in each family's HF layout, the tiny model folders that carry one, and the tokenizer parity
check against transformers.

`train` fits a tokenizer of one kind (WordPiece, byte-level BPE, Unigram) on CORPUS with the `tokenizers` library;
`build_tokenizer_folder` saves it through the family's transformers class, as transformers writes the folder.
`make_folder` puts a tiny random model (tests/tiny.py) beside such a tokenizer; `add_tokenizer` gives a folder
MiniLM's real WordPiece files (BERT) or a trained tokenizer (the others). `check_parity` compares hfport's
AutoTokenizer with transformers' on a folder: ids, masks, token types, offsets, overflow, decoding."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

import hfport
from tests import tiny


CORPUS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France; Berlin is in Germany.",
          "Hugging Face builds tokenizers, models and pipelines!", "Straße, café, naïve: accents and ümlauts.",
          "Numbers like 3.14 and 2026 appear in text.", "A question: who wrote the book about whales?",
          "Herman Melville wrote Moby-Dick in 1851.", "unbelievable, unthinkable, undeniable tokenization"] * 20
# Special tokens in each family's order; the trainers put them first in the vocabulary.
SPECIALS = {"wordpiece": ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"],
            "bpe": ["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
            "unigram-xlmr": ["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
            "unigram-albert": ["<pad>", "<unk>", "[CLS]", "[SEP]", "[MASK]"]}


def train(kind: str, vocab_size: int) -> Any:
    """A tiny tokenizer of one kind, trained on CORPUS with the `tokenizers` library."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    if kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=SPECIALS[kind])
    elif kind == "bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS[kind],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        tok = Tokenizer(models.Unigram())
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=SPECIALS[kind], unk_token="<unk>")
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def build_tokenizer_folder(family: str, folder: Path, model_max_length: int = 32) -> Path:
    """A trained tokenizer saved in `family`'s HF layout: the family's transformers class is built on the trained
    vocabulary and saves tokenizer.json + tokenizer_config.json; special_tokens_map.json is added as older
    transformers wrote it. Returns the folder."""
    import transformers

    folder = Path(folder)
    if family in ("bert", "distilbert"):
        tok = train("wordpiece", 200)
        cls = transformers.BertTokenizer if family == "bert" else transformers.DistilBertTokenizer
        hf = cls(vocab=tok.get_vocab(), model_max_length=model_max_length)
    elif family == "roberta":
        data = json.loads(train("bpe", 300).to_str())
        merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in data["model"]["merges"]]
        hf = transformers.RobertaTokenizer(vocab=data["model"]["vocab"], merges=merges,
                                           model_max_length=model_max_length)
    elif family in ("xlm-roberta", "albert"):
        kind = "unigram-xlmr" if family == "xlm-roberta" else "unigram-albert"
        vocab = [tuple(v) for v in json.loads(train(kind, 150).to_str())["model"]["vocab"]]
        cls = transformers.XLMRobertaTokenizer if family == "xlm-roberta" else transformers.AlbertTokenizer
        hf = cls(vocab=vocab, model_max_length=model_max_length)
    else:
        raise KeyError(family)
    hf.save_pretrained(folder)
    names = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
    special_map = {n: str(getattr(hf, n)) for n in names if getattr(hf, n, None) is not None}
    (folder / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2), encoding="utf-8")
    return folder


def build_mpnet_tokenizer(folder: Path, model_max_length: int = 64) -> Path:
    """A WordPiece vocabulary trained on CORPUS with MPNet's specials first (<s> 0, <pad> 1,
    </s> 2, [UNK] 3, <mask> 4), saved by transformers' MPNetTokenizer."""
    import transformers
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=200,
                                                               special_tokens=["<s>", "<pad>", "</s>", "[UNK]",
                                                                               "<mask>"]))
    transformers.MPNetTokenizer(vocab=tok.get_vocab(), model_max_length=model_max_length).save_pretrained(folder)
    return Path(folder)


def build_camembert_tokenizer(folder: Path, model_max_length: int = 64) -> Path:
    """A Unigram vocabulary with CamemBERT's specials, saved by transformers' CamembertTokenizer."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.train_from_iterator(CORPUS, trainers.UnigramTrainer(vocab_size=150, unk_token="<unk>", special_tokens=[
        "<s>NOTUSED", "<pad>", "</s>NOTUSED", "<unk>", "<s>", "</s>", "<mask>"]))
    vocab = [tuple(v) for v in json.loads(tok.to_str())["model"]["vocab"]]
    transformers.CamembertTokenizer(vocab=vocab, model_max_length=model_max_length).save_pretrained(folder)
    return Path(folder)


# the label maps make_folder gives classification heads (transformers' pipelines print these names)
NER_LABELS = {0: "O", 1: "B-PER", 2: "I-PER", 3: "B-LOC", 4: "I-LOC"}
CLS_LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def make_folder(root: Path, family: str, task: str, seed: int = 0, **overrides: Any) -> Path:
    """A tiny random `family` model with the `task` head and a trained tokenizer of the family's kind."""
    folder = root / f"{family}-{task}-{seed}"
    if folder.exists():
        return folder
    build_tokenizer_folder(family, folder, model_max_length=64)
    vocab = len(hfport.AutoTokenizer.from_pretrained(folder))
    tok = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    pad = hfport.AutoTokenizer.from_pretrained(folder).pad_token_id
    labels = {"sequence-classification": CLS_LABELS, "token-classification": NER_LABELS}.get(task)
    extra: dict[str, Any] = {"vocab_size": vocab, "pad_token_id": pad, **overrides}
    if labels:
        extra |= {"id2label": labels, "label2id": {v: k for k, v in labels.items()}}
    if tok.get("tokenizer_class", "").startswith("DistilBert"):
        extra["max_position_embeddings"] = 128
    tiny.save_hf(family, task, folder, seed=seed, **extra)
    return folder


VOCAB = 320  # covers the trained tokenizers (at most 300 pieces + specials)


def add_tokenizer(family: str, folder: Path, minilm: Path, tokenizers: Path) -> None:
    """BERT gets the real MiniLM WordPiece files; the other families a tokenizer trained here
    (built once into `tokenizers`, copied from there)."""
    if family == "bert":
        for name in tiny.TOKENIZER_FILES:
            shutil.copy(minilm / name, folder / name)
        return
    src = tokenizers / family
    if not src.exists():
        build_tokenizer_folder(family, src, model_max_length=64)
    for item in src.iterdir():
        shutil.copy(item, folder / item.name)


def vocab(family: str) -> int:
    return 30522 if family == "bert" else VOCAB


TEXTS = ["The quick brown fox jumps over the lazy dog near Paris.", "Straße café  naïve ümlauts 3.14!",
         "who wrote moby-dick?", "unbelievable tokenization of an unseen wordzzz", "x"]
PAIRS = ["Herman Melville wrote it in 1851, a long time ago in another century.", "Berlin.", "a b c",
         "The capital of France is Paris.", "y z"]
# (name, args, kwargs): every combination the pipelines use, and then some
CASES: list[tuple[str, tuple, dict]] = [
    ("single", (TEXTS[0],), {}),
    ("pair", (TEXTS[0], PAIRS[0]), {}),
    ("batch", (TEXTS,), {}),
    ("batch pairs", (TEXTS, PAIRS), {}),
    ("pad longest", (TEXTS, PAIRS), {"padding": True, "return_tensors": "pt"}),
    ("pad left", (TEXTS,), {"padding": True, "padding_side": "left"}),
    ("pad max_length", (TEXTS,), {"padding": "max_length", "max_length": 24, "truncation": True}),
    ("pad multiple", (TEXTS,), {"padding": True, "pad_to_multiple_of": 8}),
    ("truncate longest_first", (TEXTS, PAIRS), {"truncation": True, "max_length": 12}),
    ("truncate model_max_length", (TEXTS, PAIRS), {"truncation": True}),
    ("max_length alone truncates", (TEXTS,), {"max_length": 6}),
    ("truncate only_first", (PAIRS[:2], ["x", "who?"]), {"truncation": "only_first", "max_length": 20}),
    ("truncate only_second", (["who?", "where?"], [PAIRS[0], TEXTS[0]]),
     {"truncation": "only_second", "max_length": 16}),
    ("offsets", (TEXTS, PAIRS), {"return_offsets_mapping": True, "return_special_tokens_mask": True,
                                 "return_length": True}),
    ("stride overflow", (TEXTS,), {"truncation": True, "max_length": 8, "stride": 3,
                                   "return_overflowing_tokens": True, "return_offsets_mapping": True}),
    ("qa windows", (["who?", "where?"], [PAIRS[0], TEXTS[0]]),
     {"truncation": "only_second", "max_length": 20, "stride": 4, "return_overflowing_tokens": True,
      "return_offsets_mapping": True, "return_special_tokens_mask": True, "return_token_type_ids": True,
      "padding": True, "return_tensors": "pt"}),
    ("no specials", (TEXTS,), {"add_special_tokens": False, "return_offsets_mapping": True}),
    ("pretokenized", ([["Paris", "is", "nice"], ["who", "wrote", "it"]],), {"is_split_into_words": True,
                                                                            "return_offsets_mapping": True}),
    ("no token types", (TEXTS, PAIRS), {"return_token_type_ids": False, "return_attention_mask": False}),
]


def assert_same(ours: Any, theirs: Any, where: str) -> None:
    assert sorted(ours.keys()) == sorted(theirs.keys()), f"{where}: keys differ"
    for key in theirs:
        a, b = ours[key], theirs[key]
        if isinstance(b, torch.Tensor):
            assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"{where}: {key}"
        else:
            assert json.loads(json.dumps(a)) == json.loads(json.dumps(b)), f"{where}: {key}: {a} != {b}"


def check_parity(folder: Path) -> None:
    """hfport's AutoTokenizer against transformers' on `folder`: every CASES call, decoding, token conversions."""
    import transformers

    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours = hfport.AutoTokenizer.from_pretrained(folder)
    assert ours.model_input_names == list(theirs.model_input_names)
    assert ours.model_max_length == theirs.model_max_length
    for name in ("cls_token_id", "sep_token_id", "pad_token_id", "mask_token_id", "unk_token_id"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert len(ours) == len(theirs)
    for name, args, kwargs in CASES:
        assert_same(ours(*args, **kwargs), theirs(*args, **kwargs), f"{folder.name}: {name}")
        if kwargs.get("return_overflowing_tokens"):  # the Encodings the pipelines read word ids from
            a, b = ours(*args, **kwargs), theirs(*args, **kwargs)
            for i in range(len(b["input_ids"])):
                assert a.word_ids(i) == b.word_ids(i) and a.sequence_ids(i) == b.sequence_ids(i), name
    ids = theirs(TEXTS[1], PAIRS[0])["input_ids"]
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
    tokens = theirs.convert_ids_to_tokens(ids[1:5])
    assert ours.convert_tokens_to_string(tokens) == theirs.convert_tokens_to_string(tokens)
