"""The wire layout of KV cache events, as vLLM publishes them (``vllm/distributed/kv_events.py``), in both encodings.

One ZeroMQ message per batch, three frames: the topic, the batch's sequence number (8 bytes, big-endian, from 0)
and the msgpack payload. The payload is a positional array ``[ts, events, data_parallel_rank]`` (``ts`` in Unix
seconds, a float). Each event is, by :data:`~kvpage.cache.kv_events.config.ENCODINGS`:

* ``tagged``: a map with its kind under ``"type"`` and its fields by name (what vLLM sends since mid-2026);
* ``array``: a positional array led by its kind, every field in order (older vLLMs).

Kinds and fields, in order (in ``tagged`` maps, the fields after ``lora_name`` are left out when ``None``):

* ``BlockStored``: ``block_hashes``, ``parent_block_hash`` (of the first block; ``None`` at the root),
  ``token_ids`` (all blocks' tokens, concatenated), ``block_size``, ``lora_id``, ``medium``, ``lora_name``,
  ``extra_keys``, ``group_idx``, ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``;
* ``BlockRemoved``: ``block_hashes``, ``medium``, ``group_idx``;
* ``AllBlocksCleared``: no field.

A block hash goes out as vLLM sends it by default, the low 64 bits of the prefix index's digest as an unsigned int
(:func:`~kvpage.cache.hashing.hash_to_int64`), or as the whole digest (32 ``bytes``: msgpack ``bin``) with
``block_hash_format="bytes"``.
``medium`` names the tier: :data:`MEDIUM_DEVICE` (``"GPU"``, what vLLM and the routers call the tier the model
reads, whatever the device is), :data:`MEDIUM_HOST` (``"CPU"``, the host tier, as vLLM's offloading connector
names it), :data:`MEDIUM_DISK` (``"DISK"``, the local disk store) or :data:`MEDIUM_REMOTE` (``"REMOTE"``, the
shared Redis store); vLLM itself names only ``"GPU"`` and ``"CPU"`` (:data:`TIER_MEDIUMS` maps tier names).
A tier below the device sends its ``BlockStored`` as vLLM's offloading connector does: the hashes alone,
``parent_block_hash`` ``None`` and no ``token_ids``. Tensor-free.
"""

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Union

import msgspec

from kvpage.cache.hashing import hash_to_int64
from kvpage.cache.prefix_cache import BlockRemoved, BlockStored

#: ``medium`` of the tier the model reads (vLLM's ``MEDIUM_GPU``; kvpage says so on a CPU device too).
MEDIUM_DEVICE = "GPU"
#: ``medium`` of the host (CPU memory) tier below it (vLLM's offloading connector's ``"CPU"``).
MEDIUM_HOST = "CPU"

#: ``medium`` of the local disk store (vLLM's upstream names no disk medium; forks and routers write ``"DISK"``).
MEDIUM_DISK = "DISK"
#: ``medium`` of the shared (Redis) store.
MEDIUM_REMOTE = "REMOTE"
#: A tier's name (:attr:`~kvpage.cache.tiers.stores.StoreURL.tier`, ``"host"``) -> its ``medium``; a tier not
#: listed (a registered store kind) goes out under its name in capitals.
TIER_MEDIUMS: dict[str, str] = {"device": MEDIUM_DEVICE, "host": MEDIUM_HOST, "disk": MEDIUM_DISK,
                                "redis": MEDIUM_REMOTE}


def medium_of(tier: str) -> str:
    """The ``medium`` of tier ``tier`` (:data:`TIER_MEDIUMS`, else ``tier.upper()``)."""
    return TIER_MEDIUMS.get(tier, tier.upper())


#: A block hash on the wire: the index's digest bytes (or an int, for 64-bit hash forms).
ExternalBlockHash = Union[bytes, int]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix index of a tier was emptied (``reset_prefix_cache`` with no block in use)."""


#: What the collector records: ``(medium, event)``.
Record = tuple[str, Union[BlockStored, BlockRemoved, AllBlocksCleared]]


@dataclass(frozen=True)
class WireSchema:
    """The msgspec struct types of one encoding (``batch`` is ``[ts, events, data_parallel_rank]`` in both).

    Attributes:
        encoding: ``"tagged"`` or ``"array"``.
        block_stored, block_removed, all_blocks_cleared: the event types (tag = class name).
        batch: the batch type; ``msgspec.msgpack.Decoder(schema.batch)`` decodes a payload.
    """

    encoding: str
    block_stored: type
    block_removed: type
    all_blocks_cleared: type
    batch: type


def _make_schema(encoding: str) -> WireSchema:
    """The struct types of ``encoding`` (``array_like`` events for ``"array"``, maps for ``"tagged"``)."""
    array_like = encoding == "array"

    class Event(msgspec.Struct, tag=True, array_like=array_like, omit_defaults=True, gc=False):
        """A KV cache event."""

    class BlockStoredWire(Event, tag="BlockStored"):
        """Blocks entered a tier's prefix index (a chain: each block's parent is the previous one)."""

        block_hashes: list[ExternalBlockHash]
        parent_block_hash: ExternalBlockHash | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[Any] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None

    class BlockRemovedWire(Event, tag="BlockRemoved"):
        """Blocks left a tier's prefix index."""

        block_hashes: list[ExternalBlockHash]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksClearedWire(Event, tag="AllBlocksCleared"):
        """A tier's prefix index was emptied."""

    class Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        """One step's events."""

        ts: float
        events: list[Union[BlockStoredWire, BlockRemovedWire, AllBlocksClearedWire]]
        data_parallel_rank: int | None = None

    return WireSchema(encoding, BlockStoredWire, BlockRemovedWire, AllBlocksClearedWire, Batch)


#: The schema of each encoding.
SCHEMAS: dict[str, WireSchema] = {e: _make_schema(e) for e in ("tagged", "array")}


def _same(block_hash: bytes) -> bytes:
    return block_hash


#: ``block_hash_format`` -> how a block hash of the index goes on the wire.
HASH_FORMS: dict[str, Callable[[bytes], ExternalBlockHash]] = {"int": hash_to_int64, "bytes": _same}


def to_wire(records: Iterable[Record], schema: WireSchema, *, block_size: int, group_idx: int | None = 0,
            spec_kind: str | None = "full_attention", sliding_window: int | None = None,
            hash_form: Callable[[bytes], ExternalBlockHash] = hash_to_int64) -> list[Any]:
    """The wire events of ``records``, in order, with runs merged as vLLM merges them.

    A stored block whose parent is the previous stored block of the same medium joins its event (one
    ``BlockStored`` per chain, its ``parent_block_hash`` the first block's parent), and so does a stored block
    without tokens and parent (a lower tier's) after another such block of the same medium; consecutive removals
    of one medium share one ``BlockRemoved``. Nothing is reordered, so applying the events in order gives the same set
    as applying the records one by one.

    Args:
        records: ``(medium, event)`` pairs (:data:`Record`).
        schema: the encoding's types (:data:`SCHEMAS`).
        block_size: tokens per block.
        group_idx, spec_kind, sliding_window: ``group_idx``, ``kv_cache_spec_kind`` and
            ``kv_cache_spec_sliding_window`` of every ``BlockStored`` (``group_idx`` of ``BlockRemoved`` too).
        hash_form: a hash's wire form (:data:`HASH_FORMS`; default vLLM's 64-bit int).
    """
    out: list[Any] = []
    last: Any = None  # the event a following record may join
    last_hash: Any = None
    for medium, ev in records:
        if isinstance(ev, BlockStored):
            bare = ev.parent_block_hash is None and not ev.token_ids  # a lower tier's: its hash alone
            if (isinstance(last, schema.block_stored) and last.medium == medium
                    and ((ev.parent_block_hash is not None and ev.parent_block_hash == last_hash)
                         or (bare and last.parent_block_hash is None and not last.token_ids))):
                last.block_hashes.append(hash_form(ev.block_hash))
                last.token_ids.extend(ev.token_ids)
            else:
                last = schema.block_stored(
                    block_hashes=[hash_form(ev.block_hash)],
                    parent_block_hash=None if ev.parent_block_hash is None else hash_form(ev.parent_block_hash),
                    token_ids=list(ev.token_ids), block_size=block_size, lora_id=None, medium=medium,
                    lora_name=None, group_idx=group_idx, kv_cache_spec_kind=spec_kind,
                    kv_cache_spec_sliding_window=sliding_window)
                out.append(last)
            last_hash = ev.block_hash
        elif isinstance(ev, BlockRemoved):
            if isinstance(last, schema.block_removed) and last.medium == medium:
                last.block_hashes.append(hash_form(ev.block_hash))
            else:
                last = schema.block_removed(block_hashes=[hash_form(ev.block_hash)], medium=medium,
                                            group_idx=group_idx)
                out.append(last)
        elif isinstance(ev, AllBlocksCleared):
            last = schema.all_blocks_cleared()
            out.append(last)
        else:
            raise TypeError(f"not a KV cache event: {ev!r}")
    return out


def encode_batch(ts: float, events: Sequence[Any], data_parallel_rank: int, schema: WireSchema,
                 encoder: msgspec.msgpack.Encoder | None = None) -> bytes:
    """The msgpack payload ``[ts, events, data_parallel_rank]`` of wire events (from :func:`to_wire`)."""
    enc = encoder if encoder is not None else msgspec.msgpack.Encoder()
    return enc.encode(schema.batch(ts=ts, events=list(events), data_parallel_rank=data_parallel_rank))


def seq_bytes(seq: int) -> bytes:
    """A sequence number as its 8-byte big-endian frame (``-1``, the replay's end marker, signed)."""
    return seq.to_bytes(8, "big", signed=True)
