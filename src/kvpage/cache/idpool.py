"""``IdPool``: integer ids ``0 .. num_ids-1`` with a free list, a reference count per id and range checks.

The bookkeeping under every pool of kvpage -- device blocks (:class:`~kvpage.cache.prefix_cache.PrefixBlockPool`),
host blocks (:class:`~kvpage.cache.tiers.host_pool.HostBlockPool`) and tail and sink slots
(:class:`~kvpage.cache.tail.TailTable`) -- which add their own states (cached, evictable, being written)
on top. Tensor-free; imports only :mod:`kvpage.errors`.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence

from kvpage.errors import OutOfBlocksError


class IdPool:
    """Ids ``0 .. num_ids-1``, each either **free** (in the free list, ref count 0) or **taken** (ref count >= 0).

    A taken id with ref count 0 is the owning pool's business (an evictable
    cached block, a host block being written, a tail slot); only :meth:`put`
    returns an id to the free list. Every batch method checks all its ids
    before changing anything, so a call that raises changes nothing.

    Order of the free list:

    * ``lifo=False`` (FIFO): :meth:`take` hands out the front, :meth:`put`
      appends to the back, so a returned id is reused last and ids start as
      ``0, 1, 2, ...`` (the device and host block pools);
    * ``lifo=True``: the most recently returned id is taken next, and ids
      still start as ``0, 1, 2, ...`` (tail slots).

    Args:
        num_ids: ids in the pool.
        what: what an id names in error messages (``"block"``, ``"host block"``, ``"tail slot"``).
        lifo: free-list order (see above).

    Attributes:
        num_ids: ids in the pool.
        what: the noun used in error messages.

    Raises:
        ValueError: ``num_ids < 0``.
    """

    def __init__(self, num_ids: int, *, what: str = "block", lifo: bool = False) -> None:
        if num_ids < 0:
            raise ValueError(f"the number of {what}s must be >= 0, got {num_ids}")
        self.num_ids = num_ids
        self.what = what
        self.lifo = lifo
        self._free: deque[int] = deque(range(num_ids - 1, -1, -1) if lifo else range(num_ids))
        self._is_free = [True] * num_ids
        self._stale: set[int] = set()  # taken by take_ids but still in the free list (skipped by take)
        self._ref = [0] * num_ids

    # -- queries ---------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Ids in the free list."""
        return len(self._free) - len(self._stale)

    @property
    def num_taken(self) -> int:
        """Ids not in the free list (``num_ids - num_free``)."""
        return self.num_ids - self.num_free

    def free_ids(self) -> list[int]:
        """The free ids in the order :meth:`take` would hand them out (a copy; O(num_free))."""
        ids = list(reversed(self._free)) if self.lifo else list(self._free)
        return [i for i in ids if i not in self._stale] if self._stale else ids

    @property
    def refs(self) -> Sequence[int]:
        """Every id's reference count, indexed by id: a live, read-only view (no range check; for hot loops
        over ids already checked)."""
        return self._ref

    def check(self, i: int) -> None:
        """Raise ``ValueError`` unless ``0 <= i < num_ids`` (so ``-1`` never reads the last id)."""
        if not 0 <= i < self.num_ids:
            raise ValueError(f"{self.what} id {i} out of range [0, {self.num_ids})")

    def is_free(self, i: int) -> bool:
        """Whether ``i`` is in the free list.

        Raises:
            ValueError: ``i`` out of range.
        """
        self.check(i)
        return self._is_free[i]

    def ref_count(self, i: int) -> int:
        """References to ``i`` (0 for a free id).

        Raises:
            ValueError: ``i`` out of range.
        """
        self.check(i)
        return self._ref[i]

    # -- the free list ---------------------------------------------------------------------------
    def take(self, n: int, *, ref: int = 0) -> list[int]:
        """Take ``n`` ids out of the free list, in free-list order; ``take(0)`` is ``[]``.

        Args:
            n: ids to take.
            ref: the reference count each taken id starts with (0 or more).

        Raises:
            ValueError: ``n < 0``.
            OutOfBlocksError: fewer than ``n`` ids are free; nothing is taken.
        """
        if n < 0:
            raise ValueError(f"cannot take a negative number of {self.what}s ({n})")
        if n > self.num_free:
            raise OutOfBlocksError(f"need {n} {self.what}s, only {self.num_free} of {self.num_ids} are free")
        if ref < 0:
            raise ValueError(f"a reference count cannot be negative ({ref})")
        pop = self._free.pop if self.lifo else self._free.popleft
        out: list[int]
        if self._stale:
            out = []
            while len(out) < n:
                i = pop()
                if i in self._stale:
                    self._stale.discard(i)
                else:
                    out.append(i)
        else:
            out = [pop() for _ in range(n)]
        is_free, refs = self._is_free, self._ref
        for i in out:
            is_free[i] = False
            refs[i] = ref
        return out

    def take_ids(self, ids: Sequence[int], *, ref: int = 0) -> None:
        """Take these free ids out of the free list (O(1) each: their entries are skipped by :meth:`take` later).

        Raises:
            ValueError: an id is out of range, not free, or given twice; nothing is taken.
        """
        if len(set(ids)) != len(ids) or any(not 0 <= i < self.num_ids or not self._is_free[i] for i in ids):
            raise ValueError(f"{self.what}s {list(ids)} are not distinct free ids")
        for i in ids:
            self._stale.add(i)
            self._is_free[i] = False
            self._ref[i] = ref

    def put(self, ids: Iterable[int]) -> None:
        """Return taken, unreferenced ids to the free list, in the order given.

        Raises:
            ValueError: an id is out of range, already free (or given twice), or
                still referenced; nothing is returned.
        """
        ids = list(ids)
        n, is_free, refs = self.num_ids, self._is_free, self._ref
        for i in ids:
            if not 0 <= i < n:
                self.check(i)
            if is_free[i]:
                raise ValueError(f"{self.what} {i} is already free (double free)")
            if refs[i]:
                raise ValueError(f"{self.what} {i} is still referenced {refs[i]} time(s); cannot free it")
        if len(ids) > 1 and len(set(ids)) != len(ids):
            twice = next(i for k, i in enumerate(ids) if i in ids[:k])
            raise ValueError(f"{self.what} {twice} is given twice (double free)")
        for i in ids:
            is_free[i] = True
        if self._stale:  # an id whose old entry is still in the free list takes it back
            back = [i for i in ids if i not in self._stale]
            self._stale.difference_update(ids)
            self._free.extend(back)
        else:
            self._free.extend(ids)

    # -- references ------------------------------------------------------------------------------
    def incref(self, ids: Iterable[int]) -> None:
        """Add one reference to each taken id (an id given twice gets two).

        Raises:
            ValueError: an id is out of range or free; nothing is changed.
        """
        ids = list(ids)
        n, is_free, ref = self.num_ids, self._is_free, self._ref
        for i in ids:
            if not 0 <= i < n:
                self.check(i)
            if is_free[i]:
                raise ValueError(f"{self.what} {i} is free; cannot add a reference")
        for i in ids:
            ref[i] += 1

    def drops(self, ids: Sequence[int], *, verb: str = "freed") -> dict[int, int]:
        """How many references :meth:`decref` would drop from each id; checks them without changing anything.

        Args:
            ids: the ids, an id once per reference to drop.
            verb: the past participle naming the release in the error message (``"freed"``, ``"unpinned"``).

        Raises:
            ValueError: an id is out of range, or given more often than it is
                referenced (a double free).
        """
        counts: dict[int, int] = {}
        n, ref = self.num_ids, self._ref
        for i in ids:
            if not 0 <= i < n:
                self.check(i)
            c = counts[i] = counts.get(i, 0) + 1
            if c > ref[i]:
                raise ValueError(f"{self.what} {i} {verb} more often than it is referenced (double free)")
        return counts

    def decref(
        self, ids: Iterable[int], *, verb: str = "freed", veto: Callable[[dict[int, int]], None] | None = None
    ) -> list[int]:
        """Drop one reference from each id, in the order given; the ids stay taken.

        Args:
            ids: the ids, an id once per reference to drop.
            verb: as in :meth:`drops`.
            veto: called with :meth:`drops`' counts after the ids are checked and before
                anything changes; the owner's own rule may raise there to refuse the release.

        Returns:
            The ids whose count reached 0, in the order they reached it.

        Raises:
            ValueError: as :meth:`drops`; nothing is changed.
            Exception: whatever ``veto`` raises; nothing is changed.
        """
        ids = list(ids)
        counts = self.drops(ids, verb=verb)
        if veto is not None:
            veto(counts)
        ref = self._ref
        zero = []
        for i in ids:
            ref[i] -= 1
            if ref[i] == 0:
                zero.append(i)
        return zero

    # -- checks ----------------------------------------------------------------------------------
    def validate(self) -> None:
        """Check the pool's invariants (O(num_ids); for tests).

        Raises:
            AssertionError: an id is in the free list twice, a free id is
                referenced, or a count is negative.
        """
        free = self.free_ids()
        assert len(free) == len(set(free)), f"a {self.what} is in the free list twice"
        free_set = set(free)
        for i in range(self.num_ids):
            assert self._ref[i] >= 0, f"{self.what} {i}: negative ref count {self._ref[i]}"
            assert self._is_free[i] == (i in free_set), f"{self.what} {i}: free flag disagrees with the free list"
            assert not (self._is_free[i] and self._ref[i]), f"free {self.what} {i} has {self._ref[i]} reference(s)"
