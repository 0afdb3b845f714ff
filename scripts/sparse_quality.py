"""What bf16 does to SPLADE vectors: hfport's sparse-embedding in bf16 against the same model in fp32, on real texts.

  python scripts/sparse_quality.py [--model FOLDER] [--dtype bfloat16]

FOLDER: a SparseEncoder folder (e.g. best/ of `hfport finetune --task sparse-embedding`); by default the one
scripts/bench_sparse.py times (MiniLM's encoder + a seeded MLM head with ~1% of the vocabulary active).

The texts: the queries and passages of examples/data/embed_eval.jsonl and rerank_eval.jsonl (each query with its
relevant passage, the corpus every distinct passage). Reported, as means over texts: the nonzero support's Jaccard
overlap with fp32, how many of fp32's 10 largest terms bf16 keeps, cosine, and the relative error of query-passage
dot products; for retrieval by dot product over the whole corpus: how often bf16 ranks the same passage first, the
overlap of the top-10 lists, and MRR@10 against the relevant passage in each precision.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DATA = REPO / "examples" / "data"


def retrieval_set() -> tuple[list[str], list[str], list[int]]:
    """(queries, corpus, the corpus index of each query's relevant passage)."""
    pairs = []
    for name, query, negatives in (("embed_eval.jsonl", "anchor", "negative"), ("rerank_eval.jsonl", "query",
                                                                                  "negatives")):
        for line in (DATA / name).read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            others = row.get(negatives) or []
            pairs.append((row[query], row["positive"], [others] if isinstance(others, str) else others))
    corpus = list(dict.fromkeys(t for _, positive, negatives in pairs for t in (positive, *negatives)))
    index = {t: i for i, t in enumerate(corpus)}
    return [q for q, _, _ in pairs], corpus, [index[p] for _, p, _ in pairs]


def encode(folder: Path, texts: list[str], dtype: str) -> torch.Tensor:
    import hfport

    pipe = hfport.pipeline("sparse-embedding", model=folder, dtype=dtype, batch_size=32)
    out = torch.zeros(len(texts), pipe.dimension)  # (N, V)
    for row, entries in enumerate(pipe(texts)):
        for e in entries:
            out[row, e["index"]] = e["value"]
    return out


def vector_agreement(a: torch.Tensor, b: torch.Tensor, k: int = 10) -> dict[str, float]:
    sa, sb = a != 0, b != 0
    return {"support_jaccard": float(((sa & sb).sum(1) / (sa | sb).sum(1).clamp(min=1)).mean()),
            "support_fp32": float(sa.sum(1).float().mean()), "support_other": float(sb.sum(1).float().mean()),
            f"top{k}_terms_kept": float((a.topk(k).indices[:, :, None] == b.topk(k).indices[:, None, :])
                                        .any(2).float().mean()),
            "cosine": float(torch.nn.functional.cosine_similarity(a, b, dim=1).mean())}


def mrr(scores: torch.Tensor, relevant: torch.Tensor, k: int = 10) -> float:
    rank = (scores > scores.gather(1, relevant[:, None])).sum(1)  # (Q,) passages scored above the relevant one
    return float(torch.where(rank < k, 1.0 / (rank + 1), torch.zeros_like(rank, dtype=torch.float)).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--dtype", default="bfloat16", help="the precision compared with fp32")
    args = parser.parse_args()
    queries, corpus, relevant = retrieval_set()
    work = None
    folder = args.model
    if folder is None:
        sys.path.insert(0, str(REPO / "scripts"))
        from bench_sparse import build_folder, texts

        work = Path(tempfile.mkdtemp(prefix="sparse-quality-"))
        folder = build_folder(work, texts(256), tiny=False)
    try:
        fp32 = {"q": encode(folder, queries, "float32"), "d": encode(folder, corpus, "float32")}
        other = {"q": encode(folder, queries, args.dtype), "d": encode(folder, corpus, args.dtype)}
    finally:
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)
    report = {"model": str(args.model or "bench_sparse's MiniLM + seeded MLM head"), "dtype": args.dtype,
              "queries": len(queries), "corpus": len(corpus)}
    report["vectors"] = vector_agreement(torch.cat([fp32["q"], fp32["d"]]), torch.cat([other["q"], other["d"]]))
    relevant_t = torch.tensor(relevant)
    scores = fp32["q"] @ fp32["d"].T, other["q"] @ other["d"].T  # (Q, D) each
    pair = scores[0].gather(1, relevant_t[:, None]).squeeze(1), scores[1].gather(1, relevant_t[:, None]).squeeze(1)
    top = scores[0].topk(10).indices, scores[1].topk(10).indices  # (Q, 10) each
    report["retrieval"] = {
        "dot_relative_error": float(((pair[1] - pair[0]).abs() / pair[0].abs().clamp(min=1e-6)).mean()),
        "same_first": float((top[0][:, 0] == top[1][:, 0]).float().mean()),
        "top10_overlap": float((top[0][:, :, None] == top[1][:, None, :]).any(2).float().mean()),
        "mrr@10_fp32": mrr(scores[0], relevant_t), f"mrr@10_{args.dtype}": mrr(scores[1], relevant_t)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
