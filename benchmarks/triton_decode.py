"""Decode attention of the ``triton`` backend on a GPU: µs per layer and GB/s against the device's copy bandwidth.

Usage (on a CUDA machine; nothing is downloaded)::

    python benchmarks/triton_decode.py --out $OUT            # batch 1/32/128 x context 4k/32k x formats
    python benchmarks/triton_decode.py --dry-run --out /tmp/x # CPU, Triton's interpreter, tiny shapes: checks the script

Shape: Llama-3-8B's attention (32 query heads, 8 KV heads, head_dim 128), one layer, block_size 16. Each request
has ``context - 1`` cached tokens and decodes one, so a step writes ``batch`` K/V rows and attends over
``context`` tokens. The pool holds random codes (8-bit formats: codes in ``0..119``, float16 scales in
``[0.01, 0.02]``) or unit-normal bfloat16; block tables are a random permutation of the pool. One step of
``TritonBackend.forward`` (the write launch(es), the attention launch, the merge when it splits) is timed with CUDA
events over enough repeats for ~50 ms, beside ``torch``'s SDPA on dense bfloat16 ``[batch, heads, context, 128]``
(flash attention where torch picks it), which reads the same K/V without a block table.

KV bytes = the whole blocks covering each context (codes and scales); GB/s = bytes / time; copy bandwidth =
``dst.copy_(src)`` of 1 GiB (read + write counted). Writes ``triton_decode.json`` and ``triton_decode.md`` under
``--out`` (default ``.``; ``--dry-run`` without ``--out`` only prints). Not yet run on a GPU: the figures this
prints are the first ones.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are first imported

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kvpage.cache.controller import CacheController  # noqa: E402
from kvpage.ops.attention import AttentionMetadata  # noqa: E402
from kvpage.ops.backends import ReferenceBackend, TritonBackend  # noqa: E402
from kvpage.spec import CacheSpec  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


def _timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """A function timing ``fn()`` in µs per call: CUDA events on a GPU, the wall clock on the CPU."""
    def time_us(fn: Callable[[], object], min_ms: float = 50.0) -> float:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        reps, total = 1, 0.0
        while True:
            if device.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(reps):
                    fn()
                b.record()
                torch.cuda.synchronize()
                total = a.elapsed_time(b)
            else:
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn()
                total = (time.perf_counter() - t0) * 1e3
            if total >= min_ms or reps >= 1 << 12:
                return total * 1e3 / reps
            reps *= 2
    return time_us


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """GB/s of ``dst.copy_(src)`` over ``nbytes`` (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = _timer(device)(lambda: dst.copy_(src))
    return 2 * nbytes / us / 1e3


def run_one(fmt: str, batch: int, context: int, device: torch.device, check: bool) -> dict[str, float | int | str]:
    """Time one decode step of ``fmt`` (and, for ``check``, compare it with the reference backend)."""
    per_req = math.ceil(context / BLOCK_SIZE)
    num_blocks = batch * per_req
    spec = CacheSpec.build(num_layers=1, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE,
                           kv_cache_dtype=fmt)
    layer = spec.layer(0)
    cache = CacheController(spec, device).initialize_kv_cache(num_blocks)[0]
    gen = torch.Generator(device=device).manual_seed(0)
    for name, t in cache.items():
        if t.dtype == torch.uint8:
            t.copy_(torch.randint(0, 120, t.shape, dtype=torch.uint8, device=device, generator=gen))
        elif name.endswith("_scale"):
            t.uniform_(0.01, 0.02, generator=gen)
        else:
            t.normal_(generator=gen)
    perm = torch.randperm(num_blocks, device="cpu").view(batch, per_req).tolist()
    slots = [perm[i][(context - 1) // BLOCK_SIZE] * BLOCK_SIZE + (context - 1) % BLOCK_SIZE for i in range(batch)]
    meta = AttentionMetadata.build(block_tables=perm, seq_lens=[context] * batch, query_lens=[1] * batch,
                                   slot_mapping=slots, block_size=BLOCK_SIZE, device=device)
    q = torch.randn(batch, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(batch, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    backend = TritonBackend()
    step = lambda: backend.forward(q, k, v, cache, layer, meta, layer_index=0)  # noqa: E731
    row: dict[str, float | int | str] = {"format": fmt, "batch": batch, "context": context}
    if check:
        ref = ReferenceBackend().forward(q, k, v, {n: t.clone() for n, t in cache.items()}, layer, meta, layer_index=0)
        row["max_abs_diff_vs_reference"] = (step().float() - ref.float()).abs().max().item()
    row["us"] = _timer(device)(step)
    kv_bytes = sum(t[0].numel() * t.element_size() for t in cache.values()) * batch * per_req
    row["kv_bytes"] = kv_bytes
    row["gb_s"] = kv_bytes / row["us"] / 1e3
    del cache
    return row


def sdpa_row(batch: int, context: int, device: torch.device) -> dict[str, float | int | str]:
    """torch SDPA over dense bfloat16 K/V of the same shape (GQA), one query per request."""
    q = torch.randn(batch, HEADS, 1, HEAD_DIM, device=device, dtype=torch.bfloat16)
    kv = torch.randn(2, batch, KV_HEADS, context, HEAD_DIM, device=device, dtype=torch.bfloat16)
    us = _timer(device)(lambda: F.scaled_dot_product_attention(q, kv[0], kv[1], enable_gqa=True))
    kv_bytes = kv.numel() * kv.element_size()
    return {"format": "sdpa_bf16_dense", "batch": batch, "context": context, "us": us, "kv_bytes": kv_bytes,
            "gb_s": kv_bytes / us / 1e3}


def main(argv: list[str] | None = None) -> int:
    """Run the matrix, print the table, write JSON and Markdown under ``--out`` (none for a dry run without it)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None,
                   help="folder for triton_decode.json/.md (default .; a --dry-run without --out writes no file)")
    p.add_argument("--formats", default="bfloat16,int8,fp8,fp8_per_token_head,int8_rotated")
    p.add_argument("--batches", default="1,32,128")
    p.add_argument("--contexts", default="4096,32768")
    p.add_argument("--dry-run", action="store_true", help="CPU under the interpreter, tiny shapes, checked")
    a = p.parse_args(argv)
    device = torch.device("cpu" if a.dry_run else "cuda")
    batches = [2] if a.dry_run else [int(x) for x in a.batches.split(",")]
    contexts = [40] if a.dry_run else [int(x) for x in a.contexts.split(",")]
    bandwidth = copy_bandwidth(device, (1 << 20) if a.dry_run else (1 << 30))
    rows = []
    for batch in batches:
        for context in contexts:
            rows.append(sdpa_row(batch, context, device))
            for fmt in a.formats.split(","):
                rows.append(run_one(fmt, batch, context, device, check=a.dry_run or batch == 1))
                print(json.dumps(rows[-1]), flush=True)
    for r in rows:
        r["of_copy_bandwidth"] = float(r["gb_s"]) / bandwidth
        bf16 = next(x for x in rows if x["format"] == "bfloat16" and x["batch"] == r["batch"]
                    and x["context"] == r["context"])
        r["speedup_vs_bf16"] = float(bf16["us"]) / float(r["us"])
    out = a.out if a.out is not None or a.dry_run else Path(".")  # a dry run checks the script: no stray files
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "triton_decode.json").write_text(json.dumps(
            {"device": device_name, "copy_gb_s": bandwidth, "rows": rows}, indent=1))
    lines = [f"Decode attention, one layer ({device_name}; copy bandwidth {bandwidth:.0f} GB/s)", "",
             "| format | batch | context | µs | GB/s | of copy bw | vs bf16 |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['format']} | {r['batch']} | {r['context']} | {float(r['us']):.1f} | {float(r['gb_s']):.0f} | "
              f"{float(r['of_copy_bandwidth']):.0%} | {float(r['speedup_vs_bf16']):.2f}x |" for r in rows]
    if out is not None:
        (out / "triton_decode.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if a.dry_run:
        bad = [r for r in rows if "max_abs_diff_vs_reference" in r and float(r["max_abs_diff_vs_reference"]) > 2e-2]
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
