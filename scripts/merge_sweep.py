"""Tile sweep of the merge kernels on the GPU, ours against FlashInfer, both replayed from CUDA graphs.

    PYTHONPATH=/tmp/peers:src python3 scripts/merge_sweep.py [--out DIR]

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


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="default tiles only (with and without streaming hints)")
    args = ap.parse_args(argv)
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
        hints = _merge_impl.STREAM_HINTS
        _merge_impl.STREAM_HINTS = not hints
        stream_ms = graph_ms(lambda v=v, s=s: flashinfer_triton.merge_states(v, s))
        _merge_impl.STREAM_HINTS = hints
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
