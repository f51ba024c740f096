#!/usr/bin/env bash
# Runs on the GPU machine (device tool), from the repo root. Everything it measures lands in $OUT.
#   bash scripts/gpu_suite.sh tests    # the whole test suite on CUDA, a compute-sanitizer subset, the tour
#   bash scripts/gpu_suite.sh bench    # decode, vLLM, FlexAttention decode (carry .peers); starts FlashInfer's
#                                      # prefill JIT builds in the background for the next call
#   bash scripts/gpu_suite.sh bench-prefill  # prefill (fa2, fa3, SDPA, Flex) and page (carry .peers)
#   bash scripts/gpu_suite.sh bench2   # cascade and engine benchmarks (carry .peers and .engine_gpu)
# Run them back to back (the machine keeps /tmp and FlashInfer's JIT cache while it stays warm).
# Each step has its own time limit so that one slow step cannot eat the call.
set -uo pipefail
mode=${1:-tests}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/gpu-$mode.txt" 2>&1
cat "$OUT/gpu-$mode.txt"
step() { local limit=$1; shift; local name=$1; shift; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "== $name: exit $rc in $((SECONDS - t0)) s"; tail -n 12 "$OUT/$name.log"; }

if [ "$mode" = tests ]; then
  # On CUDA every test runs on the GPU: API tests through the Triton kernels, kernel tests, the gpu suite.
  step 400 gpu-tests python3 -m pytest -q -n 14 -p no:cacheprovider tests -rfE --timeout 390
  step 80 memcheck compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
    tests/test_decode.py tests/test_prefill.py tests/test_page.py tests/test_replan_fast.py -k "matches_reference"
  step 40 tour python3 examples/tour.py
fi

if [ "$mode" != tests ]; then
  bash .peers/install.sh >/dev/null && export PYTHONPATH=/tmp/peers:$PYTHONPATH FLASHINFER_CUDA_ARCH_LIST=9.0a
fi
if [ "$mode" = bench ]; then
  # First-call (cold Triton cache) times before anything else runs: FlashInfer's nvcc builds below use every
  # core and doubled them once (2026-11-23: 10.2 / 5.9 s instead of 4.4 / 1.9 s).
  step 60 bench-decode-cold python3 benchmarks/bench_decode.py --only-extras --skip-merge --skip-plan \
    --no-flashinfer --out "$OUT/cold"
  # FlashInfer compiles its prefill variants (fa2 and fa3) in the background while decode is timed.
  (timeout 460 python3 benchmarks/bench_prefill.py --fa3 --fi-build-only /tmp/prefill-fi.done > "$OUT/prefill-fi-build.log" 2>&1 &)
  step 220 bench-decode python3 benchmarks/bench_decode.py --graph --engine --skip-cold --out "$OUT"
  step 110 bench-vllm python3 benchmarks/bench_vllm_paged.py --graph --k3d --out "$OUT"
  step 130 bench-decode-flex python3 benchmarks/bench_decode_flex.py --budget 90 --out "$OUT"
  # keep the call (and so the build) alive until FlashInfer's builds are done, within the call's limit
  while [ ! -f /tmp/prefill-fi.done ] && [ "$SECONDS" -lt 470 ]; do sleep 5; done
  echo "== prefill FlashInfer builds done: $([ -f /tmp/prefill-fi.done ] && echo yes || echo no) at $SECONDS s"
fi
if [ "$mode" = bench-prefill ]; then
  step 300 bench-prefill python3 benchmarks/bench_prefill.py --fa3 --wait-build /tmp/prefill-fi.done --out "$OUT"
  step 60 bench-page python3 benchmarks/bench_page.py --out "$OUT"
fi
if [ "$mode" = bench2 ]; then
  step 200 bench-cascade python3 benchmarks/bench_cascade.py --out "$OUT"
  gguf=/tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf   # assembled by scripts/gguf_parts.sh when all parts came
  if [ -f "$gguf" ]; then
    model_args="--model $gguf"; export PYTHONPATH=.engine_gpu/pylib:$PYTHONPATH   # the gguf package rides along
  else
    model_args="--random"
  fi
  step 300 bench-engine python3 benchmarks/bench_engine.py $model_args --libs flashinfer_triton flashinfer \
    --peer-no-cascade --batch-sizes 1 8 32 --new-tokens 64 --check 16 --check-prompts 16 --out "$OUT"
fi
