"""Parallel sampling's block accounting (issue 29 item 3): peak KV blocks and copy-on-write copies of ``n`` completions.

Usage::

    python benchmarks/parallel_sampling_blocks.py [--formats float32,int8,int4] [--ns 2,4,16] [--max-tokens 20]

For prompts of ``block_size - 1``, ``block_size`` and ``block_size + 1`` tokens and each ``n`` and format, one
seeded sampled request (prefix caching off, so the sharing measured is the fork's alone) on the tests' tiny random
Llama (block accounting does not depend on the weights): the peak blocks held by requests (read from the pool at the
end of every scheduling pass, before the step's copy sources are released), the copies the step plans handed the
worker, and the prompt tokens the engine computed, against the target the tests assert
(``tests/test_parallel_sampling.py``: :func:`block_accounting` measures, :func:`block_target` is the target)::

    peak       = prompt blocks + n x generated blocks + (n - 1 when the prompt's last block is partial, else 0)
    copies     = n - 1 when the prompt's last block is partial (the last writer keeps the original), else 0
                 (0 for int4/int2, which recompute instead: see below)
    recomputed = (n - 1) x (P % bs) for int4/int2, else 0

where a completion of ``G`` tokens writes KV for ``P + G - 1`` positions (its last token is sampled, never run), so
its generated blocks are ``ceil((P + G - 1) / bs) - ceil(P / bs)``. Quantize-on-seal formats (``int4``, ``int2``)
keep a partial block's rows in their 16-bit tail: instead of a copy, each other completion recomputes the
``P % bs`` prompt tokens of that block into a block of its own (same blocks; ``recomputed`` counts the tokens).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))

from _tiny import tiny_loaded  # noqa: E402
from test_parallel_sampling import block_accounting, block_target  # noqa: E402

from kvpage import LLM  # noqa: E402
from kvpage.scales import StaticScales  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default="float32,int8,int4")
    p.add_argument("--ns", default="2,4,16")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=20)
    args = p.parse_args()
    bs = args.block_size
    print(f"block {bs}, {args.max_tokens} tokens per completion, temperature 1.0, prefix caching off, tiny random "
          f"Llama")
    print("| format | prompt | n | peak blocks | target peak | copies | target copies | prompt tokens recomputed "
          "| target recomputed | ok |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for fmt in args.formats.split(","):
        loaded = tiny_loaded()
        # static formats: any fixed scales will do, the accounting does not depend on them
        kw = ({"kv_cache_scales": StaticScales({i: 0.05 for i in range(loaded.config.num_layers)},
                                               {i: 0.05 for i in range(loaded.config.num_layers)})}
              if fmt.endswith("_static") else {})
        llm = LLM(loaded, progress=False, num_blocks=600, block_size=bs, enable_prefix_caching=False,
                  kv_cache_dtype=fmt, max_num_seqs=64, **kw)
        for prompt_len in (bs - 1, bs, bs + 1):
            for n in (int(x) for x in args.ns.split(",")):
                got = block_accounting(llm, prompt_len, n, args.max_tokens)
                want = block_target(prompt_len, n, args.max_tokens, bs, fmt)
                ok = all(got[k] == v for k, v in want.items())
                print(f"| {fmt} | {prompt_len} | {n} | {got['peak']} | {want['peak']} | {got['copies']} | "
                      f"{want['copies']} | {got['recomputed']} | {want['recomputed']} | {'yes' if ok else 'NO'} |")


if __name__ == "__main__":
    main()
