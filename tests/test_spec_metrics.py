"""Speculative-decoding counters and their snapshot: exact totals, per-position tallies, rates, checks."""
from __future__ import annotations

import dataclasses

import pytest

from kvpage.engine.speculative.metrics import SpecDecodingCounters, SpecDecodingStats


def test_counters_are_exact() -> None:
    c = SpecDecodingCounters(3)
    c.observe(3, 3, 4)  # all accepted + bonus
    c.observe(3, 1, 2)  # one accepted + correction
    c.observe(2, 0, 1)  # ngram drafted only 2, both rejected
    c.observe(0, 0, 1)  # no draft this round: not counted
    c.observe(3, 2, 2)  # a stop after the second accepted token cut the round short
    s = c.snapshot()
    assert s == SpecDecodingStats(num_drafts=4, num_draft_tokens=11, num_accepted_tokens=6, num_emitted_tokens=9,
                                  accepted_per_position=(3, 2, 1), drafted_per_position=(4, 4, 3))
    assert s.num_speculative_tokens == 3
    assert s.acceptance_rate == pytest.approx(6 / 11)
    assert s.mean_accepted_length == pytest.approx(1 + 6 / 4)
    assert s.per_position_acceptance_rate == pytest.approx((3 / 4, 2 / 4, 1 / 3))


def test_snapshot_is_frozen_and_counters_keep_running() -> None:
    c = SpecDecodingCounters(2)
    c.observe(2, 1, 2)
    first = c.snapshot()
    c.observe(1, 1, 2)
    assert first.num_drafts == 1 and first.accepted_per_position == (1, 0)
    assert c.snapshot().accepted_per_position == (2, 0) and c.snapshot().drafted_per_position == (2, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(first, "num_drafts", 5)


def test_rates_before_any_draft() -> None:
    s = SpecDecodingCounters(4).snapshot()
    assert s == SpecDecodingStats.empty(4)
    assert (s.acceptance_rate, s.mean_accepted_length, s.per_position_acceptance_rate) == (0.0, 0.0, (0.0,) * 4)


def test_all_rejected_gives_mean_length_one() -> None:
    c = SpecDecodingCounters(2)
    for _ in range(5):
        c.observe(2, 0, 1)
    s = c.snapshot()
    assert (s.acceptance_rate, s.mean_accepted_length, s.num_emitted_tokens) == (0.0, 1.0, 5)


@pytest.mark.parametrize("drafts,accepted,emitted,field", [
    (4, 0, 1, "num_draft_tokens"),   # more than k = 3
    (-1, 0, 1, "num_draft_tokens"),
    (2, 3, 4, "num_accepted"),       # more accepted than drafted
    (2, -1, 1, "num_accepted"),
    (2, 1, 3, "num_emitted"),        # more than accepted + 1
    (2, 1, 0, "num_emitted"),        # a round always emits its first token
    (0, 0, 2, "num_emitted"),
])
def test_inconsistent_observations_are_refused_and_not_counted(drafts, accepted, emitted, field) -> None:
    c = SpecDecodingCounters(3)
    with pytest.raises(ValueError, match=field):
        c.observe(drafts, accepted, emitted)
    assert c.snapshot() == SpecDecodingStats.empty(3)


def test_bad_construction() -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpecDecodingCounters(0)
    with pytest.raises(ValueError, match="differ in length"):
        SpecDecodingStats(1, 2, 1, 2, (1,), (1, 1))
    with pytest.raises(ValueError, match="num_accepted_tokens"):
        SpecDecodingStats(1, 2, 2, 2, (1, 0), (1, 1))
    with pytest.raises(ValueError, match="num_draft_tokens"):
        SpecDecodingStats(1, 3, 1, 2, (1, 0), (1, 1))
