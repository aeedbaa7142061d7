"""Block-wise (quantize-on-seal) sliding-window layers keep their sealed codes in window slots (issue 15 item 2).

An ``int4``/``int2`` windowed group is of kind :class:`~kvpage.spec.SealedWindow` and gets one manager,
:class:`~kvpage.cache.groups.SealedWindowManager` (:func:`~kvpage.cache.groups.manager_for`), combining two
bookkeepings: ``.window``, a :class:`~kvpage.cache.groups.SlidingWindowManager` whose slots hold the sealed codes,
and ``.seals``, a :class:`~kvpage.cache.groups.SealedGroupManager` whose fixed tail pool holds the 16-bit open
blocks, window copies and first-block copies by block id. Checked here: the managers and the capacity arithmetic;
through the engine, the group's tensors have window-slot rows and a long request pins at most its window; the same
requests read exactly what the layout that keeps every block reads (a differential test: window slots move rows
and never change a value), with chunked prefill, a prefix hit and concurrent requests sharing a prefix;
speculative rollback gives every slot back (a pool short of slots: ``test_sliding_window.py``, for int4 too).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvpage.cache.groups import (
    MANAGERS,
    GroupManager,
    SealedGroupManager,
    SealedWindowManager,
    SlidingWindowManager,
    manager_for,
)
from kvpage.cache.prefix_cache import PrefixBlockPool
from kvpage.engine.group_attention import ATTENTION, SealedGroupAttention
from kvpage.spec import CacheSizing, CacheSpec, LayerGroupSpec, SealedWindow, kinds

from test_families_engine import init_weights, save_family


def _spec(fmt: str) -> CacheSpec:
    return CacheSpec.build(num_layers=3, num_kv_heads=1, head_dim=8, block_size=4, layer_windows=[6, None, 6],
                           kv_cache_dtype=fmt)


def test_a_block_wise_window_group_gets_a_fixed_tail_and_window_slots() -> None:
    spec = _spec("int4")
    assert spec.sliding is not None
    assert isinstance(spec.sliding.kind, SealedWindow) and not spec.sliding.kind.may_carve
    pool = PrefixBlockPool(64)
    sizing = CacheSizing(max_num_seqs=2, residual_tokens=16, max_model_len=32)
    both = manager_for(spec.sliding, sizing, pool=pool, num_window_slots=8)
    assert isinstance(both, SealedWindowManager)
    sealed, win = both.seals, both.window
    assert isinstance(sealed, SealedGroupManager) and isinstance(win, SlidingWindowManager)
    assert sealed.table.side is None          # never carved: the group's tensors have no block-id rows
    assert sealed.table.window_blocks == 2    # 16-bit copies capped at the 6-token window: ceil(6 / 4)
    assert win.num_slots == 8 and sealed.layers == spec.sliding.layer_indices
    # the full-attention group still carves its tail from the pool, and keeps all 16 tokens of copies
    main = manager_for(spec.main, sizing, pool=pool)
    assert isinstance(main, SealedGroupManager) and main.table.side is not None and main.table.window_blocks == 4
    # the window group's two bookkeepings always come together: one manager holds both, never either alone
    alone = manager_for(spec.sliding, CacheSizing(max_num_seqs=2, residual_tokens=0), num_window_slots=8)
    assert isinstance(alone, SealedWindowManager) and alone.seals.table.side is None and alone.window.num_slots == 8
    only = manager_for(_spec("int8").sliding, CacheSizing(max_num_seqs=2, residual_tokens=0), num_window_slots=8)
    assert type(only) is SlidingWindowManager


# -- through the engine ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory, smollm2) -> dict[str, Path]:
    """Tiny random Gemma 3 (sliding + global), Mistral (all windowed) and Qwen2 (windowed last layers), window 24."""
    return {family: save_family(tmp_path_factory.mktemp(family), family, smollm2.tokenizer, seed=i,
                                weight_seed=300 + i) for i, family in enumerate(["gemma3", "mistral", "qwen2_window"])}


class _SealedByBlockId(SealedWindow):
    """The old rule, as a kind: window slots for token-wise formats only; a block-wise windowed group keeps its codes
    in every block (rows by block id), over the same fixed tail as :class:`~kvpage.spec.SealedWindow` (never
    carved)."""

    name = "sealed_by_block_id"
    window_rows = False


_BY_BLOCK_ID = _SealedByBlockId()


def _keep_every_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every block-wise windowed group of specs built from now on a :class:`_SealedByBlockId` (manager: the
    tail's alone; worker: sealed attention over block ids)."""
    real = kinds.kind_of

    def kind_of(role: str, layer: Any, sliding_window: int | None) -> kinds.GroupKind:
        kind = real(role, layer, sliding_window)
        return _BY_BLOCK_ID if isinstance(kind, SealedWindow) else kind

    def manager(group: LayerGroupSpec, sizing: CacheSizing, pool: PrefixBlockPool | None, num_blocks: int | None,
                slots: int) -> GroupManager:
        return SealedGroupManager(group, group.kind.tail(group, sizing), pool)

    monkeypatch.setattr("kvpage.spec.cache_spec.kind_of", kind_of)
    monkeypatch.setitem(MANAGERS, _SealedByBlockId, manager)
    monkeypatch.setitem(ATTENTION, _SealedByBlockId, SealedGroupAttention)


def _windowed(llm: Any) -> SealedWindowManager:
    """The engine's block-wise windowed group's manager."""
    return next(g for g in llm._built.groups if isinstance(g, SealedWindowManager))


def _window(llm: Any) -> SlidingWindowManager:
    return _windowed(llm).window


class _Rows:
    """Records every logits tensor the model computes, in order."""

    def __init__(self, model: Any) -> None:
        self.rows: list[torch.Tensor] = []
        compute = model.compute_logits

        def rec(hidden: torch.Tensor) -> torch.Tensor:
            out = compute(hidden)
            self.rows.append(out.clone())
            return out

        model.compute_logits = rec


def _serve_all(folder: Path, fmt: str, prompts: list[list[int]], **kw: Any) -> tuple[Any, list[torch.Tensor]]:
    """Serve ``prompts`` twice (the second time hitting the cached prompt blocks); every logits tensor."""
    from kvpage import LLM, SamplingParams

    llm = LLM(str(folder), progress=False, kv_cache_dtype=fmt, block_size=16, num_blocks=64,
              max_num_batched_tokens=8, enable_prefix_caching=True, enable_chunked_prefill=True, **kw)
    rec = _Rows(llm.model)
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert all(len(o.outputs[0].token_ids) == 32 for o in outs)
    return llm, rec.rows


@pytest.mark.parametrize("family", ["gemma3", "mistral", "qwen2_window"])
@pytest.mark.parametrize("fmt", ["int4", "int3", "int2"])
def test_window_slots_read_what_keeping_every_block_reads(folders: dict[str, Path], family: str, fmt: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Three requests sharing a 32-token prefix, served twice: every logits row equals the run whose windowed
    layers keep every block (within 1e-5), while the windowed tensors have far fewer rows than blocks."""
    gen = torch.Generator().manual_seed(7)
    shared = torch.randint(100, 40000, (32,), generator=gen).tolist()
    prompts = [shared + torch.randint(100, 40000, (n,), generator=gen).tolist() for n in (8, 13, 21)]
    llm, rows = _serve_all(folders[family], fmt, prompts, max_num_seqs=3)
    win = _window(llm)
    layer = win.group.layer_indices[0] if win.group is not None else 0
    assert next(iter(llm.kv_caches[layer].values())).shape[0] == win.num_slots < 64
    assert llm.kv_cache_stats().prefix_hits >= 3 * 32
    assert win.num_pinned_slots == 0
    llm.close()

    # the reference: the builder allocates the windowed layers' codes by block id (no window slots) over the same
    # fixed tail (a block-wise windowed group never carves: its kind), so both runs schedule the same steps
    _keep_every_block(monkeypatch)
    ref_llm, ref = _serve_all(folders[family], fmt, prompts, max_num_seqs=3)
    assert not any(g.kind.window_rows for g in ref_llm._built.groups)
    assert not any(isinstance(g, (SlidingWindowManager, SealedWindowManager)) for g in ref_llm._built.groups)
    assert any(g.kind is _BY_BLOCK_ID and isinstance(g, SealedGroupManager) and g.table.side is None
               for g in ref_llm._built.groups)
    ref_llm.close()
    assert len(rows) == len(ref) and [r.shape for r in rows] == [r.shape for r in ref]
    worst = max((a - b).abs().max().item() for a, b in zip(rows, ref))
    assert worst < 1e-5, (family, fmt, worst)


def _peak_pinned(llm: Any, win: SlidingWindowManager, monkeypatch: pytest.MonkeyPatch, n: int = 1000) -> int:
    """Serve an ``n``-token prompt and 24 greedy tokens; the most window slots pinned after any step's advance."""
    from kvpage import SamplingParams

    peak = 0
    advance = win.advance

    def watch(rid: str, ids: Any, position: int) -> None:
        nonlocal peak
        advance(rid, ids, position)
        peak = max(peak, win.num_pinned_slots)

    monkeypatch.setattr(win, "advance", watch)
    prompt = torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 24 and all(torch.isfinite(torch.tensor(out[0].outputs[0].token_ids)))
    return peak


@pytest.fixture(scope="module")
def long_folders(tmp_path_factory: pytest.TempPathFactory, smollm2) -> dict[str, Path]:
    """Gemma 3 and Mistral of a 32-token window and a 1,100-token context."""
    import transformers as tf

    common: dict[str, Any] = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=32,
                                  max_position_embeddings=1100, tie_word_embeddings=True)
    configs = {"gemma3": tf.Gemma3TextConfig(**common, query_pre_attn_scalar=16,
                                             layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                                          "sliding_attention"]),
               "mistral": tf.MistralConfig(**common)}
    out = {}
    for name, cfg in configs.items():
        cfg._attn_implementation = "eager"
        folder = tmp_path_factory.mktemp(f"long_{name}")
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(cfg)
        init_weights(model, seed=9)
        model.save_pretrained(folder)
        smollm2.tokenizer.save_pretrained(folder)
        out[name] = folder
    return out


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
@pytest.mark.parametrize("fmt", ["int4", "int3", "int2"])
def test_c26_a_long_request_pins_only_its_window_and_capacity_is_what_is_allocated(
        long_folders: dict[str, Path], family: str, fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 1,000-token request on a 32-token window: at most the window plus one step's chunk is pinned; the
    windowed layers' tensors are the window slots and the tail pools are what capacity counted (C26)."""
    from kvpage import LLM

    llm = LLM(str(long_folders[family]), progress=False, kv_cache_dtype=fmt, block_size=16, max_num_seqs=2,
              max_num_batched_tokens=64, kv_cache_memory_bytes=4 * 2**20)
    win, cap, built = _window(llm), llm.capacity, llm._built
    assert cap.window_slots == win.num_slots
    if family == "mistral":   # every layer windowed: block ids hold no tensor, the budget buys slots
        assert cap.pool_bytes == 0
    else:
        assert cap.window_slots < cap.num_blocks / 4
    assert win.group is not None and cap.window_group == win.group.name == ("main" if family == "mistral" else "sliding")
    real = sum(t.numel() * t.element_size() for i in win.group.layer_indices for t in llm.kv_caches[i].values())
    assert real == cap.window_bytes == cap.window_slots * win.group.bytes_per_block
    assert llm.controller.device_bytes == cap.pool_bytes + cap.window_bytes
    assert built.side_pool_bytes == cap.side_pool_bytes > 0          # the window group's fixed tail among them
    assert cap.total_bytes <= 4 * 2**20
    peak = _peak_pinned(llm, win, monkeypatch)
    assert peak <= -(-(32 - 1 + 64) // 16) + 1
    assert win.num_pinned_slots == 0 and llm.kv_cache_stats().num_in_use == 0
    sealed = _windowed(llm).seals
    assert sealed.group is win.group
    assert sealed.table.num_used == 0  # open blocks and window copies died with their requests
    llm.close()


@pytest.mark.parametrize("family", ["gemma3", "mistral"])
def test_speculative_rollback_over_window_slots_gives_everything_back(folders: dict[str, Path], family: str) -> None:
    """ngram speculation on int4 window layers: drafts seal blocks provisionally and rejected ones roll back;
    outputs agree with plain decoding up to near-ties, and every window and tail slot comes back."""
    from kvpage import LLM, SamplingParams

    rep = torch.randint(100, 40000, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    prompts = [{"prompt_token_ids": rep * 5}, {"prompt_token_ids": rep[:7] * 6}]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    kw: dict[str, Any] = dict(progress=False, kv_cache_dtype="int4", block_size=16, num_blocks=64, max_num_seqs=2,
                              max_num_batched_tokens=16)
    plain = LLM(str(folders[family]), **kw)
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    plain.close()
    llm = LLM(str(folders[family]), **kw, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                              "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert sum(a == b for a, b in zip(ref, outs)) >= 1, "speculation changed every greedy output"
    st = llm.engine.stats().spec_decoding
    assert st is not None and st.num_draft_tokens > st.num_accepted_tokens > 0   # some drafts rejected
    win = _window(llm)
    sealed = _windowed(llm).seals
    assert sealed.group is win.group
    assert win.num_pinned_slots == 0 and win.num_free_slots + win.num_cached_slots == win.num_slots
    assert sealed.table.num_used == 0 and llm.kv_cache_stats().num_in_use == 0
    llm.close()


@pytest.mark.parametrize("fmt", ["int4", "int3", "int2"])
def test_windowed_layers_dequantize_only_their_window(folders: dict[str, Path], fmt: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A windowed sealed layer reads from the first block of its queries' windows (``first_read_block``): every
    logits row equals the run that dequantizes the whole context and masks it (within 1e-5)."""
    import kvpage.ops.sealed_attention as ops

    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in (70, 45)]
    calls: list[int] = []
    trim = ops.first_read_block

    def counted(*a: Any) -> int:
        calls.append(trim(*a))
        return calls[-1]

    monkeypatch.setattr("kvpage.ops.sealed_attention.first_read_block", counted)  # (every backend reads through it)
    llm, rows = _serve_all(folders["gemma3"], fmt, prompts, max_num_seqs=2)
    llm.close()
    assert max(calls) >= 4   # some reads really started past block 0 (positions beyond 24 + 3 * 16)
    monkeypatch.setattr("kvpage.ops.sealed_attention.first_read_block", lambda *a: 0)
    ref_llm, ref = _serve_all(folders["gemma3"], fmt, prompts, max_num_seqs=2)
    ref_llm.close()
    assert [r.shape for r in rows] == [r.shape for r in ref]
    assert max((a - b).abs().max().item() for a, b in zip(rows, ref)) < 1e-5
