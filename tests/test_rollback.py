"""KV rollback of rejected speculative drafts (issue 14): the KV cache's block accounting, the quantize-on-seal
tail's provisional seals, and attention after a rollback reading exactly what a run without drafts reads.

References: hand-counted blocks and slots; a second tail (or engine group) fed the same tokens without drafts.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpage.cache.controller import CacheController
from kvpage.cache.groups import GroupManager, SealedGroupManager, manager_for
from kvpage.cache.kv_cache import KVCache
from kvpage.cache.prefix_cache import PrefixBlockPool
from kvpage.cache.requests import KVRequest
from kvpage.cache.step_plan import PassRequest
from kvpage.cache.tail import TailTable
from kvpage.cache.tail.pool import TailPool
from kvpage.cache.tail.side import SideGroups
from kvpage.engine.group_attention import GroupAttention, group_attention_for
from kvpage.errors import KVPageError
from kvpage.ops.attention import AttentionMetadata
from kvpage.spec import CacheSizing, CacheSpec

# -- 1. the KV cache: blocks holding only rejected tokens go back ------------------------------------


class _Recorder(GroupManager):
    """A full-attention group that records what the KV cache tells it."""

    def __init__(self) -> None:
        super().__init__()
        self.dead: list[tuple[tuple[int, ...], bool]] = []
        self.rollbacks: list[tuple[tuple[int, ...], int]] = []

    def on_blocks_dead(self, block_ids: Sequence[int], *, evicted: bool = False) -> None:
        self.dead.append((tuple(block_ids), evicted))

    def on_rollback(self, block_ids: Sequence[int], num_tokens: int) -> None:
        self.rollbacks.append((tuple(block_ids), num_tokens))


def _counts(m: KVCache) -> tuple[int, int, int]:
    st = m.stats()
    assert st.num_free + st.num_evictable + st.num_in_use == m.num_blocks
    return st.num_free, st.num_evictable, st.num_in_use


def test_rollback_frees_exactly_the_blocks_holding_only_rejected_tokens() -> None:
    g = _Recorder()
    m = KVCache(10, 4, groups=[g])
    r = KVRequest("r", list(range(20)))
    m.allocate(r, 6, m.match(r))
    assert m.cache(r, 6) == 1                             # block 0 indexed
    blocks = m.allocate(r, 1, num_lookahead=5)            # [last, d1..d5] at 6..11: 12 slots, 3 blocks
    assert blocks is not None and len(blocks.block_ids) == 3 and _counts(m) == (7, 0, 3)
    b0, b1, b2 = blocks.block_ids

    # every death is reported, also of blocks handed out anew: so far only those, nothing freed
    assert g.dead == [((b0, b1), False), ((b2,), False)]
    g.dead.clear()
    assert m.rollback(r, 12) == ()                        # the commit: nothing dropped, the groups told
    assert g.rollbacks == [((b0, b1, b2), 12)] and g.dead == [] and _counts(m) == (7, 0, 3)
    assert m.rollback(r, 7) == (b2,)                      # last and d1 kept: block 2 held only rejected d3..d5
    assert g.dead == [((b2,), False)] and g.rollbacks[-1] == ((b0, b1), 7)
    assert m.block_ids("r") == (b0, b1) and m.block_table("r").num_tokens == 7 and _counts(m) == (8, 0, 2)
    assert m.cache(r, 7) == 0                             # block 1 is not full of verified tokens
    again = m.allocate(r, 3)                              # the next step: 10 slots, a third block again
    assert again is not None and again.num_tokens == 10 and _counts(m) == (7, 0, 3)
    assert m.cache(r, 8) == 1                             # block 1 full and verified now

    with pytest.raises(ValueError, match="indexed 8"):
        m.rollback(r, 7)                                  # into an indexed block
    with pytest.raises(ValueError, match="holds 10 slots"):
        m.rollback(r, 11)
    with pytest.raises(KeyError):
        m.rollback("nobody", 0)
    assert (m.block_ids("r"), m.block_table("r").num_tokens) == (again.block_ids, 10)  # refused calls change nothing

    assert m.rollback(r, 8) == (again.block_ids[2],) and _counts(m) == (8, 0, 2)
    s = KVRequest("s", [1, 2, 3])
    m.allocate(s, 3)
    ids = m.block_ids("s")
    assert len(ids) == 1 and m.rollback(s, 0) == ids and m.rollback(s, 0) == ()  # nothing indexed: all of it
    assert m.block_ids("s") == () and m.block_table("s").num_tokens == 0 and _counts(m) == (8, 0, 2)
    assert m.free(r) and m.free(s)
    assert _counts(m) == (8, 2, 0)                        # the indexed blocks stay cached, nothing in use


# -- 2. slots_to_take with drafts: what the plan takes; a rollback leaves what a run without drafts holds ----


def _entries(t: TailTable, num_blocks: int) -> tuple:
    """What a tail holds, slot numbers aside."""
    return (frozenset(b for b in range(num_blocks) if t.slot_of(b) is not None), dict(t._window),
            frozenset(b for b in range(num_blocks) if t.sink_of(b) is not None))


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_slots_to_take_with_drafts_is_what_the_plan_takes_and_a_rollback_leaves_a_draft_free_state(
        data: st.DataObject) -> None:
    """Random chunks, draft lengths and kept lengths of one request: before each plan ``slots_to_take(num_draft)``
    equals the growth of used slots the plan with ``draft_lens`` makes; after the rollback nothing is
    provisional, and the blocks holding 16-bit slots, window copies and first-block copies are exactly those of
    a second tail fed the same kept tokens without drafts."""
    bs = data.draw(st.sampled_from([2, 4]), label="bs")
    w = data.draw(st.integers(0, 3), label="window")
    plen = data.draw(st.integers(0, 16), label="prompt")
    spec_t, ref_t = TailTable(bs, 64, 2, w), TailTable(bs, 64, 2, w)
    table = list(range(64))
    done = 0
    for _ in range(data.draw(st.integers(1, 10), label="steps")):
        n = data.draw(st.integers(1, 10), label="chunk")
        d = data.draw(st.integers(0, n), label="drafts")
        s = done + n
        before = spec_t.num_used
        need = spec_t.slots_to_take(table, done, n, plen, "r", num_draft=d)
        spec_t.plan([table], [s], [n], owners=["r"], prompt_lens=[plen], draft_lens=[d])
        assert need == max(0, spec_t.num_used - before)
        assert {b for b in table if spec_t.is_provisional(b)} == {
            table[j] for j in range(done // bs, s // bs) if (j + 1) * bs > s - d}
        spec_t.finish()
        keep = data.draw(st.integers(s - d, s), label="kept")
        kept = math.ceil(keep / bs)
        spec_t.release(table[kept:math.ceil(s / bs)])    # the KV cache frees the blocks past the kept ones
        spec_t.rollback(table[:kept], keep)
        assert not any(spec_t.is_provisional(b) for b in table)
        if keep > done:
            ref_t.plan([table], [keep], [keep - done], owners=["r"], prompt_lens=[plen])
            ref_t.finish()
        assert _entries(spec_t, 64) == _entries(ref_t, 64), (done, n, d, keep)
        done = keep
    spec_t.release(table)
    assert spec_t.num_used == spec_t.num_sink_used == 0


def test_without_drafts_slots_to_take_and_plan_are_unchanged() -> None:
    """``num_draft=0`` / ``draft_lens=None`` / all zeros: the same counts and the same plan as before."""
    for draft_lens in (None, [0]):
        t = TailTable(block_size=4, num_slots=4, num_sink_slots=1, window_blocks=1)
        assert t.slots_to_take(list(range(8)), 0, 10, 0, "r", num_draft=0) == t.slots_to_take(list(range(8)), 0, 10,
                                                                                               0, "r") == 2
        plan = t.plan([list(range(8))], [10], [10], owners=["r"], draft_lens=draft_lens)
        t.finish()
        assert [j for j, _, _ in plan.reads[0].sealed_now] == [0, 1]
        assert [b for b in range(8) if t.slot_of(b) is not None] == [1, 2] and not t.is_provisional(1)
    with pytest.raises(ValueError, match="draft_lens"):
        t.plan([list(range(8))], [11], [1], draft_lens=[12])
    with pytest.raises(ValueError, match="num_draft"):
        t.slots_to_take(list(range(8)), 10, 1, num_draft=12)


# -- 3. the provisional lifecycle --------------------------------------------------------------------


def test_rollback_into_a_provisionally_sealed_block_reopens_it_with_its_slot() -> None:
    """Prompt of 5 (block 0 sealed, block 1 open), then [last, d1..d5] at 5..10: block 1 fills holding drafts,
    so it is sealed (this step's later queries read it as stored) but keeps its slot. Keeping last and d1
    reopens it: same slot, the rows of its kept tokens where they were. Filled again by the true tokens it is
    sealed again and its slot goes at the end of that step."""
    t = TailTable(block_size=4, num_slots=3, num_sink_slots=1, window_blocks=0)
    table = [10, 11, 12]
    t.plan([table], [5], [5], owners=["r"], prompt_lens=[5])
    t.finish()
    slot = t.slot_of(11)
    assert slot is not None and t.slot_of(10) is None and t.sink_of(10) is not None
    plan = t.plan([table], [11], [6], owners=["r"], prompt_lens=[5], draft_lens=[5])
    rows = dict(zip(plan.tail_dst, plan.tail_src))
    assert [j for j, _, _ in plan.reads[0].sealed_now] == [1] and plan.seal_ids == (11,)
    assert all(rows[slot * 4 + p - 4] == p - 5 for p in range(5, 8))   # all its new rows kept in its slot
    t.finish()
    assert t.slot_of(11) == slot and t.is_provisional(11) and t.slot_of(12) is not None
    t.release([12])                                        # the KV cache frees block 2 (only d3..d5)
    t.rollback(table[:2], 7)
    assert t.slot_of(11) == slot and not t.is_provisional(11) and t.num_used == 1
    plan = t.plan([table[:2]], [8], [1], owners=["r"], prompt_lens=[5])   # the true token at 7 fills it again
    assert plan.seal_ids == (11,)
    assert plan.seal_from_tail_src == tuple(slot * 4 + i for i in range(3))  # positions 4..6 from the slot
    assert plan.reads[0].sealed_now == ((1, 0, slot),)
    t.finish()
    assert t.slot_of(11) is None and t.num_used == 0


def test_all_accepted_commit_drops_the_slot_or_keeps_it_as_the_window_copy() -> None:
    for w, kept_copy in ((0, False), (1, True)):
        t = TailTable(block_size=4, num_slots=4, num_sink_slots=1, window_blocks=w)
        table = [0, 1, 2]
        t.plan([table], [5], [5], owners=["r"], prompt_lens=[2])   # block 0 has generated tokens: a window block
        t.finish()
        t.plan([table], [9], [4], owners=["r"], prompt_lens=[2], draft_lens=[3])  # [last, d1..d3] fill block 1
        t.finish()
        assert t.is_provisional(1) and t.slot_of(1) is not None
        t.rollback(table, 9)                                # all accepted (the bonus token comes next step)
        assert not t.is_provisional(1) and (t.slot_of(1) is not None) == kept_copy, w
        assert (1 in t._window) == kept_copy
        assert t.slot_of(0) is None                         # outside the next query's window (w <= 1)
        assert t.slot_of(2) is not None                     # the open block


def test_rolled_back_into_block_0_the_first_block_copy_goes_and_the_reseal_makes_a_new_one() -> None:
    t = TailTable(block_size=4, num_slots=2, num_sink_slots=1, window_blocks=0)
    table = [5, 6]
    t.plan([table], [2], [2], owners=["r"], prompt_lens=[2])
    t.finish()
    t.plan([table], [6], [4], owners=["r"], prompt_lens=[2], draft_lens=[3])  # block 0 fills with drafts
    t.finish()
    assert t.sink_of(5) is not None and t.is_provisional(5)
    t.release([6])
    t.rollback(table[:1], 3)                                # only the last token was right
    assert t.sink_of(5) is None and t.slot_of(5) is not None and t.num_sink_used == 0
    plan = t.plan([table], [5], [2], owners=["r"], prompt_lens=[2])
    t.finish()
    assert plan.sink_pos == (0,) and t.sink_of(5) is not None and t.slot_of(5) is None


def test_a_drafters_pass_keeps_the_promise_and_the_slots_the_verification_pass_continues() -> None:
    """Over side groups: a pass that is not the step's final one (layer-skip's draft pass over the main group)
    retires nothing and keeps the step's promised groups; the verification pass then continues the block the
    draft pass sealed from its slot. A normal finish there would have freed the slot (and the re-plan raised)."""
    pool = PrefixBlockPool(32)
    t = TailTable(4, num_slots=8, num_sink_slots=0, window_blocks=0, side=SideGroups(pool, 4))
    table = list(pool.allocate(3))
    t.plan([table], [3], [3], owners=["r"])
    t.finish()
    assert t.side is not None and t.side.reserve(2)         # what the scheduler promised this step
    t.plan([table], [4], [1], owners=["r"])                 # draft pass: [last] fills block 0
    t.finish(release_spare=False)
    assert t.slot_of(table[0]) is not None and t.side.num_spare == 2
    t.plan([table], [5], [2], owners=["r"], draft_lens=[1])  # the draft pass of d1 (opens block 1)
    t.finish(release_spare=False)
    assert t.side.num_spare == 1
    plan = t.plan([table], [6], [3], owners=["r"], draft_lens=[2])  # verification of [last, d1, d2] from 3
    assert plan.seal_ids == (table[0],) and len(plan.seal_from_tail_src) == 3
    t.finish()
    assert t.side.num_spare == 0 and t.slot_of(table[0]) is None and t.slot_of(table[1]) is not None
    t.rollback(table[:2], 5)
    assert t.num_used == 1
    # the same passes with normal finishes: the draft pass frees block 0's slot and the re-plan cannot continue it
    u = TailTable(4, num_slots=2, num_sink_slots=0, window_blocks=0)
    u.plan([[0, 1]], [3], [3])
    u.finish()
    u.plan([[0, 1]], [4], [1])
    u.finish()
    with pytest.raises(KVPageError, match="no full-precision tail slot"):
        u.plan([[0, 1]], [6], [3], draft_lens=[2])


# -- 4. attention after a rollback reads what a run without drafts reads --------------------------------


def _engine_group(w: int, side: bool, num_blocks: int = 64):
    """A KV cache with one int4 group, its cache tensors and its group attention (reference path)."""
    bs = 4
    spec = CacheSpec.build(num_layers=1, num_kv_heads=2, head_dim=16, block_size=bs, kv_cache_dtype="int4")
    pool = PrefixBlockPool(num_blocks) if side else None
    group = manager_for(spec.main, CacheSizing(max_num_seqs=2, residual_tokens=w * bs, max_model_len=32), pool=pool)
    assert isinstance(group, SealedGroupManager) and (group.table.side is not None) == side
    m = KVCache(num_blocks, bs, groups=[group], pool=pool)
    caches = CacheController(spec).initialize_kv_cache(num_blocks)
    tail = TailPool(spec, group.layout, torch.float32, layers=list(group.layers), caches=caches)
    attn = group_attention_for(spec, spec.main, caches, tail=tail)
    return m, group, caches, attn


def _pass(m: KVCache, attn: GroupAttention, req: KVRequest, pos: int, q: torch.Tensor, k: torch.Tensor,
          v: torch.Tensor, d: int = 0) -> torch.Tensor:
    """One verification-style step of ``len(q)`` tokens at ``pos``, its last ``d`` unverified (lookahead slots):
    allocate (blocks and the chunk's tail slots, all or none), plan the pass, run the layer, commit the plan."""
    n, bs = q.shape[0], m.block_size
    m.begin_step()                                      # (the scheduler, before each step)
    if m.has_request(req.request_id):
        blocks = m.allocate(req, n - d, num_lookahead=d, num_computed=pos)
    else:
        blocks = m.allocate(req, n - d, m.match(req), num_lookahead=d)
    assert blocks is not None
    table = blocks.block_ids
    plan = m.plan_pass([PassRequest(req.request_id, pos, n, table, req.num_prompt_tokens or 0, d)])
    assert plan.slot_mapping == tuple(table[p // bs] * bs + p % bs for p in range(pos, pos + n))
    meta = AttentionMetadata.build(block_tables=plan.block_tables, seq_lens=plan.seq_lens,
                                   query_lens=plan.query_lens, slot_mapping=plan.slot_mapping, block_size=bs)
    attn.prepare(plan, plan.group(attn.group.name), meta, torch.device("cpu"))
    try:
        out = attn.attend(0, q, k, v)
    except BaseException:
        m.abort(plan)
        raise
    finally:
        attn.finish()
    m.commit(plan)
    return out


@pytest.mark.parametrize("w", [0, 1])
@pytest.mark.parametrize("side", [False, True])
def test_after_rolling_back_into_a_sealed_block_attention_equals_a_run_without_drafts(w: int, side: bool) -> None:
    """int4, block size 4, prompt of 5; then [t, d1..d5] at 5..10 (block 1 fills holding d2, d3); keep t and d1
    (rollback to 7: into the sealed block, block 2 back to the pool); then the true tokens in chunks of 1, 3, 1,
    1, 4. Every continued token's attention output equals (float32) that of a run that never saw the drafts,
    and so do t's and d1's in the verification pass, and the sealed blocks' pool bytes."""
    torch.manual_seed(0)
    total, kvh, heads, d = 17, 2, 4, 16
    q, k, v = torch.randn(total, heads, d), torch.randn(total, kvh, d), torch.randn(total, kvh, d)
    k[:, :, 3] *= 20
    qd, kd, vd = torch.randn(4, heads, d), torch.randn(4, kvh, d), torch.randn(4, kvh, d)  # wrong drafts d2..d5
    runs = []
    for spec_run in (True, False):
        m, group, caches, attn = _engine_group(w, side)
        req = KVRequest("r", list(range(total)), num_prompt_tokens=5)
        outs: dict[int, torch.Tensor] = {}
        o = _pass(m, attn, req, 0, q[:5], k[:5], v[:5])
        m.cache(req, 5)
        if spec_run:
            o = _pass(m, attn, req, 5, torch.cat([q[5:7], qd]), torch.cat([k[5:7], kd]), torch.cat([v[5:7], vd]),
                      d=5)
            outs.update({5: o[0], 6: o[1]})
            assert group.table.is_provisional(m.block_ids("r")[1])
            assert len(m.rollback(req, 7)) == 1                  # block 2 held only d3..d5
            assert not group.table.is_provisional(m.block_ids("r")[1])
            assert group.table.slot_of(m.block_ids("r")[1]) is not None
        else:
            o = _pass(m, attn, req, 5, q[5:7], k[5:7], v[5:7])
            outs.update({5: o[0], 6: o[1]})
            m.rollback(req, 7)                                   # the commit of a step without drafts
        pos = 7
        for n in (1, 3, 1, 1, 4):
            o = _pass(m, attn, req, pos, q[pos:pos + n], k[pos:pos + n], v[pos:pos + n])
            m.rollback(req, pos + n)
            outs.update({pos + i: o[i] for i in range(n)})
            pos += n
        table = m.block_ids("r")
        sealed = {name: t[list(table[: total // 4])].clone() for name, t in caches[0].items()}
        held = group.table.num_used
        m.free(req)
        assert group.table.num_used == 0 and m.stats().num_in_use == 0
        runs.append((outs, sealed, held))
    (spec_outs, spec_sealed, spec_held), (ref_outs, ref_sealed, ref_held) = runs
    assert sorted(spec_outs) == list(range(5, total))
    for p in spec_outs:
        assert torch.allclose(spec_outs[p], ref_outs[p], atol=1e-6, rtol=0), p
    for name in spec_sealed:
        assert torch.equal(spec_sealed[name].view(torch.uint8), ref_sealed[name].view(torch.uint8)), name
    assert spec_held == ref_held


def test_fixed_tails_get_room_for_the_provisional_blocks_of_the_lookahead() -> None:
    """``ceil(k / block_size)`` more 16-bit slots per request for ``k`` lookahead tokens (the blocks drafts fill keep
    theirs until verified); without speculation the sizes are unchanged."""
    spec = CacheSpec.build(num_layers=1, num_kv_heads=2, head_dim=16, block_size=4, kv_cache_dtype="int4")
    sizes = []
    for k in (0, 3, 4, 5):
        g = manager_for(spec.main, CacheSizing(max_num_seqs=3, residual_tokens=4, num_lookahead_tokens=k))
        assert isinstance(g, SealedGroupManager)
        sizes.append((g.table.num_slots, g.table.window_blocks))
    assert sizes == [(6, 1), (9, 1), (9, 1), (12, 1)]
    with pytest.raises(ValueError, match="num_lookahead_tokens"):
        manager_for(spec.main, CacheSizing(max_num_seqs=3, residual_tokens=4, num_lookahead_tokens=-1))
