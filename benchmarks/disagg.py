"""Prefill/decode disaggregation over Redis: TTFT and decode tokens/s of a consumer against a single instance.

Usage::

    python benchmarks/disagg.py [--prompt-tokens 512] [--max-tokens 32] [--kv-cache-dtype auto] [--threads 1]
                                [--repeats 3]

One process, the bundled model, three engines: a single instance (no store), a ``kv_producer`` and a
``kv_consumer`` sharing a Redis store (``kv_transfer_config``; the server is the test suite's
``tests/redis_server.py``, started on a free loopback port and stopped at the end). Each repeat draws a new
``--prompt-tokens`` prompt (``benchmarks/_text.py``, so nothing is cached on any device) and runs it three ways:

* **single** -- the whole request on one instance: TTFT (the prefill) and decode tokens/s;
* **producer** -- the prefill request of vLLM's proxy flow (``max_tokens=1``): its time includes the synchronous
  write-through of the prompt's blocks to Redis;
* **consumer** -- the decode request: TTFT is loading the blocks from Redis and computing the last partial block,
  then decode tokens/s.

Decode tokens/s is ``(output tokens - 1) / (total time - TTFT)``. A client behind the proxy waits producer +
consumer TTFT for its first token (the ``P/D`` row). The greedy outputs of single and consumer are compared.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "tests"))  # the suite's real Redis server

import torch  # noqa: E402
from _text import token_prompt  # noqa: E402
from redis_server import RedisServer  # noqa: E402

from kvpage import LLM, SamplingParams  # noqa: E402
from kvpage.model.loader import load_model  # noqa: E402


def run(llm: LLM, ids: list[int], max_tokens: int) -> tuple[float, float, int, list[int]]:
    """TTFT (s), decode tokens/s (0 for one token), cached tokens and the output ids of a greedy request."""
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                  ignore_eos=True))[0]
    m = out.metrics
    n = len(out.outputs[0].token_ids)
    decode = (n - 1) / (m.total_time_s - m.time_to_first_token_s) if n > 1 else 0.0
    return m.time_to_first_token_s, decode, m.cached_tokens, list(out.outputs[0].token_ids)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load average before: {os.getloadavg()}")
    model = load_model(None, dtype=torch.float32, progress=False)
    work = tempfile.mkdtemp(prefix="kvpage-disagg-")
    redis = RedisServer(os.path.join(work, "redis"))
    redis.start()

    def role(r: str) -> dict:
        return {"kv_connector": "KVPageStoreConnector", "kv_role": r,
                "kv_connector_extra_config": {"kv_store": redis.url}}

    common = dict(kv_cache_dtype=args.kv_cache_dtype, progress=False, num_blocks=128, num_threads=args.threads)
    try:
        single = LLM(model, **common)
        producer = LLM(model, kv_transfer_config=role("kv_producer"), **common)
        consumer = LLM(model, kv_transfer_config=role("kv_consumer"), **common)
        for llm in (single, producer, consumer):  # first-call overheads
            run(llm, token_prompt(single.tokenizer, 40, seed=999 + id(llm) % 7), 2)
        rows: dict[str, list[tuple[float, float, int]]] = {"single": [], "producer (prefill)": [], "consumer": []}
        p_d: list[float] = []
        same = True
        for r in range(args.repeats):
            ids = token_prompt(single.tokenizer, args.prompt_tokens, seed=300 + r)
            t, d, c, ref = run(single, ids, args.max_tokens)
            rows["single"].append((t, d, c))
            tp, _, c, _ = run(producer, ids, 1)
            rows["producer (prefill)"].append((tp, 0.0, c))
            t, d, c, got = run(consumer, ids, args.max_tokens)
            rows["consumer"].append((t, d, c))
            p_d.append(tp + t)
            same &= got == ref
        print(f"kvpage P/D over Redis: {args.prompt_tokens}-token prompt, {args.max_tokens} output tokens, "
              f"{args.kv_cache_dtype} KV, model float32, {args.threads} thread(s), median of {args.repeats}")
        print(f"{'':<20} {'TTFT s':>8} {'decode tok/s':>13} {'cached tokens':>14}")
        for name, vals in rows.items():
            ttft = statistics.median(v[0] for v in vals)
            dec = statistics.median(v[1] for v in vals)
            print(f"{name:<20} {ttft:>8.3f} {dec if dec else float('nan'):>13.1f} {vals[-1][2]:>14}")
        print(f"{'P/D (client)':<20} {statistics.median(p_d):>8.3f} {'':>13} {'':>14}")
        s = consumer.engine.stats().kv
        print(f"consumer: tier hits (blocks) {s.tier_hits}; bytes moved {s.tiers.tier_bytes}")
        print(f"same greedy output from consumer and single instance: {same}")
        for llm in (producer, consumer):
            llm.close()
    finally:
        redis.kill()
        shutil.rmtree(work, ignore_errors=True)
    print(f"load average after: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
