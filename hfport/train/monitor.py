"""Watching a run: an adaptive ETA and throughput (Pace), the machine's resources (ResourceSampler), and
metrics.jsonl read back tolerantly (read_metrics).

metrics.jsonl holds three kinds of lines: `train` and `eval` (what the model did: identical between a run and
its resumed twin) and `perf` (what the machine did: speed, ETA, memory; different every run). Whoever compares
runs drops `perf` lines (is_perf).

Resources are sampled by a daemon thread every ~2 s, off the training step: the loop only reads the latest
sample (a dict copy). GPU fields appear only when CUDA is present; a value a backend cannot give is left out,
never an error.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

try:  # a dependency of hfport, but the monitor still measures without it (_CpuClock)
    import psutil
except ImportError:  # pragma: no cover - exercised by the monitor test that hides it
    psutil = None

log = logging.getLogger("hfport.train")

GB = 1024**3
PERF = "perf"  # metrics.jsonl line type of machine facts


def is_perf(entry: dict[str, Any]) -> bool:
    return entry.get("type") == PERF


# --- ETA and throughput ---------------------------------------------------------------------------------------


class Ema:
    """Exponential moving average; the first value seeds it (no zero bias)."""

    def __init__(self, alpha: float):
        self.alpha, self.value = alpha, None

    def update(self, x: float) -> float:
        self.value = x if self.value is None else self.alpha * x + (1 - self.alpha) * self.value
        return self.value


class Pace:
    """Seconds per optimizer step and per evaluation, each an EMA over recent ones, so the ETA follows a run
    that speeds up (warm caches) or slows down (longer batches, a busy machine):

        eta = steps_left * step_s + evals_left * eval_s

    Time spent in evaluations is measured apart (eval_done) and not counted as step time; checkpoint time stays
    in the step time of the step after it (amortised by the EMA)."""

    def __init__(self, alpha: float = 0.1, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.step_s, self.eval_s = Ema(alpha), Ema(0.5)  # evals are few: follow the latest ones closely
        self.tokens, self.examples = Ema(alpha), Ema(alpha)  # per step
        self.last = clock()
        self.paused = 0.0  # eval seconds inside the current step interval

    def step(self, tokens: int, examples: int) -> None:
        now = self.clock()
        self.step_s.update(max(1e-9, now - self.last - self.paused))
        self.tokens.update(tokens)
        self.examples.update(examples)
        self.last, self.paused = now, 0.0

    def eval_done(self, seconds: float) -> None:
        self.eval_s.update(seconds)
        self.paused += seconds

    def eta(self, steps_left: int, evals_left: int) -> float | None:
        if self.step_s.value is None:
            return None
        return steps_left * self.step_s.value + evals_left * (self.eval_s.value or 0.0)

    def report(self, steps_left: int, evals_left: int) -> dict[str, float]:
        """The perf fields: eta_s, steps_per_s, tokens_per_s, examples_per_s, eval_s (when measured)."""
        if self.step_s.value is None:
            return {}
        s = self.step_s.value
        out = {"eta_s": round(self.eta(steps_left, evals_left) or 0.0, 2), "step_s": round(s, 5),
               "steps_per_s": round(1 / s, 4), "tokens_per_s": round((self.tokens.value or 0) / s, 1),
               "examples_per_s": round((self.examples.value or 0) / s, 2)}
        if self.eval_s.value is not None:
            out["eval_s"] = round(self.eval_s.value, 3)
        return out


def evals_left(step: int, total: int, *, strategy: str, every: int, steps_per_epoch: int, has_eval: bool) -> int:
    """Evaluations still to come after `step`, the final one (when the last step has none) included."""
    if not has_eval or step >= total:
        return 0
    if strategy == "steps" and every:
        n = total // every - step // every
        return n + (1 if total % every else 0)
    if strategy == "epoch" and steps_per_epoch:
        n = total // steps_per_epoch - step // steps_per_epoch
        return n + (1 if total % steps_per_epoch else 0)
    return 1  # only the final evaluation


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


# --- resources ------------------------------------------------------------------------------------------------


def _proc_meminfo() -> tuple[float, float] | None:
    """(used, total) bytes from /proc/meminfo (Linux without psutil)."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        total = int(info["MemTotal"].split()[0]) * 1024
        available = int(info["MemAvailable"].split()[0]) * 1024
        return total - available, total
    except (OSError, KeyError, ValueError):
        return None


def _proc_rss() -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


class _CpuClock:
    """Process CPU % between two calls, from os.times() (psutil's cpu_percent without psutil)."""

    def __init__(self) -> None:
        self.last = (time.monotonic(), self._cpu())

    @staticmethod
    def _cpu() -> float:
        t = os.times()
        return t.user + t.system

    def percent(self) -> float | None:
        now, cpu = time.monotonic(), self._cpu()
        (then, before), self.last = self.last, (now, cpu)
        return None if now - then <= 0 else 100.0 * (cpu - before) / (now - then)


def gpu_stats() -> dict[str, float]:
    """Per CUDA device i: gpu{i}_util (%, needs NVML; left out without it), gpu{i}_mem_used_gb / _mem_total_gb
    (the whole device, every process), gpu{i}_peak_alloc_gb / _peak_reserved_gb (this process's allocator).
    Empty without CUDA."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}  # never the one to create a CUDA context: that costs memory on every device
    out: dict[str, float] = {}
    for i in range(torch.cuda.device_count()):
        try:
            free, total = torch.cuda.mem_get_info(i)
            out[f"gpu{i}_mem_used_gb"] = round((total - free) / GB, 3)
            out[f"gpu{i}_mem_total_gb"] = round(total / GB, 3)
            out[f"gpu{i}_peak_alloc_gb"] = round(torch.cuda.max_memory_allocated(i) / GB, 3)
            out[f"gpu{i}_peak_reserved_gb"] = round(torch.cuda.max_memory_reserved(i) / GB, 3)
        except (RuntimeError, AssertionError):
            continue
        try:
            out[f"gpu{i}_util"] = float(torch.cuda.utilization(i))
        except Exception:  # noqa: BLE001 - pynvml missing or NVML refusing: the field is simply not there
            pass
    return out


class ResourceSampler:
    """A daemon thread that samples every `interval` s: cpu_percent (this process), rss_gb, mem_used_gb /
    mem_total_gb (the system), and gpu_stats(). `latest` is the newest sample (a copy; {} before the first)."""

    def __init__(self, interval: float = 2.0, gpu: Callable[[], dict[str, float]] = gpu_stats):
        self.interval, self.gpu = interval, gpu
        self._latest: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if psutil is not None:
            self._proc = psutil.Process()
            self._proc.cpu_percent(None)  # the first call only sets the reference point
            self._cpu_at = time.monotonic()
        else:
            self._proc = None
            self._cpu = _CpuClock()

    def sample(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self._proc is not None:
            now = time.monotonic()
            if now - self._cpu_at >= 0.2:  # psutil's percent over a shorter span is noise (often 0.0)
                out["cpu_percent"] = round(self._proc.cpu_percent(None), 1)
                self._cpu_at = now
            out["rss_gb"] = round(self._proc.memory_info().rss / GB, 3)
            vm = psutil.virtual_memory()
            out["mem_used_gb"], out["mem_total_gb"] = round((vm.total - vm.available) / GB, 3), round(vm.total / GB, 3)
        else:
            cpu, rss, mem = self._cpu.percent(), _proc_rss(), _proc_meminfo()
            if cpu is not None:
                out["cpu_percent"] = round(cpu, 1)
            if rss is not None:
                out["rss_gb"] = round(rss / GB, 3)
            if mem is not None:
                out["mem_used_gb"], out["mem_total_gb"] = round(mem[0] / GB, 3), round(mem[1] / GB, 3)
        out.update(self.gpu())
        return out

    @property
    def latest(self) -> dict[str, float]:
        with self._lock:
            return dict(self._latest)

    def _run(self) -> None:
        while True:
            try:
                values = self.sample()
                with self._lock:
                    self._latest = values
            except Exception:  # noqa: BLE001 - a sampler must never take the run down
                log.debug("resource sample failed", exc_info=True)
            if self._stop.wait(self.interval):
                return

    def start(self) -> ResourceSampler:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True, name="hfport-resources")
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> ResourceSampler:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def fmt_resources(r: dict[str, float]) -> str:
    """`RSS 1.2/23.5 GB  VRAM 2.1/80 GB (3%)` from a sample: what fits a progress line."""
    parts = []
    if "rss_gb" in r:
        parts.append(f"RSS {r['rss_gb']:.1f}/{r['mem_total_gb']:.1f} GB" if "mem_total_gb" in r
                     else f"RSS {r['rss_gb']:.1f} GB")
    for i in range(16):
        used, total = r.get(f"gpu{i}_mem_used_gb"), r.get(f"gpu{i}_mem_total_gb")
        if used is None or not total:
            break
        parts.append(f"VRAM{'' if i == 0 else i} {used:.1f}/{total:.0f} GB ({100 * used / total:.0f}%)")
    return "  ".join(parts)


# --- metrics.jsonl read back ----------------------------------------------------------------------------------


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """metrics.jsonl's entries and, for each line that is not a JSON object with a type and a step, a problem
    `FILE:LINE: why` (the line is skipped: a run killed mid-write, or a hand edit, must not hide the rest)."""
    entries: list[dict[str, Any]] = []
    problems: list[str] = []
    if not path.exists():
        return entries, problems
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as e:
                problems.append(f"{path.name}:{n}: not JSON ({e.msg}); line skipped")
                continue
            if not isinstance(entry, dict) or "type" not in entry or not isinstance(entry.get("step"), int):
                problems.append(f"{path.name}:{n}: not an entry with \"type\" and an integer \"step\"; line skipped")
                continue
            entries.append(entry)
    return entries, problems


def metrics_csv(entries: list[dict[str, Any]]) -> str:
    """Every entry as a CSV row (all points, no downsampling); columns: type, step, epoch, then the rest sorted."""
    first = ["type", "step", "epoch"]
    rest = sorted({k for e in entries for k, v in e.items() if k not in first and not isinstance(v, (dict, list))})
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=first + rest, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for e in entries:
        writer.writerow(e)
    return buf.getvalue()


# --- the chart script shared by report.html and the dashboard --------------------------------------------------

CHARTS_JS = Path(__file__).resolve().parent / "static" / "charts.js"


def charts_js() -> str:
    """The source of charts.js (hand-written SVG charts: axes, hover, log scale, downsampling). report.html
    inlines it; the server serves it to the dashboard at /static/charts.js."""
    return CHARTS_JS.read_text(encoding="utf-8")
