#!/usr/bin/env bash
# A lean copy of the staged FlashInfer peer, for GPU runs whose kernel modules all come prebuilt
# (benchmarks/fi_modules.py): run from the project root on the CPU machine, after the full staging filled
# ./.peers/. It writes ./.peers-lean/ (git-ignored through .git/info/exclude) and leaves .peers/ as it is.
#
# Left out, against .peers/:
#   - flashinfer/data/{cccl,cutlass,spdlog,include}: headers that only nvcc reads. Generating a module's
#     spec still reads the templates in flashinfer/data/csrc, which stay. Without the headers a module that
#     is not prebuilt cannot compile: run with FLASHINFER_DISABLE_JIT=1 to have FlashInfer say which.
#   - every wheel but apache-tvm-ffi and cudnn-frontend (LEAN_WHEELS, glob patterns, chooses): `import
#     flashinfer` imports cutlass, cuda.bindings, cuda.tile and nccl only inside try/if guards, and the staged
#     ones are inert or unused here anyway: nvidia-cutlass-dsl is a .pth file (not read from a PYTHONPATH
#     folder) over a libs-base wheel without its libs-core, cuda-python is metadata only, nccl4py serves only
#     FlashInfer's comm ops, cuda-tile only its cuTile backends. cudnn-frontend stays although only cuDNN
#     backends use it: the decode wrapper's plan() asks for its version (`import cudnn`) twice per call, and a
#     failed import is not cached, so without the package every plan() pays two searches of sys.path and
#     FlashInfer's host time would read slower than it is.
#
# On the GPU machine:  bash .peers-lean/install.sh [MODULES_DIR]
#   (unpacks like .peers/install.sh, then installs the modules packed by `fi_modules.py pack` when given)
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
[ -f .peers/flashinfer.tgz ] || { echo "no .peers/flashinfer.tgz: stage the full FlashInfer peer first" >&2; exit 1; }
grep -qx '/.peers-lean/' .git/info/exclude 2>/dev/null || echo '/.peers-lean/' >> .git/info/exclude
rm -rf .peers-lean && mkdir -p .peers-lean/wheels
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
tar xzf .peers/flashinfer.tgz -C "$tmp"
for d in cccl cutlass spdlog include; do rm -rf "$tmp/flashinfer/data/$d"; done
(cd "$tmp" && tar czf "$root/.peers-lean/flashinfer.tgz" flashinfer flashinfer_python-*.dist-info)
for pattern in ${LEAN_WHEELS:-apache_tvm_ffi-* nvidia_cudnn_frontend-*}; do
  cp .peers/wheels/$pattern.whl .peers-lean/wheels/ 2>/dev/null || cp .peers/wheels/$pattern .peers-lean/wheels/
done
cat > .peers-lean/install.sh <<'EOS'
#!/usr/bin/env bash
# Runs on the GPU machine from the project root: unpacks the lean FlashInfer into /tmp/peers and, given a
# folder written by `benchmarks/fi_modules.py pack`, installs its prebuilt modules there.
set -e
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p /tmp/peers
[ -d /tmp/peers/flashinfer ] || tar xzf "$here/flashinfer.tgz" -C /tmp/peers
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/peers "$here"/wheels/*.whl
if [ -n "${1:-}" ]; then
  PYTHONPATH=/tmp/peers${PYTHONPATH:+:$PYTHONPATH} FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a} \
    python3 "$here/../benchmarks/fi_modules.py" install "$1"
fi
echo "lean FlashInfer staged in /tmp/peers (no nvcc headers: every module must be prebuilt): add it to PYTHONPATH"
EOS
chmod +x .peers-lean/install.sh
du -sh .peers-lean
