"""Soak test: a server under steady mixed load for a long time, watched for memory growth and for any error.

    python scripts/soak.py                         # 600 s: /embed + /predict clients and a fine-tune job every 60 s
    python scripts/soak.py --seconds 60 --clients 2 --job-every 20   # a short run that proves the script works

It starts `hfport serve` (loopback, a throwaway data dir, the bundled all-MiniLM-L6-v2 registered as "minilm"), then
for SECONDS: CLIENTS clients send TEI's POST /embed and hfport's POST /predict in turn, back to back, and a submitter
posts a small fine-tune job (MiniLM, 16 rows, 2 steps, registered as a new model) every JOB_EVERY seconds. The
server's RSS (API process; jobs run in their own processes) is sampled every SAMPLE seconds. At the end it waits for
the submitted jobs to finish.

Passes (exit 0) when: 0 requests answered other than 200, every job succeeded, and RSS at the end is within
--rss-tolerance (10%) of RSS after the warm-up (the first WARMUP seconds: model load, first batches, allocator
growth). Prints one JSON summary (and --json FILE writes it) with the RSS series, so a slow leak shows as a slope.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadtest import TEXTS, LocalServer, linked_copy, machine, minilm_path, register, rss_mb  # noqa: E402

LABELS = ["positive", "negative", "fact", "question"]


def job_data(folder: Path) -> Path:
    path = folder / "soak-train.jsonl"
    rows = [{"text": TEXTS[i % len(TEXTS)] + f" ({i})", "label": LABELS[i % len(LABELS)]} for i in range(16)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


async def client(http: httpx.AsyncClient, i: int, deadline: float, stats: dict) -> None:
    n = 0
    while time.monotonic() < deadline:
        texts = [TEXTS[(i + n + k) % len(TEXTS)] for k in range(4)]
        if n % 2:
            r = await http.post("/predict", json={"model": "minilm", "inputs": texts})
        else:
            r = await http.post("/embed", json={"inputs": texts}, headers={"x-model": "minilm"})
        key = "ok" if r.status_code == 200 else f"{r.request.url.path} {r.status_code}"
        stats[key] = stats.get(key, 0) + 1
        n += 1


async def submitter(http: httpx.AsyncClient, train: Path, every: float, deadline: float, jobs: list[str],
                    stats: dict) -> None:
    k = 0
    while time.monotonic() < deadline:
        config = {"model": "minilm", "task": "text-classification", "train": str(train), "max_steps": 2,
                  "batch_size": 8, "eval_fraction": 0}
        r = await http.post("/jobs/finetune", json={"config": config, "register_as": f"soak-{k}"})
        if r.status_code in (200, 201, 202):
            jobs.append(r.json()["id"])
        else:
            stats[f"/jobs/finetune {r.status_code}"] = stats.get(f"/jobs/finetune {r.status_code}", 0) + 1
            print(r.text, file=sys.stderr)
        k += 1
        await asyncio.sleep(max(0.0, min(every, deadline - time.monotonic())))


async def sampler(pid: int, every: float, deadline: float, series: list[tuple[float, float]]) -> None:
    start = time.monotonic()
    while time.monotonic() < deadline:
        series.append((round(time.monotonic() - start, 1), round(rss_mb(pid), 1)))
        await asyncio.sleep(every)
    series.append((round(time.monotonic() - start, 1), round(rss_mb(pid), 1)))


async def soak(url: str, pid: int, args: argparse.Namespace, train: Path) -> dict:
    stats: dict[str, int] = {}
    jobs: list[str] = []
    series: list[tuple[float, float]] = []
    deadline = time.monotonic() + args.seconds
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        await asyncio.gather(sampler(pid, args.sample, deadline, series),
                             submitter(http, train, args.job_every, deadline, jobs, stats),
                             *(client(http, i, deadline, stats) for i in range(args.clients)))
        states = await wait_jobs(http, jobs, timeout=600)
    return {"requests": stats, "jobs": states, "rss_mb": series}


async def wait_jobs(http: httpx.AsyncClient, jobs: list[str], timeout: float) -> dict[str, str]:
    end, states = time.monotonic() + timeout, {}
    while time.monotonic() < end:
        states = {j: (await http.get(f"/jobs/{j}")).json().get("status", "?") for j in jobs}
        if all(s in ("succeeded", "failed", "cancelled") for s in states.values()):
            break
        await asyncio.sleep(2)
    return states


def verdict(result: dict, args: argparse.Namespace) -> tuple[bool, dict]:
    series = result["rss_mb"]
    warm = next((mb for t, mb in series if t >= args.warmup), series[-1][1])
    end = series[-1][1]
    errors = sum(v for k, v in result["requests"].items() if k != "ok")
    failed = [j for j, s in result["jobs"].items() if s != "succeeded"]
    growth = (end - warm) / warm
    ok = errors == 0 and not failed and growth <= args.rss_tolerance
    return ok, {"errors": errors, "jobs_submitted": len(result["jobs"]), "jobs_not_succeeded": failed,
                "rss_after_warmup_mb": warm, "rss_end_mb": end, "rss_growth": round(growth, 4)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=600)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--job-every", type=float, default=60, help="seconds between fine-tune job submissions")
    p.add_argument("--sample", type=float, default=10, help="seconds between RSS samples")
    p.add_argument("--warmup", type=float, default=60, help="RSS growth is measured from this point on")
    p.add_argument("--rss-tolerance", type=float, default=0.10)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hfport-soak-") as tmp:
        root = Path(tmp)
        train = job_data(root)
        with LocalServer(root, HFPORT_JOB_PROCESSES="1") as srv:
            register(srv.url, "minilm", linked_copy(minilm_path(), root / "minilm"), {})
            result = asyncio.run(soak(srv.url, srv.proc.pid, args, train))
    ok, summary = verdict(result, args)
    out = {"machine": machine(), "seconds": args.seconds, "clients": args.clients, **summary, **result,
           "verdict": "PASS" if ok else "FAIL"}
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
