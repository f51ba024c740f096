"""Host time of the public decode plan() against FlashInfer's on the same tables (GPU machine), with a
cProfile of ours and the host cost of the single CUDA operations plan() is made of.

    PYTHONPATH=src python3 scripts/plan_breakdown.py [--out DIR] [--rounds 7] [--calls 200]
    # FlashInfer: the lead's prefix puts .peers on PYTHONPATH; without it only ours is measured.

Cases: batch-256 eager plan() (1024 tokens each, page 16, 32/8 heads, D128) with the page table on the
CPU and on the GPU; the engine's CUDA-graph re-plan (SmolLM2 shapes 9/3 heads, D64, page 16, ~80 tokens;
indptr / last_page_len on the CPU, page indices already in the graph's device buffer) at batch 1 / 8 / 32,
ours with ``decode.GRAPH_PAGE_RANGE`` "lazy" (the default) and "plan"; the same with the whole table in
the device buffers (SGLang's way); bs1 once more at the end. Device tables also with their page indices
reduced on the device ("indices reduced": ``decode.DEVICE_INDEX_READ = 0``) instead of read back. Each fast
variant is checked once against a general plan() of the same table ("fast re-plan vs general plan: ok").
Each figure: host microseconds per plan() over ``--calls`` calls with no
synchronization between them (the GPU keeps up: a plan() queues a few tiny copies), median and min over
``--rounds`` rounds. "general" is our plan() with the fast re-plan disabled (what a first plan() costs).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch

import flashinfer_triton as fit
from flashinfer_triton import _wrapper as wmod
from flashinfer_triton import decode as dmod


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_us(fn, calls: int, rounds: int) -> tuple[float, float]:
    """(median, min) over rounds of the mean host microseconds per call of ``calls`` back-to-back calls."""
    for _ in range(20):
        fn()
    _sync()
    res = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        res.append((time.perf_counter() - t0) / calls * 1e6)
        _sync()
    return statistics.median(res), min(res)


def cases(dev):
    B, L, ps = 256, 1024, 16
    pages = L // ps
    indptr = torch.arange(B + 1, dtype=torch.int32) * pages
    indices = torch.randperm(B * pages).to(torch.int32)
    last = torch.full((B,), ps, dtype=torch.int32)
    out = [
        ("b256 eager, table on CPU", None, (indptr, indices, last), (32, 8, 128, ps)),
        ("b256 eager, table on GPU", None, (indptr.to(dev), indices.to(dev), last.to(dev)), (32, 8, 128, ps)),
    ]
    for bs in (1, 8, 32):
        ip = torch.arange(bs + 1, dtype=torch.int32) * 5
        lp = torch.full((bs,), 9, dtype=torch.int32)
        buf_ip = torch.zeros(bs + 1, dtype=torch.int32, device=dev)
        buf_ix = torch.arange(4096, dtype=torch.int32, device=dev)
        buf_lp = torch.zeros(bs, dtype=torch.int32, device=dev)
        out.append((f"engine graph bs{bs}", (buf_ip, buf_ix, buf_lp), (ip, buf_ix[: 5 * bs], lp), (9, 3, 64, 16)))
    for bs in (8,):  # SGLang: indptr / last_page_len are the graph buffers themselves, on the device
        buf_ip = (torch.arange(bs + 1, dtype=torch.int32) * 5).to(dev)
        buf_ix = torch.arange(4096, dtype=torch.int32, device=dev)
        buf_lp = torch.full((bs,), 9, dtype=torch.int32, device=dev)
        bufs = (buf_ip, buf_ix, buf_lp)
        out.append((f"graph bs{bs}, table in device buffers", bufs, (buf_ip, buf_ix[: 5 * bs], buf_lp), (9, 3, 64, 16)))
    # bs1 once more at the end: is its cost the case's own or the moment's (it read 104 us where bs8 read 73)?
    name, graph, tables, shape = out[2]
    out.append((name + ", again", graph, tables, shape))
    return out


def _resolved(max_index):
    return max_index if type(max_index) is int else max_index.value()[1]


def check_fast(w, fn, ws, graph, tables, shape) -> str:
    """One more fast re-plan (it must be served by the fast path), compared with a general plan() of the same
    table on a fresh wrapper: host lengths, device batch arrays, work list, live work count, page range."""
    orig, hits = dmod._DecodeCore._replan_fast, []

    def spy(self, *a, **k):
        hits.append(orig(self, *a, **k))
        return hits[-1]

    dmod._DecodeCore._replan_fast = spy
    try:
        fn()
    finally:
        dmod._DecodeCore._replan_fast = orig
    ref = make(fit, ws, graph)
    ref.plan(*tables, *shape)
    a, b = w._w._planned, ref._w._planned
    bad = [] if hits == [True] else [f"fast path not taken ({hits})"]
    for k in ("kv_lens_host", "kv_indptr_host"):
        if not torch.equal(getattr(a["batch"], k), getattr(b["batch"], k)):
            bad.append(k)
    n = a["batch"].batch_size
    for k in ("kv_lens", "kv_indptr"):
        m = n if k == "kv_lens" else n + 1
        if not torch.equal(getattr(a["batch"], k)[:m].cpu(), getattr(b["batch"], k)[:m].cpu()):
            bad.append(k)
    pa, pb = a["plan"], b["plan"]
    if pa.num_work != pb.num_work or pa.chunk != pb.chunk or not torch.equal(pa.work.cpu(), pb.work.cpu()):
        bad.append("work list")
    if _resolved(a["max_page_index"]) != _resolved(b["max_page_index"]):
        bad.append("page range")
    if graph is not None:  # the caller's buffers refilled with the table
        for k, buf, t in (("indptr buffer", graph[0], tables[0]), ("last_page_len buffer", graph[2], tables[2])):
            if not torch.equal(buf[: t.numel()].cpu(), t.cpu()):
                bad.append(k)
    _sync()
    return "ok" if not bad else "MISMATCH: " + ", ".join(bad)


def planner(w, tables, shape, general: bool):
    """w.plan(tables, shape) as a function of no argument; ``general``: with our fast re-plan disabled."""
    if general:

        def fn():
            w._w._fast = None
            w.plan(*tables, *shape)

        return fn
    return lambda: w.plan(*tables, *shape)


def row(case, lib, variant, med, lo) -> dict:
    return dict(case=case, lib=lib, variant=variant, host_us_median=round(med, 1), host_us_min=round(lo, 1))


def make(lib, ws, graph):
    if graph is None:
        return lib.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    return lib.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(ws, *graph, "NHD")


def api_counts(fn) -> dict:
    """CUDA runtime/driver calls one fn() makes (torch.profiler's CPU-side events), by name."""
    from torch.profiler import ProfilerActivity, profile

    try:
        fn()
        _sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
        _sync()
    except Exception as exc:  # noqa: BLE001 - report, never lose the main figures
        return {"error": f"{type(exc).__name__}: {exc}"}
    counts: dict = {}
    for ev in prof.events():
        if ev.name.startswith("cu"):
            counts[ev.name] = counts.get(ev.name, 0) + 1
    return counts


def op_costs(dev, calls, rounds) -> dict:
    """Host microseconds of the single operations a plan() is made of, on this machine."""
    import numpy as np

    small = torch.zeros(64, dtype=torch.int32, device=dev)
    small2 = torch.zeros(64, dtype=torch.int32, device=dev)
    other = torch.zeros(64, dtype=torch.int32, device=dev)
    host = np.zeros(64, dtype=np.int32)
    big = np.zeros(17000, dtype=np.int32)
    mm = torch.zeros(2, dtype=torch.int32, device=dev)
    pinned = torch.zeros(2, dtype=torch.int32, pin_memory=True)
    ev = torch.cuda.Event()
    idx = torch.arange(4096, dtype=torch.int32, device=dev)
    ops = {
        "H2D copy_ 256 B pageable (non_blocking)": lambda: small.copy_(torch.from_numpy(host), non_blocking=True),
        "H2D .to(dev) 68 KB pageable (non_blocking)": lambda: torch.from_numpy(big).to(dev, non_blocking=True),
        "D2D copy_ 256 B": lambda: small.copy_(other, non_blocking=True),
        "two D2D copy_": lambda: (small.copy_(other, non_blocking=True), small2.copy_(other, non_blocking=True)),
        "_foreach_copy_ of two": lambda: torch._foreach_copy_([small, small2], [other, other], non_blocking=True),
        "aminmax(out=) 4096": lambda: torch.aminmax(idx, out=(mm[0], mm[1])),
        "D2H copy_ 8 B to pinned": lambda: pinned.copy_(mm, non_blocking=True),
        "Event.record(current_stream(dev))": lambda: ev.record(torch.cuda.current_stream(dev)),
        "cat of 3 small + .cpu() (sync)": lambda: torch.cat([small, other, mm]).cpu(),
        "slice of a CUDA tensor": lambda: idx[:100],
    }
    out = {}
    for name, fn in ops.items():
        try:
            out[name] = round(host_us(fn, calls, rounds)[0], 2)
        except Exception as exc:  # noqa: BLE001 - report, never lose the main figures
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--cpu-smoke", action="store_true", help="run on CPU tensors (TRITON_INTERPRET=1), ours only")
    args = ap.parse_args()
    dev = torch.device("cpu" if args.cpu_smoke else "cuda")
    if args.cpu_smoke:
        args.no_flashinfer = True
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    flashinfer = None
    if not args.no_flashinfer:
        try:
            import flashinfer
        except Exception as exc:  # noqa: BLE001
            print(f"(FlashInfer not importable: {type(exc).__name__}: {exc})", flush=True)
    rows, profiles = [], {}
    all_cases = cases(dev)
    # FlashInfer first: its first plan() of a variant JIT-builds the module (before any timing).
    fi_wrappers = {}
    if flashinfer is not None:
        t0 = time.perf_counter()
        for name, graph, tables, shape in all_cases:
            try:
                w = make(flashinfer, ws, graph)
                w.plan(*tables, *shape)
                fi_wrappers[name] = w
            except Exception as exc:  # noqa: BLE001 - that case then has no FlashInfer figure
                print(f"(FlashInfer plan() failed for {name}: {type(exc).__name__}: {exc})", flush=True)
        _sync()
        print(f"(FlashInfer modules ready in {time.perf_counter() - t0:.1f} s)", flush=True)
    read_default = dmod.DEVICE_INDEX_READ
    for name, graph, tables, shape in all_cases:
        # (tag, GRAPH_PAGE_RANGE, general path, DEVICE_INDEX_READ, PINNED_READ)
        variants = [("fast", "lazy", False, read_default, True)]
        if graph is not None and tables[0].is_cpu:
            variants.append(("range at plan", "plan", False, read_default, True))
        if not tables[0].is_cpu or dev.type == "cpu" and graph is None:  # device tables: min/max on the device
            variants.append(("indices reduced", "plan" if graph is not None else "lazy", False, 0, True))
            if graph is not None:  # the previous default there: no range at plan(), an eager run() reduces it
                variants.append(("range deferred", "lazy", False, 0, True))
            else:  # the read into a fresh pageable tensor (.cpu()) instead of the reused pinned buffer
                variants.append(("pageable read", "lazy", False, read_default, False))
        variants.append(("general", "lazy", True, read_default, True))
        for tag, mode, general, read, pinned in variants:
            dmod.GRAPH_PAGE_RANGE, dmod.DEVICE_INDEX_READ, wmod.PINNED_READ = mode, read, pinned
            w = make(fit, ws, graph)
            w.plan(*tables, *shape)
            fn = planner(w, tables, shape, general)
            med, lo = host_us(fn, args.calls, args.rounds)
            rows.append(row(name, "ours", tag, med, lo))
            print(f"{name:40s} ours {tag:15s} {med:7.1f} us (min {lo:.1f})", flush=True)
            if tag != "general" and dev.type == "cuda":
                rows[-1]["cuda_calls"] = api_counts(fn)
                print(f"{'':40s}      CUDA calls per plan(): {rows[-1]['cuda_calls']}", flush=True)
            if tag != "general":
                try:
                    rows[-1]["check"] = check_fast(w, fn, ws, graph, tables, shape)
                except Exception as exc:  # noqa: BLE001 - report, never lose the main figures
                    rows[-1]["check"] = f"ERROR {type(exc).__name__}: {exc}"
                print(f"{'':40s}      fast re-plan vs general plan: {rows[-1]['check']}", flush=True)
            profiled = ("b256 eager, table on CPU", "b256 eager, table on GPU", "engine graph bs1", "engine graph bs8")
            if tag == "fast" and name in profiled:
                pr = cProfile.Profile()
                pr.enable()
                for _ in range(args.calls):
                    fn()
                pr.disable()
                _sync()
                s = io.StringIO()
                pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
                profiles[name] = s.getvalue()
        dmod.GRAPH_PAGE_RANGE, dmod.DEVICE_INDEX_READ, wmod.PINNED_READ = "lazy", read_default, True
        if name in fi_wrappers:
            med, lo = host_us(planner(fi_wrappers[name], tables, shape, False), args.calls, args.rounds)
            rows.append(row(name, "flashinfer", "", med, lo))
            print(f"{name:40s} FlashInfer {'':8s} {med:7.1f} us (min {lo:.1f})", flush=True)
            rows[-1]["cuda_calls"] = api_counts(planner(fi_wrappers[name], tables, shape, False))
            print(f"{'':40s}      CUDA calls per plan(): {rows[-1]['cuda_calls']}", flush=True)
    costs = {} if args.cpu_smoke else op_costs(dev, args.calls, args.rounds)
    print("\nHost us of single operations on this machine:")
    for k, v in costs.items():
        print(f"   {k:45s} {v}")
    for name, text in profiles.items():
        print(f"\n== cProfile, ours, {name} ({args.calls} calls)\n{text}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        meta = dict(
            device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
            torch=torch.__version__,
            flashinfer=getattr(flashinfer, "__version__", None),
            python=sys.version.split()[0],
            calls=args.calls,
            rounds=args.rounds,
        )
        with open(os.path.join(args.out, "plan_breakdown.json"), "w") as f:
            json.dump(dict(meta=meta, rows=rows, op_costs_us=costs, profiles=profiles), f, indent=1)


if __name__ == "__main__":
    main()
