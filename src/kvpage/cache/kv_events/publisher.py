"""``ZmqEventPublisher``: ships each step's KV cache events on a ZeroMQ PUB socket, off the engine's thread.

The engine hands :meth:`ZmqEventPublisher.publish` a step's records (:data:`~kvpage.cache.kv_events.wire.Record`);
that call only numbers the batch and puts it on a bounded queue, and never raises or blocks. A daemon thread
turns the records into wire events (:func:`~kvpage.cache.kv_events.wire.to_wire`), encodes them with msgspec,
sends ``(topic, seq, payload)`` and keeps ``(seq, payload)`` in a replay buffer of ``buffer_steps`` batches.
A client of the ROUTER socket (``replay_endpoint``) sends an 8-byte big-endian start sequence and receives every
buffered ``(seq, payload)`` from it on, then ``(-1, b"")`` (vLLM's ``ZmqEventPublisher`` protocol).

Sequence numbers are given when a batch is queued, so a batch dropped on a full queue leaves a gap a subscriber
sees (and cannot replay: it knows it must resynchronise). A failure in the thread is logged and costs that batch,
never the engine. Tensor-free.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence

import msgspec
import zmq

from kvpage.cache.kv_events.config import KVEventsConfig
from kvpage.cache.kv_events.wire import HASH_FORMS, SCHEMAS, Record, encode_batch, seq_bytes, to_wire

logger = logging.getLogger(__name__)

#: The replay stream's end marker: sequence ``-1`` with an empty payload.
END_SEQ = seq_bytes(-1)


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind an address with a wildcard, ``ipc://`` or ``inproc://``; connect to any other."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """A PUB socket (and an optional replay ROUTER socket) fed by a background thread.

    Args:
        config: the settings (``endpoint``, ``replay_endpoint``, ``buffer_steps``, ``hwm``, ``max_queue_size``,
            ``topic``, ``encoding``).
        block_size: tokens per block (``BlockStored.block_size``).
        data_parallel_rank: the third field of every batch.
        spec_kind, sliding_window: ``kv_cache_spec_kind`` / ``kv_cache_spec_sliding_window`` of stored blocks.

    Raises:
        ValueError: an endpoint ZeroMQ cannot bind or connect (in use, malformed); names the field.
    """

    def __init__(self, config: KVEventsConfig, block_size: int, *, data_parallel_rank: int = 0,
                 spec_kind: str | None = "full_attention", sliding_window: int | None = None) -> None:
        self.config = config
        self._schema = SCHEMAS[config.encoding]
        self._block_size = block_size
        self._rank = data_parallel_rank
        self._spec = (spec_kind, sliding_window)
        self._topic = config.topic.encode("utf-8")
        self._queue: queue.Queue[tuple[int, float, list[Record]] | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self.num_published = 0
        self.num_dropped = 0
        self.num_failed = 0
        self._ctx = zmq.Context.instance()
        self._pub = self._socket(zmq.PUB, config.endpoint, "endpoint", bind=_binds(config.endpoint))
        self._replay = None
        if config.replay_endpoint is not None:
            try:
                self._replay = self._socket(zmq.ROUTER, config.replay_endpoint, "replay_endpoint", bind=True)
            except ValueError:
                self._pub.close(linger=0)
                raise
        self.pub_endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or config.endpoint
        self.replay_endpoint = (None if self._replay is None
                                else self._replay.getsockopt_string(zmq.LAST_ENDPOINT) or config.replay_endpoint)
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kvpage-kv-events", daemon=True)
        self._thread.start()

    def _socket(self, kind: int, endpoint: str, field: str, *, bind: bool) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        if kind == zmq.PUB:
            sock.set_hwm(self.config.hwm)
        try:
            (sock.bind if bind else sock.connect)(endpoint)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            raise ValueError(f"kv_events_config.{field}={endpoint!r}: cannot "
                             f"{'bind' if bind else 'connect'} ({e})") from None
        return sock

    # -- engine thread -------------------------------------------------------------------------------------

    def publish(self, records: Sequence[Record], ts: float | None = None) -> int | None:
        """Queue one batch (a step's records, in order); returns its sequence number, or ``None`` if nothing was
        queued (no records, closed, or a full queue: counted in :attr:`num_dropped` and logged). Never raises."""
        if not records or not self._running:
            return None
        seq = self._next_seq
        self._next_seq += 1
        try:
            self._queue.put_nowait((seq, time.time() if ts is None else ts, list(records)))
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                logger.warning("KV events: the publisher queue is full (max_queue_size=%d); %d batches dropped "
                               "so far (subscribers see sequence gaps)", self.config.max_queue_size,
                               self.num_dropped)
            return None
        return seq

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued batch was sent (or ``timeout`` seconds passed); returns whether it was."""
        end = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < end:
            time.sleep(0.002)
        return not self._queue.unfinished_tasks

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (up to ``timeout`` seconds), stop the thread and close the sockets. Idempotent."""
        if not self._running:
            return
        self._running = False
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._pub.close(linger=int(timeout * 1000))  # (linger 0 would drop what zmq has not sent yet)
            if self._replay is not None:
                self._replay.close(linger=0)

    # -- publisher thread ----------------------------------------------------------------------------------

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._serve_replay()
                except Exception:  # a bad request costs that request only
                    logger.exception("KV events: replay request failed")
            try:
                item = self._queue.get(timeout=0.02)
            except queue.Empty:
                continue
            try:
                if item is None:
                    return
                seq, ts, records = item
                events = to_wire(records, self._schema, block_size=self._block_size, group_idx=0,
                                 spec_kind=self._spec[0], sliding_window=self._spec[1],
                                 hash_form=HASH_FORMS[self.config.block_hash_format])
                payload = encode_batch(ts, events, self._rank, self._schema, encoder)
                self._buffer.append((seq, payload))  # replayable even if this send fails
                self._pub.send_multipart((self._topic, seq_bytes(seq), payload))
                self.num_published += 1
            except Exception:
                self.num_failed += 1
                logger.exception("KV events: publishing a batch failed")
            finally:
                self._queue.task_done()

    def _serve_replay(self) -> None:
        """Answer one replay request: every buffered batch from the asked sequence on, then the end marker."""
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events: ignored a replay request of %d frames (want identity, b'', 8-byte seq)",
                           len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big", signed=True)
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq_bytes(seq), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))
