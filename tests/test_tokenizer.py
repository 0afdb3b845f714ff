"""hfport.AutoTokenizer against transformers' AutoTokenizer on the same folders: ids, masks, token types, offsets,
special-token masks and overflow mappings must be equal, for the real MiniLM tokenizer and for one tokenizer per
family kind trained here with the `tokenizers` library (WordPiece, byte-level BPE, Unigram)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hfport import AutoTokenizer
from hfport.tokenizer import TokenizerError
from tests.tiny_tokenizers import CORPUS, build_tokenizer_folder, check_parity

FAMILIES = ("bert", "distilbert", "roberta", "xlm-roberta", "albert")


@pytest.fixture(scope="module")
def family_folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {family: build_tokenizer_folder(family, root / family) for family in FAMILIES}


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
