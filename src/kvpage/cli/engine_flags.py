"""The engine flags ``kvpage generate`` and ``kvpage serve`` share, and the :class:`~kvpage.engine.llm.LLM` they build.

Value types and help texts come from :mod:`kvpage.engine.args` (shared with ``kvpage eval``); the engine itself is
imported only when :func:`build_llm` runs, so building the parser stays light.
"""
from __future__ import annotations

import argparse
import re
from typing import TYPE_CHECKING, Any

from kvpage.cache.hashing import DEFAULT_HASH_ALGO, HASH_ALGOS
from kvpage.errors import KVPageError
from kvpage.engine.args import (DTYPE_HELP, WEIGHTS_DTYPE_HELP, json_object_arg, model_dtype, nonnegative_int,
                               positive_int, threads_help)

if TYPE_CHECKING:
    from kvpage.engine.llm import LLM


def _format_help() -> str:
    """``--kv-cache-dtype`` help listing every registered format (generated, so it cannot go stale)."""
    from kvpage.formats import available_formats

    return f"KV format: {', '.join(available_formats())} (and aliases; see `kvpage formats`)"


def _layer_dtypes(text: str) -> dict[int, str]:
    """``--kv-layer-dtypes`` parsed (:func:`~kvpage.engine.config.parse_layer_dtypes`); formats and layer ranges
    are checked when the engine is built (:func:`build_llm` names the flag in those errors too).

    Raises:
        argparse.ArgumentTypeError: an empty map or item, a bad spelling, layer or a layer named twice (argparse
            names the flag, once: ``argument --kv-layer-dtypes: ...``).
    """
    from kvpage.engine.config import parse_layer_dtypes

    try:
        return parse_layer_dtypes(text, None)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


#: Engine fields whose errors :func:`build_llm` (and the commands' later calls) report under their flag's name:
#: errors raised after parsing, when the engine is built or a request checked (``kv_layer_dtypes: layer 99 is out
#: of range`` -> ``--kv-layer-dtypes: layer 99 ...``, ``block_size=7 is too small`` -> ``--block-size=7 ...``).
#: Every field build_llm passes from a flag, except ``model`` and ``dtype``: common words in messages.
ENGINE_FLAGS = {field: "--" + field.replace("_", "-") for field in (
    "kv_cache_dtype", "kv_layer_dtypes", "kv_cache_scales", "block_size", "kv_quant_residual_tokens",
    "kv_cache_memory_bytes", "kv_cache_memory_fraction", "num_blocks", "weights_dtype", "attention_backend",
    "max_model_len", "max_num_seqs", "speculative_config", "prefix_caching_hash_algo", "kv_events_config",
    "swap_space", "kv_offload_policy", "preemption_mode", "kv_disk_dir", "kv_disk_max_bytes", "kv_store",
    "kv_transfer_config")} | {"num_threads": "--threads"}


def name_flags(e: BaseException, flags: dict[str, str]) -> None:
    """Rewrite ``e``'s message in place to name the command-line flags of ``flags`` (field -> flag) instead of the
    Python fields the API checked (``stop must not ...`` -> ``--stop must not ...``); whole words only, so
    ``stop_token_ids`` stays. The exception's type and traceback are kept; a message that is not ``e``'s single
    string argument is left alone."""
    if len(e.args) != 1 or not isinstance(e.args[0], str):
        return
    msg = e.args[0]
    for field, flag in flags.items():
        msg = re.sub(rf"(?<![\w-]){field}\b", flag, msg)
    e.args = (msg,)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Add the engine flags (model, KV format and budget, threads, backend, speculation, tiers) to ``p``."""
    p.add_argument("--model", default=None, help="path to a .gguf file or a Hugging Face folder (default: bundled SmolLM2-135M-Instruct)")
    p.add_argument("--kv-cache-dtype", default="auto", help=_format_help())
    p.add_argument("--kv-layer-dtypes", default=None, type=_layer_dtypes,
                   help="per-layer precision: full-attention layers in another format than --kv-cache-dtype, "
                        "as 'LAYERS:FORMAT;...', e.g. '17,20,24:int4_rotated;27,13:int2_rotated' (layer indices "
                        "from 0; the rest keep --kv-cache-dtype)")
    p.add_argument("--kv-cache-scales", default=None,
                   help="static K/V scales file (safetensors from `kvpage calibrate`); required by int8_static / fp8_static")
    p.add_argument("--block-size", type=positive_int, default=None,
                   help="tokens per KV block (default 16; 32 for int4/int3/int2, whose key group is the block: "
                        "they need >= 8)")
    p.add_argument("--kv-quant-residual-tokens", type=nonnegative_int, default=None,
                   help="int4/int3/int2: recent tokens whose sealed blocks keep a 16-bit copy (default: int4 0, int3 0, int2 32)")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="KV cache budget in bytes, side pools of int4/int3/int2 included (default 512 MiB)")
    p.add_argument("--kv-cache-memory-fraction", type=float, default=None,
                   help="KV budget as a fraction in (0, 1] of the memory left: CUDA free memory after the weights "
                        "and a profiled forward pass, or available RAM on the CPU (not vLLM's "
                        "gpu_memory_utilization, a fraction of total memory); excludes --kv-cache-memory-bytes "
                        "and --num-blocks")
    p.add_argument("--num-blocks", type=int, default=None, help="exact number of KV blocks (overrides the budget)")
    p.add_argument("--dtype", default="auto", type=model_dtype, help=DTYPE_HELP)
    p.add_argument("--weights-dtype", default="auto", help=WEIGHTS_DTYPE_HELP)
    p.add_argument("--threads", type=positive_int, default=None, help=threads_help())
    p.add_argument("--attention-backend", default="auto", choices=["auto", "cpu", "reference", "triton"],
                   help="attention kernels: auto (kvpage's C++ kernels on the CPU, Triton kernels on CUDA, where "
                        "they serve the format; else reference), cpu or triton (refused at start-up where they "
                        "cannot serve), reference (PyTorch SDPA)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's context)")
    p.add_argument("--max-num-seqs", type=positive_int, default=64,
                   help="requests running at once (default 64; sizes the side pools of int4/int3/int2)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   type=json_object_arg("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'),
                   help='speculative decoding, as vLLM\'s flag: a JSON object such as \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 5}\'; methods ngram, draft_model '
                        '(with "model": PATH), layer_skip (with "num_layers": N) (default: none)')
    p.add_argument("--prefix-caching-hash-algo", default=DEFAULT_HASH_ALGO, choices=HASH_ALGOS,
                   help="block hash of the prefix cache: kvpage (own scheme, default) or sha256_cbor (vLLM's, "
                        "which KV-aware routers recompute; root from $PYTHONHASHSEED, else vLLM's default seed)")
    p.add_argument("--kv-events-config", default=None, metavar="JSON",
                   type=json_object_arg("--kv-events-config",
                                        '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}'),
                   help='KV cache events on a ZeroMQ socket in vLLM\'s format, as vLLM\'s flag: a JSON object such '
                        'as \'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
                        '"replay_endpoint": "tcp://*:5558", "topic": "kv-events"}\'; also buffer_steps, hwm, '
                        'max_queue_size, publisher (zmq, null), encoding (tagged, array), block_hash_format (int, bytes) '
                        '(default: none)')
    _add_tier_args(p)


def _add_tier_args(p: argparse.ArgumentParser) -> None:
    """KV tier flags (host tier, swap preemption, disk and Redis stores), passed to ``LLM`` by :func:`build_llm`."""
    p.add_argument("--swap-space", type=float, default=0.0,
                   help="host (CPU) KV tier in GiB (default 0: none); blocks come back from it on a prefix hit")
    p.add_argument("--kv-offload-policy", default="write_through",
                   choices=["write_through", "write_through_selective", "write_back"],
                   help="when blocks go to the host tier: when cached, once used twice, or on device eviction")
    p.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"],
                   help="preempted requests: recompute later (default) or swap their blocks to the host tier")
    p.add_argument("--kv-disk-dir", default=None, help="directory of a persistent disk store of KV blocks")
    p.add_argument("--kv-disk-max-bytes", type=int, default=None, help="size cap of the disk store in bytes (LRU)")
    p.add_argument("--kv-store", default=None, help="URL of a KV block store shared between instances: redis://host:port/db "
                   "(also rediss://, unix://), redis+cluster://h1:p1,h2:p2,... (a Redis Cluster) or disk:///dir")
    p.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                   type=json_object_arg("--kv-transfer-config",
                                        '{"kv_connector": "KVPageStoreConnector", "kv_role": "kv_producer", '
                                        '"kv_connector_extra_config": {"kv_store": "redis://host:6379/0"}}'),
                   help='prefill/decode disaggregation over the shared store, as vLLM\'s flag: a JSON object such as '
                        '\'{"kv_connector": "KVPageStoreConnector", "kv_role": "kv_producer", '
                        '"kv_connector_extra_config": {"kv_store": "redis://host:6379/0"}}\'; roles kv_producer '
                        '(prefill: writes blocks to the store before answering), kv_consumer (decode: loads them), '
                        'kv_both (default: none)')


def build_llm(args: argparse.Namespace, **extra: Any) -> LLM:
    """An :class:`~kvpage.engine.llm.LLM` from the shared engine flags (see :func:`add_engine_args`) plus ``extra``.

    Raises:
        as :class:`~kvpage.engine.llm.LLM`; an error about ``kv_layer_dtypes`` names ``--kv-layer-dtypes``.
    """
    from kvpage.engine.llm import LLM

    speculative = getattr(args, "speculative_config", None)
    if speculative is not None:  # passed only when given, like vLLM's flag (default: no speculation)
        extra = {"speculative_config": speculative, **extra}
    kv_events = getattr(args, "kv_events_config", None)
    if kv_events is not None:
        extra = {"kv_events_config": kv_events, **extra}
    kv_transfer = getattr(args, "kv_transfer_config", None)
    if kv_transfer is not None:
        extra = {"kv_transfer_config": kv_transfer, **extra}
    try:
        return LLM(
            args.model,
            kv_cache_dtype=args.kv_cache_dtype,
            kv_cache_scales=args.kv_cache_scales,
            kv_layer_dtypes=getattr(args, "kv_layer_dtypes", None) or None,
            block_size=args.block_size,
            kv_quant_residual_tokens=args.kv_quant_residual_tokens,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            kv_cache_memory_fraction=args.kv_cache_memory_fraction,
            num_blocks=args.num_blocks,
            dtype=args.dtype,
            weights_dtype=args.weights_dtype,
            num_threads=args.threads,
            attention_backend=args.attention_backend,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            prefix_caching_hash_algo=args.prefix_caching_hash_algo,
            swap_space=args.swap_space,
            kv_offload_policy=args.kv_offload_policy,
            preemption_mode=args.preemption_mode,
            kv_disk_dir=args.kv_disk_dir,
            kv_disk_max_bytes=args.kv_disk_max_bytes,
            kv_store=args.kv_store,
            **extra,
        )
    except (ValueError, KVPageError) as e:  # e.g. a --kv-layer-dtypes layer beyond the model's: name the flag
        name_flags(e, ENGINE_FLAGS)
        raise

