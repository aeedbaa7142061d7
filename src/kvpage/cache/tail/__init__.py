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
  depend on whether the prefix was cached. A format whose window copies are 8-bit
  (:meth:`~kvpage.formats.BlockFormat.window_copy_bits`: ``int2``, ``int2_rotated``) keeps
  instead an ``int8`` copy (per token and head) in an **8-bit slot** like a sink slot,
  written by the seal, and its 16-bit slot goes as outside the window (a provisional
  block keeps both until :meth:`TailTable.rollback`); half the bytes.
* **sink** slot: an 8-bit (``int8``, per token and head) copy of the first rows of a
  request's first block (:func:`~kvpage.spec.sink_rows`: token 0), read instead of
  their low-bit codes (attention sinks; KVQuant keeps the first token in fp16,
  IntactKV the pivot tokens, SKVQ 5 sink tokens); the block's other rows are read
  from its sealed codes, which hold every row, as any block's are. Kept while
  the block's content lives (in use, or cached and not evicted), so a prefix hit on
  a first block reads the same 8-bit copy the request that wrote it read.

Entries belong to a block's *content*: whenever the pool hands a block out anew
(:meth:`TailTable.invalidate`, wired to the block pool's allocation) its entries
are dropped, so a reused block id can never show another request's tokens.

In one step a request holds at most ``1 + window + 1`` slots: its open block, its
window, and the block it seals this step (its earlier tokens are read by every
layer's seal gather, so that slot is freed after the step); a verification step of
speculative decoding adds the blocks its drafts fill (*provisional*: sealed, but their
slot stays until :meth:`TailTable.rollback` verifies or reopens them). The scheduler counts
each chunk's slots before it runs (:meth:`TailTable.slots_to_take` against
:meth:`TailTable.num_takeable`) and defers or preempts instead of overrunning.

In the engine the slots are carved out of the device block pool on demand (:mod:`.side`: ``16 / bits``
blocks' codes hold one 16-bit slot, the tail tensors are views of the pool), so they cost blocks only
while requests hold them; a standalone :class:`TailTable` keeps fixed pools of the sizes it is given.

Modules, scheduler side (tensor-free): :mod:`.side` (groups of pool blocks), :mod:`.entries` (which slot each
block holds, taking and dropping slots), :mod:`.table` (:class:`TailTable`: the per-pass plan over them, a
:class:`~kvpage.cache.step_plan.SealOps`). Worker side: :mod:`.pool` (:class:`~kvpage.cache.tail.pool.TailPool`:
the per-layer tensors, which turn each pass's operations into index tensors every layer applies). This package
imports only the scheduler side.
"""
from kvpage.cache.tail.entries import TailEntries
from kvpage.cache.tail.table import TailTable

__all__ = ["TailEntries", "TailTable"]
