"""sparse-embedding (SPLADE): folders saved by sentence-transformers' SparseEncoder load and give its encode()
vectors (fp32 1e-5 on the nonzeros, the same support), for each SpladePooling option; the layout hfport writes loads
in SparseEncoder; chains and options hfport does not compute are refused by name; TEI's /embed_sparse and the
dense/sparse mismatch errors; SpladeLoss against sentence-transformers' own; training end to end into the
SparseEncoder layout, proven by `hfport verify`.

A tiny random BERT masked-LM (MiniLM's WordPiece vocabulary; its decoder bias pushed down so the vectors are sparse,
a few hundred nonzeros, as a trained SPLADE model's are).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import hfport
from hfport.formats.sentence_transformers import (SentenceTransformersError, has_embedding_layout, has_sparse_layout,
                                                  read_layout, read_sparse_layout, write_sparse_layout)
from hfport.tasks.sparse_embedding import sparse_vectors, splade_pool
from tests.tiny import SPARSE_TEXTS, TOKENIZER_FILES, build_hf, mlm_folder

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "examples" / "data"
TEXTS = SPARSE_TEXTS


@pytest.fixture(scope="module")
def st_folder(tmp_path_factory, minilm_path) -> Path:
    """The tiny masked-LM saved by SparseEncoder itself (Transformer fill-mask -> SpladePooling max/relu)."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling

    root = tmp_path_factory.mktemp("sparse")
    hf = mlm_folder(root / "hf", minilm_path)
    encoder = SparseEncoder(modules=[Transformer(str(hf), transformer_task="fill-mask"), SpladePooling("max")],
                            device="cpu")
    encoder.save(str(root / "st"))
    return root / "st"


def dense(results: list[list[dict]], vocab: int) -> torch.Tensor:
    out = torch.zeros(len(results), vocab, dtype=torch.float64)  # (N, V)
    for row, entries in enumerate(results):
        indices = [e["index"] for e in entries]
        assert indices == sorted(indices), "entries come in index order"
        for e in entries:
            out[row, e["index"]] = e["value"]
    return out


def st_encode(folder: Path, texts: list[str]) -> torch.Tensor:
    from sentence_transformers import SparseEncoder

    return SparseEncoder(str(folder), device="cpu").encode(texts, convert_to_tensor=True).to_dense().double()


def assert_same_vectors(mine: torch.Tensor, theirs: torch.Tensor) -> None:
    assert torch.equal(mine != 0, theirs != 0), "the same support"
    # the support comparison means something: every vector has nonzeros, none is close to dense (the long row, max
    # over ~110 tokens, has the most: ~4500 of 30522)
    assert 0 < int((theirs != 0).sum(1).min()) and int((theirs != 0).sum(1).max()) < theirs.shape[1] // 4
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)


# --- the layout and the pipeline --------------------------------------------------------------------------------


def test_a_sparse_encoder_folder_gives_encodes_vectors(st_folder):
    assert has_sparse_layout(st_folder) and not has_embedding_layout(st_folder)
    assert hfport.model_task(st_folder) == "sparse-embedding"
    layout = read_sparse_layout(st_folder)
    assert (layout.pooling_strategy, layout.activation) == ("max", "relu")
    pipe = hfport.pipeline("sparse-embedding", model=st_folder)
    theirs = st_encode(st_folder, TEXTS)  # (N, V)
    mine = dense(pipe(TEXTS), theirs.shape[1])
    assert_same_vectors(mine, theirs)
    # one at a time (no padding) equals the padded batch; token ids are taken as given
    assert pipe(TEXTS[1]) == pipe(TEXTS)[1]
    ids = pipe.tokenizer(TEXTS[0])["input_ids"]
    assert pipe(ids) == pipe(TEXTS[0])


@pytest.mark.parametrize("strategy,activation", [("sum", "relu"), ("max", "log1p_relu"), ("sum", "log1p_relu")])
def test_splade_pooling_options_are_honoured(st_folder, tmp_path, strategy, activation):
    folder = tmp_path / "variant"
    shutil.copytree(st_folder, folder)
    config = folder / "1_SpladePooling" / "config.json"
    config.write_text(json.dumps({"pooling_strategy": strategy, "activation_function": activation,
                                  "embedding_dimension": None}))
    theirs = st_encode(folder, TEXTS)
    mine = dense(hfport.pipeline("sparse-embedding", model=folder)(TEXTS), theirs.shape[1])
    assert_same_vectors(mine, theirs)


def test_max_active_dims_keeps_the_largest_weights(st_folder):
    from sentence_transformers import SparseEncoder

    theirs = SparseEncoder(str(st_folder), device="cpu").encode(TEXTS, convert_to_tensor=True,
                                                                max_active_dims=7).to_dense().double()
    pipe = hfport.pipeline("sparse-embedding", model=st_folder)
    mine = dense(pipe(TEXTS, max_active_dims=7), theirs.shape[1])
    assert all(len(r) == 7 for r in pipe(TEXTS, max_active_dims=7))
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)
    as_dict = pipe(TEXTS[0], output="dict")
    assert as_dict == {e["index"]: e["value"] for e in pipe(TEXTS[0])}


def test_the_layout_hfport_writes_loads_in_sparse_encoder(st_folder, tmp_path):
    folder = tmp_path / "written"
    shutil.copytree(st_folder, folder, ignore=shutil.ignore_patterns("modules.json", "1_SpladePooling", "*.md",
                                                                     "sentence_bert_config.json",
                                                                     "config_sentence_transformers.json"))
    write_sparse_layout(folder, max_seq_length=64, pooling_strategy="sum", prompts={"query": "query: "})
    theirs = st_encode(folder, TEXTS)
    layout = read_sparse_layout(folder)
    assert (layout.pooling_strategy, layout.max_seq_length, layout.prompts) == ("sum", 64, {"query": "query: "})
    # max_seq_length 64 cuts the long row in both (hfport only when asked: truncate=True)
    pipe = hfport.pipeline("sparse-embedding", model=folder)
    assert isinstance(pipe(TEXTS)[-1], hfport.ItemError)
    assert_same_vectors(dense(pipe(TEXTS, truncate=True), theirs.shape[1]), theirs)


def edit(folder: Path, name: str, change) -> None:
    path = folder / name
    path.write_text(json.dumps(change(json.loads(path.read_text()))))


@pytest.mark.parametrize("name,change,words", [
    ("modules.json", lambda m: m[:1] + [{"idx": 1, "name": "1", "path": "1_Sparse",
                                         "type": "sentence_transformers.sparse_encoder.modules.SparseStaticEmbedding"}],
     "SparseStaticEmbedding"),
    ("modules.json", lambda m: m + [{"idx": 2, "name": "2", "path": "", "type": "x.SparseAutoEncoder"}],
     "SparseAutoEncoder"),
    ("1_SpladePooling/config.json", lambda c: {**c, "pooling_strategy": "mean"}, "pooling_strategy 'mean'"),
    ("1_SpladePooling/config.json", lambda c: {**c, "activation_function": "gelu"}, "activation_function 'gelu'"),
    ("sentence_bert_config.json", lambda c: {**c, "transformer_task": "feature-extraction"},
     "transformer_task 'feature-extraction'"),
])
def test_chains_and_options_hfport_does_not_compute_are_refused_by_name(st_folder, tmp_path, name, change, words):
    folder = tmp_path / "bad"
    shutil.copytree(st_folder, folder)
    edit(folder, name, change)
    with pytest.raises(SentenceTransformersError, match=words):
        read_sparse_layout(folder)
    with pytest.raises(SentenceTransformersError, match=words):
        hfport.pipeline("sparse-embedding", model=folder)


def test_the_dense_reader_refuses_a_sparse_folder(st_folder):
    with pytest.raises(SentenceTransformersError, match="sparse"):
        read_layout(st_folder)


# --- the pooled decoder (inference) ------------------------------------------------------------------------------


def reference_vectors(model, batch, strategy: str, activation: str) -> torch.Tensor:
    """SpladePooling's order of work: the whole (B, T, V) logits, bias included, activation, pooling."""
    logits = model(batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids")).logits  # (B, T, V)
    return splade_pool(logits.float(), batch["attention_mask"], strategy, activation)  # (B, V)


@pytest.mark.parametrize("strategy,activation", [("max", "relu"), ("max", "log1p_relu"), ("sum", "relu"),
                                                 ("sum", "log1p_relu")])
def test_the_pooled_decoder_equals_pooling_the_whole_logits(st_folder, strategy, activation):
    """Real tokens only, the decoder in blocks of 256 columns (30522 = 119 x 256 + 58: a short last block), the
    activation after the max: the same vectors, same support. The batch is unsorted, has runs of equal lengths
    (duplicates), a mask with a hole (a real token left out of pooling) and padding."""
    model = hfport.AutoModelForMaskedLM.from_pretrained(st_folder).eval()
    tokenizer = hfport.AutoTokenizer.from_pretrained(st_folder)
    texts = [TEXTS[3], TEXTS[0], TEXTS[0], TEXTS[4], TEXTS[2], TEXTS[2], TEXTS[2], TEXTS[1]]
    batch = dict(tokenizer(texts, padding=True, return_tensors="pt"))
    batch["attention_mask"][1, 3] = 0  # a hole
    assert int(batch["attention_mask"].sum()) < batch["attention_mask"].numel()
    with torch.no_grad():
        theirs = reference_vectors(model, batch, strategy, activation)
        mine = sparse_vectors(model, batch["input_ids"], batch["attention_mask"], batch["token_type_ids"], strategy,
                              activation, block=256)
    assert mine.dtype == torch.float32 and mine.shape == theirs.shape
    assert_same_vectors(mine.double(), theirs.double())


@pytest.mark.parametrize("family", ["albert", "distilbert", "modernbert", "eurobert"])
def test_the_pooled_decoder_follows_each_familys_head(tmp_path, family):
    """The head's parts as each family has them: ALBERT's narrower decoder (embedding_size), DistilBERT's decoder
    bias, ModernBERT's head without a logits bias, EuroBERT's head without a transform."""
    build_hf(family, "masked-lm", seed=1).save_pretrained(tmp_path)
    model = hfport.AutoModelForMaskedLM.from_pretrained(tmp_path).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [5, 11, 12, 0, 0, 0], [5, 13, 14, 15, 0, 0]])  # (3, 6)
    mask = (torch.arange(6)[None] < torch.tensor([6, 3, 4])[:, None]).long()  # (3, 6)
    with torch.no_grad():
        for strategy in ("max", "sum"):
            theirs = reference_vectors(model, {"input_ids": ids, "attention_mask": mask}, strategy, "relu")
            mine = sparse_vectors(model, ids, mask, None, strategy, "relu")
            assert torch.equal(mine != 0, theirs != 0) and bool((theirs != 0).any())
            torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)


def test_bf16_vectors_keep_the_fp32_support_and_ranking(st_folder):
    """dtype="auto" serves bf16 where the CPU computes it natively; here bf16 is asked for outright, so the check
    runs on every machine. Against fp32, on the tiny model: the support overlaps (Jaccard), each text's 10
    largest weights are mostly the same terms, the vectors point the same way, and retrieval by dot product ranks
    the same documents first. The bounds leave room under what was measured here (Jaccard 0.982, top-10 0.978,
    cosine 0.9998, top-1 agreement 1.0); scripts/sparse_quality.py measures the same on MiniLM."""
    texts = [r[k] for r in (json.loads(x) for x in (DATA / "embed_eval.jsonl").read_text().splitlines()[:16])
             for k in ("anchor", "positive")]
    fp32 = dense(hfport.pipeline("sparse-embedding", model=st_folder)(texts), 30522)
    bf16 = dense(hfport.pipeline("sparse-embedding", model=st_folder, dtype="bfloat16")(texts), 30522)
    agreement = sparse_agreement(fp32, bf16)
    assert agreement["jaccard"] > 0.9 and agreement["top10"] > 0.85 and agreement["cosine"] > 0.999
    queries, documents = fp32[0::2], fp32[1::2]
    ranked = (queries @ documents.T).argmax(1), (bf16[0::2] @ bf16[1::2].T).argmax(1)  # (Q,) each
    assert float((ranked[0] == ranked[1]).double().mean()) >= 0.9


def sparse_agreement(a: torch.Tensor, b: torch.Tensor, k: int = 10) -> dict[str, float]:
    """Mean over rows of (N, V) vectors: support Jaccard, top-k overlap, cosine."""
    sa, sb = a != 0, b != 0
    jaccard = (sa & sb).sum(1) / (sa | sb).sum(1).clamp(min=1)  # (N,)
    ta, tb = a.topk(k).indices, b.topk(k).indices  # (N, k)
    top = (ta[:, :, None] == tb[:, None, :]).any(2).double().mean(1)  # (N,)
    cosine = torch.nn.functional.cosine_similarity(a, b, dim=1)  # (N,)
    return {"jaccard": float(jaccard.mean()), f"top{k}": float(top.mean()), "cosine": float(cosine.mean())}


# --- TEI's /embed_sparse ------------------------------------------------------------------------------------------


def tiny_dense(root: Path, minilm: Path) -> Path:
    """A tiny bare BERT (a dense embedding model, mean pooling) with MiniLM's tokenizer."""
    build_hf("bert", "base", vocab_size=30522).save_pretrained(root)
    for f in TOKENIZER_FILES:
        shutil.copy(minilm / f, root / f)
    return root


def tei_client(tmp_path: Path, allowed: list[Path], **settings):
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.settings import Settings

    # a 256-token budget: the warm-up pass stays small (the vocabulary-wide head is the costly part of SPLADE)
    return TestClient(create_app(Settings(data_dir=tmp_path / "d", allowed_dirs=allowed, batch_token_budgets=[256],
                                          predict_dtype="float32", **settings), run_worker=False))


def test_tei_embed_sparse_and_the_dense_sparse_mismatch_errors(st_folder, minilm_path, tmp_path):
    from tests.serving import assert_error

    dense_folder = tiny_dense(tmp_path / "dense", minilm_path)
    with tei_client(tmp_path, [st_folder.parent, tmp_path]) as c:
        for name, path in (("splade", st_folder), ("minilm", dense_folder)):
            r = c.post("/models", json={"name": name, "path": str(path)})
            assert r.status_code == 201, r.text
        assert c.get("/models/splade").json()["task"] == "sparse-embedding"
        r = c.post("/embed_sparse", json={"inputs": TEXTS}, headers={"x-model": "splade"})
        assert r.status_code == 200, r.text
        assert {"x-compute-time", "x-inference-time"} <= set(r.headers)
        assert all(set(e) == {"index", "value"} for row in r.json() for e in row)
        theirs = st_encode(st_folder, TEXTS)
        assert_same_vectors(dense(r.json(), theirs.shape[1]), theirs)
        one = c.post("/embed_sparse", json={"inputs": TEXTS[0], "truncate": True, "truncation_direction": "Left"},
                     headers={"x-model": "splade"})
        assert one.status_code == 200, one.text
        torch.testing.assert_close(dense(one.json(), theirs.shape[1]), theirs[:1], atol=1e-5, rtol=0)
        info = c.get("/info", headers={"x-model": "splade"}).json()
        assert info["model_type"] == {"embedding": {"pooling": "splade"}}
        # a sparse request to a dense model, a dense one to a sparse model: TEI's shape, naming model and kind
        body = assert_error(c.post("/embed_sparse", json={"inputs": "x"}, headers={"x-model": "minilm"}), 424,
                            "Backend")
        assert "'minilm'" in body["error"] and "embedding" in body["error"]
        body = assert_error(c.post("/embed", json={"inputs": "x"}, headers={"x-model": "splade"}), 424, "Backend")
        assert "'splade'" in body["error"] and "sparse-embedding" in body["error"]
        assert_error(c.post("/embed_sparse", json={"inputs": []}, headers={"x-model": "splade"}), 400, "Empty")
        assert_error(c.post("/embed_sparse", json={"inputs": "x", "normalize": True}, headers={"x-model": "splade"}),
                     422, "Validation")


# --- training -----------------------------------------------------------------------------------------------------


def test_splade_loss_is_sentence_transformers_splade_loss(st_folder):
    """Their SpladeLoss(SparseMultipleNegativesRankingLoss) on a SparseEncoder's triplet features = ours on the same
    model's vectors; weights large enough that each FLOPS term moves the total."""
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.losses import SparseMultipleNegativesRankingLoss, SpladeLoss

    from hfport.train.tasks.sparse import flops, splade_loss

    encoder = SparseEncoder(str(st_folder), device="cpu")
    rows = [json.loads(x) for x in (DATA / "embed_train.jsonl").read_text().splitlines()[:5]]
    columns = [[r["anchor"] for r in rows], [r["positive"] for r in rows], [r["negative"] for r in rows]]
    reference = SpladeLoss(encoder, SparseMultipleNegativesRankingLoss(encoder), document_regularizer_weight=0.3,
                           query_regularizer_weight=0.5)
    theirs = reference([encoder.preprocess(c) for c in columns], None)
    with torch.no_grad():
        vectors = torch.cat([encoder(encoder.preprocess(c))["sentence_embedding"] for c in columns])  # (3B, V)
    index = torch.arange(15).view(3, 5).T  # (B, 3): anchor, positive, negative rows
    ours = splade_loss(vectors, index, 1.0, 0.5, 0.3)
    torch.testing.assert_close(ours, sum(theirs.values()).detach(), rtol=1e-5, atol=1e-6)
    assert float(0.3 * flops(vectors[5:])) > 1e-3 and float(0.5 * flops(vectors[:5])) > 1e-3


def sparse_cfg(model: Path, tmp_path: Path, **kw):
    from hfport.train.config import FinetuneConfig

    values = dict(model=str(model), task="sparse-embedding", train=str(DATA / "embed_train.jsonl"),
                  eval=str(DATA / "embed_eval.jsonl"), output_dir=str(tmp_path / "run"), batch_size=16, lr=1e-3,
                  logging_steps=1, seed=3, max_length=48, precision="fp32")
    return FinetuneConfig(**{**values, **kw})


def test_sparse_training_writes_sparse_encoder_folders_that_verify(st_folder, tmp_path):
    from hfport.train.loop import finetune

    summary = finetune(sparse_cfg(st_folder, tmp_path, max_steps=6, eval_strategy="steps", eval_steps=3,
                                  query_regularizer_weight=1e-3, document_regularizer_weight=1e-3), progress=False)
    assert summary["problem_type"] == "pairs" and list(summary["best_metric"]) == ["ndcg@10"]
    evals = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if json.loads(x)["type"] == "eval"]
    assert {"eval_ndcg@10", "eval_mrr@10", "eval_query_active_dims", "eval_corpus_active_dims"} <= set(evals[-1])
    assert 0 < evals[-1]["eval_corpus_active_dims"] < 30522
    for which in ("best", "final"):
        folder = tmp_path / "run" / which
        assert has_sparse_layout(folder) and hfport.model_task(folder) == "sparse-embedding"
        assert json.loads((folder / "config.json").read_text())["architectures"] == ["BertForMaskedLM"]
    report = hfport.verify(tmp_path / "run" / "best", tmp_path / "run")
    assert report.passed, report.table()
    assert {r.output for r in report.rows if r.check == "sparse-encoder"} == {"pooling", "support", "values"}
    # `hfport export --format sparse-encoder` writes the layout and proves it; a folder whose pooling was edited
    # no longer verifies
    out = hfport.export(tmp_path / "run", tmp_path / "export", format="sparse-encoder", verify=True)
    assert {"modules.json", "1_SpladePooling"} <= set(out.files) and out.report.passed
    edit(tmp_path / "export", "1_SpladePooling/config.json", lambda c: {**c, "pooling_strategy": "sum"})
    bad = hfport.verify(tmp_path / "export", tmp_path / "run")
    assert not bad.passed and any(r.check == "sparse-encoder" and not r.passed for r in bad.rows)


@pytest.mark.parametrize("options,fragment", [
    ({"pooling": "mean"}, "sentence-embedding options"),
    ({"matryoshka_dims": [16]}, "sentence-embedding options"),
    ({"loss": "cosent"}, "SpladeLoss"),
    # scored pairs are refused by the column check at preflight, which names the task whose rows they are
    ({"train": "scored"}, "fit sentence-embedding"),
])
def test_bad_sparse_training_options_are_named(st_folder, tmp_path, options, fragment):
    from hfport.errors import ConfigError
    from hfport.formats.tables import DataError
    from hfport.train.loop import finetune

    error = ConfigError
    if options.get("train") == "scored":
        error = DataError
        scored = tmp_path / "sts.jsonl"
        scored.write_text("".join(json.dumps({"sentence1": f"a {i}", "sentence2": f"b {i}", "score": 0.5}) + "\n"
                                  for i in range(8)))
        options = {"train": str(scored), "eval": None}
    with pytest.raises(error, match=fragment):
        finetune(sparse_cfg(st_folder, tmp_path, max_steps=1, **options), progress=False)


def test_sparse_retrieval_metrics_rank_by_dot_product_and_count_nonzeros():
    """Two queries over a 3-text corpus: cosine would rank q0's documents the other way (d1 is longer but less
    aligned), the dot product ranks d1 first, as SparseEncoder's similarity does."""
    from hfport.train.data import EncodedData
    from hfport.train.tasks.sparse import SparseEmbedding

    task = SparseEmbedding()
    q0, q1 = torch.tensor([1.0, 0, 0, 0]), torch.tensor([0, 0, 1.0, 0])
    d0, d1, d2 = torch.tensor([1.0, 0.1, 0, 0]), torch.tensor([2.0, 3.0, 0, 0]), torch.tensor([0, 0, 1.0, 1.0])
    vectors = torch.stack([q0, d0, d1, q1, d2])  # (U, V)
    batch = {"labels": torch.tensor([[0, 2, 1], [3, 4, -1]])}  # q0: relevant d1, negative d0; q1: relevant d2
    items = [type("X", (), {"meta": {"ids": [10, 12, 11]}, "target": None, "source": ("f", 1)})(),
             type("X", (), {"meta": {"ids": [13, 14]}, "target": None, "source": ("f", 2)})()]
    data = EncodedData([], [], None, 0, {}, problem_type="pairs")
    out = task.metrics(task.eval_rows(vectors, batch, items, data), data, {})
    assert out["mrr@10"] == 1.0 and out["recall@1"] == 1.0  # by cosine q0 would rank d0 first: mrr (0.5 + 1) / 2
    assert out["query_active_dims"] == 1.0 and out["corpus_active_dims"] == 2.0
