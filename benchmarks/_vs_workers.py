"""Engine workers for ``vs_vllm.py``: each runs in its engine's own python (kvpage's, vLLM's or llama.cpp's venv).

``python benchmarks/_vs_workers.py ENGINE MODEL [THREADS]`` (ENGINE: ``kvpage``, ``vllm`` (``enforce_eager=True``),
``vllm_compile`` (vLLM's default CPU mode: torch.compile with Inductor) or ``llamacpp``; THREADS: CPU threads, 1
when left out) loads the model once, then serves JSON-line commands on
stdin (``{"op": "prepare", "kv", "prompts"}``: engine for that KV format and an untimed warm-up, which for
``vllm_compile`` runs every prompt so the compiled graphs exist before the timed calls;
``{"op": "run", "prompts", "max_tokens", "ttft"}``: the timed calls; ``{"op": "quit"}``) and answers each on
the original stdout; everything the libraries print goes to stderr. Only the standard library is imported
at module level, so this file loads in any of the venvs (and vLLM's spawned processes can re-import it).
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

#: KV memory per engine: vLLM's VLLM_CPU_KVCACHE_SPACE=1 (GiB), the same for kvpage.
KV_BYTES = 1 << 30

class KvpageWorker:
    """kvpage's ``LLM`` in bf16, ``threads`` torch threads; one engine per KV format, weights loaded once.

    ``weights="dequantized"`` (engine ``kvpage``): the GGUF dequantized and cast to bf16, the very tensors vLLM is
    given (the same-weights comparison). ``"as_shipped"`` (engine ``kvpage_gguf``): the file's Q4_1 projections and
    Q8_0 LM head run as shipped, as llama.cpp runs them (the comparison with llama.cpp on the same file)."""

    def __init__(self, model: str, threads: int = 1, weights: str = "dequantized") -> None:
        import torch

        from kvpage.model.loader import load_model

        self.threads = threads
        torch.set_num_threads(threads)
        self.loaded = load_model(model or None, dtype=torch.bfloat16, progress=False, weights_dtype=weights)
        self.kv: str | None = None
        self.llm: Any = None
        from importlib.metadata import version

        self.version = version("kvpage")

    def setup(self, kv: str) -> None:
        """Build the engine for KV format ``kv``, dropping the previous one."""
        from kvpage import LLM

        self.llm = None
        self.llm = LLM(self.loaded, kv_cache_dtype=kv, dtype="bfloat16", num_threads=self.threads, progress=False,
                       enable_prefix_caching=False, kv_cache_memory_bytes=KV_BYTES, max_num_seqs=64)
        self.kv = kv

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Greedy, EOS ignored; returns the generated token ids per prompt."""
        from kvpage import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return [list(o.outputs[0].token_ids) for o in outs]

    def info(self) -> dict[str, Any]:
        """The current engine's cache facts."""
        cfg = self.llm.engine_config
        return {"cache_tokens": self.llm.max_cache_tokens, "kv_bytes_per_token": self.llm.kv_bytes_per_token,
                "block_size": self.llm.spec.block_size, "max_num_batched_tokens": cfg.max_num_batched_tokens,
                "max_num_seqs": cfg.max_num_seqs}


class VllmWorker:
    """vLLM's offline ``LLM`` (CPU backend) on the exported bf16 folder; re-created when the KV format changes.

    ``eager=True`` sets ``enforce_eager`` (no compilation); ``False`` is vLLM's default CPU mode (torch.compile,
    Inductor), whose compilation happens in ``setup`` and the warm-up, untimed. Threads come from the
    ``VLLM_CPU_OMP_THREADS_BIND`` the orchestrator sets (``threads`` is recorded only).
    """

    def __init__(self, model: str, threads: int = 1, eager: bool = True) -> None:
        import vllm

        self.model, self.kv, self.llm = model, None, None
        self.threads, self.eager = threads, eager
        self.version = vllm.__version__

    def setup(self, kv: str) -> None:
        """Start an engine with ``kv_cache_dtype=kv``, shutting the previous one down first."""
        import gc

        from vllm import LLM

        if self.llm is not None:
            core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
            self.llm = None
            gc.collect()
        self.llm = LLM(self.model, dtype="bfloat16", enforce_eager=self.eager, max_model_len=2048, kv_cache_dtype=kv,
                       enable_prefix_caching=False, seed=0)
        self.kv = kv

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Greedy, ``ignore_eos=True``; returns the generated token ids per prompt."""
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def info(self) -> dict[str, Any]:
        """The current engine's cache and scheduler facts (its defaults, as the benchmark leaves them)."""
        cfg = self.llm.llm_engine.vllm_config
        cache, sched = cfg.cache_config, cfg.scheduler_config
        return {"cache_tokens": (cache.num_gpu_blocks or 0) * cache.block_size, "block_size": cache.block_size,
                "max_num_batched_tokens": sched.max_num_batched_tokens, "max_num_seqs": sched.max_num_seqs}


class LlamacppWorker:
    """llama-cpp-python on the bundled Q4_1 GGUF, ``threads`` threads (decode and batch), flash attention on
    (quantized V needs it)."""

    def __init__(self, model: str, threads: int = 1) -> None:
        import llama_cpp

        self.lc, self.model, self.kv, self.llm = llama_cpp, model, None, None
        self.threads = threads
        self.version = llama_cpp.__version__

    def setup(self, kv: str) -> None:
        """Load a context whose K and V caches are ``kv`` (``f16`` or ``q8_0``)."""
        ggml = {"f16": self.lc.GGML_TYPE_F16, "q8_0": self.lc.GGML_TYPE_Q8_0}[kv]
        if self.llm is not None:
            self.llm.close()
        self.llm = self.lc.Llama(self.model, n_ctx=2048, n_batch=512, n_threads=self.threads, n_threads_batch=self.threads, n_gpu_layers=0,
                                 type_k=ggml, type_v=ggml, flash_attn=True, seed=0, verbose=False)
        self.kv = kv

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Batch 1 only: greedy tokens from ``Llama.generate`` (which never stops at EOS), ``max_tokens`` of them."""
        outs = []
        for p in prompts:
            self.llm.reset()  # no prefix reuse between calls
            ids: list[int] = []
            for tok in self.llm.generate(p, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
                ids.append(int(tok))
                if len(ids) >= max_tokens:
                    break
            outs.append(ids)
        return outs

    def info(self) -> dict[str, Any]:
        """The context's size."""
        return {"n_ctx": self.llm.n_ctx(), "cache_type": self.kv}


def make_worker(engine: str, model: str, threads: int) -> Any:
    """The worker object of ``engine`` (see the module docstring) on ``model`` with ``threads`` threads.

    Raises:
        KeyError: an unknown engine name.
    """
    if engine in ("kvpage", "kvpage_gguf"):
        return KvpageWorker(model, threads, weights="dequantized" if engine == "kvpage" else "as_shipped")
    if engine in ("vllm", "vllm_compile"):
        return VllmWorker(model, threads, eager=engine == "vllm")
    if engine == "llamacpp":
        return LlamacppWorker(model, threads)
    raise KeyError(f"unknown engine {engine!r}")


def worker_main(engine: str, model: str, threads: int = 1) -> None:
    """Serve JSON-line commands on stdin, answer on the original stdout (all library output goes to stderr)."""
    results = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def send(obj: dict[str, Any]) -> None:
        results.write(json.dumps(obj) + "\n")

    t = time.perf_counter()
    worker = make_worker(engine, model, threads)
    send({"ready": True, "version": worker.version, "load_s": time.perf_counter() - t})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        out: dict[str, Any] = {"ok": True}
        try:
            if cmd["op"] == "prepare":  # engine for this KV format + warm-up; untimed
                t = time.perf_counter()
                if cmd["kv"] != worker.kv:
                    worker.kv = None  # until setup succeeds
                    worker.setup(cmd["kv"])
                worker.generate([cmd["prompts"][0][:32]], 4)
                if engine == "vllm_compile":  # compile for the row's shapes (prefill chunks, its decode batch)
                    worker.generate(cmd["prompts"], 2)
                out["setup_s"] = time.perf_counter() - t
                try:
                    out["engine_info"] = worker.info()
                except Exception as err:  # noqa: BLE001 -- facts are optional
                    out["engine_info"] = {"error": repr(err)}
            else:  # "run": the timed calls
                if cmd["ttft"]:
                    t = time.perf_counter()
                    worker.generate(cmd["prompts"], 1)
                    out["t1_s"] = time.perf_counter() - t
                t = time.perf_counter()
                ids = worker.generate(cmd["prompts"], cmd["max_tokens"])
                out.update(wall_s=time.perf_counter() - t, tokens=sum(map(len, ids)), min_tokens=min(map(len, ids)),
                           sample_ids=ids[0][:24])
        except Exception as err:  # noqa: BLE001 -- a broken cell is reported, the run goes on
            out = {"ok": False, "error": f"{type(err).__name__}: {err}"[:500]}
        send(out)
    results.close()


if __name__ == "__main__":
    worker_main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "", int(sys.argv[3]) if len(sys.argv) > 3 else 1)
