"""The step-time cost of a checkpoint: inline (the old way) vs a CPU snapshot written in the background.

    python scripts/bench_checkpoint.py MODEL_DIR [--steps 24] [--save-steps 4]

Fine-tunes MODEL_DIR (e.g. all-MiniLM-L6-v2) on generated sentences with logging every step, and reads the wall
time between consecutive `train` events: the interval that follows a save step contains the save. Prints the
median interval after save steps and after other steps, for both modes (medians: a shared machine is noisy).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import hfport.train.loop as loop
from hfport.train.checkpoint import CheckpointWriter


class InlineWriter(CheckpointWriter):
    """The pre-background behaviour: the save runs in the training thread."""

    def submit(self, job):  # type: ignore[override]
        job()


def run(model: str, data: Path, out: Path, steps: int, save_steps: int, inline: bool) -> dict[str, float]:
    loop.CheckpointWriter = InlineWriter if inline else CheckpointWriter
    stamps: dict[int, float] = {}

    def on_event(event: dict) -> None:
        if event["type"] == "train":
            stamps[event["step"]] = time.perf_counter()

    loop.finetune({"model": model, "train": str(data), "output_dir": str(out), "max_steps": steps,
                   "save_steps": save_steps, "logging_steps": 1, "batch_size": 16, "eval_strategy": "no",
                   "eval_fraction": 0.0, "save_total_limit": 2, "overwrite": True}, progress=False, on_event=on_event)
    after_save = [stamps[s + 1] - stamps[s] for s in stamps if s % save_steps == 0 and s + 1 in stamps]
    other = [stamps[s + 1] - stamps[s] for s in stamps if s % save_steps and s + 1 in stamps and s > 1]
    return {"after_save_ms": 1000 * statistics.median(after_save), "other_ms": 1000 * statistics.median(other)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--save-steps", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "train.jsonl"
        rng = random.Random(0)
        with open(data, "w") as f:
            for _ in range(512):
                words = " ".join(rng.choice(["good", "bad", "film", "plot", "and", "then"]) for _ in range(20))
                f.write(json.dumps({"text": words, "label": rng.choice(["pos", "neg"])}) + "\n")
        for inline in (True, False, True, False):  # interleaved: drift on a shared machine hits both
            result = run(args.model, data, Path(tmp) / "run", args.steps, args.save_steps, inline)
            print(json.dumps({"mode": "inline" if inline else "background", **{k: round(v, 1) for k, v in
                                                                             result.items()}}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
