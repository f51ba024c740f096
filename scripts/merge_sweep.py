"""Tile sweep of the merge kernels on the GPU, ours against FlashInfer, both replayed from CUDA graphs.

    PYTHONPATH=/tmp/peers:src python3 scripts/merge_sweep.py [--out DIR]
    PYTHONPATH=/tmp/peers:src python3 scripts/merge_sweep.py --variants [--budget-s 100] --out DIR

``--variants`` (session 5): the kernel variants of ``_merge_impl`` (module flags, see VARIANTS below)
against FlashInfer on every merge case, each timed two ways as ``benchmarks/bench_cascade.py`` does:
``warm`` = per call of 40 calls captured in one CUDA graph (inputs L2-resident when they fit: the
benchmark's graph column) and ``cold`` = ``do_bench`` with L2 flushed (the eager column). Writes
``merge-variants.json`` (after every case, so a run cut short keeps what it measured).

For every merge case of ``benchmarks/bench_cascade.py`` it times ``merge_states`` under each
(BLOCK_K, BLOCK_H, num_warps) and ``merge_state_in_place`` under each (BLOCK_R, num_warps), by
overriding ``_merge_impl._states_config`` / ``_pair_config``; the default heuristic's pick and
FlashInfer's time are printed beside the best. Kernel time only (graph replay): the eager figures are
host-bound at small sizes and are the benchmark's business.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))

import _common as C  # noqa: E402
from bench_cascade import MERGE_CASES, MERGE_PAIR_CASES  # noqa: E402

import flashinfer_triton  # noqa: E402
from flashinfer_triton import _merge_impl  # noqa: E402


def graph_ms(fn) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return C.bench(g.replay, warmup=10, rep=60)


# Session-5 variants: name -> module attributes of _merge_impl set for it (the rest at their defaults).
# FIXED_L2_RESIDENT off: the variants below set the tile and hints themselves (session 8's rule, off by default,
# would override both for inputs that fit in L2); "default" and "resident" compare the rule itself.
FIXED = {"STATES_KERNEL": "fixed", "FIXED_L2_RESIDENT": False}
STATES_VARIANTS = {  # in order of interest (a run cut short by the time budget drops the last ones)
    "default": {},
    "resident": {"FIXED_L2_RESIDENT": True},
    "fixed": FIXED,
    "3d-few": {"FEW_PAIRS": 1 << 40},  # the few-pairs tiling (all states of one head at once) everywhere
    "fixed-t2048": {**FIXED, "FIXED_TILE_VALUES": 2048},
    "fixed-t8192": {**FIXED, "FIXED_TILE_VALUES": 8192},
    "fixed-vpt16": {**FIXED, "FIXED_VALUES_PER_THREAD": 16},
    "fixed-persist8": {**FIXED, "FIXED_PERSIST": 8},
    "fixed-masked": {**FIXED, "FIXED_EVEN": False},
    "fixed-wide": {**FIXED, "FIXED_NARROW": False},
    "fixed-rowfast": {**FIXED, "FIXED_ROW_FAST": True},
    "fixed-nohint": {**FIXED, "FIXED_STREAM_HINTS": False},
    "fixed-hint-load": {**FIXED, "FIXED_STREAM_HINTS": "load"},  # session 7: evict_first loads, plain stores
    "fixed-hint-store": {**FIXED, "FIXED_STREAM_HINTS": "store"},  # session 7: plain loads, .cs stores
    # Session 7, second round: the store-only hints (best warm N512-K8, 9.65 us) with other tiles / persistence.
    "fixed-store-t2048": {**FIXED, "FIXED_STREAM_HINTS": "store", "FIXED_TILE_VALUES": 2048},
    "fixed-store-t8192": {**FIXED, "FIXED_STREAM_HINTS": "store", "FIXED_TILE_VALUES": 8192},
    "fixed-store-persist4-s3": {**FIXED, "FIXED_STREAM_HINTS": "store", "FIXED_PERSIST": 4, "FIXED_STAGES": 3},
    "fixed-store-persist8-s2": {**FIXED, "FIXED_STREAM_HINTS": "store", "FIXED_PERSIST": 8, "FIXED_STAGES": 2},
    "3d-few-nohint": {"FEW_PAIRS": 1 << 40, "STREAM_HINTS": False},
    "fixed-t16384": {**FIXED, "FIXED_TILE_VALUES": 16384},
    "fixed-t8192-vpt16": {**FIXED, "FIXED_TILE_VALUES": 8192, "FIXED_VALUES_PER_THREAD": 16},
    "fixed-persist4-s3": {**FIXED, "FIXED_PERSIST": 4, "FIXED_STAGES": 3},
    # Session 8: FlashInfer's grid shape (one program per row of 32 heads: 512 programs of 256 threads at
    # 512 x 8) under each hint setting, and half a row.
    "fixed-t32768": {**FIXED, "FIXED_TILE_VALUES": 32768},
    "fixed-nohint-t32768": {**FIXED, "FIXED_STREAM_HINTS": False, "FIXED_TILE_VALUES": 32768},
    "fixed-store-t32768": {**FIXED, "FIXED_STREAM_HINTS": "store", "FIXED_TILE_VALUES": 32768},
    "fixed-nohint-t16384": {**FIXED, "FIXED_STREAM_HINTS": False, "FIXED_TILE_VALUES": 16384},
    "fixed-store-t16384": {**FIXED, "FIXED_STREAM_HINTS": "store", "FIXED_TILE_VALUES": 16384},
}
PAIR_VARIANTS = {  # in order of interest
    "default": {},
    "even+rcp+narrow+hint_b": {"PAIR_EVEN": True, "PAIR_RCP": True, "PAIR_NARROW": True, "PAIR_HINT_B": True},
    "even+rcp+narrow": {"PAIR_EVEN": True, "PAIR_RCP": True, "PAIR_NARROW": True},
    "hint_b": {"PAIR_HINT_B": True},
    "rcp": {"PAIR_RCP": True},
    "even": {"PAIR_EVEN": True},
    "narrow": {"PAIR_NARROW": True},
    "rcp+narrow": {"PAIR_RCP": True, "PAIR_NARROW": True},
    "hint_b+narrow": {"PAIR_HINT_B": True, "PAIR_NARROW": True},
    "rcp+narrow+hint_b": {"PAIR_RCP": True, "PAIR_NARROW": True, "PAIR_HINT_B": True},
}
# Pair tiles (rows per program, num_warps, with the even+rcp+narrow+hint_b flags): the small in-place case tries
# these; the large ones the tiles that were best in session 4's cold sweep, with the flags.
PAIR_ALL_FLAGS = {"PAIR_RCP": True, "PAIR_NARROW": True, "PAIR_HINT_B": True, "PAIR_EVEN": True}
PAIR_SMALL_TILES = [(4, 1, 0), (4, 2, 0), (8, 2, 0), (16, 4, 0), (16, 2, 0), (4, 1, 1), (8, 2, 1)]
PAIR_LARGE_TILES = [(8, 1, 1), (128, 4, 1)]


SMOKE = False  # --cpu-smoke: tiny cases on the CPU (TRITON_INTERPRET=1), wall time, no FlashInfer


def time_smoke(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def time_warm(fn) -> float:
    """ms per call, 40 calls in one CUDA graph (benchmarks/bench_cascade.py's graph column)."""
    if SMOKE:
        return time_smoke(fn)
    from bench_page import time_graph

    return time_graph([fn], calls=40, replays=10)


def time_cold(fn) -> float:
    """ms per call with L2 flushed before each (the benchmark's eager column, shorter run)."""
    if SMOKE:
        return time_smoke(fn)
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=5, rep=25, return_mode="median"))


def apply(settings: dict) -> dict:
    """Set _merge_impl attributes; returns the previous values."""
    old = {name: getattr(_merge_impl, name) for name in settings}
    for name, value in settings.items():
        setattr(_merge_impl, name, value)
    return old


def run_variants(args):
    t0 = time.perf_counter()
    flashinfer = None
    fi_ready = threading.Event()
    fi_error = []

    def warm_flashinfer():  # FlashInfer's JIT build (~30 s) runs while our variants compile
        nonlocal flashinfer
        try:
            import flashinfer as fi

            v = torch.randn(2, 2, 4, 128, dtype=torch.float16, device="cuda")
            s = torch.randn(2, 2, 4, dtype=torch.float32, device="cuda")
            fi.merge_states(v, s)
            fi.merge_state_in_place(v[:, 0].clone(), s[:, 0].clone(), v[:, 1].clone(), s[:, 1].clone())
            torch.cuda.synchronize()
            flashinfer = fi
        except Exception as exc:  # pragma: no cover - depends on the machine
            fi_error.append(f"{type(exc).__name__}: {exc}")
        fi_ready.set()

    if not args.no_flashinfer:
        threading.Thread(target=warm_flashinfer, daemon=True).start()
    else:
        fi_ready.set()
    names_s = [n for n in STATES_VARIANTS if not args.only or n in args.only]
    names_p = [n for n in PAIR_VARIANTS if not args.only or n in args.only]
    dev = "cpu" if SMOKE else "cuda"
    gen = torch.Generator(device=dev).manual_seed(3)
    cases = []
    for n, k, h, d in [(2, 16, 4, 64), (3, 2, 2, 64)] if SMOKE else MERGE_CASES:
        v = torch.randn(n, k, h, d, dtype=torch.float16, device=dev, generator=gen)
        s = torch.randn(n, k, h, dtype=torch.float32, device=dev, generator=gen) * 4
        nbytes = v.numel() * 2 + s.numel() * 4 + n * h * d * 2 + n * h * 4
        fn = lambda v=v, s=s, mod=flashinfer_triton: mod.merge_states(v, s)  # noqa: E731
        variants = [(name, STATES_VARIANTS[name]) for name in names_s]
        cases.append((f"merge_states N{n}-K{k}-H{h}-D{d}", "states", (v, s), fn, nbytes, variants))
    for n, h, d in [(4, 2, 64)] if SMOKE else MERGE_PAIR_CASES:
        v = torch.randn(n, h, d, dtype=torch.float16, device=dev, generator=gen)
        s = torch.randn(n, h, dtype=torch.float32, device=dev, generator=gen) * 4
        vo = torch.randn(n, h, d, dtype=torch.float16, device=dev, generator=gen)
        so = torch.randn(n, h, dtype=torch.float32, device=dev, generator=gen) * 4
        nbytes = 3 * v.numel() * 2 + 3 * s.numel() * 4
        fn = lambda v=v, s=s, vo=vo, so=so, mod=flashinfer_triton: mod.merge_state_in_place(v, s, vo, so)  # noqa: E731
        variants = [(name, PAIR_VARIANTS[name]) for name in names_p]
        for br, nw, flags in PAIR_SMALL_TILES if n * h <= 4096 else PAIR_LARGE_TILES:
            settings = {"_pair_config": lambda *a, c=(br, d, nw): c, **(PAIR_ALL_FLAGS if flags else {})}
            variants.append((f"tile-{br}x{nw}w" + ("+flags" if flags else ""), settings))
        cases.append((f"merge_state_in_place N{n}-H{h}-D{d}", "pair", (v, s, vo, so), fn, nbytes, variants))

    # (case, variant) pairs round-robin over the cases (variant lists are in order of interest), so that a
    # run cut short by the time budget loses the least interesting variants of every case, not whole cases.
    order = []
    for i in range(max(len(c[5]) for c in cases)):
        order += [(c, c[5][i]) for c in cases if i < len(c[5])]

    # Phase 1: compile every variant once and check it against the default (no graph capture here: the
    # FlashInfer thread may be launching kernels).
    checks, refs = {}, {}
    for (tag, kind, tensors, _fn, _, _), (name, settings) in order:
        if time.perf_counter() - t0 > args.budget_s - 40:  # leave time to measure what compiled
            checks[tag, name] = "not compiled: over the time budget"
            continue
        if kind == "states" and tag not in refs:
            refs[tag] = flashinfer_triton.merge_states(*tensors)
        old = apply(settings)
        try:
            if kind == "states":
                out, ref = flashinfer_triton.merge_states(*tensors), refs[tag]
                checks[tag, name] = max(
                    float((out[0].float() - ref[0].float()).abs().max()), float((out[1] - ref[1]).abs().max())
                )
            else:  # in place: run on copies, compare with the default on copies
                v, s, vo, so = tensors
                a = (v.clone(), s.clone())
                apply(old)
                flashinfer_triton.merge_state_in_place(*a, vo, so)
                apply(settings)
                b = (v.clone(), s.clone())
                flashinfer_triton.merge_state_in_place(*b, vo, so)
                checks[tag, name] = max(
                    float((a[0].float() - b[0].float()).abs().max()), float((a[1] - b[1]).abs().max())
                )
        except Exception as exc:
            checks[tag, name] = f"{type(exc).__name__}: {exc}"
        finally:
            apply(old)
    if not SMOKE:
        torch.cuda.synchronize()
    print(f"compiled {len(checks)} variant-cases in {time.perf_counter() - t0:.1f} s", flush=True)
    warm_ok = fi_ready.wait(timeout=max(1.0, args.budget_s - (time.perf_counter() - t0) - 30))
    if not warm_ok:
        # The FlashInfer thread may still launch kernels: no graph capture beside it (cold timings only).
        print("FlashInfer still building: FlashInfer skipped, warm (graph) timings skipped", flush=True)
        flashinfer = None
    if fi_error:
        print("FlashInfer unavailable:", fi_error[0], file=sys.stderr)
    print(f"FlashInfer {'ready' if flashinfer else 'absent'} at {time.perf_counter() - t0:.1f} s", flush=True)

    # Phase 2: time. FlashInfer on every case first, then the variants round-robin, warm and cold.
    result = dict(gpu="cpu-smoke" if SMOKE else torch.cuda.get_device_name(), rows=[], skipped=[])
    rows = {}
    for tag, kind, tensors, _fn, nbytes, _ in cases:
        row = rows[tag] = dict(case=tag, bytes=nbytes, variants={})
        result["rows"].append(row)
        if flashinfer is not None:
            fi_fn = (
                (lambda t=tensors: flashinfer.merge_states(*t))
                if kind == "states"
                else (lambda t=tensors: flashinfer.merge_state_in_place(*t))
            )
            try:
                fi_warm, fi_cold = time_warm(fi_fn), time_cold(fi_fn)
            except Exception as exc:  # pragma: no cover - depends on the machine
                print(f"{tag}: FlashInfer failed: {type(exc).__name__}: {exc}", flush=True)
                torch.cuda.synchronize()
                continue
            if fi_warm is not None:
                row["fi_warm_ms"], row["fi_cold_ms"] = fi_warm, fi_cold
                print(f"{tag}: FI warm {fi_warm * 1e3:.2f} us, cold {fi_cold * 1e3:.2f} us", flush=True)
    for (tag, _, _, fn, nbytes, _), (name, settings) in order:
        row = rows[tag]
        if time.perf_counter() - t0 > args.budget_s:
            result["skipped"].append([tag, name])
            continue
        check = checks.get((tag, name))
        if isinstance(check, str):
            row["variants"][name] = dict(error=check)
            print(f"{tag} {name}: FAILED {check}")
            continue
        old = apply(settings)
        try:
            warm, cold = time_warm(fn) if warm_ok else None, time_cold(fn)
        except Exception as exc:
            row["variants"][name] = dict(error=f"{type(exc).__name__}: {exc}")
            print(f"{tag} {name}: FAILED while timing: {type(exc).__name__}: {exc}", flush=True)
            continue
        finally:
            apply(old)
        rec = dict(warm_ms=warm, cold_ms=cold, max_diff_vs_default=check)
        fi_w, fi_c = row.get("fi_warm_ms"), row.get("fi_cold_ms")
        if fi_w and warm:
            rec["warm_ratio"] = fi_w / warm
            rec["cold_ratio"] = fi_c / cold
        row["variants"][name] = rec
        ratios = f" ratio warm {rec['warm_ratio']:.3f} cold {rec['cold_ratio']:.3f}" if "warm_ratio" in rec else ""
        warm_us = f"{warm * 1e3:7.2f}" if warm else "    n/a"
        print(
            f"{tag:36s} {name:24s} warm {warm_us} us cold {cold * 1e3:7.2f} us"
            f" ({nbytes / cold / 1e6:.0f} GB/s cold){ratios} diff {check:.2g}",
            flush=True,
        )
        if args.out:  # after every variant: a run cut short keeps what it measured
            write_json(args.out, result)
    summarize(result)
    print(f"done in {time.perf_counter() - t0:.1f} s; skipped {len(result['skipped'])}")


def write_json(out_dir, result) -> None:
    with open(os.path.join(out_dir, "merge-variants.json"), "w") as f:
        json.dump(result, f, indent=1)


def summarize(result) -> None:
    """Per case the best variant warm and cold; per variant its worst ratio over the cases it ran on."""
    worst = {}
    print("summary (ratio = FlashInfer time / ours; >= 1.0 is the target):")
    for row in result["rows"]:
        timed = {n: r for n, r in row["variants"].items() if "cold_ms" in r}
        if not timed:
            continue
        best_w = min(((r["warm_ms"], n) for n, r in timed.items() if r.get("warm_ms")), default=(0.0, "n/a"))
        best_c = min((r["cold_ms"], n) for n, r in timed.items())
        line = f"  {row['case']:40s} best warm {best_w[1]} {best_w[0] * 1e3:.2f} us,"
        line += f" cold {best_c[1]} {best_c[0] * 1e3:.2f} us"
        if "fi_warm_ms" in row:
            line += f" (FI {row['fi_warm_ms'] * 1e3:.2f} / {row['fi_cold_ms'] * 1e3:.2f} us)"
        print(line)
        for n, r in timed.items():
            if "warm_ratio" in r:
                worst[n] = min(worst.get(n, 9.9), r["warm_ratio"], r["cold_ratio"])
    for n, w in sorted(worst.items(), key=lambda x: -x[1]):
        print(f"  variant {n:22s} worst ratio over its cases {w:.3f}")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="default tiles only (with and without streaming hints)")
    ap.add_argument("--variants", action="store_true", help="session-5 kernel variants, warm and cold")
    ap.add_argument("--only", nargs="*", help="with --variants: these variant names only")
    ap.add_argument("--budget-s", type=float, default=95.0, help="with --variants: stop timing after this")
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--cpu-smoke", action="store_true", help="with --variants: tiny cases, interpreter")
    args = ap.parse_args(argv)
    if args.cpu_smoke:
        global SMOKE
        SMOKE = True
        args.no_flashinfer = True
    if args.variants:
        run_variants(args)
        return
    try:
        import flashinfer
    except Exception:  # pragma: no cover - depends on the machine
        flashinfer = None
    gen = torch.Generator(device="cuda").manual_seed(3)
    result = []
    default_states, default_pair = _merge_impl._states_config, _merge_impl._pair_config
    for n, k, h, d in MERGE_CASES:
        v = torch.randn(n, k, h, d, dtype=torch.float16, device="cuda", generator=gen)
        s = torch.randn(n, k, h, dtype=torch.float32, device="cuda", generator=gen) * 4
        nbytes = v.numel() * 2 + s.numel() * 4 + n * h * d * 2 + n * h * 4
        ref_v, ref_s = flashinfer_triton.merge_states(v, s)
        rows = []
        for bk in () if args.quick else (1, 2, 4, 8, 16):
            if bk > 2 * k:
                continue
            for bh in (1, 2, 4, 8, 16, 32):
                if bh > h or bk * bh * d > 16384:
                    continue
                for nw in (1, 2, 4, 8):
                    if bk * bh * d < 256 * nw or bk * bh * d > 4096 * nw:
                        continue
                    _merge_impl._states_config = lambda *a, c=(bk, bh, d, nw): c
                    out_v, out_s = flashinfer_triton.merge_states(v, s)
                    ok = torch.equal(out_v, ref_v) and torch.equal(out_s, ref_s)
                    ms = graph_ms(lambda v=v, s=s: flashinfer_triton.merge_states(v, s))
                    rows.append(dict(cfg=[bk, bh, nw], ms=ms, gbps=nbytes / ms / 1e6, same=ok))
        _merge_impl._states_config = default_states
        default_cfg = list(default_states(n, h, d, k))
        default_ms = graph_ms(lambda v=v, s=s: flashinfer_triton.merge_states(v, s))
        hints = _merge_impl.STREAM_HINTS, _merge_impl.FIXED_STREAM_HINTS
        _merge_impl.STREAM_HINTS = _merge_impl.FIXED_STREAM_HINTS = not hints[0]
        stream_ms = graph_ms(lambda v=v, s=s: flashinfer_triton.merge_states(v, s))
        _merge_impl.STREAM_HINTS, _merge_impl.FIXED_STREAM_HINTS = hints
        fi_ms = graph_ms(lambda v=v, s=s: flashinfer.merge_states(v, s)) if flashinfer is not None else None
        rows.sort(key=lambda r: r["ms"])
        tag = f"merge_states N{n}-K{k}-H{h}-D{d}"
        print(
            f"{tag}: default {default_cfg} {default_ms * 1e3:.1f} us (hints toggled {stream_ms * 1e3:.1f} us),"
            f" FI {fi_ms and fi_ms * 1e3:.1f} us"
        )
        for r in rows[:6]:
            print(f"   {r['cfg']} {r['ms'] * 1e3:.1f} us {r['gbps']:.0f} GB/s same={r['same']}")
        result.append(
            dict(
                case=tag,
                default=default_cfg,
                default_ms=default_ms,
                stream_ms=stream_ms,
                flashinfer_ms=fi_ms,
                sweep=rows,
            )
        )
    for n, h, d in MERGE_PAIR_CASES:
        v = torch.randn(n, h, d, dtype=torch.float16, device="cuda", generator=gen)
        s = torch.randn(n, h, dtype=torch.float32, device="cuda", generator=gen) * 4
        vo = torch.randn(n, h, d, dtype=torch.float16, device="cuda", generator=gen)
        so = torch.randn(n, h, dtype=torch.float32, device="cuda", generator=gen) * 4
        nbytes = 3 * v.numel() * 2 + 3 * s.numel() * 4
        rows = []
        for br in () if args.quick else (1, 2, 4, 8, 16, 32, 64, 128):
            for nw in (1, 2, 4, 8):
                if br * d < 256 * nw or br * d > 8192 * nw:
                    continue
                _merge_impl._pair_config = lambda *a, c=(br, d, nw): c
                ms = graph_ms(lambda v=v, s=s, vo=vo, so=so: flashinfer_triton.merge_state_in_place(v, s, vo, so))
                rows.append(dict(cfg=[br, nw], ms=ms, gbps=nbytes / ms / 1e6))
        _merge_impl._pair_config = default_pair
        default_cfg = list(default_pair(d, n * h))
        default_ms = graph_ms(lambda v=v, s=s, vo=vo, so=so: flashinfer_triton.merge_state_in_place(v, s, vo, so))
        hints = _merge_impl.PAIR_STREAM_HINTS
        _merge_impl.PAIR_STREAM_HINTS = not hints
        stream_ms = graph_ms(lambda v=v, s=s, vo=vo, so=so: flashinfer_triton.merge_state_in_place(v, s, vo, so))
        _merge_impl.PAIR_STREAM_HINTS = hints
        fi_ms = None
        if flashinfer is not None:
            fi_ms = graph_ms(lambda v=v, s=s, vo=vo, so=so: flashinfer.merge_state_in_place(v, s, vo, so))
        rows.sort(key=lambda r: r["ms"])
        tag = f"merge_state_in_place N{n}-H{h}-D{d}"
        print(
            f"{tag}: default {default_cfg} {default_ms * 1e3:.1f} us (hints toggled {stream_ms * 1e3:.1f} us),"
            f" FI {fi_ms and fi_ms * 1e3:.1f} us"
        )
        for r in rows[:6]:
            print(f"   {r['cfg']} {r['ms'] * 1e3:.1f} us {r['gbps']:.0f} GB/s")
        result.append(
            dict(
                case=tag,
                default=default_cfg,
                default_ms=default_ms,
                stream_ms=stream_ms,
                flashinfer_ms=fi_ms,
                sweep=rows,
            )
        )
    if args.out:
        path = os.path.join(args.out, "merge-sweep.json")
        with open(path, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), rows=result), f, indent=1)
        print("wrote", path)


if __name__ == "__main__":
    main()
