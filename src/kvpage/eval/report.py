"""Tables, ``results.json`` and the Δppl-vs-bits plot of a set of :class:`PerplexityResult`.

The first result is the baseline (the unquantized cache, ``auto``); Δppl % of
each result is ``100 * (ppl / baseline.ppl - 1)``.
"""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvpage.eval.perplexity import PerplexityResult

#: Version of the ``results.json`` layout.
RESULTS_SCHEMA_VERSION = 1


def delta_ppl_percent(result: PerplexityResult, baseline: PerplexityResult) -> float:
    """Relative perplexity change against ``baseline``, in percent (``+0.6`` = 0.6 % worse)."""
    return 100.0 * (result.ppl / baseline.ppl - 1.0)


def format_table(results: Sequence[PerplexityResult]) -> str:
    """A fixed-width text table: format, bits/value, KV bytes/token, ppl, Δppl % (against ``results[0]``), seconds.

    Raises:
        ValueError: no results.
    """
    if not results:
        raise ValueError("no results to tabulate")
    base = results[0]
    width = max(10, *(len(r.name) for r in results))
    head = f"{'format':<{width}} {'bits/value':>10} {'KV B/token':>11} {'ppl':>9} {'Δppl %':>8} {'seconds':>8}"
    lines = [head, "-" * len(head)]
    for r in results:
        d = "baseline" if r is base else f"{delta_ppl_percent(r, base):+.2f}"
        lines.append(f"{r.name:<{width}} {r.bits_per_value:>10.3f} {r.kv_bytes_per_token:>11,.0f} "
                     f"{r.ppl:>9.3f} {d:>8} {r.seconds:>8.1f}")
    return "\n".join(lines)


def results_payload(results: Sequence[PerplexityResult], **meta: Any) -> dict[str, Any]:
    """The ``results.json`` content: ``meta`` (model, text, machine, ...), baseline name, and one row per result.

    Each row is :meth:`PerplexityResult.to_dict` plus ``delta_ppl_percent`` (``0.0`` for the baseline).

    Raises:
        ValueError: no results.
    """
    if not results:
        raise ValueError("no results")
    base = results[0]
    rows = [{**r.to_dict(), "delta_ppl_percent": delta_ppl_percent(r, base)} for r in results]
    return {"schema_version": RESULTS_SCHEMA_VERSION, **meta, "baseline": base.name, "results": rows}


def write_results_json(path: str | Path, results: Sequence[PerplexityResult], **meta: Any) -> Path:
    """Write :func:`results_payload` to ``path`` (parents created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results_payload(results, **meta), indent=2) + "\n", encoding="utf-8")
    return path


def plot_ppl_vs_bits(path: str | Path, results: Sequence[PerplexityResult], *, title: str | None = None) -> Path:
    """Save a PNG of Δppl % (y) against effective bits per value (x, log2 scale), one labelled point per format.

    The baseline (``results[0]``) is the horizontal line at 0. The y axis turns symmetric-log
    when some Δ exceeds 25 %, so a collapsed format doesn't flatten the others. Uses
    matplotlib's Agg backend (no display needed).

    Raises:
        ValueError: no results.
    """
    if not results:
        raise ValueError("no results to plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.ticker
    import matplotlib.pyplot as plt

    base = results[0]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    try:
        ax.axhline(0.0, color="grey", lw=1, ls="--", label=f"unquantized cache ({base.name}, ppl {base.ppl:.3f})")
        deltas = [delta_ppl_percent(r, base) for r in results]
        # Formats with the same bits per value (the 8-bit ones) get their labels stacked, not overprinted.
        stack: dict[float, int] = {}
        for r, d in sorted(zip(results, deltas), key=lambda rd: rd[1]):
            ax.scatter([r.bits_per_value], [d], s=36, zorder=3)
            k = stack.get(round(r.bits_per_value, 3), 0)
            stack[round(r.bits_per_value, 3)] = k + 1
            ax.annotate(f"{r.name} {d:+.2f}%", (r.bits_per_value, d), textcoords="offset points",
                        xytext=(6, -4 + 11 * k), fontsize=8)
        ax.set_xscale("log", base=2)
        lo = min(r.bits_per_value for r in results)
        hi = max(r.bits_per_value for r in results)
        ax.set_xlim(lo / 1.25, hi * 1.6)
        ticks = [2.0 ** k for k in range(0, 7) if lo / 1.25 <= 2.0 ** k <= hi * 1.6]
        for b in sorted(r.bits_per_value for r in results):  # each format's bits, unless a tick is that close
            if all(abs(math.log2(b / t)) > 0.2 for t in ticks):
                ticks.append(round(b, 2))
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xticks(sorted(ticks))
        ax.set_xticklabels([f"{t:g}" for t in sorted(ticks)], fontsize=8)
        ax.margins(y=0.2)
        if max(abs(d) for d in deltas) > 25:
            ax.set_yscale("symlog", linthresh=1.0)
        ax.set_xlabel("effective bits per cached value (codes, scales, full-precision parts)")
        ax.set_ylabel("Δ perplexity vs unquantized cache (%)")
        ax.set_title(title or f"{base.num_tokens} tokens, {base.mode} mode", fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
        fig.tight_layout()
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
    return path

