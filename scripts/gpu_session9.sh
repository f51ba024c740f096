#!/usr/bin/env bash
# Session 9's GPU calls (device tool, repo root, carry .peers). Everything lands in $OUT.
#   bash scripts/gpu_session9.sh a   # the 64-query x 16384-key prefill row: each kernel's GPU time (attention,
#                                    # partial merge) and the graph time, for the default and 128x128 tiles
#   bash scripts/gpu_session9.sh b   # prefill / cascade tests after the fused split merge, 64q / 128q rows fused
#                                    # vs separate merge launch
#   bash scripts/gpu_session9.sh c   # one-pass partial merge, PDL on / off, fused: tests and the few-query rows
#   bash scripts/gpu_session9.sh d   # host time per prefill run() by variant
#   bash scripts/gpu_session9.sh e   # GPU tests with the short launch path (FastKernel), memcheck subset, host probe
#   bash scripts/gpu_session9.sh f   # the whole GPU suite on the final code, host probe
#   bash scripts/gpu_session9.sh g   # FlashInfer side by side: 64-query prefill row, cascade / merge, decode table
mode=${1:-a}
# shellcheck source=scripts/gpu_common.sh
source "$(dirname "$0")/gpu_common.sh"

if [ "$mode" = a ]; then
  step 200 split-profile python3 scripts/prefill_split_sweep.py --cases 64q --configs "128x128 w8 s3" \
    --targets 0,6,8 --graph --profile
fi
if [ "$mode" = b ]; then
  # After the fused split merge (FUSED_MERGE): prefill / cascade GPU tests, then the 64-query row fused vs the
  # separate merge launch (same process), kernel times by profiler.
  step 240 gpu-tests python3 -m pytest -q -n 14 -p no:cacheprovider tests/test_prefill.py \
    tests/test_kernels_prefill.py tests/test_cascade.py tests/test_cascade_kernels.py -rfE
  step 150 split-ab python3 scripts/prefill_split_sweep.py --cases 64q --configs "128x128 w8 s3" --targets 0 \
    --fused 1,0,1,0 --graph --profile
  step 100 split-ab-128q python3 scripts/prefill_split_sweep.py --cases 128q --targets 0 --fused 1,0 --graph --profile
fi
if [ "$mode" = c ]; then
  # The partial merge in one pass (eight splits' loads per step) and as a programmatic dependent launch (PDL):
  # prefill / cascade tests, then the 64q / 128q / 16q rows: PDL on / off / fused, kernel times by profiler.
  step 200 gpu-tests python3 -m pytest -q -n 14 -p no:cacheprovider tests/test_prefill.py \
    tests/test_kernels_prefill.py tests/test_cascade.py tests/test_cascade_kernels.py -rfE
  step 120 split-pdl python3 scripts/prefill_split_sweep.py --cases 64q --configs "128x128 w8 s3" --targets 0 \
    --pdl 1,0,1,0 --graph --profile
  step 60 split-fused python3 scripts/prefill_split_sweep.py --cases 64q --targets 0 --fused 1 --graph --profile
  step 100 split-pdl-128q python3 scripts/prefill_split_sweep.py --cases 128q --targets 0 --pdl 1,0 --graph --profile
  step 100 split-pdl-16q python3 scripts/prefill_split_sweep.py --cases 16q --targets 0 --pdl 1,0 --graph --profile
fi
if [ "$mode" = d ]; then
  # Host microseconds per prefill run() (seam), by variant (TMA descriptors, split + merge launch), with a cProfile.
  step 200 host-probe python3 scripts/prefill_host_probe.py
fi
if [ "$mode" = e ]; then
  # FastKernel (the short launch path) everywhere: the decode-side and shared test files, the prefill / cascade
  # files, a memcheck subset, then the host time per prefill run() again.
  step 250 gpu-tests-1 python3 -m pytest -q -n 14 -p no:cacheprovider tests/test_vllm.py tests/test_decode.py \
    tests/test_kernels_decode.py tests/test_replan_fast.py tests/test_api.py tests/test_engine.py tests/test_errors.py \
    tests/test_launch.py tests/test_kernels_merge.py tests/test_page.py tests/test_kernels_page.py tests/test_page_range.py \
    tests/test_review_session2.py tests/test_reference.py tests/test_kernels_math.py -rfE
  step 120 gpu-tests-2 python3 -m pytest -q -n 14 -p no:cacheprovider tests/test_prefill.py tests/test_kernels_prefill.py \
    tests/test_cascade.py tests/test_cascade_kernels.py -rfE
  step 120 memcheck compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
    tests/test_kernels_prefill.py tests/test_launch.py tests/test_kernels_decode.py \
    -k "split_kv or fused_merge or fast_path or batch-paged or fused_merge_repeat or cuda_graph_replay_new_lengths"
  step 60 host-probe python3 scripts/prefill_host_probe.py
fi
if [ "$mode" = f ]; then
  # Final code: the whole GPU suite in two parts (the decode side alone had 250 s and was cut at ~95% in call e,
  # no failure up to there), the host probe again.
  step 340 gpu-tests-1 python3 -m pytest -q -n 14 -p no:cacheprovider tests/test_vllm.py tests/test_decode.py \
    tests/test_kernels_decode.py tests/test_replan_fast.py tests/test_api.py tests/test_engine.py tests/test_errors.py \
    tests/test_launch.py tests/test_kernels_merge.py tests/test_page.py tests/test_kernels_page.py tests/test_page_range.py \
    tests/test_review_session2.py tests/test_reference.py tests/test_kernels_math.py -rfE
  step 120 gpu-tests-2 python3 -m pytest -q -n 14 -p no:cacheprovider tests/test_prefill.py tests/test_kernels_prefill.py \
    tests/test_cascade.py tests/test_cascade_kernels.py -rfE
  step 60 host-probe python3 scripts/prefill_host_probe.py
fi
if [ "$mode" = g ]; then
  # Tables with FlashInfer in one process: the 64-query prefill row against fa2, the cascade / merge table, the
  # decode table with plan() timing.
  peers
  step 150 bench-prefill-64q python3 benchmarks/bench_prefill.py --only "shared prefix" --no-flex --no-sdpa --out "$OUT"
  step 230 bench-cascade python3 benchmarks/bench_cascade.py --out "$OUT"
  step $((590 - SECONDS)) bench-decode python3 benchmarks/bench_decode.py --graph --skip-cold --out "$OUT"
fi
if [ "$mode" = h ]; then
  # merge rows ours only, short launch path on / off / on (is merge_states 512 x 8 eager 28.6 us the launch path?)
  for fl in 1 0 1; do
    FLASHINFER_TRITON_FAST_LAUNCH=$fl step 100 merge-fast$fl python3 benchmarks/bench_cascade.py --skip-cascade \
      --no-flashinfer --out /tmp/m$fl
    grep -E "merge_state" "$OUT/merge-fast$fl.log" | head -8
  done
fi
if [ "$mode" = i ]; then
  # Encoded tensor descriptors cached by the launch path; small eager prefill launches take descriptors for K/V
  # seen before: prefill / cascade / launch tests, host probe, the 64-query and append rows against fa2.
  step 150 gpu-tests-2 python3 -m pytest -q -n 14 -p no:cacheprovider tests/test_prefill.py tests/test_kernels_prefill.py \
    tests/test_cascade.py tests/test_cascade_kernels.py tests/test_launch.py tests/test_api.py -rfE
  step 60 host-probe python3 scripts/prefill_host_probe.py
  peers
  step 200 bench-prefill-rows python3 benchmarks/bench_prefill.py --only "shared prefix" --no-flex --no-sdpa --out "$OUT"
fi
if [ "$mode" = j ]; then
  # Partial values in the output dtype (PARTIAL_IN_OUT_DTYPE): prefill / cascade / launch tests, the 64q / 128q /
  # 16q rows with 16-bit vs float32 partials (graph, kernel times), the 64q row against fa2, the cascade table.
  step 150 gpu-tests-2 python3 -m pytest -q -n 14 -p no:cacheprovider tests/test_prefill.py tests/test_kernels_prefill.py \
    tests/test_cascade.py tests/test_cascade_kernels.py tests/test_launch.py tests/test_api.py -rfE
  step 60 split-pdt python3 scripts/prefill_split_sweep.py --cases 64q --targets 0 --pdt 1,0,1,0 --graph --profile
  step 40 split-pdt-128q python3 scripts/prefill_split_sweep.py --cases 128q --targets 0 --pdt 1,0 --graph --profile
  step 40 split-pdt-16q python3 scripts/prefill_split_sweep.py --cases 16q --targets 0 --pdt 1,0 --graph --profile
  peers
  step 150 bench-prefill-rows python3 benchmarks/bench_prefill.py --only "shared prefix" --no-flex --no-sdpa --out "$OUT"
  step $((590 - SECONDS)) bench-cascade python3 benchmarks/bench_cascade.py --skip-merge --out "$OUT"
fi
if [ "$mode" = k ]; then
  # Final code (descriptor cache, 16-bit partials, leaner launch key): the whole GPU suite, host probe, 64q row.
  step 330 gpu-tests-1 python3 -m pytest -q -n 14 -p no:cacheprovider tests/test_vllm.py tests/test_decode.py \
    tests/test_kernels_decode.py tests/test_replan_fast.py tests/test_api.py tests/test_engine.py tests/test_errors.py \
    tests/test_launch.py tests/test_kernels_merge.py tests/test_page.py tests/test_kernels_page.py tests/test_page_range.py \
    tests/test_review_session2.py tests/test_reference.py tests/test_kernels_math.py -rfE -rs
  step 120 gpu-tests-2 python3 -m pytest -q -n 14 -p no:cacheprovider tests/test_prefill.py tests/test_kernels_prefill.py \
    tests/test_cascade.py tests/test_cascade_kernels.py -rfE
  step 45 host-probe python3 scripts/prefill_host_probe.py
  peers
  step $((590 - SECONDS)) bench-prefill-rows python3 benchmarks/bench_prefill.py --only "shared prefix" --no-flex \
    --no-sdpa --out "$OUT"
fi
if [ "$mode" = l ]; then
  # The 64-query row with the final code: tiles x split targets (graph replays), 16-bit partials and PDL on.
  step 150 split-sweep python3 scripts/prefill_split_sweep.py --cases 64q --graph --targets 0,6,10,12,16 \
    --configs "128x128 w8 s3,128x64 w8 s3,64x128 w4 s3"
fi
if [ "$mode" = m ]; then
  # Few-query rows, default tile (64x64 w4) against 128x128 w8, rule split, graph replays (three rows, twice).
  for c in 64q 128q 16q; do
    step 60 tiles-$c python3 scripts/prefill_split_sweep.py --cases $c --graph --targets 0,0 --configs "128x128 w8 s3"
  done
fi
if [ "$mode" = n ]; then
  # 128x128 tiles for split few-query batches of >= 256 rows: prefill / cascade tests, the 64q row vs fa2, cascade.
  step 150 gpu-tests-2 python3 -m pytest -q -n 14 -p no:cacheprovider tests/test_prefill.py tests/test_kernels_prefill.py \
    tests/test_cascade.py tests/test_cascade_kernels.py -rfE
  peers
  step 150 bench-prefill-rows python3 benchmarks/bench_prefill.py --only "shared prefix" --no-flex --no-sdpa --out "$OUT"
  step $((590 - SECONDS)) bench-cascade python3 benchmarks/bench_cascade.py --skip-merge --out "$OUT"
fi
if [ "$mode" = o ]; then
  # Eager decode re-plan with one split for all views and cached partial-state views: decode / re-plan / API tests,
  # plan() timing against FlashInfer (batch 256, page table on the CPU and on the GPU).
  step 200 gpu-tests python3 -m pytest -q -n 14 -p no:cacheprovider tests/test_replan_fast.py tests/test_decode.py \
    tests/test_api.py tests/test_kernels_decode.py -rfE
  peers
  step $((590 - SECONDS)) bench-plan python3 benchmarks/bench_decode.py --only-extras --skip-cold --skip-merge --out "$OUT"
fi
if [ "$mode" = p ]; then
  # Final code: the decode-side and shared GPU test files (the prefill / cascade files ran in call n).
  step 330 gpu-tests-1 python3 -m pytest -q -n 14 -p no:cacheprovider tests/test_vllm.py tests/test_decode.py \
    tests/test_kernels_decode.py tests/test_replan_fast.py tests/test_api.py tests/test_engine.py tests/test_errors.py \
    tests/test_launch.py tests/test_kernels_merge.py tests/test_page.py tests/test_kernels_page.py tests/test_page_range.py \
    tests/test_review_session2.py tests/test_reference.py tests/test_kernels_math.py -rfE
fi
