"""vLLM CPU with kvpage's KV connector against no connector and vLLM's own ExampleConnector (issue 33).

Workload: ``--docs`` documents of ``--doc-tokens`` tokens (deterministic text, ``_text.py``), each asked
``--questions`` short questions (prompt = document + question). Rows: vLLM with no connector, with its
``ExampleConnector`` (disk, bf16 safetensors per layer and prompt) and with ``KVPageConnector`` storing ``auto``,
``int8`` and ``int4`` records on disk (``--rows ...,kvpage-int4-first4``: ``int4`` with the first block in 4
bits too). Each connector row first runs a *warm* engine (every prompt once, one
token: the store fills), then a fresh *measure* engine with vLLM's own prefix cache off, so every hit is a store
hit: TTFT of each document's first question alone (median, min-max), then every prompt in one batch
(``--max-tokens`` greedy tokens each; tokens/s = generated tokens / wall seconds, prefill included). Also: bytes
the warm engine wrote to the store per prompt token it saw, and the hit rate (vLLM's ``num_cached_tokens`` /
prompt tokens) of the batch. One run; the measure engines run one after another in row order (interleaved with
nothing else), each a fresh process on ``--threads`` threads, and the load average is printed before each.

LMCache is not a row: ``pip install --dry-run lmcache`` (0.5.6) in vLLM's CPU environment keeps torch but would add
CUDA packages (``cupy-cuda13x``, ``cuda-python``, ``cufile-python``) and downgrade numpy 2.3.5 -> 2.2.6 under vLLM;
its transfer kernels are CUDA ones, so it was not installed into the environment the other rows share.

Run with kvpage's ``.venv`` python (it exports the bundled model for vLLM, as ``vs_vllm.py`` does)::

    .venv/bin/python benchmarks/vllm_connector.py --docs 16 --questions 4
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

ROWS = ("none", "example", "kvpage-auto", "kvpage-int8", "kvpage-int4")


def connector(row: str, store: Path) -> dict[str, Any] | None:
    """The ``connector`` spec of a row (``None``: no connector)."""
    if row == "none":
        return None
    if row == "example":
        return {"name": "ExampleConnector", "extra": {"shared_storage_path": str(store)}}
    parts = row.split("-")                                        # kvpage-<format>[-first4]
    extra = {"kv_store": str(store), "kv_cache_dtype": parts[1]}
    if parts[2:] == ["first4"]:
        extra["int4_first_block"] = "int4"
    return {"name": "KVPageConnector", "extra": extra}


def run_worker(python: str, spec: dict[str, Any], work: Path, name: str, threads: int) -> dict[str, Any]:
    """One engine process; raises RuntimeError with its log's tail when it fails."""
    spec_path, out_path, log = work / f"{name}.json", work / f"{name}.out.json", work / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2",
           "VLLM_CPU_OMP_THREADS_BIND": "0" if threads == 1 else f"0-{threads - 1}"}
    with log.open("w") as f:
        rc = subprocess.run([python, str(HERE / "_vllm_connector_worker.py"), str(spec_path), str(out_path)],
                            stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(work)).returncode
    if rc != 0 or not out_path.is_file():
        raise RuntimeError(f"{name} failed (exit {rc}); log {log}:\n{log.read_text(errors='replace')[-3000:]}")
    return json.loads(out_path.read_text())


def dir_bytes(path: Path) -> int:
    """Bytes of every file under ``path`` (0 when missing)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", default="/work/peers/vllm/bin/python")
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--doc-tokens", type=int, default=1000)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--work-dir", default=str(HERE / ".vllm-connector"))
    args = ap.parse_args()

    from transformers import AutoTokenizer
    from vs_vllm import build_peer, export_hf_folder, VLLM_RECIPE
    from _text import token_prompt

    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    if not build_peer("vllm", args.vllm_python, VLLM_RECIPE, work):
        sys.exit("no vLLM environment")
    model = export_hf_folder(work / "model")["path"]
    tok = AutoTokenizer.from_pretrained(model)
    docs = []
    for d in range(args.docs):
        doc = token_prompt(tok, args.doc_tokens, seed=100 + d)
        docs.append([doc + tok.encode(f"\n\nQuestion {q + 1}: what is sentence {3 * q + 1} about? Answer:")
                     for q in range(args.questions)])
    prompt_tokens = sum(len(p) for d in docs for p in d)
    rows = args.rows.split(",")
    results: dict[str, dict[str, Any]] = {}
    base = {"model": model, "threads": args.threads, "prompts": docs, "max_tokens": args.max_tokens}
    for row in rows:                                   # warm every store first
        store = work / f"store-{row}"
        shutil.rmtree(store, ignore_errors=True)
        if row != "none":
            w = run_worker(args.vllm_python, {**base, "connector": connector(row, store), "phase": "warm"}, work,
                           f"warm-{row}", args.threads)
            results[row] = {"store_bytes": dir_bytes(store), "warm_s": w["warm_s"]}
    for row in rows:
        load = os.getloadavg()[0]
        print(f"measuring {row} (load average {load:.2f}) ...", flush=True)
        m = run_worker(args.vllm_python, {**base, "connector": connector(row, work / f"store-{row}"),
                                          "phase": "measure"}, work, f"measure-{row}", args.threads)
        results.setdefault(row, {}).update(m, load=load)
    auto_bytes = results.get("kvpage-auto", {}).get("store_bytes")
    print(f"\n{args.docs} documents x {args.doc_tokens} tokens, {args.questions} questions each "
          f"({prompt_tokens} prompt tokens), {args.max_tokens} tokens per answer, {args.threads} thread(s)\n")
    print("| row | TTFT, first question (median, min-max) | batch tokens/s | store bytes / prompt token | x auto "
          "| hit rate | load |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        r = results[row]
        t = r["ttft_s"]
        sb = r.get("store_bytes")
        print(f"| {row} | {statistics.median(t):.3f} s ({min(t):.3f}-{max(t):.3f}) | {r['generated'] / r['batch_s']:.1f} "
              f"| {'' if sb is None else f'{sb / prompt_tokens:,.0f}'} "
              f"| {'' if sb is None or not auto_bytes else f'{sb / auto_bytes:.2f}'} "
              f"| {r['cached_tokens'] / r['prompt_tokens']:.1%} | {r['load']:.2f} |")
    (work / "results.json").write_text(json.dumps({"args": vars(args), "time": time.time(), "results": results}))


if __name__ == "__main__":
    main()
