"""``SealedKVPageLayer``: a transformers cache layer in a kvpage block-wise format (``int4``, ``int2``).

Block-wise formats quantize a whole block once, when it fills (:meth:`BlockFormat.seal
<kvpage.formats.BlockFormat.seal>`: KIVI's per-channel keys need the block's tokens together). As in kvpage's
engine (:mod:`kvpage.cache.tail`, :mod:`kvpage.ops.sealed_attention`), a layer keeps beside its pool, per batch
row and in the 16-bit :func:`tail dtype <kvpage.spec.tail_dtype>`:

* the **open block**: the rows of its last, partial block (its pool block is reserved, as the engine's is);
* the **window**: 16-bit copies of the ``ceil(residual_tokens / block_size)`` sealed blocks before the next
  token's block (KIVI's full-precision residual; ``int2``'s default is one block, ``int4``'s none);
* the **sink**: an 8-bit (``int8`` per token and head) copy of the first block, read instead of its low-bit codes.

What :meth:`SealedKVPageLayer.update` returns for block ``j`` of the context (a step writes positions
``L .. L + n - 1``): blocks from ``L // block_size`` on -- the blocks this step writes, sealed in it or not --
the rows as written (rounded to the tail dtype); older blocks their window copy when in the window, the sink
copy for block 0, else the sealed codes dequantized (:meth:`BlockFormat.unseal
<kvpage.formats.BlockFormat.unseal>`). In decode (one token per step) that is exactly what kvpage's engine
reads: a query reads its own block at full precision. In a longer step (prefill) every query reads the
step's blocks at full precision, as transformers' own quantized caches do.

Rollback (:meth:`~SealedKVPageLayer.crop`) must reopen a sealed block at full precision and restore the window
as it was: under ``activate_past_recording()`` (assisted generation in transformers 5.2x) every 16-bit copy made
or pushed out of the window since the last ``crop`` is kept until the next one, so any cut back to that point is
exact. Without recording, the blocks sealed by an update of several tokens (a prefill, or the verification step
of assisted generation in older releases, which crop right after it without recording) keep their 16-bit rows
until the next update; a cut that reopens any other sealed block works only when its window copy exists.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvpage.cache.tail.pool import SINK_FORMAT
from kvpage.spec import tail_dtype
from kvpage.errors import KVCacheLayoutError
from kvpage.formats import KEY, KEY_SCALE, VALUE, VALUE_SCALE, BlockFormat
from kvpage.integrations.transformers.layer import KVPageLayer
from kvpage.spec import LayerSpec

_KINDS = (KEY, VALUE)
_SCALE = {KEY: KEY_SCALE, VALUE: VALUE_SCALE}


class SealedKVPageLayer(KVPageLayer):
    """A :class:`~kvpage.integrations.transformers.layer.KVPageLayer` for quantize-on-seal formats.

    Args:
        spec: the layer's layout; its format must be block-wise.
        layer_index, sliding_window, max_blocks: as :class:`KVPageLayer`.
        residual_tokens: the full-precision window in tokens (``None``: the format's
            ``default_residual_tokens``); rounded up to whole blocks.

    Attributes:
        window_blocks: sealed blocks per row that keep a 16-bit copy.
        tail_dtype: dtype of the open block and the window copies (the model dtype when 16-bit, else float16).
        open_rows: kind -> ``[batch, block_size, kv_heads, head_dim]`` rows of the open block.
        copies: block index -> kind -> ``[batch, block_size, kv_heads, head_dim]`` 16-bit rows of sealed blocks:
            the window (the ``window_blocks`` sealed blocks before the next token's), and while ``record_past``
            also every block sealed or pushed out of the window since the last :meth:`crop`.
        sink: ``sink_key``/``sink_value`` ``[batch, block_size, kv_heads, head_dim]`` uint8 codes and
            ``sink_key_scale``/``sink_value_scale`` ``[batch, block_size, kv_heads]`` float16; ``has_sink``.

    Raises:
        KVCacheLayoutError: the spec's format is token-wise (use ``KVPageLayer``).
        ValueError: a negative ``residual_tokens``.
    """

    def __init__(
        self, spec: LayerSpec, layer_index: int, *, sliding_window: int | None = None,
        max_blocks: int | None = None, residual_tokens: int | None = None,
    ) -> None:
        super().__init__(spec, layer_index, sliding_window=sliding_window, max_blocks=max_blocks)
        fmt = spec.format
        assert isinstance(fmt, BlockFormat)
        self.format: BlockFormat = fmt
        residual = fmt.default_residual_tokens if residual_tokens is None else residual_tokens
        if residual < 0:
            raise ValueError(f"residual_tokens must be >= 0, got {residual}")
        self.residual_tokens = residual
        self.window_blocks = -(-residual // spec.block_size)
        self.sink_enabled = bool(getattr(fmt, "sink_bits", 8))
        self.tail_dtype = torch.float16
        self.open_rows: dict[str, torch.Tensor] = {}
        self.copies: dict[int, dict[str, torch.Tensor]] = {}
        self.sink: dict[str, torch.Tensor] = {}
        self.has_sink = False

    def _check_format(self, spec: LayerSpec, layer_index: int) -> None:
        if not isinstance(spec.format, BlockFormat):
            raise KVCacheLayoutError(
                f"layer {layer_index}: format {spec.kv_format} is token-wise; its layers are KVPageLayer, not "
                f"SealedKVPageLayer"
            )

    def _init_side(self, num_rows: int) -> None:
        """Allocate the open block and sink tensors for ``num_rows`` rows (emptied); no window copies yet."""
        bs, h, d = self.spec.block_size, self.spec.kv_heads, self.spec.head_dim
        self.tail_dtype = tail_dtype(self.dtype)
        dev, td = self.device, self.tail_dtype
        self.open_rows = {k: torch.zeros((num_rows, bs, h, d), dtype=td, device=dev) for k in _KINDS}
        self.copies = {}
        self.sink = {}
        if self.sink_enabled:
            for k in _KINDS:
                self.sink["sink_" + k] = torch.zeros((num_rows, bs, h, d), dtype=torch.uint8, device=dev)
                self.sink["sink_" + _SCALE[k]] = torch.zeros((num_rows, bs, h), dtype=torch.float16, device=dev)
        self.has_sink = False

    # -- write and read --------------------------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's keys and values (sealing the blocks they fill) and return the kept context.

        Args and result as :meth:`KVPageLayer.update`; what each block of the result holds is described in the
        module docstring. Side effects: seals filled blocks into the pool, updates the open block, the 16-bit
        copies (window, and while recording the rows a rollback needs) and the sink.

        Raises:
            KVCacheLayoutError: shapes that disagree with the spec, or a changed batch size.
            OutOfBlocksError: the pool would need more than ``max_blocks`` blocks.
        """
        _, start = self._begin_update(key_states, value_states)
        bs = self.spec.block_size
        n = key_states.shape[2]
        if not self.record_past:
            self._trim()                       # the previous step's rollback rows are no longer needed
        end = start + n
        q0 = start // bs                       # the first block this step writes
        self._reserve(end, q0, copy=False)     # its blocks and later ones are the row's own (no data to copy yet)
        o = start - q0 * bs
        fresh = {}
        for kind, x in ((KEY, key_states), (VALUE, value_states)):
            new = x.transpose(1, 2).to(self.tail_dtype)                          # [B, n, Hkv, D]
            fresh[kind] = torch.cat([self.open_rows[kind][:, :o], new], dim=1)   # positions q0*bs .. end-1
        m = (o + n) // bs
        if m:
            self._seal(fresh, q0, m, keep_all=self.record_past or n > 1)
        rest = o + n - m * bs
        for kind in _KINDS:
            self.open_rows[kind][:, :rest] = fresh[kind][:, m * bs:]
        self.num_tokens = end
        out = self._read_context(fresh, q0, key_states.dtype)
        if not self.record_past:
            self._slide()
            if n == 1:
                self._trim()
        return out

    def _seal(self, fresh: dict[str, torch.Tensor], q0: int, m: int, keep_all: bool) -> None:
        """Seal blocks ``q0 .. q0 + m - 1`` from their rows in ``fresh`` into the pool; keep their 16-bit copies
        (the window's, or with ``keep_all`` every one, for a rollback) and the first block's 8-bit copy."""
        assert self.table is not None
        bs, rows = self.spec.block_size, self.table.num_rows
        ids = self.table.ids(self.device)[:, q0 - self.table.first: q0 - self.table.first + m].flatten()  # [B*m]
        keep_from = q0 if keep_all else q0 + m - self.window_blocks
        for kind in _KINDS:
            blocks = fresh[kind][:, : m * bs].unflatten(1, (m, bs))                # [B, m, bs, Hkv, D]
            for name, t in self.format.seal(blocks.flatten(0, 1), kind).items():
                self.pool[name].index_copy_(0, ids, t)
            for j in range(max(q0, keep_from), q0 + m):
                self.copies.setdefault(j, {})[kind] = blocks[:, j - q0].clone()
            if q0 == 0 and self.sink_enabled:
                q = SINK_FORMAT.quantize(blocks[:, 0].flatten(0, 1), kind=kind)   # [B*bs, Hkv, D]
                assert q.scale is not None
                self.sink["sink_" + kind].copy_(q.codes.view(rows, bs, *q.codes.shape[1:]))
                self.sink["sink_" + _SCALE[kind]].copy_(q.scale.view(rows, bs, -1))
        if q0 == 0 and self.sink_enabled:
            self.has_sink = True

    def _trim(self) -> None:
        """Drop the 16-bit copies outside the window (the sealed blocks before the next token's block)."""
        sealed = self.num_tokens // self.spec.block_size
        first = self.table.first if self.table is not None else 0
        lo = max(sealed - self.window_blocks, first)
        self.copies = {j: c for j, c in self.copies.items() if lo <= j < sealed}

    def _read_context(
        self, fresh: dict[str, torch.Tensor], q0: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of every kept position, ``[batch, kv_heads, kept, head_dim]`` in ``dtype`` (no side effects)."""
        assert self.table is not None
        bs, first = self.spec.block_size, self.table.first
        last_block = (self.num_tokens - 1) // bs
        out = []
        for kind in _KINDS:
            parts = []
            if q0 > first:
                ids = self.table.ids(self.device)[:, : q0 - first]                       # [B, nq]
                names = self.format.names(kind)
                old = self.format.unseal({t: self.pool[t][ids] for t in names}, kind, dtype,
                                         self.spec.head_dim)                              # [B, nq, bs, Hkv, D]
                for j in range(max(first, last_block - self.window_blocks), min(q0, last_block)):
                    if j in self.copies:
                        old[:, j - first] = self.copies[j][kind].to(dtype)
                if first == 0 and self.has_sink:  # after the window, as the engine reads it
                    codes = self.sink["sink_" + kind]
                    scale = self.sink["sink_" + _SCALE[kind]]
                    old[:, 0] = SINK_FORMAT.dequantize(codes, scale, dtype, kind=kind)
                parts.append(old.flatten(1, 2))
            parts.append(fresh[kind].to(dtype))
            out.append(torch.cat(parts, dim=1).transpose(1, 2).contiguous())        # [B, Hkv, kept, D]
        return out[0], out[1]

    def _slide(self) -> None:
        super()._slide()
        if self.table is not None and self.table.first > 0:
            self.has_sink = False   # block 0 slid out of every window

    # -- rollback and batch ----------------------------------------------------------------------
    def crop(self, tokens_to_remove: int) -> None:
        """As :meth:`KVPageLayer.crop`; afterwards only the window's 16-bit copies are kept (the step is settled).

        Raises:
            RuntimeError: as :meth:`KVPageLayer.crop`, or the cut reopens a sealed block without a 16-bit copy
                (call ``activate_past_recording()`` before the steps you may roll back).
        """
        super().crop(tokens_to_remove)
        self._trim()

    def _truncate(self, keep: int) -> None:
        bs = self.spec.block_size
        j, rest = divmod(keep, bs)
        sealed = self.num_tokens // bs
        if rest and j < sealed:  # block j was sealed: reopen it from its 16-bit copy
            rows = self.copies.get(j)
            if rows is None:
                raise RuntimeError(
                    f"layer {self.layer_index}: crop to {keep} tokens reopens block {j}, sealed to {self.spec.kv_format} "
                    f"without a full-precision copy; call cache.activate_past_recording() before the steps you "
                    f"may roll back"
                )
            for kind in _KINDS:
                self.open_rows[kind][:, :rest] = rows[kind][:, :rest]
        super()._truncate(keep)
        self.copies = {b: c for b, c in self.copies.items() if b < j}   # blocks from j on are no longer sealed
        if keep < bs:
            self.has_sink = False

    def _reorder(self, index: Sequence[int]) -> None:
        super()._reorder(index)
        idx = torch.tensor(list(index), dtype=torch.long, device=self.device)
        self.open_rows = {k: t.index_select(0, idx) for k, t in self.open_rows.items()}
        self.sink = {k: t.index_select(0, idx) for k, t in self.sink.items()}
        self.copies = {b: {k: t.index_select(0, idx) for k, t in rows.items()} for b, rows in self.copies.items()}

    def reset(self) -> None:
        """As :meth:`KVPageLayer.reset`; the 16-bit copies and the sink are dropped too."""
        super().reset()
        self.copies = {}
        self.has_sink = False

    # -- accounting ----------------------------------------------------------------------------
    def kv_bytes(self) -> int:
        """Bytes this layer holds for its tokens, counted as kvpage's engine counts them
        (:meth:`SealedFormat.effective_bits_per_value <kvpage.formats.SealedFormat.effective_bits_per_value>`):
        pool blocks in use (the open block's reserved one included; shared blocks once), the open block's 16-bit
        rows when it holds any, the 16-bit copies (the window's, plus while recording those kept for a
        rollback) and the 8-bit first-block copy."""
        if self.table is None:
            return 0
        rows = self.table.num_rows
        bs, h, d = self.spec.block_size, self.spec.kv_heads, self.spec.head_dim
        fp_block = 2 * bs * h * d * self.tail_dtype.itemsize           # one block's K and V rows, per batch row
        total = self.table.blocks_in_use() * self.spec.bytes_per_block
        if self.num_tokens % bs:
            total += rows * fp_block
        total += sum(t.numel() * t.element_size() for c in self.copies.values() for t in c.values())
        if self.has_sink:
            total += rows * sum(t[0].numel() * t.element_size() for t in self.sink.values())
        return total

    def code_tokens(self) -> int:
        """Token slots of the sealed blocks (distinct ones): the tokens whose 4-/2-bit codes the pool holds. The
        open block's tokens are in 16 bits, its reserved pool block is side cost until it seals."""
        if self.table is None:
            return 0
        bs = self.spec.block_size
        return self.table.filled_slots(self.num_tokens // bs * bs)

    def allocated_bytes(self) -> int:
        """Bytes of every tensor the layer has allocated: pool, open block, 16-bit copies and sink."""
        side = [*self.open_rows.values(), *self.sink.values()]
        side += [t for r in self.copies.values() for t in r.values()]
        return super().allocated_bytes() + sum(t.numel() * t.element_size() for t in side)
