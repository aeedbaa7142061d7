"""``SealedKVPageLayer``: a transformers cache layer in a kvpage block-wise format (``int4``, ``int2``).

Block-wise formats quantize a whole block once, when it fills (:meth:`BlockFormat.seal
<kvpage.formats.BlockFormat.seal>`: KIVI's per-channel keys need the block's tokens together). As in kvpage's
engine (:mod:`kvpage.cache.tail`, :mod:`kvpage.ops.sealed_attention`), a layer keeps beside its pool, per batch
row and in the 16-bit :func:`tail dtype <kvpage.spec.tail_dtype>`:

* the **open block**: the rows of its last, partial block (its pool block is reserved, as the engine's is);
* the **window**: 16-bit copies of the ``ceil(residual_tokens / block_size)`` sealed blocks before the next
  token's block (KIVI's full-precision residual; ``int2``'s default is one block, ``int4``'s none). Here always 16
  bits, where the engine keeps ``int2``'s as ``int8`` copies (:meth:`~kvpage.formats.BlockFormat.window_copy_bits`):
  :meth:`~SealedKVPageLayer.crop` reopens sealed blocks from these rows, which an 8-bit copy cannot give back, so
  ``int2`` answers a little differently here and costs 0.24 more bits at 1,024 tokens;
* the **sink**: an 8-bit (``int8`` per token and head) copy of the first block's first rows
  (:func:`~kvpage.spec.sink_rows`: token 0), read instead of their low-bit codes.

What :meth:`SealedKVPageLayer.update` returns for block ``j`` of the context (a step writes positions
``L .. L + n - 1``): blocks from ``L // block_size`` on -- the blocks this step writes, sealed in it or not --
the rows as written (rounded to the tail dtype); older blocks their window copy when in the window, block 0
with a sink copy its codes and the copy's rows, else the sealed codes dequantized (:meth:`BlockFormat.unseal
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
from kvpage.spec import LayerSpec, sink_rows

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
        sink: ``sink_key``/``sink_value`` ``[batch, n, kv_heads, head_dim]`` uint8 codes and
            ``sink_key_scale``/``sink_value_scale`` ``[batch, n, kv_heads]`` float16: the first block's first ``n``
            rows (``sink_n``, :func:`~kvpage.spec.sink_rows`).
        sink_held: per batch row, whether its first block is sealed and its first rows read from the 8-bit copy.

    Left padding: every row's own tokens form their own block stream, counted from its first real token (its
    :attr:`~KVPageLayer.pads` are never stored), so a padded row's blocks, scales, window and first-block copy
    are those of the row run alone. Block indices of :attr:`copies` and of the table are in each row's stream.

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
        self.sink_n = sink_rows(fmt, spec.block_size)
        self.tail_dtype = torch.float16
        self.open_rows: dict[str, torch.Tensor] = {}
        self.copies: dict[int, dict[str, torch.Tensor]] = {}
        self.sink: dict[str, torch.Tensor] = {}
        self.sink_held: list[bool] = []

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
                n = self.sink_n
                self.sink["sink_" + k] = torch.zeros((num_rows, n, h, d), dtype=torch.uint8, device=dev)
                self.sink["sink_" + _SCALE[k]] = torch.zeros((num_rows, n, h), dtype=torch.float16, device=dev)
        self.sink_held = [False] * num_rows

    @property
    def has_sink(self) -> bool:
        """Whether any row reads its first block's first rows from the 8-bit copy (:attr:`sink_held` per row)."""
        return any(self.sink_held)

    # -- each row's own token stream ---------------------------------------------------------------
    def _local(self, row: int, position: int | None = None) -> int:
        """Row ``row``'s own token count at batch position ``position`` (default :attr:`num_tokens`): the
        position less the row's left pads, at least 0."""
        return max(0, (self.num_tokens if position is None else position) - self.pads[row])

    def _groups(self) -> list[tuple[int, slice | torch.Tensor]]:
        """The rows by left-pad count: ``(pads, rows)`` per distinct count, ``rows`` a ``slice(None)`` when it is
        every row, else an int64 index tensor. Rows of one group share their block stream's clock."""
        by_pad: dict[int, list[int]] = {}
        for b, p in enumerate(self.pads):
            by_pad.setdefault(p, []).append(b)
        if len(by_pad) == 1:
            return [(self.pads[0], slice(None))]
        return [(p, torch.tensor(rows, dtype=torch.long, device=self.device)) for p, rows in by_pad.items()]

    # -- write and read --------------------------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's keys and values (sealing the blocks they fill) and return the kept context.

        Args and result as :meth:`KVPageLayer.update`; what each block of the result holds is described in the
        module docstring. A row's left pads (:attr:`pads`) are neither stored nor sealed: its blocks hold its
        own tokens from its first real one, and the result holds zeros at its pad positions (transformers'
        attention mask hides them). Side effects: seals filled blocks into the pool, updates the open block,
        the 16-bit copies (window, and while recording the rows a rollback needs) and the sink.

        Raises:
            KVCacheLayoutError: shapes that disagree with the spec, or a changed batch size.
            OutOfBlocksError: the pool would need more than ``max_blocks`` blocks.
        """
        table, start = self._begin_update(key_states, value_states)
        bs, first = self.spec.block_size, table.first
        rows, _, n, _ = key_states.shape
        if not self.record_past:
            self._trim()                       # the previous step's rollback rows are no longer needed
        end = start + n
        groups = self._groups()
        q0s = [self._local(0 if isinstance(idx, slice) else int(idx[0]), start) // bs for _, idx in groups]
        # every row's blocks from its first written block on are its own; a row whose stream is behind another's
        # (more pads) may share sealed blocks past the lowest such block after a reorder: those are copied
        self._reserve(end, min(q0s), copy=len(set(q0s)) > 1)
        dtype = key_states.dtype
        heads, dim = key_states.shape[1], key_states.shape[3]
        out = {kind: torch.zeros((rows, end - first * bs, heads, dim), dtype=dtype, device=self.device)
               for kind in _KINDS} if len(groups) > 1 else {}
        for (pad, idx), q0 in zip(groups, q0s):
            s, e = max(0, start - pad), max(0, end - pad)       # the group's own positions written now
            o = s - q0 * bs
            fresh = {}
            for kind, x in ((KEY, key_states), (VALUE, value_states)):
                new = x[idx, :, n - (e - s):].transpose(1, 2).to(self.tail_dtype)    # [G, e - s, Hkv, D]
                fresh[kind] = torch.cat([self.open_rows[kind][idx, :o], new], dim=1)  # positions q0*bs .. e-1
            m = (o + e - s) // bs
            if m:
                self._seal(fresh, q0, m, idx, keep_all=self.record_past or n > 1)
            rest = o + e - s - m * bs
            for kind in _KINDS:
                self.open_rows[kind][idx, :rest] = fresh[kind][:, m * bs:]
            context = self._read_context(fresh, q0, e, idx, dtype)
            if len(groups) == 1:
                keys, values = (torch.nn.functional.pad(c, (0, 0, 0, 0, pad, 0)) if pad else c for c in context)
                out = {KEY: keys, VALUE: values}
            else:
                for kind, c in zip(_KINDS, context):
                    out[kind][idx, pad:] = c
        self.num_tokens = end
        if not self.record_past:
            self._slide()
            if n == 1:
                self._trim()
        return out[KEY].transpose(1, 2).contiguous(), out[VALUE].transpose(1, 2).contiguous()

    def _seal(self, fresh: dict[str, torch.Tensor], q0: int, m: int, idx: slice | torch.Tensor,
              keep_all: bool) -> None:
        """Seal the rows ``idx``'s blocks ``q0 .. q0 + m - 1`` (of their own streams) from ``fresh`` into the pool;
        keep their 16-bit copies (the window's, or with ``keep_all`` every one, for a rollback) and the first
        block's 8-bit copy."""
        assert self.table is not None
        bs = self.spec.block_size
        first = self.table.first
        ids = self.table.ids(self.device)[idx, q0 - first: q0 - first + m].flatten()   # [G*m]
        keep_from = q0 if keep_all else q0 + m - self.window_blocks
        for kind in _KINDS:
            blocks = fresh[kind][:, : m * bs].unflatten(1, (m, bs))                # [G, m, bs, Hkv, D]
            for name, t in self.format.seal(blocks.flatten(0, 1), kind).items():
                self.pool[name].index_copy_(0, ids, t)
            for j in range(max(q0, keep_from), q0 + m):
                held = self.copies.setdefault(j, {})
                if kind not in held:
                    held[kind] = torch.zeros_like(self.open_rows[kind])
                held[kind][idx] = blocks[:, j - q0]
            if q0 == 0 and self.sink_enabled:
                n = self.sink_n
                q = SINK_FORMAT.quantize(blocks[:, 0, :n].flatten(0, 1), kind=kind)   # [G*n, Hkv, D]
                assert q.scale is not None
                g = blocks.shape[0]
                self.sink["sink_" + kind][idx] = q.codes.view(g, n, *q.codes.shape[1:])
                self.sink["sink_" + _SCALE[kind]][idx] = q.scale.view(g, n, -1)
        if q0 == 0 and self.sink_enabled:
            for b in range(len(self.pads))[idx] if isinstance(idx, slice) else idx.tolist():
                self.sink_held[b] = True

    def _trim(self) -> None:
        """Drop the 16-bit copies outside every row's window (the sealed blocks before its next token's block)."""
        if not self.pads:
            self.copies = {}
            return
        sealed = [self._local(b) // self.spec.block_size for b in range(len(self.pads))]
        first = self.table.first if self.table is not None else 0
        lo = max(min(sealed) - self.window_blocks, first)
        self.copies = {j: c for j, c in self.copies.items() if lo <= j < max(sealed)}

    def _read_context(
        self, fresh: dict[str, torch.Tensor], q0: int, end: int, idx: slice | torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the rows ``idx``, their own positions ``first * block_size .. end - 1``,
        ``[G, end - first * block_size, kv_heads, head_dim]`` in ``dtype`` (no side effects)."""
        assert self.table is not None
        bs, first = self.spec.block_size, self.table.first
        last_block = (end - 1) // bs
        rows = range(len(self.pads))[idx] if isinstance(idx, slice) else idx.tolist()
        sink = first == 0 and self.sink_held[rows[0]]   # the rows of a group share their history
        out = []
        for kind in _KINDS:
            parts = []
            if q0 > first:
                ids = self.table.ids(self.device)[idx, : q0 - first]                     # [G, nq]
                names = self.format.names(kind)
                old = self.format.unseal({t: self.pool[t][ids] for t in names}, kind, dtype,
                                         self.spec.head_dim)                              # [G, nq, bs, Hkv, D]
                for j in range(max(first, last_block - self.window_blocks), min(q0, last_block)):
                    if j in self.copies and not (j == 0 and sink):   # block 0 with a copy: codes + copy
                        old[:, j - first] = self.copies[j][kind][idx].to(dtype)
                if sink:  # its first rows from the 8-bit copy, as the engine reads them
                    codes = self.sink["sink_" + kind][idx]
                    scale = self.sink["sink_" + _SCALE[kind]][idx]
                    old[:, 0, :self.sink_n] = SINK_FORMAT.dequantize(codes, scale, dtype, kind=kind)
                parts.append(old.flatten(1, 2))
            parts.append(fresh[kind].to(dtype))
            out.append(torch.cat(parts, dim=1))                                         # [G, kept, Hkv, D]
        return out[0], out[1]

    def _slide(self) -> None:
        """Free the blocks no row's next query can see (sliding-window layers), counted in each row's own stream."""
        if self.sliding_window is None or self.table is None or not self.pads:
            return
        oldest = min(max(0, self._local(b) - self.sliding_window + 1) for b in range(len(self.pads)))
        self.table.drop_before(oldest // self.spec.block_size)
        if self.table.first > 0:
            self.sink_held = [False] * len(self.sink_held)   # block 0 slid out of every window

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
        cut = 0
        for pad, idx in self._groups():
            j, rest = divmod(max(0, keep - pad), bs)
            sealed = self._local(0 if isinstance(idx, slice) else int(idx[0])) // bs
            if rest and j < sealed:  # block j was sealed: reopen it from its 16-bit copy
                rows = self.copies.get(j)
                if rows is None:
                    raise RuntimeError(
                        f"layer {self.layer_index}: crop to {keep} tokens reopens block {j}, sealed to "
                        f"{self.spec.kv_format} without a full-precision copy; call cache.activate_past_recording() "
                        f"before the steps you may roll back"
                    )
                for kind in _KINDS:
                    self.open_rows[kind][idx, :rest] = rows[kind][idx, :rest]
            cut = max(cut, j)
            if keep - pad < bs:
                for b in range(len(self.pads))[idx] if isinstance(idx, slice) else idx.tolist():
                    self.sink_held[b] = False
        super()._truncate(keep)
        self.copies = {b: c for b, c in self.copies.items() if b < cut}   # blocks from there on are no longer sealed

    def _reorder(self, index: Sequence[int]) -> None:
        super()._reorder(index)
        idx = torch.tensor(list(index), dtype=torch.long, device=self.device)
        self.open_rows = {k: t.index_select(0, idx) for k, t in self.open_rows.items()}
        self.sink = {k: t.index_select(0, idx) for k, t in self.sink.items()}
        self.sink_held = [self.sink_held[i] for i in index]
        self.copies = {b: {k: t.index_select(0, idx) for k, t in rows.items()} for b, rows in self.copies.items()}

    def reset(self) -> None:
        """As :meth:`KVPageLayer.reset`; the 16-bit copies and the sink are dropped too."""
        super().reset()
        self.copies = {}
        self.sink_held = []

    # -- accounting ----------------------------------------------------------------------------
    def kv_bytes(self) -> int:
        """Bytes this layer holds for its tokens, counted as kvpage's engine counts them
        (:meth:`SealedFormat.effective_bits_per_value <kvpage.formats.SealedFormat.effective_bits_per_value>`; but
        the window copies are 16-bit here, see the module docstring):
        pool blocks in use (the open block's reserved one included; shared blocks once), the 16-bit rows of
        each row's open block when it holds any, the 16-bit copies (the window's, plus while recording those
        kept for a rollback) and the 8-bit first-block copies."""
        if self.table is None:
            return 0
        bs, h, d = self.spec.block_size, self.spec.kv_heads, self.spec.head_dim
        fp_block = 2 * bs * h * d * self.tail_dtype.itemsize           # one block's K and V rows, per batch row
        total = self.table.blocks_in_use() * self.spec.bytes_per_block
        total += fp_block * sum(1 for b in range(len(self.pads)) if self._local(b) % bs)
        total += sum(t.numel() * t.element_size() for c in self.copies.values() for t in c.values())
        total += sum(self.sink_held) * sum(t[0].numel() * t.element_size() for t in self.sink.values())
        return total

    def code_tokens(self) -> int:
        """Token slots of the sealed blocks (distinct ones): the tokens whose 4-/2-bit codes the pool holds. The
        open block's tokens are in 16 bits, its reserved pool block is side cost until it seals."""
        if self.table is None:
            return 0
        bs, first = self.spec.block_size, self.table.first
        sealed: set[int] = set()
        for b, blocks in enumerate(self.table.rows):
            sealed.update(blocks[: max(0, self._local(b) // bs - first)])
        return len(sealed) * bs

    def allocated_bytes(self) -> int:
        """Bytes of every tensor the layer has allocated: pool, open block, 16-bit copies and sink."""
        side = [*self.open_rows.values(), *self.sink.values()]
        side += [t for r in self.copies.values() for t in r.values()]
        return super().allocated_bytes() + sum(t.numel() * t.element_size() for t in side)
