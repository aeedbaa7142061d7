"""Load test of ``kvpage serve``: streaming completions at several concurrencies against a live server on loopback.

Usage::

    python benchmarks/serve.py [--concurrency 1 8 32] [--output-tokens 64] [--prompt-sentences 8]
                               [--requests-per-client 3] [--dtype bfloat16] [--kv-cache-dtype auto] [--threads 1]
    python benchmarks/serve.py --url http://127.0.0.1:8000 [--model-name NAME]   # an already running server

Without ``--url`` it starts ``python -m kvpage.cli serve`` on a free loopback
port (the bundled model unless ``--model``), waits for ``/health`` and stops it
at the end. Each concurrency level runs that many closed-loop clients; each
client sends ``--requests-per-client`` streaming ``/v1/completions`` requests
one after another (distinct deterministic prompts, greedy, EOS ignored, so
every request yields exactly ``--output-tokens`` tokens). Reported per level:
requests/s and output tokens/s over the level's wall time, time to first
token (first non-empty text chunk) and inter-token latency (gaps between
later chunks) at p50 and p99, measured by the client.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(__file__))

import httpx  # noqa: E402
from _text import sentences  # noqa: E402


@dataclass
class RequestResult:
    """What the client saw of one streamed request."""

    ttft_s: float
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0


@dataclass
class LevelResult:
    """One concurrency level."""

    concurrency: int
    requests: int
    wall_s: float
    output_tokens: int
    ttft_s: list[float]
    itl_s: list[float]

    @property
    def requests_per_s(self) -> float:
        """Completed requests per second of wall time."""
        return self.requests / self.wall_s

    @property
    def output_tokens_per_s(self) -> float:
        """Output tokens per second of wall time (all clients together)."""
        return self.output_tokens / self.wall_s


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100), linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def stream_one(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> RequestResult:
    """Send one streaming completion and time its chunks."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first: float | None = None
    last = t0
    result = RequestResult(ttft_s=float("nan"))
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']['message']}")
            if chunk.get("usage"):
                result.output_tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                now = time.perf_counter()
                if first is None:
                    first = now
                    result.ttft_s = now - t0
                else:
                    result.itl_s.append(now - last)
                last = now
    return result


async def run_level(url: str, model: str, concurrency: int, per_client: int, output_tokens: int,
                    prompt_sentences: int, seed0: int) -> LevelResult:
    """``concurrency`` closed-loop clients, ``per_client`` requests each."""
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    results: list[RequestResult] = []
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def worker(w: int) -> None:
            for k in range(per_client):
                prompt = sentences(prompt_sentences, seed=seed0 + w * per_client + k)
                results.append(await stream_one(client, model, prompt, output_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        wall = time.perf_counter() - t0
    return LevelResult(concurrency, len(results), wall, sum(r.output_tokens for r in results),
                       [r.ttft_s for r in results], [x for r in results for x in r.itl_s])


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """Start ``kvpage serve`` in a subprocess and wait for ``/health``."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvpage.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--dtype", args.dtype, "--kv-cache-dtype", args.kv_cache_dtype, "--threads", str(args.threads),
           "--max-num-seqs", str(max(args.concurrency)), "--served-model-name", args.model_name,
           "--log-level", "warning"]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} during startup")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            proc.terminate()
            raise RuntimeError("the server did not become healthy within 300 s")
        time.sleep(0.5)


def main() -> int:
    """Run the levels and print the table; exit 1 if tokens/s at the top level is under 4x the lowest."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default=None, help="an already running server (default: start one)")
    ap.add_argument("--model-name", default="kvpage-bench", help="served model name (sent as `model`)")
    ap.add_argument("--model", default=None, help="model path for the started server (default: bundled)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests-per-client", type=int, default=3)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--prompt-sentences", type=int, default=8, help="prompt length in sentences (~12 tokens each)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--threads", type=int, default=1,
                    help="server torch threads (default 1: the client shares these CPUs)")
    args = ap.parse_args()

    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args)
    try:
        model = args.model_name
        if args.url is not None:
            model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        asyncio.run(run_level(url, model, 2, 1, 8, args.prompt_sentences, seed0=10_000))  # warm-up
        levels = []
        for i, c in enumerate(args.concurrency):
            levels.append(asyncio.run(run_level(url, model, c, args.requests_per_client, args.output_tokens,
                                                args.prompt_sentences, seed0=1000 * (i + 1))))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)

    print(f"kvpage serve load test: {url}, {args.output_tokens} output tokens/request, "
          f"prompts of {args.prompt_sentences} sentences, dtype {args.dtype}, kv {args.kv_cache_dtype}, "
          f"{args.threads} torch threads")
    print(f"{'concurrency':>11} {'requests':>8} {'wall s':>7} {'req/s':>6} {'out tok/s':>9} "
          f"{'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}")
    for lv in levels:
        print(f"{lv.concurrency:>11} {lv.requests:>8} {lv.wall_s:>7.1f} {lv.requests_per_s:>6.2f} "
              f"{lv.output_tokens_per_s:>9.1f} {percentile(lv.ttft_s, 50) * 1e3:>7.0f}ms "
              f"{percentile(lv.ttft_s, 99) * 1e3:>7.0f}ms {percentile(lv.itl_s, 50) * 1e3:>6.1f}ms "
              f"{percentile(lv.itl_s, 99) * 1e3:>6.1f}ms")
    lo, hi = levels[0], levels[-1]
    ratio = hi.output_tokens_per_s / lo.output_tokens_per_s
    ok = ratio >= 4
    print(f"output tokens/s at concurrency {hi.concurrency} = {ratio:.2f}x concurrency {lo.concurrency} "
          f"({'>= 4x: OK' if ok else '< 4x: FAIL'})")
    expected = args.output_tokens
    bad = [lv.concurrency for lv in levels if lv.output_tokens != lv.requests * expected]
    if bad:
        print(f"warning: some requests at concurrency {bad} returned fewer than {expected} tokens")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
