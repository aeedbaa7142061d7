"""Device<->host block copies as a serving engine issues them: host slices in runs, a copy stream, fences.

The CPU suite checks the protocol with a copy stream whose fences land only when the test says (a stand-in for a
CUDA stream still copying): the worker reports a transfer only once its fence is done, in issue order; every save
fences the compute stream; a store op waits for the copies issued before it; ``close`` waits for what is in
flight. The byte-level copies (runs of consecutive host ids, unsorted and scattered ids) run on every device the
suite has: the CPU always, CUDA (pinned host tier, asynchronous copies on a side stream) in the device check
(``KVPAGE_TRITON_TEST_DEVICE=cuda``, ``benchmarks/gpu_check.sh``).
"""
from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch
import random

from kvpage.cache.controller import CacheController, host_runs
from kvpage.cache.step_plan import ConnectorMetadata, TransferOp
from kvpage.cache.tiers.copy_stream import CopyStream, CudaCopyStream, copy_stream_for
from kvpage.cache.tiers.host import HostTier, TieredWorker
from kvpage.spec import CacheSpec

DEVICES = ["cpu"] + (["cuda"] if os.environ.get("KVPAGE_TRITON_TEST_DEVICE") == "cuda" else [])


# -- runs of host ids ---------------------------------------------------------------------------
def test_host_runs_cut_sorted_ids_into_slices() -> None:
    order, runs = host_runs([7, 2, 3, 9, 4, 8])
    assert order == [1, 2, 4, 0, 5, 3]                    # positions sorted by id: 2, 3, 4, 7, 8, 9
    assert runs == [(2, 0, 3), (7, 3, 3)]                 # ids 2..4 from offset 0, ids 7..9 from offset 3
    assert host_runs([]) == ([], [])
    assert host_runs([5]) == ([0], [(5, 0, 1)])


@pytest.mark.parametrize("seed", range(40))
def test_host_runs_cover_every_id_once_in_maximal_runs(seed: int) -> None:
    # (seeded draws, not hypothesis: the device check's environment has no hypothesis)
    rng = random.Random(seed)
    ids = rng.sample(range(61), rng.randint(0, 24))
    order, runs = host_runs(ids)
    assert sorted(order) == list(range(len(ids)))
    covered = [first + j for first, _, n in runs for j in range(n)]
    assert covered == sorted(ids)                          # each id once, ascending
    assert [ids[k] for k in order] == covered              # offsets index the copy order
    for (f0, o0, n0), (f1, o1, _) in zip(runs, runs[1:]):
        assert o1 == o0 + n0 and f1 > f0 + n0              # runs are maximal: a gap between two runs


# -- byte-level copies ----------------------------------------------------------------------------
def _controller(device: str, fmt: str, num_blocks: int = 12, host_blocks: int = 10) -> CacheController:
    spec = CacheSpec.build(num_layers=2, num_kv_heads=2, head_dim=16, model_dtype=torch.bfloat16, block_size=4,
                           kv_cache_dtype=fmt, num_draft_layers=1, model_name="copy-stream-test")
    ctrl = CacheController(spec, device=device)
    ctrl.initialize_kv_cache(num_blocks)
    ctrl.initialize_draft_kv_cache(num_blocks)
    ctrl.initialize_host_cache(host_blocks)
    g = torch.Generator().manual_seed(0)
    for caches in (ctrl.device_caches, ctrl.host_caches):
        for layer in caches.values():
            for t in layer.values():
                raw = torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, generator=g)
                t.view(-1).view(torch.uint8).copy_(raw.to(t.device))
    return ctrl


def _snapshot(caches: dict[int, dict[str, torch.Tensor]]) -> dict[tuple[int, str], torch.Tensor]:
    return {(i, n): t.detach().cpu().clone() for i, layer in caches.items() for n, t in layer.items()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "int4"])
def test_swaps_with_scattered_unsorted_ids_move_exactly_those_blocks(device: str, fmt: str) -> None:
    """Every tensor of every layer (main and draft; codes and scales): the named blocks land byte for byte, all
    others stay as they were, whatever the order and gaps of the host ids (several runs)."""
    ctrl = _controller(device, fmt)
    if device == "cuda":
        assert all(t.is_pinned() for layer in ctrl.host_caches.values() for t in layer.values())
    dev_ids, host_ids = [5, 0, 11, 3, 7], [8, 1, 2, 9, 5]   # host runs: 1-2, 5, 8-9
    dev0, host0 = _snapshot(ctrl.device_caches), _snapshot(ctrl.host_caches)
    ctrl.swap_out(dev_ids, host_ids)
    host1 = _snapshot(ctrl.host_caches)
    for key, t in host1.items():
        want = host0[key].clone()
        want[host_ids] = dev0[key][dev_ids]
        assert torch.equal(t.view(torch.uint8), want.view(torch.uint8)), key
    back_dev, back_host = [1, 10, 4], [9, 2, 1]             # runs 1-2 and 9, given out of order
    ctrl.swap_in(back_host, back_dev)
    for key, t in _snapshot(ctrl.device_caches).items():
        want = dev0[key].clone()
        want[back_dev] = host1[key][back_host]
        assert torch.equal(t.view(torch.uint8), want.view(torch.uint8)), key


# -- the worker over a copy stream --------------------------------------------------------------
class ManualCopyStream(CopyStream):
    """A copy stream whose copies run only when the test lands them (a CUDA stream still copying, made visible)."""

    def __init__(self) -> None:
        self.queued: list[tuple[int, Callable[[], None]]] = []
        self.landed: set[int] = set()
        self.compute_fences: list[int] = []
        self.waited: list[int] = []
        self._next = 0

    def run(self, copy: Callable[[], None]) -> object:
        fence = self._next
        self._next += 1
        self.queued.append((fence, copy))
        return fence

    def land(self, upto: int) -> None:
        """Run every queued copy with a fence <= ``upto``, in order."""
        while self.queued and self.queued[0][0] <= upto:
            fence, copy = self.queued.pop(0)
            copy()
            self.landed.add(fence)

    def done(self, fence: object) -> bool:
        return fence in self.landed

    def fence_compute(self, fence: object) -> None:
        assert isinstance(fence, int)
        self.compute_fences.append(fence)

    def wait(self, fence: object) -> None:
        assert isinstance(fence, int)
        self.waited.append(fence)
        self.land(fence)


def _op(op_id: int, kind: str, dev: tuple[int, ...], host: tuple[int, ...]) -> TransferOp:
    return TransferOp(op_id, kind, dev, host_ids=host)


def test_worker_reports_copies_only_once_their_fence_is_done_in_issue_order() -> None:
    ctrl = _controller("cpu", "int8")
    stream = ManualCopyStream()
    worker = TieredWorker(HostTier(ctrl), copy_stream=stream)
    dev0 = _snapshot(ctrl.device_caches)
    host0 = _snapshot(ctrl.host_caches)
    worker.start_load_kv(ConnectorMetadata(ops=(_op(1, "device_to_host", (4, 6), (0, 3)),
                                                _op(2, "host_to_device", (9,), (7,)))))
    assert stream.compute_fences == [0]                    # the save fences compute; the load does not
    assert worker.get_finished().done == ()            # nothing landed: nothing reported
    assert _snapshot(ctrl.host_caches)[(0, "key")].equal(host0[(0, "key")])
    stream.land(0)
    rep = worker.get_finished()
    assert rep.done == (1,)                            # the save, alone: the load has not landed
    for (i, n), t in _snapshot(ctrl.host_caches).items():
        assert torch.equal(t[[0, 3]].view(torch.uint8), dev0[(i, n)][[4, 6]].view(torch.uint8)), (i, n)
    stream.land(1)
    assert worker.get_finished().done == (2,)
    assert worker.get_finished().done == ()            # each op reported once
    for (i, n), t in _snapshot(ctrl.device_caches).items():
        assert torch.equal(t[9].view(torch.uint8), host0[(i, n)][7].view(torch.uint8)), (i, n)
    assert worker.num_unreported == 0


def test_a_later_op_waits_for_an_earlier_copy_and_close_waits_for_all() -> None:
    """Reports keep issue order: a failed (store-less) op issued after a copy still in flight is reported after it;
    a store op first fences compute behind the last copy; close() lands every copy still in flight."""
    ctrl = _controller("cpu", "bfloat16")
    stream = ManualCopyStream()
    worker = TieredWorker(HostTier(ctrl), copy_stream=stream)
    worker.start_load_kv(ConnectorMetadata(ops=(
        _op(1, "host_to_device", (2,), (1,)),
        TransferOp(2, "store_to_device", (3,), block_hashes=(b"h",), store=0),   # no store 0: fails, wrote 0
        _op(3, "host_to_device", (5,), (4,)),
    )))
    assert stream.compute_fences == [0]                    # the store op ran behind copy 0
    assert worker.get_finished().done == ()            # op 2 is done but waits behind op 1
    stream.land(0)
    rep = worker.get_finished()
    assert rep.done == (1, 2) and rep.written == {2: 0}
    assert worker.num_unreported == 1
    worker.close()
    assert stream.waited == [1] and worker.get_finished().done == (3,)


def test_the_default_copy_stream_runs_at_once_on_the_cpu() -> None:
    assert type(copy_stream_for("cpu")) is CopyStream
    ctrl = _controller("cpu", "int8")
    worker = TieredWorker(HostTier(ctrl))
    dev0 = _snapshot(ctrl.device_caches)
    worker.start_load_kv(ConnectorMetadata(ops=(_op(1, "device_to_host", (4,), (0,)),)))
    assert worker.get_finished().done == (1,)
    assert torch.equal(ctrl.host_caches[0]["key"][0].view(torch.uint8), dev0[(0, "key")][4].view(torch.uint8))


@pytest.mark.skipif("cuda" not in DEVICES, reason="CUDA: the device check (KVPAGE_TRITON_TEST_DEVICE=cuda)")
def test_cuda_copy_stream_fences_with_events_and_the_bytes_land() -> None:
    ctrl = _controller("cuda", "int8")
    stream = copy_stream_for("cuda")
    assert isinstance(stream, CudaCopyStream)
    worker = TieredWorker(HostTier(ctrl))
    assert isinstance(worker.copy_stream, CudaCopyStream)
    dev0 = _snapshot(ctrl.device_caches)
    worker.start_load_kv(ConnectorMetadata(ops=(_op(1, "device_to_host", (4, 7, 5), (6, 0, 1)),)))
    finished: tuple[int, ...] = ()
    for _ in range(10_000):                                # poll as the engine does, never synchronising
        finished = worker.get_finished().done
        if finished:
            break
        torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    finished = finished or worker.get_finished().done
    assert finished == (1,)
    for (i, n), t in _snapshot(ctrl.host_caches).items():
        assert torch.equal(t[[6, 0, 1]].view(torch.uint8), dev0[(i, n)][[4, 7, 5]].view(torch.uint8)), (i, n)
    worker.close()
