"""Regenerate ``benchmarks/ACCURACY.md``: ``kvpage eval --suite`` (the evaluation set) or one text, decode mode.

Usage (from the repository root, after ``make install`` or with kvpage on ``PYTHONPATH``)::

    python benchmarks/accuracy.py --suite               # kvpage eval --suite, then ACCURACY.md from its results.json
    python benchmarks/accuracy.py --suite --suite-members gpl3 --tokens 64 --formats auto,int8
    python benchmarks/accuracy.py --suite-dir DIR       # render from an existing `kvpage eval --suite --out DIR`
    python benchmarks/accuracy.py                       # one text: GPL-3's first 1,024 tokens (the older note)
    python benchmarks/accuracy.py --render-only         # that note again from benchmarks/accuracy/results.json

``--suite`` runs ``kvpage eval --suite --formats ... --mode decode (or --mode chunked --chunk-size 32) --threads 1 --out benchmarks/accuracy/suite``
in-process (so the suite's ``results.json`` and each member's ``<member>/ppl_vs_bits.png`` and
``kld_vs_bits.png`` are the CLI's own output), then writes the note from that ``results.json``
(:func:`render_suite`): each member's table, the tuning members' summary, the held-back member on its
own, KLD by depth of the long member, the plots, the exact command, the machine, its load average and
the members' text sha256. ``--suite-dir`` runs nothing (``--redraw-plots`` redraws the PNGs from the
JSON). Without either, ``kvpage eval --text GPL-3 --tokens 1024`` and :func:`render` (one text).
Formats this build does not know are skipped with a note, so the default command never needs editing.
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
DEFAULT_FORMATS = "auto,int8,fp8,int4,int3,int2,int8_rotated,int4_rotated,int3_rotated,int2_rotated"
DEFAULT_OUT = ROOT / "benchmarks" / "accuracy"            # one text: results.json and plots
DEFAULT_SUITE_OUT = DEFAULT_OUT / "suite"                  # --suite: results.json, <member>/*.png
DEFAULT_TEXT_TOKENS = 1024

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
        f"- Block size {payload['block_size'] or 'per format (16; 32 for int4/int3/int2)'}; total eval time {payload['total_seconds']:.0f} s"
        + (f" (script wall time {wall_s:.0f} s, model load included)" if wall_s is not None else "")
        + ". Seconds per format are wall time on a shared machine, so compare them only roughly.",
        f"- Raw numbers: [`{out_rel}/results.json`]({out_rel}/results.json).",
        "",
    ]
    return "\n".join(lines)


#: The issues' targets on the evaluation set (issue 34's for 4, 3 and 2 bits), checked on the tuning mean and on
#: the held-back member apart: format (name or kv_cache_dtype) -> (max Δppl %, max effective bits per value at
#: 1,024 tokens, or None). The bits checked are a 1,024-token member's (the longer members' are lower). The KLD
#: targets are not checked here (issue 34's 0.004 for 4 bits: see the summary's KLD columns).
SUITE_TARGETS: dict[str, tuple[float, float | None]] = {
    "int8": (0.15, None),
    "int4": (0.5, 4.6),
    "int3": (2.5, 3.6),
    "int2": (6.0, 3.0),
    # the rotated variants: the same targets
    "int4_rotated": (0.5, 4.6),
    "int3_rotated": (2.5, 3.6),
    "int2_rotated": (6.0, 3.0),
}


#: How ``int3``'s defaults were chosen (issue 34.2): screening runs on the tuning members only, chunked-32 as the note,
#: each variant a scratch subclass of ``Int3Format`` (2026-12-04; the kept row is the format's default).
INT3_CHOICE = """\
### How `int3`'s defaults were chosen

Screening on the tuning members only (the held-back member was not run), chunked-32 as above; every variant
has no full-precision window (one 32-token block would cost 0.5 bits at 1,024 tokens: over the 3.6-bit
budget). The search int2 uses (-3..8) clips too deep at 3 bits, as deeper clipping did at 2; without the
8-bit copy of the first block KLD is 2-3x as high on three members (about equal on `torch_readme`), which
its 0.26 bits (at 1,024 tokens) pay for. Kept:
int4's candidates -1..2 without int4's `max_error`, and the first-block copy; ranges -1..1 and -1..4 were
within the noise of it. (Since 2026-12-06 the copy holds the first token alone, 3.383 bits at 1,024 tokens: "Row 0
copied, block 0 sealed as it is" below; the rows here copy the whole block.)

| step search (UE5M3 codes around the min/max step) | 8-bit first block | bits at 1,024 tokens | `gpl3` KLD / Δppl | `argparse` KLD / Δppl | `matplotlibrc` KLD / Δppl | `torch_readme` KLD / Δppl |
|---|---|---|---|---|---|---|
| -3..8 (int2's) | yes | 3.633 | 0.0490 / +4.26% | 0.0492 / +6.10% | 0.0375 / +4.84% | 0.2713 / +0.53% |
| -3..8 | no | 3.375 | 0.0998 / +1.81% | 0.1003 / +10.43% | 0.0696 / +7.26% | 0.2942 / -0.34% |
| -2..4 | no | 3.375 | 0.0945 / +1.38% | 0.0875 / +10.36% | 0.0569 / +6.58% | 0.2896 / +4.50% |
| -1..2 | no | 3.375 | 0.0815 / +0.16% | 0.0738 / +8.61% | 0.0544 / +6.23% | 0.2030 / -1.25% |
| **-1..2 (int4's): kept** | yes | 3.633 | 0.0263 / +2.18% | 0.0376 / +5.21% | 0.0253 / +3.88% | 0.1952 / -3.66% |
| -1..2, max_error 0.6 (int4's) | yes | 3.633 | 0.0313 / +3.52% | — | 0.0254 / +3.55% | 0.1866 / -4.47% |
| 0..2 | yes | 3.633 | 0.0332 / +4.84% | — | 0.0281 / +1.97% | 0.2090 / -5.88% |
| -2..4 | yes | 3.633 | 0.0404 / +3.83% | — | 0.0324 / +4.78% | 0.2219 / -1.02% |
| -1..1 | yes | 3.633 | 0.0254 / +1.84% | 0.0387 / +5.42% | 0.0258 / +3.13% | — |
| -1..4 | yes | 3.633 | 0.0269 / +3.04% | 0.0377 / +5.06% | 0.0245 / +2.52% | — |

"""


#: What the ``_rotated`` quantize-on-seal formats are and what they cost (issue 34, item 1a).
ROTATED_NOTE = """\
### The `_rotated` quantize-on-seal formats

`int4_rotated`, `int3_rotated` and `int2_rotated` store the bytes of `int4`, `int3` and `int2` (same block
layout, step search, window and first-block copy, but `int4_rotated`'s copy holds the first token alone since
2026-12-06, as `int3`'s does) of Hadamard-rotated rows: the attention ops rotate q, k and v
by the per-head orthonormal Hadamard matrix when a layer's pass enters them and the output back, so the pool, the
16-bit tail and window and the 8-bit first-block copy all hold rotated rows and the kernels run unchanged
(`kvpage/formats/kivi_rotated.py`). The rotation spreads the keys' outlier channels over the head before the
per-channel key steps and per-token value steps are chosen. Compare each with its base format in the tables
above: same bits (`int4_rotated`: 0.25 fewer at 1,024 tokens), lower KLD. They are separate names, not a new version of `int4`: a value group with a large
common offset (case C21: values in [5, 6] at head_dim 96) loses `int4`'s 0.04 bound, since the rotation
gathers the offset into one coordinate; their own bound is the base bound in the rotated basis, an L2 bound
in the original one (`tests/test_kivi.py`). Engine decode speed against the base format:
`benchmarks/ab_formats.py` (README, "KV formats").

"""


#: Issue 34 items 1b-1d screened with benchmarks/kv_tries.py (fake quantization; raw rows in accuracy/tries/).
TRIES_34 = """\
### Issue 34, items 1b-1d: pre-RoPE keys, non-uniform codes, per-layer precision (screening)

Screened with fake quantization (`benchmarks/kv_tries.py`; raw rows in `accuracy/tries/`): one float32 pass per
text with the chunked-32 reads of the suite (own block at float16, block 0 through the int8 copy, `int2`'s
window at float16, the rest through the format's own seal/unseal), scored by `kvpage.eval.divergence`; tuning
members only, `argparse` on its first 1,025 tokens (1,024 scored positions). Checked against the suite above
(`kv_tries.py validate`: `int4`, `int3`, `int2` on the four members, `int4_rotated` on two): harness KLD within
0.90-1.08x of the suite's, Δppl within 1.5 points (batched K/V round differently and flip codes), so a try
counts only where KLD moves by more than about 10% on several members. Bits at 1,024 tokens, averaged over layers.

| try | bits | `gpl3` KLD / Δppl | `argparse` KLD / Δppl | `matplotlibrc` KLD / Δppl | `torch_readme` KLD / Δppl | mean KLD / Δppl | verdict |
|---|---|---|---|---|---|---|---|
| `int3_rotated` (reference) | 3.633 | 0.0178 / -0.54% | 0.0181 / +3.51% | 0.0170 / +1.76% | 0.1343 / +2.04% | 0.0468 / +1.69% | — |
| 1d: 5 most sensitive layers `int4_rotated`, 10 least `int2_rotated`, 15 `int3_rotated` | 3.633 | 0.0106 / -0.26% | 0.0107 / +1.43% | 0.0126 / +0.95% | 0.1250 / -1.74% | 0.0397 / +0.09% | **kept**: KLD -26 to -41% on three members, -7% on the fourth, same bits; worth a per-layer format map |
| 1b: `int3_rotated`, keys sealed before RoPE | 3.633 | 0.0176 / +0.88% | 0.0149 / +2.54% | 0.0124 / +1.53% | 0.1299 / -0.18% | 0.0437 / +1.19% | **kept** (weaker): KLD -18% and -27% on two members, within noise on two, none worse; costs RoPE at read in the kernels |
| 1c: `int3_rotated`, Lloyd codes for K and V | 3.633 | 0.0177 / -1.45% | 0.0168 / +2.44% | 0.0160 / +2.11% | 0.1724 / -7.15% | 0.0557 / -1.01% | rejected: within noise on three members, +28% KLD on `torch_readme` |
| `int4_rotated` (reference) | 4.633 | 0.0044 / +0.18% | 0.0035 / +0.35% | 0.0039 / +0.47% | 0.0521 / -3.42% | 0.0160 / -0.60% | — |
| 1c: `int4_rotated`, Lloyd codes for K and V | 4.633 | 0.0052 / +0.82% | 0.0044 / +0.89% | 0.0034 / +0.85% | 0.0770 / -0.42% | 0.0225 / +0.54% | rejected: KLD higher on three members |
| 1b: `int4_rotated`, keys sealed before RoPE | 4.633 | 0.0033 / -0.05% | 0.0034 / +0.39% | 0.0034 / +0.70% | 0.0267 / -1.35% | 0.0092 / -0.08% | **kept**: KLD -25%, -13%, -49% on three members, -4% on `argparse`, Δppl within noise; pre-RoPE pays most at 4 bits (KLD ≤ 0.004 on three members) |
| 1d: 2 most sensitive layers `int8_rotated`, 8 least `int3_rotated`, 20 `int4_rotated` | 4.607 | 0.0070 / -0.35% | 0.0049 / +0.64% | 0.0042 / -0.10% | 0.0562 / -2.49% | 0.0181 / -0.58% | rejected: KLD +58%, +39%, +8%, +8% on the four members: at 4 bits the int3 layers lose more than the 8-bit ones win |
| 1d: TurboQuant's preset, layers 0 and 29 `int8`, the rest `int3_rotated` | 3.941 | 0.0217 / +0.18% | 0.0183 / +2.95% | 0.0188 / +1.28% | 0.1383 / +4.35% | 0.0493 / +2.19% | rejected: 0.31 more bits, no better; here the last layer is among the least sensitive (25th of 30) |
| `int2_rotated` (reference) | 3.133 | 0.0351 / +3.30% | 0.0433 / +6.26% | 0.0372 / +4.51% | 0.2379 / -13.99% | 0.0884 / +0.02% | — |
| 1b: `int2_rotated`, keys sealed before RoPE | 3.133 | 0.0324 / +3.60% | 0.0436 / +5.07% | 0.0332 / +3.54% | 0.1785 / -7.55% | 0.0719 / +1.16% | not a gain of its own: KLD -25% on `torch_readme`, -11% on `matplotlibrc`, -8% and +1% on `gpl3` and `argparse`; none worse, so it comes free with pre-RoPE built for 4 and 3 bits |
| 1d: 10 most sensitive layers `int3_rotated`, 10 least `int2_rotated` without its window, 10 `int2_rotated` | 3.133 | 0.0649 / +1.95% | 0.0396 / +5.57% | 0.0324 / +3.27% | 0.2319 / -7.57% | 0.0922 / +0.81% | rejected: KLD +85% on `gpl3`, -9% to -13% on two, -3% on the fourth: the 10 window cuts cost more than the 10 int3 layers win |
| 1d: 5 most sensitive layers `int3_rotated`, 5 least `int2_rotated` without its window, 20 `int2_rotated` | 3.133 | 0.0278 / +1.32% | 0.0317 / +3.74% | 0.0327 / +5.06% | 0.2222 / -12.15% | 0.0786 / -0.51% | **kept** (weaker than at `int3`'s budget): KLD -21%, -27%, -12% on three members, -7% on the fourth, same bits; chosen after the 10 + 10 mix on these members |
| (diagnostic) 10 least sensitive layers `int2_rotated` without its window, the rest `int2_rotated` | 2.966 | 0.0753 / +4.12% | 0.0652 / +8.58% | 0.0482 / +5.06% | 0.2385 / -14.51% | 0.1068 / +0.81% | — : KLD +114%, +51%, +30%, 0%: the ranking below (measured with the window) does not price the window's removal |

Layer sensitivity (`kv_tries.py sensitivity`: only that layer's cache `int2`, the rest float32; mean KLD over `gpl3`
and `matplotlibrc`, 512 tokens each): layers 17, 20, 24, 8, 23 most sensitive (0.0056-0.0037), layers 27, 13,
25, 11, 16 least (0.0001-0.0002): an 80x spread, and the single-layer KLDs add up to about the all-layer one.
The fitted codes (`accuracy/tries/levels.json`, Lloyd's algorithm on the tuning members' own K/V with the group's
min and max kept as end codes) are only mildly non-uniform (3 bits: 0, 1.22, 2.19, 3.07, 3.92, 4.80, 5.78, 7 for
rotated keys): the searched step already fits the bell. `int2`'s budget has nothing below `int2` to trade, so
its mixes pay for `int3` layers by dropping `int2`'s 32-token float16 window on others (the engine's
`kv_quant_residual_tokens=0`; 0.5 bits at 1,024 tokens, exactly `int3`'s extra cost).

Held-back member `language_reference` (2,048 tokens), once for each kept try beside its reference from the same
run (`accuracy/tries/heldback_*.json`); reported, never used to choose:

| try | bits | `language_reference` KLD / Δppl | KLD against its reference |
|---|---|---|---|
| `int3_rotated` (reference) | 3.633 | 0.0197 / +1.91% | — |
| 1d: 5 most sensitive layers `int4_rotated`, 10 least `int2_rotated`, 15 `int3_rotated` | 3.633 | 0.0110 / +1.37% | -44% |
| 1b: `int3_rotated`, keys sealed before RoPE | 3.633 | 0.0148 / +1.86% | -25% |
| `int4_rotated` (reference) | 4.633 | 0.0040 / +0.40% | — |
| 1b: `int4_rotated`, keys sealed before RoPE | 4.633 | 0.0032 / -0.05% | -19% |
| `int2_rotated` (reference) | 3.133 | 0.0484 / +5.22% | — |
| 1d: 5 most sensitive layers `int3_rotated`, 5 least `int2_rotated` without its window, 20 `int2_rotated` | 3.133 | 0.0375 / +4.66% | -23% |

Not run (time): 1c without rotation, per-layer mixes of the plain formats, a sensitivity ranking of the window
cut itself, and pre-RoPE keys combined with a per-layer mix.

**1d in the engine** (`kv_layer_dtypes`, README "Per-layer precision"): the kept mix as a real per-layer format
map, through the engine's own caches and kernels, `kvpage eval --suite --suite-members
gpl3,argparse,matplotlibrc,torch_readme --formats 'auto,int3_rotated,int3_rotated[17,20,24,8,23:int4_rotated;22,10,19,12,29,16,11,25,13,27:int2_rotated]'
--mode chunked --chunk-size 32 --threads 1` (tuning members only; 152 s on 1 thread of 2 shared cores). Bits
are the mean over layers at each member's length (`argparse`: 4,096 tokens, where the `int2` layers' 32-token
window weighs less, so the mix costs fewer bits there); KLD / Δppl:

| format | bits (gpl3 / argparse) | `gpl3` | `argparse` | `matplotlibrc` | `torch_readme` | tuning mean |
|---|---|---|---|---|---|---|
| `int3_rotated` | 3.633 / 3.439 | 0.0186 / -0.50% | 0.0217 / +2.75% | 0.0162 / +1.55% | 0.1231 / -1.09% | 0.0449 / +0.68% |
| mix: 5 most sensitive `int4_rotated`, 10 least `int2_rotated`, 15 `int3_rotated` | 3.633 / 3.314 | 0.0105 / -0.71% | 0.0149 / +1.17% | 0.0127 / +1.11% | 0.1185 / -2.64% | 0.0392 / -0.27% |

KLD -44%, -31%, -21% and -4% at the same or fewer bits, as the screening found (-40%, -41%, -26%, -7%); raw rows in `accuracy/tries/engine_layer_mix.json`;
`torch_readme`'s Δppl stays within its standard error (±2.3 points). Not run: the held-back member (the layer
order was measured on two tuning members, so it is the test of whether the order generalizes).

**Where the tuning mean's KLD comes from: `torch_readme`'s massive activations** (`kv_tries.py positions
--formats bfloat16,int8,int8_rotated,fp8,int4,int4_rotated,int3_rotated,int2_rotated`; the harness above,
`argparse` on its first 2,048 tokens; raw rows in `accuracy/tries/positions.json`). On `torch_readme` SmolLM2 forms
massive activations (Sun et al. 2024: residual-stream states many times the typical size, which later layers
attend to as sinks) at 118 of 1,023 positions: the residual stream peaks at 3-8x its layer's median there, from
layer 11 on, against 9-12 positions on each other member. The logits read at those positions swing with any change
to the attention before them: even a `bfloat16` cache (the rounding floor) puts 76% of `torch_readme`'s KLD on them
and gives 14x the other members' KLD. (A one-off run of the same harness, one layer's cache `int8` at a time:
layers 1-11 move those positions' KLD by up to 1.75, layers 12-29 by less than 0.001.)

| format | other three members: mean KLD | their massive-activation positions' share | `torch_readme` KLD | median | massive-activation positions' share | KLD without them | top 3 positions' share |
|---|---|---|---|---|---|---|---|
| `bfloat16` | 0.00005 | 1% | 0.00069 | 0.000026 | 76% | 0.00018 | 35% |
| `int8` | 0.00101 | 1% | 0.03226 | 0.000644 | 82% | 0.00647 | 54% |
| `int8_rotated` | 0.00027 | 1% | 0.00811 | 0.000195 | 76% | 0.00219 | 46% |
| `fp8` | 0.00552 | 1% | 0.07138 | 0.003291 | 77% | 0.01854 | 35% |
| `int4` | 0.00607 | 1% | 0.06006 | 0.005727 | 70% | 0.02029 | 39% |
| `int4_rotated` | 0.00401 | 1% | 0.05210 | 0.002861 | 68% | 0.01881 | 35% |
| `int3_rotated` | 0.01767 | 1% | 0.13426 | 0.013430 | 57% | 0.06480 | 20% |
| `int2_rotated` | 0.04486 | 1% | 0.23789 | 0.029827 | 59% | 0.10951 | 12% |

So the tuning mean is `torch_readme`'s tail: for `int4_rotated` 0.0160 = (3 x 0.0040 + 0.0521) / 4. With about
0.004 on the other three, a format meets the issue's KLD <= 0.004 tuning mean only if `torch_readme`'s KLD is about
0.004 too: below `int8_rotated`'s at 8.25 bits (0.0081 here, 0.0057 in the suite). That is the model's sensitivity
on this text, not a layout a 4-bit cache can choose; the member stays in the set (dropping it to pass would hide
exactly the texts where a cache hurts most). What moves the other three members and the held-back one is pre-RoPE
keys (1b above: `int4_rotated` 0.0040 -> 0.0033 on three members, 0.0040 -> 0.0032 held back).

**Pre-RoPE keys at one angle per block** (`kv_tries.py screen --formats int4_rotated,int3_rotated,int4 --variants
<format>_prerope,<format>_blockrope,int4`; `accuracy/tries/screen_int3_rotated_blockrope_*.json`). True pre-RoPE keys
(1b) need each key rotated at read by its own position, and through the Hadamard basis for `_rotated` (a transform
per key row in the kernels). The cheaper variant: each key rotated back by its offset in its block only before the
seal (so a block's keys share one angle, the block's first position's), the offset re-applied at read, where it
could be folded into the query (one query copy per offset 0..31, not a transform per key):

| try | `gpl3` KLD / Δppl | `argparse` KLD / Δppl | `matplotlibrc` KLD / Δppl | `torch_readme` KLD / Δppl | mean KLD of the first three | verdict |
|---|---|---|---|---|---|---|
| `int4_rotated` (reference) | 0.0044 / +0.18% | 0.0037 / +0.50% | 0.0039 / +0.47% | 0.0521 / -3.42% | 0.0040 | — |
| `int4_rotated`, pre-RoPE keys | 0.0033 / -0.05% | 0.0036 / +0.26% | 0.0034 / +0.70% | 0.0267 / -1.35% | 0.0034 | (1b, kept above) |
| `int4_rotated`, one angle per block | 0.0035 / -0.04% | 0.0038 / +0.78% | 0.0033 / +0.35% | 0.0474 / -5.47% | 0.0035 | weak: most of pre-RoPE's gain on three members, little on `torch_readme` |
| `int3_rotated`, pre-RoPE keys | 0.0176 / +0.88% | 0.0156 / +1.59% | 0.0124 / +1.53% | 0.1299 / -0.18% | 0.0152 | (1b) |
| `int3_rotated`, one angle per block | 0.0175 / +1.82% | 0.0157 / +1.46% | 0.0169 / +2.47% | 0.1304 / +0.49% | 0.0167 | rejected: -14% on `argparse`, none on the other two |
| `int4` (reference) | 0.0059 / +0.39% | 0.0069 / +0.67% | 0.0055 / +0.72% | 0.0601 / +2.81% | 0.0061 | — |
| `int4`, pre-RoPE keys | 0.0053 / +0.17% | 0.0060 / +0.67% | 0.0048 / +0.70% | 0.0376 / +4.54% | 0.0053 | weaker than with the rotation |
| `int4`, one angle per block | 0.0064 / +0.01% | 0.0069 / +0.44% | 0.0050 / +0.56% | 0.0564 / +3.96% | 0.0061 | rejected: no gain |

Neither variant brings a 4-bit tuning mean near 0.004 (`torch_readme`, above); neither is built this round.

**The first-block copy at fewer bits** (`kv_tries.py screen --formats int4_rotated,int3_rotated --variants
...,<format>_sinkcopy0,_sinkcopy6,_sinkcopy4`; `accuracy/tries/screen_int3_rotated_int3_rotated_sinkcopy0_*.json`).
The quantize-on-seal formats keep an int8 copy of each request's first block (the sink's outliers would stretch
every key channel's range in that block): 0.258 bits per value at 1,024 tokens, exactly the margin by which
`int4_rotated` (4.633) and `int3_rotated` (3.633) miss the 4.6- and 3.6-bit floors at that length (4.50 and 3.50
from 2,048 tokens on). The copy in fewer bits (asymmetric per token and head, float16 step and zero point) or none:

| try | bits | `gpl3` KLD / Δppl | `argparse` KLD / Δppl | `matplotlibrc` KLD / Δppl | `torch_readme` KLD / Δppl | mean KLD / Δppl | mean KLD of the first three | verdict |
|---|---|---|---|---|---|---|---|---|
| `int4_rotated` (reference: int8 copy) | 4.633 | 0.0044 / +0.18% | 0.0037 / +0.50% | 0.0039 / +0.47% | 0.0521 / -3.42% | 0.0160 / -0.57% | 0.0040 | — |
| `int4_rotated`, 6-bit copy | 4.578 | 0.0051 / -0.07% | 0.0042 / +0.75% | 0.0040 / +0.80% | 0.0537 / -0.50% | 0.0168 / +0.25% | 0.0044 | rejected: meets 4.6 bits, KLD +11% on the three |
| `int4_rotated`, 4-bit copy | 4.516 | 0.0083 / +0.27% | 0.0055 / +0.80% | 0.0057 / -0.22% | 0.0795 / -0.28% | 0.0247 / +0.14% | 0.0065 | rejected: KLD +62% |
| `int4_rotated`, no copy | 4.375 | 0.0126 / -0.08% | 0.0088 / +0.82% | 0.0077 / +0.68% | 0.0408 / +0.57% | 0.0175 / +0.50% | 0.0097 | rejected: KLD 2.4x |
| `int3_rotated` (reference: int8 copy) | 3.633 | 0.0178 / -0.54% | 0.0183 / +2.93% | 0.0170 / +1.76% | 0.1343 / +2.04% | 0.0468 / +1.55% | 0.0177 | — |
| `int3_rotated`, 6-bit copy | 3.578 | 0.0216 / +0.09% | 0.0193 / +2.75% | 0.0162 / +2.39% | 0.1456 / -0.09% | 0.0507 / +1.29% | 0.0190 | rejected: meets 3.6 bits (and Δppl <= 2.5%), KLD +7% on the three |
| `int3_rotated`, 4-bit copy | 3.516 | 0.0283 / -0.68% | 0.0196 / +2.14% | 0.0172 / +1.71% | 0.1901 / +3.71% | 0.0638 / +1.72% | 0.0217 | rejected: KLD +23% |
| `int3_rotated`, no copy | 3.375 | 0.0442 / +1.82% | 0.0614 / +6.99% | 0.0346 / +5.15% | 0.1429 / +2.10% | 0.0708 / +4.01% | 0.0467 | rejected: KLD 2.6x |

`int2`'s 32-token float16 window costs 0.5 bits at 1,024 tokens; the same copies as int8 rows (per token and head,
as the first-block copy: `<format>_window8`, `accuracy/tries/screen_int2_rotated_window8_int2_window8.json`),
beside the first-block copy's trades for `int2` (`screen_int2_int2_rotated_*_sinkcopy0.json`):

| try | bits | `gpl3` KLD / Δppl | `argparse` KLD / Δppl | `matplotlibrc` KLD / Δppl | `torch_readme` KLD / Δppl | mean KLD / Δppl | verdict |
|---|---|---|---|---|---|---|---|
| `int2_rotated` (reference) | 3.133 | 0.0351 / +3.30% | 0.0623 / +7.57% | 0.0372 / +4.51% | 0.2379 / -13.99% | 0.0931 / +0.35% | — |
| `int2_rotated`, window as int8 rows | 2.891 | 0.0350 / +3.64% | 0.0605 / +7.46% | 0.0364 / +4.49% | 0.2197 / -13.46% | 0.0879 / +0.53% | **kept** (built since 2026-12-06: the engine's default): the same KLD on three members (-8% on the fourth) at 0.24 fewer bits |
| `int2_rotated`, 6-bit first-block copy | 3.078 | 0.0359 / +3.77% | 0.0623 / +7.80% | 0.0360 / +4.33% | 0.2274 / -12.79% | 0.0904 / +0.78% | within noise at 0.055 fewer bits; the window trade saves more |
| `int2_rotated`, no first-block copy | 2.875 | 0.1692 / +8.80% | 0.2121 / +21.69% | 0.1624 / +16.19% | 0.2838 / -8.23% | 0.2069 / +9.61% | rejected: KLD 3-5x |
| `int2` (reference) | 3.133 | 0.0567 / +4.72% | 0.1024 / +11.99% | 0.0559 / +5.72% | 0.2774 / +0.90% | 0.1231 / +5.83% | — |
| `int2`, window as int8 rows | 2.891 | 0.0577 / +5.44% | 0.1044 / +12.11% | 0.0583 / +5.72% | 0.2866 / -2.24% | 0.1267 / +5.26% | kept (built, as `int2_rotated`'s): KLD +2-4% at 0.24 fewer bits |
| `int2`, no first-block copy | 2.875 | 0.1947 / +8.20% | 0.2237 / +16.64% | 0.3325 / +37.32% | 0.3914 / +5.05% | 0.2856 / +16.80% | rejected |

Built so (`window_bits = 8` on `int2` and `int2_rotated`, `kvpage/cache/tail/`): window copies live in the tail's
8-bit slots (the first-block copies' pool, whose whole-block copies the kernels read as int8 rows: source kind 3
in the `cpu` and `triton` kernels), written by the seal from the block's rows, whose 16-bit slot is then freed,
except a provisional block of speculative decoding, which keeps its 16-bit rows too until verified (a rollback
reopens the block from them); over a carved tail two 8-bit copies share one group of pool blocks, as first-block
copies do, a window copy taking a free half beside a first-block copy first. The transformers `Cache` keeps
16-bit window copies (its `crop` reopens sealed blocks from them).

The int8 copy stays: 0.055 bits buy 7-11% less KLD, a better rate than any other trade screened here (per-layer
mixes pay about a bit per layer for 20-40%). Covering only the first 4 or 16 tokens of block 0 (the rest read
sealed with the sink in its groups) was worse than the whole block in a one-off run (`int4_rotated`: 0.0045 mean
KLD of the three for both, against 0.0040).

**Part of the first-block copy** (`kv_tries.py screen --variants <format>_sinkcopyK,<format>_sinkrows<n>`;
`accuracy/tries/screen_int3_int3_rotated_int3_rotated_sinkcopyK_*.json`, `screen_int3_rotated_sinkrows1_*.json`;
references re-measured in the same runs). Two ways to keep the copy's benefit for fewer bits: the keys only (block
0's values read sealed: they are grouped per token, so the sink's outliers stretch only its own row's range), or
block 0's first `n` rows only, with block 0 sealed **without** them in its groups (those rows replaced by row `n`
before the seal, so the sink stretches no key channel's range; the rows covered read from the copy):

| try | bits | `gpl3` KLD / Δppl | `argparse` KLD / Δppl | `matplotlibrc` KLD / Δppl | `torch_readme` KLD / Δppl | mean KLD / Δppl | mean KLD of the first three |
|---|---|---|---|---|---|---|---|
| `int4_rotated` (reference: int8 copy) | 4.633 | 0.0046 / +0.25% | 0.0037 / +0.72% | 0.0040 / +0.50% | 0.0492 / -2.99% | 0.0154 / -0.38% | 0.0041 |
| `int4_rotated`, keys only | 4.504 | 0.0062 / +0.75% | 0.0044 / +0.69% | 0.0043 / -0.08% | 0.0447 / -1.51% | 0.0149 / -0.04% | 0.0050 |
| `int4_rotated`, row 0 only | 4.383 | 0.0060 / +0.22% | 0.0040 / +0.80% | 0.0040 / +0.57% | 0.0487 / -2.25% | 0.0157 / -0.17% | 0.0047 |
| `int4_rotated`, rows 0-1 | 4.391 | 0.0058 / -0.03% | 0.0042 / +0.62% | 0.0039 / +0.76% | 0.0549 / -1.89% | 0.0172 / -0.13% | 0.0046 |
| `int4` (reference) | 4.633 | 0.0061 / +0.41% | 0.0068 / +0.71% | 0.0053 / +0.65% | 0.0582 / +2.71% | 0.0191 / +1.12% | 0.0061 |
| `int4`, keys only | 4.504 | 0.0089 / +1.93% | 0.0084 / +0.79% | 0.0070 / +0.61% | 0.0512 / +3.75% | 0.0189 / +1.77% | 0.0081 |
| `int3_rotated` (reference) | 3.633 | 0.0187 / -0.60% | 0.0187 / +2.49% | 0.0165 / +1.73% | 0.1407 / +2.89% | 0.0486 / +1.63% | 0.0180 |
| `int3_rotated`, keys only | 3.504 | 0.0228 / -1.09% | 0.0221 / +2.88% | 0.0202 / +2.20% | 0.1199 / +1.69% | 0.0463 / +1.42% | 0.0217 |
| `int3_rotated`, row 0 only | 3.383 | 0.0226 / +1.02% | 0.0194 / +2.66% | 0.0182 / +2.30% | 0.1375 / +2.77% | 0.0494 / +2.19% | 0.0201 |
| `int3_rotated`, rows 0-1 | 3.391 | 0.0237 / +0.92% | 0.0210 / +2.66% | 0.0163 / +1.54% | 0.1306 / +2.86% | 0.0479 / +1.99% | 0.0203 |
| `int3_rotated`, rows 0-3 | 3.407 | 0.0232 / -0.28% | 0.0184 / +2.74% | 0.0178 / +1.60% | 0.1377 / +5.49% | 0.0493 / +2.39% | 0.0198 |
| `int3_rotated`, rows 0-7 | 3.439 | 0.0224 / +0.41% | 0.0191 / +3.54% | 0.0162 / +1.57% | 0.1570 / +9.99% | 0.0537 / +3.88% | 0.0192 |
| `int3` (reference) | 3.633 | 0.0259 / +3.18% | 0.0311 / +3.79% | 0.0258 / +3.59% | 0.1702 / -5.12% | 0.0632 / +1.36% | 0.0276 |
| `int3`, keys only | 3.504 | 0.0406 / +1.37% | 0.0361 / +3.91% | 0.0339 / +2.50% | 0.1956 / -1.98% | 0.0766 / +1.45% | 0.0369 |

Keys only loses: KLD of the first three +20-22% rotated, +33-34% unrotated (the sink takes much of each query's
weight, so its value row's rounding error, though confined to its own row, is multiplied by that weight). Row 0
only keeps most of the copy's benefit at a quarter-bit less: KLD of the first three +12% (`int3_rotated`) and +15%
(`int4_rotated`), the four members' mean +2%; covering rows 0-7 gains nothing over row 0 (the rest of the gap is
block 0's other tokens read sealed, most on `gpl3`). It meets both 1,024-token bit floors (3.38 and 4.38 bits) at a
better rate than the 6-bit copy (+7-11% for 0.055 bits), and the quarter-bit it frees would buy about seven more
`int4` layers in a per-layer mix. **Not built this round**: block 0's sealed bytes stop being readable on their own
(row 0 holds row 1's codes), so every reader that may meet block 0 without its copy (a prefix hit or a tier load
after an idle copy was dropped, the transformers `Cache`, the CPU and Triton kernels' per-block sources, the
reference) must carry the row with the block, and the kernels read block 0 from two sources.

**Row 0 copied, block 0 sealed as it is: built** (`kv_tries.py screen --variants <format>_sinkhead<n>` for the
first `n` rows copied with block 0 sealed unchanged, so its codes stay readable on their own: every reader without
the copy reads block 0 as any block; `accuracy/tries/screen_*sinkhead*.json`, `screen_int2_rotated_sinkrows1_int4_sinkrows1.json`;
2026-12-06, references re-measured in the same runs; bits at 1,024 tokens, counted by hand where the screen's
column predates the per-format copy):

| try | bits | `gpl3` KLD / Δppl | `argparse` KLD / Δppl | `matplotlibrc` KLD / Δppl | `torch_readme` KLD / Δppl | mean KLD of the first three |
|---|---|---|---|---|---|---|
| `int4_rotated`, whole block (was) | 4.633 | 0.0056 / +0.16% | 0.0039 / +0.93% | 0.0037 / +0.37% | 0.0526 / -4.15% | 0.0044 |
| **`int4_rotated`, row 0 (now)** | 4.383 | 0.0059 / -0.06% | 0.0042 / +1.12% | 0.0039 / +0.38% | 0.0545 / -0.16% | 0.0047 |
| `int4_rotated`, rows 0-3 | 4.407 | 0.0059 / +0.20% | 0.0042 / +1.08% | 0.0040 / +0.42% | 0.0553 / -0.91% | 0.0047 |
| `int4_rotated`, no copy | 4.375 | 0.0133 / +0.54% | 0.0084 / +1.26% | 0.0075 / +0.48% | 0.0488 / -1.88% | 0.0097 |
| **`int4`, whole block (kept)** | 4.633 | 0.0061 / +0.33% | 0.0064 / +0.71% | 0.0053 / +0.93% | 0.0619 / +1.84% | 0.0059 |
| `int4`, row 0 | 4.383 | 0.0095 / +1.04% | 0.0075 / +0.91% | 0.0061 / +0.21% | 0.0592 / +1.66% | 0.0077 |
| `int4`, row 0, block 0 sealed without it | 4.383 | 0.0079 / +0.39% | 0.0078 / +1.17% | 0.0054 / +0.44% | 0.0606 / +0.93% | 0.0070 |
| `int3_rotated`, whole block (was) | 3.633 | 0.0193 / -0.99% | 0.0192 / +2.44% | 0.0152 / +1.43% | 0.1348 / +1.06% | 0.0179 |
| **`int3_rotated`, row 0 (now)** | 3.383 | 0.0209 / +0.01% | 0.0196 / +3.02% | 0.0170 / +2.44% | 0.1490 / +2.51% | 0.0191 |
| **`int3`, row 0 (now)** | 3.383 | 0.0286 / +2.47% | 0.0306 / +3.79% | 0.0248 / +3.21% | 0.1785 / -3.89% | 0.0280 (whole block above: 0.0276) |
| **`int2_rotated`, whole block (kept)** | 3.133 | 0.0347 / +3.33% | 0.0591 / +7.10% | 0.0379 / +4.08% | 0.2170 / -13.23% | 0.0439 |
| `int2_rotated`, row 0 | 2.883 | 0.0634 / +3.39% | 0.0687 / +7.04% | 0.0448 / +4.98% | 0.2757 / -7.20% | 0.0590 |
| `int2_rotated`, rows 0-7 | 2.940 | 0.0645 / +4.17% | 0.0712 / +7.72% | 0.0428 / +5.27% | 0.2700 / -6.98% | 0.0595 |
| `int2_rotated`, rows 0-15 | 3.004 | 0.0454 / +3.03% | 0.0690 / +7.41% | 0.0386 / +4.16% | 0.2507 / -12.67% | 0.0510 |
| `int2_rotated`, row 0, block 0 sealed without it | 2.883 | 0.0624 / +3.41% | 0.0685 / +7.80% | 0.0391 / +4.13% | 0.2540 / -8.37% | 0.0567 |

Sealed as it is, row 0 alone keeps most of the copy for the rotated formats (+6-7% KLD of the first three) and for
`int3` (+1.5%), at 0.25 bits less: `int4_rotated`, `int3_rotated` and `int3` copy row 0 (`sink_rows = 1`; 4.383,
3.383 and 3.383 bits at 1,024 tokens, inside the issue's 4.6 and 3.6). Unrotated `int4` loses 29% so (the sink's
outlier channels stretch block 0's key steps over its other 31 rows; sealing block 0 without row 0 recovers a
fifth of that, not worth rows that stop being readable on their own) and keeps its whole block. At 2 bits block 0's
other rows matter themselves (row 0 sealed apart gains nothing, 16 rows recover half): `int2` and `int2_rotated`
keep the whole block, 3.133 bits at 1,024 tokens, over the 3.0 floor; 16 rows (3.004 bits) would not be under it
either (since 2026-12-06 their window copies are int8: 2.891 bits, below). The engine: sink slots of `sink_rows` rows (a carved group of `16 / bits` pool blocks holds
`2 * block_size / sink_rows` copies), block 0's source in the kernels is its pool block with its first rows from
the copy (`SRC_SINK`); no fingerprint change (the sealed bytes are the same).

"""


def _rel(path: Path, start: Path) -> str:
    """``path`` relative to folder ``start``, with forward slashes (a Markdown link)."""
    return Path(os.path.relpath(path, start)).as_posix()


def _met(delta: float | None, bits: float, target: tuple[float, float | None]) -> str:
    """``+0.12% at 4.70 bits: met`` (or **missed**) against ``target`` = (max Δppl %, max bits); ``—`` without a Δ."""
    if delta is None:
        return "—"
    max_delta, max_bits = target
    ok = delta <= max_delta and (max_bits is None or bits <= max_bits)
    return f"{delta:+.2f}% at {bits:.2f} bits: {'met' if ok else '**missed**'}"


def _targets_table(payload: dict) -> list[str]:
    """The SUITE_TARGETS rows for the formats the run has: tuning mean and held-back member, each against the target."""
    members, summary = payload["members"], payload["summary"]
    held = next((m for m in members if m["held_back"]), None)
    lines = []
    for i, s in enumerate(summary):
        canonical = members[0]["results"][i]["kv_cache_dtype"]
        target = SUITE_TARGETS.get(s["name"]) or SUITE_TARGETS.get(canonical)
        if target is None:
            continue
        want = f"Δppl ≤ +{target[0]:g}%" + (f" at ≤ {target[1]:g} bits" if target[1] is not None else "")
        bits = next((m["results"][i]["bits_per_value"] for m in members if m["num_tokens"] == 1024),
                    s["bits_per_value"])
        lines.append(f"| `{s['name']}` | {want} | {_met(s['tuning_delta_ppl_percent'], bits, target)} | "
                     f"{_met(s['held_back_delta_ppl_percent'], bits, target)} |")
    if not lines:
        return []
    return ["| format | issue target (bits at 1,024 tokens) | tuning mean | held back |", "|---|---|---|---|",
            *lines, ""]


def _plot_links(name: str, suite_dir: Path, note_dir: Path) -> list[str]:
    """Markdown images of a member's ``ppl_vs_bits.png`` / ``kld_vs_bits.png`` that exist, relative to the note."""
    links = []
    for png, what in (("ppl_vs_bits.png", "Δppl"), ("kld_vs_bits.png", "KLD")):
        path = suite_dir / name / png
        if path.is_file():
            links.append(f"![{what} against effective bits per value, {name}]({_rel(path, note_dir)})")
    return [" ".join(links), ""] if links else ["(no plots in the suite folder)", ""]


def _member_section(m: dict, level: str, suite_dir: Path, note_dir: Path) -> list[str]:
    """One member's heading, where its text came from, its table (suite_report.member_markdown) and its plots."""
    from kvpage.eval.suite_report import member_markdown

    changed = "" if m["sha256_matches"] else " **Its text differs from the recorded one** (numbers not comparable)."
    return [f"{level} `{m['name']}`{' (held back)' if m['held_back'] else ''}: {m['kind']}, {m['num_tokens']:,} tokens",
            "", f"`{m['origin']}`, first {m['num_tokens']:,} tokens ({m['num_tokens'] - 1:,} predictions).{changed}",
            "", member_markdown(m), *_plot_links(m["name"], suite_dir, note_dir)]


def _load(values: object) -> str:
    """``[1, 5, 15]``-minute load averages as ``0.52 / 0.61 / 0.70``; ``not recorded`` without them."""
    if not isinstance(values, list) or len(values) != 3:
        return "not recorded"
    return " / ".join(f"{v:.2f}" for v in values)




def _feeding(payload: dict) -> str:
    """How the suite fed the tokens, in words (decode: one per pass; chunked: what that equals)."""
    if payload.get("mode") != "chunked":
        return "one per forward pass"
    c = payload.get("chunk_size")
    return (f"{c} per forward pass (chunked prefill; a query reads its own block at full precision, so for "
            f"`int4`/`int3`/`int2` with {c}-token blocks this is decode mode's arithmetic up to float rounding, and for the "
            f"token-wise formats it differs from decode only in the rounding of K/V computed in a batch)")
def render_suite(payload: dict, *, suite_dir: Path, note_dir: Path, command: str, wall_s: float | None) -> str:
    """ACCURACY.md from a suite ``results.json`` payload (``kvpage eval --suite``; suite schema 1 or 2).

    Args:
        payload: the suite's ``results.json``.
        suite_dir: the folder it was read from (its ``<member>/*.png`` are linked when they exist).
        note_dir: the folder the note is written to (links are relative to it).
        command: this script's command line that produced the note.
        wall_s: the script's wall time when it ran the evaluation (``None`` when it only rendered).
    """
    from kvpage.eval.suite_report import depth_markdown, grid_markdown, members_markdown, summary_markdown

    members = payload["members"]
    tuning = [m for m in members if not m["held_back"]]
    held = next((m for m in members if m["held_back"]), None)
    model = Path(str(payload.get("model", "model"))).name
    formats = ", ".join(f"`{s['name']}`" for s in payload["summary"])
    lines = [
        "# KV formats: accuracy per bit on the evaluation set", "",
        "<!-- Generated by benchmarks/accuracy.py from a `kvpage eval --suite` results.json; edit that script, "
        "not this file. -->", "",
        f"`kvpage eval --suite` on {model} ({payload.get('dtype')} compute), **{payload.get('mode')} mode**: each "
        f"member's first tokens (no BOS) {_feeding(payload)} through the paged cache's real write and read path, "
        f"once per format ({formats}). Δppl and KLD are against the unquantized cache (`{members[0]['baseline']}`) "
        "on the same tokens: KLD is the mean per-position KL(P_unquantized ‖ P_format) in nats, p99 its 99th "
        "percentile, top-1 the positions whose most likely token is the same; ± are standard errors over "
        "positions (treated as independent, so a lower bound of the noise). Effective bits per value count "
        "everything a format keeps for these tokens (codes, scales, zero points, full-precision tail/window, "
        "8-bit first block).", "",
        "## The evaluation set", "",
        members_markdown(payload),
        f"Formats and their defaults are chosen on the {len(tuning)} tuning members only; "
        + (f"`{held['name']}` is held back and reported on its own." if held else "no held-back member was run."), "",
        "## Summary", "",
        summary_markdown(payload), *_targets_table(payload),
        *([INT3_CHOICE] if any(s["name"] == "int3" for s in payload["summary"]) else []),
        *([ROTATED_NOTE] if any(s["name"].endswith("_rotated") and s["name"] != "int8_rotated"
                                for s in payload["summary"]) else []),
        *([TRIES_34] if any(s["name"] == "int3_rotated" for s in payload["summary"]) else []),
        "Each format per member (Δppl / KLD):", "", grid_markdown(payload),
    ]
    if held is not None:
        lines += ["## The held-back member", "",
                  "No format or default was chosen on this text; read it as the check of the tuning members' figures.",
                  "", *_member_section(held, "###", suite_dir, note_dir)]
    depth = depth_markdown(payload)
    split = int(payload.get("depth_split", 1024))
    min_tokens = int(payload.get("depth_min_tokens", 4096))
    lines += ["## KLD by depth", "",
              f"Members of ≥ {min_tokens:,} tokens: KLD and Δppl of the first {split:,} scored positions against "
              f"the positions after them; ⚠ marks a format whose KLD after position {split:,} is more than "
              f"{payload.get('depth_kld_ratio_flag', 2):g}x its KLD before.", ""]
    if depth is None:
        lines += ["Not recorded: no member that long, KL divergence off, or a results.json from before the depth "
                  "split (suite schema 1).", ""]
    else:
        flagged = [f"`{d['name']}` on `{d['member']}` ({d['kld_ratio']:.2f}x)" for d in payload.get("depth", [])
                   if d.get("flagged")]
        lines += [depth, ("Worse by more than 2x at depth: " + ", ".join(flagged) + ".") if flagged
                  else "No format's KLD after the split exceeds twice its KLD before it.", ""]
    lines += ["## Each tuning member", ""]
    for m in tuning:
        lines += _member_section(m, "###", suite_dir, note_dir)
    gpl = next((m for m in members if m["name"] == "gpl3"), None)
    if gpl is not None and gpl["num_tokens"] == 1024 and payload.get("mode") == "decode" \
            and payload.get("dtype") == "float32":
        base = gpl["results"][0]["ppl"]
        lines += ["## Check against the reference", "",
                  f"On `gpl3` the unquantized cache scores ppl {base:.3f}; transformers' `DynamicCache` (decode, "
                  f"fp32, the same 1,024 tokens) scores {REFERENCE_PPL} ({base - REFERENCE_PPL:+.4f}).", ""]
    rel_root = str(ROOT) + os.sep
    measured = str(payload.get("command") or "not recorded (results.json from before the command was recorded)")
    lines += [
        "## How this was made", "",
        "```bash", command.replace(rel_root, ""), "# which ran:", measured.replace(rel_root, ""), "```", "",
        f"- Machine: {_cpu_name(payload)}, {payload.get('cpu_count')} CPUs, {payload.get('threads')} torch "
        f"thread(s); torch {payload.get('torch')}, Python {payload.get('python')}; {payload.get('date')}.",
        f"- Load average (1 / 5 / 15 min): {_load(payload.get('load_average'))} at the start, "
        f"{_load(payload.get('load_average_end'))} at the end.",
        f"- Total eval time {float(payload.get('total_seconds', 0)):.0f} s"
        + (f" (script wall time {wall_s:.0f} s, model load included)" if wall_s is not None else "")
        + "; block size " + str(payload.get("block_size") or "per format (16; 32 for int4/int3/int2)") + ".",
        f"- Raw numbers: [`results.json`]({_rel(suite_dir / 'results.json', note_dir)}).",
        "- The members' texts (sha256 of the UTF-8 text as resolved on the measuring machine):", "",
    ]
    for m in members:
        version = f", {m['version_of']} {m['version']}" if m.get("version_of") else ""
        same = "the recorded text" if m["sha256_matches"] else f"**differs** from the recorded `{m['recorded_sha256']}`"
        lines.append(f"  - `{m['name']}` (`{m['origin']}`{version}): `{m['text_sha256']}` ({same})")
    lines.append("")
    return "\n".join(lines)


def _redraw_suite_plots(payload: dict, suite_dir: Path) -> None:
    """Each member's ``ppl_vs_bits.png`` (and ``kld_vs_bits.png`` when its rows carry KL) from the payload's rows."""
    from kvpage.eval import PerplexityResult
    from kvpage.eval.report import plot_kld_vs_bits, plot_ppl_vs_bits

    model = Path(str(payload.get("model", "model"))).name
    for m in payload["members"]:
        rows = [PerplexityResult.from_dict(r) for r in m["results"]]
        title = f"{model}: {m['name']} ({m['kind']}), {m['num_tokens']} tokens, {payload.get('mode')} mode"
        plot_ppl_vs_bits(suite_dir / m["name"] / "ppl_vs_bits.png", rows, title=title)
        if len(rows) > 1 and all(r.divergence is not None for r in rows[1:]):
            plot_kld_vs_bits(suite_dir / m["name"] / "kld_vs_bits.png", rows, title=f"{title}; vs {rows[0].name}")


def _known_formats(spec: str) -> tuple[list[str], list[str]]:
    """``--formats`` split into (the ones this build has, the ones it does not)."""
    from kvpage.formats import available_formats, format_aliases

    known = set(available_formats()) | set(format_aliases())
    wanted = [f.strip() for f in spec.split(",") if f.strip()]
    return [f for f in wanted if f.lower() in known], [f for f in wanted if f.lower() not in known]


def _main_suite(args: argparse.Namespace) -> int:
    """``--suite`` (run ``kvpage eval --suite`` then render) or ``--suite-dir`` (render only)."""
    from kvpage.cli import main as kvpage_main

    note = Path(args.note)
    wall: float | None = None
    if args.suite_dir is not None:
        suite_dir = Path(args.suite_dir)
        command = f"python benchmarks/accuracy.py --suite-dir {suite_dir}" + (" --redraw-plots" if args.redraw_plots else "")
    else:
        suite_dir = Path(args.out) if args.out else DEFAULT_SUITE_OUT
        formats, skipped = _known_formats(args.formats)
        if skipped:
            print(f"[accuracy] not in this build, skipped: {', '.join(skipped)}", flush=True)
        eval_args = ["eval", "--suite", "--formats", ",".join(formats), "--mode", args.mode,
                     "--threads", str(args.threads), "--out", str(suite_dir)]
        if args.mode == "chunked":
            eval_args += ["--chunk-size", str(args.chunk_size)]
        eval_args += ["--suite-members", args.suite_members] if args.suite_members else []
        eval_args += ["--tokens", str(args.tokens)] if args.tokens else []
        command = "python benchmarks/accuracy.py --suite" \
            + (f" --formats {args.formats}" if args.formats != DEFAULT_FORMATS else "") \
            + (f" --mode {args.mode}" if args.mode != "decode" else "") \
            + (f" --chunk-size {args.chunk_size}" if args.mode == "chunked" else "") \
            + (f" --suite-members {args.suite_members}" if args.suite_members else "") \
            + (f" --tokens {args.tokens}" if args.tokens else "") \
            + (f" --threads {args.threads}" if args.threads != 1 else "") \
            + (f" --out {args.out}" if args.out else "")
        start = time.perf_counter()
        rc = kvpage_main(eval_args)
        wall = time.perf_counter() - start
        if rc != 0:
            return rc
    payload = json.loads((suite_dir / "results.json").read_text(encoding="utf-8"))
    if "members" not in payload:
        raise SystemExit(f"{suite_dir / 'results.json'} is not a `kvpage eval --suite` results.json (no members)")
    if args.redraw_plots:
        _redraw_suite_plots(payload, suite_dir)
    note.parent.mkdir(parents=True, exist_ok=True)
    note.write_text(render_suite(payload, suite_dir=suite_dir.resolve(), note_dir=note.resolve().parent,
                                 command=command, wall_s=wall), encoding="utf-8")
    print(f"[accuracy] wrote {note}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse the flags and write the note (see the module docstring); returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--suite", action="store_true",
                      help="run `kvpage eval --suite` into --out (default benchmarks/accuracy/suite), then render")
    what.add_argument("--suite-dir", default=None,
                      help="render the note from an existing `kvpage eval --suite --out DIR` folder; runs nothing")
    what.add_argument("--render-only", action="store_true",
                      help="one text: rewrite the note from the existing OUT/results.json (after editing this script)")
    ap.add_argument("--formats", default=DEFAULT_FORMATS, help=f"default {DEFAULT_FORMATS} (unknown ones skipped)")
    ap.add_argument("--suite-members", default=None, help="with --suite: comma-separated members (default all)")
    ap.add_argument("--tokens", type=int, default=None,
                    help=f"tokens to score (one text: default {DEFAULT_TEXT_TOKENS}; --suite: each member's own)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--mode", choices=("decode", "chunked"), default="decode",
                    help="with --suite: kvpage eval's feeding mode (default decode; chunked with --chunk-size 32 is "
                         "decode's arithmetic for int4/int3/int2 and about 7x faster; benchmarks/ACCURACY.md used it)")
    ap.add_argument("--chunk-size", type=int, default=32, help="with --suite --mode chunked: tokens per step (default 32)")
    ap.add_argument("--text", default=None, help=f"one text: default {GPL3} (or the vendored copy {GPL3_VENDORED.relative_to(ROOT)})")
    ap.add_argument("--out", default=None,
                    help=f"evaluation folder (default {DEFAULT_OUT.relative_to(ROOT)}; --suite: "
                         f"{DEFAULT_SUITE_OUT.relative_to(ROOT)})")
    ap.add_argument("--note", default=str(ROOT / "benchmarks" / "ACCURACY.md"))
    ap.add_argument("--redraw-plots", action="store_true",
                    help="with --suite-dir: redraw each member's plots from its results.json first")
    args = ap.parse_args(argv)
    if args.redraw_plots and args.suite_dir is None:
        ap.error("--redraw-plots needs --suite-dir")
    if args.suite_members and not args.suite:
        ap.error("--suite-members needs --suite")

    sys.path.insert(0, str(ROOT / "src"))
    if args.suite or args.suite_dir is not None:
        return _main_suite(args)
    return _main_text(args)


def _main_text(args: argparse.Namespace) -> int:
    """One text (GPL-3 unless ``--text``): ``kvpage eval --text`` (unless ``--render-only``), then :func:`render`."""
    from kvpage.cli import main as kvpage_main

    formats, skipped = _known_formats(args.formats)
    if skipped:
        print(f"[accuracy] not in this build, skipped: {', '.join(skipped)}", flush=True)
    tokens = args.tokens or DEFAULT_TEXT_TOKENS
    text = Path(args.text) if args.text else (GPL3 if GPL3.is_file() else GPL3_VENDORED)
    out = Path(args.out) if args.out else DEFAULT_OUT
    eval_args = ["eval", "--text", str(text), "--formats", ",".join(formats), "--tokens", str(tokens),
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
        + (f" --tokens {tokens}" if tokens != DEFAULT_TEXT_TOKENS else "") \
        + (f" --threads {args.threads}" if args.threads != 1 else "")
    eval_command = "kvpage " + " ".join(shown).replace(str(out), rel_out)
    note = render(payload, command=command, eval_command=eval_command, skipped=skipped, wall_s=wall,
                  out_rel=os.path.relpath(out, Path(args.note).resolve().parent))
    Path(args.note).write_text(note, encoding="utf-8")
    print(f"[accuracy] wrote {args.note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
