"""Greedy agreement with the float32 cache, per KV format: same 32 tokens? and teacher-forced flips and KL.

Usage::

    python benchmarks/greedy_agreement.py [--formats int8,int8_rotated,fp8,fp8_per_token_head,bfloat16]

Each of 20 fixed chat prompts runs alone (float32 weights, prefix caching
off, so no batch shape or cache hit changes the arithmetic), 32 greedy tokens.
"same" counts prompts whose 32 tokens equal the float32 cache's. Teacher
forced: the format's engine is fed the float32 answer token by token;
"flips" counts positions whose argmax differs from the float32 cache's and
"KL" is the mean KL divergence of its next-token distribution from the
float32 cache's.
"""
from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from kvpage import LLM, SamplingParams  # noqa: E402
from kvpage.model.loader import load_model  # noqa: E402

PROMPTS = [
    "What is the capital of France, and what is it famous for?", "Explain in two sentences how a hash table works.",
    "Write a haiku about autumn leaves.", "What are three benefits of regular exercise?",
    "Who wrote Romeo and Juliet, and when?", "What is the boiling point of water at sea level?",
    "Name three planets in our solar system.", "How do I make a cup of tea?", "What is machine learning?",
    "Translate 'good morning' into Spanish.", "What is the largest ocean on Earth?", "Give me a tip for better sleep.",
    "What does DNA stand for?", "Describe a cat in one sentence.", "What is 12 times 12?",
    "Why do leaves change color in autumn?", "Who painted the Mona Lisa?", "What is the speed of light?",
    "Suggest a name for a pet goldfish.", "What is the tallest mountain in the world?",
]


def teacher_forced(llm: LLM, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """``[len(answer), vocab]`` logits, the reference answer fed one token per step through the real cache path.

    Uses :meth:`LLM.open_sequence` (blocks from the engine's pool, never prefix-indexed, freed on exit).
    """
    with llm.open_sequence(prompt_len=len(prompt)) as seq:
        rows = [seq.feed(prompt)]
        for t in answer[:-1]:
            rows.append(seq.feed([t]))
    return torch.cat(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="bfloat16,int8,int8_rotated,fp8,fp8_per_token_head")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(None, dtype=torch.float32, progress=False)
    params = SamplingParams(max_tokens=32, temperature=0.0)

    def engine(fmt: str) -> LLM:
        return LLM(lm, kv_cache_dtype=fmt, num_blocks=64, enable_prefix_caching=False, progress=False)

    ref_llm = engine("float32")
    prompts = [ref_llm.chat_prompt(p)["prompt_token_ids"] for p in PROMPTS]
    ref = [ref_llm.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids for p in prompts]
    ref_logits = [teacher_forced(ref_llm, p, a) for p, a in zip(prompts, ref)]
    positions = sum(len(a) for a in ref)
    print(f"{len(PROMPTS)} chat prompts x 32 greedy tokens, float32 weights, vs the float32 cache "
          f"({positions} teacher-forced positions)")
    print("| KV cache | bits/value | same 32 tokens | same, first 5 prompts | teacher-forced flips | mean KL |")
    print("|---|---|---|---|---|---|")
    for fmt in args.formats.split(","):
        llm = engine(fmt)
        outs = [llm.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids for p in prompts]
        same = [a == b for a, b in zip(outs, ref)]
        flips, kls = 0, []
        for p, a, r in zip(prompts, ref, ref_logits):
            x = teacher_forced(llm, p, a)
            flips += int((x.argmax(-1) != r.argmax(-1)).sum())
            kls.append(torch.nn.functional.kl_div(x.log_softmax(-1), r.log_softmax(-1), log_target=True,
                                                  reduction="none").sum(-1).mean())
        kl = float(torch.stack(kls).mean())
        bits = llm.spec.main.layer.bits_per_value
        print(f"| {fmt} | {bits:g} | {sum(same)}/{len(same)} | {sum(same[:5])}/5 | {flips}/{positions} | {kl:.5f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
