"""The capacity table of every KV format at one budget: ``kvpage formats``, the README table, ``python -m kvpage.engine.format_table``.

Each row is :func:`~kvpage.engine.sizing.kv_capacity` of one format against the float32 and bfloat16 caches.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpage.engine.sizing import MiB, SMOLLM2_SHAPE, CapacityReport, ModelShape, kv_capacity


@dataclass(frozen=True)
class FormatRow:
    """One format's capacity at a budget, against the float32 and bfloat16 caches (README table, ``kvpage formats``).

    Attributes:
        name: the format.
        report: the format's :class:`CapacityReport` (model dtype float32); ``None`` when the budget
            holds no block of it after its side pools.
        float32_tokens, bfloat16_tokens: tokens those caches hold in the same budget.
    """

    name: str
    report: CapacityReport | None
    float32_tokens: int
    bfloat16_tokens: int


def format_rows(model: ModelShape = SMOLLM2_SHAPE, budget_bytes: int = 512 * MiB, *,
                formats: list[str] | None = None, block_size: int | None = None,
                max_num_seqs: int | None = None) -> list[FormatRow]:
    """:func:`kv_capacity` of each format (default: every registered one but ``auto``) at one budget.

    Static-scale formats are sized with unit scales (their bytes do not depend on the values).
    ``max_num_seqs`` (sizes the side pools) defaults to :class:`~kvpage.engine.config.EngineConfig`'s.
    A format whose side pools leave no block in the budget, or that refuses ``block_size``, gets ``report=None``.

    Raises:
        UnknownKVFormatError: a name in ``formats`` is no format.
    """
    from kvpage.engine.config import EngineConfig
    from kvpage.formats import available_formats, get_format, needs_static_scales
    from kvpage.scales import StaticScales

    names = [n for n in (formats or available_formats()) if n != "auto"]
    extra: dict[str, Any] = {} if max_num_seqs is None else {"max_num_seqs": max_num_seqs}
    unit = StaticScales({i: 1.0 for i in range(model.num_layers)}, {i: 1.0 for i in range(model.num_layers)})

    def report(name: str) -> CapacityReport | None:
        scales = unit if needs_static_scales(get_format(name)) else None
        try:
            return kv_capacity(EngineConfig(kv_cache_dtype=name, kv_cache_scales=scales, block_size=block_size,
                                            kv_cache_memory_bytes=budget_bytes, **extra), model)
        except ValueError:  # BudgetTooSmallError, or a block size the format refuses
            return None

    f32, bf16 = (getattr(report(n), "tokens", 0) for n in ("float32", "bfloat16"))
    return [FormatRow(n, report(n), f32, bf16) for n in names]


def markdown_table(rows: list[FormatRow]) -> str:
    """The README's capacity table: format, bytes/token, side pools, tokens that fit, ratios to float32 and bfloat16."""
    budget = next((r.report.budget_bytes / MiB for r in rows if r.report is not None), 0.0)
    out = [f"| format | block | bytes/token (pool) | side pools (MiB) | tokens in {budget:,.0f} MiB "
           f"| vs float32 | vs bfloat16 |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        c = r.report
        if c is None or not r.float32_tokens or not r.bfloat16_tokens:
            out.append(f"| `{r.name}` | | | | does not fit (or refuses the block size) | | |")
            continue
        out.append(f"| `{c.kv_format}` | {c.block_size} | {c.bytes_per_token:,.0f} | {c.side_pool_bytes / MiB:.1f} "
                   f"| {c.tokens:,} | {c.tokens / r.float32_tokens:.2f}x | {c.tokens / r.bfloat16_tokens:.2f}x |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """``python -m kvpage.engine.format_table [--budget-bytes N]``: print the capacity table (SmolLM2 shape) in Markdown."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m kvpage.engine.format_table", description=main.__doc__)
    p.add_argument("--budget-bytes", type=int, default=512 * MiB, help="KV budget (default 512 MiB)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="requests at once (sizes side pools; default 64)")
    args = p.parse_args(argv)
    s = SMOLLM2_SHAPE
    print(f"SmolLM2-135M ({s.num_layers} layers x {s.num_kv_heads} kv heads x head_dim {s.head_dim}), "
          f"model dtype float32, default block size and max_num_seqs; side pools included:\n")
    print(markdown_table(format_rows(s, args.budget_bytes, max_num_seqs=args.max_num_seqs)))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
