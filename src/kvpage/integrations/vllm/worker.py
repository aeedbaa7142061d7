"""The connector's worker half: moves whole blocks between vLLM's layer caches and store records.

It decides nothing: it performs the :class:`~kvpage.integrations.vllm.scheduler.StepTransfers` the scheduler half
issued. Loads read and verify records and dequantize them into vLLM's blocks before the forward pass; a block
whose record is missing, corrupt or of another layout is never written and is reported
(:meth:`ConnectorWorker.take_load_errors`) so vLLM recomputes it. Saves copy the blocks out after the forward pass
and code them into records, on a background thread unless told otherwise. Imports torch and kvpage, never vLLM.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvpage.integrations.vllm.cache_layout import CpuAttnBlocks
from kvpage.integrations.vllm.records import BlockCodec, RecordSpecs
from kvpage.integrations.vllm.scheduler import BlockTransfer
from kvpage.integrations.vllm.stores import RecordStores

logger = logging.getLogger(__name__)


class ConnectorWorker:
    """Loads and saves whole blocks of every layer of one vLLM worker.

    Args:
        specs: the deployment's record specs (their dtype decides what loads return).
        stores: where records live.
        dtype: vLLM's cache dtype.
        save_async: code and write records on one background thread (blocks are copied out first, so vLLM's blocks
            are free as soon as :meth:`save` returns); ``False``: before :meth:`save` returns.

    Attributes:
        caches: the layer caches in layer order (set by :meth:`register`).
        view: how a block sits in them.
    """

    def __init__(self, specs: RecordSpecs, stores: RecordStores, dtype: torch.dtype, save_async: bool = True) -> None:
        self.specs = specs
        self.stores = stores
        self.codecs = {0: BlockCodec(specs.first_block, dtype), 1: BlockCodec(specs.blocks, dtype)}
        self.caches: list[torch.Tensor] = []
        self.view: CpuAttnBlocks | None = None
        self._errors: set[int] = set()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvpage-save") if save_async else None
        self._pending: list[Future[None]] = []
        self._lock = threading.Lock()
        self.blocks_loaded = 0
        self.blocks_saved = 0

    def register(self, caches: Sequence[torch.Tensor], view: CpuAttnBlocks, names: Sequence[str] | None = None) -> None:
        """Learn the layer caches (in layer order) and their layout.

        Raises:
            ValueError: not one cache per layer of the specs.
            UnsupportedCacheLayoutError: a cache ``view`` cannot read (names the layer).
        """
        if len(caches) != self.specs.blocks.num_layers:
            raise ValueError(f"{len(caches)} layer caches for a layout of {self.specs.blocks.num_layers} layers")
        for i, c in enumerate(caches):
            view.check(names[i] if names else f"#{i}", c, self.codecs[1].dtype)
        self.caches, self.view = list(caches), view

    def _codec(self, index: int) -> BlockCodec:
        return self.codecs[0 if index == 0 else 1]

    # -- loads ----------------------------------------------------------------------------------
    def load(self, loads: Sequence[BlockTransfer]) -> None:
        """Read, verify and dequantize each transfer's records into its vLLM blocks (side effect: writes exactly the
        blocks whose records arrived, up to the first that did not; the rest are added to the load errors).

        Never raises for a store or record problem: a failed transfer's unwritten blocks are load errors.
        """
        for t in loads:
            try:
                got = self.stores.get(t.first_index, t.block_hashes)
                n = next((i for i, b in enumerate(got) if b is None), len(got))
                if n:
                    self._write(t, got[:n])
            except Exception:  # a bug or a record that decoded but does not fit: recompute, never wrong bytes
                logger.exception("KVPageConnector: loading %d blocks of request %s failed; vLLM recomputes them",
                                 len(t.block_ids), t.request_id)
                n = 0
            if n < len(t.block_ids):
                self._errors.update(t.block_ids[n:])
                logger.warning("KVPageConnector: %d of %d blocks of request %s not in the store (missing or rejected); "
                               "vLLM recomputes them", len(t.block_ids) - n, len(t.block_ids), t.request_id)
            self.blocks_loaded += n

    def _write(self, t: BlockTransfer, blocks: Sequence[dict]) -> None:
        """Decode ``blocks`` (the first ``len(blocks)`` of ``t``) and scatter them into every layer."""
        assert self.view is not None, "register() first"
        decoded: list[tuple[list[int], list[torch.Tensor], list[torch.Tensor]]] = []
        for a, b in self.specs.runs(t.first_index, len(blocks)):   # decode everything before writing anything
            keys, values = self._codec(t.first_index + a).decode(blocks[a:b])
            decoded.append((list(t.block_ids[a:b]), keys, values))
        for ids, keys, values in decoded:
            for layer, cache in enumerate(self.caches):
                self.view.scatter(cache, ids, keys[layer], values[layer])

    def take_load_errors(self) -> set[int]:
        """vLLM block ids whose loads failed since the last call (then forgotten)."""
        errors, self._errors = self._errors, set()
        return errors

    # -- saves ----------------------------------------------------------------------------------
    def save(self, saves: Sequence[BlockTransfer]) -> None:
        """Copy each transfer's blocks out of every layer now, then code and write them (on the background thread
        when ``save_async``). A failed write is dropped (the store logs it); the blocks are recomputed next time."""
        if not saves:
            return
        assert self.view is not None, "register() first"
        jobs = []
        for t in saves:
            for a, b in self.specs.runs(t.first_index, len(t.block_ids)):
                ids = list(t.block_ids[a:b])
                gathered = [self.view.gather(c, ids) for c in self.caches]         # per layer ([n,bs,h,d], [n,bs,h,d])
                jobs.append((t.first_index + a, t.block_hashes[a:b], [k for k, _ in gathered], [v for _, v in gathered]))
        if self._pool is None:
            self._write_records(jobs)
        else:
            with self._lock:
                self._pending = [f for f in self._pending if not f.done()]
                self._pending.append(self._pool.submit(self._write_records, jobs))

    def _write_records(self, jobs: list) -> None:
        for first_index, hashes, keys, values in jobs:
            try:
                records = self._codec(first_index).encode(keys, values)
                self.stores.put(first_index, hashes, records)
                self.blocks_saved += len(records)
            except Exception:
                logger.exception("KVPageConnector: saving %d blocks failed; they will be recomputed", len(hashes))

    def flush(self) -> None:
        """Block until every save issued so far is written (or dropped)."""
        with self._lock:
            pending, self._pending = self._pending, []
        for f in pending:
            f.result()

    def close(self) -> None:
        """Flush the saves, stop the background thread and close the stores; no call may follow."""
        self.flush()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.stores.close()
