"""Layer group kinds: which kind of cache a layer group keeps, and the memory arithmetic that kind implies.

:meth:`~kvpage.spec.CacheSpec.build` gives every layer group one kind (:func:`kind_of`), as vLLM gives every
layer a ``KVCacheSpec`` subclass. The kind answers what the rest of kvpage would otherwise ask by testing a
format class or a window flag: how many rows its tensors have for ``N`` blocks, what side pools it keeps beside
them and their bytes, whether its tail is carved from the block pool, whether it may swap, copy a partial block or
compute on after a tier load cut short. Managers (:mod:`kvpage.cache.groups`), attention on the worker, the tiers
and capacity all derive from these answers.

=====================  ===============================  =========================================================
kind                   when                              rows of its tensors / side pools
=====================  ===============================  =========================================================
:class:`FullAttention` token-wise format, no bounded      one per block id; none
                       window (also draft/MTP layers)
:class:`SlidingWindow` token-wise, sliding window          window slots (a pool sized by the window); none
:class:`Sealed`        block-wise (quantize-on-seal)      one per block id; 16-bit tail, window and first-block
                                                          copies (carved from the block pool when the layout allows)
:class:`SealedWindow`  block-wise, sliding window          window slots for the codes; a fixed tail pool
=====================  ===============================  =========================================================

A latent (MLA) layer is a key-only :class:`~kvpage.spec.LayerSpec` (``has_value=False``) of any of these kinds:
nothing beside the missing value tensor differs. Imports :mod:`kvpage.formats` and the spec's layer types only.
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar, TypeVar

import torch

from kvpage.formats import KEY, VALUE, BlockFormat, KVFormat

if TYPE_CHECKING:
    from kvpage.spec.cache_spec import LayerGroupSpec
    from kvpage.spec.layer import LayerSpec

__all__ = ["CacheSizing", "FullAttention", "GroupKind", "GroupMemory", "Sealed", "SealedWindow", "SlidingWindow",
           "TailLayout", "blocks_per_slot", "for_kind", "kind_of", "sink_rows", "sinks_per_group", "tail_dtype"]


def tail_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """16-bit dtype of tail slots: the model dtype when it is 16-bit, else float16 (KIVI keeps fp16)."""
    return model_dtype if model_dtype in (torch.float16, torch.bfloat16) else torch.float16


@dataclass(frozen=True)
class CacheSizing:
    """The engine settings a cache's size depends on beyond its layout (side pools and window slots).

    Attributes:
        max_num_seqs: requests running at once (sizes fixed tail pools: per request one open slot, the window's
            copies and the lookahead's provisional blocks, two first-block slots).
        max_num_batched_tokens: tokens per forward pass (a step's new blocks need window slots).
        max_model_len: longest request in tokens (a carving pool must hold one beside its side space); ``None``:
            no such request is counted.
        residual_tokens: full-precision window of block-wise formats (``kv_quant_residual_tokens``), in tokens.
        num_lookahead_tokens: draft tokens a speculating request verifies per step (``num_speculative_tokens``).
        model_dtype: the compute dtype (decides :func:`tail_dtype`).
        group_residual_tokens: ``(group name, tokens)`` pairs overriding ``residual_tokens`` for those groups
            (per-layer precision: each ``main@<format>`` group keeps its own format's default window).

    Raises:
        ValueError: ``max_num_seqs`` or ``max_num_batched_tokens`` below 1, a negative count.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    residual_tokens: int = 0
    num_lookahead_tokens: int = 0
    model_dtype: torch.dtype = torch.float32
    group_residual_tokens: tuple[tuple[str, int], ...] = ()

    def residual_for(self, group: str) -> int:
        """The full-precision window in tokens of the group called ``group`` (its override, else
        ``residual_tokens``). No side effects."""
        return dict(self.group_residual_tokens).get(group, self.residual_tokens)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError(f"need max_num_seqs >= 1 and max_num_batched_tokens >= 1, got {self.max_num_seqs}, "
                             f"{self.max_num_batched_tokens}")
        if self.residual_tokens < 0 or self.num_lookahead_tokens < 0:
            raise ValueError(f"need residual_tokens >= 0 and num_lookahead_tokens >= 0, got {self.residual_tokens}, "
                             f"{self.num_lookahead_tokens}")


@dataclass(frozen=True)
class TailLayout:
    """Sizes of a quantize-on-seal group's tail (:mod:`kvpage.cache.tail`).

    Attributes:
        num_slots: 16-bit slots (open blocks + window copies at 16 bits + provisional blocks).
        num_sink_slots: 8-bit slots: first-block copies (0: none) and, at ``window_bits`` 8, window copies.
        window_blocks: sealed blocks per request that keep a window copy (``ceil(residual_tokens / bs)``).
        blocks_per_slot: ``r > 0`` when the slots are carved from the block pool on demand (``r`` pool blocks
            hold one slot, :func:`blocks_per_slot`; ``num_slots`` is then the pool's ``num_blocks // r`` and nothing
            is reserved); 0 for fixed pools of these sizes.
        window_bits: precision of the window copies (:meth:`~kvpage.formats.BlockFormat.window_copy_bits`): 16, the
            block's 16-bit slot kept; 8, an ``int8`` copy in an 8-bit slot.
    """

    num_slots: int
    num_sink_slots: int
    window_blocks: int
    blocks_per_slot: int = 0
    window_bits: int = 16

    @property
    def carved(self) -> bool:
        """Whether the slots are carved from the block pool (:attr:`blocks_per_slot` > 0)."""
        return self.blocks_per_slot > 0


@dataclass(frozen=True)
class GroupMemory:
    """What one layer group allocates over a pool of ``N`` blocks.

    Attributes:
        rows: rows of each of its layers' tensors (``N``, or its window slots).
        row_bytes: bytes of one row across the group's layers (scales included).
        tail_open_bytes: fixed 16-bit tail slots beside the tensors (open blocks and provisional ones).
        tail_window_bytes: fixed window copies (16-bit slots, or 8-bit ones at ``window_bits`` 8).
        sink_bytes: first-block copies beside the tensors (fixed pools: codes and scales; carved: scales only).
        tail: the tail's sizes (``None`` for token-wise kinds).
    """

    rows: int
    row_bytes: int
    tail_open_bytes: int = 0
    tail_window_bytes: int = 0
    sink_bytes: int = 0
    tail: TailLayout | None = None

    @property
    def tensor_bytes(self) -> int:
        """Bytes of the group's cache tensors (``rows x row_bytes``)."""
        return self.rows * self.row_bytes

    @property
    def side_bytes(self) -> int:
        """Bytes of its side pools (tail slots, window and first-block copies)."""
        return self.tail_open_bytes + self.tail_window_bytes + self.sink_bytes

    @property
    def total_bytes(self) -> int:
        """Everything the group allocates."""
        return self.tensor_bytes + self.side_bytes


def blocks_per_slot(layer: LayerSpec) -> int | None:
    """Pool blocks whose key codes hold one 16-bit tail slot of ``layer`` exactly, or ``None`` when none do.

    ``r = 2 * head_dim / P`` for a block-wise format whose key (and value) codes are ``uint8 [block_size,
    kv_heads, P]`` (int4: 4, int2: 8); ``None`` when ``P`` does not divide ``2 * head_dim`` (int3: ``P = 24`` at
    head_dim 64) or the layout differs (the tail then keeps its own tensors). No side effects.
    """
    if not isinstance(layer.format, BlockFormat):
        return None
    specs = layer.tensor_by_name
    bs, kv, d = layer.block_size, layer.kv_heads, layer.head_dim
    for name in (KEY, VALUE) if layer.has_value else (KEY,):
        t = specs.get(name)
        if t is None or t.dtype.itemsize != 1 or len(t.shape) != 3 or tuple(t.shape[:2]) != (bs, kv):
            return None
    p = int(specs[KEY].shape[2])
    if (VALUE in specs and layer.has_value and int(specs[VALUE].shape[2]) != p) or (2 * d) % p:
        return None
    return 2 * d // p


def sink_rows(fmt: KVFormat, block_size: int) -> int:
    """Rows of a request's first block that the 8-bit first-block copy of ``fmt`` at ``block_size`` holds
    (:meth:`~kvpage.formats.BlockFormat.copied_rows`), 0 when the format keeps no copy. No side effects."""
    return fmt.copied_rows(block_size) if isinstance(fmt, BlockFormat) else 0


def sinks_per_group(layer: LayerSpec) -> int:
    """First-block copies one carved group holds: its 16-bit slot's code bytes (``2 * block_size`` int8 rows per
    kv head) over a copy's :func:`sink_rows` int8 rows; 0 when the format keeps no copy. No side effects."""
    n = sink_rows(layer.format, layer.block_size)
    return 2 * layer.block_size // n if n else 0


class GroupKind:
    """One kind of layer group: its memory arithmetic and the static answers every other layer asks of it.

    Kinds are stateless singletons (one instance per class, :func:`kind_of`); the defaults are full attention's.

    Attributes:
        name: the kind's name (``full_attention``, ``sliding_window``, ``sealed``, ``sealed_window``).
        window_rows: the group's tensors are indexed by window slot, not by block id (bounded sliding window).
        seals: the format quantizes whole blocks when they fill and keeps a 16-bit tail meanwhile.
        supports_swap: a preempted request's blocks of this group may be swapped to the host tier and back.
        copies_partial_blocks: a fork may share a partial block, copied on write.
        loads_may_stop_short: after a tier load cut short at read time, computing on from where it stopped is
            correct (a bounded window's blocks inside the window of an earlier end got no rows).
        slots_per_copy: window slots one copy-on-write takes (its new block's).
        may_carve: the tail (if any) may be carved out of the block pool (:meth:`carve_ratio`).
    """

    name: ClassVar[str] = "full_attention"
    window_rows: ClassVar[bool] = False
    seals: ClassVar[bool] = False
    supports_swap: ClassVar[bool] = True
    copies_partial_blocks: ClassVar[bool] = True
    loads_may_stop_short: ClassVar[bool] = True
    slots_per_copy: ClassVar[int] = 0
    may_carve: ClassVar[bool] = False

    def carve_ratio(self, group: LayerGroupSpec, sizing: CacheSizing, num_blocks: int | None) -> int | None:
        """Pool blocks per tail slot when a pool of ``num_blocks`` blocks carves the group's tail, else ``None``."""
        return None

    def window_slots(self, group: LayerGroupSpec, num_blocks: int, sizing: CacheSizing) -> int:
        """Window slots of the group over a pool of ``num_blocks`` blocks (0 unless :attr:`window_rows`)."""
        return 0

    def tail(self, group: LayerGroupSpec, sizing: CacheSizing, num_blocks: int | None = None) -> TailLayout | None:
        """The group's tail over a pool of ``num_blocks`` blocks (``None``: fixed pools whatever the pool), or
        ``None`` for a kind without one."""
        return None

    def memory(self, group: LayerGroupSpec, num_blocks: int, sizing: CacheSizing,
               num_window_slots: int | None = None, *, carve: bool | None = None) -> GroupMemory:
        """What the group allocates over ``num_blocks`` blocks (``num_window_slots``: the window slots when the
        caller fixed them, default :meth:`window_slots`; ``carve``: a quantize-on-seal kind's tail carved from the
        pool or not whatever the pool's size, ``None``: as :meth:`tail` decides)."""
        return GroupMemory(rows=self.rows(group, num_blocks, sizing, num_window_slots), row_bytes=group.bytes_per_block)

    def rows(self, group: LayerGroupSpec, num_blocks: int, sizing: CacheSizing,
             num_window_slots: int | None = None) -> int:
        """Rows of each of the group's layer tensors over ``num_blocks`` blocks."""
        if not self.window_rows:
            return num_blocks
        return self.window_slots(group, num_blocks, sizing) if num_window_slots is None else num_window_slots

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class FullAttention(GroupKind):
    """Token-wise format, rows by block id: every token stays in its block (vLLM's ``FullAttentionSpec``). Draft/MTP
    layers are of this kind whatever their window: they keep theirs by block id."""


def _window_slots(group: LayerGroupSpec, num_blocks: int, sizing: CacheSizing) -> int:
    """Window slots of a bounded group over a pool of ``num_blocks`` blocks (what builder and capacity allocate).

    A running request pins ``w = ceil((W - 1) / bs) + 1`` blocks of its window, ``ceil(k / bs)`` more for ``k``
    lookahead tokens; a step's chunks add ``ceil(max_num_batched_tokens / bs)`` new blocks. The pool gets the
    windows of as many requests as the block pool holds requests of ``max_model_len`` tokens (at least one, at
    most ``max_num_seqs``) plus one step's chunks, and never more slots than blocks.
    """
    bs = group.layer.block_size
    assert group.sliding_window is not None
    per_request = -(-(group.sliding_window - 1) // bs) + 1 + -(-sizing.num_lookahead_tokens // bs)
    request_blocks = max(1, -(-(sizing.max_model_len or bs) // bs))
    requests = min(sizing.max_num_seqs, max(1, -(-num_blocks // request_blocks)))
    step = -(-sizing.max_num_batched_tokens // bs) + min(sizing.max_num_seqs, requests + 1)
    return max(1, min(num_blocks, requests * per_request + step))


def window_pins(group: LayerGroupSpec) -> int:
    """Window slots one running request pins: ``ceil((W - 1) / bs) + 1`` (no lookahead)."""
    assert group.sliding_window is not None
    return -(-(group.sliding_window - 1) // group.layer.block_size) + 1


class SlidingWindow(GroupKind):
    """Token-wise format with a sliding window, rows by *window slot*: memory bounded by the window, not the context
    (:class:`~kvpage.cache.groups.SlidingWindowManager`; vLLM's ``SlidingWindowSpec``)."""

    name = "sliding_window"
    window_rows = True
    loads_may_stop_short = False
    slots_per_copy = 1

    def window_slots(self, group: LayerGroupSpec, num_blocks: int, sizing: CacheSizing) -> int:
        """See :func:`_window_slots`."""
        return _window_slots(group, num_blocks, sizing)


class Sealed(GroupKind):
    """Block-wise (quantize-on-seal) format, rows by block id, with a 16-bit tail (open blocks, the window's copies,
    first-block copies) carved out of the block pool on demand where the layout allows (:mod:`kvpage.cache.tail`).

    Its tail, window and first-block copies do not travel to the host tier (no swap), and a fork shares whole blocks
    only (a partial block's rows live in its tail slot).
    """

    name = "sealed"
    seals = True
    supports_swap = False
    copies_partial_blocks = False
    may_carve = True

    def _fixed(self, group: LayerGroupSpec, sizing: CacheSizing) -> tuple[int, int, bool]:
        """``(window blocks, provisional blocks, first-block copies)`` per request."""
        bs = group.layer.block_size
        residual = sizing.residual_for(group.name)
        if group.sliding_window is not None:  # copies past the sliding window are never read
            residual = min(residual, group.sliding_window)
        fmt = group.layer.format
        assert isinstance(fmt, BlockFormat)  # (kind_of gives this kind to block-wise formats only)
        return -(-residual // bs), -(-sizing.num_lookahead_tokens // bs), bool(fmt.sink_bits)

    def carve_ratio(self, group: LayerGroupSpec, sizing: CacheSizing, num_blocks: int | None) -> int | None:
        """``r`` when a pool of ``num_blocks`` blocks (``None``: one as large as needed) carves the group's tail,
        else ``None``: the layout must allow it (:func:`blocks_per_slot`) and the pool must hold one request of
        ``max_model_len`` tokens beside its peak side space (open slot, window, provisional blocks, the block it
        seals, its first-block copy: ``window + provisional + 3`` slots) and one group of slack for alignment, so a
        lone request always fits; smaller pools keep fixed side pools."""
        r = blocks_per_slot(group.layer) if self.may_carve else None
        if r is None:
            return None
        if num_blocks is None:
            return r
        window, provisional, _ = self._fixed(group, sizing)
        request = -(-(sizing.max_model_len or 0) // group.layer.block_size)
        return r if num_blocks >= request + (window + provisional + 4) * r else None

    def tail(self, group: LayerGroupSpec, sizing: CacheSizing, num_blocks: int | None = None) -> TailLayout:
        """Carved over a pool of ``num_blocks`` blocks when :meth:`carve_ratio` allows (all its groups' slots,
        :func:`sinks_per_group` first-block slots per group), else fixed pools for ``max_num_seqs`` requests."""
        r = None if num_blocks is None else self.carve_ratio(group, sizing, num_blocks)
        return self._layout(group, sizing, None if r is None or num_blocks is None else (r, num_blocks))

    def _layout(self, group: LayerGroupSpec, sizing: CacheSizing, carved: tuple[int, int] | None) -> TailLayout:
        """The tail carved as ``(r, num_blocks)``, or fixed pools (``None``)."""
        window, provisional, sink = self._fixed(group, sizing)
        bits = self.window_bits(group)
        if carved is not None:
            r, num_blocks = carved
            groups = num_blocks // r
            return TailLayout(groups, sinks_per_group(group.layer) * groups * sink, window, r, bits)
        n = sizing.max_num_seqs
        if bits == 8 and window:  # 16-bit: open blocks, the block sealed now, provisional ones; 8-bit window copies
            return TailLayout(n * (2 + provisional), 2 * n * sink + self._window_copies(window, provisional, n),
                              window, 0, 8)
        return TailLayout(n * (1 + window + provisional), 2 * n * sink, window)

    @staticmethod
    def window_bits(group: LayerGroupSpec) -> int:
        """Precision of the group's window copies (:meth:`~kvpage.formats.BlockFormat.window_copy_bits`)."""
        fmt = group.layer.format
        return fmt.window_copy_bits(group.layer.block_size) if isinstance(fmt, BlockFormat) else 16

    @staticmethod
    def _window_copies(window: int, provisional: int, num_seqs: int) -> int:
        """Fixed 8-bit window-copy slots: per request its window, the copy made at a block end (the window's oldest
        goes after that step) and one per provisional block."""
        return num_seqs * (window + 1 + provisional)

    def memory(self, group: LayerGroupSpec, num_blocks: int, sizing: CacheSizing,
               num_window_slots: int | None = None, *, carve: bool | None = None) -> GroupMemory:
        """The tensors' rows plus the tail: fixed pools' bytes, or over carved slots only the first-block copies'
        scales (their rows are pool blocks). ``carve=True`` carves whenever the layout allows (the pool's size aside),
        ``False`` never."""
        rows = self.rows(group, num_blocks, sizing, num_window_slots)
        if carve is None:
            t = self.tail(group, sizing, num_blocks)
        else:
            r = self.carve_ratio(group, sizing, None) if carve else None
            t = self._layout(group, sizing, None if r is None else (r, num_blocks))
        if t.carved:
            return GroupMemory(rows, group.bytes_per_block, sink_bytes=self.sink_scale_bytes(group, t.num_sink_slots),
                               tail=t)
        fp_slot = self.tail_slot_bytes(group, sizing)
        if t.window_bits == 8:
            _, provisional, _ = self._fixed(group, sizing)
            copies = self._window_copies(t.window_blocks, provisional, sizing.max_num_seqs)
            return GroupMemory(rows, group.bytes_per_block, tail_open_bytes=t.num_slots * fp_slot,
                               tail_window_bytes=copies * self.sink_slot_bytes(group),
                               sink_bytes=(t.num_sink_slots - copies) * self.sink_slot_bytes(group), tail=t)
        window = sizing.max_num_seqs * t.window_blocks * fp_slot
        return GroupMemory(rows, group.bytes_per_block, tail_open_bytes=t.num_slots * fp_slot - window,
                           tail_window_bytes=window, sink_bytes=t.num_sink_slots * self.sink_slot_bytes(group), tail=t)

    @staticmethod
    def tail_slot_bytes(group: LayerGroupSpec, sizing: CacheSizing) -> int:
        """Bytes of one 16-bit tail slot across the group's layers (K and V rows of one block in :func:`tail_dtype`)."""
        ls = group.layer
        item = tail_dtype(sizing.model_dtype).itemsize
        return group.num_layers * (2 if ls.has_value else 1) * ls.block_size * ls.kv_heads * ls.head_dim * item

    @staticmethod
    def sink_slot_bytes(group: LayerGroupSpec) -> int:
        """Bytes of one 8-bit first-block slot across the group's layers (int8 codes + a float16 scale per token and
        head, K and V, for :func:`sink_rows` rows)."""
        ls = group.layer
        rows = sink_rows(ls.format, ls.block_size)
        return group.num_layers * (2 if ls.has_value else 1) * rows * ls.kv_heads * (ls.head_dim + 2)

    @staticmethod
    def sink_scale_bytes(group: LayerGroupSpec, num_sink_slots: int) -> int:
        """Bytes of the first-block copies' scales alone (all a carved tail allocates beside the pool)."""
        ls = group.layer
        rows = num_sink_slots * sink_rows(ls.format, ls.block_size)
        return group.num_layers * (2 if ls.has_value else 1) * rows * ls.kv_heads * 2


class SealedWindow(Sealed):
    """Block-wise format with a sliding window: the sealed codes live in window slots (memory bounded by the
    window), the 16-bit tail, window and first-block copies stay keyed by block id in a fixed tail pool (never
    carved: the group's tensors have no block-id rows)."""

    name = "sealed_window"
    window_rows = True
    loads_may_stop_short = False
    slots_per_copy = 1
    may_carve = False

    def window_slots(self, group: LayerGroupSpec, num_blocks: int, sizing: CacheSizing) -> int:
        """See :func:`_window_slots`."""
        return _window_slots(group, num_blocks, sizing)


FULL_ATTENTION = FullAttention()
SLIDING_WINDOW = SlidingWindow()
SEALED = Sealed()
SEALED_WINDOW = SealedWindow()


_T = TypeVar("_T")


def for_kind(registry: Mapping[type[GroupKind], _T], group: LayerGroupSpec, what: str) -> _T:
    """The entry of a per-kind ``registry`` (the scheduler side's managers, the worker side's attention) for
    ``group``'s kind; ``what`` names the registry in the error.

    Raises:
        KeyError: the kind has no entry (the message names the group, its kind and the registry).
    """
    try:
        return registry[type(group.kind)]
    except KeyError:
        raise KeyError(f"no entry for kind {group.kind!r} of group {group.name!r} in {what}; register one there") \
            from None


def kind_of(role: str, layer: LayerSpec, sliding_window: int | None) -> GroupKind:
    """The kind of a layer group: its ``role`` (``main``, ``sliding``, ``draft``), its layers' format and window.

    A model group with a sliding window keeps its KV in window slots (the ``sliding`` group beside full-attention
    layers, or the ``main`` group of an all-windowed model such as Mistral); draft layers keep theirs by block id.
    """
    bounded = role != "draft" and sliding_window is not None
    if isinstance(layer.format, BlockFormat):
        return SEALED_WINDOW if bounded else SEALED
    return SLIDING_WINDOW if bounded else FULL_ATTENTION

