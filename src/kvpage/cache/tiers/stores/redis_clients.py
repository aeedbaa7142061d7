"""How a :class:`~kvpage.cache.tiers.stores.redis.RedisStore` reaches its servers: one node or a Redis Cluster.

The store (keys, records, failure episodes, counters) is the same for both; a :class:`RedisClient` only says
which *target* (server) a key lives on, runs a batch of commands as one pipeline, and drops a target's
connections after a failure. Two kinds, picked by URL scheme (:func:`redis_client_for_url`):

* :class:`SingleNodeClient` -- ``redis://``, ``rediss://``, ``unix://``: one server, every key on target
  ``""``. A server that turns out to be a Redis Cluster member is refused at creation (``INFO cluster`` says
  ``cluster_enabled:1``), because a plain client gets ``MOVED`` for every key of another node's slots; a
  ``MOVED`` reply met later (the server was down at creation) fails that batch with the same message.
* :class:`ClusterClient` -- ``redis+cluster://h1:p1,h2:p2,...`` (``rediss+cluster://`` for TLS): redis-py's
  :class:`redis.cluster.RedisCluster`, whose pipeline groups commands by the node owning each key's hash slot
  (one pipelined round trip per node, written to every node before reading any) and follows ``MOVED``/``ASK``
  while a slot migrates. The target of a key is the ``host:port`` owning its slot, so the store backs off only
  from a dead node and keeps serving the others. The client is built on first use, so a cluster that is
  down when the store opens is a miss, not an error.

Both use short socket timeouts and no redis-py retries or back-off: the store owns back-off (per target) and
recovery, and a failed batch is a miss, never a wait.
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote, urlparse

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

#: The target of a whole store (a single node, or a cluster whose topology is unknown).
WHOLE = ""

#: URL schemes of :class:`ClusterClient`.
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")

#: Errors that mean "a server is unreachable or misbehaving" (never raised to the store's callers).
IO_ERRORS: tuple[type[BaseException], ...] = (
    redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError,
)

#: Per-command replies that mean "this key's server is unavailable right now", not "this key is bad".
OUTAGE_REPLIES: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, redis.exceptions.ClusterError,
    redis.exceptions.TryAgainError, redis.exceptions.AskError, redis.exceptions.RedisClusterException, OSError,
)


class ClusterMemberError(redis.exceptions.RedisError):
    """A single-node ``redis://`` URL names a Redis Cluster member (use ``redis+cluster://``)."""


def cluster_member_message(url: str) -> str:
    """The one message for a single-node URL that names a cluster member (``url`` already redacted)."""
    return (f"{url} is a Redis Cluster node (cluster_enabled:1): a single-node redis:// store would get MOVED "
            f"for the keys of the other nodes' slots. Use redis+cluster://host1:port1,host2:port2,... "
            f"(any reachable members; the rest are discovered)")


def standalone_server_message(node: str) -> str:
    """The one message for a ``redis+cluster://`` URL whose node is a standalone server (``node``: ``host:port``)."""
    return (f"{node} is a standalone Redis server (cluster_enabled:0), not a Redis Cluster node: a "
            f"redis+cluster:// store would find no hash slots there. Use redis://{node}/0")


def cluster_enabled(client: redis.Redis) -> str | None:
    """The server's ``cluster_enabled`` field of ``INFO cluster`` (``"0"`` or ``"1"``), or ``None`` when it cannot
    be reached now."""
    try:
        return str(client.info("cluster").get("cluster_enabled"))
    except IO_ERRORS:
        return None


class RedisClient(ABC):
    """One way of reaching Redis for a :class:`~kvpage.cache.tiers.stores.redis.RedisStore` (thread-safe).

    Args:
        url: the store URL (its scheme picks the kind).
        timeout_s: socket connect and read/write timeout in seconds.
    """

    def __init__(self, url: str, timeout_s: float) -> None:
        self.url = url
        self.timeout_s = timeout_s

    @abstractmethod
    def targets(self, names: Sequence[str]) -> list[str]:
        """The target (server) of each Redis key name, in order; :data:`WHOLE` for a single node.

        Raises:
            one of :data:`IO_ERRORS`: the servers cannot be reached to learn where keys live.
        """

    @abstractmethod
    def execute(self, commands: Sequence[tuple[str, tuple[Any, ...], dict[str, Any]]]) -> list[Any]:
        """Run ``(method name, args, kwargs)`` commands as one non-transactional pipeline.

        Returns:
            one reply per command, in order; a command that failed on its own is its exception object.

        Raises:
            one of :data:`IO_ERRORS`: the batch as a whole failed (a server unreachable, a timeout).
        """

    @abstractmethod
    def disconnect(self, target: str) -> None:
        """Drop the connections to ``target`` (after a failure; the next use reconnects). Never raises."""

    @abstractmethod
    def get(self, name: str) -> bytes | None:
        """``GET name`` outside any pipeline (tests and tools).

        Raises:
            one of :data:`IO_ERRORS`.
        """

    def check(self) -> None:
        """Refuse a server this kind cannot use, when it can be reached now (called once, at creation).

        Raises:
            ValueError: the server is of the wrong kind (the message says which URL to use).
        """

    @abstractmethod
    def close(self) -> None:
        """Close every connection. Never raises."""


def _no_retry() -> Retry:
    return Retry(NoBackoff(), 0)


class SingleNodeClient(RedisClient):
    """One Redis server (``redis://[user:password@]host:port/db``, ``rediss://...``, ``unix:///path?db=N``)."""

    def __init__(self, url: str, timeout_s: float, shown_url: str) -> None:
        super().__init__(url, timeout_s)
        self.shown_url = shown_url
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=_no_retry(),
            health_check_interval=0,
        )

    def targets(self, names: Sequence[str]) -> list[str]:
        """Every key is on the one server: :data:`WHOLE`."""
        return [WHOLE] * len(names)

    def execute(self, commands: Sequence[tuple[str, tuple[Any, ...], dict[str, Any]]]) -> list[Any]:
        """One pipeline; a ``MOVED`` reply (the server is a cluster member) fails the batch with
        :class:`ClusterMemberError`. See :meth:`RedisClient.execute`."""
        pipe = self._client.pipeline(transaction=False)
        for name, args, kwargs in commands:
            getattr(pipe, name)(*args, **kwargs)
        res = pipe.execute(raise_on_error=False)
        if any(isinstance(r, redis.exceptions.MovedError) for r in res):
            raise ClusterMemberError(cluster_member_message(self.shown_url))
        return res

    def check(self) -> None:
        """Raise ``ValueError`` when the server answers ``INFO cluster`` with ``cluster_enabled:1``; an
        unreachable server is not checked (its first use is a miss, and a later ``MOVED`` says the same)."""
        if cluster_enabled(self._client) == "1":
            raise ValueError(cluster_member_message(self.shown_url))

    def disconnect(self, target: str) -> None:
        """Drop every pooled connection."""
        try:
            self._client.connection_pool.disconnect()
        except Exception:  # noqa: BLE001 - best effort; the pool reconnects on the next call
            pass

    def get(self, name: str) -> bytes | None:
        """``GET name``."""
        return self._client.get(name)

    def close(self) -> None:
        """Close the connection pool."""
        try:
            self._client.close()
        except Exception:  # noqa: BLE001 - closing a dead connection must not raise
            pass


def parse_cluster_url(url: str) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """Startup nodes and connection options of ``redis+cluster://[user:password@]h1:p1,h2:p2,...[/0]``.

    Returns:
        ``([(host, port), ...], {"username": ..., "password": ..., "ssl": ...})`` (port 6379 when omitted).

    Raises:
        ValueError: another scheme, no host, a bad port, a database other than 0 (a cluster has only db 0),
            or a query string.
    """
    parsed = urlparse(url)
    scheme = parsed.scheme.lower()
    if scheme not in CLUSTER_SCHEMES:
        raise ValueError(f"a Redis Cluster URL starts with redis+cluster:// or rediss+cluster://, got {url!r}")
    netloc = parsed.netloc
    creds, _, hosts = netloc.rpartition("@")
    if parsed.path not in ("", "/", "/0"):
        raise ValueError(f"a Redis Cluster has only database 0; drop {parsed.path!r} from {url!r}")
    if parsed.query or parsed.fragment:
        raise ValueError(f"a Redis Cluster URL takes no query string (use the store options), got {url!r}")
    nodes: list[tuple[str, int]] = []
    for part in hosts.split(","):
        host, sep, port = part.strip().rpartition(":") if ":" in part else (part.strip(), "", "6379")
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"bad host:port {part!r} in Redis Cluster URL "
                             f"(want redis+cluster://host1:port1,host2:port2,...)")
        nodes.append((host, int(port)))
    options: dict[str, Any] = {"ssl": scheme == "rediss+cluster"}
    if creds:
        user, _, password = creds.partition(":")
        options["username"] = unquote(user) or None
        options["password"] = unquote(password) or None
    return nodes, options


class ClusterClient(RedisClient):
    """A Redis Cluster (``redis+cluster://h1:p1,h2:p2,...``) through :class:`redis.cluster.RedisCluster`.

    The listed nodes are only where discovery starts; the topology (slot -> node) is read from the cluster
    on first use and refreshed by redis-py after a connection error, a ``MOVED`` or ``CLUSTERDOWN``.

    Raises:
        ValueError: a malformed URL (:func:`parse_cluster_url`).
    """

    def __init__(self, url: str, timeout_s: float) -> None:
        super().__init__(url, timeout_s)
        self.startup_nodes, self._options = parse_cluster_url(url)
        self._client: RedisCluster | None = None
        self._lock = threading.Lock()

    def _get(self) -> RedisCluster:
        """The cluster client, built (topology read) on first use. Raises one of :data:`IO_ERRORS`."""
        with self._lock:
            if self._client is None:
                self._client = RedisCluster(
                    startup_nodes=[ClusterNode(h, p) for h, p in self.startup_nodes],
                    socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s,
                    retry=_no_retry(),  # redis-py retries whole pipelines; the store backs off instead
                    require_full_coverage=False,  # a node down leaves its slots uncovered: misses, not a refusal
                    reinitialize_steps=1,  # a MOVED (a slot migrated) re-reads the whole slot table at once
                    health_check_interval=0,
                    **self._options,
                )
            return self._client

    def check(self) -> None:
        """Raise ``ValueError`` when the first listed node that answers ``INFO cluster`` says
        ``cluster_enabled:0`` (the cluster client would report it down forever); unreachable nodes are not
        checked (their first use is a miss)."""
        for host, port in self.startup_nodes:
            client = redis.Redis(host=host, port=port, socket_timeout=self.timeout_s,
                                 socket_connect_timeout=self.timeout_s, retry=_no_retry(), **self._options)
            try:
                enabled = cluster_enabled(client)
            finally:
                client.close()
            if enabled == "0":
                raise ValueError(standalone_server_message(f"{host}:{port}"))
            if enabled is not None:
                return

    def targets(self, names: Sequence[str]) -> list[str]:
        """``host:port`` of the node owning each key's hash slot (the cached slot table)."""
        client = self._get()
        out = []
        for name in names:
            try:
                out.append(client.nodes_manager.get_node_from_slot(client.keyslot(name)).name)
            except IO_ERRORS:  # an uncovered slot: routed nowhere, the pipeline reports it per key
                out.append("unrouted")
        return out

    def execute(self, commands: Sequence[tuple[str, tuple[Any, ...], dict[str, Any]]]) -> list[Any]:
        """One cluster pipeline (grouped by node by redis-py). See :meth:`RedisClient.execute`."""
        pipe = self._get().pipeline()
        for name, args, kwargs in commands:
            getattr(pipe, name)(*args, **kwargs)
        return pipe.execute(raise_on_error=False)

    def disconnect(self, target: str) -> None:
        """Drop the pooled connections to node ``target`` (``host:port``)."""
        try:
            node = None if self._client is None else self._client.get_node(node_name=target)
            if node is not None and node.redis_connection is not None:
                node.redis_connection.connection_pool.disconnect()
        except Exception:  # noqa: BLE001 - best effort; redis-py reconnects on the next call
            pass

    def get(self, name: str) -> bytes | None:
        """``GET name`` on the node owning its slot."""
        return self._get().get(name)

    def close(self) -> None:
        """Close every node's connections."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - closing dead connections must not raise
                pass


def redis_client_for_url(url: str, timeout_s: float, shown_url: str) -> RedisClient:
    """The :class:`RedisClient` kind a URL names: :class:`ClusterClient` for ``redis+cluster://`` /
    ``rediss+cluster://``, else :class:`SingleNodeClient` (``shown_url``: ``url`` without its password, for
    messages).

    Raises:
        ValueError: a malformed URL.
    """
    if urlparse(url).scheme.lower() in CLUSTER_SCHEMES:
        return ClusterClient(url, timeout_s)
    return SingleNodeClient(url, timeout_s, shown_url)
