"""The connector's scheduler half: which of a request's blocks to load from the store and which to save.

Plain bookkeeping over integers and hashes: it probes the store (``exists``), never reads a record or touches a
tensor, and hands the worker half a :class:`StepTransfers` per step. Imports no vLLM: the vLLM glue
(:mod:`kvpage.integrations.vllm.connector`) passes it request fields.

**Block hashes.** Records are keyed by kvpage's chained SHA-256 of the prompt's token ids
(:func:`kvpage.cache.hashing.hash_block_chain`, the scheme kvpage's own prefix cache and stores use), at vLLM's
block size, rooted in the request's ``cache_salt`` and mixed with its LoRA adapter name; not by vLLM's
``request.block_hashes``. vLLM's hashes are only reproducible across processes when its hash algorithm and
``PYTHONHASHSEED`` are configured alike (its non-cryptographic default seeds the root per process), so a second
engine -- the point of a shared store -- would miss every block; kvpage's hash is the same in every process and on
every machine, and needs nothing from vLLM but the token ids.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpage.cache.hashing import hash_block_chain
from kvpage.integrations.vllm.stores import RecordStores


@dataclass(frozen=True)
class BlockTransfer:
    """Whole blocks of one request to move between vLLM's cache and the store.

    Attributes:
        request_id: the request.
        block_ids: vLLM block ids, in the request's order.
        block_hashes: the blocks' chain hashes (32 bytes each), one per block id.
        first_index: index of ``block_ids[0]`` in the request's block chain (0: its first block).
    """

    request_id: str
    block_ids: tuple[int, ...]
    block_hashes: tuple[bytes, ...]
    first_index: int


@dataclass
class StepTransfers:
    """One step's work for the worker half: ``loads`` before the forward pass, ``saves`` after it."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


@dataclass
class _Request:
    """What the scheduler half keeps per live request.

    Token regions of the prompt, in blocks of ``block_size``::

        [0, load_start)            on vLLM's device (its own prefix cache)
        [load_start, save_from)    in the store (loaded, or already there)
        [save_from, len(hashes))   to save once vLLM has computed them
    """

    hashes: list[bytes]
    load_start: int = 0
    num_hits: int = 0
    save_from: int = 0
    block_ids: list[int] = field(default_factory=list)


class ConnectorScheduler:
    """Decides, per step, which whole prompt blocks vLLM loads from the store and which it saves.

    Only full blocks of the prompt are stored (generated tokens are not: their last block is open and a speculative
    token may still be rejected); a load never covers the prompt's last token, which vLLM must compute.

    Args:
        stores: the deployment's record stores (only ``exists`` is called).
        block_size: vLLM's block size in tokens.
    """

    def __init__(self, stores: RecordStores, block_size: int) -> None:
        self.stores = stores
        self.block_size = block_size
        self._requests: dict[str, _Request] = {}
        self._loads: list[BlockTransfer] = []

    def hashes(self, prompt_token_ids: Sequence[int], cache_salt: str | None = None,
               lora_name: str | None = None) -> list[bytes]:
        """Chain hashes of the prompt's full blocks (no side effects); the LoRA adapter's name enters every block."""
        extra = () if lora_name is None else (("lora", lora_name),)
        return hash_block_chain(list(prompt_token_ids), self.block_size, cache_salt, extra)

    def get_num_new_matched_tokens(self, request_id: str, prompt_token_ids: Sequence[int] | None,
                                   num_computed_tokens: int, cache_salt: str | None = None,
                                   lora_name: str | None = None, cacheable: bool = True) -> int:
        """Tokens after vLLM's own hits that the store holds, in whole blocks (probes the store; remembers the answer
        for :meth:`update_state_after_alloc`, the last call winning).

        Args:
            request_id: the request.
            prompt_token_ids: its prompt (``None``: prompt embeddings, never stored).
            num_computed_tokens: tokens vLLM serves itself (block-aligned).
            cacheable: ``False`` for requests whose KV depends on more than token ids (multimodal inputs): nothing
                is loaded or saved for them.

        Returns:
            ``0`` or a multiple of ``block_size``: the run of consecutive stored blocks from
            ``num_computed_tokens``, ending before the prompt's last token.
        """
        if prompt_token_ids is None or not cacheable:
            self._requests[request_id] = _Request([])
            return 0
        bs = self.block_size
        hashes = self.hashes(prompt_token_ids, cache_salt, lora_name)
        start = num_computed_tokens // bs
        loadable = (len(prompt_token_ids) - 1) // bs
        hits = 0
        if loadable > start:
            for present in self.stores.exists(start, hashes[start:loadable]):
                if not present:
                    break
                hits += 1
        self._requests[request_id] = _Request(hashes, start, hits, save_from=start + hits)
        return hits * bs

    def update_state_after_alloc(self, request_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks (``block_ids``: all of them, in order) and will take
        ``num_external_tokens`` from the store: queue their load for the next :meth:`build_connector_meta`."""
        req = self._requests.get(request_id)
        if req is None:
            return
        req.block_ids = list(block_ids)
        if num_external_tokens <= 0:
            return
        n = min(-(-num_external_tokens // self.block_size), req.num_hits)
        a, b = req.load_start, req.load_start + n
        self._loads.append(BlockTransfer(request_id, tuple(req.block_ids[a:b]), tuple(req.hashes[a:b]), a))

    def build_connector_meta(
        self,
        new_requests: Sequence[tuple[str, Sequence[int], int]],
        cached_requests: Sequence[tuple[str, Sequence[int] | None, bool, int]],
        num_scheduled_tokens: dict[str, int],
    ) -> StepTransfers:
        """The step's loads (queued since the last call) and saves; resets the queue.

        Args:
            new_requests: ``(request id, all its block ids, tokens computed before this step)`` of requests
                scheduled for the first time.
            cached_requests: ``(request id, block ids added this step or None, resumed from preemption (then the ids
                are all of them), tokens computed before this step)``.
            num_scheduled_tokens: request id -> tokens this step computes.

        Returns:
            :class:`StepTransfers`; a save lists the prompt blocks that become full with this step and that the store
            did not hold (read by the worker after the forward pass).
        """
        # a request's computed region grows to [0, computed + scheduled) with this step; its blocks
        # [save_from, that // block_size) are full and written when the forward pass ends.
        out = StepTransfers(loads=self._loads)
        self._loads = []
        touched: list[tuple[str, int]] = []
        for req_id, block_ids, computed in new_requests:
            req = self._requests.get(req_id)
            if req is not None:
                req.block_ids = list(block_ids)
                touched.append((req_id, computed + num_scheduled_tokens.get(req_id, 0)))
        for req_id, new_ids, resumed, computed in cached_requests:
            req = self._requests.get(req_id)
            if req is None:
                continue
            if resumed:
                req.block_ids = list(new_ids or ())
            elif new_ids:
                req.block_ids.extend(new_ids)
            touched.append((req_id, computed + num_scheduled_tokens.get(req_id, 0)))
        for req_id, upto in touched:
            req = self._requests[req_id]
            full = min(upto // self.block_size, len(req.hashes), len(req.block_ids))
            if full > req.save_from:
                a, b = req.save_from, full
                out.saves.append(BlockTransfer(req_id, tuple(req.block_ids[a:b]), tuple(req.hashes[a:b]), a))
                req.save_from = full
        return out

    def request_finished(self, request_id: str) -> None:
        """Forget the request (its saves were issued in the steps that computed the blocks)."""
        self._requests.pop(request_id, None)
