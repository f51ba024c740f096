"""Prefill / append attention: ours beside FlashInfer (fa2, fa3), PyTorch SDPA (flash, cuDNN) and
FlexAttention (compiled), in the same process, in TFLOP/s.

FLOPs = 4 * visible (query, key) pairs * head_dim * num_qo_heads (causal counts only the visible pairs,
bottom-right aligned; a custom mask counts its set bits). ``ours_ms`` times ``_prefill_impl.run`` after
one ``plan()`` (what a wrapper does per layer); ``ours_public_ms`` times the public entry point end to end
(single: plan + run every call; batch: the wrapper's run). ``ratio = flashinfer_ms (fa2) / ours_ms``.

Every peer is optional: a missing or failing peer leaves its column null and says why in the row's
``null_reasons``. FlashInfer's fa3 JIT costs ~90 s per module (one per kind, head dim, dtype and score
variant), so it runs only with ``--fa3``, on ``--fa3-cases`` (default: every case FlashInfer has an fa3 kernel
for: head dim 64/128/256, no custom mask, K/V in the query dtype) and within ``--fa3-budget`` seconds; build the
modules first, all at once, with ``--fi-build-only`` (``--wait-build`` waits for it). FlexAttention compiles per
shape within ``--flex-budget``. ``ratio`` compares with fa2 and ``ratio_fa3`` with fa3.

    PYTHONPATH=src python benchmarks/bench_prefill.py [--sweep] [--out DIR] [--no-flashinfer] [--fa3] [--no-flex]
        [--only SUBSTR,...]
    PYTHONPATH=src python benchmarks/bench_prefill.py --gluon-sweep [--only SUBSTR,...] [--gluon-sweep-json PATH]
        [--sweep-compile I/N] [--no-flashinfer]   # Gluon kernel variants (GLUON_SWEEP) beside fa3
    PYTHONPATH=src python benchmarks/bench_prefill.py --fi-build-only DONE_FILE [--fa3]   # warm FlashInfer's JIT
    PYTHONPATH=src python benchmarks/bench_prefill.py --resources [--group 1] [--d 128] [--causal] [--ps 16] ...
        # no GPU needed: the Gluon prefill kernel compiled for sm_90a, its registers, shared memory, spills
        # and SASS counts (_gluon_resources.py)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import threading
import time
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

from flashinfer_triton.testing import (  # noqa: E402
    PREFILL_CASES,
    PrefillCase,
    prefill_inputs,
    prefill_mask,
    request_lens,
)

# The timed rows, shared with the GPU test that checks each against the reference at the same shape.
Case = PrefillCase
CASES = PREFILL_CASES


def fa3_offered(case: Case) -> bool:
    """Whether FlashInfer 0.7.2 has an fa3 (Hopper) kernel for the case: head dim 64, 128 or 256, no custom mask,
    and K/V of the query dtype (its fa3 takes fp8 K/V only with fp8 queries)."""
    return case.d in (64, 128, 256) and case.mask is None and case.kv_type == case.dtype


FA3_DEFAULT = [c.name for c in CASES if fa3_offered(c)]
NO_FA3 = "FlashInfer has no fa3 kernel for this case (head dim, custom mask or fp8 K/V)"

# Configurations tried with --sweep: "BMxBN wW sS" plus flags tma / notma, fold / nofold.
SWEEP = {
    "4096 32/32 D128 causal": [
        "64x64 w4 s3",
        "64x128 w4 s2",
        "64x128 w4 s3",
        "128x64 w8 s3",
        "128x128 w8 s3",
        "128x128 w8 s2",
        "64x64 w4 s4",
    ],
    "4096 32/32 D128 full": ["128x128 w8 s3", "128x128 w8 s2", "128x64 w8 s3", "128x64 w8 s4", "64x128 w4 s3"],
    "8192 32/8 D128 causal": ["64x64 w4 s3", "128x64 w8 s3", "128x128 w8 s3"],
    "16384 32/8 D128 causal": ["64x64 w4 s3", "128x64 w8 s3", "128x128 w8 s3"],
    "4096 32/32 D64 causal": ["128x64 w8 s3", "64x64 w4 s3", "128x128 w8 s3", "64x128 w4 s3"],
    "16x(1024 over 2048 paged) 32/8": [
        "64x64 w4 s3",
        "128x64 w8 s3",
        "128x64 w8 s4",
        "64x128 w4 s3",
        "128x128 w8 s2",
        "128x128 w8 s3",
        "128x64 w8 s2",
    ],
    "4096 16/16 D256 causal": ["64x32 w4 s3", "64x64 w4 s2", "64x32 w4 s4", "64x64 w8 s2"],
    # 32x32 w8 s2 (the default) runs mma.sync with no spill; the 64-row tiles take wgmma with 128-184 B of stack.
    "4096 16/16 D512 causal bf16": ["32x32 w8 s2", "64x16 w8 s2", "64x32 w8 s2", "32x64 w8 s2", "32x16 w8 s3"],
    "append 512 over 8192 32/8": ["64x64 w4 s3", "128x64 w8 s3", "128x128 w8 s3"],
    "shared prefix 64q x 16384 32/8": ["128x128 w8 s3", "128x64 w8 s3", "64x64 w4 s3"],
    "4096 32/8 D128 blockdiag-512 mask": [
        "64x64 w4 s3",
        "128x64 w8 s3",
        "128x128 w8 s3",
    ],
}

# The softmax exponent as one FMA (``fold``, now the default) against the old two-op form (``nofold``),
# on the default tile of each case and its nearest alternatives.
SWEEP_FOLD = {
    "4096 32/32 D128 causal": ["64x64 w4 s3 nofold", "128x128 w8 s3", "128x64 w8 s3", "64x128 w4 s2"],
    "4096 32/32 D128 full": ["128x128 w8 s3 nofold", "128x64 w8 s3", "64x128 w4 s2", "128x128 w8 s2"],
    "8192 32/8 D128 causal": ["128x128 w8 s3 nofold", "64x64 w4 s3", "128x64 w8 s3"],
    "16384 32/8 D128 causal": ["128x128 w8 s3 nofold", "64x64 w4 s3", "128x64 w8 s3"],
    "4096 32/32 D64 causal": ["64x64 w4 s3 nofold", "128x64 w8 s3", "64x128 w4 s3"],
    "16x(1024 over 2048 paged) 32/8": ["128x64 w8 s3 nofold", "128x128 w8 s3", "64x64 w4 s3", "128x64 w8 s4"],
    "4096 32/32 D128 causal bf16": ["64x64 w4 s3 nofold"],
    "4096 16/16 D256 causal": ["64x32 w4 s3 nofold", "64x64 w4 s2"],
    "append 512 over 8192 32/8": ["64x64 w4 s3 nofold", "128x64 w8 s3"],
}


# Gluon kernel variants tried with --gluon-sweep, timed in interleaved rounds beside FlashInfer's fa3 (the rows
# furthest from it). Words: "default" (the configuration as it is), "triton" (the Gluon kernel off), "gluon" (the
# configuration with the case's head dim and group added), then "sN" (ring depth at the case's head dim), "bnN"
# (key tile), "regsN" (consumer registers).
GLUON_SWEEP = {
    # (most wanted first: the timing run writes its JSON after every case)
    # D64: three consumer warpgroups (192-row tiles) from group 2; "s2" is FlashInfer's fa3 D64 ring (192 x 128,
    # 2 stages)
    "16384 32/8 D64 causal": ["default", "triton", "gluon s2"],
    # (group 1: the Triton kernel by default, the three-consumer Gluon kernel with "gluon")
    "4096 32/32 D64 causal": ["default", "gluon"],
    "16384 32/8 D128 causal window 4096": ["default", "triton"],
    "8192 32/8 D128 causal soft cap 30": ["default", "triton"],
    # rows with no new variant: ours against fa3 in the same rounds, to place the others
    "8192 32/8 D128 causal bf16": ["default"],
    "append 512 over 8192 32/8": ["default"],
}


def gluon_sweep_config(spec: str, case: Case):
    """The GluonPrefillConfig of one --gluon-sweep variant (see GLUON_SWEEP) for ``case``."""
    from flashinfer_triton import _config

    base = _config.GLUON_PREFILL
    words = spec.split()
    if words == ["default"]:
        return base
    if words == ["triton"]:
        return replace(base, enabled=False)
    if words[0] != "gluon":
        raise ValueError(f"gluon sweep variant {spec!r}: starts with 'default', 'triton' or 'gluon'")
    group = case.hq // case.hkv
    kw = dict(
        head_dims=tuple(sorted({*base.head_dims, case.d})),
        groups=tuple(sorted({*base.groups, group})),
        d64_min_group=min(base.d64_min_group, group),
    )
    for w in words[1:]:
        name, num = w.rstrip("0123456789"), w[len(w.rstrip("0123456789")) :]
        if name == "s" and num:
            kw["stages_d64" if case.d <= 64 else "stages_d128" if case.d <= 128 else "stages_d256"] = int(num)
        elif name == "bn" and num:
            key = "tile_d256" if case.d > 128 else "tile"
            kw[key] = replace(getattr(base, key), block_n=int(num))
        elif name == "regs" and num:
            kw["consumer_regs"] = int(num)
        else:
            raise ValueError(f"gluon sweep variant {spec!r}: unknown word {w!r}")
    return replace(base, **kw)


def gluon_sweep(cases, out_json: str | None, compile_shard: str | None, rounds: int = 2, fa3: bool = True,
                exclude: tuple = ()) -> None:  # fmt: skip
    """--gluon-sweep: every GLUON_SWEEP variant of ``cases``, each planned and run under ``_config.using`` (what
    run() reads from the configuration is read at the call), timed in ``rounds`` interleaved rounds with fa3 in
    each round; a row's time is its best round. ``compile_shard`` "I/N": only run every N-th variant once (fills
    Triton's cache from N processes side by side) and time nothing. ``exclude``: words whose variants are left out
    (a variant whose GPU tests failed or hung)."""
    from flashinfer_triton import _config

    def variants(name):
        return [v for v in GLUON_SWEEP[name] if not set(v.split()) & set(exclude)]

    todo = [(c, v) for c in cases if c.name in GLUON_SWEEP for v in variants(c.name)]
    if compile_shard:
        i, n = (int(x) for x in compile_shard.split("/"))
        inputs = {}
        for k, (case, spec) in enumerate(todo):
            if k % n != i:
                continue
            t0 = time.time()
            try:
                inp = inputs.setdefault(case.name, make_inputs(case))
                with _config.using(gluon_prefill=gluon_sweep_config(spec, case)):
                    fn, _, p = ours_fn(case, inp)
                    fn()
                    torch.cuda.synchronize()
                done = f"gluon={p.config.gluon}"
            except Exception as exc:  # reported; the timing run shows the variant's error too
                done = f"FAILED {type(exc).__name__}: {str(exc)[:300]}"
            print(f"[compile] {case.name} | {spec}: {done} {time.time() - t0:.1f}s", flush=True)
        return
    fi = C.import_flashinfer() if fa3 else None
    rows = []
    t_start = time.time()
    by_name = {c.name: c for c in cases}
    for name in GLUON_SWEEP:  # (its order)
        case = by_name.get(name)
        if case is None:
            continue
        inp = make_inputs(case)
        fl = flops(case)
        entries = []  # (row, config, fn)
        ref = None
        for spec in variants(case.name):
            row = {"case": case.name, "variant": spec, "kernel": None, "ms": None, "tflops": None, "rounds_ms": []}
            try:
                cfg = gluon_sweep_config(spec, case)
                with _config.using(gluon_prefill=cfg):
                    fn, out, p = ours_fn(case, inp)
                    out.fill_(float("nan"))
                    fn()
                    torch.cuda.synchronize()
                row["kernel"] = "gluon" if p.config.gluon else "triton"
                row["splits"] = p.num_merge_host > 0
                o = out.float()
                row["nan"] = bool(o.isnan().any())
                if ref is None:
                    ref = o.clone()
                row["max_abs_diff_vs_first"] = float((o - ref).abs().max())
                entries.append((row, cfg, fn, o))
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            rows.append(row)
        fa3_row = None
        if fi is not None and fa3_offered(case):
            fa3_row = {"case": case.name, "variant": "flashinfer fa3", "kernel": "fa3", "rounds_ms": []}
            try:
                ffn = flashinfer_fn(fi, case, inp, "fa3")
                fo = ffn().float()
                torch.cuda.synchronize()
                for row, _, _, o in entries:
                    row["max_abs_diff_vs_fa3"] = float((o - fo).abs().max())
                del fo
            except Exception as exc:
                fa3_row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                ffn = None
            rows.append(fa3_row)
        for _ in range(rounds):
            for row, cfg, fn, _ in entries:
                with _config.using(gluon_prefill=cfg):
                    ms = timed(fn)
                if ms is not None:
                    row["rounds_ms"].append(ms)
            if fa3_row is not None and ffn is not None:
                ms = timed(ffn)
                if ms is not None:
                    fa3_row["rounds_ms"].append(ms)
        for row in [r for r, *_ in entries] + ([fa3_row] if fa3_row else []):
            if row["rounds_ms"]:
                row["ms"] = min(row["rounds_ms"])
                row["tflops"] = fl / (row["ms"] * 1e-3) / 1e12
        fa3_ms = fa3_row.get("ms") if fa3_row else None
        for row, *_ in entries:
            if fa3_ms and row["ms"]:
                row["ratio_fa3"] = fa3_ms / row["ms"]
        del entries, ref
        for row in rows:
            if row["case"] == case.name:
                print(f"[gsweep] {case.name} | {row['variant']}: {row.get('kernel')} {row.get('tflops') or 0:.0f} "
                      f"TFLOP/s ratio_fa3 {row.get('ratio_fa3') or 0:.3f} diff {row.get('max_abs_diff_vs_first')} "
                      f"{row.get('error', '')}", flush=True)  # fmt: skip
        _write_sweep_json(out_json, rows, fi, partial=True)
    C.print_table(rows, ["case", "variant", "kernel", "tflops", "ratio_fa3", "max_abs_diff_vs_first"])
    print(f"[gsweep] {time.time() - t_start:.0f}s")
    _write_sweep_json(out_json, rows, fi, partial=False)


def _write_sweep_json(path: str | None, rows: list, fi, partial: bool) -> None:
    if not path:
        return
    import json

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    doc = {"gpu": C.gpu_name(), "flashinfer": getattr(fi, "__version__", None), "partial": partial, "rows": rows}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    if not partial:
        print(f"[gsweep] wrote {path}")


def parse_config(spec: str):
    from flashinfer_triton._prefill_impl import PrefillConfig

    words = spec.split()
    bm, bn = (int(x) for x in words[0].split("x"))
    kw = {}
    for w in words[1:]:
        if w[0] == "w" and w[1:].isdigit():
            kw["num_warps"] = int(w[1:])
        elif w[0] == "s" and w[1:].isdigit():
            kw["num_stages"] = int(w[1:])
        elif w in ("tma", "notma"):
            kw["use_tma"] = w == "tma"
        elif w in ("fold", "nofold"):
            kw["fold_scale"] = w == "fold"
        else:
            raise ValueError(f"sweep config {spec!r}: unknown word {w!r}")
    return PrefillConfig(bm, bn, kw.pop("num_warps", 4), kw.pop("num_stages", 3), **kw)


def dense_mask(case: Case, device="cuda"):
    """The custom mask of a case as bool [qo, kv], or None."""
    return prefill_mask(case, device)


def _pairs(qo: int, kv: int, causal: bool, window_left: int) -> int:
    """(query, key) pairs one request attends: query i sees keys up to i + kv - qo (causal, bottom-right) and
    from i + kv - qo - window_left (a window)."""
    if not causal and window_left < 0:
        return qo * kv
    last = torch.arange(qo, dtype=torch.int64) + (kv - qo)  # last visible key of each query
    hi = last.clamp(max=kv - 1) if causal else torch.full_like(last, kv - 1)
    lo = (last - window_left).clamp(min=0) if window_left >= 0 else torch.zeros_like(last)
    return int((hi - lo + 1).clamp(min=0).sum())


def visible_pairs(case: Case) -> int:
    """(query, key) pairs attended over the whole batch (a custom mask counts its set bits)."""
    m = dense_mask(case, "cpu")
    if m is not None:
        return int(m.sum()) * case.batch
    return sum(_pairs(qo, kv, case.causal, case.window_left) for qo, kv in request_lens(case))


def flops(case: Case) -> float:
    return 4.0 * visible_pairs(case) * case.d * case.hq


def make_inputs(case: Case, seed=0):
    return prefill_inputs(case, seed=seed, device="cuda")


def _soft_cap(case: Case):
    return case.soft_cap if case.soft_cap > 0 else None


# ----------------------------------------------------------------------------- ours
def ours_fn(case: Case, inp, config=None):
    """plan() once, return (run closure, out tensor, plan) through the backend seam."""
    from flashinfer_triton import _prefill_impl as impl
    from flashinfer_triton._backend import AttentionBatch, AttentionOptions, Workspace
    from flashinfer_triton.quantization import packbits

    dev = torch.device("cuda")
    paged = case.kind == "paged"
    mask = inp["mask"]
    opts = AttentionOptions(
        num_qo_heads=case.hq,
        num_kv_heads=case.hkv,
        head_dim=case.d,
        page_size=case.page_size if paged else 1,
        paged=paged,
        causal=case.causal and mask is None,
        window_left=case.window_left,
        logits_soft_cap=case.soft_cap,
        sm_scale=1.0 / math.sqrt(case.d),
        has_custom_mask=mask is not None,
        q_dtype=case.dtype,
        kv_dtype=case.kv_type,
        o_dtype=case.dtype,
    )
    lens = request_lens(case)
    qo_indptr = inp["qo_indptr"].cpu().long()
    kv_lens = torch.tensor([kv for _, kv in lens], dtype=torch.int64)
    kv_indptr_host = inp["kv_indptr"].cpu().long()
    if paged:
        k4, v4 = inp["cache"]
        kv_indices = inp["kv_indices"]
    else:
        k4, v4 = inp["k"][:, None], inp["v"][:, None]
        kv_indices = None
    mask_packed = mask_indptr = None
    if mask is not None:
        mask_packed = packbits(mask.reshape(-1), bitorder="little")
        mask_indptr = torch.tensor([0, mask_packed.numel()], dtype=torch.int32, device=dev)
    b = AttentionBatch(
        batch_size=len(lens),
        qo_indptr=inp["qo_indptr"],
        kv_indptr=inp["kv_indptr"],
        kv_indices=kv_indices,
        kv_lens=kv_lens.to(torch.int32).to(dev),
        qo_indptr_host=qo_indptr,
        kv_lens_host=kv_lens,
        kv_indptr_host=kv_indptr_host,
        mask_packed=mask_packed,
        mask_indptr=mask_indptr,
    )
    ws = Workspace(
        float_buffer=torch.empty(128 << 20, dtype=torch.uint8, device=dev),
        int_buffer=torch.empty(8 << 20, dtype=torch.uint8, device=dev),
    )
    p = impl.plan(opts, b, ws, config=config)
    q = inp["q"]
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=dev)

    def fn():
        impl.run(p, opts, b, q, k4, v4, out, lse, qk_scale_mult=1.0, v_scale=1.0)

    return fn, out, p


def _variant_kw(case: Case, inp) -> dict:
    """The mask and score options of a case as the public API (ours and FlashInfer's) takes them. A custom mask
    goes in packed once (``packed_custom_mask``, bits little-endian as both libraries pack them): the timed call is
    the attention alone, for both, and FlashInfer's packing needs a JIT module of its own (``quantization``)."""
    from flashinfer_triton.quantization import packbits

    kw = dict(window_left=case.window_left, logits_soft_cap=_soft_cap(case))
    if inp["mask"] is not None:
        if "mask_packed" not in inp:
            inp["mask_packed"] = packbits(inp["mask"].reshape(-1), bitorder="little")
        kw["packed_custom_mask"] = inp["mask_packed"]
    else:
        kw["causal"] = case.causal
    return kw


def _batch_wrapper(lib, case: Case, inp, **ctor):
    """A planned batch wrapper of ``lib`` (flashinfer_triton or FlashInfer) and its run closure."""
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    kw = _variant_kw(case, inp)
    kw.pop("packed_custom_mask", None)
    dtypes = dict(q_data_type=case.dtype, kv_data_type=case.kv_type)
    if case.kind == "paged":
        w = lib.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", **ctor)
        w.plan(inp["qo_indptr"], inp["kv_indptr"], inp["kv_indices"], inp["last_page_len"], case.hq, case.hkv,
               case.d, case.page_size, **kw, **dtypes)  # fmt: skip
        return lambda: w.run(inp["q"], inp["cache"])
    w = lib.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD", **ctor)
    w.plan(inp["qo_indptr"], inp["kv_indptr"], case.hq, case.hkv, case.d, **kw, **dtypes)
    return lambda: w.run(inp["q"], inp["k"], inp["v"])


def ours_public_fn(case: Case, inp):
    import flashinfer_triton as fit

    if case.kind == "single":
        kw = _variant_kw(case, inp)
        return lambda: fit.single_prefill_with_kv_cache(inp["q"], inp["k"], inp["v"], **kw)
    return _batch_wrapper(fit, case, inp)


# ----------------------------------------------------------------------------- peers
class Skip(Exception):
    """A peer that does not apply to a case (its column stays null with this reason)."""


def flashinfer_fn(fi, case: Case, inp, backend):
    if backend == "fa3" and not fa3_offered(case):
        raise Skip(NO_FA3)
    if case.kind == "single":
        kw = _variant_kw(case, inp)
        return lambda: fi.single_prefill_with_kv_cache(inp["q"], inp["k"], inp["v"], backend=backend, **kw)
    return _batch_wrapper(fi, case, inp, backend=backend)


def _bhsd(inp, expand_gqa: bool, hq: int):
    q = inp["q"].transpose(0, 1)[None].contiguous()
    k = inp["k"].transpose(0, 1)[None].contiguous()
    v = inp["v"].transpose(0, 1)[None].contiguous()
    if expand_gqa and k.shape[1] != hq:
        k = k.repeat_interleave(hq // k.shape[1], dim=1)
        v = v.repeat_interleave(hq // v.shape[1], dim=1)
    return q, k, v


def _plain(case: Case, who: str) -> None:
    """Raise Skip unless the case is one request with no window, soft cap or fp8 K/V."""
    if case.kind != "single":
        raise Skip(f"{who} has no paged or ragged KV in this benchmark")
    if case.window_left >= 0 or case.soft_cap > 0 or case.kv_type != case.dtype:
        raise Skip(f"{who}: no window / soft cap / fp8 K/V in this benchmark")


def sdpa_fn(case: Case, inp, backend_name):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    _plain(case, "SDPA")
    if case.causal and case.qo != case.kv:
        raise Skip("SDPA is_causal is top-left aligned (FlashInfer: bottom-right); only square causal compares")
    if case.mask is not None:
        raise Skip("SDPA flash/cuDNN take no boolean mask")
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend_name]
    q, k, v = _bhsd(inp, True, case.hq)

    def fn():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=case.causal)

    return fn


_FLEX = {}


def flex_fn(case: Case, inp):
    """FlexAttention (torch.compile'd); causal (bottom-right) and custom masks through a block mask."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    _plain(case, "FlexAttention")
    if "fn" not in _FLEX:
        import torch._dynamo

        # One compile per shape; past dynamo's default limit of 8, flex silently falls back to an unfused
        # eager path that materializes the scores (what the first run of this benchmark measured).
        for knob in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit"):
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, max(64, getattr(torch._dynamo.config, knob)))
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    q, k, v = _bhsd(inp, False, case.hq)
    block_mask = None
    qo, kv = case.qo, case.kv
    if case.mask is not None:
        dense = inp["mask"]

        def mask_mod(b, h, qi, kj):
            return dense[qi, kj]

        block_mask = create_block_mask(mask_mod, None, None, qo, kv, device="cuda")
    elif case.causal:
        offset = kv - qo

        def causal_mod(b, h, qi, kj):
            return kj <= qi + offset

        block_mask = create_block_mask(causal_mod, None, None, qo, kv, device="cuda")
    flex = _FLEX["fn"]
    return lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=case.hkv != case.hq)


def select_cases(only: str | None) -> list:
    """The cases whose name contains one of the comma-separated substrings of ``only`` (all when None)."""
    if only is None:
        return list(CASES)
    words = [w for w in only.split(",") if w]
    return [c for c in CASES if any(w in c.name for w in words)]


def fi_variants(fa3: bool, fa3_cases=None, cases=None):
    """One small call per FlashInfer JIT module the table needs (built concurrently by --fi-build-only)."""
    seen, out = set(), []
    fa3_cases = FA3_DEFAULT if fa3_cases is None else fa3_cases
    for case in CASES if cases is None else cases:
        for backend in ("fa2", "fa3") if fa3 else ("fa2",):
            if backend == "fa3" and (case.name not in fa3_cases or not fa3_offered(case)):
                continue
            key = (case.kind, case.d, case.dtype, case.kv_type, case.window_left >= 0, case.soft_cap > 0, backend)
            if key in seen:
                continue
            seen.add(key)
            lens = (16, 32) if case.lens else None
            small = replace(case, batch=min(case.batch, 2), qo=16, kv=32, mask=None, lens=lens)
            out.append((key, small))
    return out


def fi_build_only(done_file: str, fa3: bool, fa3_cases, cases=None) -> None:
    from concurrent.futures import ThreadPoolExecutor

    fi = C.import_flashinfer()
    if fi is None:
        with open(done_file, "w") as f:
            f.write("no flashinfer\n")
        return
    t0 = time.time()

    def build(item):
        key, small = item
        t = time.time()
        try:
            fn = flashinfer_fn(fi, small, make_inputs(small), key[-1])  # the key ends with the backend
            fn()
            torch.cuda.synchronize()
            return f"{key}: built in {time.time() - t:.0f}s"
        except Exception as exc:  # report and go on: a missing variant leaves a gap in the table
            return f"{key}: FAILED {type(exc).__name__}: {str(exc)[:300]}"

    items = fi_variants(fa3, fa3_cases, cases)
    with ThreadPoolExecutor(max_workers=len(items)) as ex:
        for line in ex.map(build, items):
            print(line, flush=True)
    with open(done_file, "w") as f:
        f.write(f"done in {time.time() - t0:.0f}s\n")


# ----------------------------------------------------------------------------- main
def timed(fn):
    try:
        fn()
        torch.cuda.synchronize()
        return C.bench(fn)
    except Exception as exc:
        print(f"[bench] failed: {type(exc).__name__}: {str(exc)[:300]}", file=sys.stderr, flush=True)
        return None


def within(seconds: float, fn):
    """fn() (a first call that may JIT-compile) on a daemon thread; TimeoutError past ``seconds``."""
    box = {}
    device = torch.cuda.current_device()

    def target():
        try:
            # Make the device's context current on this new thread before anything else: FlashInfer's fa3
            # builds its TMA descriptors through the driver API (cuTensorMapEncodeTiled), which on a thread
            # with no current context fails with error 201 (CUDA_ERROR_INVALID_CONTEXT); the kernel then runs
            # with a bad descriptor and an illegal instruction loses the CUDA context.
            torch.cuda.set_device(device)
            torch.cuda.synchronize(device)  # a runtime call: binds the primary context to this thread
            box["v"] = fn()
            torch.cuda.synchronize()
        except BaseException as exc:  # handed to the caller
            box["e"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(max(0.0, seconds))
    if t.is_alive():
        raise TimeoutError(f"first call (JIT) still running after {seconds:.0f} s of budget")
    if "e" in box:
        raise box["e"]
    return box.get("v")


class Budget:
    def __init__(self, seconds: float):
        self.left = seconds
        self.reason = None

    def run_first(self, fn):
        if self.reason:
            raise Skip(self.reason)
        t = time.time()
        try:
            return within(self.left, fn)
        except TimeoutError as exc:
            self.reason = f"budget exhausted ({exc})"
            raise Skip(self.reason) from exc
        finally:
            self.left -= time.time() - t


def peer(row, key, fl, make, budget=None, check=None):
    """Time one peer into row[key] (ms) and row[key -> tflops]; null with a reason on skip or failure."""
    try:
        fn = make()
        if budget is not None:
            budget.run_first(fn)
        ms = timed(fn)
        if ms is None:
            raise RuntimeError("timing failed (see stderr)")
        row[key] = ms
        row[key.replace("_ms", "_tflops")] = fl / (ms * 1e-3) / 1e12
        if check is not None:
            check(fn)
    except Skip as exc:
        row[key] = None
        row["null_reasons"][key] = str(exc)
    except Exception as exc:
        row[key] = None
        row["null_reasons"][key] = f"{type(exc).__name__}: {str(exc)[:200]}"
        print(f"[bench] {key} {row['case']}: {row['null_reasons'][key]}", flush=True)


PEER_KEYS = ("flashinfer_ms", "flashinfer_fa3_ms", "sdpa_flash_ms", "sdpa_cudnn_ms", "flex_ms")


def main() -> None:
    if "--resources" in sys.argv[1:]:  # the offline sm_90a build of the Gluon kernel: no GPU, no timing
        import _gluon_resources

        return _gluon_resources.main("prefill", [a for a in sys.argv[1:] if a != "--resources"])
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-only", action="store_true", help="with --sweep: skip the public/graph timings")
    ap.add_argument("--sweep-cases", default=None, help="with --sweep: comma-separated substrings of case names")
    ap.add_argument("--sweep-set", choices=("tiles", "fold"), default="tiles", help="with --sweep: which list")
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--fa3", action="store_true", help="also FlashInfer's fa3 backend (JIT ~90 s per module)")
    ap.add_argument("--fa3-cases", default=None, help="comma-separated case names for fa3 (default: all it has)")
    ap.add_argument("--fa3-budget", type=float, default=200.0, help="seconds for fa3 (JIT included)")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--flex-budget", type=float, default=150.0, help="seconds for FlexAttention compiles")
    ap.add_argument("--no-sdpa", action="store_true")
    ap.add_argument("--fi-build-only", default=None, metavar="DONE_FILE")
    ap.add_argument("--wait-build", default=None, metavar="DONE_FILE", help="wait for a --fi-build-only run")
    ap.add_argument("--wait-limit", type=float, default=240.0)
    ap.add_argument("--only", default=None, help="comma-separated substrings of the case names to run")
    ap.add_argument("--gluon-sweep", action="store_true", help="the GLUON_SWEEP variants (with --only) and fa3")
    ap.add_argument("--gluon-sweep-json", default=None, metavar="PATH", help="with --gluon-sweep: write rows here")
    ap.add_argument("--gluon-sweep-rounds", type=int, default=2)
    ap.add_argument("--sweep-compile", default=None, metavar="I/N", help="with --gluon-sweep: compile shard I of N")
    ap.add_argument("--gluon-sweep-exclude", default="", help="with --gluon-sweep: leave out variants with these words")
    args = ap.parse_args()
    if not args.gluon_sweep:  # (options of --gluon-sweep alone: an error, not silently ignored)
        given = [o for o, v in (("--gluon-sweep-json", args.gluon_sweep_json), ("--sweep-compile", args.sweep_compile),
                                ("--gluon-sweep-exclude", args.gluon_sweep_exclude),
                                ("--gluon-sweep-rounds", args.gluon_sweep_rounds != 2)) if v]  # fmt: skip
        if given:
            ap.error(f"{', '.join(given)} only with --gluon-sweep")
    elif args.sweep:
        ap.error("--sweep and --gluon-sweep are separate runs")
    fa3_cases = args.fa3_cases.split(",") if args.fa3_cases else FA3_DEFAULT
    cases = select_cases(args.only)
    if args.gluon_sweep:
        fa3 = not args.no_flashinfer
        exclude = tuple(w for w in args.gluon_sweep_exclude.split(",") if w)
        gluon_sweep(cases, args.gluon_sweep_json, args.sweep_compile, args.gluon_sweep_rounds, fa3, exclude)
        return
    if args.fi_build_only:
        fi_build_only(args.fi_build_only, args.fa3, fa3_cases, cases)
        return

    rows, sweep_rows = [], []
    inputs, outs = {}, {}
    t_start = time.time()
    for case in cases:
        name = case.name
        inp = make_inputs(case)
        inputs[name] = inp
        fn, out, p = ours_fn(case, inp)
        t0 = time.time()
        fn()
        torch.cuda.synchronize()
        first_ms = (time.time() - t0) * 1e3
        ms = timed(fn)
        outs[name] = out.clone()
        graph_ms = pub = None
        if not args.sweep_only:
            try:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fn()
                graph_ms = timed(graph.replay)
            except Exception as exc:
                print(f"[bench] graph capture {name}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            pub = timed(ours_public_fn(case, inp))
        fl = flops(case)
        cfg = p.config
        row = {
            "case": name,
            "ours_ms": ms,
            "ours_tflops": fl / (ms * 1e-3) / 1e12 if ms else None,
            "ours_graph_ms": graph_ms,
            "ours_public_ms": pub,
            "config": f"{cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}",
            # (planned for the Gluon kernel on Hopper; run() falls back to the Triton kernel when the tensors do not
            # fit its descriptors)
            "gluon": bool(cfg.gluon),
            "splits": p.num_merge_host > 0,
            # (programs of the persistent Gluon grid, _prefill_impl.plan's rule; 0: the one-shot grid)
            "persist_programs": int(getattr(p, "persist_nprog", 0)),
            "first_call_ms": first_ms,
            "flops": fl,
            "null_reasons": {},
        }
        if p.num_blocks_host:
            row["mask_kv_tiles_visited"] = p.num_blocks_host
        for key in PEER_KEYS:
            row[key] = None
        rows.append(row)
        print(f"[ours] {name}: {ms:.3f} ms {row['ours_tflops']:.0f} TFLOP/s ({row['config']})", flush=True)
        wanted = args.sweep_cases is None or any(x in name for x in args.sweep_cases.split(","))
        sweep = SWEEP_FOLD if args.sweep_set == "fold" else SWEEP
        if args.sweep and name in sweep and wanted:
            for spec in sweep[name]:
                entry = {"case": name, "config": spec, "ms": None, "tflops": None, "max_abs_diff_vs_default": None}
                try:
                    sfn, sout, _ = ours_fn(case, inp, config=parse_config(spec))
                    sms = timed(sfn)
                    entry["ms"] = sms
                    entry["tflops"] = fl / (sms * 1e-3) / 1e12 if sms else None
                    entry["max_abs_diff_vs_default"] = float((sout.float() - outs[name].float()).abs().max())
                except Exception as exc:
                    entry["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                sweep_rows.append(entry)
                print(f"[sweep] {name} {spec}: {entry['ms']} ms, diff {entry['max_abs_diff_vs_default']}", flush=True)
        C.write_json("prefill", rows, {"sweep": sweep_rows, "partial": True}, args.out)

    fi = None if args.no_flashinfer else C.import_flashinfer()
    if fi is not None and args.wait_build:
        t0 = time.time()
        while not os.path.exists(args.wait_build) and time.time() - t0 < args.wait_limit:
            time.sleep(2)
        print(f"[bench] waited {time.time() - t0:.0f}s for FlashInfer builds", flush=True)
    fa3_budget = Budget(args.fa3_budget)
    flex_budget = Budget(args.flex_budget)
    # fa3 goes last, in its own pass: when its kernels fail (a TMA descriptor error followed by an illegal
    # instruction was seen once on the H100 machine) the CUDA context is lost for every later call.
    for case, row in zip(cases, rows, strict=True):
        name = case.name
        inp = inputs[name]
        fl = row["flops"]
        reasons = row["null_reasons"]
        if fi is None:
            why = "--no-flashinfer" if args.no_flashinfer else "flashinfer not importable"
            reasons["flashinfer_ms"] = reasons["flashinfer_fa3_ms"] = why
        else:

            def check_fa2(ffn, case=case, inp=inp, row=row):
                ref = ffn()
                row["max_abs_diff_vs_fa2"] = float((outs[case.name].float() - ref.float()).abs().max())

            peer(
                row,
                "flashinfer_ms",
                fl,
                lambda case=case, inp=inp: flashinfer_fn(fi, case, inp, "fa2"),
                check=check_fa2,
            )
        for b in ("flash", "cudnn"):
            if args.no_sdpa:
                reasons[f"sdpa_{b}_ms"] = "--no-sdpa"
            else:
                peer(row, f"sdpa_{b}_ms", fl, lambda case=case, inp=inp, b=b: sdpa_fn(case, inp, b))
        if args.no_flex:
            reasons["flex_ms"] = "--no-flex"
        else:
            peer(row, "flex_ms", fl, lambda case=case, inp=inp: flex_fn(case, inp), budget=flex_budget)
        fa2 = row.get("flashinfer_ms")
        row["ratio"] = fa2 / row["ours_ms"] if fa2 and row["ours_ms"] else None
        partial = {"sweep": sweep_rows, "partial": True, "flashinfer": getattr(fi, "__version__", None)}
        C.write_json("prefill", rows, partial, args.out)
    for case, row in zip(cases, rows, strict=True):
        name = case.name
        reasons = row["null_reasons"]
        if fi is None:
            continue
        if not args.fa3:
            reasons["flashinfer_fa3_ms"] = "fa3 not requested (--fa3)"
        elif not fa3_offered(case):
            reasons["flashinfer_fa3_ms"] = NO_FA3
        elif name not in fa3_cases:
            reasons["flashinfer_fa3_ms"] = "not in --fa3-cases (fa3 JIT ~90 s per module)"
        else:
            peer(
                row,
                "flashinfer_fa3_ms",
                row["flops"],
                lambda case=case, inp=inputs[name]: flashinfer_fn(fi, case, inp, "fa3"),
                budget=fa3_budget,
            )
        if row.get("flashinfer_fa3_ms") and row["ours_ms"]:
            row["ratio_fa3"] = row["flashinfer_fa3_ms"] / row["ours_ms"]
        partial = {"sweep": sweep_rows, "partial": True, "flashinfer": getattr(fi, "__version__", None)}
        C.write_json("prefill", rows, partial, args.out)

    meta = {
        "sweep": sweep_rows,
        "elapsed_s": time.time() - t_start,
        "flashinfer": getattr(fi, "__version__", None),
        "fa3_cases": fa3_cases if args.fa3 else [],
    }
    path = C.write_json("prefill", rows, meta, args.out)
    cols = [
        "case",
        "ours_ms",
        "ours_tflops",
        "flashinfer_tflops",
        "flashinfer_fa3_tflops",
        "sdpa_flash_tflops",
        "sdpa_cudnn_tflops",
        "flex_tflops",
        "ratio",
        "config",
    ]
    C.print_table(rows, cols)
    if sweep_rows:
        C.print_table(sweep_rows, ["case", "config", "ms", "tflops", "max_abs_diff_vs_default"])
    print(f"[bench] wrote {path}")


if __name__ == "__main__":
    main()
