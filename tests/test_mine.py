"""Hard-negative mining (`hfport mine`, hfport.retrieval) against sentence-transformers' mine_hard_negatives on the same
model, data and options: the same rows for every query (exact score ties aside), the random draw included; the
blocked and faiss searches against a full top-k; the embedding cache; the rows `hfport finetune` reads back."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import hfport
from hfport.errors import HfportError
from hfport.formats.tables import DataError
from hfport.retrieval import Encoder, mine_hard_negatives, top_k
from hfport.retrieval.encode import ROLE_PROMPTS
from hfport.retrieval.mine import read_corpus, read_pairs

REPO = Path(__file__).resolve().parents[1]
ROWS = [json.loads(line) for line in (REPO / "examples" / "data" / "embed_train.jsonl").read_text().splitlines()]
ANCHORS = [r["anchor"] for r in ROWS[:40]]
POSITIVES = [r["positive"] for r in ROWS[:40]]
CORPUS = [r["negative"] for r in ROWS] + [r["positive"] for r in ROWS[40:]]  # distractors: ~200 texts in all
TIE = 1e-5  # hfport's and sentence-transformers' embeddings differ by ~1e-7 (other kernels): nearer scores are ties


@pytest.fixture(scope="module")
def st_model(minilm_path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_path), device="cpu")


@pytest.fixture(scope="module")
def encoder(minilm_path, tmp_path_factory):
    """hfport's MiniLM encoder with a cache of its own: each text is embedded once for the module."""
    return Encoder(minilm_path, cache=tmp_path_factory.mktemp("embeddings"), progress=False)


@pytest.fixture(scope="module")
def st_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("st-cache"))


def theirs(st_model, st_cache, seed=None, cross_encoder=None, **options):
    from datasets import Dataset
    from sentence_transformers.util import mine_hard_negatives as st_mine

    if seed is not None:
        random.seed(seed)  # sentence-transformers draws from the global random module
    dataset = Dataset.from_dict({"anchor": ANCHORS, "positive": POSITIVES})
    return st_mine(dataset, st_model, corpus=CORPUS, cross_encoder=cross_encoder, verbose=False, output_scores=True,
                   cache_folder=st_cache, batch_size=64, **options).to_list()


def score_list(row: dict) -> list[float]:
    return row.get("scores") or [row["score"]]


def assert_same_rows(mine: list[dict], ref: list[dict]) -> None:
    """Row for row: the anchors and positives equal, every score within TIE. A negative may differ only where the two
    candidates score the same (an exact tie: either may come first), which the equal scores at its place show."""
    assert len(mine) == len(ref), (len(mine), len(ref))
    ties = 0
    for i, (a, b) in enumerate(zip(mine, ref)):
        assert list(a) == list(b), f"row {i}: columns {list(a)} != {list(b)}"
        assert a["anchor"] == b["anchor"], f"row {i}"
        np.testing.assert_allclose(score_list(a), score_list(b), atol=TIE, err_msg=f"row {i}")
        ties += any(a[k] != b[k] for k in a if k not in ("anchor", "scores", "score", "label", "labels"))
    assert ties <= len(ref) // 20, f"{ties} rows differ: more than ties explain"


CASES = {
    "triplet (default)": {},
    "n-tuple": {"output_format": "n-tuple"},
    "range": {"output_format": "n-tuple", "range_min": 2, "range_max": 20, "num_negatives": 5},
    "absolute margin": {"absolute_margin": 0.05},
    "relative margin, labeled pairs": {"relative_margin": 0.1, "output_format": "labeled-pair"},
    "max and min score, labeled lists": {"max_score": 0.6, "min_score": 0.45, "output_format": "labeled-list"},
    "include positives": {"include_positives": True},
    "random draw": {"sampling_strategy": "random", "range_max": 30, "num_negatives": 4, "output_format": "n-tuple",
                    "seed": 7},
    "random draw past the filters": {"sampling_strategy": "random", "max_score": 0.5, "num_negatives": 3,
                                     "seed": 3},
    "prompts": {"query_prompt": "query: ", "corpus_prompt": "passage: ", "output_format": "n-tuple"},
}


@pytest.mark.parametrize("options", CASES.values(), ids=CASES.keys())
def test_mining_equals_sentence_transformers(options, encoder, st_model, st_cache):
    """Every option with sentence-transformers' meaning; the random draw too: seed=s draws what sentence-transformers
    draws after random.seed(s) (the same random.sample calls, in the same order)."""
    ours = mine_hard_negatives(ANCHORS, POSITIVES, encoder, corpus=CORPUS, output_scores=True, progress=False,
                               **options)
    assert_same_rows(ours.rows, theirs(st_model, st_cache, **options))
    assert ours.rows, "the case mines something"


def test_faiss_search_mines_what_sentence_transformers_faiss_mines(encoder, st_model, st_cache):
    pytest.importorskip("faiss")  # the `faiss` extra (in dev)
    options = {"output_format": "n-tuple", "num_negatives": 4, "relative_margin": 0.05}
    ours = mine_hard_negatives(ANCHORS, POSITIVES, encoder, corpus=CORPUS, output_scores=True, use_faiss=True,
                               progress=False, **options)
    assert_same_rows(ours.rows, theirs(st_model, st_cache, use_faiss=True, **options))


def test_random_draws_differ_by_seed_and_keep_score_order(encoder):
    """The draw is the seed's: another seed picks other negatives, from the same candidates, still best first."""
    options = {"sampling_strategy": "random", "range_max": 30, "num_negatives": 4, "output_format": "n-tuple",
               "output_scores": True, "progress": False}
    a = mine_hard_negatives(ANCHORS, POSITIVES, encoder, corpus=CORPUS, seed=1, **options).rows
    b = mine_hard_negatives(ANCHORS, POSITIVES, encoder, corpus=CORPUS, seed=2, **options).rows
    assert a == mine_hard_negatives(ANCHORS, POSITIVES, encoder, corpus=CORPUS, seed=1, **options).rows
    assert a != b
    for row in a + b:
        assert row["scores"][1:] == sorted(row["scores"][1:], reverse=True)


def test_reranker_rescores_as_sentence_transformers_cross_encoder(encoder, st_model, st_cache, minilm_path,
                                                                  tmp_path):
    import shutil

    from sentence_transformers import CrossEncoder

    from tests.tiny import save_with_tokenizer

    folder = tmp_path / "reranker"
    save_with_tokenizer("bert", "sequence-classification", folder, minilm_path, vocab_size=30522, num_labels=1,
                        max_position_embeddings=512)
    options = {"min_score": 0.3, "num_negatives": 2, "output_format": "n-tuple"}
    ours = mine_hard_negatives(ANCHORS, POSITIVES, encoder, corpus=CORPUS, reranker=folder, output_scores=True,
                               progress=False, **options)
    ref = theirs(st_model, st_cache, cross_encoder=CrossEncoder(str(folder), device="cpu"), **options)
    assert_same_rows(ours.rows, ref)
    run = tmp_path / "rerank-run"  # a fine-tune's run folder stands for its best/, as the embedding model's does
    shutil.copytree(folder, run / "best")
    (run / "summary.json").write_text("{}")
    assert mine_hard_negatives(ANCHORS, POSITIVES, encoder, corpus=CORPUS, reranker=run, output_scores=True,
                               progress=False, **options).rows == ours.rows
    with pytest.raises(ValueError, match="a reranker rescores the candidates for the score filters"):
        mine_hard_negatives(ANCHORS, POSITIVES, encoder, corpus=CORPUS, reranker=folder, progress=False)


def test_blocked_search_equals_a_full_top_k():
    g = torch.Generator().manual_seed(0)
    queries, corpus = torch.randn(37, 8, generator=g), torch.randn(301, 8, generator=g)
    full_scores, full_idx = torch.topk(queries @ corpus.T, k=12, dim=1)
    # blocks of 5 queries x 16 corpus rows: 8 query blocks, 19 corpus blocks merged into the running top 12
    scores, idx = top_k(queries, corpus, 12, query_block=5, block_bytes=5 * 16 * 4, use_faiss=False)
    torch.testing.assert_close(scores, full_scores)
    assert torch.equal(idx, full_idx)
    # a corpus smaller than k: padded with -inf and -1, as sentence-transformers pads
    scores, idx = top_k(queries, corpus[:4], 6, use_faiss=False)
    assert torch.isinf(scores[:, 4:]).all() and (idx[:, 4:] == -1).all()
    assert set(idx[0, :4].tolist()) == {0, 1, 2, 3}


def test_faiss_search_equals_the_exact_one():
    pytest.importorskip("faiss")
    g = torch.Generator().manual_seed(1)
    queries, corpus = torch.randn(20, 16, generator=g), torch.randn(100, 16, generator=g)
    exact = top_k(queries, corpus, 10, use_faiss=False)
    approx = top_k(queries, corpus, 10, use_faiss=True)
    torch.testing.assert_close(approx[0], exact[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(approx[1], exact[1])
    padded = top_k(queries, corpus[:3], 5, use_faiss=True)
    assert (padded[1][:, 3:] == -1).all() and torch.isinf(padded[0][:, 3:]).all()


def test_a_second_run_with_other_options_reads_the_cache(tiny_bert, tmp_path, monkeypatch):
    """The corpus and queries are embedded once per model, dtype and prompt; other mining options reuse them, a
    changed text or prompt embeds only what is new; the files are numpy arrays, never pickles."""
    calls: list[int] = []
    real = Encoder._embed

    def counting(self, texts, prompt):
        calls.append(len(texts))
        return real(self, texts, prompt)

    monkeypatch.setattr(Encoder, "_embed", counting)
    cache = tmp_path / "cache"
    kw = {"corpus": CORPUS[:60], "cache": cache, "progress": False}
    first = mine_hard_negatives(ANCHORS[:10], POSITIVES[:10], tiny_bert, num_negatives=2, **kw)
    embedded = sum(calls)
    assert embedded == len(set(CORPUS[:60] + POSITIVES[:10])) + 10
    calls.clear()
    again = mine_hard_negatives(ANCHORS[:10], POSITIVES[:10], tiny_bert, num_negatives=3, range_min=1,
                                output_format="n-tuple", **kw)
    assert calls == [] and again.rows and first.rows
    mine_hard_negatives(ANCHORS[:11], POSITIVES[:11], tiny_bert, **kw)  # one more pair: only its new texts
    seen = set(CORPUS[:60]) | set(POSITIVES[:10]) | set(ANCHORS[:10])  # one prompt (none): one cache for both
    assert sum(calls) == len({ANCHORS[10], POSITIVES[10]} - seen) >= 1
    calls.clear()
    mine_hard_negatives(ANCHORS[:10], POSITIVES[:10], tiny_bert, query_prompt="query: ", **kw)
    assert calls == [10]  # another prompt is another key: the queries again, the corpus from the cache
    folders = list((cache).iterdir())
    assert len(folders) == 2 and all((f / "model.json").is_file() for f in folders)
    for f in folders:
        for array in f.glob("*.npy"):
            np.load(array, allow_pickle=False)  # would raise on a pickled object array
    # the key follows the weights: a changed weights file is another model
    copy = tmp_path / "copy"
    copy.mkdir()
    for p in Path(tiny_bert).rglob("*"):
        if p.is_file():
            target = copy / p.relative_to(tiny_bert)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(p.read_bytes())
    assert Encoder(copy, cache=cache, progress=False).cache_for("").folder == \
        Encoder(tiny_bert, cache=cache, progress=False).cache_for("").folder
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of the last weight
    weights.write_bytes(bytes(data))
    assert Encoder(copy, cache=cache, progress=False).cache_for("").folder != \
        Encoder(tiny_bert, cache=cache, progress=False).cache_for("").folder


def test_prompts_default_as_encode_query_and_encode_document(encoder):
    assert ROLE_PROMPTS == {"query": ("query",), "document": ("document", "passage", "corpus")}
    layout = encoder.layout
    saved = dict(layout.prompts), layout.default_prompt_name
    try:
        layout.prompts.update({"query": "q: ", "passage": "p: ", "other": "o: "})
        assert encoder.prompt("query") == "q: " and encoder.prompt("document") == "p: "
        assert encoder.prompt("query", prompt_name="other") == "o: "
        assert encoder.prompt("query", prompt_name="other", prompt="x: ") == "x: "  # a text wins, as in encode
        with pytest.raises(ValueError, match="prompt name 'nope'"):
            encoder.prompt("query", prompt_name="nope")
    finally:
        layout.prompts.clear()
        layout.prompts.update(saved[0])


def test_cli_writes_rows_that_finetune_reads(tiny_bert, tmp_path):
    """`hfport mine` writes n-tuples (negative_1..n) a sentence-embedding fine-tune reads as hard negatives, triplets
    it reads as before, and labeled pairs a text-ranking fine-tune reads; Parquet as well as JSONL."""
    from typer.testing import CliRunner

    from hfport.cli import app
    from hfport.train.config import FinetuneConfig
    from hfport.train.tasks.embedding import read_examples
    from hfport.train.tasks.ranking import read_groups

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"anchor": a, "positive": p}) + "\n" for a, p in zip(ANCHORS, POSITIVES)))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(CORPUS) + "\n\n")  # a blank line is no text
    runner = CliRunner()
    common = ["--model", str(tiny_bert), "--data", str(pairs), "--corpus", str(corpus), "--cache-dir",
              str(tmp_path / "cache"), "-q"]
    out = tmp_path / "mined.parquet"
    result = runner.invoke(app, ["mine", *common, "--out", str(out), "--output-format", "n-tuple",
                                 "--num-negatives", "2"])
    assert result.exit_code == 0, result.output
    config = FinetuneConfig(model=str(tiny_bert), task="sentence-embedding", train=str(out))
    kind, hard, rows = read_examples(out, config)
    rows = list(rows)
    assert kind == "pairs" and hard and len(rows) == 40 and all(len(texts) == 4 for texts, _, _ in rows)
    expected = mine_hard_negatives(ANCHORS, POSITIVES, tiny_bert, corpus=CORPUS, output_format="n-tuple",
                                   num_negatives=2, cache=tmp_path / "cache", progress=False).rows
    assert [texts for texts, _, _ in rows] == [[r["anchor"], r["positive"], r["negative_1"], r["negative_2"]]
                                              for r in expected]
    labeled = tmp_path / "labeled.jsonl"
    result = runner.invoke(app, ["mine", *common, "--out", str(labeled), "--output-format", "labeled-pair"])
    assert result.exit_code == 0, result.output
    groups = list(read_groups(labeled, FinetuneConfig(model=str(tiny_bert), task="text-ranking",
                                                      train=str(labeled), query_column="anchor",
                                                      text_column="positive")))
    assert len(groups) == 40 and all(g.labels[0] == 1 and set(g.labels[1:]) == {0} for g in groups)


def test_a_run_folder_mines_with_its_best_model(tiny_bert, tmp_path):
    """`hfport mine --model RUN`, as `evaluate` and `export` take a run: its best/ model embeds (mining again with the
    model a fine-tune made)."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_bert, run / "best")
    (run / "summary.json").write_text("{}")
    encoder = Encoder(run, cache=False, progress=False)
    assert encoder.folder == run / "best"
    mined = mine_hard_negatives(ANCHORS[:8], POSITIVES[:8], run, corpus=CORPUS, cache=False, progress=False)
    assert mined.rows == mine_hard_negatives(ANCHORS[:8], POSITIVES[:8], tiny_bert, corpus=CORPUS, cache=False,
                                             progress=False).rows


def test_bad_input_is_named(minilm_path, encoder, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"anchor": "a", "positive": "b"}) + "\n" + json.dumps({"anchor": "a", "positive": ""})
                   + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl, line 2, field 'positive': expected non-empty text"):
        hfport.mine(encoder, bad)
    with pytest.raises(DataError, match=r"line 1, field 'query': missing"):
        hfport.mine(encoder, bad, anchor_column="query")
    broken = tmp_path / "broken.jsonl"  # a line cut short in the middle of the file (a raw newline in a string)
    broken.write_text(json.dumps({"anchor": "a", "positive": "b"}) + "\n" + '{"anchor": "c", "positive": "d\n'
                      + json.dumps({"anchor": "e", "positive": "f"}) + "\n")
    with pytest.raises(DataError, match=r"^\S*broken.jsonl, line 2: not valid JSON \(Invalid control character at "
                                        r"column 31\)$"):
        hfport.mine(encoder, broken)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(DataError, match=r"corpus.jsonl, line 1, field 'text': missing; the row has \['body'\] .*"
                                        r"`mine --corpus-column`"):
        hfport.mine(encoder, [("a", "b")], corpus=corpus)
    for options, message in (({"num_negatives": 0}, "num_negatives must be at least 1"),
                             ({"range_min": 5, "range_max": 5}, "range_min must be smaller than range_max"),
                             ({"num_negatives": 4, "range_max": 3}, "cannot mine 4 negatives per query"),
                             ({"sampling_strategy": "best"}, r"sampling_strategy 'best': use one of \['top', "),
                             ({"output_format": "pairs"}, r"output_format 'pairs': use one of \['triplet'"),
                             ({"min_score": 0.9, "max_score": 0.1}, "min_score 0.9 is above max_score 0.1: every "
                                                                    "candidate would be dropped")):
        with pytest.raises(ValueError, match=message):
            mine_hard_negatives(ANCHORS, POSITIVES, encoder, progress=False, **options)
    with pytest.raises((DataError, HfportError), match=r"hfport writes \.jsonl"):
        mine_hard_negatives(ANCHORS[:3], POSITIVES[:3], encoder, progress=False).write(tmp_path / "out.csv")


def test_pairs_read_by_position_are_said(tmp_path, caplog):
    """A file without anchor/positive columns is read by position, as sentence-transformers reads it; the columns
    taken are logged, since a wrong file (text, label) would otherwise rank texts against labels without a word."""
    data = tmp_path / "topics.csv"
    data.write_text("text,label\na goal in the last minute,sports\nrain tomorrow,weather\n")
    with caplog.at_level(logging.WARNING, logger="hfport.retrieval"):
        anchors, positives, a, p = read_pairs(data)
    assert (a, p, positives) == ("text", "label", ["sports", "weather"])
    assert "no 'anchor' or 'positive' column: read (anchor, positive) from its columns 'text', 'label'" in caplog.text
    caplog.clear()
    named = tmp_path / "pairs.csv"
    named.write_text("anchor,positive\nq,a\n")
    with caplog.at_level(logging.WARNING, logger="hfport.retrieval"):
        read_pairs(named)
        read_pairs(data, "text", "label")
    assert not caplog.text  # named columns, or the usual ones: nothing to say
    scored = tmp_path / "sts.csv"  # scored pairs: by position, the pair scored 0 would be mined as (anchor, positive)
    scored.write_text("sentence1,sentence2,score\na cat sits,a cat is sitting,0.9\na dog runs,stock prices fell,0\n")
    with pytest.raises(DataError, match=r"sts.csv, line 2: the row has a 'score' column \(\['sentence1', 'sentence2', "
                                        r"'score'\]\): scored pairs"):
        read_pairs(scored)
    assert read_pairs(scored, "sentence1", "sentence2")[1] == ["a cat is sitting", "stock prices fell"]  # as named


def test_a_txt_corpus_is_read_past_its_byte_order_mark(tiny_bert, tmp_path):
    """A .txt corpus saved with a UTF-8 byte-order mark (Notepad, Excel's "Unicode text") is read as every other text
    file is: the mark is no part of its first text. Left on it, a positive on the first line was a text of its own,
    which mining took as a negative of the very query it answers. Bad bytes and UTF-16 are named by line."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\ufeff" + "\n".join([POSITIVES[0], *CORPUS[:20]]) + "\n", encoding="utf-8")
    assert read_corpus(corpus) == [POSITIVES[0], *CORPUS[:20]]
    mined = hfport.mine(tiny_bert, list(zip(ANCHORS[:5], POSITIVES[:5])), corpus=corpus, num_negatives=25,
                        cache=False, progress=False)  # every candidate a negative: the marked copy among them
    assert mined.rows and not [r for r in mined.rows if r["negative"].lstrip("\ufeff") == r["positive"]]
    corpus.write_bytes(b"one\ntwo\nth\xffree\n")
    with pytest.raises(DataError, match=r"corpus.txt, line 3: not UTF-8"):
        read_corpus(corpus)
    corpus.write_text("one\ntwo\n", encoding="utf-16")
    with pytest.raises(DataError, match=r"corpus.txt, line 1: UTF-16"):
        read_corpus(corpus)


@pytest.mark.parametrize("name, content", [("empty.txt", ""), ("blank.txt", "\n  \n\n"), ("empty.jsonl", ""),
                                           ("header.csv", "text\n")])
def test_an_empty_corpus_file_is_refused(name, content, tiny_bert, tmp_path):
    """--corpus naming a file without a text stops, naming it, before anything is embedded: mining (and evaluate)
    went on with the positives alone, as if no corpus had been given, which a wrong or unfinished file is not."""
    corpus = tmp_path / name
    corpus.write_text(content)
    with pytest.raises(DataError, match=rf"{name}: the corpus file has no texts"):
        read_corpus(corpus)
    with pytest.raises(DataError, match=rf"{name}: the corpus file has no texts"):
        hfport.mine(tiny_bert, list(zip(ANCHORS[:3], POSITIVES[:3])), corpus=corpus, cache=False, progress=False)


def test_an_output_path_that_cannot_be_written_fails_before_the_mining(tiny_bert, tmp_path):
    """--out naming a folder, a path under a file, or a suffix hfport does not write stops first, naming it (here
    before a model that does not exist is even looked for): it failed once the mining was done, a folder as a
    traceback (IsADirectoryError from the final rename) through `hfport mine`."""
    from typer.testing import CliRunner

    from hfport.cli import app

    pairs = list(zip(ANCHORS[:3], POSITIVES[:3]))
    (tmp_path / "taken.jsonl").mkdir()
    (tmp_path / "file").write_text("x")
    for out, message in ((tmp_path / "taken.jsonl", r"taken.jsonl: a folder; name a file to write the mined rows"),
                         (tmp_path / "file" / "mined.jsonl", r"mined.jsonl: .*file is a file, not a folder"),
                         (tmp_path / "mined.csv", r"mined.csv: hfport writes \.jsonl")):
        with pytest.raises(HfportError, match=message):
            hfport.mine(tmp_path / "no-such-model", pairs, out=out)
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"anchor": a, "positive": p}) + "\n" for a, p in pairs))
    result = CliRunner().invoke(app, ["mine", "--model", str(tiny_bert), "--data", str(data), "--out",
                                      str(tmp_path / "taken.jsonl"), "--no-cache", "-q"])
    assert result.exit_code == 1 and isinstance(result.exception, (SystemExit, type(None))), result.exception
    assert "taken.jsonl: a folder" in result.output


def test_mining_nothing_writes_nothing(tiny_bert, tmp_path):
    """A mining that finds no row (a corpus smaller than num_negatives for n-tuples, filters that drop every
    candidate) is an error saying why, and --out is left alone: an empty file, which the fine-tune reading it would
    only refuse later, was written with exit code 0. The API without `out` returns the empty result, as
    sentence-transformers returns an empty dataset."""
    pairs = list(zip(ANCHORS[:4], POSITIVES[:4]))
    out = tmp_path / "mined.jsonl"
    out.write_text("kept\n")
    with pytest.raises(ValueError, match=r"mined.jsonl: nothing written, no row was mined: 4 queries among 6 "
                                         r"candidate texts .*num_negatives 10.*n-tuple: a row only where all"):
        hfport.mine(tiny_bert, pairs, corpus=CORPUS[:2], out=out, num_negatives=10, output_format="n-tuple",
                    cache=False, progress=False)
    with pytest.raises(ValueError, match=r"no row was mined: .*the filters dropped .* by max_score -2"):
        hfport.mine(tiny_bert, pairs, corpus=CORPUS[:2], out=out, max_score=-2.0, cache=False, progress=False)
    assert out.read_text() == "kept\n"
    empty = hfport.mine(tiny_bert, pairs, corpus=CORPUS[:2], num_negatives=10, output_format="n-tuple", cache=False,
                        progress=False)
    assert empty.rows == [] and empty.stats["missing"] == 4


def test_pairs_labelled_not_relevant_are_refused(tiny_bert, tmp_path):
    """Rows with a `label` saying the pair is not relevant (`hfport mine --output-format labeled-pair`'s negatives,
    a qrels judgement of 0), read as (anchor, positive) pairs by mine or evaluate: each such text became a positive (a
    relevant document, with no word), so the file, line and field are named. Relevant rows and labels that are no
    number (a class name) pass."""
    labeled = tmp_path / "labeled.jsonl"
    hfport.mine(tiny_bert, list(zip(ANCHORS[:4], POSITIVES[:4])), corpus=CORPUS[:20], out=labeled,
                output_format="labeled-pair", num_negatives=1, cache=False, progress=False)
    message = r"labeled.jsonl, line 2, field 'label': 0 marks a pair that is not relevant"
    with pytest.raises(DataError, match=message):
        read_pairs(labeled)
    with pytest.raises(DataError, match=message):
        hfport.evaluate(tiny_bert, labeled, task="sentence-embedding", cache=False, progress=False)
    qrels = tmp_path / "qrels.csv"
    qrels.write_text("anchor,positive,label\nq,a,1\nq,b,0\n")
    with pytest.raises(DataError, match=r"qrels.csv, line 3, field 'label': '0' marks a pair that is not relevant"):
        read_pairs(qrels)
    fine = tmp_path / "fine.csv"
    fine.write_text("anchor,positive,label\nq,a,1\nr,b,sports\n")
    assert read_pairs(fine)[:2] == (["q", "r"], ["a", "b"])


def test_the_cli_names_the_corpus_text_column(tiny_bert, tmp_path):
    """`hfport mine --corpus-column body` reads a corpus data file whose texts are in another column than `text` (the
    library's corpus_column=, evaluate's --set corpus_column=); the command had no way to name it."""
    from typer.testing import CliRunner

    from hfport.cli import app

    pairs, corpus, out = tmp_path / "pairs.jsonl", tmp_path / "corpus.jsonl", tmp_path / "mined.jsonl"
    pairs.write_text("".join(json.dumps({"anchor": a, "positive": p}) + "\n" for a, p in zip(ANCHORS[:5], POSITIVES)))
    corpus.write_text("".join(json.dumps({"id": i, "body": t}) + "\n" for i, t in enumerate(CORPUS[:20])))
    result = CliRunner().invoke(app, ["mine", "--model", str(tiny_bert), "--data", str(pairs), "--corpus", str(corpus),
                                      "--corpus-column", "body", "--out", str(out), "--no-cache", "-q"])
    assert result.exit_code == 0, result.output
    expected = hfport.mine(tiny_bert, list(zip(ANCHORS[:5], POSITIVES)), corpus=CORPUS[:20], cache=False,
                           progress=False).rows
    assert [json.loads(line) for line in out.read_text().splitlines()] == expected


def test_a_datasetdict_folder_mines_the_split_named(tiny_bert, tmp_path):
    """`hfport mine --data FOLDER --split NAME` mines a DatasetDict folder's split (default "train"); the split could
    not be named, so any other split of a folder was out of reach."""
    from datasets import Dataset, DatasetDict
    from typer.testing import CliRunner

    from hfport.cli import app

    folder = tmp_path / "dd"
    DatasetDict({"train": Dataset.from_dict({"anchor": ANCHORS[:3], "positive": POSITIVES[:3]}),
                 "test": Dataset.from_dict({"anchor": ANCHORS[3:8], "positive": POSITIVES[3:8]})}).save_to_disk(folder)
    out = tmp_path / "mined.jsonl"
    result = CliRunner().invoke(app, ["mine", "--model", str(tiny_bert), "--data", str(folder), "--split", "test",
                                      "--num-negatives", "1", "--out", str(out), "--no-cache", "-q"])
    assert result.exit_code == 0, result.output
    assert [json.loads(line)["anchor"] for line in out.read_text().splitlines()] == ANCHORS[3:8]
    assert {r["anchor"] for r in hfport.mine(tiny_bert, folder, num_negatives=1, cache=False, progress=False).rows} \
        == set(ANCHORS[:3])
    with pytest.raises(DataError, match=r"no split 'dev'; its splits are \['train', 'test'\] \(choose one with split "
                                        r"\(mine --split\)\)"):
        hfport.mine(tiny_bert, folder, split="dev")
