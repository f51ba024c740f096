#!/usr/bin/env bash
# Runs on the GPU machine (device tool), from the repo root. Everything it measures lands in $OUT.
#   bash scripts/gpu_suite.sh tests    # the whole test suite on CUDA + compute-sanitizer subset + the tour
#   bash scripts/gpu_suite.sh bench    # every benchmark side by side with FlashInfer (needs .peers carried)
set -uo pipefail
mode=${1:-tests}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/gpu.txt"
cat "$OUT/gpu.txt"

if [ "$mode" = tests ]; then
  # On CUDA every test runs on the GPU: the API tests through the Triton kernels, the kernel tests, the gpu suite.
  python3 -m pytest -q -p no:cacheprovider tests -x --timeout=900 -m "not slow" \
    --junitxml="$OUT/gpu-tests.xml" 2>&1 | tail -n 40 | tee "$OUT/gpu-tests.txt"
  # memcheck on a representative subset (small shapes: the sanitizer is ~100x slower)
  compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
    tests/test_decode.py tests/test_prefill.py tests/test_cascade.py tests/test_page.py -k "not cuda_graph" \
    2>&1 | tail -n 15 | tee "$OUT/memcheck.txt"
  echo "memcheck exit: ${PIPESTATUS[0]}" | tee -a "$OUT/memcheck.txt"
  python3 examples/tour.py 2>&1 | tee "$OUT/tour.txt"
fi

if [ "$mode" = bench ]; then
  bash .peers/install.sh >/dev/null && export PYTHONPATH=/tmp/peers:$PYTHONPATH FLASHINFER_CUDA_ARCH_LIST=9.0a
  for b in decode prefill cascade page; do
    python3 benchmarks/bench_$b.py --out "$OUT" 2>&1 | tail -n 40 | tee "$OUT/bench-$b.txt"
  done
fi
