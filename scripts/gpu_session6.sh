#!/usr/bin/env bash
# Session 6's GPU calls (device tool, repo root). Everything lands in $OUT.
#   bash scripts/gpu_session6.sh a   # the whole GPU test suite ALONE, memcheck subset, tour, then the vLLM
#                                    # partitions-per-program rows (no FlashInfer; no .peers needed)
#   bash scripts/gpu_session6.sh b   # carry .peers: FlashInfer's prefill builds (nothing else on the CPU), then
#                                    # the prefill table (fa2, fa3, SDPA; no Flex) and the cascade/merge table
mode=${1:-a}
# shellcheck source=scripts/gpu_common.sh
source "$(dirname "$0")/gpu_common.sh"

if [ "$mode" = a ]; then
  step 300 gpu-tests python3 -m pytest -q -n 12 -p no:cacheprovider tests -rfE --timeout 280 --durations 15
  step 70 memcheck compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
    tests/test_decode.py tests/test_prefill.py tests/test_page.py tests/test_replan_fast.py tests/test_vllm.py \
    -k "matches_reference"
  step 25 tour python3 examples/tour.py
  step $((590 - SECONDS)) vllm-pp python3 benchmarks/bench_vllm_paged.py --graph --no-flashinfer \
    --cases '1x32768,16x8192' --variants v1,v2,v2-pp2,v2-pp2-r0,v2-pp4,v2-pp8,v1,v2 --out "$OUT"
fi
if [ "$mode" = b ]; then
  bash .peers/install.sh >/dev/null && export PYTHONPATH=/tmp/peers:$PYTHONPATH FLASHINFER_CUDA_ARCH_LIST=9.0a
  step 200 prefill-fi-build python3 benchmarks/bench_prefill.py --fa3 --fi-build-only /tmp/prefill-fi.done
  step 220 bench-prefill python3 benchmarks/bench_prefill.py --fa3 --no-flex --wait-build /tmp/prefill-fi.done \
    --wait-limit 30 --out "$OUT"
  step $((590 - SECONDS)) bench-cascade python3 benchmarks/bench_cascade.py --out "$OUT"
fi
if [ "$mode" = c ]; then
  # The decode files of the GPU suite on the final decode kernel, then the decode table against FlashInfer
  # (carry .peers; its decode modules build inside the benchmark, nothing else running beside it).
  step 170 decode-tests python3 -m pytest -q -n 12 -p no:cacheprovider tests/test_decode.py \
    tests/test_kernels_decode.py tests/test_replan_fast.py tests/test_page_range.py tests/test_cascade.py \
    tests/test_cascade_kernels.py tests/test_api.py tests/test_vllm.py tests/test_engine.py -rfE
  bash .peers/install.sh >/dev/null && export PYTHONPATH=$PYTHONPATH:/tmp/peers FLASHINFER_CUDA_ARCH_LIST=9.0a
  step $((590 - SECONDS)) bench-decode python3 benchmarks/bench_decode.py --graph --skip-cold --skip-merge --out "$OUT"
fi
