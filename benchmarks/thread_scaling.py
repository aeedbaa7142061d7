"""kvpage at 1 thread against N threads on ``vs_vllm.py``'s 32-request mix: does the second thread pay?

Usage::

    python benchmarks/thread_scaling.py [--threads 2] [--requests 32] [--tokens 128] [--rounds 2] [--kv auto]

One ``LLM`` per thread count (bundled SmolLM2, bf16 weights, prefix caching off, 1 GiB of KV, the same
engine settings as ``vs_vllm.py``'s kvpage worker), built once; each round runs the mix (prompts 64-512
tokens, ``vs_vllm.make_prompts``, greedy, EOS ignored) on each engine, alternating which goes first. Every
engine step is timed: steps where all requests decode ("decode") apart from the rest ("prefill", which holds
the prompt chunks). Printed per run: tok/s, cores used (this process's CPU s / wall s), the load average,
prefill seconds and decode-step min/median; then the N-thread / 1-thread ratios of the medians over rounds.
The issue's target: 2 threads >= 1.7x one thread at 32 requests. Run it on a quiet machine: on a box whose
cores are busy, an N-thread op waits for its slowest thread at every barrier, and N threads lose to one.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from kvpage import LLM, SamplingParams  # noqa: E402
from kvpage.model.loader import load_model  # noqa: E402


def run_mix(llm: LLM, prompts: list[list[int]], n_out: int, tag: str) -> dict[str, Any]:
    """Run every prompt to ``n_out`` tokens through ``llm``'s engine step by step; wall, CPU and step times."""
    eng = llm.engine
    params = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(None, p, params, request_id=f"{tag}-{i}")
    prefill, decode = [], []
    c0, t0 = time.process_time(), time.perf_counter()
    while eng.has_unfinished_requests():
        s0 = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - s0
        all_decode = len(outs) == len(prompts) and all(len(o.outputs[0].token_ids) > 1 for o in outs)
        (decode if all_decode else prefill).append(dt)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "tok_s": len(prompts) * n_out / wall, "cores": (time.process_time() - c0) / wall,
            "prefill_s": sum(prefill), "decode_steps": decode, "load": os.getloadavg()[0]}


def main() -> None:
    """Parse arguments, build both engines, run the rounds and print the comparison."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2, help="the thread count compared with 1")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kv", default="auto", help="KV cache format (kv_cache_dtype)")
    args = ap.parse_args()
    if args.threads < 2:
        ap.error(f"--threads must be >= 2, got {args.threads}")
    import vs_vllm

    # bf16 weights dequantized, as vs_vllm's kvpage worker (the same tensors vLLM runs)
    loaded = load_model(None, dtype=torch.bfloat16, progress=False, weights_dtype="dequantized")
    prompts = vs_vllm.make_prompts(loaded.tokenizer, args.requests, 1000)["batch"]
    counts = (1, args.threads)
    llms = {}
    for n in counts:
        torch.set_num_threads(n)
        llms[n] = LLM(loaded, kv_cache_dtype=args.kv, dtype="bfloat16", num_threads=n, progress=False,
                      enable_prefix_caching=False, kv_cache_memory_bytes=vs_vllm.KV_BYTES, max_num_seqs=64)
        llms[n].generate([{"prompt_token_ids": prompts[0][:32]}], SamplingParams(max_tokens=4, temperature=0.0))
    print(f"{args.requests} requests, {sum(map(len, prompts)):,} prompt tokens, {args.tokens} out each, kv {args.kv}; "
          f"{args.rounds} round(s); loadavg {os.getloadavg()}", flush=True)
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in counts}
    for rnd in range(args.rounds):
        for n in (counts if rnd % 2 == 0 else counts[::-1]):
            torch.set_num_threads(n)  # one process, two engines: the count is process-wide
            r = run_mix(llms[n], prompts, args.tokens, f"t{n}-r{rnd}")
            runs[n].append(r)
            d = r["decode_steps"]
            print(f"  round {rnd + 1}, {n} thread(s): {r['tok_s']:.1f} tok/s ({r['wall_s']:.2f} s), "
                  f"{r['cores']:.2f} cores, load {r['load']:.2f}; prefill {r['prefill_s']:.2f} s; "
                  f"decode step min {min(d) * 1e3:.1f} ms, median {statistics.median(d) * 1e3:.1f} ms", flush=True)
    one, many = runs[1], runs[args.threads]

    def med(rs: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r[key] for r in rs)

    dec = [statistics.median([x for r in rs for x in r["decode_steps"]]) for rs in (one, many)]
    print(f"{args.threads} threads / 1 thread: throughput {med(many, 'tok_s') / med(one, 'tok_s'):.2f}x, "
          f"prefill {med(one, 'prefill_s') / med(many, 'prefill_s'):.2f}x, decode step {dec[0] / dec[1]:.2f}x "
          f"(target >= 1.7x throughput at 2 threads, 32 requests)")


if __name__ == "__main__":
    main()
