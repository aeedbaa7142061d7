"""The summary of a ``kvpage eval --suite`` run: per format, the tuning members' means and the held-back member apart.

Each member's own table and rows are :mod:`kvpage.eval.report`'s; this module averages them over the
members formats may be tuned on and keeps the held-back member's figures in their own columns, then
writes the suite's ``results.json`` (every member's rows, its text's source and sha256, the summary).
"""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvpage.eval.perplexity import PerplexityResult
from kvpage.eval.report import delta_ppl_percent, results_payload
from kvpage.eval.suite import ResolvedText

#: Version of the suite ``results.json`` layout (its members' rows follow ``RESULTS_SCHEMA_VERSION``).
SUITE_SCHEMA_VERSION = 1


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
    rows; ``summary`` is :func:`summarize_suite` as dicts.

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
    return {"suite_schema_version": SUITE_SCHEMA_VERSION, "schema_version": results_payload(runs[0][1])["schema_version"],
            **meta, "held_back": held, "members": members, "summary": [s.to_dict() for s in summary]}


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


def suite_markdown(payload: dict[str, Any]) -> str:
    """Markdown tables of a suite ``results.json`` payload (:func:`suite_payload`), for a report such as ACCURACY.md.

    Three tables: the members (kind, where the text was found, tokens scored, sha256 prefix, whether it
    matched the recorded text, held back or not); the summary per format (mean bits, the tuning members'
    mean Δppl %, KLD and top-1 %, then the held-back member's); and each format's Δppl % / mean KLD per
    member (``—`` without KL).

    Raises:
        KeyError: the payload lacks ``members`` or ``summary`` (not a suite ``results.json``).
    """
    members, summary = payload["members"], payload["summary"]
    held = payload.get("held_back")
    out = ["| member | kind | text | tokens | sha256 | held back |", "|---|---|---|---|---|---|"]
    for m in members:
        version = f" ({m['version_of']} {m['version']})" if m.get("version_of") else ""
        same = "" if m["sha256_matches"] else " (differs from the recorded text)"
        out.append(f"| `{m['name']}` | {m['kind']} | `{m['origin']}`{version} | {m['num_tokens']:,} | "
                   f"`{m['text_sha256'][:12]}`{same} | {'**yes**' if m['held_back'] else 'no'} |")
    n = summary[0]["tuning_members"] if summary else 0
    out += ["", f"| format | bits/value | Δppl, tuning mean ({n}) | KLD, tuning mean | top-1 %, tuning mean | "
                f"Δppl, held back (`{held or 'not run'}`) | KLD, held back | top-1 %, held back |",
            "|---|---|---|---|---|---|---|---|"]
    for s in summary:
        out.append(f"| `{s['name']}` | {s['bits_per_value']:.3f} | {_md(s['tuning_delta_ppl_percent'], '+.2f')}% | "
                   f"{_md(s['tuning_kld_mean'], '.5f')} | {_md(s['tuning_top1_percent'], '.2f')} | "
                   f"{_md(s['held_back_delta_ppl_percent'], '+.2f')}% | {_md(s['held_back_kld_mean'], '.5f')} | "
                   f"{_md(s['held_back_top1_percent'], '.2f')} |")
    names = [f"`{m['name']}`{' (held back)' if m['held_back'] else ''}" for m in members]
    out += ["", "| format | " + " | ".join(f"{n}: Δppl / KLD" for n in names) + " |",
            "|---|" + "---|" * len(members)]
    for i, s in enumerate(summary):
        cells = []
        for m in members:
            row = m["results"][i]
            kld = row["divergence"]["kld_mean"] if row.get("divergence") else None
            cells.append(f"{row['delta_ppl_percent']:+.2f}% / {_md(kld, '.5f')}")
        out.append(f"| `{s['name']}` | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"
