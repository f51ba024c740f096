"""Where the host time of the public API goes, on the GPU machine: plan() and small run() calls.

    PYTHONPATH=src python3 scripts/host_profile.py [--out DIR]

Prints median host microseconds per call, the cProfile top entries of plan(), and the CUDA runtime calls
(torch.profiler) one plan() makes, so copies and synchronizations can be counted. Also reports which
optional packages (transformers, gguf, accelerate) the machine has.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import json
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import _common as C  # noqa: E402


def env_report() -> dict:
    out = {"torch": torch.__version__}
    for mod in ("triton", "transformers", "gguf", "accelerate", "numpy", "yaml", "tokenizers"):
        try:
            out[mod] = getattr(importlib.import_module(mod), "__version__", "present")
        except Exception as exc:  # report, never fail
            out[mod] = f"missing ({type(exc).__name__})"
    return out


def profile_calls(fn, n=30, top=22) -> str:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def cuda_api_calls(fn) -> dict:
    """Counts of CUDA runtime/driver calls one fn() makes (torch.profiler CPU-side events)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    counts: dict = {}
    for ev in prof.events():
        name = ev.name
        if name.startswith("cuda") or name.startswith("aten::") or "Memcpy" in name:
            c = counts.setdefault(name, [0, 0.0])
            c[0] += 1
            c[1] += ev.cpu_time_total
    return {k: (v[0], round(v[1], 1)) for k, v in sorted(counts.items(), key=lambda kv: -kv[1][1])[:25]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import flashinfer_triton as fit

    res = {"env": env_report()}
    print("[env]", res["env"], flush=True)
    dev = torch.device("cuda")
    B, L, ps, hq, hkv, d = 256, 1024, 16, 32, 8, 128
    pages = L // ps
    indptr = torch.arange(B + 1, dtype=torch.int32) * pages
    indices = torch.randperm(B * pages).to(torch.int32)
    last = torch.full((B,), ps, dtype=torch.int32)
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    for where, (ip, ix, lp) in (
        ("cpu", (indptr, indices, last)),
        ("cuda", (indptr.to(dev), indices.to(dev), last.to(dev))),
        ("indptr-cpu-indices-cuda", (indptr, indices.to(dev), last)),
    ):
        w = fit.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")

        def plan(w=w, ip=ip, ix=ix, lp=lp):
            w.plan(ip, ix, lp, hq, hkv, d, ps, q_data_type=torch.float16)

        us = C.host_time_us(plan, sync=torch.cuda.synchronize)
        res[f"decode_plan_us_{where}"] = us
        print(f"[plan {where}] {us:.1f} us", flush=True)
        print(profile_calls(plan), flush=True)
        calls = cuda_api_calls(plan)
        res[f"decode_plan_cuda_calls_{where}"] = calls
        print("[calls]", json.dumps(calls), flush=True)

    # Small eager run() calls: host time with a sync after each (what a Python engine pays per layer).
    small = {}
    kc = torch.randn(64, ps, hkv, d, dtype=torch.float16, device=dev)
    vc = torch.randn_like(kc)
    w = fit.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    ip = torch.tensor([0, 4], dtype=torch.int32)
    w.plan(ip, torch.arange(4, dtype=torch.int32, device=dev), torch.tensor([16], dtype=torch.int32), hq, hkv, d, ps)
    q = torch.randn(1, hq, d, dtype=torch.float16, device=dev)
    small["decode_run_b1_64tok"] = C.host_time_us(lambda: w.run(q, (kc, vc)), sync=torch.cuda.synchronize)
    t0 = time.perf_counter()
    for _ in range(200):
        w.run(q, (kc, vc))
    torch.cuda.synchronize()
    small["decode_run_b1_64tok_back_to_back"] = (time.perf_counter() - t0) / 200 * 1e6
    print(profile_calls(lambda: w.run(q, (kc, vc))), flush=True)
    v = torch.randn(64, hq, d, dtype=torch.float16, device=dev)
    s = torch.randn(64, hq, dtype=torch.float32, device=dev)
    v2, s2 = v.clone(), s.clone()
    small["merge_state_in_place_n64"] = C.host_time_us(
        lambda: fit.merge_state_in_place(v, s, v2, s2), sync=torch.cuda.synchronize
    )
    print(profile_calls(lambda: fit.merge_state_in_place(v, s, v2, s2)), flush=True)
    res["small_calls_us"] = small
    print("[small]", small, flush=True)
    if args.out:
        path = os.path.join(args.out, "host-profile.json")
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
        print("[host_profile] wrote", path)


if __name__ == "__main__":
    main()
