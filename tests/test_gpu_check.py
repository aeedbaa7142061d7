"""``benchmarks/gpu_check.sh --dry-run``: the device check of issue 31 runs end to end on the CPU (Triton's
interpreter, tiny shapes), so the script cannot rot unseen between GPU runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_check_dry_run_writes_every_part_to_json_and_markdown(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    from kvpage.ops.cpu.build import load_kernels

    load_kernels()  # a fresh machine compiles the CPU kernels (minutes) here, not inside a part's timeout
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, KVPAGE_GPU_CHECK_BUDGET_S="300")
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    parts = {p["part"]: p["status"] for p in report["parts"]}
    assert parts == {"tests": "ok", "decode": "ok", "e2e_probe": "ok", "e2e_bfloat16": "ok", "e2e_int4": "ok"}
    assert report["tests"]["tests"] > 0 and not report["tests"]["failed"]
    assert {row["format"] for row in report["decode"]["rows"]} == {"sdpa_bf16_dense", "bfloat16", "int8"}
    assert [row["format"] for row in report["e2e"]] == ["bfloat16", "int4"]
    assert all(row["decode_tokens_per_s"] > 0 and row["requests_that_fit"] >= 1 for row in report["e2e"])
    md = (tmp_path / "gpu_check.md").read_text()
    assert "## Decode attention" in md and "## End to end" in md


@pytest.mark.slow
@pytest.mark.parametrize("script, argv", [("triton_decode.py", ["--formats", "bfloat16"]),
                                          ("gpu_e2e.py", ["--format", "bfloat16"])])
def test_a_dry_run_without_out_writes_nothing(tmp_path: Path, script: str, argv: list[str]) -> None:
    """``benchmarks/triton_decode.py --dry-run`` left triton_decode.json/.md in the current directory (and
    ``gpu_e2e.py --dry-run`` appended to ./gpu_e2e.jsonl): a dry run checks the script, so without ``--out`` it
    only prints. (With ``--out``, as gpu_check.sh runs them, they write there: the test above.)"""
    if script == "triton_decode.py":
        pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", KVPAGE_TRITON_TEST_DEVICE="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--dry-run", *argv], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert '"format": "bfloat16"' in r.stdout
    assert list(tmp_path.iterdir()) == []
