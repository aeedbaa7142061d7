"""Continuous batching on the real model: prefix caching, chunked prefill and preemption never change greedy outputs."""
from __future__ import annotations

import pytest

from kvpage import LLM, SamplingParams

SYSTEM = (
    "You are a careful assistant for a public library. Answer briefly and precisely. "
    "The library opens at nine in the morning and closes at six in the evening on weekdays, "
    "and at four on Saturdays. It is closed on Sundays and public holidays. Members may borrow "
    "up to ten books for three weeks, renew them twice online, and reserve up to five titles. "
) * 3
QUESTIONS = [
    "When does the library open on weekdays?",
    "How many books can a member borrow?",
    "Is the library open on Sundays?",
    "How long is the loan period?",
    "Can I renew a book online?",
    "How many titles can I reserve?",
    "When does it close on Saturdays?",
    "Write one sentence welcoming a new member.",
]
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _prompts(llm: LLM) -> list[dict]:
    return [llm.chat_prompt([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(smollm2):
    """Each prompt alone, no prefix caching, no chunking: the ground truth."""
    llm = LLM(smollm2, kv_cache_dtype="float32", num_blocks=256, enable_prefix_caching=False,
              enable_chunked_prefill=False, max_num_batched_tokens=4096, progress=False)
    return [llm.generate([p], PARAMS)[0].outputs[0].token_ids for p in _prompts(llm)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,kwargs",
    [
        ("caching on", dict(enable_prefix_caching=True, max_num_batched_tokens=512)),
        ("caching off", dict(enable_prefix_caching=False, max_num_batched_tokens=512)),
        ("chunked prefill, 64-token steps", dict(enable_chunked_prefill=True, max_num_batched_tokens=64)),
        ("no chunked prefill", dict(enable_chunked_prefill=False, max_num_batched_tokens=600)),
    ],
)
def test_shared_prefix_outputs_identical(smollm2, reference, name, kwargs):
    llm = LLM(smollm2, kv_cache_dtype="float32", num_blocks=256, progress=False, **kwargs)
    outs = llm.generate(_prompts(llm), PARAMS)
    assert [o.outputs[0].token_ids for o in outs] == reference, name
    assert llm.kv_cache_stats().num_in_use == 0
    prompt_len = outs[0].metrics.prompt_tokens
    stats = llm.kv_cache_stats()
    if llm.engine_config.enable_prefix_caching:
        # Requests admitted in the first step find nothing (blocks are indexed only once written, C18);
        # later ones hit the full blocks of the shared chat prefix written so far: whole blocks, never
        # past the shared prefix, all of it once the first request's prefill is done.
        ids = [o.prompt_token_ids for o in outs]
        common = next(i for i in range(len(ids[0])) if len({tuple(x[: i + 1]) for x in ids}) > 1)
        expected = common // 16 * 16
        cached = [o.metrics.cached_tokens for o in outs]
        assert outs[0].metrics.cached_tokens == 0
        assert all(c % 16 == 0 and c <= expected for c in cached) and max(cached) == expected, (cached, expected)
        assert stats.prefix_hits == sum(cached)
        assert 0 < stats.hit_rate < 1
    else:
        assert all(o.metrics.cached_tokens == 0 for o in outs) and stats.prefix_hits == 0
    assert prompt_len > 200  # a long shared prefix


@pytest.mark.slow
def test_small_pool_preempts_and_outputs_stay_identical(smollm2, reference):
    # ~250-token prompts + 12 outputs need 17 blocks each, 14 of them the shared prefix; 19 blocks hold
    # the prefix plus a few private tails, so growing decodes run out and later requests are preempted
    # (recompute) and readmitted.
    llm = LLM(smollm2, kv_cache_dtype="float32", num_blocks=19, max_num_batched_tokens=128, progress=False)
    outs = llm.generate(_prompts(llm), PARAMS)
    assert llm.engine.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert llm.kv_cache_stats().num_in_use == 0
    s = llm.kv_cache_stats()
    assert s.num_free + s.num_evictable + s.num_in_use == s.num_blocks == 19


@pytest.mark.slow
def test_stream_deltas_add_up_and_closing_aborts(smollm2):
    llm = LLM(smollm2, kv_cache_dtype="int8", num_blocks=128, progress=False)
    prompts = _prompts(llm)[:3]
    params = SamplingParams(max_tokens=10, temperature=0.0)
    texts: dict[str, str] = {}
    tokens: dict[str, list[int]] = {}
    finals = {}
    for out in llm.generate_stream(prompts, params):
        c = out.outputs[0]
        texts[out.request_id] = texts.get(out.request_id, "") + c.delta_text
        tokens.setdefault(out.request_id, []).extend(c.delta_token_ids)
        if out.finished:
            finals[out.request_id] = out
    assert len(finals) == 3
    for rid, out in finals.items():
        assert texts[rid] == out.outputs[0].text
        assert tokens[rid] == out.outputs[0].token_ids
        assert out.metrics.time_to_first_token_s is not None and out.metrics.time_to_first_token_s > 0
    # closing the stream early aborts what is still running and frees its blocks
    stream = llm.generate_stream(prompts, SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    next(stream)
    assert llm.kv_cache_stats().num_in_use > 0
    stream.close()
    assert llm.kv_cache_stats().num_in_use == 0
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.slow
def test_abort_reports_reason_and_frees(smollm2):
    llm = LLM(smollm2, kv_cache_dtype="float32", num_blocks=64, progress=False)
    ids = llm.chat_prompt("Count from one to fifty.")["prompt_token_ids"]
    req = llm.engine.add_request(None, ids, SamplingParams(max_tokens=40, temperature=0.0))
    llm.engine.step()
    llm.engine.step()
    out = llm.engine.abort_request(req.request_id)
    assert out is not None and out.finished and out.outputs[0].finish_reason == "abort"
    assert len(out.outputs[0].token_ids) == 2
    assert llm.kv_cache_stats().num_in_use == 0
    assert llm.engine.abort_request(req.request_id) is None   # already finished: nothing to do


def test_identical_requests_in_a_pool_their_twins_fill_finish_like_a_roomy_pool() -> None:
    """Regression (fresh-user pass, issue 27): two identical requests in a pool that holds one of them whole. The
    second's blocks duplicate the first's indexed ones and keep them referenced (its twins), so a running request
    could only preempt itself; the step came out empty and the engine raised "waiting requests cannot be
    scheduled". An empty step that preempted makes room for the next one: both finish, as in a roomy pool."""
    from _tiny import tiny_loaded

    prompt = {"prompt_token_ids": list(range(60, 76))}  # 16 tokens + 80 out = 6 blocks of 16: the whole pool
    params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    want = LLM(tiny_loaded(), progress=False, block_size=16).generate([prompt], params)[0].outputs[0].token_ids
    tight = LLM(tiny_loaded(), progress=False, block_size=16, num_blocks=6)
    outs = tight.generate([prompt, prompt], params)
    assert [o.outputs[0].token_ids for o in outs] == [want, want]
    assert tight.kv_cache_stats().preemptions > 0 and tight.kv_cache_stats().num_in_use == 0
