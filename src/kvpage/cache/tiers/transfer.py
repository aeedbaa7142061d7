"""Block copies between tiers as operations with a completion: :class:`Transfer` handles and a :class:`TransferQueue`.

A copy between the device, the host tier and a store is asynchronous in a
real serving engine (CUDA copy streams, network I/O): it is *issued*, later it
is *done*, and only when the owner *acknowledges* the completion
(:meth:`TransferQueue.poll`) may the blocks it touches change hands. kvpage
keeps that bookkeeping explicit even where the copy itself is synchronous
(CPU tensors): every copy is a :class:`Transfer` in a pending set, so the rules
that depend on it are real and testable:

* a host block that is the target of a device->host copy is never reused
  until that copy is acknowledged (case C09; SGLang issue 28468, where an
  eviction recycled host pages a backup was still writing);
* device blocks being loaded for a request that is aborted go back to the pool
  only once the load completes or a deadline passes; a completion that arrives
  after the deadline is ignored without an error (case C10; vLLM issues 32255
  and 46283).

A synchronous queue (the default) runs each copy and acknowledges it inside
:meth:`TransferQueue.submit`. An asynchronous queue (``synchronous=False``)
leaves transfers pending until something completes them: a test by hand
(:meth:`Transfer.complete`), or :meth:`TransferQueue.wait`, which runs the copy
then (a blocking wait). Tensor-free: a transfer holds the copy as a callable.
"""
from __future__ import annotations

import enum
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


class TransferState(enum.Enum):
    """Where a :class:`Transfer` is in its life."""

    PENDING = "pending"  # issued, the copy has not finished
    DONE = "done"  # the copy finished; not yet acknowledged by the queue's owner
    ACKNOWLEDGED = "acknowledged"  # the owner processed the completion (blocks may change hands)
    CANCELLED = "cancelled"  # abandoned (deadline passed); a later completion is ignored


_ids = itertools.count()


@dataclass(eq=False)
class Transfer:
    """One issued block copy (vLLM's ``TransferSpec`` + job id; SGLang's ``CacheOperation``).

    Attributes:
        kind: what moves: ``"device_to_host"``, ``"host_to_device"``, ``"store_to_device"``.
        src: source block ids (device or host ids; empty for a store read).
        dst: destination block ids.
        nbytes: payload bytes moved (``len(dst) * bytes per block``).
        transfer_id: unique, increasing.
        state: :class:`TransferState`.
    """

    kind: str
    src: tuple[int, ...]
    dst: tuple[int, ...]
    nbytes: int
    _run: Callable[[], None] | None = field(default=None, repr=False)
    _on_ack: list[Callable[[Transfer], None]] = field(default_factory=list, repr=False)
    transfer_id: int = field(default_factory=lambda: next(_ids))
    state: TransferState = TransferState.PENDING

    @property
    def done(self) -> bool:
        """Whether the copy finished (done or already acknowledged); ``False`` when cancelled."""
        return self.state in (TransferState.DONE, TransferState.ACKNOWLEDGED)

    @property
    def acknowledged(self) -> bool:
        """Whether the queue's owner processed the completion."""
        return self.state is TransferState.ACKNOWLEDGED

    @property
    def cancelled(self) -> bool:
        """Whether the transfer was abandoned (its completion will be ignored)."""
        return self.state is TransferState.CANCELLED

    def complete(self) -> bool:
        """Signal that the copy finished, running it first if it has not run yet.

        Idempotent. A completion for a cancelled transfer is ignored without an
        error (case C10): the copy is not run, so blocks that went back to the
        pool at the deadline are never written.

        Returns:
            Whether this call completed the transfer (``False`` when it was
            already done, acknowledged or cancelled).
        """
        if self.state is not TransferState.PENDING:
            return False
        if self._run is not None:
            run, self._run = self._run, None
            run()
        self.state = TransferState.DONE
        return True

    def on_acknowledge(self, callback: Callable[[Transfer], None]) -> None:
        """Call ``callback(self)`` when the queue acknowledges the completion (at once if it already did)."""
        if self.state is TransferState.ACKNOWLEDGED:
            callback(self)
        else:
            self._on_ack.append(callback)


class TransferQueue:
    """The pending set of issued transfers; :meth:`poll` acknowledges finished ones.

    Args:
        synchronous: run and acknowledge every copy inside :meth:`submit` (CPU
            tensors; the default). ``False`` leaves transfers pending until they
            are completed by hand or waited for (tests of in-flight states).

    Invariant: a transfer's acknowledgement callbacks run exactly once, in
    :meth:`poll` (or :meth:`submit` when synchronous), never for a cancelled
    transfer.
    """

    def __init__(self, *, synchronous: bool = True) -> None:
        self.synchronous = synchronous
        self._pending: dict[int, Transfer] = {}
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

    def submit(
        self,
        kind: str,
        src: Iterable[int],
        dst: Iterable[int],
        nbytes: int,
        run: Callable[[], None] | None,
        on_ack: Callable[[Transfer], None] | None = None,
    ) -> Transfer:
        """Issue a copy.

        Args:
            kind, src, dst, nbytes: see :class:`Transfer`.
            run: performs the copy (``None``: nothing to copy, e.g. already done).
            on_ack: called with the transfer once its completion is acknowledged.

        Returns:
            The transfer: acknowledged already when the queue is synchronous, pending otherwise.
        """
        t = Transfer(kind, tuple(src), tuple(dst), int(nbytes), run)
        if on_ack is not None:
            t._on_ack.append(on_ack)
        self._pending[t.transfer_id] = t
        self.num_submitted += 1
        if self.synchronous:
            t.complete()
            self._acknowledge(t)
        return t

    def _acknowledge(self, t: Transfer) -> None:
        del self._pending[t.transfer_id]
        t.state = TransferState.ACKNOWLEDGED
        self.num_acknowledged += 1
        callbacks, t._on_ack = t._on_ack, []
        for cb in callbacks:
            cb(t)

    def poll(self) -> list[Transfer]:
        """Acknowledge every finished transfer (in issue order) and run its callbacks.

        Returns:
            The transfers acknowledged by this call.
        """
        done = [t for t in self._pending.values() if t.state is TransferState.DONE]
        for t in done:
            self._acknowledge(t)
        return done

    def wait(self, transfers: Iterable[Transfer] | None = None) -> None:
        """Block until the given transfers (default: all pending) are done, then acknowledge them.

        The queue is one copy stream: waiting for a transfer also finishes every
        transfer issued before it, in issue order (so a backup that reads a
        device block always runs before a later load that overwrites that block).
        Deferred copies run now; cancelled and acknowledged transfers are skipped.
        """
        if transfers is None:
            todo = list(self._pending.values())
        else:
            wanted = [t.transfer_id for t in transfers if t.transfer_id in self._pending]
            last = max(wanted, default=-1)
            todo = [t for t in self._pending.values() if t.transfer_id <= last]
        for t in todo:  # _pending keeps issue order
            t.complete()
        self.poll()

    def cancel(self, t: Transfer) -> bool:
        """Abandon a pending transfer: its callbacks never run and a later :meth:`Transfer.complete` is ignored.

        Returns:
            Whether it was pending (not yet acknowledged).
        """
        if t.transfer_id not in self._pending:
            return False
        del self._pending[t.transfer_id]
        t.state = TransferState.CANCELLED
        t._run = None
        t._on_ack = []
        self.num_cancelled += 1
        return True
