"""The scheduler decides, the worker executes (issue 27): plans that replay byte-exact, loads that land late,
and a re-allocation that follows the build's plan of rows.

* A whole run's plans -- step plans (tier transfers, copies) and pass plans (rows, slot mappings, seals, window
  slots), pickled -- replayed on a second worker built from the same spec leave the same bytes in every cache tensor:
  the worker consults nothing but the plan.
* A worker half that completes loads two steps late gives the same outputs as the synchronous one, under
  preemption, and leaks no block: nothing in the scheduler assumes a transfer completes at issue.
* ``reset_kv_cache`` re-allocates exactly what the build allocated (window slots included), and the tiers still
  address the window layers by slot.
"""
from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Gemma3TextConfig, MistralConfig

from _families import kvpage_model
from _tiny import VOCAB, ByteTokenizer, tiny_loaded
from kvpage import LLM, SamplingParams
from kvpage.cache.step_plan import KVStepPlan, PassPlan
from kvpage.model.config import ModelConfig
from kvpage.model.loader import LoadedModel

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def _hf_loaded(config: Any, name: str, seed: int) -> LoadedModel:
    """kvpage's model of a random transformers ``config`` (norms and biases perturbed), with the byte tokenizer."""
    from _families import hf_model

    config._attn_implementation = "eager"
    model = kvpage_model(hf_model(config, seed=seed))
    return LoadedModel(config=ModelConfig.from_hf(config), model=model, tokenizer=ByteTokenizer(), path=Path(name))


def gemma3(seed: int = 0) -> LoadedModel:
    """A tiny Gemma 3: two sliding-window layers (16 tokens) beside one global layer, byte vocabulary."""
    cfg = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
                           max_position_embeddings=512, query_pre_attn_scalar=16, tie_word_embeddings=True,
                           layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                           bos_token_id=257, eos_token_id=256, pad_token_id=258)
    return _hf_loaded(cfg, "/tiny-gemma3", seed)


def mistral(seed: int = 0) -> LoadedModel:
    """A tiny Mistral whose every layer is windowed (16 tokens), byte vocabulary."""
    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=16,
                        max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=257, eos_token_id=256)
    return _hf_loaded(cfg, "/tiny-mistral", seed)


def _prompt(seed: int, n: int) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(seed)
    return {"prompt_token_ids": torch.randint(1, 250, (n,), generator=g).tolist()}


def _device_bytes(llm: LLM) -> dict[int, dict[str, tuple]]:
    """Every device tensor's shape and dtype, per layer."""
    return {i: {n: (tuple(t.shape), t.dtype) for n, t in c.items()} for i, c in llm.controller.device_caches.items()}


def _no_leak(llm: LLM) -> None:
    st = llm.kv_cache_stats()
    assert not llm.engine.has_unfinished_requests()
    assert st.num_in_use == 0, st
    assert st.num_free + st.num_evictable + st.num_in_use + st.num_side == llm.num_blocks
    if st.tiers is not None:
        assert st.tiers.num_held_blocks == 0 and st.tiers.pending_transfers == 0
        offload = llm.kv_connector.offload  # type: ignore[union-attr]
        if offload.host is not None:
            offload.host.validate()
            assert offload.host.num_busy == 0


# -- reset_kv_cache re-allocates what the build allocated -------------------------------------------------------------

@pytest.mark.parametrize("model,fmt,budget", [
    ("mistral", "int8", 100_000),     # every layer windowed: the budget buys window slots only
    ("gemma3", "float32", 3_000_000),  # sliding layers beside a global one
    ("gemma3", "int4", 3_000_000),     # ... block-wise: the sliding group's codes in window slots, a fixed tail
])
def test_reset_kv_cache_reallocates_the_builds_rows_and_tiers_still_address_window_slots(
        model: str, fmt: str, budget: int) -> None:
    """Regression (issue 27): ``reset_kv_cache`` re-allocated the pool without the window-slot counts the build
    passed (a tiny all-windowed Mistral at a 100,000-byte budget went from 43 rows per layer to 142: 3.3x over budget)
    and lost the controller's window layers, so tiers would address window layers by block id."""
    loaded = mistral() if model == "mistral" else gemma3()
    llm = LLM(loaded, kv_cache_dtype=fmt, block_size=16, kv_cache_memory_bytes=budget, max_num_seqs=2,
              swap_space=0.002, progress=False)
    window_layers = llm.controller.window_layers
    assert window_layers, "the model has layers whose rows are window slots"
    built, shapes = llm.controller.device_bytes, _device_bytes(llm)
    assert built + llm.side_pool_bytes <= budget
    prompt = _prompt(1, 40)
    first = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids

    llm.reset_kv_cache()
    assert llm.controller.device_bytes == built            # what the build allocated, to the byte
    assert _device_bytes(llm) == shapes                     # every layer's rows (window slots) and dtypes
    assert llm.controller.window_layers == window_layers    # the tiers address them by slot
    assert llm.kv_cache_stats().num_in_use == 0 and llm.kv_cache_stats().num_evictable == 0
    hits = llm.kv_cache_stats().tier_hits.get("host", 0)
    again = llm.generate([prompt], GREEDY)[0].outputs[0]
    if fmt != "int4":  # (int4's tiers serve a prefix only after a device hit on its first block: none after a reset)
        assert llm.kv_cache_stats().tier_hits["host"] > hits   # the prompt's blocks came back from the host tier...
    assert again.token_ids == first                              # ...with their window rows in the right slots
    _no_leak(llm)


# -- a worker half whose loads land two steps late --------------------------------------------------------------------

def _run(llm: LLM, prompts: list[dict[str, list[int]]], rounds: int) -> list[list[int]]:
    """Each round: every prompt at once; between rounds the device forgets its prefix cache (the host tier keeps it)."""
    out: list[list[int]] = []
    for _ in range(rounds):
        out += [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        llm.reset_prefix_cache()
    return out


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_loads_that_land_two_steps_late_change_no_output_and_leak_nothing(mode: str) -> None:
    prompts = [_prompt(10 + i, 30 + 7 * i) for i in range(4)]
    kw = dict(kv_cache_dtype="float32", block_size=16, num_blocks=14, max_num_seqs=4, swap_space=0.02,
              preemption_mode=mode, progress=False)
    sync = LLM(tiny_loaded(0), **kw)
    want = _run(sync, prompts, 3)
    assert sync.kv_cache_stats().preemptions > 0  # the pool is small enough to preempt
    assert sync.kv_cache_stats().tier_hits["host"] > 0

    late = LLM(tiny_loaded(0), **kw)
    worker = late._built.tier_worker
    assert worker is not None
    worker.load_delay = 2  # every load is performed and reported two get_finished() calls after it is issued
    seen = []
    steps_waiting = []
    real = worker.start_load_kv

    def watch(meta: Any) -> None:
        real(meta)
        seen.append(worker.num_deferred)

    worker.start_load_kv = watch  # type: ignore[method-assign]
    step = late.engine.step

    def counting() -> Any:
        steps_waiting.append(late.engine.scheduler.num_waiting_for_kv)
        return step()

    late.engine.step = counting  # type: ignore[method-assign]
    assert _run(late, prompts, 3) == want
    assert max(seen) > 0 and max(steps_waiting) > 0  # loads really were in flight while requests waited for them
    st = late.kv_cache_stats()
    assert st.preemptions > 0 and st.tier_hits["host"] == sync.kv_cache_stats().tier_hits["host"]
    _no_leak(late)
    assert worker.num_deferred == 0


# -- one run's plans, pickled, replayed on a second worker ------------------------------------------------------------

class Recorder:
    """Pickles every plan an engine's worker side executes, in order: step plans and each runner's passes."""

    def __init__(self, llm: LLM) -> None:
        self.log: list[bytes] = []
        worker = llm.engine.worker
        begin = worker.begin_step

        def begin_step(plan: KVStepPlan) -> None:
            self.log.append(pickle.dumps(("step", plan)))
            begin(plan)

        worker.begin_step = begin_step  # type: ignore[method-assign]
        self._wrap(llm.engine.runner, "target")
        drafter = llm.engine.drafter
        self._wrap(drafter.runner, "draft")  # type: ignore[union-attr]

    def _wrap(self, runner: Any, name: str) -> None:
        execute = runner.execute

        def recorded(batch: Any, plan: PassPlan, **kw: Any) -> torch.Tensor:
            self.log.append(pickle.dumps(("pass", name, list(batch), plan, kw)))
            return execute(batch, plan=plan, **kw)

        runner.execute = recorded


def _tensors(llm: LLM) -> dict[str, torch.Tensor]:
    """Every cache tensor the worker side owns: device layers, host layers, the tails' own tensors."""
    out = {f"device/{i}/{n}": t for i, c in llm.controller.device_caches.items() for n, t in c.items()}
    out.update({f"host/{i}/{n}": t for i, c in llm.controller.host_caches.items() for n, t in c.items()})
    for g, tail in llm._built.tails.items():
        out.update({f"tail/{g}/{i}/{n}": t for i, c in tail._own.items() for n, t in c.items()})
    return out


def test_a_pickled_run_of_plans_replays_on_a_second_worker_to_identical_cache_bytes() -> None:
    """int4 main group + sliding group + draft group, a fork (n=2), seals, a host-tier load in one batch: every
    plan of the run, pickled, replayed on a second engine's worker built from the same spec and weights."""
    def build() -> LLM:
        draft = tiny_loaded(3, layers=1)
        return LLM(gemma3(), kv_cache_dtype="int4", block_size=16, num_blocks=64, max_num_seqs=4, swap_space=0.02,
                   speculative_config={"method": "draft_model", "num_speculative_tokens": 2, "model": draft},
                   progress=False)

    llm = build()
    assert [(g.name, g.kind.name) for g in llm.spec.groups] == [
        ("main", "sealed"), ("sliding", "sealed_window"), ("draft", "full_attention")]
    rec = Recorder(llm)
    shared = _prompt(20, 48)  # three full blocks: a device hit, a host load, then a chunk that seals block 2
    llm.generate([shared], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    e = llm.engine
    # the device forgets the prompt's last two blocks (the host tier kept them: write-through); int4's tiers serve a
    # prefix after a device hit on its first block, so the next request of it loads block 1 from the host
    assert e.kv.stats().num_evictable == 3 and e.kv.evict(2) == 2
    e.add_request(None, _prompt(21, 37)["prompt_token_ids"], SamplingParams(max_tokens=24, n=2, temperature=0.8,
                                                                             seed=5, ignore_eos=True), request_id="fork")
    for _ in range(3):
        e.step()
    e.add_request(None, shared["prompt_token_ids"], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
                  request_id="load")
    while e.has_unfinished_requests():
        e.step()
    _no_leak(llm)

    records = [pickle.loads(b) for b in rec.log]
    steps = [r[1] for r in records if r[0] == "step"]
    passes = [r for r in records if r[0] == "pass"]
    # the mix this test is about, in one step plan and the target pass that follows it
    mixed = False
    for i, r in enumerate(records):
        if r[0] != "step" or not any(op.kind == "host_to_device" for op in r[1].connector.ops):
            continue
        target = next(p for p in records[i:] if p[0] == "pass" and p[1] == "target")
        plan: PassPlan = target[3]
        rids = [q.request_id for q in plan.requests]
        sealed = plan.group("main").seals
        forked = [q for q in plan.requests if q.request_id and q.request_id.startswith("fork")]
        shares = len(forked) == 2 and set(forked[0].block_ids) & set(forked[1].block_ids)
        mixed = ("load" in rids and bool(shares) and sealed is not None and bool(sealed.seal_ids)
                 and plan.group("sliding").seals is not None)
        if mixed:
            break
    assert any(op.kind == "device_to_host" for s in steps for op in s.connector.ops)
    assert any(p[1] == "draft" for p in passes) and any(p[3].final is False for p in passes if p[1] == "draft")
    assert mixed, "no step loaded a block while the forked pair decoded and a block sealed"

    replica = build()
    assert replica.spec.fingerprint == llm.spec.fingerprint
    before = {k: v.clone() for k, v in _tensors(replica).items()}
    assert any(not torch.equal(before[k], v) for k, v in _tensors(llm).items())  # the run changed the bytes
    runners = {"target": replica.engine.runner, "draft": replica.engine.drafter.runner}  # type: ignore[union-attr]
    for blob in rec.log:
        r = pickle.loads(blob)
        if r[0] == "step":
            replica.engine.worker.begin_step(r[1])
        else:
            _, name, batch, plan, kw = r
            runners[name].execute(batch, plan=plan, **kw)
    got, want = _tensors(replica), _tensors(llm)
    assert got.keys() == want.keys()
    diff = [k for k in want if not torch.equal(got[k].view(torch.uint8) if got[k].dtype != torch.bool else got[k],
                                               want[k].view(torch.uint8) if want[k].dtype != torch.bool else want[k])]
    assert not diff, f"tensors differ after the replay: {diff[:8]}"
