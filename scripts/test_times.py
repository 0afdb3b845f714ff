"""Where the test suite's time goes: each test file in its own pytest process, its wall time and its CPU time (user +
system of pytest and every process it waited for: the servers, `accelerate launch` children, tokenizer builds).

CPU time is the figure to compare on a shared machine: other processes stretch wall time, not the CPU seconds a
file spends (they still move it a little: caches, frequency). Wall time is the figure CI pays; take it from a quiet
machine. Each file's slowest tests come from pytest's own --durations.

Processes the tests leave to others count too: this script is a child subreaper (Linux prctl), so a process whose
parent exits without waiting for it (multiprocessing's fork server, whose children run the SIGKILL-and-resume
fine-tunes) is handed to it and reaped here, its CPU time (and its reaped children's) added to the file's.

    HF_HUB_OFFLINE=1 .venv/bin/python scripts/test_times.py --out before.json            # every tests/test_*.py
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/test_times.py tests/test_tei.py tests/test_int8.py --out after.json
    HF_HUB_OFFLINE=1 .venv/bin/python scripts/test_times.py --together tests --slowest 50 --out suite.json  # as CI
    .venv/bin/python scripts/test_times.py --compare before.json after.json               # a before/after table

The whole suite takes ~15 minutes of wall time on a quiet 2-core machine; files run one after the other.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DURATION = re.compile(r"^([0-9.]+)s (call|setup|teardown)\s+(\S+)")
SUMMARY = re.compile(r"^=*\s*(\d+ (?:passed|failed|skipped|errors?|deselected|xfailed|xpassed)\b.*) in [0-9.]+s")


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def become_subreaper() -> bool:
    """Orphaned descendants are re-parented to this process instead of init (PR_SET_CHILD_SUBREAPER), so their CPU
    time reaches RUSAGE_CHILDREN once reaped. False where the call is unavailable (not Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(36, 1, 0, 0, 0) == 0  # 36: PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def reap_orphans(grace_s: float) -> int:
    """Reap the orphans handed to this process as they exit, for up to `grace_s` seconds; the number still alive."""
    deadline = time.monotonic() + grace_s
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return 0
        if pid:
            continue
        if time.monotonic() > deadline:
            return len([p for p in Path("/proc").iterdir() if p.name.isdigit() and _parent(p) == os.getpid()])
        time.sleep(0.1)


def _parent(proc: Path) -> int:
    try:
        return int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def time_file(path: str, python: str, slowest: int, extra: list[str], workers: list[str]) -> dict:
    """One pytest process over `path` (several, space-separated: one process for them all): wall and CPU seconds,
    pytest's summary line and its `slowest` durations. `workers`: pytest-xdist's options (`-n 0`: none)."""
    cmd = [python, "-m", "pytest", *path.split(), "-q", "-p", "no:cacheprovider", "--durations", str(slowest),
           *workers, *extra]
    cpu0, wall0 = children_cpu(), time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    wall = time.perf_counter() - wall0
    left = reap_orphans(grace_s=30)  # a fork server exits once pytest has: reap it before reading the clock
    cpu = children_cpu() - cpu0
    lines = proc.stdout.splitlines()
    durations = [(float(m[1]), m[2], m[3]) for m in map(DURATION.match, lines) if m]
    summary = next((m[1] for m in map(SUMMARY.match, reversed(lines)) if m), proc.stdout[-300:])
    return {"file": path, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "rc": proc.returncode,
            "orphans_left": left, "summary": summary, "failures": _failures(proc.stdout) if proc.returncode else "",
            "slowest": durations[:slowest] if slowest else durations}


def _failures(stdout: str) -> str:
    """pytest's failure report (from its FAILURES banner), shortened to the last 6000 characters."""
    start = stdout.find("= FAILURES =")
    return stdout[start if start >= 0 else 0:][-6000:]


def compare(before: Path, after: Path) -> str:
    old = {r["file"]: r for r in json.loads(before.read_text())["files"]}
    new = {r["file"]: r for r in json.loads(after.read_text())["files"]}
    rows = ["| file | CPU s before | CPU s after | wall s before | wall s after | tests after |",
            "|---|---:|---:|---:|---:|---|"]
    for name in sorted(old.keys() & new.keys(), key=lambda n: -old[n]["cpu_s"]):
        a, b = old[name], new[name]
        rows.append(f"| {name} | {a['cpu_s']} | {b['cpu_s']} | {a['wall_s']} | {b['wall_s']} | {b['summary']} |")
    total = [sum(d[n][k] for n in old.keys() & new.keys()) for d in (old, new) for k in ("cpu_s", "wall_s")]
    rows.append(f"| total | {total[0]:.0f} | {total[2]:.0f} | {total[1]:.0f} | {total[3]:.0f} | |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", help="test files (default: every tests/test_*.py)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--slowest", type=int, default=10, help="pytest --durations per file (0: every test)")
    parser.add_argument("--together", action="store_true",
                        help="one pytest run for all the files (the whole suite: `--together tests`), as CI runs "
                             "them: on pyproject's xdist workers (addopts: -n 2), session fixtures built once a "
                             "worker. Without it each file runs in one process (-n 0): its figures are its own, "
                             "not an idle second worker's start-up too")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--pytest-arg", action="append", default=[], help="passed on to pytest (repeatable)")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"),
                        help="print a markdown table of two --out files and exit")
    args = parser.parse_args()
    if args.compare:
        print(compare(*args.compare))
        return
    if not become_subreaper():
        print("warning: not a child subreaper: CPU time of processes the tests orphan is not counted", file=sys.stderr)
    files = args.files or sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*.py"))
    if args.together:
        files = [" ".join(files)]
    results = []
    for path in files:
        result = time_file(path, args.python, args.slowest, args.pytest_arg, [] if args.together else ["-n", "0"])
        results.append(result)
        print(f"{result['cpu_s']:8.1f} cpu s {result['wall_s']:8.1f} wall s  {path}: {result['summary']}", flush=True)
        if args.out:  # written after every file, so a long run that is stopped keeps what it measured
            args.out.write_text(json.dumps({"nproc": os.cpu_count(), "files": results}, indent=1))
    print(f"total: {sum(r['cpu_s'] for r in results):.0f} cpu s, {sum(r['wall_s'] for r in results):.0f} wall s")


if __name__ == "__main__":
    main()
