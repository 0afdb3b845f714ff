"""hfport.train.metrics: hand-computed cases for every metric, edge cases, and cross-checks against
scikit-learn and seqeval where they are installed (neither is a dependency: those tests skip without them)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from hfport.train import metrics as M

approx = pytest.approx


# ------------------------------------------------------------------------------ single-label classification

# 3 classes. Per class (tp, fp, fn): 0 -> (1, 1, 0), 1 -> (1, 1, 1), 2 -> (1, 0, 1)
# => P = (1/2, 1/2, 1), R = (1, 1/2, 1/2), F1 = (2/3, 1/2, 2/3); 3 of 5 right.
PRED = [0, 1, 2, 1, 0]
GOLD = [0, 2, 2, 1, 1]


def test_classification_by_hand():
    out = M.classification_metrics(PRED, GOLD)
    assert out == approx({"accuracy": 0.6, "f1_macro": 11 / 18, "f1_micro": 0.6,
                          "precision_macro": 2 / 3, "precision_micro": 0.6,
                          "recall_macro": 2 / 3, "recall_micro": 0.6,
                          "f1/0": 2 / 3, "f1/1": 0.5, "f1/2": 2 / 3})
    assert M.accuracy(PRED, GOLD) == approx(0.6)
    assert M.precision_recall_f1(PRED, GOLD, average="macro") == approx((2 / 3, 2 / 3, 11 / 18))
    assert M.precision_recall_f1(PRED, GOLD, average="micro") == approx((0.6, 0.6, 0.6))


def test_classification_absent_label_counts_with_num_labels():
    # class 3 appears in neither array: F1 0 (zero_division=0), still one of the 4 classes in the macro mean
    out = M.classification_metrics(PRED, GOLD, num_labels=4)
    assert out["f1_macro"] == approx(11 / 18 * 3 / 4)
    assert out["f1/3"] == 0.0
    assert out["f1_micro"] == approx(0.6)
    names = ["neg", "neu", "pos", "other"]
    assert M.per_label_f1(PRED, GOLD, label_names=names) == approx({"neg": 2 / 3, "neu": 0.5, "pos": 2 / 3,
                                                                     "other": 0.0})


def test_classification_from_logits_and_tensors():
    logits = np.eye(3)[PRED] * 2.0 - 1.0  # (5, 3), argmax = PRED
    expected = M.classification_metrics(PRED, GOLD, num_labels=3)
    assert M.classification_metrics(logits, GOLD) == expected
    torch = pytest.importorskip("torch")
    assert M.classification_metrics(torch.tensor(logits), torch.tensor(GOLD)) == expected


def test_classification_all_one_class():
    assert M.classification_metrics([1, 1, 1], [1, 1, 1])["f1_macro"] == 1.0  # only class 1 is seen
    out = M.classification_metrics([1, 1, 1], [1, 1, 1], num_labels=2)
    assert out["accuracy"] == 1.0 and out["f1_macro"] == 0.5 and out["f1/0"] == 0.0
    out = M.classification_metrics([0, 0, 0], [1, 1, 1], num_labels=2)
    assert out["accuracy"] == 0.0 and out["f1_macro"] == 0.0 and out["precision_macro"] == 0.0


def test_classification_errors():
    with pytest.raises(ValueError, match="predictions is empty"):
        M.classification_metrics([], [1])
    with pytest.raises(ValueError, match="labels is empty"):
        M.classification_metrics([1], [])
    with pytest.raises(ValueError, match="predictions has 3 items but labels has 2"):
        M.classification_metrics([0, 1, 1], [0, 1])
    with pytest.raises(ValueError, match="labels holds id 5"):
        M.classification_metrics([0, 1], [0, 5], num_labels=3)
    with pytest.raises(ValueError, match="num_labels is 2 but label_names has 3"):
        M.classification_metrics([0, 1], [0, 1], num_labels=2, label_names=["a", "b", "c"])
    with pytest.raises(ValueError, match="4 logits per row but num_labels is 3"):
        M.classification_metrics(np.zeros((2, 4)), [0, 1], num_labels=3)
    with pytest.raises(ValueError, match="labels must hold integer class ids"):
        M.classification_metrics([0, 1], ["neg", "pos"])
    with pytest.raises(ValueError, match="average"):
        M.precision_recall_f1(PRED, GOLD, average="weighted")


@pytest.mark.parametrize("num_labels", [None, 7])
def test_classification_matches_sklearn(num_labels):
    skm = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(0)
    pred, gold = rng.integers(0, 5, 200), rng.integers(0, 5, 200)
    gold[gold == 3] = 4  # a class that is predicted but never true
    out = M.classification_metrics(pred, gold, num_labels=num_labels)
    labels = None if num_labels is None else list(range(num_labels))
    for avg in ("macro", "micro"):
        p, r, f, _ = skm.precision_recall_fscore_support(gold, pred, labels=labels, average=avg, zero_division=0)
        assert (out[f"precision_{avg}"], out[f"recall_{avg}"], out[f"f1_{avg}"]) == approx((p, r, f), abs=1e-12)
    per = skm.f1_score(gold, pred, labels=labels, average=None, zero_division=0)
    assert [v for k, v in out.items() if k.startswith("f1/")] == approx(list(per), abs=1e-12)
    assert out["accuracy"] == approx(skm.accuracy_score(gold, pred))


# -------------------------------------------------------------------------------- multi-label classification

ML_LOGITS = np.array([[2.0, -1.0, 0.5], [-3.0, 1.0, -1.0], [0.1, 0.2, -0.2], [0.0, 0.0, 0.0]])
ML_PRED = np.array([[1, 0, 1], [0, 1, 0], [1, 1, 0], [0, 0, 0]])  # logit > 0; exactly 0 is negative
ML_GOLD = np.array([[1, 0, 1], [0, 1, 0], [1, 0, 0], [0, 0, 1]], dtype=np.float32)  # float, as BCE wants


def test_multilabel_by_hand():
    # columns (tp, fp, fn): (2, 0, 0), (1, 1, 0), (1, 0, 1) -> F1 1, 2/3, 2/3; totals (4, 1, 1)
    expected = {"exact_match": 0.5, "accuracy": 0.5, "f1_macro": 7 / 9, "f1_micro": 0.8,
                "precision_macro": (1 + 0.5 + 1) / 3, "precision_micro": 0.8,
                "recall_macro": (1 + 1 + 0.5) / 3, "recall_micro": 0.8,
                "f1/a": 1.0, "f1/b": 2 / 3, "f1/c": 2 / 3}
    assert M.multilabel_metrics(ML_LOGITS, ML_GOLD, label_names=["a", "b", "c"]) == approx(expected)
    assert M.multilabel_metrics(ML_PRED, ML_GOLD, label_names=["a", "b", "c"]) == approx(expected)
    assert M.multilabel_metrics(ML_PRED.astype(bool), ML_GOLD)["f1/2"] == approx(2 / 3)
    assert M.multilabel_per_label_f1(ML_LOGITS, ML_GOLD) == approx({"0": 1.0, "1": 2 / 3, "2": 2 / 3})
    # a higher threshold on the logits: only 2.0, 1.0 and 0.5 stay positive
    out = M.multilabel_metrics(ML_LOGITS, ML_GOLD, threshold=0.3)
    assert (out["f1/0"], out["f1/1"], out["exact_match"]) == approx((2 / 3, 1.0, 0.5))


def test_multilabel_edge_cases():
    none = np.zeros((3, 2))
    out = M.multilabel_metrics(none, none)  # nothing positive anywhere: every F1 is 0/0 -> 0
    assert out["exact_match"] == 1.0 and out["f1_micro"] == 0.0 and out["f1_macro"] == 0.0
    with pytest.raises(ValueError, match="must both be"):
        M.multilabel_metrics(np.zeros((3, 2)), np.zeros((3, 3)))
    with pytest.raises(ValueError, match="integer predictions must be 0/1"):
        M.multilabel_metrics(np.array([[2, 0]]), np.array([[1, 0]]))
    with pytest.raises(ValueError, match="labels must be 0/1"):
        M.multilabel_metrics(np.zeros((1, 2)), np.array([[0.5, 0]]))
    with pytest.raises(ValueError, match="label_names has 2 names but predictions has 3 columns"):
        M.multilabel_metrics(ML_LOGITS, ML_GOLD, label_names=["a", "b"])
    with pytest.raises(ValueError, match="predictions is empty"):
        M.multilabel_metrics(np.zeros((0, 2)), np.zeros((0, 2)))


def test_multilabel_matches_sklearn():
    skm = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(1)
    logits, gold = rng.normal(size=(100, 6)), rng.integers(0, 2, (100, 6))
    gold[:, 5] = 0  # a label never true
    out = M.multilabel_metrics(logits, gold)
    pred = (logits > 0).astype(int)
    for avg in ("macro", "micro"):
        p, r, f, _ = skm.precision_recall_fscore_support(gold, pred, average=avg, zero_division=0)
        assert (out[f"precision_{avg}"], out[f"recall_{avg}"], out[f"f1_{avg}"]) == approx((p, r, f), abs=1e-12)
    assert out["exact_match"] == approx(skm.accuracy_score(gold, pred))  # sklearn's subset accuracy


# ------------------------------------------------------------------------------------------------ regression

def test_regression_by_hand():
    # errors (0, 0, -2); mean target 8/3, ss_tot = 78/9, ss_res = 4 -> R² = 1 - 36/78 = 7/13
    assert M.regression_metrics([1.0, 2.0, 3.0], [1.0, 2.0, 5.0]) == approx({"mse": 4 / 3, "mae": 2 / 3,
                                                                             "r2": 7 / 13})
    # the head's (N, 1) output against (N,) labels
    assert M.regression_metrics(np.array([[1.0], [2.0], [3.0]]), [1.0, 2.0, 5.0])["r2"] == approx(7 / 13)


def test_regression_constant_target_and_tiny_inputs():
    assert M.regression_metrics([2.0, 2.0, 2.0], [2.0, 2.0, 2.0])["r2"] == 1.0  # sklearn: perfect -> 1
    assert M.regression_metrics([1.0, 2.0, 3.0], [2.0, 2.0, 2.0])["r2"] == 0.0  # sklearn: else 0
    assert math.isnan(M.regression_metrics([1.0], [2.0])["r2"])  # sklearn: undefined under two samples
    with pytest.raises(ValueError, match="predictions has 2 items but labels has 3"):
        M.regression_metrics([1.0, 2.0], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="labels is empty"):
        M.regression_metrics([1.0], [])
    with pytest.raises(ValueError, match="2 outputs per row but labels has 3"):
        M.regression_metrics(np.zeros((4, 2)), np.zeros((4, 3)))


def test_regression_matches_sklearn():
    skm = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(2)
    pred, gold = rng.normal(size=(50, 3)), rng.normal(size=(50, 3))
    gold[:, 2] = 1.5  # a constant output, averaged with the others as sklearn does
    out = M.regression_metrics(pred, gold)
    assert out["mse"] == approx(skm.mean_squared_error(gold, pred))
    assert out["mae"] == approx(skm.mean_absolute_error(gold, pred))
    assert out["r2"] == approx(skm.r2_score(gold, pred))
    assert M.regression_metrics(pred[:, 0], gold[:, 0])["r2"] == approx(skm.r2_score(gold[:, 0], pred[:, 0]))


# --------------------------------------------------------------------------------------- token classification

NER_GOLD = [["B-PER", "I-PER", "O", "B-LOC"], ["O", "B-ORG", "I-ORG", "O"]]
NER_PRED = [["B-PER", "I-PER", "O", "B-ORG"], ["O", "B-ORG", "O", "O"]]


def test_entities_lenient_like_seqeval_default():
    E = M.Entity
    assert M.get_entities(["B-PER", "I-PER", "O", "B-LOC"]) == [E("PER", 0, 1), E("LOC", 3, 3)]
    # I- after O starts an entity; I- of another type closes the open one and starts its own
    assert M.get_entities(["O", "I-PER", "I-PER", "I-LOC", "B-LOC", "I-LOC"]) == [
        E("PER", 1, 2), E("LOC", 3, 3), E("LOC", 4, 5)]
    assert M.get_entities(["B-PER", "I-LOC"]) == [E("PER", 0, 0), E("LOC", 1, 1)]
    assert M.get_entities(["B-PER", "B-PER", "I-PER"]) == [E("PER", 0, 0), E("PER", 1, 2)]
    assert M.get_entities(["S-PER", "B-LOC", "E-LOC"]) == [E("PER", 0, 0), E("LOC", 1, 2)]  # IOBES too
    assert M.get_entities(["B-PER", "I-PER"]) == [E("PER", 0, 1)]  # open at the end: closed
    assert M.get_entities(["O", "O"]) == []


def test_token_classification_by_hand():
    # gold PER, LOC, ORG[1:2]; predicted PER, ORG (where LOC is), ORG[1:1] -> only PER is right
    out = M.token_classification_metrics(NER_PRED, NER_GOLD)
    assert out == approx({"precision": 1 / 3, "recall": 1 / 3, "f1": 1 / 3, "accuracy": 6 / 8,
                          "f1/LOC": 0.0, "f1/ORG": 0.0, "f1/PER": 1.0})
    assert M.entity_f1_per_type(NER_PRED, NER_GOLD) == approx({"LOC": 0.0, "ORG": 0.0, "PER": 1.0})
    # precision and recall are not swapped: 1 of 1 predicted right, 1 of 2 gold found
    out = M.token_classification_metrics([["B-PER", "O", "O"]], [["B-PER", "O", "B-LOC"]])
    assert (out["precision"], out["recall"], out["f1"]) == approx((1.0, 0.5, 2 / 3))


def test_token_classification_lenient_spans_count_as_entities():
    # the prediction's I-PER after O opens an entity with the gold span: a hit in seqeval's default mode
    out = M.token_classification_metrics([["O", "I-PER", "I-PER"]], [["O", "B-PER", "I-PER"]])
    assert out["f1"] == 1.0


def test_token_classification_no_entities():
    out = M.token_classification_metrics([["O", "O"]], [["O", "O"]])
    assert out == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "accuracy": 1.0}


def test_token_classification_errors():
    with pytest.raises(ValueError, match="predictions is empty"):
        M.token_classification_metrics([], [["O"]])
    with pytest.raises(ValueError, match="predictions has 1 items but labels has 2"):
        M.token_classification_metrics([["O"]], [["O"], ["O"]])
    with pytest.raises(ValueError, match="sequence 1: predictions has 1 tags but labels has 2"):
        M.token_classification_metrics([["O"], ["O"]], [["O"], ["O", "O"]])
    with pytest.raises(ValueError, match="flat list"):
        M.token_classification_metrics(["B-PER", "O"], ["B-PER", "O"])


def test_tags_from_ids_drops_ignored_positions():
    id2label = {0: "O", 1: "B-PER", 2: "I-PER"}
    labels = np.array([[-100, 1, 2, 0, -100], [-100, 0, 1, -100, -100]])
    pred_ids = np.array([[2, 1, 2, 1, 0], [0, 0, 1, 2, 2]])
    logits = np.eye(3)[pred_ids]  # (B, T, L)
    expected = ([["B-PER", "I-PER", "B-PER"], ["O", "B-PER"]], [["B-PER", "I-PER", "O"], ["O", "B-PER"]])
    assert M.tags_from_ids(pred_ids, labels, id2label) == expected
    assert M.tags_from_ids(logits, labels, id2label) == expected
    assert M.tags_from_ids(pred_ids, labels, {"0": "O", "1": "B-PER", "2": "I-PER"}) == expected  # JSON keys
    assert M.tags_from_ids(pred_ids, labels, ["O", "B-PER", "I-PER"]) == expected
    ragged = M.tags_from_ids([[1, 2], [0]], [[1, -100], [0]], id2label)
    assert ragged == ([["B-PER"], ["O"]], [["B-PER"], ["O"]])
    with pytest.raises(ValueError, match="predictions holds id 7"):
        M.tags_from_ids([[7]], [[0]], id2label)
    with pytest.raises(ValueError, match="sequence 0: predictions has 2 positions but labels has 3"):
        M.tags_from_ids([[0, 0]], [[0, 0, 0]], id2label)


def test_token_classification_matches_seqeval():
    seqeval = pytest.importorskip("seqeval.metrics")
    rng = np.random.default_rng(3)
    tags = ["O", "O", "O", "B-PER", "I-PER", "B-LOC", "I-LOC", "I-MISC", "B-MISC"]
    for _ in range(20):
        gold = [list(rng.choice(tags, rng.integers(1, 12))) for _ in range(8)]
        pred = [list(rng.choice(tags, len(s))) for s in gold]
        out = M.token_classification_metrics(pred, gold)
        assert out["precision"] == approx(seqeval.precision_score(gold, pred, zero_division=0))
        assert out["recall"] == approx(seqeval.recall_score(gold, pred, zero_division=0))
        assert out["f1"] == approx(seqeval.f1_score(gold, pred, zero_division=0))
        assert out["accuracy"] == approx(seqeval.accuracy_score(gold, pred))
        report = seqeval.classification_report(gold, pred, output_dict=True, zero_division=0)
        per_type = {k[3:]: v for k, v in out.items() if k.startswith("f1/")}
        assert per_type == approx({k: v["f1-score"] for k, v in report.items() if " avg" not in k})


# ------------------------------------------------------------------------------------------------ SQuAD (QA)

def test_normalize_answer():
    assert M.normalize_answer("The  Quick, brown fox!") == "quick brown fox"
    assert M.normalize_answer("An apple a day") == "apple day"
    assert M.normalize_answer("theater") == "theater"  # articles only as whole words
    assert M.normalize_answer(" A.") == ""


def test_squad_by_hand():
    golds = ["a cat sat on the mat", "Cat"]
    # "cat sat" vs "cat sat on mat": P 1, R 1/2 -> 2/3; vs "cat": P 1/2, R 1 -> 2/3
    assert M.squad_f1("the cat sat", golds) == approx(2 / 3)
    assert M.squad_exact_match("the cat sat", golds) == 0.0
    assert M.squad_exact_match("CAT.", golds) == 1.0  # max over golds, after normalisation
    assert M.squad_f1("dog", golds) == 0.0
    # repeated tokens count once per match (Counter intersection): "the the cat" -> "cat"
    assert M.squad_f1("cat cat", ["cat"]) == approx(2 * 0.5 * 1 / 1.5)
    out = M.squad_metrics(["the cat sat", "Paris"], [golds, ["paris", "Paris, France"]])
    assert out == approx({"exact_match": 0.5, "f1": (2 / 3 + 1) / 2})


def test_squad_v2_no_answer():
    assert M.squad_exact_match("", []) == 1.0 and M.squad_f1("", []) == 1.0
    assert M.squad_exact_match("cat", []) == 0.0 and M.squad_f1("cat", []) == 0.0
    assert M.squad_exact_match("", ["cat"]) == 0.0 and M.squad_f1("", ["cat"]) == 0.0
    assert M.squad_f1("", ["The"]) == 1.0  # a gold that normalises to nothing is no answer (v2 script)
    out = M.squad_metrics(["", "cat", "cat"], [[], {"text": ["the cat"], "answer_start": [3]}, []])
    assert out == approx({"exact_match": 2 / 3, "f1": 2 / 3})


def test_squad_errors():
    with pytest.raises(ValueError, match="predictions is empty"):
        M.squad_metrics([], [["a"]])
    with pytest.raises(ValueError, match="predictions has 1 items but answers has 2"):
        M.squad_metrics(["a"], [["a"], ["b"]])
    with pytest.raises(ValueError, match="answer strings"):
        M.squad_metrics([1], [["a"]])


# ------------------------------------------------------------------------------------------------- masked LM

def test_perplexity():
    assert M.perplexity(0.0) == 1.0
    assert M.perplexity(math.log(10.0)) == approx(10.0)
    assert M.perplexity(709.0) == approx(math.exp(709.0))
    assert M.perplexity(1e4) == math.inf  # exp would overflow
    assert math.isnan(M.perplexity(math.nan))
    with pytest.raises(ValueError, match="mean_loss"):
        M.perplexity(-0.5)


def test_masked_accuracy():
    labels = np.array([[-100, 5, -100, 7], [3, -100, -100, -100]])
    pred = np.array([[1, 5, 2, 0], [3, 9, 9, 9]])
    assert M.masked_accuracy(pred, labels) == approx(2 / 3)
    assert M.masked_accuracy(np.eye(10)[pred], labels) == approx(2 / 3)  # (B, T, V) logits
    with pytest.raises(ValueError, match="no position other than ignore_index"):
        M.masked_accuracy([[1]], [[-100]])


def test_masked_lm_loss_from_logits():
    rng = np.random.default_rng(4)
    logits = rng.normal(size=(2, 5, 7)) * 3
    labels = np.array([[-100, 3, -100, 6, 0], [1, -100, -100, -100, -100]])
    keep = labels != -100
    z = logits[keep]
    nll = np.log(np.exp(z).sum(1)) - z[np.arange(len(z)), labels[keep]]
    assert M.masked_lm_loss(logits, labels) == approx(nll.mean())
    assert M.masked_lm_loss(logits, labels, chunk_rows=1) == approx(nll.mean())
    assert M.masked_lm_loss(np.array([[[1000.0, 0.0]]]), np.array([[1]])) == approx(1000.0)  # no overflow
    torch = pytest.importorskip("torch")
    ref = torch.nn.functional.cross_entropy(torch.tensor(logits).reshape(-1, 7), torch.tensor(labels).reshape(-1))
    assert M.masked_lm_loss(logits, labels) == approx(ref.item())
    with pytest.raises(ValueError, match="outside the vocabulary of 7"):
        M.masked_lm_loss(logits, np.full((2, 5), 9))
    with pytest.raises(ValueError, match="vocabulary axis"):
        M.masked_lm_loss(logits[0], labels)


# ------------------------------------------------------------------------------------------------ dispatcher

def test_compute_metrics_keys_per_task():
    cls = M.compute_metrics("sequence-classification", "single_label_classification", predictions=PRED,
                            labels=GOLD, label_names=["a", "b", "c"])
    assert set(cls) == {"accuracy", "f1_macro", "f1_micro", "precision_macro", "precision_micro", "recall_macro",
                        "recall_micro", "f1/a", "f1/b", "f1/c"}
    ml = M.compute_metrics("sequence-classification", "multi_label_classification", predictions=ML_LOGITS,
                           labels=ML_GOLD)
    assert set(ml) == {"exact_match", "accuracy", "f1_macro", "f1_micro", "precision_macro", "precision_micro",
                       "recall_macro", "recall_micro", "f1/0", "f1/1", "f1/2"}
    reg = M.compute_metrics("sequence-classification", "regression", predictions=[1.0, 2.0], labels=[1.0, 3.0])
    assert set(reg) == {"mse", "mae", "r2"}
    tok = M.compute_metrics("token-classification", predictions=NER_PRED, labels=NER_GOLD)
    assert tok == M.token_classification_metrics(NER_PRED, NER_GOLD)
    tok_ids = M.compute_metrics("token-classification", predictions=[[1, 2, 0]], labels=[[1, 2, -100]],
                                id2label=["O", "B-PER", "I-PER"])
    assert tok_ids == {"precision": 1.0, "recall": 1.0, "f1": 1.0, "accuracy": 1.0, "f1/PER": 1.0}
    # label_names (names in id order, as the training loop passes them) stand in for id2label; logits work
    tok_logits = M.compute_metrics("token-classification", predictions=np.eye(3)[[[1, 2, 0]]],
                                   labels=np.array([[1, 2, -100]]), label_names=["O", "B-PER", "I-PER"])
    assert tok_logits == tok_ids
    assert M.compute_metrics("token-classification", predictions=NER_PRED, labels=NER_GOLD,
                             label_names=["O", "B-PER"]) == tok  # tag strings are used as they are
    qa = M.compute_metrics("question-answering", predictions=["cat"], labels=[["the cat"]])
    assert qa == {"exact_match": 1.0, "f1": 1.0}
    mlm = M.compute_metrics("masked-lm", loss=math.log(4.0))
    assert mlm == approx({"loss": math.log(4.0), "perplexity": 4.0})
    mlm = M.compute_metrics("masked-lm", loss=1.0, predictions=[[1, 2]], labels=[[1, -100]])
    assert set(mlm) == {"loss", "perplexity", "accuracy"} and mlm["accuracy"] == 1.0
    mlm_logits = np.log([[[0.25, 0.75], [0.5, 0.5]]])  # (1, 2, V=2); the second position is ignored
    mlm = M.compute_metrics("masked-lm", predictions=mlm_logits, labels=[[0, -100]])
    assert mlm == approx({"loss": math.log(4.0), "perplexity": 4.0, "accuracy": 0.0})
    for out in (cls, ml, reg, tok, qa, mlm):
        assert all(type(v) is float for v in out.values())


def test_compute_metrics_infers_problem_type_as_transformers_does():
    logits = np.eye(3)[PRED]
    assert M.compute_metrics("sequence-classification", predictions=logits, labels=np.array(GOLD)) == \
        M.classification_metrics(logits, GOLD)
    assert "exact_match" in M.compute_metrics("sequence-classification", predictions=ML_LOGITS, labels=ML_GOLD)
    assert "r2" in M.compute_metrics("sequence-classification", predictions=np.zeros((3, 1)),
                                     labels=np.array([0.0, 1.0, 2.0]))


def test_compute_metrics_errors_list_the_valid_values():
    with pytest.raises(ValueError, match="valid tasks.*masked-lm"):
        M.compute_metrics("summarization", predictions=[1], labels=[1])
    with pytest.raises(ValueError, match="valid.*regression"):
        M.compute_metrics("sequence-classification", "multi_class", predictions=[1], labels=[1])
    with pytest.raises(ValueError, match="need loss.*or logits"):
        M.compute_metrics("masked-lm")
    with pytest.raises(ValueError, match="id2label"):
        M.compute_metrics("token-classification", predictions=[[1, 2]], labels=[[1, 2]])


# ------------------------------------------------------------------------------ history and early stopping

def test_metric_history():
    h = M.MetricHistory([(10, 1.0), (20, 2.0), (30, 4.0), (40, 4.0)])
    assert h.best("max") == M.Point(30, 4.0)  # earliest of the ties
    assert h.best("min") == (10, 1.0)
    assert h.slope(3) == approx(np.polyfit([20, 30, 40], [2.0, 4.0, 4.0], 1)[0])
    assert h.slope(3) == approx(0.1)
    assert h.slope(100) == approx(np.polyfit(h.steps, h.values, 1)[0])  # fewer evals than asked: all of them
    assert M.MetricHistory().best() is None
    with pytest.raises(ValueError, match="not after the last recorded step 40"):
        h.append(40, 5.0)
    with pytest.raises(ValueError, match="at least 2 evals"):
        M.MetricHistory([(1, 1.0)]).slope(5)
    with pytest.raises(ValueError, match="mode must be one of"):
        h.best("maximum")


def test_metric_history_stalled_and_converged():
    h = M.MetricHistory(enumerate([0.50, 0.60, 0.61, 0.605]))
    assert not h.stalled(patience=2)  # 0.61 beat 0.60 within the last two
    assert h.stalled(patience=2, threshold=0.02)  # ... but not by more than 0.02
    assert h.stalled(patience=1)  # 0.605 < 0.61
    assert not h.stalled(patience=4)  # nothing before the window to compare against
    assert h.stalled(patience=2, mode="min")  # nothing went below 0.50
    assert not M.MetricHistory(enumerate([1.0, 0.9, 0.8])).stalled(patience=2, mode="min")
    assert h.converged(window=3, tolerance=0.011) and not h.converged(window=3, tolerance=0.009)
    assert not h.converged(window=5, tolerance=1.0)  # not enough evals yet
    assert not M.MetricHistory(enumerate([1.0, math.nan])).converged(2, 1.0)


def test_metric_history_state_round_trip():
    h = M.MetricHistory([(1, 0.5), (2, 0.25)])
    restored = M.MetricHistory()
    restored.load_state_dict(json.loads(json.dumps(h.state_dict())))
    assert restored.points == h.points


def test_early_stopping_max():
    es = M.EarlyStopping("accuracy", mode="max", patience=2)
    assert [es.update(v) for v in (0.5, 0.6, 0.6)] == [True, True, False]  # equal is not better
    assert not es.should_stop and es.best == 0.6
    assert not es.update(0.55) and es.should_stop
    assert es.update(0.7) and not es.should_stop and es.num_bad_evals == 0  # a later improvement resets


def test_early_stopping_thresholds_and_min_mode():
    es = M.EarlyStopping("f1", threshold=0.01)
    assert es.update(0.6) and not es.update(0.605) and es.update(0.62)
    rel = M.EarlyStopping("r2", threshold=0.1, threshold_mode="rel")
    assert rel.update(-1.0) and not rel.update(-0.95) and rel.update(-0.85)  # needs > best + 0.1 * |best|
    es = M.EarlyStopping("loss", mode="min", patience=1, threshold=0.1)
    assert es.update(1.0) and es.update(0.85) and not es.update(0.8) and es.should_stop
    es = M.EarlyStopping("loss", mode="min")
    assert not es.update(math.nan) and es.best is None  # nan never improves
    with pytest.raises(ValueError, match="mode must be one of"):
        M.EarlyStopping("loss", mode="down")
    with pytest.raises(ValueError, match="patience"):
        M.EarlyStopping("loss", patience=0)
    with pytest.raises(ValueError, match="threshold_mode"):
        M.EarlyStopping("loss", threshold_mode="percent")


def test_early_stopping_update_from_metrics_dict():
    es = M.EarlyStopping("f1")
    assert es.update_from({"f1": 0.3, "loss": 1.0}, step=100) and es.best_step == 100
    with pytest.raises(KeyError, match="'f1' is not among the eval metrics \\['loss'\\]"):
        es.update_from({"loss": 1.0})


def test_early_stopping_state_round_trip_resumes_exactly():
    values = [0.5, 0.7, 0.65, 0.66, 0.64, 0.8, 0.79, 0.78]
    straight = M.EarlyStopping("f1", patience=3, threshold=0.005)
    for step, v in enumerate(values):
        straight.update(v, step)

    first = M.EarlyStopping("f1", patience=3, threshold=0.005)
    for step, v in enumerate(values[:4]):
        first.update(v, step)
    saved = json.dumps(first.state_dict())
    resumed = M.EarlyStopping("f1", patience=3, threshold=0.005)
    resumed.load_state_dict(json.loads(saved))
    assert resumed.state_dict() == first.state_dict()
    for step, v in enumerate(values[4:], start=4):
        resumed.update(v, step)
    assert resumed.state_dict() == straight.state_dict()
    assert (resumed.best, resumed.best_step, resumed.num_bad_evals) == (0.8, 5, 2)

    with pytest.raises(ValueError, match="tracks metric 'f1'"):
        M.EarlyStopping("accuracy").load_state_dict(first.state_dict())
    with pytest.raises(ValueError, match="tracks mode 'max'"):
        M.EarlyStopping("f1", mode="min").load_state_dict(first.state_dict())
