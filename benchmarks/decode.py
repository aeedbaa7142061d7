"""Decode speed per KV format: kvpage batch 1 and 8 against transformers ``generate()`` batch 1, in one run.

Usage::

    python benchmarks/decode.py [--tokens 64] [--threads 1] [--dtypes float32,bfloat16]
                                [--formats float32,bfloat16,int8,fp8]

Decode tokens/s excludes prefill: for kvpage it is ``(output_tokens - 1) /
(finish time - first token time)`` of each request; for transformers it is
``(N - 1) / (t(N tokens) - t(1 token))`` of two greedy ``generate()`` calls on
the same prompt (DynamicCache). Both run greedy with EOS ignored, on the same
weights (the bundled SmolLM2 GGUF) and the same thread count.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from kvpage import LLM, SamplingParams  # noqa: E402
from kvpage.engine.capacity import SMOLLM2_SHAPE, kv_capacity  # noqa: E402
from kvpage.engine.config import EngineConfig  # noqa: E402
from kvpage.model.loader import default_model_path  # noqa: E402

#: Bytes of KV blocks every format gets; its side pools (int4/int2) come on top (see kv_budget).
POOL_BYTES = 64 * 2**20

PROMPTS = [
    "What is the capital of France, and what is it famous for?",
    "Explain how a hash table works in two sentences.",
    "Write a short poem about the sea.",
    "List three uses of copper.",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
    "What is photosynthesis?",
    "Describe the rules of chess briefly.",
]


def bench_kvpage(llm: LLM, batch: int, tokens: int) -> float:
    """Decode tokens/s of ``batch`` chat prompts generating ``tokens`` tokens each (greedy, EOS ignored)."""
    prompts = [llm.chat_prompt(PROMPTS[i % len(PROMPTS)]) for i in range(batch)]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
    outs = llm.generate(prompts, params)
    first = min(o.metrics.time_to_first_token_s for o in outs)
    last = max(o.metrics.total_time_s for o in outs)
    produced = sum(o.metrics.output_tokens - 1 for o in outs)
    return produced / (last - first)


def bench_transformers(dtype: torch.dtype, tokens: int) -> float:
    """Decode tokens/s of transformers ``generate()`` batch 1 (DynamicCache), same prompt and weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]

    def run(n: int) -> float:
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - t

    run(4)  # warm-up
    t1 = min(run(1) for _ in range(2))
    tn = run(tokens)
    return (tokens - 1) / (tn - t1)


def kv_budget(fmt: str, dtype: str) -> int:
    """KV budget giving ``fmt`` :data:`POOL_BYTES` of blocks plus its side pools, from the engine's capacity function.

    A flat 64 MiB budget failed for int4, whose tail pool alone takes more (about 91 MiB at max_num_seqs 64).
    """
    side = kv_capacity(EngineConfig(kv_cache_dtype=fmt, dtype=dtype, num_blocks=1), SMOLLM2_SHAPE).side_pool_bytes
    return POOL_BYTES + side


def measure(threads: int, dtypes: list[str], formats: list[str], batches: list[int], tokens: int) -> list[list]:
    """Rows ``[threads, engine, weights, kv_cache, batch, tokens/s]`` for one thread count (in this process)."""
    torch.set_num_threads(threads)
    rows: list[list] = []
    for dt in dtypes:
        hf = bench_transformers(getattr(torch, dt), tokens)
        rows.append([threads, "transformers generate", dt, "DynamicCache", 1, hf])
        print(f"[{threads} thr] transformers {dt} batch 1: {hf:.1f} tokens/s", file=sys.stderr, flush=True)
    for dt in dtypes:
        for fmt in formats:
            llm = LLM(kv_cache_dtype=fmt, dtype=dt, num_threads=threads, progress=False,
                      kv_cache_memory_bytes=kv_budget(fmt, dt))
            for b in batches:
                r = bench_kvpage(llm, b, tokens)
                rows.append([threads, "kvpage", dt, fmt, b, r])
                print(f"[{threads} thr] kvpage {dt} {fmt} batch {b}: {r:.1f} tokens/s", file=sys.stderr, flush=True)
            del llm
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", default="1,2", help="torch thread counts; each runs in a fresh process")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="model compute dtypes for kvpage and transformers")
    ap.add_argument("--formats", default="float32,bfloat16,int8,fp8")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--json-rows", action="store_true", help=argparse.SUPPRESS)  # child mode
    args = ap.parse_args()
    dtypes, formats = args.dtypes.split(","), args.formats.split(",")
    batches = [int(x) for x in args.batches.split(",")]
    threads_list = [int(t) for t in args.threads.split(",")]
    if args.json_rows:
        print(json.dumps(measure(threads_list[0], dtypes, formats, batches, args.tokens)))
        return 0
    rows: list[list] = []
    for threads in threads_list:
        # A fresh process per thread count: switching torch's thread pool size in one process slowed
        # later runs by up to 1.5x here.
        cmd = [sys.executable, __file__, "--json-rows", "--threads", str(threads), "--tokens", str(args.tokens),
               "--dtypes", args.dtypes, "--formats", args.formats, "--batches", args.batches]
        out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
        rows += json.loads(out.strip().splitlines()[-1])
    print(f"\nDecode throughput (tokens/s, prefill excluded), SmolLM2-135M-Instruct, {args.tokens} tokens/request, "
          f"greedy, torch {torch.__version__}")
    head = (f"| threads | {'engine':<21} | {'weights':<8} | {'KV cache':<12} | batch | {'tokens/s':>8} "
            f"| vs HF same weights | vs HF float32 |")
    print(head)
    print("|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|")
    for threads, eng, dt, fmt, b, r in rows:
        base = {d: next(x[5] for x in rows if x[0] == threads and x[1].startswith("transformers") and x[2] == d)
                for d in dtypes}
        b32 = base.get("float32", next(iter(base.values())))
        print(f"| {threads:>7} | {eng:<21} | {dt:<8} | {fmt:<12} | {b:>5} | {r:>8.1f} | {r / base[dt]:>17.2f}x "
              f"| {r / b32:>12.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
