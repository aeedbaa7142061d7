"""``TailTable``: the per-pass seal plan over the tail entries (what a forward pass writes, seals and reads).

:meth:`TailTable.plan` books one pass's open slots, seals, window and first-block copies and returns the
:class:`~kvpage.cache.step_plan.SealOps` every layer of the group applies; :meth:`TailTable.slots_to_take` is its
dry run for the scheduler. Tensor-free.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence

from kvpage.cache.step_plan import SealOps, SealRead
from kvpage.cache.tail.entries import TailEntries
from kvpage.errors import KVPageError


class TailTable(TailEntries):
    """Tail and sink bookkeeping plus the per-step plan (see :mod:`kvpage.cache.tail`; arguments as :class:`TailEntries`)."""

    def slots_to_take(
        self, block_ids: Sequence[int], num_computed: int, num_new: int, prompt_len: int = 0,
        owner: Hashable | None = None, *, num_draft: int = 0,
    ) -> int:
        """Net 16-bit slots a plan of this one chunk takes beyond what the request holds now (no side effects).

        Mirrors :meth:`plan`: a block that ends the chunk partial, or fills inside the request's window
        (generated tokens only), needs a slot, and takes one unless it has an entry; the window copies the
        chunk pushes out are freed first and offset the count. The slot of a continued block sealed outside
        the window is already held (and freed by :meth:`finish`), so it costs nothing more. Never negative:
        slots a chunk frees are not counted for the other chunks of its step. The scheduler sums this over a
        step's chunks and compares with :meth:`num_takeable`. With ``num_draft`` unverified tokens a block the
        chunk fills that holds one is provisional and needs its slot too, and the window is the verified length's
        (as :meth:`plan`'s ``draft_lens``).

        Args:
            block_ids: the request's block ids held now (blocks after them are new: no entries).
            num_computed: tokens already computed (the chunk's first position).
            num_new: tokens of the chunk (>= 0).
            prompt_len: the request's prompt length in tokens (as :meth:`plan`'s ``prompt_lens``).
            owner: who owns the request's window copies (as :meth:`plan`'s ``owners``).
            num_draft: the last this many tokens of the context are unverified (as :meth:`plan`'s ``draft_lens``).

        Raises:
            ValueError: negative counts, or ``num_draft`` above the context's ``num_computed + num_new`` tokens.
        """
        if num_computed < 0 or num_new < 0:
            raise ValueError(f"num_computed and num_new must be >= 0, got {num_computed}, {num_new}")
        bs, first, s = self.block_size, num_computed, num_computed + num_new
        if not 0 <= num_draft <= s:
            raise ValueError(f"num_draft must be in [0, {s}], got {num_draft}")
        w, verified = self.window_blocks, s - num_draft
        window_from = (verified - 1) // bs - w
        w16 = w and self.window_bits == 16
        takes = 0
        for j in range(first // bs, math.ceil(s / bs)):
            fills = min(s, (j + 1) * bs) == (j + 1) * bs
            provisional = fills and (j + 1) * bs > verified
            if fills and not provisional and (not w16 or j < window_from or (j + 1) * bs <= prompt_len):
                continue  # sealed outside the window (or its window copy is 8-bit): no slot kept
            if j >= len(block_ids) or int(block_ids[j]) not in self._slot:
                takes += 1
        pushed = [b for b in self._pushed_out(block_ids, first, window_from, owner) if b in self._window]
        return max(0, takes - len(pushed))

    def copies_to_take(
        self, block_ids: Sequence[int], num_computed: int, num_new: int, prompt_len: int = 0,
        owner: Hashable | None = None, *, num_draft: int = 0,
    ) -> int:
        """Net 8-bit window copies a plan of this one chunk may make (``window_bits`` 8; else 0): blocks it fills
        inside the window (holding generated tokens; block 0 too, which takes one only when its first-block copy
        could not be made), less the request's 8-bit copies it pushes out of the window first. Arguments as
        :meth:`slots_to_take`; no side effects. Never negative."""
        if self.window_bits != 8 or not self.window_blocks:
            return 0
        bs, first, s = self.block_size, num_computed, num_computed + num_new
        window_from = (s - num_draft - 1) // bs - self.window_blocks
        makes = sum(1 for j in range(max(0, first // bs, window_from), s // bs)
                    if (j + 1) * bs > max(first, prompt_len))  # (block 0 counted: its first-block copy may fail)
        pushed = [b for b in self._pushed_out(block_ids, first, window_from, owner) if b in self._wcopy]
        return max(0, makes - len(pushed))

    # -- one forward pass ------------------------------------------------------------------------

    def plan(
        self,
        block_tables: Sequence[Sequence[int]],
        seq_lens: Sequence[int],
        query_lens: Sequence[int],
        owners: Sequence[Hashable] | None = None,
        prompt_lens: Sequence[int] | None = None,
        *,
        is_live: Callable[[int], bool] | None = None,
        is_in_use: Callable[[int], bool] | None = None,
        draft_lens: Sequence[int] | None = None,
    ) -> SealOps:
        """Book this step's writes (open slots, seals, window and sink copies) and describe its reads.

        **Window copies** (``window_blocks`` > 0): a block sealed inside the window of the last verified query,
        holding generated tokens, keeps its 16-bit slot as its copy, or at ``window_bits`` 8 gets an ``int8`` copy in
        an 8-bit slot (written by the seal: a ``sink_pos`` entry of all its rows) while its 16-bit slot goes as
        outside the window; block 0 then takes none (its first-block copy holds the whole block).

        **Drafts** (speculative verification, issue 14): the last ``draft_lens[i]`` positions of request ``i``'s
        context are unverified. A block that fills and holds one is sealed as usual -- each query of this step
        reads what decoding reads at its position: its own block at full precision, the blocks of its own
        window from their copies (the reads' ``fp_blocks`` and ``copy_blocks`` cover every query's window, issue
        29), the others as stored -- but is *provisional*: its 16-bit slot keeps all its rows (taken if it had
        none) and is not freed by :meth:`finish`, until :meth:`rollback` verifies it (the slot goes, or stays as a
        16-bit window copy) or reopens it (the slot is its open slot again; the next plan seals it anew; an 8-bit
        window copy made of it goes). The window
        (which sealed blocks keep a copy, which copies are pushed out) follows the verified length
        ``seq_lens[i] - draft_lens[i]`` instead of ``seq_lens[i]``, so a rollback to any length in between
        finds every copy its next query reads. No unverified token thus ends up only in low-bit codes.

        Args:
            block_tables: per request, its block ids (covering ``seq_lens[i]`` tokens).
            seq_lens: context length of each request after this step, in tokens.
            query_lens: new tokens of each request this step (its last ``query_lens[i]`` positions).
            owners: per request, who owns (and alone reads) the window copies it makes
                (its request id); default ``None`` for all.
            prompt_lens: per request, its prompt length in tokens: blocks made of prompt
                tokens only get no window copy; default 0 (every token counts as generated,
                as in ``kvpage eval``'s decode mode).
            is_live: ``block_id -> bool``, the device pool's view: whether a block's content is still
                held (in use or cached); entries of dead blocks are reclaimed first. ``None`` treats all as live.
            is_in_use: ``block_id -> bool``, the pool's view: whether a request references the block; a
                first block's 8-bit copy is taken from an idle cached block before one in use.
                ``None`` treats all as in use.
            draft_lens: per request, unverified positions at the end of its context (``seq_lens[i]`` minus its
                verified length; may exceed ``query_lens[i]`` in a drafter's later passes, whose earlier
                positions its earlier passes of the step wrote); default none.

        Raises:
            ValueError: a draft length outside ``[0, seq_lens[i]]`` (nothing booked).
            KVPageError: a request continues a partial block that has no open slot (its
                earlier tokens were never written through the tail).
            OutOfBlocksError: no slot can be freed for an open block.
        """
        drafts = [0] * len(seq_lens) if draft_lens is None else [int(d) for d in draft_lens]
        if len(drafts) != len(seq_lens) or any(not 0 <= d <= s for d, s in zip(drafts, seq_lens)):
            raise ValueError(f"draft_lens {drafts} must give each request a length in [0, seq_lens[i]] "
                             f"(seq_lens {list(seq_lens)})")
        self._is_live, self._is_in_use = is_live, is_in_use
        self._planning = True
        try:
            return self._plan(block_tables, seq_lens, query_lens, owners, prompt_lens, drafts)
        except BaseException:
            self._sealed_after = []  # nothing was sealed: the open slots must stay for a re-run
            self._read_last = []
            raise
        finally:
            self._is_live = self._is_in_use = None
            self._planning = False

    def _plan(
        self,
        block_tables: Sequence[Sequence[int]],
        seq_lens: Sequence[int],
        query_lens: Sequence[int],
        owners: Sequence[Hashable] | None,
        prompt_lens: Sequence[int] | None,
        drafts: Sequence[int],
    ) -> SealOps:
        bs, w = self.block_size, self.window_blocks
        w8 = self.window_bits == 8
        tail_dst: list[int] = []
        tail_src: list[int] = []
        seal_ids: list[int] = []
        new_dst: list[int] = []
        new_src: list[int] = []
        old_dst: list[int] = []
        old_src: list[int] = []
        sink_pos: list[int] = []
        sink_slots: list[int] = []
        # Every block this step reads or writes keeps its entries until the plan is done: evicting a
        # copy a request of this batch reads (a prefix hit's first block, say) would change its output.
        protected: set[int] = {int(b) for table, s in zip(block_tables, seq_lens) for b in table[: -(-s // bs)]}
        row0 = 0
        owners = list(owners) if owners is not None else [None] * len(seq_lens)
        prompt_lens = list(prompt_lens) if prompt_lens is not None else [0] * len(seq_lens)
        sealed_now: list[list[tuple[int, int, int | None]]] = []
        for table, s, n, owner, plen, d in zip(block_tables, seq_lens, query_lens, owners, prompt_lens, drafts):
            first, verified = s - n, s - d
            mine: list[tuple[int, int, int | None]] = []
            sealed_now.append(mine)
            # The last verified query's window: the w blocks before its own block; sealed blocks from this index
            # on keep a 16-bit copy (its own block too, for the next query's window), older copies go. (Without
            # drafts the step's last query; with them, a rollback may keep only the verified tokens.)
            window_from = (verified - 1) // bs - w
            # Window copies this step pushes out of the request's window go first: nothing reads them this
            # step, and freeing them before the request's new blocks take slots bounds its peak by 1 + w + 1.
            for b in self._pushed_out(table, first, window_from, owner):
                self._drop_window(b)
            if w and verified % bs == 0 and 0 <= window_from < len(table):  # the next window starts one later
                self._read_last.append((int(table[window_from]), owner))
            for j in range(first // bs, math.ceil(s / bs)):
                b = int(table[j])
                lo, hi = max(first, j * bs), min(s, (j + 1) * bs)
                slot = self._slot.get(b)
                if lo == j * bs:  # the block's first token: new content
                    self._drop_fp(b)
                    self._drop_sink(b)
                    self._drop_wcopy(b)
                    slot = None
                elif slot is None:
                    raise KVPageError(
                        f"block {b} (index {j}) already holds {lo - j * bs} tokens but has no full-precision tail "
                        f"slot; quantize-on-seal blocks must be written through the tail"
                    )
                if hi == (j + 1) * bs:  # the block fills: seal it from its earlier (tail) and new tokens
                    base = len(seal_ids) * bs
                    seal_ids.append(b)
                    for t in range(j * bs, (j + 1) * bs):
                        if t < lo:
                            assert slot is not None  # (tokens before lo: a continued block, which has a slot)
                            old_dst.append(base + t - j * bs)
                            old_src.append(slot * bs + t - j * bs)
                        else:
                            new_dst.append(base + t - j * bs)
                            new_src.append(row0 + t - first)
                    if j == 0 and self.num_sink_slots:
                        self._drop_sink(b)  # a re-run of a failed step seals it again: one sink slot per block
                        sink = self._take_sink(b, protected)
                        if sink is not None:
                            sink_pos.append(len(seal_ids) - 1)
                            sink_slots.append(sink)
                    in_window = bool(w) and j >= window_from and (j + 1) * bs > plen
                    # a copy of an earlier seal of these rows goes, in the window or not (a failed step's plan, or
                    # a drafter's earlier pass, may have booked one: its rows may be unwritten or other tokens')
                    self._drop_wcopy(b)
                    if in_window and w8 and not (j == 0 and b in self._sink):  # (block 0: its whole-block copy)
                        copy = self._take_window_copy(b, owner, protected)  # int8 rows of the block, 8-bit slot
                        if copy is not None:
                            sink_pos.append(len(seal_ids) - 1)
                            sink_slots.append(copy)
                    if (j + 1) * bs > verified:  # provisional: the slot keeps its rows until rollback()
                        self._provisional[b] = owner
                        if in_window and not w8:
                            self._window[b] = owner
                            self._window.move_to_end(b)
                        else:
                            self._window.pop(b, None)
                    elif not in_window or w8:  # outside the window, a prompt block, or an 8-bit window copy
                        self._provisional.pop(b, None)  # (a drafter's earlier pass of this step sealed it)
                        if slot is not None:
                            self._window.pop(b, None)  # (a stale entry of a failed step's plan)
                            self._sealed_after.append(b)  # every layer's seal gather reads it first
                            for t in range(lo, hi):  # complete its rows: this step's queries in it read them
                                tail_dst.append(slot * bs + t - j * bs)
                                tail_src.append(row0 + t - first)
                        mine.append((j, len(seal_ids) - 1, slot))  # the slot (if any) lives until finish()
                        continue
                    else:
                        self._provisional.pop(b, None)
                        self._window[b] = owner
                        self._window.move_to_end(b)
                if slot is None:
                    slot = self._take_slot(b, protected)
                if hi == (j + 1) * bs:  # a window or provisional block: its slot keeps its rows
                    mine.append((j, len(seal_ids) - 1, slot))
                for t in range(lo, hi):
                    tail_dst.append(slot * bs + t - j * bs)
                    tail_src.append(row0 + t - first)
            row0 += n
        reads = []
        for table, s, n, owner, mine in zip(block_tables, seq_lens, query_lens, owners, sealed_now):
            nfull = s // bs
            # Each query reads the copies of its own window (the w blocks before its block), as decoding at its
            # position does: the copies of every query's window, from the first query's on (a verification
            # pass's first query is its last verified one, whose window the pushed-out copies above kept).
            window = range(max(0, (s - max(n, 1)) // bs - w), min(nfull, (s - 1) // bs))
            fp_blocks = tuple((j, self._slot[int(table[j])]) for j in window
                              if int(table[j]) in self._window and self._window[int(table[j])] == owner)
            copy_blocks = tuple((j, self._wcopy[int(table[j])][1]) for j in window
                                if int(table[j]) in self._wcopy and self._wcopy[int(table[j])][0] == owner)
            for j, _ in copy_blocks:
                self._wcopy.move_to_end(int(table[j]))
            open_slot = None
            if s % bs:
                open_slot = self._slot.get(int(table[nfull]))
                if open_slot is None:
                    raise KVPageError(f"block {int(table[nfull])} is partial but has no full-precision tail slot")
            sink = self._sink.get(int(table[0])) if nfull else None
            if sink is not None:
                self._sink.move_to_end(int(table[0]))
            reads.append(
                SealRead(
                    full_ids=tuple(int(b) for b in table[:nfull]),
                    fp_blocks=fp_blocks,
                    sink_slot=sink,
                    open_slot=open_slot,
                    open_len=s % bs,
                    sealed_now=tuple(mine),
                    window_blocks=w,
                    copy_blocks=copy_blocks,
                )
            )
        return SealOps(
            tail_dst=tuple(tail_dst),
            tail_src=tuple(tail_src),
            seal_ids=tuple(seal_ids),
            seal_from_new_dst=tuple(new_dst),
            seal_from_new_src=tuple(new_src),
            seal_from_tail_dst=tuple(old_dst),
            seal_from_tail_src=tuple(old_src),
            sink_pos=tuple(sink_pos),
            sink_slots=tuple(sink_slots),
            reads=tuple(reads),
        )

    def finish(self, *, release_spare: bool = True) -> None:
        """After every layer applied the last plan: free the 16-bit slots it retired.

        A block sealed outside the window keeps its open slot until now, because every
        layer's seal gather reads its earlier tokens from it. So does the window copy that
        only the plan's last query read (at a block boundary, the block ``w`` before its own):
        the next query's window starts one block later. (Window copies a plan pushes out are
        freed by the plan itself: nothing reads them in that step.) Provisional blocks keep
        their slot (:meth:`rollback` decides).

        ``release_spare=False``: the plan was not the step's last over this table (a drafter's pass before the
        verification pass): retire nothing -- the final plan covers the same positions again, continuing
        their blocks from these slots, and retires them -- and keep the side groups promised to the step.
        """
        if release_spare:
            for b in self._sealed_after:
                if b not in self._window and b not in self._provisional:
                    self._drop_fp(b)
            for b, owner in self._read_last:  # outside every later query's window
                if self._owns_copy(b, owner):
                    self._drop_window(b)
        self._sealed_after = []
        self._read_last = []
        if release_spare and self.side is not None:
            self.side.release_spare()  # groups reserved for the step that no slot took

    def rollback(self, block_ids: Sequence[int], num_tokens: int) -> None:
        """Resolve a request's provisional blocks (:meth:`plan`'s drafts) once it keeps ``num_tokens`` tokens.

        ``block_ids`` is the table it keeps (``ceil(num_tokens / block_size)`` blocks; the entries of blocks
        dropped past it go by :meth:`release`). A provisional block wholly within ``num_tokens`` is verified:
        its slot goes, unless it is a window copy the next query reads. One the rollback reopened (the
        request's partial block, index ``num_tokens // block_size``) is an open block again: its slot stays
        as its open slot (the rows of its kept tokens are this step's, so the next plan continues it and
        seals it anew when it fills), it is no window copy, and a first block loses its 8-bit copy (made
        from a seal that held drafts; the new seal makes another). The request's window copies before the
        next query's window go too, so what it holds is what a run that never saw the drafts would hold.
        Call it between steps, after the verification pass, for every request of the step (nothing
        provisional: no-op). Without side groups no pool state changes; over side groups freed slots give
        their blocks back at once.
        """
        prov = self._provisional
        if not prov:
            return
        bs, w = self.block_size, self.window_blocks
        top = len(block_ids) - 1
        if top >= 0 and int(block_ids[top]) not in prov:
            top -= 1  # the step's open block
        low = top
        while low >= 0 and int(block_ids[low]) in prov:
            low -= 1
        low += 1  # provisional blocks are block_ids[low : top + 1] (those of one plan are contiguous)
        if low > top:
            return
        owner = prov[int(block_ids[top])]
        window_from = num_tokens // bs - w  # the next query's window: blocks [window_from, num_tokens // bs)
        for j in range(low, top + 1):
            b = int(block_ids[j])
            del prov[b]
            if (j + 1) * bs <= num_tokens:  # verified
                if b not in self._window or j < window_from:
                    self._drop_fp(b)  # (an 8-bit window copy stays: its block is sealed for good)
                if j < window_from:
                    self._drop_wcopy(b)
            else:  # reopened: the partial block (the table ends at num_tokens)
                self._window.pop(b, None)
                self._drop_wcopy(b)
                if j == 0:
                    self._drop_sink(b)
        for j in range(max(0, low - 1 - w), min(low, window_from)):  # copies the verified-length window kept
            b = int(block_ids[j])
            if self._owns_copy(b, owner):
                self._drop_window(b)

    def abort(self) -> None:
        """After a forward pass that raised (some layers may not have run the last plan): keep what a re-run needs.

        The open slots of blocks the plan sealed stay (a re-run of the same tokens seals them again from
        there; the forward writes the same K/V to the same slots, so the re-run is idempotent). A block
        that is never re-run frees its slot when its request is freed (:meth:`release`), when the pool
        hands the block out again (:meth:`invalidate`), or earlier as a dead block's. Window copies the
        plan's last query read stay too (the re-run reads them).
        """
        self._sealed_after = []
        self._read_last = []
        if self.side is not None:
            self.side.release_spare()
