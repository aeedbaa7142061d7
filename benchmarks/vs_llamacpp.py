"""llama.cpp's quantized KV caches under kvpage's accuracy protocol: ppl and KL divergence side by side.

Usage (kvpage's python runs this; it starts itself as the llama.cpp worker in llama.cpp's venv)::

    nice .venv/bin/python benchmarks/vs_llamacpp.py [--tokens 1024] [--text /usr/share/common-licenses/GPL-3]
        [--cache-types f16,q8_0,q8_0-norot,q4_0,q4_0-norot,...] [--formats auto,int8,int8_rotated,int4,...]
        [--out benchmarks/vs_llamacpp/results.json] [--skip-kvpage] [--llamacpp-python PATH]

llama.cpp lives in a virtual environment of its own, never in kvpage's dependencies. When
``--llamacpp-python`` (default ``/work/peers/llamacpp/bin/python``) is missing the script creates that
venv and compiles ``llama-cpp-python`` into it (CPU only, ~10 min on 2 cores; ``--no-install`` skips
llama.cpp instead), printing the command it runs (:data:`INSTALL_COMMAND`, as in ``vs_vllm.py``).

Protocol, the same as ``kvpage eval`` in decode mode:

* one text's first ``--tokens`` token ids (kvpage's tokenizer, no BOS), tokenized once here and given to
  both engines; the worker checks that llama.cpp's own tokenizer gives the same ids and vocabulary size;
* one token per forward pass (llama.cpp: one ``Llama.eval([token])`` call per token, ``n_threads=1``,
  flash attention on for every cache type, since llama.cpp needs it for a quantized V cache), tokens
  ``0 .. n-2`` fed; the float32 logits at position ``t`` score token ``t + 1``;
* per-position float32 logits of each llama.cpp cache type go to a ``.npy`` file (written by the worker);
  this process scores them with :mod:`kvpage.eval.divergence`'s functions (float64 ``log_softmax``,
  ``KL(P_base || P_fmt)``, top-1 agreement, paired standard errors), each cache type against llama.cpp's
  own ``f16`` cache; kvpage's formats run through :func:`kvpage.eval.evaluate_formats` (float32 weights,
  each against kvpage's ``auto`` = float32 cache);
* sanity: kvpage's float32-cache run scored against llama.cpp's ``f16`` logits (the same KL math), which
  tells how far the two engines' baselines are apart (not 0: llama.cpp multiplies by the Q4_1 weights
  with 8-bit-quantized activations, kvpage by the dequantized float32 weights; different kernels too).

llama.cpp rotates Q, K and V by a Hadamard matrix before a quantized cache by default (its PR 21038, 2026),
as kvpage's ``_rotated`` formats do; a cache type ending in ``-norot`` runs with that rotation off
(``LLAMA_ATTN_ROT_DISABLE=1``), and the results say whether the build has the switch at all
(``rotation_in_build``: its library names the variable).

Effective bits of a llama.cpp cache type are the GGML block format's bits per value (:data:`GGML_BITS`:
e.g. ``q8_0`` = 34 bytes per 32 values = 8.5); K and V of different types: their mean. kvpage's are what
``evaluate_formats`` reports (everything kept counted).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DEFAULT_LLAMACPP = "/work/peers/llamacpp/bin/python"
DEFAULT_TEXT = "/usr/share/common-licenses/GPL-3"
DEFAULT_OUT = HERE / "vs_llamacpp" / "results.json"
DEFAULT_CACHE_TYPES = ("f16", "q8_0", "q8_0-norot", "q5_1", "q4_0", "q4_0-norot", "q4_1", "iq4_nl", "iq4_nl-norot",
                       "q8_0/q4_0")
DEFAULT_FORMATS = ("auto", "int8", "int8_rotated", "fp8", "int4", "int4_rotated", "int3", "int3_rotated", "int2",
                   "int2_rotated")
#: Suffix of a cache type run with llama.cpp's Hadamard rotation of Q/K/V off (``LLAMA_ATTN_ROT_DISABLE=1``; the
#: rotation of its PR 21038 is on by default for quantized caches in builds that have it).
NO_ROTATION = "-norot"
#: Bits per value of GGML's block formats: block bytes * 8 / values per block.
GGML_BITS = {"f32": 32.0, "f16": 16.0, "bf16": 16.0, "q8_0": 8.5, "q5_0": 5.5, "q5_1": 6.0, "q4_0": 4.5,
             "q4_1": 5.0, "iq4_nl": 4.5}
#: How the llama.cpp venv is made when missing (the flags of ``vs_vllm.py``'s docstring: no GGML_NATIVE,
#: whose AMX int8 path segfaults in llama_decode on these VMs).
CMAKE_ARGS = ("-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_AVX_VNNI=ON -DGGML_BMI2=ON -DGGML_FMA=ON "
              "-DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON "
              "-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DGGML_CUDA=OFF -DGGML_BLAS=OFF")
LLAMACPP_PIN = "llama-cpp-python==0.3.36"
INSTALL_COMMAND = (f"python3 -m venv {{venv}} && {{venv}}/bin/pip install -q --upgrade pip && "
                   f"CMAKE_ARGS=\"{CMAKE_ARGS}\" CMAKE_BUILD_PARALLEL_LEVEL=2 {{venv}}/bin/pip install {LLAMACPP_PIN}")


def cache_kv_types(spec: str) -> tuple[str, str]:
    """``(K type, V type)`` of a cache spec: ``"q4_0"`` -> both ``q4_0``; ``"q8_0/q4_0"`` -> K ``q8_0``, V ``q4_0``.

    A trailing :data:`NO_ROTATION` (``"q4_0-norot"``) names the same types run without llama.cpp's rotation.

    Raises:
        ValueError: a type not in :data:`GGML_BITS`.
    """
    k, _, v = spec.removesuffix(NO_ROTATION).partition("/")
    v = v or k
    for t in (k, v):
        if t not in GGML_BITS:
            raise ValueError(f"unknown llama.cpp cache type {t!r} (known: {', '.join(GGML_BITS)})")
    return k, v


def cache_bits(spec: str) -> float:
    """Effective bits per cached value of a cache spec: the mean of its K and V types' block bits."""
    k, v = cache_kv_types(spec)
    return (GGML_BITS[k] + GGML_BITS[v]) / 2


def set_rotation_env(spec: str, environ: Any) -> None:
    """Set ``LLAMA_ATTN_ROT_DISABLE=1`` in ``environ`` for a :data:`NO_ROTATION` spec, remove it for any other.

    llama.cpp reads the variable when it builds a KV cache (``llama_kv_cache``'s constructor), so the worker
    calls this before each ``Llama``; side effect: ``environ`` (``os.environ`` there) is changed.
    """
    if spec.endswith(NO_ROTATION):
        environ["LLAMA_ATTN_ROT_DISABLE"] = "1"
    else:
        environ.pop("LLAMA_ATTN_ROT_DISABLE", None)


def _file_name(spec: str) -> str:
    return spec.replace("/", "_k_v_") + ".npy"


# ---------------------------------------------------------------- worker (llama.cpp's venv: stdlib + numpy)

def worker_main(job_path: str) -> None:
    """Run every cache type of the job file through llama.cpp; print one JSON summary line on the original stdout.

    The job (JSON) holds ``model`` (GGUF path), ``ids`` (token ids), ``text`` and ``text_tokens`` (for the
    tokenizer check), ``vocab_size``, ``cache_types``, ``threads`` and ``out_dir``. Per cache type the logits
    of positions ``0 .. n-2`` are written as ``out_dir/<type>.npy`` (``[n - 1, vocab]`` float32). A type
    llama.cpp refuses is reported with its error and the others still run. Library output goes to stderr.
    """
    results = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    import numpy as np
    import llama_cpp

    job = json.loads(Path(job_path).read_text())
    ids: list[int] = job["ids"]
    n_ctx = len(ids) + 16
    libs = [p for p in Path(llama_cpp.__file__).parent.rglob("libllama*") if p.is_file()]
    summary: dict[str, Any] = {"version": llama_cpp.__version__, "runs": {},
                               "rotation_in_build": any(b"LLAMA_ATTN_ROT_DISABLE" in p.read_bytes() for p in libs)}
    for spec in job["cache_types"]:
        k, v = cache_kv_types(spec)
        run: dict[str, Any] = {"type_k": k, "type_v": v}
        t0 = time.perf_counter()
        llm = None
        set_rotation_env(spec, os.environ)
        try:
            llm = llama_cpp.Llama(job["model"], n_ctx=n_ctx, n_batch=512, n_threads=job["threads"],
                                  n_threads_batch=job["threads"], n_gpu_layers=0, logits_all=True,
                                  type_k=getattr(llama_cpp, f"GGML_TYPE_{k.upper()}"),
                                  type_v=getattr(llama_cpp, f"GGML_TYPE_{v.upper()}"),
                                  flash_attn=True, seed=0, verbose=False)
            if "tokenizer" not in summary:
                mine = llm.tokenize(Path(job["text"]).read_bytes(), add_bos=False, special=False)[: len(ids)]
                summary["tokenizer"] = {"n_vocab": llm.n_vocab(), "same_ids": mine == ids,
                                        "first_mismatch": next((i for i, (a, b) in enumerate(zip(mine, ids)) if a != b),
                                                               None)}
            if llm.n_vocab() != job["vocab_size"]:
                raise ValueError(f"llama.cpp's vocabulary has {llm.n_vocab()} entries; kvpage's {job['vocab_size']}")
            out = np.lib.format.open_memmap(Path(job["out_dir"]) / _file_name(spec), mode="w+", dtype=np.float32,
                                            shape=(len(ids) - 1, llm.n_vocab()))
            t1 = time.perf_counter()
            for t in range(len(ids) - 1):
                llm.eval([ids[t]])                                   # one token per forward pass
                out[t] = llm.scores[llm.n_tokens - 1]                # [vocab] float32 logits predicting ids[t + 1]
            out.flush()
            del out
            run.update(ok=True, load_s=t1 - t0, decode_s=time.perf_counter() - t1,
                       tok_per_s=(len(ids) - 1) / (time.perf_counter() - t1))
        except Exception as err:  # noqa: BLE001 -- a refused cache type is reported, the others still run
            run.update(ok=False, error=f"{type(err).__name__}: {err}"[:500])
        finally:
            if llm is not None:
                llm.close()
        summary["runs"][spec] = run
        print(f"llama.cpp {spec}: {run}", file=sys.stderr, flush=True)
    results.write(json.dumps(summary) + "\n")
    results.close()


# ---------------------------------------------------------------- orchestrator (kvpage's venv)

def ensure_llamacpp(python: str, install: bool) -> bool:
    """True when ``python`` exists; else, with ``install``, create its venv and pip-install llama-cpp-python there.

    The venv is the folder two levels above ``python`` (``<venv>/bin/python``). Prints the command it runs.
    Returns False (llama.cpp skipped) when missing and not installed or the install failed.
    """
    if Path(python).is_file():
        return True
    venv = Path(python).parent.parent
    cmd = INSTALL_COMMAND.format(venv=venv)
    if not install:
        print(f"NOTE: llama.cpp skipped: no python at {python}; install it with:\n  {cmd}")
        return False
    print(f"llama.cpp not found at {python}; installing (CPU build, ~10 min on 2 cores):\n  {cmd}", flush=True)
    rc = subprocess.call(cmd, shell=True)
    if rc != 0 or not Path(python).is_file():
        print(f"NOTE: llama.cpp skipped: the install failed (exit {rc})")
        return False
    return True


def score_llamacpp(out_dir: Path, specs: list[str], ids: list[int], chunk: int = 64) -> dict[str, dict[str, Any]]:
    """ppl, Δppl and divergence of each cache type's logits file against the ``f16`` one (``specs[0]``).

    Uses :mod:`kvpage.eval.divergence` (the functions ``kvpage eval`` uses): float64 log-softmax of the
    float32 logits, NLL of ``ids[t + 1]`` from row ``t``, per-row KL against the baseline's row, argmax
    agreement, :func:`~kvpage.eval.divergence.summarize_divergence`. Rows are read ``chunk`` at a time.

    Returns:
        ``{spec: {"nll", "ppl", "divergence"}}`` (``divergence`` a dict) for the specs whose file exists.
    """
    import numpy as np
    import torch

    from kvpage.eval.divergence import kl_divergence_rows, log_probs, summarize_divergence

    base = np.load(out_dir / _file_name(specs[0]), mmap_mode="r")                  # [n - 1, vocab] float32
    tgt = torch.as_tensor(ids[1:], dtype=torch.long)                               # [n - 1]
    scored: dict[str, dict[str, Any]] = {}
    base_nll: np.ndarray | None = None
    for spec in specs:
        path = out_dir / _file_name(spec)
        if not path.is_file():
            continue
        arr = np.load(path, mmap_mode="r")
        nll, kld, same = [], [], []
        for a in range(0, arr.shape[0], chunk):
            lp = log_probs(torch.from_numpy(np.array(arr[a : a + chunk])))          # [m, vocab] float64
            lb = log_probs(torch.from_numpy(np.array(base[a : a + chunk])))
            nll.append((-lp.gather(1, tgt[a : a + chunk, None])[:, 0]).numpy())
            kld.append(kl_divergence_rows(lb, lp).numpy())
            same.append((lp.argmax(-1) == lb.argmax(-1)).numpy())
        token_nll = np.concatenate(nll)
        if base_nll is None:
            base_nll = token_nll
        div = summarize_divergence(np.concatenate(kld), np.concatenate(same), token_nll, base_nll)
        mean = float(token_nll.mean())
        scored[spec] = {"nll": mean, "ppl": float(np.exp(mean)), "divergence": div.to_dict()}
    return scored


def sanity_kvpage_vs_llamacpp(loaded: Any, ids: list[int], f16_path: Path, threads: int) -> dict[str, Any]:
    """kvpage's float32-cache run scored against llama.cpp's ``f16`` logits, with ``kvpage eval``'s own code path.

    The llama.cpp rows fill a :class:`~kvpage.eval.divergence.ReferenceLogits`, then
    :func:`~kvpage.eval.evaluate_perplexity` runs kvpage's ``auto`` cache with it as the reference. Position
    alignment is therefore the same as between two kvpage formats (row ``t`` predicts ``ids[t + 1]``).
    """
    import numpy as np
    import torch

    from kvpage import LLM
    from kvpage.eval.divergence import ReferenceLogits, log_probs
    from kvpage.eval.perplexity import evaluate_perplexity

    arr = np.load(f16_path, mmap_mode="r")
    tgt = torch.as_tensor(ids[1:], dtype=torch.long)
    dtype = next(loaded.model.parameters()).dtype
    with ReferenceLogits(loaded.config.vocab_size) as store:
        for a in range(0, arr.shape[0], 64):
            rows = torch.from_numpy(np.array(arr[a : a + 64]))                     # [m, vocab] float32
            lp = log_probs(rows)
            store.append(rows, rows.argmax(-1), -lp.gather(1, tgt[a : a + 64, None])[:, 0])
        llm = LLM(loaded, kv_cache_dtype="auto", num_blocks=-(-len(ids) // 16) + 1, block_size=16, dtype=dtype,
                  num_threads=threads, progress=False, enable_prefix_caching=False)
        res = evaluate_perplexity(llm, ids, progress=False, name="kvpage auto vs llama.cpp f16", reference=store)
    assert res.divergence is not None
    return {"kvpage_ppl": res.ppl, "llamacpp_f16_ppl": float(np.exp(store.nll().mean())),
            "divergence": res.divergence.to_dict()}


def table(rows: list[dict[str, Any]]) -> str:
    """Fixed-width table of the rows (engine, format, bits, ppl, Δppl % ± se, KLD ± se, p99, top-1 %)."""
    head = (f"{'engine':<10} {'format':<14} {'bits':>6} {'ppl':>8} {'Δppl %':>15} {'KLD (nats)':>19} "
            f"{'p99 KLD':>8} {'top-1 %':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        d = r["divergence"]
        lines.append(f"{r['engine']:<10} {r['format']:<14} {r['bits']:>6.2f} {r['ppl']:>8.4f} "
                     f"{r['delta_ppl_percent']:>+7.2f} ± {d['delta_ppl_se_percent']:<5.2f} "
                     f"{d['kld_mean']:>9.5f} ± {d['kld_se']:<7.5f} {d['kld_p99']:>8.4f} {d['top1_percent']:>8.2f}")
    return "\n".join(lines)


def main() -> int:
    """Parse arguments, run llama.cpp's cache types and kvpage's formats, print the table and write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", default=DEFAULT_TEXT, help=f"UTF-8 text file (default {DEFAULT_TEXT})")
    ap.add_argument("--tokens", type=int, default=1024, help="first N tokens of the text (default 1024)")
    ap.add_argument("--cache-types", default=",".join(DEFAULT_CACHE_TYPES),
                    help="llama.cpp cache types, comma-separated; K/V for different types (first: the baseline)")
    ap.add_argument("--formats", default=",".join(DEFAULT_FORMATS), help="kvpage formats (first: the baseline)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"results JSON (default {DEFAULT_OUT})")
    ap.add_argument("--skip-kvpage", action="store_true", help="llama.cpp rows only (and no sanity line)")
    ap.add_argument("--llamacpp-python", default=DEFAULT_LLAMACPP, help=f"default {DEFAULT_LLAMACPP}")
    ap.add_argument("--no-install", action="store_true", help="skip llama.cpp when its venv is missing")
    ap.add_argument("--threads", type=int, default=1, help="threads of each engine (default 1)")
    args = ap.parse_args()
    load_start = os.getloadavg()
    specs = [s.strip() for s in args.cache_types.split(",") if s.strip()]
    formats = [s.strip() for s in args.formats.split(",") if s.strip()]
    for s in specs:
        cache_kv_types(s)
    import torch

    from kvpage.eval import evaluate_formats, text_token_ids
    from kvpage.model.loader import default_model_path, load_model

    torch.set_num_threads(args.threads)
    model_path = default_model_path()
    loaded = load_model(None, dtype=torch.float32, progress=False)
    ids = text_token_ids(loaded.tokenizer, args.text, args.tokens)
    from importlib.metadata import version

    versions: dict[str, str] = {"kvpage": version("kvpage"), "torch": torch.__version__}
    print(f"{args.text}: {len(ids)} tokens (no BOS), model {model_path.name}; loadavg at start {load_start}", flush=True)
    rows: list[dict[str, Any]] = []
    llama_runs: dict[str, Any] = {}
    tokenizer: dict[str, Any] = {}
    sanity: dict[str, Any] | None = None
    rotation_in_build: bool | None = None
    with tempfile.TemporaryDirectory(prefix="kvpage-vs-llamacpp-") as tmp:
        out_dir = Path(tmp)
        if specs and ensure_llamacpp(args.llamacpp_python, not args.no_install):
            job = out_dir / "job.json"
            job.write_text(json.dumps({"model": str(model_path), "ids": ids, "text": args.text,
                                       "vocab_size": loaded.config.vocab_size, "cache_types": specs,
                                       "threads": args.threads, "out_dir": str(out_dir)}))
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
            proc = subprocess.run([args.llamacpp_python, str(Path(__file__).resolve()), "--worker", str(job)],
                                  stdout=subprocess.PIPE, text=True, env=env, check=False)
            if proc.returncode != 0 or not proc.stdout.strip():
                raise RuntimeError(f"the llama.cpp worker failed (exit {proc.returncode})")
            summary = json.loads(proc.stdout.strip().splitlines()[-1])
            versions["llama-cpp-python"] = summary["version"]
            llama_runs, tokenizer = summary["runs"], summary.get("tokenizer", {})
            rotation_in_build = summary.get("rotation_in_build")
            if not tokenizer.get("same_ids", False):
                print(f"WARNING: llama.cpp's tokenizer disagrees with kvpage's on this text: {tokenizer}")
            if not llama_runs.get(specs[0], {}).get("ok"):
                raise RuntimeError(f"llama.cpp's baseline {specs[0]} failed: {llama_runs.get(specs[0])}")
            for spec, sc in score_llamacpp(out_dir, specs, ids).items():
                rows.append({"engine": "llama.cpp", "format": spec, "bits": cache_bits(spec), **sc,
                             "seconds": llama_runs[spec].get("decode_s")})
            for r in rows:
                r["delta_ppl_percent"] = 100.0 * (r["ppl"] / rows[0]["ppl"] - 1.0)
            if not args.skip_kvpage and specs[0] == "f16":
                print("sanity: kvpage auto (float32 cache) against llama.cpp f16 ...", flush=True)
                sanity = sanity_kvpage_vs_llamacpp(loaded, ids, out_dir / _file_name("f16"), args.threads)
        if not args.skip_kvpage and formats:
            print(f"kvpage formats {formats} (decode mode) ...", flush=True)
            res = evaluate_formats(loaded, ids, formats, num_threads=args.threads, progress=False)
            for r in res:
                assert r.divergence is not None
                rows.append({"engine": "kvpage", "format": r.name, "bits": r.bits_per_value, "nll": r.nll,
                             "ppl": r.ppl, "delta_ppl_percent": 100.0 * (r.ppl / res[0].ppl - 1.0),
                             "divergence": r.divergence.to_dict(), "seconds": r.seconds,
                             "kv_cache_dtype": r.kv_cache_dtype})
    rows.sort(key=lambda r: (-r["bits"], r["engine"]))
    load_end = os.getloadavg()
    text = table(rows)
    print("\n" + text)
    if sanity is not None:
        d = sanity["divergence"]
        print(f"\nsanity: kvpage float32 cache vs llama.cpp f16 cache, same ids: KLD {d['kld_mean']:.5f} ± "
              f"{d['kld_se']:.5f} (p99 {d['kld_p99']:.4f}), top-1 {d['top1_percent']:.2f} %, ppl "
              f"{sanity['kvpage_ppl']:.4f} vs {sanity['llamacpp_f16_ppl']:.4f} "
              f"({100 * (sanity['kvpage_ppl'] / sanity['llamacpp_f16_ppl'] - 1):+.2f} %)")
    for spec, run in llama_runs.items():
        if not run.get("ok"):
            print(f"FAILED: llama.cpp {spec}: {run.get('error')}")
    print(f"\nΔppl and KLD against each engine's own baseline (llama.cpp f16, kvpage auto = float32); decode mode, "
          f"one token per step, {args.threads} thread(s); tokenizer check {tokenizer}; llama.cpp build has the "
          f"rotation switch (LLAMA_ATTN_ROT_DISABLE): {rotation_in_build}\n"
          f"versions {versions}; loadavg start {tuple(round(x, 2) for x in load_start)}, "
          f"end {tuple(round(x, 2) for x in load_end)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "text": args.text, "num_tokens": len(ids), "model": str(model_path), "mode": "decode",
        "threads": args.threads, "versions": versions, "loadavg_start": load_start, "loadavg_end": load_end,
        "tokenizer_check": tokenizer, "llamacpp_rotation_in_build": rotation_in_build,
        "llamacpp_runs": llama_runs, "sanity_kvpage_vs_llamacpp_f16": sanity,
        "rows": rows, "table": text, "command": " ".join(sys.argv)}, indent=1))
    print(f"wrote {args.out}")
    return 1 if any(not r.get("ok") for r in llama_runs.values()) else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2])
    else:
        sys.exit(main())
