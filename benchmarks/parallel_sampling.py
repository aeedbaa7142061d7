"""Parallel sampling (issue 16): n = 1, 4, 16 completions of one 512-token prompt on the bundled model.

Usage::

    python benchmarks/parallel_sampling.py [--prompt-tokens 512] [--max-tokens 64] [--kv-cache-dtype int8]

For each ``n``: output tokens per second (all completions' tokens over the wall time of the request), and the
peak KV blocks in use (read from the pool after every engine step) against what ``n`` independent requests
would hold without sharing (``n x`` the prompt's blocks + their outputs). Prefix caching is off, so the sharing
measured is the fork's alone. One run; the load average is printed.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

from _text import token_prompt  # noqa: E402

from kvpage import LLM, SamplingParams  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--kv-cache-dtype", default="int8")
    p.add_argument("--ns", default="1,4,16")
    args = p.parse_args()
    llm = LLM(progress=False, kv_cache_dtype=args.kv_cache_dtype, enable_prefix_caching=False, max_num_seqs=16)
    prompt = token_prompt(llm.tokenizer, args.prompt_tokens, seed=0)
    bs = llm.spec.block_size
    engine = llm.engine
    step = engine.step
    peak = 0

    def watched() -> list:
        nonlocal peak
        out = step()
        peak = max(peak, llm.kv_cache_stats().num_in_use)
        return out

    setattr(engine, "step", watched)
    llm.generate({"prompt_token_ids": prompt[:64]}, SamplingParams(max_tokens=4))  # warm-up
    print(f"load average: {os.getloadavg()[0]:.2f}; {args.kv_cache_dtype}, block {bs}, prompt {len(prompt)} tokens, "
          f"{args.max_tokens} tokens per completion, temperature 1.0, prefix caching off")
    print("| n | output tokens/s | wall s | peak KV blocks | n independent requests (blocks) | bound: prompt + "
          "n x (gen + 1) |")
    print("|---:|---:|---:|---:|---:|---:|")
    prompt_blocks = -(-len(prompt) // bs)
    gen_blocks = -(-args.max_tokens // bs)
    for n in (int(x) for x in args.ns.split(",")):
        peak = 0
        params = SamplingParams(n=n, max_tokens=args.max_tokens, temperature=1.0, seed=0, ignore_eos=True)
        t0 = time.perf_counter()
        out = llm.generate({"prompt_token_ids": prompt}, params)[0]
        wall = time.perf_counter() - t0
        tokens = sum(len(c.token_ids) for c in out.outputs)
        independent = n * -(-(len(prompt) + args.max_tokens) // bs)
        bound = prompt_blocks + n * (gen_blocks + 1)
        print(f"| {n} | {tokens / wall:.1f} | {wall:.2f} | {peak} | {independent} | {bound} |")


if __name__ == "__main__":
    main()
