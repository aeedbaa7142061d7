"""Tables, ``results.json`` and the Δppl- and KLD-vs-bits plots of a set of :class:`PerplexityResult`.

The first result is the baseline (the unquantized cache, ``auto``); Δppl % of
each result is ``100 * (ppl / baseline.ppl - 1)``; KLD and top-1 agreement are the
results' :class:`~kvpage.eval.divergence.Divergence` against it.
"""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvpage.eval.perplexity import PerplexityResult


def cpu_model_name() -> str:
    """This machine's CPU model (``/proc/cpuinfo``'s ``model name``), else ``platform.processor()`` or the architecture."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()

#: Version of the ``results.json`` layout (2: each row's ``divergence``; 3: its ``depth`` split).
RESULTS_SCHEMA_VERSION = 3
#: A rest-over-first KLD ratio above this is flagged in the depth tables (the issue's "worse by more than 2x").
DEPTH_KLD_RATIO_FLAG = 2.0


def delta_ppl_percent(result: PerplexityResult, baseline: PerplexityResult) -> float:
    """Relative perplexity change against ``baseline``, in percent (``+0.6`` = 0.6 % worse)."""
    return 100.0 * (result.ppl / baseline.ppl - 1.0)


def format_table(results: Sequence[PerplexityResult]) -> str:
    """A fixed-width text table, one row per result, against ``results[0]``.

    Columns: format, effective bits/value, KV bytes/token, ppl, Δppl % and its standard error
    (percentage points), mean KLD and its standard error, 99th-percentile KLD (nats), same-top-token
    % and its standard error, seconds. Divergence columns read ``-`` for a result without one.
    Under the rows, :func:`side_parts_note` when a format's figure includes side parts.

    Raises:
        ValueError: no results.
    """
    if not results:
        raise ValueError("no results to tabulate")
    base = results[0]
    width = max(10, *(len(r.name) for r in results))
    head = (f"{'format':<{width}} {'bits/value':>10} {'KV B/token':>11} {'ppl':>9} {'Δppl %':>8} {'± se':>5} "
            f"{'KLD':>9} {'± se':>9} {'KLD p99':>8} {'top-1 %':>7} {'± se':>5} {'seconds':>8}")
    lines = [head, "-" * len(head)]
    for r in results:
        d = "baseline" if r is base else f"{delta_ppl_percent(r, base):+.2f}"
        v = r.divergence
        div = ((f"{v.delta_ppl_se_percent:>5.2f} {v.kld_mean:>9.6f} {v.kld_se:>9.6f} {v.kld_p99:>8.5f} "
                f"{v.top1_percent:>7.2f} {v.top1_se_percent:>5.2f}") if v is not None
               else f"{'-':>5} {'-':>9} {'-':>9} {'-':>8} {'-':>7} {'-':>5}")
        lines.append(f"{r.name:<{width}} {r.bits_per_value:>10.3f} {r.kv_bytes_per_token:>11,.0f} "
                     f"{r.ppl:>9.3f} {d:>8} {div} {r.seconds:>8.1f}")
    return "\n".join(lines + side_parts_note(results))


def side_parts_note(results: Sequence[PerplexityResult]) -> list[str]:
    """Lines that say what the bits/value of the quantize-on-seal rows hold besides their codes, or ``[]``.

    Over a short text the side parts (the open block and the window in 16 bits, the first block in 8 bits)
    weigh much: int4 and int2 can show the same figure over 256 tokens although int2's codes are half
    as large. For each row whose figure exceeds its ``steady_bits_per_value`` (codes, scales and zero
    points alone): the tokens also held in 16 bits and the steady figure; then one line per set of rows
    that show the same figure but differ in the steady one. Rows without a steady figure (older
    ``results.json``) are left out.
    """
    rows = [r for r in results if r.steady_bits_per_value is not None
            and r.bits_per_value > r.steady_bits_per_value * (1 + 1e-6)]
    if not rows:
        return []
    out = [f"bits/value counts all that the text's tokens hold; quantize-on-seal formats add side parts (open "
           f"block in 16 bits, window in 16 or 8, first block in 8) whose share shrinks as the text grows:"]
    for r in rows:
        out.append(f"  {r.name}: {r.full_precision_tokens:,} of {r.num_tokens:,} tokens also held in 16 bits; "
                   f"{r.steady_bits_per_value:.3f} bits/value for codes and scales alone (long texts)")
    same: dict[str, list[PerplexityResult]] = {}
    for r in results:
        same.setdefault(f"{r.bits_per_value:.3f}", []).append(r)
    for bits, group in same.items():
        steady = {f"{r.steady_bits_per_value:.3f}" for r in group if r.steady_bits_per_value is not None}
        if len(group) > 1 and len(steady) > 1 and any(r in rows for r in group):
            names = " and ".join(r.name for r in group)
            out.append(f"  {names} show the same {bits} bits/value over these {group[0].num_tokens:,} tokens only "
                       f"because of the side parts; their codes and scales alone cost "
                       f"{' vs '.join(f'{r.steady_bits_per_value:.3f}' for r in group)}")
    return out


def format_depth_table(results: Sequence[PerplexityResult]) -> str | None:
    """KLD and Δppl by depth: the first ``split`` scored positions, the rest, and their KLD ratio, per result.

    Columns: format, then for each part its mean KLD ± se (nats) and Δppl % ± se (percentage points),
    then ``rest / first`` KLD and a ``!`` where that ratio exceeds :data:`DEPTH_KLD_RATIO_FLAG`. A
    result without a depth split, or whose text is too short for a rest part, reads ``-`` there.

    Returns:
        The table, or ``None`` when no result has a rest part (every text ``<= split + 1`` tokens).
    """
    splits = [r.divergence.depth for r in results if r.divergence is not None and r.divergence.depth is not None]
    deep = [s for s in splits if s.rest is not None]
    if not deep:
        return None
    split, stop = deep[0].split, max(s.rest.stop for s in deep if s.rest is not None)
    first_h, rest_h = f"first {split:,} positions", f"positions {split:,}-{stop - 1:,}"
    width = max(10, *(len(r.name) for r in results))
    title = f"{'':<{width}} | {first_h:^38} | {rest_h:^38} |"
    head = (f"{'format':<{width}} | {'KLD':>9} {'± se':>9} {'Δppl %':>8} {'± se':>8} | "
            f"{'KLD':>9} {'± se':>9} {'Δppl %':>8} {'± se':>8} | {'rest/first':>10}")
    lines = [title, head, "-" * len(head)]
    for r in results:
        dep = r.divergence.depth if r.divergence is not None else None
        cells = []
        for part in ((dep.first, dep.rest) if dep is not None else (None, None)):
            cells.append(f"{part.kld_mean:>9.6f} {part.kld_se:>9.6f} {part.delta_ppl_percent:>+8.2f} "
                         f"{part.delta_ppl_se_percent:>8.2f}" if part is not None
                         else f"{'-':>9} {'-':>9} {'-':>8} {'-':>8}")
        ratio = dep.kld_ratio() if dep is not None else None
        flag = " !" if ratio is not None and ratio > DEPTH_KLD_RATIO_FLAG else ""
        lines.append(f"{r.name:<{width}} | {cells[0]} | {cells[1]} | "
                     f"{'-' if ratio is None else f'{ratio:.2f}':>10}{flag}")
    lines.append(f"(! marks a rest/first KLD ratio above {DEPTH_KLD_RATIO_FLAG:g})")
    return "\n".join(lines)


def results_payload(results: Sequence[PerplexityResult], **meta: Any) -> dict[str, Any]:
    """The ``results.json`` content: ``meta`` (model, text, machine, ...), baseline name, and one row per result.

    Each row is :meth:`PerplexityResult.to_dict` (its ``divergence`` a nested dict of
    :class:`~kvpage.eval.divergence.Divergence` fields, or ``null``; inside it ``depth``: ``split``,
    ``first`` and ``rest`` (``null`` for a text of ``split + 1`` tokens or fewer), each a
    :class:`~kvpage.eval.divergence.DepthPart` dict) plus ``delta_ppl_percent`` (``0.0`` for the baseline).

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


def _bits_axis(ax: Any, bits: Sequence[float]) -> None:
    """Log2 x axis over ``bits`` (effective bits per value) with power-of-two ticks plus each format's own bits."""
    import matplotlib.ticker

    ax.set_xscale("log", base=2)
    lo, hi = min(bits), max(bits)
    ax.set_xlim(lo / 1.25, hi * 1.6)
    ticks = [2.0 ** k for k in range(0, 7) if lo / 1.25 <= 2.0 ** k <= hi * 1.6]
    for b in sorted(bits):  # each format's bits, unless a tick is that close
        if all(abs(math.log2(b / t)) > 0.2 for t in ticks):
            ticks.append(round(b, 2))
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xticks(sorted(ticks))
    ax.set_xticklabels([f"{t:g}" for t in sorted(ticks)], fontsize=8)


def spread_positions(ys: Sequence[float], gap: float, lo: float = 0.0, hi: float = 1.0) -> list[float]:
    """Label positions at least ``gap`` apart, each as near its ``ys[i]`` as that allows, in the same order.

    A deterministic 1-D layout (no label-repelling package needed): sorted by ``(y, index)``, an upward
    sweep pushes each position to ``>= previous + gap`` (and ``>= lo``), then a downward sweep pulls them
    under ``hi`` keeping the gaps. When ``n`` labels need more than ``hi - lo`` the lowest start below ``lo``
    rather than overlap. All values in one unit (e.g. axes fraction).

    Raises:
        ValueError: ``gap <= 0``.
    """
    if gap <= 0:
        raise ValueError(f"gap must be > 0, got {gap}")
    order = sorted(range(len(ys)), key=lambda i: (ys[i], i))
    pos = [float(ys[i]) for i in order]
    for k in range(len(pos)):
        pos[k] = max(pos[k], lo if k == 0 else pos[k - 1] + gap)
    for k in reversed(range(len(pos))):
        pos[k] = min(pos[k], hi if k == len(pos) - 1 else pos[k + 1] - gap)
    out = [0.0] * len(ys)
    for k, i in enumerate(order):
        out[i] = pos[k]
    return out


def plot_kld_vs_bits(path: str | Path, results: Sequence[PerplexityResult], *, title: str | None = None) -> Path:
    """Save a PNG of mean KLD against the baseline (y, log scale) vs effective bits per value (x, log2).

    One filled point with a ±se error bar per compared format, its 99th-percentile KLD as a hollow
    triangle above it. Labels (``name KLD``) sit in a column right of the axes at
    :func:`spread_positions` heights, each joined to its point by a thin line, so formats with the
    same bits (the 8-bit ones) never overprint. The baseline (``results[0]``, KLD 0) is named in the
    title; a compared format with KLD exactly 0 is drawn on the axis floor, labelled ``KLD 0``.
    Results without a ``divergence`` are skipped. Uses matplotlib's Agg backend.

    Raises:
        ValueError: no result after the first has a ``divergence``.
    """
    rows = [r for r in results[1:] if r.divergence is not None]
    if not rows:
        raise ValueError("no compared result with a divergence to plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = results[0]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    divs = [r.divergence for r in rows if r.divergence is not None]
    positive = [v for d in divs for v in (d.kld_mean, d.kld_p99) if v > 0]
    floor = min(positive) / 4 if positive else 1e-6
    top = max([d.kld_p99 for d in divs] + [d.kld_mean + d.kld_se for d in divs] + [floor * 10])
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=110)
    try:
        _bits_axis(ax, [r.bits_per_value for r in rows])
        ax.set_yscale("log")
        ax.set_ylim(floor / 1.5, top * 2.5)
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        frac: list[float] = []
        for i, (r, d) in enumerate(zip(rows, divs)):
            c = colors[i % len(colors)]
            y = max(d.kld_mean, floor)
            ax.errorbar([r.bits_per_value], [y], yerr=[[min(d.kld_se, y - floor / 1.5)], [d.kld_se]], fmt="o",
                        ms=6, color=c, capsize=3, zorder=3, label="mean KLD ± se" if i == 0 else None)
            ax.scatter([r.bits_per_value], [max(d.kld_p99, floor)], marker="^", s=30, facecolors="none",
                       edgecolors=c, zorder=3, label="99th percentile" if i == 0 else None)
            frac.append(float(ax.transAxes.inverted().transform(ax.transData.transform((r.bits_per_value, y)))[1]))
        gap = 1.35 * 8 / 72 * fig.dpi / (ax.get_position().height * fig.get_figheight() * fig.dpi)  # 8 pt lines
        for i, (r, d, yf) in enumerate(zip(rows, divs, spread_positions(frac, gap))):
            label = f"{r.name} {d.kld_mean:.3g}" if d.kld_mean > 0 else f"{r.name} KLD 0"
            ax.annotate(label, xy=(r.bits_per_value, max(d.kld_mean, floor)), xycoords="data", xytext=(1.03, yf),
                        textcoords="axes fraction", va="center", fontsize=8, color=colors[i % len(colors)],
                        annotation_clip=False,
                        arrowprops=dict(arrowstyle="-", lw=0.6, ls=":", color=colors[i % len(colors)]))
        ax.set_xlabel("effective bits per cached value (codes, scales, full-precision parts)")
        ax.set_ylabel(f"KL(P_{base.name} || P_format) per token (nats)")
        ax.set_title(title or f"{base.num_tokens} tokens, {base.mode} mode; vs unquantized cache ({base.name})",
                     fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8, loc="lower left")
        fig.tight_layout()
        fig.savefig(path, format="png", bbox_inches="tight")
    finally:
        plt.close(fig)
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
        _bits_axis(ax, [r.bits_per_value for r in results])
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

