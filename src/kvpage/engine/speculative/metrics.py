"""Speculative-decoding counters, named as vLLM's spec-decode metrics: drafts, drafted, accepted and emitted tokens.

:class:`SpecDecodingCounters` is the engine's mutable tally (one :meth:`~SpecDecodingCounters.observe` per
request per verification round); :class:`SpecDecodingStats` its frozen snapshot, carried by
``EngineStats.spec_decoding`` to ``/metrics`` and the CLI summary. Imports nothing of kvpage.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SpecDecodingCounters", "SpecDecodingStats"]


@dataclass(frozen=True)
class SpecDecodingStats:
    """Speculative-decoding totals since the engine started (one snapshot; immutable).

    Attributes:
        num_drafts: verification rounds (one request, one step) that had at least one draft token.
        num_draft_tokens: draft tokens proposed in those rounds.
        num_accepted_tokens: draft tokens the target accepted.
        num_emitted_tokens: tokens those rounds output: accepted drafts plus the one bonus (all accepted)
            or corrected token each, fewer where a stop or ``max_tokens`` cut the round short.
        accepted_per_position: length ``num_speculative_tokens``; entry ``i`` counts rounds whose
            ``i``-th draft (0-based) was accepted (acceptance is a prefix, so the entries never increase).
        drafted_per_position: length ``num_speculative_tokens``; entry ``i`` counts rounds that had an
            ``i``-th draft (a proposer such as ``ngram`` may propose fewer than ``k``).

    Raises:
        ValueError: the per-position tuples differ in length or hold more than their totals allow.
    """

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_emitted_tokens: int
    accepted_per_position: tuple[int, ...]
    drafted_per_position: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.accepted_per_position) != len(self.drafted_per_position):
            raise ValueError(f"accepted_per_position ({len(self.accepted_per_position)} entries) and "
                             f"drafted_per_position ({len(self.drafted_per_position)}) differ in length")
        if sum(self.accepted_per_position) != self.num_accepted_tokens:
            raise ValueError(f"accepted_per_position sums to {sum(self.accepted_per_position)}, "
                             f"not num_accepted_tokens {self.num_accepted_tokens}")
        if sum(self.drafted_per_position) != self.num_draft_tokens:
            raise ValueError(f"drafted_per_position sums to {sum(self.drafted_per_position)}, "
                             f"not num_draft_tokens {self.num_draft_tokens}")

    @classmethod
    def empty(cls, num_speculative_tokens: int) -> SpecDecodingStats:
        """All-zero stats for ``num_speculative_tokens`` positions."""
        zeros = (0,) * num_speculative_tokens
        return cls(0, 0, 0, 0, zeros, zeros)

    @property
    def num_speculative_tokens(self) -> int:
        """``k``: the number of draft positions tracked."""
        return len(self.accepted_per_position)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens, in [0, 1]; 0.0 before any draft."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per round that had drafts, ``1 + accepted / num_drafts`` (vLLM's mean acceptance length).

        The 1 is the bonus or corrected token every round emits. 0.0 before any draft (so a gauge
        tells "nothing measured" from 1.0, "every draft rejected").
        """
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def per_position_acceptance_rate(self) -> tuple[float, ...]:
        """Entry ``i``: accepted / proposed ``i``-th drafts, in [0, 1] (0.0 where none was proposed).

        Divided by the rounds that had an ``i``-th draft (``drafted_per_position[i]``), not by all
        rounds as vLLM does, so a proposer that often drafts fewer than ``k`` tokens is not scored
        as rejecting the drafts it never made. Under a fixed-``k`` proposer the two agree.
        """
        return tuple(a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position))


class SpecDecodingCounters:
    """The engine's running tally of speculative rounds; :meth:`snapshot` freezes it.

    Args:
        num_speculative_tokens: ``k``, the most draft tokens a round may have (>= 1).

    Raises:
        ValueError: ``num_speculative_tokens`` < 1.

    Not thread-safe: the engine thread observes and snapshots.
    """

    def __init__(self, num_speculative_tokens: int) -> None:
        if isinstance(num_speculative_tokens, bool) or not isinstance(num_speculative_tokens, int) \
                or num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {num_speculative_tokens!r}")
        self.num_speculative_tokens = num_speculative_tokens
        self._drafts = self._draft_tokens = self._accepted = self._emitted = 0
        self._accepted_pos = [0] * num_speculative_tokens
        self._drafted_pos = [0] * num_speculative_tokens

    def observe(self, num_draft_tokens: int, num_accepted: int, num_emitted: int) -> None:
        """Count one request's verification round.

        Args:
            num_draft_tokens: drafts verified, ``0 <= d <= num_speculative_tokens``.
            num_accepted: of those, the accepted prefix, ``0 <= a <= d``.
            num_emitted: tokens the round output, ``1 <= e <= a + 1`` (fewer than ``a + 1`` only where a
                stop or ``max_tokens`` cut it short); with ``d = 0``, ``e`` must be 0 or 1.

        A round with no drafts (``d = 0``: a plain decode step, e.g. no n-gram match) is checked and
        not counted, as vLLM counts only rounds with drafts.

        Raises:
            ValueError: a value out of its range (nothing is counted then).
        """
        k = self.num_speculative_tokens
        if not 0 <= num_draft_tokens <= k:
            raise ValueError(f"num_draft_tokens must be in [0, {k}], got {num_draft_tokens}")
        if not 0 <= num_accepted <= num_draft_tokens:
            raise ValueError(f"num_accepted must be in [0, num_draft_tokens={num_draft_tokens}], got {num_accepted}")
        low = 0 if num_draft_tokens == 0 else 1
        if not low <= num_emitted <= num_accepted + 1:
            raise ValueError(f"num_emitted must be in [{low}, num_accepted + 1 = {num_accepted + 1}], "
                             f"got {num_emitted}")
        if num_draft_tokens == 0:
            return
        self._drafts += 1
        self._draft_tokens += num_draft_tokens
        self._accepted += num_accepted
        self._emitted += num_emitted
        for i in range(num_draft_tokens):
            self._drafted_pos[i] += 1
        for i in range(num_accepted):
            self._accepted_pos[i] += 1

    def snapshot(self) -> SpecDecodingStats:
        """The totals so far as an immutable :class:`SpecDecodingStats` (the counters keep running)."""
        return SpecDecodingStats(self._drafts, self._draft_tokens, self._accepted, self._emitted,
                                 tuple(self._accepted_pos), tuple(self._drafted_pos))
