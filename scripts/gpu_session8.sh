#!/usr/bin/env bash
# Session 8's GPU calls (device tool, repo root, carry .peers). Everything lands in $OUT.
#   bash scripts/gpu_session8.sh a   # decode-side GPU test files ALONE (the fused merges' [heads, D] tiles),
#                                    # then: paged-prefill probe (ours only), FlashInfer: the vLLM table and a
#                                    # fused / separate v2 reduction A/B, the decode table
#   bash scripts/gpu_session8.sh b   # prefill / cascade / vLLM tests after the paged addressing, paged probe
#                                    # (new vs old addressing), vLLM table, paged row vs fa2 + its tile sweep
#   bash scripts/gpu_session8.sh c   # v2's [rows, 4] reduction: decode-side + prefill kernel tests, vLLM table,
#                                    # fused / separate A/B, decode table with plan() timing
#   bash scripts/gpu_session8.sh d   # vLLM / engine / API / merge / page / error / cascade tests, memcheck subset,
#                                    # plan() breakdown
#   bash scripts/gpu_session8.sh e   # prefill table with fa2 / fa3 (modules built alone first), cascade / merge table
#   bash scripts/gpu_session8.sh f   # merge_states 512 x 8 under ncu, the 64-query prefill row's tile / split sweep
mode=${1:-a}
# shellcheck source=scripts/gpu_common.sh
source "$(dirname "$0")/gpu_common.sh"

if [ "$mode" = a ]; then
  step 210 gpu-tests python3 -m pytest -v -n 14 -p no:cacheprovider tests/test_vllm.py tests/test_decode.py \
    tests/test_kernels_decode.py tests/test_replan_fast.py tests/test_cascade.py tests/test_cascade_kernels.py \
    tests/test_api.py -rfE
  step 100 paged-probe python3 scripts/prefill_paged_probe.py --out "$OUT"
  peers
  step 120 bench-vllm python3 benchmarks/bench_vllm_paged.py --graph --out "$OUT"
  mkdir -p "$OUT/ab"
  step 60 vllm-ab python3 benchmarks/bench_vllm_paged.py --graph --no-flashinfer --cases 1x32768,16x8192 \
    --variants v2,v2-f1,v2-f0,v1,v2 --out "$OUT/ab"
  step $((590 - SECONDS)) bench-decode python3 benchmarks/bench_decode.py --graph --skip-cold --skip-merge \
    --skip-plan --out "$OUT"
fi
if [ "$mode" = b ]; then
  # After the paged-prefill addressing (PAGE_INV / KV_SHARED / KV_I32) and v2's reduction as a called function:
  # the prefill / cascade / vLLM / decode-kernel test files ALONE, the paged probe with and without the new
  # addressing, then FlashInfer: the vLLM table, the paged prefill row against fa2 in one process.
  step 230 gpu-tests python3 -m pytest -v -n 14 -p no:cacheprovider tests/test_prefill.py tests/test_kernels_prefill.py \
    tests/test_cascade.py tests/test_cascade_kernels.py tests/test_vllm.py tests/test_kernels_decode.py tests/test_page.py -rfE
  step 90 paged-probe python3 scripts/prefill_paged_probe.py --forms paged-random --out "$OUT" \
    --configs "128x64 w8 s3,64x64 w4 s3,128x128 w8 s3,128x64 w8 s4,64x128 w4 s3,64x64 w4 s4,128x64 w8 s3 nopi,64x64 w4 s3 nopi"
  peers
  step 110 bench-vllm python3 benchmarks/bench_vllm_paged.py --graph --out "$OUT"
  step $((590 - SECONDS)) bench-prefill-paged python3 benchmarks/bench_prefill.py --only paged --no-flex --no-sdpa \
    --sweep --sweep-cases paged --out "$OUT"
fi
if [ "$mode" = c ]; then
  # v2's reduction as [rows, 4] tiles (inline, no stack): the decode-side files and the prefill kernel file ALONE,
  # then FlashInfer: the vLLM table, the fused / separate v2 A/B, the decode table with plan() timing.
  step 230 gpu-tests python3 -m pytest -v -n 14 -p no:cacheprovider tests/test_vllm.py tests/test_decode.py \
    tests/test_kernels_decode.py tests/test_kernels_prefill.py tests/test_replan_fast.py -rfE
  peers
  step 110 bench-vllm python3 benchmarks/bench_vllm_paged.py --graph --out "$OUT"
  mkdir -p "$OUT/ab"
  step 60 vllm-ab python3 benchmarks/bench_vllm_paged.py --graph --no-flashinfer --cases 1x32768,16x8192,64x4096 \
    --variants v2,v2-f1,v2-f0,v1,v2 --out "$OUT/ab"
  mv "$OUT/ab/"*.json "$OUT/vllm-ab.json" 2>/dev/null; mv "$OUT/ab/"* "$OUT/" 2>/dev/null; rmdir "$OUT/ab"
  step $((590 - SECONDS)) bench-decode python3 benchmarks/bench_decode.py --graph --skip-cold --skip-merge --out "$OUT"
fi
if [ "$mode" = d ]; then
  # v2 fused by default: the vLLM file again with the engine / API / merge / page / error files ALONE, memcheck on
  # the changed kernels (paged prefill addressing, fused merges and v2's reduction), then plan() host time.
  step 260 gpu-tests python3 -m pytest -v -n 14 -p no:cacheprovider tests/test_vllm.py tests/test_engine.py \
    tests/test_api.py tests/test_kernels_merge.py tests/test_kernels_page.py tests/test_errors.py tests/test_cascade.py -rfE
  step 170 memcheck compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
    tests/test_kernels_prefill.py tests/test_vllm.py tests/test_kernels_decode.py \
    -k "paged_offsets or fp8-e4m3-paged or append-512 or batch-paged or v1_internal_split or v2_parts_per_program or fused_merge_repeat or cuda_graph_replay_new_lengths"
  peers
  step $((590 - SECONDS)) plan-breakdown python3 scripts/plan_breakdown.py --out "$OUT" --rounds 5 --calls 100
fi
if [ "$mode" = e ]; then
  # The prefill table with fa2 / fa3 in one process (FlashInfer's prefill modules built alone first), then the
  # cascade / merge table.
  peers
  step 200 prefill-fi-build python3 benchmarks/bench_prefill.py --fa3 --fi-build-only /tmp/prefill-fi.done
  step 220 bench-prefill python3 benchmarks/bench_prefill.py --fa3 --no-flex --wait-build /tmp/prefill-fi.done \
    --wait-limit 30 --out "$OUT"
  step $((590 - SECONDS)) bench-cascade python3 benchmarks/bench_cascade.py --out "$OUT"
fi
if [ "$mode" = f ]; then
  # Nsight Compute on merge_states 512 x 8 with L2 kept between calls (ours: default / no hints / store hints;
  # FlashInfer), then the 64-query prefill row's tile and split choices timed as CUDA-graph replays.
  peers
  step 200 merge-ncu ncu --clock-control none --cache-control none -k 'regex:(?i)merge' \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size,launch__block_size,launch__occupancy_limit_registers,smsp__inst_executed.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed \
    python3 scripts/merge_ncu_probe.py
  step $((590 - SECONDS)) prefill-64q python3 scripts/prefill_split_sweep.py --cases 64q --graph \
    --configs "64x64 w4 s3,128x64 w8 s3,128x128 w8 s3" --targets 0,4,6,8,12
fi
if [ "$mode" = g ]; then
  # The GPU test files not yet run on the final code (their kernels last changed before calls b-d), then a
  # memcheck pass on the public prefill / decode / page entry points.
  step 330 gpu-tests python3 -m pytest -v -n 14 -p no:cacheprovider tests/test_cascade_kernels.py tests/test_page_range.py \
    tests/test_prefill.py tests/test_kernels_math.py tests/test_reference.py tests/test_review_session2.py \
    tests/test_decode.py tests/test_kernels_decode.py -rfE
  step $((590 - SECONDS)) memcheck compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q \
    -p no:cacheprovider tests/test_decode.py tests/test_prefill.py tests/test_page.py tests/test_replan_fast.py \
    -k "matches_reference"
fi
if [ "$mode" = h ]; then
  # merge_states with FlashInfer's grid shape (a program per row) under each cache-hint setting, warm and cold.
  peers
  step 250 merge-variants python3 scripts/merge_sweep.py --variants --budget-s 200 --out "$OUT" \
    --only default fixed-nohint fixed-hint-store fixed-t32768 fixed-nohint-t32768 fixed-store-t32768 \
    fixed-nohint-t16384 fixed-store-t16384
fi
if [ "$mode" = i ]; then
  # The candidates of call h again with a longer budget (its cold column had outliers of 100+ us).
  peers
  step 330 merge-variants python3 scripts/merge_sweep.py --variants --budget-s 300 --out "$OUT" \
    --only default fixed-hint-store fixed-store-t32768 fixed-store-t16384 fixed-t32768
fi
if [ "$mode" = j ]; then
  # merge_states' L2-resident rule: the merge test files ALONE, then FlashInfer: the cascade / merge table and
  # the rule against the old default (resident-off), warm and cold.
  step 150 gpu-tests python3 -m pytest -v -n 14 -p no:cacheprovider tests/test_kernels_merge.py tests/test_cascade.py \
    tests/test_cascade_kernels.py tests/test_api.py -rfE
  peers
  step 120 bench-cascade python3 benchmarks/bench_cascade.py --out "$OUT"
  step $((590 - SECONDS)) merge-variants python3 scripts/merge_sweep.py --variants --budget-s 120 --out "$OUT" \
    --only default resident-off
fi
if [ "$mode" = k ]; then
  # The cascade / merge table with merge_states' L2-resident rule (FlashInfer's modules build first: a fresh
  # machine has none).
  peers
  step 500 bench-cascade python3 benchmarks/bench_cascade.py --out "$OUT"
fi
if [ "$mode" = m ]; then
  # The prefill partial merge as [rows, 4] tiles: the prefill / cascade test files ALONE, the 64-query row's
  # graph time per tile, then FlashInfer fa2: the 64-query row and the append row.
  step 200 gpu-tests python3 -m pytest -v -n 14 -p no:cacheprovider tests/test_kernels_prefill.py tests/test_prefill.py \
    tests/test_cascade_kernels.py -rfE
  step 60 prefill-64q python3 scripts/prefill_split_sweep.py --cases 64q --graph --configs "128x128 w8 s3" --targets 0,8
  peers
  step $((590 - SECONDS)) bench-prefill-64q python3 benchmarks/bench_prefill.py --only "shared prefix" --no-flex \
    --no-sdpa --out "$OUT"
fi
if [ "$mode" = n ]; then
  # The 64-query row after the merge rebuild: tiles x split targets as graph replays.
  step 200 prefill-64q python3 scripts/prefill_split_sweep.py --cases 64q --graph --targets 0,6,8,12 \
    --configs "128x128 w8 s3,128x64 w8 s3,64x128 w4 s3,128x128 w8 s2,64x64 w4 s4"
fi
