"""One CSR decode launch and one vLLM v1 launch on the same data, for Nsight Compute (issue 6's gap).

    ncu --clock-control none --profile-from-start off -k regex:_decode_kernel --section LaunchStats \
        --section Occupancy --section SpeedOfLight python3 scripts/vllm_ncu_probe.py [--case 64x4096]

Both paths are warmed up (compiled) first; only the launches between cudaProfilerStart/Stop are profiled:
CSR ``run()`` then ``paged_attention_v1`` (and v1 capped at 128 registers with ``--r128``).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))

import bench_vllm_paged as B  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="64x4096 32/8")
    ap.add_argument("--r128", action="store_true")
    ap.add_argument("--k2d", action="store_true", help="also v1 with the keys loaded as [BLOCK_N, D] tiles")
    args = ap.parse_args(argv)
    from flashinfer_triton import _decode_impl

    case = next(c for c in B.CASES if c[0].startswith(args.case))
    dev = torch.device("cuda")
    data = B.build(case, dev)
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    csr, _ = B.csr_fns(case, data, ws)
    v1, _ = B.vllm_fns(case, data, "v1")
    variants = [("v1", None, True)] + ([("v1-r128", 128, True)] if args.r128 else [])
    variants += [("v1-k2d", None, False)] if args.k2d else []
    for _name, reg, k3d in variants:
        _decode_impl.VLLM_MAXNREG, _decode_impl.VLLM_K3D = reg, k3d
        v1[0]()
    csr[0]()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    csr[0]()
    for name, reg, k3d in variants:
        _decode_impl.VLLM_MAXNREG, _decode_impl.VLLM_K3D = reg, k3d
        v1[0]()
        print("profiled", name)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("profiled", case[0])


if __name__ == "__main__":
    main()
