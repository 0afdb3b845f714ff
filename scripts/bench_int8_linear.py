"""torch's int8 GEMM kernels and Int8Linear's variants beside fp32 and bf16 nn.Linear, one Linear shape at a time.

    python scripts/bench_int8_linear.py [--tokens 256,2048] [--threads 1,2] [--rounds 7]

For MiniLM's (384 -> 1536, 1536 -> 384) and BERT-base's (768 -> 3072, 3072 -> 768) feed-forward shapes and each M
(tokens of a packed batch), every candidate runs once per round, all candidates interleaved round by round (so a
burst of load from another process hits them all); prints GOP/s (2 M K N per call) as best / median over the rounds.
One thread is timed by the thread's CPU time (a descheduled thread does not count), more threads by wall clock.

Kernels (the product alone; operands quantized beforehand):
  int_mm (K,N)       torch._int_mm, int8 x int8 -> int32, weight (K, N) contiguous
  int_mm (N,K).t     the same on a transposed view of the (N, K) weight
  onednn u8          torch.ops.onednn.qlinear_pointwise: uint8 activations (per-tensor scale and zero point) x int8
                     weight packed once (qlinear_prepack), dequantization by the channel scales fused, fp32 out
  onednn u8 fused    the same with the bias fused and bf16 out (what Int8Linear "tensor" runs)
  dynamic fbgemm     torch.ops.quantized.linear_dynamic on fbgemm's prepacked per-channel weight (fp32 in and out;
                     quantizes its input per tensor inside; torch.ao's deprecated path)
  weight-only int8   torch._weight_int8pack_mm: bf16 activations x int8 weight (no int8 product: for reference)
Layers (everything a call does: quantize the input, multiply, dequantize, bias):
  Int8Linear tensor / token   hfport.nn.int8.Int8Linear with either activation granularity, fp32 in and out
  Int8Linear tensor bf16      "tensor" with bf16 in and out (its bias bf16): what an int8 model's bf16 body runs

`--quick` runs one small M and two rounds (a check that the script works, not a measurement).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch
from torch import nn

from hfport.nn.int8 import Int8Linear, onednn_int8_available

SHAPES = ((384, 1536), (1536, 384), (768, 3072), (3072, 768))


def kernels(m: int, k: int, n: int) -> dict[str, object]:
    """name -> a call running that candidate on (m, k) x (k, n) operands made here."""
    torch.manual_seed(0)
    x, w, bias = torch.randn(m, k), torch.randn(n, k) * 0.05, torch.randn(n)
    xb, wb, bb = x.bfloat16(), w.bfloat16(), bias.bfloat16()
    qx = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    ux = (qx.int() + 128).to(torch.uint8)
    wq = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    wt, ws, wzp = wq.t().contiguous(), torch.rand(n) * 0.01 + 1e-3, torch.zeros(n, dtype=torch.long)
    linear = nn.Linear(k, n).eval()
    out = {"fp32 linear": lambda: nn.functional.linear(x, w, bias),
           "bf16 linear": lambda: nn.functional.linear(xb, wb, bb),
           "int_mm (K,N)": lambda: torch._int_mm(qx, wt),
           "int_mm (N,K).t": lambda: torch._int_mm(qx, wq.t())}
    if onednn_int8_available():
        packed = torch.ops.onednn.qlinear_prepack(wq, None)
        out["onednn u8"] = lambda: torch.ops.onednn.qlinear_pointwise(ux, 1.0, 128, packed, ws, wzp, None, 1.0, 0,
                                                                      torch.float32, "none", [], "")
        out["onednn u8 fused"] = lambda: torch.ops.onednn.qlinear_pointwise(ux, 0.01, 128, packed, ws, wzp, bias, 1.0,
                                                                            0, torch.bfloat16, "none", [], "")
    if "fbgemm" in torch.backends.quantized.supported_engines:
        torch.backends.quantized.engine = "fbgemm"
        with warnings.catch_warnings():  # torch.ao's quantized tensors are deprecated: measured, not used
            warnings.simplefilter("ignore")
            dyn = torch.ops.quantized.linear_prepack(torch.quantize_per_channel(w, ws, wzp, 0, torch.qint8), bias)
        out["dynamic fbgemm"] = lambda: torch.ops.quantized.linear_dynamic(x, dyn, True)
    out["weight-only int8"] = lambda: torch._weight_int8pack_mm(xb, wq, ws.bfloat16())
    for activations in ("tensor", "token") if onednn_int8_available() else ("token",):
        layer = Int8Linear.from_linear(linear, activations=activations)
        out[f"Int8Linear {activations}"] = lambda layer=layer: layer(x)
        if activations == "tensor":  # what a bf16 body runs (hfport.int8.float_dtype): bf16 in and out
            layer16 = copy.deepcopy(layer).to(torch.bfloat16)
            out["Int8Linear tensor bf16"] = lambda layer=layer16: layer(xb)
    return out


def measure(calls: dict[str, object], rounds: int, clock) -> dict[str, list[float]]:
    """Seconds per call of each candidate, per round, interleaved."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    with torch.inference_mode():
        for call in calls.values():
            call()  # warm-up: kernel selection, packing, first touch
        for _ in range(rounds):
            for name, call in calls.items():
                start = clock()
                call()
                times[name].append(clock() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="256,2048", help="comma-separated M values")
    parser.add_argument("--threads", default="1,2", help="comma-separated intra-op thread counts")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="M=64, 2 rounds, one thread: proves the script runs")
    args = parser.parse_args()
    tokens = [64] if args.quick else [int(t) for t in args.tokens.split(",")]
    threads = [1] if args.quick else [int(t) for t in args.threads.split(",")]
    rounds = 2 if args.quick else args.rounds
    print(f"torch {torch.__version__}; GOP/s best / median over {rounds} interleaved rounds")
    for n_threads in threads:
        torch.set_num_threads(n_threads)
        clock = time.thread_time if n_threads == 1 else time.perf_counter
        for m in tokens:
            for k, n in SHAPES:
                ops = 2 * m * k * n / 1e9
                times = measure(kernels(m, k, n), rounds, clock)
                cells = ", ".join(f"{name} {ops / min(v):.0f}/{ops / statistics.median(v):.0f}"
                                  for name, v in times.items())
                print(f"{n_threads} thread(s), M={m} {k}->{n}: {cells}", flush=True)


if __name__ == "__main__":
    main()
