"""Host cost of one Triton launch on the GPU machine, by layer: the JIT path, a direct CompiledKernel.run,
and our public decode run() against its implementation and its kernel launch alone.

    PYTHONPATH=src python3 scripts/launch_overhead.py
"""

from __future__ import annotations

import time

import torch
import triton
import triton.language as tl
from triton import knobs


@triton.jit
def _many_args(
    x,
    y,
    a0,
    a1,
    a2,
    a3,
    a4,
    a5,
    a6,
    a7,
    a8,
    a9,
    b0,
    b1,
    b2,
    b3,
    b4,
    b5,
    b6,
    b7,
    b8,
    b9,
    f0,
    f1,
    f2,
    N: tl.constexpr,
    M: tl.constexpr,
    K: tl.constexpr,
):
    i = tl.program_id(0)
    tl.store(y + i, tl.load(x + i) + a0 + b9 + f0 + N + M + K)


def per_call_us(fn, n=300):
    """Host microseconds per call, measured while the GPU is still busy with a long sleep kernel, so
    neither a full launch queue nor GPU time enters the figure."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~100 ms of GPU time ahead of the calls
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def gpu_us(fn, n=300):
    """GPU microseconds per call: the calls queue behind a sleep kernel, then run back to back."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(200_000_000)
    e0.record()
    for _ in range(n):
        fn()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / n * 1e3


def main():
    dev = torch.device("cuda")
    x = torch.randn(128, device=dev)
    y = torch.empty_like(x)
    ints = list(range(3, 23))
    args = [x, y, *ints, 1.0, 2.0, 3.0]
    res = {}
    res["jit_launch_25args"] = per_call_us(lambda: _many_args[(1,)](*args, N=1, M=2, K=3))
    compiled = _many_args[(1,)](*args, N=1, M=2, K=3)
    full = [*args, 1, 2, 3]
    get_stream = triton.runtime.driver.active.get_current_stream
    get_dev = triton.runtime.driver.active.get_current_device

    def direct():
        compiled.run(
            1,
            1,
            1,
            get_stream(get_dev()),
            compiled.function,
            compiled.packed_metadata,
            None,
            knobs.runtime.launch_enter_hook,
            knobs.runtime.launch_exit_hook,
            *full,
        )

    res["direct_run_25args"] = per_call_us(direct)
    _, _, _, _, binder = _many_args.device_caches[get_dev()]
    res["binder_only_25args"] = per_call_us(lambda: binder(*args, N=1, M=2, K=3))
    res["torch_empty_like"] = per_call_us(lambda: torch.empty_like(x))
    res["torch_add_small"] = per_call_us(lambda: x.add(1.0))

    import flashinfer_triton as fit
    from flashinfer_triton import _decode_impl

    ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    kc = torch.randn(64, 16, 8, 128, dtype=torch.float16, device=dev)
    vc = torch.randn_like(kc)
    w = fit.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    w.plan(
        torch.tensor([0, 4], dtype=torch.int32),
        torch.arange(4, dtype=torch.int32, device=dev),
        torch.tensor([16], dtype=torch.int32),
        32,
        8,
        128,
        16,
    )
    q = torch.randn(1, 32, 128, dtype=torch.float16, device=dev)
    out = torch.empty_like(q)
    res["decode_public_run"] = per_call_us(lambda: w.run(q, (kc, vc)), n=500)
    res["decode_public_run_out"] = per_call_us(lambda: w.run(q, (kc, vc), out=out), n=500)
    p = w._w._planned
    v64 = torch.randn(64, 32, 128, dtype=torch.float16, device=dev)
    s64 = torch.randn(64, 32, device=dev)
    v64b, s64b = v64.clone(), s64.clone()
    k4, v4 = kc, vc
    res["decode_impl_run"] = per_call_us(
        lambda: _decode_impl.run(p["plan"], p["opts"], p["batch"], q, k4, v4, out, None), n=500
    )

    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(300):
        _decode_impl.run(p["plan"], p["opts"], p["batch"], q, k4, v4, out, None)
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(14)

    for name, fn in (
        ("decode_public_run", lambda: w.run(q, (kc, vc))),
        ("decode_impl_run", lambda: _decode_impl.run(p["plan"], p["opts"], p["batch"], q, k4, v4, out, None)),
        ("merge_state_in_place_n64", lambda: fit.merge_state_in_place(v64, s64, v64b, s64b)),
        ("jit_launch_25args", lambda: _many_args[(1,)](*args, N=1, M=2, K=3)),
    ):
        res[name + "_gpu"] = gpu_us(fn)
    for k, v in res.items():
        print(f"{k:32s} {v:8.1f} us")


if __name__ == "__main__":
    main()
