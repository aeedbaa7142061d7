"""Where the host tier's block copies run: at once on the caller's stream (CPU), or on a CUDA copy stream of their own.

A serving engine overlaps KV transfers with compute: vLLM's offloading connector and SGLang's HiCache issue
device<->host copies on a side stream and learn that they landed from a CUDA event, never by synchronising the
host. :class:`TieredWorker <kvpage.cache.tiers.host.TieredWorker>` does the same through this interface:

* :meth:`CopyStream.run` issues a copy and returns a fence (on CUDA: the copy stream first waits for the work the
  compute stream has queued so far, so a copy reads what the passes before it wrote; then the copy; then an event);
* :meth:`CopyStream.done` polls a fence without blocking (the worker reports a transfer finished only then, and
  only then may the scheduler side hand its blocks on or schedule a request over them);
* :meth:`CopyStream.fence_compute` makes the compute stream wait for a fence on the device, without the host:
  a save (device -> host) is fenced so that no later pass overwrites a block before the copy has read it (the
  scheduler side may free a swapped-out request's device blocks at once);
* :meth:`CopyStream.wait` blocks the host (at close).

Loads (host -> device) write blocks that no pass reads until their transfer is reported done, so they overlap
the step's compute. :class:`CopyStream` itself runs everything at once on the current stream (the CPU, where a
copy is done when issued); :func:`copy_stream_for` picks the CUDA one for a CUDA device.
"""
from __future__ import annotations

from collections.abc import Callable

import torch


class CopyStream:
    """Copies run at once, in the caller's thread and stream (CPU devices): every fence is done when returned."""

    def run(self, copy: Callable[[], None]) -> object:
        """Issue ``copy`` (a callable that issues tensor copies, possibly asynchronous on the current stream) and
        return its fence. Exceptions ``copy`` raises propagate (nothing is fenced)."""
        copy()
        return None

    def done(self, fence: object) -> bool:
        """Whether the copies behind ``fence`` have landed (never blocks)."""
        return True

    def fence_compute(self, fence: object) -> None:
        """Make later compute on the device wait for ``fence`` (no host synchronisation); nothing here."""

    def wait(self, fence: object) -> None:
        """Block the host until ``fence`` is done."""


class CudaCopyStream(CopyStream):
    """Copies on a CUDA stream of their own, each fenced by an event recorded after it.

    Args:
        device: the CUDA device whose compute stream (its current stream when a copy is issued) the copies follow.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def run(self, copy: Callable[[], None]) -> object:
        """Issue ``copy`` on the copy stream after the compute stream's queued work; returns a ``torch.cuda.Event``."""
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # read what the passes queued so far wrote
        with torch.cuda.stream(self.stream):
            copy()
            return self.stream.record_event()

    def done(self, fence: object) -> bool:
        """``event.query()``: the copies before the event have completed."""
        assert isinstance(fence, torch.cuda.Event)
        return bool(fence.query())

    def fence_compute(self, fence: object) -> None:
        """The compute stream waits for the event on the device (``Stream.wait_event``)."""
        assert isinstance(fence, torch.cuda.Event)
        torch.cuda.current_stream(self.device).wait_event(fence)

    def wait(self, fence: object) -> None:
        """``event.synchronize()``."""
        assert isinstance(fence, torch.cuda.Event)
        fence.synchronize()


def copy_stream_for(device: torch.device | str) -> CopyStream:
    """The copy stream for a device tier: :class:`CudaCopyStream` on CUDA, else :class:`CopyStream` (at once)."""
    device = torch.device(device)
    return CudaCopyStream(device) if device.type == "cuda" else CopyStream()


__all__ = ["CopyStream", "CudaCopyStream", "copy_stream_for"]
