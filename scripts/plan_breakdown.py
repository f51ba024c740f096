"""Per-function host time inside the public decode plan() on the GPU machine (wrapping timers), then a
cProfile of the engine's CUDA-graph re-plan and, when importable, FlashInfer's plan() on the same tables.

PYTHONPATH=src python3 scripts/plan_breakdown.py            # with .peers on PYTHONPATH for FlashInfer
"""

from __future__ import annotations

import collections
import functools
import time

import torch

import flashinfer_triton as fit
from flashinfer_triton import _checks, _decode_impl, _wrapper
from flashinfer_triton import decode as dmod

ACC: dict = collections.defaultdict(float)
CNT: dict = collections.defaultdict(int)


def timed(owner, name, label=None):
    fn = getattr(owner, name)
    _ORIG.setdefault((owner, name), fn)
    label = label or f"{getattr(owner, '__name__', owner)}.{name}"

    @functools.wraps(fn)
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            ACC[label] += time.perf_counter() - t0
            CNT[label] += 1

    setattr(owner, name, wrapper)


def main():
    dev = torch.device("cuda")
    B, L, ps, hq, hkv, d = 256, 1024, 16, 32, 8, 128
    pages = L // ps
    indptr = torch.arange(B + 1, dtype=torch.int32) * pages
    indices = torch.randperm(B * pages).to(torch.int32)
    last = torch.full((B,), ps, dtype=torch.int32)
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    for owner, name in (
        (_wrapper, "read_page_table"),
        (_wrapper._AttentionWrapper, "_plan_common"),
        (_wrapper._AttentionWrapper, "_device_batch_arrays"),
        (_wrapper._AttentionWrapper, "_stage"),
        (_wrapper, "select_impl"),
        (_decode_impl, "plan"),
        (_decode_impl, "_config"),
        (_decode_impl, "_chunk_size"),
        (_decode_impl, "_num_sms"),
        (_wrapper, "_host_array"),
        (_wrapper, "AttentionOptions"),
        (_wrapper, "AttentionBatch"),
        (_checks, "parse_dtype"),
        (_wrapper, "alibi_slopes"),
    ):
        if hasattr(owner, name):
            timed(owner, name)
    cases = [
        ("b256 cpu", None, (indptr, indices, last), (hq, hkv, d, ps)),
        ("b256 cuda", None, (indptr.to(dev), indices.to(dev), last.to(dev)), (hq, hkv, d, ps)),
    ]
    # The engine's CUDA-graph decode step (SmolLM2: 9/3 heads, D64, page 16, ~80 tokens): indptr and
    # last_page_len on the CPU, page indices already in the graph's device buffer.
    for bs in (1, 8, 32):
        ip = torch.arange(bs + 1, dtype=torch.int32) * 5
        lp = torch.full((bs,), 9, dtype=torch.int32)
        buf_ip = torch.zeros(bs + 1, dtype=torch.int32, device=dev)
        buf_ix = torch.arange(4096, dtype=torch.int32, device=dev)
        buf_lp = torch.zeros(bs, dtype=torch.int32, device=dev)
        cases.append((f"engine graph bs{bs}", (buf_ip, buf_ix, buf_lp), (ip, buf_ix[: 5 * bs], lp), (9, 3, 64, 16)))
    for where, graph, args, shape in cases:
        if graph is None:
            w = fit.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        else:
            w = fit.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(ws, *graph, "NHD")
        hq, hkv, d, ps = shape
        for _ in range(10):
            w.plan(*args, hq, hkv, d, ps)
        torch.cuda.synchronize()
        ACC.clear()
        CNT.clear()
        n = 100
        t0 = time.perf_counter()
        for _ in range(n):
            w.plan(*args, hq, hkv, d, ps)
            torch.cuda.synchronize()
        total = (time.perf_counter() - t0) / n * 1e6
        print(f"== plan with {where} index tensors: {total:.1f} us per call (timers included)")
        for k in sorted(ACC, key=lambda k: -ACC[k]):
            print(f"   {k:55s} {ACC[k] / n * 1e6:8.1f} us  ({CNT[k] // n} calls)")
    _ = dmod
    for owner_name, fn in list(_ORIG.items()):
        owner, name = owner_name
        setattr(owner, name, fn)
    profile_and_compare(cases, ws)


def profile_and_compare(cases, ws):
    """cProfile of plan() (timers removed) and FlashInfer's plan() on the same arguments."""
    import cProfile
    import pstats

    try:
        import flashinfer
    except Exception as exc:  # noqa: BLE001
        flashinfer = None
        print(f"(FlashInfer not importable: {type(exc).__name__}: {exc})")
    for where, graph, args, shape in cases:
        hq, hkv, d, ps = shape
        libs = [("ours", fit)] + ([("flashinfer", flashinfer)] if flashinfer is not None else [])
        for lib_name, lib in libs:
            if graph is None:
                w = lib.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
            else:
                w = lib.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(ws, *graph, "NHD")
            for _ in range(10):
                w.plan(*args, hq, hkv, d, ps)
            torch.cuda.synchronize()
            n = 200
            t0 = time.perf_counter()
            for _ in range(n):
                w.plan(*args, hq, hkv, d, ps)
            host = (time.perf_counter() - t0) / n * 1e6
            torch.cuda.synchronize()
            print(f"== {lib_name} plan {where}: {host:.1f} us per call (no sync between calls)", flush=True)
            if (
                lib_name == "ours"
                and where.startswith("engine graph bs8")
                or where == "b256 cpu"
                and lib_name == "ours"
            ):
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(n):
                    w.plan(*args, hq, hkv, d, ps)
                pr.disable()
                torch.cuda.synchronize()
                pstats.Stats(pr).sort_stats("tottime").print_stats(28)


_ORIG: dict = {}


if __name__ == "__main__":
    main()
