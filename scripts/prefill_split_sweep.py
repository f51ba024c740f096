"""KV-split targets of the prefill plan on few-query, long-KV cases (GPU machine).

PYTHONPATH=src python3 scripts/prefill_split_sweep.py [--cases 64q --configs '128x64 w8 s3' --targets 0,4,8 --graph]
# prints one line per (case, config, target); JSON to $OUT
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import _common as C  # noqa: E402
import bench_prefill as B  # noqa: E402

from flashinfer_triton import _prefill_impl as impl  # noqa: E402

CASES = [
    ("shared prefix 64q x 16384 32/8", "single", 1, 64, 16384, 32, 8, 128, False, torch.float16, 1, None),
    ("128q x 16384 32/8", "single", 1, 128, 16384, 32, 8, 128, False, torch.float16, 1, None),
    ("16q x 32768 32/8", "single", 1, 16, 32768, 32, 8, 128, False, torch.float16, 1, None),
    ("256q x 8192 32/32 causal", "single", 1, 256, 8192, 32, 32, 128, True, torch.float16, 1, None),
]


def _graph_ms(fn) -> float:
    """GPU time per call: the call (attention + partial merge) captured once, replayed."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return C.bench(g.replay)


def _kernel_us(fn, iters=30) -> dict:
    """GPU microseconds per call of each kernel the call launches (torch.profiler / CUPTI), by kernel name."""
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
            out[ev.key[:60]] = round(t / iters, 2)
    return out


def main():
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default=None, help="substring of the case names")
    ap.add_argument("--configs", default=None, help="comma-separated bench configs, e.g. '64x64 w4 s3,128x64 w8 s3'")
    ap.add_argument("--targets", default="0,4,6,8,9,12,16,24")
    ap.add_argument("--graph", action="store_true", help="time CUDA-graph replays (GPU time) instead of eager calls")
    ap.add_argument("--fused", default=None, help="comma-separated FUSED_MERGE settings to compare, e.g. 1,0")
    ap.add_argument("--pdl", default=None, help="comma-separated MERGE_PDL settings to compare, e.g. 1,0")
    ap.add_argument("--pdt", default=None, help="comma-separated PARTIAL_IN_OUT_DTYPE settings, e.g. 1,0")
    ap.add_argument("--profile", action="store_true", help="also each kernel's GPU time per call (torch.profiler)")
    a = ap.parse_args()
    configs = [None] + [B.parse_config(c.strip()) for c in a.configs.split(",")] if a.configs else [None]
    rows = []
    for case in CASES:
        if a.cases and a.cases not in case[0]:
            continue
        inp = B.make_inputs(case)
        ref = None
        fused_opts = [bool(int(x)) for x in a.fused.split(",")] if a.fused else [impl.FUSED_MERGE]
        pdl_opts = [bool(int(x)) for x in a.pdl.split(",")] if a.pdl else [impl.MERGE_PDL]
        pdt_opts = [bool(int(x)) for x in a.pdt.split(",")] if a.pdt else [impl.PARTIAL_IN_OUT_DTYPE]
        grid = [
            (c, int(t), f, d, h)
            for c in configs
            for t in a.targets.split(",")
            for f in fused_opts
            for d in pdl_opts
            for h in pdt_opts
        ]
        for cfg, target, fused, pdl, pdt in grid:
            impl.PARTIAL_IN_OUT_DTYPE = pdt
            impl.SPLIT_SLOTS_OVERRIDE = target
            impl.FUSED_MERGE = fused
            impl.MERGE_PDL = pdl
            fn, out, p = B.ours_fn(case, inp, config=cfg)
            fn()
            torch.cuda.synchronize()
            ms = _graph_ms(fn) if a.graph else C.bench(fn)
            if ref is None:
                ref = out.clone()
            diff = float((out.float() - ref.float()).abs().max())
            fl = B.flops(case)
            row = dict(
                case=case[0],
                config=str(p.config),
                target=target or "rule",
                fused=fused,
                pdl=pdl,
                partial_out_dtype=pdt,
                pieces=p.num_work_host,
                ms=ms,
                tflops=fl / (ms * 1e-3) / 1e12,
                max_diff_vs_rule=diff,
            )
            if a.profile:
                row["kernel_us"] = _kernel_us(fn)
            rows.append(row)
            print(row, flush=True)
    impl.SPLIT_SLOTS_OVERRIDE = 0
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "prefill-split-sweep.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
