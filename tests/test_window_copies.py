"""8-bit window copies (issue 34: ``int2`` within 3.0 bits at 1,024 tokens): a format whose ``window_bits`` is 8
keeps the window's sealed blocks as ``int8`` copies in the 8-bit (first-block copy) slots instead of their 16-bit
slots. Exact bookkeeping of the table (which slot each block holds after each step, decode, drafts and rollback,
pressure, side groups), the rows read against an int8 round trip of the written rows, and the engine's answer
against a run whose window copies are 16-bit (a dequantized copy of the same rows: close, not equal)."""
from __future__ import annotations

import pytest
import torch

from _forced import teacher_forced_logits
from _tiny import tiny_loaded
from kvpage import LLM, SamplingParams
from kvpage.cache.prefix_cache import PrefixBlockPool
from kvpage.cache.tail import TailTable
from kvpage.cache.tail.pool import SINK_FORMAT, TailPool
from kvpage.cache.tail.side import SideGroups
from kvpage.cache.controller import CacheController
from kvpage.formats import KEY, VALUE, get_format
from kvpage.ops.sealed_attention import read_sealed_context, write_sealed_kv
from kvpage.spec import CacheSpec, TailLayout


def test_int2_formats_keep_int8_window_copies_where_the_copy_slot_holds_a_whole_block() -> None:
    for name in ("int2", "int2_rotated"):
        assert get_format(name).window_copy_bits(32) == 8
        # only the open block's 6 tokens are held in 16 bits (the window's 32: int8 copies)
        assert get_format(name).full_precision_tokens(num_tokens=1030, block_size=32, residual_tokens=32) == 6
    assert get_format("int4").full_precision_tokens(num_tokens=1030, block_size=32, residual_tokens=32) == 38
    # formats whose 8-bit copy holds row 0 alone, or that keep no window, keep 16-bit copies when given a window
    for name in ("int4", "int4_rotated", "int3", "int3_rotated"):
        assert get_format(name).window_copy_bits(32) == 16
    with pytest.raises(ValueError, match="window_bits"):
        TailTable(block_size=4, num_slots=2, num_sink_slots=0, window_blocks=1, window_bits=8)
    with pytest.raises(ValueError, match="window_bits"):
        TailTable(block_size=4, num_slots=2, num_sink_slots=2, window_blocks=1, window_bits=12)


def test_decode_keeps_the_window_in_8_bit_slots_and_frees_the_16_bit_slot_at_the_seal() -> None:
    t = TailTable(block_size=2, num_slots=4, num_sink_slots=6, window_blocks=1, window_bits=8)
    table = [10, 11, 12, 13]
    plan = t.plan([table[:3]], [5], [5])         # blocks 10, 11 sealed (10: first-block copy, 11: window copy)
    t.finish()
    assert plan.seal_ids == (10, 11)
    assert plan.sink_pos == (0, 1) and plan.sink_slots == (t.sink_of(10), t.window_copy_of(11))
    assert (t.slot_of(10), t.slot_of(11), t.slot_of(12) is not None) == (None, None, True)  # 16 bits: the open one
    assert plan.reads[0].copy_blocks == ((1, t.window_copy_of(11)),) and plan.reads[0].fp_blocks == ()
    assert (t.num_used, t.num_sink_used, t.num_window_copies) == (1, 1, 1)
    copy11 = t.window_copy_of(11)
    plan = t.plan([table[:3]], [6], [1])         # block 12 seals: its query reads 11's copy and its own rows
    read = plan.reads[0]
    assert read.copy_blocks == ((1, copy11),) and read.sealed_now == ((2, 0, t.slot_of(12)),)
    assert plan.sink_pos == (0,) and plan.sink_slots == (t.window_copy_of(12),)
    t.finish()                                   # 12's 16-bit slot and 11's copy (out of every later window) go
    assert (t.slot_of(12), t.window_copy_of(11), t.num_used, t.num_window_copies) == (None, None, 0, 1)
    plan = t.plan([table], [7], [1])             # the next query: window = block 12, read from its copy
    t.finish()
    assert plan.reads[0].copy_blocks == ((2, t.window_copy_of(12)),) and plan.sink_pos == ()
    assert (t.num_used, t.num_sink_used, t.num_window_copies) == (1, 1, 1)
    t.release(table)
    assert (t.num_used, t.num_sink_used, t.num_window_copies) == (0, 0, 0)
    assert t._sink_slots.num_free == 6 and t._slots.num_free == 4


def test_block_0_in_the_window_is_read_through_its_whole_block_first_block_copy() -> None:
    t = TailTable(block_size=4, num_slots=2, num_sink_slots=2, window_blocks=1, window_bits=8)
    plan = t.plan([[3, 4]], [5], [5])            # block 3 seals inside the next query's window
    t.finish()
    assert plan.sink_pos == (0,) and t.window_copy_of(3) is None and t.sink_of(3) is not None
    plan = t.plan([[3, 4]], [6], [1])
    t.finish()
    assert plan.reads[0].copy_blocks == () and plan.reads[0].sink_slot == t.sink_of(3)


def test_prompt_blocks_and_other_owners_get_no_window_copy() -> None:
    t = TailTable(block_size=2, num_slots=4, num_sink_slots=6, window_blocks=1, window_bits=8)
    plan = t.plan([[0, 1, 2]], [5], [5], owners=["a"], prompt_lens=[5])  # blocks 0, 1: prompt tokens only
    t.finish()
    assert t.window_copy_of(1) is None and plan.reads[0].copy_blocks == ()
    t.plan([[0, 1, 2]], [6], [1], owners=["a"], prompt_lens=[5])         # block 2 holds a generated token
    t.finish()
    assert t.window_copy_of(2) is not None
    plan = t.plan([[0, 1, 2, 3]], [7], [1], owners=["b"], prompt_lens=[6])  # b shares a's blocks: not a's copy
    t.finish()
    assert plan.reads[0].copy_blocks == ()
    plan = t.plan([[0, 1, 2, 4]], [7], [1], owners=["a"], prompt_lens=[5])
    t.finish()
    assert plan.reads[0].copy_blocks == ((2, t.window_copy_of(2)),)


def test_drafts_keep_their_16_bit_rows_and_a_copy_until_rollback_decides() -> None:
    """A provisional block in the window gets its int8 copy (what every later query of the pass, and decoding
    without drafts, reads) and keeps its 16-bit slot (a rollback reopens the block from it); verified, the slot
    goes and the copy stays; reopened, the copy goes and the slot is the open slot again."""
    def fresh() -> TailTable:
        t = TailTable(block_size=2, num_slots=6, num_sink_slots=8, window_blocks=1, window_bits=8)
        t.plan([[0, 1, 2]], [5], [5])
        t.finish()
        return t

    table = [0, 1, 2, 3]
    for keep in (8, 7):
        t = fresh()
        plan = t.plan([table], [8], [3], draft_lens=[2])  # 1 verified token (block 2 fills) + 2 drafts (block 3)
        t.finish()
        assert [x[:2] for x in plan.reads[0].sealed_now] == [(2, 0), (3, 1)]  # (2's slot: freed by finish)
        assert plan.reads[0].sealed_now[1][2] == t.slot_of(3)
        assert plan.sink_slots == (t.window_copy_of(2), t.window_copy_of(3))
        assert t.slot_of(2) is None and t.is_provisional(3) and t.slot_of(3) is not None
        t.rollback(table, keep)
        if keep == 8:                            # verified: block 3 is sealed for good, its copy is the window
            assert (t.slot_of(3), t.window_copy_of(3) is not None, t.window_copy_of(2)) == (None, True, None)
            assert (t.num_used, t.num_window_copies) == (0, 1)
        else:                                    # reopened: block 3 is the open block again, 2's copy the window
            assert (t.slot_of(3) is not None, t.window_copy_of(3), t.window_copy_of(2) is not None) == (True, None, True)
            plan = t.plan([table], [8], [1])     # and seals anew from its slot
            t.finish()
            assert plan.sink_slots == (t.window_copy_of(3),) and plan.reads[0].copy_blocks == ((2, plan.reads[0].copy_blocks[0][1]),)
            assert (t.slot_of(3), t.window_copy_of(2)) == (None, None)


def test_window_copies_are_optional_under_pressure_first_block_copies_are_not() -> None:
    """Fixed 8-bit slots all held: a new window copy takes the oldest window copy of a request outside the step
    (else none: its block is read as sealed), and a first-block copy takes a window copy's slot before giving up."""
    t = TailTable(block_size=2, num_slots=8, num_sink_slots=3, window_blocks=1, window_bits=8)
    t.plan([[0, 1, 2]], [5], [5], owners=["a"])   # a: sink of 0, window copy of 1
    t.finish()
    t.plan([[3, 4, 5]], [5], [5], owners=["b"])   # b: sink of 3; its window copy takes a's (the last free slot taken)
    t.finish()
    assert (t.sink_of(0) is not None, t.sink_of(3) is not None) == (True, True)
    assert (t.window_copy_of(1), t.window_copy_of(4) is not None) == (None, True)
    plan = t.plan([[0, 1, 2]], [6], [1], owners=["a"])  # a's block 2 seals: b's copy goes to it
    t.finish()
    assert plan.reads[0].copy_blocks == () and t.window_copy_of(4) is None and t.window_copy_of(2) is not None
    plan = t.plan([[6, 7]], [3], [3], owners=["c"])     # c's first block takes a's window copy's slot
    t.finish()
    assert t.sink_of(6) is not None and t.window_copy_of(2) is None and t.num_sink_used == 3


def test_two_8_bit_copies_share_a_carved_group_and_the_scheduler_counts_the_groups() -> None:
    """Over side groups (int2: a 16-bit slot's group holds two whole-block int8 copies) a request's first-block copy
    and its window copy share one group; ``copies_to_take`` counts the copies a chunk makes, less those it pushes
    out of the window; the held groups are always the open slots' plus the copies' distinct groups."""
    pool = PrefixBlockPool(64)
    side = SideGroups(pool, 4)
    t = TailTable(block_size=4, num_slots=side.num_groups, num_sink_slots=2 * side.num_groups, window_blocks=1,
                  side=side, window_bits=8)
    ids = pool.allocate(4)
    assert t.copies_to_take(ids, 0, 9) == 1       # blocks 0, 1 sealed: block 1's window copy (block 0: its sink)
    plan = t.plan([ids[:3]], [9], [9])
    t.finish()
    assert (t.num_used, t.num_sink_used, t.num_window_copies, t.num_sink_groups) == (1, 1, 1, 1)
    assert t.sink_of(ids[0]) // 2 == t.window_copy_of(ids[1]) // 2  # one group holds both
    assert side.num_held == t.num_used + t.num_sink_groups == 2
    assert t.copies_to_take(ids[:3], 9, 3) == 1   # block 2 fills: a copy (block 1's goes after that step)
    t.plan([ids[:3]], [12], [3])
    t.finish()
    # during that step 1's copy was read while 2's was written: 2's took a second group, 1's then went
    assert (t.window_copy_of(ids[1]), t.num_window_copies, t.num_sink_groups, t.num_used) == (None, 1, 2, 0)
    assert side.num_held == 2 and len(t._part_free) == 2
    assert t.copies_to_take(ids, 12, 4) == 1      # block 3 fills: its copy takes the first-block copy's free half
    plan = t.plan([ids], [16], [4])
    t.finish()
    assert t.window_copy_of(ids[3]) // 2 == t.sink_of(ids[0]) // 2 and t.window_copy_of(ids[2]) is None
    assert (t.num_window_copies, t.num_sink_groups, side.num_held) == (1, 1, 1)  # 2's group went with its copy
    t.release(ids)
    assert (side.num_held, pool.num_side, t.num_sink_groups) == (0, 0, 0)
    assert [j for j, _ in plan.reads[0].copy_blocks] == [2]  # (the step sealing block 3 read 2's copy)


def test_rows_read_from_an_8_bit_window_copy_are_the_int8_round_trip_of_the_written_rows() -> None:
    """The reference read of a window block is the int8 (per token and head) round trip of its rows in the tail
    dtype -- exactly -- and every other sealed block its codes dequantized."""
    bs = 4
    spec = CacheSpec.build(num_layers=1, num_kv_heads=2, head_dim=64, block_size=bs, kv_cache_dtype="int2")
    layer, fmt = spec.layer(0), spec.layer(0).format
    layout = TailLayout(num_slots=2, num_sink_slots=4, window_blocks=1, window_bits=8)
    table = TailTable(bs, 2, 4, 1, window_bits=8)
    pool = TailPool(spec, layout, torch.float32)
    cache = CacheController(spec).initialize_kv_cache(4)[0]
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(10, 2, 64, generator=gen) for _ in range(2))
    ctx = pool.context(table.plan([[2, 0, 3]], [10], [10]))
    write_sealed_kv(cache, pool.layers[0], fmt, ctx, bs, k, v)
    read = ctx.plan.reads[0]
    assert [j for j, _ in read.copy_blocks] == [1]
    keys, vals = read_sealed_context(cache, pool.layers[0], fmt, SINK_FORMAT, layer, read, torch.float32)
    for got, x, kind in ((keys, k, KEY), (vals, v, VALUE)):
        rows = x[bs:2 * bs].to(pool.dtype)
        q = SINK_FORMAT.quantize(rows, kind=kind)
        want = SINK_FORMAT.dequantize(q.codes, q.scale, torch.float32, kind=kind)
        assert torch.equal(got[bs:2 * bs], want)
        assert not torch.equal(got[bs:2 * bs], rows.float())  # (an int8 copy, not the 16-bit rows)
        assert (got[bs:2 * bs] - rows.float()).abs().max() <= x[bs:2 * bs].abs().amax() / 127
        assert torch.equal(got[2 * bs:], x[2 * bs:].to(pool.dtype).float())  # the open block's 16-bit rows


@pytest.mark.parametrize("fmt", ["int2", "int2_rotated"])
def test_engine_logits_close_to_16_bit_window_copies(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny model fed 30 prompt and 60 answer tokens one step at a time on ``fmt`` with an 8-token window (a copy
    made and one dropped at every block end): the logits with 8-bit window copies within a small distance of the
    same run with 16-bit copies, which must differ (the copies are read), and closer to them than the run without
    a window is."""
    prompt, answer = list(range(5, 35)), [(7 * i) % 250 for i in range(60)]

    def logits(window_bits: int, residual: int) -> torch.Tensor:
        monkeypatch.setattr(type(get_format(fmt)), "window_bits", window_bits)
        llm = LLM(tiny_loaded(), kv_cache_dtype=fmt, block_size=8, progress=False,
                  kv_quant_residual_tokens=residual)
        return teacher_forced_logits(llm, prompt, answer)

    eight, sixteen, none = logits(8, 8), logits(16, 8), logits(8, 0)
    assert not torch.equal(eight, sixteen)
    d8, dnone = (eight - sixteen).abs().max().item(), (none - sixteen).abs().max().item()
    assert d8 < 0.05 * sixteen.abs().max().item() and d8 < dnone, (d8, dnone)


def test_a_failed_passs_window_copy_is_never_read_after_a_later_seal_outside_the_window() -> None:
    """Regression (found in review): a copy booked by a plan whose pass raised survived when a rescheduled run
    sealed the block outside the window, and the next read named its slot, whose rows were never written."""
    t = TailTable(block_size=4, num_slots=8, num_sink_slots=8, window_blocks=1, window_bits=8)
    ids = [10, 11, 12, 13]
    t.plan([ids[:2]], [6], [6])
    t.finish()
    plan = t.plan([ids[:2]], [8], [2])                # block 11 fills inside the window: a copy is booked ...
    assert plan.seal_ids == (11,) and plan.sink_pos == (0,) and t.window_copy_of(11) is not None
    t.abort()                                         # ... but the pass raised
    t.plan([ids[:2]], [7], [1])                       # rescheduled shorter: 11 stays open
    t.finish()
    plan = t.plan([ids], [16], [9])                   # 11 sealed again, now outside the last query's window
    written = {plan.seal_ids[p]: slot for p, slot in zip(plan.sink_pos, plan.sink_slots)}
    assert t.window_copy_of(11) is None
    assert all(written.get(ids[j]) == slot for j, slot in plan.reads[0].copy_blocks), (plan.reads[0], written)


def test_the_scheduler_promises_a_group_per_window_copy_whatever_the_free_parts() -> None:
    """Regression (found in review): each chunk subtracted the same free parts of held groups, so two requests
    making a window copy in one step counted one free part twice; a copy then took the group promised to a third
    request's open slot and the plan raised OutOfBlocksError. Now every copy is promised a group (unused promises
    go back after the step), and a step the pool cannot promise is refused before it runs instead."""
    from types import SimpleNamespace

    from kvpage.cache.groups.sealed import SealedGroupManager

    for blocks in (32, 64):
        pool = PrefixBlockPool(blocks)
        side = SideGroups(pool, 4)
        t = TailTable(4, side.num_groups, 2 * side.num_groups, 1, side, window_bits=8)
        mgr = SimpleNamespace(table=t)                # slots_needed reads the table alone

        def need(rid: str, ids: list[int], start: int, n: int) -> int:
            req = SimpleNamespace(request_id=rid, num_prompt_tokens=8)
            return SealedGroupManager.slots_needed(mgr, req, ids, start, n)[0]

        a, b, c = pool.allocate(3), pool.allocate(3), pool.allocate(2)
        assert side.reserve(need("a", [], 0, 11) + need("b", [], 0, 11) + need("c", [], 0, 8))
        t.plan([a, b, c], [11, 11, 8], [11, 11, 8], owners="abc", prompt_lens=[8, 8, 8])
        t.finish()
        assert len(t._part_free) == 1
        c += pool.allocate(1)
        needs = [need("a", a, 11, 1), need("b", b, 11, 1), need("c", c, 8, 1)]
        assert needs == [1, 1, 1]                     # a and b: a copy each; c: its new open slot
        if not side.reserve(sum(needs)):              # 32 blocks: the step waits (no plan runs)
            assert blocks == 32
            continue
        plan = t.plan([a, b, c], [12, 12, 9], [1, 1, 1], owners="abc", prompt_lens=[8, 8, 8])
        t.finish()
        assert len(plan.sink_pos) == 2 and t.window_copy_of(a[2]) is not None and t.window_copy_of(b[2]) is not None


@pytest.mark.parametrize("carved", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_randomized_schedules_read_only_the_latest_seal_of_a_block(seed: int, carved: bool) -> None:
    """Random steps of up to four requests (prompts, decode, verification passes with drafts, a drafter's pass
    before them, passes that raise and are re-run shorter, rollbacks, finished requests) on fixed pools or carved
    groups: every 8-bit slot a read names holds the latest seal of that block (a failed pass's writes count as
    garbage), no slot is booked twice, the carved groups' parts add up, and releasing everything frees everything."""
    import random
    from collections import Counter

    rng = random.Random(seed)
    bs, w = 4, rng.choice([1, 2])
    pool = PrefixBlockPool(400) if carved else None
    side = SideGroups(pool, 4) if pool is not None else None
    t = (TailTable(bs, side.num_groups, 2 * side.num_groups, w, side, window_bits=8) if side is not None
         else TailTable(bs, 40, rng.choice([2, 3, 5, 8]), w, window_bits=8))
    fresh = iter(range(10**6))

    def alloc(n: int) -> list[int]:
        return pool.allocate(n) if pool is not None else [next(fresh) for _ in range(n)]

    def free(ids: list[int]) -> None:
        t.release(ids)
        if pool is not None and ids:
            pool.release(ids)

    content: dict[int, tuple] = {}                    # 8-bit slot -> (block, its seal count) written last
    seals: Counter = Counter()

    def consistent() -> None:
        slots = list(t._sink.values()) + [s for _, s in t._wcopy.values()]
        assert len(slots) == len(set(slots))
        if side is not None:
            c = t.sinks_per_group
            per = Counter(s // c for s in slots)
            assert dict(per) == t._group_copies
            assert t._part_free == {x for g in per for x in range(c * g, c * g + c)} - set(slots)
            assert side.num_held == t.num_used + t.num_sink_groups + side.num_spare

    def run(batch: list[str], drafts: list[int], final: bool = True, fail: bool = False) -> None:
        tables = [reqs[r]["ids"] for r in batch]
        ops = t.plan(tables, [reqs[r]["s"] for r in batch], [reqs[r]["n"] for r in batch], owners=batch,
                     prompt_lens=[reqs[r]["plen"] for r in batch], draft_lens=drafts)
        seals.update(ops.seal_ids)
        for p, slot in zip(ops.sink_pos, ops.sink_slots):
            content[slot] = (ops.seal_ids[p], seals[ops.seal_ids[p]])
        for read, table in zip(ops.reads, tables):
            for j, slot in read.copy_blocks:
                assert content.get(slot) == (table[j], seals[table[j]])
        if fail:
            t.abort()
            for slot in ops.sink_slots:
                content[slot] = ("garbage",)
        else:
            t.finish(release_spare=final)
        consistent()

    reqs: dict[str, dict] = {}
    for step in range(150):
        if len(reqs) < 4 and rng.random() < 0.3:
            reqs[f"r{step}"] = dict(ids=[], s=0, n=0, d=0, plen=rng.randint(1, 12), verified=0)
        if not reqs:
            continue
        batch = rng.sample(sorted(reqs), rng.randint(1, len(reqs)))
        speculate = rng.random() < 0.3
        drafts = []
        for r in batch:
            q = reqs[r]
            if q["verified"] < q["plen"]:
                n, d = rng.randint(1, q["plen"] - q["verified"]), 0
            else:
                d = rng.randint(1, 4) if speculate else 0
                n = (rng.randint(1, 6) if rng.random() < 0.3 else 1) + d
            q.update(s=q["verified"] + n, n=n, d=d)
            q["ids"] += alloc(max(0, -(-q["s"] // bs) - len(q["ids"])))
            drafts.append(d)
        if speculate and rng.random() < 0.5:
            run(batch, drafts, final=False)           # a drafter's pass over the same positions
        if rng.random() < 0.15:
            run(batch, drafts, fail=True)             # a pass that raised; the re-run is shorter, without drafts
            if rng.random() < 0.5:
                batch = rng.sample(batch, rng.randint(1, len(batch)))
                drafts = []
                for r in batch:
                    q = reqs[r]
                    n = rng.randint(1, max(1, q["n"] - q["d"]))
                    q.update(n=n, s=q["verified"] + n, d=0)
                    drafts.append(0)
        run(batch, drafts)
        for r, d in zip(batch, drafts):
            q = reqs[r]
            keep = q["s"] - (rng.randint(0, d) if d else 0)
            if d:
                nb = -(-keep // bs)
                dropped, q["ids"] = q["ids"][nb:], q["ids"][:nb]
                t.rollback(q["ids"], keep)
                free(dropped)
                consistent()
            q.update(verified=keep, s=keep)
            if keep > 60 or rng.random() < 0.03:
                free(q["ids"])
                del reqs[r]
    for q in reqs.values():
        free(q["ids"])
    consistent()
    assert not t._slot and not t._sink and not t._wcopy
    assert (side.num_held if side is not None else t.num_sink_slots - t._sink_slots.num_free) == 0
