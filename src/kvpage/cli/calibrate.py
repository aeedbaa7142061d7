"""``kvpage calibrate``: static K/V scales for ``int8_static`` / ``fp8_static`` measured on sample text.

The measuring is :mod:`kvpage.eval.calibrate`'s; this module reads the flags, loads the model and writes the file.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any

from kvpage.engine.args import DTYPE_HELP, check_output_file, model_dtype, positive_int, read_text_file, threads_help


def add_calibrate_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``calibrate`` sub-command to ``sub`` (an ``add_subparsers()`` result); returns its parser."""
    c = sub.add_parser("calibrate", help="calibrate static K/V scales (int8_static, fp8_static) on sample text")
    c.add_argument("--text", required=True,
                   help="UTF-8 text file to calibrate on (encoded as the model's tokenizer does: BOS first where "
                        "it adds one; see --bos)")
    c.add_argument("--out", required=True, help="scales file to write (safetensors), e.g. scales.safetensors")
    c.add_argument("--model", default=None, help="path to a .gguf file or a Hugging Face folder (default: bundled SmolLM2-135M-Instruct)")
    c.add_argument("--tokens", type=positive_int, default=2048, help="calibrate on the text's first N tokens (default 2048)")
    c.add_argument("--chunk-size", type=positive_int, default=512, help="tokens per forward pass (default 512)")
    c.add_argument("--dtype", default="auto", type=model_dtype, help=DTYPE_HELP)
    c.add_argument("--threads", type=positive_int, default=None, help=threads_help())
    c.add_argument("--bos", action=argparse.BooleanOptionalAction, default=None,
                   help="--bos: put the tokenizer's BOS first; --no-bos: no special tokens (default: as the "
                        "tokenizer's configuration says)")
    c.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bar (default on)")
    c.set_defaults(func=run_calibrate)
    return c


def run_calibrate(args: argparse.Namespace) -> int:
    """``kvpage calibrate``: per-layer K/V absmax on sample text -> a scales file for int8_static / fp8_static.

    ``--text`` (UTF-8) and ``--out`` (a writable file path) are checked before the model loads.
    """
    from pathlib import Path

    from kvpage.engine.llm import resolve_dtype
    from kvpage.engine.threads import apply_num_threads
    from kvpage.eval.calibrate import calibrate, summarize
    from kvpage.model.loader import load_model

    dtype = resolve_dtype(args.dtype)  # bad flags fail before the model loads
    text_path = Path(args.text)
    text = read_text_file(text_path, "--text")
    check_output_file(args.out, "--out")  # a directory or unwritable --out fails now, not after calibrating
    threads = apply_num_threads(args.threads)
    print(f"[kvpage] calibrate: {threads.num_threads} torch thread(s) ({threads.reason})", file=sys.stderr,
          flush=True)
    loaded = load_model(args.model, dtype=dtype, progress=args.progress)
    scales = calibrate(loaded, text, num_tokens=args.tokens, chunk_size=args.chunk_size, progress=args.progress,
                       bos=args.bos)
    out = scales.save(args.out, {"text": text_path.name})
    cfg = loaded.config
    print(f"[kvpage] calibrated {cfg.num_layers} layers x {cfg.num_kv_heads} kv heads x {cfg.head_dim} channels "
          f"on {scales.metadata['tokens']} tokens of {text_path} "
          f"({'BOS first' if scales.metadata['bos'] == 'true' else 'no BOS'}, {scales.metadata['dtype']})")
    for line in summarize(scales):
        print(f"[kvpage] {line}")
    print(f"[kvpage] wrote {out} (sha256 {scales.sha256[:16]}...); use it with "
          f"--kv-cache-dtype int8_static|fp8_static --kv-cache-scales {out}")
    return 0
