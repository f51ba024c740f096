"""merge_states N512-K8 (inputs L2-resident) under Nsight Compute: ours (default, no cache hints, store hints
only) against FlashInfer, three back-to-back calls each (GPU machine, ncu on the PATH).

    ncu --cache-control none --metrics ... -k regex:'(?i)merge' python3 scripts/merge_ncu_probe.py

With ``--cache-control none`` every call sees the L2 left by the calls before it, as the benchmark's
CUDA-graph loop does. Prints nothing itself but which variant ran in which order.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import flashinfer_triton  # noqa: E402
from flashinfer_triton import _merge_impl  # noqa: E402

try:
    import flashinfer
except Exception:  # noqa: BLE001
    flashinfer = None


def main():
    n, k, h, d = 512, 8, 32, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    v = torch.randn(n, k, h, d, device="cuda", dtype=torch.float16, generator=g)
    s = torch.randn(n, k, h, device="cuda", dtype=torch.float32, generator=g)
    runs = [("default", True), ("nohint", False), ("store", "store")]
    for _, hint in runs:  # compile outside the profiled order's first calls
        _merge_impl.FIXED_STREAM_HINTS = hint
        flashinfer_triton.merge_states(v, s)
    if flashinfer is not None:
        flashinfer.merge_states(v, s)
    torch.cuda.synchronize()
    for name, hint in runs:
        _merge_impl.FIXED_STREAM_HINTS = hint
        for _ in range(3):
            flashinfer_triton.merge_states(v, s)
        torch.cuda.synchronize()
        print("ran", name, flush=True)
    if flashinfer is not None:
        for _ in range(3):
            flashinfer.merge_states(v, s)
        torch.cuda.synchronize()
        print("ran flashinfer", flush=True)


if __name__ == "__main__":
    main()
