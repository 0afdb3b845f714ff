"""sentence-embedding: the losses against sentence-transformers' own, duplicate masking, GradCache chunks, the
retrieval/correlation metrics, training end to end into the sentence-transformers layout (proven by
SentenceTransformer.encode through `verify`), the pipeline's pooling defaults, bad input, and an HTTP job.

A tiny random BERT with the real MiniLM WordPiece tokenizer; the examples/data retrieval files (real text).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import hfport
from hfport.errors import ConfigError
from hfport.export import read_st_pooling, verify
from hfport.train.config import FinetuneConfig
from hfport.train.data import DataError
from hfport.train.loop import finetune
from hfport.train.metrics.retrieval import correlation_metrics, ranking_metrics, retrieval_metrics
from hfport.train.preflight import preflight
from hfport.train.tasks.embedding import cosent_loss, mnrl_loss
from tests.data import DATA, write_jsonl
from tests.finetuning import embedding_config as cfg

torch.set_num_threads(1)


# --- losses -----------------------------------------------------------------------------------------------------


def test_mnrl_matches_sentence_transformers_without_duplicates():
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    g = torch.Generator().manual_seed(0)
    a, p, n = (torch.randn(6, 8, generator=g) for _ in range(3))  # anchors, positives, hard negatives
    reference = MultipleNegativesRankingLoss(model=None, scale=20.0)
    for with_negatives in (False, True):
        parts = [a, p, n] if with_negatives else [a, p]
        embeddings = torch.cat(parts)  # (U, C): every text distinct
        index = torch.arange(len(embeddings)).view(len(parts), 6).T  # (B, K): anchor, positive, negative rows
        theirs = reference.compute_loss_from_embeddings(parts, None)
        torch.testing.assert_close(mnrl_loss(embeddings, index, 20.0), theirs, rtol=1e-6, atol=1e-6)


def test_mnrl_masks_duplicates_instead_of_counting_them_as_negatives():
    g = torch.Generator().manual_seed(1)
    emb = torch.randn(5, 8, generator=g)  # rows: 0,1 anchors; 2,3 positives; 4 a third anchor
    # examples 0 and 1 share the positive text (row 2): it is one candidate, the right one for both
    shared = mnrl_loss(emb, torch.tensor([[0, 2], [1, 2], [4, 3]]), 20.0)
    scores = torch.nn.functional.normalize(emb[[0, 1, 4]], dim=-1) @ torch.nn.functional.normalize(emb[[2, 3]],
                                                                                               dim=-1).T * 20
    expected = torch.nn.functional.cross_entropy(scores, torch.tensor([0, 0, 1]))
    torch.testing.assert_close(shared, expected)
    # examples 0 and 1 share the anchor text (row 0) with two different positives: neither is the other's negative
    same_anchor = mnrl_loss(emb, torch.tensor([[0, 2], [0, 3], [4, 1]]), 20.0)
    s = torch.nn.functional.normalize(emb[[0, 0, 4]], dim=-1) @ torch.nn.functional.normalize(emb[[1, 2, 3]],
                                                                                           dim=-1).T * 20
    s[0, 2] = s[1, 1] = float("-inf")  # columns: rows 1, 2, 3
    expected = torch.nn.functional.cross_entropy(s, torch.tensor([1, 2, 0]))
    torch.testing.assert_close(same_anchor, expected)
    unmasked = torch.nn.functional.cross_entropy(
        torch.nn.functional.normalize(emb[[0, 0, 4]], dim=-1) @ torch.nn.functional.normalize(emb[[1, 2, 3]],
                                                                                          dim=-1).T * 20,
        torch.tensor([1, 2, 0]))
    assert not torch.isclose(same_anchor, unmasked)  # the mask changed something


def test_cosent_matches_sentence_transformers():
    from sentence_transformers.sentence_transformer.losses import CoSENTLoss

    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(7, 8, generator=g), torch.randn(7, 8, generator=g)
    scores = torch.tensor([0.1, 0.9, 0.5, 0.5, 0.0, 1.0, 0.3])  # ties included
    theirs = CoSENTLoss(model=None, scale=20.0).compute_loss_from_embeddings([a, b], scores)
    ours = cosent_loss(torch.cat([a, b]), torch.stack([torch.arange(7), torch.arange(7, 14)], 1), scores, 20.0)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_gradcache_chunks_give_the_whole_batch_gradient(tiny_bert, tmp_path):
    """mini_batch_size embeds in checkpointed chunks: the loss and every gradient equal one whole-batch pass."""
    checked = preflight(cfg(tiny_bert, tmp_path, batch_size=12))
    task, data = checked.task, checked.data
    batch = task.collate(data.train[:12], data, seed=0)
    grads = []
    for chunk in (None, 5):
        data.extra["mini_batch_size"] = chunk
        model = hfport.AutoModel.from_pretrained(tiny_bert).train()
        loss = task.loss(task.forward(model, batch, data), batch, data, None, 0.0)
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (l0, g0), (l1, g1) = grads
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    assert g0.keys() == g1.keys() and len(g0) > 10
    for name in g0:  # summation order differs between chunked and whole passes
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-6, msg=name)


def test_embedding_batch_loss_and_gradients_are_the_same_on_every_attention_path(tiny_bert, tmp_path, monkeypatch):
    """An MNRL batch of real (question, answer) texts: per-run attention calls, one padded call, the padded groups by
    length, and the padded layout (no packing at all) give the same loss and every gradient (fp32; the paths differ
    only in summation order)."""
    from hfport.nn import groups as groups_module

    checked = preflight(cfg(tiny_bert, tmp_path, batch_size=16))
    task, data = checked.task, checked.data
    batch = task.collate(data.train[:16], data, seed=0)
    assert len(set(batch["attention_mask"].sum(1).tolist())) > 4  # texts of many lengths
    model = hfport.AutoModel.from_pretrained(tiny_bert).train()
    results = {}
    for path in ("runs", "padded", "groups", "padded layout"):
        monkeypatch.setattr(groups_module, "PACKED_ATTENTION", "auto" if path == "groups" else path)
        # free calls and no scatter cost: the rule cuts a group per distinct length
        monkeypatch.setattr(groups_module, "CALL_COST", 0 if path == "groups" else 1_300_000)
        monkeypatch.setattr(groups_module, "SCATTER_COST", -1 if path == "groups" else 100)
        model.padding_free = path != "padded layout"
        if path == "groups":
            groups = groups_module.plan_groups(model.body.plan(batch["input_ids"], batch["attention_mask"]),
                                                model.config.hidden_size)
            assert len(groups.shapes) > 4
        model.zero_grad()
        loss = task.loss(task.forward(model, batch, data), batch, data, None, 0.0)
        loss.backward()
        results[path] = loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    reference_loss, reference_grads = results.pop("padded layout")
    for path, (loss, grads) in results.items():
        torch.testing.assert_close(loss, reference_loss, rtol=1e-5, atol=1e-5, msg=path)
        assert grads.keys() == reference_grads.keys() and len(grads) > 10
        for name in grads:
            torch.testing.assert_close(grads[name], reference_grads[name], rtol=1e-5, atol=1e-5,
                                       msg=lambda m, path=path, name=name: f"{path} {name}: {m}")


# --- metrics ----------------------------------------------------------------------------------------------------


def test_ranking_metrics_by_hand():
    scores = [np.array([0.9, 0.8, 0.1, 0.5]), np.array([0.2, 0.7, 0.6])]
    gains = [np.array([0, 1, 0, 1]), np.array([1, 0, 0])]
    m = ranking_metrics(scores, gains)
    # query 0: ranking d0 d1 d3 d2 -> first relevant at rank 2; query 1: d1 d2 d0 -> rank 3
    assert m["mrr@10"] == pytest.approx((1 / 2 + 1 / 3) / 2)
    ndcg0 = (1 / np.log2(3) + 1 / np.log2(4)) / (1 + 1 / np.log2(3))
    ndcg1 = (1 / np.log2(4)) / 1
    assert m["ndcg@10"] == pytest.approx((ndcg0 + ndcg1) / 2)
    assert m["recall@1"] == 0.0 and m["recall@10"] == 1.0
    with pytest.raises(ValueError, match="q7: no relevant document"):
        ranking_metrics([np.array([0.1, 0.2])], [np.array([0, 0])], names=["q7"])
    # embeddings: the query is nearest to document 1, its relevant one
    r = retrieval_metrics(np.array([[1.0, 0.0]]), np.array([[0.0, 1.0], [0.9, 0.1]]), [[1]])
    assert r["mrr@10"] == 1.0 and r["recall@1"] == 1.0


def test_spearman_matches_scipy():
    from scipy import stats

    rng = np.random.default_rng(0)
    pred, gold = rng.normal(size=40), np.round(rng.uniform(0, 5, size=40))  # ties in the gold scores
    m = correlation_metrics(pred, gold)
    assert m["spearman"] == pytest.approx(stats.spearmanr(pred, gold).statistic, abs=1e-12)
    assert m["pearson"] == pytest.approx(stats.pearsonr(pred, gold).statistic, abs=1e-12)


# --- training end to end, the layout and its proof --------------------------------------------------------------


def test_triplets_train_into_a_sentence_transformers_folder_that_verifies(tiny_bert, tmp_path):
    c = cfg(tiny_bert, tmp_path, max_steps=30, eval_strategy="steps", eval_steps=10, pooling="max", normalize=True)
    summary = finetune(c, progress=False)
    evals = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if json.loads(x)["type"] == "eval"]
    assert summary["problem_type"] == "pairs" and list(summary["best_metric"]) == ["ndcg@10"]
    assert {"eval_mrr@10", "eval_ndcg@10", "eval_recall@1", "eval_recall@10"} <= set(evals[-1])
    assert evals[-1]["eval_ndcg@10"] > evals[0]["eval_ndcg@10"] and evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    for which in ("best", "final"):
        folder = tmp_path / "run" / which
        assert read_st_pooling(folder) == ("max", True) and (folder / "2_Normalize").is_dir()
    # the sentence-embedding pipeline pools as the folder says; sentence-transformers agrees (verify fails closed
    # otherwise)
    pipe = hfport.pipeline("sentence-embedding", model=tmp_path / "run" / "best")
    vector = np.asarray(pipe("What is the capital of Peru?"))
    assert vector.shape == (32,) and abs(np.linalg.norm(vector) - 1) < 1e-5
    report = verify(tmp_path / "run" / "best", tmp_path / "run")
    st_rows = [r for r in report.rows if r.check == "sentence-transformers"]
    assert report.passed, report.table()
    assert {r.output for r in st_rows} >= {"pooling", "encode/cosine", "encode/values"}
    # `hfport export` keeps the layout; a folder whose pooling was edited no longer verifies
    out = hfport.export(tmp_path / "run", tmp_path / "export", verify=True)
    assert {"modules.json", "sentence_bert_config.json", "1_Pooling", "2_Normalize"} <= set(out.files)
    pooling = tmp_path / "export" / "1_Pooling" / "config.json"
    values = json.loads(pooling.read_text())
    values["pooling_mode_max_tokens"], values["pooling_mode_mean_tokens"] = False, True
    pooling.write_text(json.dumps(values))
    bad = verify(tmp_path / "export", tmp_path / "run")
    assert not bad.passed and any(r.check == "sentence-transformers" and not r.passed for r in bad.rows)


def test_scored_pairs_train_with_cosent_and_spearman(tiny_bert, tmp_path):
    rows = [json.loads(x) for x in (DATA / "embed_train.jsonl").read_text().splitlines()]
    scored = [{"sentence1": r["anchor"], "sentence2": r["positive"], "score": 1.0} for r in rows[:60]] + \
             [{"sentence1": r["anchor"], "sentence2": r["negative"], "score": 0.4} for r in rows[60:120]]
    train = write_jsonl(tmp_path / "sts.jsonl", scored)
    summary = finetune(cfg(tiny_bert, tmp_path, train=str(train), eval=None, eval_fraction=0.25, max_steps=4,
                           grad_accum=2, batch_size=8), progress=False)
    assert summary["problem_type"] == "scored-pairs" and list(summary["best_metric"]) == ["spearman"]
    assert {"eval_spearman", "eval_pearson"} <= set(summary["final_eval"])
    assert read_st_pooling(tmp_path / "run" / "best") == ("mean", False)  # the tiny base has no ST config
    assert not (tmp_path / "run" / "best" / "2_Normalize").exists()


def test_pooling_defaults_come_from_the_base_models_sentence_transformers_config(minilm_path, tmp_path):
    checked = preflight(FinetuneConfig(model=str(minilm_path), task="sentence-embedding",
                                       train=str(DATA / "embed_train.jsonl"), output_dir=str(tmp_path / "r")))
    assert (checked.data.extra["pooling"], checked.data.extra["normalize"]) == ("mean", True)
    assert checked.data.extra["loss"] == "mnrl" and checked.data.problem_type == "pairs"


# --- bad input --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows, options, fragment", [
    ([{"anchor": "a b", "positive": "c d", "negative": "e"}, {"anchor": "f", "positive": "g"}], {},
     "line 2, field 'negative': missing"),
    ([{"anchor": "a b", "positive": "   "}, {"anchor": "f", "positive": "g"}], {},
     "line 1, field 'positive': expected non-empty text"),
    ([{"sentence1": "a", "sentence2": "b", "score": 0.5}, {"sentence1": "c", "sentence2": "d", "score": 4.0}], {},
     "line 2, field 'score': score 4.0 is outside score_range [0.0, 1.0]"),
    ([{"anchor": "a", "positive": "b"}, {"anchor": "c", "positive": "d"}], {"batch_size": 1},
     "batch_size 1 gives no in-batch negatives"),
    ([{"anchor": "a", "positive": "b"}, {"anchor": "c", "positive": "d"}], {"loss": "listwise"},
     "loss 'listwise' does not fit"),
    ([{"text": "a", "label": 1}], {}, "no columns 'anchor', 'positive'; the row has ['label', 'text']"),
    # `hfport mine --output-format labeled-pair` rows: the mined negative (label 0) would train as a positive
    ([{"anchor": "a", "positive": "b", "label": 1}, {"anchor": "a", "positive": "c", "label": 0}], {},
     "line 2, field 'label': 0 marks a pair that is not relevant"),
])
def test_bad_embedding_data_is_named(tiny_bert, tmp_path, rows, options, fragment):
    train = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises((DataError, ConfigError)) as e:
        preflight(cfg(tiny_bert, tmp_path, **{"train": str(train), "eval": None, "eval_fraction": 0.0,
                                               "batch_size": 2, **options}))
    assert fragment in str(e.value) and (fragment.startswith(("batch_size", "loss")) or "bad.jsonl" in str(e.value))
    assert not (tmp_path / "run").exists()


def test_score_range_must_be_ordered(tiny_bert, tmp_path):
    with pytest.raises(ValueError, match="score_range"):
        cfg(tiny_bert, tmp_path, score_range=(1.0, 0.0))


# --- over HTTP --------------------------------------------------------------------------------------------------


def test_http_finetune_job_trains_an_embedding_model(tmp_path, tiny_bert):
    import httpx

    from tests.serving import Server, wait_job

    root = tmp_path / "allowed"
    (root / "data").mkdir(parents=True)
    shutil.copytree(tiny_bert, root / "base")
    for name in ("embed_train.jsonl", "embed_eval.jsonl"):
        shutil.copy(DATA / name, root / "data" / name)
    server = Server(tmp_path / "srv", root, workers=1).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            config = {"model": str(root / "base"), "task": "sentence-similarity", "train": str(root / "data" /
                      "embed_train.jsonl"), "eval": str(root / "data" / "embed_eval.jsonl"), "max_steps": 3,
                      "batch_size": 8, "max_length": 32}
            r = client.post("/jobs/finetune", json={"config": config, "register_as": "embedder"})
            assert r.status_code == 202, r.text
            assert r.json()["config"]["task"] == "sentence-embedding"  # the alias is stored canonical
            job = wait_job(client, r.json()["id"], lambda j: j["status"] == "succeeded", timeout=240)
            assert "eval_ndcg@10" in job["metrics"]
            model = client.get("/models/embedder").json()
            assert model["task"] == "feature-extraction" and (Path(model["path"]) / "modules.json").is_file()
            # the registered task (feature-extraction) answers token states, as transformers' pipeline does; the
            # sentence-embedding task pools as the folder says
            body = {"model": "embedder", "inputs": ["What is the capital of Peru?"]}
            pred = client.post("/predict", json={**body, "task": "sentence-embedding"})
            assert pred.status_code == 200 and len(pred.json()["outputs"][0]) == 32, pred.text  # pooled
            tokens = client.post("/predict", json=body)
            assert tokens.status_code == 200 and len(tokens.json()["outputs"][0][0][0]) == 32, tokens.text
    finally:
        server.stop()


@pytest.fixture(scope="module")
def st6_folder(minilm_path, tmp_path_factory) -> Path:
    """MiniLM saved by sentence-transformers itself (6.x writes `...sentence_transformer.modules.pooling.Pooling`
    and a `pooling_mode` string, where older versions wrote `...models.Pooling` and pooling_mode_* flags)."""
    from sentence_transformers import SentenceTransformer

    folder = tmp_path_factory.mktemp("st6") / "minilm"
    SentenceTransformer(str(minilm_path), device="cpu").save(str(folder))
    return folder


def test_every_reader_of_a_sentence_transformers_6_folder_sees_its_pooling_and_normalize(st6_folder):
    """The serving pipeline (sentence-embedding, as TEI's /embed and OpenAI's embeddings run it) and the
    export/training reader all read one layout; it equals SentenceTransformer.encode() on the folder, normalized as it
    says. feature-extraction keeps transformers' meaning there too: per-token states, pooled only when asked."""
    from sentence_transformers import SentenceTransformer

    from hfport.formats.sentence_transformers import read_layout

    modules = json.loads((st6_folder / "modules.json").read_text())
    assert any(m["type"].endswith("modules.pooling.Pooling") for m in modules), modules  # the new spelling
    layout = read_layout(st6_folder)
    assert (layout.pooling, layout.normalize, layout.max_seq_length) == ("mean", True, 256)
    assert read_st_pooling(st6_folder) == ("mean", True)
    texts = ["The cat sat on the mat.", "A dog barked at the mailman all morning long.", "ok"]
    theirs = SentenceTransformer(str(st6_folder), device="cpu").encode(texts, convert_to_numpy=True)  # (N, C)
    features = hfport.pipeline("feature-extraction", model=st6_folder)
    for mine in ([np.asarray(v) for v in hfport.pipeline("sentence-embedding", model=st6_folder)(texts)],
                 features(texts, pooling=layout.pooling, normalize=layout.normalize)):
        mine = np.array(mine)  # (N, C)
        np.testing.assert_allclose(np.linalg.norm(mine, axis=1), 1.0, atol=1e-5)
        np.testing.assert_allclose(mine, theirs, atol=1e-5)
    assert np.asarray(features(texts[0])).shape[::2] == (1, theirs.shape[1])  # (1, T, C): token states


def test_a_module_hfport_does_not_compute_is_refused_by_name(st6_folder, tmp_path):
    """A Dense layer after pooling changes every embedding: serving without it would be silently wrong. (Token
    states, feature-extraction's answer, are what the Transformer module computes, before any Dense layer.)"""
    folder = tmp_path / "dense"
    shutil.copytree(st6_folder, folder)
    modules = json.loads((folder / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (folder / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ConfigError, match=r"modules\.json: module\(s\) \['sentence_transformers\.models\.Dense'\]"):
        hfport.pipeline("sentence-embedding", model=folder)


def test_prompts_with_include_prompt_false_pool_as_sentence_transformers_does(minilm_path, tmp_path):
    """A folder whose Pooling says include_prompt false (instruction-tuned embedders): the prompt's tokens, and the
    leading [CLS], are left out of mean pooling. hfport's sentence-embedding pipeline (what TEI's /embed and OpenAI's
    embeddings run) equals SentenceTransformer.encode(prompt_name=...) on it, and `hfport export` keeps the prompts
    and the setting."""
    from sentence_transformers import SentenceTransformer

    from hfport.formats.sentence_transformers import read_layout

    folder = tmp_path / "prompted"
    st = SentenceTransformer(str(minilm_path), device="cpu",
                             prompts={"query": "query: ", "passage": "passage: represent this text for retrieval: "})
    st[1].include_prompt = False
    st.save(str(folder))
    layout = read_layout(folder)
    assert layout.include_prompt is False and layout.prompts["query"] == "query: "
    theirs_st = SentenceTransformer(str(folder), device="cpu")
    texts = ["The cat sat on the mat.", "A dog barked at the mailman all morning long.", "ok"]
    pipe = hfport.pipeline("sentence-embedding", model=folder)
    for name in ("query", "passage"):
        theirs = theirs_st.encode(texts, prompt_name=name, convert_to_numpy=True)  # (N, C)
        mine = np.array(pipe(texts, prompt_name=name))  # (N, C)
        np.testing.assert_allclose(mine, theirs, atol=1e-5, err_msg=name)
        included = np.array(hfport.pipeline("sentence-embedding", model=include_prompt_true(folder, tmp_path))(texts,
                                                                                                 prompt_name=name))
        assert np.abs(included - theirs).max() > 1e-3, "the prompt tokens must make a difference here"
    np.testing.assert_allclose(np.array(pipe(texts)), theirs_st.encode(texts, convert_to_numpy=True), atol=1e-5)

    out = tmp_path / "exported"
    hfport.export(folder, out, verify=False)
    again = read_layout(out)
    assert (again.include_prompt, again.prompts) == (False, layout.prompts)


def include_prompt_true(folder: Path, tmp_path: Path) -> Path:
    """The same folder with include_prompt true: prompts pooled with the text."""
    copy = tmp_path / "included"
    if not copy.exists():
        shutil.copytree(folder, copy)
        config = copy / "1_Pooling" / "config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), "include_prompt": True}))
    return copy
