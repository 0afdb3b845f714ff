"""zero-shot-classification against transformers' ZeroShotClassificationPipeline on the same folders: the real
MiniLM body (WordPiece, token types, 512 positions) under a random NLI head (contradiction, neutral, entailment)
scaled so that labels score far apart, and a tiny random RoBERTa with a trained BPE tokenizer (no token types,
model_max_length 64). Texts past the tokenizer's length are truncated on the text side only, in both. Each label's
score must agree within SCORE_TOL (tests/parity.py: probabilities from fp32 logits, batched vs one at a time), and
the labels' order wherever their scores differ by more. Then the refusals, the server's native /predict and
`hfport predict`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import hfport
from hfport.cli import app as cli
from hfport.pipelines.base import InputTooLongError
from tests.parity import SCORE_TOL
from tests.tiny_tokenizers import make_folder

NLI = {0: "contradiction", 1: "neutral", 2: "entailment"}
TEXTS = ["I have a problem with my iphone that needs to be resolved asap!!",
         "The match ended in a draw after extra time.",
         " ".join(["a long text about cooking pasta and the weather"] * 60)]  # 540 words: truncated
CALLS = [dict(candidate_labels=["urgent", "phone", "sports", "cooking"]),
         dict(candidate_labels="urgent, sports, cooking", multi_label=True),
         dict(candidate_labels=["sports"]),  # one label: scored alone (entailment against contradiction)
         dict(candidate_labels=["football", "food"], hypothesis_template="This text is about {}.")]


def minilm_nli(minilm: Path, out: Path) -> Path:
    """MiniLM's body (its pooler included) under a random three-label head, scaled: a random body's pooled vectors
    barely differ between inputs, so its labels would all score ~1/N and their order would be a tie-break; a real
    body's differ, and the scaled head turns that into scores far apart."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        minilm, id2label=NLI, label2id={v: k for k, v in NLI.items()})
    with torch.no_grad():
        model.classifier.weight.normal_(0.0, 1.0)
        model.classifier.bias.normal_(0.0, 0.1)
    model.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(minilm).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory, minilm_path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("zero-shot")
    roberta = make_folder(root, "roberta", "sequence-classification")  # three labels, renamed NLI's
    config = json.loads((roberta / "config.json").read_text())
    config.update(id2label={str(k): v for k, v in NLI.items()}, label2id={v: k for k, v in NLI.items()})
    (roberta / "config.json").write_text(json.dumps(config))
    return {"minilm": minilm_nli(minilm_path, root / "minilm-nli"), "roberta": roberta}


def assert_same(ours, theirs) -> None:
    ours, theirs = (ours, theirs) if isinstance(ours, list) else ([ours], [theirs])
    assert len(ours) == len(theirs)
    for o, t in zip(ours, theirs):
        assert o["sequence"] == t["sequence"] and sorted(o["labels"]) == sorted(t["labels"]), (o, t)
        mine, ref = dict(zip(o["labels"], o["scores"])), dict(zip(t["labels"], t["scores"]))
        torch.testing.assert_close(torch.tensor([mine[k] for k in ref]), torch.tensor(list(ref.values())),
                                   atol=SCORE_TOL, rtol=0)
        # the order, wherever transformers' scores tell two neighbours apart by more than the tolerance
        for (a, sa), (b, sb) in zip(list(ref.items()), list(ref.items())[1:]):
            if sa - sb > SCORE_TOL:
                assert o["labels"].index(a) < o["labels"].index(b), (o, t)


@pytest.mark.parametrize("family", ["minilm", "roberta"])
def test_matches_transformers(folders, family):
    import transformers

    theirs = transformers.pipeline("zero-shot-classification", model=str(folders[family]))
    ours = hfport.pipeline("zero-shot-classification", model=folders[family])
    spread = []
    for call in CALLS:
        assert_same(ours(TEXTS, **call), theirs(TEXTS, **call))
        spread += [max(r["scores"]) - min(r["scores"]) for r in ours(TEXTS, **call) if len(r["scores"]) > 1]
    if family == "minilm":  # the real body tells labels apart: the order compared is not a tie-break
        assert max(spread) > 0.3, spread
    # one text: one dict; labels by position, as transformers takes them
    assert_same(ours(TEXTS[1], ["sports", "phone"]), theirs(TEXTS[1], ["sports", "phone"]))


def test_refusals_name_the_option(folders, tmp_path):
    pipe = hfport.pipeline("zero-shot-classification", model=folders["roberta"])
    with pytest.raises(ValueError, match="give candidate_labels"):
        pipe("a text")
    with pytest.raises(ValueError, match="candidate_labels"):
        pipe("a text", candidate_labels=" , ")
    with pytest.raises(ValueError, match=r"hypothesis_template='no slot': it must hold \{\}"):
        pipe("a text", candidate_labels=["a"], hypothesis_template="no slot")
    with pytest.raises(ValueError, match="multi_label='yes'"):
        pipe("a text", candidate_labels=["a"], multi_label="yes")
    # a hypothesis the text cannot make room for: tokenized whole, then refused for its length (transformers'
    # fallback tokenizes it whole too, and its model fails on the row)
    with pytest.raises(InputTooLongError):
        pipe("a text", candidate_labels=[" ".join(["label"] * 200)])
    # a list: the bad item fails alone
    results = pipe.predict(["a text", "   "], candidate_labels=["a", "b"])
    assert results[0]["labels"] and isinstance(results[1], hfport.ItemError)

    # no label named entailment: transformers warns and reads the last logit; hfport refuses, naming the labels
    plain = tmp_path / "plain"
    make_folder(tmp_path, "roberta", "sequence-classification").rename(plain)
    with pytest.raises(ValueError, match=r"no entailment label \(label2id: \{'negative': 0"):
        hfport.pipeline("zero-shot-classification", model=plain)


def test_served_and_predicted(folders, tmp_path):
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.settings import Settings

    pipe = hfport.pipeline("zero-shot-classification", model=folders["roberta"])
    expected = pipe(TEXTS[:2], candidate_labels=["sports", "phone"])
    app = create_app(Settings(data_dir=tmp_path / "data", models=[f"nli={folders['roberta']}"],
                              predict_dtype="float32", batch_token_budgets=[]), run_worker=False)
    with TestClient(app) as client:
        r = client.post("/predict", json={"model": "nli", "inputs": TEXTS[:2], "task": "zero-shot-classification",
                                          "parameters": {"candidate_labels": ["sports", "phone"]}})
        assert r.status_code == 200, r.text
        assert_same(r.json()["outputs"], expected)
        r = client.post("/predict", json={"model": "nli", "inputs": "x", "task": "zero-shot-classification"})
        assert r.status_code == 422 and "candidate_labels" in r.json()["error"], r.text

    out = CliRunner().invoke(cli, ["predict", str(folders["roberta"]), "--task", "zero-shot-classification",
                                   "-o", "candidate_labels=sports,phone", TEXTS[0]])
    assert out.exit_code == 0, out.output
    assert_same(json.loads(out.stdout.strip().splitlines()[-1]), expected[0])


def test_auto_int8_times_the_calls_asked_for(folders, monkeypatch):
    """dtype="auto-int8" times each int8 path on zero-shot calls: they need the pipeline's candidate_labels, asked
    for before anything is exported; given, the chosen path answers."""
    import hfport.pipelines as pipelines

    chooser = pipelines.INT8_CHOOSER
    monkeypatch.setattr(pipelines, "INT8_CHOOSER", lambda *a, **k: pytest.fail("exported before refusing"))
    with pytest.raises(ValueError, match="give candidate_labels= to pipeline"):
        hfport.pipeline("zero-shot-classification", model=folders["roberta"], dtype="auto-int8")
    monkeypatch.setattr(pipelines, "INT8_CHOOSER", chooser)
    pipe = hfport.pipeline("zero-shot-classification", model=folders["roberta"], dtype="auto-int8",
                           int8_paths=["torch", "onnx"], candidate_labels=["sports", "phone"])
    result = pipe(TEXTS[0])
    assert sorted(result["labels"]) == ["phone", "sports"] and abs(sum(result["scores"]) - 1) < 1e-5


def test_adapters_in_one_call_equal_each_alone(folders, tmp_path):
    """A LoRA adapter (its own NLI head) over the RoBERTa base, in one call with the base: each text answers as its
    adapter's (or the base's) pipeline alone does."""
    from tests.tiny import make_adapter

    adapter = make_adapter(folders["roberta"], tmp_path / "nli-lora", "text-classification", 4, ["q", "v"], seed=1,
                           id2label=NLI, label2id={v: k for k, v in NLI.items()})
    call = dict(candidate_labels=["sports", "phone", "food"])
    mixed = hfport.pipeline("zero-shot-classification", model=folders["roberta"], adapters={"nli": adapter})(
        TEXTS[:2], adapter=["nli", None], **call)
    assert_same(mixed[0], hfport.pipeline("zero-shot-classification", model=adapter)(TEXTS[0], **call))
    assert_same(mixed[1], hfport.pipeline("zero-shot-classification", model=folders["roberta"])(TEXTS[1], **call))
