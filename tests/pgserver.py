"""A real PostgreSQL for the tests: initdb into a temporary folder, `pg_ctl start` on 127.0.0.1 with a free port,
stopped (and the folder removed) at the end. Never a mock.

Debian's binaries live in /usr/lib/postgresql/<major>/bin, off PATH; `make test` installs the package when absent.
PostgreSQL refuses to run as root, so as root the cluster folder is handed to the `postgres` user (which the Debian
package creates) and every server command runs through `runuser -u postgres`."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from server.launch import free_port

INSTALL_HINT = "apt-get install postgresql (make test does this when it runs as root)"


def find_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if found:
        return Path(found[-1]).parent
    on_path = shutil.which("initdb")
    return Path(on_path).parent if on_path else None


def require_bin() -> Path:
    """The binaries' folder; without them a failure in CI (the tests must run there), a skip elsewhere, saying why."""
    found = find_bin()
    if found is None:
        message = f"PostgreSQL server binaries (initdb, pg_ctl) not found: {INSTALL_HINT}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return found


class PgServer:
    """`listen`: the addresses it listens on (more than loopback: the partition test's veth address);
    `trust_hosts`: further client addresses pg_hba lets in (loopback always may)."""

    def __init__(self, bindir: Path, listen: tuple[str, ...] = ("127.0.0.1",), trust_hosts: tuple[str, ...] = ()):
        self.bindir, self.listen, self.trust_hosts = bindir, listen, trust_hosts
        self.root = Path(tempfile.mkdtemp(prefix="hfport-pg-"))
        self.data = self.root / "cluster"
        self.port = free_port()
        self.as_root = os.geteuid() == 0
        self.user = "hfport"

    def _run(self, *argv: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        cmd = [str(self.bindir / argv[0]), *argv[1:]]
        if self.as_root:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=self.root)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[:2])} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
        return out

    def start(self) -> PgServer:
        if self.as_root:
            shutil.chown(self.root, "postgres", "postgres")
        self._run("initdb", "-D", str(self.data), "-U", self.user, "-A", "trust", "-E", "UTF8", "--no-sync")
        if self.trust_hosts:
            with open(self.data / "pg_hba.conf", "a") as hba:
                hba.writelines(f"host all all {host}/32 trust\n" for host in self.trust_hosts)
        # throwaway cluster: durability off (fsync, synchronous commit) for speed; sockets in the temp folder
        opts = (f"-h {','.join(self.listen)} -p {self.port} -k {self.root} -c fsync=off -c synchronous_commit=off "
                f"-c full_page_writes=off -c max_connections=200")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "server.log"), "-o", opts, "-w", "-t", "60",
                  "start")
        return self

    def url(self, dbname: str = "postgres", host: str = "127.0.0.1") -> str:
        return f"postgresql://{self.user}@{host}:{self.port}/{dbname}"

    def create_database(self, name: str) -> str:
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        if self.data.exists():
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop", check=False, timeout=60)
        shutil.rmtree(self.root, ignore_errors=True)

    def log(self) -> str:
        path = self.root / "server.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""


class Relay:
    """A TCP relay on 127.0.0.1 in front of a server's port, in this process, no root needed. `freeze()` makes it
    stop passing bytes either way while every connection stays open: to a client, a link that went silent (a
    partition, a hung server or proxy), its kernel still acknowledging what it sends, so only the client's own
    deadline ends the wait. `thaw()` passes them on again. `stop()` is a server that went down: every connection is
    closed and new ones are closed at once, until `start()`."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._open = threading.Event()
        self._open.set()
        self._down = False
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def freeze(self) -> None:
        self._open.clear()

    def thaw(self) -> None:
        self._open.set()

    def stop(self) -> None:
        self._down = True
        for sock in self._sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def start(self) -> None:
        self._down = False

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
                if self._down:
                    client.close()
                    continue
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                return
            self._sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                self._open.wait()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.thaw()
        self.listener.close()
        for sock in self._sockets:
            sock.close()


_counter = iter(range(1, 10**9))


def fresh_db_name() -> str:
    return f"t{os.getpid()}_{next(_counter)}_{int(time.time() * 1000) % 10**8}"
