"""hfport on a CUDA GPU against transformers (and sentence-transformers), in one prepared call: scripts/gpu_check.sh
runs it on the lent machine after the CUDA tests, offline, and docs/benchmarks.md gets its figures only from such a
run.

    python scripts/bench_gpu.py --out $OUT/bench.json        # on a GPU: every section, within --budget seconds
    python scripts/bench_gpu.py --dry-run                    # anywhere, in seconds: the plan, shapes, what would run
    python scripts/bench_gpu.py --tiny --device cpu --out /tmp/bench.json   # every section on tiny shapes, a CPU

Models are random weights in BERT-base's and ModernBERT-base's shapes (transformers' default configs for those two
families), saved once by transformers so that every side loads the same tensors; texts are tests/synthetic.py's
pseudo-words with a learnable label, lengths log-uniform from 16 to 512 tokens, tokenized by a WordPiece tokenizer
trained on them (no hub, no MiniLM on that machine).

Sections (each writes its figures into --out as it ends; one that fails records its error and the rest go on; one
that would start with less than its share of the budget left is skipped and says so):
  finetune   bf16 AMP fine-tunes, hfport's finetune() and transformers' Trainer (sdpa, fused AdamW), same weights and
             texts, batch 32, 512 tokens at most: real (unpadded) tokens/s over the steps after a warm-up (the clock
             read after a GPU sync at both ends, nothing in between), MFU on real tokens (against the datasheet's
             989 TFLOP/s dense bf16 and against a bf16 matmul measured here), peak memory (max_memory_allocated).
             FLOPs per sequence of L real tokens: 6 N L (N: non-embedding parameters) + 12 d L K per layer, K = L
             for global attention and min(L, window + 1) for ModernBERT's local layers.
  inference  the same texts embedded (mean pooling) by hfport's pipeline in bf16, transformers' AutoModel in bf16
             (sdpa, batches of 64 sorted by length) and sentence-transformers in fp16 (its encode, batch 64): texts/s
             and real tokens/s, tokenization included everywhere, the best of two passes after a warm-up.
  serve      `hfport serve` (HFPORT_DEVICE=cuda, bf16) and 64 concurrent clients posting /embed (8 texts a request)
             for a fixed time: requests/s, texts/s, latency p50/p95.
  adapters   8 LoRA adapters over one BERT-base classifier: one pipeline serving mixed-adapter batches (adapter= per
             text) against one pipeline per adapter fed its own texts: texts/s.
  profile    where the time goes, BERT-base: torch.profiler over 3 steps of hfport's finetune() and of Trainer, and
             over hfport's pipeline embedding 512 texts: the top operators by GPU and by CPU time, and GPU-busy time
             against wall time (the first GPU run's fine-tunes ran at ~1-3% MFU on both sides: host-bound).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import torch  # noqa: E402

from tests import synthetic  # noqa: E402

DATASHEET_BF16 = 989.4e12  # H100/H200 SXM dense bf16, FLOP/s (NVIDIA's datasheet); KINDS.md measured ~790 here


@dataclass
class Shape:
    """One model shape: transformers' config class and its overrides (none: the family's base defaults)."""

    name: str
    config_class: str
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass
class Plan:
    device: str
    tiny: bool
    shapes: list[Shape]
    max_length: int
    batch_size: int
    warmup_steps: int
    timed_steps: int
    train_texts: int
    infer_texts: int
    infer_batch: int
    serve_clients: int
    serve_texts_per_request: int
    serve_seconds: float
    adapters: int
    adapter_texts: int
    budget_s: float
    sections: list[str]

    def lengths(self, n: int, seed: int) -> list[int]:
        """n lengths in words, log-uniform from 16 to max_length - 2 (the [CLS] and [SEP] make max_length)."""
        rng = random.Random(seed)
        top = self.max_length - 2
        return [int(math.exp(rng.uniform(math.log(min(16, top)), math.log(top)))) for _ in range(n)]


SECTIONS = ("finetune", "inference", "serve", "adapters", "profile")


def make_plan(args: argparse.Namespace) -> Plan:
    if args.tiny:
        tiny = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                    vocab_size=2000)
        shapes = [Shape("bert-tiny", "BertConfig", dict(tiny, max_position_embeddings=128)),
                  Shape("modernbert-tiny", "ModernBertConfig", dict(tiny, num_hidden_layers=3, local_attention=16,
                                                                    max_position_embeddings=128))]
        return Plan(args.device, True, shapes, max_length=96, batch_size=8, warmup_steps=2, timed_steps=3,
                    train_texts=40, infer_texts=48, infer_batch=16, serve_clients=4, serve_texts_per_request=4,
                    serve_seconds=3.0, adapters=2, adapter_texts=16, budget_s=args.budget, sections=args.sections)
    shapes = [Shape("bert-base", "BertConfig"), Shape("modernbert-base", "ModernBertConfig")]
    return Plan(args.device, False, shapes, max_length=512, batch_size=32, warmup_steps=10, timed_steps=30,
                train_texts=32 * 40, infer_texts=2048, infer_batch=64, serve_clients=64, serve_texts_per_request=8,
                serve_seconds=15.0, adapters=8, adapter_texts=1024, budget_s=args.budget, sections=args.sections)


# --- what the sections share ---------------------------------------------------------------------------------------


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def hf_config(shape: Shape, ids: dict[str, int], **extra: Any) -> Any:
    """transformers' config of `shape`, its special ids the tokenizer's."""
    import transformers

    config = getattr(transformers, shape.config_class)(**shape.overrides, **extra)
    config.pad_token_id = ids["[PAD]"]
    for name, token in (("cls_token_id", "[CLS]"), ("sep_token_id", "[SEP]"), ("bos_token_id", "[CLS]"),
                        ("eos_token_id", "[SEP]")):
        if hasattr(config, name):
            setattr(config, name, ids[token])
    return config


def save_model(shape: Shape, folder: Path, tokenizer: Path, ids: dict[str, int], head: str) -> Path:
    """A seeded random transformers model of `shape` (head: AutoModel class name), saved with the tokenizer."""
    import shutil

    import transformers

    config = hf_config(shape, ids, num_labels=2)
    torch.manual_seed(0)
    model = getattr(transformers, head).from_config(config)
    model.save_pretrained(folder)
    for f in tokenizer.iterdir():
        shutil.copy(f, folder / f.name)
    return folder


def base_folder(shape: Shape, work: Path, tokenizer: Path, ids: dict[str, int]) -> Path:
    """`shape`'s bare encoder (what embeds), saved once."""
    folder = work / f"{shape.name}-base"
    return folder if folder.exists() else save_model(shape, folder, tokenizer, ids, "AutoModel")


def shape_facts(shape: Shape) -> dict[str, Any]:
    """Sizes of `shape` from a model built on the meta device (no memory, no weights)."""
    import transformers

    config = hf_config(shape, {t: i for i, t in enumerate(synthetic.SPECIALS)})  # ids inside a tiny vocabulary
    with torch.device("meta"):
        model = transformers.AutoModel.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    embed = sum(p.numel() for n, p in model.named_parameters() if "embeddings" in n)
    local = sum(t == "sliding_attention" for t in getattr(config, "layer_types", None) or ())
    return {"hidden": config.hidden_size, "layers": config.num_hidden_layers, "heads": config.num_attention_heads,
            "intermediate": config.intermediate_size, "vocab": config.vocab_size, "parameters": total,
            "non_embedding_parameters": total - embed, "local_layers": local,
            "local_window": getattr(config, "local_attention", None) if local else None}


def train_flops(facts: dict[str, Any], lengths: list[int]) -> float:
    """Forward + backward FLOPs of sequences of `lengths` real tokens (see the module docstring)."""
    n, d, layers = facts["non_embedding_parameters"], facts["hidden"], facts["layers"]
    local, window = facts["local_layers"], facts["local_window"]
    total = 0.0
    for length in lengths:
        seen_local = min(length, window + 1) if local else length  # keys a query sees in a local layer
        total += 6 * n * length + 12 * d * length * ((layers - local) * length + local * seen_local)
    return total


def matmul_peak(device: str) -> float | None:
    """bf16 FLOP/s of an 8192^3 matmul on random data, the mean of 10 after 3 warm-ups (None off CUDA)."""
    if not device.startswith("cuda"):
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync(device)
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    sync(device)
    return 10 * 2 * 8192 ** 3 / (time.perf_counter() - start)


def peak_memory(device: str) -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 3) if device.startswith("cuda") else None


def reset_memory(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


# --- finetune ----------------------------------------------------------------------------------------------------


def finetune_hfport(plan: Plan, model: Path, train: Path, out: Path) -> dict[str, Any]:
    """hfport's finetune(): the clock read after a sync at the end of the warm-up's last step and of the last step
    (Trainer.step wrapped here to find those two moments and to add up each step's real tokens)."""
    from hfport.train import loop
    from hfport.train.config import FinetuneConfig

    marks: dict[str, Any] = {"tokens": 0, "lengths": []}
    step = loop.Trainer.step

    def timed(self, group):
        result = step(self, group)
        n = self.state.step
        if n == plan.warmup_steps:
            sync(plan.device)
            marks["t0"] = time.perf_counter()
        elif n > plan.warmup_steps:
            marks["tokens"] += result.tokens
            marks["lengths"] += [len(self.data.train[i].input_ids) for g in group for i in g]
            if n == plan.warmup_steps + plan.timed_steps:
                sync(plan.device)
                marks["t1"] = time.perf_counter()
        return result

    loop.Trainer.step = timed
    reset_memory(plan.device)
    try:
        loop.finetune(FinetuneConfig(
            model=str(model), train=str(train), eval=None, eval_fraction=0.0, output_dir=str(out),
            batch_size=plan.batch_size, max_length=plan.max_length, precision="bf16", lr=2e-5, warmup_ratio=0.0,
            max_steps=plan.warmup_steps + plan.timed_steps, logging_steps=plan.warmup_steps, save_strategy="no",
            eval_strategy="no", seed=3), progress=False)
    finally:
        loop.Trainer.step = step
    seconds = marks["t1"] - marks["t0"]
    return {"seconds": seconds, "real_tokens": marks["tokens"], "lengths": marks["lengths"],
            "peak_memory_gib": peak_memory(plan.device)}


def finetune_trainer(plan: Plan, model: Path, train: Path, out: Path) -> dict[str, Any]:
    """transformers' Trainer (sdpa, fused AdamW, bf16), batches as its default sampler draws them: the clock read
    after a sync at the same two steps; real tokens counted by the collator (no worker processes: it runs just
    before each step)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model)
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    data = [{**tok(r["text"], truncation=True, max_length=plan.max_length), "labels": r["label"]} for r in rows]
    pad = transformers.DataCollatorWithPadding(tok)
    marks: dict[str, Any] = {"tokens": 0, "lengths": []}

    def collate(features):
        batch = pad(features)
        lengths = batch["attention_mask"].sum(1).tolist()
        marks["pending"] = lengths
        return batch

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == plan.warmup_steps:
                sync(plan.device)
                marks["t0"] = time.perf_counter()
            elif state.global_step > plan.warmup_steps:
                marks["tokens"] += sum(marks["pending"])
                marks["lengths"] += marks["pending"]
                if state.global_step == plan.warmup_steps + plan.timed_steps:
                    sync(plan.device)
                    marks["t1"] = time.perf_counter()

    reset_memory(plan.device)
    ref = transformers.AutoModelForSequenceClassification.from_pretrained(model, attn_implementation="sdpa")
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=plan.batch_size, learning_rate=2e-5,
        max_steps=plan.warmup_steps + plan.timed_steps, logging_steps=plan.warmup_steps, save_strategy="no",
        report_to=[], seed=3, bf16=True, optim="adamw_torch_fused" if plan.device.startswith("cuda") else "adamw_torch",
        dataloader_num_workers=0, use_cpu=not plan.device.startswith("cuda"), disable_tqdm=True)
    trainer = transformers.Trainer(model=ref, args=args, train_dataset=data, data_collator=collate,
                                   callbacks=[Clock()])
    trainer.train()
    return {"seconds": marks["t1"] - marks["t0"], "real_tokens": marks["tokens"], "lengths": marks["lengths"],
            "peak_memory_gib": peak_memory(plan.device)}


def section_finetune(plan: Plan, work: Path, tokenizer: Path, ids: dict[str, int], peak: float | None) -> dict:
    train = synthetic.write_jsonl(work / "train.jsonl", synthetic.texts(plan.lengths(plan.train_texts, 1), seed=1))
    out: dict[str, Any] = {}
    for shape in plan.shapes:
        folder = save_model(shape, work / f"{shape.name}-cls", tokenizer, ids,
                            "AutoModelForSequenceClassification")
        facts = shape_facts(shape)
        rows = {}
        for side, run in (("hfport", finetune_hfport), ("transformers_trainer", finetune_trainer)):
            measured = run(plan, folder, train, work / f"run-{shape.name}-{side}")
            lengths = measured.pop("lengths")
            flops = train_flops(facts, lengths) / measured["seconds"]
            rows[side] = {**measured, "real_tokens_per_s": round(measured["real_tokens"] / measured["seconds"], 1),
                          "tflops_on_real_tokens": round(flops / 1e12, 2),
                          "mfu_datasheet": round(flops / DATASHEET_BF16, 4),
                          "mfu_measured_peak": round(flops / peak, 4) if peak else None}
        rows["speedup_real_tokens_per_s"] = round(rows["hfport"]["real_tokens_per_s"]
                                                  / rows["transformers_trainer"]["real_tokens_per_s"], 3)
        out[shape.name] = {"shape": facts, **rows}
    return out


# --- inference ---------------------------------------------------------------------------------------------------


def best_of(runs: int, fn: Callable[[], Any], device: str) -> float:
    """Seconds of the fastest of `runs` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(runs):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return min(times)


def section_inference(plan: Plan, work: Path, tokenizer: Path, ids: dict[str, int], peak: float | None) -> dict:
    import transformers

    import hfport

    texts = [t for t, _ in synthetic.texts(plan.lengths(plan.infer_texts, 2), seed=2)]
    cuda = plan.device.startswith("cuda")
    out: dict[str, Any] = {"texts": len(texts)}
    for shape in plan.shapes:
        folder = base_folder(shape, work, tokenizer, ids)
        tok = transformers.AutoTokenizer.from_pretrained(folder)
        real = sum(min(len(x), plan.max_length) for x in tok(texts, truncation=True,
                                                             max_length=plan.max_length)["input_ids"])
        rows: dict[str, Any] = {"real_tokens": real}
        start = time.perf_counter()
        tok(texts, truncation=True, max_length=plan.max_length)
        rows["tokenize_only_s"] = round(time.perf_counter() - start, 4)  # what every side pays before the model

        pipe = hfport.pipeline("sentence-embedding", model=folder, device=plan.device, dtype="bfloat16")
        rows["hfport_bf16"] = best_of(2, lambda: pipe(texts), plan.device)
        del pipe

        model = transformers.AutoModel.from_pretrained(folder, dtype=torch.bfloat16,
                                                       attn_implementation="sdpa").to(plan.device).eval()

        @torch.inference_mode()
        def theirs() -> None:
            order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
            for start in range(0, len(order), plan.infer_batch):
                batch = tok([texts[i] for i in order[start:start + plan.infer_batch]], padding=True,
                            truncation=True, max_length=plan.max_length, return_tensors="pt").to(plan.device)
                hidden = model(**batch).last_hidden_state
                mask = batch["attention_mask"][..., None].to(hidden.dtype)
                ((hidden * mask).sum(1) / mask.sum(1)).float().cpu()

        rows["transformers_bf16"] = best_of(2, theirs, plan.device)
        del model

        try:
            from sentence_transformers import SentenceTransformer

            st = SentenceTransformer(str(folder), device=plan.device)
            st.max_seq_length = plan.max_length
            if cuda:
                st.half()
            rows["sentence_transformers_fp16" if cuda else "sentence_transformers_fp32"] = best_of(
                2, lambda: st.encode(texts, batch_size=plan.infer_batch), plan.device)
            del st
        except ImportError as e:
            rows["sentence_transformers"] = f"not run: {e}"
        for key in [k for k, v in rows.items() if isinstance(v, float)]:
            rows[key] = {"seconds": round(rows[key], 4), "texts_per_s": round(len(texts) / rows[key], 1),
                         "real_tokens_per_s": round(real / rows[key], 1)}
        out[shape.name] = rows
    return out


# --- serve: /embed with many clients -------------------------------------------------------------------------------


def section_serve(plan: Plan, work: Path, tokenizer: Path, ids: dict[str, int], peak: float | None) -> dict:
    import httpx

    from server.launch import ServerProcess

    shape = plan.shapes[0]
    folder = base_folder(shape, work, tokenizer, ids)  # a bare encoder: the server embeds with it
    texts = [t for t, _ in synthetic.texts(plan.lengths(512, 3), seed=3)]
    env = {"HFPORT_DEVICE": plan.device, "HFPORT_PREDICT_DTYPE": "bfloat16", "HF_HUB_OFFLINE": "1",
           "HFPORT_PREDICT_MAX_PENDING": str(4 * plan.serve_clients), "HFPORT_PREDICT_THREADS": "2"}
    server = ServerProcess(work / "serve-data", work / "serve.log", env=env, ready_timeout=180, cwd=REPO,
                           args=("--model", f"embedder={folder}"))
    server.start()
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    stop = time.perf_counter() + plan.serve_seconds

    def client(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=server.url, timeout=60) as c:
            while time.perf_counter() < stop:
                body = {"inputs": rng.sample(texts, plan.serve_texts_per_request), "truncate": True}
                start = time.perf_counter()
                r = c.post("/embed", json=body)
                took = time.perf_counter() - start
                with lock:
                    (latencies.append(took) if r.status_code == 200 else errors.append(f"{r.status_code}"))

    try:
        with httpx.Client(base_url=server.url, timeout=120) as c:  # a warm-up request, and what the server says
            c.post("/embed", json={"inputs": texts[:8], "truncate": True}).raise_for_status()
            health, info = c.get("/health").json(), c.get("/info").json()
        stop = time.perf_counter() + plan.serve_seconds
        started = time.perf_counter()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(plan.serve_clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - started
    finally:
        server.stop()
    latencies.sort()
    pick = (lambda q: round(latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000, 1)) \
        if latencies else (lambda q: None)
    return {"model": shape.name, "clients": plan.serve_clients, "texts_per_request": plan.serve_texts_per_request,
            "seconds": round(seconds, 2), "requests": len(latencies), "errors": len(errors),
            "requests_per_s": round(len(latencies) / seconds, 1),
            "texts_per_s": round(len(latencies) * plan.serve_texts_per_request / seconds, 1),
            "latency_ms_p50": pick(0.5), "latency_ms_p95": pick(0.95),
            "server_device": health.get("device"), "server_dtype": info.get("model_dtype")}


# --- adapters: mixed batches against one pipeline per adapter ----------------------------------------------------


def section_adapters(plan: Plan, work: Path, tokenizer: Path, ids: dict[str, int], peak: float | None) -> dict:
    import hfport
    from hfport import lora

    shape = plan.shapes[0]
    base = work / f"{shape.name}-cls"
    if not base.exists():
        save_model(shape, base, tokenizer, ids, "AutoModelForSequenceClassification")
    folders = []
    for i in range(plan.adapters):
        model = hfport.AutoModelForSequenceClassification.from_pretrained(base)
        lora.apply_lora(model, r=8, alpha=16, targets=["q", "v"], base=str(base))
        g = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.requires_grad:
                    p.add_(torch.randn(p.shape, generator=g) * 0.02)
        folders.append(work / f"adapter-{i}")
        lora.save_adapter(model, folders[-1])
    names = [f"a{i}" for i in range(plan.adapters)]
    texts = [t for t, _ in synthetic.texts(plan.lengths(plan.adapter_texts, 4), seed=4)]
    which = [names[i % len(names)] for i in range(len(texts))]  # each text its adapter, interleaved

    mixed = hfport.pipeline("text-classification", model=base, device=plan.device, dtype="bfloat16",
                            adapters=dict(zip(names, map(str, folders))))
    mixed_s = best_of(2, lambda: mixed(texts, adapter=which), plan.device)
    del mixed
    own = {n: hfport.pipeline("text-classification", model=f, device=plan.device, dtype="bfloat16")
           for n, f in zip(names, folders)}
    mine = {n: [t for t, w in zip(texts, which) if w == n] for n in names}
    apart_s = best_of(2, lambda: [own[n](mine[n]) for n in names], plan.device)
    return {"model": shape.name, "adapters": plan.adapters, "texts": len(texts),
            "mixed_batches": {"seconds": round(mixed_s, 4), "texts_per_s": round(len(texts) / mixed_s, 1)},
            "pipeline_per_adapter": {"seconds": round(apart_s, 4), "texts_per_s": round(len(texts) / apart_s, 1)},
            "mixed_over_per_adapter": round(apart_s / mixed_s, 3)}


# --- profile: where the time goes ----------------------------------------------------------------------------------


def _tables(prof: Any, cuda: bool, wall: float) -> dict[str, Any]:
    events = prof.key_averages()
    device_us = sum(getattr(e, "self_device_time_total", 0) or 0 for e in events) if cuda else 0
    out = {"wall_s": round(wall, 4), "gpu_busy_s": round(device_us / 1e6, 4) if cuda else None,
           "by_cpu": events.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60).splitlines()}
    if cuda:
        out["by_gpu"] = events.table(sort_by="self_device_time_total", row_limit=18,
                                     max_name_column_width=60).splitlines()
    return out


def section_profile(plan: Plan, work: Path, tokenizer: Path, ids: dict[str, int], peak: float | None) -> dict:
    import transformers
    from torch.profiler import ProfilerActivity, profile

    import hfport
    from hfport.train import loop
    from hfport.train.config import FinetuneConfig

    cuda = plan.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    shape = plan.shapes[0]
    folder = work / f"{shape.name}-cls"
    if not folder.exists():
        save_model(shape, folder, tokenizer, ids, "AutoModelForSequenceClassification")
    train = work / "train.jsonl"
    if not train.exists():
        synthetic.write_jsonl(train, synthetic.texts(plan.lengths(plan.train_texts, 1), seed=1))
    first, last = 5, 7  # profile steps 5..7 of 8: after the optimizer's state and the allocator have settled
    out: dict[str, Any] = {"model": shape.name, "steps": [first, last]}

    prof = profile(activities=activities)
    marks: dict[str, float] = {}
    step = loop.Trainer.step

    def traced(self, group):
        if self.state.step + 1 == first:
            sync(plan.device)
            prof.start()
            marks["t0"] = time.perf_counter()
        result = step(self, group)
        if self.state.step == last:
            sync(plan.device)
            marks["t1"] = time.perf_counter()
            prof.stop()
        return result

    loop.Trainer.step = traced
    try:
        loop.finetune(FinetuneConfig(
            model=str(folder), train=str(train), eval=None, eval_fraction=0.0, output_dir=str(work / "prof-hfport"),
            batch_size=plan.batch_size, max_length=plan.max_length, precision="bf16", lr=2e-5, warmup_ratio=0.0,
            max_steps=last + 1, logging_steps=100, save_strategy="no", eval_strategy="no", seed=3), progress=False)
    finally:
        loop.Trainer.step = step
    out["hfport_finetune"] = _tables(prof, cuda, marks["t1"] - marks["t0"])

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    data = [{**tok(r["text"], truncation=True, max_length=plan.max_length), "labels": r["label"]} for r in rows]
    prof2 = profile(activities=activities)

    class Trace(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step + 1 == first:
                sync(plan.device)
                prof2.start()
                marks["t2"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == last:
                sync(plan.device)
                marks["t3"] = time.perf_counter()
                prof2.stop()

    ref = transformers.AutoModelForSequenceClassification.from_pretrained(folder, attn_implementation="sdpa")
    args = transformers.TrainingArguments(
        output_dir=str(work / "prof-trainer"), per_device_train_batch_size=plan.batch_size, learning_rate=2e-5,
        max_steps=last + 1, logging_steps=100, save_strategy="no", report_to=[], seed=3, bf16=cuda,
        optim="adamw_torch_fused" if cuda else "adamw_torch", use_cpu=not cuda, disable_tqdm=True)
    transformers.Trainer(model=ref, args=args, train_dataset=data, data_collator=transformers.DataCollatorWithPadding(tok),
                         callbacks=[Trace()]).train()
    out["trainer_finetune"] = _tables(prof2, cuda, marks["t3"] - marks["t2"])
    del ref

    texts = [t for t, _ in synthetic.texts(plan.lengths(min(512, plan.infer_texts), 2), seed=2)]
    pipe = hfport.pipeline("sentence-embedding", model=base_folder(shape, work, tokenizer, ids), device=plan.device,
                           dtype="bfloat16")
    pipe(texts)
    sync(plan.device)
    with profile(activities=activities) as prof3:
        start = time.perf_counter()
        pipe(texts)
        sync(plan.device)
        wall = time.perf_counter() - start
    out["hfport_inference_512_texts"] = _tables(prof3, cuda, wall)
    return out


# --- the run -------------------------------------------------------------------------------------------------------

RUNNERS = {"finetune": section_finetune, "inference": section_inference, "serve": section_serve,
           "adapters": section_adapters, "profile": section_profile}
# of the budget, to start a section (a section starts with at least half its share left)
SHARE = {"finetune": 0.4, "inference": 0.2, "serve": 0.2, "adapters": 0.2, "profile": 0.2}


def describe_plan(plan: Plan) -> dict[str, Any]:
    """What would run, on which shapes and data: the dry run's output (no GPU, no weights)."""
    lengths = plan.lengths(plan.train_texts, 1)
    return {"plan": {**asdict(plan), "shapes": [{"name": s.name, "config": s.config_class, **shape_facts(s)}
                                                for s in plan.shapes]},
            "train_lengths": {"texts": len(lengths), "min": min(lengths) + 2, "median": statistics.median(lengths) + 2,
                              "max": max(lengths) + 2, "mean": round(statistics.mean(lengths) + 2, 1)},
            "would_run": {name: SECTION_WORDS[name] for name in plan.sections}}


SECTION_WORDS = {
    "finetune": "hfport finetune() vs transformers Trainer (sdpa), bf16 AMP, per shape: real tokens/s, MFU, memory",
    "inference": "hfport pipeline bf16 vs transformers bf16 vs sentence-transformers fp16, per shape: texts/s",
    "serve": "hfport serve + concurrent /embed clients: requests/s, texts/s, latency p50/p95",
    "adapters": "mixed-adapter batches vs one pipeline per adapter: texts/s",
    "profile": "torch.profiler over 3 fine-tune steps (hfport, Trainer) and one embedding pass: top ops, GPU busy",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON report here (also printed)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, shapes and what would run; no GPU")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes and counts (checks the script end to end)")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (with --tiny)")
    parser.add_argument("--budget", type=float, default=200.0, help="seconds for all sections together")
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    args = parser.parse_args(argv)
    plan = make_plan(args)
    if args.dry_run:
        report = describe_plan(plan)
        text = json.dumps(report, indent=1, default=str)
        print(text)
        if args.out:
            args.out.write_text(text + "\n")
        return 0
    if plan.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench_gpu.py: no CUDA device here; use --dry-run, or --tiny --device cpu", file=sys.stderr)
        return 2
    if not plan.tiny and not plan.device.startswith("cuda"):
        print("bench_gpu.py: the full shapes are for a GPU; on a CPU use --tiny", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from _benchutil import machine

    started = time.perf_counter()
    peak = matmul_peak(plan.device)
    report: dict[str, Any] = {"machine": machine(), "plan": asdict(plan),
                              "bf16_matmul_tflops": round(peak / 1e12, 1) if peak else None, "sections": {}}

    def save() -> None:
        text = json.dumps(report, indent=1, default=str)
        if args.out:
            args.out.write_text(text + "\n")

    with tempfile.TemporaryDirectory(prefix="bench-gpu-") as tmp:
        work = Path(tmp)
        tokenizer = work / "tokenizer"
        ids = synthetic.wordpiece_tokenizer(tokenizer, max_length=plan.max_length)
        for name in plan.sections:
            left = plan.budget_s - (time.perf_counter() - started)
            if left < SHARE[name] * plan.budget_s * 0.5:
                report["sections"][name] = {"skipped": f"{left:.0f} s of the budget left"}
                save()
                continue
            section_start = time.perf_counter()
            try:
                report["sections"][name] = RUNNERS[name](plan, work, tokenizer, ids, peak)
            except Exception as e:  # one section's failure is its result; the others still run
                report["sections"][name] = {"error": f"{type(e).__name__}: {e}",
                                            "traceback": traceback.format_exc()[-3000:]}
            report["sections"][name]["section_s"] = round(time.perf_counter() - section_start, 1)
            print(f"{name}: {json.dumps(report['sections'][name], default=str)[:2000]}", flush=True)
            save()
    report["total_s"] = round(time.perf_counter() - started, 1)
    save()
    print(json.dumps({k: v for k, v in report.items() if k != "plan"}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
