"""Collect the parts of ``benchmarks/gpu_check.sh`` under ``OUT`` into ``gpu_check.json`` and ``gpu_check.md``.

Reads ``parts.jsonl`` (each part's status), ``versions.txt``, ``tests.xml`` (pytest's JUnit counts),
``triton_decode.json`` and ``gpu_e2e.jsonl``; a part that left nothing is reported by its status alone.
"""
from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def collect(out: Path) -> dict:
    report: dict = {"versions": (out / "versions.txt").read_text().strip() if (out / "versions.txt").exists() else None,
                    "parts": _lines(out / "parts.jsonl"), "tests": None, "decode": None, "e2e": _lines(out / "gpu_e2e.jsonl")}
    if (out / "tests.xml").exists():
        suite = ET.parse(out / "tests.xml").getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        report["tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")} | \
            {"seconds": float(suite.get("time", 0)),
             "failed": [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                        if c.find("failure") is not None or c.find("error") is not None]}
    if (out / "triton_decode.json").exists():
        report["decode"] = json.loads((out / "triton_decode.json").read_text())
    return report


def markdown(r: dict) -> str:
    md = ["# kvpage device check (issue 31)", "", f"`{r['versions']}`", "", "| part | status | s | note |", "|---|---|---|---|"]
    md += [f"| {p['part']} | {p['status']} | {p.get('seconds', '')} | {p.get('note', p.get('log', ''))} |" for p in r["parts"]]
    if r["tests"]:
        t = r["tests"]
        md += ["", f"Tests: {t['tests']} run, {t['failures']} failed, {t['errors']} errors, {t['skipped']} skipped "
               f"in {t['seconds']:.0f} s" + "".join(f"\n- FAILED {n}" for n in t["failed"])]
    if r["decode"]:
        d = r["decode"]
        md += ["", f"## Decode attention, one layer ({d['device']}; copy bandwidth {d['copy_gb_s']:.0f} GB/s)", "",
               "| format | batch | context | µs | GB/s | of copy bw | vs bf16 |", "|---|---|---|---|---|---|---|"]
        md += [f"| {x['format']} | {x['batch']} | {x['context']} | {x['us']:.1f} | {x['gb_s']:.0f} | "
               f"{x['of_copy_bandwidth']:.0%} | {x['speedup_vs_bf16']:.2f}x |" for x in d["rows"]]
    if r["e2e"]:
        md += ["", "## End to end (random Llama-3-8B-shaped model)", "",
               "| format | backend | batch | context | decode tok/s | requests that fit | KV budget GiB |",
               "|---|---|---|---|---|---|---|"]
        md += [f"| {x['format']} | {x['attention_backend']} | {x['batch']} | {x['context']} | "
               f"{x['decode_tokens_per_s'] or 0:.0f} | {x['requests_that_fit']:.0f} | {x['budget_bytes'] / 2**30:.2f} |"
               for x in r["e2e"]]
    return "\n".join(md) + "\n"


def main(out: str) -> int:
    path = Path(out)
    r = collect(path)
    (path / "gpu_check.json").write_text(json.dumps(r, indent=1))
    (path / "gpu_check.md").write_text(text := markdown(r))
    print(text)
    return 0 if all(p["status"] == "ok" for p in r["parts"]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "gpu-check-out"))
