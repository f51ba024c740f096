"""Decode: ours beside FlexAttention (torch.compile'd flex_attention on a dense cache), in TB/s.

FlexAttention has no paged KV, so it reads a dense ``[B, Hkv, L, D]`` cache (the best case for it) while
ours reads the same number of bytes through a page table (page 16, HND pages, shuffled page order, as
bench_decode.py). ``ratio = flex_ms / ours_ms``. Each shape compiles once (tens of seconds), so the rows
run within ``--budget`` seconds and the rest are reported as not run.

    PYTHONPATH=src python benchmarks/bench_decode_flex.py [--out DIR] [--budget 150]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

# (name, batch, kv_len, hq, hkv, head_dim)
CASES = [
    ("64x4096 32/8", 64, 4096, 32, 8, 128),
    ("1x32768 32/8", 1, 32768, 32, 8, 128),
    ("256x1024 32/8", 256, 1024, 32, 8, 128),
    ("16x8192 32/8", 16, 8192, 32, 8, 128),
    ("64x4096 32/32", 64, 4096, 32, 32, 128),
]
PAGE = 16


def ours_ms(case, dtype, device) -> float:
    import flashinfer_triton as fit

    _, b, L, hq, hkv, d = case
    pages = b * (L // PAGE)
    n_rot = C.num_rotations(2 * pages * PAGE * hkv * d * dtype.itemsize)
    caches = [
        torch.randn(pages, 2, hkv, PAGE, d, dtype=dtype, device=device) for _ in range(n_rot)
    ]  # 5-D HND: [pages, 2, Hkv, page, D]
    indptr, indices, last, _ = C.page_table([L] * b, PAGE)
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=device)
    w = fit.BatchDecodeWithPagedKVCacheWrapper(ws, "HND")
    w.plan(indptr, indices, last, hq, hkv, d, PAGE, q_data_type=dtype)
    q = torch.randn(b, hq, d, dtype=dtype, device=device)
    out = torch.empty_like(q)
    return C.bench(C.rotating([lambda c=c: w.run(q, c, out=out) for c in caches]))


_FLEX: dict = {}


def flex_ms(case, dtype, device) -> float:
    from torch.nn.attention.flex_attention import flex_attention

    if "fn" not in _FLEX:
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    fn = _FLEX["fn"]
    _, b, L, hq, hkv, d = case
    n_rot = C.num_rotations(2 * b * L * hkv * d * dtype.itemsize)
    kvs = [
        (
            torch.randn(b, hkv, L, d, dtype=dtype, device=device),
            torch.randn(b, hkv, L, d, dtype=dtype, device=device),
        )
        for _ in range(n_rot)
    ]
    q = torch.randn(b, hq, 1, d, dtype=dtype, device=device)
    fn(q, *kvs[0], enable_gqa=True)  # compile
    torch.cuda.synchronize()
    return C.bench(C.rotating([lambda k=k, v=v: fn(q, k, v, enable_gqa=True) for k, v in kvs]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--budget", type=float, default=150.0, help="seconds for all rows (FlexAttention compiles)")
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    dtype = torch.float16
    t_start = time.perf_counter()
    rows = []
    for case in CASES:
        name, b, L, hq, hkv, d = case
        nbytes = C.decode_bytes(b, L, hq, hkv, d, dtype.itemsize, dtype.itemsize)
        row = {"case": name, "ours_ms": None, "flex_ms": None, "ratio": None}
        if time.perf_counter() - t_start > args.budget:
            row["note"] = "not run: time budget spent"
            rows.append(row)
            continue
        try:
            row["ours_ms"] = ours_ms(case, dtype, device)
            row["ours_tbps"] = C.tbps(nbytes, row["ours_ms"])
        except Exception as exc:  # report, keep going
            row["ours_error"] = f"{type(exc).__name__}: {exc}"[:300]
        torch.cuda.empty_cache()
        try:
            row["flex_ms"] = flex_ms(case, dtype, device)
            row["flex_tbps"] = C.tbps(nbytes, row["flex_ms"])
        except Exception as exc:
            row["flex_error"] = f"{type(exc).__name__}: {exc}"[:300]
        torch.cuda.empty_cache()
        if row["ours_ms"] and row["flex_ms"]:
            row["ratio"] = row["flex_ms"] / row["ours_ms"]
        rows.append(row)
        print(row, flush=True)
    C.print_table(rows, ["case", "ours_ms", "ours_tbps", "flex_ms", "flex_tbps", "ratio"])
    meta = {"what": "decode, fp16, D128: ours paged (page 16, HND) vs FlexAttention dense; ratio = flex / ours"}
    print("[bench_decode_flex] wrote", C.write_json("decode-flex", rows, meta, out_dir=args.out), flush=True)


if __name__ == "__main__":
    main()
