"""End-to-end decode throughput of one KV format with a randomly initialised Llama-3-8B-shaped model (issue 31, item
4c; run by ``benchmarks/gpu_check.sh``, one process per format).

Usage::

    python benchmarks/gpu_e2e.py --format int8 --out $OUT       # CUDA: bf16 weights made on the device
    python benchmarks/gpu_e2e.py --format int8 --tiny --out x     # a 2-layer model, tiny shapes: does the engine run?
    python benchmarks/gpu_e2e.py --format int8 --dry-run --out x  # the same on the CPU: checks the script

Shape: 32 layers, hidden 4096, 32 query / 8 KV heads of 128, MLP 14336, vocabulary 128256 (Llama-3-8B), weights
``N(0, 0.02)`` in bfloat16; nothing is downloaded and no tokenizer is needed (prompts are token ids). ``batch``
requests of ``context - tokens`` random prompt ids each generate ``tokens`` tokens (greedy, EOS ignored), so each
ends at ``context`` tokens. Decode tokens/s = tokens produced after every request's first one / (the last finish -
the last first token), i.e. the steps where the whole batch decodes. The KV cache gets the same
``--budget-gib`` for every format; ``requests_that_fit`` is the engine's own ``max_concurrency`` for ``context``-token
requests at that budget. Appends one JSON line to ``gpu_e2e.jsonl`` under ``--out`` (default ``.``; ``--dry-run``
without ``--out`` only prints).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from kvpage import LLM, SamplingParams  # noqa: E402
from kvpage.model.config import ModelConfig  # noqa: E402
from kvpage.model.llama import LlamaForCausalLM  # noqa: E402
from kvpage.model.loader import LoadedModel  # noqa: E402

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                 num_kv_heads=8, head_dim=128)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=16)


class _NoTokenizer:
    """Prompts are token ids and outputs are counted, not read: every decode is empty."""

    all_special_ids: list[int] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return ""


@torch.no_grad()
def random_model(shape: dict[str, int], dtype: torch.dtype, device: torch.device, max_len: int) -> LoadedModel:
    """Random weights, each tensor made directly on ``device`` (the module is built on ``meta``)."""
    config = ModelConfig(**shape, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=max_len,
                         torch_dtype=dtype)
    model = LlamaForCausalLM(config, dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    sd = {n: (torch.ones(s, dtype=dtype, device=device) if n.endswith("norm.weight")
              else torch.randn(s, dtype=dtype, device=device, generator=gen) * 0.02)
          for n, s in model.hf_parameter_shapes().items()}
    model.load_hf_state_dict(sd)
    del sd
    return LoadedModel(config=config, model=model.eval(), tokenizer=_NoTokenizer(), path=Path("random-llama3-8b"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--format", default="bfloat16")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=128, help="tokens each request generates")
    p.add_argument("--budget-gib", type=float, default=20.0, help="KV cache bytes, the same for every format")
    p.add_argument("--out", type=Path, default=None,
                   help="folder of gpu_e2e.jsonl (default .; a --dry-run without --out writes no file)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model, tiny shapes (a probe of the engine)")
    p.add_argument("--dry-run", action="store_true", help="--tiny on the CPU")
    a = p.parse_args(argv)
    device = torch.device("cpu" if a.dry_run else a.device)
    shape, dtype = LLAMA3_8B, torch.bfloat16
    if a.tiny or a.dry_run:
        shape, a.batch, a.context, a.tokens, a.budget_gib = TINY, 2, 48, 4, 1 / 64
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    t0 = time.perf_counter()
    loaded = random_model(shape, dtype, device, a.context)
    llm = LLM(loaded, progress=False, device=device.type, dtype=str(dtype).removeprefix("torch."),
              kv_cache_dtype=a.format, kv_cache_memory_bytes=int(a.budget_gib * 2**30), max_model_len=a.context,
              max_num_seqs=a.batch, attention_backend="auto")
    setup_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(0, shape["vocab_size"], (a.context - a.tokens,), generator=gen)
                .tolist()} for _ in range(a.batch)]
    params = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))  # warm-up
    t1 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall_s = time.perf_counter() - t1
    last_first = max(o.metrics.time_to_first_token_s for o in outs)
    last = max(o.metrics.total_time_s for o in outs)
    produced = sum(o.metrics.output_tokens - 1 for o in outs)
    row = {"format": a.format, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
           "batch": a.batch, "context": a.context, "tokens": a.tokens, "budget_bytes": int(a.budget_gib * 2**30),
           "decode_tokens_per_s": produced / (last - last_first) if last > last_first else None,
           "wall_s": wall_s, "setup_s": setup_s, "requests_that_fit": llm.capacity.max_concurrency,
           "num_blocks": llm.num_blocks, "attention_backend": llm._built.runner.backends[0].ops.name}
    out = a.out if a.out is not None or a.dry_run else Path(".")  # a dry run checks the script: no stray files
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "gpu_e2e.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
