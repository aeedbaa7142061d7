"""The store(s) one vLLM deployment's records live in: kvpage's disk or Redis store per record spec.

Imports kvpage's stores and this package's records module, never vLLM.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpage.cache.tiers.stores import BlockData, KVStore, open_store
from kvpage.integrations.vllm.records import RecordSpecs


class RecordStores:
    """kvpage stores for a deployment's :class:`~kvpage.integrations.vllm.records.RecordSpecs`, addressed by block.

    A request's block ``index`` (0: its first block) picks the spec (``RecordSpecs.for_block``) and so the store
    instance, whose keys carry that spec's fingerprint. Like every kvpage store, calls never raise for I/O problems:
    an unreachable Redis or an unreadable file is a miss, a failed write is dropped (logged once per episode).

    Args:
        url: the store location (:func:`kvpage.cache.tiers.stores.open_store`): a directory or a Redis URL.
        specs: the deployment's record specs.
        options: keyword options for the store (``max_bytes``, ``ttl_seconds``, ``timeout_s``, ``namespace``, ...).

    Raises:
        ValueError: an unknown URL scheme or an unusable directory (from ``open_store``).
    """

    def __init__(self, url: str, specs: RecordSpecs, **options: Any) -> None:
        self.specs = specs
        self.blocks: KVStore = open_store(url, specs.blocks, **options)
        self.first: KVStore = (self.blocks if specs.first_block is specs.blocks
                               else open_store(url, specs.first_block, **options))

    def _split(self, first_index: int, n: int) -> list[tuple[KVStore, slice]]:
        """``(store, slice of the n blocks)`` runs: block ``first_index + i`` belongs to ``store_for(first_index + i)``."""
        return [(self.store_for(first_index + a), slice(a, b)) for a, b in self.specs.runs(first_index, n)]

    def store_for(self, index: int) -> KVStore:
        """The store of a request's block ``index``."""
        return self.first if index == 0 else self.blocks

    def exists(self, first_index: int, hashes: Sequence[bytes]) -> list[bool]:
        """Which of blocks ``first_index, first_index + 1, ...`` (chain hashes ``hashes``) have a record (a probe).

        Returns:
            one bool per hash; ``False`` for all when the store is unreachable.
        """
        out: list[bool] = []
        for store, part in self._split(first_index, len(hashes)):
            keys = [store.key(h) for h in hashes[part]]
            out += store.exists(keys) if keys else []
        return out

    def get(self, first_index: int, hashes: Sequence[bytes]) -> list[BlockData | None]:
        """Read and verify those blocks' records: one entry per hash, ``None`` for a missing, corrupt or foreign
        record (the store removes a rejected one) or an I/O failure."""
        out: list[BlockData | None] = []
        for store, part in self._split(first_index, len(hashes)):
            keys = [store.key(h) for h in hashes[part]]
            out += store.get(keys) if keys else []
        return out

    def put(self, first_index: int, hashes: Sequence[bytes], blocks: Sequence[BlockData]) -> None:
        """Write those blocks' records (each whole or not at all; a failed write is dropped).

        Raises:
            KVCacheLayoutError: a block disagrees with its spec (a caller bug, not an I/O problem).
        """
        for store, part in self._split(first_index, len(hashes)):
            items = [(store.key(h), b) for h, b in zip(hashes[part], blocks[part])]
            if items:
                store.put(items)

    def stats(self) -> dict[str, int]:
        """The stores' counters summed (:class:`~kvpage.cache.tiers.stores.StoreStats` fields)."""
        total = self.blocks.stats.as_dict()
        if self.first is not self.blocks:
            for k, v in self.first.stats.as_dict().items():
                total[k] += v
        return total

    def close(self) -> None:
        """Close the stores; no call may follow."""
        self.blocks.close()
        if self.first is not self.blocks:
            self.first.close()
