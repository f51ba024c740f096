#!/usr/bin/env bash
# Session 10's GPU calls (device tool, repo root, carry .peers). Everything lands in $OUT.
#   bash scripts/gpu_session10.sh a   # the Gluon (warp-specialized) prefill kernel: its GPU tests, then A/B
#                                     # against the Triton kernel on the prefill table's single-request rows
mode=${1:-a}
# shellcheck source=scripts/gpu_common.sh
source "$(dirname "$0")/gpu_common.sh"

if [ "$mode" = a ]; then
  step 300 ws-tests python3 -m pytest -q -x -p no:cacheprovider tests/test_prefill_sm90.py -rfE
  step 200 ws-probe python3 scripts/prefill_ws_probe.py --out "$OUT/ws-probe-a.json"
fi
if [ "$mode" = b ]; then
  # K and V buffers released separately, 3 stages at D128 (4 at D64): tests, then the A/B (and 2 stages again)
  step 300 ws-tests python3 -m pytest -q -p no:cacheprovider tests/test_prefill_sm90.py -rfE
  step 150 ws-probe python3 scripts/prefill_ws_probe.py --out "$OUT/ws-probe-b.json"
  step 100 ws-probe-s2 python3 scripts/prefill_ws_probe.py --stages 2 --only "D128 full"
fi
if [ "$mode" = c ]; then
  # CUDA-graph descriptors over the whole buffers (V tail zeroed), ping-pong option: tests, A/B rows
  step 300 ws-tests python3 -m pytest -q -p no:cacheprovider tests/test_prefill_sm90.py -rfE
  step 100 ws-probe python3 scripts/prefill_ws_probe.py --out "$OUT/ws-probe-c.json" --only D128
  step 100 ws-probe-pp python3 scripts/prefill_ws_probe.py --pingpong 1 --out "$OUT/ws-probe-c-pp.json" --only D128
  step 60 ws-probe-d64 python3 scripts/prefill_ws_probe.py --d64 1 --pingpong 1 --only D64
fi
if [ "$mode" = d ]; then
  # split pieces through the Gluon kernel (partial rows + merge launch): its tests, the prefill / cascade files,
  # then the A/B over every single-request row
  step 200 ws-tests python3 -m pytest -q -p no:cacheprovider tests/test_prefill_sm90.py -rfE
  step 240 gpu-tests-2 python3 -m pytest -q -n 14 -p no:cacheprovider tests/test_prefill.py \
    tests/test_kernels_prefill.py tests/test_cascade.py tests/test_cascade_kernels.py tests/test_api.py -rfE
  step 100 ws-probe python3 scripts/prefill_ws_probe.py --out "$OUT/ws-probe-d.json"
fi
if [ "$mode" = e ]; then
  # The prefill table with fa2 / fa3 in one process (FlashInfer's prefill modules built alone first)
  peers
  step 200 prefill-fi-build python3 benchmarks/bench_prefill.py --fa3 --fi-build-only /tmp/prefill-fi.done
  step 230 bench-prefill python3 benchmarks/bench_prefill.py --fa3 --no-flex --wait-build /tmp/prefill-fi.done \
    --wait-limit 30 --out "$OUT"
  step $((590 - SECONDS)) memcheck compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q \
    -p no:cacheprovider tests/test_prefill_sm90.py -k "(causal-g1-d128-fp16 and lse) or split-causal or graph_replan"
fi
if [ "$mode" = f ]; then
  # paged K/V through the Gluon kernel (one TMA copy per page): its tests, the prefill files, A/B on the paged
  # row (ours with the Gluon kernel on / off, same process), then FlashInfer fa2 / fa3 on the paged row
  step 200 ws-tests python3 -m pytest -q -p no:cacheprovider tests/test_prefill_sm90.py -rfE
  step 120 gpu-tests-2 python3 -m pytest -q -n 14 -p no:cacheprovider tests/test_prefill.py \
    tests/test_kernels_prefill.py tests/test_cascade.py tests/test_cascade_kernels.py tests/test_api.py -rfE
  step 60 paged-ab python3 scripts/prefill_ws_probe.py --paged --out "$OUT/ws-probe-f-paged.json"
  peers
  step $((590 - SECONDS)) bench-prefill-paged python3 benchmarks/bench_prefill.py --only paged --fa3 --no-flex \
    --no-sdpa --out "$OUT"
fi
if [ "$mode" = g ]; then
  # the whole GPU suite on the final code (the Gluon kernel's file included), memcheck on paged Gluon cases
  step 420 gpu-tests python3 -m pytest -q -n 14 -p no:cacheprovider tests -rfE
  step $((590 - SECONDS)) memcheck compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q \
    -p no:cacheprovider tests/test_prefill_sm90.py -k "(paged and lse and not pingpong) or graph_replan"
fi
if [ "$mode" = h ]; then
  # The whole prefill table on the final code with fa2 / fa3 in one process (FlashInfer's modules built first)
  peers
  step 230 prefill-fi-build python3 benchmarks/bench_prefill.py --fa3 --fi-build-only /tmp/prefill-fi.done
  step 250 bench-prefill python3 benchmarks/bench_prefill.py --fa3 --no-flex --wait-build /tmp/prefill-fi.done \
    --wait-limit 30 --out "$OUT"
fi
if [ "$mode" = i ]; then
  # issue #3's 1 x 32768 row: how fast TMA streaming reads its 134 MB at all (dense and per-head page boxes)
  step 200 tma-probe python3 scripts/decode_tma_probe.py --out "$OUT/decode-tma-probe.json"
fi
if [ "$mode" = j ]; then
  # decode rows through the prefill path with the Gluon kernel (TMA-fed) vs our decode kernel
  step 300 decode-via-prefill python3 scripts/decode_via_prefill_probe.py --pieces "${PIECES:-12,16,33}" --out "$OUT/decode-via-prefill.json"
fi
if [ "$mode" = k ]; then
  # one consumer warpgroup (64-row tiles) for the decode rows through the Gluon prefill path; its tests
  step 200 decode-via-prefill python3 scripts/decode_via_prefill_probe.py --pieces 16,33 --out "$OUT/decode-via-prefill-k.json"
  step 200 ws-tests python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_prefill_sm90.py -rfE
fi
if [ "$mode" = l ]; then
  # the same rows with the page table in order: is the shuffled page table (TLB / DRAM locality) the limit?
  step 200 decode-seq-pages python3 scripts/decode_via_prefill_probe.py --seq-pages --pieces 16 --consumers 1 \
    --cases "1x32768 32/8,16x8192 32/8" --out "$OUT/decode-via-prefill-seq.json"
fi
if [ "$mode" = m ]; then
  # TMA streaming in the decode split pattern: one head's stripe per program vs whole pages per program
  step 200 tma-probe python3 scripts/decode_tma_probe.py --out "$OUT/decode-tma-probe-m.json"
fi
if [ "$mode" = n ]; then
  # page numbers as one vector load a tile ahead (WS_PAGE_PREFETCH): tests on the final code, the paged prefill row
  # and the decode rows through the Gluon path with prefetch on / off
  step 240 gpu-tests-2 python3 -m pytest -q -n 14 -p no:cacheprovider tests/test_prefill_sm90.py tests/test_prefill.py \
    tests/test_kernels_prefill.py tests/test_cascade.py tests/test_cascade_kernels.py tests/test_api.py -rfE
  step 60 paged-ab python3 scripts/prefill_ws_probe.py --paged --out "$OUT/ws-probe-n-paged.json"
  step 90 decode-pf1 python3 scripts/decode_via_prefill_probe.py --prefetch 1 --pieces 16 --consumers 1,2 \
    --cases "1x32768 32/8,16x8192 32/8" --out "$OUT/decode-via-prefill-n-pf1.json"
  step 90 decode-pf0 python3 scripts/decode_via_prefill_probe.py --prefetch 0 --pieces 16 --consumers 1 \
    --cases "1x32768 32/8" --out "$OUT/decode-via-prefill-n-pf0.json"
fi
if [ "$mode" = o ]; then
  # per-kernel GPU time of the 1 x 32768 row: our decode, the Gluon path (1 consumer), the Triton prefill path
  step 120 decode-profile python3 scripts/decode_via_prefill_probe.py --profile --pieces 16 --consumers 1 \
    --cases "1x32768 32/8" --out "$OUT/decode-via-prefill-o.json"
fi
if [ "$mode" = p ]; then
  # decode rows back to back (no L2 flush) vs do_bench's flushed median: ours, the Gluon path, FlashInfer
  peers
  step 400 decode-steady python3 scripts/decode_steady_probe.py --out "$OUT/decode-steady.json"
fi
if [ "$mode" = q ]; then
  # the final code: prefill / cascade / api / Gluon GPU files
  step 300 gpu-tests-2 python3 -m pytest -q -n 14 -p no:cacheprovider tests/test_prefill_sm90.py tests/test_prefill.py \
    tests/test_kernels_prefill.py tests/test_cascade.py tests/test_cascade_kernels.py tests/test_api.py -rfE
fi
