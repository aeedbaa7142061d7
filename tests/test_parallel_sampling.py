"""Parallel sampling (issue 16): ``SamplingParams(n=...)``, the engine's parents and children, HTTP ``n``.

The n completions of a request share its prompt's blocks: the first computes the prompt, all sample their first
tokens from its logits, the others fork from it. Checked: greedy completions equal ``n=1``; seeded sampled ones are
reproducible, not all equal, and each equals a lone request with its derived seed; exact peak blocks, copies and
recomputed prompt tokens per format and prompt length (issue 29); the peak blocks of ``n=8`` stay near one prompt;
aborting the parent ends every completion and frees every block; streams carry each completion's deltas
under its index; the HTTP endpoints return ``n`` choices with usage counting each token once.
"""
from __future__ import annotations

import json
import time
from typing import Any

import pytest
import torch

from _tiny import tiny_loaded
from kvpage import LLM, SamplingParams
from kvpage.engine.sampling import MAX_N, child_params, child_seed

PROMPT = {"prompt_token_ids": list(range(10, 70))}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(tiny_loaded(), progress=False, num_blocks=400, block_size=16, max_num_seqs=16)


def test_n_is_checked_and_children_get_derived_seeds() -> None:
    for bad in (0, MAX_N + 1, 1.5, "2", True):
        with pytest.raises(ValueError, match="n must be an integer"):
            SamplingParams(n=bad)
    assert SamplingParams(n=3).n == 3
    assert child_seed(None, 3) is None and child_seed(7, 0) == 7
    seeds = {child_seed(7, i) for i in range(50)}
    assert len(seeds) == 50 and seeds == {child_seed(7, i) for i in range(50)}
    p = child_params(SamplingParams(n=5, seed=7, temperature=0.7, top_k=5, stop=["x"], max_tokens=9), 2)
    assert (p.n, p.seed, p.temperature, p.top_k, p.stop, p.max_tokens) == (1, child_seed(7, 2), 0.7, 5, ("x",), 9)


def test_greedy_completions_are_identical_and_equal_n_1(llm: LLM) -> None:
    one = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0))[0].outputs[0]
    out = llm.generate(PROMPT, SamplingParams(n=4, max_tokens=12, temperature=0))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(c.token_ids == one.token_ids and c.text == one.text and c.finish_reason == "length"
               for c in out.outputs)
    assert out.metrics.output_tokens == 4 * 12 and out.metrics.prompt_tokens == 60


def test_seeded_samples_are_reproducible_and_differ(llm: LLM) -> None:
    params = SamplingParams(n=6, max_tokens=10, temperature=1.0, seed=11)
    a = [c.token_ids for c in llm.generate(PROMPT, params)[0].outputs]
    b = [c.token_ids for c in llm.generate(PROMPT, params)[0].outputs]
    assert a == b
    assert len({tuple(t) for t in a}) > 1
    # completion 0 samples as the same request with n=1 would
    solo = llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=1.0, seed=11))[0].outputs[0].token_ids
    assert a[0] == solo


def test_completions_share_the_prompt_blocks(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """n=8 on a long prompt: peak blocks in use <= prompt blocks + 8 x (generated blocks + 1), from the pool."""
    llm.reset_prefix_cache()
    bs = llm.spec.block_size
    prompt = {"prompt_token_ids": torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(3)).tolist()}
    gen = 20
    peak = 0
    engine = llm.engine
    step = engine.step

    def watched() -> list:
        nonlocal peak
        out = step()
        peak = max(peak, llm.kv_cache_stats().num_in_use)
        return out

    monkeypatch.setattr(engine, "step", watched)
    out = llm.generate(prompt, SamplingParams(n=8, max_tokens=gen, temperature=1.0, seed=1, ignore_eos=True))[0]
    monkeypatch.undo()
    assert all(len(c.token_ids) == gen for c in out.outputs)
    prompt_blocks = -(-300 // bs)
    bound = prompt_blocks + 8 * (-(-gen // bs) + 1)
    assert peak <= bound, (peak, bound)
    assert peak < 8 * prompt_blocks / 2  # far below eight separate prompts
    assert llm.kv_cache_stats().num_in_use == 0


def test_aborting_the_parent_ends_every_completion_and_frees_every_block(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request(None, list(range(20, 60)), SamplingParams(n=5, max_tokens=50, temperature=1.0),
                       request_id="parent")
    engine.step()  # the first completion computes the prompt; the others are held
    engine.step()  # now they run
    out = engine.abort_request("parent")
    assert out is not None and out.finished and out.request_id == "parent"
    assert [c.finish_reason for c in out.outputs] == ["abort"] * 5
    assert not engine.has_unfinished_requests()
    assert llm.kv_cache_stats().num_in_use == 0
    assert engine.abort_request("parent") is None
    # aborted while the others were still held
    engine.add_request(None, list(range(20, 60)), SamplingParams(n=3, max_tokens=5, temperature=1.0),
                       request_id="early")
    out = engine.abort_request("early")
    assert out is not None and [c.finish_reason for c in out.outputs] == ["abort"] * 3
    assert not engine.has_unfinished_requests() and llm.kv_cache_stats().num_in_use == 0


@pytest.mark.parametrize("steps", [0, 2])  # while the others are held / once every completion runs
def test_aborting_one_completion_id_is_refused_and_changes_nothing(llm: LLM, steps: int) -> None:
    """``"q#1"`` is the engine's own id of completion 1 of ``"q"``: aborting it alone is refused (it used to end that
    completion with index 0 and leave the parent to finish with a completion of ``finish_reason=None``)."""
    engine = llm.engine
    engine.add_request(None, list(range(20, 40)), SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=1,
                                                                 ignore_eos=True), request_id="q")
    for _ in range(steps):
        engine.step()
    for child in ("q#0", "q#1", "q#2"):
        with pytest.raises(ValueError, match=rf"request_id '{child}' is one completion of request 'q'.*abort 'q'"):
            engine.abort_request(child)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "q" and out.finished:
                final = out
    assert final is not None
    assert [(c.index, c.finish_reason, len(c.token_ids)) for c in final.outputs] == [(i, "length", 8) for i in range(3)]
    assert llm.kv_cache_stats().num_in_use == 0
    assert engine.abort_request("q#1") is None  # finished: an unknown id again

def test_stream_deltas_add_up_per_completion(llm: LLM) -> None:
    texts: dict[int, str] = {}
    tokens: dict[int, list[int]] = {}
    last = None
    for out in llm.generate_stream(PROMPT, SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=2)):
        assert [c.index for c in out.outputs] == [0, 1, 2]
        for c in out.outputs:
            texts[c.index] = texts.get(c.index, "") + c.delta_text
            tokens.setdefault(c.index, []).extend(c.delta_token_ids)
        last = out
    assert last is not None and last.finished
    for c in last.outputs:
        assert tokens[c.index] == c.token_ids and texts[c.index] == c.text


def test_a_request_id_in_use_by_a_parent_is_refused(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request(None, [1, 2, 3], SamplingParams(n=2, max_tokens=2, temperature=1.0), request_id="dup")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(None, [1, 2, 3], SamplingParams(max_tokens=2), request_id="dup")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(None, [1, 2, 3], SamplingParams(max_tokens=2), request_id="dup#1")
    engine.abort_request("dup")


# -- HTTP ---------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(llm: LLM):
    import httpx

    from kvpage.server.app import ServerThread, build_app

    with ServerThread(build_app(llm, "tiny")) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            yield http


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hello there"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}]}),
])
def test_http_n_returns_n_choices_and_counts_each_token_once(server, path: str, body: dict) -> None:
    r = server.post(path, json={"model": "tiny", **body, "n": 3, "max_tokens": 6, "temperature": 1.0, "seed": 4})
    assert r.status_code == 200, r.text
    data = r.json()
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    u = data["usage"]
    assert u["completion_tokens"] == 18 and u["total_tokens"] == u["prompt_tokens"] + 18
    # streamed: every chunk's choice carries its index; the deltas add up to the whole answers
    r2 = server.post(path, json={"model": "tiny", **body, "n": 3, "max_tokens": 6, "temperature": 1.0, "seed": 4,
                                 "stream": True, "stream_options": {"include_usage": True}})
    got: dict[int, str] = {0: "", 1: "", 2: ""}
    finished: list[int] = []
    usage = None
    for line in r2.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            usage = chunk["usage"]
        for c in chunk["choices"]:
            piece = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
            got[c["index"]] += piece or ""
            if c.get("finish_reason"):
                finished.append(c["index"])
    assert sorted(finished) == [0, 1, 2]
    whole = [c.get("text") if "text" in c else c["message"]["content"] for c in data["choices"]]
    assert [got[i] for i in range(3)] == whole  # same seed: the same answers streamed
    assert usage is not None and usage["completion_tokens"] == 18


def test_http_stream_disconnect_frees_every_completion(server, llm: LLM) -> None:
    """A client that leaves a streamed n=4 request midway: every completion is aborted and every block freed."""
    from test_server import metric, scrape

    url = str(server.base_url).rstrip("/")
    before = metric(scrape(url), "kvpage:request_success_total", finished_reason="abort")
    body = {"model": "tiny", "prompt": "once", "n": 4, "max_tokens": 400, "temperature": 1.0, "ignore_eos": True,
            "stream": True}
    with server.stream("POST", "/v1/completions", json=body) as r:
        for _ in r.iter_lines():
            break  # one chunk, then hang up
    deadline = time.monotonic() + 20
    while True:
        after = scrape(url)
        done = metric(after, "kvpage:request_success_total", finished_reason="abort") - before
        if done >= 1 and metric(after, "kvpage:num_requests_running") == 0:
            break
        assert time.monotonic() < deadline, "the abandoned request was not aborted"
        time.sleep(0.05)
    assert metric(after, "kvpage:kv_cache_usage_perc") == 0.0


# -- fork and copy-on-write through the engine ---------------------------------------------------------------------

def _peaked(seed: int = 0):
    """The tiny model with weights x8: next-token distributions peaked enough that sampling at temperature 1e-3
    picks the argmax (so forked completions must equal greedy unless their KV is wrong)."""
    loaded = tiny_loaded(seed)
    with torch.no_grad():
        for name, p in loaded.model.named_parameters():
            if "norm" not in name:
                p.mul_(8.0)
    return loaded


@pytest.mark.parametrize("fmt", ["float32", "int8", "int4"])
def test_completions_fork_from_the_first_and_copy_its_partial_block(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefix caching off: the completions still share the prompt, by fork (int4: whole blocks); the partial block
    is copied on write by every holder but the last writer, and every completion reads exactly the prompt's KV
    (equal to greedy at temperature 1e-3)."""
    llm = LLM(_peaked(), progress=False, num_blocks=200, block_size=16, enable_prefix_caching=False,
              kv_cache_dtype=fmt)
    kv, controller = llm._built.kv, llm._built.controller
    greedy = llm.generate(PROMPT, SamplingParams(max_tokens=20, temperature=0))[0].outputs[0].token_ids
    forks: list[tuple[int, bool]] = []
    copies: list[int] = []
    fork, copy_blocks = kv.fork, controller.copy_blocks

    def forked(p: Any, c: Any, n: int) -> bool:
        ok = fork(p, c, n)  # KVCache.fork says False when a group refuses (the old manager raised)
        forks.append((n, ok))
        return ok

    def copied(pairs: Any, window_pairs: Any = None) -> None:
        # the copy-on-write copies of a step plan, applied to the tensors by the worker (Worker.begin_step)
        copies.append(len(pairs))
        copy_blocks(pairs, window_pairs)

    monkeypatch.setattr(kv, "fork", forked)
    monkeypatch.setattr(controller, "copy_blocks", copied)
    out = llm.generate(PROMPT, SamplingParams(n=5, max_tokens=20, temperature=1e-3, seed=3))[0]
    assert all(c.token_ids == greedy for c in out.outputs)
    assert forks == [(60 if fmt != "int4" else 48, True)] * 4  # the whole prompt (int4: its whole blocks)
    assert sum(copies) == (4 if fmt != "int4" else 0)  # 60 % 16 != 0: the partial block copied by all but one of 5
    assert llm.kv_cache_stats().num_in_use == 0


def test_window_completions_fork_with_their_window_slots(tmp_path_factory: pytest.TempPathFactory, smollm2) -> None:
    """A Gemma-3-style model: forks pin the window slots of the shared blocks and copy-on-write copies the
    partial block's window slot too; every completion equals greedy at temperature 1e-3."""
    from test_sliding_window import _gemma_folder

    from kvpage.cache.groups import SlidingWindowManager

    folder = _gemma_folder(tmp_path_factory.mktemp("gemma_fork"), smollm2.tokenizer, window=32, context=300)
    llm = LLM(str(folder), progress=False, num_blocks=120, block_size=16, enable_prefix_caching=False,
              kv_cache_dtype="int8")
    win = llm._built.groups[1]
    assert isinstance(win, SlidingWindowManager)
    prompt = {"prompt_token_ids": torch.randint(100, 40000, (70,), generator=torch.Generator().manual_seed(5)).tolist()}
    greedy = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0))[0].outputs[0].token_ids
    out = llm.generate(prompt, SamplingParams(n=4, max_tokens=16, temperature=1e-3, seed=8))[0]
    assert all(c.token_ids == greedy for c in out.outputs)
    assert win.num_pinned_slots == 0 and win.num_free_slots + win.num_cached_slots == win.num_slots
    assert llm.kv_cache_stats().num_in_use == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_child_preempted_before_its_copy_ran_swaps_out_the_copied_kv(mode: str) -> None:
    """Regression (fresh-user pass, issue 27): a completion forked in the step that preempts it, before the step
    plan copied its partial block, swapped that block out uncopied (and the pending copy was then dropped), so it
    resumed on garbage KV. Its completions (seeded) are those of a pool roomy enough for no preemption at all."""
    prompts = [{"prompt_token_ids": list(range(40 + 9 * i, 58 + 9 * i))} for i in range(2)]  # 18 tokens: a partial block
    params = SamplingParams(max_tokens=40, temperature=1e-3, seed=7, n=2, ignore_eos=True)
    roomy = LLM(tiny_loaded(), progress=False, block_size=16)
    want = [[c.token_ids for c in o.outputs] for o in roomy.generate(prompts, params)]
    assert roomy.kv_cache_stats().preemptions == 0
    kw: dict[str, Any] = dict(swap_space=0.01) if mode == "swap" else {}
    llm = LLM(tiny_loaded(), progress=False, block_size=16, num_blocks=6, preemption_mode=mode, **kw)
    outs = llm.generate(prompts, params)
    st = llm.kv_cache_stats()
    assert st.preemptions > 0 and (mode == "recompute" or st.tiers.swapped_out_blocks > 0)  # type: ignore[union-attr]
    assert [[c.token_ids for c in o.outputs] for o in outs] == want
    assert st.num_in_use == 0


# -- block accounting: the prompt computed once, its blocks shared, copies only for a partial last block -----------

def block_target(prompt_len: int, n: int, max_tokens: int, bs: int, fmt: str) -> dict[str, int]:
    """What ``n`` completions of ``max_tokens`` over a ``prompt_len``-token prompt may cost (issue 29 item 3).

    A completion writes KV for ``prompt_len + max_tokens - 1`` positions (its last token is sampled, never run). The
    prompt is computed once; a partial last block is copied on write by all holders but the last writer, which keeps
    the original; quantize-on-seal formats (whose partial block lives in the 16-bit tail) have each other completion
    recompute that block's prompt tokens into a block of its own instead (the same blocks, no copy)."""
    prompt_blocks = -(-prompt_len // bs)
    generated = -(-(prompt_len + max_tokens - 1) // bs) - prompt_blocks
    partial = prompt_len % bs
    sealed = fmt in ("int4", "int2")
    extra = n - 1 if partial else 0
    return {"peak": prompt_blocks + n * generated + extra, "copies": 0 if sealed else extra,
            "recomputed": (n - 1) * partial if sealed else 0}


def block_accounting(llm: LLM, prompt_len: int, n: int, max_tokens: int, seed: int = 1) -> dict[str, Any]:
    """Peak blocks in use (read at the end of every scheduling pass, copy sources still held), copies the step plans
    handed the worker, prompt tokens computed beyond one prompt, and the completions' tokens."""
    kv = llm.engine.kv
    seen = {"peak": 0, "copies": 0}
    step_plan = kv.step_plan

    def watched() -> Any:
        seen["peak"] = max(seen["peak"], kv.stats().num_in_use)
        plan = step_plan()
        seen["copies"] += len(plan.copies)
        return plan

    kv.step_plan = watched  # type: ignore[method-assign]
    before = llm.engine.prompt_tokens_computed
    try:
        prompt = {"prompt_token_ids": [(7 * i + 3) % 250 for i in range(prompt_len)]}
        out = llm.generate(prompt, SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0, seed=seed,
                                                  ignore_eos=True))[0]
    finally:
        del kv.step_plan
    assert llm.kv_cache_stats().num_in_use == 0
    assert [len(c.token_ids) for c in out.outputs] == [max_tokens] * n
    return {**seen, "recomputed": llm.engine.prompt_tokens_computed - before - prompt_len,
            "tokens": [c.token_ids for c in out.outputs]}


@pytest.fixture(scope="module", params=["float32", "int8", "int4"])
def fmt_llm(request: pytest.FixtureRequest) -> tuple[str, LLM]:
    return request.param, LLM(tiny_loaded(), progress=False, num_blocks=300, block_size=16,
                              enable_prefix_caching=False, kv_cache_dtype=request.param, max_num_seqs=32)


@pytest.mark.parametrize("n", [2, 4, 16])
@pytest.mark.parametrize("prompt_len", [15, 16, 17])
def test_completions_compute_the_prompt_once_and_copy_only_a_partial_last_block(
        fmt_llm: tuple[str, LLM], prompt_len: int, n: int) -> None:
    """Regression (issue 29 item 3): each completion forked at the last prompt token and recomputed it, so a prompt
    of exactly one block made n - 1 copies (n=4: a peak of 12 blocks where 9 suffice), a 15-token prompt copied the
    parent's own partial block too (n copies where n - 1 do), and int4 shared nothing of a one-block prompt. Now
    the prompt is computed once and the n first tokens are sampled from its logits: peak blocks, copies and
    recomputed prompt tokens are exactly the target's."""
    fmt, llm = fmt_llm
    got = block_accounting(llm, prompt_len, n, max_tokens=20)
    want = block_target(prompt_len, n, 20, 16, fmt)
    assert {k: got[k] for k in want} == want


def test_each_completion_samples_as_its_own_seeded_request() -> None:
    """The per-completion seeding contract (``child_seed``): completion ``i`` of a request seeded with ``s`` draws
    what a lone ``n=1`` request seeded with ``child_seed(s, i)`` draws, its first token included (sampled from the
    shared prompt pass's logits with its own generator); float32, so the shared pass reads what a lone one does."""
    llm = LLM(tiny_loaded(), progress=False, num_blocks=300, block_size=16, enable_prefix_caching=False,
              kv_cache_dtype="float32")
    for prompt_len in (15, 16, 17):
        got = block_accounting(llm, prompt_len, 4, max_tokens=12, seed=5)["tokens"]
        prompt = {"prompt_token_ids": [(7 * i + 3) % 250 for i in range(prompt_len)]}
        alone = [llm.generate(prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=child_seed(5, i),
                                                     ignore_eos=True))[0].outputs[0].token_ids for i in range(4)]
        assert got == alone
        assert len({tuple(t) for t in got}) > 1


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_window_model_completions_meet_the_block_target(fmt: str, tmp_path_factory: pytest.TempPathFactory,
                                                       smollm2) -> None:
    """A Gemma-3-style model (sliding-window groups: window slots; int4: sealed codes in window slots) meets the same
    exact block accounting as a full-attention one for prompts of bs - 1, bs and bs + 1 tokens, and its window
    slots are all given back."""
    from test_sliding_window import _gemma_folder

    folder = _gemma_folder(tmp_path_factory.mktemp(f"gemma_fork_{fmt}"), smollm2.tokenizer, window=32, context=300)
    llm = LLM(str(folder), progress=False, num_blocks=120, block_size=16, enable_prefix_caching=False,
              kv_cache_dtype=fmt, max_num_seqs=8)
    from kvpage.cache.groups import SealedWindowManager, SlidingWindowManager

    group = llm._built.groups[1]
    win = group.window if isinstance(group, SealedWindowManager) else group
    assert isinstance(win, SlidingWindowManager)
    for prompt_len in (15, 16, 17):
        got = block_accounting(llm, prompt_len, 4, max_tokens=20)
        want = block_target(prompt_len, 4, 20, 16, fmt)
        assert {k: got[k] for k in want} == want, prompt_len
    assert win.num_pinned_slots == 0 and win.num_free_slots + win.num_cached_slots == win.num_slots
