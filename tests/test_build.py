"""EngineConfig (every setting checked once, one error per field), build_engine's assembly, open_sequence."""
from __future__ import annotations

import math

import pytest
import torch

from kvpage.cache.groups import FullAttentionManager, SealedGroupManager
from kvpage.engine.group_attention import GroupAttention, SealedGroupAttention
from kvpage.engine.config import DEFAULT_KV_CACHE_BYTES, EngineConfig
from kvpage.engine.model_runner import ModelRunner
from kvpage.errors import OutOfBlocksError, StaticScalesError, UnknownKVFormatError
from kvpage.spec import CacheSpec, Sealed


@pytest.mark.parametrize("field,value", [
    ("block_size", 0), ("block_size", 2.5), ("num_blocks", 0), ("max_model_len", 1), ("num_threads", 0),
    ("num_threads", True), ("max_num_seqs", 0), ("max_num_batched_tokens", -1), ("kv_cache_memory_bytes", -5),
    ("kv_quant_residual_tokens", -1), ("swap_space", -1.0), ("swap_space", math.inf), ("kv_offload_policy", "lazy"),
    ("preemption_mode", "pause"), ("kv_disk_max_bytes", 0), ("kv_store", "http://x"), ("device", "tpu"),
    ("dtype", "int8"), ("enable_prefix_caching", "yes"),
    # wrong types that used to pass here and fail later, deep inside (issue 12's class of poison input)
    ("kv_cache_scales", 5), ("kv_disk_dir", 5), ("kv_disk_dir", ""), ("kv_store", 5), ("max_model_len", "8"),
])
def test_each_bad_field_gets_one_error_naming_it(field: str, value: object) -> None:
    with pytest.raises(ValueError) as err:
        EngineConfig(**{field: value})
    names = {"kv_offload_policy": "kv_offload_policy", "dtype": "dtype"}
    assert names.get(field, field) in str(err.value)


def test_cross_field_rules_and_unknown_formats() -> None:
    with pytest.raises(ValueError, match="swap_space"):
        EngineConfig(preemption_mode="swap")
    with pytest.raises(ValueError, match="kv_disk_dir"):
        EngineConfig(kv_disk_max_bytes=10)
    with pytest.raises(UnknownKVFormatError):
        EngineConfig(kv_cache_dtype="int5")
    with pytest.raises(StaticScalesError, match="calibrated static scales"):
        EngineConfig(kv_cache_dtype="int8_static")  # fails before any model would load


def test_derived_fields_resolve_once() -> None:
    c = EngineConfig(kv_cache_dtype="int4", dtype="bf16")
    assert c.torch_dtype is torch.bfloat16 and c.kv_format.name == "int4"
    assert (c.block_size_resolved, c.residual_tokens) == (32, 0)  # the format's preferred block, its window
    assert EngineConfig(kv_cache_dtype="int2").residual_tokens == 32
    assert EngineConfig(kv_cache_dtype="int8", block_size=8).block_size_resolved == 8
    assert EngineConfig().kv_budget_bytes == DEFAULT_KV_CACHE_BYTES and not EngineConfig().has_tiers
    assert EngineConfig(swap_space=0.5).has_tiers and "kv_cache_dtype" in EngineConfig.field_names()
    assert "torch_dtype" not in EngineConfig.field_names()


def test_model_runner_needs_one_backend_per_layer() -> None:
    spec = CacheSpec.build(num_layers=2, num_kv_heads=1, head_dim=4, num_draft_layers=1)
    main = GroupAttention(spec, spec.main, {})
    with pytest.raises(ValueError, match=r"layers \[2\] have no attention backend"):
        ModelRunner(torch.nn.Identity(), spec, [main], torch.device("cpu"))
    with pytest.raises(ValueError, match="two attention backends"):
        ModelRunner(torch.nn.Identity(), spec, [main, main], torch.device("cpu"))


@pytest.mark.slow
@pytest.mark.parametrize("fmt,manager_cls,backend_cls", [
    ("int8", FullAttentionManager, GroupAttention), ("int4", SealedGroupManager, SealedGroupAttention),
])
def test_build_picks_group_managers_and_backends_from_the_spec(smollm2, fmt, manager_cls, backend_cls) -> None:
    from kvpage.engine.llm import LLM

    llm = LLM(smollm2, kv_cache_dtype=fmt, kv_cache_memory_bytes=256 * 2**20, max_num_seqs=4)
    built = llm._built
    (group,) = built.groups
    assert type(group) is manager_cls and built.kv.groups == (group,)
    (backend,) = built.runner.backends
    assert type(backend) is backend_cls and backend.caches is built.caches
    if fmt == "int4":
        # the backend keeps no bookkeeping of its own: it applies the seal operations the group manager's table
        # plans, over the tail tensors built for that same table's sizes
        tail = built.tails["main"]
        assert not hasattr(backend, "table") and backend.tail is tail
        t = group.table
        assert (tail.layout.num_slots, tail.layout.num_sink_slots, tail.layout.window_blocks) == (
            t.num_slots, t.num_sink_slots, t.window_blocks)
        # carved side space: the 16-bit rows and first-block codes are views of the pool's code tensors; what
        # the tail allocates beside the pool (the first-block copies' scales) is what the engine and report count
        assert group.table.side is not None and tail.layers[0]["key"].untyped_storage().data_ptr() == (
            built.caches[0]["key"].untyped_storage().data_ptr())
        pool_storages = {t.untyped_storage().data_ptr() for c in built.caches.values() for t in c.values()}
        beside = sum(t.numel() * t.element_size() for layer in tail.layers.values() for t in layer.values()
                     if t.untyped_storage().data_ptr() not in pool_storages)
        assert llm.side_pool_bytes == beside == llm.capacity.side_pool_bytes > 0
        (gspec,) = llm.spec.groups
        assert tuple(group.layers) == tuple(gspec.layer_indices)
        assert beside == Sealed.sink_scale_bytes(gspec, group.table.num_sink_slots)
        # the budget pays for the tail pool: blocks + tail fit in it
        assert llm.num_blocks * llm.spec.bytes_per_block + llm.side_pool_bytes <= 256 * 2**20
    else:
        assert llm.side_pool_bytes == 0 and built.tails == {}
    with pytest.raises(TypeError, match="kv_cache_dtpe"):
        LLM(smollm2, kv_cache_dtpe="int8")


@pytest.mark.slow
def test_open_sequence_feeds_the_real_cache_and_frees_its_blocks(smollm2) -> None:
    from kvpage.engine.llm import LLM
    from kvpage.engine.sampling import SamplingParams

    llm = LLM(smollm2, num_blocks=8, block_size=16)
    prompt = llm.encode("The capital of France is")[1]
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=4, temperature=0))[0]
    answer = out.outputs[0].token_ids
    stored = llm.kv_cache_stats().blocks_stored
    with llm.open_sequence() as seq:
        rows = [seq.feed(prompt)]                                             # [1, vocab]
        rows += [seq.feed([t]) for t in answer[:-1]]
        assert seq.num_tokens == len(prompt) + len(answer) - 1
        assert llm.kv_cache_stats().num_in_use > 0
    # the same computation as greedy decoding (float32, one request, one token per step): same argmax
    assert [int(r.argmax()) for r in rows] == answer
    st = llm.kv_cache_stats()
    assert st.num_in_use == 0 and st.blocks_stored == stored  # freed, never indexed
    with pytest.raises(ValueError, match="closed"):
        seq.feed([1])
    with llm.open_sequence() as seq:
        assert seq.feed(prompt, all_logits=True).shape == (len(prompt), llm.config.vocab_size)
        with pytest.raises(OutOfBlocksError, match="no KV blocks left"):
            seq.feed([1] * (8 * 16))
    assert llm.kv_cache_stats().num_in_use == 0
