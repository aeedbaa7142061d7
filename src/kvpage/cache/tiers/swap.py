"""Swap preemption (vLLM's ``preemption_mode="swap"``): a preempted request's blocks go to host blocks it owns.

A mixin of :class:`~kvpage.cache.tiers.offload.OffloadManager` (which owns the host pool, the transfer queue
and the counters): :meth:`SwapPreemption.swap_out` copies a preempted request's written blocks to host blocks,
:meth:`SwapPreemption.swap_loads` hands them back as loads on readmission (after any of its full blocks still
cached on the device), :meth:`SwapPreemption.drop_swapped` frees them when it ends first. With bounded
sliding-window layers, a block's window rows go along only where it holds a window slot (its own window's
blocks do), and the host block remembers it. Tensor-free.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from kvpage.cache.tiers.host_pool import HostBlockPool
from kvpage.cache.tiers.transfer import Transfer
from kvpage.cache.tiers.types import BlockLoad, BlockMover, SwapRecord


class SwapPreemption:
    """Swap-out, swap-in loads and their host blocks (see the module docstring); needs the attributes below,
    set by :class:`~kvpage.cache.tiers.offload.OffloadManager`."""

    host: HostBlockPool | None
    mover: BlockMover
    _swapped: dict[str, SwapRecord]
    _no_window: set[int]
    _swap_out: int
    _swap_fallbacks: int

    def _submit(self, kind: str, direction: str, src: Sequence[int], dst: Sequence[int],
                run: Callable[[], None] | None, on_ack: Callable[[], None],
                on_cancel: Callable[[], None] | None = None) -> Transfer:
        """Issue a copy (the owner's transfer bookkeeping)."""
        raise NotImplementedError

    def _rows(self, device_ids: Sequence[int]) -> dict[str, list[int | None]]:
        """The mover's ``window_rows`` argument for ``device_ids`` (the owner's)."""
        raise NotImplementedError

    def _mark_window(self, host_ids: Sequence[int], rows: dict[str, list[int | None]]) -> None:
        """Remember which host blocks got window rows (the owner's)."""
        raise NotImplementedError

    def wait(self, transfers: Sequence[Transfer] | None = None) -> None:
        """Block until ``transfers`` are done (the owner's queue)."""
        raise NotImplementedError

    def swap_loads(
        self, request_id: str, first_block: int, max_tokens: int, block_size: int
    ) -> tuple[list[BlockLoad], int] | None:
        """The loads that swap a preempted request back in, from its block ``first_block`` on.

        Waits for the request's swap-out copy if it is still in flight.

        Args:
            request_id: the request.
            first_block: blocks before it are served otherwise (device hits).
            max_tokens: at most this many tokens come back (``len(tokens) - 1``: the
                last token is always computed, so the step yields logits).
            block_size: tokens per block.

        Returns:
            ``(loads, tokens they restore)``, or ``None`` when the request is not swapped out.
        """
        rec = self._swapped.get(request_id)
        if rec is None:
            return None
        if not rec.transfer.acknowledged:
            self.wait([rec.transfer])
        num_tokens = max(min(rec.num_tokens, max_tokens), 0)
        last = -(-num_tokens // block_size)
        return [BlockLoad("swap", None, host_block=b, window=b not in self._no_window)
                for b in rec.host_ids[first_block:last]], num_tokens

    def is_swapped(self, request_id: str) -> bool:
        """Whether the request's blocks are in the host tier waiting for a swap-in."""
        return request_id in self._swapped

    def swap_out(self, request_id: str, device_ids: Sequence[int], num_tokens: int) -> bool:
        """Copy a preempted request's blocks (holding ``num_tokens`` tokens) to host blocks it owns.

        Returns:
            ``False`` (nothing done; recompute instead) without a host tier, with
            no blocks, or when fewer host blocks are free or evictable than needed.

        Raises:
            ValueError: the request is already swapped out.
        """
        if request_id in self._swapped:
            raise ValueError(f"request {request_id!r} is already swapped out")
        n = len(device_ids)
        if self.host is None or n == 0 or not self.host.can_allocate(n):
            if n:
                self._swap_fallbacks += 1
            return False
        dids = [int(d) for d in device_ids]
        hids = self.host.allocate(n)
        rows = self._rows(dids)
        self._mark_window(hids, rows)

        def written(host: HostBlockPool = self.host, hids: list[int] = hids) -> None:
            for b in hids:
                host.finish_write(b)

        t = self._submit("device_to_host", "device_to_host", dids, hids,
                         lambda: self.mover.device_to_host(dids, hids, **rows), written)
        self._swapped[request_id] = SwapRecord(tuple(hids), int(num_tokens), t)
        self._swap_out += n
        return True

    def drop_swapped(self, request_id: str) -> bool:
        """Free a swapped-out request's host blocks (it finished or was aborted while waiting).

        Blocks whose swap-out copy is still in flight are freed when it is acknowledged.

        Returns:
            Whether the request was swapped out.
        """
        rec = self._swapped.pop(request_id, None)
        if rec is None:
            return False
        assert self.host is not None  # (a swap record exists only with a host tier)
        self.host.free_owned(rec.host_ids)
        return True
