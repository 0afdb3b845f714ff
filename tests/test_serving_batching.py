"""The server batches a request once: concurrent requests for one model, through different routes and with different
options, are prepared each with its own options, and their rows go through the model in the forward passes the
server's batcher packs (longest first, under the model's tuned token budget), each row exactly once; the pipeline's own
batching (Pipeline.batches, a library call's) never runs on the server path. Results match the pipeline alone at 1e-5
(the project's fp32 bound: a row's batch-mates change the float sums' order only), and a request whose options the
pipeline refuses fails alone. In process (TestClient over create_app), a tiny BERT."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

import hfport
from hfport.pipelines import Pipeline
from server.app import create_app
from server.serving import ModelRecord
from server.settings import Settings

TEXTS = ["Paris", "the capital of France is Paris", "a cat", "what is the tallest mountain on the earth today",
         "rivers run to the sea", "one", "how do I reset my password for this account"]
BUDGET = 64  # padded tokens a forward pass; the texts' 3..12 tokens need several passes


def close(a, b) -> None:
    torch.testing.assert_close(torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64),
                               atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from tests.tiny_tokenizers import make_folder

    return make_folder(tmp_path_factory.mktemp("batching"), "bert", "base")


def expected_passes(lengths: list[int], budget: int) -> list[list[int]]:
    """The passes a batcher owning the rows forms: longest first, each pass at most `budget` padded tokens."""
    passes: list[list[int]] = []
    for n in sorted(lengths, reverse=True):
        if passes and (len(passes[-1]) + 1) * passes[-1][0] <= budget:
            passes[-1].append(n)
        else:
            passes.append([n])
    return passes


def test_concurrent_requests_are_batched_once_by_the_server(folder, tmp_path, monkeypatch):
    inputs = 3 + 2 + 2 + 1  # the four requests below: the group flushes when the last one is in (not on a timer)
    settings = Settings(data_dir=tmp_path / "data", allowed_dirs=[folder.parent], predict_dtype="float32",
                        batch_token_budgets=[BUDGET], predict_max_inputs=inputs // 2,  # merged calls: twice that
                        batch_max_wait_ms=60_000)
    app = create_app(settings, run_worker=False)
    with TestClient(app) as c:
        assert c.post("/models", json={"name": "emb", "path": str(folder)}).status_code == 201
        service = app.state.model_service
        pipe = service.load(ModelRecord.of(app.state.store.get_model("emb"), "sentence-embedding"))
        assert pipe.max_batch_tokens == BUDGET  # tuned at load (one budget offered)
        passes: list[list[int]] = []
        forward_batch = Pipeline.forward_batch

        def spy(self, batch):
            passes.append([len(f.input_ids) for f in batch])
            return forward_batch(self, batch)

        def refuse(self, features):
            raise AssertionError("the pipeline's own batching ran on the server path")

        monkeypatch.setattr(Pipeline, "forward_batch", spy)
        monkeypatch.setattr(Pipeline, "batches", refuse)
        tei = {"x-model": "emb"}
        calls = {
            "embed": lambda: c.post("/embed", json={"inputs": TEXTS[:3]}, headers=tei),
            "matryoshka": lambda: c.post("/embed", json={"inputs": TEXTS[3:5], "dimensions": 8, "normalize": False},
                                         headers=tei),
            "openai": lambda: c.post("/v1/embeddings", json={"input": TEXTS[5:], "model": "emb"}),
            "bad prompt": lambda: c.post("/embed", json={"inputs": ["x"], "prompt_name": "nope"}, headers=tei),
        }
        answers: dict[str, object] = {}
        threads = [threading.Thread(target=lambda k=k, f=f: answers.__setitem__(k, f())) for k, f in calls.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        metrics = c.get("/metrics").text
    monkeypatch.undo()
    for key in ("embed", "matryoshka", "openai"):
        assert answers[key].status_code == 200, (key, answers[key].text)
    # the request the pipeline refuses (an unknown prompt) fails alone, in its protocol's words
    assert answers["bad prompt"].status_code == 422 and "prompt_name='nope'" in answers["bad prompt"].text
    # one group of every input, its rows in the passes the server packed: each row once, rows of all three requests
    # (three option sets, two routes) sharing passes
    assert re.search(r'^hfport_batch_size_count\{model="emb"\} 1\.0$', metrics, re.M), metrics
    assert re.search(rf'^hfport_batch_size_sum\{{model="emb"\}} {float(inputs)}$', metrics, re.M), metrics
    lengths = [len(pipe.tokenizer(t)["input_ids"]) for t in TEXTS]
    assert passes == expected_passes(lengths, BUDGET), passes
    assert len(passes) > 1 and any(len(p) > 3 for p in passes), passes  # the budget split the group, not a request
    alone = hfport.pipeline("sentence-embedding", model=folder)
    close(answers["embed"].json(), alone(TEXTS[:3], normalize=True))
    close(answers["matryoshka"].json(), alone(TEXTS[3:5], dimensions=8, normalize=False))
    close([d["embedding"] for d in answers["openai"].json()["data"]], alone(TEXTS[5:], normalize=True))


def test_predict_is_the_steps_a_server_runs(folder):
    """Pipeline.predict = prepare, forward_rows over `batches`, finish: the steps the server's batcher calls."""
    pipe = hfport.pipeline("sentence-embedding", model=folder, max_batch_tokens=BUDGET)
    prepared = pipe.prepare([*TEXTS, "  "], dimensions=8)
    assert sorted(prepared.failed) == [len(TEXTS)] and len(prepared.rows) == len(TEXTS)  # the blank text fails alone
    for rows in pipe.batches(prepared.rows):
        pipe.forward_rows(rows)
    stepped = pipe.finish(prepared)
    called = pipe.predict([*TEXTS, "  "], dimensions=8)
    close(stepped[:-1], called[:-1])
    assert stepped[-1].error_type == called[-1].error_type == "PipelineInputError"
    with pytest.raises(ValueError, match="prompt_name='nope'"):
        pipe.prepare(TEXTS, prompt_name="nope")  # a bad option raises: the server fails that request alone


@pytest.mark.parametrize("budgets, passes", [((64,), [64]), ((32, 64), [32, 32, 64])])
def test_a_choice_of_budgets_is_timed_and_one_budget_only_warmed_up(folder, budgets, passes, monkeypatch):
    """tune_batch_tokens, what the server runs at each model load: a warm-up pass at the smallest budget, then one
    timed pass per budget where there is a choice; one budget (the server's `batch_token_budgets=[]`: the model's
    own, "no timing") gets its warm-up pass alone, not a second one (the real MiniLM's 16384 tokens: seconds)."""
    from hfport.embeddings import tune_batch_tokens

    pipe = hfport.pipeline("sentence-embedding", model=folder)
    tokens: list[int] = []
    forward_batch = Pipeline.forward_batch
    monkeypatch.setattr(Pipeline, "forward_batch",
                        lambda self, batch: tokens.append(sum(len(f.input_ids) for f in batch)) or
                        forward_batch(self, batch))
    tuning = tune_batch_tokens(pipe, budgets, seq_len=16)
    assert tokens == passes
    assert set(tuning.throughput) == set(budgets) and pipe.max_batch_tokens == tuning.chosen in budgets
