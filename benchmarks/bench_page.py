"""append_paged_kv_cache: ours (Triton) against FlashInfer's CUDA kernel, in GB/s.

Bytes counted: the appended K and V read once plus the same number of bytes written into the cache
(index tensors left out). Each case is timed two ways, both in the same process on the same GPU:

* ``*_ms``: ``_common.bench`` median (``triton.testing.do_bench``'s method with the host's time kept out), eager
  calls through the public API, L2 flushed before each call: the GPU time of an eager call;
* ``*_graph_ms``: the calls captured in one CUDA graph, rotating over 4 independent input sets (caches
  included, more than the 50 MB L2 together for the prefill cases): kernel time without host overhead;
* ``*_host_us``: median host time of one eager call (Python checks + launch), no synchronization.

The eager ``*_ms`` holds no host time (docs/benchmarking.md); what an engine pays on the host per eager call is in
the host columns, the kernel without the L2 flush in the graph columns.

Run: ``PYTHONPATH=src python3 benchmarks/bench_page.py [--out DIR] [--no-flashinfer] [--fi-recorded JSON]``;
writes ``<DIR>/<gpu>/page.json`` (default DIR: benchmarks/results). FlashInfer is optional; without
it ``--fi-recorded`` fills its columns from an earlier side-by-side run (marked as recorded).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

import torch

import flashinfer_triton

NUM_SETS = 4


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import bench as time_eager  # noqa: E402
from _common import host_time_us, page_table, write_json  # noqa: E402
from _common import import_flashinfer as load_flashinfer  # noqa: E402


def recorded_flashinfer(path):
    """``{case: row}`` of an earlier results JSON (its FlashInfer columns stand in for a peer not run now)."""
    if not path:
        return None
    with open(path) as f:
        return {row["case"]: row for row in json.load(f)["rows"]}


def rotate(fns):
    """One callable that calls ``fns`` in turn (each bound to its own inputs)."""
    state = [0]

    def call():
        state[0] += 1
        return fns[state[0] % len(fns)]()

    return call


def time_graph(fns, calls: int = 40, replays: int = 10) -> float | None:
    """Milliseconds per call of ``fns`` (rotated) captured in one CUDA graph; None if capture fails."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for fn in fns:
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fns[i % len(fns)]()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(replays):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / calls)
        return float(statistics.median(times))
    except Exception as exc:  # a peer that cannot be captured is reported, not fatal
        print(f"  (graph capture failed: {type(exc).__name__}: {exc})", file=sys.stderr)
        torch.cuda.synchronize()
        return None


def ratio(peer_ms, ours_ms):
    return None if peer_ms is None or ours_ms is None else round(peer_ms / ours_ms, 3)


def meta_info(flashinfer) -> dict:
    import triton

    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "flashinfer": getattr(flashinfer, "__version__", None) if flashinfer else None,
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        "timing": "*_ms: _common.bench median (do_bench's method, host time kept out), eager, L2 flushed; "
        "*_graph_ms: per call inside one CUDA graph",
    }


# ----------------------------------------------------------------------------- the cases
# name, lens before the append, tokens appended per request, kv heads, head dim, page size
CASES = [
    ("prefill-4x1024tok-h8-d128-ps16", [100, 37, 0, 515], [1024] * 4, 8, 128, 16),
    ("prefill-4x1024tok-h8-d128-ps1", [100, 37, 0, 515], [1024] * 4, 8, 128, 1),
    ("prefill-4x1024tok-h32-d128-ps16", [100, 37, 0, 515], [1024] * 4, 32, 128, 16),
    ("decode-256tok-h8-d128-ps16", "decode", [1] * 256, 8, 128, 16),
    ("decode-256tok-h8-d128-ps1", "decode", [1] * 256, 8, 128, 1),
    ("decode-256tok-h32-d128-ps16", "decode", [1] * 256, 32, 128, 16),
]


def build_set(seed, lens_before, lens_append, heads, head_dim, page_size, dtype=torch.float16):
    """One independent append problem on the GPU: cache (5-D NHD), page table, appended rows."""
    lens_after = [a + b for a, b in zip(lens_before, lens_append, strict=True)]
    kv_indptr, kv_indices, kv_last_page_len, num_pages = page_table(lens_after, page_size, spare_pages=8, seed=seed)
    append_indptr = torch.tensor([0, *torch.tensor(lens_append).cumsum(0).tolist()], dtype=torch.int32)
    nnz = sum(lens_append)
    cuda = lambda t: t.cuda()
    cache = torch.randn(num_pages, 2, page_size, heads, head_dim, dtype=dtype, device="cuda")
    key = torch.randn(nnz, heads, head_dim, dtype=dtype, device="cuda")
    value = torch.randn(nnz, heads, head_dim, dtype=dtype, device="cuda")
    kv_indptr, kv_indices, kv_last_page_len, append_indptr = map(
        cuda, (kv_indptr, kv_indices, kv_last_page_len, append_indptr)
    )
    seq_lens = flashinfer_triton.get_seq_lens(kv_indptr, kv_last_page_len, page_size)
    batch_indices, positions = flashinfer_triton.get_batch_indices_positions(append_indptr, seq_lens, nnz)
    return dict(
        args=(key, value, batch_indices, positions, cache, kv_indices, kv_indptr, kv_last_page_len),
        nnz=nnz,
    )


def check_once(s, page_size):
    """The cache after our append holds the appended rows at the addressed slots."""
    key, value, batch_indices, positions, cache, kv_indices, kv_indptr, _ = s["args"]
    flashinfer_triton.append_paged_kv_cache(*s["args"], kv_layout="NHD")
    b, pos = batch_indices.long(), positions.long()
    pages = kv_indices.long()[kv_indptr.long()[b] + pos // page_size]
    ok = torch.equal(cache[pages, 0, pos % page_size], key) and torch.equal(cache[pages, 1, pos % page_size], value)
    if not ok:
        raise SystemExit("append check failed: the cache does not hold the appended rows")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--no-flashinfer", action="store_true", help="time ours only")
    parser.add_argument("--fi-recorded", help="a results JSON whose FlashInfer times fill the peer columns")
    args = parser.parse_args()
    flashinfer = None if args.no_flashinfer else load_flashinfer()
    recorded = recorded_flashinfer(args.fi_recorded) or {}
    rows = []
    header = f"{'case':36s} {'ours ms':>9s} {'FI ms':>9s} {'ratio':>6s} {'ours GB/s':>10s} {'FI GB/s':>9s}"
    header += f" {'ours graph':>11s} {'FI graph':>9s} {'ratio':>6s} {'ours us':>8s} {'FI us':>8s}"
    print(header)
    for name, lens_before, lens_append, heads, head_dim, page_size in CASES:
        if lens_before == "decode":
            gen = torch.Generator().manual_seed(5)
            lens_before = torch.randint(1, 1024, (len(lens_append),), generator=gen).tolist()
        sets = [build_set(100 + i, lens_before, lens_append, heads, head_dim, page_size) for i in range(NUM_SETS)]
        check_once(sets[0], page_size)
        nnz = sets[0]["nnz"]
        nbytes = 2 * 2 * nnz * heads * head_dim * 2  # K and V, read + written, fp16
        ours = [lambda s=s: flashinfer_triton.append_paged_kv_cache(*s["args"], kv_layout="NHD") for s in sets]
        ours_ms, ours_graph = time_eager(rotate(ours)), time_graph(ours)
        ours_host = host_time_us(rotate(ours))
        # The same call below the public layer (views precomputed): how much of the host time is launch.
        from flashinfer_triton import _page_impl

        direct = []
        for st in sets:
            key, value, bi, pos, cache, ind, iptr, _ = st["args"]
            k4, v4 = cache[:, 0], cache[:, 1]
            direct.append(lambda a=(key, value, bi, pos, k4, v4, ind, iptr): _page_impl.append_paged_kv_cache(*a))
        impl_host = host_time_us(rotate(direct))
        fi_ms = fi_graph = fi_host = None
        if flashinfer is not None:
            peer = [lambda s=s: flashinfer.append_paged_kv_cache(*s["args"], kv_layout="NHD") for s in sets]
            fi_ms, fi_graph = time_eager(rotate(peer)), time_graph(peer)
            fi_host = host_time_us(rotate(peer))
        elif name in recorded:
            rec = recorded[name]
            fi_ms, fi_graph, fi_host = (
                rec.get("flashinfer_ms"),
                rec.get("flashinfer_graph_ms"),
                rec.get("flashinfer_host_us"),
            )
        torch.cuda.synchronize()
        gbps = lambda ms, nbytes=nbytes: None if ms is None else round(nbytes / ms / 1e6, 1)
        row = dict(
            case=name,
            ours_ms=round(ours_ms, 5),
            flashinfer_ms=None if fi_ms is None else round(fi_ms, 5),
            ratio=ratio(fi_ms, ours_ms),
            ours_gbps=gbps(ours_ms),
            flashinfer_gbps=gbps(fi_ms),
            ours_graph_ms=None if ours_graph is None else round(ours_graph, 5),
            flashinfer_graph_ms=None if fi_graph is None else round(fi_graph, 5),
            graph_ratio=ratio(fi_graph, ours_graph),
            ours_graph_gbps=gbps(ours_graph),
            flashinfer_graph_gbps=gbps(fi_graph),
            ours_host_us=round(ours_host, 1),
            ours_impl_host_us=round(impl_host, 1),
            flashinfer_host_us=None if fi_host is None else round(fi_host, 1),
            bytes=nbytes,
        )
        if flashinfer is None and name in recorded:
            row["note"] = "FlashInfer columns recorded by an earlier side-by-side run (--fi-recorded), not re-measured"
        rows.append(row)
        fmt = lambda x, w, p=4: f"{x:>{w}.{p}f}" if x is not None else f"{'-':>{w}s}"
        print(
            f"{name:36s} {fmt(ours_ms, 9)} {fmt(fi_ms, 9)} {fmt(row['ratio'], 6, 2)} {fmt(row['ours_gbps'], 10, 0)}"
            f" {fmt(row['flashinfer_gbps'], 9, 0)} {fmt(ours_graph, 11)} {fmt(fi_graph, 9)}"
            f" {fmt(row['graph_ratio'], 6, 2)} {fmt(ours_host, 8, 1)} {fmt(fi_host, 8, 1)}"
        )
        del sets
        torch.cuda.empty_cache()
    path = write_json("page", rows, meta_info(flashinfer), args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
