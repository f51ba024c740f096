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
