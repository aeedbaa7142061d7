"""Fixtures for the tests against the real vLLM CPU build (``make test-vllm``; not collected by ``make test``).

These tests run in vLLM's own environment (the recipe in ``benchmarks/vs_vllm.py``), where kvpage is installed
with ``pip install --no-deps -e .``. Each vLLM engine is a fresh process (``_engine.py``); the model is kvpage's
bundled SmolLM2-135M exported as a bf16 Hugging Face folder (``KVPAGE_VLLM_MODEL``, written by ``make test-vllm``;
nothing is downloaded). A Redis server is started from ``KVPAGE_REDIS_SERVER`` (the valkey-server of kvpage's
``.venv``) or a ``redis-server`` on PATH; without either the Redis cases are skipped with the reason.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests"))

#: Seconds one engine process may take (start-up ~20-30 s, shutdown ~5 s on a 2-core machine).
ENGINE_TIMEOUT_S = 600


def model_path() -> str:
    """The exported bf16 model folder; the whole directory is skipped when it is missing."""
    path = os.environ.get("KVPAGE_VLLM_MODEL", "")
    if not path or not (Path(path) / "config.json").is_file():
        pytest.skip(f"KVPAGE_VLLM_MODEL={path!r} is not an exported model folder; run `make test-vllm`")
    return path


def run_engine(workdir: Path, name: str, **spec: Any) -> dict[str, Any]:
    """Run one vLLM engine in a fresh process (``_engine.py``) and return its JSON result.

    ``spec`` is ``_engine.py``'s SPEC (``model`` is filled in); the engine's log goes to ``workdir/<name>.log``.

    Raises:
        RuntimeError: the process failed or timed out (with the log's tail).
    """
    spec = {"model": model_path(), "block_size": 128, "max_tokens": 16, "connector": None, **spec}
    spec_path, out_path, log = workdir / f"{name}.json", workdir / f"{name}.out.json", workdir / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0"),
           # no AMX, as on the machines these exact-equality tests were written on: vLLM's attention on ISA vec
           # (vec_isa/sitecustomize.py says why) and oneDNN's bfloat16 matmuls on AVX-512
           "PYTHONPATH": os.pathsep.join(p for p in (str(HERE / "vec_isa"), os.environ.get("PYTHONPATH")) if p),
           "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "DNNL_MAX_CPU_ISA": "AVX512_CORE_BF16"}
    with log.open("w") as f:
        rc = subprocess.run([sys.executable, str(HERE / "_engine.py"), str(spec_path), str(out_path)], stdout=f,
                            stderr=subprocess.STDOUT, env=env, timeout=ENGINE_TIMEOUT_S, cwd=str(workdir)).returncode
    if rc != 0 or not out_path.is_file():
        raise RuntimeError(f"engine {name} failed (exit {rc}); log {log}:\n{log.read_text(errors='replace')[-4000:]}")
    result = json.loads(out_path.read_text())
    result["log"] = log.read_text(errors="replace")
    return result


def redis_executable() -> str | None:
    """The Redis-protocol server binary for the Redis cases, or ``None``."""
    exe = os.environ.get("KVPAGE_REDIS_SERVER") or shutil.which("redis-server") or shutil.which("valkey-server")
    return exe if exe and Path(exe).is_file() else None


@pytest.fixture(scope="session")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One directory for the session's engine specs, logs and stores."""
    return tmp_path_factory.mktemp("vllm")
