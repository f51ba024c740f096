"""Batch decode: ours (public BatchDecodeWithPagedKVCacheWrapper) beside FlashInfer's, in TB/s.

bytes = the whole KV cache read once + q read + o written. FlashInfer runs with use_tensor_cores False
and True; the better of the two is the baseline of ``ratio = flashinfer_ms / ours_ms``. Also: host time
of ``plan()`` for batch 256, the first call of a new variant with a cold Triton cache, the merge kernels
beside a device copy of the same bytes, and (``--sweep``) tile/split configurations of our kernel.

    PYTHONPATH=src python benchmarks/bench_decode.py [--sweep] [--sweep-set wide] [--sweep-cases NAME,...]
        [--out DIR] [--no-flashinfer] [--cases 1x32768,...] [--graph] [--engine] [--merge-small] [--skip-cold]
        [--skip-plan]
    PYTHONPATH=src python benchmarks/bench_decode.py --fi-build-only DONE_FILE [--cases ...]   # warm FlashInfer's JIT
    PYTHONPATH=src python benchmarks/bench_decode.py --resources [--group 4] [--d 128] [--ps 16] [--lse] ...

``--graph`` also times each case's ``run()`` replayed from a CUDA graph (the GPU's own time: no host
overhead and no L2 flush; the eager figures, ``_common.bench``'s, keep the host's time out but flush L2).
``--engine``: the serving engine's graph-mode decode (SmolLM2 shape, 30 layers in one graph, short
contexts) in microseconds per layer, plus plan() and run() host times. ``--merge-small``: the
cascade bench's merge rows (eager, graph and host microseconds). ``--resources`` (no GPU needed): the Gluon
decode kernel compiled for sm_90a, its registers, shared memory, spills and SASS counts
(``_gluon_resources.py``). ``--fi-build-only`` builds, all at once, the FlashInfer JIT modules the run would use
(one per dtype, head dim and decode kind: ``fi_variants``), then writes DONE_FILE; nothing is timed.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

from flashinfer_triton.testing import DECODE_CASES, DecodeCase, decode_inputs  # noqa: E402

# The timed rows, shared with the GPU test that checks each against the reference at the same shape.
CASES = DECODE_CASES

# Tile / split / merge configurations tried with --sweep on the split rows (B x Hkv < 2 waves of SMs):
# (label, DecodeConfig fields replaced in the configuration ``_decode_impl.choose_config`` picks)
SWEEP = [
    ("t2", dict(split_target_waves=2.0)),
    ("t3", dict(split_target_waves=3.0)),
    ("t6", dict(split_target_waves=6.0)),
    ("mk8", dict(merge_max_k=8)),
    ("n32w4s4", dict(block_n=32, num_warps=4, num_stages=4)),
    ("n32w4s4-t3", dict(block_n=32, num_warps=4, num_stages=4, split_target_waves=3.0)),
    ("n16w8s3", dict(block_n=16, num_warps=8, num_stages=3)),
    ("n32w8s2", dict(block_n=32, num_warps=8, num_stages=2)),
]


def _gluon(**fields):
    """The Gluon decode configuration with head dim 256 and ``fields`` (plans="all": every plan of a covered
    variant, split or not)."""
    from flashinfer_triton import _config

    return replace(_config.GluonDecodeConfig(), head_dims=(64, 128, 256), **{"plans": "all", **fields})


# ``--sweep-set wide``: head dim 256, the Triton kernel's tiles and split rule, and the Gluon kernel (one program
# per SM) with its ring shapes and split targets.
SWEEP_WIDE = [
    ("nosplit", dict(split_min_waves=0.9)),
    ("t4", dict(split_target_waves=4.0)),
    ("n64w8s2", dict(block_n=64, num_warps=8, num_stages=2)),
    ("n32w4s3", dict(block_n=32, num_warps=4, num_stages=3)),
    ("n32w8s4", dict(block_n=32, num_warps=8, num_stages=4)),
    ("n16w4s4", dict(block_n=16, num_warps=4, num_stages=4)),
    ("g32x4", dict(gluon=_gluon())),
    ("g32x4-w2", dict(gluon=_gluon(split_waves=2.0))),
    ("g32x6", dict(gluon=_gluon(stages_d256=6))),
    ("g64x3", dict(block_n=64, gluon=_gluon(block_n_d256=64, stages_d256=3))),
    ("g64x2-w2", dict(block_n=64, gluon=_gluon(block_n_d256=64, stages_d256=2, split_waves=2.0))),
]


def _gluon_d128(**fields):
    from flashinfer_triton import _config

    return replace(_config.GluonDecodeConfig(), **fields)


# ``--sweep-set few``: batches of one to two programs per SM (B x Hkv from SMs to 2 x SMs): the Triton kernel with
# its split rule (two pieces a request here) and the Gluon kernel split to two programs per SM.
SWEEP_FEW = [
    ("triton", dict(gluon=_gluon_d128(plans="none"))),
    ("g-w2", dict(gluon=_gluon_d128(split_waves=2.0))),
]
SWEEPS = {"default": SWEEP, "wide": SWEEP_WIDE, "few": SWEEP_FEW}


def _error(exc: Exception, limit: int = 200) -> str:
    """An exception for the results file: its type and message, file paths cut to their last part (a JIT's
    generated sources are named after the variant; the directories are the machine's)."""
    msg = re.sub(r"(?:/[^/\s]+)+/", "", str(exc))
    return f"{type(exc).__name__}: {msg[:limit]}"


def build(case, device, seed=0):
    """Caches (rotating copies), shuffled page table, q for one case (a ``DecodeCase`` or its fields)."""
    case = DecodeCase(*case)
    cache_bytes = 2 * -(-case.kv_len // case.page_size) * case.batch * case.page_size * case.num_kv_heads
    cache_bytes *= case.head_dim * case.dtype.itemsize
    data = decode_inputs(case, device, seed=seed, copies=C.num_rotations(cache_bytes))
    data["nbytes"] = C.decode_bytes(
        case.batch, case.kv_len, case.num_qo_heads, case.num_kv_heads, case.head_dim, case.dtype.itemsize,
        case.dtype.itemsize,
    )  # fmt: skip
    return data


def ours_wrapper(case, data, ws):
    import flashinfer_triton as fit

    name, bsz, kv_len, hq, hkv, d, ps, dtype = case
    w = fit.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    w.plan(data["indptr"], data["indices"], data["last"], hq, hkv, d, ps, q_data_type=dtype, kv_data_type=dtype)
    return w


def time_ours(case, data, ws):
    w = ours_wrapper(case, data, ws)
    q = data["q"]
    fns = [lambda kv=kv: w.run(q, kv) for kv in data["caches"]]
    out = w.run(q, data["caches"][0])
    return C.bench(C.rotating(fns)), out


def time_graph(w, q, caches):
    """Median ms of run() replayed from CUDA graphs (one graph per cache copy, replayed in turn)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for kv in caches:
            w.run(q, kv)
    torch.cuda.current_stream().wait_stream(stream)
    graphs = []
    for kv in caches:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            w.run(q, kv)
        graphs.append(g)
    return C.bench(C.rotating([g.replay for g in graphs]))


def flashinfer_wrapper(fi, case, data, ws, tc):
    """FlashInfer's decode wrapper planned for one case (``tc``: its tensor-core decode)."""
    name, bsz, kv_len, hq, hkv, d, ps, dtype = case
    w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
    w.plan(data["indptr"], data["indices"], data["last"], hq, hkv, d, ps, q_data_type=dtype, kv_data_type=dtype)
    return w


def time_flashinfer(fi, case, data, ws, tc):
    w = flashinfer_wrapper(fi, case, data, ws, tc)
    q = data["q"]
    fns = [lambda kv=kv: w.run(q, kv) for kv in data["caches"]]
    out = w.run(q, data["caches"][0])
    return C.bench(C.rotating(fns)), out


def select_cases(spec: str | None) -> list:
    """The rows named in the comma-separated ``spec`` (a name or its first words; all when None)."""
    if not spec:
        return list(CASES)
    wanted = [c.strip() for c in spec.split(",") if c.strip()]
    return [c for c in CASES if any(c[0] == w or c[0].startswith(w + " ") for w in wanted)]


TABLE_COLUMNS = ["case", "ours_ms", "ours_tbps", "ours_graph_ms", "ours_graph_tbps", "fi_tbps", "fi_tc_tbps", "ratio",
                 "best_sweep", "best_sweep_tbps"]  # fmt: skip


def decode_table(args, fi, device, meta):
    from flashinfer_triton import _decode_impl as impl

    ws = torch.empty(128 << 20, dtype=torch.uint8, device=device)
    fi_ws = torch.empty(128 << 20, dtype=torch.uint8, device=device)
    rows = []
    for case in select_cases(args.cases):
        name = case[0]
        data = build(case, device)
        ms, out = time_ours(case, data, ws)
        row = dict(case=name, ours_ms=ms, ours_tbps=C.tbps(data["nbytes"], ms), bytes=data["nbytes"])
        if args.graph:
            try:
                gms = time_graph(ours_wrapper(case, data, ws), data["q"], data["caches"])
                row["ours_graph_ms"] = gms
                row["ours_graph_tbps"] = C.tbps(data["nbytes"], gms)
            except Exception as exc:
                row["ours_graph_error"] = _error(exc)
        split_row = case[1] * case[4] < 2 * meta.get("sms", 132)
        # (the split rows by default; --sweep-cases names rows to sweep whether they split or not)
        swept = name in args.sweep_cases.split(",") if args.sweep_cases else split_row
        if args.sweep and swept:
            sweep, sweep_graph = {}, {}
            for label, fields in SWEEPS[args.sweep_set]:
                chosen = impl.choose_config
                # plan() takes the module's choose_config: swap in one that replaces the swept fields.
                impl.choose_config = lambda opts, chosen=chosen, fields=fields: replace(chosen(opts), **fields)
                try:
                    w = ours_wrapper(case, data, ws)
                    q = data["q"]
                    fns = [lambda kv=kv, w=w, q=q: w.run(q, kv) for kv in data["caches"]]
                    sweep[label] = C.bench(C.rotating(fns), warmup=10, rep=40)
                    if args.graph:
                        sweep_graph[label] = time_graph(w, q, data["caches"])
                except Exception as exc:  # a config that does not compile is reported, not fatal
                    sweep[label] = _error(exc, 120)
                finally:
                    impl.choose_config = chosen
            row["sweep_ms"] = sweep
            if sweep_graph:
                row["sweep_graph_ms"] = sweep_graph
            best = min(((v, k) for k, v in (sweep_graph or sweep).items() if isinstance(v, float)), default=None)
            if best is not None:
                row["best_sweep"] = best[1]
                row["best_sweep_tbps"] = C.tbps(data["nbytes"], best[0])
            print("[sweep]", name, {k: round(v * 1e3, 1) if isinstance(v, float) else v for k, v in sweep.items()},
                  "graph us:", {k: round(v * 1e3, 1) for k, v in sweep_graph.items()}, flush=True)  # fmt: skip
        if fi is not None:
            for tc in (False, True):
                key = "fi_tc" if tc else "fi"
                try:
                    t0 = time.perf_counter()
                    fms, fout = time_flashinfer(fi, case, data, fi_ws, tc)
                    row[f"{key}_wall_s"] = time.perf_counter() - t0
                    row[f"{key}_ms"] = fms
                    row[f"{key}_tbps"] = C.tbps(data["nbytes"], fms)
                    row[f"{key}_maxdiff"] = float((fout.float() - out.float()).abs().max())
                except Exception as exc:
                    row[f"{key}_error"] = _error(exc)
            fis = [row[k] for k in ("fi_ms", "fi_tc_ms") if k in row]
            if fis:
                row["flashinfer_ms"] = min(fis)
                row["ratio"] = row["flashinfer_ms"] / ms
        rows.append(row)
        C.write_json("decode", rows, meta, args.out)  # partial results survive a timeout
        C.print_table([row], TABLE_COLUMNS)
        del data
        torch.cuda.empty_cache()
    return rows


# plan()'s host time is measured on this shape (FlashInfer's plan() called without dtypes: fp16, its default).
PLAN_CASE = DecodeCase("plan 256x1024", 256, 1024, 32, 8, 128, 16, torch.float16)


def plan_timing(fi, device):
    """Host time of plan() for batch 256 x 1024 (page 16), index tensors on the GPU and on the CPU."""
    import flashinfer_triton as fit

    case = PLAN_CASE
    data = build(case, device)
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=device)
    out = {}
    for where in ("cuda", "cpu"):
        sfx = "" if where == "cuda" else "_cpu"
        args = (data["indptr" + sfx], data["indices" + sfx], data["last" + sfx], 32, 8, 128, 16)
        w = fit.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        out[f"ours_plan_us_{where}"] = C.host_time_us(lambda w=w, args=args: w.plan(*args), sync=torch.cuda.synchronize)
        if fi is not None:
            for tc in (False, True):
                fw = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
                try:
                    out[f"fi{'_tc' if tc else ''}_plan_us_{where}"] = C.host_time_us(
                        lambda fw=fw, args=args: fw.plan(*args), sync=torch.cuda.synchronize
                    )
                except Exception as exc:
                    out[f"fi{'_tc' if tc else ''}_plan_error"] = _error(exc)
    # The implementation's own plan() (lengths already on the host), without the public checks.
    w = fit.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    w.plan(data["indptr_cpu"], data["indices_cpu"], data["last_cpu"], 32, 8, 128, 16)
    core = getattr(w, "_w", w)
    out["impl_plan_us"] = C.host_time_us(core.kernel_planner(), sync=torch.cuda.synchronize)
    print("[plan]", out, flush=True)
    return out


def cold_first_call_child():
    """Run in a fresh process with an empty TRITON_CACHE_DIR: seconds to the first result of two variants."""
    import flashinfer_triton as fit

    device = torch.device("cuda")
    res = {}
    for label, case, kw in (
        ("fp16 32/8 d128 ps16 1x32768 (decode + merge)", ("c", 1, 32768, 32, 8, 128, 16, torch.float16), {}),
        (
            "fp16 32/8 d128 ps16 4x512 rope",
            ("c", 4, 512, 32, 8, 128, 16, torch.float16),
            {"pos_encoding_mode": "ROPE_LLAMA"},
        ),
    ):
        data = build(case, device)
        ws = torch.empty(128 << 20, dtype=torch.uint8, device=device)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        w = fit.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(data["indptr"], data["indices"], data["last"], 32, 8, 128, 16, **kw)
        w.run(data["q"], data["caches"][0])
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        w.run(data["q"], data["caches"][0])
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        res[label] = dict(first_call_s=t1 - t0, second_call_s=t2 - t1)
    print("COLD", res, flush=True)
    return res


def cold_first_call():
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, TRITON_CACHE_DIR=tmp)
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--cold-child"], env=env, capture_output=True, text=True
        )
        wall = time.perf_counter() - t0
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("COLD ")]
    if not line:
        return {"error": proc.stderr[-500:], "process_wall_s": wall}
    import ast

    res = ast.literal_eval(line[-1][5:])
    res["process_wall_s"] = wall
    print("[cold]", res, flush=True)
    return res


def merge_bench(device):
    """merge_states / merge_state / the split-KV partial merge beside a device copy of the same bytes."""
    from flashinfer_triton import _merge_impl as M

    rows = []
    n, k, h, d = 4096, 4, 32, 128
    for dtype in (torch.float16, torch.float32):
        v = torch.randn((n, k, h, d), dtype=dtype, device=device)
        s = torch.randn((n, k, h), device=device)
        nbytes = v.numel() * v.element_size() + s.numel() * 4 + n * h * d * v.element_size() + n * h * 4
        ms = C.bench(lambda v=v, s=s: M.merge_states(v, s))
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        cms = C.bench(lambda src=src, dst=dst: dst.copy_(src))
        rows.append(
            dict(
                case=f"merge_states {n}x{k}x{h}x{d} {str(dtype)[6:]}",
                ours_ms=ms,
                ours_tbps=C.tbps(nbytes, ms),
                copy_ms=cms,
                copy_tbps=C.tbps(nbytes, cms),
                frac_of_copy=cms / ms,
            )
        )
        va, vb = v[:, 0].contiguous(), v[:, 1].contiguous()
        sa, sb = s[:, 0].contiguous(), s[:, 1].contiguous()
        nbytes = 3 * va.numel() * va.element_size() + 3 * sa.numel() * 4
        ms = C.bench(lambda va=va, sa=sa, vb=vb, sb=sb: M.merge_state(va, sa, vb, sb))
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        cms = C.bench(lambda src=src, dst=dst: dst.copy_(src))
        rows.append(
            dict(
                case=f"merge_state {n}x{h}x{d} {str(dtype)[6:]}",
                ours_ms=ms,
                ours_tbps=C.tbps(nbytes, ms),
                copy_ms=cms,
                copy_tbps=C.tbps(nbytes, cms),
                frac_of_copy=cms / ms,
            )
        )
    C.print_table(rows, ["case", "ours_ms", "ours_tbps", "copy_tbps", "frac_of_copy"])
    return rows


def engine_decode(device):
    """The serving engine's CUDA-graph decode step, attention only: SmolLM2-135M's shape (9 q / 3 KV heads,
    D64, bf16, page 16), contexts of 40-100 tokens, 30 layers (own caches) captured in one graph with the
    public CUDAGraphBatchDecodeWithPagedKVCacheWrapper as the engine drives it. Microseconds per layer
    (graph replay / 30), and host microseconds of plan() and of one eager run()."""
    import flashinfer_triton as fit

    hq, hkv, d, ps, layers = 9, 3, 64, 16, 30
    out = []
    gen = torch.Generator(device="cpu").manual_seed(1)
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=device)
    for bs in (1, 8, 32):
        lens = torch.randint(40, 101, (bs,), generator=gen).tolist()
        seed = int(torch.randint(1 << 30, (), generator=gen))
        indptr, indices, last, num_pages = C.page_table(lens, ps, spare_pages=64, seed=seed)
        indptr_buf = torch.zeros(bs + 1, dtype=torch.int32, device=device)
        indices_buf = torch.zeros(4096, dtype=torch.int32, device=device)
        last_buf = torch.ones(bs, dtype=torch.int32, device=device)
        w = fit.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(ws, indptr_buf, indices_buf, last_buf, "NHD")
        caches = [torch.randn((num_pages, 2, ps, hkv, d), dtype=torch.bfloat16, device=device) for _ in range(layers)]
        qs = [torch.randn((bs, hq, d), dtype=torch.bfloat16, device=device) for _ in range(layers)]
        ind_dev = indices.to(device)
        args = (indptr, ind_dev, last, hq, hkv, d, ps)
        kw = dict(pos_encoding_mode="NONE", q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, non_blocking=True)
        w.plan(*args, **kw)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for q, kv in zip(qs, caches, strict=True):
                w.run(q, kv)
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for q, kv in zip(qs, caches, strict=True):
                w.run(q, kv)
        torch.cuda.synchronize()
        ms = C.bench(g.replay, warmup=10, rep=50)
        row = dict(case=f"engine-graph bs{bs}", us_per_layer=ms * 1e3 / layers, graph_ms_30_layers=ms)
        row["plan_host_us"] = C.host_time_us(
            lambda w=w, args=args, kw=kw: w.plan(*args, **kw), sync=torch.cuda.synchronize
        )
        core = getattr(w, "_w", w)
        row["impl_plan_host_us"] = C.host_time_us(core.kernel_planner(), sync=torch.cuda.synchronize)
        w.plan(*args, **kw)
        row["run_host_us"] = C.host_time_us(lambda w=w, q=qs[0], kv=caches[0]: w.run(q, kv))
        # The same 30 layers in a graph but each run() as the kernel launch alone (no public checks).
        info = w.plan_info()
        row["grid"] = list(info.grid)
        row["fused"] = info.split  # (split pieces are merged inside the launch)
        # Correctness against the reference on layer 0 after the graph replay.
        g.replay()
        torch.cuda.synchronize()
        from flashinfer_triton import reference

        ref = (
            reference.batch_decode_with_paged_kv_cache(qs[0].cpu(), caches[0].cpu(), indptr, indices, last, "NHD")[0]
            if hasattr(reference, "batch_decode_with_paged_kv_cache")
            else None
        )
        if ref is not None:
            o_eager = w.run(qs[0], caches[0])
            row["maxdiff_vs_reference"] = float((o_eager.float().cpu() - ref.float()).abs().max())
        out.append(row)
        print("[engine]", row, flush=True)
        del caches, qs
        torch.cuda.empty_cache()
    return out


# The cascade bench's merge rows, with FlashInfer's times recorded there (H100, 2026-11-22, eager / graph ms).
MERGE_SMALL = [
    ("merge_states", (64, 16, 32, 128), 0.03347, 0.00516),
    ("merge_states", (512, 8, 32, 128), 0.02102, 0.00798),
    ("merge_states", (4096, 2, 32, 128), 0.04019, 0.03583),
    ("merge_states", (4096, 8, 32, 128), 0.11274, 0.10392),
    ("merge_states", (16384, 2, 8, 128), 0.04154, 0.03632),
    ("merge_state_in_place", (64, 32, 128), 0.00544, 0.00178),
    ("merge_state_in_place", (4096, 32, 128), 0.03946, 0.03553),
    ("merge_state_in_place", (32768, 32, 128), 0.27226, 0.26887),
]


def merge_small(device):
    """Public merge functions on the cascade bench's shapes: eager (_common.bench, L2 flushed), graph, host us."""
    import flashinfer_triton as fit

    gen = torch.Generator(device="cuda").manual_seed(3)
    rows = []
    for op, shape, fi_ms, fi_graph_ms in MERGE_SMALL:
        if op == "merge_states":
            n, k, h, d = shape
            v = torch.randn(n, k, h, d, dtype=torch.float16, device=device, generator=gen)
            s = torch.randn(n, k, h, dtype=torch.float32, device=device, generator=gen) * 4
            fn = lambda v=v, s=s: fit.merge_states(v, s)
            tag = f"merge_states N{n}-K{k}-H{h}-D{d}"
        else:
            n, h, d = shape
            v = torch.randn(n, h, d, dtype=torch.float16, device=device, generator=gen)
            s = torch.randn(n, h, dtype=torch.float32, device=device, generator=gen) * 4
            vo = torch.randn(n, h, d, dtype=torch.float16, device=device, generator=gen)
            so = torch.randn(n, h, dtype=torch.float32, device=device, generator=gen) * 4
            fn = lambda v=v, s=s, vo=vo, so=so: fit.merge_state_in_place(v, s, vo, so)
            tag = f"merge_state_in_place N{n}-H{h}-D{d}"
        fn()
        torch.cuda.synchronize()
        ms = C.bench(fn)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        gms = C.bench(g.replay)
        row = dict(case=tag, ours_ms=ms, fi_ms_recorded=fi_ms, ratio_vs_recorded=fi_ms / ms, ours_graph_ms=gms,
                   fi_graph_ms_recorded=fi_graph_ms, graph_ratio_vs_recorded=fi_graph_ms / gms,
                   host_us=C.host_time_us(fn))  # fmt: skip
        rows.append(row)
        print("[merge-small]", {k: (round(x, 5) if isinstance(x, float) else x) for k, x in row.items()}, flush=True)
    return rows


def fi_variants(cases, plan: bool = True) -> list:
    """``[(key, small case, tc)]``: one per FlashInfer JIT module the timed run uses. FlashInfer 0.7.2 compiles
    its decode per (q/KV dtype, head dim) and its tensor-core decode (a prefill module) likewise; the batch, the
    heads and the page size are runtime arguments. ``plan``: plan_timing's shape too (with --skip-plan it does
    not run)."""
    seen, out = set(), []
    for case in [*cases, *([PLAN_CASE] if plan else [])]:
        case = DecodeCase(*case)
        for tc in (False, True):  # decode_table and plan_timing call both
            key = ("tensor-core decode" if tc else "decode", str(case.dtype)[6:], case.head_dim)
            if key not in seen:
                seen.add(key)
                out.append((key, case._replace(batch=2, kv_len=3 * case.page_size + 1), tc))
    return out


def fi_build_only(done_file: str, cases, plan: bool = True, device="cuda") -> None:
    """Build the FlashInfer decode modules of ``cases`` at once, each by one plan() and run() of a small batch."""
    fi = C.import_flashinfer()
    if fi is None:
        return C.fi_absent(done_file)

    def call(item):
        _, small, tc = item
        data = build(small, device)
        ws = torch.empty(16 << 20, dtype=torch.uint8, device=device)
        flashinfer_wrapper(fi, small, data, ws, tc).run(data["q"], data["caches"][0])

    C.fi_prebuild(done_file, [(v[0], v) for v in fi_variants(cases, plan)], call)


def main():
    if "--resources" in sys.argv[1:]:  # the offline sm_90a build of the Gluon kernel: no GPU, no timing
        import _gluon_resources

        return _gluon_resources.main("decode", [a for a in sys.argv[1:] if a != "--resources"])
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--skip-cold", action="store_true")
    ap.add_argument("--cold-child", action="store_true")
    ap.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    ap.add_argument("--graph", action="store_true", help="also time run() replayed from CUDA graphs")
    ap.add_argument("--engine", action="store_true", help="engine-shaped graph-mode decode, us per layer")
    ap.add_argument("--merge-small", action="store_true", help="the cascade bench's merge rows")
    ap.add_argument("--sweep-cases", default=None, help="comma-separated case names to sweep (default: split rows)")
    ap.add_argument("--sweep-set", default="default", choices=sorted(SWEEPS), help="the configurations swept")
    ap.add_argument("--skip-plan", action="store_true")
    ap.add_argument("--skip-merge", action="store_true")
    ap.add_argument("--only-extras", action="store_true", help="skip the decode table")
    ap.add_argument("--fi-build-only", default=None, metavar="DONE_FILE", help="only build FlashInfer's JIT modules")
    args = ap.parse_args()
    if args.fi_build_only:
        cases = [] if args.only_extras else select_cases(args.cases)
        fi_build_only(args.fi_build_only, cases, plan=not args.skip_plan)
        return
    if args.cold_child:
        cold_first_call_child()
        return
    device = torch.device("cuda")
    meta = {"device": torch.cuda.get_device_name(), "sms": torch.cuda.get_device_properties(0).multi_processor_count}
    if not args.skip_cold:
        meta["first_call"] = cold_first_call()  # before anything warms the cache in this process
    fi = None if args.no_flashinfer else C.import_flashinfer()
    if fi is not None:
        meta["flashinfer"] = getattr(fi, "__version__", "?")
    for flag, key, fn in (
        (args.engine, "engine", engine_decode),
        (args.merge_small, "merge_small", merge_small),
        (not args.skip_merge, "merge", merge_bench),
    ):
        if flag:
            try:
                meta[key] = fn(device)
            except Exception as exc:  # one section failing must not lose the others
                meta[key] = _error(exc, 300)
                print(f"[{key}] failed: {meta[key]}", flush=True)
            C.write_json("decode", [], meta, args.out)
    if not args.skip_plan:
        meta["plan"] = plan_timing(fi, device)
    C.write_json("decode", [], meta, args.out)
    if args.only_extras:
        return
    rows = decode_table(args, fi, device, meta)
    path = C.write_json("decode", rows, meta, args.out)
    print("wrote", path)
    C.print_table(rows, TABLE_COLUMNS)


if __name__ == "__main__":
    main()
