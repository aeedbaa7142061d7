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
    assert SamplingParams(stop=["a", ""]).stop == ("a",)
    assert SamplingParams(temperature=0).greedy and SamplingParams(top_k=1).greedy
    assert not SamplingParams(temperature=0.5).greedy


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
