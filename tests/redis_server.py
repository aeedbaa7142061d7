"""A real ``redis-server`` for tests: own process, free loopback port, temp dir, no persistence.

``make test`` (and so ``.ci/run``) installs Debian's ``redis-server`` when it is
missing; tests never mock Redis. Used by the ``redis_server`` / ``redis_url``
fixtures in ``conftest.py``.
"""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

MISSING_MESSAGE = (
    "redis-server is not on PATH. The Redis store tests need a real server: run `make test` "
    "(it installs Debian's redis-server) or `apt-get install -y redis-server`."
)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One ``redis-server`` process on ``127.0.0.1:port`` (``--save "" --appendonly no``).

    Args:
        workdir: the server's working directory (logs go there).
        port: TCP port; default a free one. :meth:`start` after :meth:`kill`
            restarts on the same port.

    Raises:
        RuntimeError: ``redis-server`` is missing (:data:`MISSING_MESSAGE`),
            exits, or does not answer PING within the start timeout.
    """

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        exe = shutil.which("redis-server")
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
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {self._log_tail()}")
                try:
                    if c.ping():
                        return
                except redis.exceptions.RedisError:
                    pass
                if time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"redis-server on port {self.port} did not answer PING: {self._log_tail()}")
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
