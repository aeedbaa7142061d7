"""Model families and hybrid KV groups (issue 15): sliding-window memory, MLA bytes, quantized caches per family.

Usage::

    python benchmarks/families.py [--context 4096] [--window 1024] [--formats int8,int4] [--skip-formats]

Three parts, all on small random-initialised transformers models (no weights are downloaded):

1. **Sliding window at a long context.** A Gemma-3-style model (5 local layers of ``--window`` tokens for each
   global layer, 12 layers) serves one request of ``--context`` tokens (chunked prefill, then 32 decode steps)
   on an ``int8`` cache. After every step the KV bytes the request holds are read from the pool (global blocks
   in use x their bytes + pinned window slots x theirs) and compared with the theory: the global layers' full
   share + the window layers' window share + one block per group; and with the same model on a cache that
   keeps every block in every layer.
   1b. The same for a Mistral-style model whose every layer is windowed: block ids carry no tensor and the
   budget buys window slots only. Both for each of ``--formats`` (default ``int8,int4``): ``int4`` keeps its
   sealed codes in the window slots too, and its 16-bit tails (open blocks, copies) are reported beside them.
2. **MLA.** Bytes per token of a DeepSeek-V3-sized latent cache (``L x (kv_lora_rank + rope)`` values) against
   the uncompressed K/V the same attention would cache, and the tiny model's cache as the engine allocates it.
3. **Quantized caches per family.** For each family, the KL divergence of the next-token distribution of
   ``int8`` and ``int4`` caches from transformers' float32 forward, over 32 decode positions after a 40-token
   prompt (the weights are random: the figures show the formats run and how far they move, not accuracy).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402
import transformers as tf  # noqa: E402
from test_families_engine import FAMILIES, LogitRecorder, family_config, hf_logits, init_weights  # noqa: E402

from kvpage import LLM, SamplingParams  # noqa: E402
from kvpage.cache.groups import SealedWindowManager, SlidingWindowManager  # noqa: E402
from kvpage.model.loader import load_model  # noqa: E402
from kvpage.spec import CacheSizing, CacheSpec, Sealed  # noqa: E402


def save(model_config: tf.PretrainedConfig, folder: Path, tokenizer: object, seed: int = 0) -> Path:
    model_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(model_config)
    init_weights(model, seed=seed + 100)
    model.save_pretrained(folder)
    getattr(tokenizer, "save_pretrained")(folder)
    return folder


def tails_held(llm: LLM) -> int:
    """Bytes of 16-bit tail the quantize-on-seal groups hold now (open blocks, window and first-block copies):
    pool blocks carved for them plus the used slots of fixed tail pools; 0 for token-wise formats."""
    spec, built = llm.spec, llm._built
    held = llm.kv_cache_stats().num_side * spec.main.bytes_per_block  # only the full-attention group carves
    for g in built.groups:
        table = g.seals.table if isinstance(g, SealedWindowManager) else getattr(g, "table", None)
        if table is not None and table.side is None:
            gs, sizing = spec.group(g.name), CacheSizing(model_dtype=built.tails[g.name].dtype)
            held += table.num_used * Sealed.tail_slot_bytes(gs, sizing) + table.num_sink_used * Sealed.sink_slot_bytes(gs)
    return held


def window_manager(llm: LLM) -> SlidingWindowManager:
    """The window slots' bookkeeping of the model's windowed group (a block-wise group's is inside its manager)."""
    g = llm._built.kv.group(llm.capacity.window_group)
    win = g.window if isinstance(g, SealedWindowManager) else g
    assert isinstance(win, SlidingWindowManager)
    return win


def sliding_window(tokenizer: object, root: Path, context: int, window: int, fmt: str) -> None:
    layers = ["sliding_attention"] * 5 + ["full_attention"]
    cfg = tf.Gemma3TextConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=12,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=window,
                              max_position_embeddings=context + 64, query_pre_attn_scalar=32,
                              layer_types=layers * 2, tie_word_embeddings=True)
    folder = save(cfg, root / "gemma3", tokenizer)
    prompt = torch.randint(100, 40000, (context - 32,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    llm = LLM(str(folder), progress=False, kv_cache_dtype=fmt, block_size=16, max_num_seqs=4,
              max_num_batched_tokens=256, kv_cache_memory_bytes=64 * 2**20)
    spec, cap = llm.spec, llm.capacity
    win = window_manager(llm)
    assert spec.sliding is not None
    main_bpb, win_bpb = spec.main.bytes_per_block, spec.sliding.bytes_per_block
    samples: list[tuple[int, int, int, int]] = []  # (position, global blocks in use, pinned window slots, tails)
    advance = win.advance

    def watch(rid: str, ids: list[int], position: int) -> None:
        advance(rid, ids, position)
        samples.append((position, llm.kv_cache_stats().num_in_use, win.num_pinned_slots, tails_held(llm)))

    setattr(win, "advance", watch)
    llm.generate({"prompt_token_ids": prompt}, params)
    bs = spec.block_size
    decode = [s for s in samples if s[0] >= len(prompt)]
    at_peak = max(decode, key=lambda s: s[1] * main_bpb + s[2] * win_bpb)
    peak_decode = at_peak[1] * main_bpb + at_peak[2] * win_bpb
    peak_all = max(m * main_bpb + w * win_bpb for _, m, w, _ in samples)
    theory = -(-context // bs) * main_bpb + -(-window // bs) * win_bpb + main_bpb + win_bpb
    full = -(-context // bs) * (main_bpb + win_bpb)
    print(f"## 1. Sliding window: Gemma-3-style, 12 layers (10 local of {window} tokens, 2 global), "
          f"{context}-token request, {fmt}, block 16")
    print(f"groups: {[(g.name, g.num_layers, g.sliding_window) for g in spec.groups]}; bytes/block: global "
          f"{main_bpb:,}, window {win_bpb:,}; window slots allocated {cap.window_slots:,} "
          f"({cap.window_bytes / 2**20:.2f} MiB) beside {cap.num_blocks:,} blocks ({cap.pool_bytes / 2**20:.2f} MiB)")
    print("| KV bytes held by the request | bytes | vs theory |")
    print("|---|---:|---:|")
    print(f"| theory: global {-(-context // bs)} blocks + window {-(-window // bs)} blocks + one block per group "
          f"| {theory:,} | 1.000 |")
    print(f"| measured, peak during decode | {peak_decode:,} | {peak_decode / theory:.3f} |")
    print(f"| measured, peak during chunked prefill (256-token chunks: the chunk's blocks too) | {peak_all:,} "
          f"| {peak_all / theory:.3f} |")
    print(f"| every block in every layer (no window bound) | {full:,} | {full / theory:.3f} |")
    if at_peak[3]:
        print(f"| beside the codes at the decode peak: 16-bit tails (open blocks, window and first-block copies) "
              f"| {at_peak[3]:,} | {at_peak[3] / theory:.3f} |")
    print()


def all_windowed(tokenizer: object, root: Path, context: int, window: int, fmt: str) -> None:
    cfg = tf.MistralConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=12,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=window,
                           max_position_embeddings=context + 64, tie_word_embeddings=True)
    folder = save(cfg, root / "mistral", tokenizer)
    prompt = torch.randint(100, 40000, (context - 32,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    llm = LLM(str(folder), progress=False, kv_cache_dtype=fmt, block_size=16, max_num_seqs=4,
              max_num_batched_tokens=256, kv_cache_memory_bytes=16 * 2**20)
    spec, cap = llm.spec, llm.capacity
    win = window_manager(llm)
    assert cap.bytes_per_block == 0
    bpb = spec.main.bytes_per_block
    samples: list[tuple[int, int, int]] = []  # (position, pinned window slots, tails)
    advance = win.advance

    def watch(rid: str, ids: list[int], position: int) -> None:
        advance(rid, ids, position)
        samples.append((position, win.num_pinned_slots, tails_held(llm)))

    setattr(win, "advance", watch)
    llm.generate({"prompt_token_ids": prompt}, params)
    bs = spec.block_size
    at_peak = max((s for s in samples if s[0] >= len(prompt)), key=lambda s: s[1])
    peak_decode = at_peak[1] * bpb
    peak_all = max(w for _, w, _ in samples) * bpb
    theory = (-(-window // bs) + 1) * bpb
    full = -(-context // bs) * bpb
    print(f"## 1b. Every layer windowed: Mistral-style, 12 layers of a {window}-token window, {context}-token "
          f"request, {fmt}, block 16")
    print(f"groups: {[(g.name, g.num_layers, g.sliding_window) for g in spec.groups]}; block ids {cap.num_blocks:,} "
          f"(no tensor); window slots {cap.window_slots:,} x {bpb:,} bytes = {cap.window_bytes / 2**20:.2f} MiB, "
          f"all the device KV memory ({llm.controller.device_bytes / 2**20:.2f} MiB allocated)"
          + (f" beside a {cap.side_pool_bytes / 2**20:.2f} MiB 16-bit tail pool" if cap.side_pool_bytes else ""))
    print("| KV bytes held by the request | bytes | vs theory |")
    print("|---|---:|---:|")
    print(f"| theory: window {-(-window // bs)} blocks + one block | {theory:,} | 1.000 |")
    print(f"| measured, peak during decode | {peak_decode:,} | {peak_decode / theory:.3f} |")
    print(f"| measured, peak during chunked prefill (256-token chunks: the chunk's blocks too) | {peak_all:,} "
          f"| {peak_all / theory:.3f} |")
    print(f"| every block (no window bound) | {full:,} | {full / theory:.3f} |")
    if at_peak[2]:
        print(f"| beside the codes at the decode peak: 16-bit tails (open blocks, window and first-block copies) "
              f"| {at_peak[2]:,} | {at_peak[2] / theory:.3f} |")
    print()


def mla(tokenizer: object, root: Path) -> None:
    print("## 2. MLA: bytes per token of the latent cache")
    print("| model | layers | cached per token and layer | bytes/token (bf16) | uncompressed K/V (bf16) | ratio |")
    print("|---|---:|---|---:|---:|---:|")
    for name, L, H, R, rope, nope, v in (("DeepSeek-V3 / R1", 61, 128, 512, 64, 128, 128),
                                         ("DeepSeek-V2-Lite", 27, 16, 512, 64, 128, 128)):
        spec = CacheSpec.build(num_layers=L, num_kv_heads=1, head_dim=R + rope, has_value=False,
                               kv_cache_dtype="bfloat16")
        full = L * H * ((nope + rope) + v) * 2
        assert spec.bytes_per_token == L * (R + rope) * 2
        print(f"| {name} | {L} | latent {R} + rope key {rope} = {R + rope} values | {spec.bytes_per_token:,.0f} "
              f"| {full:,} ({H} heads x ({nope}+{rope} + {v})) | {full / spec.bytes_per_token:.1f}x |")
    folder = save(family_config("deepseek_v3"), root / "mla", tokenizer)
    for fmt in ("float32", "int8", "fp8", "int4"):
        llm = LLM(str(folder), progress=False, kv_cache_dtype=fmt, num_blocks=64)
        g = llm.spec.main
        print(f"- tiny MLA model, `{fmt}`: {g.num_layers} layers x 1 latent head x {g.layer.head_dim} "
              f"(key-only) = {llm.kv_bytes_per_token:,.1f} bytes/token "
              f"({g.layer.bits_per_value:.3g} bits/value)")
        llm.close()
    print()


def formats(tokenizer: object, root: Path) -> None:
    print("## 3. Quantized caches on every family (random weights; KL of next-token distributions vs "
          "transformers float32, 32 decode positions after a 40-token prompt)")
    print("| family | groups | int8 mean KL | int8 max KL | int4 mean KL | int4 max KL |")
    print("|---|---|---:|---:|---:|---:|")
    prompt = torch.randint(100, 40000, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    for i, family in enumerate(FAMILIES):
        folder = save(family_config(family), root / family, tokenizer, seed=i)
        cells, groups = [], ""
        for fmt in ("int8", "int4"):
            llm = LLM(str(folder), progress=False, kv_cache_dtype=fmt, block_size=16, num_blocks=64,
                      max_num_batched_tokens=8, max_num_seqs=1)
            groups = ", ".join(f"{g.name} {g.num_layers}" + (f" (window {g.sliding_window})" if g.sliding_window
                                                               else "") for g in llm.spec.groups)
            rec = LogitRecorder(llm.model)
            out = llm.generate({"prompt_token_ids": prompt},
                               SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))[0]
            ref = hf_logits(folder, prompt + list(out.outputs[0].token_ids))
            kl = []
            for pos, got in rec.rows:
                p = ref[pos].log_softmax(-1)
                kl.append(float((p.exp() * (p - got.log_softmax(-1))).sum()))
            cells += [f"{sum(kl) / len(kl):.2e}", f"{max(kl):.2e}"]
            llm.close()
        print(f"| {family} | {groups} | " + " | ".join(cells) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--formats", default="int8,int4", help="KV formats of parts 1 and 1b (comma-separated)")
    p.add_argument("--skip-formats", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"load average: {os.getloadavg()[0]:.2f}")
    tokenizer = load_model(None, progress=False).tokenizer
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for fmt in args.formats.split(","):
            sliding_window(tokenizer, root, args.context, args.window, fmt)
            all_windowed(tokenizer, root, args.context, args.window, fmt)
        mla(tokenizer, root)
        if not args.skip_formats:
            formats(tokenizer, root)


if __name__ == "__main__":
    main()
