"""Decode tokens/s of two or more KV formats at this checkout, interleaved (is a format slower than its base?).

Usage::

    python benchmarks/ab_formats.py --formats int4,int4_rotated [--batch 8] [--tokens 64] [--rounds 5] [--threads 1]

Each round runs every format once, each in a fresh subprocess (``benchmarks/ab_commits.py``'s child: the bundled
SmolLM2, ``PYTHONPATH`` this checkout's ``src``, the kernels' shared build), alternating the order between rounds
so drift on a shared machine falls on both. Decode tokens/s excludes prefill (as ``ab_commits.py``). Prints each
run with the 1-minute load average, then the median per format and each format's median over the first's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from ab_commits import CHILD  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", required=True, help="comma-separated kv_cache_dtype names; the first is the base")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    fmts = args.formats.split(",")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": str(args.threads)}
    print("load average before:", os.getloadavg(), flush=True)
    res: dict[str, list[float]] = {f: [] for f in fmts}
    for r in range(args.rounds):
        for f in (fmts if r % 2 == 0 else fmts[::-1]):
            out = subprocess.run([sys.executable, "-c", CHILD, f, str(args.batch), str(args.tokens),
                                  str(args.threads), "0"], env=env, capture_output=True, text=True, check=True)
            v = float(json.loads(out.stdout.strip().splitlines()[-1])["tokens_per_s"])
            res[f].append(v)
            print(r, f, f"{v:.1f}", "load %.2f" % os.getloadavg()[0], flush=True)
    print("load average after:", os.getloadavg())
    base = statistics.median(res[fmts[0]])
    for f in fmts:
        m = statistics.median(res[f])
        print(f"{f:14s} median {m:7.1f} tok/s  {m / base:.3f}x {fmts[0]}  runs {[round(x, 1) for x in res[f]]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
