"""The n-gram (prompt lookup) proposer: exact proposals on hand-made sequences, a property test against a
slow reference, argument checks, and an 8k-token sequence."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpage.engine.speculative.ngram import NgramProposer


def reference(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """Prompt lookup the slow way: longest n first, then the latest start of an earlier occurrence."""
    size = len(tokens)
    for n in range(hi, lo - 1, -1):
        if n >= size:
            continue
        pattern = tokens[size - n:]
        for start in range(size - n - 1, -1, -1):  # start + n <= size - 1: never the suffix itself
            if tokens[start:start + n] == pattern:
                return tokens[start + n:start + n + k]
    return []


def test_most_recent_match_wins() -> None:
    p = NgramProposer(3, 2, 2)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 7, 7, 9, 1, 2, 8, 8, 1, 2]
    assert p.propose_tokens(tokens) == [8, 8, 1]  # [1, 2] at 5 (followed by 8 8 1), not at 0 (7 7 9)


def test_longest_n_first_beats_a_more_recent_shorter_match() -> None:
    p = NgramProposer(2, 1, 3)
    # suffix [5, 6, 7]: occurs at 0 (then 40 41); [6, 7] alone and [7] alone recur later (then 50 / 60)
    tokens = [5, 6, 7, 40, 41, 9, 6, 7, 50, 51, 7, 60, 5, 6, 7]
    assert p.propose_tokens(tokens) == [40, 41]
    assert NgramProposer(2, 1, 2).propose_tokens(tokens) == [50, 51]  # max 2: the latest [6, 7]
    assert NgramProposer(2, 1, 1).propose_tokens(tokens) == [60, 5]   # max 1: the latest [7]


def test_min_is_respected() -> None:
    tokens = [3, 9, 1, 4, 5, 9]  # only the 1-gram [9] recurs
    assert NgramProposer(2, 1, 3).propose_tokens(tokens) == [1, 4]
    assert NgramProposer(2, 2, 3).propose_tokens(tokens) == []


def test_no_match_and_short_sequences_give_nothing() -> None:
    p = NgramProposer(4, 1, 4)
    assert p.propose_tokens([1, 2, 3, 4, 5]) == []
    assert p.propose_tokens([]) == [] and p.propose_tokens([7]) == []
    assert p.propose_tokens([7, 7]) == [7]  # the 1-gram at 0 is followed by the last token


def test_k_caps_the_proposal_and_defaults_to_num_speculative_tokens() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    assert NgramProposer(5, 2, 2).propose_tokens(tokens) == [3, 4, 5, 6, 7]
    assert NgramProposer(5, 2, 2).propose_tokens(tokens, k=2) == [3, 4]
    assert NgramProposer(5, 2, 2).propose_tokens(tokens, k=1) == [3]


def test_proposal_runs_off_the_end() -> None:
    p = NgramProposer(5, 2, 3)
    assert p.propose_tokens([4, 1, 2, 9, 1, 2]) == [9, 1, 2]  # only three tokens follow the match
    # an occurrence overlapping the suffix: [a b a b a b] matches [b a b] at 1, followed by [a, b]
    assert p.propose_tokens([1, 2, 1, 2, 1, 2]) == [1, 2]


def test_pattern_at_the_very_start() -> None:
    p = NgramProposer(3, 3, 3)
    tokens = [10, 11, 12, 13, 14, 15, 10, 11, 12]
    assert p.propose_tokens(tokens) == [13, 14, 15]
    assert p.propose_tokens(np.array(tokens, dtype=np.int32)) == [13, 14, 15]  # arrays too
    assert all(type(t) is int for t in p.propose_tokens(np.array(tokens)))


def test_bad_arguments_name_the_field() -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        NgramProposer(0, 1, 2)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(2, 0, 2)
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        NgramProposer(2, 3, 2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        NgramProposer(True, 1, 2)
    with pytest.raises(ValueError, match="k must be"):
        NgramProposer(2, 1, 2).propose_tokens([1, 2, 1], k=0)
    with pytest.raises(ValueError, match="one-dimensional"):
        NgramProposer(2, 1, 2).propose_tokens(np.zeros((2, 3), dtype=np.int64))


@settings(max_examples=400, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), max_size=40), k=st.integers(1, 6), lo=st.integers(1, 4),
       extra=st.integers(0, 3))
def test_matches_the_slow_reference(tokens: list[int], k: int, lo: int, extra: int) -> None:
    hi = lo + extra
    assert NgramProposer(k, lo, hi).propose_tokens(tokens) == reference(tokens, k, lo, hi)


def test_8k_sequence_returns_the_planted_continuation() -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50_000, size=8192).tolist()
    tokens[1000:1010] = list(range(60_000, 60_010))  # a planted span, repeated at the end but its last 2 tokens
    tokens[-8:] = list(range(60_000, 60_008))
    p = NgramProposer(4, 2, 5)
    assert p.propose_tokens(tokens) == [60_008, 60_009, tokens[1010], tokens[1011]]
    same = [7] * 8192  # the worst case for the candidate count: every position matches; the most
    assert p.propose_tokens(same) == [7]  # recent occurrence ends one token before the suffix's end
