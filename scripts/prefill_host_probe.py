"""Host microseconds per prefill ``run()`` (the backend seam) on the GPU machine, by variant, with a cProfile
of the default. The GPU is kept busy by a long sleep kernel queued first, so only host time is measured.

    PYTHONPATH=src python3 scripts/prefill_host_probe.py [--out DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))
sys.path.insert(0, HERE)

import bench_prefill as B  # noqa: E402
from launch_overhead import gpu_us, per_call_us  # noqa: E402

from flashinfer_triton import _prefill_impl as impl  # noqa: E402

CASES = {
    "64q x 16384 32/8": ("64q x 16384 32/8", "single", 1, 64, 16384, 32, 8, 128, False, torch.float16, 1, None),
    "128q x 1024 32/8 causal": ("128q x 1024", "single", 1, 128, 1024, 32, 8, 128, True, torch.float16, 1, None),
    "paged 4 x 128 over 1024": ("paged", "paged", 4, 128, 1024, 32, 8, 128, True, torch.float16, 16, None),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT"))
    a = ap.parse_args()
    rows = []
    for label, case in CASES.items():
        inp = B.make_inputs(case)
        variants = {"default": dict(config=None), "no TMA": dict(config="64x64 w4 s3 notma")}
        for vname, kw in variants.items():
            cfg = B.parse_config(kw["config"]) if kw["config"] else None
            for split in (True, False):
                impl.SPLIT_SLOTS_OVERRIDE = 0 if split else 1
                fn, out, p = B.ours_fn(case, inp, config=cfg)
                fn()
                torch.cuda.synchronize()
                row = dict(case=label, variant=vname, split=p.num_merge_host > 0, launches=1 + (p.merge is not None),
                           host_us=round(per_call_us(fn), 1), gpu_us=round(gpu_us(fn), 1))  # fmt: skip
                rows.append(row)
                print(row, flush=True)
                if vname == "default" and split:
                    pr = cProfile.Profile()
                    pr.enable()
                    for _ in range(200):
                        fn()
                    pr.disable()
                    torch.cuda.synchronize()
                    s = io.StringIO()
                    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
                    print(s.getvalue(), flush=True)
        impl.SPLIT_SLOTS_OVERRIDE = 0
    if a.out:
        with open(os.path.join(a.out, "prefill-host-probe.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
