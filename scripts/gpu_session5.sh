#!/usr/bin/env bash
# Session 5's final GPU calls (device tool, repo root, carry .peers). Everything lands in $OUT.
#   bash scripts/gpu_session5.sh a   # GPU test suite + memcheck + tour while FlashInfer builds its prefill
#                                    # modules, then the prefill table (fa2, fa3, SDPA; no Flex)
#   bash scripts/gpu_session5.sh b   # cascade + merge rows, plan() host time, vLLM variants (pass the labels in
#                                    # VLLM_VARIANTS), all against FlashInfer in the same process
set -uo pipefail
mode=${1:-a}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
bash .peers/install.sh >/dev/null && export PYTHONPATH=/tmp/peers:${PYTHONPATH:-} FLASHINFER_CUDA_ARCH_LIST=9.0a
export PYTHONUNBUFFERED=1 PYTHONPATH=src:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu-$mode.txt" 2>&1
step() { local limit=$1; shift; local name=$1; shift; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "== $name: exit $rc in $((SECONDS - t0)) s"; tail -n 6 "$OUT/$name.log"; }

if [ "$mode" = a ]; then
  (timeout 300 python3 benchmarks/bench_prefill.py --fa3 --fi-build-only /tmp/prefill-fi.done > "$OUT/prefill-fi-build.log" 2>&1 &)
  step 280 gpu-tests python3 -m pytest -q -n 12 -p no:cacheprovider tests -rfE --timeout 270
  step 60 memcheck compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
    tests/test_decode.py tests/test_prefill.py tests/test_page.py tests/test_replan_fast.py -k "matches_reference"
  step 30 tour python3 examples/tour.py
  step 200 bench-prefill python3 benchmarks/bench_prefill.py --fa3 --no-flex --wait-build /tmp/prefill-fi.done \
    --wait-limit 120 --out "$OUT"
fi
if [ "$mode" = b ]; then
  step 150 bench-cascade python3 benchmarks/bench_cascade.py --out "$OUT"
  step 130 plan-breakdown python3 scripts/plan_breakdown.py --out "$OUT"
  if [ -n "${VLLM_VARIANTS:-}" ]; then
    step 110 vllm-variants python3 benchmarks/bench_vllm_paged.py --no-flashinfer --graph --out "$OUT" \
      --cases "64x4096 32/8,256x1024,16x8192,1x32768" --variants "$VLLM_VARIANTS"
  fi
fi
