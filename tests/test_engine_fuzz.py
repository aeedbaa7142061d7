"""Random ``add_request`` / ``abort_request`` / ``step`` sequences with valid and invalid arguments (hypothesis).

On a tiny random Llama with a small pool (preemption happens), every call either raises a clear error up
front (``ValueError``/``TypeError``/``PromptTooLongError`` whose message names the bad field, nothing
queued) or completes; valid requests never end in ``"error"`` unless a fault was injected for that very
request (a forward pass that raises while it is in the batch). After every step the pool invariant holds
(free + evictable + in use == total blocks) and the engine's request table matches the scheduler's queues;
at the end, after aborting everything, no block is in use.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from _tiny import VOCAB, tiny_loaded
from kvpage import LLM, SamplingParams
from kvpage.engine.engine import EngineStepError
from kvpage.errors import PromptTooLongError

MAX_MODEL_LEN = 48
_LLMS: dict[str, LLM] = {}
SEEN: Counter[str] = Counter()  # what the runs covered (checked after each run)


def _llm(fmt: str) -> LLM:
    """A cached engine per format: 56 tokens of pool (blocks of 4, or 8 for int4's per-block key groups)."""
    if fmt not in _LLMS:
        bs = 8 if fmt == "int4" else 4
        _LLMS[fmt] = LLM(tiny_loaded(0, max_positions=64), kv_cache_dtype=fmt, block_size=bs, num_blocks=56 // bs,
                         max_model_len=MAX_MODEL_LEN, max_num_seqs=4, max_num_batched_tokens=24, progress=False)
    return _LLMS[fmt]


class FaultyRunner:
    """The real runner, except that a batch holding a doomed request raises (alone too, so only it fails)."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.doomed: set[str] = set()

    def execute(self, batch, **kw):
        hit = [r.request_id for r in batch if r.request_id in self.doomed]
        if hit:
            raise RuntimeError(f"injected fault for {hit}")
        return self.runner.execute(batch, **kw)


token_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=30) | st.lists(st.just(7), min_size=40,
                                                                                   max_size=50)
valid_params = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 10),
    temperature=st.sampled_from([0.0, 0.7, 1.0]),
    top_p=st.sampled_from([1.0, 0.9, 0.3]),
    top_k=st.sampled_from([-1, 0, 1, 5]),
    seed=st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1)),
    stop=st.one_of(st.none(), st.sampled_from(["a", ["\x00", "zz"], []])),
    stop_token_ids=st.lists(st.sampled_from([256, 135, 65, 5, 252]) | st.integers(0, VOCAB - 1), max_size=2),
    ignore_eos=st.booleans(),
)
# field -> bad values of add_request (the field name each error message must contain)
BAD_REQUEST = {
    "prompt": [5, b"x", "\ud800", ["a"]],
    "prompt_token_ids": ["12", 7, None, {"prompt_token_ids": [1]}, [1, True], [1.5], [VOCAB], [-1], [], ["a"]],
    "sampling_params": [None, {"max_tokens": 3}, "greedy", 0.5],
    "request_id": [5, b"id", ""],
    "cache_salt": [5, b"salt", ["a"], "\udc80"],
    "stop_token_ids": [[VOCAB], [VOCAB + 100]],
}
BAD_SAMPLING = {
    "max_tokens": [0, -1, "5", 1.5, True, None], "temperature": [-0.1, float("nan"), "1", None],
    "top_p": [0, 1.5, float("inf")], "top_k": [-5, 2.5, True], "seed": [2**64, -(2**63) - 1, "7", 1.0],
    "stop": [[1], 5, ["a", None], "", ["a", ""]], "stop_token_ids": [[-1], [True], "12", ["3"]], "ignore_eos": [1, "yes", None],
}
MESSAGE_NAMES = {"prompt_token_ids": ("prompt_token_ids", "empty prompt"), "stop_token_ids": ("stop_token_ids",)}


class EngineMachine(RuleBasedStateMachine):
    fmt = "float32"

    @initialize()
    def start(self) -> None:
        self.llm = _llm(self.fmt)
        # Each example starts from the same state (an empty pool and prefix cache, the same RNG): hypothesis
        # replays examples, and one whose steps depend on what earlier examples cached is flaky to it.
        self.llm.reset_kv_cache()
        torch.manual_seed(0)
        self.engine = self.llm.engine
        self.runner = FaultyRunner(self.engine.runner)
        self.engine.runner = self.runner
        self.live: set[str] = set()  # ids queued and not yet seen finished
        self.counter = 0

    def teardown(self) -> None:
        if not hasattr(self, "engine"):
            return
        for rid in list(self.engine.requests):
            self.engine.abort_request(rid)
        self.engine.runner = self.runner.runner
        assert not self.engine.has_unfinished_requests() and not self.engine.requests
        assert self.engine.kv.stats().num_in_use == 0
        self._pool_ok()

    def _pool_ok(self) -> None:
        kv = self.engine.kv
        st = kv.stats()
        assert st.num_free + st.num_evictable + st.num_in_use == kv.num_blocks

    def _fresh_id(self) -> str:
        self.counter += 1
        return f"r{self.counter}"

    def _fits(self, n: int, params: SamplingParams) -> bool:
        """Whether the engine must take a prompt of ``n`` tokens: prompt + max_tokens within the context (a
        larger max_tokens is refused, never cut) and within the whole pool."""
        if n + params.max_tokens > MAX_MODEL_LEN:
            return False
        return self.engine.kv.blocks_for(n + params.max_tokens) <= self.engine.num_blocks

    # -- rules -----------------------------------------------------------------------------------
    @rule(ids=token_ids, params=valid_params, salt=st.sampled_from([None, "t1", "t2", ""]),
          text=st.sampled_from([None, "a prompt", "😀"]), duplicate=st.booleans())
    def add_valid(self, ids, params, salt, text, duplicate) -> None:
        rid = next(iter(self.engine.requests), None) if duplicate else None
        rid = rid or self._fresh_id()
        before = len(self.engine.requests)
        try:
            self.engine.add_request(text, ids, params, request_id=rid, cache_salt=salt)
        except PromptTooLongError as e:
            assert not self._fits(len(ids), params) and ("max_model_len" in str(e) or "blocks" in str(e))
            assert len(self.engine.requests) == before
            return
        except ValueError as e:
            assert rid in self.engine.requests and "already in use" in str(e)
            assert len(self.engine.requests) == before
            return
        assert self._fits(len(ids), params) and rid not in self.live
        self.live.add(rid)
        SEEN["added"] += 1

    @rule(ids=token_ids, params=valid_params, data=st.data(), field=st.sampled_from(sorted(BAD_REQUEST)))
    def add_invalid(self, ids, params, data, field) -> None:
        bad = data.draw(st.sampled_from(BAD_REQUEST[field]), label=field)
        args: dict[str, Any] = dict(prompt=None, prompt_token_ids=ids, params=params, request_id=self._fresh_id(),
                                    cache_salt=None)
        if field == "sampling_params":
            args["params"] = bad
        elif field == "stop_token_ids":
            args["params"] = SamplingParams(stop_token_ids=bad)
        else:
            args[field] = bad
        before = (len(self.engine.requests), self.engine.kv.stats().num_in_use)
        with pytest.raises((TypeError, ValueError)) as e:
            self.engine.add_request(args.pop("prompt"), args.pop("prompt_token_ids"), args.pop("params"), **args)
        assert any(name in str(e.value) for name in MESSAGE_NAMES.get(field, (field,))), (field, bad, str(e.value))
        assert (len(self.engine.requests), self.engine.kv.stats().num_in_use) == before
        SEEN[f"rejected:{field}"] += 1

    @rule(data=st.data(), field=st.sampled_from(sorted(BAD_SAMPLING)))
    def bad_sampling_params(self, data, field) -> None:
        bad = data.draw(st.sampled_from(BAD_SAMPLING[field]), label=field)
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: bad})

    @rule(data=st.data())
    def abort(self, data) -> None:
        choices = sorted(self.engine.requests) + ["nobody"]
        rid = data.draw(st.sampled_from(choices), label="abort")
        out = self.engine.abort_request(rid)
        if rid == "nobody":
            assert out is None
        else:
            assert out is not None and out.finished and out.outputs[0].finish_reason == "abort"
            self.live.discard(rid)
            assert rid not in self.engine.requests
            SEEN["finish:abort"] += 1

    def _step_until_finished(self, rids: set[str]) -> None:
        for _ in range(8 * MAX_MODEL_LEN):
            if not rids & self.live:
                return
            self.step(1)
        raise AssertionError(f"requests {sorted(rids & self.live)} never finished")

    @precondition(lambda self: hasattr(self, "engine") and bool(self.engine.requests))
    @rule(data=st.data())
    def doom(self, data) -> None:
        """Make the forward pass raise whenever one queued request (running, or waiting: every request runs at
        least one forward pass) is in the batch, and step until it finished.

        The rules that step until their requests finish make the paths this test must cover (a fault, a stop,
        a preemption) certain once drawn, not dependent on where the search went (which other hypothesis
        users in the same session shift, and so does any edit of this file or of the package's source: hypothesis
        derives its derandomized search from them). Hence also any queued request, not only a running one: a
        request is running only between the steps of a step rule that stopped early, and a search that never
        drew this rule then covered no fault at all."""
        queued = sorted(self.engine.requests)
        rid = data.draw(st.sampled_from(queued), label="doom")
        self.runner.doomed.add(rid)
        self._step_until_finished({rid})

    @rule(ids=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12))
    def stop_at_once(self, ids) -> None:
        """A request whose every token is a stop token finishes with "stop" after one token."""
        rid = self._fresh_id()
        self.engine.add_request(None, ids, SamplingParams(max_tokens=8, stop_token_ids=list(range(VOCAB))),
                                request_id=rid)
        self.live.add(rid)
        SEEN["added"] += 1
        self._step_until_finished({rid})

    @rule()
    def pressure(self) -> None:
        """Two requests that outgrow the pool together (2 x 40 tokens > 56): one must be preempted."""
        rids = set()
        for _ in range(2):
            rid = self._fresh_id()
            self.engine.add_request(None, [9] * 20 + [len(rids)], SamplingParams(max_tokens=20, temperature=0.0,
                                                                                 ignore_eos=True), request_id=rid)
            self.live.add(rid)
            rids.add(rid)
            SEEN["added"] += 1
        self._step_until_finished(rids)

    @rule(n=st.integers(1, 30))
    def step(self, n) -> None:
        SEEN["step rule"] += 1
        for _ in range(n):
            if not self.engine.has_unfinished_requests():
                assert self.engine.step() == []
                return
            doomed_before = set(self.runner.doomed)
            try:
                outs = self.engine.step()
            except EngineStepError as e:  # every request of the step failed alone: here, all were doomed
                assert e.outputs and all(o.request_id in doomed_before for o in e.outputs)
                outs = e.outputs
            SEEN["steps"] += 1
            for out in outs:
                c = out.outputs[0]
                SEEN[f"finish:{c.finish_reason}"] += out.finished
                assert out.request_id in self.live
                if c.finish_reason == "error":
                    assert out.request_id in doomed_before and "injected fault" in (c.error or "")
                else:
                    assert c.error is None and c.finish_reason in (None, "stop", "length")
                if out.finished:
                    self.live.discard(out.request_id)
                    assert out.request_id not in self.engine.requests
            self._pool_ok()

    @rule(n=st.integers(1, 30))
    def step_more(self, n) -> None:
        """Steps drawn twice as often as the other rules."""
        self.step(n)

    # -- invariants ------------------------------------------------------------------------------
    @invariant()
    def pool_and_queues_agree(self) -> None:
        if not hasattr(self, "engine"):
            return
        self._pool_ok()
        sched = self.engine.scheduler
        queued = {r.request_id for r in sched.running} | {r.request_id for r in sched.waiting}
        assert queued == set(self.engine.requests) == self.live


class Int4EngineMachine(EngineMachine):
    """The same on a quantize-on-seal format (tail slots, seals, re-runs after a failed forward)."""

    fmt = "int4"


@pytest.mark.parametrize("machine,examples", [(EngineMachine, 300), (Int4EngineMachine, 150)], ids=["float32", "int4"])
def test_engine_fuzz(machine: type[EngineMachine], examples: int) -> None:
    torch.manual_seed(0)
    SEEN.clear()
    preemptions = _llm(machine.fmt).engine.scheduler.num_preemptions
    run_state_machine_as_test(
        machine,
        settings=settings(max_examples=examples, stateful_step_count=25, deadline=None, database=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]),
    )
    SEEN["preemptions"] = _llm(machine.fmt).engine.scheduler.num_preemptions - preemptions
    print(machine.fmt, dict(sorted(SEEN.items())))
    # the runs reached what they are for: requests finished every way, faults isolated, preemption, rejections
    for key in ("finish:length", "finish:stop", "finish:abort", "finish:error", "preemptions", "added"):
        assert SEEN[key] > 0, (key, SEEN)
    assert sum(v for k, v in SEEN.items() if k.startswith("rejected:")) > 0
