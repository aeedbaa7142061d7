"""Regenerate ``benchmarks/ACCURACY.md``: ``kvpage eval`` on the first 1,024 tokens of the GPL-3 text, decode mode.

Usage (from the repository root, after ``make install`` or with kvpage on ``PYTHONPATH``)::

    python benchmarks/accuracy.py                       # auto,int8,fp8,int4,int2 (those this build has)
    python benchmarks/accuracy.py --formats auto,int8,fp8 --tokens 1024 --threads 1

It runs ``kvpage eval --text GPL-3 --tokens 1024 --mode decode --out benchmarks/accuracy``
in-process (so ``benchmarks/accuracy/results.json`` and ``ppl_vs_bits.png`` are the
CLI's own output), then writes ``benchmarks/ACCURACY.md`` from ``results.json``:
the table, the plot, the command, the machine, and the reference numbers measured on
the same text with other tools. Formats this build does not know (e.g. ``int4``
before it lands) are skipped with a note, so the default command never needs editing.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parent.parent
GPL3 = Path("/usr/share/common-licenses/GPL-3")  # Debian's base-files; `dpkg -L base-files | grep GPL-3`
GPL3_VENDORED = ROOT / "tests" / "data" / "GPL-3"  # a verbatim copy, for machines without base-files
DEFAULT_FORMATS = "auto,int8,fp8,int4,int2,int8_rotated"

#: Reference ppl of the unquantized fp32 cache on this text (transformers DynamicCache, decode).
REFERENCE_PPL = 19.299
#: The issue's targets: format -> (max Δppl %, max effective bits per value or None).
TARGETS: dict[str, tuple[float, float | None]] = {
    "int8": (0.3, None),
    "fp8": (1.0, None),
    "int4": (1.0, 5.0),
    "int2": (15.0, 3.5),
}

#: The closest reference measurement per format (what, ppl), from the table below.
CLOSEST_REFERENCE: dict[str, tuple[str, float]] = {
    "int8": ("per-token int8 quantize-dequantize probe", 19.297),
    "fp8": ("per-token fp8 e4m3 with scale, probe", 19.424),
    "int4": ("transformers QuantizedCache quanto int4, 128-token fp window", 19.405),
    "int2": ("int2 asym group 32 with a 128-token fp window, probe", 33.23),
}

DESIGN_NOTES = """\
## What the low-bit formats keep, and why

- `int4` / `int2` (KIVI on pages, "quantize on seal"): keys per channel over a block's 32 tokens,
  values per token over 64 channels, asymmetric; zero point float16 (rounded down), step one UE5M3
  byte (rounded up). At 1,024 tokens, 3 kv heads and head_dim 64, `int4` costs 4 bits of codes +
  0.375 (key metadata) + 0.1875 (value metadata) + 0.258 (the 8-bit copy of the first block) = 4.82
  bits per value; `int2` 2 + 0.5625 + 0.258 + 0.5 (one 32-token 16-bit window block) = 3.32.
- Chosen by measurement on this text (a prefill simulation of the same rules, fp16 metadata unless
  stated): block 16 vs 32 for `int4` +0.65% vs +1.32% without the first-block copy but 5.07 vs
  4.82 bits with it; with 8-bit steps and the first-block copy, value groups of 32 channels
  measured no better than 64 (19.314 vs 19.283) at 0.19 more bits; a Hadamard rotation of values
  gained 0.1-0.2 ppl but breaks values with a large common offset (case C21), so it is not used;
  `int2` needs the window: 23.6 without it, 21.5-21.6 with one 32-token block.
- `int8` is the plain per-(token, head) layout: it and the rotated layout (`int8_rotated`) are
  both inside the ~0.3% that any 8-bit rounding moves this text, although the rotation cuts the
  teacher-forced KL to the unquantized cache 3-4x (0.00045 vs 0.0015 on this text, prefill
  simulation); `int8` meets the +0.3% target here, `int8_rotated` does not.
"""

REFERENCE_TABLE = """\
| cache | measured how | ppl | Δ |
|---|---|---|---|
| transformers DynamicCache (fp32) | decode, 1 token/step | 19.299 | — |
| transformers DynamicCache, bf16 | decode | 19.304 | +0.03% |
| transformers QuantizedCache quanto int4 (128-token fp window) | decode | 19.405 | +0.55% |
| transformers QuantizedCache HQQ int4 | decode | 22.904 | +18.7% |
| transformers QuantizedCache quanto int2 / HQQ int2 | decode | 156.6 / 1256 | collapse |
| transformers fp8 cache (per-tensor scale frozen after the first token) | decode | 39.18 | +103% |
| per-token int8 (quantize-dequantize probe) | decode | 19.297 | ±0 |
| per-token fp8 e4m3 with scale (probe) | decode | 19.424 | +0.6% |
| per-token int4 asym, group 32, no window (probe) | decode | 20.758 | +7.6% |
| same with a 128-token fp window | decode | 19.513 | +1.1% |
| int2 asym group 32 with a 128-token fp window (probe) | decode | 33.23 | +72% |
| int4 on K only / V only (probe, prefill) | prefill | 19.97 / 19.60 | +3.5% / +1.5% |
"""


def _cpu_name(payload: dict) -> str:
    """The CPU the numbers were measured on: ``results.json``'s ``cpu`` (kvpage eval records it since KL was added).

    Never this machine's: ``--render-only`` may run elsewhere than the measurement did."""
    return str(payload.get("cpu") or "CPU not recorded")


def _target_cell(name: str, canonical: str, delta: float, bits: float) -> str:
    target = TARGETS.get(canonical) or TARGETS.get(name)
    if target is None:
        return "—"
    max_delta, max_bits = target
    ok = delta <= max_delta and (max_bits is None or bits <= max_bits)
    want = f"≤ +{max_delta:g}%" + (f" at ≤ {max_bits:g} bits" if max_bits is not None else "")
    return f"{want}: {'met' if ok else '**missed**'}"


def render(payload: dict, *, command: str, eval_command: str, skipped: list[str], wall_s: float | None,
           out_rel: str) -> str:
    """ACCURACY.md from a ``results.json`` payload; ``out_rel`` is the output folder relative to the note."""
    rows = payload["results"]
    base = rows[0]
    n = payload["num_tokens"]
    lines = [
        "# KV formats: accuracy per bit",
        "",
        "<!-- Generated by benchmarks/accuracy.py; edit that script, not this file. -->",
        "",
        f"Perplexity of SmolLM2-135M-Instruct (the bundled Q4_1 GGUF, {payload['dtype']} compute) on the first "
        f"{n:,} tokens of the GPL-3 licence text (Debian `base-files`' `/usr/share/common-licenses/GPL-3`, "
        f"no BOS; {n - 1:,} predictions), **{payload['mode']} mode**: one token per forward pass, each written "
        "to the paged cache through its format's quantizer and attending to every earlier token read back from "
        "the blocks (the engine's real write and read path, `kvpage.eval.evaluate_perplexity`). "
        "Δ is against the unquantized cache (`auto` = the model dtype). Effective bits per value count "
        "everything a format keeps for these tokens (codes, scales, zero points, full-precision tail/window, "
        "8-bit first block).",
        "",
        "| format | stored as | bits/value | KV bytes/token | ppl | Δppl | seconds | issue target |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        d = r["delta_ppl_percent"]
        dcell = "baseline" if r is base else f"{d:+.2f}%"
        lines.append(
            f"| `{r['name']}` | {r['kv_cache_dtype']} | {r['bits_per_value']:.3f} | {r['kv_bytes_per_token']:,.0f} "
            f"| {r['ppl']:.3f} | {dcell} | {r['seconds']:.0f} | "
            f"{_target_cell(r['name'], r['kv_cache_dtype'], d, r['bits_per_value'])} |"
        )
    lines += ["", f"![Δppl against effective bits per value]({out_rel}/ppl_vs_bits.png)", ""]
    if skipped:
        lines += [f"Not in this build, so not measured: {', '.join(f'`{s}`' for s in skipped)}.", ""]
    ref_ok = abs(base["ppl"] - REFERENCE_PPL) <= 0.01
    lines += [
        "## Check against the reference",
        "",
        f"The unquantized cache scores ppl {base['ppl']:.3f}; the reference (transformers' `DynamicCache`, "
        f"decode, fp32, same {n:,} tokens) is {REFERENCE_PPL}: "
        + (f"within ±0.01 ({base['ppl'] - REFERENCE_PPL:+.4f})." if ref_ok and n == 1024 and payload['mode'] == 'decode'
           else f"difference {base['ppl'] - REFERENCE_PPL:+.4f} (only comparable at 1,024 tokens, decode, float32)."),
        "",
    ]
    ours = [r for r in rows[1:] if (r["kv_cache_dtype"] in CLOSEST_REFERENCE or r["name"] in CLOSEST_REFERENCE)]
    if ours:
        lines += ["| format | ours: ppl (Δ) | closest reference | its ppl (Δ vs 19.299) |", "|---|---|---|---|"]
        for r in ours:
            what, ppl = CLOSEST_REFERENCE.get(r["kv_cache_dtype"]) or CLOSEST_REFERENCE[r["name"]]
            lines.append(f"| `{r['name']}` | {r['ppl']:.3f} ({r['delta_ppl_percent']:+.2f}%) | {what} "
                         f"| {ppl:.3f} ({100 * (ppl / REFERENCE_PPL - 1):+.2f}%) |")
        lines.append("")
    lines += [
        "All reference numbers measured on the same text and model with other tools (project research notes; "
        "differences under ≈ 0.1–0.15 ppl between quantized methods are within the noise of fp32 rounding):",
        "",
        REFERENCE_TABLE,
        "llama.cpp's own perplexity tool scores the second half of each window, so only its Δ compare: "
        "context 1,024: f16 18.21; q8_0 −0.16%; q5_1 +1.7%; q4_1 +6.8%; iq4_nl +6.4%; q4_0 +7.6%; "
        "K q8_0 + V q4_0 +0.85%.",
        "",
        DESIGN_NOTES,
        "## How this was made",
        "",
        "```bash",
        command,
        "# which runs:",
        eval_command,
        "```",
        "",
        f"- Machine: {_cpu_name(payload)}, {payload.get('cpu_count')} CPUs, {payload['threads']} torch thread(s); "
        f"torch {payload['torch']}, Python {payload.get('python')}; {payload['date']}.",
        f"- Block size {payload['block_size'] or 'per format (16; 32 for int4/int2)'}; total eval time {payload['total_seconds']:.0f} s"
        + (f" (script wall time {wall_s:.0f} s, model load included)" if wall_s is not None else "")
        + ". Seconds per format are wall time on a shared machine, so compare them only roughly.",
        f"- Raw numbers: [`{out_rel}/results.json`]({out_rel}/results.json).",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default=DEFAULT_FORMATS, help=f"default {DEFAULT_FORMATS} (unknown ones skipped)")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--text", default=None, help=f"default {GPL3} (or the vendored copy {GPL3_VENDORED.relative_to(ROOT)})")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "accuracy"))
    ap.add_argument("--note", default=str(ROOT / "benchmarks" / "ACCURACY.md"))
    ap.add_argument("--render-only", action="store_true",
                    help="don't evaluate: rewrite the note from the existing OUT/results.json (after editing this script)")
    args = ap.parse_args(argv)

    sys.path.insert(0, str(ROOT / "src"))
    from kvpage.cli import main as kvpage_main
    from kvpage.formats import available_formats, format_aliases

    known = set(available_formats()) | set(format_aliases())
    wanted = [f.strip() for f in args.formats.split(",") if f.strip()]
    formats = [f for f in wanted if f.lower() in known]
    skipped = [f for f in wanted if f.lower() not in known]
    if skipped:
        print(f"[accuracy] not in this build, skipped: {', '.join(skipped)}", flush=True)
    text = Path(args.text) if args.text else (GPL3 if GPL3.is_file() else GPL3_VENDORED)
    out = Path(args.out)
    eval_args = ["eval", "--text", str(text), "--formats", ",".join(formats), "--tokens", str(args.tokens),
                 "--mode", "decode", "--threads", str(args.threads), "--out", str(out)]
    wall: float | None = None
    if not args.render_only:
        start = time.perf_counter()
        rc = kvpage_main(eval_args)
        wall = time.perf_counter() - start
        if rc != 0:
            return rc
    payload = json.loads((out / "results.json").read_text())
    if args.render_only:  # redraw the plot from the saved numbers too
        from kvpage.eval import PerplexityResult
        from kvpage.eval.report import plot_kld_vs_bits, plot_ppl_vs_bits

        rows = [PerplexityResult.from_dict(r) for r in payload["results"]]
        title = f"{Path(str(payload.get('model', 'model'))).name}: GPL-3, {payload['num_tokens']} tokens, {payload['mode']} mode"
        plot_ppl_vs_bits(out / "ppl_vs_bits.png", rows, title=title)
        if all(r.divergence is not None for r in rows):
            plot_kld_vs_bits(out / "kld_vs_bits.png", rows, title=title)
    shown = ["eval", "--text", payload["text"], "--formats", ",".join(r["name"] for r in payload["results"]),
             "--tokens", str(payload["num_tokens"]), "--mode", payload["mode"], "--threads", str(payload["threads"]),
             "--out", str(out)]
    rel_out = os.path.relpath(out, ROOT)
    command = "python benchmarks/accuracy.py" + (f" --formats {args.formats}" if args.formats != DEFAULT_FORMATS else "") \
        + (f" --tokens {args.tokens}" if args.tokens != 1024 else "") + (f" --threads {args.threads}" if args.threads != 1 else "")
    eval_command = "kvpage " + " ".join(shown).replace(str(out), rel_out)
    note = render(payload, command=command, eval_command=eval_command, skipped=skipped, wall_s=wall,
                  out_rel=os.path.relpath(out, Path(args.note).resolve().parent))
    Path(args.note).write_text(note, encoding="utf-8")
    print(f"[accuracy] wrote {args.note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
