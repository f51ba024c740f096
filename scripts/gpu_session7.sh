#!/usr/bin/env bash
# Session 7's GPU calls (device tool, repo root, carry .peers). Everything lands in $OUT.
#   bash scripts/gpu_session7.sh a   # decode/vLLM/merge GPU test files ALONE (positional launches, literal
#                                    # constants), then FlashInfer: the vLLM table (graph + eager, host times)
#                                    # and the merge hint variants (load-only / store-only streaming hints)
#   bash scripts/gpu_session7.sh b   # the test files again ALONE, then FlashInfer: vLLM table, merge variants
#                                    # round 2, append/merge table (bench_page)
#   bash scripts/gpu_session7.sh c   # FlashInfer: decode table + plan() timing, cascade + merge rows
mode=${1:-a}
# shellcheck source=scripts/gpu_common.sh
source "$(dirname "$0")/gpu_common.sh"

if [ "$mode" = a ]; then
  step 180 gpu-tests python3 -m pytest -q -n 12 -p no:cacheprovider tests/test_decode.py \
    tests/test_kernels_decode.py tests/test_replan_fast.py tests/test_page_range.py tests/test_cascade.py \
    tests/test_cascade_kernels.py tests/test_api.py tests/test_vllm.py tests/test_engine.py \
    tests/test_kernels_merge.py -rfE
  peers
  step 260 bench-vllm python3 benchmarks/bench_vllm_paged.py --graph --out "$OUT"
  step $((590 - SECONDS)) merge-variants python3 scripts/merge_sweep.py --variants --budget-s 70 --out "$OUT" \
    --only default fixed-nohint fixed-hint-load fixed-hint-store
fi
if [ "$mode" = b ]; then
  # After v2's small-batch reduction moved to its separate launch eagerly too: the same test files ALONE
  # (the first run was cut at ~90% by its 180 s limit, no failure), then FlashInfer: the vLLM table again,
  # merge variants round 2 (store-only hints with other tiles / persistence), the append/merge table.
  step 250 gpu-tests python3 -m pytest -q -n 14 -p no:cacheprovider tests/test_decode.py \
    tests/test_kernels_decode.py tests/test_replan_fast.py tests/test_page_range.py tests/test_cascade.py \
    tests/test_cascade_kernels.py tests/test_api.py tests/test_vllm.py tests/test_engine.py \
    tests/test_kernels_merge.py -rfE
  peers
  step 100 bench-vllm python3 benchmarks/bench_vllm_paged.py --graph --out "$OUT"
  step 70 merge-variants python3 scripts/merge_sweep.py --variants --budget-s 40 --out "$OUT" \
    --only default fixed-hint-store fixed-store-t2048 fixed-store-t8192 fixed-store-persist4-s3 \
    fixed-store-persist8-s2 3d-few-nohint
  step $((590 - SECONDS)) bench-page python3 benchmarks/bench_page.py --out "$OUT"
fi
if [ "$mode" = c ]; then
  # Final code: the GPU test files but the engine's (slow model set-up; the public API it uses is covered),
  # verbose so a cut run still shows what passed; then the decode table + plan() timing with FlashInfer.
  step 230 gpu-tests python3 -m pytest -v -n 14 -p no:cacheprovider tests/test_vllm.py tests/test_decode.py \
    tests/test_kernels_decode.py tests/test_replan_fast.py tests/test_page_range.py tests/test_cascade.py \
    tests/test_cascade_kernels.py tests/test_api.py tests/test_kernels_merge.py -rfE
  peers
  step $((590 - SECONDS)) bench-decode python3 benchmarks/bench_decode.py --graph --skip-cold --skip-merge --out "$OUT"
fi
if [ "$mode" = d ]; then
  # The engine tests (left out of c) ALONE on the final code, then FlashInfer: merge variants round 2 and
  # the cascade/merge table.
  step 200 engine-tests python3 -m pytest -v -n 8 -p no:cacheprovider tests/test_engine.py -rfE
  peers
  step 130 merge-variants python3 scripts/merge_sweep.py --variants --budget-s 100 --out "$OUT" \
    --only default fixed-hint-store fixed-store-t2048 fixed-store-t8192 fixed-store-persist4-s3 \
    fixed-store-persist8-s2 3d-few-nohint
  step $((590 - SECONDS)) bench-cascade python3 benchmarks/bench_cascade.py --out "$OUT"
fi
if [ "$mode" = e ]; then
  # After MERGE_TWO_PASS (the fused merges take the maximum first): the decode/vLLM/cascade test files ALONE,
  # then FlashInfer: the vLLM table, a same-process A/B of the fused merges (two-pass vs online) on the split
  # rows for vLLM (eager and graph) and the CSR decode (graph replays).
  step 200 gpu-tests python3 -m pytest -v -n 14 -p no:cacheprovider tests/test_vllm.py tests/test_decode.py \
    tests/test_kernels_decode.py tests/test_replan_fast.py tests/test_cascade.py tests/test_cascade_kernels.py \
    tests/test_api.py -rfE
  peers
  step 120 bench-vllm python3 benchmarks/bench_vllm_paged.py --graph --out "$OUT"
  mkdir -p "$OUT/ab"
  step 90 vllm-ab python3 benchmarks/bench_vllm_paged.py --graph --no-flashinfer --cases 1x32768,16x8192 \
    --variants v1,v2,v1-op,v2-op,v1,v2,v1-op,v2-op --out "$OUT/ab"
  step $((590 - SECONDS)) decode-ab python3 scripts/decode_ab.py --flag MERGE_TWO_PASS --values True,False \
    --cases 1x32768,16x8192 --rounds 3 --out "$OUT/ab"
fi
if [ "$mode" = f ]; then
  # The GPU test files calls c/d/e did not run (prefill, page, math, errors, ...: the literal constants touch
  # RoPE's cosine/sine), then the memcheck subset on the final kernels (no FlashInfer).
  step 330 gpu-tests python3 -m pytest -v -n 14 -p no:cacheprovider tests/test_prefill.py tests/test_kernels_prefill.py \
    tests/test_page.py tests/test_kernels_page.py tests/test_kernels_math.py tests/test_errors.py \
    tests/test_reference.py tests/test_review_session2.py tests/test_readme.py tests/test_docs.py -rfE
  step $((590 - SECONDS)) memcheck compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q \
    -p no:cacheprovider tests/test_decode.py tests/test_prefill.py tests/test_page.py tests/test_replan_fast.py \
    tests/test_vllm.py -k "matches_reference"
fi
if [ "$mode" = g ]; then
  # After the positional prefill / merge / append launches: the files that run them, then memcheck on them.
  step 300 gpu-tests python3 -m pytest -v -n 14 -p no:cacheprovider tests/test_prefill.py tests/test_kernels_prefill.py \
    tests/test_kernels_merge.py tests/test_page.py tests/test_kernels_page.py tests/test_cascade.py \
    tests/test_cascade_kernels.py tests/test_api.py tests/test_engine.py -rfE
  step $((590 - SECONDS)) memcheck compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q \
    -p no:cacheprovider tests/test_prefill.py tests/test_decode.py tests/test_kernels_merge.py \
    tests/test_kernels_page.py -k "matches_reference or merge_gpu_large or append_cast_on_store_gpu"
fi
