"""The tiers carry a bounded sliding-window group (issue 15 item 2: "the tiers carry every group").

A model with windowed layers beside full-attention ones keeps the windowed layers' KV in window slots, not in
rows keyed by block id. The tiers copy a block's window rows from (or into) its slot where it holds one; a host
block remembers whether it got them, a store record is always whole, and a tier's run is read only up to an end
whose window holds rows (vLLM's rule for a prefix hit, applied to loads). Checked here: the rule by hand; window
slots at admission after loads; controller and store copies byte-exact through window slots; and through the
engine, a prompt served again from the host tier, from a disk store (by another engine) and after swap
preemption matches transformers' forward within 1e-3, while blocks backed up without window rows are never read
inside a window.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvpage.cache.controller import CacheController
from kvpage.cache.groups import FullAttentionManager, SlidingWindowManager
from kvpage.cache.kv_cache import KVCache
from kvpage.cache.prefix_cache import PrefixBlockPool
from kvpage.cache.requests import KVRequest
from kvpage.cache.tiers.stores.blocks import gather_blocks, scatter_blocks
from kvpage.engine.llm import LLM
from kvpage.engine.sampling import SamplingParams
from kvpage.spec import CacheSpec

from _kv_kinds import OfferingConnector, window_of

BS, W = 4, 6  # a query at p reads positions > p - 6: blocks from (p - 5) // 4 on


def _spec(kv_cache_dtype: str = "float32") -> CacheSpec:
    return CacheSpec.build(num_layers=3, num_kv_heads=1, head_dim=8, block_size=BS, layer_windows=[W, None, W],
                           kv_cache_dtype=kv_cache_dtype)


def _manager(num_blocks: int = 32, num_slots: int = 8,
             connector: OfferingConnector | None = None) -> tuple[KVCache, SlidingWindowManager]:
    spec = _spec()
    assert spec.sliding is not None
    pool = PrefixBlockPool(num_blocks)
    win = SlidingWindowManager(spec.sliding, num_slots, pool)
    groups = [FullAttentionManager(spec.main, pool), win]
    return KVCache(num_blocks, BS, groups=groups, pool=pool, connector=connector), win


# -- the rule ---------------------------------------------------------------------------------------------------

def test_usable_external_needs_window_rows_inside_the_window_of_the_end() -> None:
    _, win = _manager()
    device = [10, 11]
    for b in device:
        win._slot[b] = win._free.pop()
    # 2 device blocks (8 tokens) + 3 loaded blocks: the end at 20 tokens reads blocks (20 - 5) // 4 = 3 .. 4
    assert win.usable_external(device, [True, True, True], 12) == 12
    assert win.usable_external(device, [False, True, True], 12) == 12   # block 2 is before that window
    assert win.usable_external(device, [True, True, False], 12) == 8    # end 16 reads blocks 2, 3: both held
    assert win.usable_external(device, [True, False, False], 12) == 4   # end 12 reads blocks 1, 2
    assert win.usable_external(device, [False, False, True], 12) == 0   # no end has its window's rows
    # a swap-in's partial last block: the end at 18 tokens reads blocks (18 - 5) // 4 = 3 .. 4
    assert win.usable_external(device, [False, True, True], 10) == 10
    # without device hits: the end at 8 reads blocks 0 .. 1, the end at 4 block 0
    assert win.usable_external([], [True, False], 8) == 4 and win.usable_external([], [False, True], 8) == 0
    # the default group reads every load
    assert FullAttentionManager().usable_external(device, [False], 4) == 4


def test_admission_after_loads_gives_slots_only_to_the_window_of_the_hit_end() -> None:
    tiers = OfferingConnector(BS, max_blocks=8)
    mgr, win = _manager(num_slots=6, connector=tiers)
    req = KVRequest("a", list(range(100, 141)))  # 41 tokens
    # 32 tokens loaded by a tier (8 blocks), then 5 computed: the first query (position 32) reads blocks 6, 7
    m = mgr.match(req)
    assert m.block_ids == () and m.num_loaded_tokens == 32 and m.num_computed_tokens == 32
    need = [g.slots_needed(req, (), 32, 5) for g in mgr.groups]
    assert need == [(), (4,)]                    # blocks 6, 7 (loaded, in the window) and 8, 9 (new)
    assert mgr.can_allocate(req, 5, m)
    mgr.begin_step()
    blocks = mgr.allocate(req, 5, m)             # the promise of those 4 slots comes with the allocation
    assert blocks is not None and blocks.num_computed_tokens == 32 and blocks.loading
    ids = blocks.block_ids
    assert tiers.issued == [("a", ids[:8], 32)]  # the loads go into the first 8 new blocks
    assert [win.slot_of(b) is not None for b in ids] == [False] * 6 + [True] * 4
    assert win.num_pinned_slots == 4 and win.num_free_slots == 2


# -- copies through window slots ------------------------------------------------------------------------------

def _controller(num_blocks: int = 8, slots: int = 3, host: int = 6, fmt: str = "int8") -> CacheController:
    c = CacheController(_spec(fmt))
    c.initialize_kv_cache(num_blocks, {"sliding": slots})
    c.initialize_host_cache(host)
    gen = torch.Generator().manual_seed(0)
    for cache in c.device_caches.values():
        for t in cache.values():
            t.copy_(torch.randint(0, 255, t.shape, generator=gen).to(t.dtype))
    return c


@pytest.mark.parametrize("fmt", ["int8", "int4"])  # int4: the window slots hold sealed codes and their scales
def test_swap_out_and_in_carry_window_rows_byte_exact_and_skip_blocks_without_a_slot(fmt: str) -> None:
    c = _controller(fmt=fmt)
    assert c.window_layers == {0, 2}
    with pytest.raises(ValueError, match="window slots: pass window_rows"):
        c.swap_out([1, 2], [0, 1])
    before = {i: {n: t.clone() for n, t in c.host_caches[i].items()} for i in (0, 2)}
    c.swap_out([4, 5], [0, 1], window_rows=[2, None])  # block 4 sits in slot 2; block 5 holds no slot
    for i in range(3):
        for n, t in c.host_caches[i].items():
            d = c.device_caches[i][n]
            if i in c.window_layers:
                assert torch.equal(t[0], d[2])
                assert torch.equal(t[1], before[i][n][1])   # no row: that host row is left as it was
            else:
                assert torch.equal(t[0], d[4]) and torch.equal(t[1], d[5])
    c.swap_in([0, 1], [6, 7], window_rows=[0, None])        # back into device block 6 (slot 0) and 7
    for i in range(3):
        for n, t in c.device_caches[i].items():
            if i in c.window_layers:
                assert torch.equal(t[0], c.host_caches[i][n][0])
            else:
                assert torch.equal(t[6], c.host_caches[i][n][0]) and torch.equal(t[7], c.host_caches[i][n][1])
    with pytest.raises(IndexError, match="layer 0 destination rows"):
        c.swap_in([0], [6], window_rows=[3])                # only 3 slots


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_store_blocks_gather_and_scatter_through_window_rows(fmt: str) -> None:
    c = _controller(fmt=fmt)
    spec = c.spec
    rows = {0: [1, 2], 2: [1, 2]}
    datas = gather_blocks(c.device_caches, spec, [3, 4], rows=rows)
    for j, (b, r) in enumerate([(3, 1), (4, 2)]):
        for i in range(3):
            for n, t in c.device_caches[i].items():
                assert torch.equal(datas[j][i][n], t[r if i in rows else b])
    with pytest.raises(ValueError, match="holds no row"):
        gather_blocks(c.device_caches, spec, [3], rows={0: [None], 2: [None]})
    other = _controller(fmt=fmt)
    for cache in other.device_caches.values():
        for t in cache.values():
            t.zero_()
    scatter_blocks(other.device_caches, spec, [6, 7], datas, rows={0: [0, None], 2: [0, None]})
    for i in range(3):
        for n, t in other.device_caches[i].items():
            if i in rows:
                assert torch.equal(t[0], datas[0][i][n]) and not t[1:].any()  # block 7: no slot, not written
            else:
                assert torch.equal(t[6], datas[0][i][n]) and torch.equal(t[7], datas[1][i][n])


# -- through the engine ---------------------------------------------------------------------------------------

WINDOW = 24
PROMPT_LEN = 90
STEPS = 8


@pytest.fixture(scope="module", params=["gemma3", "mistral"])
def windowed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, smollm2) -> Path:
    """A tiny random model saved as a HF folder: Gemma 3 text (3 sliding layers of 24 tokens beside 1 global:
    a ``sliding`` group) or Mistral (every layer windowed: the ``main`` group keeps window slots only)."""
    from transformers import AutoModelForCausalLM

    from test_families_engine import family_config, init_weights

    folder = tmp_path_factory.mktemp(f"{request.param}_tiers")
    config = family_config(request.param)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    init_weights(model, seed=106)
    model.save_pretrained(folder)
    smollm2.tokenizer.save_pretrained(folder)
    return folder


def _win(llm: LLM) -> SlidingWindowManager:
    return window_of(llm._built.groups)


def _llm(folder: Path, **kw) -> LLM:
    base = dict(progress=False, kv_cache_dtype="float32", block_size=16, num_blocks=64, max_num_batched_tokens=32,
                max_num_seqs=1, enable_prefix_caching=True, enable_chunked_prefill=True)
    return LLM(str(folder), **{**base, **kw})


def _prompt(seed: int, n: int = PROMPT_LEN) -> list[int]:
    return torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _check_against_transformers(folder: Path, llm: LLM, prompt: list[int]) -> int:
    """Serve ``prompt`` and compare every logits row the engine computed (chunk ends, then each decode step) with
    transformers' forward; returns the position of the first row (the tiers and the device served what came
    before the first chunk)."""
    from test_families_engine import LogitRecorder, hf_logits

    rec = LogitRecorder(llm.model)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=STEPS, temperature=0.0,
                                                                    ignore_eos=True))[0]
    ids = prompt + list(out.outputs[0].token_ids)
    ref = hf_logits(folder, ids)
    assert [p for p, _ in rec.rows[-STEPS:]] == list(range(len(prompt) - 1, len(ids) - 1))  # chunk ends before
    for pos, row in rec.rows:
        err = (row - ref[pos]).abs().max().item()
        assert err < 1e-3, f"position {pos}: max |diff| {err:.2e}"
    return rec.rows[0][0]


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_host_tier_serves_the_prompt_again_with_its_window_rows(windowed: Path, policy: str) -> None:
    # write_through copies each block when it is cached; write_back when the device evicts it, from the window
    # slot the block held then (handed out again at once, its content intact until the next forward pass)
    llm = _llm(windowed, swap_space=0.01, kv_offload_policy=policy)
    prompt = _prompt(1)
    _check_against_transformers(windowed, llm, prompt)
    llm.reset_prefix_cache()                       # the device forgets it; the host tier keeps it
    win = _win(llm)
    assert win.num_cached_slots == 0
    # write_through copied every block with its rows; write_back only those that still held a slot when evicted
    # (here the first block's slot went to newer content), which includes the window of the hit's end
    assert bool(llm._built.connector.offload._no_window) == (policy == "write_back")
    assert _check_against_transformers(windowed, llm, prompt) == PROMPT_LEN - 1  # only the last token computed
    st = llm.kv_cache_stats()
    assert st.tier_hits["host"] == (PROMPT_LEN - 1) // 16
    assert win.num_pinned_slots == 0 and st.num_in_use == 0


def test_disk_store_serves_another_engine_whole_records(windowed: Path, tmp_path: Path) -> None:
    writer = _llm(windowed, kv_disk_dir=tmp_path)
    prompt = _prompt(2)
    _check_against_transformers(windowed, writer, prompt)
    reader = _llm(windowed, kv_disk_dir=tmp_path)    # a fresh device: everything it reuses comes from the disk
    assert _check_against_transformers(windowed, reader, prompt) == PROMPT_LEN - 1
    assert reader.kv_cache_stats().tier_hits["disk"] == (PROMPT_LEN - 1) // 16


def test_a_store_record_missing_at_read_time_recomputes_the_whole_prefix(windowed: Path, tmp_path: Path) -> None:
    # a load cut short leaves the window of the earlier end without rows (those blocks got no slot at
    # admission), so a sliding-window model recomputes the prefix instead of continuing from the cut
    writer = _llm(windowed, kv_disk_dir=tmp_path)
    prompt = _prompt(4)
    first = _check_against_transformers(windowed, writer, prompt)
    store = writer._built.connector.offload.stores[0][1]
    hashes = writer.engine.kv.index.block_hashes(KVRequest("x", prompt), (PROMPT_LEN - 1) // 16)
    path = store.path_for(store.key(hashes[2]))
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0x01                   # exists() still says yes; get() rejects it
    path.write_bytes(bytes(blob))
    reader = _llm(windowed, kv_disk_dir=tmp_path)
    assert _check_against_transformers(windowed, reader, prompt) == first   # recomputed from the start, exact
    st = reader.kv_cache_stats()
    assert st.tiers is not None and st.tiers.store_rejected == 1 and st.num_in_use == 0
    assert _win(reader).num_pinned_slots == 0


def test_blocks_backed_up_without_window_rows_are_never_read_inside_a_window(windowed: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # blocks whose window slot was gone when the device evicted them (taken by newer content) reach the host
    # with the other layers only: a hit may not end where its window needs their rows
    llm = _llm(windowed, swap_space=0.01, kv_offload_policy="write_back")
    win = _win(llm)
    monkeypatch.setattr(win, "evicted_rows_of", lambda ids: [None] * len(ids))  # what the tiers ask at eviction
    prompt = _prompt(3)
    first = _check_against_transformers(windowed, llm, prompt)   # 31: the end of the first 32-token chunk
    llm.reset_prefix_cache()
    offload = llm._built.connector.offload
    assert offload.stats().backups == (PROMPT_LEN + STEPS - 1) // 16   # every full block the request computed
    loads = offload.lookup(llm.engine.kv.index.block_hashes(KVRequest("x", prompt), (PROMPT_LEN - 1) // 16))
    assert len(loads) == (PROMPT_LEN - 1) // 16 and not any(ld.window for ld in loads)
    assert _check_against_transformers(windowed, llm, prompt) == first   # recomputed from the start, exact
    assert llm.kv_cache_stats().tier_hits.get("host", 0) == 0


@pytest.mark.slow
def test_swap_preemption_with_window_slots_matches_no_preemption(windowed: Path) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": _prompt(10 + i, 50)} for i in range(4)]
    big = _llm(windowed, num_blocks=128, max_num_seqs=4, enable_prefix_caching=False)
    ref = [o.outputs[0].token_ids for o in big.generate(prompts, params)]
    # 4 requests growing to 90 tokens (6 blocks each) in 14 blocks: some are swapped out and back in
    llm = _llm(windowed, num_blocks=14, max_num_seqs=4, enable_prefix_caching=False, swap_space=0.01,
               preemption_mode="swap")
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == ref
    st = llm.engine.stats()
    assert st.num_preemptions > 0
    assert st.kv.tiers.swapped_out_blocks > 0 and st.kv.tiers.swapped_in_blocks > 0
    assert st.kv.num_in_use == 0 and st.kv.tiers.num_host_busy == 0
    assert _win(llm).num_pinned_slots == 0
