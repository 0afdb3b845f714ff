"""A/B of each remaining CPU engine mechanism, on whole-model inference (and, with --train, training steps), in
interleaved rounds in one process: every contestant runs every batch of every round, taking turns going first.

Inference runs the way a pipeline runs a batch (Pipeline.forward_batch: the padded batch through the model under
no_grad, each row's outputs cut and copied out), on scripts/bench.py's models, batches (16 rows of 8..256 tokens by
default, sorted longest first as a pipeline sorts them) and text-classification heads. Per model and dtype:
    default            every mechanism at its default: pipeline(packed_linear=True, row_shards="auto")
    -packed_linear     prepacked Linear weights off (hfport.for_inference(model, packed_linear=False))
    -row_shards        row shards off (row_shards="off"); for a dtype "auto" leaves whole (bf16, int8 with bf16
                       float parts) the contestant is +row_shards instead: row_shards=<intra-op threads>
    -attention_groups  packed attention always one call per run of equal lengths (nn/groups.py's cost rule off)
    -math_attention    bf16 only: attention always torch's fused SDPA kernel (nn/attention.py's _math_is_faster off)
    -padding_free      the padded layout (model.padding_free = False): the engine's layout itself, for scale
    -int8_float_path   int8 only: every call int8 (min_rows 0), no float weights for calls of few rows
With --train, per model a plain fine-tuning step (AdamW, dropout on) in fp32 and under bf16 autocast:
    default            as from_pretrained loads it (no inference step ever touches a training model)
    -dropout_mask      torch's own F.dropout (bernoulli_) instead of hfport's rand >= p mask (nn/dropout.py)
    -attention_groups, -math_attention (bf16), -padding_free   as above

Printed per model and dtype: real tokens/s of every contestant (median round), then for each mechanism what it buys
on that path: the off contestant's time over the default's, median and min..max over rounds (>1: the mechanism
makes it faster). A mechanism stays only where that is >= 1.05 on a default path (docs/benchmarks.md). Needs a quiet
machine; nothing is asserted. bf16 where the CPU computes it natively; where it does not, fp32 stands in.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_engine_ab.py --rounds 9 --train     # the A/B table
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_engine_ab.py --models minilm --dtypes fp32 --mechanisms row_shards
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_engine_ab.py --short --train --models minilm --rounds 5   # short texts
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_engine_ab.py --quick --train        # checks that it runs
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import importlib
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

import bench
from _benchutil import describe, machine

INFERENCE = ("packed_linear", "row_shards", "attention_groups", "math_attention", "padding_free", "int8_float_path")
TRAINING = ("dropout_mask", "attention_groups", "math_attention", "padding_free")


@contextlib.contextmanager
def switched(groups_on: bool = True, math_on: bool = True, dropout_on: bool = True) -> Iterator[None]:
    with attention_groups(groups_on), math_attention(math_on), dropout_mask(dropout_on):
        yield


@contextlib.contextmanager
def math_attention(on: bool) -> Iterator[None]:
    """bf16 attention in the math form where nn/attention.py's rule picks it (on), or always torch's fused kernel."""
    attention = importlib.import_module("hfport.nn.attention")
    saved = attention._math_is_faster
    if not on:
        attention._math_is_faster = lambda q, k, v: False
    try:
        yield
    finally:
        attention._math_is_faster = saved


@contextlib.contextmanager
def attention_groups(on: bool) -> Iterator[None]:
    """Packed attention's regrouping by length (nn/groups.py's cost rule) as it is (on) or never ("runs")."""
    from hfport.nn import groups

    saved = groups.PACKED_ATTENTION
    groups.PACKED_ATTENTION = saved if on else "runs"
    try:
        yield
    finally:
        groups.PACKED_ATTENTION = saved


def _torch_dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    return F.dropout(x, p, training)


@contextlib.contextmanager
def dropout_mask(on: bool) -> Iterator[None]:
    """hfport's dropout (on) or torch's F.dropout in its place, at both of its call sites (the Dropout modules and
    attention's probabilities)."""
    attention = importlib.import_module("hfport.nn.attention")
    dropout = importlib.import_module("hfport.nn.dropout")  # the module: hfport.nn.dropout names the function
    saved = dropout.dropout, attention.dropout
    if not on:
        dropout.dropout = attention.dropout = _torch_dropout
    try:
        yield
    finally:
        dropout.dropout, attention.dropout = saved


def features(batches: list[dict[str, torch.Tensor]]) -> list[list]:
    """Each padded batch as a pipeline's Features, longest row first (as Pipeline.batches sorts them)."""
    from hfport.pipelines import Feature

    out = []
    for batch in batches:
        rows = []
        for ids, mask in zip(batch["input_ids"].tolist(), batch["attention_mask"].tolist()):
            n = sum(mask)
            rows.append(Feature(item=len(rows), input_ids=ids[:n], attention_mask=[1] * n, token_type_ids=None))
        out.append(sorted(rows, key=lambda f: len(f.input_ids), reverse=True))
    return out


def inference_contestants(folder: Path, dtype: str, mechanisms: list[str]) -> dict[str, Callable]:
    """name -> step(features) for the default and each mechanism switched (module docstring), on their own copies
    of the model (the inference step changes a model in place)."""
    import hfport
    from hfport.pipelines import TextClassificationPipeline, shards

    tokenizer = hfport.AutoTokenizer.from_pretrained(folder)
    fp32 = bench.load_model("hfport", folder, "sdpa").eval()
    if dtype == "int8":
        base = bench.int8_model(fp32, folder)
        float_dtype = base.dtype
    else:
        base = fp32.to(torch.bfloat16) if dtype == "bf16" else fp32
        float_dtype = base.dtype

    def pipe(model: torch.nn.Module, **kw) -> TextClassificationPipeline:
        return TextClassificationPipeline(copy.deepcopy(model), tokenizer, **kw)

    def step(p: TextClassificationPipeline, **switches: bool) -> Callable:
        def run(batch: list) -> None:
            with switched(**switches):
                p.forward_batch(batch)
        return run

    steps = {"default": step(pipe(base))}
    if "packed_linear" in mechanisms:
        steps["-packed_linear"] = step(pipe(base, packed_linear=False))
    if "row_shards" in mechanisms:
        if float_dtype in shards.AUTO_DTYPES:
            steps["-row_shards"] = step(pipe(base, row_shards="off"))
        elif torch.get_num_threads() > 1:
            steps["+row_shards"] = step(pipe(base, row_shards=torch.get_num_threads()))
    if "attention_groups" in mechanisms:
        steps["-attention_groups"] = step(pipe(base), groups_on=False)
    if "math_attention" in mechanisms and float_dtype == torch.bfloat16:
        steps["-math_attention"] = step(pipe(base), math_on=False)
    if "padding_free" in mechanisms:
        padded = pipe(base)
        padded.model.padding_free = False
        steps["-padding_free"] = step(padded)
    if "int8_float_path" in mechanisms and dtype == "int8":
        import hfport.int8

        always = copy.deepcopy(fp32)
        hfport.int8.quantize(always, folder, min_rows=0)
        steps["-int8_float_path"] = step(pipe(always.eval()))
    return steps


def training_contestants(folder: Path, precision: str, mechanisms: list[str]) -> dict[str, Callable]:
    """name -> a plain fine-tuning step (bench.trainer_step: AdamW, dropout on), each on its own model."""
    def step(padding_free: bool = True, **switches: bool) -> Callable:
        model = bench.load_model("hfport", folder, "sdpa")
        model.padding_free = padding_free
        inner = bench.trainer_step(model, precision)

        def run(batch: dict[str, torch.Tensor]) -> None:
            with switched(**switches):
                inner(batch)
        return run

    steps = {"default": step()}
    if "dropout_mask" in mechanisms:
        steps["-dropout_mask"] = step(dropout_on=False)
    if "attention_groups" in mechanisms:
        steps["-attention_groups"] = step(groups_on=False)
    if "math_attention" in mechanisms and precision == "bf16":
        steps["-math_attention"] = step(math_on=False)
    if "padding_free" in mechanisms:
        steps["-padding_free"] = step(padding_free=False)
    return steps


def report(title: str, per_round: dict[str, list[float]], tokens: int) -> None:
    print(f"\n{title}")
    for name, seconds in per_round.items():
        print(f"  {name:18s} {tokens / statistics.median(seconds):9,.0f} tok/s")
    for name, seconds in per_round.items():
        if name == "default":
            continue
        ratios = [o / d for o, d in zip(seconds, per_round["default"])]  # >1: the default is faster
        mechanism, verb = name[1:], "buys" if name[0] == "-" else "would cost (<1 buys)"
        print(f"  {mechanism} {verb}: {statistics.median(ratios):.3f}x ({min(ratios):.3f}-{max(ratios):.3f})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="minilm,bert-base", help=f"of {', '.join(bench.MODELS)}, by comma")
    p.add_argument("--dtypes", default="fp32,bf16", help="inference dtypes, of fp32, bf16, int8, by comma")
    p.add_argument("--mechanisms", default=",".join(dict.fromkeys(INFERENCE + TRAINING)),
                   help="the mechanisms to switch off one at a time, by comma")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--train", action="store_true", help="also training steps (fp32, and bf16 autocast)")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--quick", action="store_true", help="short batches, 2 rounds: checks that it runs")
    p.add_argument("--short", action="store_true", help="batches of 64 rows of 8..30 tokens (an embedding "
                   "fine-tune's texts: many short runs, the case nn/groups.py's cost rule is for) instead of "
                   "bench.py's 16 rows of 8..256")
    args = p.parse_args(argv)
    mechanisms = args.mechanisms.split(",")
    unknown = set(mechanisms) - set(INFERENCE + TRAINING)
    if unknown:
        p.error(f"--mechanisms: {sorted(unknown)}; expected some of {', '.join(dict.fromkeys(INFERENCE + TRAINING))}")
    if args.threads:
        torch.set_num_threads(args.threads)
    bench.quiet_libraries()
    work = bench.QUICK if args.quick else bench.FULL
    if args.short:
        work = dataclasses.replace(work, batch_size=64, min_len=8, max_len=30)
    rounds = 2 if args.quick else args.rounds
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
            rows = features(batches)
            print(f"\n{name} ({spec.about}): {tokens} real tokens a round, padding "
                  f"{bench.padding_fraction(batches):.0%}")
            for dtype in args.dtypes.split(","):
                steps = inference_contestants(folder, dtype, mechanisms)
                bench.warm_up(steps, rows)
                report(f"{name} inference {dtype}", bench.interleaved(steps, rows, rounds, 0, name), tokens)
            if args.train:
                for precision in ("fp32", "bf16"):
                    steps = training_contestants(folder, precision, mechanisms)
                    bench.warm_up(steps, batches)
                    report(f"{name} training {precision}", bench.interleaved(steps, batches, rounds, 0, name),
                           tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
