"""Batch-1 decode speed of the bundled GGUF with its weights dequantized to bfloat16 against run as shipped (Q4_1, Q8_0 head).

Usage::

    python benchmarks/gguf_weights.py [--rounds 3] [--tokens 128] [--depth 1000] [--threads 1]

Both engines (``weights_dtype="dequantized"`` and ``"as_shipped"``; ``dtype=bfloat16``, ``kv_cache_dtype=auto``)
are loaded once, then run alternately (A B A B ...) on the same prompts: a short chat prompt and a
``--depth``-token text prompt, ``--tokens`` out, greedy, EOS ignored. Decode tokens/s excludes prefill:
``(output_tokens - 1) / (total time - time to first token)`` of the request. Prints each run, the
load average around it, the weights' bytes, and per prompt the median of each mode and their ratio.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _text import token_prompt  # noqa: E402

from kvpage import LLM, SamplingParams  # noqa: E402

MODES = ("dequantized", "as_shipped")


def decode_rate(llm: LLM, prompt: dict, tokens: int) -> tuple[float, float]:
    """``(decode tokens/s, time to first token in s)`` of one greedy request."""
    out = llm.generate(prompt, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))[0]
    m = out.metrics
    return (m.output_tokens - 1) / (m.total_time_s - m.time_to_first_token_s), m.time_to_first_token_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--depth", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    llms = {mode: LLM(None, dtype="bfloat16", weights_dtype=mode, kv_cache_dtype="auto", num_threads=args.threads,
                      progress=False, enable_prefix_caching=False) for mode in MODES}
    for mode, llm in llms.items():
        print(f"{mode}: {llm.weight_bytes / 2**20:,.1f} MiB of weights", flush=True)
    tok = llms[MODES[0]].tokenizer
    prompts = {"short chat": llms[MODES[0]].chat_prompt("What is the capital of France, and what is it famous for?"),
               f"depth {args.depth}": {"prompt_token_ids": token_prompt(tok, args.depth, seed=1)}}
    for llm in llms.values():  # warm-up: kernels built, caches touched
        for p in prompts.values():
            decode_rate(llm, p, 4)
    rates: dict[tuple[str, str], list[float]] = {}
    for r in range(args.rounds):
        for name, p in prompts.items():
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                load = os.getloadavg()[0]
                rate, ttft = decode_rate(llms[mode], p, args.tokens)
                rates.setdefault((name, mode), []).append(rate)
                print(f"round {r} {name:>12} {mode:>11}: {rate:6.1f} tok/s decode, TTFT {ttft:.3f} s "
                      f"(load {load:.2f} -> {os.getloadavg()[0]:.2f})", flush=True)
    for name in prompts:
        a, b = (statistics.median(rates[(name, m)]) for m in MODES)
        print(f"{name:>12}: dequantized {a:.1f}, as_shipped {b:.1f} tok/s (median of {args.rounds}); "
              f"as_shipped / dequantized = {b / a:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
