"""hfport.pipeline against transformers' pipelines on the same folders (tiny random heads with a fixed id2label and
a real trained tokenizer), the real MiniLM against sentence-transformers, and question answering against the
transformers 4.57 reference outputs in tests/fixtures/qa_reference.json."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import hfport
from hfport.pipelines import PipelineInputError
from tests.parity import SCORE_TOL, assert_close_results
from tests.tiny_tokenizers import CLS_LABELS, make_folder

EMBED_TOL = 1e-5  # MiniLM sentence embeddings vs sentence-transformers
FIXTURES = Path(__file__).parent / "fixtures"

TEXTS = ["Herman Melville wrote Moby-Dick in Paris.", "The quick brown fox jumps over the lazy dog near Berlin!",
         "unbelievable tokenization", "Straße café naïve 3.14"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models on shared cores: a second intra-op thread only adds synchronisation (16 ms per op vs 20 us)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pipelines")


def hf_pipeline(task: str, folder: Path, **kwargs: Any):
    import transformers

    return transformers.pipeline(task, model=str(folder), tokenizer=str(folder), device="cpu", **kwargs)


MAX_DIFFS: dict[str, float] = {}


def record(name: str, diff: float) -> None:
    MAX_DIFFS[name] = max(MAX_DIFFS.get(name, 0.0), diff)
    logging.getLogger("hfport.tests").info("%s: max score diff %.2e", name, diff)


# --- text-classification ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_text_classification_matches_transformers(root, family):
    folder = make_folder(root, family, "sequence-classification")
    ours, theirs = hfport.pipeline("text-classification", model=folder, batch_size=3), \
        hf_pipeline("text-classification", folder)
    pair = {"text": TEXTS[0], "text_pair": TEXTS[1]}
    cases = [((TEXTS[0],), {}), ((TEXTS,), {}), ((pair,), {}), (([pair, pair],), {}),
             ((TEXTS[1],), {"top_k": 2}), ((TEXTS,), {"top_k": None}), ((TEXTS,), {"function_to_apply": "sigmoid"}),
             ((TEXTS,), {"function_to_apply": "none", "top_k": 3}), ((TEXTS[2],), {"function_to_apply": "softmax"})]
    for args, kwargs in cases:
        record("text-classification", assert_close_results(ours(*args, **kwargs), theirs(*args, **kwargs),
                                                            f"{family} {kwargs}"))


def test_text_classification_regression_and_multilabel_defaults(root):
    import transformers

    for problem_type, labels in (("regression", {0: "score"}), ("multi_label_classification", CLS_LABELS)):
        folder = make_folder(root, "bert", "sequence-classification", seed=len(labels),
                             id2label=labels, label2id={v: k for k, v in labels.items()}, problem_type=problem_type)
        ours = hfport.pipeline("text-classification", model=folder)
        theirs = transformers.pipeline("text-classification", model=str(folder), device="cpu")
        record("text-classification", assert_close_results(ours(TEXTS, top_k=None), theirs(TEXTS, top_k=None),
                                                            problem_type))


# --- token-classification ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["bert", "roberta", "albert"])
def test_token_classification_matches_transformers(root, family):
    folder = make_folder(root, family, "token-classification")
    ours = hfport.pipeline("token-classification", model=folder, max_batch_tokens=64)
    theirs = hf_pipeline("token-classification", folder)
    for strategy in ("none", "simple", "first", "average", "max"):
        for ignore in (None, []):
            kwargs = {"aggregation_strategy": strategy, "ignore_labels": ignore}
            a, b = ours(TEXTS, **kwargs), theirs(TEXTS, **kwargs)
            record("token-classification", assert_close_results(a, b, f"{family} {kwargs}"))
            if ignore == [] and strategy == "none":  # every non-special token is there, with its index
                assert all("index" in e for e in a[0]) and len(a[0]) > 5
    # long texts: truncated to model_max_length by default, or split into windows with a stride
    long_text = " ".join(TEXTS * 6)
    for kwargs in ({"aggregation_strategy": "simple"}, {"aggregation_strategy": "first", "stride": 8},
                   {"aggregation_strategy": "max", "stride": 16, "ignore_labels": []}):
        record("token-classification", assert_close_results(ours(long_text, **kwargs), theirs(long_text, **kwargs),
                                                             f"{family} long {kwargs}"))


# --- fill-mask --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["bert", "roberta", "xlm-roberta"])
def test_fill_mask_matches_transformers(root, family):
    folder = make_folder(root, family, "masked-lm")
    ours, theirs = hfport.pipeline("fill-mask", model=folder), hf_pipeline("fill-mask", folder)
    m = ours.tokenizer.mask_token
    texts = [f"Paris is the {m} of France.", f"The {m} fox jumps over the {m} dog.", f"{m}"]
    vocab = list(ours.tokenizer.get_vocab())
    for args, kwargs in [((texts[0],), {}), ((texts,), {}), ((texts[1],), {"top_k": 3}), (([texts[0]],), {}),
                         ((texts[:2],), {"targets": vocab[10:17], "top_k": 4}), ((texts[0],), {"targets": vocab[30]})]:
        record("fill-mask", assert_close_results(ours(*args, **kwargs), theirs(*args, **kwargs), f"{family} {kwargs}"))


# --- feature-extraction -----------------------------------------------------------------------------------------

def test_feature_extraction_matches_transformers(root):
    folder = make_folder(root, "roberta", "base")
    ours, theirs = hfport.pipeline("feature-extraction", model=folder, batch_size=2), \
        hf_pipeline("feature-extraction", folder)
    for args, kwargs in [((TEXTS[0],), {}), ((TEXTS,), {}), ((TEXTS[1],), {"return_tensors": True})]:
        a, b = ours(*args, **kwargs), theirs(*args, **kwargs)
        if kwargs.get("return_tensors"):
            assert a.shape == b.shape
            diff = (a - b).abs().max().item()
        else:
            diff = (torch.tensor(a) - torch.tensor(b)).abs().max().item() if args[0] is TEXTS[0] else max(
                (torch.tensor(x) - torch.tensor(y)).abs().max().item() for x, y in zip(a, b))
        assert diff <= SCORE_TOL, (kwargs, diff)
        record("feature-extraction", diff)


def test_minilm_sentence_embeddings_match_sentence_transformers(minilm_path):
    from sentence_transformers import SentenceTransformer

    sentences = ["A man is eating food.", "A man is riding a horse on a sunny day in the mountains.",
                 "The new movie is awesome", "Ünïcödé and 東京 too", "short"]
    reference = SentenceTransformer(str(minilm_path), device="cpu").encode(sentences, convert_to_tensor=True)
    pipe = hfport.pipeline("feature-extraction", model=minilm_path, batch_size=2)
    ours = torch.tensor(pipe(sentences, pooling="mean", normalize=True))  # (N, 384)
    assert ours.shape == reference.shape == (5, 384)
    torch.testing.assert_close(ours, reference.cpu(), rtol=0, atol=EMBED_TOL)
    record("minilm embeddings", (ours - reference.cpu()).abs().max().item())
    # cls pooling is the first token's hidden state; normalize gives unit vectors
    cls = torch.tensor(pipe(sentences[0], pooling="cls"))
    tokens = torch.tensor(pipe(sentences[0], pooling=None))[0]  # (T, 384): pooling=None asks for token states
    # the folder is in the sentence-transformers layout: feature-extraction still gives token states without options
    # (transformers' meaning); the sentence-embedding pipeline pools as its modules say
    torch.testing.assert_close(torch.tensor(pipe(sentences[0]))[0], tokens, rtol=0, atol=0)
    theirs = [torch.tensor(t) for t in hf_pipeline("feature-extraction", minilm_path)(sentences)]  # (1, T, 384) each
    for mine, reference in zip(pipe(sentences), theirs):
        assert torch.tensor(mine).shape == reference.shape
        assert (torch.tensor(mine) - reference).abs().max().item() <= SCORE_TOL
    pooled = hfport.pipeline("sentence-embedding", model=minilm_path, batch_size=2)
    torch.testing.assert_close(torch.tensor(pooled(sentences)), ours, rtol=0, atol=0)
    torch.testing.assert_close(cls, tokens[0], rtol=0, atol=0)
    assert abs(ours.norm(dim=-1) - 1).max() < 1e-5


# --- batching and bad input -------------------------------------------------------------------------------------

def test_batching_sorts_by_length_and_keeps_input_order(root):
    folder = make_folder(root, "bert", "sequence-classification")
    texts = [" ".join(["the"] * n) for n in (3, 40, 1, 25, 7, 12)]  # "the" is one token: n + 2 tokens
    one_by_one = hfport.pipeline("text-classification", model=folder, batch_size=1)
    batched = hfport.pipeline("text-classification", model=folder, max_batch_tokens=60)
    opts = batched.resolve_options({})
    batches = batched.batches([f for t in texts for f in batched.preprocess(t, opts)])
    assert [[len(f.input_ids) for f in b] for b in batches] == [[42], [27, 14], [9, 5, 3]]  # <= 60 padded tokens
    assert [len(b) for b in hfport.pipeline("text-classification", model=folder, batch_size=2).batches(
        [f for t in texts for f in batched.preprocess(t, opts)])] == [2, 2, 2]
    record("batched vs one by one", assert_close_results(batched(texts, top_k=None), one_by_one(texts, top_k=None)))


def test_bad_items_get_errors_and_the_rest_is_answered(root):
    folder = make_folder(root, "bert", "sequence-classification")
    pipe = hfport.pipeline("text-classification", model=folder)
    huge = " ".join(["the"] * 10_000)  # 10,000 words, one token each
    out = pipe([TEXTS[0], "", "   \n", huge, TEXTS[1], 42])
    assert [isinstance(r, hfport.ItemError) for r in out] == [False, True, True, True, False, True]
    assert out[1] == hfport.ItemError("text is empty or only whitespace", "PipelineInputError")
    # the CLI and the HTTP API render it with its position (tests below check both)
    assert out[1].to_dict(1) == {"error": "input 1: text is empty or only whitespace",
                                 "error_type": "PipelineInputError", "index": 1}
    rendered = hfport.ItemError.render(out)
    assert "input 3: 10002 tokens, but the model takes at most 128" in rendered[3]["error"]
    assert "input 5: text must be a string, got int" in rendered[5]["error"]
    assert_close_results([out[0], out[4]], pipe([TEXTS[0], TEXTS[1]]))
    with pytest.raises(PipelineInputError, match="text is empty"):
        pipe("")
    # truncation makes the long text answerable
    assert "label" in pipe([huge], truncation=True)[0]

    mask = make_folder(root, "bert", "masked-lm")
    fill = hfport.pipeline("fill-mask", model=mask)
    out = fill(["no mask here", "a [MASK] here"])
    assert out[0] == hfport.ItemError("no mask token ([MASK]) in the text", "PipelineInputError")
    assert out[0].to_dict(0)["error"] == "input 0: no mask token ([MASK]) in the text" and out[1][0]["token_str"]
    tokens = hfport.pipeline("token-classification", model=make_folder(root, "bert", "token-classification"))
    out = tokens([huge, "", TEXTS[0]], ignore_labels=[])  # truncated to model_max_length 64, as transformers
    assert len(out[0]) == 62 and isinstance(out[1], hfport.ItemError) and len(out[2]) > 3


def test_options_are_checked(root):
    folder = make_folder(root, "bert", "token-classification")
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['top_n'\]; valid: \['aggregation_strategy'"):
        hfport.pipeline("token-classification", model=folder, top_n=3)
    pipe = hfport.pipeline("token-classification", model=folder)
    with pytest.raises(ValueError, match="aggregation_strategy='fancy'"):
        pipe("a", aggregation_strategy="fancy")
    with pytest.raises(ValueError, match="needs aggregation_strategy"):
        pipe("a", stride=4)
    with pytest.raises(ValueError, match="task 'summarization' is not supported"):
        hfport.pipeline("summarization", model=folder)


@pytest.mark.parametrize("value", ["yes", "no", "false", 1, 0, None])
def test_a_switch_takes_only_a_bool(root, value):
    """packed_linear / allow_untrained_head "no" (truthy) would turn them on: anything but True or False is refused
    before the model loads, naming the option; a call switch (return_tensors, normalize) takes a bool or None (its
    default) and nothing else."""
    folder = make_folder(root, "bert", "feature-extraction")
    for option in ("packed_linear", "allow_untrained_head"):
        with pytest.raises(ValueError, match=rf"{option}={value!r}: expected True or False$"):
            hfport.pipeline("feature-extraction", model=folder, **{option: value})
    pipe = hfport.pipeline("feature-extraction", model=folder, packed_linear=False)
    if value is None:  # a call switch's None is its default
        assert isinstance(pipe("a", return_tensors=value), list)
        return
    with pytest.raises(ValueError, match=rf"feature-extraction: return_tensors={value!r}: expected True or False"):
        pipe("a", return_tensors=value)
    with pytest.raises(ValueError, match=rf"sentence-embedding: normalize={value!r}: expected True or False"):
        hfport.pipeline("sentence-embedding", model=folder)("a", normalize=value)


# --- question-answering: transformers 4.57's semantics, from the stored reference --------------------------------

QA_REFERENCE = json.loads((FIXTURES / "qa_reference.json").read_text(encoding="utf-8"))


QA_CASES = [(model, case) for model, cases in QA_REFERENCE["models"].items() for case in cases]


@pytest.fixture(scope="module")
def qa_pipes() -> dict[str, Any]:
    return {name: hfport.pipeline("question-answering", model=FIXTURES / name, max_batch_tokens=200)
            for name in QA_REFERENCE["models"]}


@pytest.fixture(scope="module")
def qa_pipe(qa_pipes):
    return qa_pipes["qa_tiny_bert"]


@pytest.mark.parametrize(("model", "case"), QA_CASES, ids=[f"{m}-{c['name']}" for m, c in QA_CASES])
def test_question_answering_matches_transformers_4_57(qa_pipes, model, case):
    assert QA_REFERENCE["transformers"].startswith("4.57.")
    pipe = qa_pipes[model]
    inputs, kwargs = case["inputs"], case["kwargs"]
    if isinstance(inputs, dict):
        ours = pipe(question=inputs["question"], context=inputs["context"], **kwargs)
    else:
        ours = pipe(inputs, **kwargs)
    record("question-answering", assert_close_results(ours, case["output"], f"{model} {case['name']}"))


def test_question_answering_bad_items(qa_pipe):
    context = QA_REFERENCE["models"]["qa_tiny_bert"][0]["inputs"]["context"]
    huge = " ".join(["the whale"] * 5_000)  # 10,000 words: hundreds of windows, still answered
    out = qa_pipe([{"question": "Who wrote it?", "context": context},
                   {"question": "", "context": context},
                   {"question": "Who wrote the long novel about the white whale?", "context": "Melville."},
                   {"question": " ".join(["who"] * 70) + "?", "context": context * 4},
                   {"question": "What?", "context": huge},
                   {"context": context}])
    assert [isinstance(r, hfport.ItemError) for r in out] == [False, True, True, True, False, True]
    rendered = hfport.ItemError.render(out)  # what the CLI and the HTTP API show
    assert rendered[1]["error"] == "input 1: question is empty or only whitespace"
    assert "input 2: the context (9 characters) is shorter than the question" in rendered[2]["error"]
    assert "input 3: the question takes" in rendered[3]["error"] and "max_seq_len=64" in rendered[3]["error"]
    assert "input 5: needs a dict with keys 'question' and 'context'" in rendered[5]["error"]
    assert_close_results(out[0], qa_pipe(question="Who wrote it?", context=context))
    assert huge[out[4]["start"]:out[4]["end"]] == out[4]["answer"]
    with pytest.raises(ValueError, match=r"doc_stride \(50\) is larger than max_seq_len \(40\)"):
        qa_pipe(question="a", context=context, doc_stride=50, max_seq_len=40)
    with pytest.raises(PipelineInputError, match="context is empty"):
        qa_pipe(question="Who?", context=" ")


# --- hfport predict ----------------------------------------------------------------------------------------------

def test_cli_predict_prints_one_json_line_per_input(root, tmp_path):
    from typer.testing import CliRunner

    from hfport.cli import app

    folder = make_folder(root, "bert", "token-classification")
    runner = CliRunner()
    result = runner.invoke(app, ["predict", str(folder), "--task", "ner", "-o", "aggregation_strategy=simple",
                                 "-o", "ignore_labels=[]", TEXTS[0], "   ", TEXTS[1]])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    ner = hfport.pipeline("ner", model=folder, aggregation_strategy="simple", ignore_labels=[])
    expected = ner([TEXTS[0], TEXTS[1]])
    assert len(lines) == 3 and lines[1]["error"] == "input 1: text is empty or only whitespace"
    assert_close_results([lines[0], lines[2]], expected)

    qa_file = tmp_path / "qa.jsonl"
    case = QA_REFERENCE["models"]["qa_tiny_bert"][0]
    qa_file.write_bytes(json.dumps(case["inputs"]).encode() + b"\n\xff\xfe not utf-8\n\n" +
                        json.dumps({"question": "Who?", "context": ""}).encode() + b"\n{broken\n")
    result = runner.invoke(app, ["predict", str(FIXTURES / "qa_tiny_bert"), "--task", "question-answering",
                                 "--input", str(qa_file)])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(lines) == 4  # the blank line is not an input
    assert_close_results(lines[0], case["output"])
    assert "line 2: not UTF-8" in lines[1]["error"] and lines[1]["index"] == 1
    assert lines[2]["error"] == f"{qa_file} line 4: context is empty or only whitespace"  # its line, not its index
    assert "line 5: not JSON" in lines[3]["error"]

    result = runner.invoke(app, ["predict", str(folder), "--task", "ner", "-o", "top_n=1", "x"])
    assert result.exit_code == 1 and "unknown option(s) ['top_n']" in result.output
    result = runner.invoke(app, ["predict", str(folder), "--task", "ner"])
    assert result.exit_code == 1 and "no inputs" in result.output


def test_a_folder_without_the_tasks_head_is_refused(root):
    """A base model asked for text-classification: its head would be random weights, so pipeline() (and predict and
    the server, which build on it) refuse it, naming the missing weights and what to do, as the exporters do;
    feature-extraction on the same folder needs no head and serves."""
    from typer.testing import CliRunner

    from hfport.cli import app
    from hfport.errors import UntrainedHeadError

    base = make_folder(root, "bert", "feature-extraction")
    with pytest.raises(UntrainedHeadError, match=r"weights hold no text-classification head \(head\.\S+ .*missing\).*"
                                                 r"randomly initialised weights\. Fine-tune it"):
        hfport.pipeline("text-classification", model=base)
    assert len(hfport.pipeline("feature-extraction", model=base)(TEXTS[:1])) == 1
    result = CliRunner().invoke(app, ["predict", str(base), "--task", "text-classification", TEXTS[0]])
    assert result.exit_code != 0 and "hold no text-classification head" in result.output


def test_another_tasks_head_of_the_same_shape_is_refused(root):
    """A token-classification folder asked for text-classification: BERT's token classifier and sequence classifier
    are both `classifier.*` of one shape, so the head loads without a gap (transformers' does, silently) and would
    score the pooled text with a token head. Refused as an untrained head, naming what config.json says it is; its
    own task, and tasks that need no head, serve."""
    from hfport.errors import UntrainedHeadError

    ner = make_folder(root, "bert", "token-classification")
    with pytest.raises(UntrainedHeadError, match=r"architectures name a token-classification model, so its head "
                                                 r"weights were trained for token-classification, not "
                                                 r"text-classification"):
        hfport.pipeline("text-classification", model=ner)
    for task in ("token-classification", "feature-extraction", "sentence-embedding"):
        assert len(hfport.pipeline(task, model=ner)(TEXTS[:2])) == 2
