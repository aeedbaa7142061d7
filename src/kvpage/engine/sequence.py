"""``Request``: the engine's state of one generation request.

It implements :class:`~kvpage.cache.manager.SupportsKVCache` (``request_id``,
``all_token_ids``, ``cache_salt``, ``extra_keys``, ``block_hashes``), so the
scheduler hands it straight to the :class:`~kvpage.cache.kv_cache.KVCache`.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from kvpage.engine.detokenize import IncrementalDetokenizer
from kvpage.engine.sampling import SamplingParams, generator_seed


class RequestStatus(enum.Enum):
    """Where a request is in its life (vLLM v1's ``RequestStatus``, reduced)."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One request's tokens, progress and timings.

    Attributes:
        request_id: unique id.
        prompt: prompt text (or ``None`` for token prompts).
        prompt_token_ids: the prompt's tokens.
        params: sampling parameters.
        arrival_time: ``time.perf_counter()`` at submission.
        max_tokens: output tokens at most (``params.max_tokens``; prompt + it fit the context, checked on add).
        all_token_ids: prompt then output tokens (append-only).
        num_computed_tokens: tokens whose KV is in the cache (reset to 0 by preemption).
        num_cached_tokens: tokens served from the prefix cache at first admission (-1 before).
        cache_salt: tenant salt for prefix caching (``None`` = shared).
        extra_keys: mixed into block hashes (adapter id, multimodal digests).
        block_hashes: filled by the KV-cache manager; survives preemption.
        status: :class:`RequestStatus`.
        finish_reason: ``"stop"``, ``"length"``, ``"abort"``, ``"error"`` or ``None`` (running).
        error: with ``finish_reason == "error"``, ``"<ExceptionType>: <message>"`` of what failed.
        text: detokenized output (stop strings cut).
        detokenizer: the engine's incremental decoder of the output (set at the first output token).
        generator: per-request RNG when ``params.seed`` is set, seeded with
            :func:`~kvpage.engine.sampling.generator_seed` (all 64 bits of the seed count).
        first_token_time, finish_time: ``perf_counter`` stamps, or ``None``.
        num_preemptions: times this request was preempted.
        tier_load_failed: loading its prefix from a tier raised once; it is matched against the device only.
        rematch_at: with a chunk admitted under :attr:`~kvpage.cache.kv_cache.PrefixMatch.compute_first`, the
            computed tokens at which it is matched again (tiers serve the rest); 0 when none is pending.
        num_first_computed: tokens it computed itself before that second match (they are not counted as cached).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    max_tokens: int
    cache_salt: str | None = None
    extra_keys: tuple = ()
    all_token_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    error: str | None = None
    text: str = ""
    detokenizer: IncrementalDetokenizer | None = None
    generator: torch.Generator | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    tier_load_failed: bool = False
    rematch_at: int = 0
    num_first_computed: int = 0
    _emitted_tokens: int = 0
    _emitted_text: int = 0

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        if self.params.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(generator_seed(self.params.seed))

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens in the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far."""
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """Generated tokens so far."""
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens so far."""
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        """Whether generation has ended (stop, length, abort or error)."""
        return self.status is RequestStatus.FINISHED
