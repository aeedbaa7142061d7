"""SamplingParams validation and the sampler's filters, against distributions computed by hand."""
from __future__ import annotations

import math

import pytest
import torch

from kvpage.engine.sampling import SamplingParams, sample


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_tokens=0), dict(max_tokens=-1), dict(max_tokens="5"), dict(max_tokens=1.5), dict(max_tokens=True),
        dict(temperature=-0.1), dict(temperature=math.nan), dict(temperature=math.inf), dict(temperature="1"),
        dict(top_p=0), dict(top_p=1.5), dict(top_p=math.nan), dict(top_k=2.5), dict(seed="7"), dict(seed=1.0),
    ],
)
def test_bad_values_are_clear_errors(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_stop_normalisation_and_greedy():
    p = SamplingParams(stop="END", stop_token_ids=[3, 4])
    assert p.stop == ("END",) and p.stop_token_ids == (3, 4)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b") and SamplingParams(stop=[]).stop == ()
    assert SamplingParams(temperature=0).greedy and SamplingParams(top_k=1).greedy
    assert not SamplingParams(temperature=0.5).greedy


@pytest.mark.parametrize("stop", ["", [""], ["a", ""], ("", "b")])
def test_an_empty_stop_string_is_refused_not_dropped(stop):
    """``SamplingParams(stop="")`` used to drop the empty string silently while the server answers 400
    ``stop: must not be empty``; the Python API refuses it too, naming ``stop``."""
    with pytest.raises(ValueError, match=r"^stop must not contain an empty string"):
        SamplingParams(stop=stop)


def test_greedy_is_argmax_and_filters_keep_the_right_tokens():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0, -1.0])
    assert sample(logits, SamplingParams(temperature=0), None) == 1
    # top_k=2 keeps tokens 1 and 3 only
    seen = {sample(logits, SamplingParams(temperature=1.0, top_k=2), torch.Generator().manual_seed(s)) for s in range(200)}
    assert seen == {1, 3}
    # top_p: softmax = [.032, .636, .086, .234, .012]; 0.7 keeps {1, 3} (the mass before 3 is .636 < .7)
    seen = {sample(logits, SamplingParams(temperature=1.0, top_p=0.7), torch.Generator().manual_seed(s)) for s in range(300)}
    assert seen == {1, 3}
    seen = {sample(logits, SamplingParams(temperature=1.0, top_p=0.6), torch.Generator().manual_seed(s)) for s in range(100)}
    assert seen == {1}


def test_sampling_frequencies_follow_the_tempered_softmax():
    logits = torch.tensor([0.0, 1.0, 2.0])
    g = torch.Generator().manual_seed(0)
    n = 4000
    counts = torch.bincount(torch.tensor([sample(logits, SamplingParams(temperature=2.0), g) for _ in range(n)]),
                            minlength=3).double() / n
    expected = torch.softmax(logits.double() / 2.0, dim=0)
    assert torch.allclose(counts, expected, atol=0.03)


def test_tiny_temperature_is_greedy_and_tiny_top_p_keeps_the_top_token() -> None:
    """Regression (found by schemathesis): 1e-300 is in range for both, but in float32 it is 0, so the
    temperature division overflowed and top-p dropped every token; both made NaN probabilities."""
    from kvpage.engine.sampling import SAMPLING_EPS, SamplingParams, sample

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1000, generator=g)
    top = int(logits.argmax())
    for t in (1e-300, SAMPLING_EPS / 2):
        p = SamplingParams(temperature=t, seed=1)
        assert p.greedy and sample(logits, p, torch.Generator().manual_seed(1)) == top
    assert not SamplingParams(temperature=SAMPLING_EPS).greedy
    for top_p in (1e-300, 1e-45, 1e-6):
        p = SamplingParams(temperature=1.0, top_p=top_p)
        picks = {sample(logits, p, torch.Generator().manual_seed(s)) for s in range(20)}
        assert picks == {top}, (top_p, picks)


# -- add_request checks the fields themselves (issue 29, item 8) ----------------------------------------------

#: ``(field, value set behind the constructor's back, words of the error)`` for every field of SamplingParams.
TAMPERED = [
    ("max_tokens", True, "max_tokens"), ("max_tokens", 0, "max_tokens"), ("max_tokens", 2.0, "max_tokens"),
    ("max_tokens", "3", "max_tokens"),
    ("temperature", math.nan, "temperature"), ("temperature", -1.0, "temperature"), ("temperature", "1", "temperature"),
    ("temperature", math.inf, "temperature"), ("temperature", True, "temperature"),
    ("top_p", 0.0, "top_p"), ("top_p", 1.5, "top_p"), ("top_p", math.nan, "top_p"), ("top_p", None, "top_p"),
    ("top_k", -2, "top_k"), ("top_k", 2.5, "top_k"), ("top_k", False, "top_k"),
    ("seed", "7", "seed"), ("seed", 1.5, "seed"), ("seed", 2**64, "seed"), ("seed", True, "seed"),
    ("stop", (123,), "stop"), ("stop", "END", "stop"), ("stop", ("",), "stop"), ("stop", None, "stop"),
    ("stop", ["a"], "stop"),
    ("stop_token_ids", (-1,), "stop_token_ids"), ("stop_token_ids", ("3",), "stop_token_ids"),
    ("stop_token_ids", (True,), "stop_token_ids"), ("stop_token_ids", 5, "stop_token_ids"),
    ("stop_token_ids", (10**9,), "stop_token_ids"),
    ("ignore_eos", 1, "ignore_eos"), ("ignore_eos", None, "ignore_eos"),
    ("n", 0, "n"), ("n", True, "n"), ("n", 129, "n"), ("n", 2.0, "n"),
]


def _tampered(field: str, value: object) -> SamplingParams:
    p = SamplingParams(max_tokens=3, temperature=0)
    object.__setattr__(p, field, value)
    return p


def test_every_field_is_in_the_tampered_cases() -> None:
    from dataclasses import fields

    assert {f.name for f in fields(SamplingParams)} == {f for f, _, _ in TAMPERED}


@pytest.fixture(scope="module")
def tiny_llm():
    from _tiny import tiny_loaded

    from kvpage import LLM

    return LLM(tiny_loaded(0), num_blocks=32, max_model_len=64, progress=False)


@pytest.mark.parametrize("field,value,words", TAMPERED, ids=[f"{f}={v!r}" for f, v, _ in TAMPERED])
def test_add_request_refuses_a_sampling_params_changed_after_construction(tiny_llm, field, value, words) -> None:
    """A frozen SamplingParams mutated with ``object.__setattr__`` is checked again at ``add_request``, from its
    fields: a clear ValueError naming the field, nothing queued (it used to run ``True`` as 1 or fail in the step)."""
    engine = tiny_llm.engine
    with pytest.raises(ValueError, match=rf"\b{words}\b"):
        engine.add_request(None, [5, 6, 7], _tampered(field, value))
    assert not engine.has_unfinished_requests() and not engine.requests
    with pytest.raises(ValueError, match=rf"\b{words}\b"):
        tiny_llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7, 8]}],
                          [SamplingParams(max_tokens=2), _tampered(field, value)])
    assert not engine.has_unfinished_requests() and not engine.requests


def test_an_untampered_params_still_runs_and_the_check_is_cheap(tiny_llm) -> None:
    import time

    from kvpage.engine.sampling import check_sampling_params

    p = SamplingParams(max_tokens=3, temperature=0.7, top_p=0.9, top_k=5, seed=3, stop=["x", "yz"],
                       stop_token_ids=[1, 2, 3], n=2)
    out = tiny_llm.generate({"prompt_token_ids": [5, 6, 7]}, p)[0]
    assert len(out.outputs) == 2 and all(len(c.token_ids) <= 3 for c in out.outputs)
    start = time.perf_counter()
    for _ in range(2000):
        check_sampling_params(p)
    per_call = (time.perf_counter() - start) / 2000
    assert per_call < 50e-6, f"{per_call * 1e6:.1f} us per check"
