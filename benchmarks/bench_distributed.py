"""Context parallelism on N GPUs against the same work on one GPU.

    torchrun --nproc_per_node 1 benchmarks/bench_distributed.py     # the one-GPU baseline rows
    torchrun --nproc_per_node 2 benchmarks/bench_distributed.py     # speedups against those rows
    torchrun --nproc_per_node 4 benchmarks/bench_distributed.py

Decode (32 query heads, 8 KV heads, D128, fp16, pages of 16): 1 x 1M, 8 x 128k, 8 x 256k and 64 x 32k
tokens, each request's pages split in contiguous runs over the ranks. Per-step time of the whole
``ContextParallelDecodeWrapper.run`` (local decode + combination), of the local decode alone and of the
combination alone (the communication, run on the states of the last step); the baseline is
``BatchDecodeWithPagedKVCacheWrapper`` over the whole cache on one GPU.

Causal ring prefill (same heads) of 128k, 512k and 1M tokens, one request, zig-zag shards. Time of the ring
run, of the ring's transfers alone (``comm_ms``), and for the smaller sizes of the same attention calls
without any transfer (``compute_ms``: the run minus it is the communication left exposed). The baseline is
``BatchPrefillWithRaggedKVCacheWrapper`` (causal) over the whole sequence on one GPU.

Every time is the slowest rank's (all-reduce MAX of CUDA-event times taken after a barrier). Rows go to
``<out-dir or benchmarks/results>/<gpu>/distributed.json``, merged with the rows of other GPU counts
already there (a run replaces the rows of its own count); speedups use the one-GPU rows of that file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from _common import gpu_name, page_table, print_table, results_path  # noqa: E402

import flashinfer_triton as fi  # noqa: E402
from flashinfer_triton import distributed as cp  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16
DTYPE = torch.float16
DECODE_CASES = [(1, 1 << 20), (8, 128 << 10), (8, 256 << 10), (64, 32 << 10)]
PREFILL_CASES = [128 << 10, 512 << 10, 1 << 20]
EXPOSED_MAX = 512 << 10  # the compute-only run (to get the exposed communication) up to this length
WS = 256 << 20


def _k(n: int) -> str:
    if n < 1024:
        return str(n)
    return f"{n >> 20}M" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n >> 10}k"


DEV = torch.device("cuda")  # the CPU (gloo) with --smoke


def slowest_ms(fn, *, iters: int, windows: int = 3) -> float:
    """Median over ``windows`` of the mean time per call of ``iters`` back-to-back calls, slowest rank's."""
    times = []
    for _ in range(windows):
        dist.barrier()
        if DEV.type == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end) / iters
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            ms = (time.perf_counter() - t0) * 1e3 / iters
        t = torch.tensor([ms], device=DEV)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
    return sorted(times)[len(times) // 2]


def bench_decode(batch: int, kv_len: int, world: int, rank: int, combine: str) -> dict:
    dev = DEV
    ip, idx, last, _ = page_table([kv_len] * batch, PAGE, seed=1)
    q = torch.randn(batch, HQ, D, device=dev).to(DTYPE)
    ws = torch.empty(WS, dtype=torch.uint8, device=dev)
    row = dict(kind="decode", case=f"{batch}x{_k(kv_len)}", ngpus=world)
    if world == 1:
        cache = torch.randn(int(ip[-1]), 2, PAGE, HKV, D, device=dev, dtype=DTYPE)
        w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(ip, idx, last, HQ, HKV, D, PAGE, q_data_type=DTYPE)
        out = torch.empty_like(q)
        w.run(q, cache, out=out)  # compiles outside the timed calls
        row["ms"] = slowest_ms(lambda: w.run(q, cache, out=out), iters=20)
        return row
    shard = cp.shard_page_table(ip, idx, last, PAGE, world, rank, "contiguous", compact=True)
    cache = torch.randn(shard.indices.numel(), 2, PAGE, HKV, D, device=dev, dtype=DTYPE)
    w = cp.ContextParallelDecodeWrapper(ws, "NHD", combine=combine)
    w.plan(shard.indptr.to(dev), shard.indices.to(dev), shard.last_page_len.to(dev), HQ, HKV, D, PAGE,
           q_data_type=DTYPE, seq_lens=shard.seq_lens, shard_layout="contiguous")  # fmt: skip
    out = torch.empty_like(q)
    row["combine"] = w.combine_method
    w.run(q, cache, out=out)
    row["ms"] = slowest_ms(lambda: w.run(q, cache, out=out), iters=20)
    row["local_ms"] = slowest_ms(lambda: w._run_local(q, cache), iters=20)
    row["comm_ms"] = slowest_ms(w._run_combine, iters=50)
    row["comm_share"] = row["comm_ms"] / row["ms"]
    row["exposed_comm_ms"] = max(row["ms"] - row["local_ms"], 0.0)
    return row


def bench_prefill(seq_len: int, world: int, rank: int) -> dict:
    dev = DEV
    ws = torch.empty(WS, dtype=torch.uint8, device=dev)
    row = dict(kind="prefill-causal", case=_k(seq_len), ngpus=world)
    reps = 1 if seq_len >= EXPOSED_MAX else 3
    gen = torch.Generator(device=dev).manual_seed(3)
    if world == 1:
        q = torch.randn(seq_len, HQ, D, device=dev, generator=gen, dtype=DTYPE)
        k = torch.randn(seq_len, HKV, D, device=dev, generator=gen, dtype=DTYPE)
        v = torch.randn(seq_len, HKV, D, device=dev, generator=gen, dtype=DTYPE)
        w = fi.BatchPrefillWithRaggedKVCacheWrapper(ws)
        ip = torch.tensor([0, seq_len], dtype=torch.int32)
        w.plan(ip, ip, HQ, HKV, D, causal=True, q_data_type=DTYPE)
        out = torch.empty_like(q)
        w.run(q, k, v, out=out)  # a first call at this size (any variant it compiles is not timed)
        row["ms"] = slowest_ms(lambda: w.run(q, k, v, out=out), iters=1, windows=reps)
        return row
    n_local = cp.zigzag_indices([seq_len], world, rank).numel()
    q = torch.randn(n_local, HQ, D, device=dev, generator=gen, dtype=DTYPE)
    k = torch.randn(n_local, HKV, D, device=dev, generator=gen, dtype=DTYPE)
    v = torch.randn(n_local, HKV, D, device=dev, generator=gen, dtype=DTYPE)
    w = cp.RingPrefillWrapper(ws)
    w.plan([seq_len], HQ, HKV, D, causal=True, q_data_type=DTYPE)
    out = torch.empty_like(q)
    w.run(q, k, v, out=out)
    row["ms"] = slowest_ms(lambda: w.run(q, k, v, out=out), iters=1, windows=reps)
    row["comm_ms"] = slowest_ms(lambda: w._run_comm_only(k, v), iters=3)
    row["comm_share"] = row["comm_ms"] / row["ms"]
    row["step_ms"] = row["ms"] / world
    if seq_len <= EXPOSED_MAX:
        row["compute_ms"] = slowest_ms(lambda: _ring_compute_only(w, q, k, v), iters=1, windows=reps)
        row["exposed_comm_ms"] = max(row["ms"] - row["compute_ms"], 0.0)
    return row


def _ring_compute_only(w, q, k, v):
    """The ring's attention calls and merges on the local block only (the same work, no transfer)."""
    from flashinfer_triton import merge_state_in_place

    n, hq, d = q.shape
    acc_o = torch.zeros((n, hq, d), dtype=torch.float32, device=q.device)
    acc_l = torch.full((n, hq), float("-inf"), dtype=torch.float32, device=q.device)
    part_o, part_l = torch.empty_like(acc_o), torch.empty_like(acc_l)
    for calls in w._steps:
        for c in calls:
            kk, vv = k[c.k0 : c.k1], v[c.k0 : c.k1]
            if kk.shape[0] < c.k1 - c.k0:  # another rank's block may be one row longer: pad with local rows
                kk = torch.cat([kk, k[: c.k1 - c.k0 - kk.shape[0]]])
                vv = torch.cat([vv, v[: c.k1 - c.k0 - vv.shape[0]]])
            po, pl = part_o[c.q0 : c.q1], part_l[c.q0 : c.q1]
            c.wrapper.run(q[c.q0 : c.q1], kk, vv, out=po, lse=pl, return_lse=True)
            merge_state_in_place(acc_o[c.q0 : c.q1], acc_l[c.q0 : c.q1], po, pl)


def merge_rows(path: str, rows: list, world: int) -> list:
    """The file's rows of other GPU counts plus ``rows``, with speedups against its one-GPU rows."""
    old = []
    if os.path.exists(path):
        with open(path) as f:
            old = [r for r in json.load(f).get("rows", []) if r.get("ngpus") != world]
    merged = old + rows
    base = {(r["kind"], r["case"]): r["ms"] for r in merged if r.get("ngpus") == 1}
    for r in merged:
        b = base.get((r["kind"], r["case"]))
        if b is not None:
            r["baseline_ms"] = b
            r["speedup"] = b / r["ms"]
            r["efficiency"] = r["speedup"] / r["ngpus"]
    return sorted(merged, key=lambda r: (r["kind"], r["case"], r["ngpus"]))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", default=None, help="results root (default benchmarks/results)")
    ap.add_argument("--only", choices=("decode", "prefill"), default=None)
    ap.add_argument("--combine", default="auto", choices=cp.COMBINE_METHODS)
    ap.add_argument("--max-prefill", type=int, default=1 << 20, help="skip ring prefill cases longer than this")
    ap.add_argument("--smoke", action="store_true", help="the CPU (gloo), every size divided by 1024, 4 heads")
    args = ap.parse_args()
    global DEV, DECODE_CASES, PREFILL_CASES, EXPOSED_MAX, HQ, HKV, D, WS
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if args.smoke:
        DEV = torch.device("cpu")
        DECODE_CASES = [(b, n >> 10) for b, n in DECODE_CASES]
        PREFILL_CASES = [n >> 10 for n in PREFILL_CASES]
        EXPOSED_MAX, HQ, HKV, D, WS = EXPOSED_MAX >> 10, 4, 2, 32, 1 << 20
        dist.init_process_group("gloo")
    else:
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    world, rank = dist.get_world_size(), dist.get_rank()
    t0 = time.time()
    rows = []
    path = results_path("distributed", args.out_dir)

    def save():
        """Rewrite the file after every case, so a run cut short keeps what it measured."""
        merged = merge_rows(path, [dict(r) for r in rows], world)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        doc = dict(
            op="distributed", gpu=gpu_name(), date=datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
            torch=torch.__version__, triton=triton.__version__,
            nccl=None if args.smoke else ".".join(map(str, torch.cuda.nccl.version())),
            meta=dict(heads=f"{HQ}/{HKV}", head_dim=D, page_size=PAGE, dtype=str(DTYPE), combine=args.combine,
                      nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE")),
            rows=merged,
        )  # fmt: skip
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
        return merged

    def done(kind):
        if rank == 0:
            r = rows[-1]
            print(f"{kind} {r['case']}: {r['ms']:.3f} ms ({time.time() - t0:.0f} s)", flush=True)
            save()

    if args.only != "prefill":
        for batch, kv_len in DECODE_CASES:
            rows.append(bench_decode(batch, kv_len, world, rank, args.combine))
            torch.cuda.empty_cache()
            done("decode")
    if args.only != "decode":
        bench_prefill(64 if args.smoke else 8192, world, rank)  # compiles the kernels outside any timed call
        for n in PREFILL_CASES:
            if n > args.max_prefill:
                continue
            rows.append(bench_prefill(n, world, rank))
            torch.cuda.empty_cache()
            done("prefill")
    if rank == 0:
        merged = save()
        cols = ["kind", "case", "ngpus", "ms", "baseline_ms", "speedup", "efficiency", "comm_ms", "comm_share",
                "exposed_comm_ms", "combine"]  # fmt: skip
        print_table([r for r in merged if r["ngpus"] == world or r["ngpus"] == 1], cols)
        print(f"wrote {path} ({time.time() - t0:.0f} s)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
