"""Prefix caching: 16 requests sharing a 1,024-token system prompt, caching on vs off, in one run.

Usage::

    python benchmarks/prefix.py [--requests 16] [--prefix-tokens 1024] [--dtype bfloat16] [--threads 2]

Each request is the shared system prompt followed by its own question
(~10-20 tokens) and generates 8 tokens. Requests arrive one after another
(each submitted when the previous finished, as users of a chat service do),
after one warm-up request that computes the system prompt. Reported: mean and
p50 time to first token of the 16 requests, prefix hit rate (cached tokens /
prompt tokens), and the speed-up of caching on over caching off.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402
from _text import token_prompt  # noqa: E402

from kvpage import LLM, SamplingParams  # noqa: E402

QUESTIONS = ["What happened at the harbour?", "Who repaired the bridge?", "Summarise the report.",
             "What did the committee plan?", "Name one festival.", "What was measured?", "Who wrote letters?",
             "What is the budget question?", "Describe the tunnels.", "When did the meeting end?",
             "What did the robot do?", "What was painted?", "Who translated the song?", "What about the windows?",
             "What is the winter plan?", "Which boat was designed?"]


def run(llm: LLM, prefix: list[int], n: int) -> tuple[list[float], float, list[list[int]]]:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    warm = prefix + llm.tokenizer.encode("\nQuestion: Hello?\nAnswer:", add_special_tokens=False)
    llm.generate({"prompt_token_ids": warm}, params)
    ttft, prompt_tokens, cached, outs = [], 0, 0, []
    for q in QUESTIONS[:n]:
        ids = prefix + llm.tokenizer.encode(f"\nQuestion: {q}\nAnswer:", add_special_tokens=False)
        o = llm.generate({"prompt_token_ids": ids}, params)[0]
        ttft.append(o.metrics.time_to_first_token_s)
        prompt_tokens += o.metrics.prompt_tokens
        cached += o.metrics.cached_tokens
        outs.append(o.outputs[0].token_ids)
    return ttft, cached / prompt_tokens, outs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prefix-tokens", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-dtype", default="int8")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = {}
    for caching in (False, True):
        llm = LLM(kv_cache_dtype=args.kv_cache_dtype, dtype=args.dtype, progress=False,
                  kv_cache_memory_bytes=256 * 2**20, enable_prefix_caching=caching)
        prefix = token_prompt(llm.tokenizer, args.prefix_tokens, seed=1234)
        results[caching] = run(llm, prefix, args.requests)
        del llm
    print(f"{args.requests} requests sharing a {args.prefix_tokens}-token system prompt, arriving one after "
          f"another; weights {args.dtype}, KV cache {args.kv_cache_dtype}, {args.threads} thread(s)")
    print("| prefix caching | mean TTFT s | p50 TTFT s | prefix hit rate |")
    print("|---|---|---|---|")
    for caching in (False, True):
        ttft, rate, _ = results[caching]
        print(f"| {'on' if caching else 'off'} | {statistics.mean(ttft):.3f} | {statistics.median(ttft):.3f} "
              f"| {rate:.1%} |")
    off, on = statistics.mean(results[False][0]), statistics.mean(results[True][0])
    same = sum(a == b for a, b in zip(results[False][2], results[True][2]))
    print(f"time to first token: {off / on:.1f}x faster with prefix caching; greedy outputs identical in "
          f"{same}/{args.requests} requests")
    return 0


if __name__ == "__main__":
    sys.exit(main())
