#!/usr/bin/env bash
# Session 11's GPU calls (device tool, repo root, carry .peers). Everything lands in $OUT.
#   bash scripts/gpu_session11.sh a   # the Gluon decode kernel: its tests, then ring settings vs the Triton
#                                     # kernel and FlashInfer on the decode rows (back to back and do_bench)
mode=${1:-a}
# shellcheck source=scripts/gpu_common.sh
source "$(dirname "$0")/gpu_common.sh"

if [ "$mode" = a ]; then
  peers
  step 200 ws-decode-tests python3 -m pytest -q -x -p no:cacheprovider tests/test_decode_sm90.py -rfE
  step 330 steady python3 scripts/decode_steady_probe.py --out "$OUT/steady-a.json" \
    --cases "1x32768 32/8,16x8192 32/8,64x4096 32/8,128x2048 32/8"
fi
if [ "$mode" = b ]; then
  # ring depth / tile / programs per SM on the split rows (our kernels only)
  step 400 steady python3 scripts/decode_steady_probe.py --out "$OUT/steady-b.json" --cases "1x32768 32/8,16x8192 32/8" \
    --paths triton,gluon,gluon_w1,gluon_bn128_s3_w1,gluon_bn64_s6_w1,gluon_bn32_s12_w1,gluon_bn64_s4_w1,gluonstream,gluonstream_w1,gluonstream_bn128_s3_w1,gluonstream_bn32_s12_w1
fi
if [ "$mode" = c ]; then
  # one program per SM for the Gluon kernel's split plans: decode-side GPU files, then the rows back to back
  peers
  step 300 gpu-tests python3 -m pytest -q -n 14 -p no:cacheprovider tests/test_decode_sm90.py tests/test_decode.py \
    tests/test_kernels_decode.py tests/test_replan_fast.py tests/test_api.py tests/test_cascade.py tests/test_engine.py -rfE
  step $((580 - SECONDS)) steady python3 scripts/decode_steady_probe.py --out "$OUT/steady-c.json" \
    --cases "1x32768 32/8,16x8192 32/8,1x32768 32/8 bf16,64x4096 32/8" --paths triton,gluon,gluon_s4,gluonstream,fi
fi
if [ "$mode" = d ]; then
  # the decode table with FlashInfer in the process (cold first call included), then memcheck on Gluon decode cases
  peers
  step 400 bench-decode python3 benchmarks/bench_decode.py --graph --out "$OUT"
  step $((585 - SECONDS)) memcheck compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q \
    -p no:cacheprovider tests/test_decode_sm90.py -k "split-1x9000 or split-ps32 or batch-ps16-g3 or graph" -rfE
fi
if [ "$mode" = e ]; then
  # the whole GPU suite on the final decode code, then host time per run() and the 1 x 32768 rows again
  peers
  step 420 gpu-suite python3 -m pytest -q -n 14 -p no:cacheprovider tests -rfE
  step $((585 - SECONDS)) steady python3 scripts/decode_steady_probe.py --host --out "$OUT/steady-e.json" \
    --cases "1x32768 32/8" --paths triton,gluon,gluonstream,fi
fi
if [ "$mode" = f ]; then
  # after the descriptor-geometry cache: Gluon decode + launch tests, host time per run(); then cascade and merge
  # rows (merge_states also right after a write of its states, as an engine runs it)
  peers
  step 150 gpu-tests python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_decode_sm90.py tests/test_launch.py \
    tests/test_decode.py -rfE
  step 120 steady python3 scripts/decode_steady_probe.py --host --out "$OUT/steady-f.json" --cases "1x32768 32/8" \
    --paths triton,gluon,fi
  step $((585 - SECONDS)) bench-cascade python3 benchmarks/bench_cascade.py --out "$OUT"
fi
if [ "$mode" = g ]; then
  # the whole GPU suite on the final code
  step 560 gpu-suite python3 -m pytest -q -n 14 -p no:cacheprovider tests -rfE
fi
if [ "$mode" = h ]; then
  # review fixes (every CUDA-graph plan of a covered variant takes the Gluon kernel; chunk alignment): the decode-side
  # files, then the unsplit rows Gluon vs Triton (what graph-mode plans now run)
  step 300 gpu-tests python3 -m pytest -q -n 14 -p no:cacheprovider tests/test_decode_sm90.py tests/test_decode.py \
    tests/test_kernels_decode.py tests/test_replan_fast.py tests/test_engine.py tests/test_api.py tests/test_cascade.py -rfE
  step $((560 - SECONDS)) steady python3 scripts/decode_steady_probe.py --out "$OUT/steady-h.json" --paths triton,gluon \
    --cases "128x2048 32/8,256x1024 32/8,64x4096 32/32,64x4096 64/8,64x4096 32/8 ps1"
fi
if [ "$mode" = i ]; then
  # the engine (SmolLM2 shapes, random weights, bf16, D64, group 3, CUDA-graph decode: now the Gluon kernel) against
  # FlashInfer, then ours with the Gluon kernels off
  peers
  step 330 engine python3 benchmarks/bench_engine.py --random --libs flashinfer_triton flashinfer --peer-no-cascade \
    --batch-sizes 1 8 32 --new-tokens 64 --check 0 --out-dir "$OUT"
  mkdir -p "$OUT/nogluon"
  export FLASHINFER_TRITON_GLUON=0
  step $((570 - SECONDS)) engine-nogluon python3 benchmarks/bench_engine.py --random \
    --libs flashinfer_triton --batch-sizes 1 8 32 --new-tokens 64 --check 0 --out-dir "$OUT/nogluon"
fi
