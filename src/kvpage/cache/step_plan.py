"""The KV step plan: everything the worker does to the cache in one step, decided on the scheduler side.

Plain data (ints, tuples, bytes; no tensor, no reference to a manager), so a plan pickles and a worker in
another process or on another device executes it without consulting any bookkeeping::

    KVStepPlan                          made by KVCache.step_plan() at the end of scheduling
     ├─ connector: ConnectorMetadata     tier transfers, in issue order (a save before the load that follows it)
     ├─ copies / window_copies           copy-on-write of forked blocks (after the transfers, before any pass)
     └─ passes: (PassPlan, ...)          one per forward pass (KVCache.plan_pass), each with, per layer group:
          └─ GroupPlan                     rows (window slots) when not block ids, and the seal operations

The worker runs the transfers, then the copies, then each pass; after a pass the scheduler side commits or
aborts it (:meth:`~kvpage.cache.kv_cache.KVCache.commit`). Torch-free; imports nothing from kvpage.
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ConnectorMetadata", "GroupPlan", "KVStepPlan", "PassPlan", "PassRequest", "SealOps", "SealRead",
           "TransferOp", "TransferReport"]


@dataclass(frozen=True, slots=True)
class PassRequest:
    """One request's share of a forward pass, as the cache sees it (no token ids).

    A request's token regions in the pass::

        [0, num_computed)                        in the cache before the pass
        [num_computed, num_computed + num_new)   written by the pass (its queries)
        [seq_len - num_draft, seq_len)           of those (or before, in a drafter's later passes), unverified drafts

    Attributes:
        request_id: who owns the full-precision window copies the pass makes (``None``: anonymous).
        num_computed: tokens already in the cache (the pass's first position).
        num_new: tokens the pass runs for it (>= 1).
        block_ids: its block table, covering ``num_computed + num_new`` tokens.
        prompt_len: its prompt length (prompt-only blocks of quantize-on-seal groups get no window copy).
        num_draft: unverified positions at the end of its context after the pass (speculative decoding).
    """

    request_id: str | None
    num_computed: int
    num_new: int
    block_ids: tuple[int, ...]
    prompt_len: int = 0
    num_draft: int = 0

    @property
    def seq_len(self) -> int:
        """Tokens of its context after the pass."""
        return self.num_computed + self.num_new


@dataclass(frozen=True, slots=True)
class SealRead:
    """Where one request's context is read from in a quantize-on-seal group after the pass's writes (see
    :class:`~kvpage.ops.seal_plan.RequestRead`, the same fields as index tensors on the worker)."""

    full_ids: tuple[int, ...]
    fp_blocks: tuple[tuple[int, int], ...]
    sink_slot: int | None
    open_slot: int | None
    open_len: int
    sealed_now: tuple[tuple[int, int, int | None], ...] = ()
    window_blocks: int = 0
    copy_blocks: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class SealOps:
    """One pass's seals, tail writes and reads in a quantize-on-seal group (the fields of
    :class:`~kvpage.ops.seal_plan.SealPlan`, as tuples of ints: rows of the pass's new tokens, flat tail rows
    ``slot * block_size + offset``, pool rows (block ids or window slots) of the sealed blocks)."""

    tail_dst: tuple[int, ...]
    tail_src: tuple[int, ...]
    seal_ids: tuple[int, ...]
    seal_from_new_dst: tuple[int, ...]
    seal_from_new_src: tuple[int, ...]
    seal_from_tail_dst: tuple[int, ...]
    seal_from_tail_src: tuple[int, ...]
    sink_pos: tuple[int, ...]
    sink_slots: tuple[int, ...]
    reads: tuple[SealRead, ...]


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """One layer group's part of a pass.

    Attributes:
        group: the layer group's name.
        block_tables: per request, the rows of its tensors each block lives in, when they are not the block ids
            (a bounded sliding-window group's window slots; a block before the window reads row 0, which its mask
            never lets a query see); ``None``: the pass's block tables.
        slot_mapping: the rows new tokens are written to, likewise (``None``: the pass's).
        seals: the seal operations of a quantize-on-seal group, else ``None``.
    """

    group: str
    block_tables: tuple[tuple[int, ...], ...] | None = None
    slot_mapping: tuple[int, ...] | None = None
    seals: SealOps | None = None


@dataclass(frozen=True, slots=True)
class PassPlan:
    """One forward pass: its requests and, per layer group it runs, what the group's layers write and read.

    Attributes:
        plan_id: unique per cache, increasing (commit and abort name it).
        block_size: tokens per block.
        requests: the pass's requests, in batch order.
        groups: one :class:`GroupPlan` per layer group the pass runs, in spec order.
        final: the step's last pass over these groups (a drafter's earlier passes are not; see
            :meth:`~kvpage.cache.kv_cache.KVCache.plan_pass`).
    """

    plan_id: int
    block_size: int
    requests: tuple[PassRequest, ...]
    groups: tuple[GroupPlan, ...]
    final: bool = True

    @property
    def seq_lens(self) -> tuple[int, ...]:
        """Context length of each request after the pass."""
        return tuple(r.seq_len for r in self.requests)

    @property
    def query_lens(self) -> tuple[int, ...]:
        """New tokens of each request."""
        return tuple(r.num_new for r in self.requests)

    @property
    def block_tables(self) -> tuple[tuple[int, ...], ...]:
        """Each request's block ids."""
        return tuple(r.block_ids for r in self.requests)

    @property
    def slot_mapping(self) -> tuple[int, ...]:
        """Flat slot (``block_id * block_size + offset``) of every new token, in batch order."""
        bs = self.block_size
        return tuple(r.block_ids[p // bs] * bs + p % bs for r in self.requests
                     for p in range(r.num_computed, r.seq_len))

    def group(self, name: str) -> GroupPlan:
        """The plan of group ``name`` (``KeyError`` when the pass does not run it)."""
        for g in self.groups:
            if g.group == name:
                return g
        raise KeyError(f"pass {self.plan_id} does not run layer group {name!r} (it runs "
                       f"{[g.group for g in self.groups]})")


@dataclass(frozen=True, slots=True)
class TransferOp:
    """One block transfer the worker half of the tier connector performs (vLLM's ``TransferSpec`` as data).

    Attributes:
        op_id: unique, increasing; the worker reports it when the transfer is done.
        kind: ``device_to_host``, ``host_to_device``, ``device_to_store`` or ``store_to_device``.
        device_ids: device block ids (sources of a save, destinations of a load).
        host_ids: host block ids (same length) for host transfers.
        window_rows: per device block, its window slot in the bounded sliding-window layers (``None``: none held,
            those layers are skipped for it); ``None`` for a model without such layers.
        block_hashes: per block, its chained hash (store transfers).
        store: the store a ``store_to_device`` load reads (index in the connector's store list).
        targets: per block of a ``device_to_store`` save, the stores it is written to.
    """

    op_id: int
    kind: str
    device_ids: tuple[int, ...] = ()
    host_ids: tuple[int, ...] = ()
    window_rows: tuple[int | None, ...] | None = None
    block_hashes: tuple[bytes, ...] = ()
    store: int = -1
    targets: tuple[tuple[int, ...], ...] = ()

    @property
    def is_load(self) -> bool:
        """Whether it writes device blocks (a load)."""
        return self.kind in ("host_to_device", "store_to_device")


@dataclass(frozen=True, slots=True)
class ConnectorMetadata:
    """The tier work of a step for the connector's worker half (vLLM's ``KVConnectorMetadata``).

    Attributes:
        ops: transfers to issue, in issue order (the worker keeps it: a save that reads a device block runs before
            a later load that writes it).
        cancelled: earlier loads abandoned at their deadline (case C10): the worker drops them if they have not run.
    """

    ops: tuple[TransferOp, ...] = ()
    cancelled: tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.ops or self.cancelled)


@dataclass(frozen=True, slots=True)
class TransferReport:
    """What the worker half finished since its last report (:meth:`~kvpage.cache.tiers.connector.KVConnectorWorker.get_finished`).

    Attributes:
        done: op ids whose transfer finished (or failed), in issue order.
        written: op id -> the leading blocks it wrote, for ops that wrote fewer than they named (a store record
            missing or rejected at read time cuts a load there; a transfer that raised wrote none); an op not named
            here wrote all its blocks.
        unsaved: op id -> ``(block index in the op, store index)`` of each record a ``device_to_store`` save
            named but its store did not take (:meth:`~kvpage.cache.tiers.stores.KVStore.put` returned ``False``:
            an outage, a refused write, a size cap); an op not named here saved every record it named.
    """

    done: tuple[int, ...] = ()
    written: dict[int, int] = field(default_factory=dict)
    unsaved: dict[int, tuple[tuple[int, int], ...]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class KVStepPlan:
    """Everything the worker does to the cache in one step (see the module docstring for the order).

    Attributes:
        step: the scheduling pass it came from (increasing).
        connector: the tier transfers.
        copies: copy-on-write ``(source, destination)`` block ids: every tensor of every layer with block-id rows.
        window_copies: the same copies in the bounded sliding-window layers' window slots (pairs whose both blocks
            hold one).
        passes: the forward passes, filled in as they are planned.
    """

    step: int
    connector: ConnectorMetadata = ConnectorMetadata()
    copies: tuple[tuple[int, int], ...] = ()
    window_copies: tuple[tuple[int, int], ...] = ()
    passes: tuple[PassPlan, ...] = ()
