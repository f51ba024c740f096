"""Where the paged prefill row loses against the ragged rows (GPU machine).

    PYTHONPATH=src python3 scripts/prefill_paged_probe.py [--out DIR]

The benchmark's paged case (16 requests x 1024 new tokens over 2048 keys, 32/8 heads, D128, fp16, causal,
page size 16) timed through the plan/run seam in several forms on the same shapes:
``paged-random`` (the benchmark: pages in random order), ``paged-seq`` (pages in order), ``paged-p64``
(page size 64), ``ragged-ptr`` (the same keys contiguous, pointer loads) and ``ragged-tma`` (contiguous,
tensor descriptors). If ``ragged-ptr`` is close to ``paged-random`` the loss is the shape (short programs,
causal tails), not the page gather; if it is much faster, the gather. Each output is compared with the
first form's (same keys, same result up to summation order). One line per (form, config); JSON to DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import _common as C  # noqa: E402
import bench_prefill as B  # noqa: E402

CONFIGS = ["128x64 w8 s3", "128x128 w8 s3", "64x64 w4 s3", "128x64 w8 s2"]


def _inputs(form, batch=16, qo=1024, kv=2048, hq=32, hkv=8, d=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = torch.float16
    q = torch.randn(batch * qo, hq, d, device="cuda", dtype=dt, generator=g)
    k = torch.randn(batch * kv, hkv, d, device="cuda", dtype=dt, generator=g)
    v = torch.randn(batch * kv, hkv, d, device="cuda", dtype=dt, generator=g)
    ps = 64 if form == "paged-p64" else 16
    if form.startswith("ragged"):
        case = ("probe", "single", batch, qo, kv, hq, hkv, d, True, dt, 1, None)
        return case, {"q": q, "k": k, "v": v, "mask": None}
    pages_per = kv // ps
    num_pages = batch * pages_per
    if form == "paged-random":
        perm = torch.randperm(num_pages, device="cuda", generator=g)
    else:
        perm = torch.arange(num_pages, device="cuda")
    cache = torch.empty(num_pages, 2, ps, hkv, d, device="cuda", dtype=dt)
    # Page perm[i] holds keys i * ps .. (i + 1) * ps - 1 of the concatenated requests: the same keys as ragged.
    cache[perm, 0] = k.view(num_pages, ps, hkv, d)
    cache[perm, 1] = v.view(num_pages, ps, hkv, d)
    inp = {
        "q": q,
        "mask": None,
        "cache": cache,
        "kv_indices": perm.to(torch.int32),
        "kv_indptr": torch.arange(batch + 1, device="cuda", dtype=torch.int32) * pages_per,
        "last_page_len": torch.full((batch,), ps, device="cuda", dtype=torch.int32),
        "qo_indptr": torch.arange(batch + 1, device="cuda", dtype=torch.int32) * qo,
    }
    case = ("probe", "paged", batch, qo, kv, hq, hkv, d, True, dt, ps, None)
    return case, inp


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--forms", default="paged-random,paged-seq,paged-p64,ragged-ptr,ragged-tma")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    a = ap.parse_args(argv)
    rows, ref = [], None
    for form in a.forms.split(","):
        case, inp = _inputs(form)
        gflop = B.flops(case) / 1e9
        for spec in a.configs.split(","):
            spec = spec.strip()
            if form == "ragged-tma":
                spec += " tma"
            elif form == "ragged-ptr":
                spec += " notma"
            try:
                fn, out, _ = B.ours_fn(case, inp, config=B.parse_config(spec))
                fn()
                torch.cuda.synchronize()
                ms = C.bench(fn)
            except Exception as e:  # a config that does not fit (shared memory) is reported, not fatal
                print(f"{form:13s} {spec:22s} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            if ref is None:
                ref = out.float().clone()
            diff = (out.float() - ref).abs().max().item()
            tf = gflop / ms
            rows.append({"form": form, "config": spec, "ms": ms, "tflops": tf, "max_abs_diff": diff})
            print(f"{form:13s} {spec:22s} {ms:8.4f} ms {tf:6.1f} TFLOP/s diff {diff:.2e}", flush=True)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "prefill-paged-probe.json"), "w") as f:
            json.dump({"gpu": C.gpu_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
