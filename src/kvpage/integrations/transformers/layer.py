"""``KVPageLayer``: one transformers cache layer stored in a kvpage token-wise format, in paged blocks.

transformers hands a layer this step's keys and values, ``[batch, kv_heads, new_tokens, head_dim]``, and
wants the whole context back in the same layout (:meth:`KVPageLayer.update`). This layer writes the new
rows into its pool through the format (:func:`kvpage.ops.attention.write_kv`: quantized per token, into the
slots its :class:`~kvpage.integrations.transformers.blocks.BlockTable` gives) and reads every kept block
back through the format (:func:`kvpage.ops.attention.read_kv`, in the model's basis: rotated formats are
rotated back), so each query -- the newest included -- sees exactly what the cache stores, as in kvpage's
own attention. Only the codes and scales stay between steps; the dequantized context is a temporary.

The pool is one tensor per :attr:`LayerSpec.tensors <kvpage.spec.LayerSpec.tensors>` entry,
``[num_blocks, *per_block_shape]`` in the spec's dtype (what :class:`~kvpage.cache.controller.CacheController`
allocates), checked with :meth:`LayerSpec.validate <kvpage.spec.LayerSpec.validate>`; it grows by doubling,
or is allocated once at ``max_blocks`` when a limit is set. Block-wise formats (``int4``, ``int2``) use the
subclass :class:`~kvpage.integrations.transformers.sealed.SealedKVPageLayer`.

Imports transformers' ``CacheLayerMixin`` and kvpage's spec, formats and ops (never the engine).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from kvpage.errors import KVCacheLayoutError
from kvpage.formats import KEY, VALUE
from kvpage.integrations.transformers.blocks import BlockTable
from kvpage.ops.attention import read_kv, token_format, write_kv
from kvpage.spec import LayerSpec


class KVPageLayer(CacheLayerMixin):
    """A transformers cache layer whose keys and values live in paged blocks of a kvpage token-wise format.

    Args:
        spec: the layer's layout (with its static scales bound, for ``int8_static``/``fp8_static``).
        layer_index: the model layer it serves (for messages).
        sliding_window: the layer's window in tokens for a ``sliding_attention`` layer (blocks that slid out
            of every future query's window are freed), ``None`` for full attention.
        max_blocks: the most pool blocks this layer's tokens may take; the pool is allocated at once on the
            first update, with one more block per batch row (for partial blocks). ``None``: the pool grows on demand.

    Attributes:
        num_tokens: tokens written so far per batch row (left padding included; dropped ones too).
        pads: per batch row, its left pads: the leading positions that hold no token of the row (set by
            :class:`~kvpage.integrations.transformers.KVPageCache` before the first update; zeros otherwise).
            Token-wise formats store them as written (each token's codes are its own, and transformers'
            attention mask hides them); block-wise formats never store them.
        table: the block bookkeeping (``None`` before the first update).
        pool: tensor name -> ``[num_blocks, *per_block_shape]`` storage.
        record_past: set by ``activate_past_recording`` (assisted generation): sliding layers keep slid-out
            blocks until the next :meth:`crop`, so a rollback can restore them.

    Raises:
        KVCacheLayoutError: the spec's format is block-wise (use ``SealedKVPageLayer``).
    """

    is_compileable = False
    is_croppable = True

    def __init__(
        self, spec: LayerSpec, layer_index: int, *, sliding_window: int | None = None, max_blocks: int | None = None
    ) -> None:
        super().__init__()
        self._check_format(spec, layer_index)
        self.spec = spec
        self.layer_index = layer_index
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.max_blocks = max_blocks
        self.record_past = False
        self.num_tokens = 0
        self.pads: list[int] = []
        self.table: BlockTable | None = None
        self.pool: dict[str, torch.Tensor] = {}
        self.device = torch.device("cpu")
        self.dtype = torch.float32

    def _check_format(self, spec: LayerSpec, layer_index: int) -> None:
        """Raise unless ``spec``'s format is one this class writes (token-wise here)."""
        token_format(spec, layer_index)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec.kv_format}, layer={self.layer_index}, tokens={self.num_tokens})"

    # -- setup ---------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Take device and dtype from the first update's keys; start the block table (and a preallocated pool).

        A pool kept by :meth:`reset` on the same device is reused. No other side effect.
        """
        self.device = key_states.device
        self.dtype = key_states.dtype
        if self.pool and next(iter(self.pool.values())).device != self.device:
            self.pool = {}
        cap = next(iter(self.pool.values())).shape[0] if self.pool else 0
        # max_blocks covers the tokens; each batch row may also hold one partial block
        limit = None if self.max_blocks is None else self.max_blocks + key_states.shape[0]
        self.table = BlockTable(self.spec.block_size, cap, limit)
        if limit is not None and cap < limit:
            self._grow(limit)
        self.is_initialized = True

    def _init_side(self, num_rows: int) -> None:
        """Per-row state beside the pool (the full-precision tail of block-wise formats); none here."""

    def _check_states(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Check the update's shapes against the spec and the batch; start the rows on the first tokens.

        Raises:
            KVCacheLayoutError: keys/values not ``[batch, kv_heads, n, head_dim]`` per the spec, or of different
                shapes; another batch size than the cache holds (names the layer).
        """
        want = (self.spec.kv_heads, self.spec.head_dim)
        if (key_states.dim() != 4 or (key_states.shape[1], key_states.shape[3]) != want
                or value_states.shape != key_states.shape):
            raise KVCacheLayoutError(
                f"layer {self.layer_index}: keys and values must both be [batch, {want[0]}, new_tokens, {want[1]}] "
                f"(the model config's KV heads and head_dim), got {list(key_states.shape)} and "
                f"{list(value_states.shape)}"
            )
        assert self.table is not None
        rows = key_states.shape[0]
        if self.num_tokens == 0 and len(self.pads) != rows:
            self.pads = [0] * rows
        if self.num_tokens == 0 and self.table.num_rows != rows:
            self.table.truncate(0)
            self.table.set_rows(rows)
            self._init_side(rows)
        elif self.table.num_rows != rows:
            raise KVCacheLayoutError(
                f"layer {self.layer_index}: the cache holds {self.table.num_rows} batch rows, this update has {rows} "
                f"(use reorder_cache / batch_repeat_interleave / batch_select_indices to change them, or reset())"
            )

    def _begin_update(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[BlockTable, int]:
        """The prologue of every :meth:`update`: initialize on the first call, check the states, start the rows.

        Args:
            key_states: ``[batch, kv_heads, n, head_dim]`` this step's keys, any float dtype.
            value_states: ``[batch, kv_heads, n, head_dim]`` this step's values.

        Returns:
            ``(table, start)``: the block table (never ``None`` once this returns) and :attr:`num_tokens` before
            this step (the position of its first token). Side effects: :meth:`lazy_initialization` on the
            first call; on the first tokens after a reset, the rows of the table and the per-row state.

        Raises:
            KVCacheLayoutError: shapes that disagree with the spec, or a changed batch size.
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check_states(key_states, value_states)
        assert self.table is not None
        return self.table, self.num_tokens

    # -- pool ----------------------------------------------------------------------------------
    def _grow(self, capacity: int) -> None:
        """Grow the pool tensors (and the table) to ``capacity`` blocks, keeping their data."""
        assert self.table is not None
        self.table.grow(capacity)
        old = self.pool
        new: dict[str, torch.Tensor] = {}
        for t in self.spec.tensors:
            x = torch.zeros((capacity, *t.shape), dtype=t.dtype, device=self.device)
            if t.name in old:
                x[: old[t.name].shape[0]] = old[t.name]
            new[t.name] = x
        self.spec.validate(new, layer_index=self.layer_index, num_blocks=capacity)
        self.pool = new

    def _reserve(self, num_tokens: int, written_from: int, copy: bool = True) -> None:
        """Blocks for ``num_tokens`` tokens per row, rows' blocks from ``written_from`` on their own (copy-on-write).

        Raises:
            OutOfBlocksError: beyond ``max_blocks``.
        """
        assert self.table is not None
        need = self.table.missing(num_tokens, written_from)
        free = self.table.capacity - self.table.blocks_in_use()
        if need > free:
            cap = self.table.capacity
            target = max(cap + need - free, 2 * cap)
            if self.table.limit is not None:
                target = max(min(target, self.table.limit), cap + need - free)
            self._grow(target)
        copies = self.table.claim(num_tokens, written_from)
        if copies and copy:
            src = torch.tensor([a for a, _ in copies], dtype=torch.long, device=self.device)
            dst = torch.tensor([b for _, b in copies], dtype=torch.long, device=self.device)
            for t in self.pool.values():
                t.index_copy_(0, dst, t.index_select(0, src))

    # -- the transformers layer API --------------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's keys and values and return the layer's whole (kept) context.

        Args:
            key_states: ``[batch, kv_heads, n, head_dim]`` new keys (RoPE applied), any float dtype.
            value_states: ``[batch, kv_heads, n, head_dim]`` new values.

        Returns:
            ``(keys, values)``, each ``[batch, kv_heads, kept, head_dim]`` in ``key_states.dtype``: every
            kept token (from position ``get_mask_sizes(n)[1]`` on, this step's included) as the cache stores
            it, dequantized. Side effects: writes the pool, may grow it, may free slid-out blocks.

        Raises:
            KVCacheLayoutError: shapes that disagree with the spec, or a changed batch size.
            OutOfBlocksError: the pool would need more than ``max_blocks`` blocks.
        """
        table, start = self._begin_update(key_states, value_states)
        rows, heads, n, dim = key_states.shape
        self._reserve(start + n, start // self.spec.block_size)
        if n:
            slots = table.slots(start, n, self.device)
            k = key_states.transpose(1, 2).reshape(rows * n, heads, dim)
            v = value_states.transpose(1, 2).reshape(rows * n, heads, dim)
            write_kv(self.pool, self.spec, k, v, slots)
        self.num_tokens = start + n
        keys, values = self._read(key_states.dtype)
        if not self.record_past:
            self._slide()
        return keys, values

    def _read(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Every kept token's key and value, ``[batch, kv_heads, kept, head_dim]`` in ``dtype`` (no side effects)."""
        assert self.table is not None
        ids = self.table.ids(self.device)                                       # [B, nb]
        kept = self.num_tokens - self.table.first * self.spec.block_size
        out = []
        for name in (KEY, VALUE):
            x = read_kv(self.pool, self.spec, name, ids, dtype)                  # [B, nb, bs, Hkv, D]
            out.append(x.flatten(1, 2)[:, :kept].transpose(1, 2).contiguous())  # [B, Hkv, kept, D]
        return out[0], out[1]

    def _slide(self) -> None:
        """Free the blocks no future query of a sliding-window layer can see (none for full attention)."""
        if self.sliding_window is None or self.table is None:
            return
        oldest = max(0, self.num_tokens - self.sliding_window + 1)   # the next query's first visible position
        self.table.drop_before(oldest // self.spec.block_size)

    def get_seq_length(self) -> int:
        """Tokens written per batch row (dropped sliding-window tokens included: the next token's position)."""
        return self.num_tokens

    def get_mask_sizes(self, query_length: int | torch.Tensor) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of the next :meth:`update` of ``query_length`` tokens.

        ``kv_offset`` is the position of the first key :meth:`update` returns (the first kept block's first
        token: 0 unless a sliding-window layer dropped blocks), ``kv_length`` how many it returns.
        ``query_length`` may also be the step's ``cache_position`` tensor (what transformers before 5.2x pass).
        """
        n = query_length if isinstance(query_length, int) else int(query_length.shape[0])
        first = self.table.first * self.spec.block_size if self.table is not None else 0
        return self.num_tokens - first + n, first

    def get_max_length(self) -> int:
        """The most tokens a query reads: the sliding window, or -1 (no maximum) for full attention."""
        return -1 if self.sliding_window is None else self.sliding_window

    def get_max_cache_shape(self) -> int:
        """Same as :meth:`get_max_length` (the name transformers releases before it used)."""
        return self.get_max_length()

    def activate_past_recording(self) -> None:
        """Keep what a rollback (:meth:`crop`) needs until the next :meth:`crop` (assisted generation calls it)."""
        self.record_past = True

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the newest tokens: ``tokens_to_remove <= 0`` removes ``-tokens_to_remove`` of them.

        A positive value is the older transformers convention: the number of tokens to keep. The freed blocks
        return to the pool; a partial block's stale rows are overwritten by later tokens. Afterwards the
        cache is exactly as if the removed tokens had never been written. ``crop(0)`` only frees what a
        sliding-window layer recorded for a rollback.

        Raises:
            RuntimeError: the cut reaches back past what a sliding-window layer still holds (record the past
                with ``activate_past_recording()`` first), or past what a block-wise layer can reopen.
        """
        if not self.is_initialized or self.table is None:
            return
        keep = self.num_tokens + tokens_to_remove if tokens_to_remove <= 0 else min(tokens_to_remove, self.num_tokens)
        keep = max(keep, 0)
        if keep < self.num_tokens:
            bs = self.spec.block_size
            oldest = max(0, keep - self.sliding_window + 1) if self.sliding_window is not None else 0
            if keep and oldest < self.table.first * bs:
                raise RuntimeError(
                    f"layer {self.layer_index}: crop to {keep} tokens needs the sliding window's tokens from position "
                    f"{oldest}, but blocks before position {self.table.first * bs} were freed; call "
                    f"cache.activate_past_recording() before the steps you may roll back"
                )
            self._truncate(keep)
        self._slide()

    def _truncate(self, keep: int) -> None:
        """Drop every token from position ``keep`` on (``keep < num_tokens``)."""
        assert self.table is not None
        self.table.truncate(keep)
        self.num_tokens = keep

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row ``i`` becomes old row ``beam_idx[i]`` (beam search); blocks are shared, copied only when written."""
        if self.table is None or not self.table.num_rows:
            return
        self._reorder([int(i) for i in beam_idx.tolist()])

    def _reorder(self, index: Sequence[int]) -> None:
        """Apply a batch reordering (``index[i]``: old row of new row ``i``) to the table and per-row state."""
        assert self.table is not None
        self.table.reorder(index)
        self.pads = [self.pads[i] for i in index]

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every batch row ``repeats`` times in place (row ``b`` becomes rows ``b * repeats ..``)."""
        if self.table is None or not self.table.num_rows:
            return
        self._reorder([i for i in range(self.table.num_rows) for _ in range(repeats)])

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the batch rows ``indices`` (int64 indices, or a bool mask over the rows)."""
        if self.table is None or not self.table.num_rows:
            return
        idx = indices.nonzero().flatten() if indices.dtype == torch.bool else indices.flatten()
        self._reorder([int(i) for i in idx.tolist()])

    def reset(self) -> None:
        """Forget every token; the pool tensors are kept for the next generation (on the same device)."""
        if self.table is not None:
            self.table.truncate(0)
        self.table = None
        self.num_tokens = 0
        self.pads = []
        self.record_past = False
        self.is_initialized = False

    def offload(self) -> None:
        """No-op: KVPageCache layers are not offloaded (the cache is built with ``offloading=False``)."""

    def prefetch(self) -> None:
        """No-op (see :meth:`offload`)."""

    # -- accounting ----------------------------------------------------------------------------
    def kv_bytes(self) -> int:
        """Bytes of KV data this layer holds for its tokens: pool blocks in use (shared blocks once) x the spec's
        :attr:`~kvpage.spec.LayerSpec.bytes_per_block`."""
        return 0 if self.table is None else self.table.blocks_in_use() * self.spec.bytes_per_block

    def code_tokens(self) -> int:
        """Token slots whose codes (and scales) the pool holds: every written token, in distinct blocks (a block
        shared by beams counts once). At the spec's rate they cost :meth:`code_bytes`."""
        return 0 if self.table is None else self.table.filled_slots(self.num_tokens)

    def code_bytes(self) -> int:
        """Bytes of :meth:`code_tokens` at the spec's rate (``bytes_per_block / block_size`` a token); the rest of
        :meth:`kv_bytes` is side cost (here: the unfilled end of partial blocks)."""
        return self.code_tokens() * self.spec.bytes_per_block // self.spec.block_size

    def allocated_bytes(self) -> int:
        """Bytes of every tensor the layer has allocated (the whole pool, free blocks included)."""
        return sum(t.numel() * t.element_size() for t in self.pool.values())
