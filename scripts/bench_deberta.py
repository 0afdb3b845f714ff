"""Forward + backward time of hfport vs transformers' DebertaV2ForSequenceClassification, same weights, same batches.

The model is DeBERTa-v3-base's shape scaled to run on a small CPU: hidden 384, 6 layers, 6 heads, intermediate
1536, vocab 32000, position_buckets 256 (max_relative_positions 512), c2p + p2c with shared projections,
LayerNorm-ed relative table, no absolute positions. Two workloads of batches of 4 rows with lengths in 16..256:
"random" (each row's length drawn independently, padded to the longest) and "grouped" (length-grouped batching:
a batch length drawn from 16..256, rows within [T/2, T]). Training mode (dropout on), loss.backward() included.
Rounds interleave the two implementations (alternating which goes first). Per batch the median and the min over
rounds are kept (the min is the steadier figure on a machine shared with other work); the figure printed is
total transformers time / total hfport time, and the median of the per-batch ratios.

    python scripts/bench_deberta.py [--rounds 5] [--batches 8] [--mode train|eval] [--workload both]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import transformers
from _benchutil import cpu_name

import hfport

CONFIG = dict(vocab_size=32000, hidden_size=384, num_hidden_layers=6, num_attention_heads=6, intermediate_size=1536,
              max_position_embeddings=512, relative_attention=True, position_buckets=256, max_relative_positions=-1,
              pos_att_type="p2c|c2p", share_att_key=True, norm_rel_ebd="layer_norm", position_biased_input=False,
              type_vocab_size=0, num_labels=3)


def make_batches(n: int, batch_size: int, lo: int, hi: int, seed: int = 0,
                 grouped: bool = False) -> list[dict[str, torch.Tensor]]:
    """random: every row's length drawn from lo..hi (padding to the longest, ~40% of the batch);
    grouped: as with length-grouped batching, a batch length drawn from lo..hi and rows within [T/2, T]."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n):
        if grouped:
            top = int(torch.randint(lo, hi + 1, (1,), generator=g))
            lengths = torch.randint(max(lo, top // 2), top + 1, (batch_size,), generator=g)
            lengths[0] = top
        else:
            lengths = torch.randint(lo, hi + 1, (batch_size,), generator=g)
        t = int(lengths.max())
        mask = (torch.arange(t)[None, :] < lengths[:, None]).long()  # (B, T)
        ids = torch.randint(3, CONFIG["vocab_size"], (batch_size, t), generator=g).masked_fill(mask == 0, 0)
        labels = torch.randint(0, CONFIG["num_labels"], (batch_size,), generator=g)
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return batches


def step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> float:
    """One forward + backward (training), or one forward under inference_mode when the model is in eval mode
    and INFER is set."""
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    if INFER:
        with torch.inference_mode():
            model(**batch)
    else:
        model(**batch).loss.backward()
    return time.perf_counter() - start


INFER = False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--mode", choices=("train", "eval", "infer"), default="train",
                        help="train: dropout on, as in fine-tuning; eval: dropout off (still forward + backward); "
                             "infer: forward only under inference_mode")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--workload", choices=("random", "grouped", "both"), default="both")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    global INFER
    INFER = args.mode == "infer"

    torch.manual_seed(0)
    theirs = transformers.DebertaV2ForSequenceClassification(transformers.DebertaV2Config(**CONFIG))
    with tempfile.TemporaryDirectory() as folder:
        theirs.save_pretrained(folder)
        ours = hfport.AutoModelForSequenceClassification.from_pretrained(folder)
    for model in (theirs, ours):
        model.train(args.mode == "train")

    print(f"machine: {cpu_name()}, {os.cpu_count()} cores visible, {args.threads} threads; torch {torch.__version__}, "
          f"transformers {transformers.__version__}")
    print(f"model: hidden {CONFIG['hidden_size']}, {CONFIG['num_hidden_layers']} layers, "
          f"{CONFIG['num_attention_heads']} heads, intermediate {CONFIG['intermediate_size']}, vocab "
          f"{CONFIG['vocab_size']}, position_buckets {CONFIG['position_buckets']}; mode {args.mode}; "
          f"{args.rounds} interleaved rounds")
    for grouped in ((False, True) if args.workload == "both" else (args.workload == "grouped",)):
        run(theirs, ours, args, grouped)


def run(theirs: torch.nn.Module, ours: torch.nn.Module, args: argparse.Namespace, grouped: bool) -> None:
    batches = make_batches(args.batches, args.batch_size, args.min_len, args.max_len, grouped=grouped)
    with torch.no_grad():  # the same function, before timing anything
        theirs.eval(), ours.eval()
        diff = max((theirs(**b).logits - ours(**b).logits).abs().max().item() for b in batches[:2])
        theirs.train(args.mode == "train"), ours.train(args.mode == "train")
    for b in batches[:2]:  # warm-up: allocator, relative-index cache, kernels
        step(theirs, b), step(ours, b)

    times: dict[str, list[list[float]]] = {"transformers": [[] for _ in batches], "hfport": [[] for _ in batches]}
    for r in range(args.rounds):
        for i, b in enumerate(batches):
            order = [("transformers", theirs), ("hfport", ours)]
            for name, model in order if (r + i) % 2 == 0 else order[::-1]:
                times[name][i].append(step(model, b))

    real = sum(int(b["attention_mask"].sum()) for b in batches)
    padded = sum(b["attention_mask"].numel() for b in batches)
    print(f"\nworkload {'grouped' if grouped else 'random'}: {args.batches} batches of {args.batch_size}, lengths "
          f"{args.min_len}..{args.max_len}, {100 * (1 - real / padded):.0f}% padding; max |logit diff| {diff:.1e}")
    print(f"{'batch':>5} {'T':>4} {'transformers ms':>16} {'hfport ms':>10} {'ratio':>6}   (median over rounds)")
    med = {k: [statistics.median(ts) for ts in v] for k, v in times.items()}
    best = {k: [min(ts) for ts in v] for k, v in times.items()}
    for i, b in enumerate(batches):
        print(f"{i:>5} {b['input_ids'].shape[1]:>4} {med['transformers'][i] * 1e3:>16.1f} "
              f"{med['hfport'][i] * 1e3:>10.1f} {med['transformers'][i] / med['hfport'][i]:>6.2f}")
    for label, t in (("median", med), ("min", best)):
        ratios = [a / o for a, o in zip(t["transformers"], t["hfport"])]
        print(f"{label:>6} over rounds: total transformers {sum(t['transformers']) * 1e3:.0f} ms, hfport "
              f"{sum(t['hfport']) * 1e3:.0f} ms -> {sum(t['transformers']) / sum(t['hfport']):.2f}x; per-batch "
              f"ratio median {statistics.median(ratios):.2f}x (range {min(ratios):.2f}x..{max(ratios):.2f}x)")


if __name__ == "__main__":
    main()
