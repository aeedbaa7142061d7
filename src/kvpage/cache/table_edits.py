"""``TableEdits``: the verbs of :class:`~kvpage.cache.manager.KVCacheManager` that edit a request's block table in
place: :meth:`~TableEdits.rollback` (rejected drafts), :meth:`~TableEdits.fork` (parallel sampling) and the
copy-on-write of a shared block a request is about to write into. Tensor-free: a copy is a ``(source,
destination)`` pair of block ids that the caller applies to the tensors (:meth:`~TableEdits.apply_block_copies`).

A fork's regions, for a child of ``n`` tokens::

    [0, n // bs * bs)        full blocks: shared by reference (never written again by anyone)
    [n // bs * bs, n)        the partial last block: shared until parent or child first writes into it; the
                             writer then gets a copy of the whole block (K, V, every scale, every group)
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from kvpage.cache.groups import GroupManager
from kvpage.cache.prefix_cache import ROOT, PrefixBlockPool
from kvpage.cache.req_state import _ReqState
from kvpage.cache.requests import KVCacheBlocks, SupportsKVCache



class TableEdits:
    """Rollback, fork and copy-on-write (mixed into :class:`~kvpage.cache.manager.KVCacheManager`)."""

    groups: tuple[GroupManager, ...]
    pool: PrefixBlockPool
    block_size: int
    _reqs: dict[str, _ReqState]
    _copies: list[tuple[str, int, int]]  # (request, source, destination) booked, not applied

    def blocks_for(self, num_tokens: int) -> int:  # (the manager's)
        """Blocks needed for ``num_tokens`` tokens."""
        raise NotImplementedError

    def _take(self, n: int) -> list[int]:  # (the manager's)
        raise NotImplementedError

    def _freed(self, block_ids: Sequence[int]) -> None:  # (the manager's)
        raise NotImplementedError

    def rollback(self, request: SupportsKVCache | str, num_tokens: int) -> tuple[int, ...]:
        """Keep the request's first ``num_tokens`` reserved slots, dropping the rest (rejected drafts, issue 14)::

            [0, num_cached_blocks * bs)   indexed blocks: never rolled back into (ValueError)
            [.., num_tokens)              kept: verified tokens
            [num_tokens, reserved)        dropped; blocks past blocks_for(num_tokens) go back to the pool

        The dropped blocks were never indexed: they return to the free list, and every group manager hears of
        them (:meth:`~kvpage.cache.groups.GroupManager.on_blocks_freed`), then of the kept table
        (:meth:`~kvpage.cache.groups.GroupManager.on_rollback`) -- also when nothing is dropped
        (``num_tokens == reserved``: the *commit* after a verification step, when a quantize-on-seal group learns
        which provisional seals are verified). Returns the freed block ids in table order (maybe empty).

        Raises:
            KeyError: the request holds no blocks.
            ValueError: ``num_tokens`` below its indexed blocks' tokens or above its reserved slots.
        """
        rid = request if isinstance(request, str) else request.request_id
        st = self._reqs[rid]
        indexed = st.num_cached_blocks * self.block_size
        if not indexed <= num_tokens <= st.num_tokens:
            raise ValueError(f"request {rid!r} cannot roll back to {num_tokens} tokens: it must keep its indexed "
                             f"{indexed} and holds {st.num_tokens} slots")
        keep = self.blocks_for(num_tokens)
        freed = st.block_ids[keep:]
        del st.block_ids[keep:]
        st.num_tokens = num_tokens
        if freed:
            self.pool.release(list(reversed(freed)))
            self._freed(freed)
        for g in self.groups:
            g.on_rollback(st.block_ids, num_tokens)
        return tuple(freed)

    # -- fork and copy-on-write ----------------------------------------------------------------------------

    def fork(self, parent: SupportsKVCache | str, child: SupportsKVCache, num_tokens: int) -> KVCacheBlocks:
        """Give ``child`` the parent's first ``num_tokens`` tokens by reference: every block holding them gains a
        reference (no block is taken from the pool), the child's table points at them, and it resumes at
        ``num_tokens`` (parallel sampling: ``n`` completions over one prompt). A partial last block stays shared
        until a holder writes into it (:meth:`needs_copy`). Every group hears of it (``on_fork``).

        Raises:
            KeyError: the parent holds no blocks.
            ValueError: the child holds blocks already, ``num_tokens`` is outside ``[0, parent's tokens]``, or a
                group cannot serve the child from them (``can_fork``: int4/int2 share whole blocks only; a window
                whose blocks lost their slots); nothing changed then.
        """
        pid = parent if isinstance(parent, str) else parent.request_id
        st = self._reqs[pid]
        if child.request_id in self._reqs:
            raise ValueError(f"request {child.request_id!r} already holds blocks; fork needs a new request")
        if not 0 <= num_tokens <= st.num_tokens:
            raise ValueError(f"cannot fork {num_tokens} tokens of request {pid!r}, which holds {st.num_tokens}")
        ids = st.block_ids[:self.blocks_for(num_tokens)]
        refused = [g.name for g in self.groups if not g.can_fork(ids, num_tokens)]
        if refused:
            raise ValueError(f"layer groups {refused} cannot serve a child from {num_tokens} tokens of {pid!r}")
        # the parent holds slots past num_tokens in the shared partial block: it will write there without asking
        # for slots, so the child takes its copy of that block now
        eager = num_tokens % self.block_size != 0 and st.num_tokens > num_tokens
        if eager and self.pool.num_free + self.pool.num_evictable < 1:
            raise ValueError(f"no block for the child's copy of request {pid!r}'s partial block")
        # the child also references the indexed twins the parent chained the duplicate blocks it shares onto (the
        # shared blocks indexed after a twin are that twin's cached children, kept in use); anchors follow the
        # parent's duplicates in table order, and its indexed range holds indexed blocks and duplicates only
        shared_full = min(num_tokens // self.block_size, st.num_cached_blocks)
        anchors = st.anchors[:sum(1 for b in st.block_ids[:shared_full] if self.pool.block_hash(b) is None)]
        self.pool.touch([*ids, *anchors])
        # the child indexes its full blocks itself (passing over those a sibling indexed, twins of duplicates)
        self._reqs[child.request_id] = _ReqState(block_ids=list(ids), num_tokens=num_tokens, num_cached_blocks=0,
                                                 parent=ROOT, anchors=list(anchors))
        for g in self.groups:
            g.on_fork(pid, child.request_id, ids, num_tokens)
        if eager:
            self._copy_on_write(child.request_id)
        return KVCacheBlocks(tuple(self._reqs[child.request_id].block_ids), (), num_tokens)

    def needs_copy(self, request_id: str, num_new_tokens: int) -> bool:
        """Whether the request's next write lands in a block it shares or that is indexed (a fork's partial
        block): then :meth:`allocate_slots` copies that block first (one more block from the pool)."""
        st = self._reqs.get(request_id)
        if st is None or num_new_tokens <= 0 or st.num_tokens % self.block_size == 0:
            return False
        idx = st.num_tokens // self.block_size
        if idx >= len(st.block_ids):
            return False
        b = st.block_ids[idx]
        return self.pool.ref_count(b) > 1 or self.pool.block_hash(b) is not None

    def _copy_on_write(self, request_id: str) -> int:
        """Replace the block the request's next write lands in by a fresh block and book the copy (the old block
        keeps the reference of the pending copy until :meth:`apply_block_copies`); returns the fresh block."""
        st = self._reqs[request_id]
        idx = st.num_tokens // self.block_size
        old, (new,) = st.block_ids[idx], self._take(1)
        st.block_ids[idx] = new
        self._copies.append((request_id, old, new))
        for g in self.groups:
            g.on_block_copied(request_id, old, new)
        return new

    @property
    def num_pending_copies(self) -> int:
        """Copies booked by copy-on-write and not applied yet."""
        return len(self._copies)

    def apply_block_copies(self, copy: Callable[[Sequence[tuple[int, int]]], None]) -> int:
        """Hand the booked ``(source, destination)`` pairs to ``copy`` (which copies every layer's tensors of each
        block), then drop the sources' pending references; returns how many. Call it before the forward pass
        that writes into the destinations."""
        pairs, self._copies = [(a, b) for _, a, b in self._copies], []
        if not pairs:
            return 0
        copy(pairs)
        self._release_sources(pairs)
        return len(pairs)

    def _drop_copies(self, request_id: str) -> None:
        """The request let go of its table before its booked copies ran (preempted or aborted while scheduling):
        forget them and drop their sources' references (their destinations went with the table)."""
        mine = [(a, b) for r, a, b in self._copies if r == request_id]
        if mine:
            self._copies = [c for c in self._copies if c[0] != request_id]
            self._release_sources(mine)

    def _release_sources(self, pairs: Sequence[tuple[int, int]]) -> None:
        for g in self.groups:
            g.on_copies_applied(pairs)
        olds = [a for a, _ in pairs]
        self.pool.release(olds)
        self._freed(olds)
