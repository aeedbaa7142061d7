"""µs per token of keeping a 1,000-token output's text up to date: a whole decode every token vs the
engine's :class:`~kvpage.engine.detokenize.IncrementalDetokenizer`.

Usage::

    python benchmarks/detokenize.py [--tokens 1000] [--rounds 5]

The bundled tokenizer encodes this repository's README; its first ``--tokens`` ids play the output. "whole"
decodes ``ids[:k]`` for every k (what the engine did before); "incremental" appends the ids one by one (and
checks its text against the whole decode at the end). Best of ``--rounds``; CPU only, no model weights run.
"""
from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from kvpage.engine.detokenize import IncrementalDetokenizer  # noqa: E402
from kvpage.model.loader import load_model  # noqa: E402


def best_seconds(fn: Callable[[], None], rounds: int) -> float:
    """The shortest of ``rounds`` timed calls of ``fn`` (seconds)."""
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    """Print µs per token of both routes."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    tok = load_model(None, progress=False).tokenizer
    ids = tok.encode((Path(__file__).parents[1] / "README.md").read_text(), add_special_tokens=False)[: args.tokens]

    def whole() -> None:
        for k in range(1, len(ids) + 1):
            tok.decode(ids[:k], skip_special_tokens=True)

    def incremental() -> None:
        detok = IncrementalDetokenizer(tok)
        for t in ids:
            detok.append(t)
        assert detok.text == tok.decode(ids, skip_special_tokens=True)

    for name, fn in (("whole decode every token", whole), ("incremental", incremental)):
        us = best_seconds(fn, args.rounds) / len(ids) * 1e6
        print(f"{name:26s} {us:7.1f} µs/token ({len(ids):,}-token output, best of {args.rounds})")


if __name__ == "__main__":
    main()
