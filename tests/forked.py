"""Child processes from one fork server for the session: a process that has imported torch, hfport's training loop and
its CLI once (FORKSERVER_PRELOAD) but never run an op, and forks a child per call. A child starts in milliseconds
where `python -m hfport` pays ~2.5 s of imports (CPU, on the 2-core CI machine) every time, and without the
OpenMP-after-fork hang that forking this (already computing) test process would risk.

    start_child(target, *args)      target(*args) in a child, started (a test joins it or SIGKILLs it)
    start_cli(*args, env=, cwd=,    `hfport ARGS` in a child as `python -m hfport ARGS` runs it (hfport.cli.main on
              stdout=, stderr=)     that argv), in that environment and folder, its stdout and stderr into those
                                    files; with $HFPORT_TESTS_FAULT set, through tests/faults.py's fault as
                                    `python -m tests.faults ARGS` runs it. Started: a test joins it or SIGKILLs it
    run_cli(*args, env=, cwd=)      start_cli to its end: a subprocess.CompletedProcess with the exit status, stdout
                                    and stderr (text), as subprocess.run(capture_output=True, text=True) gives them
    popen_cli(*args, env=, cwd=,    start_cli with stdout and stderr appended to one log, as a ForkedPopen: poll,
              log=)                 wait, send_signal, kill, pid and returncode as subprocess.Popen has them (the
                                    tests' `hfport serve` processes: tests/serving.py)
What differs from a fresh interpreter is only what the fork server imported already; a crash prints its traceback
and exits 1 as Python does (multiprocessing's child bootstrap), a SystemExit exits with its code. atexit handlers do
not run (a multiprocessing child ends with os._exit).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

_FORKSERVER = None
# what the fork server imports once for all its children. torch._dynamo (with sympy under it: ~800 modules, about a
# second of CPU) is what a child's first optimizer imports (torch.optim's constructor is wrapped in
# torch._disable_dynamo); preloaded, a child imports almost nothing. tests.faults: test_checkpoint_faults' targets;
# hfport.cli and tests.forked: start_cli's; server.app: `hfport serve`'s (FastAPI, uvicorn).
FORKSERVER_PRELOAD = ["torch", "torch._dynamo", "accelerate", "hfport.train.loop", "hfport.tokenizer", "hfport.cli",
                      "server.app", "tests.faults", "tests.forked"]


def _call(env: dict[str, str], target: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> None:
    """start_child's child: the caller's environment as it is now (the fork server's is the one it started with,
    in whichever test that was), fresh library settings, then the target."""
    import hfport.settings

    os.environ.clear()
    os.environ.update(env)
    hfport.settings.reset()
    target(*args, **kwargs)


def start_child(target: Callable[..., Any], *args: Any, **kwargs: Any) -> multiprocessing.process.BaseProcess:
    """target(*args, **kwargs) in a child process with this process's environment, started (a test SIGKILLs it or
    joins it)."""
    global _FORKSERVER
    if _FORKSERVER is None:
        _FORKSERVER = multiprocessing.get_context("forkserver")
        _FORKSERVER.set_forkserver_preload(FORKSERVER_PRELOAD)
    child = _FORKSERVER.Process(target=_call, args=(dict(os.environ), target, args, kwargs))
    child.start()
    return child


def _cli_main(args: list[str], env: dict[str, str], cwd: str, stdout: str, stderr: str, append: bool = False) -> None:
    """start_cli's child: this environment, folder and argv, stdout and stderr into the files (APPEND: after what
    they hold), then the CLI."""
    import torch

    import hfport.settings
    from hfport.cli import main
    from tests import faults

    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, stdout), (2, stderr)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC), 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    # what a fresh interpreter would take from the environment at start: OpenMP's thread count (read when the fork
    # server loaded torch), the library settings (read on first use)
    if env.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    hfport.settings.reset()
    if env.get(faults.ENV):
        point, step, *action = env[faults.ENV].split(":")
        faults.install(point, int(step), *action)
    sys.argv = ["hfport", *args]
    main()


def start_cli(*args: str, stdout: str | os.PathLike[str], stderr: str | os.PathLike[str],
              env: dict[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
              append: bool = False) -> multiprocessing.process.BaseProcess:
    """`hfport ARGS` in a fork-server child, started (the module docstring)."""
    env = dict(os.environ if env is None else env)
    return start_child(_cli_main, [str(a) for a in args], env, str(cwd or os.getcwd()), str(stdout), str(stderr),
                       append)


class ForkedPopen:
    """A fork-server child seen as subprocess.Popen sees a process: pid, returncode, poll, wait, send_signal,
    kill."""

    def __init__(self, child: multiprocessing.process.BaseProcess, args: list[str]):
        self.child, self.args, self.pid = child, args, child.pid

    @property
    def returncode(self) -> int | None:
        return self.child.exitcode

    def poll(self) -> int | None:
        return self.child.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.child.join(timeout)
        if self.child.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.child.exitcode

    def send_signal(self, sig: int) -> None:
        if self.child.exitcode is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


def popen_cli(*args: str, log: str | os.PathLike[str], env: dict[str, str] | None = None,
              cwd: str | os.PathLike[str] | None = None) -> ForkedPopen:
    """`hfport ARGS` started in a fork-server child, its stdout and stderr appended to LOG (the module docstring)."""
    child = start_cli(*args, stdout=log, stderr=log, env=env, cwd=cwd, append=True)
    return ForkedPopen(child, ["hfport", *map(str, args)])


def run_cli(*args: str, env: dict[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
            timeout: float = 180) -> subprocess.CompletedProcess:
    """`hfport ARGS` in a fork-server child to its end (the module docstring): exit status, stdout and stderr."""
    with tempfile.TemporaryDirectory(prefix="hfport-cli-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        child = start_cli(*args, stdout=out, stderr=err, env=env, cwd=cwd)
        child.join(timeout)
        if child.exitcode is None:
            child.kill()
            child.join()
            raise subprocess.TimeoutExpired(["hfport", *args], timeout)
        read = lambda path: path.read_text(errors="replace") if path.exists() else ""  # noqa: E731
        return subprocess.CompletedProcess(["hfport", *args], child.exitcode, read(out), read(err))
