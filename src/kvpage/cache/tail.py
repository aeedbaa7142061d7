"""The full-precision tail of quantize-on-seal formats: open blocks, the recent window, first-block copies.

Quantize-on-seal formats (:mod:`kvpage.formats.kivi`) quantize a block once,
when it is full. Until then its tokens live here, in a small pool of 16-bit
*slots* (one block each), keyed by the block id that owns them:

* **open** slot: the request's last, partial block. Mandatory: decode writes and
  reads it; when the block fills it is sealed into the pool from this slot.
* **window** slot: a sealed block among the ``w = ceil(residual_tokens /
  block_size)`` blocks before a query's own block keeps its 16-bit copy, and
  attention reads it instead of the quantized block (KIVI's full-precision
  residual; the query's own block is read at full precision anyway, from its open
  slot or, in the step that seals it, from the rows it is sealed from). Optional: under
  pressure the oldest window copy goes, and the block is read quantized. Only
  blocks holding generated tokens get one, and only the request that sealed it reads
  it: a prompt block may come from the prefix cache or a tier without a copy, so
  reading copies of prompt blocks (or another request's) would make the output
  depend on whether the prefix was cached.
* **sink** slot: an 8-bit (``int8``, per token and head) copy of a request's first
  block, read instead of its low-bit codes (attention sinks; KVQuant keeps the
  first token in fp16, IntactKV the pivot tokens, SKVQ 5 sink tokens). Kept while
  the block's content lives (in use, or cached and not evicted), so a prefix hit on
  a first block reads the same 8-bit copy the request that wrote it read.

Entries belong to a block's *content*: whenever the pool hands a block out anew
(:meth:`TailTable.invalidate`, wired to the block pool's allocation) its entries
are dropped, so a reused block id can never show another request's tokens.

In one step a request holds at most ``1 + window + 1`` slots: its open block, its
window, and the block it seals this step (its earlier tokens are read by every
layer's seal gather, so that slot is freed after the step). The scheduler counts
each chunk's slots before it runs (:meth:`TailTable.slots_to_take` against
:meth:`TailTable.num_takeable`) and defers or preempts instead of overrunning.

:class:`TailTable` is the tensor-free bookkeeping; :class:`TailPool` adds the
per-layer tensors. Both are driven once per forward pass by :meth:`TailTable.plan`,
whose :class:`~kvpage.ops.seal_plan.SealPlan` every layer then applies.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

import torch

from kvpage.cache.idpool import IdPool
from kvpage.errors import KVPageError, OutOfBlocksError
from kvpage.formats import KEY, KEY_SCALE, VALUE, VALUE_SCALE, BlockFormat, Int8Format
from kvpage.ops.seal_plan import RequestRead, SealPlan
from kvpage.ops.sealed_attention import SealContext
from kvpage.spec import CacheSpec

#: Format of first-block (sink) copies: int8 per (token, head), unrotated.
SINK_FORMAT = Int8Format()


def _long(xs: Sequence[int], device: torch.device | str) -> torch.Tensor:
    return torch.as_tensor(list(xs), dtype=torch.long, device=device)


class TailTable:
    """Tensor-free bookkeeping of tail and sink slots (see the module docstring).

    Args:
        block_size: tokens per block.
        num_slots: 16-bit slots (open blocks + window copies).
        num_sink_slots: 8-bit first-block slots (0 disables sink copies).
        window_blocks: sealed blocks per request that keep their 16-bit copy.

    Raises:
        ValueError: negative sizes, or ``num_slots < 1``.
    """

    def __init__(
        self,
        block_size: int,
        num_slots: int,
        num_sink_slots: int,
        window_blocks: int,
    ) -> None:
        if block_size <= 0 or num_slots < 1 or num_sink_slots < 0 or window_blocks < 0:
            raise ValueError(
                f"bad tail sizes: block_size={block_size}, num_slots={num_slots}, "
                f"num_sink_slots={num_sink_slots}, window_blocks={window_blocks}"
            )
        self.block_size = block_size
        self.num_slots = num_slots
        self.num_sink_slots = num_sink_slots
        self.window_blocks = window_blocks
        self._is_live: Callable[[int], bool] | None = None    # the pool's views, for the plan being made
        self._is_in_use: Callable[[int], bool] | None = None
        self._slots = IdPool(num_slots, what="tail slot", lifo=True)  # a freed slot is reused first
        self._slot: dict[int, int] = {}                       # block id -> 16-bit slot
        self._window: OrderedDict[int, Hashable] = OrderedDict()  # block -> owner of its window copy, LRU first
        self._sink_slots = IdPool(num_sink_slots, what="sink slot", lifo=True)
        self._sink: OrderedDict[int, int] = OrderedDict()     # block id -> sink slot, LRU first
        self._sealed_after: list[int] = []                   # sealed blocks whose open slot the seal gather reads
        self._read_last: list[tuple[int, Hashable]] = []     # window copies only this step's last query reads

    # -- queries ---------------------------------------------------------------------------------

    def slot_of(self, block_id: int) -> int | None:
        """16-bit slot of ``block_id`` (open or window), or ``None``."""
        return self._slot.get(block_id)

    def sink_of(self, block_id: int) -> int | None:
        """Sink slot of ``block_id``, or ``None``."""
        return self._sink.get(block_id)

    @property
    def num_used(self) -> int:
        """16-bit slots in use."""
        return len(self._slot)

    @property
    def num_sink_used(self) -> int:
        """Sink slots in use."""
        return len(self._sink)

    @property
    def num_free(self) -> int:
        """16-bit slots no entry holds."""
        return self._slots.num_free

    def num_takeable(self, is_in_use: Callable[[int], bool], is_live: Callable[[int], bool]) -> int:
        """16-bit slots the next plan can surely take: free ones, and those a plan reclaims whatever its batch.

        A plan reclaims the slot of a dead block (``not is_live``) and a window copy, unless a request of
        its batch references the block; counted here are only entries of blocks no request references
        (``not is_in_use``), so the count holds for any batch. No side effects.
        """
        return self._slots.num_free + sum(
            1 for b in self._slot if not is_in_use(b) and (b in self._window or not is_live(b))
        )

    def slots_to_take(
        self, block_ids: Sequence[int], num_computed: int, num_new: int, prompt_len: int = 0,
        owner: Hashable | None = None,
    ) -> int:
        """Net 16-bit slots a plan of this one chunk takes beyond what the request holds now (no side effects).

        Mirrors :meth:`plan`: a block that ends the chunk partial, or fills inside the request's window
        (generated tokens only), needs a slot, and takes one unless it has an entry; the window copies the
        chunk pushes out are freed first and offset the count. The slot of a continued block sealed outside
        the window is already held (and freed by :meth:`finish`), so it costs nothing more. Never negative:
        slots a chunk frees are not counted for the other chunks of its step. The scheduler sums this over a
        step's chunks and compares with :meth:`num_takeable`.

        Args:
            block_ids: the request's block ids held now (blocks after them are new: no entries).
            num_computed: tokens already computed (the chunk's first position).
            num_new: tokens of the chunk (>= 0).
            prompt_len: the request's prompt length in tokens (as :meth:`plan`'s ``prompt_lens``).
            owner: who owns the request's window copies (as :meth:`plan`'s ``owners``).

        Raises:
            ValueError: negative counts.
        """
        if num_computed < 0 or num_new < 0:
            raise ValueError(f"num_computed and num_new must be >= 0, got {num_computed}, {num_new}")
        bs, first, s = self.block_size, num_computed, num_computed + num_new
        w = self.window_blocks
        window_from = (s - 1) // bs - w if s else 0
        takes = 0
        for j in range(first // bs, math.ceil(s / bs)):
            fills = min(s, (j + 1) * bs) == (j + 1) * bs
            if fills and (not w or j < window_from or (j + 1) * bs <= prompt_len):
                continue  # sealed outside the window: no slot kept
            if j >= len(block_ids) or int(block_ids[j]) not in self._slot:
                takes += 1
        return max(0, takes - len(self._pushed_out(block_ids, first, window_from, owner)))

    def _pushed_out(self, table: Sequence[int], first: int, read_from: int, owner: Hashable) -> list[int]:
        """The request's window copies among blocks before ``read_from`` that this chunk does not touch.

        ``read_from`` is the first block of the last new query's window: the ``window_blocks`` blocks
        before the query's own block (which it reads at full precision anyway).
        """
        bs, w = self.block_size, self.window_blocks
        hi = min(max(0, read_from), first // bs, len(table))
        return [b for b in (int(table[j]) for j in range(max(0, first // bs - w - 1), hi))
                if b in self._window and self._window[b] == owner]

    # -- lifecycle -------------------------------------------------------------------------------

    def invalidate(self, block_ids: Sequence[int]) -> None:
        """Drop every entry of ``block_ids``: the pool handed them out for new content."""
        for b in block_ids:
            self._drop_fp(b)
            self._drop_sink(b)

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop every entry of ``block_ids``: their content died (freed to the pool's free list, not cached).

        Called when a request is freed, so its open slot and window copies are free at once instead of
        waiting to be reclaimed. Call it between steps (not between a :meth:`plan` and its :meth:`finish`).
        """
        self.invalidate(block_ids)

    def reset(self) -> None:
        """Drop every entry (the pool was re-allocated)."""
        self.invalidate(list(self._slot) + list(self._sink))

    def _drop_fp(self, b: int) -> None:
        slot = self._slot.pop(b, None)
        if slot is not None:
            self._window.pop(b, None)
            self._slots.put([slot])

    def _drop_sink(self, b: int) -> None:
        slot = self._sink.pop(b, None)
        if slot is not None:
            self._sink_slots.put([slot])

    def _live(self, b: int) -> bool:
        return True if self._is_live is None else bool(self._is_live(b))

    def _take_slot(self, b: int, protected: set[int]) -> int:
        if not self._slots.num_free:
            victim = next((x for x in self._slot if x not in protected and not self._live(x)), None)
            if victim is None:
                victim = next((x for x in self._window if x not in protected), None)
            if victim is None:
                raise OutOfBlocksError(
                    f"the full-precision tail pool is full: {self.num_slots} slots hold open blocks of running "
                    f"requests; run fewer requests at once (max_num_seqs) or give the tail more slots"
                )
            self._drop_fp(victim)
        (slot,) = self._slots.take(1)
        self._slot[b] = slot
        return slot

    def _take_sink(self, b: int, protected: set[int]) -> int | None:
        if not self._sink_slots.num_free:
            victim = next((x for x in self._sink if x not in protected and not self._live(x)), None)
            if victim is None and self._is_in_use is not None:
                in_use = self._is_in_use
                victim = next((x for x in self._sink if x not in protected and not in_use(x)), None)
            if victim is None:
                victim = next((x for x in self._sink if x not in protected), None)
            if victim is None:
                return None
            self._drop_sink(victim)
        (slot,) = self._sink_slots.take(1)
        self._sink[b] = slot
        return slot

    # -- one forward pass ------------------------------------------------------------------------

    def plan(
        self,
        block_tables: Sequence[Sequence[int]],
        seq_lens: Sequence[int],
        query_lens: Sequence[int],
        device: torch.device | str = "cpu",
        owners: Sequence[Hashable] | None = None,
        prompt_lens: Sequence[int] | None = None,
        *,
        is_live: Callable[[int], bool] | None = None,
        is_in_use: Callable[[int], bool] | None = None,
    ) -> SealPlan:
        """Book this step's writes (open slots, seals, window and sink copies) and describe its reads.

        Args:
            block_tables: per request, its block ids (covering ``seq_lens[i]`` tokens).
            seq_lens: context length of each request after this step, in tokens.
            query_lens: new tokens of each request this step (its last ``query_lens[i]`` positions).
            device: where the plan's index tensors go.
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

        Raises:
            KVPageError: a request continues a partial block that has no open slot (its
                earlier tokens were never written through the tail).
            OutOfBlocksError: no slot can be freed for an open block.
        """
        self._is_live, self._is_in_use = is_live, is_in_use
        try:
            return self._plan(block_tables, seq_lens, query_lens, device, owners, prompt_lens)
        except BaseException:
            self._sealed_after = []  # nothing was sealed: the open slots must stay for a re-run
            self._read_last = []
            raise
        finally:
            self._is_live = self._is_in_use = None

    def _plan(
        self,
        block_tables: Sequence[Sequence[int]],
        seq_lens: Sequence[int],
        query_lens: Sequence[int],
        device: torch.device | str,
        owners: Sequence[Hashable] | None,
        prompt_lens: Sequence[int] | None,
    ) -> SealPlan:
        bs, w = self.block_size, self.window_blocks
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
        for table, s, n, owner, plen in zip(block_tables, seq_lens, query_lens, owners, prompt_lens):
            first = s - n
            mine: list[tuple[int, int, int | None]] = []
            sealed_now.append(mine)
            # The last query's window: the w blocks before its own block; sealed blocks from this index on
            # keep a 16-bit copy (its own block too, for the next query's window), older copies go.
            window_from = (s - 1) // bs - w
            # Window copies this step pushes out of the request's window go first: nothing reads them this
            # step, and freeing them before the request's new blocks take slots bounds its peak by 1 + w + 1.
            for b in self._pushed_out(table, first, window_from, owner):
                self._drop_fp(b)
            if w and s % bs == 0 and 0 <= window_from < len(table):  # the next query's window starts one later
                self._read_last.append((int(table[window_from]), owner))
            for j in range(first // bs, math.ceil(s / bs)):
                b = int(table[j])
                lo, hi = max(first, j * bs), min(s, (j + 1) * bs)
                slot = self._slot.get(b)
                if lo == j * bs:  # the block's first token: new content
                    self._drop_fp(b)
                    self._drop_sink(b)
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
                    if not w or j < window_from or (j + 1) * bs <= plen:  # outside the window, or a prompt block
                        if slot is not None:
                            self._window.pop(b, None)  # (a stale entry of a failed step's plan)
                            self._sealed_after.append(b)  # every layer's seal gather reads it first
                            for t in range(lo, hi):  # complete its rows: this step's queries in it read them
                                tail_dst.append(slot * bs + t - j * bs)
                                tail_src.append(row0 + t - first)
                        mine.append((j, len(seal_ids) - 1, slot))  # the slot (if any) lives until finish()
                        continue
                    self._window[b] = owner
                    self._window.move_to_end(b)
                if slot is None:
                    slot = self._take_slot(b, protected)
                if hi == (j + 1) * bs:  # a window block: its slot keeps its rows
                    mine.append((j, len(seal_ids) - 1, slot))
                for t in range(lo, hi):
                    tail_dst.append(slot * bs + t - j * bs)
                    tail_src.append(row0 + t - first)
            row0 += n
        reads = []
        for table, s, owner, mine in zip(block_tables, seq_lens, owners, sealed_now):
            nfull = s // bs
            fp_blocks = tuple(
                (j, self._slot[int(table[j])]) for j in range(max(0, (s - 1) // bs - w), min(nfull, (s - 1) // bs))
                if int(table[j]) in self._window and self._window[int(table[j])] == owner
            )
            open_slot = None
            if s % bs:
                open_slot = self._slot.get(int(table[nfull]))
                if open_slot is None:
                    raise KVPageError(f"block {int(table[nfull])} is partial but has no full-precision tail slot")
            sink = self._sink.get(int(table[0])) if nfull else None
            if sink is not None:
                self._sink.move_to_end(int(table[0]))
            reads.append(
                RequestRead(
                    full_ids=_long(table[:nfull], device),
                    fp_blocks=fp_blocks,
                    sink_slot=sink,
                    open_slot=open_slot,
                    open_len=s % bs,
                    sealed_now=tuple(mine),
                )
            )
        plan = SealPlan(
            tail_dst=_long(tail_dst, device),
            tail_src=_long(tail_src, device),
            seal_ids=_long(seal_ids, device),
            seal_from_new_dst=_long(new_dst, device),
            seal_from_new_src=_long(new_src, device),
            seal_from_tail_dst=_long(old_dst, device),
            seal_from_tail_src=_long(old_src, device),
            sink_pos=_long(sink_pos, device),
            sink_slots=_long(sink_slots, device),
            reads=tuple(reads),
        )
        return plan

    def finish(self) -> None:
        """After every layer applied the last plan: free the 16-bit slots it retired.

        A block sealed outside the window keeps its open slot until now, because every
        layer's seal gather reads its earlier tokens from it. So does the window copy that
        only the plan's last query read (at a block boundary, the block ``w`` before its own):
        the next query's window starts one block later. (Window copies a plan pushes out are
        freed by the plan itself: nothing reads them in that step.)
        """
        for b in self._sealed_after:
            if b not in self._window:
                self._drop_fp(b)
        self._sealed_after = []
        for b, owner in self._read_last:  # outside every later query's window
            if b in self._window and self._window[b] == owner:
                self._drop_fp(b)
        self._read_last = []

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


def tail_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """16-bit dtype of tail slots: the model dtype when it is 16-bit, else float16 (KIVI keeps fp16)."""
    return model_dtype if model_dtype in (torch.float16, torch.bfloat16) else torch.float16


class TailPool:
    """Per-layer tail and sink tensors of every quantize-on-seal layer, with their :class:`TailTable`.

    Tensors of layer ``L`` (``S`` = ``num_slots``, ``K`` = ``num_sink_slots``, rows flat
    as ``slot * block_size + offset``):
    ``key``/``value`` ``[S * block_size, kv_heads, head_dim]`` in :func:`tail_dtype`;
    ``sink_key``/``sink_value`` ``[K * block_size, kv_heads, head_dim]`` uint8 and
    ``sink_key_scale``/``sink_value_scale`` ``[K * block_size, kv_heads]`` float16 (the
    ``int8`` format's per-token codes).

    Args:
        spec: the cache layout; only layers whose format seals get tensors.
        table: the bookkeeping (its block size must be the spec's).
        model_dtype: the model's compute dtype (decides :func:`tail_dtype`).
        device: where the tensors live.
        layers: global indices of the layers to serve (one layer group's); default every block-wise layer.

    Raises:
        ValueError: the layers include none in a block-wise format, or block sizes differ.
    """

    def __init__(
        self, spec: CacheSpec, table: TailTable, model_dtype: torch.dtype, device: torch.device | str = "cpu",
        layers: Sequence[int] | None = None,
    ) -> None:
        self.spec = spec
        self.table = table
        self.dtype = tail_dtype(model_dtype)
        self.sink_format = SINK_FORMAT
        if table.block_size != spec.block_size:
            raise ValueError(f"tail block_size {table.block_size} != spec block_size {spec.block_size}")
        self.layers: dict[int, dict[str, torch.Tensor]] = {}
        rows, sink_rows = table.num_slots * table.block_size, table.num_sink_slots * table.block_size
        for i in range(spec.num_layers) if layers is None else layers:
            ls = spec.layer(i)
            if not isinstance(ls.format, BlockFormat):
                continue
            t: dict[str, torch.Tensor] = {}
            for kind in (KEY, VALUE) if ls.has_value else (KEY,):
                t[kind] = torch.zeros((rows, ls.kv_heads, ls.head_dim), dtype=self.dtype, device=device)
                t["sink_" + kind] = torch.zeros((sink_rows, ls.kv_heads, ls.head_dim), dtype=torch.uint8, device=device)
                scale_name = KEY_SCALE if kind == KEY else VALUE_SCALE
                t["sink_" + scale_name] = torch.zeros((sink_rows, ls.kv_heads), dtype=torch.float16, device=device)
            self.layers[i] = t
        if not self.layers:
            raise ValueError("the cache spec has no quantize-on-seal layer; it needs no tail pool")

    def context(self, plan: SealPlan) -> SealContext:
        """What :func:`~kvpage.ops.sealed_attention.sealed_attention` needs for one step: ``plan``, the tensors, the sink format.

        No side effects; the context refers to (does not copy) this pool's tensors.
        """
        return SealContext(plan=plan, tails=self.layers, sink_format=self.sink_format)

    @property
    def nbytes(self) -> int:
        """Bytes of all tail and sink tensors."""
        return sum(t.numel() * t.element_size() for layer in self.layers.values() for t in layer.values())

    @staticmethod
    def bytes_for(spec: CacheSpec, model_dtype: torch.dtype, num_slots: int, num_sink_slots: int,
                  layers: Sequence[int] | None = None) -> int:
        """Bytes a :class:`TailPool` of these sizes allocates for ``spec``'s ``layers`` (for memory budgets)."""
        total, item = 0, tail_dtype(model_dtype).itemsize
        for i in range(spec.num_layers) if layers is None else layers:
            ls = spec.layer(i)
            if isinstance(ls.format, BlockFormat):
                per_row = ls.kv_heads * (num_slots * ls.head_dim * item + num_sink_slots * (ls.head_dim + 2))
                total += (2 if ls.has_value else 1) * spec.block_size * per_row
        return total
