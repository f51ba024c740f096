"""Prefill / append attention: ours beside FlashInfer (fa2, fa3) and torch SDPA, in TFLOP/s.

FLOPs = 4 * visible (query, key) pairs * head_dim * num_qo_heads (causal counts only the visible pairs,
bottom-right aligned). ``ours_ms`` times ``_prefill_impl.run`` after one ``plan()`` (what a wrapper does
per layer); ``ours_public_ms`` times the public entry point end to end (single: plan + run every call;
batch: the wrapper's run). ``ratio = flashinfer_ms (fa2) / ours_ms``.

    PYTHONPATH=src python benchmarks/bench_prefill.py [--sweep] [--out DIR] [--no-flashinfer] [--fa3]
    PYTHONPATH=src python benchmarks/bench_prefill.py --fi-build-only DONE_FILE   # warm FlashInfer's JIT
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

# (name, kind, batch, qo_len, kv_len, hq, hkv, head_dim, causal, dtype, page_size)
CASES = [
    ("4096 32/32 D128 causal", "single", 1, 4096, 4096, 32, 32, 128, True, torch.float16, 1),
    ("4096 32/32 D128 full", "single", 1, 4096, 4096, 32, 32, 128, False, torch.float16, 1),
    ("8192 32/8 D128 causal", "single", 1, 8192, 8192, 32, 8, 128, True, torch.float16, 1),
    ("16384 32/8 D128 causal", "single", 1, 16384, 16384, 32, 8, 128, True, torch.float16, 1),
    ("4096 32/32 D64 causal", "single", 1, 4096, 4096, 32, 32, 64, True, torch.float16, 1),
    ("16x(1024 over 2048 paged) 32/8", "paged", 16, 1024, 2048, 32, 8, 128, True, torch.float16, 16),
    ("4096 32/32 D128 causal bf16", "single", 1, 4096, 4096, 32, 32, 128, True, torch.bfloat16, 1),
    ("4096 16/16 D256 causal", "single", 1, 4096, 4096, 16, 16, 256, True, torch.float16, 1),
    ("append 512 over 8192 32/8", "single", 1, 512, 8192, 32, 8, 128, True, torch.float16, 1),
    ("shared prefix 64q x 16384 32/8", "single", 1, 64, 16384, 32, 8, 128, False, torch.float16, 1),
]

# Configurations tried with --sweep: (block_m, block_n, num_warps, num_stages, use_tma, page_prefetch).
SWEEP = {
    "4096 32/32 D128 causal": [
        (64, 64, 4, 3, True, True),
        (64, 64, 4, 4, True, True),
        (64, 128, 4, 3, True, True),
        (128, 128, 8, 3, True, True),
        (64, 64, 4, 3, False, True),
    ],
    "4096 32/32 D128 full": [
        (128, 128, 8, 3, True, True),
        (128, 64, 8, 3, True, True),
        (64, 128, 4, 3, True, True),
        (128, 128, 8, 3, False, True),
    ],
    "8192 32/8 D128 causal": [(64, 64, 4, 3, True, True), (64, 64, 4, 4, True, True), (128, 128, 8, 3, True, True)],
    "4096 32/32 D64 causal": [(128, 64, 8, 3, True, True), (64, 64, 4, 3, True, True), (64, 64, 4, 4, True, True)],
    "16x(1024 over 2048 paged) 32/8": [
        (128, 64, 8, 3, False, True),
        (128, 64, 8, 3, False, False),
        (64, 64, 4, 3, False, True),
        (64, 64, 4, 4, False, True),
        (128, 64, 8, 4, False, True),
    ],
    "4096 16/16 D256 causal": [(64, 32, 4, 3, True, True), (64, 64, 4, 2, True, True), (32, 64, 4, 3, True, True)],
    "append 512 over 8192 32/8": [
        (64, 64, 4, 3, True, True),
        (128, 64, 8, 3, True, True),
        (128, 128, 8, 3, True, True),
    ],
    "shared prefix 64q x 16384 32/8": [
        (128, 128, 8, 3, True, True),
        (128, 64, 8, 3, True, True),
        (64, 64, 4, 3, True, True),
    ],
}


def visible_pairs(qo: int, kv: int, causal: bool) -> int:
    """(query, key) pairs attended; causal: query i sees keys 0 .. i + kv - qo (bottom-right), clipped."""
    if not causal:
        return qo * kv
    return sum(min(kv, max(0, i + kv - qo + 1)) for i in range(qo))


def flops(case) -> float:
    _, _, batch, qo, kv, hq, _, d, causal, _, _ = case
    return 4.0 * batch * visible_pairs(qo, kv, causal) * d * hq


def make_inputs(case, seed=0):
    name, kind, batch, qo, kv, hq, hkv, d, causal, dtype, ps = case
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    q = torch.randn(batch * qo, hq, d, device=dev, dtype=dtype, generator=g)
    inp = {"q": q}
    if kind == "single":
        inp["k"] = torch.randn(kv, hkv, d, device=dev, dtype=dtype, generator=g)
        inp["v"] = torch.randn(kv, hkv, d, device=dev, dtype=dtype, generator=g)
    else:
        pages_per = -(-kv // ps)
        num_pages = batch * pages_per
        cache = torch.randn(num_pages, 2, ps, hkv, d, device=dev, dtype=dtype, generator=g)
        perm = torch.randperm(num_pages, device=dev, generator=g).to(torch.int32)
        inp["cache"] = cache
        inp["kv_indices"] = perm
        inp["kv_indptr"] = torch.arange(batch + 1, device=dev, dtype=torch.int32) * pages_per
        inp["last_page_len"] = torch.full((batch,), kv - (pages_per - 1) * ps, device=dev, dtype=torch.int32)
        inp["qo_indptr"] = torch.arange(batch + 1, device=dev, dtype=torch.int32) * qo
    return inp


# ----------------------------------------------------------------------------- ours
def ours_fn(case, inp, config=None):
    """plan() once, return (run closure, out tensor, plan) through the backend seam."""
    from flashinfer_triton import _prefill_impl as impl
    from flashinfer_triton._backend import AttentionBatch, AttentionOptions, Workspace

    name, kind, batch, qo, kv, hq, hkv, d, causal, dtype, ps = case
    dev = torch.device("cuda")
    paged = kind == "paged"
    opts = AttentionOptions(
        num_qo_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        page_size=ps if paged else 1,
        paged=paged,
        causal=causal,
        sm_scale=1.0 / math.sqrt(d),
        q_dtype=dtype,
        kv_dtype=dtype,
        o_dtype=dtype,
    )
    qo_indptr = torch.arange(batch + 1, dtype=torch.int64) * qo
    kv_lens = torch.full((batch,), kv, dtype=torch.int64)
    if paged:
        kv_indptr_host = inp["kv_indptr"].cpu().long()
        k4, v4 = inp["cache"][:, 0], inp["cache"][:, 1]
        kv_indices = inp["kv_indices"]
    else:
        kv_indptr_host = torch.arange(batch + 1, dtype=torch.int64) * kv
        k4, v4 = inp["k"][:, None], inp["v"][:, None]
        kv_indices = None
    b = AttentionBatch(
        batch_size=batch,
        qo_indptr=qo_indptr.to(torch.int32).to(dev),
        kv_indptr=kv_indptr_host.to(torch.int32).to(dev),
        kv_indices=kv_indices,
        kv_lens=kv_lens.to(torch.int32).to(dev),
        qo_indptr_host=qo_indptr,
        kv_lens_host=kv_lens,
        kv_indptr_host=kv_indptr_host,
    )
    ws = Workspace(
        float_buffer=torch.empty(128 << 20, dtype=torch.uint8, device=dev),
        int_buffer=torch.empty(8 << 20, dtype=torch.uint8, device=dev),
    )
    p = impl.plan(opts, b, ws, config=config)
    q = inp["q"]
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=dev)

    def fn():
        impl.run(p, opts, b, q, k4, v4, out, lse, qk_scale_mult=1.0, v_scale=1.0)

    return fn, out, p


def ours_public_fn(case, inp):
    import flashinfer_triton as fit

    name, kind, batch, qo, kv, hq, hkv, d, causal, dtype, ps = case
    if kind == "single":
        return lambda: fit.single_prefill_with_kv_cache(inp["q"], inp["k"], inp["v"], causal=causal)
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    w = fit.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    w.plan(
        inp["qo_indptr"],
        inp["kv_indptr"],
        inp["kv_indices"],
        inp["last_page_len"],
        hq,
        hkv,
        d,
        ps,
        causal=causal,
        q_data_type=dtype,
    )
    return lambda: w.run(inp["q"], inp["cache"])


# ----------------------------------------------------------------------------- peers
def flashinfer_fn(fi, case, inp, backend):
    name, kind, batch, qo, kv, hq, hkv, d, causal, dtype, ps = case
    if kind == "single":
        return lambda: fi.single_prefill_with_kv_cache(inp["q"], inp["k"], inp["v"], causal=causal, backend=backend)
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
    w.plan(
        inp["qo_indptr"],
        inp["kv_indptr"],
        inp["kv_indices"],
        inp["last_page_len"],
        hq,
        hkv,
        d,
        ps,
        causal=causal,
        q_data_type=dtype,
        kv_data_type=dtype,
    )
    return lambda: w.run(inp["q"], inp["cache"])


def sdpa_fn(case, inp, backend_name):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    name, kind, batch, qo, kv, hq, hkv, d, causal, dtype, ps = case
    if kind != "single" or (causal and qo != kv):
        return None  # SDPA's is_causal is top-left aligned; only square causal matches
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend_name]
    q = inp["q"].transpose(0, 1)[None]
    k = inp["k"].transpose(0, 1)[None]
    v = inp["v"].transpose(0, 1)[None]
    if hkv != hq:
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)

    def fn():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return fn


def fi_variants(fa3: bool):
    """One small call per FlashInfer JIT module the table needs (built concurrently by --fi-build-only)."""
    seen, out = set(), []
    for case in CASES:
        name, kind, batch, qo, kv, hq, hkv, d, causal, dtype, ps = case
        for backend in ("fa2", "fa3") if fa3 else ("fa2",):
            if backend == "fa3" and (dtype != torch.float16 or d not in (64, 128)):
                continue
            key = (kind, d, dtype, backend)
            if key in seen:
                continue
            seen.add(key)
            small = (name, kind, min(batch, 2), 16, 32, hq, hkv, d, causal, dtype, ps)
            out.append((key, small))
    return out


def fi_build_only(done_file: str, fa3: bool) -> None:
    from concurrent.futures import ThreadPoolExecutor

    fi = C.import_flashinfer()
    if fi is None:
        with open(done_file, "w") as f:
            f.write("no flashinfer\n")
        return
    t0 = time.time()

    def build(item):
        key, small = item
        t = time.time()
        try:
            fn = flashinfer_fn(fi, small, make_inputs(small), key[3])
            fn()
            torch.cuda.synchronize()
            return f"{key}: built in {time.time() - t:.0f}s"
        except Exception as exc:  # report and go on: a missing variant leaves a gap in the table
            return f"{key}: FAILED {type(exc).__name__}: {str(exc)[:300]}"

    items = fi_variants(fa3)
    with ThreadPoolExecutor(max_workers=len(items)) as ex:
        for line in ex.map(build, items):
            print(line, flush=True)
    with open(done_file, "w") as f:
        f.write(f"done in {time.time() - t0:.0f}s\n")


# ----------------------------------------------------------------------------- main
def timed(fn):
    try:
        fn()
        torch.cuda.synchronize()
        return C.bench(fn)
    except Exception as exc:
        print(f"[bench] failed: {type(exc).__name__}: {str(exc)[:300]}", file=sys.stderr, flush=True)
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--fa3", action="store_true", help="also FlashInfer's fa3 backend (JIT 85-100 s per variant)")
    ap.add_argument("--fi-build-only", default=None, metavar="DONE_FILE")
    ap.add_argument("--wait-build", default=None, metavar="DONE_FILE", help="wait for a --fi-build-only run")
    ap.add_argument("--wait-limit", type=float, default=240.0)
    ap.add_argument("--only", default=None, help="substring of the case names to run")
    args = ap.parse_args()
    if args.fi_build_only:
        fi_build_only(args.fi_build_only, args.fa3)
        return

    from flashinfer_triton._prefill_impl import PrefillConfig

    cases = [c for c in CASES if args.only is None or args.only in c[0]]
    rows, sweep_rows = [], []
    inputs = {}
    t_start = time.time()
    for case in cases:
        name = case[0]
        inp = make_inputs(case)
        inputs[name] = inp
        fn, out, p = ours_fn(case, inp)
        t0 = time.time()
        fn()
        torch.cuda.synchronize()
        first_ms = (time.time() - t0) * 1e3
        ms = timed(fn)
        graph_ms = None
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            graph_ms = timed(graph.replay)
        except Exception as exc:
            print(f"[bench] graph capture {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        pub = timed(ours_public_fn(case, inp))
        fl = flops(case)
        row = {
            "case": name,
            "ours_ms": ms,
            "ours_tflops": fl / (ms * 1e-3) / 1e12 if ms else None,
            "ours_graph_ms": graph_ms,
            "ours_public_ms": pub,
            "config": f"{p.config.block_m}x{p.config.block_n} w{p.config.num_warps} s{p.config.num_stages}",
            "splits": p.num_merge_host > 0,
            "first_call_ms": first_ms,
            "flops": fl,
        }
        rows.append(row)
        print(f"[ours] {name}: {ms:.3f} ms {row['ours_tflops']:.0f} TFLOP/s ({row['config']})", flush=True)
        if args.sweep and name in SWEEP:
            for bm, bn, w, s, tma, pf in SWEEP[name]:
                cfg = PrefillConfig(bm, bn, w, s, use_tma=tma, page_prefetch=pf)
                try:
                    sfn, _, _ = ours_fn(case, inp, config=cfg)
                    sms = timed(sfn)
                except Exception as exc:
                    print(f"[sweep] {name} {cfg}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    sms = None
                sweep_rows.append(
                    {
                        "case": name,
                        "config": f"{bm}x{bn} w{w} s{s} tma={tma} pf={pf}",
                        "ms": sms,
                        "tflops": fl / (sms * 1e-3) / 1e12 if sms else None,
                    }
                )
                print(f"[sweep] {name} {bm}x{bn} w{w} s{s} tma={tma} pf={pf}: {sms} ms", flush=True)
        C.write_json("prefill", rows, {"sweep": sweep_rows, "partial": True}, args.out)

    fi = None if args.no_flashinfer else C.import_flashinfer()
    if fi is not None and args.wait_build:
        t0 = time.time()
        while not os.path.exists(args.wait_build) and time.time() - t0 < args.wait_limit:
            time.sleep(2)
        print(f"[bench] waited {time.time() - t0:.0f}s for FlashInfer builds", flush=True)
    fa3_built = {key for key, _ in fi_variants(True) if key[3] == "fa3"}
    for case, row in zip(cases, rows, strict=True):
        name = case[0]
        inp = inputs[name]
        fl = row["flops"]
        if fi is not None:
            for backend, key in (("fa2", "flashinfer_ms"), ("fa3", "flashinfer_fa3_ms")):
                if backend == "fa3" and (not args.fa3 or (case[1], case[7], case[9], "fa3") not in fa3_built):
                    continue
                try:
                    ffn = flashinfer_fn(fi, case, inp, backend)
                    row[key] = timed(ffn)
                    if backend == "fa2" and row[key] is not None:
                        ref = ffn()
                        fn2, out2, _ = ours_fn(case, inp)
                        fn2()
                        row["max_abs_diff_vs_fa2"] = float((out2.float() - ref.float()).abs().max())
                except Exception as exc:
                    print(f"[bench] flashinfer {backend} {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                    row[key] = None
        for b in ("flash", "cudnn"):
            try:
                sfn = sdpa_fn(case, inp, b)
                row[f"sdpa_{b}_ms"] = timed(sfn) if sfn is not None else None
            except Exception as exc:
                print(f"[bench] sdpa {b} {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                row[f"sdpa_{b}_ms"] = None
        for key in ("flashinfer_ms", "flashinfer_fa3_ms", "sdpa_flash_ms", "sdpa_cudnn_ms"):
            if row.get(key):
                row[key.replace("_ms", "_tflops")] = fl / (row[key] * 1e-3) / 1e12
        fa2 = row.get("flashinfer_ms")
        row["ratio"] = fa2 / row["ours_ms"] if fa2 and row["ours_ms"] else None
        if fa2 and row.get("flashinfer_fa3_ms"):
            row["ratio_fa3"] = row["flashinfer_fa3_ms"] / row["ours_ms"]
        C.write_json("prefill", rows, {"sweep": sweep_rows, "partial": True}, args.out)

    meta = {"sweep": sweep_rows, "elapsed_s": time.time() - t_start, "flashinfer": getattr(fi, "__version__", None)}
    path = C.write_json("prefill", rows, meta, args.out)
    cols = [
        "case",
        "ours_ms",
        "ours_tflops",
        "flashinfer_tflops",
        "flashinfer_fa3_tflops",
        "sdpa_cudnn_tflops",
        "ratio",
        "ours_public_ms",
        "config",
    ]
    C.print_table(rows, cols)
    if sweep_rows:
        C.print_table(sweep_rows, ["case", "config", "ms", "tflops"])
    print(f"[bench] wrote {path}")


if __name__ == "__main__":
    main()
