"""Scheduler policy on the real KVCache, without a model: budgets, order, chunking, preemption, accounting."""
from __future__ import annotations

import time

import pytest

from kvpage.cache.kv_cache import KVCache
from kvpage.cache.requests import KVUpdate
from kvpage.engine.sampling import SamplingParams
from kvpage.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvpage.engine.sequence import Request, RequestStatus


def make_request(rid: str, prompt_len: int, max_tokens: int = 8, base: int = 1000) -> Request:
    ids = [base + i for i in range(prompt_len)]
    return Request(rid, None, ids, SamplingParams(max_tokens=max_tokens), time.perf_counter(), max_tokens)


def run_step(s: Scheduler, out: SchedulerOutput) -> None:
    """Pretend the forward pass ran: advance progress, then 'sample' token 7 for each completed sequence."""
    s.update_after_step(out)
    for c in out.scheduled:
        if c.completes_sequence:
            c.request.all_token_ids.append(7)
            if c.request.num_output_tokens >= c.request.max_tokens:
                s.finish(c.request, "length")


def check_accounting(kv: KVCache) -> None:
    st = kv.stats()
    assert st.num_free + st.num_evictable + st.num_in_use == kv.num_blocks


def test_budget_chunks_a_long_prefill_and_decodes_go_first():
    kv = KVCache(64, 4)
    s = Scheduler(kv, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10))
    a = make_request("a", 3, base=10)
    s.add_request(a)
    run_step(s, s.schedule())                      # a: whole prompt (3 tokens), samples 1 token
    b = make_request("b", 25, base=500)
    s.add_request(b)
    out = s.schedule()
    # a's decode comes first (1 token), then b's first chunk fills the rest of the 10-token budget
    assert [(c.request.request_id, c.num_new_tokens) for c in out.scheduled] == [("a", 1), ("b", 9)]
    assert out.num_tokens == 10
    run_step(s, out)
    assert b.num_computed_tokens == 9 and b.num_output_tokens == 0   # a chunk samples nothing
    out = s.schedule()
    assert [(c.request.request_id, c.num_new_tokens, c.num_computed) for c in out.scheduled] == [("a", 1, 4), ("b", 9, 9)]
    run_step(s, out)
    out = s.schedule()
    assert [(c.request.request_id, c.num_new_tokens) for c in out.scheduled] == [("a", 1), ("b", 7)]
    assert out.scheduled[1].completes_sequence
    run_step(s, out)
    assert b.num_output_tokens == 1
    check_accounting(kv)


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    kv = KVCache(64, 4)
    s = Scheduler(kv, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10, enable_chunked_prefill=False))
    a, b = make_request("a", 6, base=10), make_request("b", 6, base=90)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    assert [(c.request.request_id, c.num_new_tokens) for c in out.scheduled] == [("a", 6)]  # b (6) > 4 left
    run_step(s, out)
    out = s.schedule()
    assert [(c.request.request_id, c.num_new_tokens) for c in out.scheduled] == [("a", 1), ("b", 6)]
    # a prompt longer than the whole budget still runs, alone, instead of waiting forever
    c = make_request("c", 30, base=300)
    s2 = Scheduler(KVCache(64, 4), SchedulerConfig(max_num_batched_tokens=10, enable_chunked_prefill=False))
    s2.add_request(c)
    assert [(x.request.request_id, x.num_new_tokens) for x in s2.schedule().scheduled] == [("c", 30)]


def test_fcfs_and_max_num_seqs():
    kv = KVCache(64, 4)
    s = Scheduler(kv, SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100))
    reqs = [make_request(str(i), 4, base=100 * i) for i in range(4)]
    for r in reqs:
        s.add_request(r)
    out = s.schedule()
    assert [c.request.request_id for c in out.scheduled] == ["0", "1"]
    assert [r.request_id for r in s.waiting] == ["2", "3"]
    run_step(s, out)
    s.finish(reqs[0], "abort")
    out = s.schedule()
    assert [c.request.request_id for c in out.scheduled] == ["1", "2"]


def test_preemption_by_recompute_frees_blocks_and_rehits_the_prefix():
    kv = KVCache(6, 4)        # 24 slots
    s = Scheduler(kv, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64))
    a, b = make_request("a", 8, max_tokens=12, base=10), make_request("b", 8, max_tokens=12, base=500)
    s.add_request(a)
    s.add_request(b)
    preempted = []
    steps = 0
    while s.num_unfinished and steps < 200:
        out = s.schedule()
        preempted += out.preempted
        # a request is never both scheduled and preempted in the same step
        assert not {c.request.request_id for c in out.scheduled} & {r.request_id for r in out.preempted}
        run_step(s, out)
        check_accounting(kv)
        assert kv.stats().num_in_use <= kv.num_blocks
        steps += 1
    assert not s.num_unfinished
    assert preempted and preempted[0] is b                 # the later arrival yields
    assert b.num_preemptions >= 1 and s.num_preemptions == len(preempted)
    assert a.num_output_tokens == b.num_output_tokens == 12
    assert kv.stats().num_in_use == 0
    stats = kv.stats()
    assert stats.preemptions == len(preempted)
    assert stats.prefix_hits > 0                           # b re-hit its own full blocks on readmission


def test_preempting_an_already_scheduled_decode_takes_its_chunk_back():
    """Regression: the victim (latest admitted) can be a decode already scheduled in this step, since
    decodes go first; its chunk must leave the step, or the engine would write into freed blocks."""
    kv = KVCache(3, 4)                                # 12 slots
    s = Scheduler(kv, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4))
    a = make_request("a", 12, max_tokens=1, base=10)
    s.add_request(a)
    run_step(s, s.schedule())                                 # a: first 4-token chunk, 1 block
    assert a.num_computed_tokens == 4
    # b was admitted after a and is already decoding (white-box set-up of that state)
    b = make_request("b", 3, max_tokens=4, base=500)
    b.all_token_ids.append(7)
    assert kv.allocate(b, 3) is not None
    kv.cache(b, 3)
    b.num_computed_tokens, b.status = 3, RequestStatus.RUNNING
    s.running.append(b)
    s.config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16)
    out = s.schedule()
    # b's decode took block 3 first; a's 8-token chunk needs 2 more blocks, so b is preempted and dropped
    assert out.preempted == [b]
    assert [(c.request.request_id, c.num_new_tokens) for c in out.scheduled] == [("a", 8)]
    assert b.status is RequestStatus.PREEMPTED and s.waiting[0] is b
    run_step(s, out)                                          # no KeyError from cache on b
    check_accounting(kv)
    while s.num_unfinished:
        run_step(s, s.schedule())
    assert a.num_output_tokens == 1 and b.num_output_tokens == 4
    assert kv.stats().num_in_use == 0


def test_finish_and_abort_return_every_block():
    kv = KVCache(32, 4)
    s = Scheduler(kv, SchedulerConfig())
    reqs = [make_request(str(i), 5 + i, base=50 * i) for i in range(5)]
    for r in reqs:
        s.add_request(r)
    run_step(s, s.schedule())
    assert kv.stats().num_in_use > 0
    s.finish(reqs[0], "abort")
    s.finish(reqs[0], "abort")      # idempotent
    for r in reqs[1:]:
        s.finish(r, "stop")
    assert reqs[0].finish_reason == "abort" and reqs[0].status is RequestStatus.FINISHED
    assert kv.stats().num_in_use == 0 and not s.num_unfinished
    check_accounting(kv)


def test_config_rejects_nonsense():
    with pytest.raises(ValueError):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError):
        SchedulerConfig(max_num_batched_tokens=-1)


def test_a_sealed_format_computes_its_first_block_alone_then_loads_the_rest():
    """int4/int2 (tiers serve a prefix only behind a device-resident first block, whose 8-bit copy never leaves the
    device): a request whose first block is on no device but whose next blocks a tier holds computes block 0
    alone, goes back to the front of the queue without being preempted, and is matched again: block 0 is a
    device hit and blocks 1-2 are loads. It is done once: if block 0 is gone by then, the prompt is computed."""
    from _kv_kinds import OfferingConnector

    from kvpage.cache.groups import manager_for
    from kvpage.cache.step_plan import PassRequest
    from kvpage.spec import CacheSizing, CacheSpec

    def setup(budget: int = 64) -> tuple[KVCache, Scheduler, OfferingConnector, Request]:
        spec = CacheSpec.build(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, kv_cache_dtype="int4")
        tiers = OfferingConnector(4, max_blocks=8)
        kv = KVCache(16, 4, groups=[manager_for(spec.main, CacheSizing(max_num_seqs=2, residual_tokens=0))],
                     connector=tiers)
        s = Scheduler(kv, SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=budget))
        r = make_request("r", 14)
        s.add_request(r)
        return kv, s, tiers, r

    def step(kv: KVCache, s: Scheduler) -> list[tuple[int, int]]:
        out = s.schedule()
        kv.commit(kv.plan_pass([PassRequest(c.request.request_id, c.num_computed, c.num_new_tokens, c.block_ids)
                                for c in out.scheduled]))  # the pass seals block 0 and makes its 8-bit copy
        run_step(s, out)
        return [(c.num_computed, c.num_new_tokens) for c in out.scheduled]

    kv, s, tiers, r = setup()
    assert step(kv, s) == [(0, 4)] and not tiers.issued    # block 0 alone, no load yet
    assert step(kv, s) == [(12, 2)]                        # matched again: 4 device + 8 loaded tokens
    assert tiers.issued == [("r", tiers.issued[0][1], 8)] and r.num_cached_tokens == 8
    assert s.num_preemptions == 0 and r.num_preemptions == 0
    st = kv.stats()  # one request; block 0, which it computed itself, is no device hit
    assert (st.requests, st.prefix_queries, st.prefix_hits, st.tier_hits["device"]) == (1, 14, 0, 0)
    check_accounting(kv)

    kv, s, tiers, r = setup()  # the loads cut short at block 1: only block 0 is there, computed by r itself
    step(kv, s)
    out = s.schedule()
    s.update_from_kv(KVUpdate(cut_short={"r": 4}), out)
    assert r.num_computed_tokens == 4 and r.num_cached_tokens == 0

    kv, s, tiers, r = setup(budget=3)  # block 0 takes two steps; the second stops at its end
    assert step(kv, s) == [(0, 3)] and step(kv, s) == [(3, 1)]
    assert step(kv, s) == [(12, 2)] and tiers.issued[0][2] == 8

    kv, s, tiers, r = setup()
    assert step(kv, s) == [(0, 4)]
    rematch = kv.rematch

    def rematch_and_evict(request: Request, num_computed_tokens: int) -> bool:  # block 0 is evicted in between
        held = rematch(request, num_computed_tokens)
        assert kv.reset_prefix_cache()
        return held

    kv.rematch = rematch_and_evict  # type: ignore[method-assign]
    assert step(kv, s) == [(0, 14)] and not tiers.issued  # computed whole: block 0 is not computed alone twice
    assert r.num_cached_tokens == 0
    check_accounting(kv)
