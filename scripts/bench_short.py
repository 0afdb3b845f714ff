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
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_short.py --profile --threads 1 # where hfport auto's step goes
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_short.py --copies 3 --steps 60 --runs 7 \
        --ab AA_NOTHING_READS=1                    # longer windows; an A/A pair (a variable nothing reads): the noise

One run's window is ~0.1-0.5 s a step x --steps; on a shared machine the ratio of one pair of runs moves by +-15%,
so longer windows (--copies writes the sentences several times over: one epoch, the longest window, holds
--copies x 25 batches) and more runs narrow the median's range.

--profile measures nothing against Trainer: it runs hfport.finetune(precision="auto") twice on the same batches
(the first run only warms the process: oneDNN builds and caches its bf16 matmuls per shape, so a batch whose
token count is new pays ~1 ms per matmul shape and keeps ~1.6 MB per weight shape; measured on 25 batches of these
sentences, one thread, a step with a new count took 4% more CPU time than the same step repeated. The timed runs
repeat the same batches, so only their first run pays that) and prints torch.profiler's self CPU time over the second run's measured steps, by part of the work
(scripts/bench.py's groups) and by operator. Profile on a quiet machine: a loaded one stretches every operator.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch

import bench
from _benchutil import describe, machine

ROOT = Path(__file__).resolve().parent.parent
DATA = [ROOT / "examples" / "data" / "topics_train.csv", ROOT / "examples" / "data" / "topics_eval.csv"]


def write_data(path: Path, folder: Path, copies: int = 1) -> dict[str, float]:
    """The sentences as JSONL {"text", "label" (an id: both libraries read ids alike)}, COPIES times over (one epoch
    then holds COPIES x 25 batches: a longer measured window on a noisy machine, same sentences, same lengths);
    their token-length stats (of one copy) and "rows" written."""
    from tokenizers import Tokenizer

    rows = [r for f in DATA for r in csv.DictReader(f.open(encoding="utf-8"))]
    topics = sorted({r["label"] for r in rows})
    if len(topics) != bench.NUM_LABELS:
        raise RuntimeError(f"{DATA[0].name}: {len(topics)} topics, the checkpoint's head has {bench.NUM_LABELS}")
    with open(path, "w") as f:
        f.writelines(json.dumps({"text": r["text"], "label": topics.index(r["label"])}) + "\n"
                     for _ in range(copies) for r in rows)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    lengths = [len(e.ids) for e in tokenizer.encode_batch([r["text"] for r in rows])]
    return {"examples": len(rows), "rows": len(rows) * copies, "median_tokens": statistics.median(lengths),
            "min_tokens": min(lengths),
            "max_tokens": max(lengths)}


def with_env(setting: str, run: Callable[[], float]) -> float:
    """RUN with SETTING ("NAME=VALUE") in the environment, the old value put back after."""
    name, _, value = setting.partition("=")
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        return run()
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


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


class ProfileWindow:
    """torch.profiler over the measured steps of one training loop: started at the forward of step `first`, stopped
    at the forward of step `last` (the one that closes the timed window), counting top-level module calls through
    torch's global module hooks, as bench.StepClock does, so the loop itself is not touched."""

    def __init__(self, first: int, last: int):
        self.first, self.last, self.depth, self.calls = first, last, 0, 0
        self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self.running = False

    def __enter__(self) -> ProfileWindow:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        self.handles = [register_module_forward_pre_hook(self._before), register_module_forward_hook(self._after)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles:
            handle.remove()
        if self.running:
            self.profiler.stop()
            self.running = False

    def _before(self, module: torch.nn.Module, args: Any) -> None:
        if self.depth == 0:
            self.calls += 1
            if self.calls == self.first:
                self.profiler.start()
                self.running = True
            elif self.calls == self.last and self.running:
                self.profiler.stop()
                self.running = False
        self.depth += 1

    def _after(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self.depth -= 1

    def report(self, steps: int, rows: int = 25) -> str:
        events = self.profiler.key_averages()
        spent: dict[str, float] = {}
        for event in events:
            group = next((g for g, fragments in bench.PROFILE_GROUPS if any(f in event.key for f in fragments)),
                         "other")
            spent[group] = spent.get(group, 0.0) + event.self_cpu_time_total
        total = sum(spent.values()) or 1.0
        lines = [f"self CPU time over {steps} steps: {total / 1e3 / steps:.1f} ms a step"]
        lines += [f"  {g:32s} {spent.get(g, 0.0) / total:5.1%}" for g, _ in bench.PROFILE_GROUPS + (("other", ()),)]
        return "\n".join(lines) + "\n" + events.table(sort_by="self_cpu_time_total", row_limit=rows)


def profile_auto(folder: Path, data: Path, scratch: Path, work: Any, total: int) -> None:
    """--profile: hfport auto's measured steps under torch.profiler, after one unprofiled run on the same batches."""
    bench.run_hfport_finetune(folder, data, scratch / "h", work, total, "auto")
    with ProfileWindow(work.warmup_steps + 1, total) as window:
        bench.run_hfport_finetune(folder, data, scratch / "h", work, total, "auto")
    print(f"threads: {torch.get_num_threads()}")
    print(window.report(total - work.warmup_steps - 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="runs of each contestant, alternating the order")
    parser.add_argument("--steps", type=int, default=20, help="measured steps a run")
    parser.add_argument("--warmup-steps", type=int, default=2, help="steps before the measured window")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--copies", type=int, default=1, help="the 400 sentences written this many times over, so "
                        "one epoch (the longest window: an epoch end checkpoints) holds more steps")
    parser.add_argument("--trainer-bf16", action="store_true", help="also Trainer(bf16=True)")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's; 1 on a shared machine "
                        "keeps other jobs from stalling every parallel kernel)")
    parser.add_argument("--ab", metavar="ENV=VALUE", help="also hfport auto with this environment setting, in the "
                        "same interleaved runs: the A/B of a switch read at call time; a setting training ignores makes it an A/A run, whose spread is the machine's noise")
    parser.add_argument("--json", type=Path, help="write every figure to this file")
    parser.add_argument("--profile", action="store_true", help="no comparison: where hfport auto's step goes "
                        "(torch.profiler's self CPU time by part and by operator; see above)")
    args = parser.parse_args()
    if args.ab is not None and "=" not in args.ab.strip("="):
        parser.error(f"--ab {args.ab!r}: expected NAME=VALUE")
    if args.threads:
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
        stats = write_data(data, folder, args.copies)
        per_epoch = stats["rows"] // work.batch_size
        if total > per_epoch:  # an epoch end checkpoints: it must not fall inside the window
            parser.error(f"{total} steps exceed one epoch ({per_epoch} batches of {work.batch_size}); fewer --steps "
                         "or more --copies")
        bench.say(f"machine: {describe(m)}; data: {stats['examples']} sentences, median {stats['median_tokens']} "
                  f"tokens ({stats['min_tokens']}..{stats['max_tokens']}); batches of {work.batch_size}, "
                  f"{work.warmup_steps} warm-up + {work.steps} measured steps a run")
        if args.profile:
            profile_auto(folder, data, scratch, work, total)
            return
        runs = {
            "Trainer fp32": lambda: bench.run_trainer(spec, folder, data, scratch / "t", work, total),
            "hfport fp32": lambda: bench.run_hfport_finetune(folder, data, scratch / "h", work, total),
            "hfport auto": lambda: bench.run_hfport_finetune(folder, data, scratch / "h", work, total, "auto")}
        if args.trainer_bf16:
            runs["Trainer bf16"] = lambda: bench.run_trainer(spec, folder, data, scratch / "t", work, total, True)
        if args.ab:
            runs[f"hfport auto {args.ab}"] = lambda: with_env(args.ab, lambda: bench.run_hfport_finetune(
                folder, data, scratch / "h", work, total, "auto"))
        rates = run_all(runs, args.runs)
    results: dict[str, Any] = {"hfport fp32 / Trainer fp32": pair(rates, "hfport fp32", "Trainer fp32"),
                               "hfport auto / Trainer fp32": pair(rates, "hfport auto", "Trainer fp32")}
    if args.trainer_bf16:
        results["hfport auto / Trainer bf16"] = pair(rates, "hfport auto", "Trainer bf16")
    if args.ab:
        results[f"hfport auto {args.ab} / Trainer fp32"] = pair(rates, f"hfport auto {args.ab}", "Trainer fp32")
        results[f"hfport auto / auto {args.ab}"] = pair(rates, "hfport auto", f"hfport auto {args.ab}")
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
