"""Speculative decoding on the bundled model: tokens/s and acceptance per method vs no speculation, in one run.

Usage::

    python benchmarks/speculative.py [--reps 2] [--max-tokens 128] [--threads 1] [--dtype float32]
    python benchmarks/speculative.py --quick          # smoke test: 2 prompts, 16 tokens, 1 repetition, no sweeps

Two workloads of 8 chat prompts each (the tokenizer's chat template): (a) *copy-heavy*, asking the model to
repeat or lightly edit a given paragraph or code snippet, and (b) *open chat* questions. Each runs at batch 1
(the prompts one after another) and batch 8 (all at once), greedy, ``max_tokens`` 128, stopping at EOS, with

* no speculation (the baseline: kvpage itself, same weights, same process);
* ``ngram`` (prompt lookup): ``k`` and the lookup range are the fastest of a short sweep on (a) at batch 1
  (k in 2, 3, 4: on these CPUs a float32 matmul costs about the same for 1 to 3 rows and twice that for 4 to 6,
  so a verification pass of more than 3 rows per request costs more than a decode step);
* ``draft_model`` with the bundled model as its own draft, ``k = 4``: acceptance is (nearly) perfect, so it is
  an upper bound on acceptance and shows what drafting with a model as large as the target costs;
* ``layer_skip`` (the target's first N layers, final norm and LM head as the draft), ``k = 3``; N is the
  fastest of a sweep over 4, 12, 20 and 27 of the 30 layers (its acceptance is printed too).

One :func:`~kvpage.model.loader.load_model` serves every engine. The methods run interleaved: each repetition
runs every method on the same block (workload x batch), in an order that alternates between repetitions, and
``os.getloadavg()`` is printed before and after each block. Tokens/s is *decode* tokens/s: output tokens after
the first, divided by the time from the first request's first token to the last request's finish (summed over
requests at batch 1), so prefill (the same work for every method) is left out. Acceptance counters are the
engine's (``llm.engine.stats().spec_decoding``): acceptance rate = accepted / drafted tokens, mean accepted
length = 1 + accepted / rounds with drafts (vLLM's). "exact" counts outputs whose tokens equal the
non-speculative output of the same repetition (greedy; a near-tie may flip under another batch shape).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from kvpage import LLM, SamplingParams  # noqa: E402
from kvpage.model.loader import LoadedModel, load_model  # noqa: E402

_PARAGRAPH_1 = ("The river town woke slowly. Fishermen pulled their boats onto the stones, the baker opened his "
                "shutters, and children ran along the bank with their dogs. By noon the market square was full of "
                "voices, and the smell of bread and smoked fish drifted over the water.")
_PARAGRAPH_2 = ("Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to make "
                "glucose and oxygen. It takes place in the chloroplasts, which contain the pigment chlorophyll. The "
                "oxygen is released into the air, and the glucose is used by the plant for energy and growth.")
_PARAGRAPH_3 = ("Our library is open from nine in the morning until six in the evening, Monday to Saturday. "
                "Members may borrow up to five books at a time for three weeks. Late returns cost ten cents a day, "
                "and lost books must be replaced or paid for at the front desk.")
_PARAGRAPH_4 = ("Dear team, thank you all for your hard work this quarter. Sales grew by twelve percent, two new "
                "customers signed long contracts, and the support queue is shorter than ever. Please take Friday "
                "afternoon off, and see you at the team lunch next week.")
_CODE_1 = ("def average(numbers):\n    total = 0\n    for n in numbers:\n        total = total + n\n"
           "    return total / len(numbers)\n\n\nprint(average([1, 2, 3, 4]))\n")
_CODE_2 = ("class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
           "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n"
           "    def is_empty(self):\n        return len(self.items) == 0\n")
_CODE_3 = ("def count_words(text):\n    counts = {}\n    for word in text.split():\n        word = word.lower()\n"
           "        counts[word] = counts.get(word, 0) + 1\n    return counts\n")
_CODE_4 = ("import json\n\n\ndef load_config(path):\n    with open(path) as f:\n        config = json.load(f)\n"
           "    if \"name\" not in config:\n        config[\"name\"] = \"default\"\n    return config\n")

#: (a) Copy-heavy: repeat or lightly edit a given paragraph or code snippet.
COPY_PROMPTS = [
    f"Repeat the following paragraph exactly, word for word:\n\n{_PARAGRAPH_1}",
    f"Copy this text exactly as it is:\n\n{_PARAGRAPH_2}",
    f"Rewrite this notice, changing only \"five books\" to \"seven books\":\n\n{_PARAGRAPH_3}",
    f"Repeat this email, but replace \"Friday\" with \"Thursday\":\n\n{_PARAGRAPH_4}",
    f"Repeat this Python code exactly:\n\n```python\n{_CODE_1}```",
    f"Add a docstring to each method of this class and repeat the rest unchanged:\n\n```python\n{_CODE_2}```",
    f"Rename the function count_words to word_counts in this code and show the full code:\n\n"
    f"```python\n{_CODE_3}```",
    f"Copy this code and add a comment at the top saying what it does:\n\n```python\n{_CODE_4}```",
]

#: (b) Open chat.
CHAT_PROMPTS = [
    "Why is the sky blue?",
    "Give me three tips for sleeping better.",
    "What is the difference between a virus and a bacterium?",
    "Write a short story about a robot who learns to paint.",
    "How does a refrigerator keep food cold?",
    "What are the main causes of climate change?",
    "Explain what a neural network is to a ten-year-old.",
    "Plan a one-day visit to Rome.",
]


@dataclass
class Block:
    """One measurement: one method on one workload at one batch size.

    Attributes:
        outputs: each prompt's output token ids, in prompt order.
        decode_tokens: output tokens after each request's first, summed.
        decode_s: seconds of decoding (see the module docstring).
        counters: ``(drafts, draft tokens, accepted, emitted)`` during this block; zeros without speculation.
    """

    outputs: list[list[int]] = field(default_factory=list)
    decode_tokens: int = 0
    decode_s: float = 0.0
    counters: tuple[int, int, int, int] = (0, 0, 0, 0)

    @property
    def tokens_per_s(self) -> float:
        """Decode tokens/s."""
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0


def _counters(llm: LLM) -> tuple[int, int, int, int]:
    s = llm.engine.stats().spec_decoding
    if s is None:
        return (0, 0, 0, 0)
    return (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, s.num_emitted_tokens)


def run_block(llm: LLM, prompts: list[dict[str, Any]], batch: int, params: SamplingParams) -> Block:
    """Generate ``prompts`` in groups of ``batch`` (each group one ``generate`` call) and time the decoding.

    Returns a :class:`Block`; the engine's speculation counters are read before and after.
    """
    before = _counters(llm)
    block = Block()
    for i in range(0, len(prompts), batch):
        outs = llm.generate(prompts[i:i + batch], params)
        block.outputs += [list(o.outputs[0].token_ids) for o in outs]
        block.decode_tokens += sum(o.metrics.output_tokens - 1 for o in outs)
        block.decode_s += (max(o.metrics.total_time_s for o in outs)
                           - min(o.metrics.time_to_first_token_s for o in outs))
    after = _counters(llm)
    block.counters = (after[0] - before[0], after[1] - before[1], after[2] - before[2], after[3] - before[3])
    return block


def _load() -> str:
    """``os.getloadavg()`` as ``"1m/5m/15m"``."""
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def _engine(loaded: LoadedModel, spec: dict[str, Any] | None, args: argparse.Namespace) -> LLM:
    """An engine on the shared weights (prefix caching off: repetitions stay independent), warmed up."""
    llm = LLM(loaded, speculative_config=spec, num_threads=args.threads, progress=False,
              kv_cache_memory_bytes=256 * 2**20, enable_prefix_caching=False)
    llm.generate([llm.chat_prompt("Hello!")], SamplingParams(max_tokens=8, temperature=0.0))  # warm-up
    return llm


def _acc(c: Sequence[int]) -> tuple[float, float]:
    """(acceptance rate, mean accepted length) from ``(drafts, draft tokens, accepted, emitted)``."""
    drafts, drafted, accepted = c[0], c[1], c[2]
    return (accepted / drafted if drafted else 0.0, 1 + accepted / drafts if drafts else 0.0)


def sweep(loaded: LoadedModel, name: str, specs: list[dict[str, Any]], prompts: list[dict[str, Any]],
          params: SamplingParams, args: argparse.Namespace) -> dict[str, Any]:
    """Run each config of ``specs`` on ``prompts`` at batch 1; print its speed and acceptance; return the fastest."""
    print(f"\n{name} sweep (batch 1, {len(prompts)} prompts, {params.max_tokens} tokens), load {_load()}", flush=True)
    best, best_tps = specs[0], -1.0
    for spec in specs:
        llm = _engine(loaded, spec, args)
        b = run_block(llm, prompts, 1, params)
        acc, mal = _acc(b.counters)
        shown = {k: v for k, v in spec.items() if k not in ("method", "model")}
        print(f"  {shown}: {b.tokens_per_s:6.1f} tokens/s, acceptance {acc:.3f}, mean accepted length {mal:.2f}",
              flush=True)
        if b.tokens_per_s > best_tps:
            best, best_tps = spec, b.tokens_per_s
        del llm
    print(f"  -> {name}: {({k: v for k, v in best.items() if k not in ('method', 'model')})}, load {_load()}")
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2, help="repetitions of every block (method order alternates)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: steady on a shared 2-core box)")
    ap.add_argument("--dtype", default="float32", help="model compute dtype (the engine's default, auto, is float32)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--ngram", default=None, help="skip the ngram sweep: MIN,MAX lookup range")
    ap.add_argument("--ngram-k", type=int, default=2, help="with --ngram: num_speculative_tokens")
    ap.add_argument("--layer-skip", type=int, default=None, help="skip the layer_skip sweep: its num_layers")
    ap.add_argument("--methods", default="none,ngram,draft_model,layer_skip",
                    help="methods to run (comma-separated; none is always run: the ratios need it)")
    ap.add_argument("--quick", action="store_true", help="smoke test: 2 prompts, 16 tokens, 1 repetition, no sweeps")
    args = ap.parse_args()
    wanted = set(args.methods.split(",")) | {"none"}
    if args.quick:
        args.reps, args.max_tokens = 1, 16
        args.ngram, args.layer_skip = args.ngram or "1,3", args.layer_skip or 24
    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    loaded = load_model(None, dtype=getattr(torch, args.dtype), progress=False)
    n_layers = loaded.config.num_layers
    plain = _engine(loaded, None, args)
    workloads = {"(a) copy": [plain.chat_prompt(p) for p in COPY_PROMPTS],
                 "(b) chat": [plain.chat_prompt(p) for p in CHAT_PROMPTS]}
    if args.quick:
        workloads = {k: v[:2] for k, v in workloads.items()}
    batches = [int(b) for b in args.batches.split(",")]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    sweep_params = SamplingParams(max_tokens=min(args.max_tokens, 64), temperature=0.0)
    print(f"SmolLM2-135M-Instruct ({n_layers} layers), {args.dtype} weights and KV, {args.threads} thread(s), "
          f"torch {torch.__version__}, load {_load()}", flush=True)

    if "ngram" not in wanted:
        ngram = {}
    elif args.ngram:
        lo, hi = (int(x) for x in args.ngram.split(","))
        ngram = {"method": "ngram", "num_speculative_tokens": args.ngram_k, "prompt_lookup_min": lo,
                 "prompt_lookup_max": hi}
    else:  # k too: on the CPU a verification pass of more than ~3 rows per request is compute-bound
        ngram = sweep(loaded, "ngram", [
            {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lo, "prompt_lookup_max": hi}
            for k in (2, 3, 4) for lo, hi in [(1, 3), (2, 5)]], workloads["(a) copy"][:3], sweep_params, args)
    if "layer_skip" not in wanted:
        skip = {}
    elif args.layer_skip:
        skip = {"method": "layer_skip", "num_speculative_tokens": 3, "num_layers": args.layer_skip}
    else:
        skip = sweep(loaded, "layer_skip (k=3)", [
            {"method": "layer_skip", "num_speculative_tokens": 3, "num_layers": n}
            for n in (4, 12, 20, 27) if n < n_layers],
            [workloads["(a) copy"][0], workloads["(b) chat"][0]], sweep_params, args)
    methods: dict[str, dict[str, Any] | None] = {"none": None}
    if ngram:
        methods[f"ngram k={ngram['num_speculative_tokens']} [{ngram['prompt_lookup_min']},"
                f"{ngram['prompt_lookup_max']}]"] = ngram
    if "draft_model" in wanted:
        methods["draft_model (itself) k=4"] = {"method": "draft_model", "num_speculative_tokens": 4, "model": loaded}
    if skip:
        methods[f"layer_skip {skip['num_layers']}/{n_layers} k=3"] = skip
    engines = {"none": plain} | {name: _engine(loaded, spec, args) for name, spec in methods.items() if spec}

    results: dict[tuple[str, int, str], list[Block]] = {}
    names = list(methods)
    for rep in range(args.reps):
        order = names if rep % 2 == 0 else names[::-1]
        for wl, prompts in workloads.items():
            for batch in batches:
                print(f"\nrep {rep + 1}, {wl}, batch {batch}", flush=True)
                for name in order:
                    before = _load()
                    b = run_block(engines[name], prompts, batch, params)
                    results.setdefault((wl, batch, name), []).append(b)
                    print(f"  {name:<28} {b.tokens_per_s:6.1f} tokens/s ({b.decode_tokens} tokens)  "
                          f"load {before} -> {_load()}", flush=True)
    for name, llm in engines.items():
        assert llm.kv_cache_stats().num_in_use == 0, f"{name}: blocks left in use"

    print(f"\nDecode tokens/s (mean of {args.reps} interleaved repetitions; ratio = tokens/s over no speculation, "
          f"per repetition, then averaged), greedy, max_tokens {args.max_tokens}, EOS stops")
    head = (f"| {'workload':<8} | batch | {'method':<28} | tokens/s | vs none | acceptance | mean acc. len "
            f"| exact |")
    print(head)
    print("|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|")
    for wl in workloads:
        for batch in batches:
            base = results[(wl, batch, "none")]
            for name in names:
                blocks = results[(wl, batch, name)]
                tps = sum(b.tokens_per_s for b in blocks) / len(blocks)
                ratio = sum(b.tokens_per_s / r.tokens_per_s for b, r in zip(blocks, base)) / len(blocks)
                acc, mal = _acc([sum(c) for c in zip(*(b.counters for b in blocks))])
                same = sum(o == r for b, rb in zip(blocks, base) for o, r in zip(b.outputs, rb.outputs))
                n = sum(len(b.outputs) for b in blocks)
                spec_cells = (f"{acc:>10.3f} | {mal:>13.2f}" if methods[name] else f"{'-':>10} | {'-':>13}")
                print(f"| {wl:<8} | {batch:>5} | {name:<28} | {tps:>8.1f} | {ratio:>6.2f}x | {spec_cells} "
                      f"| {same:>2}/{n:<2} |")
    print(f"\nwall time {time.perf_counter() - t_start:.0f} s, load {_load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
