"""What this machine's CPU computes fast, measured rather than guessed from its name.

A CPU flag list says what instructions exist, not whether torch's kernels use them or how fast they run (a
hypervisor may hide flags; oneDNN may or may not have a bf16 path for the build). So the answer comes from a timed
square matmul per dtype, the operation that dominates an encoder: bf16 counts as native when its matmul runs at
least NATIVE_MARGIN times as fast as fp32's. The probe takes well under a second, once per machine: its result is
kept in `hardware.json` under hfport's cache dir (the setting cache_dir: $HFPORT_CACHE_DIR, else
$XDG_CACHE_HOME/hfport, else ~/.cache/hfport), keyed by CPU model, core count and torch version; a file for another
key, or one that does not parse, is measured again and replaced.

Decisions that read it: fine-tuning's `precision: auto` (bf16 autocast where native) and `dtype="auto"` when
loading a model for the CPU (an fp32 checkpoint runs in bf16 where native; see `auto_dtype`).

HeapPolicy, the C allocator's setting a training loop holds while it runs, lives here too: it is about the machine
(glibc's malloc), not about training.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import platform
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .settings import settings

log = logging.getLogger("hfport.hardware")

CACHE_FILE = "hardware.json"
FORMAT = 3  # bumped when the probe changes, so older files are measured again (2: one thread, CPU time; 3: int8 on
# oneDNN's uint8 Linear)
NATIVE_MARGIN = 1.5  # bf16 matmul at least this much faster than fp32: native (emulated bf16 runs slower than fp32)

# (matrix side, dtype) per probe. fp32 and bf16 decide; fp16 and int8 are informative. fp16 is kept small because
# where it is emulated it runs at ~1% of fp32 (a 768-side product would take half a second); int8, reported in GOP/s,
# is the kernel hfport's int8 Linear runs fastest on (nn/int8.py): oneDNN's uint8 x int8 Linear on a packed weight
# where this torch has it (what VNNI multiplies natively), else torch._int_mm (int8 x int8, int32 accumulation).
PROBES: dict[str, tuple[int, torch.dtype]] = {"float32": (768, torch.float32), "bfloat16": (768, torch.bfloat16),
                                             "float16": (256, torch.float16), "int8": (768, torch.int8)}
DECIDING = ("float32", "bfloat16")


@dataclass(frozen=True)
class Capabilities:
    """The CPU's measured matmul peaks (GFLOP/s per dtype; int8 in GOP/s) and what they imply."""

    cpu: str
    cores: int
    torch: str
    threads: int  # torch's intra-op threads during the probe (1: per-core peaks)
    peaks: dict[str, float]
    measured_at: str
    format: int = FORMAT
    source: str = field(default="measured", compare=False)  # "measured" now or read from the "cache" file

    @property
    def key(self) -> dict[str, Any]:
        return {"cpu": self.cpu, "cores": self.cores, "torch": self.torch, "format": self.format}

    @property
    def bf16_speedup(self) -> float:
        return self.peaks["bfloat16"] / self.peaks["float32"]

    @property
    def bf16_native(self) -> bool:
        return self.bf16_speedup >= NATIVE_MARGIN

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "bf16_speedup": round(self.bf16_speedup, 2), "bf16_native": self.bf16_native,
                "native_margin": NATIVE_MARGIN, "cache_file": str(cache_path())}


def cpu_name() -> str:
    """The CPU model string (/proc/cpuinfo's "model name" on Linux; platform's answer elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


# the CPU flags of the int8 instructions torch's and oneDNN's int8 kernels dispatch on (x86: AVX2's vpmaddubsw,
# AVX512BW, the VNNI dot products, AMX tiles; Arm: the dot-product and int8 matrix-multiply extensions)
INT8_FLAGS = ("avx2", "avx512bw", "avx512_vnni", "avx_vnni", "amx_int8", "asimddp", "i8mm")


def int8_isa() -> str:
    """The CPU's int8 instructions as the kernels see them: torch's CPU capability (the vector instruction set its
    kernels dispatch to: DEFAULT, AVX2, AVX512, ...) and the INT8_FLAGS /proc/cpuinfo lists (a hypervisor may hide
    some), e.g. "AVX512 avx2 avx512_vnni avx512bw". The int8 gate's kept verdicts are keyed by it
    (hfport/int8_verdicts.py)."""
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags |= set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return " ".join([torch.backends.cpu.get_cpu_capability(), *sorted(flags & set(INT8_FLAGS))])


def machine_key() -> dict[str, Any]:
    return {"cpu": cpu_name(), "cores": os.cpu_count() or 1, "torch": torch.__version__, "format": FORMAT}


def cache_root() -> Path:
    """hfport's user cache dir, the setting cache_dir (this file's hardware.json; hfport/retrieval/cache.py's
    embeddings; the encoded-examples stores)."""
    return settings().cache_dir


def cache_path() -> Path:
    return cache_root() / CACHE_FILE


def _operands(dtype: torch.dtype, n: int) -> tuple[Any, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    if dtype == torch.int8:
        a, b = (torch.randint(-64, 64, (n, n), dtype=torch.int8, generator=gen) for _ in range(2))
        if torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise"):
            packed = torch.ops.onednn.qlinear_prepack(b, None)
            ones, zeros = torch.ones(n), torch.zeros(n, dtype=torch.long)

            def qlinear(x: torch.Tensor, _: torch.Tensor) -> torch.Tensor:  # x (n, n) uint8 @ b^T, fp32 out
                return torch.ops.onednn.qlinear_pointwise(x, 1.0, 128, packed, ones, zeros, None, 1.0, 0,
                                                          torch.float32, "none", [], "")
            return qlinear, (a.int() + 128).to(torch.uint8), b
        return torch._int_mm, a, b
    a, b = (torch.randn(n, n, generator=gen).to(dtype) for _ in range(2))
    return torch.matmul, a, b


def _timed(product: Any, a: torch.Tensor, b: torch.Tensor, clock: Any = time.perf_counter) -> float:
    start = clock()
    product(a, b)
    return clock() - start


def matmul_peak(dtype: torch.dtype, n: int, seconds: float = 0.3, min_reps: int = 3,
                clock: Any = time.perf_counter) -> float:
    """Best GFLOP/s (2 n^3 per product) of an n x n product over `seconds` (at least min_reps timed runs)."""
    product, a, b = _operands(dtype, n)
    product(a, b)  # warm-up: kernel selection, first-touch of the output
    best, reps, stop = float("inf"), 0, time.perf_counter() + seconds
    while reps < min_reps or time.perf_counter() < stop:
        best, reps = min(best, _timed(product, a, b, clock)), reps + 1
    return 2 * n**3 / best / 1e9


def measure(seconds: float = 0.4, per_core: bool = False) -> dict[str, float]:
    """Matmul peaks per dtype. fp32 and bf16 alternate product by product for `seconds` and keep their best, so a
    burst of load from another process hits both rather than skewing their ratio. About half a second in all.

    per_core: on one thread, timed by that thread's own CPU time. What the capability decision uses: on a busy
    machine, wall-clock time of a multi-threaded product stretches with every descheduled thread its barrier waits
    for (longer products more often, so fp32 more than bf16: a loaded 2-core machine once read 30x), while one
    thread's CPU time does not. Otherwise all of torch's threads by wall clock (what scripts/bench.py divides by)."""
    threads, clock = torch.get_num_threads(), time.thread_time if per_core else time.perf_counter
    if per_core:
        torch.set_num_threads(1)
    try:
        runs = {name: _operands(PROBES[name][1], PROBES[name][0]) for name in DECIDING}
        for product, a, b in runs.values():
            product(a, b)  # warm-up
        best = {name: float("inf") for name in DECIDING}
        rounds, stop = 0, time.perf_counter() + seconds
        while rounds < 3 or time.perf_counter() < stop:
            for name, (product, a, b) in runs.items():
                best[name] = min(best[name], _timed(product, a, b, clock))
            rounds += 1
        peaks = {name: 2 * PROBES[name][0] ** 3 / best[name] / 1e9 for name in DECIDING}
        for name in PROBES.keys() - set(DECIDING):
            n, dtype = PROBES[name]
            try:
                peaks[name] = matmul_peak(dtype, n, seconds=0.0, min_reps=1, clock=clock)
            except RuntimeError as e:  # a build without the kernel: informative only, so just absent
                log.debug("no %s matmul here: %s", name, e)
    finally:
        torch.set_num_threads(threads)
    return {name: round(value, 1) for name, value in peaks.items()}


_memo: dict[str, Capabilities] = {}


def cpu_capabilities(refresh: bool = False) -> Capabilities:
    """This machine's capabilities: from memory, else the cache file when it matches this machine, else measured
    (and the file written). refresh=True measures again."""
    key = machine_key()
    memo_key = json.dumps(key, sort_keys=True) + str(cache_path())
    if not refresh and memo_key in _memo:
        return _memo[memo_key]
    caps = None if refresh else _read_cache(key)
    if caps is None:
        caps = Capabilities(**{k: v for k, v in key.items() if k != "format"}, threads=1,
                            peaks=measure(per_core=True), measured_at=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        _write_cache(caps)
    _memo[memo_key] = caps
    return caps


def _read_cache(key: dict[str, Any]) -> Capabilities | None:
    path = cache_path()
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
        caps = Capabilities(**{k: raw[k] for k in ("cpu", "cores", "torch", "threads", "peaks", "measured_at",
                                                   "format")}, source="cache")
        if not all(isinstance(caps.peaks.get(k), (int, float)) and caps.peaks[k] > 0 for k in DECIDING):
            raise ValueError(f"peaks {caps.peaks!r} lack a positive {DECIDING}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("%s: unreadable (%s); measuring again", path, e)
        return None
    if caps.key != key:
        log.info("%s: measured for %s, this is %s; measuring again", path, caps.key, key)
        return None
    return caps


def _write_cache(caps: Capabilities) -> None:
    """Atomically (a temporary file, then rename); a cache dir that cannot be written only costs a re-measure."""
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # a name of this write's own (threads of one process measure at once), removed if the write fails; hub's
        # write_text_atomic is a floor above this module
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
        try:
            tmp.write_text(json.dumps({k: v for k, v in asdict(caps).items() if k != "source"}, indent=1) + "\n")
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as e:
        log.warning("could not write %s (%s); the probe will run again in the next process", path, e)


def is_cpu(device: Any) -> bool:
    return device is None or torch.device(device).type == "cpu"


# --- devices: what `device=` accepts (loaders, pipelines, the CLI's --device, the server's HFPORT_DEVICE) ----------

DEVICE_CHOICES = ("auto", "cpu", "cuda", "cuda:N")


def resolve_device(device: Any) -> torch.device:
    """A device as loaders, pipelines, the CLI and the server take it: "auto" (the first CUDA device when this
    process sees one, else the CPU), "cpu", "cuda" (CUDA device 0) or "cuda:N", or a torch.device. A CUDA device
    this process does not see, or any other name, is an error naming the choices and the devices there are."""
    if isinstance(device, torch.device):
        chosen = device
    elif isinstance(device, str) and device.strip().lower() == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    else:
        try:
            chosen = torch.device(device.strip().lower() if isinstance(device, str) else device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device {device!r} is not one of {', '.join(DEVICE_CHOICES)}") from e
    if chosen.type == "cpu":
        return torch.device("cpu")
    if chosen.type != "cuda":
        raise ValueError(f"device {device!r}: hfport runs on {', '.join(DEVICE_CHOICES)}")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = 0 if chosen.index is None else chosen.index
    if index >= count:
        seen = f"CUDA devices 0..{count - 1}" if count else "no CUDA device"
        raise ValueError(f"device {device!r}: this process sees {seen} (torch {torch.__version__}, CUDA "
                         f"{torch.version.cuda or 'not built in'}); use one of {', '.join(DEVICE_CHOICES)}")
    return torch.device("cuda", index)


def device_name(device: Any) -> str:
    """What reports print for a device (anything resolve_device takes, "auto" too): "cpu", or
    "cuda:0 (NVIDIA H200)"."""
    device = resolve_device(device)
    if device.type != "cuda":
        return device.type
    return f"cuda:{device.index} ({torch.cuda.get_device_name(device.index)})"


def auto_dtype(checkpoint_dtype: torch.dtype, device: Any = None) -> torch.dtype:
    """dtype="auto": the checkpoint's dtype (as in transformers), except that an fp32 checkpoint loaded for a CPU
    with native bf16, or for a CUDA device with bf16 (compute capability 8.0 and up), runs in bf16. Casting the
    weights was measured against bf16 autocast over fp32 weights for MiniLM inference on an AVX512-BF16 CPU: about
    as fast (12.4k vs 11.9k tokens/s, fp32 6.5k), half the weight memory, and mean-pooled embeddings within cosine
    0.9999 of fp32 (autocast: 0.99996); it also needs nothing from the code that runs the model. On a GPU bf16 is
    the tensor cores' rate (an H200: ~790 TFLOP/s in bf16 against ~67 in plain fp32)."""
    if checkpoint_dtype != torch.float32:
        return checkpoint_dtype
    if is_cpu(device):
        return torch.bfloat16 if cpu_capabilities().bf16_native else checkpoint_dtype
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False):
        return torch.bfloat16
    return checkpoint_dtype


def describe(caps: Capabilities) -> str:
    """The human-readable lines `hfport info --hardware` prints."""
    lines = [f"cpu: {caps.cpu} ({caps.cores} cores, torch {caps.torch})",
             f"matmul peaks on {caps.threads} thread{'s' if caps.threads != 1 else ''} ({caps.source} "
             f"{caps.measured_at}):"]
    for name, value in caps.peaks.items():
        unit = "GOP/s" if name == "int8" else "GFLOP/s"
        lines.append(f"  {name:<9} {value:8.1f} {unit}  ({value / caps.peaks['float32']:.2f}x float32)")
    verdict = "native" if caps.bf16_native else "not native"
    lines.append(f"bf16: {verdict} ({caps.bf16_speedup:.2f}x float32; native means >= {NATIVE_MARGIN}x)")
    lines.append(f"fine-tune precision auto: {'bf16 autocast' if caps.bf16_native else 'fp32'}; "
                 f"dtype auto for an fp32 checkpoint: {'bfloat16' if caps.bf16_native else 'float32'}")
    lines.append(f"cache: {cache_path()}")
    return "\n".join(lines)


class HeapPolicy:
    """glibc serves every allocation above 32 MiB with a fresh mmap and unmaps it on free, so a tensor that size made
    on every step pays page faults on every step. The word-embedding gradient is one (vocab x hidden fp32: 47 MB for
    MiniLM, 94 MB for BERT-base; autograd builds it dense each backward), and so are a long batch's attention scores.
    Measured for MiniLM on 16 short sentences (one thread, a shared 2-core EPYC): 12.6k page faults a backward before,
    none after; backward 0.45 -> 0.41 s. While a loop runs, the heap serves blocks up to 1 GiB and keeps freed ones
    for the next step; when the last loop of the process ends, restore() sets glibc's steady state (mmap threshold
    32 MiB, trim threshold 64 MiB: where its dynamic thresholds settle in any process that has freed a block that
    size) and returns the kept memory to the system. Only the allocator's bookkeeping changes: no value does.
    Elsewhere than glibc (macOS, musl) it does nothing."""

    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
    KEEP, STEADY_MMAP, STEADY_TRIM = 1 << 30, 32 << 20, 64 << 20
    _lock, _holders = threading.Lock(), 0  # the setting is the process's: fine-tunes in threads share it

    def __init__(self) -> None:
        self.libc, self.held = None, False
        if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
            libc = ctypes.CDLL(None)  # the process's own C library
            if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim"):
                self.libc = libc

    def keep_large_blocks(self) -> HeapPolicy:
        if self.libc is not None and not self.held:
            with HeapPolicy._lock:
                if HeapPolicy._holders == 0:
                    self.libc.mallopt(self.M_MMAP_THRESHOLD, self.KEEP)
                    self.libc.mallopt(self.M_TRIM_THRESHOLD, self.KEEP)
                HeapPolicy._holders += 1
                self.held = True
        return self

    def restore(self) -> None:
        """Undo this holder's keep_large_blocks (a second call does nothing); the last holder restores glibc."""
        if not self.held:
            return
        with HeapPolicy._lock:
            HeapPolicy._holders -= 1
            self.held = False
            if HeapPolicy._holders == 0:
                self.libc.mallopt(self.M_MMAP_THRESHOLD, self.STEADY_MMAP)
                self.libc.mallopt(self.M_TRIM_THRESHOLD, self.STEADY_TRIM)
                self.libc.malloc_trim(0)
