"""How fast can the H100 read the 1 x 32768 decode row's KV cache (134 MB) at all? TMA streaming probes in Gluon.

    python3 scripts/decode_tma_probe.py [--out FILE.json]

Session 5 measured a softmax-free read with the decode kernel's access pattern (pointer loads) at 2.23-2.26 TB/s
and ``torch.sum`` over the same bytes at 2.17, below issue #3's 2.6 TB/s target. These probes read the same
number of bytes through TMA copies into a ring of shared-memory buffers (nothing computed; each copy's barrier is
waited for before its buffer is reused) with a persistent grid:

* dense: the cache as one [rows, 128] fp16 tensor, boxes of [128, 128] (32 KB);
* per-head pages: the paged NHD cache [pages, 16, 8 heads, 128] as [pages * 16, 8 * 128], one box per (page,
  head) of [16, 128] (4 KB), the pattern a per-KV-head decode program reads.

Timed as CUDA-graph replays over three cache copies in turn (past L2), median of triton.testing.do_bench.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))


@gluon.jit
def _stream_kernel(desc, out_ptr, n_boxes, cols_per_row, STAGES: gl.constexpr):
    """Box b (row block b // cols_per_row, column block b % cols_per_row) for b = pid, pid + nprog, ..."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    BR: gl.constexpr = desc.block_type.shape[0]
    BC: gl.constexpr = desc.block_type.shape[1]
    bufs = gl.allocate_shared_memory(desc.dtype, [STAGES, BR, BC], desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    cnt = (n_boxes - pid + nprog - 1) // nprog
    for k in range(cnt + STAGES):
        if k >= STAGES:
            j = k - STAGES
            mbarrier.wait(bars.index(j % STAGES), (j // STAGES) & 1)
        if k < cnt:
            b = pid + k * nprog
            st = k % STAGES
            mbarrier.expect(bars.index(st), desc.block_type.nbytes)
            tma.async_copy_global_to_shared(
                desc, [(b // cols_per_row) * BR, (b % cols_per_row) * BC], bars.index(st), bufs.index(st)
            )
    gl.store(out_ptr + pid, cnt)


@gluon.jit
def _split_kernel(desc, out_ptr, boxes_per_prog, rows_per_box, col_blocks, STAGES: gl.constexpr):
    """Program (piece, column block) reads its column block of rows [piece * boxes_per_prog * rows_per_box, ...)
    in order: the decode split pattern (one KV head's stripe of a run of pages per program)."""
    piece = gl.program_id(0)
    cb = gl.program_id(1)
    BR: gl.constexpr = desc.block_type.shape[0]
    BC: gl.constexpr = desc.block_type.shape[1]
    bufs = gl.allocate_shared_memory(desc.dtype, [STAGES, BR, BC], desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(bars.index(s), count=1)
    cnt = boxes_per_prog
    for k in range(cnt + STAGES):
        if k >= STAGES:
            j = k - STAGES
            mbarrier.wait(bars.index(j % STAGES), (j // STAGES) & 1)
        if k < cnt:
            st = k % STAGES
            mbarrier.expect(bars.index(st), desc.block_type.nbytes)
            row = (piece * cnt + k) * rows_per_box
            tma.async_copy_global_to_shared(desc, [row, cb * BC], bars.index(st), bufs.index(st))
    gl.store(out_ptr + piece * gl.num_programs(1) + cb, cnt)


def run_split(kind, stages, pieces, copies, nbytes):
    """kind "head": programs (piece, head), boxes [16, 128] of one head; "page": programs (piece,), boxes of
    whole pages [128, 128] over the [rows * 8, 128] view (16 slots x 8 heads)."""
    if kind == "head":
        block, view_cols, col_blocks = [16, 128], 1024, 8
    else:
        block, view_cols, col_blocks = [128, 128], 128, 1
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.float16)
    descs = []
    for x in copies:
        v = x.view(-1, view_cols)
        descs.append(TensorDescriptor(v, list(v.shape), list(v.stride()), block, layout))
    rows = copies[0].numel() // view_cols
    boxes = rows // block[0]
    per = boxes // pieces
    out = torch.zeros(pieces * col_blocks, dtype=torch.int32, device="cuda")

    def launch(i):
        _split_kernel[(pieces, col_blocks)](descs[i], out, per, block[0], col_blocks, stages, num_warps=1)

    for i in range(len(copies)):
        launch(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(len(copies)):
            launch(i)
    ms = triton.testing.do_bench(lambda: g.replay(), warmup=10, rep=100, return_mode="median") / len(copies)
    read = per * pieces * col_blocks * block[0] * block[1] * 2
    return ms, read / ms / 1e9


def run_probe(kind, stages, progs, copies, nbytes):
    descs = []
    if kind == "dense":
        block, view_cols = [128, 128], 128
    else:
        block, view_cols = [16, 128], 1024
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.float16)
    for x in copies:
        v = x.view(-1, view_cols)
        descs.append(TensorDescriptor(v, list(v.shape), list(v.stride()), block, layout))
    rows = copies[0].numel() // view_cols
    n_boxes = (rows // block[0]) * (view_cols // block[1])
    cols_per_row = view_cols // block[1]
    out = torch.zeros(progs, dtype=torch.int32, device="cuda")

    def launch(i):
        _stream_kernel[(progs,)](descs[i], out, n_boxes, cols_per_row, stages, num_warps=1)

    for i in range(len(copies)):
        launch(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(len(copies)):
            launch(i)
    ms = triton.testing.do_bench(lambda: g.replay(), warmup=10, rep=100, return_mode="median") / len(copies)
    got = int(out.sum())
    assert got == n_boxes, (got, n_boxes)
    return ms, nbytes / ms / 1e9


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    nbytes = 32768 * 8 * 128 * 2 * 2  # K and V of 1 x 32768, 8 KV heads, D128, fp16: 134 MB
    copies = [torch.randn(nbytes // 2, device="cuda", dtype=torch.float16) for _ in range(3)]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for kind, stages_list in (("dense", (4, 6)), ("pages", (16, 32, 48))):
        for stages in stages_list:
            for progs in (sms, 2 * sms):
                if kind == "dense" and progs == 2 * sms and stages > 3:
                    continue  # 2 x 6 x 32 KB does not fit
                try:
                    ms, tb = run_probe(kind, stages, progs, copies, nbytes)
                except Exception as e:  # report, go on
                    print(
                        f"{kind} stages {stages} progs {progs}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True
                    )
                    continue
                rows.append({"kind": kind, "stages": stages, "programs": progs, "us": ms * 1e3, "tbps": tb})
                print(
                    f"{kind:6s} stages {stages:3d} programs {progs:4d}: {ms * 1e3:7.1f} us {tb:5.2f} TB/s", flush=True
                )
    for kind, pieces, stages in (("head", 16, 16), ("head", 16, 32), ("head", 32, 16), ("page", 128, 4),
                                 ("page", 132, 4), ("page", 256, 3)):  # fmt: skip
        try:
            ms, tb = run_split(kind, stages, pieces, copies, nbytes)
        except Exception as e:
            print(f"split {kind} pieces {pieces}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        progs = pieces * (8 if kind == "head" else 1)
        rows.append({"kind": "split-" + kind, "stages": stages, "programs": progs, "us": ms * 1e3, "tbps": tb})
        print(f"split-{kind:5s} stages {stages:3d} programs {progs:4d}: {ms * 1e3:7.1f} us {tb:5.2f} TB/s", flush=True)
    x = copies[0]
    ms = triton.testing.do_bench(lambda: torch.sum(x), warmup=10, rep=100, return_mode="median")
    print(f"torch.sum (one copy, L2 warm-ish): {ms * 1e3:.1f} us {nbytes / ms / 1e9:.2f} TB/s")
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=10, rep=100, return_mode="median")
    print(f"copy 134 MB -> 134 MB: {ms * 1e3:.1f} us {2 * nbytes / ms / 1e9:.2f} TB/s (read + write)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "bytes": nbytes, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
