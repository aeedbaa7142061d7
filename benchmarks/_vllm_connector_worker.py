"""One vLLM engine for ``benchmarks/vllm_connector.py`` (run by vLLM's python): warm a store, or measure.

``python _vllm_connector_worker.py SPEC.json OUT.json``; SPEC: ``model``, ``threads``, ``connector`` (``null``,
``{"name": "ExampleConnector", "extra": {...}}`` or ``{"name": "KVPageConnector", "extra": {...}}``), ``phase``
(``warm``: every prompt once, one token, so the store holds them; ``measure``: each document's first prompt alone,
timed to its first token, then every prompt in one batch, timed), ``prompts`` (per document, per question: token
ids) and ``max_tokens``. vLLM's own prefix cache is off, so every hit is a store hit (and ExampleConnector, which
keys a whole prompt, does not save a prompt cut short by a device hit, which it then failed to load:
``shape mismatch: value tensor of shape [768, 3, 128] ... [896, 3, 128]``).
"""
from __future__ import annotations

import json
import sys
import time

from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig

if __name__ == "__main__":
    spec = json.loads(open(sys.argv[1]).read())
    kw = {}
    conn = spec["connector"]
    if conn is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector=conn["name"], kv_role="kv_both", kv_connector_extra_config=conn["extra"],
            kv_load_failure_policy="recompute",
            **({"kv_connector_module_path": "kvpage.integrations.vllm"} if conn["name"] == "KVPageConnector" else {}))
    llm = LLM(spec["model"], dtype="bfloat16", enforce_eager=True, max_model_len=4096, seed=0,
              enable_prefix_caching=False, **kw)
    docs = spec["prompts"]
    flat = [{"prompt_token_ids": p} for d in docs for p in d]
    out: dict = {}
    if spec["phase"] == "warm":
        t = time.perf_counter()
        llm.generate(flat, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        out["warm_s"] = time.perf_counter() - t
    else:
        one = SamplingParams(max_tokens=1, temperature=0)
        llm.generate([flat[0]], one, use_tqdm=False)                               # untimed: first-call overheads
        ttft = []
        for d in docs:
            t = time.perf_counter()
            llm.generate([{"prompt_token_ids": d[0]}], one, use_tqdm=False)
            ttft.append(time.perf_counter() - t)
        t = time.perf_counter()
        outs = llm.generate(flat, SamplingParams(max_tokens=spec["max_tokens"], temperature=0, ignore_eos=True),
                            use_tqdm=False)
        wall = time.perf_counter() - t
        out.update(ttft_s=ttft, batch_s=wall, generated=sum(len(o.outputs[0].token_ids) for o in outs),
                   prompt_tokens=sum(len(o.prompt_token_ids) for o in outs),
                   cached_tokens=sum(o.num_cached_tokens or 0 for o in outs),
                   first_tokens=[list(o.outputs[0].token_ids[:8]) for o in outs[:4]])
    del llm
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)
