"""The ``kvpage`` command line: ``kvpage generate``, ``kvpage serve``, ``kvpage eval`` and ``kvpage formats``.

``kvpage generate "PROMPT" --kv-cache-dtype int8`` loads the bundled model (or
``--model PATH``), answers the prompt from a paged cache in that format and
prints the answer, the speed, the KV bytes per token and the saving against a
cache in the model's dtype. ``kvpage serve`` serves the model over an
OpenAI-compatible HTTP API (see :mod:`kvpage.server`). ``kvpage eval --text FILE``
measures each KV format's perplexity and KL divergence against the unquantized cache, ``kvpage eval --suite``
over the evaluation set (see :mod:`kvpage.eval.command`).
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from kvpage.engine.args import DTYPE_HELP, json_object, nonnegative_int, port, positive_int, threads_help
from kvpage.errors import KVPageError

if TYPE_CHECKING:
    from kvpage.engine.llm import LLM
    from kvpage.engine.speculative.metrics import SpecDecodingStats
    from kvpage.spec import LayerGroupSpec


def _format_help() -> str:
    """``--kv-cache-dtype`` help listing every registered format (generated, so it cannot go stale)."""
    from kvpage.formats import available_formats

    return f"KV format: {', '.join(available_formats())} (and aliases; see `kvpage formats`)"


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="path to a .gguf file or a Hugging Face folder (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--kv-cache-dtype", default="auto", help=_format_help())
    p.add_argument("--kv-cache-scales", default=None,
                   help="static K/V scales file (safetensors from `kvpage calibrate`); required by int8_static / fp8_static")
    p.add_argument("--block-size", type=positive_int, default=None,
                   help="tokens per KV block (default 16; 32 for int4/int2, whose key group is the block: "
                        "they need >= 8)")
    p.add_argument("--kv-quant-residual-tokens", type=nonnegative_int, default=None,
                   help="int4/int2: recent tokens whose sealed blocks keep a 16-bit copy (default: int4 0, int2 32)")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="KV cache budget in bytes, side pools of int4/int2 included (default 512 MiB)")
    p.add_argument("--kv-cache-memory-fraction", type=float, default=None,
                   help="KV budget as a fraction in (0, 1] of the memory left: CUDA free memory after the weights "
                        "and a profiled forward pass, or available RAM on the CPU (not vLLM's "
                        "gpu_memory_utilization, a fraction of total memory); excludes --kv-cache-memory-bytes "
                        "and --num-blocks")
    p.add_argument("--num-blocks", type=int, default=None, help="exact number of KV blocks (overrides the budget)")
    p.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    p.add_argument("--threads", type=positive_int, default=None, help=threads_help())
    p.add_argument("--attention-backend", default="auto", choices=["auto", "cpu", "reference"],
                   help="attention kernels: auto (kvpage's C++ CPU kernels where they serve the format, else "
                        "reference), cpu (refused at start-up where they cannot serve), reference (PyTorch SDPA)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's context)")
    p.add_argument("--max-num-seqs", type=positive_int, default=64,
                   help="requests running at once (default 64; sizes the side pools of int4/int2)")
    p.add_argument("--speculative-config", type=json_object, default=None, metavar="JSON",
                   help='speculative decoding, as vLLM\'s flag: a JSON object such as \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 5}\'; methods ngram, draft_model '
                        '(with "model": PATH), layer_skip (with "num_layers": N) (default: none)')
    _add_tier_args(p)


def _add_tier_args(p: argparse.ArgumentParser) -> None:
    """KV tier flags (host tier, swap preemption, disk and Redis stores), passed to ``LLM`` by :func:`_build_llm`."""
    p.add_argument("--swap-space", type=float, default=0.0,
                   help="host (CPU) KV tier in GiB (default 0: none); blocks come back from it on a prefix hit")
    p.add_argument("--kv-offload-policy", default="write_through",
                   choices=["write_through", "write_through_selective", "write_back"],
                   help="when blocks go to the host tier: when cached, once used twice, or on device eviction")
    p.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"],
                   help="preempted requests: recompute later (default) or swap their blocks to the host tier")
    p.add_argument("--kv-disk-dir", default=None, help="directory of a persistent disk store of KV blocks")
    p.add_argument("--kv-disk-max-bytes", type=int, default=None, help="size cap of the disk store in bytes (LRU)")
    p.add_argument("--kv-store", default=None, help="redis://host:port/db of a KV block store shared between instances")


def _build_llm(args: argparse.Namespace, **extra: Any) -> LLM:
    """An :class:`~kvpage.engine.llm.LLM` from the shared engine flags (see :func:`_add_engine_args`) plus ``extra``."""
    from kvpage.engine.llm import LLM

    speculative = getattr(args, "speculative_config", None)
    if speculative is not None:  # passed only when given, like vLLM's flag (default: no speculation)
        extra = {"speculative_config": speculative, **extra}
    return LLM(
        args.model,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_cache_scales=args.kv_cache_scales,
        block_size=args.block_size,
        kv_quant_residual_tokens=args.kv_quant_residual_tokens,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        num_blocks=args.num_blocks,
        dtype=args.dtype,
        num_threads=args.threads,
        attention_backend=args.attention_backend,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        swap_space=args.swap_space,
        kv_offload_policy=args.kv_offload_policy,
        preemption_mode=args.preemption_mode,
        kv_disk_dir=args.kv_disk_dir,
        kv_disk_max_bytes=args.kv_disk_max_bytes,
        kv_store=args.kv_store,
        **extra,
    )


def _cmd_generate(args: argparse.Namespace) -> int:
    from kvpage.engine.sampling import SamplingParams

    params = SamplingParams(  # before loading the model: bad sampling values fail fast
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
    )
    if args.chat and not args.prompt.strip():
        raise ValueError("empty prompt: give a non-blank message")
    llm = _build_llm(args)
    prompt = llm.chat_prompt(args.prompt) if args.chat else args.prompt
    out = llm.generate([prompt], params)[0]
    comp, m = out.outputs[0], out.metrics
    print(comp.text.strip())
    print()
    decode_s = (m.total_time_s or 0.0) - (m.time_to_first_token_s or 0.0)
    rate = (m.output_tokens - 1) / decode_s if m.output_tokens > 1 and decode_s > 0 else float("nan")
    print(f"[kvpage] {m.prompt_tokens} prompt tokens, {m.output_tokens} output tokens ({comp.finish_reason}); "
          f"time to first token {m.time_to_first_token_s:.3f} s; decode {rate:.1f} tokens/s")
    for line in _capacity_lines(llm):
        print(line)
    tiers = tier_line(llm)
    if tiers is not None:
        print(tiers)
    spec = spec_decode_line(getattr(llm.engine.stats(), "spec_decoding", None))
    if spec is not None:
        print(spec)
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


def _capacity_lines(llm: LLM) -> list[str]:
    """The KV cache's size and its saving against a model-dtype cache, from the engine's :class:`CapacityReport`."""
    cap, spec = llm.capacity, llm.spec
    layer = spec.main.layer
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
             f"{_group_formula(windowed)} per token in a slot)" if windowed is not None else "")
    return [
        f"[kvpage] KV cache: {layer.kv_format} ({layer.bits_per_value:g} bits/value), "
        f"{cap.bytes_per_token:,.0f} bytes/token = "
        + (" + ".join(_group_formula(g) for g in per_token) if per_token else "0 (every layer is windowed)")
        + f"; {cap.num_blocks:,} blocks x {cap.block_size} tokens "
        f"= {cap.pool_bytes / 2**20:.1f} MiB{slots}{side}",
        f"[kvpage] vs a {cap.model_dtype} cache ({cap.reference_bytes_per_token:,.0f} bytes/token"
        f"{' in every layer; the same layout, window slots too' if window else ''}): "
        f"{1 - (cap.reference_tokens / cap.tokens if window else cap.bytes_per_token / cap.reference_bytes_per_token):.1%}"
        f" less KV memory per cached token; "
        f"{cap.tokens:,} vs {cap.reference_tokens:,} tokens in the same {cap.budget_bytes / 2**20:,.1f} MiB "
        f"({cap.ratio:.2f}x more tokens per byte, side space included)",
    ]


def _group_formula(g: LayerGroupSpec) -> str:
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
    bpb = max(1, conn.offload.block_bytes)
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


def _cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from kvpage.server.app import build_app

    llm = _build_llm(
        args,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=args.enable_chunked_prefill,
        enable_prefix_caching=args.enable_prefix_caching,
    )
    app = build_app(llm, args.served_model_name)
    print(f"[kvpage] serving {app.state.served_model_name!r} ({llm.spec.main.layer.kv_format} KV cache, "
          f"{llm.num_blocks} blocks x {llm.spec.block_size} tokens) on http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _cmd_formats(args: argparse.Namespace) -> int:
    """``kvpage formats``: every format's aliases, bits per value, and tokens that fit at ``--budget-bytes``."""
    from kvpage.engine.capacity import SMOLLM2_SHAPE, Shape, model_shape
    from kvpage.engine.format_table import format_rows
    from kvpage.formats import format_aliases, get_format
    from kvpage.spec import CacheSpec

    base = SMOLLM2_SHAPE if args.model is None else model_shape(args.model)
    shape = Shape(args.num_layers or base.num_layers, args.num_kv_heads or base.num_kv_heads,
                  args.head_dim or base.head_dim, base.max_position_embeddings, base.kv_has_value,
                  base.layer_windows if args.num_layers in (None, base.num_layers) else None)
    aliases: dict[str, list[str]] = {}
    for a, c in format_aliases().items():
        aliases.setdefault(c, []).append(a)
    rows = {r.name: r.report for r in format_rows(shape, args.budget_bytes, block_size=args.block_size,
                                                               max_num_seqs=args.max_num_seqs)}
    block = ("each format's default block size (16; 32 for int4/int2)" if args.block_size is None
             else f"block {args.block_size}")
    default = ("" if (args.num_layers, args.num_kv_heads, args.head_dim) != (None, None, None) else
               " (SmolLM2-135M)" if args.model is None else f" ({args.model})")
    spec = CacheSpec.build(num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                           has_value=shape.kv_has_value, layer_windows=shape.layer_windows)
    groups = "; ".join(f"{g.name}: {_group_formula(g).split(' x ', 1)[0]}"
                       + (f" with a {g.sliding_window}-token window" if g.sliding_window else "")
                       + ("" if g.layer.has_value else " (key-only latent: keys serve as values)")
                       for g in spec.groups)
    print(f"# layer groups: {groups}")
    print(f"# {shape.num_layers} layers x {shape.num_kv_heads} kv heads x head_dim {shape.head_dim}{default}, {block}, "
          f"float32 model, max_num_seqs {args.max_num_seqs}; tokens that fit in {args.budget_bytes:,} bytes "
          f"({args.budget_bytes / 2**20:,.1f} MiB), side pools included ('-': no block fits, or the block size "
          f"is refused)")
    print(f"{'format':<20} {'bits/value':>10}  {'storage':<9} {'tokens':>10}  aliases")
    print(f"{'auto':<20} {'16/32':>10}  {'model':<9} {'':>10}  the model's dtype")
    for name, cap in rows.items():
        f = get_format(name)
        bs = args.block_size or f.preferred_block_size
        specs = f.tensor_specs(block_size=bs, kv_heads=1, head_dim=shape.head_dim)
        bits = f.bits_per_value(block_size=bs, kv_heads=1, head_dim=shape.head_dim)
        storage = str(specs[0].dtype).removeprefix("torch.")
        tokens = "-" if cap is None else f"{cap.tokens:,}"
        print(f"{name:<20} {bits:>10.3g}  {storage:<9} {tokens:>10}  {', '.join(sorted(aliases.get(name, [])))}")
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    """``kvpage calibrate``: per-layer K/V absmax on sample text -> a scales file for int8_static / fp8_static."""
    from pathlib import Path

    from kvpage.eval.calibrate import calibrate, summarize
    from kvpage.engine.llm import resolve_dtype
    from kvpage.engine.threads import apply_num_threads
    from kvpage.model.loader import load_model

    dtype = resolve_dtype(args.dtype)  # bad flags fail before the model loads
    text_path = Path(args.text)
    if not text_path.is_file():
        raise FileNotFoundError(f"--text {text_path}: no such file")
    text = text_path.read_text(encoding="utf-8")
    threads = apply_num_threads(args.threads)
    print(f"[kvpage] calibrate: {threads.num_threads} torch thread(s) ({threads.reason})", file=sys.stderr,
          flush=True)
    loaded = load_model(args.model, dtype=dtype, progress=args.progress)
    scales = calibrate(loaded, text, num_tokens=args.tokens, chunk_size=args.chunk_size, progress=args.progress)
    out = scales.save(args.out, {"text": text_path.name})
    cfg = loaded.config
    print(f"[kvpage] calibrated {cfg.num_layers} layers x {cfg.num_kv_heads} kv heads x {cfg.head_dim} channels "
          f"on {scales.metadata['tokens']} tokens of {text_path} ({scales.metadata['dtype']})")
    for line in summarize(scales):
        print(f"[kvpage] {line}")
    print(f"[kvpage] wrote {out} (sha256 {scales.sha256[:16]}...); use it with "
          f"--kv-cache-dtype int8_static|fp8_static --kv-cache-scales {out}")
    return 0


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line and a hint, not the whole usage block.

    ``kvpage generate --max-num-seqs 0`` prints ``kvpage generate: error: argument --max-num-seqs: ...``
    and ``run 'kvpage generate --help' for the options`` on stderr, then exits with status 2
    (argparse's). Sub-command parsers are of this class too (``add_subparsers`` uses the parent's).
    """

    def error(self, message: str) -> NoReturn:
        """Print ``<prog>: error: <message>`` and a ``--help`` hint on stderr; exit with status 2."""
        self.exit(2, f"{self.prog}: error: {message}\nrun '{self.prog} --help' for the options\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``kvpage`` argument parser (sub-commands ``generate``, ``serve``, ``eval`` and ``formats``).

    A bad flag exits with status 2 after one error line and a ``--help`` hint (:class:`_Parser`).
    """
    parser = _Parser(prog="kvpage", description="Paged, quantized KV cache and a small LLM engine.")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="answer a prompt from a paged KV cache")
    g.add_argument("prompt", help="the prompt (a user message with --chat)")
    _add_engine_args(g)
    g.add_argument("--max-tokens", type=int, default=64, help="output tokens at most (default 64)")
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap the prompt in the model's chat template (default on)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.set_defaults(func=_cmd_generate)
    s = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    _add_engine_args(s)
    s.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    s.add_argument("--port", type=port, default=8000, help="TCP port (default 8000)")
    s.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the model file's stem or folder name)")
    s.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokens per forward pass (default 2048)")
    s.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="split long prompts across steps (default on)")
    s.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of shared prompt prefixes (default on)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default info)")
    s.set_defaults(func=_cmd_serve)
    from kvpage.eval.command import add_eval_parser  # here, not at the top: importing kvpage.eval imports torch

    add_eval_parser(sub)
    c = sub.add_parser("calibrate", help="calibrate static K/V scales (int8_static, fp8_static) on sample text")
    c.add_argument("--text", required=True, help="UTF-8 text file to calibrate on (no BOS is added)")
    c.add_argument("--out", required=True, help="scales file to write (safetensors), e.g. scales.safetensors")
    c.add_argument("--model", default=None, help="path to a .gguf file or a Hugging Face folder (default: bundled SmolLM2-135M-Instruct)")
    c.add_argument("--tokens", type=positive_int, default=2048, help="calibrate on the text's first N tokens (default 2048)")
    c.add_argument("--chunk-size", type=positive_int, default=512, help="tokens per forward pass (default 512)")
    c.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    c.add_argument("--threads", type=positive_int, default=None, help=threads_help())
    c.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bar (default on)")
    c.set_defaults(func=_cmd_calibrate)
    f = sub.add_parser("formats", help="list KV formats: aliases, bits per value, tokens that fit at a budget")
    f.add_argument("--budget-bytes", type=positive_int, default=512 * 2**20,
                   help="KV budget for the tokens column, side pools included (default 512 MiB)")
    f.add_argument("--model", default=None,
                   help="size for this model's cache (a Hugging Face folder or .gguf; its config only): its layer "
                        "groups (sliding-window, key-only latent) and shape; default the bundled model")
    f.add_argument("--num-layers", type=positive_int, default=None, help="model layers (default: the bundled model's, 30)")
    f.add_argument("--num-kv-heads", type=positive_int, default=None, help="KV heads (default: the bundled model's, 3)")
    f.add_argument("--head-dim", type=positive_int, default=None, help="head dim (default: the bundled model's, 64)")
    f.add_argument("--max-num-seqs", type=positive_int, default=64,
                   help="requests at once, which size int4/int2's side pools (default 64)")
    f.add_argument("--block-size", type=positive_int, default=None,
                   help="tokens per block (default: each format's, 16; 32 for int4/int2)")
    f.set_defaults(func=_cmd_formats)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvpage`` console script; returns the exit status (2 on a kvpage error)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (KVPageError, FileNotFoundError, ValueError) as e:
        print(f"kvpage: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
