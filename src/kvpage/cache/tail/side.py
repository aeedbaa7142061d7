"""``SideGroups``: 16-bit tail slots and 8-bit first-block slots carved out of the device block pool on demand.

A quantize-on-seal block's packed codes take ``bits / 16`` of a 16-bit row's bytes, so ``r = 16 / bits``
consecutive pool blocks (an aligned *group*, ``[r*g, r*g + r)``) hold one 16-bit tail slot exactly in
their key codes (and its values in their value codes): the tail tensors are zero-copy views of the pool
(:class:`~kvpage.cache.tail.pool.TailPool`), slot ``g`` = group ``g``. A first block's 8-bit copy of
:func:`~kvpage.spec.sink_rows` rows takes ``1 / c`` of a group's code bytes (``c`` =
:func:`~kvpage.spec.sinks_per_group`; sink slots ``c*g .. c*g + c - 1``: that many copies share a group). A slot
is taken by claiming its group's blocks out of the pool
(:meth:`~kvpage.cache.prefix_cache.PrefixBlockPool.claim`, evicting cached, unused ones) and freed by
giving them back, so side space is paid for only while requests hold it. Tensor-free.
"""
from __future__ import annotations

from collections.abc import Collection

from kvpage.cache.prefix_cache import PrefixBlockPool


class SideGroups:
    """Aligned groups of ``r`` pool blocks, claimed one per 16-bit tail slot or a few 8-bit first-block copies.

    Args:
        pool: the device block pool the groups come out of.
        blocks_per_group: ``r`` (:func:`~kvpage.spec.blocks_per_slot`).

    Attributes:
        num_groups: groups the pool holds (``num_blocks // r``): the most slots there can be.

    Raises:
        ValueError: ``blocks_per_group < 1``.
    """

    def __init__(self, pool: PrefixBlockPool, blocks_per_group: int) -> None:
        if blocks_per_group < 1:
            raise ValueError(f"blocks_per_group must be >= 1, got {blocks_per_group}")
        self.pool = pool
        self.r = blocks_per_group
        self.num_groups = pool.num_blocks // blocks_per_group
        self._spare: list[int] = []   # claimed for this step's tail slots, not yet holding one
        self.num_held = 0             # groups claimed and not given back (slots, sinks, spare)

    @property
    def num_spare(self) -> int:
        """Groups reserved for the next plan's tail slots (:meth:`reserve`)."""
        return len(self._spare)

    def blocks(self, g: int) -> range:
        """The block ids of group ``g``."""
        return range(g * self.r, g * self.r + self.r)

    def _find(self, k: int, protected: Collection[int], evict: bool) -> list[int]:
        """Up to ``k`` claimable groups, highest first (normal blocks come from the low end of the free list)."""
        out: list[int] = []
        claimable, prot = self.pool.claimable, frozenset(protected)
        for g in range(self.num_groups - 1, -1, -1):
            if all(claimable(b, prot, evict=evict) for b in self.blocks(g)):
                out.append(g)
                if len(out) == k:
                    break
        return out

    def claim(self) -> int | None:
        """Claim one group of free blocks out of the pool (evicting nothing: safe inside a forward pass);
        ``None`` when none is free."""
        found = self._find(1, (), False)
        if not found:
            return None
        self.pool.claim(self.blocks(found[0]))
        self.num_held += 1
        return found[0]

    def can_reserve(self, k: int, protected: Collection[int] = ()) -> bool:
        """Whether :meth:`reserve` of ``k`` groups would succeed now (no side effects)."""
        return k <= 0 or len(self._find(k, protected, True)) >= k

    def reserve(self, k: int, protected: Collection[int] = ()) -> bool:
        """Claim ``k`` groups for the next plan's tail slots, all or none; whether they were claimed.

        Cached blocks no request uses are evicted for them (never those in ``protected``: a match about to be
        admitted); the caller hands the evictions to the tiers before the forward pass.
        """
        if k <= 0:
            return True
        found = self._find(k, protected, True)
        if len(found) < k:
            return False
        for g in found:
            self.pool.claim(self.blocks(g))
        self.num_held += k
        self._spare.extend(found)
        return True

    def unreserve(self, k: int) -> None:
        """Give back ``k`` (at most all) reserved groups."""
        for _ in range(min(k, len(self._spare))):
            self.put(self._spare.pop())

    def take(self) -> int | None:
        """A group for a tail slot: a reserved one, else a fresh claim of free blocks; ``None`` when neither exists."""
        if self._spare:
            return self._spare.pop()
        return self.claim()

    def keep(self, g: int) -> None:
        """Hold the freed group ``g`` as reserved (a plan freed it; a later slot of the same plan takes it)."""
        self._spare.append(g)

    def put(self, g: int) -> None:
        """Give group ``g`` back to the pool's free list."""
        self.pool.unclaim(self.blocks(g))
        self.num_held -= 1

    def release_spare(self) -> None:
        """Give every reserved group back (after a step, or before scheduling the next)."""
        self.unreserve(len(self._spare))
