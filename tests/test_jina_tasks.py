"""jina-embeddings-v3's task adapters as PEFT adapters over the base. transformers 5.23's JinaEmbeddingsV3Model has no
task-adapter config: a task (retrieval.query, retrieval.passage, ...) is a LoRA made with peft over the loaded
transformers model, naming its modules as transformers holds them in memory (`layers.0.self_attn.q_proj`) while the
checkpoint (and hfport) fuse q/k/v into `mixer.Wqkv`. Here such adapters (random, tiny, built with peft at test time)
load in hfport over the base and compute what transformers + peft compute (fp32 1e-5 at real positions of a padded
batch with a 70-token row; LoRA gradients too), several tasks are served together (pipeline adapters=, a mixed batch
equal to each task alone; the server's model name) and an adapter saved back from hfport loads in peft again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import hfport
from hfport import lora
from hfport.nn.lora import ChunkLoraLinear
from tests.tiny import batch, save_hf
from tests.tiny_tokenizers import build_tokenizer_folder

import peft  # noqa: E402 - a dev dependency: missing must fail, not skip
import transformers  # noqa: E402

FAMILY = "jina_embeddings_v3"
TEXTS = ["what is the capital of france", "paris", "the capital of france is paris, a city on the seine",
         "a b c d e f", "rotary positions"]
# two tasks as a user would make them with peft: other ranks, alphas and targets (q/k/v land on the fused Wqkv)
TASKS = {"retrieval.query": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "fc1", "fc2"]),
         "retrieval.passage": dict(r=2, lora_alpha=6, target_modules=["k_proj", "v_proj", "fc2"])}


def peft_model(base: Path, folder: Path | None = None, config: dict | None = None, seed: int = 0):
    """transformers' JinaEmbeddingsV3Model with a PEFT adapter: loaded from `folder`, or new from `config` with its
    A and B moved off their init (B = 0 would hide errors)."""
    model = transformers.AutoModel.from_pretrained(base).eval()
    if folder is not None:
        return peft.PeftModel.from_pretrained(model, folder).eval()
    out = peft.get_peft_model(model, peft.LoraConfig(**config))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in out.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return out.eval()


@pytest.fixture(scope="module")
def jina(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("jina-tasks")
    base = root / "base"
    build_tokenizer_folder("xlm-roberta", base, model_max_length=128)
    tok = hfport.AutoTokenizer.from_pretrained(base)
    save_hf(FAMILY, "base", base, vocab_size=len(tok), pad_token_id=tok.pad_token_id)
    out = {"root": root, "base": base}
    for i, (task, config) in enumerate(TASKS.items()):
        peft_model(base, config=config, seed=i).save_pretrained(root / task)
        out[task] = root / task
    return out


def real(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return hidden[mask.bool()]  # (real tokens, C)


@pytest.mark.parametrize("padding_free", [True, False])
@pytest.mark.parametrize("task", list(TASKS))
def test_task_adapter_equals_peft_outputs_and_gradients(jina, task, padding_free):
    b = batch(FAMILY, lengths=(70, 41, 9), pairs=False)
    theirs = peft_model(jina["base"], jina[task])
    ours = hfport.EncoderModel.from_pretrained(jina[task], base_model=jina["base"])
    ours.padding_free = padding_free
    fused = [m for m in ours.modules() if isinstance(m, ChunkLoraLinear)]
    assert len(fused) == 2 and {m.blocks for m in fused} == {(0, 2) if task == "retrieval.query" else (1, 2)}
    for model in (theirs, ours):
        for name, p in model.named_parameters():
            p.requires_grad_(".lora_" in name)
    want = theirs(**b).last_hidden_state  # (B, T, C)
    got = ours(**b).last_hidden_state
    torch.testing.assert_close(real(got, b["attention_mask"]), real(want, b["attention_mask"]), atol=1e-5, rtol=1e-4)
    real(want, b["attention_mask"]).pow(2).sum().backward()
    real(got, b["attention_mask"]).pow(2).sum().backward()
    grads = {n: p.grad for n, p in theirs.named_parameters() if p.grad is not None}
    # hfport's LoRA tensors under PEFT's keys are views of its parameters: their gradients, viewed the same way
    for p in ours.parameters():
        if p.grad is not None:
            p.data = p.grad
    mine = {k.replace(".weight", ".default.weight"): g for k, g in lora.adapter_state_dict(ours).items()}
    assert set(mine) == set(grads)  # PeftModel's parameter names: its saved keys with the adapter's name
    for key, g in mine.items():
        torch.testing.assert_close(g, grads[key], atol=1e-5, rtol=1e-4)


def test_chunk_lora_trains_only_its_blocks(jina):
    """A gradient step never fills B's blocks between chunks (what PEFT's layout cannot hold)."""
    ours = hfport.EncoderModel.from_pretrained(jina["retrieval.passage"], base_model=jina["base"])
    layer = next(m for m in ours.modules() if isinstance(m, ChunkLoraLinear))
    layer.lora_B.weight.requires_grad_(True)
    b = batch(FAMILY, lengths=(12, 5), pairs=False)
    ours(**b).last_hidden_state.sum().backward()
    off = layer.lora_B.weight.grad * (1 - layer.block_mask)
    assert layer.lora_B.weight.grad.abs().sum() > 0 and off.abs().max() == 0


def test_save_back_writes_transformers_names_peft_loads(jina, tmp_path):
    task = "retrieval.query"
    ours = hfport.EncoderModel.from_pretrained(jina[task], base_model=jina["base"])
    lora.save_adapter(ours, tmp_path / "back")
    config = json.loads((tmp_path / "back" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == sorted(TASKS[task]["target_modules"])
    keys = {}
    for folder in (jina[task], tmp_path / "back"):
        with safe_open(str(folder / "adapter_model.safetensors"), framework="pt") as f:
            keys[folder] = {k: f.get_tensor(k) for k in f.keys()}
    original, saved = keys.values()
    assert set(saved) == set(original)
    for k in original:
        assert torch.equal(saved[k], original[k]), k
    b = batch(FAMILY, pairs=False)
    with torch.no_grad():
        want = peft_model(jina["base"], jina[task])(**b).last_hidden_state
        again = peft_model(jina["base"], tmp_path / "back")(**b).last_hidden_state
    torch.testing.assert_close(real(again, b["attention_mask"]), real(want, b["attention_mask"]), atol=0, rtol=0)
    with torch.no_grad():  # folded into the fused weight: each chunk's B A on its own rows
        folded = lora.merged(ours)(**b).last_hidden_state
    torch.testing.assert_close(real(folded, b["attention_mask"]), real(want, b["attention_mask"]), atol=1e-5, rtol=1e-4)


def test_tasks_selectable_at_load_and_per_call_mixed_equals_alone(jina):
    tasks = list(TASKS)
    pipe = hfport.pipeline("feature-extraction", model=jina["base"], adapters={t: jina[t] for t in tasks})
    names = [tasks[0], tasks[1], None, tasks[1], tasks[0]]
    mixed = pipe(TEXTS, adapter=names)
    tokenizer = transformers.AutoTokenizer.from_pretrained(jina["base"])
    for text, name, row in zip(TEXTS, names, mixed):
        alone = pipe(text, adapter=name)
        torch.testing.assert_close(torch.tensor(row), torch.tensor(alone), atol=1e-5, rtol=1e-4)
        # and what transformers + peft compute for that task (the base itself for a row without one)
        enc = tokenizer(text, return_tensors="pt")
        model = (peft_model(jina["base"], jina[name]) if name else transformers.AutoModel.from_pretrained(jina["base"]))
        with torch.no_grad():
            want = model.eval()(**enc).last_hidden_state
        torch.testing.assert_close(torch.tensor(row).reshape(want.shape), want, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(torch.tensor(mixed[0]), torch.tensor(pipe(TEXTS[0])))  # the task changes the output


def test_fused_name_adapter_keeps_the_saved_names(jina, tmp_path):
    """An adapter hfport trains on its default targets (the fused Wqkv) stays in the saved layout's names."""
    model = hfport.EncoderModel.from_pretrained(jina["base"])
    lora.apply_lora(model, r=2, alpha=4, base=str(jina["base"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.1)
    lora.save_adapter(model, tmp_path / "fused")
    with safe_open(str(tmp_path / "fused" / "adapter_model.safetensors"), framework="pt") as f:
        assert all(".mixer.Wqkv.lora_" in k for k in f.keys())
    back = hfport.EncoderModel.from_pretrained(tmp_path / "fused")
    assert not any(isinstance(m, ChunkLoraLinear) for m in back.modules())
    b = batch(FAMILY, pairs=False)
    with torch.no_grad():
        torch.testing.assert_close(back(**b).last_hidden_state, model(**b).last_hidden_state, atol=0, rtol=0)


def test_missing_chunk_tensors_are_named(jina, tmp_path):
    folder = tmp_path / "cut"
    folder.mkdir()
    src = jina["retrieval.passage"]
    (folder / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
    from safetensors.torch import save_file
    with safe_open(str(src / "adapter_model.safetensors"), framework="pt") as f:
        save_file({k: f.get_tensor(k) for k in f.keys() if "layers.1.self_attn.k_proj" not in k},
                  str(folder / "adapter_model.safetensors"))
    with pytest.raises(lora.LoraError, match=r"lacks 2 tensor\(s\).*layers\.1\.self_attn\.k_proj\.lora_A"):
        hfport.EncoderModel.from_pretrained(folder, base_model=jina["base"])


def test_server_selects_a_task_by_model_name(jina, tmp_path):
    """Tasks registered over one base on the server: /embed and OpenAI's embeddings pick the task by model name,
    in one batch, and equal the library's sentence-embedding pipeline with that adapter."""
    from fastapi.testclient import TestClient

    from server.app import create_app
    from server.settings import Settings

    app = create_app(Settings(data_dir=tmp_path / "data", allowed_dirs=[jina["root"]], batch_token_budgets=[512],
                              predict_dtype="float32", batch_max_wait_ms=200), run_worker=False)
    pipe = hfport.pipeline("sentence-embedding", model=jina["base"], adapters={t: jina[t] for t in TASKS})
    with TestClient(app) as c:
        assert c.post("/models", json={"name": "jina", "path": str(jina["base"])}).status_code == 201
        for task in TASKS:
            r = c.post("/models", json={"name": task, "path": str(jina[task]), "base": "jina"})
            assert r.status_code == 201, r.text
        got = {}
        for model in ("jina", *TASKS):
            got[model] = c.post("/v1/embeddings", json={"input": TEXTS, "model": model}).json()
            r = c.post("/embed", json={"inputs": TEXTS}, headers={"x-model": model})
            assert r.status_code == 200, r.text
            want = torch.tensor(pipe(TEXTS, adapter=None if model == "jina" else model, normalize=True))
            torch.testing.assert_close(torch.tensor(r.json()), want, atol=1e-5, rtol=1e-4)
            openai = torch.tensor([d["embedding"] for d in got[model]["data"]])
            torch.testing.assert_close(openai, want, atol=1e-5, rtol=1e-4)
    assert got["retrieval.query"]["data"][0]["embedding"] != got["retrieval.passage"]["data"][0]["embedding"]


def test_classification_task_adapter_with_its_head(jina, tmp_path):
    """A task adapter made by peft over JinaEmbeddingsV3ForSequenceClassification (SEQ_CLS: the classifier saved
    whole, the body under `roberta.layers.`): hfport's text-classification model over the base equals peft's, and
    its saved-back folder loads in peft to the same logits."""
    base = tmp_path / "cls-base"
    save_hf(FAMILY, "sequence-classification", base)
    made = peft.get_peft_model(transformers.AutoModelForSequenceClassification.from_pretrained(base),
                               peft.LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8,
                                               target_modules=["q_proj", "k_proj", "o_proj", "fc1"]))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for _, p in made.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
    made.save_pretrained(tmp_path / "cls")
    b = batch(FAMILY, pairs=False)
    with torch.no_grad():
        want = made.eval()(**b).logits  # (B, labels)
        plain = transformers.AutoModelForSequenceClassification.from_pretrained(base).eval()(**b).logits
    cls = hfport.tasks.get("text-classification").model_class
    ours = cls.from_pretrained(tmp_path / "cls", base_model=base)
    with torch.no_grad():
        torch.testing.assert_close(ours(**b).logits, want, atol=1e-5, rtol=1e-4)
    assert (want - plain).abs().max() > 1e-3  # the adapter and its head change the logits
    lora.save_adapter(ours, tmp_path / "cls-back")
    again = peft.PeftModel.from_pretrained(transformers.AutoModelForSequenceClassification.from_pretrained(base),
                                           tmp_path / "cls-back").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(**b).logits, want, atol=1e-5, rtol=1e-4)
