"""The summary of a ``kvpage eval --suite`` run: per format, the tuning members' means and the held-back member apart.

Each member's own table and rows are :mod:`kvpage.eval.report`'s; this module averages them over the
members formats may be tuned on and keeps the held-back member's figures in their own columns, splits
the long members' KLD by depth (:class:`DepthRow`), writes the suite's ``results.json`` (every member's
rows, its text's source and sha256, the summary, the depth rows) and renders it as Markdown.
"""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvpage.eval.divergence import DEPTH_SPLIT
from kvpage.eval.perplexity import PerplexityResult
from kvpage.eval.report import DEPTH_KLD_RATIO_FLAG, delta_ppl_percent, results_payload
from kvpage.eval.suite import ResolvedText

#: Version of the suite ``results.json`` layout (its members' rows follow ``RESULTS_SCHEMA_VERSION``;
#: 2: ``depth`` rows of the long members).
SUITE_SCHEMA_VERSION = 2
#: Members scoring at least this many tokens get a :class:`DepthRow` per format (the issue's long context).
LONG_CONTEXT_TOKENS = 4096


@dataclass(frozen=True)
class SummaryRow:
    """One format over the suite (from :func:`summarize_suite`); ``None`` where no member (or no KL) gives a value.

    Attributes:
        name: the format as asked for.
        bits_per_value: effective bits per value, mean over every member run (it depends on the length
            for quantize-on-seal formats).
        tuning_members: how many tuning (not held-back) members the means are over.
        tuning_delta_ppl_percent: mean Δppl % against the baseline over the tuning members.
        tuning_kld_mean: mean over the tuning members of each one's mean KLD, in nats.
        tuning_top1_percent: mean same-top-token % over the tuning members.
        held_back_delta_ppl_percent: the held-back member's Δppl %.
        held_back_kld_mean: the held-back member's mean KLD, in nats.
        held_back_top1_percent: the held-back member's same-top-token %.
    """

    name: str
    bits_per_value: float
    tuning_members: int
    tuning_delta_ppl_percent: float | None
    tuning_kld_mean: float | None
    tuning_top1_percent: float | None
    held_back_delta_ppl_percent: float | None
    held_back_kld_mean: float | None
    held_back_top1_percent: float | None

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return asdict(self)


def _mean(values: Sequence[float | None]) -> float | None:
    """Mean of ``values``, ``None`` if empty or any is ``None`` (a mean over a subset would mislead)."""
    if not values or any(v is None for v in values):
        return None
    return math.fsum(v for v in values if v is not None) / len(values)


def summarize_suite(runs: Sequence[tuple[ResolvedText, Sequence[PerplexityResult]]]) -> list[SummaryRow]:
    """Per format (in the first member's order), the tuning members' means and the held-back member's values.

    Args:
        runs: each member's resolved text and its results, baseline first (as from
            :func:`~kvpage.eval.perplexity.evaluate_formats`); every member runs the same formats.

    Raises:
        ValueError: no runs, or the members' format lists differ.
    """
    if not runs:
        raise ValueError("no suite runs to summarize")
    names = [r.name for r in runs[0][1]]
    for resolved, results in runs:
        if [r.name for r in results] != names:
            raise ValueError(f"member {resolved.member.name!r} ran {[r.name for r in results]}, not {names}")
    rows = []
    for i, name in enumerate(names):
        tuning = [(results[i], results[0]) for resolved, results in runs if not resolved.member.held_back]
        held = [(results[i], results[0]) for resolved, results in runs if resolved.member.held_back]
        h = held[0] if held else None
        hd = h[0].divergence if h else None
        rows.append(SummaryRow(
            name=name,
            bits_per_value=math.fsum(results[i].bits_per_value for _, results in runs) / len(runs),
            tuning_members=len(tuning),
            tuning_delta_ppl_percent=_mean([delta_ppl_percent(r, b) for r, b in tuning]),
            tuning_kld_mean=_mean([r.divergence.kld_mean if r.divergence else None for r, _ in tuning]),
            tuning_top1_percent=_mean([r.divergence.top1_percent if r.divergence else None for r, _ in tuning]),
            held_back_delta_ppl_percent=delta_ppl_percent(*h) if h else None,
            held_back_kld_mean=hd.kld_mean if hd else None,
            held_back_top1_percent=hd.top1_percent if hd else None,
        ))
    return rows


@dataclass(frozen=True)
class DepthRow:
    """One format on one long member: KLD and Δppl of its first ``split`` scored positions against the rest.

    Attributes:
        member: the member's name.
        held_back: whether it is the held-back member.
        num_tokens: tokens it scored.
        name: the format as asked for.
        split: scored positions in the first part (:data:`~kvpage.eval.divergence.DEPTH_SPLIT`).
        first_kld_mean, first_kld_se: mean KLD of positions ``[0, split)`` and its standard error, nats.
        first_delta_ppl_percent, first_delta_ppl_se_percent: Δppl % of those positions' tokens ± se.
        rest_positions: positions after the split.
        rest_kld_mean, rest_kld_se, rest_delta_ppl_percent, rest_delta_ppl_se_percent: the same for them.
        kld_ratio: ``rest_kld_mean / first_kld_mean``; ``None`` where the first part's KLD is 0 (the baseline).
        flagged: ``kld_ratio > DEPTH_KLD_RATIO_FLAG`` (deep positions diverge more than 2x as much).
    """

    member: str
    held_back: bool
    num_tokens: int
    name: str
    split: int
    first_kld_mean: float
    first_kld_se: float
    first_delta_ppl_percent: float
    first_delta_ppl_se_percent: float
    rest_positions: int
    rest_kld_mean: float
    rest_kld_se: float
    rest_delta_ppl_percent: float
    rest_delta_ppl_se_percent: float
    kld_ratio: float | None
    flagged: bool

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict."""
        return asdict(self)


def member_depth_rows(member: str, held_back: bool, results: Sequence[PerplexityResult],
                      min_tokens: int | None = None) -> list[DepthRow]:
    """:class:`DepthRow` per result of one member that scored ``>= min_tokens`` tokens (else ``[]``;
    ``None``: :data:`LONG_CONTEXT_TOKENS`, read at call time).

    A result without a divergence, or without a rest part, gives no row (``--no-kl-divergence``, or a
    ``results.json`` written before the depth split).
    """
    min_tokens = LONG_CONTEXT_TOKENS if min_tokens is None else min_tokens
    rows: list[DepthRow] = []
    for r in results:
        dep = r.divergence.depth if r.divergence is not None else None
        if r.num_tokens < min_tokens or dep is None or dep.rest is None:
            continue
        ratio = dep.kld_ratio()
        rows.append(DepthRow(
            member=member, held_back=held_back, num_tokens=r.num_tokens, name=r.name, split=dep.split,
            first_kld_mean=dep.first.kld_mean, first_kld_se=dep.first.kld_se,
            first_delta_ppl_percent=dep.first.delta_ppl_percent,
            first_delta_ppl_se_percent=dep.first.delta_ppl_se_percent,
            rest_positions=dep.rest.num_positions, rest_kld_mean=dep.rest.kld_mean, rest_kld_se=dep.rest.kld_se,
            rest_delta_ppl_percent=dep.rest.delta_ppl_percent,
            rest_delta_ppl_se_percent=dep.rest.delta_ppl_se_percent,
            kld_ratio=ratio, flagged=ratio is not None and ratio > DEPTH_KLD_RATIO_FLAG))
    return rows


def depth_rows(runs: Sequence[tuple[ResolvedText, Sequence[PerplexityResult]]],
               min_tokens: int | None = None) -> list[DepthRow]:
    """:func:`member_depth_rows` of every member that scored ``>= min_tokens`` tokens, in suite order."""
    return [row for resolved, results in runs
            for row in member_depth_rows(resolved.member.name, resolved.member.held_back, results, min_tokens)]


def payload_depth_rows(payload: dict[str, Any], min_tokens: int | None = None) -> list[DepthRow]:
    """:func:`member_depth_rows` recomputed from a suite ``results.json`` payload's member rows (``min_tokens``
    ``None``: the payload's ``depth_min_tokens``, else :data:`LONG_CONTEXT_TOKENS`).

    Works on any suite schema: members whose rows predate the depth split (suite schema 1) give none.
    """
    if min_tokens is None:
        min_tokens = int(payload.get("depth_min_tokens", LONG_CONTEXT_TOKENS))
    return [row for m in payload["members"]
            for row in member_depth_rows(m["name"], bool(m.get("held_back")),
                                         [PerplexityResult.from_dict(r) for r in m["results"]], min_tokens)]


def format_depth_summary(rows: Sequence[DepthRow]) -> str | None:
    """A fixed-width table of :class:`DepthRow` s: member, format, KLD ± se and Δppl % of both parts, the ratio.

    A ``!`` follows a ratio above :data:`~kvpage.eval.report.DEPTH_KLD_RATIO_FLAG`. ``None`` for no rows.
    """
    if not rows:
        return None
    mw = max(6, *(len(r.member) for r in rows))
    fw = max(6, *(len(r.name) for r in rows))
    split = rows[0].split
    head = (f"{'member':<{mw}} {'format':<{fw}} | {f'KLD <{split}':>10} {'± se':>9} {'Δppl %':>7} | "
            f"{f'KLD >={split}':>10} {'± se':>9} {'Δppl %':>7} | {'rest/first':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = "-" if r.kld_ratio is None else f"{r.kld_ratio:.2f}"
        lines.append(f"{r.member:<{mw}} {r.name:<{fw}} | {r.first_kld_mean:>10.6f} {r.first_kld_se:>9.6f} "
                     f"{r.first_delta_ppl_percent:>+7.2f} | {r.rest_kld_mean:>10.6f} {r.rest_kld_se:>9.6f} "
                     f"{r.rest_delta_ppl_percent:>+7.2f} | {ratio:>10}{' !' if r.flagged else ''}")
    lines.append(f"(! marks a rest/first KLD ratio above {DEPTH_KLD_RATIO_FLAG:g})")
    return "\n".join(lines)


def _cell(value: float | None, spec: str, width: int) -> str:
    """``value`` formatted with ``spec`` (e.g. ``+.2f``), right-aligned in ``width``; ``-`` for ``None``."""
    return ("-" if value is None else format(value, spec)).rjust(width)


def format_summary_table(rows: Sequence[SummaryRow], held_back: str | None) -> str:
    """A fixed-width table: format, mean bits, then the tuning means and the held-back member's columns.

    ``-`` marks a value no member gave (no KL, or no tuning / held-back member in the run).

    Raises:
        ValueError: no rows.
    """
    if not rows:
        raise ValueError("no summary rows to tabulate")
    width = max(10, *(len(r.name) for r in rows))
    n = rows[0].tuning_members
    tuning, held = f"tuning members ({n}), mean", f"held back: {held_back or 'not run'}"
    title = f"{'':<{width}} {'':>10} | {tuning:^28} | {held:^28}"
    head = (f"{'format':<{width}} {'bits/value':>10} | {'Δppl %':>8} {'KLD':>10} {'top-1 %':>8} | "
            f"{'Δppl %':>8} {'KLD':>10} {'top-1 %':>8}")
    lines = [title, head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.name:<{width}} {r.bits_per_value:>10.3f} | {_cell(r.tuning_delta_ppl_percent, '+.2f', 8)} "
                     f"{_cell(r.tuning_kld_mean, '.6f', 10)} {_cell(r.tuning_top1_percent, '.2f', 8)} | "
                     f"{_cell(r.held_back_delta_ppl_percent, '+.2f', 8)} {_cell(r.held_back_kld_mean, '.6f', 10)} "
                     f"{_cell(r.held_back_top1_percent, '.2f', 8)}")
    return "\n".join(lines)


def suite_payload(runs: Sequence[tuple[ResolvedText, Sequence[PerplexityResult]]], **meta: Any) -> dict[str, Any]:
    """The suite's ``results.json``: ``meta``, the held-back member's name, each member and the summary.

    Each member is :meth:`ResolvedText.to_dict` (source, kind, sha256, versions, ``held_back``) plus its
    scored ``num_tokens`` and :func:`~kvpage.eval.report.results_payload`'s ``baseline`` and ``results``
    rows; ``summary`` is :func:`summarize_suite` as dicts; ``depth`` is :func:`depth_rows` as dicts (the
    members of ``depth_min_tokens`` tokens or more, split at ``depth_split`` scored positions, flagged
    above ``depth_kld_ratio_flag``).

    Raises:
        ValueError: no runs, or the members' format lists differ.
    """
    summary = summarize_suite(runs)
    members = []
    for resolved, results in runs:
        one = results_payload(results)
        members.append({**resolved.to_dict(), "num_tokens": results[0].num_tokens,
                        "baseline": one["baseline"], "results": one["results"]})
    held = next((r.member.name for r, _ in runs if r.member.held_back), None)
    deep = depth_rows(runs)
    return {"suite_schema_version": SUITE_SCHEMA_VERSION, "schema_version": results_payload(runs[0][1])["schema_version"],
            **meta, "held_back": held, "members": members, "summary": [s.to_dict() for s in summary],
            "depth_split": deep[0].split if deep else DEPTH_SPLIT, "depth_min_tokens": LONG_CONTEXT_TOKENS,
            "depth_kld_ratio_flag": DEPTH_KLD_RATIO_FLAG, "depth": [d.to_dict() for d in deep]}


def write_suite_json(path: str | Path, runs: Sequence[tuple[ResolvedText, Sequence[PerplexityResult]]],
                     **meta: Any) -> Path:
    """Write :func:`suite_payload` to ``path`` (parents created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(suite_payload(runs, **meta), indent=2) + "\n", encoding="utf-8")
    return path


def _md(value: float | None, spec: str) -> str:
    """A Markdown table cell: ``value`` with ``spec``, or an em dash for ``None``."""
    return "—" if value is None else format(value, spec)


def members_markdown(payload: dict[str, Any]) -> str:
    """The members as a Markdown table: kind, where the text was found (and which version decided it), tokens
    scored, sha256 prefix (and whether it matched the recorded text), held back or not."""
    out = ["| member | kind | text | tokens | sha256 | held back |", "|---|---|---|---|---|---|"]
    for m in payload["members"]:
        version = f" ({m['version_of']} {m['version']})" if m.get("version_of") else ""
        same = "" if m["sha256_matches"] else " (differs from the recorded text)"
        out.append(f"| `{m['name']}` | {m['kind']} | `{m['origin']}`{version} | {m['num_tokens']:,} | "
                   f"`{m['text_sha256'][:12]}`{same} | {'**yes**' if m['held_back'] else 'no'} |")
    return "\n".join(out) + "\n"


def summary_markdown(payload: dict[str, Any]) -> str:
    """The summary per format as a Markdown table: mean bits, the tuning members' mean Δppl %, KLD and
    top-1 %, then the held-back member's (``—`` where no member gave a value)."""
    summary, held = payload["summary"], payload.get("held_back")
    n = summary[0]["tuning_members"] if summary else 0
    out = [f"| format | bits/value | Δppl, tuning mean ({n}) | KLD, tuning mean | top-1 %, tuning mean | "
           f"Δppl, held back (`{held or 'not run'}`) | KLD, held back | top-1 %, held back |",
           "|---|---|---|---|---|---|---|---|"]
    for s in summary:
        out.append(f"| `{s['name']}` | {s['bits_per_value']:.3f} | {_md(s['tuning_delta_ppl_percent'], '+.2f')}% | "
                   f"{_md(s['tuning_kld_mean'], '.5f')} | {_md(s['tuning_top1_percent'], '.2f')} | "
                   f"{_md(s['held_back_delta_ppl_percent'], '+.2f')}% | {_md(s['held_back_kld_mean'], '.5f')} | "
                   f"{_md(s['held_back_top1_percent'], '.2f')} |")
    return "\n".join(out) + "\n"


def grid_markdown(payload: dict[str, Any]) -> str:
    """Each format's Δppl % / mean KLD per member, one column per member (``—`` without KL)."""
    members, summary = payload["members"], payload["summary"]
    names = [f"`{m['name']}`{' (held back)' if m['held_back'] else ''}" for m in members]
    out = ["| format | " + " | ".join(f"{n}: Δppl / KLD" for n in names) + " |", "|---|" + "---|" * len(members)]
    for i, s in enumerate(summary):
        cells = []
        for m in members:
            row = m["results"][i]
            kld = row["divergence"]["kld_mean"] if row.get("divergence") else None
            cells.append(f"{row['delta_ppl_percent']:+.2f}% / {_md(kld, '.5f')}")
        out.append(f"| `{s['name']}` | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def member_markdown(member: dict[str, Any]) -> str:
    """One member's rows (a suite payload's ``members[i]``) as a Markdown table.

    Columns: format, effective bits/value, ppl, Δppl % ± se, mean KLD ± se, 99th-percentile KLD,
    same-top-token % ± se (``—`` without KL; ``baseline`` for the first row).
    """
    out = ["| format | bits/value | ppl | Δppl ± se | KLD ± se | KLD p99 | top-1 % ± se |",
           "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(member["results"]):
        d = r.get("divergence")
        if i == 0:
            delta = "baseline"
        elif d is not None:
            delta = f"{r['delta_ppl_percent']:+.2f} ± {d['delta_ppl_se_percent']:.2f}%"
        else:
            delta = f"{r['delta_ppl_percent']:+.2f}%"
        kld = f"{d['kld_mean']:.5f} ± {d['kld_se']:.5f}" if d is not None else "—"
        p99 = f"{d['kld_p99']:.4f}" if d is not None else "—"
        top1 = f"{d['top1_percent']:.2f} ± {d['top1_se_percent']:.2f}" if d is not None else "—"
        out.append(f"| `{r['name']}` | {r['bits_per_value']:.3f} | {r['ppl']:.3f} | {delta} | {kld} | {p99} | {top1} |")
    return "\n".join(out) + "\n"


def depth_markdown(payload: dict[str, Any]) -> str | None:
    """The long members' KLD by depth (:func:`payload_depth_rows`) as a Markdown table; ``None`` when there
    is none (no member that long, KL off, or rows written before the depth split).

    Columns: member, format, KLD ± se and Δppl ± se of the first ``split`` scored positions and of the
    rest, and ``rest / first`` KLD in bold with a ⚠ where it exceeds the flag ratio.
    """
    rows = payload_depth_rows(payload)
    if not rows:
        return None
    split = rows[0].split
    out = [f"| member | format | KLD, positions < {split:,} | Δppl, < {split:,} | KLD, positions ≥ {split:,} | "
           f"Δppl, ≥ {split:,} | KLD rest / first |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = "—" if r.kld_ratio is None else (f"**{r.kld_ratio:.2f}** ⚠" if r.flagged else f"{r.kld_ratio:.2f}")
        out.append(f"| `{r.member}`{' (held back)' if r.held_back else ''} | `{r.name}` | "
                   f"{r.first_kld_mean:.5f} ± {r.first_kld_se:.5f} | "
                   f"{r.first_delta_ppl_percent:+.2f} ± {r.first_delta_ppl_se_percent:.2f}% | "
                   f"{r.rest_kld_mean:.5f} ± {r.rest_kld_se:.5f} | "
                   f"{r.rest_delta_ppl_percent:+.2f} ± {r.rest_delta_ppl_se_percent:.2f}% | {ratio} |")
    return "\n".join(out) + "\n"


def suite_markdown(payload: dict[str, Any]) -> str:
    """Markdown tables of a suite ``results.json`` payload (:func:`suite_payload`), for a report such as ACCURACY.md.

    :func:`members_markdown`, :func:`summary_markdown` and :func:`grid_markdown`, then
    :func:`depth_markdown` when a long member has a depth split, separated by blank lines. Reads suite
    schema 1 payloads too (no depth table then).

    Raises:
        KeyError: the payload lacks ``members`` or ``summary`` (not a suite ``results.json``).
    """
    parts = [members_markdown(payload), summary_markdown(payload), grid_markdown(payload)]
    depth = depth_markdown(payload)
    return "\n".join(parts + ([depth] if depth else []))
