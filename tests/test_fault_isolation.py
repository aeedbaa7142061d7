"""One request's failure never stops the engine: it finishes with ``finish_reason="error"``, its blocks are freed,
the others' outputs equal a clean run's, and the ``LLM`` stays usable.

Failures are injected on a tiny random Llama (``tests/_tiny.py``): a forward pass that raises when a marked
request is in the batch (before any layer runs, and in the middle of the forward after layer 0 wrote and sealed
its K/V), a sampler error, a tokenizer error, and a tier load that raises.

Comparing with a clean run. A failed batch is re-run one request at a time, so in that step the survivors are
computed alone instead of batched. Two ways keep the comparison exact:

* :class:`Flaky` computes every request alone in *every* step (clean run and faulty run alike), so the
  survivors' arithmetic is the same by construction, whatever the BLAS does with batch size;
* the mid-forward tests run real batches and first check their premise: for this model and cache format a
  request's greedy tokens are the same batched or alone (float32 model; the formats are deterministic functions
  of the K/V written). Only then do they compare the faulty run's survivors with the clean batched run.
"""
from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from _engine_kv import tail_tables
from _tiny import tiny_loaded
from kvpage import LLM, SamplingParams
from kvpage.cache.groups import FullAttentionManager
from kvpage.cache.kv_cache import KVCache
from kvpage.cache.step_plan import PassPlan
from kvpage.engine.engine import EngineStepError
from kvpage.engine.model_runner import ScheduledRequest, pass_requests

PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [(7 * i + 3 * j) % 250 + 1 for j in range(n)]} for i, n in enumerate([21, 30, 9, 40])]


@pytest.fixture(scope="module")
def tiny():
    return tiny_loaded(0)


def _llm(tiny, fmt: str = "float32", **kw) -> LLM:
    return LLM(tiny, kv_cache_dtype=fmt, block_size=16, num_blocks=kw.pop("num_blocks", 48), progress=False, **kw)


def _pool_ok(llm: LLM) -> None:
    st = llm.kv_cache_stats()
    # side space: int4's 8-bit copies of cached first blocks live in carved pool blocks while those are cached
    assert st.num_free + st.num_evictable + st.num_in_use + st.num_side == llm.num_blocks
    assert st.num_in_use == 0 and not llm.engine.has_unfinished_requests()
    for table in tail_tables(llm):
        assert table.num_used == 0  # no open slot or window copy outlives its request


class Flaky:
    """Wraps a ModelRunner: computes each request alone; raises when a marked request is in the batch.

    ``after``: the marked request fails only once it has this many tokens computed (so it first makes progress).

    The engine hands ``execute`` the plan of the whole batch (``kv.plan_pass``), which cannot be split: each
    request's own pass is planned by the cache (``kv``), run and committed here, and the engine then commits the
    batch's plan, which no request ran. That is only bookkeeping-free where no group books anything per pass:
    token-wise formats, whose groups are all full attention (``FullAttentionManager``: plan, commit and abort
    book nothing), which is what Flaky is used with here (float32); the constructor checks it.
    """

    def __init__(self, runner, kv: KVCache, marked: Sequence[str] = (), after: int = 0) -> None:
        assert all(type(g) is FullAttentionManager for g in kv.groups), (
            f"Flaky re-plans each request's pass on its own: only over groups that book nothing per pass, "
            f"not {kv.groups}")
        self.runner, self.kv, self.marked, self.after = runner, kv, set(marked), after
        self.fired = 0

    def execute(self, batch: Sequence[ScheduledRequest], *, plan: PassPlan, **kw) -> torch.Tensor:
        if any(r.request_id in self.marked and r.num_computed >= self.after for r in batch):
            self.fired += 1
            raise RuntimeError("injected forward failure")
        return torch.cat([self._alone(r, plan.final, **kw) for r in batch])

    def _alone(self, r: ScheduledRequest, final: bool, **kw) -> torch.Tensor:
        """``r``'s own pass: planned over the runner's groups, run, committed (aborted if it raised)."""
        p = self.kv.plan_pass(pass_requests([r]), groups=self.runner.groups, final=final)
        try:
            out = self.runner.execute([r], plan=p, **kw)
        except BaseException:
            self.kv.abort(p)
            raise
        self.kv.commit(p)
        return out


def _run(llm: LLM, prompts, ids: Sequence[str]) -> dict[str, object]:
    """Queue ``prompts`` under ``ids`` and step until all finish; {id: final RequestOutput}."""
    for rid, p in zip(ids, prompts):
        llm.engine.add_request(None, p["prompt_token_ids"], PARAMS, request_id=rid)
    final = {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


IDS = ["a", "b", "c", "d"]


@pytest.mark.parametrize("after", [0, 30])
def test_a_forward_failing_for_one_request_finishes_only_it(tiny, after: int) -> None:
    clean_llm = _llm(tiny)
    clean_llm.engine.runner = Flaky(clean_llm.engine.runner, clean_llm.engine.kv)
    clean = _run(clean_llm, PROMPTS, IDS)

    llm = _llm(tiny)
    flaky = Flaky(llm.engine.runner, llm.engine.kv, marked=["b"], after=after)
    llm.engine.runner = flaky
    got = _run(llm, PROMPTS, IDS)
    assert flaky.fired >= 1
    bad = got["b"].outputs[0]
    assert bad.finish_reason == "error" and "injected forward failure" in (bad.error or "")
    if after:
        assert 0 < len(bad.token_ids) < PARAMS.max_tokens  # it had made progress before failing
    for rid in ("a", "c", "d"):
        c = got[rid].outputs[0]
        assert c.finish_reason == "length" and c.error is None
        assert c.token_ids == clean[rid].outputs[0].token_ids, rid
    _pool_ok(llm)
    # still usable: a new request runs as in the clean engine
    again = _run(llm, PROMPTS[:1], ["e"])["e"].outputs[0].token_ids
    assert again == clean["a"].outputs[0].token_ids
    _pool_ok(llm)


def test_a_broken_model_fails_every_request_then_raises_and_the_engine_recovers(tiny) -> None:
    llm = _llm(tiny)
    real = llm.engine.runner
    llm.engine.runner = Flaky(real, llm.engine.kv, marked=IDS)  # every request fails, alone too
    with pytest.raises(EngineStepError, match="every request") as e:
        _run(llm, PROMPTS, IDS)
    assert isinstance(e.value.__cause__, RuntimeError)
    assert sorted(o.request_id for o in e.value.outputs) == IDS
    assert all(o.outputs[0].finish_reason == "error" and o.finished for o in e.value.outputs)
    _pool_ok(llm)
    llm.engine.runner = real
    out = llm.generate(PROMPTS[:1], PARAMS)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == PARAMS.max_tokens
    _pool_ok(llm)


class MidForward:
    """Makes layer 1 raise whenever the marked request is in the batch, from the first step in which another
    request of the batch seals a block (layer 0 has then written its K/V, sealed that block and written the tail)."""

    def __init__(self, llm: LLM, marked: str) -> None:
        self.runner = llm.engine.runner
        self.bs = llm.spec.block_size
        self.marked = marked
        self.batch: Sequence[ScheduledRequest] = ()
        self.fired_while_sealing = 0
        backend = self.runner._by_layer[1]
        inner = backend.attend

        def attend(layer_index, q, k, v, params):
            others_seal = any((r.num_computed + len(r.token_ids)) % self.bs == 0 and len(r.token_ids) == 1
                              for r in self.batch if r.request_id != self.marked)
            if layer_index == 1 and any(r.request_id == self.marked for r in self.batch):
                if others_seal:
                    self.fired_while_sealing += 1
                if self.fired_while_sealing:
                    raise RuntimeError("injected failure in layer 1")
            return inner(layer_index, q, k, v, params)

        backend.attend = attend

    def execute(self, batch, **kw):
        self.batch = batch
        try:
            return self.runner.execute(batch, **kw)
        finally:
            self.batch = ()


@pytest.mark.parametrize("fmt", ["float32", "int4", "int2"])
def test_a_failure_in_the_middle_of_the_forward_leaves_the_others_exact(tiny, fmt: str) -> None:
    # premise: batched and alone give the same greedy tokens here (see the module docstring)
    ref = _llm(tiny, fmt)
    clean = _run(ref, PROMPTS, IDS)
    for rid, p in zip(IDS, PROMPTS):
        alone = ref.generate([p], PARAMS)[0].outputs[0].token_ids
        assert alone == clean[rid].outputs[0].token_ids, f"premise: {rid} differs batched vs alone"

    llm = _llm(tiny, fmt)
    mid = MidForward(llm, "c")
    llm.engine.runner = mid
    got = _run(llm, PROMPTS, IDS)
    assert mid.fired_while_sealing == 1  # c failed in a step where another request sealed a block
    assert got["c"].outputs[0].finish_reason == "error" and "layer 1" in got["c"].outputs[0].error
    for rid in ("a", "b", "d"):
        assert got[rid].outputs[0].finish_reason == "length"
        assert got[rid].outputs[0].token_ids == clean[rid].outputs[0].token_ids, (fmt, rid)
    _pool_ok(llm)
    for tab in tail_tables(llm):  # no tail or sink slot lost: each is free or held by one block
        if tab.side is None:  # fixed side pools
            assert tab._slots.num_free + tab.num_used == tab.num_slots
            assert tab._sink_slots.num_free + tab.num_sink_used == tab.num_sink_slots
        else:  # carved from the pool: every side block belongs to a group an entry holds (one per slot or copy)
            assert tab.side.num_spare == 0
            assert tab.side.num_held == tab.num_used + tab.num_sink_groups
            assert tab.side.num_held * tab.side.r == llm.kv_cache_stats().num_side


def test_a_sampler_error_finishes_only_that_request(tiny, monkeypatch) -> None:
    import kvpage.engine.engine as engine_mod

    llm = _llm(tiny)
    llm.engine.runner = Flaky(llm.engine.runner, llm.engine.kv)
    clean = _run(llm, PROMPTS[:2], ["a", "b"])
    real = engine_mod.sample

    def sample(logits, params, generator):
        if params.seed == 13:
            raise FloatingPointError("injected sampler failure")
        return real(logits, params, generator)

    monkeypatch.setattr(engine_mod, "sample", sample)
    llm.engine.add_request(None, PROMPTS[2]["prompt_token_ids"], SamplingParams(max_tokens=5, seed=13),
                           request_id="seeded")
    got = _run(llm, PROMPTS[:2], ["a2", "b2"])
    s = got["seeded"].outputs[0]
    assert s.finish_reason == "error" and "FloatingPointError: injected sampler failure" == s.error
    assert s.token_ids == []
    assert got["a2"].outputs[0].token_ids == clean["a"].outputs[0].token_ids
    assert got["b2"].outputs[0].token_ids == clean["b"].outputs[0].token_ids
    _pool_ok(llm)


class FailingDecode:
    """Delegates to the byte tokenizer; ``decode`` raises for outputs that start with ``poison``."""

    def __init__(self, tok, poison: list[int]) -> None:
        self.tok, self.poison = tok, poison

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def decode(self, ids, skip_special_tokens=True):
        if list(ids[: len(self.poison)]) == self.poison:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected tokenizer failure")
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_a_tokenizer_error_finishes_only_that_request(tiny) -> None:
    llm = _llm(tiny)
    llm.engine.runner = Flaky(llm.engine.runner, llm.engine.kv)
    clean = _run(llm, PROMPTS, IDS)
    poison = clean["d"].outputs[0].token_ids[:4]
    assert [rid for rid, o in clean.items() if o.outputs[0].token_ids[:4] == poison] == ["d"]

    llm2 = _llm(tiny)
    llm2.engine.runner = Flaky(llm2.engine.runner, llm2.engine.kv)
    llm2.engine.tokenizer = FailingDecode(llm2.tokenizer, poison)
    got = _run(llm2, PROMPTS, IDS)
    d = got["d"].outputs[0]
    assert d.finish_reason == "error" and "injected tokenizer failure" in (d.error or "") and d.token_ids == poison
    for rid in ("a", "b", "c"):
        assert got[rid].outputs[0].token_ids == clean[rid].outputs[0].token_ids
        assert got[rid].outputs[0].text == clean[rid].outputs[0].text
    _pool_ok(llm2)


def test_a_tier_load_that_raises_falls_back_to_recompute(tiny) -> None:
    """A host-tier hit whose copy raises is recomputed instead (the tier is a cache): same tokens, nothing leaks."""
    llm = _llm(tiny, num_blocks=12, swap_space=0.01, enable_prefix_caching=True)
    offload = llm.kv_connector.offload  # the scheduler half's bookkeeping (host blocks, transfer queue)
    tier = llm._built.tier_worker.tier  # the worker half's copier: a transfer that raises there wrote nothing
    prompt = PROMPTS[3]  # 40 tokens: 2 full blocks
    first = llm.generate([prompt], PARAMS)[0].outputs[0].token_ids
    llm.reset_prefix_cache()  # the device forgets; the host tier kept the blocks (write-through)
    calls = []

    def broken(*a, **kw):
        calls.append(a)
        raise OSError("injected host->device copy failure")

    tier.host_to_device = broken
    out = llm.generate([prompt], PARAMS)[0]
    assert calls, "the host tier was never asked to load"
    assert out.outputs[0].finish_reason == "length" and out.outputs[0].token_ids == first
    assert out.metrics.cached_tokens == 0  # recomputed, not loaded
    _pool_ok(llm)
    assert offload.queue.num_pending == 0 and offload.host.num_busy == 0  # the failed copy pins nothing
    # the next request goes on as usual (the failing transfer does not poison later steps)
    assert llm.generate([PROMPTS[0]], PARAMS)[0].outputs[0].finish_reason == "length"
    _pool_ok(llm)
