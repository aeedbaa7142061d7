"""One vLLM engine in its own process, for ``tests_vllm``: greedy answers and teacher-forced next-token logprobs.

Run by the peer environment's python as ``python _engine.py SPEC.json OUT.json``. SPEC holds ``model``, ``prompts``
(token ids), ``max_tokens``, ``connector`` (``kv_connector_extra_config``, or null for none), ``block_size`` and
optionally ``prime`` (answer each prompt twice: first with the prompt computed or loaded, reported as
``prime_answers`` / ``prime_cached_tokens``, then with its blocks in vLLM's own prefix cache), ``forced`` (per
prompt, a continuation whose first ``forced_positions`` positions are scored; ``"self"``: the greedy answers) and
``logprobs_out`` (a ``.pt`` file for the ``[prompts, positions, vocab]`` float32 log-probabilities). OUT gets, per
prompt, the greedy token ids and vLLM's ``num_cached_tokens``. The engine is built inside ``__main__`` (vLLM spawns
its engine-core and worker processes) and shut down before the process exits, so its saves are flushed.
"""
from __future__ import annotations

import json
import sys

import torch
from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig

if __name__ == "__main__":
    spec = json.loads(open(sys.argv[1]).read())
    kw = {}
    if spec.get("connector") is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVPageConnector", kv_connector_module_path="kvpage.integrations.vllm", kv_role="kv_both",
            kv_load_failure_policy="recompute", kv_connector_extra_config=spec["connector"])
    llm = LLM(spec["model"], dtype="bfloat16", enforce_eager=True, max_model_len=2048, block_size=spec["block_size"],
              max_logprobs=-1, seed=0, **kw)
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    greedy = SamplingParams(max_tokens=spec["max_tokens"], temperature=0, ignore_eos=True)
    result = {}
    if spec.get("prime"):
        # first pass: the whole prompt prefilled (or loaded); the second pass below then finds the prompt's full
        # blocks in vLLM's own prefix cache, so its arithmetic is that of any prefix hit, a store hit included
        outs = llm.generate(prompts, greedy)
        result["prime_answers"] = [list(o.outputs[0].token_ids) for o in outs]
        result["prime_cached_tokens"] = [o.num_cached_tokens for o in outs]
    outs = llm.generate(prompts, greedy)
    result.update(answers=[list(o.outputs[0].token_ids) for o in outs],
                  num_cached_tokens=[o.num_cached_tokens for o in outs])
    if spec.get("forced"):
        # next-token distributions at positions len(prompt) + j of prompt + forced[:j] (teacher forcing)
        n = spec["forced_positions"]
        forced = result["answers"] if spec["forced"] == "self" else spec["forced"]
        reqs = [{"prompt_token_ids": p + f[:j]} for p, f in zip(spec["prompts"], forced) for j in range(n)]
        outs = llm.generate(reqs, SamplingParams(max_tokens=1, temperature=0, logprobs=-1))
        vocab = max(len(o.outputs[0].logprobs[0]) for o in outs)
        lp = torch.full((len(reqs), vocab), float("-inf"))
        for i, o in enumerate(outs):
            d = o.outputs[0].logprobs[0]
            ids = torch.tensor(list(d.keys()))
            lp[i, ids] = torch.tensor([v.logprob for v in d.values()], dtype=torch.float32)
        torch.save(lp.view(len(spec["prompts"]), n, vocab), spec["logprobs_out"])
        result["forced_cached_tokens"] = [o.num_cached_tokens for o in outs]
    del llm
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)
