"""The attention op alone: one decode layer-step of the ``reference`` and ``cpu`` backends, every format.

Usage::

    python benchmarks/attention.py                       # the full matrix (a few minutes)
    python benchmarks/attention.py --quick               # smoke test
    python benchmarks/attention.py --batch 32 --depth 1024 --formats int8,int4 --repeats 9 --json out.json

Shape: SmolLM2's attention (9 query heads, 3 KV heads, head_dim 64), one layer;
block_size 16, or 32 for ``int4``/``int3``/``int2`` (the engine's preferred size). Each
request has ``depth`` cached tokens and decodes one new token, so the step writes
``batch`` K/V rows and attends over ``depth + 1`` tokens per request.

* Token-wise formats: the pool holds random codes (8-bit codes in ``0..119``,
  float16 scales in ``[0.01, 0.02]``) or unit-normal floats; static formats get
  ``absmax`` scales of ~5 (:class:`kvpage.scales.StaticScales`). Re-running the
  step rewrites the same rows with the same K/V, so repeats see the same state.
* ``int4``/``int3``/``int2``: the cache is filled by a real prefill through the cpu
  backend's ``forward_sealed`` (1,024-token chunks per request, so sealed blocks,
  the sink copy of block 0 and, for ``int2``, the 32-token 16-bit window are real;
  tail slots sized as the engine sizes them). The decode step is then planned
  **once** (``TailTable.plan``'s operations made index tensors by ``TailPool.context``) and its ``forward_sealed`` is
  repeated before ``table.finish()``, exactly as every layer of a model applies one
  plan; its writes (one row into the open tail slot) are idempotent, so every repeat
  sees depth exactly ``depth`` and no reset is needed.

Per-step state a model shares across layers (the metadata's tensors, the cpu
backend's per-step source table) is built in the warm-up, not timed. Reference and
cpu samples alternate (A/B, order flipped each round) because the machine is shared.

* **Cold** (the default): each sample is one call with the KV out of every cache, as
  in a model's decode step, where a layer's blocks were last read one step and all
  other layers ago, while the code and the interpreter's state are warm from the
  layer before. Before it, untimed: a buffer of four times the last-level cache (at
  least 64 MiB, allocated once) is rewritten three times, which the cache keeps in
  preference to lines read once (a single streaming pass left much of a depth-1,024
  cache resident), then the same backend runs the same format on a one-request,
  two-block cache of its own (code, dispatch and page walks warm again; batch 1,
  depth 256, int4: 90 µs warm, ~400 µs after the flush alone).
* ``--warm``: each sample times a loop of calls (enough for ~2 ms) and divides, so
  every call but the first finds the KV where the previous one left it (in the
  last-level cache when it fits).

Either way glibc's heap is trimmed (``malloc_trim(0)``, untimed) before each sample:
the next large ``free`` returns the memory freed since to the OS, and a cpu call right
after a reference call otherwise paid for the reference's ~100 MiB of temporaries (a
``brk`` of 4-6 ms inside the call: 3-4x the call itself at batch 32, depth 1,024,
int8). The table gives the median and the min of the samples, the KV bytes the step must
read (the whole blocks covering each context, all tensors incl. scales; for the
sealed formats the pool blocks read plus the 16-bit window/open rows and the
8-bit sink block with its scales), GB/s = bytes / median, that as a fraction of
this machine's copy bandwidth (``dst.copy_(src)`` of 512 MiB at the same thread
count, read + write bytes counted), and the cpu/reference speed-up.
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import functools
import gc
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from kvpage.cache.controller import CacheController  # noqa: E402
from kvpage.cache.tail import TailTable  # noqa: E402
from kvpage.cache.tail.pool import TailPool  # noqa: E402
from kvpage.ops.attention import AttentionMetadata  # noqa: E402
from kvpage.ops.backends import ReferenceBackend, select_backend  # noqa: E402
from kvpage.scales import StaticScales  # noqa: E402
from kvpage.spec import CacheSpec, TailLayout  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
FORMATS = ["float32", "bfloat16", "float16", "int8", "fp8", "int8_rotated", "fp8_per_token_head",
           "int8_static", "fp8_static", "int4", "int3", "int2", "int4_rotated", "int3_rotated", "int2_rotated"]
SEALED = ("int4", "int3", "int2", "int4_rotated", "int3_rotated", "int2_rotated")
PREFILL_CHUNK = 1024
SAMPLE_S = 0.002  # target seconds of one timed sample (a loop of calls)


@dataclass
class Case:
    """One prepared row: a call per backend that runs the layer-step, the bytes it must read, a clean-up."""

    calls: dict[str, Callable[[], torch.Tensor]]
    bytes_read: int
    close: Callable[[], None]


def load() -> str:
    """``os.getloadavg()`` as ``"1m/5m/15m"``."""
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def memory_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """This machine's copy bandwidth in GB/s at the current torch thread count (read + write bytes, best of ``repeats``)."""
    src = torch.ones(mib << 18, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.nbytes / best / 1e9


def last_level_cache_bytes() -> int:
    """This machine's largest CPU cache in bytes (Linux sysfs), or 32 MiB where it cannot be read."""
    best = 0
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = f.read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * unit)
    return best or 32 << 20


@functools.cache
def _eviction_buffer() -> torch.Tensor:
    """The float32 buffer :func:`evict_caches` rewrites: 4x the last-level cache, at least 64 MiB (made once)."""
    return torch.zeros(max(4 * last_level_cache_bytes(), 64 << 20) // 4, dtype=torch.float32)


def evict_caches() -> None:
    """Push every cache line of earlier work out of the CPU caches: rewrite :func:`_eviction_buffer` three times.

    Reused lines are what a last-level cache keeps (a single streaming read or write leaves much of what it
    held), so the buffer is read and written three times over; it is allocated once, so no page is faulted here.
    """
    buf = _eviction_buffer()
    for _ in range(3):
        buf.add_(1.0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or ``None`` (another C library, another OS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


def trim_heap() -> None:
    """Return the heap's free memory to the OS now (glibc), so that no timed call pays for an earlier one's frees."""
    fn = _malloc_trim()
    if fn is not None:
        fn(0)


def build_spec(fmt: str) -> CacheSpec:
    """A one-layer SmolLM2-shaped spec of ``fmt`` (static formats get absmax scales of ~5)."""
    scales = None
    if fmt.endswith("_static"):
        absmax = 4.5 + torch.rand(KV_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(9))
        scales = StaticScales({0: absmax}, {0: absmax}, kind="absmax")
    return CacheSpec.build(num_layers=1, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=32 if fmt in SEALED else 16,
                           kv_cache_dtype=fmt, static_scales=scales)


def _meta(tables: list[list[int]], seq_lens: list[int], query_lens: list[int], bs: int) -> AttentionMetadata:
    slots = [t[p // bs] * bs + p % bs for t, s, n in zip(tables, seq_lens, query_lens) for p in range(s - n, s)]
    return AttentionMetadata.build(block_tables=tables, seq_lens=seq_lens, query_lens=query_lens,
                                   slot_mapping=slots, block_size=bs)


def _qkv(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.randn(n, HEADS, HEAD_DIM, generator=gen), torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen),
            torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen))


def _tables(batch: int, blocks: int) -> list[list[int]]:
    """Interleaved block ids (request ``i`` owns ``i, i + batch, ...``), as round-robin decode allocates them."""
    return [[j * batch + i for j in range(blocks)] for i in range(batch)]


def token_case(fmt: str, batch: int, depth: int, gen: torch.Generator) -> Case:
    """A token-wise format: random codes in the pool, one decode token per request."""
    spec = build_spec(fmt)
    ls, bs = spec.layer(0), spec.block_size
    nbr = math.ceil((depth + 1) / bs)
    cache = CacheController(spec).initialize_kv_cache(batch * nbr)[0]
    for t in cache.values():
        if t.dtype == torch.uint8:
            t.random_(0, 120, generator=gen)
        elif t.dtype == torch.float16 and t.dim() == 3:  # per-token scales [blocks, bs, heads]
            t.uniform_(0.01, 0.02, generator=gen)
        else:
            t.normal_(generator=gen)
    tables = _tables(batch, nbr)
    meta = _meta(tables, [depth + 1] * batch, [1] * batch, bs)
    q, k, v = _qkv(batch, gen)
    calls: dict[str, Callable[[], torch.Tensor]] = {}
    for name, be in (("reference", ReferenceBackend()), ("cpu", select_backend("cpu", ls, "cpu"))):
        calls[name] = lambda be=be: be.forward(q, k, v, cache, ls, meta, layer_index=0)
    static = 2 * KV_HEADS * HEAD_DIM * 4 if fmt.endswith("_static") else 0  # the bound channel scales
    return Case(calls, batch * nbr * ls.bytes_per_block + static, lambda: None)


def sealed_case(fmt: str, batch: int, depth: int, gen: torch.Generator, setup_threads: int) -> Case:
    """``int4``/``int3``/``int2``: a real chunked prefill through the cpu backend, then one planned decode step."""
    spec = build_spec(fmt)
    ls, bs = spec.layer(0), spec.block_size
    window = -(-ls.format.default_residual_tokens // bs)
    nbr = math.ceil((depth + 1) / bs)
    cache = CacheController(spec).initialize_kv_cache(batch * nbr)[0]
    bits = ls.format.window_copy_bits(bs) if window else 16  # int2: int8 window copies in 8-bit slots
    layout = (TailLayout(num_slots=batch * (1 + window), num_sink_slots=2 * batch, window_blocks=window)
              if bits == 16 else TailLayout(num_slots=2 * batch, num_sink_slots=batch * (3 + window),
                                            window_blocks=window, window_bits=8))
    table = TailTable(bs, layout.num_slots, layout.num_sink_slots, layout.window_blocks, window_bits=bits)
    pool = TailPool(spec, layout, torch.float32)  # a float32 model: float16 tail rows
    tables = _tables(batch, nbr)
    cpu = select_backend("cpu", ls, "cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(setup_threads)
    try:
        for i in range(batch):
            for a in range(0, depth, PREFILL_CHUNK):
                b = min(depth, a + PREFILL_CHUNK)
                tab = [tables[i][: math.ceil(b / bs)]]
                meta = _meta(tab, [b], [b - a], bs)
                ctx = pool.context(table.plan(tab, [b], [b - a]))
                cpu.forward_sealed(*_qkv(b - a, gen), cache, ls, meta, ctx, layer_index=0)
                table.finish()
    finally:
        torch.set_num_threads(threads)
    seq_lens = [depth + 1] * batch
    meta = _meta(tables, seq_lens, [1] * batch, bs)
    plan = table.plan(tables, seq_lens, [1] * batch)
    ctx = pool.context(plan)
    q, k, v = _qkv(batch, gen)
    calls: dict[str, Callable[[], torch.Tensor]] = {}
    for name, be in (("reference", ReferenceBackend()), ("cpu", cpu)):
        calls[name] = lambda be=be: be.forward_sealed(q, k, v, cache, ls, meta, ctx, layer_index=0)
    tail_row = KV_HEADS * HEAD_DIM * pool.dtype.itemsize       # one 16-bit row of one tensor
    sink_row = KV_HEADS * HEAD_DIM + KV_HEADS * 2              # int8 codes + float16 per-head scale
    tensors = 2 if ls.has_value else 1
    total = 0
    copied = ls.format.copied_rows(bs)                         # rows of block 0 its 8-bit copy holds
    for read in plan.reads:  # the sources the cpu backend reads, block by block (see its _sealed_sources)
        kind = ["pool"] * len(read.full_ids)
        for j, _ in read.fp_blocks:
            kind[j] = "window"
        for j, _ in read.copy_blocks:
            kind[j] = "copy"
        if read.sink_slot is not None:
            kind[0] = "sink"  # the copy's rows, the block's others from the pool
            total += ls.bytes_per_block if copied < bs else 0
        total += kind.count("pool") * ls.bytes_per_block
        total += tensors * (bs * (kind.count("window") * tail_row + kind.count("copy") * sink_row)
                            + kind.count("sink") * copied * sink_row + read.open_len * tail_row)
    return Case(calls, total, table.finish)


def time_ab(calls: dict[str, Callable[[], torch.Tensor]], repeats: int, budget_s: float,
            primers: dict[str, Callable[[], torch.Tensor]] | None = None) -> tuple[dict[str, list[float]], int]:
    """Seconds per call, one sample per round and backend, rounds interleaved A/B (order flipped each round).

    Two warm-up calls each. Before each sample, untimed: :func:`trim_heap`, and when ``primers`` are given (cold
    samples) :func:`evict_caches` then ``primers[name]()`` (the backend on a small cache of its own); a cold sample
    is one call, a warm one loops enough calls for ~:data:`SAMPLE_S`. The round count is ``repeats``, cut to fit
    ``budget_s`` (the untimed preparations counted) but never below 3. Returns the samples and the round count.
    """
    def prepare(name: str) -> None:
        trim_heap()
        if primers is not None:
            evict_caches()
            primers[name]()

    est: dict[str, float] = {}
    settle: dict[str, float] = {}
    for name, f in calls.items():
        f()
        t = time.perf_counter()
        prepare(name)
        settle[name] = time.perf_counter() - t
        t = time.perf_counter()
        f()
        est[name] = time.perf_counter() - t
    number = {n: 1 if primers is not None else max(1, int(SAMPLE_S / max(e, 1e-7))) for n, e in est.items()}
    per_round = sum(est[n] * number[n] + settle[n] for n in calls)
    rounds = max(3, min(repeats, int(budget_s / max(per_round, 1e-9))))
    samples: dict[str, list[float]] = {n: [] for n in calls}
    names = list(calls)
    gc.collect()
    gc.disable()
    try:
        for r in range(rounds):
            for n in names if r % 2 == 0 else names[::-1]:
                f, k = calls[n], number[n]
                prepare(n)
                t = time.perf_counter()
                for _ in range(k):
                    f()
                samples[n].append((time.perf_counter() - t) / k)
    finally:
        gc.enable()
    return samples, rounds


def run_row(fmt: str, batch: int, depth: int, repeats: int, budget_s: float, bandwidth: float, seed: int,
            cold: bool = True) -> dict:
    """Prepare, time (``cold``: see :func:`time_ab`) and summarize one (format, batch, depth) row; its JSON-able record."""
    gen = torch.Generator().manual_seed(seed)

    def make(b: int, d: int) -> Case:
        if fmt in SEALED:
            # the prefill that fills the cache runs on the timing's own threads: with more, an OpenMP worker left
            # spinning after it took samples from the timed calls (int4 at depth 4,096: 8.6 ms timed, 6.0 without it)
            return sealed_case(fmt, b, d, gen, torch.get_num_threads())
        return token_case(fmt, b, d, gen)

    primer = make(1, 2 * build_spec(fmt).block_size - 1) if cold else None
    case = make(batch, depth)
    try:
        samples, rounds = time_ab(case.calls, repeats, budget_s, primer.calls if primer else None)
    finally:
        case.close()
        if primer:
            primer.close()
    row: dict = {"format": fmt, "batch": batch, "depth": depth, "bytes": case.bytes_read, "rounds": rounds,
                 "load": list(os.getloadavg())}
    for n, s in samples.items():
        med = statistics.median(s)
        row[n] = {"median_us": med * 1e6, "min_us": min(s) * 1e6, "gbps": case.bytes_read / med / 1e9,
                  "of_bandwidth": case.bytes_read / med / 1e9 / bandwidth}
    row["speedup"] = row["reference"]["median_us"] / row["cpu"]["median_us"]
    return row


HEADER = ("| batch | depth | format | KV read (KiB) | ref µs med (min) | cpu µs med (min) | ref GB/s | cpu GB/s "
          "| cpu % of bw | cpu/ref | rounds | load |")


def table_line(r: dict) -> str:
    """One markdown table line of a row record."""
    ref, cpu = r["reference"], r["cpu"]
    return (f"| {r['batch']} | {r['depth']} | {r['format']} | {r['bytes'] / 1024:,.0f} "
            f"| {ref['median_us']:,.0f} ({ref['min_us']:,.0f}) | {cpu['median_us']:,.1f} ({cpu['min_us']:,.1f}) "
            f"| {ref['gbps']:.2f} | {cpu['gbps']:.2f} | {100 * cpu['of_bandwidth']:.0f}% | {r['speedup']:.1f}x "
            f"| {r['rounds']} | {'/'.join(f'{x:.1f}' for x in r['load'])} |")


def _ints(s: str) -> list[int]:
    return [int(x.replace(",", "_")) for x in s.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    """Parse the options, run the matrix, print progress, the markdown table and (``--json``) a record."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=_ints, default=None, help="comma list (default 1,8,32)")
    ap.add_argument("--depth", type=_ints, default=None, help="comma list of cached tokens (default 256,1024,4096)")
    ap.add_argument("--formats", default=None, help=f"comma list (default all: {','.join(FORMATS)})")
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds per row (default 15; cut by --budget)")
    ap.add_argument("--budget", type=float, default=4.0, help="seconds of timed rounds per row before cutting (min 3 rounds)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads while timing (default 1)")
    ap.add_argument("--warm", action="store_true",
                    help="time loops of calls that find the KV where the last call left it (default: each call cold)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="smoke test: batch 1,8, depth 256, float32,int8,int4, 3 rounds")
    ap.add_argument("--json", type=Path, default=None, help="write the header and rows here")
    a = ap.parse_args(argv)
    batches = a.batch or ([1, 8] if a.quick else [1, 8, 32])
    depths = a.depth or ([256] if a.quick else [256, 1024, 4096])
    formats = a.formats.split(",") if a.formats else (["float32", "int8", "int4"] if a.quick else FORMATS)
    repeats = a.repeats or (3 if a.quick else 15)
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        ap.error(f"unknown formats {unknown}; choose from {FORMATS}")
    torch.set_num_threads(a.threads)
    select_backend("cpu", build_spec("float32").layer(0), "cpu")  # compile the kernels before any timing
    bandwidth = memory_bandwidth()
    header = {"torch": torch.__version__, "threads": a.threads, "cpus": os.cpu_count(), "copy_gbps": bandwidth,
              "cache": "warm" if a.warm else "cold", "last_level_cache_bytes": last_level_cache_bytes(),
              "load": list(os.getloadavg()), "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM}}
    print(f"# attention decode layer-step: {HEADS} q heads, {KV_HEADS} kv heads, head_dim {HEAD_DIM}; "
          f"torch {torch.__version__}, {a.threads} thread(s), {os.cpu_count()} cpus")
    print(f"# memory bandwidth (512 MiB copy, read+write): {bandwidth:.2f} GB/s; load {load()}", flush=True)
    print("# " + ("warm: loops of calls, the KV where the last call left it" if a.warm else
                  f"cold: one call per sample, the caches flushed before it (a {_eviction_buffer().nbytes >> 20} MiB "
                  f"buffer rewritten; last-level cache {last_level_cache_bytes() >> 20} MiB), then the code warmed "
                  f"on a small cache") +
          "; heap trimmed before each sample", flush=True)
    rows = []
    for batch in batches:
        for depth in depths:
            for fmt in formats:
                r = run_row(fmt, batch, depth, repeats, a.budget, bandwidth, a.seed, cold=not a.warm)
                rows.append(r)
                print(f"B={batch:<3d} S={depth:<5d} {fmt:19s} ref {r['reference']['median_us']:10,.0f} µs  "
                      f"cpu {r['cpu']['median_us']:9,.1f} µs  x{r['speedup']:5.1f}  cpu {r['cpu']['gbps']:6.2f} GB/s "
                      f"({100 * r['cpu']['of_bandwidth']:3.0f}% of bw)  load {load()}", flush=True)
    print()
    print(HEADER)
    print("|" + "---|" * (HEADER.count("|") - 1))
    for r in rows:
        print(table_line(r))
    if a.json:
        a.json.write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
