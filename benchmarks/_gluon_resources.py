"""``--resources``: compile a Gluon Hopper kernel for sm_90a on any machine (no GPU) and print its resources.

    PYTHONPATH=src python benchmarks/bench_decode.py --resources [--group 4] [--d 128] [--ps 16] [--bn N]
        [--stages N] [--lse] [--dtype fp16|bf16] [--maxnreg N] [--loader-regs 32] [--dump DIR]
    PYTHONPATH=src python benchmarks/bench_prefill.py --resources [--group 1] [--d 128] [--causal] [--lse]
        [--ps 0] [--split] [--bn 128] [--stages 2] [--regs 240] [--loader-regs 24] [--maxnreg 168]
        [--dtype fp16|bf16] [--soft-cap] [--window] [--consumers 2|3] [--q-rows] [--dump DIR]

Lines: shared memory and warps; registers, stack and local memory (``cuobjdump -res-usage``); counts of the
SASS instructions that matter to these kernels (HGMMA, MUFU, BAR, SYNCS, spills as STL/LDL, ...); the global and
shared stores and shared loads by full opcode (their widths: ``STG.E`` 32 bits, ``STG.E.128``, ``STSM``); the
shared-memory allocations (mbarriers, buffers) and each mbarrier that overlays another allocation.
Arguments are CPU tensors and a stand-in sm_90 driver answers Triton's binder, so the kernel is specialized
as at run time (pointer and stride divisibility included) and nothing is launched. ``--dump DIR`` also writes
the TTGIR, PTX and SASS.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

SASS_COUNTS = ["HGMMA", "MUFU", "FFMA", "FMUL", "FADD", "FMNMX", "BAR", "SYNCS", "WARPGROUP", "STL", "LDL", "LDS",
               "STS", "STG", "USETMAXREG"]  # fmt: skip


class StandInDriver:
    """Answers the questions Triton's binder asks of the active driver as an sm_90 GPU would."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", 90, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def _use_stand_in_driver() -> None:
    from triton.runtime import driver

    driver.set_active(StandInDriver())


def compile_decode(group=4, d=128, ps=16, bn=64, stages=3, lse=False, dtype="fp16", maxnreg=128, loader_regs=32,
                   merge_k=16):  # fmt: skip
    """The Gluon decode kernel (``kernels/decode_sm90.py``) compiled for one variant (a triton CompiledKernel)."""
    import torch

    _use_stand_in_driver()
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from flashinfer_triton.kernels._sm90_common import kernel_layouts
    from flashinfer_triton.kernels.decode_sm90 import _decode_gluon_kernel as kernel

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
    return kernel.warmup(
        q, kd, kd, o, lse_t, part, lse_t, ints, ints, ints, ints, ints, ints, ps, 0, d, q.stride(0), q.stride(1),
        o.stride(0), o.stride(1), lse_t.stride(0), lse_t.stride(1), 16, 0.1, hq, group, gp2, d, bn, stages, ps, lse,
        merge_k, loader_regs, grid=(1, hkv), num_warps=4, maxnreg=maxnreg,
    )  # fmt: skip


def compile_prefill(group=1, d=128, bn=128, causal=False, lse=False, zero_tail=False, split=False, ps=0,
                    loader_regs=24, stages=2, regs=240, maxnreg=168, dtype="fp16", soft_cap=False,
                    window=False, consumers=2, q_rows=False):  # fmt: skip
    """The Gluon prefill kernel (``kernels/prefill_sm90.py``) compiled for one variant (ps 0: ragged K/V; q_rows:
    runs of exactly rows // group tokens, the query rows loaded by the consumers). The output has q's dtype, so
    the rows go out through shared memory (``EPI_SMEM``), as ``_run_gluon`` launches it."""
    import torch

    _use_stand_in_driver()
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from flashinfer_triton.kernels._sm90_common import kernel_layouts
    from flashinfer_triton.kernels.prefill_sm90 import _prefill_gluon_kernel as kernel

    dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    rows = 64 * consumers
    tile_t = rows // group if (rows // group) & (rows // group - 1) == 0 or q_rows else rows // group // 8 * 8
    hkv = 8
    q = torch.empty(256, hkv * group, d, dtype=dt)
    k = torch.empty(256, hkv, d, dtype=dt)
    o = torch.empty_like(q)
    lse_t = torch.empty(256, hkv * group, dtype=torch.float32)
    ints = torch.zeros(64, dtype=torch.int32)
    q2, k2 = q.view(q.shape[0], -1), k.view(k.shape[0], -1)
    qb = tile_t & -tile_t if tile_t % 8 == 0 else 8
    ql = kernel_layouts(dtype, qb, bn, d)[0]
    kl = kernel_layouts(dtype, ps, ps, d)[1] if ps else kernel_layouts(dtype, tile_t, bn, d)[1]
    qd = TensorDescriptor(q2, list(q2.shape), list(q2.stride()), [qb, d], ql)
    blk = ps or bn
    kd = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [blk, d], kl)
    vd = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [blk, d], kl)
    return kernel.warmup(
        qd, kd, vd, o, lse_t, q2, o, lse_t, ints, ints, ints, 32, 0, d, o.stride(0), o.stride(1),
        lse_t.stride(0), lse_t.stride(1), 0.1, 0.01, hkv * group, group, d, bn, tile_t, stages, causal, soft_cap, lse,
        zero_tail or bool(ps), split, bool(ps), ps or 1, regs, loader_regs, 100, window, consumers, q2.stride(0),
        True, grid=(1, hkv), num_warps=4, maxnreg=maxnreg,
    )  # fmt: skip


def report(ck, dump: str | None = None) -> None:
    """Print shared memory, registers / spills (``cuobjdump -res-usage``) and SASS instruction counts."""
    import triton

    md = ck.metadata
    print(f"shared {md.shared} bytes, num_warps {md.num_warps}")
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(ck.asm["cubin"])
        sass = _cuobjdump(cuobjdump, "-sass", path)
        res = _cuobjdump(cuobjdump, "-res-usage", path)
    usage = [line for line in res.splitlines() if "REG:" in line]
    if not usage:
        raise RuntimeError(f"cuobjdump -res-usage printed no REG: line:\n{res}")
    print(usage[-1])
    counts = collections.Counter()
    widths = collections.Counter()  # (shared and global stores and shared loads by their full opcode: the width)
    for line in sass.splitlines():
        # (SASS addresses grow past four hex digits in long kernels)
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line)
        if m:
            counts[m.group(1).split(".")[0]] += 1
            if m.group(1).split(".")[0] in ("STG", "STS", "STSM", "LDS", "LDSM"):
                widths[m.group(1)] += 1
    if not counts:  # (zero counts would read as no spills)
        raise RuntimeError(f"no SASS instruction found in cuobjdump -sass's output:\n{sass[-2000:]}")
    print(" ".join(f"{k}={counts.get(k, 0)}" for k in SASS_COUNTS))
    print("widths " + " ".join(f"{k}={v}" for k, v in sorted(widths.items())))
    allocs = shared_allocations(ck)
    print("mbarriers " + " ".join(f"{o}+{n}" for o, n, what in allocs if what == "mbarrier"))
    print("buffers " + " ".join(f"{o}+{n}" if n else f"{o}({what})" for o, n, what in allocs if what != "mbarrier"))
    print("mbarrier overlays " + (" ".join(mbarrier_overlays(allocs)) or "none"))
    if dump:
        os.makedirs(dump, exist_ok=True)
        for name in ("ttgir", "ptx"):
            with open(os.path.join(dump, f"k.{name}"), "w") as f:
                f.write(ck.asm[name])
        with open(os.path.join(dump, "k.sass"), "w") as f:
            f.write(sass)


def shared_allocations(ck) -> list[tuple[int, int | None, str]]:
    """Every shared-memory allocation of a compiled kernel as (byte offset, bytes, what): its TTGIR through
    Triton's shared-memory allocation pass (the offsets the PTX uses). ``what``: "mbarrier" (an i64 buffer),
    "buffer" (any other ``local_alloc``), else the op given scratch space (bytes None: not in the IR)."""
    from triton._C.libtriton import ir, nvidia, passes

    ptx_version = int("".join(re.search(r"\.version (\d+)\.(\d+)", ck.asm["ptx"]).groups()))
    ctx = ir.context()
    ir.load_dialects(ctx)
    nvidia.load_dialects(ctx)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ttgir")
        with open(path, "w") as f:
            f.write(ck.asm["ttgir"])
        mod = ir.parse_mlir_module(path, ctx)
    mod.context = ctx
    pm = ir.pass_manager(ctx)
    # (make_llir's passes up to the allocation)
    passes.ttgpuir.add_combine_tensor_select_and_if(pm)
    passes.ttgpuir.add_allocate_warp_groups(pm)
    passes.convert.add_scf_to_cf(pm)
    passes.gluon.add_inliner(pm)
    nvidia.passes.ttgpuir.add_allocate_shared_memory_nv(pm, 90, ptx_version)
    pm.run(mod, "shared_allocations")
    allocs = []
    for line in str(mod).splitlines():
        m = re.search(r"allocation\.offset = (\d+)", line)
        if not m:
            continue
        if "ttg.local_alloc" in line:
            t = re.search(r"-> !ttg\.memdesc<([0-9x]+)x([a-zA-Z]+)(\d+)\w*,", line)
            if not t:
                raise RuntimeError(f"local_alloc of no shape and element type read: {line.strip()[:300]}")
            n = 1
            for side in t.group(1).split("x"):
                n *= int(side)
            mbar = t.group(2) == "i" and t.group(3) == "64"
            allocs.append((int(m.group(1)), n * int(t.group(3)) // 8, "mbarrier" if mbar else "buffer"))
        else:
            op = re.search(r"\b(\w+\.\w+)[ ({]", line.split("=", 1)[-1] if " = " in line.split("(")[0] else line)
            allocs.append((int(m.group(1)), None, op.group(1) if op else "op"))
    if not any(what == "mbarrier" for _, _, what in allocs):
        raise RuntimeError("no mbarrier allocation read from the TTGIR")
    return sorted(allocs)


def mbarrier_overlays(allocs) -> list[str]:
    """``OFF+N/OFF+N``: each mbarrier that shares bytes with another allocation (a buffer, another mbarrier, or the
    start of an op's scratch space). An mbarrier left initialized (none of these kernels invalidates one) must
    keep its bytes to itself: the allocator overlays what it deems dead past its last use, init included."""
    out = []
    for i, (o, n, what) in enumerate(allocs):
        if what != "mbarrier":
            continue
        for j, (o2, n2, _) in enumerate(allocs):
            if j != i and (o < o2 + n2 and o2 < o + n if n2 else o <= o2 < o + n):
                out.append(f"{o}+{n}/{o2}+{n2}")
    return out


def _cuobjdump(cuobjdump: str, flag: str, path: str) -> str:
    """``cuobjdump FLAG PATH``'s output; a failure raises with its stderr (rather than reading as no spills)."""
    r = subprocess.run([cuobjdump, flag, path], capture_output=True, text=True)
    if r.returncode != 0 or not r.stdout.strip():
        raise RuntimeError(f"cuobjdump {flag} exited {r.returncode}:\n{r.stderr[-2000:]}\n{r.stdout[-2000:]}")
    return r.stdout


def main(kernel: str, argv: list[str]) -> None:
    """``bench_<kernel>.py --resources ARGS``: ``kernel`` is "decode" or "prefill"; ``argv`` without the flag."""
    ap = argparse.ArgumentParser(prog=f"bench_{kernel}.py --resources", description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=128, help="head dim")
    ap.add_argument("--dtype", default="fp16", choices=("fp16", "bf16"))
    ap.add_argument("--lse", action="store_true", help="the variant that writes the LSE")
    ap.add_argument("--dump", default=None, help="also write the TTGIR, PTX and SASS into this folder")
    if kernel == "decode":
        ap.add_argument("--group", type=int, default=4)
        ap.add_argument("--ps", type=int, default=16, help="page size")
        ap.add_argument("--bn", type=int, default=None, help="keys per ring buffer (default: the plan's at --d)")
        ap.add_argument("--stages", type=int, default=None, help="ring depth (default: the plan's at --d)")
        ap.add_argument("--maxnreg", type=int, default=None, help="launch register cap (default: the plan's at --d)")
        ap.add_argument("--loader-regs", type=int, default=None)
        a = ap.parse_args(argv)
        from flashinfer_triton._config import GluonDecodeConfig

        cfg = GluonDecodeConfig()
        bn, stages, maxnreg = (x if x is not None else y for x, y in zip((a.bn, a.stages, a.maxnreg), cfg.tile(a.d)))
        loader_regs = cfg.loader_regs if a.loader_regs is None else a.loader_regs
        ck = compile_decode(a.group, a.d, a.ps, bn, stages, a.lse, a.dtype, maxnreg, loader_regs)
    elif kernel == "prefill":
        ap.add_argument("--group", type=int, default=1)
        ap.add_argument("--ps", type=int, default=0, help="paged, this page size (0: ragged)")
        ap.add_argument("--bn", type=int, default=128, help="keys per tile")
        ap.add_argument("--stages", type=int, default=2, help="K/V ring depth")
        ap.add_argument("--causal", action="store_true")
        ap.add_argument("--zero-tail", action="store_true")
        ap.add_argument("--split", action="store_true", help="the split-KV variant (partial states)")
        ap.add_argument("--regs", type=int, default=240, help="registers per consumer warpgroup")
        ap.add_argument("--loader-regs", type=int, default=24)
        ap.add_argument("--maxnreg", type=int, default=168)
        ap.add_argument("--soft-cap", action="store_true", help="the logits soft-cap variant")
        ap.add_argument("--window", action="store_true", help="the sliding-window variant")
        ap.add_argument("--consumers", type=int, default=2, help="consumer warpgroups (3: 192-row tiles)")
        ap.add_argument("--q-rows", action="store_true", help="runs of exactly rows // group tokens")
        a = ap.parse_args(argv)
        ck = compile_prefill(a.group, a.d, a.bn, a.causal, a.lse, a.zero_tail, a.split, a.ps, a.loader_regs,
                             a.stages, a.regs, a.maxnreg, a.dtype, a.soft_cap, a.window, a.consumers,
                             a.q_rows)  # fmt: skip
    else:
        raise ValueError(f"kernel must be 'decode' or 'prefill', got {kernel!r}")
    report(ck, a.dump)
