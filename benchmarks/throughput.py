"""Continuous batching vs one request at a time: total output tokens/s for the same 32 requests, in one run.

Usage::

    python benchmarks/throughput.py [--requests 32] [--output-tokens 128] [--dtype bfloat16]
                                    [--kv-cache-dtype float32] [--threads 2]

Prompts are 64-512 tokens (evenly spread, deterministic text), every request
generates exactly ``--output-tokens`` tokens (greedy, EOS ignored). "one at a
time" calls ``LLM.generate`` on each request alone, in order; "continuous
batching" submits all of them at once and lets the scheduler batch them.
Prefill is included in both: it is the same work either way.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from _text import token_prompt  # noqa: E402

from kvpage import LLM, SamplingParams  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(kv_cache_dtype=args.kv_cache_dtype, dtype=args.dtype, progress=False,
              kv_cache_memory_bytes=1 * 2**30, max_num_seqs=args.requests,
              max_num_batched_tokens=args.max_num_batched_tokens)
    n = args.requests
    lens = [64 + (512 - 64) * i // max(n - 1, 1) for i in range(n)]
    prompts = [{"prompt_token_ids": token_prompt(llm.tokenizer, L, seed=i)} for i, L in enumerate(lens)]
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up

    # Prefix caching stays on in both modes, but every prompt is distinct text: no hits either way.
    t = time.perf_counter()
    single = [llm.generate([p], params)[0] for p in prompts]
    t_single = time.perf_counter() - t
    t = time.perf_counter()
    batched = llm.generate(prompts, params)
    t_batched = time.perf_counter() - t

    produced = sum(o.metrics.output_tokens for o in batched)
    assert produced == sum(o.metrics.output_tokens for o in single) == n * args.output_tokens
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(single, batched))
    print(f"{n} requests, prompts {min(lens)}-{max(lens)} tokens ({sum(lens):,} in all), {args.output_tokens} output "
          f"tokens each; weights {args.dtype}, KV cache {args.kv_cache_dtype}, {args.threads} thread(s), "
          f"max_num_batched_tokens {args.max_num_batched_tokens}")
    print("| mode | wall s | output tokens/s | mean TTFT s |")
    print("|---|---|---|---|")
    ttft_single = sum(o.metrics.time_to_first_token_s for o in single) / n
    ttft_batched = sum(o.metrics.time_to_first_token_s for o in batched) / n
    print(f"| one at a time | {t_single:.1f} | {produced / t_single:.1f} | {ttft_single:.3f} |")
    print(f"| continuous batching | {t_batched:.1f} | {produced / t_batched:.1f} | {ttft_batched:.3f} |")
    print(f"speed-up: {t_single / t_batched:.2f}x; greedy outputs identical in {same}/{n} requests; "
          f"preemptions {llm.engine.stats().num_preemptions}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
