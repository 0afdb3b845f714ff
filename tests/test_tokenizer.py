"""hfport.AutoTokenizer against transformers' AutoTokenizer on the same folders: ids, masks, token types, offsets,
special-token masks and overflow mappings must be equal, for the real MiniLM tokenizer and for one tokenizer per
family kind trained here with the `tokenizers` library (WordPiece, byte-level BPE, Unigram)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from hfport import AutoTokenizer
from hfport.tokenizer import TokenizerError

CORPUS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France; Berlin is in Germany.",
          "Hugging Face builds tokenizers, models and pipelines!", "Straße, café, naïve: accents and ümlauts.",
          "Numbers like 3.14 and 2026 appear in text.", "A question: who wrote the book about whales?",
          "Herman Melville wrote Moby-Dick in 1851.", "unbelievable, unthinkable, undeniable tokenization"] * 20
FAMILIES = ("bert", "distilbert", "roberta", "xlm-roberta", "albert")
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


@pytest.fixture(scope="module")
def family_folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {family: build_tokenizer_folder(family, root / family) for family in FAMILIES}


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
    import transformers

    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours = AutoTokenizer.from_pretrained(folder)
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


def test_minilm_tokenizer_matches_transformers(minilm_path):
    # its tokenizer.json bakes in truncation and padding to 128: a call that asks for neither must get neither
    check_parity(minilm_path)
    ours = AutoTokenizer.from_pretrained(minilm_path)
    assert len(ours(" ".join(["word"] * 300))["input_ids"]) == 302


@pytest.mark.parametrize("family", FAMILIES)
def test_family_tokenizer_matches_transformers(family_folders, family):
    check_parity(family_folders[family])


def test_token_types_follow_the_family(family_folders):
    with_types = {f: "token_type_ids" in AutoTokenizer.from_pretrained(family_folders[f])("a", "b") for f in FAMILIES}
    assert with_types == {"bert": True, "distilbert": False, "roberta": False, "xlm-roberta": False, "albert": False}


def _slow_folder(family: str, src: Path, dst: Path) -> Path:
    """The family's slow vocabulary files only (no tokenizer.json), written from the fast folder's vocabulary."""
    import sentencepiece as spm

    dst.mkdir()
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        (dst / name).write_bytes((src / name).read_bytes())
    model = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))["model"]
    if family == "bert":
        vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
        (dst / "vocab.txt").write_text("".join(t + "\n" for t, _ in vocab), encoding="utf-8")
    elif family == "roberta":
        (dst / "vocab.json").write_text(json.dumps(model["vocab"]), encoding="utf-8")
        merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
        (dst / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    else:  # albert: a real sentencepiece model, trained here
        corpus = dst / "corpus.txt"
        corpus.write_text("\n".join(CORPUS), encoding="utf-8")
        spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(dst / "spiece"), vocab_size=100,
                                       model_type="unigram", pad_id=0, unk_id=1, bos_id=2, eos_id=3,
                                       pad_piece="<pad>", unk_piece="<unk>", bos_piece="[CLS]", eos_piece="[SEP]",
                                       user_defined_symbols=["[MASK]"], minloglevel=2)
        corpus.unlink()
        (dst / "spiece.vocab").unlink()
    return dst


@pytest.mark.parametrize("family", ["bert", "roberta", "albert"])
def test_slow_files_fallback_matches_transformers(family_folders, tmp_path, family):
    if family == "albert":  # transformers reads spiece.model through protobuf; hfport says so when it is missing
        pytest.importorskip("google.protobuf", reason="converting spiece.model needs protobuf (not installed)")
    folder = _slow_folder(family, family_folders[family], tmp_path / f"{family}-slow")
    assert not (folder / "tokenizer.json").exists()
    check_parity(folder)


def test_errors_name_the_problem(family_folders, tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer.json and none of the slow"):
        AutoTokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(TokenizerError, match="tokenizer.json: the tokenizers library cannot read it"):
        AutoTokenizer.from_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(family_folders["bert"])
    with pytest.raises(TokenizerError, match="padding='sideways'"):
        tok("a", padding="sideways")
    with pytest.raises(TokenizerError, match="rows have lengths"):
        tok(["a", "a b c"], return_tensors="pt")
    # a question that leaves the context no room: transformers panics in Rust, hfport raises a clear error
    with pytest.raises(TokenizerError, match="cannot encode with truncation='only_second', max_length=8"):
        tok(" ".join(["fox"] * 20), "paris", truncation="only_second", max_length=8, stride=2,
            return_overflowing_tokens=True)
    from hfport.tokenizer import _importable

    if not _importable("google.protobuf"):
        slow = _slow_folder("albert", family_folders["albert"], tmp_path / "albert-slow")
        with pytest.raises(TokenizerError, match="converting spiece.model needs protobuf"):
            AutoTokenizer.from_pretrained(slow)
    with pytest.raises(TokenizerError, match="text must be a str"):
        tok(123)


@pytest.mark.parametrize("name", ["qa_tiny_bert", "qa_tiny_roberta"])
def test_hand_written_tokenizer_json_matches_transformers(name):
    # the QA fixtures' tokenizer.json files are assembled with `tokenizers` directly, not saved by transformers
    check_parity(Path(__file__).parent / "fixtures" / name)
