"""LoRA adapters in the service: a fine-tune job with `lora` registers its adapter over its base, an adapter
registers over a registered base (checked to fit), /predict answers by adapter name with what the merged export
computes, and adapters over one base share its tensors in the model cache."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

import hfport
from tests.serving import Server, allowed_root, assert_error, finetune_config, wait_job
from tests.tiny import save_hf, save_random_adapter

TEXTS = ["the plot was great overall", "the acting was awful overall", "the ending was lovely overall"]


def _adapter(base: Path, out: Path, task: str = "text-classification", seed: int = 0) -> Path:
    model = hfport.tasks.get(task).model_class.from_pretrained(base, id2label={0: "negative", 1: "positive"})
    save_random_adapter(model, out, base=base, seed=seed, r=4, alpha=8, targets=["q", "v"])
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory, tiny_bert) -> Path:
    """The allowed dir (tests/serving.py's allowed_root): its own, since the tests write adapters into it."""
    return allowed_root(tmp_path_factory.mktemp("allowed"), tiny_bert)


@pytest.fixture(scope="module")
def client(root, tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("lora-srv") / "data", root, HFPORT_BATCH_MAX_WAIT_MS="5",
                 # fp32, as the library runs it: "auto" serves bf16 on a CPU with native bf16, and an adapter runs in
                 # its base's dtype (it shares the base's body)
                 HFPORT_PREDICT_DTYPE="float32").start()
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        yield c
    srv.stop()


def test_lora_job_registers_its_adapter_and_predict_equals_the_merged_export(client, root, tmp_path):
    r = client.post("/models", json={"name": "ftbase", "path": str(root / "models" / "ft-base")})
    assert r.status_code == 201, r.text
    config = finetune_config(root, epochs=1, lora={"r": 4, "target_modules": ["q", "k", "v", "o", "ffn.up"]})
    job = client.post("/jobs/finetune", json={"config": config, "register_as": "sent-lora"}).json()
    done = wait_job(client, job["id"], lambda j: j["status"] == "succeeded", timeout=300)
    entry = client.get("/models/sent-lora").json()
    assert entry["kind"] == "adapter" and entry["task"] == "text-classification"
    assert Path(entry["base"]) == (root / "models" / "ft-base").resolve()
    assert (Path(done["result"]["model_path"]) / "adapter_config.json").is_file()
    r = client.post("/predict", json={"model": "sent-lora", "inputs": TEXTS, "parameters": {"top_k": None}})
    assert r.status_code == 200, r.text
    served = r.json()["outputs"]
    hfport.export(entry["path"], tmp_path / "merged", merge=True, verify=True)
    merged = hfport.pipeline("text-classification", model=tmp_path / "merged")(TEXTS, top_k=None)
    for got, want in zip(served, merged):
        assert [d["label"] for d in got] == [d["label"] for d in want]
        assert [d["score"] for d in got] == pytest.approx([d["score"] for d in want], abs=1e-5)


def test_adapter_registers_over_a_registered_base(client, root):
    client.post("/models", json={"name": "ftbase", "path": str(root / "models" / "ft-base")})
    folder = _adapter(root / "models" / "ft-base", root / "adapters" / "two", seed=2)
    r = client.post("/models", json={"name": "two", "path": str(folder), "base": "ftbase"})
    assert r.status_code == 201, r.text
    assert r.json()["kind"] == "adapter" and r.json()["base"] == str(root / "models" / "ft-base")
    out = client.post("/predict", json={"model": "two", "inputs": TEXTS})
    assert out.status_code == 200, out.text
    want = hfport.pipeline("text-classification", model=folder)(TEXTS)
    assert [o["label"] for o in out.json()["outputs"]] == [w["label"] for w in want]
    assert [o["score"] for o in out.json()["outputs"]] == pytest.approx([w["score"] for w in want], abs=1e-5)
    # the base registered as a text-classification model: its weights hold no such head (its adapters bring theirs),
    # so the leader the adapter joined loads for them but never answers for the base itself
    r = client.post("/models", json={"name": "base-cls", "path": str(root / "models" / "ft-base"),
                                     "task": "text-classification"})
    assert r.status_code == 201, r.text
    base = client.post("/predict", json={"model": "base-cls", "inputs": TEXTS})
    assert base.status_code == 400 and base.json()["error_type"] == "UntrainedHeadError", base.text
    assert "hold no text-classification head" in base.json()["error"]
    assert client.post("/predict", json={"model": "two", "inputs": TEXTS}).json()["outputs"] == out.json()["outputs"]
    # bad input: a base the adapter does not fit, an adapter given as a base, a base for a plain model
    other = root / "models" / "wide-base"
    save_hf("bert", "base", other, vocab_size=30522, hidden_size=48)
    body = assert_error(client.post("/models", json={"name": "bad", "path": str(folder), "base": str(other)}), 400)
    assert "hidden_size 32 (adapter) vs 48 (base)" in body["error"]
    assert_error(client.post("/models", json={"name": "bad", "path": str(folder), "base": "two"}), 400)
    assert_error(client.post("/models", json={"name": "bad", "path": str(root / "models" / "ft-base"),
                                              "base": "ftbase"}), 400)


def test_adapters_over_one_base_share_its_tensors(root, tmp_path):
    from server.serving import ModelRecord, ModelService, total_weight_bytes, weight_bytes
    from server.settings import Settings

    base = root / "models" / "ft-base"
    one, two = _adapter(base, tmp_path / "one", seed=3), _adapter(base, tmp_path / "two", seed=4)
    service = ModelService(Settings(data_dir=tmp_path / "data", allowed_dirs=[root, tmp_path],  # what it may read
                                    batch_token_budgets=[], predict_dtype="float32"))
    try:
        a = service.load(ModelRecord("one", str(one), "text-classification", base=str(base)))
        b = service.load(ModelRecord("two", str(two), "text-classification", base=str(base)))
    finally:
        service.close()
    for name in ("embeddings.word.weight", "encoder.layers.0.attn.q.weight", "encoder.layers.1.ffn.up.weight"):
        assert a.model.body.get_parameter(name).data_ptr() == b.model.body.get_parameter(name).data_ptr()
    # the cache's memory budget counts the shared base once
    assert total_weight_bytes([a, b]) < weight_bytes(a) + weight_bytes(b)
    assert total_weight_bytes([a, b]) < 1.1 * weight_bytes(a)


def test_an_adapter_with_an_explicit_base_embeds_the_same_on_every_route(root, tmp_path):
    """The base given at registration travels with the model (the cache's record), so TEI's /embed and OpenAI's
    embeddings run the adapter over the same base as /predict, not over the one its adapter_config.json names."""
    import shutil

    from fastapi.testclient import TestClient
    from safetensors.torch import load_file, save_file

    from server.app import create_app
    from server.settings import Settings

    base = root / "models" / "ft-base"
    decoy = tmp_path / "decoy-base"  # what adapter_config.json names: same shapes, other weights
    shutil.copytree(base, decoy)
    g = torch.Generator().manual_seed(5)
    weights = {k: v + torch.randn(v.shape, generator=g) * 0.5 if v.is_floating_point() else v
               for k, v in load_file(decoy / "model.safetensors").items()}
    save_file(weights, decoy / "model.safetensors", metadata={"format": "pt"})
    model = hfport.tasks.get("feature-extraction").model_class.from_pretrained(base)
    folder = root / "adapters" / "embed-explicit-base"
    save_random_adapter(model, folder, base=decoy, seed=6, r=4, alpha=8, targets=["q", "v"])

    def fresh(data: str) -> TestClient:  # a fresh service: nothing loaded yet
        return TestClient(create_app(Settings(data_dir=tmp_path / data, allowed_dirs=[root, tmp_path],
                                              batch_token_budgets=[], predict_dtype="float32"), run_worker=False))

    def register(c: TestClient) -> None:
        r = c.post("/models", json={"name": "emb-lora", "path": str(folder), "base": str(base)})
        assert r.status_code == 201 and r.json()["base"] == str(base), r.text

    with fresh("one") as c:
        register(c)
        native = c.post("/predict", json={"model": "emb-lora", "inputs": TEXTS, "task": "sentence-embedding",
                                          "parameters": {"normalize": True}})
        assert native.status_code == 200, native.text
    with fresh("two") as c:  # /embed first: no /predict has loaded the adapter before it
        register(c)
        embed = c.post("/embed", json={"inputs": TEXTS}, headers={"x-model": "emb-lora"})
        assert embed.status_code == 200, embed.text
        openai = c.post("/v1/embeddings", json={"input": TEXTS, "model": "emb-lora"})
        assert openai.status_code == 200, openai.text
    want = torch.tensor(native.json()["outputs"])
    assert torch.tensor(embed.json()).allclose(want, atol=1e-5)
    assert torch.tensor([d["embedding"] for d in openai.json()["data"]]).allclose(want, atol=1e-5)
