"""Compile the Gluon Hopper prefill kernel (kernels/prefill_sm90.py) for sm_90a without a GPU; print its resources.

    .venv/bin/python scripts/prefill_ws_sm90.py [--group 1] [--d 128] [--causal] [--lse] [--stages 2]
        [--regs 240] [--dtype fp16|bf16] [--dump DIR]

Prints registers, shared memory, spills and instruction counts (HGMMA, MUFU.EX2, BAR, SYNCS) from the SASS.
Arguments are CPU tensors; Triton's binder runs with a stand-in sm_90 driver (nothing is launched).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))


class _StandInDriver:
    def __init__(self):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", 90, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def main(argv=None):
    import torch
    from triton.runtime import driver

    ap = argparse.ArgumentParser()
    ap.add_argument("--group", type=int, default=1)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--bn", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--lse", action="store_true")
    ap.add_argument("--zero-tail", action="store_true")
    ap.add_argument("--split", action="store_true")
    ap.add_argument("--ps", type=int, default=0, help="paged, this page size (0: ragged)")
    ap.add_argument("--loader-regs", type=int, default=24)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--regs", type=int, default=240)
    ap.add_argument("--maxnreg", type=int, default=168)
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--dump", default=None)
    a = ap.parse_args(argv)
    driver.set_active(_StandInDriver())

    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from flashinfer_triton.kernels.prefill_sm90 import _prefill_ws_kernel, kernel_layouts

    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[a.dtype]
    g, d = a.group, a.d
    tile_t = 128 // g if g & (g - 1) == 0 else 128 // g // 8 * 8
    hkv = 8
    q = torch.empty(256, hkv * g, d, dtype=dt)
    k = torch.empty(256, hkv, d, dtype=dt)
    o = torch.empty_like(q)
    lse = torch.empty(256, hkv * g, dtype=torch.float32)
    ints = torch.zeros(64, dtype=torch.int32)
    ql, kl = kernel_layouts(a.dtype, tile_t, a.bn, d)
    q2, k2 = q.view(q.shape[0], -1), k.view(k.shape[0], -1)
    qb = tile_t if tile_t & (tile_t - 1) == 0 else 8
    ql = kernel_layouts(a.dtype, qb, a.bn, d)[0]
    qd = TensorDescriptor(q2, list(q2.shape), list(q2.stride()), [qb, d], ql)
    if a.ps:
        kl = kernel_layouts(a.dtype, a.ps, a.ps, d)[1]
    blk = a.ps or a.bn
    kd = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [blk, d], kl)
    vd = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [blk, d], kl)
    ck = _prefill_ws_kernel.warmup(
        qd, kd, vd, o, lse, o, lse, ints, ints, ints, ints, ints, ints, 32, 0, d, o.stride(0), o.stride(1),
        lse.stride(0), lse.stride(1), 0.1, hkv * g, g, d, a.bn, tile_t, a.stages, a.causal, a.lse,
        a.zero_tail or bool(a.ps), a.split, bool(a.ps), a.ps or 1, a.regs, a.loader_regs,
        grid=(1, hkv), num_warps=4, maxnreg=a.maxnreg,
    )  # fmt: skip
    report(ck, a.dump)


def report(ck, dump=None):
    """Shared memory, registers / spills (cuobjdump -res-usage) and SASS instruction counts of a compiled kernel."""
    md = ck.metadata
    print(f"shared {md.shared} bytes, num_warps {md.num_warps}")
    cubin = ck.asm["cubin"]
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        import triton

        cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        sass = subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True).stdout
        res = subprocess.run([cuobjdump, "-res-usage", path], capture_output=True, text=True).stdout
    print(res.strip().splitlines()[-1] if res.strip() else "(no res usage)")
    counts = collections.Counter()
    for line in sass.splitlines():
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line)
        if m:
            counts[m.group(1).split(".")[0]] += 1
    keys = [
        "HGMMA",
        "MUFU",
        "FFMA",
        "FMUL",
        "FADD",
        "FMNMX",
        "BAR",
        "SYNCS",
        "WARPGROUP",
        "STL",
        "LDL",
        "LDS",
        "STS",
        "STG",
        "USETMAXREG",
    ]
    print(" ".join(f"{k}={counts.get(k, 0)}" for k in keys))
    if dump:
        os.makedirs(dump, exist_ok=True)
        for name in ("ttgir", "ptx"):
            with open(os.path.join(dump, f"k.{name}"), "w") as f:
                f.write(ck.asm[name])
        with open(os.path.join(dump, "k.sass"), "w") as f:
            f.write(sass)


if __name__ == "__main__":
    main()
