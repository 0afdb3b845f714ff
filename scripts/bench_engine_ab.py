"""A/B of the inference engine's switches in one process: hfport with prepacked Linear weights and row shards
(HFPORT_PACKED_LINEAR=auto, HFPORT_ROW_SHARDS=auto: the defaults) against the same code with both off (what main
ran before them), per dtype (fp32, bf16, int8), beside transformers fp32, on scripts/bench.py's models, batches
and interleaved rounds (same weights, same padded batches: 16 rows of 8..256 tokens by default).

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_engine_ab.py                     # minilm and bert-base
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_engine_ab.py --models minilm --rounds 3 --quick
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_engine_ab.py --off HFPORT_ROW_SHARDS --rounds 7   # one switch

--off names the switches the "off" side turns off (default both); the "on" side keeps every switch at its default.

Printed per model: real tokens/s of every contestant (median round) and the ratios on/off and on/transformers with
their min..max over rounds. Timing needs a quiet machine; no figure is asserted anywhere.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

import bench
from _benchutil import describe, machine

ALL_SWITCHES = ("HFPORT_PACKED_LINEAR", "HFPORT_ROW_SHARDS")
SWITCHES = ALL_SWITCHES  # the ones the "off" side turns off (--off)


@contextlib.contextmanager
def switches(value: str | None):
    """Both engine switches set to VALUE ("off") for the block, or left at their defaults (None)."""
    saved = {k: os.environ.get(k) for k in SWITCHES}
    try:
        for k in SWITCHES:
            if value is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = value
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def hfport_models(folder: Path, off: bool) -> dict[str, torch.nn.Module]:
    """hfport's fp32, bf16 and int8 models of FOLDER, loaded with the switches off or at their defaults."""
    with switches("off" if off else None):
        fp32 = bench.load_model("hfport", folder, "sdpa").eval()
        bf16 = bench.load_model("hfport", folder, "sdpa").to(torch.bfloat16).eval()
        int8 = bench.int8_model(fp32, folder)
    return {"fp32": fp32, "bf16": bf16, "int8": int8}


def step(model: torch.nn.Module, off: bool):
    """bench's inference step, with the switches off around each call for the "off" side (row shards are read per
    call, packing at load and per call)."""
    inner = bench.inference_step(model)

    def run(batch: dict[str, torch.Tensor]) -> None:
        with switches("off" if off else None):
            inner(batch)

    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="minilm,bert-base")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dtypes", default="fp32,bf16,int8")
    p.add_argument("--quick", action="store_true", help="short batches, 2 rounds: checks that it runs")
    p.add_argument("--off", default=",".join(ALL_SWITCHES), help="the switches the off side turns off, by comma")
    args = p.parse_args(argv)
    global SWITCHES
    SWITCHES = tuple(args.off.split(","))
    if not set(SWITCHES) <= set(ALL_SWITCHES):
        p.error(f"--off: expected some of {', '.join(ALL_SWITCHES)}")
    work = bench.QUICK if args.quick else bench.FULL
    rounds = 2 if args.quick else args.rounds
    dtypes = args.dtypes.split(",")
    print(f"{describe(machine())}; torch threads {torch.get_num_threads()}")
    with tempfile.TemporaryDirectory(prefix="hfport-engine-ab-") as tmp:
        for name in args.models.split(","):
            spec = bench.MODELS[name]
            folder = Path(tmp) / name
            bench.build_checkpoint(spec, folder, seed=0)
            vocab = bench.read_vocabulary(folder)
            batches = bench.make_batches(bench.make_examples(work.batch_size * work.batches, vocab, work), work,
                                         vocab.pad)
            tokens = bench.real_tokens(batches)
            hf = bench.load_model("transformers", folder, spec.hf_attention).eval()
            on, off = hfport_models(folder, off=False), hfport_models(folder, off=True)
            steps = {"transformers fp32": bench.inference_step(hf)}
            for d in dtypes:
                steps[f"{d} on"] = step(on[d], off=False)
                steps[f"{d} off"] = step(off[d], off=True)
            bench.warm_up(steps, batches)
            per_round = bench.interleaved(steps, batches, rounds, seed=0, label=name)
            print(f"\n{name}: {tokens} real tokens a round, padding {bench.padding_fraction(batches):.0%}")
            for k, xs in per_round.items():
                print(f"  {k:18s} {tokens / statistics.median(xs):9,.0f} tok/s")
            for d in dtypes:
                for a, b in ((f"{d} on", f"{d} off"), (f"{d} on", "transformers fp32"),
                             (f"{d} off", "transformers fp32")):
                    r = [t / o for t, o in zip(per_round[b], per_round[a])]
                    print(f"  {a} vs {b}: {statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f})")
            if "int8" in dtypes and "bf16" in dtypes:
                for side in ("on", "off"):
                    r = [t / o for t, o in zip(per_round[f"bf16 {side}"], per_round[f"int8 {side}"])]
                    print(f"  int8 {side} vs bf16 {side}: {statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
