"""Compile the Gluon Hopper decode kernel (kernels/decode_sm90.py) for sm_90a without a GPU; print its resources.

    .venv/bin/python scripts/decode_ws_sm90.py [--group 4] [--d 128] [--ps 16] [--bn 64] [--stages 3] [--lse]
        [--dtype fp16|bf16] [--maxnreg 168] [--loader-regs 32] [--dump DIR]

Prints registers, shared memory, spills and instruction counts from the SASS (scripts/prefill_ws_sm90.py's
stand-in driver and counters: nothing is launched).
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

from prefill_ws_sm90 import _StandInDriver, report  # noqa: E402


def compile_decode(group=4, d=128, ps=16, bn=64, stages=3, lse=False, dtype="fp16", maxnreg=168, loader_regs=32,
                   merge_k=16):  # fmt: skip
    """The compiled kernel (triton CompiledKernel) for one variant."""
    import torch
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime import driver

    driver.set_active(_StandInDriver())
    from flashinfer_triton.kernels.decode_sm90 import _decode_ws_kernel
    from flashinfer_triton.kernels.prefill_sm90 import kernel_layouts

    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    hkv = 8
    hq = hkv * group
    q = torch.empty(4, hq, d, dtype=dt)
    cache = torch.empty(64, ps, hkv, d, dtype=dt)
    c2 = cache.view(64 * ps, hkv * d)
    o = torch.empty_like(q)
    lse_t = torch.empty(4, hq, dtype=torch.float32)
    part = torch.empty(64, hq, d, dtype=torch.float32)
    ints = torch.zeros(64, dtype=torch.int32)
    kl = kernel_layouts(dtype, ps, ps, d)[1]
    kd = TensorDescriptor(c2, list(c2.shape), list(c2.stride()), [ps, d], kl)
    gp2 = 1 << (group - 1).bit_length()
    return _decode_ws_kernel.warmup(
        q, kd, kd, o, lse_t, part, lse_t, ints, ints, ints, ints, ints, ints, ps, 0, d, q.stride(0), q.stride(1),
        o.stride(0), o.stride(1), lse_t.stride(0), lse_t.stride(1), 16, 0.1, hq, group, gp2, d, bn, stages, ps, lse,
        merge_k, loader_regs, grid=(1, hkv), num_warps=4, maxnreg=maxnreg,
    )  # fmt: skip


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--ps", type=int, default=16)
    ap.add_argument("--bn", type=int, default=64)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--lse", action="store_true")
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--maxnreg", type=int, default=168)
    ap.add_argument("--loader-regs", type=int, default=32)
    ap.add_argument("--dump", default=None)
    a = ap.parse_args(argv)
    ck = compile_decode(a.group, a.d, a.ps, a.bn, a.stages, a.lse, a.dtype, a.maxnreg, a.loader_regs)
    report(ck, a.dump)


if __name__ == "__main__":
    main()
