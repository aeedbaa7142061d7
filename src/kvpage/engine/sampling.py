"""Sampling parameters and the sampler (temperature, top-k, top-p, per-request seeds).

Semantics follow vLLM's ``SamplingParams``: ``temperature == 0`` is greedy,
``top_k`` of -1 or 0 and ``top_p == 1`` disable those filters, ``seed`` makes one
request's samples reproducible whatever else is in the batch.
"""
from __future__ import annotations

import hashlib
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpage.engine.validate import as_int

#: Temperatures below this decode greedily, as in vLLM: dividing float32 logits by a smaller one
#: overflows (a temperature of 1e-300 made every probability NaN).
SAMPLING_EPS = 1e-5

#: Seeds ``torch.Generator.manual_seed`` accepts; it maps a negative seed ``s`` to ``s + 2**64`` (so -1 is
#: ``2**64 - 1``); vLLM passes the seed to the same call and accepts the int64 range, which this contains.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
#: Most completions one request may ask for (OpenAI caps ``n`` at 128).
MAX_N = 128

_MASK64 = 2**64 - 1


def _mix64(z: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit words in which every output bit depends on every input bit."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def generator_seed(seed: int) -> int:
    """The seed handed to a request's ``torch.Generator``, derived so that every bit of ``seed`` counts.

    torch's CPU generator (mt19937) is seeded from the low 32 bits only:
    ``manual_seed(0)``, ``manual_seed(2**32)`` and ``manual_seed(2**63)`` give the same
    stream, and torch maps a negative seed ``s`` to ``s + 2**64`` (``-1`` is ``2**64 - 1``).
    Here the seed's 64-bit word goes through splitmix64's finalizer; a negative seed
    then goes through it once more after XOR with a constant, so it is not the same
    seed as ``s + 2**64``; the result is folded to 32 bits (high half XOR low half).
    Different seeds give different streams except by chance (about ``2**-32`` per pair,
    the most a 32-bit state seed allows); the same seed always gives the same stream.

    Args:
        seed: an int in ``[SEED_MIN, SEED_MAX]``.

    Returns:
        An int in ``[0, 2**32)``.
    """
    z = _mix64(seed & _MASK64)
    if seed < 0:
        z = _mix64(z ^ 0x9E3779B97F4A7C15)
    return (z ^ (z >> 32)) & 0xFFFFFFFF


def _as_float(value: object, name: str) -> float:
    """``value`` as a finite plain float if it is a real number (int, float, numpy scalars; not bool).

    Raises:
        ValueError: not a real number, a bool, not finite, or too large for a float (``10**400``), naming ``name``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    try:
        out = float(value)
    except OverflowError:
        raise ValueError(f"{name} must be a finite number, got an int too large for a float") from None
    if not math.isfinite(out):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return out


@dataclass(frozen=True, init=False)
class SamplingParams:
    """How to pick output tokens for one request; every field is checked when it is built, and again, as it is
    then, when a request is added (:func:`check_sampling_params`).

    Attributes:
        max_tokens: output tokens to generate at most (an int >= 1); prompt + max_tokens beyond the context is
            refused when the request is added (:class:`~kvpage.errors.PromptTooLongError`), never cut.
        temperature: softmax temperature, a finite number >= 0; 0 means greedy (argmax).
        top_p: nucleus sampling mass in (0, 1].
        top_k: keep the k most likely tokens (an int >= 1); -1 or 0 keeps all (vLLM).
        seed: per-request random seed, an int in ``[-2**63, 2**64 - 1]`` (the range vLLM and
            ``torch.Generator.manual_seed`` take); the request's generator is seeded with
            :func:`generator_seed` of it, so seeds that differ only above bit 31, or ``-1`` and
            ``2**64 - 1``, still give different samples. ``None`` draws from the global generator.
        stop: strings that end the output when generated (not included in the text); given as one str or a
            sequence of str, stored as a tuple. An empty string is refused (``ValueError``), as the server's
            ``stop: must not be empty``.
        stop_token_ids: token ids (ints >= 0) that end the output besides the model's EOS, stored as a tuple;
            the engine checks them against the vocabulary at ``add_request``.
        ignore_eos: keep going past EOS (benchmarks); a bool.
        n: completions to return for the prompt, an int in ``[1, MAX_N]`` (OpenAI's and vLLM's ``n``). They share
            the prompt's KV blocks; each sampled one draws with its own seed (:func:`child_seed`), greedy ones are
            one computation returned ``n`` times.

    Raises:
        ValueError: any field of the wrong type or out of range (the message names the field). Type errors are
            ValueErrors here too, as in vLLM, so a caller (the HTTP server) maps every bad field to one 400.
    """

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    n: int

    def __init__(
        self,
        max_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        n: int = 1,
    ) -> None:
        n_ = as_int(n)
        if n_ is None or not 1 <= n_ <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {n!r}")
        max_tokens_ = as_int(max_tokens)
        if max_tokens_ is None or max_tokens_ < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        top_k_ = as_int(top_k)
        if top_k_ is None or top_k_ < -1:
            raise ValueError(f"top_k must be an integer >= 1, or -1 or 0 to disable it, got {top_k!r}")
        temperature_ = _as_float(temperature, "temperature")
        top_p_ = _as_float(top_p, "top_p")
        if temperature_ < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature_}")
        if not 0 < top_p_ <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p_}")
        seed_ = None if seed is None else as_int(seed)
        if seed is not None and (seed_ is None or not SEED_MIN <= seed_ <= SEED_MAX):
            raise ValueError(f"seed must be None or an integer in [-2**63, 2**64 - 1], got {seed!r}")
        if not isinstance(ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {ignore_eos!r}")
        if stop is None:
            stops: tuple[str, ...] = ()
        elif isinstance(stop, str):
            stops = (stop,)
        elif isinstance(stop, (list, tuple)):
            bad = [s for s in stop if not isinstance(s, str)]
            if bad:
                raise ValueError(f"stop must be a string or a list of strings; got the entry {bad[0]!r}")
            stops = tuple(stop)
        else:
            raise ValueError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
        if "" in stops:  # as the server's 400: an empty stop string cannot mean anything, so it is not dropped
            raise ValueError(f"stop must not contain an empty string (it would match before any text); got {stop!r}")
        if isinstance(stop_token_ids, (str, bytes)) or not isinstance(stop_token_ids, (list, tuple, range)):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {type(stop_token_ids).__name__}")
        ids = [as_int(t) for t in stop_token_ids]
        bad_ids = [t for t, i in zip(stop_token_ids, ids) if i is None or i < 0]
        if bad_ids:
            raise ValueError(f"stop_token_ids must be integers >= 0; got the entry {bad_ids[0]!r}")
        checked: tuple[tuple[str, object], ...] = (
            ("max_tokens", max_tokens_), ("temperature", temperature_), ("top_p", top_p_), ("top_k", top_k_),
            ("seed", seed_), ("stop", stops),
            ("stop_token_ids", tuple(i for i in ids if i is not None)),
            ("ignore_eos", ignore_eos), ("n", n_),
        )
        for name, checked_value in checked:
            object.__setattr__(self, name, checked_value)

    @property
    def greedy(self) -> bool:
        """Whether this request decodes greedily: ``temperature`` below :data:`SAMPLING_EPS` (0 included) or ``top_k == 1``."""
        return self.temperature < SAMPLING_EPS or self.top_k == 1


def check_sampling_params(params: SamplingParams) -> None:
    """Check every field of ``params`` as it is now, in the form the constructor stores (cheap: ~1-2 us).

    :class:`SamplingParams` is frozen and checked when built, but ``object.__setattr__`` (or a subclass) can
    change a field afterwards; ``add_request`` runs this so that what the engine runs is what the rules allow,
    whatever the object's history: ``max_tokens``, ``top_k``, ``n`` plain ints (not bools) in range,
    ``temperature`` and ``top_p`` finite plain floats in range, ``seed`` ``None`` or an int in
    ``[SEED_MIN, SEED_MAX]``, ``stop`` a tuple of non-empty strs, ``stop_token_ids`` a tuple of ints >= 0,
    ``ignore_eos`` a bool.

    Raises:
        ValueError: the first field that breaks its rule, named (``sampling_params.stop: ...``).
    """
    def bad(field: str, rule: str, value: object) -> ValueError:
        return ValueError(f"sampling_params.{field} must be {rule}, got {value!r} ({type(value).__name__}); the "
                          f"SamplingParams was changed after it was built: build a new one")

    v: object = params.max_tokens
    if type(v) is not int or v < 1:
        raise bad("max_tokens", "an int >= 1", v)
    v = params.temperature
    if type(v) is not float or not 0.0 <= v < math.inf:
        raise bad("temperature", "a finite float >= 0", v)
    v = params.top_p
    if type(v) is not float or not 0.0 < v <= 1.0:
        raise bad("top_p", "a float in (0, 1]", v)
    v = params.top_k
    if type(v) is not int or v < -1:
        raise bad("top_k", "an int >= -1", v)
    v = params.seed
    if v is not None and (type(v) is not int or not SEED_MIN <= v <= SEED_MAX):
        raise bad("seed", "None or an int in [-2**63, 2**64 - 1]", v)
    v = params.stop
    if type(v) is not tuple or not all(type(s) is str and s for s in v):
        raise bad("stop", "a tuple of non-empty strs", v)
    v = params.stop_token_ids
    if type(v) is not tuple or not all(type(t) is int and t >= 0 for t in v):
        raise bad("stop_token_ids", "a tuple of ints >= 0", v)
    v = params.ignore_eos
    if type(v) is not bool:
        raise bad("ignore_eos", "a bool", v)
    v = params.n
    if type(v) is not int or not 1 <= v <= MAX_N:
        raise bad("n", f"an int in [1, {MAX_N}]", v)


def child_seed(seed: int | None, index: int) -> int | None:
    """The seed of completion ``index`` of a request seeded with ``seed`` (``None`` stays ``None``).

    Completion 0 keeps ``seed`` (so ``n=1`` samples as before); completion ``i`` gets the first 8 bytes of
    SHA-256 over ``(seed, i)``, an int64, so every completion is reproducible and the completions differ.
    """
    if seed is None or index == 0:
        return seed
    digest = hashlib.sha256(f"kvpage-completion:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little", signed=True)


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The one-completion params of completion ``index`` of ``params`` (``n=1``, :func:`child_seed`)."""
    return SamplingParams(max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                          top_k=params.top_k, seed=child_seed(params.seed, index), stop=params.stop,
                          stop_token_ids=params.stop_token_ids, ignore_eos=params.ignore_eos)


def processed_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``logits`` after temperature, top-k and top-p, as float32 with filtered tokens at ``-inf``.

    Works on one row ``[V]`` or row-wise on ``[N, V]`` (same shape out, a new tensor; ``logits`` is not
    modified). The logits are divided by ``params.temperature``; top-k (when ``0 < top_k < V``) keeps the
    tokens at least as large as the k-th largest (ties at the k-th value all stay); top-p then drops a
    token when the probability mass of the tokens sorted before it already reaches ``top_p`` (the most
    likely token always stays). Top-k before top-p, as in vLLM and transformers. Meant for sampled
    params: under greedy params (``temperature`` near 0) the division may overflow; use
    :func:`sampling_probs`, which handles greedy.
    """
    x = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first token always stays).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        drop[..., 0] = False  # also when top_p is below float32's range (1e-300 rounds to 0 in the comparison)
        x = x.scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))
    return x


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution :func:`sample` draws from: float32 probabilities shaped as ``logits`` (``[V]`` or ``[N, V]``).

    Sampled params: ``softmax`` of :func:`processed_logits` over the last dimension. Greedy params
    (``params.greedy``): the one-hot of the first maximum of each row (``max(-1).indices``, what
    :func:`sample` returns). Each row sums to 1 (up to rounding); ``logits`` is not modified.
    """
    if params.greedy:
        top = logits.max(-1, keepdim=True).indices
        return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(-1, top, 1.0)
    return torch.softmax(processed_logits(logits, params), dim=-1)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick one token id from ``logits`` ``[vocab]`` (float32) per ``params``.

    Top-k is applied before top-p, as in vLLM and transformers (:func:`processed_logits`). Ties under
    greedy go to the lowest id (``argmax``). A sampled pick is one ``torch.multinomial`` draw from
    ``generator`` (the global generator when ``None``) over :func:`sampling_probs`.
    """
    if params.greedy:
        return int(torch.argmax(logits))
    probs = torch.softmax(processed_logits(logits, params), dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
