"""Deterministic English text for benchmarks (no downloads): sentences drawn from a fixed list by a seeded RNG."""
from __future__ import annotations

import random

_SUBJECTS = ["The library", "A careful engineer", "The old harbour", "Our team", "The committee", "A small robot",
             "The river", "Every student", "The city council", "A travelling musician", "The weather service",
             "The museum", "A new recipe", "The garden", "The train company", "The night shift"]
_VERBS = ["announced", "described", "measured", "repaired", "celebrated", "questioned", "painted", "recorded",
          "planned", "explained", "collected", "reviewed", "designed", "discovered", "organised", "translated"]
_OBJECTS = ["a long report about the spring floods", "the results of the annual survey", "an unusual pattern in the data",
            "a plan for the coming winter", "the history of the northern bridge", "a quiet festival by the lake",
            "several questions about the budget", "a map of the forgotten tunnels", "the rules for visiting hours",
            "a collection of letters from sailors", "the cost of new windows", "a song about the mountains",
            "the timetable for the summer", "a method to save water", "the design of a wooden boat",
            "an argument about street lights"]
_TAILS = ["before the meeting ended.", "with great care.", "after a short delay.", "to everyone's surprise.",
          "in the local newspaper.", "for the second time this year.", "while the rain kept falling.",
          "without any help.", "during the long weekend.", "as the sun went down."]


def sentences(n: int, seed: int = 0) -> str:
    """``n`` pseudo-random English sentences, the same for the same ``seed``."""
    rng = random.Random(seed)
    return " ".join(
        f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}" for _ in range(n)
    )


def token_prompt(tokenizer, num_tokens: int, seed: int) -> list[int]:
    """Exactly ``num_tokens`` token ids of such text."""
    ids: list[int] = []
    n = max(8, num_tokens // 10)
    while len(ids) < num_tokens:
        ids = tokenizer.encode(sentences(n, seed), add_special_tokens=False)
        n *= 2
    return ids[:num_tokens]
