"""How fast can a paged 1 x 32768 decode stream its KV cache at all? (issue #3's 2.6 TB/s row)

    PYTHONPATH=src python3 scripts/decode_stream_probe.py [--out DIR]

Times, on the 1 x 32768, 32/8, D128, fp16, page 16 NHD cache of the decode table (134 MB of K/V):
- ``torch.sum`` over the same bytes as one dense tensor (a read-only ceiling of the library's own kernels);
- a probe kernel with the decode kernel's access pattern and no softmax (page lookup per key, K and V tiles
  through two small ``tl.dot``), over a grid of (chunks per head, BLOCK_N, warps, stages);
- our public decode (plan once, CUDA-graph replay).
Graph replays, median of ``do_bench``, several cache copies rotated so nothing is served from L2.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl

import flashinfer_triton as fit


@triton.jit
def _probe(
    q_ptr, k_ptr, v_ptr, idx_ptr, out_ptr, keys_per_prog, stride_p, stride_s, stride_h,
    BLOCK_N: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    h = tl.program_id(1)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    offs_r = tl.arange(0, ROWS)
    q = tl.load(q_ptr + offs_r[:, None] * D + offs_d[None, :])
    acc = tl.zeros([ROWS, D], dtype=tl.float32)
    start = pid * keys_per_prog
    base_k = k_ptr + h.to(tl.int64) * stride_h
    base_v = v_ptr + h.to(tl.int64) * stride_h
    for j in range(start, start + keys_per_prog, BLOCK_N):
        tok = j + offs_n
        page = tl.load(idx_ptr + tok // PAGE).to(tl.int64)
        off = page * stride_p + (tok % PAGE) * stride_s
        k = tl.load(base_k + off[:, None] + offs_d[None, :])
        v = tl.load(base_v + off[:, None] + offs_d[None, :])
        s = tl.dot(q, tl.trans(k))
        acc = tl.dot(s.to(tl.float16), v, acc)
    tl.store(out_ptr + (h * tl.num_programs(0) + pid) * ROWS + offs_r, tl.sum(acc, 1))


def graph_ms(fn, rep=200):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return triton.testing.do_bench(g.replay, warmup=25, rep=rep, return_mode="median")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    dev = "cuda"
    L, hq, hkv, d, ps = 32768, 32, 8, 128, 16
    pages = L // ps
    copies = 3  # 3 x 134 MB > 50 MB L2
    nbytes = 2 * L * hkv * d * 2
    torch.manual_seed(0)
    caches = [torch.randn(pages, 2, ps, hkv, d, dtype=torch.float16, device=dev) for _ in range(copies)]
    perms = [torch.randperm(pages, device=dev).to(torch.int32) for _ in range(copies)]
    rows = []

    def add(name, ms, **kw):
        tbps = nbytes / (ms * 1e-3) / 1e12
        rows.append({"case": name, "ms": ms, "tbps": tbps, **kw})
        print(f"{name:60s} {ms * 1e3:8.1f} us {tbps:5.2f} TB/s", flush=True)

    dense = [c.view(-1) for c in caches]
    it = iter(range(10**9))
    add("torch.sum over the same bytes (dense)", graph_ms(lambda: dense[next(it) % copies].sum()))

    q = torch.randn(16, d, dtype=torch.float16, device=dev)
    grids = [32, 64, 132, 264] if not a.quick else [32, 64]
    for chunks in grids:
        keys = -(-L // chunks)
        for bn, warps, stages in ((64, 4, 3), (64, 4, 4), (128, 4, 3), (32, 4, 6), (64, 8, 3)):
            keys_c = -(-keys // bn) * bn
            n_chunks = -(-L // keys_c)
            if n_chunks * keys_c != L:
                continue
            out = torch.empty(hkv * n_chunks * 16, dtype=torch.float32, device=dev)
            state = {"i": 0}

            def fn(bn=bn, warps=warps, stages=stages, keys_c=keys_c, n_chunks=n_chunks, out=out, state=state):
                i = state["i"] % copies
                state["i"] += 1
                c = caches[i]
                _probe[(n_chunks, hkv)](
                    q, c[:, 0], c[:, 1], perms[i], out, keys_c, c.stride(0), c.stride(2), c.stride(3),
                    BLOCK_N=bn, D=d, PAGE=ps, ROWS=16, num_warps=warps, num_stages=stages,
                )  # fmt: skip

            try:
                ms = graph_ms(fn)
                add(f"probe chunks={n_chunks} x {hkv} heads BLOCK_N={bn} w{warps} s{stages}", ms,
                    programs=n_chunks * hkv, block_n=bn, warps=warps, stages=stages)  # fmt: skip
            except Exception as exc:  # noqa: BLE001
                print(f"probe {chunks} {bn} {warps} {stages}: {type(exc).__name__}: {str(exc)[:150]}")

    # our decode on the same caches
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    w = fit.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    indptr = torch.tensor([0, pages], dtype=torch.int32, device=dev)
    last = torch.tensor([ps], dtype=torch.int32, device=dev)
    outs = [torch.empty(1, hq, d, dtype=torch.float16, device=dev) for _ in range(copies)]
    w.plan(indptr, perms[0], last, hq, hkv, d, ps, q_data_type=torch.float16)
    qd = torch.randn(1, hq, d, dtype=torch.float16, device=dev)
    state = {"i": 0}

    def ours():
        i = state["i"] % copies
        state["i"] += 1
        w.run(qd, caches[i], out=outs[i])

    add("ours decode (same page order as copy 0; graph)", graph_ms(ours))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "decode-stream-probe.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "bytes": nbytes, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
