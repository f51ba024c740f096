"""Decode rows timed back to back (no L2 flush between calls) beside do_bench's median, ours and FlashInfer's.

    python3 scripts/decode_steady_probe.py [--cases "1x32768 32/8,16x8192 32/8"] [--out F.json]

``triton.testing.do_bench`` (the prescribed timer) clears L2 before every call by writing zeros over a 256 MB
buffer: the call then starts with ~50 MB of dirty lines in L2, written back to memory while it reads. On a ~50 us
decode call that is a sizable share. Here each path is also timed as one CUDA graph holding one call per cache copy
(copies rotated past L2), replayed 20 times between two events: back-to-back calls, as an engine's layers run them.
Paths: our decode wrapper, the Gluon prefill path (one query per request, one consumer warpgroup), FlashInfer's
CUDA-core and tensor-core decode (when importable).
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


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="1x32768 32/8,16x8192 32/8,64x4096 32/8")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import flashinfer_triton as fit
    from flashinfer_triton import _prefill_impl as impl

    fi = C.import_flashinfer()
    want = [c.strip() for c in a.cases.split(",")]
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    fws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    rows = []
    for case in BD.CASES:
        if not any(case[0] == w for w in want):
            continue
        name, bsz, kv_len, hq, hkv, d, ps, dtype = case
        data = BD.build(case, "cuda")
        q, caches = data["q"], data["caches"]
        paths = {}
        w = BD.ours_wrapper(case, data, ws)
        paths["ours_decode"] = w.run
        impl.WS_CONFIG, impl.WS_MIN_ROWS = impl.WS_CONFIG_64, 1
        pw = fit.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        qo = torch.arange(bsz + 1, dtype=torch.int32, device="cuda")
        pw.plan(qo, data["indptr"], data["indices"], data["last"], hq, hkv, d, ps, q_data_type=dtype)
        paths["ours_gluon_prefill_path"] = pw.run
        if fi is not None:
            for tc in (False, True):
                fw = fi.BatchDecodeWithPagedKVCacheWrapper(fws, "NHD", use_tensor_cores=tc)
                fw.plan(data["indptr"], data["indices"], data["last"], hq, hkv, d, ps, q_data_type=dtype,
                        kv_data_type=dtype)  # fmt: skip
                paths["fi_tc" if tc else "fi"] = fw.run
        row = {"case": name, "bytes": data["nbytes"]}
        for key, run in paths.items():
            back, flushed = steady(run, caches, q)
            row[key + "_steady_ms"], row[key + "_flushed_ms"] = back, flushed
            nb = data["nbytes"]
            print(f"{name:16s} {key:26s} back-to-back {back * 1e3:7.1f} us {nb / back / 1e9:5.2f} TB/s | "
                  f"do_bench {flushed * 1e3:7.1f} us {nb / flushed / 1e9:5.2f} TB/s", flush=True)  # fmt: skip
        rows.append(row)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"gpu": C.gpu_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
