"""Sampling parameters and the sampler (temperature, top-k, top-p, per-request seeds).

Semantics follow vLLM's ``SamplingParams``: ``temperature == 0`` is greedy,
``top_k <= 0`` and ``top_p == 1`` disable those filters, ``seed`` makes one
request's samples reproducible whatever else is in the batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to pick output tokens for one request.

    Attributes:
        max_tokens: output tokens to generate at most (>= 1).
        temperature: softmax temperature; 0 means greedy (argmax).
        top_p: nucleus sampling mass in (0, 1].
        top_k: keep the k most likely tokens; <= 0 keeps all.
        seed: per-request random seed; ``None`` draws from the global generator.
        stop: strings that end the output when generated (not included in the text).
        stop_token_ids: token ids that end the output (besides the model's EOS).
        ignore_eos: keep going past EOS (benchmarks).

    Raises:
        ValueError: out-of-range values.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an integer (<= 0 disables it), got {self.top_k!r}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        object.__setattr__(self, "stop", tuple(s for s in stop if s))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        """Whether this request decodes greedily."""
        return self.temperature == 0 or self.top_k == 1


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick one token id from ``logits`` ``[vocab]`` (float32) per ``params``.

    Top-k is applied before top-p, as in vLLM and transformers. Ties under
    greedy go to the lowest id (``argmax``).
    """
    if params.greedy:
        return int(torch.argmax(logits))
    x = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first token always stays).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        x = x.scatter(0, order, sorted_x.masked_fill(drop, float("-inf")))
    probs = torch.softmax(x, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
