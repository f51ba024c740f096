"""Decode rows timed back to back (no L2 flush between calls) beside do_bench's median, ours and FlashInfer's.

    python3 scripts/decode_steady_probe.py [--cases "1x32768 32/8,16x8192 32/8"] [--out F.json]

``triton.testing.do_bench`` (the prescribed timer) clears L2 before every call by writing zeros over a 256 MB
buffer: the call then starts with ~50 MB of dirty lines in L2, written back to memory while it reads. On a ~50 us
decode call that is a sizable share. Here each path is also timed as one CUDA graph holding one call per cache copy
(copies rotated past L2), replayed 20 times between two events: back-to-back calls, as an engine's layers run them.
Paths (--paths): our decode wrapper with the Triton kernel, with the Gluon decode kernel (ring settings in the path
name), the Gluon prefill path (one query per request, one consumer warpgroup), FlashInfer's CUDA-core and
tensor-core decode (when importable). Outputs of every path are checked against the first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))

import _common as C  # noqa: E402
import bench_decode as BD  # noqa: E402


def steady(run, caches, q, reps=20):
    """(per-call ms back to back, per-call ms by do_bench over single-call graphs)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for kv in caches:
            run(q, kv)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for kv in caches:
            run(q, kv)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        t0.record()
        for _ in range(reps):
            g.replay()
        t1.record()
        torch.cuda.synchronize()
        times.append(t0.elapsed_time(t1) / (reps * len(caches)))
    times.sort()
    singles = []
    for kv in caches:
        gi = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gi):
            run(q, kv)
        singles.append(gi)
    flushed = C.bench(C.rotating([x.replay for x in singles]))
    return times[len(times) // 2], flushed


def host_us(run, q, kv, n=300):
    """Host microseconds per eager call on a row small enough that the GPU keeps up (the loop is host-bound)."""
    for _ in range(20):
        run(q, kv)
    torch.cuda.synchronize()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            run(q, kv)
        times.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return min(times)


def host_rows(fi):
    """Host time per run() of a split 2 x 1024 row (32/8, D128, page 16): Triton kernel, Gluon kernel, FlashInfer."""
    from flashinfer_triton import _decode_impl as dimpl

    case = ("host 2x1024 32/8", 2, 1024, 32, 8, 128, 16, torch.float16)
    data = BD.build(case, "cuda")
    q, kv = data["q"], data["caches"][0]
    out = {}
    for key, mode in (("ours_triton", False), ("ours_gluon", True)):
        dimpl.WS_DECODE = mode
        w = BD.ours_wrapper(case, data, torch.empty(64 << 20, dtype=torch.uint8, device="cuda"))
        out[key + "_host_us"] = host_us(w.run, q, kv)
    dimpl.WS_DECODE = "split"
    if fi is not None:
        fws = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        fw = fi.BatchDecodeWithPagedKVCacheWrapper(fws, "NHD")
        fw.plan(data["indptr"], data["indices"], data["last"], 32, 8, 128, 16, q_data_type=torch.float16,
                kv_data_type=torch.float16)  # fmt: skip
        out["fi_host_us"] = host_us(fw.run, q, kv)
    print("[host]", {k: round(v, 1) for k, v in out.items()}, flush=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="1x32768 32/8,16x8192 32/8,64x4096 32/8")
    ap.add_argument("--out", default=None)
    ap.add_argument("--paths", default="triton,gluon,gluon_bn32_s6,gluon_bn32_s4,gluon_bn64_s2,fi",
                    help="triton, gluon[_bn<keys>_s<stages>], gluon_prefill, fi (CUDA-core and tensor-core)")
    ap.add_argument("--host", action="store_true", help="also host us per run() (a small split row)")
    a = ap.parse_args(argv)
    import flashinfer_triton as fit
    from flashinfer_triton import _prefill_impl as impl

    fi = C.import_flashinfer()
    want = [c.strip() for c in a.cases.split(",")]
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    fws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    rows = []
    host = host_rows(fi) if a.host else None
    for case in BD.CASES:
        if not any(case[0] == w for w in want):
            continue
        name, bsz, kv_len, hq, hkv, d, ps, dtype = case
        data = BD.build(case, "cuda")
        q, caches = data["q"], data["caches"]
        paths = {}
        from flashinfer_triton import _decode_impl as dimpl

        for pth in a.paths.split(","):
            if pth == "triton":
                dimpl.WS_DECODE = False
                w = BD.ours_wrapper(case, data, torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
                paths["ours_decode"] = w.run
            elif pth.startswith("gluon") and pth != "gluon_prefill":
                # gluon[_bn<keys>_s<stages>]: the Gluon decode kernel with that ring (planned with it forced on)
                # (_w<waves>: the split rule's target of programs per SM at plan time, WS_SPLIT_WAVES)
                bn, st, waves = 64, 3, dimpl.WS_SPLIT_WAVES
                for part in pth.split("_")[1:]:
                    if part.startswith("bn"):
                        bn = int(part[2:])
                    elif part.startswith("s"):
                        st = int(part[1:])
                    elif part.startswith("w"):
                        waves = float(part[1:])
                dimpl.WS_DECODE = True
                saved, dimpl.WS_SPLIT_WAVES = dimpl.WS_SPLIT_WAVES, waves
                w = BD.ours_wrapper(case, data, torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
                dimpl.WS_SPLIT_WAVES = saved

                stream = pth.startswith("gluonstream")  # copies only, no arithmetic (wrong outputs)

                def run_g(q_, kv_, w=w, bn=bn, st=st, stream=stream):
                    dimpl.WS_BLOCK_N, dimpl.WS_STAGES, dimpl.WS_PROBE_STREAM = bn, st, stream
                    try:
                        return w.run(q_, kv_)
                    finally:
                        dimpl.WS_PROBE_STREAM = False

                paths["ours_" + pth] = run_g
            elif pth == "gluon_prefill":
                impl.WS_CONFIG, impl.WS_MIN_ROWS = impl.WS_CONFIG_64, 1
                pw = fit.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
                qo = torch.arange(bsz + 1, dtype=torch.int32, device="cuda")
                pw.plan(qo, data["indptr"], data["indices"], data["last"], hq, hkv, d, ps, q_data_type=dtype)
                paths["ours_gluon_prefill_path"] = pw.run
        dimpl.WS_DECODE, dimpl.WS_BLOCK_N, dimpl.WS_STAGES = "split", 64, 3
        if fi is not None and "fi" in a.paths.split(","):
            for tc in (False, True):
                fw = fi.BatchDecodeWithPagedKVCacheWrapper(fws, "NHD", use_tensor_cores=tc)
                fw.plan(data["indptr"], data["indices"], data["last"], hq, hkv, d, ps, q_data_type=dtype,
                        kv_data_type=dtype)  # fmt: skip
                paths["fi_tc" if tc else "fi"] = fw.run
        row = {"case": name, "bytes": data["nbytes"]}
        ref = None
        for key, run in paths.items():
            o = run(q, caches[0]).float()
            torch.cuda.synchronize()
            if ref is None:
                ref = o
            row[key + "_max_diff"] = diff = float((o - ref).abs().max())
            if not diff < 2e-2 and "stream" not in key:
                print(f"{name} {key}: max diff {diff} against {next(iter(paths))}", flush=True)
            back, flushed = steady(run, caches, q)
            row[key + "_steady_ms"], row[key + "_flushed_ms"] = back, flushed
            nb = data["nbytes"]
            print(f"{name:16s} {key:26s} back-to-back {back * 1e3:7.1f} us {nb / back / 1e9:5.2f} TB/s | "
                  f"do_bench {flushed * 1e3:7.1f} us {nb / flushed / 1e9:5.2f} TB/s", flush=True)  # fmt: skip
        rows.append(row)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"gpu": C.gpu_name(), "rows": rows, "host": host}, f, indent=1)


if __name__ == "__main__":
    main()
