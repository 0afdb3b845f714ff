"""hfport.finetune against transformers.Trainer on short real sentences, where fixed per-step costs weigh most.

The data: the topic-classification sentences under examples/data (topics_train.csv + topics_eval.csv: 400
hand-written sentences, 4 topics; median 18 tokens with [CLS] and [SEP], 11..45), written as JSONL with the topic
as a label id. The model: the real all-MiniLM-L6-v2 checkpoint with a fresh seeded 4-label head (bench.py's
build_checkpoint), loaded by both libraries from one folder.

Each run is a library's own entry point, measured as scripts/bench.py measures its "entry points" (its helpers
are imported, not copied): same batch size, lr, linear schedule, weight decay, clipping and logging interval;
shuffled batches, not grouped by length; no evaluation and no checkpoint inside the measured window; tokens/s over
the steps after the warm-up ones, timed from torch's global module hooks so that neither loop is touched.
Contestants: Trainer fp32, hfport.finetune fp32, hfport.finetune precision="auto" (bf16 autocast where the CPU
computes bf16 natively; fp32 elsewhere); with --trainer-bf16 also Trainer(bf16=True). Runs alternate which
library goes first (forward, then backward order); the ratio is the median over pairs of runs, min-max beside it.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_short.py              # ~3 min on 2 cores
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_short.py --runs 2 --steps 8    # a quick look
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import bench
from _benchutil import describe, machine

ROOT = Path(__file__).resolve().parent.parent
DATA = [ROOT / "examples" / "data" / "topics_train.csv", ROOT / "examples" / "data" / "topics_eval.csv"]


def write_data(path: Path, folder: Path) -> dict[str, float]:
    """The sentences as JSONL {"text", "label" (an id: both libraries read ids alike)}; their token-length stats."""
    from tokenizers import Tokenizer

    rows = [r for f in DATA for r in csv.DictReader(f.open(encoding="utf-8"))]
    topics = sorted({r["label"] for r in rows})
    if len(topics) != bench.NUM_LABELS:
        raise RuntimeError(f"{DATA[0].name}: {len(topics)} topics, the checkpoint's head has {bench.NUM_LABELS}")
    with open(path, "w") as f:
        f.writelines(json.dumps({"text": r["text"], "label": topics.index(r["label"])}) + "\n" for r in rows)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    lengths = [len(e.ids) for e in tokenizer.encode_batch([r["text"] for r in rows])]
    return {"examples": len(rows), "median_tokens": statistics.median(lengths), "min_tokens": min(lengths),
            "max_tokens": max(lengths)}


def run_all(runs: dict[str, Callable[[], float]], n: int) -> dict[str, list[float]]:
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(n):
        for name in list(runs) if r % 2 == 0 else list(runs)[::-1]:
            rates[name].append(runs[name]())
        bench.say(f"  run {r + 1}/{n}: " + ", ".join(f"{k} {v[-1]:,.0f} tok/s" for k, v in rates.items()))
    return rates


def pair(rates: dict[str, list[float]], ours: str, theirs: str) -> dict[str, float]:
    ratios = [o / t for o, t in zip(rates[ours], rates[theirs])]
    return {"theirs_tok_s": statistics.median(rates[theirs]), "ours_tok_s": statistics.median(rates[ours]),
            "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="runs of each contestant, alternating the order")
    parser.add_argument("--steps", type=int, default=20, help="measured steps a run")
    parser.add_argument("--warmup-steps", type=int, default=2, help="steps before the measured window")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--trainer-bf16", action="store_true", help="also Trainer(bf16=True)")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's; 1 on a shared machine "
                        "keeps other jobs from stalling every parallel kernel)")
    parser.add_argument("--json", type=Path, help="write every figure to this file")
    args = parser.parse_args()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    bench.quiet_libraries()
    m = machine()  # after --threads: the report names the threads used
    # max_len 128: MiniLM's own limit for sentences; every sentence here is shorter, so nothing is cut
    work = replace(bench.FULL, batch_size=args.batch_size, min_len=0, max_len=128, warmup_steps=args.warmup_steps,
                   steps=args.steps, entry_runs=args.runs)
    total = work.warmup_steps + work.steps + 1  # + 1: the step whose start closes the window
    spec = bench.MODELS["minilm"]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="hfport-bench-short-") as scratch:
        scratch = Path(scratch)
        folder, data = scratch / "model", scratch / "train.jsonl"
        bench.build_checkpoint(spec, folder, work.seed)
        stats = write_data(data, folder)
        per_epoch = stats["examples"] // work.batch_size
        if total > per_epoch:  # an epoch end checkpoints: it must not fall inside the window
            parser.error(f"{total} steps exceed one epoch ({per_epoch} batches of {work.batch_size}); fewer --steps")
        bench.say(f"machine: {describe(m)}; data: {stats['examples']} sentences, median {stats['median_tokens']} "
                  f"tokens ({stats['min_tokens']}..{stats['max_tokens']}); batches of {work.batch_size}, "
                  f"{work.warmup_steps} warm-up + {work.steps} measured steps a run")
        runs = {
            "Trainer fp32": lambda: bench.run_trainer(spec, folder, data, scratch / "t", work, total),
            "hfport fp32": lambda: bench.run_hfport_finetune(folder, data, scratch / "h", work, total),
            "hfport auto": lambda: bench.run_hfport_finetune(folder, data, scratch / "h", work, total, "auto")}
        if args.trainer_bf16:
            runs["Trainer bf16"] = lambda: bench.run_trainer(spec, folder, data, scratch / "t", work, total, True)
        rates = run_all(runs, args.runs)
    results: dict[str, Any] = {"hfport fp32 / Trainer fp32": pair(rates, "hfport fp32", "Trainer fp32"),
                               "hfport auto / Trainer fp32": pair(rates, "hfport auto", "Trainer fp32")}
    if args.trainer_bf16:
        results["hfport auto / Trainer bf16"] = pair(rates, "hfport auto", "Trainer bf16")
    from hfport.train.loop import mixed_precision

    auto = mixed_precision("auto")
    print(f"machine: {describe(m)}")
    print(f"data: {stats['examples']} real sentences (examples/data topics), median {stats['median_tokens']} tokens "
          f"({stats['min_tokens']}..{stats['max_tokens']}); batch {work.batch_size}; {args.runs} runs each of "
          f"{work.warmup_steps} warm-up + {work.steps} measured steps; hfport auto = {auto!r} mixed precision here; "
          f"{time.perf_counter() - started:.0f} s in all")
    for name, r in results.items():
        print(f"{name:28s} {r['ratio']:.2f}x ({r['ratio_min']:.2f}-{r['ratio_max']:.2f})   "
              f"{r['ours_tok_s']:,.0f} vs {r['theirs_tok_s']:,.0f} tok/s")
    if args.json:
        args.json.write_text(json.dumps({"machine": m, "data": stats, "auto": auto, "rates": rates,
                                         "results": results, "argv": sys.argv[1:]}, indent=2))


if __name__ == "__main__":
    main()
