# Sourced by the scripts/gpu_session*.sh call scripts (device tool, repo root): $mode set by the caller.
# Sets up $OUT and PYTHONPATH, records the GPU and clocks, and defines
#   step LIMIT NAME CMD...   run CMD under a time limit, its output in $OUT/NAME.log, print the exit and tail
#   peers                    install FlashInfer from .peers (carried) and put it on PYTHONPATH
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/gpu-$mode.txt" 2>&1
cat "$OUT/gpu-$mode.txt"
step() { local limit=$1; shift; local name=$1; shift; local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "== $name: exit $rc in $((SECONDS - t0)) s"; tail -n 8 "$OUT/$name.log"; }
peers() { bash .peers/install.sh >/dev/null && export PYTHONPATH=$PYTHONPATH:/tmp/peers FLASHINFER_CUDA_ARCH_LIST=9.0a; }
