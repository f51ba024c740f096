#!/usr/bin/env bash
# Session 9's GPU calls (device tool, repo root, carry .peers). Everything lands in $OUT.
#   bash scripts/gpu_session9.sh a   # the 64-query x 16384-key prefill row: each kernel's GPU time (attention,
#                                    # partial merge) and the graph time, for the default and 128x128 tiles
mode=${1:-a}
# shellcheck source=scripts/gpu_common.sh
source "$(dirname "$0")/gpu_common.sh"

if [ "$mode" = a ]; then
  step 200 split-profile python3 scripts/prefill_split_sweep.py --cases 64q --configs "128x128 w8 s3" \
    --targets 0,6,8 --graph --profile
fi
