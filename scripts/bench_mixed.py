"""Mixed-adapter forward passes against the base alone, in one process, interleaved (a shared machine's drift hits
both alike): what scripts/loadtest.py --adapters measures over HTTP, without the server.

    python scripts/bench_mixed.py                        # 8 adapters, 16 texts, 30 rounds, the server's dtype
    python scripts/bench_mixed.py --dtype float32 --texts 8
    python scripts/bench_mixed.py --rounds 5 --profile   # and torch.profiler's op table for each side

Each round times, back to back and in an order that alternates, one pipeline call of the same TEXTS on (a) the base
alone and (b) client c's text on adapter c mod N (the loadtest's spread; the adapters are loadtest's: ranks and
targets varied, weights random); the same two as one forward pass of the batch (Pipeline.forward_batch); and the
mixed pass with every adapted layer in the stacked form (nn/lora.py's MIXED_LORA, what the cost rule chooses
against). Printed: the median time of each and the ratio base / mixed (the share of the base's throughput mixing
keeps) with its interquartile range over rounds. Timed by this thread's CPU time unless --wall.

Also timed: "call/per-adapter", the same texts served as one pipeline per adapter serves them at best: one call per
adapter with only that adapter's texts (the clients of one adapter batched together, no adapter sharing a pass).
per-adapter / mixed is the ceiling of what mixed batches can gain over one pipeline per adapter on this machine
(issue 29's ">= 3x" goal): the compute alone, with HTTP, JSON and scheduling costing nothing and every client's
request in one mixed batch. On a CPU, where a forward pass costs a fixed part plus a part that grows with its rows,
that ceiling is the fixed part's share; on a GPU a pass of 16 short texts costs about what one of 2 does.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadtest import TEXTS, adapter_folders, linked_copy, minilm_path  # noqa: E402

import hfport  # noqa: E402
from hfport.nn import lora as nn_lora  # noqa: E402


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[0], statistics.median(xs), q[2]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--texts", type=int, default=16, help="texts per call (the loadtest's clients)")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--dtype", default="auto", help="as the server's HFPORT_PREDICT_DTYPE (auto: bf16 on a CPU with "
                   "native bf16, which is what scripts/loadtest.py's servers run)")
    p.add_argument("--profile", action="store_true", help="print torch.profiler's table of each side")
    p.add_argument("--wall", action="store_true", help="wall-clock time (default: this thread's CPU time, which "
                   "other processes on a shared machine disturb less; with --threads 1 torch runs on this thread)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.wall or args.threads > 1 else time.thread_time
    with tempfile.TemporaryDirectory(prefix="hfport-bench-mixed-") as tmp:
        base = linked_copy(minilm_path(), Path(tmp) / "minilm")
        folders = adapter_folders(base, Path(tmp), args.adapters)
        pipe = hfport.pipeline("sentence-embedding", model=str(base), dtype=args.dtype)
        for i, folder in enumerate(folders):
            pipe.add_adapter(f"a{i}", folder)
        texts = [TEXTS[c % len(TEXTS)] for c in range(args.texts)]
        names = [f"a{c % args.adapters}" for c in range(args.texts)]
        rows = [f for t, n in zip(texts, names) for f in pipe.adapters[n].preprocess(t, pipe.resolve_options({}))]
        for f, n in zip(rows, names):
            f.pipe = pipe.adapters[n]
        plain = [type(f)(item=f.item, input_ids=f.input_ids, attention_mask=f.attention_mask,
                         token_type_ids=f.token_type_ids) for f in rows]
        (rows,), (plain,) = pipe.batches(rows), pipe.batches(plain)  # as a call batches them: longest first
        def stacked(fn):  # every adapted layer in the stacked form (every present adapter's columns, masked)
            def run():
                saved, nn_lora.MIXED_LORA = nn_lora.MIXED_LORA, "stacked"
                try:
                    fn()
                finally:
                    nn_lora.MIXED_LORA = saved
            return run

        groups = {n: [t for t, m in zip(texts, names) if m == n] for n in dict.fromkeys(names)}

        def per_adapter() -> None:  # one pipeline per adapter at best: each adapter's clients in one call of its own
            for n, ts in groups.items():
                pipe.predict(ts, adapter=n)

        cases = {
            "call/base": lambda: pipe.predict(texts),
            "call/mixed": lambda: pipe.predict(texts, adapter=names),
            "call/per-adapter": per_adapter,
            "pass/base": lambda: pipe.forward_batch(plain),
            "pass/mixed": lambda: pipe.forward_batch(rows),
            "pass/stacked": stacked(lambda: pipe.forward_batch(rows)),
        }
        for fn in cases.values():  # warm-up: first-call allocations, kernel choices
            fn(), fn()
        times: dict[str, list[float]] = {k: [] for k in cases}
        order = list(cases)
        for r in range(args.rounds):
            for k in (order if r % 2 == 0 else order[::-1]):
                t0 = clock()
                cases[k]()
                times[k].append(clock() - t0)
        for k, xs in times.items():
            lo, med, hi = quartiles(xs)
            print(f"{k:16s} median {med * 1e3:7.2f} ms (quartiles {lo * 1e3:.2f}..{hi * 1e3:.2f})")
        for base_key, key in (("call/base", "call/mixed"), ("pass/base", "pass/mixed"), ("pass/base", "pass/stacked")):
            ratios = [b / m for b, m in zip(times[base_key], times[key])]
            lo, med, hi = quartiles(ratios)
            print(f"{base_key} / {key} = {med:.3f} (quartiles {lo:.3f}..{hi:.3f}): the share of the base's "
                  f"throughput mixed keeps")
        ratios = [p / m for p, m in zip(times["call/per-adapter"], times["call/mixed"])]
        lo, med, hi = quartiles(ratios)
        print(f"call/per-adapter / call/mixed = {med:.3f} (quartiles {lo:.3f}..{hi:.3f}): the most mixed batches can "
              f"gain over one pipeline per adapter here (compute only; {len(groups)} adapters, "
              f"{args.texts} texts in one batch)")
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            for k in ("pass/base", "pass/mixed", "pass/stacked"):
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    for _ in range(5):
                        cases[k]()
                print(f"--- {k} (5 passes)")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
    return 0


if __name__ == "__main__":
    sys.exit(main())
