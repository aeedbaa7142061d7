"""``KVEventsConfig``: where and how the engine publishes its KV cache events, spelled as vLLM's ``kv_events_config``.

``LLM(kv_events_config={"enable_kv_cache_events": True, "endpoint": "tcp://*:5557"})``, or the same JSON through
``--kv-events-config`` on ``kvpage generate`` / ``kvpage serve``. The fields are vLLM's (``vllm/config/kv_events.py``)
with their defaults, plus kvpage's ``encoding``: the event layout on the wire (see :mod:`kvpage.cache.kv_events.wire`).
Tensor-free.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from kvpage.config_json import config_fields

#: Publisher kinds: ``zmq`` (a ZeroMQ PUB socket) or ``null`` (events are collected nowhere).
PUBLISHERS = ("zmq", "null")
#: Event encodings: ``tagged`` (each event a msgpack map keyed by field name, its kind under ``"type"``; what vLLM
#: sends since mid-2026) or ``array`` (each event a positional array led by its kind, as older vLLMs send).
ENCODINGS = ("tagged", "array")
#: Block hash forms on the wire: ``int`` (the low 64 bits of each hash as an unsigned int: vLLM's default,
#: ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, what llm-d's indexer keys blocks by) or ``bytes`` (the whole digest, as
#: vLLM sends with that variable set to 0).
BLOCK_HASH_FORMATS = ("int", "bytes")


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"kv_events_config.{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class KVEventsConfig:
    """KV cache event publishing (vLLM's ``KVEventsConfig``).

    Attributes:
        enable_kv_cache_events: publish ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events.
        publisher: ``"zmq"`` or ``"null"``; ``None`` = ``"zmq"`` when events are enabled, else ``"null"`` (vLLM's rule).
        endpoint: the PUB socket's ZeroMQ address: bound when it holds ``*`` or ``::`` or is ``ipc://`` /
            ``inproc://``, else connected (vLLM's rule); default ``tcp://*:5557``.
        replay_endpoint: the ROUTER socket's address (always bound) that answers replay requests, or ``None``.
        buffer_steps: batches (one per engine step) kept for replay, newest last.
        hwm: the PUB socket's send high-water mark in messages; beyond it ZeroMQ drops messages for a slow
            subscriber (it sees a sequence gap and replays).
        max_queue_size: batches waiting for the publisher thread; when full a batch is dropped (counted and
            logged, its sequence number left as a gap) rather than blocking the engine.
        topic: the first frame of every message (subscribers filter on its prefix).
        encoding: ``"tagged"`` (default) or ``"array"`` (:data:`ENCODINGS`); the batch itself is a positional
            array ``[ts, events, data_parallel_rank]`` either way.
        block_hash_format: ``"int"`` (default, vLLM's) or ``"bytes"`` (:data:`BLOCK_HASH_FORMATS`): how
            ``block_hashes`` and ``parent_block_hash`` go out.

    Raises:
        ValueError: a bad field (the message names ``kv_events_config.<field>``).
    """

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    encoding: str = "tagged"
    block_hash_format: str = "int"

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(f"kv_events_config.enable_kv_cache_events must be true or false, "
                             f"got {self.enable_kv_cache_events!r}")
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"kv_events_config.publisher must be one of {', '.join(PUBLISHERS)}, "
                             f"got {self.publisher!r}")
        if not isinstance(self.endpoint, str) or "://" not in self.endpoint:
            raise ValueError(f"kv_events_config.endpoint must be a ZeroMQ address such as 'tcp://*:5557', "
                             f"got {self.endpoint!r}")
        if self.replay_endpoint is not None and (not isinstance(self.replay_endpoint, str)
                                                 or "://" not in self.replay_endpoint):
            raise ValueError(f"kv_events_config.replay_endpoint must be a ZeroMQ address such as 'tcp://*:5558' "
                             f"(or null), got {self.replay_endpoint!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            _positive_int(name, getattr(self, name))
        if not isinstance(self.topic, str):
            raise ValueError(f"kv_events_config.topic must be a string, got {self.topic!r}")
        if self.encoding not in ENCODINGS:
            raise ValueError(f"kv_events_config.encoding must be one of {', '.join(ENCODINGS)}, "
                             f"got {self.encoding!r}")
        if self.block_hash_format not in BLOCK_HASH_FORMATS:
            raise ValueError(f"kv_events_config.block_hash_format must be one of {', '.join(BLOCK_HASH_FORMATS)}, "
                             f"got {self.block_hash_format!r}")

    @property
    def active(self) -> bool:
        """Whether events are published (enabled and a ``zmq`` publisher)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def coerce(cls, value: KVEventsConfig | dict[str, Any] | str) -> KVEventsConfig:
        """A config from itself, a dict of its fields, or that dict as JSON (``--kv-events-config``).

        Raises:
            ValueError: bad JSON, not an object, an unknown key or a bad field (named).
        """
        if isinstance(value, cls):
            return value
        value = config_fields(value, "kv_events_config", (f.name for f in fields(cls)))
        return cls(**value)
