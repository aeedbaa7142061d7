#!/usr/bin/env bash
# The prepared device check of issue 31 (item 4): one GPU machine, no network, under 8 minutes.
#
#   bash benchmarks/gpu_check.sh                  # on the GPU machine, from the repository root
#   bash benchmarks/gpu_check.sh --dry-run        # CPU, Triton's interpreter, tiny shapes, fewer formats, ~1 min
#                                                 # (also KVPAGE_GPU_CHECK_DRY_RUN=1; tests/test_gpu_check.py runs it)
#   bash benchmarks/gpu_check.sh fetch-wheels     # here, with network: the small wheels the device may lack
#
# Parts, each under its own timeout (and all under KVPAGE_GPU_CHECK_BUDGET_S, default 450 s), so one failure or
# hang loses only its own figures:
#   (a) tests: tests/test_triton_backend.py, tests/test_triton_sealed.py, tests/test_copy_stream.py (the tiers' copy
#       stream, pinned host blocks), tests/test_staging.py (step metadata without a host synchronisation) and
#       tests/test_c29_gpu_dtypes.py on CUDA tensors, kernels compiled (KVPAGE_TRITON_TEST_DEVICE=cuda); the dry
#       run: test_c29 under the interpreter;
#   (b) decode: benchmarks/triton_decode.py (batch 1/32/128 x context 4k/32k x formats, µs per layer, GB/s against
#       the measured copy bandwidth, torch SDPA on dense bf16 beside it);
#   (c) e2e: benchmarks/gpu_e2e.py per KV format (random Llama-3-8B-shaped bf16 model, batch 64, 2,048-token
#       contexts, requests that fit one KV budget), after a tiny probe of the engine on the device: if the probe
#       fails, (c) is skipped and the report says why.
# Writes $OUT/gpu_check.json and $OUT/gpu_check.md (OUT defaults to ./gpu-check-out), beside each part's log.
#
# Install: kvpage from this working tree (pip install --no-deps --no-build-isolation -e .; if that fails, e.g. an
# old setuptools, PYTHONPATH=src). Needs torch (2.11 is fine: nothing here needs 2.13) and triton; of the rest,
# a module the device lacks (pytest, msgspec, safetensors, tqdm, numpy) is installed from benchmarks/wheels/
# (fetch-wheels; ignored by git, so carry that folder to the device), or its part fails saying so.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DRY=${KVPAGE_GPU_CHECK_DRY_RUN:-0}
case "${1:-}" in
  --dry-run) DRY=1 ;;
  fetch-wheels)
    exec "$PY" -m pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
      --no-deps -d benchmarks/wheels pytest pluggy iniconfig packaging pygments msgspec safetensors tqdm numpy ;;
  "") ;;
  *) echo "usage: $0 [--dry-run | fetch-wheels]" >&2; exit 2 ;;
esac
OUT=${OUT:-./gpu-check-out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
rm -f "$OUT/parts.jsonl" "$OUT/gpu_e2e.jsonl"
DEADLINE=$((SECONDS + ${KVPAGE_GPU_CHECK_BUDGET_S:-450}))

# part NAME LIMIT_S CMD...: run CMD under min(LIMIT_S, time left), log to $OUT/NAME.log, record the outcome.
part() {
  local name=$1 limit=$2 left=$((DEADLINE - SECONDS)) t0=$SECONDS rc status
  shift 2
  ((limit > left)) && limit=$left
  if ((limit < 15)); then
    echo "{\"part\": \"$name\", \"status\": \"skipped\", \"note\": \"no time left in the budget\"}" >>"$OUT/parts.jsonl"
    return 1
  fi
  echo "== $name (limit ${limit}s)"
  timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  case $rc in 0) status=ok ;; 124|137) status=timeout ;; *) status=failed ;; esac
  echo "{\"part\": \"$name\", \"status\": \"$status\", \"rc\": $rc, \"seconds\": $((SECONDS - t0)), \"log\": \"$name.log\"}" \
    >>"$OUT/parts.jsonl"
  echo "   $status in $((SECONDS - t0))s"
  return $rc
}
skip() { echo "{\"part\": \"$1\", \"status\": \"skipped\", \"note\": $("$PY" -c 'import json,sys; print(json.dumps(sys.argv[1]))' "$2")}" >>"$OUT/parts.jsonl"; echo "== $1 skipped: $2"; }

if ((DRY)); then
  export KVPAGE_TRITON_TEST_DEVICE=cpu TRITON_INTERPRET=1 PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
  DEV=(--dry-run)
  DECODE=(--formats bfloat16,int8)
  : "${KVPAGE_GPU_CHECK_E2E_FORMATS:=bfloat16 int4}"
else
  export KVPAGE_TRITON_TEST_DEVICE=cuda
  unset TRITON_INTERPRET
  DEV=()
  DECODE=()
  for m in pytest pluggy iniconfig packaging pygments msgspec safetensors tqdm numpy; do
    "$PY" -c "import $m" 2>/dev/null && continue
    w=$(ls benchmarks/wheels/"$m"-*.whl 2>/dev/null | head -1)
    if [[ -n $w ]]; then "$PY" -m pip install -q --no-index --no-deps "$w"; else echo "missing module $m (no wheel)"; fi
  done
  if ! "$PY" -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1; then
    echo "pip install -e . failed (see install.log): using PYTHONPATH=src"
    export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
  fi
fi
"$PY" -c 'import torch, triton, kvpage; print("torch", torch.__version__, "triton", triton.__version__, "cuda",
  torch.cuda.is_available(), "kvpage", kvpage.__file__)' | tee "$OUT/versions.txt"

# (a) tests
TESTS=(tests/test_c29_gpu_dtypes.py)
((DRY)) || TESTS=(tests/test_triton_backend.py tests/test_triton_sealed.py tests/test_copy_stream.py tests/test_staging.py "${TESTS[@]}")
part tests 200 "$PY" -m pytest -p no:xdist -p no:cacheprovider -q -o addopts= "${TESTS[@]}" --junitxml="$OUT/tests.xml"

# (b) decode-attention microbenchmark
part decode 150 "$PY" benchmarks/triton_decode.py "${DEV[@]}" "${DECODE[@]}" --out "$OUT"

# (c) end to end, if the engine runs on the device at all
if part e2e_probe 90 "$PY" benchmarks/gpu_e2e.py "${DEV[@]}" --tiny --format bfloat16 --out "$OUT/probe"; then
  for fmt in ${KVPAGE_GPU_CHECK_E2E_FORMATS:-bfloat16 int8 fp8 int4}; do
    part "e2e_$fmt" 100 "$PY" benchmarks/gpu_e2e.py "${DEV[@]}" --format "$fmt" --out "$OUT"
  done
else
  skip e2e "the engine did not run a tiny model on the device (e2e_probe.log: $(tail -1 "$OUT/e2e_probe.log" 2>/dev/null))"
fi

"$PY" benchmarks/gpu_check_report.py "$OUT"
