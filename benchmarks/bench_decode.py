"""Batch decode: ours (public BatchDecodeWithPagedKVCacheWrapper) beside FlashInfer's, in TB/s.

bytes = the whole KV cache read once + q read + o written. FlashInfer runs with use_tensor_cores False
and True; the better of the two is the baseline of ``ratio = flashinfer_ms / ours_ms``. Also: host time
of ``plan()`` for batch 256, the first call of a new variant with a cold Triton cache, the merge kernels
beside a device copy of the same bytes, and (``--sweep``) tile/split configurations of our kernel.

    PYTHONPATH=src python benchmarks/bench_decode.py [--sweep] [--out DIR] [--no-flashinfer]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

# (name, batch, kv_len, hq, hkv, head_dim, page_size, dtype)
CASES = [
    ("1x32768 32/8", 1, 32768, 32, 8, 128, 16, torch.float16),
    ("16x8192 32/8", 16, 8192, 32, 8, 128, 16, torch.float16),
    ("64x4096 32/8", 64, 4096, 32, 8, 128, 16, torch.float16),
    ("128x2048 32/8", 128, 2048, 32, 8, 128, 16, torch.float16),
    ("256x1024 32/8", 256, 1024, 32, 8, 128, 16, torch.float16),
    ("64x4096 32/32", 64, 4096, 32, 32, 128, 16, torch.float16),
    ("64x4096 64/8", 64, 4096, 64, 8, 128, 16, torch.float16),
    ("1x32768 32/8 ps1", 1, 32768, 32, 8, 128, 1, torch.float16),
    ("64x4096 32/8 ps1", 64, 4096, 32, 8, 128, 1, torch.float16),
    ("1x32768 32/8 bf16", 1, 32768, 32, 8, 128, 16, torch.bfloat16),
    ("64x4096 32/8 bf16", 64, 4096, 32, 8, 128, 16, torch.bfloat16),
]

# Tile / split configurations tried with --sweep (CONFIG_OVERRIDE keys, plus split target waves).
SWEEP = [
    # (label, CONFIG_OVERRIDE, SPLIT_TARGET_WAVES or None, SPLIT_MIN_WAVES or None)
    ("n32w4s4", dict(BLOCK_N=32, num_warps=4, num_stages=4), None, None),
    ("n128w8s3", dict(BLOCK_N=128, num_warps=8, num_stages=3), None, None),
    ("nodot", dict(USE_DOT=False), None, None),
    ("splitall-t8", {}, 8.0, 1e9),
]


def build(case, device, seed=0):
    """Caches (rotating copies), shuffled page table, q for one case."""
    name, bsz, kv_len, hq, hkv, d, ps, dtype = case
    gen = torch.Generator(device="cpu").manual_seed(seed)
    pages_per = -(-kv_len // ps)
    total_pages = bsz * pages_per
    indptr = torch.arange(0, bsz + 1, dtype=torch.int32) * pages_per
    indices = torch.randperm(total_pages, generator=gen).to(torch.int32)
    last = torch.full((bsz,), kv_len - (pages_per - 1) * ps, dtype=torch.int32)
    cache_bytes = 2 * total_pages * ps * hkv * d * dtype.itemsize
    n_rot = C.num_rotations(cache_bytes)
    caches = []
    for _ in range(n_rot):
        k = torch.randn((total_pages, ps, hkv, d), dtype=dtype, device=device)
        v = torch.randn((total_pages, ps, hkv, d), dtype=dtype, device=device)
        caches.append((k, v))
    q = torch.randn((bsz, hq, d), dtype=dtype, device=device)
    return dict(
        indptr=indptr.to(device),
        indices=indices.to(device),
        last=last.to(device),
        indptr_cpu=indptr,
        indices_cpu=indices,
        last_cpu=last,
        caches=caches,
        q=q,
        nbytes=C.decode_bytes(bsz, kv_len, hq, hkv, d, dtype.itemsize, dtype.itemsize),
    )


def ours_wrapper(case, data, ws):
    import flashinfer_triton as fit

    name, bsz, kv_len, hq, hkv, d, ps, dtype = case
    w = fit.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    w.plan(data["indptr"], data["indices"], data["last"], hq, hkv, d, ps, q_data_type=dtype, kv_data_type=dtype)
    return w


def time_ours(case, data, ws):
    w = ours_wrapper(case, data, ws)
    q = data["q"]
    fns = [lambda kv=kv: w.run(q, kv) for kv in data["caches"]]
    out = w.run(q, data["caches"][0])
    return C.bench(C.rotating(fns)), out


def time_flashinfer(fi, case, data, ws, tc):
    name, bsz, kv_len, hq, hkv, d, ps, dtype = case
    w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
    w.plan(data["indptr"], data["indices"], data["last"], hq, hkv, d, ps, q_data_type=dtype, kv_data_type=dtype)
    q = data["q"]
    fns = [lambda kv=kv: w.run(q, kv) for kv in data["caches"]]
    out = w.run(q, data["caches"][0])
    return C.bench(C.rotating(fns)), out


def decode_table(args, fi, device, meta):
    from flashinfer_triton import _decode_impl as impl

    ws = torch.empty(128 << 20, dtype=torch.uint8, device=device)
    fi_ws = torch.empty(128 << 20, dtype=torch.uint8, device=device)
    rows = []
    for case in CASES:
        name = case[0]
        data = build(case, device)
        ms, out = time_ours(case, data, ws)
        row = dict(case=name, ours_ms=ms, ours_tbps=C.tbps(data["nbytes"], ms), bytes=data["nbytes"])
        if args.sweep:
            sweep = {}
            for label, override, waves, min_waves in SWEEP:
                saved = dict(impl.CONFIG_OVERRIDE), impl.SPLIT_TARGET_WAVES, impl.SPLIT_MIN_WAVES
                impl.CONFIG_OVERRIDE.clear()
                impl.CONFIG_OVERRIDE.update(override)
                if waves is not None:
                    impl.SPLIT_TARGET_WAVES = waves
                if min_waves is not None:
                    impl.SPLIT_MIN_WAVES = min_waves
                try:
                    w = ours_wrapper(case, data, ws)
                    q = data["q"]
                    fns = [lambda kv=kv, w=w, q=q: w.run(q, kv) for kv in data["caches"]]
                    sweep[label] = C.bench(C.rotating(fns), warmup=10, rep=40)
                except Exception as exc:  # a config that does not compile is reported, not fatal
                    sweep[label] = f"{type(exc).__name__}: {str(exc)[:120]}"
                finally:
                    impl.CONFIG_OVERRIDE.clear()
                    impl.CONFIG_OVERRIDE.update(saved[0])
                    impl.SPLIT_TARGET_WAVES = saved[1]
                    impl.SPLIT_MIN_WAVES = saved[2]
            row["sweep_ms"] = sweep
            best = min((v, k) for k, v in sweep.items() if isinstance(v, float))
            row["best_sweep"] = best[1]
            row["best_sweep_tbps"] = C.tbps(data["nbytes"], best[0])
        if fi is not None:
            for tc in (False, True):
                key = "fi_tc" if tc else "fi"
                try:
                    t0 = time.perf_counter()
                    fms, fout = time_flashinfer(fi, case, data, fi_ws, tc)
                    row[f"{key}_wall_s"] = time.perf_counter() - t0
                    row[f"{key}_ms"] = fms
                    row[f"{key}_tbps"] = C.tbps(data["nbytes"], fms)
                    row[f"{key}_maxdiff"] = float((fout.float() - out.float()).abs().max())
                except Exception as exc:
                    row[f"{key}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            fis = [row[k] for k in ("fi_ms", "fi_tc_ms") if k in row]
            if fis:
                row["flashinfer_ms"] = min(fis)
                row["ratio"] = row["flashinfer_ms"] / ms
        rows.append(row)
        C.write_json("decode", rows, meta, args.out)  # partial results survive a timeout
        C.print_table(
            [row], ["case", "ours_ms", "ours_tbps", "fi_tbps", "fi_tc_tbps", "ratio", "best_sweep", "best_sweep_tbps"]
        )
        del data
        torch.cuda.empty_cache()
    return rows


def plan_timing(fi, device):
    """Host time of plan() for batch 256 x 1024 (page 16), index tensors on the GPU and on the CPU."""
    import flashinfer_triton as fit
    from flashinfer_triton import _decode_impl as impl

    case = ("plan 256x1024", 256, 1024, 32, 8, 128, 16, torch.float16)
    data = build(case, device)
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=device)
    out = {}
    for where in ("cuda", "cpu"):
        sfx = "" if where == "cuda" else "_cpu"
        args = (data["indptr" + sfx], data["indices" + sfx], data["last" + sfx], 32, 8, 128, 16)
        w = fit.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        out[f"ours_plan_us_{where}"] = C.host_time_us(lambda w=w, args=args: w.plan(*args), sync=torch.cuda.synchronize)
        if fi is not None:
            for tc in (False, True):
                fw = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
                try:
                    out[f"fi{'_tc' if tc else ''}_plan_us_{where}"] = C.host_time_us(
                        lambda fw=fw, args=args: fw.plan(*args), sync=torch.cuda.synchronize
                    )
                except Exception as exc:
                    out[f"fi{'_tc' if tc else ''}_plan_error"] = str(exc)[:200]
    # The implementation's own plan() (lengths already on the host), without the public checks.
    w = fit.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    w.plan(data["indptr_cpu"], data["indices_cpu"], data["last_cpu"], 32, 8, 128, 16)
    core = getattr(w, "_w", w)
    p = core._planned
    out["impl_plan_us"] = C.host_time_us(
        lambda: impl.plan(p["opts"], p["batch"], core._workspace()), sync=torch.cuda.synchronize
    )
    print("[plan]", out, flush=True)
    return out


def cold_first_call_child():
    """Run in a fresh process with an empty TRITON_CACHE_DIR: seconds to the first result of two variants."""
    import flashinfer_triton as fit

    device = torch.device("cuda")
    res = {}
    for label, case, kw in (
        ("fp16 32/8 d128 ps16 1x32768 (decode + merge)", ("c", 1, 32768, 32, 8, 128, 16, torch.float16), {}),
        (
            "fp16 32/8 d128 ps16 4x512 rope",
            ("c", 4, 512, 32, 8, 128, 16, torch.float16),
            {"pos_encoding_mode": "ROPE_LLAMA"},
        ),
    ):
        data = build(case, device)
        ws = torch.empty(128 << 20, dtype=torch.uint8, device=device)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        w = fit.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(data["indptr"], data["indices"], data["last"], 32, 8, 128, 16, **kw)
        w.run(data["q"], data["caches"][0])
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        w.run(data["q"], data["caches"][0])
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        res[label] = dict(first_call_s=t1 - t0, second_call_s=t2 - t1)
    print("COLD", res, flush=True)
    return res


def cold_first_call():
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, TRITON_CACHE_DIR=tmp)
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--cold-child"], env=env, capture_output=True, text=True
        )
        wall = time.perf_counter() - t0
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("COLD ")]
    if not line:
        return {"error": proc.stderr[-500:], "process_wall_s": wall}
    import ast

    res = ast.literal_eval(line[-1][5:])
    res["process_wall_s"] = wall
    print("[cold]", res, flush=True)
    return res


def merge_bench(device):
    """merge_states / merge_state / the split-KV partial merge beside a device copy of the same bytes."""
    from flashinfer_triton import _merge_impl as M

    rows = []
    n, k, h, d = 4096, 4, 32, 128
    for dtype in (torch.float16, torch.float32):
        v = torch.randn((n, k, h, d), dtype=dtype, device=device)
        s = torch.randn((n, k, h), device=device)
        nbytes = v.numel() * v.element_size() + s.numel() * 4 + n * h * d * v.element_size() + n * h * 4
        ms = C.bench(lambda v=v, s=s: M.merge_states(v, s))
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        cms = C.bench(lambda src=src, dst=dst: dst.copy_(src))
        rows.append(
            dict(
                case=f"merge_states {n}x{k}x{h}x{d} {str(dtype)[6:]}",
                ours_ms=ms,
                ours_tbps=C.tbps(nbytes, ms),
                copy_ms=cms,
                copy_tbps=C.tbps(nbytes, cms),
                frac_of_copy=cms / ms,
            )
        )
        va, vb = v[:, 0].contiguous(), v[:, 1].contiguous()
        sa, sb = s[:, 0].contiguous(), s[:, 1].contiguous()
        nbytes = 3 * va.numel() * va.element_size() + 3 * sa.numel() * 4
        ms = C.bench(lambda va=va, sa=sa, vb=vb, sb=sb: M.merge_state(va, sa, vb, sb))
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        cms = C.bench(lambda src=src, dst=dst: dst.copy_(src))
        rows.append(
            dict(
                case=f"merge_state {n}x{h}x{d} {str(dtype)[6:]}",
                ours_ms=ms,
                ours_tbps=C.tbps(nbytes, ms),
                copy_ms=cms,
                copy_tbps=C.tbps(nbytes, cms),
                frac_of_copy=cms / ms,
            )
        )
    C.print_table(rows, ["case", "ours_ms", "ours_tbps", "copy_tbps", "frac_of_copy"])
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--skip-cold", action="store_true")
    ap.add_argument("--cold-child", action="store_true")
    args = ap.parse_args()
    if args.cold_child:
        cold_first_call_child()
        return
    device = torch.device("cuda")
    meta = {"device": torch.cuda.get_device_name(), "sms": torch.cuda.get_device_properties(0).multi_processor_count}
    if not args.skip_cold:
        meta["first_call"] = cold_first_call()  # before anything warms the cache in this process
    fi = None if args.no_flashinfer else C.import_flashinfer()
    if fi is not None:
        meta["flashinfer"] = getattr(fi, "__version__", "?")
    meta["merge"] = merge_bench(device)
    meta["plan"] = plan_timing(fi, device)
    C.write_json("decode", [], meta, args.out)
    rows = decode_table(args, fi, device, meta)
    path = C.write_json("decode", rows, meta, args.out)
    print("wrote", path)
    C.print_table(
        rows, ["case", "ours_ms", "ours_tbps", "fi_tbps", "fi_tc_tbps", "ratio", "best_sweep", "best_sweep_tbps"]
    )


if __name__ == "__main__":
    main()
