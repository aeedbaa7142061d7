"""N-gram (prompt lookup) proposer: drafts the continuation of the latest earlier match of a request's suffix.

Prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding"; vLLM's ``"ngram"`` method): copy-heavy
outputs (edits, summaries quoting the prompt, code) repeat spans of their own context, so the tokens that
followed the last occurrence of the current suffix are a free, often right, guess. No model, no draft KV;
numpy only, so this module imports nothing of the engine.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["NgramProposer"]


def _check_int(name: str, value: int, minimum: int) -> int:
    """``value`` if it is an int >= ``minimum``, else a ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


class NgramProposer:
    """Proposes draft tokens by matching the sequence's last ``n`` tokens against its earlier tokens.

    For ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the pattern is the last ``n``
    tokens; the proposal is the (up to ``k``) tokens that followed its most recent earlier occurrence
    (one that ends before the last token, so never the suffix itself; it may overlap the suffix). The
    first ``n`` with an occurrence wins, so a longer match beats a more recent shorter one.

    Args:
        num_speculative_tokens: default number of draft tokens per call (``k``, >= 1).
        prompt_lookup_min: shortest suffix tried (>= 1).
        prompt_lookup_max: longest suffix tried (>= ``prompt_lookup_min``).

    Raises:
        ValueError: an argument out of range (the message names it).

    Stateless between calls: one instance serves every request.
    """

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.num_speculative_tokens = _check_int("num_speculative_tokens", num_speculative_tokens, 1)
        self.prompt_lookup_min = _check_int("prompt_lookup_min", prompt_lookup_min, 1)
        self.prompt_lookup_max = _check_int("prompt_lookup_max", prompt_lookup_max, 1)
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(f"prompt_lookup_max ({self.prompt_lookup_max}) must be >= prompt_lookup_min "
                             f"({self.prompt_lookup_min})")

    def __repr__(self) -> str:
        return (f"NgramProposer(num_speculative_tokens={self.num_speculative_tokens}, "
                f"prompt_lookup_min={self.prompt_lookup_min}, prompt_lookup_max={self.prompt_lookup_max})")

    def propose_tokens(self, token_ids: Sequence[int] | np.ndarray, k: int | None = None) -> list[int]:
        """Draft tokens continuing ``token_ids`` (prompt + output so far), at most ``k``, possibly none.

        Args:
            token_ids: the request's tokens, oldest first (a list, tuple or 1-D integer array; not modified).
            k: most tokens to propose (>= 1); default ``num_speculative_tokens``. Fewer come back when
                the match's continuation reaches the end of ``token_ids``.

        Returns:
            The proposed token ids as Python ints; ``[]`` when no suffix of length
            ``prompt_lookup_min`` .. ``prompt_lookup_max`` occurs earlier.

        Raises:
            ValueError: ``k`` < 1, or ``token_ids`` not one-dimensional.

        Complexity: one vectorised comparison of all ``L`` tokens with the last token (O(L)), then
        at most ``prompt_lookup_max - 1`` vectorised filters over the surviving candidates, each
        extending every candidate's match one token further back. Time O(L + c * prompt_lookup_max)
        with ``c`` the occurrences of the last token (worst case ``c = L``, a run of one token), memory
        O(L). Measured at L = 8192 on a shared CPU core: ~0.01 ms from an int array and ~0.2 ms from
        a Python list (the conversion dominates); in the worst case ~0.1 ms and ~0.4 ms.
        """
        k = self.num_speculative_tokens if k is None else _check_int("k", k, 1)
        tokens = token_ids if isinstance(token_ids, np.ndarray) else np.asarray(token_ids, dtype=np.int64)
        if tokens.ndim != 1:
            raise ValueError(f"token_ids must be one-dimensional, got shape {tokens.shape}")
        size = tokens.shape[0]
        if size <= self.prompt_lookup_min:  # an earlier occurrence of n tokens needs n + 1 tokens at least
            return []
        # ends: positions e <= size - 2 where an earlier occurrence of the pattern may end; e's match
        # length is how many tokens tokens[..e] and tokens[..size-1] agree on, read backwards.
        ends = np.flatnonzero(tokens[: size - 1] == tokens[size - 1])
        if ends.size == 0:
            return []
        length = 1  # every survivor in ends matches at least `length` tokens back
        for j in range(1, min(self.prompt_lookup_max, size - 1)):
            room = ends[ends >= j]  # an occurrence of j + 1 tokens must start at index >= 0
            keep = room[tokens[room - j] == tokens[size - 1 - j]]
            if keep.size == 0:
                break
            ends, length = keep, j + 1
        if length < self.prompt_lookup_min:
            return []
        end = int(ends[-1])  # flatnonzero is ascending and filtering keeps order: the most recent match
        return [int(t) for t in tokens[end + 1: end + 1 + k]]
