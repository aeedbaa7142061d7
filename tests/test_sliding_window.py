"""Sliding-window layer groups whose memory is bounded by the window (issue 15 item 2).

The ``sliding`` group of a model with windowed layers beside full-attention ones keeps its KV in window slots
(:class:`~kvpage.cache.groups.SlidingWindowManager`). Checked here: exact slot accounting through admission,
advance, caching, eviction, rollback and free (``free + pinned + cached == slots`` after every operation); the
prefix rule (a hit is usable only while the blocks inside the window of its end hold slots); an engine whose
window slots are reused many times still matches transformers; peak memory of a long request stays within the
window share; a pool short of slots defers requests instead of failing (tiers: ``test_sliding_tiers.py``).
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kvpage.cache.groups import FullAttentionManager, SlidingWindowManager
from kvpage.cache.groups.sliding import WindowSlotsExhaustedError
from kvpage.cache.kv_cache import KVCache
from kvpage.cache.prefix_cache import PrefixBlockPool
from kvpage.cache.requests import KVRequest
from kvpage.cache.step_plan import PassRequest
from kvpage.spec import CacheSizing, CacheSpec

from _kv_kinds import window_of

BS, W = 4, 6  # a query reads its 6 last positions: blocks from (p - 5) // 4 on


def _manager(num_blocks: int = 32, num_slots: int = 8) -> tuple[KVCache, SlidingWindowManager]:
    spec = CacheSpec.build(num_layers=3, num_kv_heads=1, head_dim=8, block_size=BS, layer_windows=[W, None, W])
    assert spec.sliding is not None
    pool = PrefixBlockPool(num_blocks)
    win = SlidingWindowManager(spec.sliding, num_slots, pool)
    mgr = KVCache(num_blocks, BS, groups=[FullAttentionManager(spec.main, pool), win], pool=pool)
    return mgr, win


def _check(win: SlidingWindowManager, mgr: KVCache) -> None:
    """Slot accounting is exact; every block a live request's window reaches holds a distinct slot."""
    assert win.num_free_slots + win.num_pinned_slots + win.num_cached_slots == win.num_slots
    slots = [win.slot_of(b) for b in range(mgr.num_blocks) if win.slot_of(b) is not None]
    assert len(slots) == len(set(slots)) == win.num_slots - win.num_free_slots
    st = mgr.stats()
    assert st.num_free + st.num_evictable + st.num_in_use == mgr.num_blocks


def _req(rid: str, tokens: list[int]) -> KVRequest:
    return KVRequest(rid, list(tokens))


def _pass(mgr: KVCache, req: KVRequest, start: int, upto: int) -> None:
    """The step's final pass over ``req``'s tokens ``[start, upto)`` (it releases the window slots that slid
    out), committed, then its full blocks indexed."""
    rid = req.request_id
    mgr.commit(mgr.plan_pass([PassRequest(rid, start, upto - start, mgr.block_ids(rid))]))
    mgr.cache(req, upto)


def _run(mgr: KVCache, win: SlidingWindowManager, req: KVRequest, upto: int) -> None:
    """Admit (or extend) ``req`` to ``upto`` tokens as the scheduler and a final pass would, then index."""
    mgr.begin_step()
    if not mgr.has_request(req.request_id):
        m = mgr.match(req)
        start = m.num_computed_tokens
        assert mgr.allocate(req, upto - start, m) is not None   # blocks and the window slots, promised
    else:
        start = mgr.block_table(req.request_id).num_tokens
        assert mgr.allocate(req, upto - start) is not None
    _pass(mgr, req, start, upto)
    _check(win, mgr)


def test_slots_follow_the_window_and_cached_blocks_keep_theirs() -> None:
    mgr, win = _manager()
    a = _req("a", list(range(100, 124)))  # 6 blocks
    _run(mgr, win, a, 10)                 # blocks 0..2 pinned
    assert win.num_pinned_slots == 3 and win.num_free_slots == 5
    for t in range(11, 25):               # decode to 24 tokens
        _run(mgr, win, a, t)
        # the next query (position t - 1) reads blocks from first_block(t - 1) on: nothing before is pinned
        first = win.first_block(t - 1)
        assert win.num_pinned_slots == len(mgr.block_ids("a")) - first
    # blocks that slid out were indexed when they filled: they kept their slots, evictable
    assert win.num_cached_slots == 8 - win.num_pinned_slots - win.num_free_slots > 0
    mgr.free(a)
    _check(win, mgr)
    assert win.num_pinned_slots == 0


def test_prefix_hit_needs_the_window_of_its_end_and_shrinks_when_slots_were_evicted() -> None:
    mgr, win = _manager(num_slots=8)
    tokens = list(range(200, 229))        # 29 tokens: 7 full blocks
    a = _req("a", tokens)
    for t in range(8, 30, 4):
        _run(mgr, win, a, t)
    mgr.free(a)
    # the window of a 28-token hit is blocks 5 and 6 ((28 - 5) // 4 = 5): held, so the whole hit is usable
    b = _req("b", tokens)
    assert mgr.match(b).num_cached_tokens == 28
    # another request's new blocks take every free and cached slot: the hit loses its window, then shrinks
    c = _req("c", list(range(900, 932)))
    _run(mgr, win, c, 32)
    assert win.num_cached_slots == 0
    m = mgr.match(b)
    assert m.num_cached_tokens == 0       # no block of a's chain kept a slot
    mgr.free(c)
    _check(win, mgr)


def test_usable_prefix_rule_by_hand() -> None:
    mgr, win = _manager(num_slots=8)
    ids = [5, 6, 7, 8]
    for b in (6, 7):                      # slots for blocks 6, 7 only
        win._slot[b] = win._free.pop()
    # L = 4 needs blocks (16 - 5) // 4 = 2 .. 3 -> 7 and 8: 8 has none; L = 3 needs blocks 1 .. 2 -> 6, 7: held
    assert win.usable_prefix(ids) == 3
    assert win.usable_prefix([5]) == 0    # L = 1 needs block 0 (5): none
    assert win.usable_prefix([]) == 0


def test_rollback_and_free_return_every_slot() -> None:
    mgr, win = _manager()
    a = _req("a", list(range(300, 340)))
    _run(mgr, win, a, 9)
    mgr.begin_step()
    assert mgr.allocate(a, 8) is not None  # 17 slots: 5 blocks, two of them for drafts (window slots promised)
    pinned = win.num_pinned_slots
    freed = mgr.rollback(a, 10)           # drafts rejected: blocks 3, 4 go back with their slots
    assert len(freed) == 2 and win.num_pinned_slots == pinned - 2
    _check(win, mgr)
    mgr.free(a)
    # blocks 0 and 1 were indexed (9 tokens computed): they keep their slots; the others' came back
    assert win.num_pinned_slots == 0 and win.num_cached_slots == 2 and win.num_free_slots == win.num_slots - 2
    _check(win, mgr)


def test_promises_bound_what_a_step_may_take() -> None:
    mgr, win = _manager(num_slots=4)
    a, b = _req("a", list(range(40))), _req("b", list(range(500, 540)))
    mgr.begin_step()
    assert [g.slots_needed(a, (), 0, 12) for g in mgr.groups] == [(), (3,)]  # 3 new blocks of the sliding group
    assert mgr.allocate(a, 12, mgr.match(a)) is not None
    before = (mgr.stats(), win.num_free_slots, win.num_pinned_slots)
    assert [g.slots_needed(b, (), 0, 8) for g in mgr.groups] == [(), (2,)]
    assert not mgr.can_allocate(b, 8, mgr.match(b))
    assert mgr.allocate(b, 8, mgr.match(b)) is None   # 3 + 2 > 4 slots: nothing promised, nothing allocated
    assert not mgr.has_request("b") and (mgr.stats(), win.num_free_slots, win.num_pinned_slots) == before
    assert [g.slots_needed(b, (), 0, 4) for g in mgr.groups] == [(), (1,)]
    assert mgr.allocate(b, 4, mgr.match(b)) is not None
    assert win.num_free_slots == 0 and win.num_pinned_slots == 4
    c = _req("c", list(range(700, 710)))
    mgr.begin_step()
    assert mgr.allocate(c, 4, mgr.match(c)) is None    # its slot cannot be promised: no slot left
    assert not mgr.has_request("c")
    # and a table that grows without a promise (allocated past the cache's allocate) finds no slot
    with pytest.raises(WindowSlotsExhaustedError, match=r"without promising its slots \(reserve\)"):
        win.on_request_blocks("c", [30], 0)


def test_random_operations_keep_exact_slot_accounting() -> None:
    """Random admissions (shared prefixes), decode steps, frees and evictions: accounting exact throughout."""
    rng = random.Random(7)
    mgr, win = _manager(num_blocks=40, num_slots=12)
    live: dict[str, KVRequest] = {}
    prefixes = [list(range(1000 * k, 1000 * k + 40)) for k in range(3)]
    for step in range(400):
        op = rng.random()
        mgr.begin_step()
        if op < 0.3 and len(live) < 3:
            rid = f"r{step}"
            base = rng.choice(prefixes)
            req = _req(rid, base[: rng.randint(5, 20)] + [rng.randint(5000, 6000) for _ in range(20)])
            m = mgr.match(req)
            n = min(len(req.all_token_ids), m.num_cached_tokens + rng.randint(1, 6)) - m.num_cached_tokens
            if mgr.allocate(req, n, m) is None:
                continue
            _pass(mgr, req, m.num_cached_tokens, m.num_cached_tokens + n)
            live[rid] = req
        elif op < 0.8 and live:
            rid = rng.choice(sorted(live))
            req, held = live[rid], mgr.block_table(rid).num_tokens
            if held >= len(req.all_token_ids):
                mgr.free(req)
                del live[rid]
            elif mgr.allocate(req, 1) is not None:
                _pass(mgr, req, held, held + 1)
        elif op < 0.9 and live:
            rid = rng.choice(sorted(live))
            mgr.free(live.pop(rid))
        else:
            mgr.evict(rng.randint(1, 4))
        _check(win, mgr)
        for rid in live:                   # every block a live request's next query reads holds a slot
            ids, t = mgr.block_ids(rid), mgr.block_table(rid).num_tokens
            assert all(win.slot_of(b) is not None for b in ids[win.first_block(t):])
    for req in live.values():
        mgr.free(req)
    _check(win, mgr)
    assert win.num_pinned_slots == 0


def test_window_slots_for_sizes_by_requests_that_fit() -> None:
    spec = CacheSpec.build(num_layers=2, num_kv_heads=1, head_dim=8, block_size=16, layer_windows=[1024, None])
    g = spec.sliding
    assert g is not None and g.kind.window_rows
    # 4096-token requests: 256 blocks each; a pool of 1,024 blocks holds 4 -> 4 windows of 65 blocks + one step
    n = g.kind.window_slots(g, 1024, CacheSizing(max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=2048))
    assert n == 4 * 65 + 128 + 5
    assert g.kind.window_slots(g, 10, CacheSizing(max_model_len=4096, max_num_seqs=1, max_num_batched_tokens=16)) == 10


# -- through the engine ---------------------------------------------------------------------------------------

def _gemma_folder(tmp_path: Path, tokenizer, *, window: int, context: int) -> Path:
    import transformers as tf

    from test_families_engine import init_weights

    cfg = tf.Gemma3TextConfig(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=window,
                              max_position_embeddings=context, query_pre_attn_scalar=16, tie_word_embeddings=True,
                              layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                           "sliding_attention"])
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    init_weights(model, seed=5)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    return tmp_path


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory, smollm2) -> Path:
    return _gemma_folder(tmp_path_factory.mktemp("gemma_window"), smollm2.tokenizer, window=32, context=1100)


def _peak_pinned_over_a_long_request(llm, win: SlidingWindowManager, monkeypatch: pytest.MonkeyPatch) -> int:
    """Serve a 1,000-token prompt and 24 greedy tokens; the most window slots pinned after any step's advance."""
    from kvpage import SamplingParams

    peak = 0
    advance = win.advance

    def watch(rid: str, ids, position: int) -> None:
        nonlocal peak
        advance(rid, ids, position)
        peak = max(peak, win.num_pinned_slots)

    monkeypatch.setattr(win, "advance", watch)
    prompt = torch.randint(100, 40000, (1000,), generator=torch.Generator().manual_seed(0)).tolist()
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 24
    return peak


def test_long_request_memory_stays_within_the_window_share(gemma: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 1,024-token request: the sliding layers never hold more than their window (+ one block per group), while
    the global layer holds every block; the allocated window slots are far fewer than the blocks."""
    from kvpage import LLM

    llm = LLM(str(gemma), progress=False, kv_cache_dtype="int8", block_size=16, max_num_seqs=2,
              max_num_batched_tokens=64, kv_cache_memory_bytes=4 * 2**20)
    win = llm._built.groups[1]
    assert isinstance(win, SlidingWindowManager)
    peak = _peak_pinned_over_a_long_request(llm, win, monkeypatch)
    bs = 16
    # a step's queries (<= 64 tokens) start at p: pinned blocks cover positions p - 31 .. p + 63
    assert peak <= -(-(32 - 1 + 64) // bs) + 1
    spec, cap = llm.spec, llm.capacity
    sliding = spec.sliding
    assert sliding is not None
    real = sum(t.numel() * t.element_size() for i in sliding.layer_indices for t in llm.kv_caches[i].values())
    assert real == cap.window_bytes == cap.window_slots * sliding.bytes_per_block   # C26: what is allocated
    assert cap.window_slots < cap.num_blocks / 4
    assert llm.controller.device_bytes == cap.pool_bytes + cap.window_bytes


@pytest.mark.parametrize("fmt", ["float32", "int4"])  # int4: sealed codes in the slots, a fixed tail beside them
def test_a_pool_short_of_window_slots_defers_requests_and_every_one_finishes(gemma: Path, fmt: str,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """More requests than window slots for them: the scheduler waits or preempts; all finish, nothing leaks."""
    from kvpage import LLM, SamplingParams

    llm = LLM(str(gemma), progress=False, kv_cache_dtype=fmt, block_size=16, max_num_seqs=6,
              max_num_batched_tokens=32, num_blocks=200)
    win = window_of(llm._built.groups)
    refused = 0
    reserve = win.reserve

    def counting(*a, **k) -> bool:
        nonlocal refused
        ok = reserve(*a, **k)
        refused += not ok
        return ok

    monkeypatch.setattr(win, "reserve", counting)
    gen = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(100, 40000, (int(n),), generator=gen).tolist()}
               for n in torch.randint(20, 120, (10,), generator=gen)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 40 and o.outputs[0].finish_reason == "length" for o in outs)
    assert refused > 0, f"the {win.num_slots} window slots never ran short: the test does not test deferral"
    assert win.num_pinned_slots == 0 and win.num_free_slots + win.num_cached_slots == win.num_slots
    assert llm.kv_cache_stats().num_in_use == 0


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory, smollm2) -> Path:
    """A tiny random Mistral (every layer windowed, 32 tokens) saved as a HF folder."""
    import transformers as tf

    from test_families_engine import init_weights

    folder = tmp_path_factory.mktemp("mistral_window")
    cfg = tf.MistralConfig(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=32,
                           max_position_embeddings=1100, tie_word_embeddings=True)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    init_weights(model, seed=7)
    model.save_pretrained(folder)
    smollm2.tokenizer.save_pretrained(folder)
    return folder


def test_all_windowed_model_allocates_window_slots_only(mistral: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mistral: every layer windowed, so the block ids carry no tensor and the budget buys window slots; a
    1,000-token request pins at most its window (+ one step's chunk) and runs to the end."""
    from kvpage import LLM

    budget = 2 * 2**20
    llm = LLM(str(mistral), progress=False, kv_cache_dtype="int8", block_size=16, max_num_seqs=2,
              max_num_batched_tokens=64, kv_cache_memory_bytes=budget)
    spec, cap = llm.spec, llm.capacity
    win = llm._built.groups[0]
    assert isinstance(win, SlidingWindowManager) and win.name == "main" and spec.sliding is None
    assert cap.bytes_per_block == 0 and cap.pool_bytes == 0 and cap.window_group == "main"
    assert cap.window_slots == win.num_slots == budget // spec.main.bytes_per_block   # the budget buys slots
    assert cap.num_blocks == max(cap.window_slots, 2 * -(-1100 // 16) + 64 // 16)  # ids for 2 requests, each slot
    assert llm.controller.device_bytes == cap.window_bytes <= budget
    assert cap.max_concurrency == cap.window_slots / (-(-31 // 16) + 1)
    peak = _peak_pinned_over_a_long_request(llm, win, monkeypatch)
    assert peak <= -(-(32 - 1 + 64) // 16) + 1
    assert win.num_pinned_slots == 0 and llm.kv_cache_stats().num_in_use == 0


def test_all_windowed_budget_too_small_names_the_window(mistral: Path) -> None:
    from kvpage import LLM
    from kvpage.cache.capacity import BudgetTooSmallError

    with pytest.raises(BudgetTooSmallError, match="32-token window"):
        LLM(str(mistral), progress=False, kv_cache_dtype="int8", block_size=16, kv_cache_memory_bytes=4096)
    # int4's fixed tail pool is sized by max_num_seqs: the message says so (found by a fresh-user pass)
    with pytest.raises(BudgetTooSmallError, match="side pools .*max_num_seqs=64.*or lower max_num_seqs"):
        LLM(str(mistral), progress=False, kv_cache_dtype="int4", block_size=16, kv_cache_memory_bytes=100_000)


@pytest.mark.parametrize("fixture", ["gemma", "mistral"])
@pytest.mark.parametrize("fmt", ["float32", "int8", "int4"])
def test_c26_the_model_dtype_comparison_keeps_the_window_layout(request: pytest.FixtureRequest, fixture: str,
                                                           fmt: str) -> None:
    """The CLI's "vs a float32 cache" compares a float32 engine of the same layout (window slots too) and budget:
    its tokens are what that engine really holds (every layer windowed: its window slots), a float32 cache gains
    1.00x, and the window's saving is not counted as the format's (a regression). (At this small budget the
    fixed count of window slots is a large share: a format also gains the blocks its cheaper slots leave.)"""
    from kvpage import LLM
    from kvpage.cli.generate import capacity_lines

    folder = str(request.getfixturevalue(fixture))
    llm = LLM(folder, progress=False, kv_cache_dtype=fmt, block_size=16, kv_cache_memory_bytes=8 * 2**20)
    ref = LLM(folder, progress=False, kv_cache_dtype="float32", block_size=16, kv_cache_memory_bytes=8 * 2**20)
    cap, rc = llm.capacity, ref.capacity
    if fixture == "mistral":   # every layer windowed: the budget buys window slots
        assert cap.ratio == pytest.approx(cap.window_slots / rc.window_slots, rel=1e-3)
    else:
        assert cap.reference_tokens == rc.tokens
    assert (cap.ratio == 1.0) == (fmt == "float32")
    line = capacity_lines(llm)[1]
    assert f"({cap.ratio:.2f}x more tokens per byte" in line
    assert ("0.0% less" in line) == (fmt == "float32")
    assert llm.capacity.max_concurrency <= cap.window_slots / (-(-31 // 16) + 1)   # window slots bound it too
