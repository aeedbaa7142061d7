"""Soak test of the OpenAI-compatible server (not in CI): mixed good, bad and abandoned requests for N minutes.

Starts the server in this process (uvicorn in a thread, ``ServerThread``) on the
bundled model (or ``--model``), then runs ``--concurrency`` async clients (httpx)
that loop until ``--minutes`` have passed, each picking one request kind at random:

* streamed and non-streamed ``/v1/completions`` and ``/v1/chat/completions``;
* streams the client abandons after a few chunks, and non-streamed requests it
  abandons by timing out (the server must abort both and free their blocks);
* bad requests: wrong types (``"max_tokens": "5"``), ``max_tokens`` beyond the
  context, an unknown model, malformed JSON (each must be a 4xx with an OpenAI-style body).

At the end it prints requests served by kind, outcomes by kind (status code or
exception type), unexpected outcomes (5xx, a bad request not rejected, a 4xx
without an error body), process RSS and load average at start and end, and the
KV blocks in use (from ``/metrics`` and the ``LLM`` itself; must be 0). Exit
status 1 if anything unexpected happened or blocks were left in use.

    nice .venv/bin/python benchmarks/soak.py --minutes 1
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import sys
import time
from typing import Any

import httpx

MODEL = "soak"
PROMPTS = ["The capital of France is", "Write a haiku about autumn:", "List three prime numbers:",
           "A short story about a robot begins:", "def fibonacci(n):"]
CHAT = [[{"role": "user", "content": "Name two planets."}],
        [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2 + 2?"}]]


def rss_mib() -> float:
    """This process's resident set size in MiB (psutil when installed, else ``/proc/self/status``)."""
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**20
    except ImportError:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    return float("nan")


def load_average() -> str:
    """The 1/5/15-minute load averages as ``a b c``."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def metric(text: str, name: str) -> float:
    """The value of an unlabelled sample ``name`` in a Prometheus text exposition."""
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.split()[-1])
    raise KeyError(name)


class Soak:
    """The client side: request kinds, their expected outcomes, and the tallies.

    Args:
        url: the server's base URL.
        max_model_len: the served context (to build an oversized ``max_tokens``).
        max_tokens: output tokens of each good request (kept small: the point is many requests).
        rng: picks kinds and prompts.
    """

    KINDS = ("completion", "completion_stream", "chat", "chat_stream", "abandon_stream", "abandon_wait",
             "bad_type", "bad_oversized", "bad_model", "bad_json")
    WEIGHTS = (3, 3, 2, 2, 1, 1, 1, 1, 1, 1)

    def __init__(self, url: str, max_model_len: int, max_tokens: int, rng: random.Random) -> None:
        self.url = url
        self.max_model_len = max_model_len
        self.max_tokens = max_tokens
        self.rng = rng
        self.served: collections.Counter[str] = collections.Counter()
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.unexpected: list[str] = []
        self.tokens = 0

    def _note(self, kind: str, outcome: str, ok: bool, detail: str = "") -> None:
        self.served[kind] += 1
        self.outcomes[f"{kind}: {outcome}"] += 1
        if not ok and len(self.unexpected) < 50:
            self.unexpected.append(f"{kind}: {outcome} {detail[:200]}")

    def _good_body(self, chat: bool, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model": MODEL, "max_tokens": self.max_tokens, "temperature": self.rng.choice([0, 0.8]),
                                "stream": stream}
        if stream:
            body["stream_options"] = {"include_usage": True}
        if chat:
            body["messages"] = self.rng.choice(CHAT)
        else:
            body["prompt"] = self.rng.choice(PROMPTS)
        return body

    async def one(self, client: httpx.AsyncClient) -> None:
        """Send one request of a random kind and record its outcome."""
        kind = self.rng.choices(self.KINDS, self.WEIGHTS)[0]
        chat = "chat" in kind or (kind.startswith("abandon") and self.rng.random() < 0.5)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        try:
            if kind in ("completion", "chat"):
                r = await client.post(path, json=self._good_body(chat, False))
                ok = r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length")
                if ok:
                    self.tokens += r.json()["usage"]["completion_tokens"]
                self._note(kind, str(r.status_code), ok, r.text)
            elif kind in ("completion_stream", "chat_stream", "abandon_stream"):
                body = self._good_body(chat, True)
                if kind == "abandon_stream":
                    body["max_tokens"] = min(400, self.max_model_len // 2)
                    body["ignore_eos"] = True
                await self._stream(client, kind, path, body, abandon_after=3 if kind == "abandon_stream" else None)
            elif kind == "abandon_wait":
                body = {**self._good_body(chat, False), "max_tokens": min(400, self.max_model_len // 2),
                        "ignore_eos": True}
                try:
                    r = await client.post(path, json=body, timeout=0.3)
                    self._note(kind, f"{r.status_code} (finished before the client gave up)", r.status_code == 200)
                except httpx.TimeoutException:
                    self._note(kind, "client timeout (abandoned)", True)
            else:
                await self._bad(client, kind, path, chat)
        except httpx.HTTPError as e:
            self._note(kind, type(e).__name__, False, str(e))

    async def _stream(self, client: httpx.AsyncClient, kind: str, path: str, body: dict[str, Any],
                      abandon_after: int | None) -> None:
        chunks, done, finish, usage = 0, False, None, None
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                self._note(kind, str(r.status_code), False, r.text)
                return
            async for line in r.aiter_lines():
                if not line:
                    continue
                payload = line.removeprefix("data: ")
                if payload == "[DONE]":
                    done = True
                    continue
                event = json.loads(payload)
                if "error" in event:
                    self._note(kind, "sse error event", False, payload)
                    return
                if event.get("usage"):
                    usage = event["usage"]
                if event["choices"]:
                    chunks += 1
                    finish = event["choices"][0]["finish_reason"] or finish
                if abandon_after is not None and chunks >= abandon_after:
                    break  # leaving the block closes the connection mid-stream
        if abandon_after is not None:
            self._note(kind, "abandoned mid-stream" if not done else "finished before abandoning", True)
            return
        ok = done and finish in ("stop", "length") and usage is not None
        if ok:
            self.tokens += usage["completion_tokens"]
        self._note(kind, "200 stream", ok, f"done={done} finish={finish}")

    async def _bad(self, client: httpx.AsyncClient, kind: str, path: str, chat: bool) -> None:
        body = self._good_body(chat, False)
        content: bytes | None = None
        if kind == "bad_type":
            field, value = self.rng.choice([("max_tokens", "5"), ("max_tokens", True), ("max_tokens", 2.5),
                                            ("stream", "yes"), ("stream", 1), ("temperature", "1"),
                                            ("temperature", True), ("n", 2), ("stop", 5)])
            body[field] = value
            want = 400
        elif kind == "bad_oversized":
            body["max_tokens"] = self.max_model_len
            want = 400
        elif kind == "bad_model":
            body["model"] = "gpt-4"
            want = 404
        else:
            content = json.dumps(body).encode()[:-7]
            want = 400
        if content is not None:
            r = await client.post(path, content=content, headers={"content-type": "application/json"})
        else:
            r = await client.post(path, json=body)
        try:
            err = r.json()["error"]
            has_body = {"message", "type", "param", "code"} <= set(err)
        except (ValueError, KeyError, TypeError):
            has_body = False
        self._note(kind, str(r.status_code), r.status_code == want and has_body, r.text)

    async def worker(self, client: httpx.AsyncClient, deadline: float) -> None:
        """Send requests back to back until ``deadline`` (``time.monotonic()``)."""
        while time.monotonic() < deadline:
            await self.one(client)


async def run_clients(soak: Soak, minutes: float, concurrency: int) -> float:
    """Run ``concurrency`` workers for ``minutes``; returns the seconds it took."""
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency * 2)
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=soak.url, timeout=120, limits=limits) as client:
        await asyncio.gather(*(soak.worker(client, t0 + minutes * 60) for _ in range(concurrency)))
    return time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, serve, soak, report; 0 when nothing unexpected happened and no block is left in use."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: the bundled SmolLM2-135M)")
    p.add_argument("--minutes", type=float, default=10.0, help="how long to run (default 10)")
    p.add_argument("--concurrency", type=int, default=8, help="concurrent clients (default 8)")
    p.add_argument("--max-tokens", type=int, default=24, help="output tokens of each good request (default 24)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--num-threads", type=int, default=1, help="torch threads (default 1: a shared box)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    import torch

    from kvpage import LLM
    from kvpage.server.app import ServerThread, build_app

    torch.set_num_threads(args.num_threads)
    print(f"load average at start: {load_average()}")
    llm = LLM(args.model, max_model_len=args.max_model_len, max_num_seqs=args.concurrency * 2, progress=False,
              num_threads=args.num_threads)
    rss_start = rss_mib()
    print(f"model {llm.model_path.name}, {llm.num_blocks} KV blocks; RSS at start {rss_start:.0f} MiB; "
          f"{args.concurrency} clients for {args.minutes:g} min")
    soak = Soak("", llm.max_model_len, args.max_tokens, random.Random(args.seed))
    with ServerThread(build_app(llm, MODEL)) as srv:
        soak.url = srv.url
        elapsed = asyncio.run(run_clients(soak, args.minutes, args.concurrency))
        deadline = time.monotonic() + 60
        while True:  # aborted requests are freed before the engine's next step; wait for its snapshot
            text = httpx.get(f"{srv.url}/metrics", timeout=30).text
            if metric(text, "kvpage:num_requests_running") == metric(text, "kvpage:num_requests_waiting") == 0:
                break
            if time.monotonic() > deadline:
                soak.unexpected.append("requests still running 60 s after the clients stopped")
                break
            time.sleep(0.1)
        usage_perc = metric(text, "kvpage:kv_cache_usage_perc")
        healthy = httpx.get(f"{srv.url}/health", timeout=30).status_code == 200
    in_use = llm.kv_cache_stats().num_in_use  # the server (and its engine thread) has stopped
    rss_end = rss_mib()

    total = sum(soak.served.values())
    print(f"\n{total} requests in {elapsed:.0f} s ({total / elapsed:.1f}/s), {soak.tokens} output tokens served")
    print("requests by kind:")
    for kind in Soak.KINDS:
        print(f"  {kind:18s} {soak.served[kind]}")
    print("outcomes (status code or exception type):")
    for outcome, n in sorted(soak.outcomes.items()):
        print(f"  {outcome:58s} {n}")
    print(f"unexpected outcomes: {len(soak.unexpected)}")
    for line in soak.unexpected[:20]:
        print(f"  {line}")
    print(f"server healthy at the end: {healthy}")
    print(f"KV blocks in use at the end: {in_use} (metrics kv_cache_usage_perc {usage_perc})")
    print(f"RSS: start {rss_start:.0f} MiB, end {rss_end:.0f} MiB ({rss_end - rss_start:+.0f} MiB)")
    print(f"load average at end: {load_average()}")
    return 0 if not soak.unexpected and in_use == 0 and usage_perc == 0 and healthy else 1


if __name__ == "__main__":
    sys.exit(main())
