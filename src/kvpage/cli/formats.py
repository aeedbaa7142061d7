"""``kvpage formats``: every KV format's aliases, bits per value and tokens that fit at a budget, for a model's shape.

Its header names the layer groups in :func:`kvpage.cli.generate.group_formula`'s words.
"""
from __future__ import annotations

import argparse
from typing import Any

from kvpage.cli.generate import group_formula
from kvpage.engine.args import positive_int


def add_formats_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``formats`` sub-command to ``sub`` (an ``add_subparsers()`` result); returns its parser."""
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
                   help="requests at once, which size int4/int3/int2's side pools (default 64)")
    f.add_argument("--block-size", type=positive_int, default=None,
                   help="tokens per block (default: each format's, 16; 32 for int4/int3/int2)")
    f.set_defaults(func=run_formats)
    return f


def run_formats(args: argparse.Namespace) -> int:
    """``kvpage formats``: every format's aliases, bits per value, and tokens that fit at ``--budget-bytes``."""
    from kvpage.engine.sizing import SMOLLM2_SHAPE, Shape, model_shape
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
    block = ("each format's default block size (16; 32 for int4/int3/int2)" if args.block_size is None
             else f"block {args.block_size}")
    default = ("" if (args.num_layers, args.num_kv_heads, args.head_dim) != (None, None, None) else
               " (SmolLM2-135M)" if args.model is None else f" ({args.model})")
    spec = CacheSpec.build(num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                           has_value=shape.kv_has_value, layer_windows=shape.layer_windows)
    groups = "; ".join(f"{g.name}: {group_formula(g).split(' x ', 1)[0]}"
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
