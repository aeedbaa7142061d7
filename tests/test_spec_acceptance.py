"""Draft verification on synthetic logits: greedy acceptance lengths exactly, and chi-square tests over 20,000
draws that speculative sampling emits tokens distributed as the target's processed distribution."""
from __future__ import annotations

import math

import pytest
import torch

from kvpage.engine.sampling import SamplingParams, processed_logits, sample, sampling_probs
from kvpage.engine.speculative.acceptance import Verdict, accept_greedy, accept_sampled, verify

V = 6
N_DRAWS = 20_000
P_MIN = 1e-4  # a chi-square p-value below this fails (fixed seeds: the tests are deterministic)


# ---------------------------------------------------------------- chi-square without scipy

def _chi2_sf(stat: float, dof: int) -> float:
    """P(X >= stat) for X ~ chi-square(dof): 1 - P(dof/2, stat/2), P the regularised lower incomplete gamma
    by its power series (Abramowitz & Stegun 6.5.29); exact enough to compare with 1e-4."""
    a, x = dof / 2.0, stat / 2.0
    if x <= 0:
        return 1.0
    term = total = 1.0 / a
    n = 0
    while term > 1e-17 * total and n < 10_000:
        n += 1
        term *= x / (a + n)
        total += term
    lower = math.exp(a * math.log(x) - x - math.lgamma(a)) * total
    return max(0.0, 1.0 - lower)


def test_chi2_sf_matches_known_quantiles() -> None:
    # textbook critical values: chi2(1) 3.841 at 0.05, chi2(5) 15.086 at 0.01, chi2(5) 25.745 at 1e-4
    assert _chi2_sf(3.841459, 1) == pytest.approx(0.05, rel=1e-4)
    assert _chi2_sf(15.086272, 5) == pytest.approx(0.01, rel=1e-4)
    assert _chi2_sf(25.744680, 5) == pytest.approx(1e-4, rel=1e-3)


def _chi2_pvalue(samples: list[int], probs: torch.Tensor) -> float:
    """Chi-square goodness of fit of ``samples`` to ``probs`` ``[V]``; cells of probability 0 must be empty."""
    counts = torch.bincount(torch.tensor(samples), minlength=probs.numel()).double()
    probs = probs.double() / probs.double().sum()
    zero = probs <= 0
    assert counts[zero].sum() == 0, f"tokens the target cannot emit were emitted: {counts.tolist()}"
    expected = probs[~zero] * len(samples)
    assert expected.min() >= 5, "too few draws per cell for the chi-square approximation"
    stat = float(((counts[~zero] - expected) ** 2 / expected).sum())
    return _chi2_sf(stat, int((~zero).sum()) - 1)


# ---------------------------------------------------------------- greedy

def _logits_with_argmax(tops: list[int], vocab: int = V) -> torch.Tensor:
    """``[len(tops), vocab]`` random logits whose row ``i`` has its maximum (by a margin of 1) at ``tops[i]``."""
    g = torch.Generator().manual_seed(len(tops))
    x = torch.randn(len(tops), vocab, generator=g)
    for i, t in enumerate(tops):
        x[i, t] = x[i].max() + 1.0
    return x


@pytest.mark.parametrize(
    "tops, drafts, tokens, n",
    [
        ([1, 2, 3, 4], [1, 2, 3], (1, 2, 3, 4), 3),  # all accepted + bonus from the last row
        ([1, 2, 3, 4], [0, 2, 3], (1,), 0),          # first rejected: the correction only
        ([1, 2, 3, 4], [1, 5, 3], (1, 2), 1),        # middle rejected: later matches do not count
        ([1, 2, 3, 4], [1, 2, 0], (1, 2, 3), 2),     # last rejected
        ([5], [], (5,), 0),                          # d = 0: the argmax
    ],
)
def test_greedy_acceptance_lengths(tops: list[int], drafts: list[int], tokens: tuple[int, ...], n: int) -> None:
    logits = _logits_with_argmax(tops)
    assert accept_greedy(logits, drafts) == Verdict(tokens, n)
    assert verify(logits, drafts, None, SamplingParams(temperature=0), None) == Verdict(tokens, n)
    assert verify(logits, drafts, None, SamplingParams(temperature=0.7, top_k=1), None) == Verdict(tokens, n)


def test_greedy_ties_go_to_the_first_index() -> None:
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [3.0, 3.0, 3.0, 0.0]])
    assert accept_greedy(logits, [2]) == Verdict((1,), 0)  # 2 ties with 1 but is not the first maximum
    assert accept_greedy(logits, [1]) == Verdict((1, 0), 1)
    onehot = sampling_probs(logits, SamplingParams(temperature=0))
    assert onehot.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]
    assert sample(logits[1], SamplingParams(temperature=0), None) == 0


def test_shapes_and_tokens_are_checked_at_the_boundary() -> None:
    logits = torch.zeros(3, V)
    expected = r"target_logits must have shape \[d \+ 1, V\] = \[2, 6\] for 1 draft token, got \(3, 6\)"
    with pytest.raises(ValueError, match=expected):
        accept_greedy(logits, [1])
    with pytest.raises(ValueError, match=r"target_probs .*\[3, V\].*got \(6,\)"):
        accept_sampled(torch.zeros(V), [1, 2], None, None)
    with pytest.raises(ValueError, match=r"draft_probs must have shape \[d, V\] = \[2, 6\].*got \(2, 5\)"):
        accept_sampled(torch.softmax(logits, -1), [1, 2], torch.zeros(2, 5), None)
    with pytest.raises(ValueError, match=r"draft_probs .*\[2, 6\].*got \(3, 6\)"):
        verify(logits, [1, 2], torch.zeros(3, V), SamplingParams(temperature=0), None)
    with pytest.raises(ValueError, match=r"draft_tokens\[1\] must be a token id in \[0, 6\), got 6"):
        verify(logits, [1, 6], None, SamplingParams(), None)
    with pytest.raises(ValueError, match=r"draft_tokens\[0\].*got 1.0"):
        not_ids: list = [1.0, 2]  # the wrong type is the test
        accept_greedy(logits, not_ids)
    with pytest.raises(ValueError, match="target_logits must be a floating-point tensor"):
        accept_greedy(torch.zeros(3, V, dtype=torch.long), [1, 2])


# ---------------------------------------------------------------- sampling: the target distribution is kept

TARGET_LOGITS = torch.tensor([
    [1.0, 0.2, -0.5, 2.0, -2.5, 0.6],   # p0: token 4 is rare (~2%)
    [-1.0, 1.5, 0.3, 0.0, 0.9, -2.2],   # p1: token 5 is rare
    [0.4, 0.4, 0.4, 0.4, 0.4, 0.4],     # p2: uniform
])
P = torch.softmax(TARGET_LOGITS, dim=-1)                              # [3, V]


def _bad_draft() -> torch.Tensor:
    """``[2, V]``: 90% of the mass on each row's rarest target token."""
    q = torch.full((2, V), 0.02)
    q[0, 4] = q[1, 5] = 0.9
    return q


DRAFTS = {
    "equal": P[:2].clone(),
    "uniform": torch.full((2, V), 1.0 / V),
    "bad": _bad_draft(),
}


def _run(q: torch.Tensor | None, fixed: list[int] | None, seed: int,
         decide=accept_sampled) -> tuple[list[int], list[int], list[int]]:
    """``N_DRAWS`` verdicts with drafts drawn from ``q`` (or the ``fixed`` n-gram drafts); returns the first
    emitted tokens, the second emitted tokens where the first draft was accepted, and the accepted counts."""
    gd = torch.Generator().manual_seed(seed + 1)   # the drafter's randomness, apart from the verifier's
    g = torch.Generator().manual_seed(seed)
    if q is not None:
        drafts = torch.stack([torch.multinomial(q[i], N_DRAWS, replacement=True, generator=gd) for i in range(2)], 1)
        rows = drafts.tolist()
    else:
        assert fixed is not None
        rows = [fixed] * N_DRAWS
    first, second, accepted = [], [], []
    for d in rows:
        v = decide(P, d, q, g)
        assert len(v.tokens) == v.num_accepted + 1 and list(v.tokens[:v.num_accepted]) == d[:v.num_accepted]
        first.append(v.tokens[0])
        accepted.append(v.num_accepted)
        if v.num_accepted >= 1:
            second.append(v.tokens[1])
    return first, second, accepted


@pytest.mark.parametrize("name", sorted(DRAFTS))
def test_sampled_first_and_second_tokens_follow_the_target(name: str) -> None:
    first, second, accepted = _run(DRAFTS[name], None, seed=11)
    assert _chi2_pvalue(first, P[0]) > P_MIN
    # given the first draft accepted, the next emitted token is distributed as the target's next row
    assert len(second) > 1000
    assert _chi2_pvalue(second, P[1]) > P_MIN
    # acceptance follows the theory: P(accept d0) = sum_x min(p0(x), q0(x))
    rate = sum(a >= 1 for a in accepted) / N_DRAWS
    assert rate == pytest.approx(float(torch.minimum(P[0], DRAFTS[name][0]).sum()), abs=0.015)
    if name == "equal":
        assert min(accepted) == 2  # p == q: never rejected


def test_ngram_draft_without_probs_keeps_the_target() -> None:
    # a deterministic draft (q one-hot): [0, 1] are accepted with p0(0) then p1(1)
    first, second, accepted = _run(None, [0, 1], seed=12)
    assert _chi2_pvalue(first, P[0]) > P_MIN
    assert _chi2_pvalue(second, P[1]) > P_MIN
    assert sum(a >= 1 for a in accepted) / N_DRAWS == pytest.approx(float(P[0, 0]), abs=0.015)
    # the rare token proposed: still the target's distribution
    first, _, _ = _run(None, [4, 5], seed=13)
    assert _chi2_pvalue(first, P[0]) > P_MIN


def test_the_chi_square_catches_a_wrong_rule() -> None:
    """Not vacuous: correcting from p instead of the residual max(0, p - q) biases towards the bad draft's token."""

    def wrong(p: torch.Tensor, d: list[int], q: torch.Tensor | None, g: torch.Generator) -> Verdict:
        assert q is not None
        u = float(torch.rand(1, generator=g))
        if u < float(p[0, d[0]] / q[0, d[0]]):
            return Verdict((d[0], int(torch.multinomial(p[1], 1, generator=g))), 1)
        return Verdict((int(torch.multinomial(p[0], 1, generator=g)),), 0)

    first, _, _ = _run(DRAFTS["bad"], None, seed=14, decide=wrong)
    assert _chi2_pvalue(first, P[0]) < 1e-10


def test_verify_with_temperature_top_k_top_p_keeps_the_processed_target() -> None:
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.92)
    target = sampling_probs(TARGET_LOGITS, params)                     # [3, V]
    assert (target[0] == 0).sum() >= 1 and (target[1] == 0).sum() >= 1  # the filters removed tokens
    draft_logits = torch.tensor([[0.0, 1.0, 2.0, -1.0, 1.5, 0.5], [2.0, -1.0, 0.0, 0.5, 1.0, 3.0]])
    q = sampling_probs(draft_logits, params)                            # [2, V]
    gd, g = torch.Generator().manual_seed(21), torch.Generator().manual_seed(20)
    drafts = torch.stack([torch.multinomial(q[i], N_DRAWS, replacement=True, generator=gd) for i in range(2)], 1)
    first, second = [], []
    for d in drafts.tolist():
        v = verify(TARGET_LOGITS, d, q, params, g)
        first.append(v.tokens[0])
        if v.num_accepted >= 1:
            second.append(v.tokens[1])
    assert _chi2_pvalue(first, target[0]) > P_MIN
    assert _chi2_pvalue(second, target[1]) > P_MIN


def test_no_drafts_is_one_target_sample_identical_to_sample() -> None:
    params = SamplingParams(temperature=0.9, top_k=4)
    for seed in range(200):
        v = verify(TARGET_LOGITS[:1], [], None, params, torch.Generator().manual_seed(seed))
        assert v.num_accepted == 0
        assert v.tokens == (sample(TARGET_LOGITS[0], params, torch.Generator().manual_seed(seed)),)


def test_same_seed_same_verdicts() -> None:
    q = DRAFTS["uniform"]
    drafts = [[i % V, (3 * i) % V] for i in range(300)]

    def verdicts(seed: int) -> list[Verdict]:
        g = torch.Generator().manual_seed(seed)
        return [accept_sampled(P, d, q, g) for d in drafts]

    assert verdicts(5) == verdicts(5)
    assert verdicts(5) != verdicts(6)


def test_draft_token_the_draft_gave_zero_probability() -> None:
    q = torch.tensor([[0.0, 1.0, 0.0, 0.0, 0.0, 0.0]])
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]])
    assert accept_sampled(p, [0], q, None) == Verdict((0, 2), 1)   # p > 0: accepted
    v = accept_sampled(p, [3], q, None)                             # p == 0: rejected, corrected from p - q
    assert v == Verdict((0,), 0)


# ---------------------------------------------------------------- the sampler refactor changed nothing

def _old_sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """``sample()`` as it was before processed_logits/sampling_probs were factored out (verbatim)."""
    if params.greedy:
        return int(torch.argmax(logits))
    x = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        drop[0] = False
        x = x.scatter(0, order, sorted_x.masked_fill(drop, float("-inf")))
    probs = torch.softmax(x, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@pytest.mark.parametrize("kwargs", [
    dict(temperature=1.0), dict(temperature=0.6, top_k=20), dict(temperature=1.3, top_p=0.8),
    dict(temperature=0.8, top_k=50, top_p=0.95), dict(top_p=1e-300), dict(temperature=0), dict(top_k=1),
])
def test_sample_draws_exactly_as_before_the_refactor(kwargs: dict[str, float]) -> None:
    params = SamplingParams(**kwargs)
    logits = torch.randn(300, 500, generator=torch.Generator().manual_seed(7)) * 3
    g_new, g_old = torch.Generator().manual_seed(99), torch.Generator().manual_seed(99)
    new = [sample(row, params, g_new) for row in logits]
    old = [_old_sample(row, params, g_old) for row in logits]
    assert new == old
    assert len(set(new)) > 1 or params.greedy or kwargs.get("top_p") == 1e-300
    assert torch.equal(torch.rand(4, generator=g_new), torch.rand(4, generator=g_old))  # same draws consumed


def test_processed_logits_is_row_wise() -> None:
    params = SamplingParams(temperature=0.8, top_k=7, top_p=0.9)
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(3))
    batch = processed_logits(logits, params)
    assert batch.dtype == torch.float32 and batch.shape == (5, 40)
    for i in range(5):
        assert torch.equal(batch[i], processed_logits(logits[i], params))
        kept = torch.isfinite(batch[i])
        assert 1 <= int(kept.sum()) <= 7
        assert torch.equal(batch[i][kept], logits[i][kept] / 0.8)
    probs = sampling_probs(logits, params)
    assert torch.allclose(probs.sum(-1), torch.ones(5)) and torch.equal(probs == 0, ~torch.isfinite(batch))
