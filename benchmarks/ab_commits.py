"""Decode (or prefill) speed of kvpage at two commits, interleaved A/B in one run (did a change slow the hot path?).

Usage::

    python benchmarks/ab_commits.py --base 8441d79 [--head WORKTREE] [--rounds 3] [--formats float32,int8]
                                    [--batch 1,8] [--tokens 48] [--prompt-tokens 0 | --mix]
                                    [--dtype bfloat16 --weights-dtype dequantized]

``--base`` is checked out into a temporary ``git worktree`` (or, naming a checkout folder, used as it is:
its kernels, built once into its ``.kvpage-extensions``, then serve every run); ``--head`` defaults to this checkout. Each round
runs every (format, batch) once at the base and once at the head, alternating which goes first, each in a fresh
subprocess (``PYTHONPATH`` set to that commit's ``src``) on the bundled SmolLM2 with the same thread count.
Decode tokens/s excludes prefill: ``(output_tokens - 1) / (finish time - first token time)`` per request,
summed over the batch. With ``--prompt-tokens N`` the load is prefill-heavy instead: ``batch`` prompts of ``N``
tokens each (distinct texts: no prefix hits), ``--tokens`` out, and the figure is prompt tokens per second of the
whole run. With ``--mix`` it is the request mix of ``benchmarks/vs_vllm.py``'s batch rows: ``batch`` requests of
64..512-token prompts (distinct texts), ``--tokens`` out each, and the figure is output tokens per second of the
whole run, prefill included (``--batch 32 --tokens 128 --mix`` is that row). The model runs as ``LLM(None)``
does (the GGUF's blocks as shipped) unless ``--dtype`` / ``--weights-dtype`` say otherwise: ``--dtype bfloat16
--weights-dtype dequantized`` is how ``vs_vllm.py`` runs kvpage (bf16 linears). The table gives the median of the
rounds and head / base; the load average is printed before and after (the machines are shared).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
import torch
from kvpage import LLM, SamplingParams
fmt, batch, tokens, threads, plen = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]),
                                     int(sys.argv[5]))
# only what is asked for: an older base commit may not know weights_dtype
model_args = {k: v for k, v in (("dtype", sys.argv[6]), ("weights_dtype", sys.argv[7])) if v != "auto"}
torch.set_num_threads(threads)
llm = LLM(None, progress=False, kv_cache_dtype=fmt, kv_cache_memory_bytes=512 * 2**20, max_num_seqs=batch,
          **model_args)
if plen < 0:  # the mix: prompts of 64..512 tokens (as benchmarks/vs_vllm.py's batch rows), distinct texts
    import random
    words = " ".join(f"word{k} is number {k * 13 % 97}." for k in range(600 * batch))
    base = llm.tokenizer.encode(words)
    lengths = [64 + (512 - 64) * i // max(batch - 1, 1) for i in range(batch)]
    random.Random(0).shuffle(lengths)
    prompts = [{"prompt_token_ids": base[i * 600: i * 600 + n]} for i, n in enumerate(lengths)]
elif plen:  # prefill-heavy: distinct long prompts
    words = " ".join(f"word{k} is number {k * 13 % 97}." for k in range(plen))
    base = llm.tokenizer.encode(words)
    prompts = [{"prompt_token_ids": base[i * 7: i * 7 + plen]} for i in range(batch)]
else:
    prompts = [llm.chat_prompt(f"Question {i}: tell me about the number {i * 7}.") for i in range(batch)]
params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
llm.generate([llm.chat_prompt("warm up")], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
first, done = {}, {}
t0 = time.perf_counter()
for out in llm.generate_stream(prompts, params):
    now = time.perf_counter()
    first.setdefault(out.request_id, now)
    if out.finished:
        done[out.request_id] = (now, len(out.outputs[0].token_ids))
if plen < 0:
    rate = sum(n for _, n in done.values()) / (time.perf_counter() - t0)
elif plen:
    rate = sum(len(p["prompt_token_ids"]) for p in prompts) / (time.perf_counter() - t0)
else:
    rate = sum((n - 1) / (t - first[r]) for r, (t, n) in done.items() if t > first[r])
print(json.dumps({"tokens_per_s": rate}))
"""


def run(src: Path, fmt: str, batch: int, tokens: int, threads: int, prompt_tokens: int = 0, dtype: str = "auto",
        weights_dtype: str = "auto") -> float:
    # each checkout compiles its CPU kernels into its own folder (ninja records source paths: a shared folder
    # would be rebuilt at every alternation)
    env = {**os.environ, "PYTHONPATH": str(src), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "KVPAGE_EXTENSIONS_DIR": str(src.parent / ".kvpage-extensions")}
    out = subprocess.run([sys.executable, "-c", CHILD, fmt, str(batch), str(tokens), str(threads), str(prompt_tokens),
                          dtype, weights_dtype], env=env, capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["tokens_per_s"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="git revision to compare against, or a checkout folder of it")
    p.add_argument("--head", type=Path, default=ROOT, help="checkout of the new code (default: this one)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--formats", default="float32,int8")
    p.add_argument("--batch", default="1,8")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompt-tokens", type=int, default=0,
                   help="prefill-heavy load: prompts of this many tokens; report prompt tokens/s (default 0: decode)")
    p.add_argument("--mix", action="store_true",
                   help="the request mix: batch requests of 64..512-token prompts, --tokens out each; report "
                        "output tokens/s of the whole run (prefill included)")
    p.add_argument("--dtype", default="auto",
                   help="the model's compute dtype (LLM's dtype; bfloat16 with --weights-dtype dequantized is what "
                        "vs_vllm.py runs kvpage with: the bf16 linears)")
    p.add_argument("--weights-dtype", default="auto", help="LLM's weights_dtype (auto: the GGUF's blocks as shipped)")
    args = p.parse_args()
    if args.mix and args.prompt_tokens:
        p.error("--mix and --prompt-tokens are two workloads: give one")
    if args.mix:
        args.prompt_tokens = -1
    cases = [(f, int(b)) for f in args.formats.split(",") for b in args.batch.split(",")]
    print(f"load average before: {os.getloadavg()}")
    given = Path(args.base)
    with tempfile.TemporaryDirectory() as tmp:
        base = given if (given / "src" / "kvpage").is_dir() else Path(tmp) / "base"
        if base != given:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(base), args.base],
                           check=True)
        try:
            res: dict[tuple[str, int, str], list[float]] = {}
            for r in range(args.rounds):
                for fmt, batch in cases:
                    order = [("base", base / "src"), ("head", args.head / "src")]
                    for name, src in (order if r % 2 == 0 else order[::-1]):
                        res.setdefault((fmt, batch, name), []).append(
                            run(src, fmt, batch, args.tokens, args.threads, args.prompt_tokens, args.dtype,
                                args.weights_dtype))
        finally:
            if base != given:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=True)
    print(f"load average after: {os.getloadavg()}")
    what = ("mix (output tokens/s of the whole run, prompts 64-512 tokens)" if args.mix
            else f"prefill (prompt tokens/s of the run, {args.prompt_tokens}-token prompts)" if args.prompt_tokens
            else "decode tokens/s")
    print(f"\nkvpage {what}, median of {args.rounds} interleaved rounds, {args.threads} thread(s), "
          f"{args.tokens} tokens per request, dtype {args.dtype}, weights {args.weights_dtype}; base {args.base}, "
          f"head {args.head}")
    print("| format | batch | base | head | head / base |")
    print("|---|---:|---:|---:|---:|")
    for fmt, batch in cases:
        b, h = (statistics.median(res[(fmt, batch, n)]) for n in ("base", "head"))
        print(f"| {fmt} | {batch} | {b:.1f} | {h:.1f} | {h / b:.3f} |")


if __name__ == "__main__":
    main()
