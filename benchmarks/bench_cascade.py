"""Shared-prefix decode (cascade) and merge_states: ours (Triton) against FlashInfer.

Shared prefix (docs/cascade.md): ``batch`` decode requests share ``shared`` prefix tokens and own
``unique`` tokens each; 32 query / 8 KV heads, head dim 128, fp16, page size 16, NHD. Peers, timed in
the same process on the same GPU: FlashInfer's plain decode and tensor-core decode over each request's
whole page list, FlashInfer's ``MultiLevelCascadeAttentionWrapper`` (2 levels), and ours (2 levels,
plus our plain batch decode for context). Lower ms is better; ``ratio = flashinfer_ms / ours_ms``.

merge_states: ``v [N, K, H, D]`` fp16 and ``s [N, K, H]`` float32 merged to ``[N, H, D]`` / ``[N, H]``;
GB/s counts the inputs read once and the outputs written once. merge_state_in_place likewise.

Timing: ``*_ms`` is ``_common.bench``'s median (``triton.testing.do_bench``'s method with the host's time kept out)
with the L2 flushed before each eager call;
``*_graph_ms`` is the same ``run()`` captured in one CUDA graph (no host overhead, no flush; the
cascade KV is 128 MB or more, larger than the L2). Plans are made once, outside the timing.

Run: ``PYTHONPATH=src python3 benchmarks/bench_cascade.py [--out DIR] [--skip-merge] [--skip-context] [--variants]
[--no-flashinfer] [--fi-recorded RESULTS.json] [--fi-build-only DONE_FILE]``; writes ``<DIR>/<gpu>/cascade.json``
(default DIR: benchmarks/results). FlashInfer is optional: without it (or with ``--no-flashinfer``) ours is timed
alone, and ``--fi-recorded`` fills the peer columns from an earlier side-by-side run's JSON (marked as recorded).
``--variants`` also times our fused plan at 2, 4, 6 and 8 split waves (``_config.CascadeConfig``) and the per-level
path. ``--fi-build-only`` builds, all at once, the FlashInfer JIT modules the run would use (``fi_variants``), then
writes DONE_FILE; nothing is timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
from bench_page import (  # noqa: E402
    host_time_us,
    load_flashinfer,
    meta_info,
    ratio,
    recorded_flashinfer,
    time_eager,
    time_graph,
    write_json,
)

import flashinfer_triton  # noqa: E402
from flashinfer_triton.testing import CASCADE_CASES, shared_prefix_inputs  # noqa: E402

# The shared-prefix rows (shared with the GPU test that checks each against the reference) all have these heads,
# head dim and page size.
HQ, HKV, D, PAGE = 32, 8, 128, 16
if any(c[3:7] != (HQ, HKV, D, PAGE) or c.dtype != torch.float16 for c in CASCADE_CASES):
    raise RuntimeError("CASCADE_CASES: every row must be 32/8 heads, head dim 128, page size 16, fp16")
MERGE_CASES = [(64, 16, 32, 128), (512, 8, 32, 128), (4096, 2, 32, 128), (4096, 8, 32, 128), (16384, 2, 8, 128)]
MERGE_PAIR_CASES = [(64, 32, 128), (4096, 32, 128), (32768, 32, 128)]


def merge_cases():
    """``[(op, shape)]``: the merge rows, merge_states then merge_state_in_place."""
    return [("merge_states", c) for c in MERGE_CASES] + [("merge_state_in_place", c) for c in MERGE_PAIR_CASES]


def plan_cascade(module, levels, workspace, fused=True):
    """A two-level cascade wrapper planned for ``levels``; ``fused=False``: ours planned on the per-level path."""
    from flashinfer_triton import _config

    # (the plan keeps the configuration it was built with)
    override = {} if fused else {"cascade": dataclasses.replace(_config.CASCADE, fused=False)}
    with _config.using(**override):
        w = module.MultiLevelCascadeAttentionWrapper(2, workspace, "NHD")
        w.plan(
            levels["qo_indptr"], levels["kv_indptr"], levels["kv_indices"], levels["last_page_len"],
            HQ, HKV, D, PAGE, q_data_type=torch.float16, kv_data_type=torch.float16,
        )  # fmt: skip
    return w


def plan_decode(module, flat, workspace, use_tensor_cores):
    w = module.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=use_tensor_cores)
    w.plan(
        flat["indptr"], flat["indices"], flat["last_page_len"], HQ, HKV, D, PAGE,
        q_data_type=torch.float16, kv_data_type=torch.float16,
    )  # fmt: skip
    return w


def fmt(x, w=9, p=4):
    return f"{x:>{w}.{p}f}" if x is not None else f"{'-':>{w}s}"


def runner(wrapper, q, cache):
    return lambda: wrapper.run(q, cache)


def timed(label, fn):
    """Eager and graph milliseconds of ``fn``; a failure is printed and gives (None, None)."""
    try:
        fn()
        torch.cuda.synchronize()
        return time_eager(fn), time_graph([fn])
    except Exception as exc:
        print(f"  {label} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        torch.cuda.synchronize()
        return None, None


def bench_variants(levels, q, cache, workspace, tag, rows):
    """Ours only: the fused plan at several split factors, and the per-level path (one launch per level)."""
    from flashinfer_triton import _config

    for waves, rows_knob in ((2, None), (4, None), (6, None), (8, None), ("per-level", None)):
        if waves == "per-level":
            cfg = _config.CascadeConfig(fused=False)
        else:
            cfg = _config.CascadeConfig(split_waves=waves, tile_rows=rows_knob)
        with _config.using(cascade=cfg):
            w = plan_cascade(flashinfer_triton, levels, workspace)
        fn = runner(w, q, cache)
        ms, graph = timed(f"ours variant {waves}", fn)
        host = host_time_us(fn)
        label = f"waves={waves}" if waves != "per-level" else "per-level launches"
        if rows_knob:
            label += f" tile-rows<={rows_knob}"
        fused = w.plan_info().fused
        if fused is not None:
            part_o = fused.arrays.get("part_o")
            slots = part_o.shape[0] // max(1, q.shape[0]) if part_o is not None else 1
            label += f" (BLOCK_M {fused.config.block_m}, {fused.details['grid0']} items, {slots} slots/row)"
        rows.append(
            dict(
                case=f"variant cascade {tag} ours {label}",
                ours_ms=None if ms is None else round(ms, 5),
                ours_graph_ms=None if graph is None else round(graph, 5),
                ours_host_us=round(host, 1),
                note="ours only (tuning); no peer",
            )
        )
        print(f"  variant {label:48s} eager {fmt(ms)} graph {fmt(graph)} host us {host:8.1f}")


def bench_cascade(flashinfer, rows, *, context=True, variants=False, recorded=None):
    print(f"{'shared-prefix case':44s} {'ours ms':>9s} {'peer ms':>9s} {'ratio':>6s} {'ours gr':>9s} {'peer gr':>9s}")
    workspace_ours = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    workspace_fi = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    for case in CASCADE_CASES:
        tag = case.name
        cache, q, levels, flat = shared_prefix_inputs(case)
        ours = plan_cascade(flashinfer_triton, levels, workspace_ours)
        ours_ms, ours_graph = timed("ours cascade", runner(ours, q, cache))
        ours_host = host_time_us(runner(ours, q, cache))
        print(f"  ours host time per run(): {ours_host:.1f} us (fused plan: {ours.plan_info().fused is not None})")
        per_level = plan_cascade(flashinfer_triton, levels, workspace_ours, fused=False)
        diff_levels = float((ours.run(q, cache).float() - per_level.run(q, cache).float()).abs().max())
        print(f"  max |fused - per-level| = {diff_levels:.3g}")
        del per_level
        if variants:
            bench_variants(levels, q, cache, workspace_ours, tag, rows)
        peers = {}
        if context:
            ours_decode = plan_decode(flashinfer_triton, flat, workspace_ours, False)
            peers["ours plain decode (context)"] = timed("ours decode", runner(ours_decode, q, cache))
        if flashinfer is None and recorded:
            for peer in ("FI MultiLevelCascadeAttentionWrapper", "FI plain decode", "FI tensor-core decode"):
                rec = recorded.get(f"cascade {tag} vs {peer}")
                if rec is not None:
                    peers[peer + " (recorded)"] = (rec.get("flashinfer_ms"), rec.get("flashinfer_graph_ms"))
        max_diff = None
        if flashinfer is not None:
            fi_cascade = plan_cascade(flashinfer, levels, workspace_fi)
            peers["FI MultiLevelCascadeAttentionWrapper"] = timed("FI cascade", runner(fi_cascade, q, cache))
            try:
                max_diff = float((ours.run(q, cache).float() - fi_cascade.run(q, cache).float()).abs().max())
            except Exception as exc:
                print(f"  output comparison failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            fi_decode = plan_decode(flashinfer, flat, workspace_fi, False)
            peers["FI plain decode"] = timed("FI decode", runner(fi_decode, q, cache))
            fi_tc = plan_decode(flashinfer, flat, workspace_fi, True)
            peers["FI tensor-core decode"] = timed("FI tc decode", runner(fi_tc, q, cache))
        for peer, (peer_ms, peer_graph) in peers.items():
            row = dict(
                case=f"cascade {tag} vs {peer}",
                ours_ms=None if ours_ms is None else round(ours_ms, 5),
                flashinfer_ms=None if peer_ms is None else round(peer_ms, 5),
                ratio=ratio(peer_ms, ours_ms),
                ours_graph_ms=None if ours_graph is None else round(ours_graph, 5),
                flashinfer_graph_ms=None if peer_graph is None else round(peer_graph, 5),
                graph_ratio=ratio(peer_graph, ours_graph),
                max_abs_diff_vs_fi_cascade=max_diff,
                ours_host_us=round(ours_host, 1),
                max_abs_diff_fused_vs_per_level=diff_levels,
            )
            if peer.endswith("(recorded)"):
                row["note"] = "FlashInfer time recorded by an earlier side-by-side run (--fi-recorded), not re-measured"
            if peer.startswith("ours"):
                row["note"] = "peer column is our own plain batch decode, not FlashInfer"
            rows.append(row)
            print(
                f"{tag + ' / ' + peer[:18]:44s} {fmt(ours_ms)} {fmt(peer_ms)} {fmt(row['ratio'], 6, 2)}"
                f" {fmt(ours_graph)} {fmt(peer_graph)}"
            )
        if max_diff is not None:
            print(f"  max |ours - FI cascade| = {max_diff:.3g}")


def bench_merge(flashinfer, rows):
    print(f"{'merge case':40s} {'ours ms':>9s} {'FI ms':>9s} {'ratio':>6s} {'ours GB/s':>10s} {'FI GB/s':>9s}")
    gen = torch.Generator(device="cuda").manual_seed(3)
    for op, shape in merge_cases():
        if op == "merge_states":
            n, k, h, d = shape
            v = torch.randn(n, k, h, d, dtype=torch.float16, device="cuda", generator=gen)
            s = torch.randn(n, k, h, dtype=torch.float32, device="cuda", generator=gen) * 4
            nbytes = v.numel() * 2 + s.numel() * 4 + n * h * d * 2 + n * h * 4
            tag = f"merge_states N{n}-K{k}-H{h}-D{d}"
            make = lambda mod, v=v, s=s: lambda: mod.merge_states(v, s)
        else:
            n, h, d = shape
            v = torch.randn(n, h, d, dtype=torch.float16, device="cuda", generator=gen)
            s = torch.randn(n, h, dtype=torch.float32, device="cuda", generator=gen) * 4
            vo = torch.randn(n, h, d, dtype=torch.float16, device="cuda", generator=gen)
            so = torch.randn(n, h, dtype=torch.float32, device="cuda", generator=gen) * 4
            # in place: v and s read and written, the other state read
            nbytes = 3 * v.numel() * 2 + 3 * s.numel() * 4
            tag = f"merge_state_in_place N{n}-H{h}-D{d}"
            make = lambda mod, v=v, s=s, vo=vo, so=so: lambda: mod.merge_state_in_place(v, s, vo, so)
        ours_ms, ours_graph = timed(f"ours {op}", make(flashinfer_triton))
        fi_ms = fi_graph = None
        if flashinfer is not None:
            fi_ms, fi_graph = timed(f"FI {op}", make(flashinfer))
        gbps = lambda ms, nbytes=nbytes: None if ms is None else round(nbytes / ms / 1e6, 1)
        row = dict(
            case=tag,
            ours_ms=None if ours_ms is None else round(ours_ms, 5),
            flashinfer_ms=None if fi_ms is None else round(fi_ms, 5),
            ratio=ratio(fi_ms, ours_ms),
            ours_gbps=gbps(ours_ms),
            flashinfer_gbps=gbps(fi_ms),
            ours_graph_ms=None if ours_graph is None else round(ours_graph, 5),
            flashinfer_graph_ms=None if fi_graph is None else round(fi_graph, 5),
            graph_ratio=ratio(fi_graph, ours_graph),
            bytes=nbytes,
        )
        if op == "merge_states":
            # As an engine runs it: the states were just written (by the attention launches that made them), then
            # merged once. A graph of (write the states, merge) minus a graph of the write alone; the write copies
            # from a second random buffer, so the states sit in L2 dirty, as attention leaves them.
            v_src, s_src = torch.randn_like(v), torch.randn_like(s) * 4

            def write(v=v, s=s, v_src=v_src, s_src=s_src):
                v.copy_(v_src)
                s.copy_(s_src)

            def after(mod, v=v, s=s, write=write):
                def fn():
                    write()
                    mod.merge_states(v, s)

                return fn

            w_ms = time_graph([write])
            for key, mod in (("ours", flashinfer_triton), ("flashinfer", flashinfer)):
                t = None if mod is None or w_ms is None else time_graph([after(mod)])
                row[f"{key}_after_write_ms"] = None if t is None else round(t - w_ms, 5)
            row["write_ms"] = None if w_ms is None else round(w_ms, 5)
            row["after_write_ratio"] = ratio(row["flashinfer_after_write_ms"], row["ours_after_write_ms"])
            print(f"  after a write of the states: ours {fmt(row['ours_after_write_ms'])} FI "
                  f"{fmt(row['flashinfer_after_write_ms'])} ratio {fmt(row['after_write_ratio'], 6, 2)} "
                  f"(write alone {fmt(w_ms)} ms)")  # fmt: skip
            vo_ours, so_ours = flashinfer_triton.merge_states(v, s)
            if flashinfer is not None:
                vo_fi, so_fi = flashinfer.merge_states(v, s)
                row["max_abs_diff_v"] = float((vo_ours.float() - vo_fi.float()).abs().max())
                row["max_abs_diff_s"] = float((so_ours - so_fi).abs().max())
        rows.append(row)
        print(
            f"{tag:40s} {fmt(ours_ms)} {fmt(fi_ms)} {fmt(row['ratio'], 6, 2)} {fmt(row['ours_gbps'], 10, 0)}"
            f" {fmt(row['flashinfer_gbps'], 9, 0)}"
        )


def fi_variants(cascade: bool = True, merge: bool = True) -> list:
    """``[(key, (kind, arg))]``: one per FlashInfer JIT module the timed run uses. Shared-prefix rows: its cascade
    wrapper (a batch prefill module per (dtype, head dim)) and its decode with and without tensor cores (one module
    each per (dtype, head dim)); ``arg`` is a small row of the same heads, head dim, page size and dtype. Merge
    rows: one call per function (one cascade-ops module)."""
    seen, out = set(), []

    def add(key, item):
        if key not in seen:
            seen.add(key)
            out.append((key, item))

    for case in CASCADE_CASES if cascade else []:
        small = case._replace(batch=2, shared=2 * case.page_size, unique=case.page_size + 1)
        dims = (str(case.dtype)[6:], case.head_dim)
        add(("cascade", *dims), ("cascade", (small, None)))
        for tc in (False, True):
            add(("tensor-core decode" if tc else "decode", *dims), ("decode", (small, tc)))
    for op, shape in merge_cases() if merge else []:
        add((op,), (op, shape))
    return out


def fi_build_only(done_file: str, cascade: bool = True, merge: bool = True, device="cuda") -> None:
    """Build the FlashInfer modules of the run at once, each by one small call (see ``fi_variants``)."""
    flashinfer = load_flashinfer()
    if flashinfer is None:
        return C.fi_absent(done_file)

    def call(item):
        kind, arg = item
        if kind in ("cascade", "decode"):
            small, tc = arg  # tc: None for the cascade wrapper, else the decode's use_tensor_cores
            cache, q, levels, flat = shared_prefix_inputs(small, device=device)
            ws = torch.empty(16 << 20, dtype=torch.uint8, device=device)
            w = plan_cascade(flashinfer, levels, ws) if tc is None else plan_decode(flashinfer, flat, ws, tc)
            w.run(q, cache)
            return
        h, d = arg[-2:]
        v = torch.randn(4, *arg[1:-2], h, d, dtype=torch.float16, device=device)
        s = torch.randn(v.shape[:-1], dtype=torch.float32, device=device)
        if kind == "merge_states":
            flashinfer.merge_states(v, s)
        else:
            flashinfer.merge_state_in_place(v, s, torch.randn_like(v), torch.randn_like(s))

    C.fi_prebuild(done_file, fi_variants(cascade, merge), call)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--skip-merge", action="store_true")
    parser.add_argument("--skip-cascade", action="store_true")
    parser.add_argument("--skip-context", action="store_true", help="do not time our plain batch decode")
    parser.add_argument("--variants", action="store_true", help="ours only: split factors and per-level path")
    parser.add_argument("--no-flashinfer", action="store_true", help="time ours only")
    parser.add_argument("--fi-recorded", help="a results JSON whose FlashInfer times fill the peer columns")
    parser.add_argument("--fi-build-only", metavar="DONE_FILE", help="only build FlashInfer's JIT modules")
    args = parser.parse_args()
    if args.fi_build_only:
        fi_build_only(args.fi_build_only, cascade=not args.skip_cascade, merge=not args.skip_merge)
        return
    flashinfer = None if args.no_flashinfer else load_flashinfer()
    recorded = recorded_flashinfer(args.fi_recorded)
    rows = []
    if not args.skip_cascade:
        bench_cascade(flashinfer, rows, context=not args.skip_context, variants=args.variants, recorded=recorded)
    if not args.skip_merge:
        bench_merge(flashinfer, rows)
    path = write_json("cascade", rows, meta_info(flashinfer), args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
