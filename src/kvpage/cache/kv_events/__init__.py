"""KV cache events on the wire in vLLM's format: settings, wire layout, collector, ZeroMQ publisher.

:mod:`~kvpage.cache.kv_events.config` (``KVEventsConfig``), :mod:`~kvpage.cache.kv_events.wire` (the msgpack
layout, both encodings), :mod:`~kvpage.cache.kv_events.collector` (a step's events) and
:mod:`~kvpage.cache.kv_events.publisher` (the PUB/ROUTER sockets and their thread). The publisher module imports
``zmq``; import it only where events are enabled. Tensor-free.
"""
from kvpage.cache.kv_events.config import ENCODINGS, KVEventsConfig

__all__ = ["ENCODINGS", "KVEventsConfig"]
