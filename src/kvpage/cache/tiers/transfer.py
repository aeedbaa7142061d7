"""Block transfers on the scheduler side: each issued :class:`~kvpage.cache.step_plan.TransferOp` and its completion.

A copy between the device, the host tier and a store is asynchronous in a real serving engine (CUDA copy
streams, network I/O, another process): the scheduler side *issues* it as data (the op goes out in the next step
plan's :class:`~kvpage.cache.step_plan.ConnectorMetadata`), the connector's worker half performs it, and only
when the worker reports it done (:class:`~kvpage.cache.step_plan.TransferReport`) is it *acknowledged*, and may
the blocks it touches change hands. So the rules that depend on it are real whatever the worker's speed:

* a host block that is the target of a device->host copy is never reused until that copy is acknowledged
  (case C09; SGLang issue 28468, where an eviction recycled host pages a backup was still writing);
* device blocks being loaded for a request that is aborted go back to the pool only once the load completes
  or a deadline passes; a completion that arrives after the deadline is ignored without an error (case C10;
  vLLM issues 32255 and 46283), and the worker is told to drop the load if it has not run it.

Tensor-free: a transfer holds its op (plain data) and the callbacks of its acknowledgement.
"""
from __future__ import annotations

import enum
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvpage.cache.step_plan import ConnectorMetadata, TransferOp, TransferReport


class TransferState(enum.Enum):
    """Where a :class:`Transfer` is in its life."""

    PENDING = "pending"  # issued; the worker has not reported it done
    ACKNOWLEDGED = "acknowledged"  # reported done and processed (blocks may change hands)
    CANCELLED = "cancelled"  # abandoned (deadline passed); a later report is ignored


@dataclass(eq=False)
class Transfer:
    """One issued block transfer (vLLM's ``TransferSpec`` + job id; SGLang's ``CacheOperation``).

    Attributes:
        op: what the worker does (kind, block ids, window rows, hashes).
        nbytes: payload bytes moved (blocks x bytes per block).
        state: :class:`TransferState`.
        num_done: leading blocks the worker wrote (fewer than the op names when a store record was missing at read
            time or the transfer failed; set on acknowledgement).
        unsaved: of a ``device_to_store`` save, the ``(block index, store index)`` records the stores did not take
            (set on acknowledgement; see :class:`~kvpage.cache.step_plan.TransferReport`).
    """

    op: TransferOp
    nbytes: int
    _on_ack: list[Callable[[Transfer], None]] = field(default_factory=list, repr=False)
    state: TransferState = TransferState.PENDING
    num_done: int = 0
    unsaved: frozenset[tuple[int, int]] = frozenset()

    @property
    def transfer_id(self) -> int:
        """The op's id."""
        return self.op.op_id

    @property
    def kind(self) -> str:
        """The op's kind."""
        return self.op.kind

    @property
    def acknowledged(self) -> bool:
        """Whether the worker reported it done and the completion was processed."""
        return self.state is TransferState.ACKNOWLEDGED

    @property
    def cancelled(self) -> bool:
        """Whether the transfer was abandoned (its completion will be ignored)."""
        return self.state is TransferState.CANCELLED

    def on_acknowledge(self, callback: Callable[[Transfer], None]) -> None:
        """Call ``callback(self)`` when the completion is acknowledged (at once if it already was)."""
        if self.state is TransferState.ACKNOWLEDGED:
            callback(self)
        else:
            self._on_ack.append(callback)


class TransferQueue:
    """The pending set of issued transfers and the outbox of ops not yet handed to the worker.

    Invariant: a transfer's acknowledgement callbacks run exactly once, in :meth:`acknowledge`, never for a
    cancelled transfer; ops leave the outbox in issue order.
    """

    def __init__(self) -> None:
        self._ids = itertools.count()
        self._pending: dict[int, Transfer] = {}
        self._outbox: list[TransferOp] = []
        self._cancelled: list[int] = []
        self.num_submitted = 0
        self.num_acknowledged = 0
        self.num_cancelled = 0

    @property
    def pending(self) -> tuple[Transfer, ...]:
        """Transfers issued and not yet acknowledged or cancelled, oldest first."""
        return tuple(self._pending.values())

    @property
    def num_pending(self) -> int:
        """``len(pending)``."""
        return len(self._pending)

    def new_id(self) -> int:
        """A fresh op id (increasing)."""
        return next(self._ids)

    def submit(self, op: TransferOp, nbytes: int, on_ack: Callable[[Transfer], None] | None = None) -> Transfer:
        """Issue ``op`` (its id from :meth:`new_id`): pending until the worker reports it done.

        Args:
            op: the transfer as data; it goes out in the next :meth:`take_metadata`.
            nbytes: payload bytes.
            on_ack: called with the transfer once its completion is acknowledged.
        """
        t = Transfer(op, int(nbytes))
        if on_ack is not None:
            t._on_ack.append(on_ack)
        self._pending[op.op_id] = t
        self._outbox.append(op)
        self.num_submitted += 1
        return t

    def take_metadata(self) -> ConnectorMetadata:
        """The ops issued and the cancellations made since the last call, in order (for the worker half)."""
        meta = ConnectorMetadata(tuple(self._outbox), tuple(self._cancelled))
        self._outbox, self._cancelled = [], []
        return meta

    def acknowledge(self, report: TransferReport) -> list[Transfer]:
        """Process the worker's report: every pending transfer it names is acknowledged (in issue order) and its
        callbacks run; reports of cancelled or unknown transfers are ignored (case C10).

        Returns:
            The transfers acknowledged by this call.
        """
        done: list[Transfer] = []
        for op_id in sorted(report.done):
            t = self._pending.pop(op_id, None)
            if t is None:
                continue
            t.num_done = report.written.get(op_id, len(t.op.device_ids))
            t.unsaved = frozenset(report.unsaved.get(op_id, ()))
            t.state = TransferState.ACKNOWLEDGED
            self.num_acknowledged += 1
            callbacks, t._on_ack = t._on_ack, []
            for cb in callbacks:
                cb(t)
            done.append(t)
        return done

    def cancel(self, t: Transfer) -> bool:
        """Abandon a pending transfer: its callbacks never run, a later report is ignored and the worker is told to
        drop it if it has not run it (the op id goes out with the next metadata).

        Returns:
            Whether it was pending.
        """
        if t.transfer_id not in self._pending:
            return False
        del self._pending[t.transfer_id]
        if t.op in self._outbox:  # never handed out: the worker need not hear of it
            self._outbox.remove(t.op)
        else:
            self._cancelled.append(t.transfer_id)
        t.state = TransferState.CANCELLED
        t._on_ack = []
        self.num_cancelled += 1
        return True


def ops_of(transfers: Iterable[Transfer]) -> list[TransferOp]:
    """The ops of ``transfers`` (for tests and logs)."""
    return [t.op for t in transfers]
