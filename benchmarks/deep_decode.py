"""Decode tokens/s at depth: ``batch`` requests with ``depth``-token prompts, one KV format against another.

Usage::

    python benchmarks/deep_decode.py [--batch 8] [--depth 4096] [--formats auto,int8,int4] [--steps 32]
                                     [--rounds 3] [--dtype bfloat16] [--threads 1] [--attention-backend auto]

Every format gets its own ``LLM`` (bundled SmolLM2, prefix caching off), loaded once. Each round, in an
order that alternates between rounds (A/B, B/A), each engine takes ``batch`` fresh requests of random
prompt tokens (the same ids for every format), runs their prefills, then times ``--steps`` decode steps
of the whole batch: tokens/s = batch * steps / seconds. Prefill is not timed. The load average is printed
beside every measurement: these machines are shared. Reports the median and range per format and each
format's ratio to the first one.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from kvpage import LLM, SamplingParams  # noqa: E402


def decode_rate(llm: LLM, prompts: list[list[int]], steps: int, tag: str) -> float:
    """Tokens/s of ``steps`` decode steps of all ``prompts`` at once (after their prefills, which are not timed)."""
    eng = llm.engine
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"{tag}-{i}", p, params)
    while not (len(eng.scheduler.running) == len(prompts)
               and all(r.num_tokens - r.num_computed_tokens == 1 for r in eng.scheduler.running)):
        eng.step()
    eng.step()  # one untimed decode step
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    dt = time.perf_counter() - t
    while eng.has_unfinished_requests():
        eng.step()
    return len(prompts) * steps / dt


def main() -> None:
    """Parse the flags, run the rounds and print one line per measurement and a summary table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--depth", type=int, default=4096)
    ap.add_argument("--formats", default="auto,int8,int4")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--attention-backend", default="auto")
    args = ap.parse_args()
    formats = args.formats.split(",")
    need = args.batch * (args.depth + args.steps + 16)
    llms = {f: LLM(None, kv_cache_dtype=f, dtype=args.dtype, num_threads=args.threads, progress=False,
                   attention_backend=args.attention_backend, enable_prefix_caching=False,
                   max_model_len=args.depth + args.steps + 64, max_num_batched_tokens=2048,
                   kv_cache_memory_bytes=max(1 << 28, int(need * 23040 * 1.3)))
            for f in formats}
    rng = random.Random(0)
    rates: dict[str, list[float]] = {f: [] for f in formats}
    print(f"batch {args.batch}, depth {args.depth}, {args.steps} timed decode steps, dtype {args.dtype}, "
          f"{args.threads} thread(s), attention backend {args.attention_backend}; loadavg {os.getloadavg()}")
    for r in range(args.rounds):
        prompts = [[rng.randrange(100, 40000) for _ in range(args.depth)] for _ in range(args.batch)]
        order = formats if r % 2 == 0 else formats[::-1]
        for f in order:
            load = os.getloadavg()[0]
            rate = decode_rate(llms[f], prompts, args.steps, f"r{r}")
            rates[f].append(rate)
            print(f"  round {r + 1}: {f:8s} {rate:7.1f} tok/s   loadavg {load:.2f}", flush=True)
    base = statistics.median(rates[formats[0]])
    print(f"\n| format | decode tok/s, median (min-max) | vs {formats[0]} |\n|---|---|---|")
    for f in formats:
        m = statistics.median(rates[f])
        print(f"| {f} | {m:.1f} ({min(rates[f]):.1f}-{max(rates[f]):.1f}) | {m / base:.2f} |")
    print(f"loadavg at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
