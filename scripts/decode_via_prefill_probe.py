"""Decode rows through the prefill path (one query per request) with the Gluon Hopper kernel, beside our decode.

    python3 scripts/decode_via_prefill_probe.py [--cases 1x32768,16x8192] [--pieces 12,16,24,33] [--out F.json]

Same process, same caches (rotated past L2), CUDA-graph replays: our decode wrapper, then the paged prefill wrapper
with qo_len 1 per request (TMA-fed warp-specialized kernel, split KV + merge) at several caps on the split
(_prefill_impl.SPLIT_MAX_PIECES), then the same with the Triton prefill kernel. Prints TB/s and checks outputs agree.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))

import _common as C  # noqa: E402
import bench_decode as BD  # noqa: E402


def time_prefill(case, data, ws, gluon: bool, pieces: int, consumers: int = 2):
    import flashinfer_triton as fit
    from flashinfer_triton import _prefill_impl as impl

    impl.WS_CONFIG = impl.WS_CONFIG_64 if consumers == 1 else impl.PrefillConfig(128, 128, 8, 3, ws=True)
    impl.WS_ENABLED = gluon
    impl.WS_MIN_ROWS = 1  # (one query x group rows: below the 128-row rule)
    impl.SPLIT_MAX_PIECES = pieces
    name, bsz, kv_len, hq, hkv, d, ps, dtype = case
    w = fit.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    qo = torch.arange(bsz + 1, dtype=torch.int32, device="cuda")
    w.plan(qo, data["indptr"], data["indices"], data["last"], hq, hkv, d, ps, q_data_type=dtype)
    out = w.run(data["q"], data["caches"][0])
    return BD.time_graph(w, data["q"], data["caches"]), out


def kernel_times(fn, iters=20):
    """Average GPU time per call of each kernel fn() launches (torch profiler, eager calls)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t and ev.count:
            out[ev.key[:60]] = (t / iters, ev.count / iters)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="1x32768 32/8,16x8192 32/8,64x4096 32/8")
    ap.add_argument("--pieces", default="12,16,24,33")
    ap.add_argument("--out", default=None)
    ap.add_argument("--seq-pages", action="store_true", help="page table in order (0, 1, 2, ...) instead of shuffled")
    ap.add_argument("--consumers", default="1,2")
    ap.add_argument("--prefetch", type=int, default=1, help="_prefill_impl.WS_PAGE_PREFETCH (0/1)")
    ap.add_argument("--profile", action="store_true", help="also each kernel's GPU time (torch profiler, eager)")
    a = ap.parse_args(argv)
    want = [c.strip() for c in a.cases.split(",")]
    from flashinfer_triton import _prefill_impl

    _prefill_impl.WS_PAGE_PREFETCH = bool(a.prefetch)
    rows = []
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for case in BD.CASES:
        if not any(case[0].startswith(w) for w in want) or case[6] != 16 or case[7] != torch.float16:
            continue
        data = BD.build(case, "cuda")
        if a.seq_pages:
            n = data["indices"].numel()
            data["indices"] = torch.arange(n, dtype=torch.int32, device="cuda")
            data["indices_cpu"] = torch.arange(n, dtype=torch.int32)
        w = BD.ours_wrapper(case, data, ws)
        ref = w.run(data["q"], data["caches"][0])
        ms = BD.time_graph(w, data["q"], data["caches"])
        if a.profile:
            kv0 = data["caches"][0]
            for kname, (us, cnt) in kernel_times(lambda w=w, q=data["q"], kv=kv0: w.run(q, kv)).items():
                print(f"{'':30s}   {kname:60s} {us:7.1f} us x{cnt:.0f}", flush=True)
        row = {"case": case[0], "decode_ms": ms, "decode_tbps": data["nbytes"] / ms / 1e9}
        print(f"{case[0]:28s} decode        {ms * 1e3:7.1f} us {row['decode_tbps']:.2f} TB/s", flush=True)
        variants = [
            (True, p, c)
            for c in [int(x) for x in a.consumers.split(",")]
            for p in [int(x) for x in a.pieces.split(",")]
        ] + [(False, 12, 2)]
        for gluon, p, cons in variants:
            if True:
                try:
                    ms_p, out = time_prefill(case, data, ws, gluon, p, cons)
                except Exception as e:
                    print(f"  prefill gluon={gluon} pieces={p}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                diff = float((out.float() - ref.float()).abs().max())
                key = f"prefill_{'gluon' if gluon else 'triton'}_c{cons}_p{p}"
                if a.profile:
                    import flashinfer_triton as fit

                    name, bsz, kv_len, hq, hkv, d, ps, dtype = case
                    pw = fit.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
                    qo = torch.arange(bsz + 1, dtype=torch.int32, device="cuda")
                    pw.plan(qo, data["indptr"], data["indices"], data["last"], hq, hkv, d, ps, q_data_type=dtype)
                    kv0 = data["caches"][0]
                    for kname, (us, cnt) in kernel_times(lambda w=pw, q=data["q"], kv=kv0: w.run(q, kv)).items():
                        print(f"{'':30s}   {kname:60s} {us:7.1f} us x{cnt:.0f}", flush=True)
                row[key + "_ms"] = ms_p
                row[key + "_diff"] = diff
                print(f"{'':28s} {key:22s} {ms_p * 1e3:7.1f} us {data['nbytes'] / ms_p / 1e9:.2f} TB/s diff {diff:.1e}",
                      flush=True)  # fmt: skip
        rows.append(row)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"gpu": C.gpu_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
