"""Result dataclasses of the engine (shaped like vLLM's ``RequestOutput``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpage.cache.requests import KVCacheStats
    from kvpage.engine.speculative.metrics import SpecDecodingStats

#: Why a request ended (``CompletionOutput.finish_reason``).
FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass
class CompletionOutput:
    """One generated sequence (cumulative), plus what is new since the previous output of the same request.

    Attributes:
        index: position among the request's outputs (always 0: ``n == 1``).
        text: decoded output so far, special tokens skipped, cut before a stop string.
        token_ids: generated token ids so far (a stop token included, as in vLLM).
        finish_reason: one of :data:`FINISH_REASONS`: ``"stop"`` (EOS, stop token or stop string),
            ``"length"`` (``max_tokens`` or the context limit), ``"abort"``, ``"error"`` (this request's
            forward pass, sampling, detokenization or stop check raised; see ``error``), or ``None`` while running.
        delta_text: text added since the previous output of this request (streaming).
        delta_token_ids: tokens added since the previous output of this request.
        error: with ``finish_reason == "error"``, what went wrong (``"<ExceptionType>: <message>"``); else ``None``.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    error: str | None = None


@dataclass
class RequestMetrics:
    """Per-request timings and counts.

    Attributes:
        prompt_tokens: tokens in the prompt.
        output_tokens: tokens generated.
        cached_tokens: prompt tokens served from the prefix cache at admission.
        time_to_first_token_s: seconds from submission to the first output token.
        total_time_s: seconds from submission to finish.
        num_preemptions: times the request was preempted (recomputed).
    """

    prompt_tokens: int
    output_tokens: int = 0
    cached_tokens: int = 0
    time_to_first_token_s: float | None = None
    total_time_s: float | None = None
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    """Everything one request produced so far.

    Attributes:
        request_id: the request's id.
        prompt: the prompt text (the chat-templated text for chat requests), or ``None`` for token prompts.
        prompt_token_ids: the tokens the model saw.
        outputs: one :class:`CompletionOutput` (``n == 1``).
        finished: whether generation ended.
        metrics: timings and counts.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0))


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for metrics.

    Attributes:
        num_running: requests in the running batch.
        num_waiting: requests queued (new or preempted).
        kv_usage: fraction of KV blocks requests hold, in [0, 1] (0 when idle; ``kv.usage``).
        kv: the KV cache's counters (prefix queries/hits, evictions, ...; tier counters in ``kv.tiers``).
        num_preemptions: requests preempted since start.
        prompt_tokens: prompt tokens computed since start (cache hits excluded).
        generation_tokens: tokens output since start (accepted drafts included).
        spec_decoding: speculative decoding's counters (drafted, accepted, emitted tokens, per
            position), or ``None`` when the engine does not speculate.
        kv_side_usage: fraction of KV blocks lent as side space (quantize-on-seal tail slots and
            first-block copies; ``kv.side_usage``), in [0, 1].
    """

    num_running: int
    num_waiting: int
    kv_usage: float
    kv: KVCacheStats
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    spec_decoding: SpecDecodingStats | None = None
    kv_side_usage: float = 0.0
