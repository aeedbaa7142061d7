"""Verification of draft tokens: which proposals the target accepts and the one token it adds.

Greedy verification accepts the longest prefix equal to the target's argmax; sampled verification is the
speculative sampling rule of Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative
Decoding", Algorithm 1) and Chen et al. 2023 ("Accelerating Large Language Model Decoding with Speculative
Sampling", Algorithm 2), which leaves every emitted token distributed as the target alone would sample it.
Pure functions over tensors: no engine state; imports only the sampler.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpage.engine.sampling import SamplingParams, sampling_probs
from kvpage.engine.validate import as_int


@dataclass(frozen=True)
class Verdict:
    """What one request emits after verification.

    Attributes:
        tokens: the emitted token ids: the ``num_accepted`` accepted drafts, then exactly one more token
            (the bonus token sampled from the row after the last draft when every draft was accepted, else
            the target's correction at the first rejected position); ``len(tokens) == num_accepted + 1``.
        num_accepted: drafts accepted, ``0..len(draft_tokens)``.
    """

    tokens: tuple[int, ...]
    num_accepted: int


def _check_tokens(draft_tokens: Sequence[int], vocab: int) -> list[int]:
    """``draft_tokens`` as plain ints, each in ``[0, vocab)``.

    Raises:
        ValueError: an entry not an integer or out of range (naming ``draft_tokens`` and the position).
    """
    out: list[int] = []
    for i, t in enumerate(draft_tokens):
        v = as_int(t)
        if v is None or not 0 <= v < vocab:
            raise ValueError(f"draft_tokens[{i}] must be a token id in [0, {vocab}), got {t!r}")
        out.append(v)
    return out


def _check_rows(name: str, x: torch.Tensor, rows: int, vocab: int | None, what: str) -> None:
    """Raise ValueError unless ``x`` is a floating tensor of shape ``[rows, vocab]`` (any vocab when ``None``)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {type(x).__name__}"
                         + (f" of {x.dtype}" if isinstance(x, torch.Tensor) else ""))
    v = x.shape[-1] if vocab is None and x.dim() == 2 else vocab
    if x.dim() != 2 or x.shape[0] != rows or x.shape[1] != v or x.shape[1] < 1:
        raise ValueError(f"{name} must have shape [{what}, V] = [{rows}, {'V' if v is None else v}] "
                         f"for {_len_word(rows if what == 'd' else rows - 1)}, got {tuple(x.shape)}")


def _len_word(d: int) -> str:
    """``"1 draft token"`` / ``"3 draft tokens"``: the count the expected shape came from, for error messages."""
    return f"{d} draft token" + ("" if d == 1 else "s")


def accept_greedy(target_logits: torch.Tensor, draft_tokens: Sequence[int]) -> Verdict:
    """Greedy verification: the longest prefix of drafts equal to the target's argmax, then the argmax after it.

    Args:
        target_logits: ``[d + 1, V]`` float target logits; row ``i`` scores the token after the ``i``-th
            verified position (row 0 follows the last verified token, row ``i`` follows draft ``i - 1``).
        draft_tokens: ``d`` proposed token ids (``d`` may be 0).

    Returns:
        The drafts up to the first one that differs from its row's argmax, then that row's argmax (the
        correction, or the bonus token from row ``d`` when all were accepted). The argmax is the first
        maximum index (``max(-1).indices``), as in :func:`~kvpage.engine.sampling.sample`. Reads only.

    Raises:
        ValueError: ``target_logits`` not ``[d + 1, V]``, or a draft token not in ``[0, V)``.
    """
    _check_rows("target_logits", target_logits, len(draft_tokens) + 1, None, "d + 1")
    drafts = _check_tokens(draft_tokens, target_logits.shape[1])
    top: list[int] = target_logits.max(-1).indices.tolist()
    n = 0
    while n < len(drafts) and drafts[n] == top[n]:
        n += 1
    return Verdict(tuple(drafts[:n]) + (top[n],), n)


def accept_sampled(
    target_probs: torch.Tensor,
    draft_tokens: Sequence[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> Verdict:
    """Speculative sampling (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023, Algorithm 2).

    With ``p_i`` the target's and ``q_i`` the draft's distribution at position ``i``: draft ``d_i`` is
    accepted with probability ``min(1, p_i(d_i) / q_i(d_i))``; at the first rejection the correction is
    drawn from ``max(0, p_i - q_i)`` normalised (from ``p_i`` itself when that residual is all zero, i.e.
    ``p_i == q_i``); when every draft is accepted the bonus token is drawn from ``p_d``. Each emitted
    token is then distributed exactly as sampling the target alone would give it, whatever ``q`` is.

    Args:
        target_probs: ``[d + 1, V]`` float (float32) target probabilities per row, after temperature /
            top-k / top-p (:func:`~kvpage.engine.sampling.sampling_probs`).
        draft_tokens: ``d`` proposed token ids (``d`` may be 0: one token drawn from ``p_0``).
        draft_probs: ``[d, V]`` float draft probabilities the drafts were sampled from, on the same device
            as ``target_probs``; ``None`` for a deterministic draft (n-gram lookup): ``q_i`` is the one-hot
            of ``d_i``, so ``d_i`` is accepted with probability ``p_i(d_i)``. A draft with ``q_i(d_i) == 0``
            is accepted exactly when ``p_i(d_i) > 0``.
        generator: every random draw uses it: ``d`` uniforms in one ``torch.rand`` call (drawn on the
            generator's device), then one ``torch.multinomial`` draw (the row is moved to the generator's
            device when they differ); ``None`` uses torch's global generator. Same seed, same inputs: same
            verdict.

    Returns:
        The accepted drafts and the correction or bonus token.

    Raises:
        ValueError: a tensor not of the shape above, or a draft token not in ``[0, V)``.
    """
    d = len(draft_tokens)
    _check_rows("target_probs", target_probs, d + 1, None, "d + 1")
    vocab = target_probs.shape[1]
    drafts = _check_tokens(draft_tokens, vocab)
    if draft_probs is not None:
        _check_rows("draft_probs", draft_probs, d, vocab, "d")
    p = target_probs.float()                                               # [d + 1, V]
    dev = p.device
    gdev = generator.device if generator is not None else dev
    n = 0
    if d:
        idx = torch.tensor(drafts, dtype=torch.long, device=dev)          # [d]
        rows = torch.arange(d, device=dev)
        p_d = p[rows, idx]                                                 # [d] target prob of each draft
        q_d = torch.ones(d, device=dev) if draft_probs is None else draft_probs.float()[rows, idx]
        u = torch.rand(d, generator=generator, device=gdev).to(dev)        # [d] in [0, 1)
        # u < p/q: always when p >= q (u < 1); never when p == 0 (q > 0: ratio 0; q == 0: NaN compares False)
        accepted: list[bool] = (u < p_d / q_d).tolist()
        n = accepted.index(False) if False in accepted else d
    if n < d:
        if draft_probs is None:
            q_row = torch.zeros(vocab, device=dev)
            q_row[drafts[n]] = 1.0
        else:
            q_row = draft_probs[n].float()
        dist = (p[n] - q_row).clamp_min(0.0)                               # [V] residual, unnormalised
        if not bool(dist.sum() > 0):
            dist = p[n]
    else:
        dist = p[d]
    last = int(torch.multinomial(dist.to(gdev), 1, generator=generator))  # multinomial normalises
    return Verdict(tuple(drafts[:n]) + (last,), n)


def verify(
    target_logits: torch.Tensor,
    draft_tokens: Sequence[int],
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> Verdict:
    """Verify one request's drafts under its sampling params.

    Greedy params (``params.greedy``): :func:`accept_greedy` (``draft_probs`` and ``generator`` unused).
    Otherwise the target's distribution is ``sampling_probs(target_logits, params)`` (temperature, top-k,
    top-p as :func:`~kvpage.engine.sampling.sample` applies them) and :func:`accept_sampled` decides, so
    the emitted tokens are distributed as non-speculative sampling with ``params`` would give them.

    Args:
        target_logits: ``[d + 1, V]`` float32 target logits (row ``i`` follows draft ``i - 1``; row 0
            follows the last verified token).
        draft_tokens: ``d`` proposed token ids (``d >= 0``).
        draft_probs: ``[d, V]`` the draft's distribution after the *same* processing, i.e.
            ``sampling_probs(draft_logits, params)``, the distribution the drafts were sampled from; ``None``
            for a deterministic draft (n-gram). Anything else still keeps the target distribution (the rule
            holds for any ``q`` the drafts were really drawn from) but accepts less.
        params: the request's sampling params.
        generator: the request's generator (``None``: torch's global one).

    Raises:
        ValueError: a tensor not of the shape above, or a draft token not in ``[0, V)``.
    """
    _check_rows("target_logits", target_logits, len(draft_tokens) + 1, None, "d + 1")
    if draft_probs is not None:
        _check_rows("draft_probs", draft_probs, len(draft_tokens), target_logits.shape[1], "d")
    if params.greedy:
        return accept_greedy(target_logits, draft_tokens)
    return accept_sampled(sampling_probs(target_logits, params), draft_tokens, draft_probs, generator)
