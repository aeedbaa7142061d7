"""Lookahead slots in the scheduler (speculative decoding), on the real KVCache without a model: exact block
accounting of reserve, verify and rollback; lookahead dropped before anyone is preempted; budget and max_tokens caps."""
from __future__ import annotations

import time

from kvpage.cache.kv_cache import KVCache
from kvpage.engine.sampling import SamplingParams
from kvpage.engine.scheduler import Scheduler, SchedulerConfig
from kvpage.engine.sequence import Request


def _request(rid: str, prompt_len: int, max_tokens: int = 32, base: int = 1000) -> Request:
    ids = [base + i for i in range(prompt_len)]
    return Request(rid, None, ids, SamplingParams(max_tokens=max_tokens), time.perf_counter(), max_tokens)


def _prefill_and_sample(s: Scheduler, req: Request) -> None:
    out = s.schedule()
    assert [c.request for c in out.scheduled] == [req] and out.scheduled[0].num_lookahead == 0
    req.all_token_ids.append(7)
    s.update_after_step(out)


def _accounting(mgr: KVCache) -> None:
    st = mgr.stats()
    assert st.num_free + st.num_evictable + st.num_in_use == mgr.num_blocks


def test_lookahead_reserves_k_slots_and_rollback_returns_the_rejected_blocks() -> None:
    mgr = KVCache(16, 4)
    s = Scheduler(mgr, SchedulerConfig(num_lookahead_tokens=5))
    a = _request("a", 7)
    s.add_request(a)
    _prefill_and_sample(s, a)                              # 7 computed, 8 tokens: blocks 0-1
    assert a.num_computed_tokens == 7 and len(mgr.block_ids("a")) == 2
    out = s.schedule()
    (c,) = out.scheduled
    assert (c.num_new_tokens, c.num_lookahead, c.num_computed) == (1, 5, 7) and out.num_tokens == 6
    assert mgr.block_table("a").num_tokens == 7 + 1 + 5 and len(c.block_ids) == 4   # 13 slots: 4 blocks
    # verification kept 1 draft of 5 and emitted one more token: 2 tokens appended, 9 computed
    a.all_token_ids += [11, 12]
    s.update_after_step(out, {"a": 1})
    assert a.num_computed_tokens == 9 and mgr.block_table("a").num_tokens == 9
    assert len(mgr.block_ids("a")) == 3 and mgr.stats().num_in_use == 3     # the 4th block held only drafts
    assert mgr.stats().blocks_stored == 2     # the two blocks full of verified tokens, not the third
    _accounting(mgr)
    s.finish(a, "length")
    assert mgr.stats().num_in_use == 0
    _accounting(mgr)


def test_lookahead_is_capped_by_budget_and_max_tokens() -> None:
    mgr = KVCache(64, 4)
    s = Scheduler(mgr, SchedulerConfig(num_lookahead_tokens=8, max_num_batched_tokens=6))
    a = _request("a", 5, max_tokens=4)
    s.add_request(a)
    _prefill_and_sample(s, a)
    (c,) = s.schedule().scheduled
    assert c.num_lookahead == 2           # 1 output so far, 4 at most: 2 drafts + 1 more token
    s2 = Scheduler(KVCache(64, 4), SchedulerConfig(num_lookahead_tokens=8, max_num_batched_tokens=6))
    b = _request("b", 5, max_tokens=50)
    s2.add_request(b)
    _prefill_and_sample(s2, b)
    (c,) = s2.schedule().scheduled
    assert c.num_lookahead == 5           # the step's budget of 6 tokens


def test_lookahead_is_dropped_before_preempting() -> None:
    """Room for every request's next token but not for the drafts: nobody is preempted, the request decodes
    without drafts this step; the counts stay exact."""
    mgr = KVCache(4, 4)
    s = Scheduler(mgr, SchedulerConfig(num_lookahead_tokens=4))
    a, b = _request("a", 6, base=10), _request("b", 6, base=500)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    assert [x.request for x in out.scheduled] == [a, b]
    for r in (a, b):
        r.all_token_ids.append(7)
    s.update_after_step(out)                # 2 blocks each, all 4 in use, 7 tokens in 8 slots
    out = s.schedule()
    assert not out.preempted and [(x.num_new_tokens, x.num_lookahead) for x in out.scheduled] == [(1, 0), (1, 0)]
    assert mgr.stats().num_free == 0
    _accounting(mgr)


def test_no_lookahead_at_or_above_the_batch_limit() -> None:
    """``disable_by_batch_size``: with 2 requests running and a limit of 2, nobody drafts; alone, one does."""
    mgr = KVCache(64, 4)
    s = Scheduler(mgr, SchedulerConfig(num_lookahead_tokens=3, speculation_max_batch=2))
    a, b = _request("a", 5, base=10), _request("b", 5, base=500)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    for r in (a, b):
        r.all_token_ids.append(7)
    s.update_after_step(out)
    assert [c.num_lookahead for c in s.schedule().scheduled] == [0, 0]
    s.finish(b, "abort")
    mgr2 = KVCache(64, 4)
    s2 = Scheduler(mgr2, SchedulerConfig(num_lookahead_tokens=3, speculation_max_batch=2))
    c = _request("c", 5)
    s2.add_request(c)
    _prefill_and_sample(s2, c)
    assert [x.num_lookahead for x in s2.schedule().scheduled] == [3]
