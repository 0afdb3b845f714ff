"""hfport vs transformers' ModernBertForSequenceClassification (attn_implementation="sdpa", its best CPU path): a
fine-tune step (forward + backward, dropout on) and inference (forward under inference_mode), in real tokens/s.

The model is ModernBERT-base's shape scaled to run on a small CPU: hidden 384, 6 layers (global attention every
3rd, the rest a 128-token sliding window), 6 heads, GeGLU intermediate 576, vocab 50368, no biases but the
decoder's, mean pooling (ModernBERT-base's classifier_pooling). Same weights, same batches: rows with lengths
drawn from 16..512, padded to the longest (what dynamic padding produces). Rounds interleave the two
implementations, alternating which goes first; per batch the median over rounds is kept. Real tokens/s counts
the attention-mask ones only (padding is work transformers does, not throughput).

    python scripts/bench_modernbert.py [--rounds 3] [--batches 6] [--batch-size 4] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import transformers
from _benchutil import describe, machine

import hfport

CONFIG = dict(vocab_size=50368, hidden_size=384, num_hidden_layers=6, num_attention_heads=6, intermediate_size=576,
              local_attention=128, global_attn_every_n_layers=3, max_position_embeddings=8192,
              classifier_pooling="mean", pad_token_id=50283, num_labels=3, attention_dropout=0.1,
              embedding_dropout=0.1, mlp_dropout=0.1, classifier_dropout=0.1)


def make_batches(n: int, batch_size: int, lo: int, hi: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n):
        lengths = torch.randint(lo, hi + 1, (batch_size,), generator=g)
        t = int(lengths.max())
        mask = (torch.arange(t)[None, :] < lengths[:, None]).long()  # (B, T)
        ids = torch.randint(0, 50280, (batch_size, t), generator=g).masked_fill(mask == 0, CONFIG["pad_token_id"])
        labels = torch.randint(0, CONFIG["num_labels"], (batch_size,), generator=g)
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return batches


def train_step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> float:
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    model(**batch).loss.backward()
    return time.perf_counter() - start


def infer_step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> float:
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    start = time.perf_counter()
    with torch.inference_mode():
        model(**inputs)
    return time.perf_counter() - start


def measure(theirs, ours, batches, rounds: int, step, train: bool) -> dict[str, list[float]]:
    for model in (theirs, ours):
        model.train(train)
    for b in batches[:1]:  # warm-up: allocator, kernels
        step(theirs, b), step(ours, b)
    times: dict[str, list[list[float]]] = {"transformers": [[] for _ in batches], "hfport": [[] for _ in batches]}
    for r in range(rounds):
        for i, b in enumerate(batches):
            order = [("transformers", theirs), ("hfport", ours)]
            for name, model in order if (r + i) % 2 == 0 else order[::-1]:
                times[name][i].append(step(model, b))
    return {k: [statistics.median(ts) for ts in v] for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    config = transformers.ModernBertConfig(**CONFIG)
    theirs = transformers.ModernBertForSequenceClassification(config)
    with tempfile.TemporaryDirectory() as folder:
        theirs.save_pretrained(folder)
        theirs = transformers.ModernBertForSequenceClassification.from_pretrained(folder, attn_implementation="sdpa")
        ours = hfport.AutoModelForSequenceClassification.from_pretrained(folder)
    batches = make_batches(args.batches, args.batch_size, args.min_len, args.max_len)
    theirs.eval(), ours.eval()
    with torch.no_grad():  # the same function, before timing anything
        diff = max((theirs(**b).logits - ours(**b).logits).abs().max().item() for b in batches[:2])

    real = sum(int(b["attention_mask"].sum()) for b in batches)
    padded = sum(b["attention_mask"].numel() for b in batches)
    print(f"machine: {describe(machine())}")
    print(f"model: hidden {CONFIG['hidden_size']}, {CONFIG['num_hidden_layers']} layers (global every "
          f"{CONFIG['global_attn_every_n_layers']}, window {CONFIG['local_attention']}), {CONFIG['num_attention_heads']}"
          f" heads, GeGLU intermediate {CONFIG['intermediate_size']}, vocab {CONFIG['vocab_size']}; transformers "
          f"attention: {theirs.config._attn_implementation}")
    print(f"batches: {args.batches} of {args.batch_size}, lengths {args.min_len}..{args.max_len}, {real} real tokens, "
          f"{100 * (1 - real / padded):.0f}% padding; {args.rounds} interleaved rounds; max |logit diff| {diff:.1e}")
    for label, step, train in (("fine-tune step (forward + backward, dropout on)", train_step, True),
                               ("inference (forward, inference_mode)", infer_step, False)):
        med = measure(theirs, ours, batches, args.rounds, step, train)
        total = {k: sum(v) for k, v in med.items()}
        ratios = [a / o for a, o in zip(med["transformers"], med["hfport"])]
        print(f"\n{label}")
        print(f"{'batch':>5} {'T':>4} {'real':>5} {'transformers ms':>16} {'hfport ms':>10} {'ratio':>6}")
        for i, b in enumerate(batches):
            print(f"{i:>5} {b['input_ids'].shape[1]:>4} {int(b['attention_mask'].sum()):>5} "
                  f"{med['transformers'][i] * 1e3:>16.1f} {med['hfport'][i] * 1e3:>10.1f} {ratios[i]:>6.2f}")
        print(f"real tokens/s (median per batch, summed): transformers {real / total['transformers']:.0f}, hfport "
              f"{real / total['hfport']:.0f} -> {total['transformers'] / total['hfport']:.2f}x; per-batch ratio "
              f"median {statistics.median(ratios):.2f}x (range {min(ratios):.2f}x..{max(ratios):.2f}x)")


if __name__ == "__main__":
    main()
