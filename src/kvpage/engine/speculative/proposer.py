"""``Drafter``: what the engine asks of a speculation method each step, and the n-gram drafter.

Each engine step the drafter gets the step's chunks (so a drafter with its own KV, the draft model,
writes its layers' KV for every token the target computes this step, prefill chunks included: case
C19) and the speculating requests with their lookahead (``k``), and returns each one's draft tokens
with the distributions they were drawn from. Verification (:mod:`kvpage.engine.speculative.acceptance`)
then keeps a prefix of them.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpage.engine.sampling import SamplingParams, sampling_probs
from kvpage.engine.scheduler import ScheduledRequestChunk
from kvpage.engine.speculative.ngram import NgramProposer


@dataclass(frozen=True)
class Proposal:
    """One request's draft for one step.

    Attributes:
        tokens: the draft tokens (at most the request's lookahead; may be empty).
        probs: ``[len(tokens), vocab]`` float32: the distribution each token was drawn from (the draft's,
            after the request's temperature / top-k / top-p), or ``None`` for a deterministic draft.
    """

    tokens: tuple[int, ...] = ()
    probs: torch.Tensor | None = None


class Drafter(ABC):
    """A speculation method: proposes draft tokens for the requests that speculate in a step."""

    @abstractmethod
    def propose(self, chunks: Sequence[ScheduledRequestChunk]) -> list[Proposal]:
        """Drafts for each chunk of the step, in order (``Proposal()`` for chunks without lookahead).

        Args:
            chunks: every chunk of the step; a chunk with ``num_lookahead > 0`` is a decode chunk whose
                drafts may fill its lookahead slots (draft KV goes to positions ``num_computed ..
                num_computed + num_lookahead - 1``); the others are only observed.
        """

    def index_limit(self, request_id: str) -> int | None:
        """Tokens of the request whose draft-layer KV is written (its blocks past them may not be indexed yet),
        or ``None`` when this drafter keeps no KV of its own."""
        return None

    def on_verified(self, request_id: str, num_computed: int, num_drafted: int, num_accepted: int) -> None:
        """The step verified ``num_accepted`` of ``num_drafted`` drafts of a request that had ``num_computed``
        tokens computed before it (called for speculating chunks only)."""

    def forget(self, request_id: str) -> None:
        """The request finished: drop its state. (A preempted request keeps it: swapped back in, its draft KV
        is where it was; recomputed, it resumes from a prefix whose draft KV was written.)"""


class NgramDrafter(Drafter):
    """Prompt lookup (vLLM's ``ngram``): continue the latest earlier match of the request's last tokens.

    Args:
        proposer: the n-gram matcher (:class:`~kvpage.engine.speculative.ngram.NgramProposer`).
    """

    def __init__(self, proposer: NgramProposer) -> None:
        self.proposer = proposer

    def propose(self, chunks: Sequence[ScheduledRequestChunk]) -> list[Proposal]:
        """Drafts from each speculating request's own tokens (deterministic: ``probs`` is ``None``)."""
        out = []
        for c in chunks:
            if not c.num_lookahead:
                out.append(Proposal())
                continue
            out.append(Proposal(tuple(self.proposer.propose_tokens(c.request.all_token_ids, c.num_lookahead))))
        return out


def draw(logits: torch.Tensor, params: SamplingParams,
         generator: torch.Generator | None) -> tuple[int, torch.Tensor | None]:
    """A draft token from draft ``logits`` ``[vocab]`` and the distribution it was drawn from ``[vocab]`` float32.

    Greedy requests take the first argmax and return no distribution (greedy verification compares tokens
    only); others sample the processed distribution (:func:`~kvpage.engine.sampling.sampling_probs`) with the
    request's generator, so a seeded request drafts the same tokens on every run.
    """
    if params.greedy:
        return int(logits.max(-1).indices), None
    probs = sampling_probs(logits, params)
    return int(torch.multinomial(probs, 1, generator=generator)), probs
