"""``LLM.generate`` and ``generate_stream`` calls interleaved on one engine: every output reaches its owner.

Regression tests for what a tester found: a paused stream whose request a later ``generate`` call
stepped to the end then waited forever (the outputs went to the other caller's loop and were dropped),
two interleaved streams each lost the deltas the other's steps produced, and a request failing alone
in its step made ``generate`` raise and drop the other requests' finished outputs.
"""
from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from _tiny import tiny_loaded
from kvpage import LLM, SamplingParams
from kvpage.engine.model_runner import ScheduledRequest
from kvpage.engine.output_router import RequestLostError

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
A = {"prompt_token_ids": [5, 17, 29, 41]}
B = {"prompt_token_ids": [200, 3, 3, 90, 12]}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(tiny_loaded(0), kv_cache_dtype="float32", block_size=4, num_blocks=64, progress=False)


@pytest.fixture(scope="module")
def alone(llm: LLM) -> dict[str, list[int]]:
    """Each prompt's greedy tokens when it runs by itself."""
    return {k: llm.generate([p], GREEDY)[0].outputs[0].token_ids for k, p in (("a", A), ("b", B))}


def _idle(llm: LLM) -> None:
    st = llm.kv_cache_stats()
    assert st.num_in_use == 0 and not llm.engine.has_unfinished_requests()
    assert not llm._router._routes, "a finished call left routes behind"


def _drain(stream) -> tuple[list[int], str, str | None]:
    ids: list[int] = []
    text, reason = "", None
    for out in stream:
        c = out.outputs[0]
        ids += c.delta_token_ids
        text += c.delta_text
        reason = c.finish_reason if out.finished else reason
    return ids, text, reason


def test_a_paused_stream_survives_a_generate_that_finishes_its_request(llm: LLM, alone) -> None:
    s = llm.generate_stream([A], GREEDY)
    first = next(s)
    other = llm.generate([B], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert other.outputs[0].finish_reason == "length"
    ids, _, reason = _drain(s)  # used to spin forever: its outputs had gone to generate's loop
    assert first.outputs[0].delta_token_ids + ids == alone["a"] and reason == "length"
    _idle(llm)


def test_interleaved_streams_lose_no_delta(llm: LLM, alone) -> None:
    s1, s2 = llm.generate_stream([A], GREEDY), llm.generate_stream([B], GREEDY)
    o1, o2 = next(s1), next(s2)
    ids1, text1, _ = _drain(s1)
    ids2, text2, _ = _drain(s2)
    got1 = o1.outputs[0].delta_token_ids + ids1
    got2 = o2.outputs[0].delta_token_ids + ids2
    assert len(got1) == len(got2) == GREEDY.max_tokens
    # batched with each other: same arithmetic per row here (float32 cache, tiny model), so the same tokens
    assert got1 == alone["a"] and got2 == alone["b"]
    assert o1.outputs[0].delta_text + text1 == llm.tokenizer.decode(got1, skip_special_tokens=True)
    _idle(llm)


def test_closing_a_stream_aborts_only_its_requests(llm: LLM, alone) -> None:
    s1, s2 = llm.generate_stream([A], GREEDY), llm.generate_stream([B], GREEDY)
    next(s1), next(s2)
    s1.close()
    ids, _, reason = _drain(s2)
    assert reason == "length" and len(ids) == GREEDY.max_tokens - 1
    _idle(llm)


class FailAfter:
    """A runner that raises whenever the request with a ``prompt_len``-token prompt is in the batch once it has
    ``after`` tokens computed (so it first makes progress)."""

    def __init__(self, runner, prompt_len: int, after: int) -> None:
        self.runner, self.prompt_len, self.after = runner, prompt_len, after

    def execute(self, batch: Sequence[ScheduledRequest], **kw) -> torch.Tensor:
        if any(r.num_prompt_tokens == self.prompt_len and r.num_computed >= self.after for r in batch):
            raise RuntimeError("late failure")
        return self.runner.execute(batch, **kw)


def test_a_request_failing_alone_in_its_step_is_an_error_output_not_an_exception(llm: LLM, alone) -> None:
    """Once the short request finished, the long one is alone in its steps, so its failure cannot be told
    from a broken model (the engine raises EngineStepError); generate still answers for both."""
    real = llm.engine.runner
    n = len(B["prompt_token_ids"])
    llm.engine.runner = FailAfter(real, n, after=n + 3)
    try:
        short, long = llm.generate([A, B], [SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
                                            SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)])
    finally:
        llm.engine.runner = real
    assert short.outputs[0].finish_reason == "length" and short.outputs[0].token_ids == alone["a"][:2]
    assert long.outputs[0].finish_reason == "error" and "late failure" in (long.outputs[0].error or "")
    assert 0 < len(long.outputs[0].token_ids) < 20
    _idle(llm)
    assert llm.generate([A], GREEDY)[0].outputs[0].token_ids == alone["a"]  # still usable


def test_a_request_finished_behind_the_callers_back_is_reported_not_waited_for(llm: LLM) -> None:
    s = llm.generate_stream([A], GREEDY)
    first = next(s)
    assert llm.engine.abort_request(first.request_id) is not None  # bypasses the stream
    with pytest.raises(RequestLostError, match="outside"):
        next(s)
    _idle(llm)
