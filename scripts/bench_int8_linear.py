"""Int8Linear's dequantization and weight layout variants beside fp32 and bf16 nn.Linear, one Linear at a time.

    OMP_NUM_THREADS=1 python scripts/bench_int8_linear.py [--tokens 2048] [--reps 20]

Prints ms per call and the ratio to fp32 for MiniLM's (384 -> 1536, 1536 -> 384) and BERT-base's (768 -> 3072,
3072 -> 768) feed-forward shapes. Variants of the same math (nn/int8.py):
  int8 (K,N)      Int8Linear as shipped: weight kept (K, N) contiguous; acc * token scale written over acc's own
                  memory, then addcmul in place
  int8 (N,K).t    the same with the weight a transposed view of (N, K) (the kernel packs it per call)
  int8 4-pass     the textbook dequantization: float(acc), * token scale, * channel scale, + bias
  int_mm only     the int8 product alone (the ceiling the quantization passes eat into)
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from hfport.nn.int8 import Int8Linear, quantize_rows


def timed(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def four_pass(layer: Int8Linear, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    q, scale = quantize_rows(x)
    y = torch._int_mm(q, weight).float()
    return y * scale * layer.weight_scale + layer.bias


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {args.tokens} tokens; ms (x fp32)")
    for k, n in ((384, 1536), (1536, 384), (768, 3072), (3072, 768)):
        linear = nn.Linear(k, n).eval()
        x = torch.randn(args.tokens, k)
        q = Int8Linear.from_linear(linear)
        strided = Int8Linear.from_linear(linear)
        strided.weight_t = q.weight_t.t().contiguous().t()  # (K, N) view of an (N, K) tensor
        qx, _ = quantize_rows(x)
        bf16, xb = nn.Linear(k, n).to(torch.bfloat16).eval(), x.to(torch.bfloat16)
        with torch.inference_mode():
            rows = {"fp32": lambda: linear(x), "bf16": lambda: bf16(xb), "int8 (K,N)": lambda: q(x),
                    "int8 (N,K).t": lambda: strided(x),
                    "int8 4-pass": lambda: four_pass(q, x, q.weight_t),
                    "int_mm only": lambda: torch._int_mm(qx, q.weight_t)}
            ms = {name: timed(fn, args.reps) for name, fn in rows.items()}
        line = ", ".join(f"{name} {v:.2f} ({ms['fp32'] / v:.2f}x)" for name, v in ms.items())
        print(f"{k}->{n}: {line}")


if __name__ == "__main__":
    main()
