"""What bench_mine.py and bench_evaluate.py share: the synthetic retrieval data, and running one measurement in a
fresh process (its wall time and peak RSS, its output as JSON).

The data (seeded): QUERIES short questions of 8..14 words, each with one positive passage of 25..60 words holding
most of its query's key words; the corpus is the positives plus CORPUS - QUERIES distractor passages, a fifth of them
built around some other query's key words (near misses: what hard-negative mining is for). Written as pairs.jsonl
({"anchor", "positive"} per line) and corpus.txt (the distractors, one a line), the files both tools read.
"""

from __future__ import annotations

import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

WORDS = ("the a of and to in is was it for on with as his that by at from this had not are but be were have one "
         "all their there been which when who will more no if out so said what up its about into than them can only "
         "other new some could time these two may then do first any my now such like our over man me even most made "
         "after also did many before must through back years where much your way well down should because each just "
         "those people how too little state good very make world still own see men work long get here between both "
         "life being under never day same another know while last might us great old year off come since against go "
         "came right used take three film plot ending music actor scene story review market price river city").split()
TOPICS = ("harbor glacier violin copper meadow lantern orchard falcon canyon velvet marble thunder compass saffron "
          "pepper engine rocket tunnel garden castle bridge island desert forest valley summit harvest festival "
          "library museum theater stadium railway airport factory village kingdom planet ocean volcano comet storm "
          "winter summer autumn spring silver golden crimson emerald amber ivory cobalt scarlet jasmine cedar maple "
          "willow birch lotus tiger eagle dolphin wolf bear otter heron falcon salmon coral pearl quartz granite "
          "basalt nickel cobalt zinc tin lead iron steel brass bronze clay sand chalk flint coal oil gas wind solar "
          "tidal nuclear atom cell gene protein enzyme virus fungus algae moss fern reed grain wheat barley rice "
          "maize bean lentil pea olive grape lemon mango melon peach plum cherry berry apple pear fig date").split()


def _text(rng: random.Random, keys: list[str], length: int) -> str:
    words = [rng.choice(WORDS) for _ in range(length)]
    for k in keys:
        words.insert(rng.randrange(len(words) + 1), k)
    return " ".join(words)


def write_data(folder: Path, corpus: int, queries: int, seed: int = 0) -> dict[str, Any]:
    """pairs.jsonl (QUERIES pairs) and corpus.txt (CORPUS - QUERIES distractors) in FOLDER; returns their facts."""
    if queries > corpus:
        raise SystemExit(f"--queries {queries} > --corpus {corpus}: every query's positive is in the corpus")
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    keys = [rng.sample(TOPICS, 4) for _ in range(queries)]
    with open(folder / "pairs.jsonl", "w", encoding="utf-8") as f:
        for i, k in enumerate(keys):
            query = _text(rng, k, rng.randint(4, 10)) + "?"
            positive = _text(rng, k[:3] + rng.sample(TOPICS, 1), rng.randint(21, 56)) + f" (document {i})."
            f.write(json.dumps({"anchor": query, "positive": positive}) + "\n")
    with open(folder / "corpus.txt", "w", encoding="utf-8") as f:
        for i in range(corpus - queries):
            near = rng.random() < 0.2 and keys
            k = rng.choice(keys)[:2] + rng.sample(TOPICS, 1) if near else rng.sample(TOPICS, 3)
            f.write(_text(rng, k, rng.randint(22, 57)) + f" (passage {i}).\n")
    return {"corpus": corpus, "queries": queries, "seed": seed, "folder": str(folder)}


def read_data(folder: Path) -> tuple[list[str], list[str], list[str]]:
    """(anchors, positives, distractors)."""
    rows = [json.loads(line) for line in (folder / "pairs.jsonl").read_text(encoding="utf-8").splitlines()]
    distractors = [line for line in (folder / "corpus.txt").read_text(encoding="utf-8").splitlines() if line]
    return [r["anchor"] for r in rows], [r["positive"] for r in rows], distractors


def peak_rss_mib() -> float:
    """This process's peak resident set so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mib() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def measure(load: Callable[[], Any], run: Callable[[Any], Any]) -> dict[str, Any]:
    """In a child: LOAD (the model: not timed), then RUN(loaded), timed; the RSS before and the peak after."""
    loaded = load()
    before = rss_mib()
    start = time.perf_counter()
    output = run(loaded)
    seconds = time.perf_counter() - start
    return {"seconds": round(seconds, 3), "rss_before_mib": round(before, 1), "peak_rss_mib": round(peak_rss_mib(), 1),
            "output": output}


def in_fresh_process(script: Path, kind: str, args: list[str], out: Path, threads: int | None) -> dict[str, Any]:
    """Run `python SCRIPT --child KIND ARGS --result OUT` (a fresh process: nothing of another run's memory or caches
    counts) and read the JSON it leaves in OUT; the process's wall time beside it."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if threads:
        env |= {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, str(script), "--child", kind, *args, "--result", str(out)], env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{kind} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    result = json.loads(out.read_text())
    result["process_seconds"] = round(wall, 2)
    return result
