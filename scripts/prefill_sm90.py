"""Compile the prefill kernel for sm_90a on a machine without a GPU and print what the compiler made of it.

    .venv/bin/python scripts/prefill_sm90.py [--bm 128 --bn 128 --warps 8 --stages 3] [--fold]
        [--causal] [--paged] [--tma] [--dtype fp16|bf16] [--dump DIR]

Prints registers, spills, shared memory and instruction counts (MUFU.EX2, HGMMA, FFMA, ...) from the SASS.
Pointers and strides carry ``tt.divisibility=16`` as the JIT adds them at run time (without it the loads do
not vectorise and the result misleads).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from flashinfer_triton.kernels.prefill import _prefill_kernel  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--bm", type=int, default=128)
    ap.add_argument("--bn", type=int, default=128)
    ap.add_argument("--warps", type=int, default=8)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--group", type=int, default=1)
    ap.add_argument("--fold", action="store_true")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--paged", action="store_true")
    ap.add_argument("--tma", action="store_true")
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--dump", default=None)
    ap.add_argument("--maxnreg", type=int, default=None)
    ap.add_argument("--split", action="store_true", help="split pieces (HAS_SPLIT), merged by the second launch")
    ap.add_argument("--fused", action="store_true", help="split pieces with the fused merge (HAS_SPLIT too)")
    ap.add_argument("--nopi", action="store_true", help="paged: the per-tile 64-bit addressing of before")
    a = ap.parse_args(argv)
    dt = a.dtype
    names = _prefill_kernel.arg_names
    ptrs = {
        "q_ptr": dt, "k_ptr": dt, "v_ptr": dt, "o_ptr": dt, "lse_ptr": "fp32", "part_o_ptr": "fp32",
        "part_lse_ptr": "fp32", "work_ptr": "i32", "num_work_ptr": "i32", "qo_indptr_ptr": "i32",
        "kv_indptr_ptr": "i32", "kv_indices_ptr": "i32", "kv_lens_ptr": "i32", "mask_ptr": "u8",
        "mask_indptr_ptr": "i32", "alibi_ptr": "fp32", "blk_ptr": "i32", "counter_ptr": "i32",
    }  # fmt: skip
    floats = {"qk_scale", "v_scale", "soft_cap", "rope_rcp_scale", "rope_log2_theta"}
    consts = dict(
        NUM_QO_HEADS=32, GROUP=a.group, HEAD_DIM=a.d, BLOCK_D=a.d, BLOCK_M=a.bm, BLOCK_N=a.bn,
        TILE_T=a.bm // a.group, PAGED=a.paged, PAGE_SIZE=16 if a.paged else 1, CAUSAL=a.causal, WINDOW=False,
        CUSTOM_MASK=False, SOFTCAP=False, ALIBI=False, ROPE=False, WRITE_LSE=False, HAS_SPLIT=False,
        DOT_F32=False, USE_TMA=a.tma, PAGE_PREFETCH=True, PAGE_TILE=False, MASK_I64=False,
        FOLD_SCALE=a.fold, PAGE_INV=a.paged and not a.nopi, KV_SHARED=a.paged and not a.nopi,
        KV_I32=a.paged and not a.nopi, FUSED_MERGE=a.fused,
    )  # fmt: skip
    if a.fused or a.split:
        consts["HAS_SPLIT"] = True
    sig, attrs = {}, {}
    for i, n in enumerate(names):
        if n in consts:
            sig[n] = "constexpr"
        elif n in ptrs:
            sig[n] = "*" + ptrs[n]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif n in floats:
            sig[n] = "fp32"
        elif n in ("k_desc", "v_desc"):
            if a.tma:
                sig[n] = f"tensordesc<{dt}[{a.bn}, 1, {a.d}]>"
            else:
                sig[n] = "constexpr"
                consts[n] = None
        elif n == "window_left":
            sig[n] = "i32"
        else:  # strides
            sig[n] = "i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(_prefill_kernel, sig, consts, attrs)
    k = triton.compile(
        src,
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": a.warps, "num_stages": a.stages, **({"maxnreg": a.maxnreg} if a.maxnreg else {})},
    )
    md = k.metadata
    print(f"shared {md.shared} B, regs {k.n_regs if hasattr(k, 'n_regs') else '?'}")
    cubin = k.asm["cubin"]
    tmp = "/tmp/prefill_sm90.cubin"
    with open(tmp, "wb") as f:
        f.write(cubin)
    nvbin = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    res = subprocess.run([os.path.join(nvbin, "cuobjdump"), "-res-usage", tmp], capture_output=True, text=True).stdout
    print(" ".join(line.strip() for line in res.splitlines() if "REG" in line))
    sass = subprocess.run([os.path.join(nvbin, "cuobjdump"), "-sass", tmp], capture_output=True, text=True).stdout
    ops = collections.Counter(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", sass, re.M))
    keys = ("MUFU", "HGMMA", "FFMA", "FMUL", "FADD", "FMNMX", "F2FP", "HADD2", "HFMA2", "HMUL2", "SHFL", "LDL", "STL")
    print({k: v for k, v in ops.items() if k in keys})
    if a.dump:
        os.makedirs(a.dump, exist_ok=True)
        for ext in ("ttgir", "ptx"):
            with open(os.path.join(a.dump, f"prefill.{ext}"), "w") as f:
                f.write(k.asm[ext])
        with open(os.path.join(a.dump, "prefill.sass"), "w") as f:
            f.write(sass)


if __name__ == "__main__":
    main()
