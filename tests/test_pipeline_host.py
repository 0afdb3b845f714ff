"""The host side of a pipeline call: a call's texts tokenized in one tokenizer call (Pipeline.preprocess_many,
encode_many) with the rows, and the per-item errors, of one call per text; sentence embeddings pooled on the model's
device (SentenceEmbeddingPipeline.device_outputs) equal to pooling each row's token states on the host."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import hfport
from hfport.heads import pool
from hfport.pipelines.sentence_embedding import POOLINGS
from hfport.tokenizer import PreTrainedTokenizer
from tests.tiny import make_adapter
from tests.tiny_tokenizers import make_folder

TEXTS = ["Herman Melville wrote Moby-Dick in Paris.", "The quick brown fox jumps over the lazy dog near Berlin!",
         "unbelievable tokenization", "Straße café naïve 3.14", "a", "Paris is the capital of France; Berlin is "
         "in Germany and the book about whales was written in 1851 by Herman Melville."]
HUGE = " ".join(["the"] * 300)  # more tokens than the tiny models' 128 positions


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: a second intra-op thread only adds synchronisation
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pipeline-host")


@pytest.fixture
def tokenizer_calls(monkeypatch) -> list[Any]:
    """The first argument of every tokenizer call made while the test runs."""
    calls: list[Any] = []
    real = PreTrainedTokenizer.__call__

    def spy(self, text, *args, **kwargs):
        calls.append(text)
        return real(self, text, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizer, "__call__", spy)
    return calls


def outcome(prepared, shift: int = 0) -> tuple[dict, dict]:
    """A Prepared's rows (ids, mask, types per item) and errors (type, message per item)."""
    rows: dict[int, list] = {}
    for f in prepared.rows:
        rows.setdefault(f.item + shift, []).append((f.input_ids, f.attention_mask, f.token_type_ids))
    return rows, {i + shift: (type(e).__name__, str(e)) for i, e in prepared.failed.items()}


def assert_batched_equals_per_item(pipe, items: list[Any], **options: Any) -> None:
    """prepare over all items gives each item the rows and the error it gets prepared alone (one tokenizer call)."""
    rows, errors = outcome(pipe.prepare(items, **options))
    alone_rows, alone_errors = {}, {}
    for i, item in enumerate(items):
        r, e = outcome(pipe.prepare([item], **options), shift=i)
        alone_rows |= r
        alone_errors |= e
    assert errors == alone_errors, options
    assert rows == alone_rows, options


# --- A: one tokenizer call for a call's texts -------------------------------------------------------------------

@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_texts_of_a_call_are_tokenized_in_one_call(root, family, tokenizer_calls):
    """One tokenizer call per pipeline call (texts alone and pairs: one each), not one per text."""
    embed = hfport.pipeline("sentence-embedding", model=make_folder(root, family, "base"), batch_size=2)
    embed(TEXTS)
    assert len(tokenizer_calls) == 1 and tokenizer_calls[0] == TEXTS
    tokenizer_calls.clear()
    embed(TEXTS, truncate=True, truncation_direction="left", prompt="query: ")
    assert tokenizer_calls == [["query: " + t for t in TEXTS]]

    classify = hfport.pipeline("text-classification", model=make_folder(root, family, "sequence-classification"))
    tokenizer_calls.clear()
    classify([TEXTS[0], {"text": TEXTS[1], "text_pair": TEXTS[2]}, TEXTS[3], {"text": TEXTS[4], "text_pair": TEXTS[5]},
              {"text": TEXTS[5]}])
    assert tokenizer_calls == [[TEXTS[0], TEXTS[3], TEXTS[5]], [TEXTS[1], TEXTS[4]]]  # the texts alone, the pairs

    for task, head in (("feature-extraction", "base"), ("token-classification", "token-classification")):
        pipe = hfport.pipeline(task, model=make_folder(root, family, head))
        tokenizer_calls.clear()
        pipe(TEXTS)
        assert tokenizer_calls == [TEXTS], task
    fill = hfport.pipeline("fill-mask", model=make_folder(root, family, "masked-lm"))
    masked = [t + " " + fill.tokenizer.mask_token for t in TEXTS]
    tokenizer_calls.clear()
    fill(masked)
    assert tokenizer_calls == [masked]


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_batched_rows_and_errors_equal_one_call_per_item(root, family):
    """Every option that changes tokenization, with bad items among good ones: each item's rows (ids, mask, token
    types) and error equal those it gets alone."""
    embed = hfport.pipeline("sentence-embedding", model=make_folder(root, family, "base"))
    items = [*TEXTS, "", "  ", 42, [5, 6, 7, 8], [10**9], [], HUGE, None]
    for options in ({}, {"truncate": True}, {"truncate": True, "truncation_direction": "left"},
                    {"prompt": "query: "}, {"truncate": True, "prompt": "passage: "}):
        assert_batched_equals_per_item(embed, items, **options)

    classify = hfport.pipeline("text-classification", model=make_folder(root, family, "sequence-classification"))
    items = [TEXTS[0], {"text": TEXTS[1], "text_pair": TEXTS[2]}, {"text": TEXTS[3]}, {"text": TEXTS[4],
             "text_pair": None}, {"text": TEXTS[5], "text_pair": TEXTS[0]}, ["a", "b"], {"txt": "a"}, "",
             {"text": "a", "text_pair": ""}, HUGE, {"text": HUGE, "text_pair": TEXTS[1]}]
    for options in ({}, {"truncation": True}, {"truncation": True, "max_length": 12},
                    {"truncation": "only_first", "max_length": 20}):
        assert_batched_equals_per_item(classify, items, **options)

    features = hfport.pipeline("feature-extraction", model=make_folder(root, family, "base"))
    for options in ({}, {"truncation": True, "max_length": 8}, {"tokenize_kwargs": {"padding": True}},
                    {"tokenize_kwargs": {"padding": "max_length", "max_length": 40, "truncation": True}}):
        assert_batched_equals_per_item(features, [*TEXTS, "", HUGE], **options)

    tokens = hfport.pipeline("token-classification", model=make_folder(root, family, "token-classification"))
    for options in ({}, {"stride": 4, "aggregation_strategy": "simple"}):
        assert_batched_equals_per_item(tokens, [*TEXTS, "", HUGE], **options)

    fill = hfport.pipeline("fill-mask", model=make_folder(root, family, "masked-lm"))
    mask = fill.tokenizer.mask_token
    assert_batched_equals_per_item(fill, [f"{TEXTS[0]} {mask}", TEXTS[1], f"{mask} {TEXTS[2]}", "", 3], top_k=2)


def test_a_failing_batched_call_is_redone_text_by_text(root, tokenizer_calls):
    """A pair whose second text cannot be cut to max_length (only_second) makes the tokenizer refuse the whole
    batched call: the call is redone one text at a time, so that pair alone fails, with the error it gets alone."""
    classify = hfport.pipeline("text-classification", model=make_folder(root, "bert", "sequence-classification"))
    short = {"text": TEXTS[5], "text_pair": "a"}  # the first text alone is longer than max_length
    items = [{"text": "a", "text_pair": TEXTS[1]}, short, {"text": "b", "text_pair": TEXTS[5]}, "c"]
    options = {"truncation": "only_second", "max_length": 10}
    out = classify(items, **options)
    assert [isinstance(r, hfport.ItemError) for r in out] == [False, True, False, False]
    alone = classify([short], **options)[0]
    assert out[1] == alone and alone.error_type == "TokenizerError"
    # the pairs: one call that failed, then one per item (the text alone was alone anyway)
    assert tokenizer_calls[:5] == [["a", TEXTS[5], "b"], "a", TEXTS[5], "b", "c"]
    tokenizer_calls.clear()
    assert_batched_equals_per_item(classify, items, **options)


def test_items_of_other_adapters_or_options_are_tokenized_apart(root, tokenizer_calls):
    """Items sharing a pipeline and options share a tokenizer call; a call's items of two adapters make two calls,
    each with its adapter's rows (the server's groups prepare each request with its own options: one call each)."""
    folder = make_folder(root, "bert", "sequence-classification")
    adapter = make_adapter(folder, root / "adapter", "text-classification", 2, ["q", "v"], 1)
    classify = hfport.pipeline("text-classification", model=folder)
    classify.add_adapter("a", adapter)
    tokenizer_calls.clear()
    out = classify.predict(TEXTS, adapter=["a", None, "a", None, "a", None])
    assert sorted(map(len, tokenizer_calls)) == [3, 3]
    alone = [classify.predict([t], adapter=a)[0] for t, a in zip(TEXTS, ["a", None] * 3)]
    for mine, theirs in zip(out, alone):
        assert mine["label"] == theirs["label"] and abs(mine["score"] - theirs["score"]) < 1e-5


# --- B: sentence embeddings pooled on the model's device ----------------------------------------------------------

def host_copies(monkeypatch) -> list[tuple[int, ...]]:
    """The shapes of the floating tensors copied to the host (.cpu()) while the test runs."""
    shapes: list[tuple[int, ...]] = []
    real = torch.Tensor.cpu

    def spy(self, *args, **kwargs):
        if self.is_floating_point():
            shapes.append(tuple(self.shape))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", spy)
    return shapes


def test_sentence_embedding_batches_hand_the_host_pooled_vectors(minilm_path, monkeypatch):
    """Each forward pass sends the host its (B, C) sentence vectors in one copy, not its (B, T, C) token states;
    output="tokens" still sends the states."""
    pipe = hfport.pipeline("sentence-embedding", model=minilm_path, batch_size=4)
    shapes = host_copies(monkeypatch)
    pipe(TEXTS)
    assert shapes == [(4, 384), (2, 384)]
    shapes.clear()
    pipe(TEXTS[:2], output="tokens")
    assert len(shapes) == 1 and len(shapes[0]) == 3


def host_pooled(tokens: list[Any], pooling: str, dimensions: int | None, normalize: bool) -> torch.Tensor:
    """What the pipeline computed before pooling moved to the device: the row's float32 token states (T, C),
    pooled on the host, cut to `dimensions`, normalized."""
    vector = pool(torch.tensor(tokens)[None], None, pooling)[0]  # (C,)
    vector = vector[:dimensions] if dimensions is not None else vector
    return F.normalize(vector, p=2, dim=-1) if normalize else vector


@pytest.mark.parametrize("model", ["minilm", "bert", "roberta"])
def test_pooling_on_the_device_equals_pooling_on_the_host(model, minilm_path, root):
    """Every pooling, normalize on and off, Matryoshka dimensions, padded batches of mixed lengths, text and
    token-id inputs: each vector equals its row's token states pooled on the host. Tolerance 1e-6, not exact: mean
    and mean_sqrt_len sum a padded row under its mask where the host averaged the cut row, another float32
    summation order (cls, max and lasttoken pick or compare values, and are exact)."""
    folder = minilm_path if model == "minilm" else make_folder(root, model, "base")
    pipe = hfport.pipeline("sentence-embedding", model=folder, batch_size=3)
    items = [*TEXTS, [5, 6, 7, 8, 9, 10, 11]]
    tokens = pipe(items, output="tokens")  # each row's own (T, C) states, copied to the host as before
    for pooling in POOLINGS:
        for normalize in (False, True):
            for dimensions in (None, 16):
                got = pipe(items, pooling=pooling, normalize=normalize, dimensions=dimensions, return_tensors=True)
                for vector, states in zip(got, tokens):
                    want = host_pooled(states, pooling, dimensions, normalize)
                    exact = pooling in ("cls", "max", "lasttoken")
                    torch.testing.assert_close(vector, want, rtol=0, atol=0 if exact else 1e-6)


def one_pass(pipe, asks: list[dict[str, Any]]) -> tuple[list[Any], list[list[Any]]]:
    """TEXTS prepared once per options in `asks` (a server group's requests), all rows run in one forward pass."""
    prepared = [pipe.prepare(TEXTS, **options) for options in asks]
    pipe.forward_rows([row for p in prepared for row in p.rows])
    return prepared, [pipe.finish(p) for p in prepared]


def test_a_batch_of_several_calls_pools_each_row_as_its_call_asks(minilm_path):
    """The server packs the rows of requests with other options into one pass: each row pools as its own request
    asks (poolings mixed in one batch); a batch with a row that asks for token states sends the host the states and
    the others pool there. Each vector equals its row's states from the same pass pooled on the host (1e-6: see
    above)."""
    pipe = hfport.pipeline("sentence-embedding", model=minilm_path)
    asks = [{"pooling": "mean", "normalize": False}, {"pooling": "cls", "normalize": True},
            {"pooling": "max", "normalize": False, "dimensions": 8}]
    for extra in ([], [{"output": "tokens"}]):
        _, states = one_pass(pipe, [{"output": "tokens"}] * len(asks + extra))  # the same rows: the same pass
        prepared, got = one_pass(pipe, asks + extra)
        if extra:
            assert "last_hidden_state" in prepared[0].rows[0].outputs  # the states came; pooled on the host
            assert torch.tensor(got[3][0]).shape == (len(prepared[3].rows[0].input_ids), 384)
        else:
            assert set(prepared[0].rows[0].outputs) == {"sentence_embedding"}
        for options, vectors, rows in zip(asks, got, states):
            for vector, tokens in zip(vectors, rows):
                want = host_pooled(tokens, options["pooling"], options.get("dimensions"), options["normalize"])
                torch.testing.assert_close(torch.tensor(vector), want, rtol=0, atol=1e-6)
