"""``kvpage generate "PROMPT"``: answer one prompt from a paged cache, then say what the cache cost.

It loads the bundled model (or ``--model PATH``), answers in the ``--kv-cache-dtype`` format and prints the
answer, the speed, the KV bytes per token and the saving against a cache in the model's dtype
(:func:`capacity_lines`), plus the tier and speculative-decoding counters when those are on.
"""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from kvpage.cli.engine_flags import ENGINE_FLAGS, add_engine_args, build_llm, name_flags
from kvpage.engine.args import seed
from kvpage.errors import KVPageError

if TYPE_CHECKING:
    from kvpage.engine.llm import LLM
    from kvpage.engine.speculative.metrics import SpecDecodingStats
    from kvpage.spec import CacheSpec, LayerGroupSpec


def add_generate_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``generate`` sub-command to ``sub`` (an ``add_subparsers()`` result); returns its parser."""
    g = sub.add_parser("generate", help="answer a prompt from a paged KV cache")
    g.add_argument("prompt", help="the prompt (a user message with --chat)")
    add_engine_args(g)
    g.add_argument("--max-tokens", type=int, default=64, help="output tokens at most (default 64)")
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap the prompt in the model's chat template (default on)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=seed, default=None,
                   help="sampling seed, an integer in [-2**63, 2**64 - 1] (default: random)")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.set_defaults(func=run_generate)
    return g


#: ``SamplingParams`` field -> the ``kvpage generate`` flag that sets it (for its error messages).
_SAMPLING_FLAGS = {"max_tokens": "--max-tokens", "temperature": "--temperature", "top_p": "--top-p",
                   "top_k": "--top-k", "seed": "--seed", "stop": "--stop"}


def run_generate(args: argparse.Namespace) -> int:
    """``kvpage generate``: answer the prompt, then print the speed, capacity, tier and speculative lines.

    Bad sampling flags fail before the model loads, the message naming the flag (``--stop`` for ``--stop ""``).
    """
    from kvpage.engine.sampling import SamplingParams

    try:
        params = SamplingParams(  # before loading the model: bad sampling values fail fast
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            stop=args.stop,
        )
    except ValueError as e:  # named as the flags the user typed: --stop "" -> "--stop must not contain ..."
        name_flags(e, _SAMPLING_FLAGS)
        raise
    if args.chat and not args.prompt.strip():
        raise ValueError("empty prompt: give a non-blank message")
    llm = build_llm(args)
    try:  # a request the engine cannot hold: "Raise --kv-cache-memory-bytes/--num-blocks, ... lower --max-tokens"
        prompt = llm.chat_prompt(args.prompt) if args.chat else args.prompt
        out = llm.generate([prompt], params)[0]
    except (ValueError, KVPageError) as e:
        name_flags(e, {**ENGINE_FLAGS, **_SAMPLING_FLAGS})
        raise
    comp, m = out.outputs[0], out.metrics
    print(comp.text.strip())
    print()
    decode_s = (m.total_time_s or 0.0) - (m.time_to_first_token_s or 0.0)
    rate = (m.output_tokens - 1) / decode_s if m.output_tokens > 1 and decode_s > 0 else float("nan")
    print(f"[kvpage] {m.prompt_tokens} prompt tokens, {m.output_tokens} output tokens ({comp.finish_reason}); "
          f"time to first token {m.time_to_first_token_s:.3f} s; decode {rate:.1f} tokens/s")
    for line in capacity_lines(llm):
        print(line)
    tiers = tier_line(llm)
    if tiers is not None:
        print(tiers)
    spec = spec_decode_line(getattr(llm.engine.stats(), "spec_decoding", None))
    if spec is not None:
        print(spec)
    llm.close()  # sends the KV events still queued (kv_events_config) before the process exits
    return 0


def spec_decode_line(stats: SpecDecodingStats | None) -> str | None:
    """One line of speculative-decoding counters (``None`` when the engine does not speculate).

    Drafted and accepted tokens over the rounds that had drafts, the acceptance rate (accepted /
    drafted), the mean accepted length (1 + accepted / rounds: tokens per target pass when verification accepts them; a
    stop may end a round's output earlier) and the
    acceptance rate of each draft position (among rounds that drafted it), from ``EngineStats.spec_decoding``.
    """
    if stats is None:
        return None
    per_pos = " ".join(f"{r:.2f}" for r in stats.per_position_acceptance_rate)
    return (f"[kvpage] speculative: {stats.num_draft_tokens} drafted, {stats.num_accepted_tokens} accepted "
            f"in {stats.num_drafts} rounds; acceptance rate {stats.acceptance_rate:.1%}, mean accepted length "
            f"{stats.mean_accepted_length:.2f}; per position {per_pos}")


def capacity_lines(llm: LLM) -> list[str]:
    """The KV cache's size and its saving against a model-dtype cache, from the engine's :class:`CapacityReport`."""
    cap, spec = llm.capacity, llm.spec
    if cap.side_blocks_per_slot:  # quantize-on-seal side space carved from the pool: only the copies' scales beside it
        scales = f" + {cap.side_pool_bytes / 2**20:.1f} MiB of first-block copy scales" if cap.side_pool_bytes else ""
        side = (f"{scales} (16-bit tail slots, window and first-block copies are taken from these blocks while "
                f"requests hold them, {cap.side_blocks_per_slot} blocks each)")
    elif cap.side_pool_bytes:
        side = (f" + {cap.side_pool_bytes / 2**20:.1f} MiB side pools (16-bit tail slots, window and first-block "
                f"copies for {cap.max_num_seqs} requests)")
    else:
        side = ""
    window = cap.sliding_window if cap.window_slots else None
    windowed = next((g for g in spec.groups if window and g.name == cap.window_group), None)
    per_token = [g for g in spec.groups if g is not windowed]
    slots = (f" + {cap.window_bytes / 2**20:.1f} MiB of {cap.window_slots:,} window slots for the "
             f"{windowed.num_layers} sliding-window layers ({window}-token window: "
             f"{group_formula(windowed)} per token in a slot)" if windowed is not None else "")
    if not window and cap.bytes_per_token == cap.reference_bytes_per_token:  # the model-dtype cache: no saving to say
        compared = (f"[kvpage] the cache is in the model's dtype ({cap.model_dtype}): {cap.tokens:,} tokens in "
                    f"{cap.budget_bytes / 2**20:,.1f} MiB; a quantized --kv-cache-dtype (int8, int4_rotated, ...) "
                    f"holds more in the same budget (`kvpage formats` lists them with their tokens)")
    else:
        used = cap.reference_tokens / cap.tokens if window else cap.bytes_per_token / cap.reference_bytes_per_token
        compared = (
            f"[kvpage] vs a {cap.model_dtype} cache ({cap.reference_bytes_per_token:,.0f} bytes/token"
            f"{' in every layer; the same layout, window slots too' if window else ''}): "
            f"{1 - used:.1%} less KV memory per cached token; "
            f"{cap.tokens:,} vs {cap.reference_tokens:,} tokens in the same {cap.budget_bytes / 2**20:,.1f} MiB "
            f"({cap.ratio:.2f}x more tokens per byte, side space included)")
    return [
        f"[kvpage] KV cache: {spec.format_label} ({_mean_bits(spec):g} bits/value"
        f"{', mean over layers' if spec.format_groups else ''}), "
        f"{cap.bytes_per_token:,.0f} bytes/token = "
        + (" + ".join(group_formula(g) for g in per_token) if per_token else "0 (every layer is windowed)")
        + f"; {cap.num_blocks:,} blocks x {cap.block_size} tokens "
        f"= {cap.pool_bytes / 2**20:.1f} MiB{slots}{side}",
        compared,
    ]


def _mean_bits(spec: CacheSpec) -> float:
    """Bits per value of the model's layers, averaged over them (one format: that format's)."""
    groups = spec.model_groups
    return round(sum(g.num_layers * g.layer.bits_per_value for g in groups) / sum(g.num_layers for g in groups), 4)


def group_formula(g: LayerGroupSpec) -> str:
    """``30 layers x 2 x 3 kv heads x 64 x 1.03 bytes`` for one group (a key-only latent group: ``x 1``)."""
    name = "" if g.name == "main" else g.name + " "
    return (f"{g.num_layers} {name}layer{'s' if g.num_layers != 1 else ''} x {2 if g.layer.has_value else 1} x {g.layer.kv_heads} kv "
            f"heads x {g.layer.head_dim} x {g.layer.bits_per_value / 8:g} bytes")


def tier_line(llm: LLM) -> str | None:
    """One line of tier counters (``None`` without tiers), every number taken from ``llm.kv_cache_stats()``.

    Device: blocks served from the device prefix cache (``tier_hits["device"]``). Host: blocks served
    to requests (hits), blocks copied host->device (loaded) and device->host (stored: write-policy
    backups and swap-outs), from ``tiers.tier_bytes`` in blocks. Stores (``disk``, ``redis``): each
    store's hits (blocks served, ``tier_hits[name]``), then blocks loaded from and written to the
    stores (``tier_bytes["store_read"]``/``["store_write"]`` in blocks; one figure for all stores,
    as the tiers count them), records rejected and I/O errors.
    """
    conn = llm.kv_connector
    if conn is None:
        return None
    kv = llm.kv_cache_stats()
    t = kv.tiers
    parts = [f"device {kv.tier_hits.get('device', 0)} block hits"]
    bpb = max(1, conn.offload.bytes_per_block)
    if t is not None and t.num_host_blocks:
        parts.append(f"host {kv.tier_hits.get('host', 0)} hits, {t.tier_bytes['host_to_device'] // bpb} blocks "
                     f"loaded, {t.tier_bytes['device_to_host'] // bpb} stored ({t.backups} backups, "
                     f"{t.swapped_out_blocks} swapped out), {t.num_host_blocks - t.num_host_free} of "
                     f"{t.num_host_blocks} host blocks used")
    names = [name for name, _ in conn.offload.stores]
    if names and t is not None:
        hits = ", ".join(f"{name} {kv.tier_hits.get(name, 0)} hits" for name in names)
        moved = (f"{t.tier_bytes['store_read'] // bpb} blocks loaded, {t.tier_bytes['store_write'] // bpb} stored"
                 + (" (all stores)" if len(names) > 1 else ""))
        parts.append(f"{hits}, {moved}" + (f", {t.store_rejected} rejected" if t.store_rejected else "")
                     + (f", {t.store_errors} errors" if t.store_errors else ""))
    return "[kvpage] tiers: " + "; ".join(parts)
