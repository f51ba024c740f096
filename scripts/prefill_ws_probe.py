"""A/B: the warp-specialized Gluon prefill kernel vs the Triton kernel on the prefill table's single-request rows.

    python3 scripts/prefill_ws_probe.py [--only SUBSTR] [--out FILE.json] [--regs 240] [--stages 2]

Same process, same inputs; each row times plan-once + run() (CUDA-graph replays of run(), median of
triton.testing.do_bench) with _prefill_impl.WS_ENABLED on and off, checks the two outputs agree, prints
TFLOP/s and the ratio Triton time / Gluon time.
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
import bench_prefill as B  # noqa: E402


def time_ours(case, inp, enabled: bool):
    import flashinfer_triton as fit
    from flashinfer_triton import _prefill_impl as impl

    impl.WS_ENABLED = enabled
    name, kind, batch, qo, kv, hq, hkv, d, causal, dtype, ps, _ = case
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    w = fit.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
    qi = torch.tensor([0, qo], dtype=torch.int32, device="cuda")
    ki = torch.tensor([0, kv], dtype=torch.int32, device="cuda")
    w.plan(qi, ki, hq, hkv, d, causal=causal, q_data_type=dtype)
    out = w.run(inp["q"], inp["k"], inp["v"])
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.run(inp["q"], inp["k"], inp["v"], out=out)
    ms = C.bench(lambda: g.replay())
    return ms, out.clone(), None


def time_paged(case, inp, enabled: bool):
    import flashinfer_triton as fit
    from flashinfer_triton import _prefill_impl as impl

    impl.WS_ENABLED = enabled
    name, kind, batch, qo, kv, hq, hkv, d, causal, dtype, ps, _ = case
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    w = fit.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    w.plan(inp["qo_indptr"], inp["kv_indptr"], inp["kv_indices"], inp["last_page_len"], hq, hkv, d, ps,
           causal=causal, q_data_type=dtype)  # fmt: skip
    out = w.run(inp["q"], inp["cache"])
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.run(inp["q"], inp["cache"], out=out)
    ms = C.bench(lambda: g.replay())
    return ms, out.clone(), None


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--regs", type=int, default=None)
    ap.add_argument("--stages", type=int, default=None)
    ap.add_argument("--nocausal-ws", action="store_true", help="causal rows: WS_CAUSAL = False")
    ap.add_argument("--pingpong", type=int, default=None, help="WS_PINGPONG 0/1")
    ap.add_argument("--d64", type=int, default=None, help="head dim 64 through the Gluon kernel 0/1")
    ap.add_argument("--paged", action="store_true", help="the paged rows instead of the single-request ones")
    a = ap.parse_args(argv)
    from flashinfer_triton import _prefill_impl as impl

    if a.regs:
        impl.WS_CONSUMER_REGS = a.regs
    if a.stages:
        impl.WS_STAGES = {64: a.stages, 128: a.stages}
    if a.pingpong is not None:
        impl.WS_PINGPONG = bool(a.pingpong)
    if a.d64 is not None:
        impl.WS_HEAD_DIMS = (64, 128) if a.d64 else (128,)
    if a.nocausal_ws:
        impl.WS_CAUSAL = False
    rows = []
    for case in B.CASES:
        if case[1] != ("paged" if a.paged else "single") or case[11] is not None:
            continue
        if a.only and a.only not in case[0]:
            continue
        inp = B.make_inputs(case)
        fl = B.flops(case)
        try:
            timer = time_paged if a.paged else time_ours
            ms_ws, o_ws, _ = timer(case, inp, True)
            ms_tr, o_tr, _ = timer(case, inp, False)
        except Exception as e:  # report and go on
            print(f"{case[0]}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            rows.append({"case": case[0], "error": f"{type(e).__name__}: {str(e)[:300]}"})
            continue
        diff = float((o_ws.float() - o_tr.float()).abs().max())
        nan = bool(torch.isnan(o_ws).any())
        row = {
            "case": case[0],
            "ws_ms": ms_ws,
            "triton_ms": ms_tr,
            "ws_tflops": fl / ms_ws / 1e9,
            "triton_tflops": fl / ms_tr / 1e9,
            "ratio": ms_tr / ms_ws,
            "max_abs_diff": diff,
            "nan": nan,
        }
        rows.append(row)
        print(
            f"{case[0]:32s} gluon {ms_ws:.4f} ms {row['ws_tflops']:6.1f} TF/s | triton {ms_tr:.4f} ms "
            f"{row['triton_tflops']:6.1f} TF/s | x{row['ratio']:.3f} | diff {diff:.2e} nan {nan}",
            flush=True,
        )
    if a.out:
        with open(a.out, "w") as f:
            json.dump(
                {"gpu": C.gpu_name(), "regs": impl.WS_CONSUMER_REGS, "stages": impl.WS_STAGES, "rows": rows},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
