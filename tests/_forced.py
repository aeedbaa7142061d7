"""Teacher forcing against the float32 cache: how far a KV format's next-token distributions drift.

Exact greedy agreement of a lossy KV format (or of bf16) with float32 is decided by float
rounding wherever the small model's top-1/top-2 logit margin is near zero, and that rounding
differs between CPU code paths (AVX-512 vs AVX2 kernels, x86 vs ARM). The tests instead feed
every engine the *same* token sequence (the float32 answer) and compare, position by position,
the argmax and the full distribution: a flip at one near-tie position cannot derail the rest.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from kvpage import LLM


def teacher_forced_logits(llm: LLM, prompt_ids: Sequence[int], answer: Sequence[int]) -> torch.Tensor:
    """Logits predicting each token of ``answer``, fed the prompt then ``answer`` one token per step.

    Args:
        llm: a :class:`kvpage.LLM`; its own paged cache (and KV format) is used.
        prompt_ids: the prompt's token ids (non-empty).
        answer: the reference continuation (non-empty); ``answer[i]`` is predicted from
            ``prompt_ids + answer[:i]``.

    Returns:
        ``[len(answer), vocab]`` float32: row ``i`` is the distribution over ``answer[i]``.
        The prompt runs as one prefill, each answer token as one decode step, as in generation
        (``prompt_len`` is the prompt's, so quantize-on-seal formats keep the same window copies).

    Side effects: none that outlive the call: the sequence's blocks come from the engine's
    manager, are never prefix-indexed, and are freed on return (also on error).
    """
    prompt_ids, answer = list(prompt_ids), list(answer)
    if not prompt_ids or not answer:
        raise ValueError("teacher forcing needs a non-empty prompt and answer")
    with llm.open_sequence(prompt_len=len(prompt_ids)) as seq:
        rows = [seq.feed(prompt_ids)]
        for t in answer[:-1]:
            rows.append(seq.feed([t]))
    return torch.cat(rows).float()


def divergence(logits: torch.Tensor, ref: torch.Tensor) -> tuple[int, float]:
    """Argmax flips and mean KL(ref || logits) over positions.

    Args:
        logits, ref: ``[N, vocab]`` logits of the same N positions (``ref``: the float32 cache's).

    Returns:
        ``(flips, mean_kl)``: how many of the N rows have another argmax than ``ref``'s, and the
        mean over rows of ``sum_v p_ref(v) (log p_ref(v) - log p(v))`` in nats (float64 math).

    Raises:
        ValueError: the shapes differ.
    """
    if logits.shape != ref.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and reference {tuple(ref.shape)} differ in shape")
    flips = int((logits.argmax(-1) != ref.argmax(-1)).sum())
    kl = F.kl_div(logits.double().log_softmax(-1), ref.double().log_softmax(-1), log_target=True,
                  reduction="none").sum(-1)
    return flips, float(kl.mean())


def assert_greedy_agrees_up_to_a_near_tie(reference: LLM, prompt_ids: Sequence[int], want: Sequence[int],
                                          got: Sequence[int], margin: float) -> None:
    """``got`` (greedy tokens of another run of the prompt: other chunking, a tier hit) equals ``want`` (the
    ``reference`` engine's greedy tokens), or first differs where ``reference``'s top-2 logits lie within
    ``margin`` of each other and ``got`` took the runner-up (a near-tie that float rounding of another
    computation order may flip).

    Raises:
        AssertionError: the runs differ at a position with a clear margin, or ``got`` is cut short.
    """
    want, got = list(want), list(got)
    if want == got:
        return
    i = next((j for j, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    assert i < min(len(want), len(got)), f"one run stopped early: {want} vs {got}"
    top2 = teacher_forced_logits(reference, prompt_ids, want[: i + 1])[i].topk(2)
    gap = float(top2.values[0] - top2.values[1])
    assert got[i] in top2.indices.tolist(), f"token {i}: {got[i]} is not one of the reference's top two {top2.indices}"
    assert gap < margin, f"token {i} differs ({want[i]} vs {got[i]}) at a logit margin of {gap:.3f} >= {margin}"
