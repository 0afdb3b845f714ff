"""`hfport serve` as a child process on a free loopback port, started and waited for until /health answers.
Used by the tests and by scripts/loadtest.py: a real server, never an in-process stand-in."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """Start with `start()` (or `with`), stop with `stop()`: SIGINT first, so running jobs are requeued cleanly."""

    def __init__(self, data_dir: Path, log_path: Path, env: dict[str, str], args: tuple[str, ...] = (),
                 ready_timeout: float = 60.0, cwd: Path | None = None):
        self.data_dir, self.log_path, self.env, self.args = data_dir, log_path, env, args
        self.ready_timeout, self.cwd = ready_timeout, cwd
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self) -> ServerProcess:
        import httpx

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.proc = self.spawn(["serve", "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(self.data_dir),
                                *self.args], {**os.environ, **self.env})
        deadline = time.time() + self.ready_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.read_log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server did not come up in {self.ready_timeout:.0f} s:\n{self.read_log()}")

    def spawn(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        """`hfport ARGV` started with ENV in `cwd`, stdout and stderr appended to the log (a subclass may start it
        another way: what it returns answers poll, wait, send_signal, kill and pid as a Popen does)."""
        self.log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the server
        return subprocess.Popen([sys.executable, "-m", "hfport", *argv], cwd=self.cwd, env=env, stdout=self.log,
                                stderr=subprocess.STDOUT)

    def read_log(self, tail: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-tail:] if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if getattr(self, "log", None) is not None:
            self.log.close()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
