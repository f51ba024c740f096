"""A short tour: batch decode, batch prefill and cascade attention on the available device, each checked
against the reference, with timings.

    python examples/tour.py            # CUDA when present, else CPU
    python examples/tour.py --device cpu
"""

from __future__ import annotations

import argparse
import time

import torch

import flashinfer_triton as fi
from flashinfer_triton import reference as R


def _time(fn, device, reps=5):
    fn()  # warm-up (compiles the kernel variant on first use)
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e3


def _paged_cache(kv_lens, page_size, hkv, d, device, dtype):
    pages = [-(-n // page_size) for n in kv_lens]
    total = sum(pages)
    cache = torch.randn(total, 2, page_size, hkv, d, device=device, dtype=dtype)
    indptr = torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), dtype=torch.int32)
    indices = torch.randperm(total, dtype=torch.int32)
    last = torch.tensor([n - (p - 1) * page_size for n, p in zip(kv_lens, pages)], dtype=torch.int32)
    return cache, indptr, indices, last


def _report(name, out, expected, ms):
    err = (out.float().cpu() - expected.float().cpu()).abs().max().item()
    status = "ok" if err < 2e-2 else "MISMATCH"
    print(f"  {name:<44} max |ours - reference| = {err:.2e}  [{status}]   {ms:8.3f} ms")
    return status == "ok"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.float16
    big = device.type == "cuda"
    hq, hkv, d, ps = 32, 8, 128, 16
    from flashinfer_triton._backend import use_triton

    path = "Triton kernels" if use_triton(device) else "PyTorch path"
    name = torch.cuda.get_device_name(device) if big else "CPU"
    print(f"flashinfer_triton tour on {name}: {path}")
    ok = True
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=device)

    # Batch decode: one new token per request over a paged cache.
    kv_lens = [1024, 77, 3000, 1] * (16 if big else 1)
    cache, indptr, indices, last = _paged_cache(kv_lens, ps, hkv, d, device, dtype)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    w.plan(indptr, indices, last, hq, hkv, d, ps)
    q = torch.randn(len(kv_lens), hq, d, device=device, dtype=dtype)
    out = w.run(q, cache)
    ms = _time(lambda: w.run(q, cache), device)
    n_check = 4
    eo, _ = R.batch_decode_with_paged_kv_cache(q[:n_check], cache, indptr[: n_check + 1], indices, last[:n_check])
    ok &= _report(f"batch decode ({len(kv_lens)} requests)", out[:n_check], eo, ms)

    # Batch prefill / append: new tokens attend causally to themselves and their cached prefix.
    qo_lens = [128, 1, 64, 33] if not big else [512, 1, 256, 1024] * 4
    kv_lens = [n + 100 for n in qo_lens]
    cache, indptr, indices, last = _paged_cache(kv_lens, ps, hkv, d, device, dtype)
    qo_indptr = torch.tensor([0] + torch.tensor(qo_lens).cumsum(0).tolist(), dtype=torch.int32)
    p = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    p.plan(qo_indptr, indptr, indices, last, hq, hkv, d, ps, causal=True)
    q = torch.randn(int(qo_indptr[-1]), hq, d, device=device, dtype=dtype)
    out = p.run(q, cache)
    ms = _time(lambda: p.run(q, cache), device)
    rows = int(qo_indptr[4])
    eo, _ = R.batch_prefill_with_paged_kv_cache(
        q[:rows], qo_indptr[:5], cache, indptr[:5], indices, last[:4], causal=True
    )
    ok &= _report(f"batch prefill, causal append ({len(qo_lens)} requests)", out[:rows], eo, ms)

    # Cascade: a shared prompt prefix read once for every request, merged with each request's own tokens.
    bs, shared, own = (64, 4096, 256) if big else (4, 256, 16)
    cache, indptr, indices, last = _paged_cache([shared] + [own] * bs, ps, hkv, d, device, dtype)
    n_shared = int(indptr[1])
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)
    c = fi.MultiLevelCascadeAttentionWrapper(2, ws, "NHD")
    c.plan(
        [i32(0, bs), torch.arange(bs + 1, dtype=torch.int32)],
        [indptr[:2], indptr[1:] - n_shared],
        [indices[:n_shared], indices[n_shared:]],
        [last[:1], last[1:]],
        hq,
        hkv,
        d,
        ps,
    )
    q = torch.randn(bs, hq, d, device=device, dtype=dtype)
    out = c.run(q, cache)
    ms = _time(lambda: c.run(q, cache), device)
    # expected: each request attends to the shared prefix followed by its own tokens
    shared_k, shared_v = R.paged_kv_to_dense(cache, "NHD", indptr, indices, last, 0)
    expected = []
    for b in range(2):
        own_k, own_v = R.paged_kv_to_dense(cache, "NHD", indptr, indices, last, b + 1)
        k_all, v_all = torch.cat([shared_k, own_k]), torch.cat([shared_v, own_v])
        expected.append(R.attention(q[b : b + 1], k_all, v_all)[0])
    eo = torch.cat(expected)
    ok &= _report(f"cascade, {shared} shared + {own} own tokens x {bs}", out[:2], eo, ms)
    print("all checks passed" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
