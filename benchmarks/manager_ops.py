"""KV-cache bookkeeping speed: allocate / append / match / free operations per second.

Usage::

    python benchmarks/manager_ops.py [--ops 100000] [--blocks 4096] [--block-size 16] [--seed 0] [--no-caching]

A simulated serving loop drives one :class:`~kvpage.cache.kv_cache.KVCache`
(no tensors, no model) for ``--ops`` operations in all, picking at each step:

* **allocate** — admit a new request: ``match`` + ``allocate``
  for its whole prompt + ``cache`` (prompts of 64-1024 tokens; half
  start with one of 8 shared "system prompts" of 256 tokens, so hits happen);
* **append** — one decode step of a running request: append a token,
  ``allocate(req, 1)``, ``cache``;
* **match** — ``match`` of a fresh request (routing-style lookup);
* **free** — finish a running request (``free``); when ``allocate``
  returns ``None`` the oldest running request is preempted instead.

Each operation is timed on its own with ``time.perf_counter_ns``; the table
gives count, total time, operations per second and mean microseconds per
operation for each kind, plus the prefix-cache stats at the end.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvpage.cache.kv_cache import KVCache  # noqa: E402
from kvpage.cache.requests import KVRequest  # noqa: E402


def run(num_ops: int, num_blocks: int, block_size: int, seed: int, caching: bool) -> dict[str, list[int]]:
    """Run the mixed workload; returns ``{op: [count, total_ns]}`` and prints nothing."""
    rng = random.Random(seed)
    mgr = KVCache(num_blocks, block_size, enable_caching=caching)
    systems = [[rng.randrange(32000) for _ in range(256)] for _ in range(8)]
    running: list[KVRequest] = []
    timing: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    clock = time.perf_counter_ns
    counter = 0

    def new_request() -> KVRequest:
        nonlocal counter
        counter += 1
        n = rng.randint(64, 1024)
        if rng.random() < 0.5:
            head = rng.choice(systems)
            tokens = head + [rng.randrange(32000) for _ in range(max(n - len(head), 1))]
        else:
            tokens = [rng.randrange(32000) for _ in range(n)]
        return KVRequest(f"r{counter}", tokens)

    done = 0
    while done < num_ops:
        r = rng.random()
        if r < 0.15 or not running:
            req = new_request()
            t0 = clock()
            match = mgr.match(req)
            blocks = mgr.allocate(req, len(req.all_token_ids) - match.num_cached_tokens, match)
            if blocks is not None:
                mgr.cache(req, blocks.num_tokens)
            t1 = clock()
            if blocks is None:
                if running:  # out of blocks: preempt the oldest, as a scheduler would
                    victim = running.pop(0)
                    t0 = clock()
                    mgr.preempt(victim)
                    t1 = clock()
                    timing["free"][0] += 1
                    timing["free"][1] += t1 - t0
                    done += 1
                continue
            running.append(req)
            op = "allocate"
        elif r < 0.80:
            req = rng.choice(running)
            req.all_token_ids.append(rng.randrange(32000))
            t0 = clock()
            blocks = mgr.allocate(req, 1)
            if blocks is not None:
                mgr.cache(req, blocks.num_tokens)
            t1 = clock()
            if blocks is None:
                req.all_token_ids.pop()
                victim = running.pop(0)
                mgr.preempt(victim)
                continue
            op = "append"
        elif r < 0.90:
            req = new_request()
            t0 = clock()
            mgr.match(req)
            t1 = clock()
            op = "match"
        else:
            req = running.pop(rng.randrange(len(running)))
            t0 = clock()
            mgr.free(req)
            t1 = clock()
            op = "free"
        timing[op][0] += 1
        timing[op][1] += t1 - t0
        done += 1
    for req in running:
        mgr.free(req)
    st = mgr.stats()
    assert st.num_in_use == 0
    assert st.num_free + st.num_evictable == num_blocks
    timing["_stats"] = mgr.stats()  # type: ignore[assignment]
    return timing


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ops", type=int, default=100_000)
    ap.add_argument("--blocks", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-caching", action="store_true", help="prefix caching off (plain paged allocation)")
    args = ap.parse_args()

    modes = [False] if args.no_caching else [True, False]
    print(
        f"KVCache bookkeeping, {args.ops:,} operations, {args.blocks} blocks x {args.block_size} tokens, "
        f"Python {sys.version.split()[0]}"
    )
    print(f"{'caching':<8} {'op':<9} {'count':>8} {'total s':>9} {'ops/s':>11} {'us/op':>9}")
    for caching in modes:
        t = run(args.ops, args.blocks, args.block_size, args.seed, caching)
        stats = t.pop("_stats")
        total_n = total_ns = 0
        for op in ("allocate", "append", "match", "free"):
            n, ns = t.get(op, [0, 0])
            total_n += n
            total_ns += ns
            rate = n / (ns / 1e9) if ns else float("nan")
            print(f"{'on' if caching else 'off':<8} {op:<9} {n:>8,} {ns / 1e9:>9.3f} {rate:>11,.0f} {ns / max(n, 1) / 1e3:>9.2f}")
        print(f"{'on' if caching else 'off':<8} {'all':<9} {total_n:>8,} {total_ns / 1e9:>9.3f} "
              f"{total_n / (total_ns / 1e9):>11,.0f} {total_ns / total_n / 1e3:>9.2f}")
        print(
            f"         stats: hit rate {stats.hit_rate:.1%} ({stats.prefix_hits:,}/{stats.prefix_queries:,} tokens), "
            f"{stats.blocks_stored:,} blocks stored, {stats.evictions:,} evicted, {stats.preemptions:,} preemptions"
        )


if __name__ == "__main__":
    main()
