"""Every field of ``add_request``, ``SamplingParams``, ``LLM.generate/chat`` and ``ForcedSequence.feed`` is checked
where it enters, with a message naming the field; nothing is queued by a call that fails.

The rule (``kvpage.engine.validate``): a wrong Python type of an argument is a ``TypeError``; a malformed or
out-of-range value is a ``ValueError``; ``SamplingParams`` raises ``ValueError`` for every bad field (as vLLM).
Also: a request cut at ``length`` inside a multi-byte character does not end in U+FFFD.
"""
from __future__ import annotations

import pytest

from _tiny import EOS, VOCAB, tiny_loaded
from kvpage import LLM, SamplingParams
from kvpage.errors import PromptTooLongError

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(tiny_loaded(0), kv_cache_dtype="float32", block_size=16, num_blocks=32, progress=False)


def _idle(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests
    st = llm.kv_cache_stats()
    assert st.num_in_use == 0 and st.num_free + st.num_evictable == llm.num_blocks


# -- SamplingParams ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(top_k=-5), dict(top_k=-2), dict(top_k=True), dict(stop_token_ids=[-1]), dict(stop_token_ids=[True]),
        dict(stop_token_ids=["3"]), dict(stop_token_ids=[1.0]), dict(stop_token_ids="12"), dict(stop_token_ids=5),
        dict(stop=[1]), dict(stop=["ok", None]), dict(stop=5), dict(stop={"a"}), dict(ignore_eos=1),
        dict(ignore_eos="yes"), dict(seed=-(2**63) - 1), dict(seed=2**64), dict(seed=True), dict(max_tokens=None),
        dict(temperature=None), dict(top_p="0.5"),
    ],
)
def test_bad_sampling_fields_are_value_errors_naming_the_field(kwargs) -> None:
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_sampling_fields_that_are_valid() -> None:
    assert SamplingParams(top_k=0).top_k == 0 and SamplingParams(top_k=-1).top_k == -1  # both disable (vLLM)
    assert SamplingParams(top_k=3).top_k == 3
    for seed in (0, -1, -(2**63), 2**64 - 1):  # torch.Generator.manual_seed's range (negatives remapped by torch)
        SamplingParams(seed=seed)
    p = SamplingParams(stop=["a"], stop_token_ids=range(2, 4))
    assert p.stop == ("a",) and p.stop_token_ids == (2, 3) and isinstance(p.stop, tuple)
    assert SamplingParams(stop=None).stop == () and SamplingParams(stop="x").stop == ("x",)


def test_sampling_params_survive_dataclasses_replace() -> None:
    from dataclasses import replace

    p = replace(SamplingParams(stop="END", seed=3), max_tokens=7)
    assert (p.max_tokens, p.stop, p.seed) == (7, ("END",), 3)
    with pytest.raises(ValueError, match="max_tokens"):
        replace(p, max_tokens=0)


# -- LLMEngine.add_request ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,kwargs,exc,field",
    [
        (("\ud800", [1, 2]), {}, ValueError, "prompt"),
        ((5, [1, 2]), {}, TypeError, "prompt"),
        ((None, "12"), {}, TypeError, "prompt_token_ids"),
        ((None, 12), {}, TypeError, "prompt_token_ids"),
        ((None, {"prompt_token_ids": [1]}), {}, TypeError, "prompt_token_ids"),
        ((None, [1, True]), {}, ValueError, r"prompt_token_ids\[1\]"),
        ((None, [1, "2"]), {}, ValueError, r"prompt_token_ids\[1\]"),
        ((None, [1.0]), {}, ValueError, r"prompt_token_ids\[0\]"),
        ((None, [1, VOCAB]), {}, ValueError, "outside the vocabulary"),
        ((None, [-3]), {}, ValueError, "outside the vocabulary"),
        ((None, []), {}, ValueError, "empty prompt"),
        ((None, [1], {"max_tokens": 4}), {}, TypeError, "sampling_params"),
        ((None, [1], None), {}, TypeError, "sampling_params"),
        ((None, [1], SamplingParams(stop_token_ids=[VOCAB + 5])), {}, ValueError, "stop_token_ids"),
        ((None, [1], GREEDY), {"request_id": 7}, TypeError, "request_id"),
        ((None, [1], GREEDY), {"request_id": ""}, ValueError, "request_id"),
        ((None, [1], GREEDY), {"cache_salt": 5}, TypeError, "cache_salt"),
        ((None, [1], GREEDY), {"cache_salt": b"t1"}, TypeError, "cache_salt"),
        ((None, [1], GREEDY), {"cache_salt": "\udfff"}, ValueError, "cache_salt"),
        ((None, [1] * 600, GREEDY), {}, PromptTooLongError, "max_model_len"),
        # prompt + max_tokens beyond the context (512): refused naming max_tokens and the room (it was cut to 12)
        ((None, [1] * 500, SamplingParams(max_tokens=20)), {}, PromptTooLongError,
         r"prompt of 500 tokens \+ max_tokens 20 = 520 tokens exceed .*max_model_len\) of 512. Lower max_tokens "
         r"to at most 12"),
    ],
)
def test_add_request_rejects_bad_fields_up_front(llm: LLM, args, kwargs, exc, field) -> None:
    args = args if len(args) == 3 else (*args, GREEDY)
    with pytest.raises(exc, match=field):
        llm.engine.add_request(*args, **kwargs)
    _idle(llm)
    assert llm.engine.step() == []  # nothing was queued: no poisoned step


def test_the_poison_pill_salt_no_longer_poisons_the_engine(llm: LLM) -> None:
    """``cache_salt=5`` used to be accepted; the next step raised TypeError and every later generate failed."""
    with pytest.raises(TypeError, match="cache_salt"):
        llm.engine.add_request(None, [1, 2, 3], GREEDY, cache_salt=5)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], GREEDY)[0].outputs[0]
    assert out.finish_reason in ("length", "stop") and len(out.token_ids) >= 1
    req = llm.engine.add_request(None, [1, 2, 3], GREEDY, cache_salt="tenant-a", request_id="salted")
    assert req.cache_salt == "tenant-a"
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    _idle(llm)


def test_token_ids_of_numpy_and_tuples_are_accepted(llm: LLM) -> None:
    import numpy as np

    a = llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY)[0].outputs[0].token_ids
    b = llm.generate([{"prompt_token_ids": tuple(np.array([5, 6, 7]))}], GREEDY)[0].outputs[0].token_ids
    assert a == b
    _idle(llm)


# -- LLM.generate / generate_stream / chat ---------------------------------------------------------


@pytest.mark.parametrize(
    "prompts,exc,field",
    [
        (None, TypeError, "prompts"),
        (5, TypeError, "prompts"),
        ({"prompt_token_ids": ["a"]}, ValueError, r"prompt_token_ids\[0\]"),
        ({"prompt": "hi"}, ValueError, "prompt_token_ids"),
        ({"prompt_token_ids": []}, ValueError, "empty prompt"),
        ({"prompt_token_ids": "abc"}, TypeError, "prompt_token_ids"),
        ({"prompt_token_ids": [1], "prompt": 3}, ValueError, "prompt"),
        ({"prompt_token_ids": [1], "promt": "typo"}, ValueError, "promt"),
        ("\ud800", ValueError, "prompt"),
        (["fine", "\ud83d"], ValueError, "surrogate"),
        (["fine", None], TypeError, "prompt"),
        (["fine", {"prompt_token_ids": [1, 10**8]}], ValueError, "outside the vocabulary"),
        # a list's bad prompt is named by its index; an empty text as a text, not as token ids
        (["ok", ""], ValueError, r"^prompts\[1\]: empty prompt: the text '' encodes to no tokens"),
        ("", ValueError, r"^empty prompt: the text '' encodes to no tokens"),
        (["fine", "fine", {"prompt_token_ids": [1, 10**8]}], ValueError,
         r"^prompts\[2\]: prompt_token_ids \[100000000\]"),
        (["fine", None], TypeError, r"^prompts\[1\]: a prompt is a str or a dict"),
    ],
)
def test_generate_rejects_bad_prompts_and_queues_nothing(llm: LLM, prompts, exc, field) -> None:
    with pytest.raises(exc, match=field):
        llm.generate(prompts, GREEDY)
    _idle(llm)
    with pytest.raises(exc, match=field):
        next(iter(llm.generate_stream(prompts, GREEDY)))
    _idle(llm)


@pytest.mark.parametrize(
    "params,exc,field",
    [
        ({"max_tokens": 4}, TypeError, "sampling_params"),
        ("greedy", TypeError, "sampling_params"),
        ([GREEDY, {"max_tokens": 4}], TypeError, r"sampling_params\[1\]"),
        ([GREEDY], ValueError, "1 sampling params for 2 prompts"),
    ],
)
def test_generate_rejects_bad_sampling_params(llm: LLM, params, exc, field) -> None:
    with pytest.raises(exc, match=field):
        llm.generate(["a", "b"], params)
    _idle(llm)


@pytest.mark.parametrize(
    "messages,exc,field",
    [
        (5, TypeError, "messages"),
        (None, TypeError, "messages"),
        ([], ValueError, "messages is empty"),
        ([{"role": "user", "content": 5}], ValueError, r"messages\[0\]\.content"),
        ([{"role": "user", "content": None}], ValueError, r"messages\[0\]\.content"),
        ([{"role": 1, "content": "hi"}], ValueError, r"messages\[0\]\.role"),
        ([{"content": "hi"}], ValueError, r"messages\[0\]\.role"),
        ([{"role": "user", "content": "hi"}, "oops"], ValueError, r"messages\[1\]"),
        ([{"role": "user", "content": "\ud800"}], ValueError, r"messages\[0\]\.content"),
        ([{"role": "system", "content": "only a system message"}], ValueError, "no non-blank user message"),
        ("   ", ValueError, "empty prompt"),
        ([[{"role": "user", "content": "ok"}], [{"role": "user", "content": 5}]], ValueError, "content"),
    ],
)
def test_chat_rejects_bad_messages(llm: LLM, messages, exc, field) -> None:
    with pytest.raises(exc, match=field):
        llm.chat(messages, GREEDY)
    _idle(llm)


@pytest.mark.parametrize("role", ["wizard", "tool", "User", ""])
def test_chat_refuses_an_unknown_role_as_the_server_does(llm: LLM, role) -> None:
    """``llm.chat([{"role": "wizard", ...}])`` said "empty prompt: the conversation has no non-blank user message";
    the server says ``messages[0].role: must be 'system', 'developer', 'user' or 'assistant'``. The Python API
    checks the role against the same list (``CHAT_ROLES``, which the server's request model is built from)."""
    from kvpage.engine.validate import CHAT_ROLES
    from kvpage.server.protocol import ChatMessage

    msg = r"^messages\[1\]\.role must be 'system', 'developer', 'user' or 'assistant', got "
    with pytest.raises(ValueError, match=msg + repr(role)):
        llm.chat([{"role": "user", "content": "hi"}, {"role": role, "content": "hi"}], GREEDY)
    _idle(llm)
    assert ChatMessage.model_json_schema()["properties"]["role"]["enum"] == list(CHAT_ROLES)


def test_chat_renders_developer_as_system(llm: LLM) -> None:
    """``developer`` (OpenAI's newer name) is accepted and rendered as ``system``, as the server renders it."""
    dev = llm.chat_prompt([{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}])
    sys_ = llm.chat_prompt([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert dev == sys_


def test_chat_and_generate_still_work(llm: LLM) -> None:
    one = llm.chat([{"role": "user", "content": "hi"}], GREEDY)
    two = llm.chat([[{"role": "user", "content": "hi"}], "hi"], GREEDY)
    assert len(one) == 1 and len(two) == 2
    assert one[0].outputs[0].token_ids == two[0].outputs[0].token_ids == two[1].outputs[0].token_ids
    assert llm.generate("hi", GREEDY)[0].prompt == "hi"
    _idle(llm)


# -- ForcedSequence.feed ---------------------------------------------------------------------------


def test_forced_sequence_rejects_ids_outside_the_vocabulary(llm: LLM) -> None:
    with llm.open_sequence() as seq:
        with pytest.raises(ValueError, match=rf"token_ids \[100000000\] are outside the vocabulary \[0, {VOCAB}\)"):
            seq.feed([10**8])
        with pytest.raises(ValueError, match=r"token_ids\[0\]"):
            seq.feed(["a"])
        with pytest.raises(ValueError, match="at least one token"):
            seq.feed([])
        assert seq.num_tokens == 0  # nothing was written
        assert seq.feed([1, 2]).shape == (1, VOCAB)
    _idle(llm)


# -- a final split multi-byte character ------------------------------------------------------------


def test_output_cut_inside_a_multibyte_character_does_not_end_in_fffd() -> None:
    """The byte tokenizer spells "😀" as 4 tokens (F0 9F 98 80): a model forced to write them, cut after 2 or 3 by
    ``max_tokens``, would end its text in U+FFFD; the engine drops it. A complete U+FFFD (EF BF BD) stays."""
    from kvpage.engine.detokenize import ends_with_split_character

    loaded = tiny_loaded(0)
    tok = loaded.tokenizer
    emoji = list("😀".encode())
    for cut in range(1, 4):
        assert ends_with_split_character(tok, [65] + emoji[:cut], tok.decode([65] + emoji[:cut]))
    assert not ends_with_split_character(tok, [65] + emoji, tok.decode([65] + emoji))
    real = list("\ufffd".encode())
    assert not ends_with_split_character(tok, [65] + real, tok.decode([65] + real))
    assert not ends_with_split_character(tok, [65, EOS], "A")

    llm = LLM(loaded, kv_cache_dtype="float32", block_size=16, num_blocks=32, progress=False)
    script = {}  # request id -> the tokens its "model" must produce

    class Scripted:
        def __init__(self, runner):
            self.runner = runner

        def execute(self, batch, **kw):
            logits = self.runner.execute(batch, **kw).clone()  # (an inference tensor: clone to edit it)
            for i, r in enumerate(batch):
                done = r.num_computed + len(r.token_ids) - r.num_prompt_tokens  # output tokens so far
                want = script[r.request_id]
                logits[i, want[min(done, len(want) - 1)]] = 1e9
            return logits

    llm.engine.runner = Scripted(llm.engine.runner)
    for cut in range(1, 5):
        script[f"cut{cut}"] = [72, 105] + emoji  # "Hi😀"
        llm.engine.add_request(None, [1, 2, 3], SamplingParams(max_tokens=2 + cut, temperature=0),
                               request_id=f"cut{cut}")
    script["real"] = [72] + real
    llm.engine.add_request(None, [1, 2, 3], SamplingParams(max_tokens=4, temperature=0), request_id="real")
    final, streamed = {}, {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            streamed[out.request_id] = streamed.get(out.request_id, "") + out.outputs[0].delta_text
            if out.finished:
                final[out.request_id] = out.outputs[0]
    for cut in range(1, 4):
        c = final[f"cut{cut}"]
        assert c.finish_reason == "length" and c.token_ids == [72, 105] + emoji[:cut]
        assert c.text == "Hi" and streamed[f"cut{cut}"] == "Hi", cut
    assert final["cut4"].text == streamed["cut4"] == "Hi😀"
    assert final["real"].text == streamed["real"] == "H\ufffd"
    _idle(llm)


@pytest.mark.slow
def test_bundled_model_output_cut_inside_a_cjk_character_does_not_end_in_fffd(smollm2) -> None:
    """The bundled byte-level BPE splits "你" over two tokens: a prompt ending in its first token must not make a
    1-token output end in a dangling U+FFFD."""
    from kvpage.engine.detokenize import ends_with_split_character

    tok = smollm2.tokenizer
    ids = tok.encode("😀 你好", add_special_tokens=False)
    text = tok.decode(ids[:1])
    assert text == "\ufffd" and ends_with_split_character(tok, ids[:1], text)
    assert ends_with_split_character(tok, ids[:2], tok.decode(ids[:2]))
    assert not ends_with_split_character(tok, ids[:3], tok.decode(ids[:3]))
    assert not ends_with_split_character(tok, ids, tok.decode(ids))


def test_max_tokens_beyond_the_context_is_refused_not_cut(llm: LLM) -> None:
    """One policy with the server's 400: ``LLM.generate`` refuses prompt + max_tokens beyond ``max_model_len``
    (512 here) naming max_tokens and the room, and queues nothing; exactly filling the context runs to the end.
    The regression: max_tokens was cut to the room silently (the server answered the same request with a 400)."""
    prompt = {"prompt_token_ids": [1] * 500}
    with pytest.raises(PromptTooLongError, match="max_tokens 13 = 513 tokens exceed .* at most 12"):
        llm.generate([{"prompt_token_ids": [1, 2]}, prompt], SamplingParams(max_tokens=13, ignore_eos=True))
    _idle(llm)
    out = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 12 and out.finish_reason == "length"
