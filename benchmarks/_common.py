"""Shared benchmark helpers: timing, byte/flop formulas, FlashInfer import, JSON results, tables.

Timing (``bench``) is ``triton.testing.do_bench``'s method (median; L2 flushed before each timed call) with
the host's time kept out of the figure; callers also rotate among several input buffers whose total is
larger than L2 (50 MB on the H100), so no call reads what the previous one left in cache.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import time

import torch

# The page tables and caches of the tests (re-exported: benchmarks call them as _common.page_table, ...).
from flashinfer_triton.testing import make_paged, page_table, paged_caches  # noqa: F401

L2_BYTES = 50 * 1024 * 1024
RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def num_rotations(bytes_per_input: int, min_total: int = 4 * L2_BYTES, max_count: int = 8) -> int:
    """How many input copies to rotate so that together they exceed ``min_total`` bytes (at least 2)."""
    return max(2, min(max_count, -(-min_total // max(1, bytes_per_input))))


_CLEAR_BYTES = 256 * 1024 * 1024  # (as triton.testing.do_bench: a 256 MB write evicts the whole L2)
_sleep_cycles_per_us: float | None = None


def _cycles_per_us() -> float:
    """Clock cycles of ``torch.cuda._sleep`` per microsecond on this GPU (measured once)."""
    global _sleep_cycles_per_us
    if _sleep_cycles_per_us is None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)
        start.record()
        torch.cuda._sleep(2_000_000)
        end.record()
        end.synchronize()
        _sleep_cycles_per_us = 2_000_000 / max(start.elapsed_time(end) * 1000.0, 1.0)
    return _sleep_cycles_per_us


def bench(fn, *, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of ``fn()`` on the GPU, L2 cleared before each call, host time kept out.

    Each timed call is ``clear L2; start event; fn(); end event``, as in ``triton.testing.do_bench``. There
    the host must enqueue ``fn()`` before the GPU finishes the ~85 us clear, or the wait lands inside the
    timed interval: eager calls whose host time passes that (sampling at batch 1 on a slow host: 50-110 us)
    read as host time. Here a GPU-side sleep before each clear, as long as the measured host time of an
    iteration (with a margin), plus a 2 ms sleep first, keeps the GPU behind the host: every call is
    already queued when the GPU reaches it, and the events time the GPU alone. The sleep touches no memory,
    so each call still starts with a cleared L2 and the clear's dirty lines, exactly as under ``do_bench``.
    """
    fn()
    torch.cuda.synchronize()
    cache = torch.empty(_CLEAR_BYTES // 4, dtype=torch.int32, device="cuda")
    t0 = time.perf_counter()
    for _ in range(5):
        cache.zero_()
        fn()
    host_us = (time.perf_counter() - t0) / 5 * 1e6
    torch.cuda.synchronize()
    # The sleep alone covers an iteration's host time (the GPU time of the clear and the call comes on top):
    # an event-timed estimate of the GPU time would itself contain host gaps when the host is the slower one.
    # Margin: the sleep's and the events' own launches, and host jitter (the 2 ms head start absorbs spikes).
    cycles = int((1.25 * host_us + 15.0) * _cycles_per_us())
    # The GPU time of an iteration's clear and call, each timed between its own events behind its sleep.
    marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(5)]
    torch.cuda._sleep(int(2000 * _cycles_per_us()))
    for start, end in marks:
        torch.cuda._sleep(cycles)
        start.record()
        cache.zero_()
        fn()
        end.record()
    torch.cuda.synchronize()
    iter_ms = max(sum(s.elapsed_time(e) for s, e in marks) / len(marks), 1e-3)
    n_warmup, n_rep = max(1, int(warmup / iter_ms)), max(1, int(rep / iter_ms))
    for _ in range(n_warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n_rep)]
    torch.cuda._sleep(int(2000 * _cycles_per_us()))
    for i in range(n_rep):
        torch.cuda._sleep(cycles)
        cache.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    n = len(times)
    return float(times[n // 2] if n % 2 else (times[n // 2 - 1] + times[n // 2]) / 2)


def back_to_back_ms(fns, *, reps: int = 20) -> float:
    """Median milliseconds per call of ``fns`` run back to back, as an engine's layers run them.

    ``fns`` are zero-argument callables, one per input copy (together larger than L2). They are captured
    in one CUDA graph, which is replayed ``reps`` times between two events, five times over. No L2 clear
    comes between calls: ``do_bench``'s clear leaves ~50 MB of dirty lines that every timed call pays to
    write back (10-15 us on an H100), a large share of a ~50 us decode call.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compiles) outside the capture
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / (reps * len(fns)))
    return sorted(times)[len(times) // 2]


def rotating(fns):
    """One callable that calls the given callables in turn (each bound to its own input copy)."""
    state = {"i": 0}

    def call():
        f = fns[state["i"] % len(fns)]
        state["i"] += 1
        return f()

    return call


def host_time_us(fn, *, iters: int = 50, warmup: int = 5, sync=None) -> float:
    """Median host wall time of ``fn()`` in microseconds (``sync()`` after each call when given)."""
    for _ in range(warmup):
        fn()
    if sync:
        sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append((time.perf_counter() - t0) * 1e6)
    times.sort()
    return times[len(times) // 2]


def tbps(nbytes: int, ms: float) -> float:
    """Terabytes per second."""
    return nbytes / (ms * 1e-3) / 1e12


def decode_bytes(batch: int, kv_len: int, hq: int, hkv: int, d: int, kv_elem: int, q_elem: int) -> int:
    """Bytes a decode step must move at least: the whole KV read once, q read and o written."""
    return batch * kv_len * hkv * d * 2 * kv_elem + 2 * batch * hq * d * q_elem


def import_flashinfer():
    """FlashInfer (``flashinfer`` package) when importable, else None; the reason goes to stderr."""
    try:
        import flashinfer  # noqa: F401

        return flashinfer
    except Exception as exc:  # pragma: no cover - depends on the machine
        print(f"[bench] FlashInfer not available: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None


def gpu_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name().replace(" ", "-").replace("/", "-")
    return platform.processor() or "cpu"


def gpu_dir() -> str:
    """The results folder of this GPU: its name without the vendor, e.g. ``H100-80GB-HBM3``."""
    name = gpu_name()
    return name[len("NVIDIA-") :] if name.startswith("NVIDIA-") else name


def results_path(op: str, out_dir: str | None = None) -> str:
    """``<out_dir or benchmarks/results>/<gpu>/<op>.json``: one current table per GPU and operation."""
    return os.path.join(out_dir or RESULTS_DIR, gpu_dir(), f"{op}.json")


def write_json(op: str, rows: list, meta: dict | None = None, out_dir: str | None = None) -> str:
    """Write ``{"op", "gpu", "date", "meta", "rows"}``; each row has case, ours_ms, flashinfer_ms, ratio."""
    path = results_path(op, out_dir)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    doc = {
        "op": op,
        "gpu": gpu_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        "torch": torch.__version__,
        "meta": meta or {},
        "rows": rows,
    }
    try:
        import triton

        doc["triton"] = triton.__version__
    except Exception:  # pragma: no cover
        pass
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    return path


def print_table(rows: list, columns: list, file=None) -> str:
    """A fixed-width table of ``rows`` (dicts) over ``columns``; returns the text and prints it."""

    def fmt(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    text = "\n".join(lines)
    print(text, file=file or sys.stdout, flush=True)
    return text


def fi_prebuild(done_file: str, variants: list, call) -> list:
    """Build FlashInfer's JIT modules before any timing: ``call(arg)`` makes one small FlashInfer call for each
    ``(key, arg)`` of ``variants``, all at once on threads (its JIT compiles in nvcc/ninja subprocesses, so the
    builds overlap). Prints a line per variant (built in N s / FAILED reason), then writes ``done_file``.
    Returns the lines."""
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.time()
    device = torch.cuda.current_device() if torch.cuda.is_available() else None

    def one(item):
        key, arg = item
        t = time.time()
        try:
            if device is not None:
                # A new thread has no current CUDA context; FlashInfer's fa3 encodes TMA descriptors through
                # the driver API, which fails without one. A runtime call binds the device's primary context.
                torch.cuda.set_device(device)
                torch.cuda.synchronize(device)
            call(arg)
            if device is not None:
                torch.cuda.synchronize(device)
            return f"{key}: built in {time.time() - t:.0f}s"
        except Exception as exc:  # report and go on: the timed run reports the missing variant again
            return f"{key}: FAILED {type(exc).__name__}: {str(exc)[:300]}"

    lines = []
    with ThreadPoolExecutor(max_workers=max(1, len(variants))) as ex:
        for line in ex.map(one, variants):
            print(line, flush=True)
            lines.append(line)
    failed = sum(": FAILED " in line for line in lines)
    with open(done_file, "w") as f:
        f.write(f"done in {time.time() - t0:.0f}s: {len(lines) - failed} built, {failed} failed\n")
    return lines


def fi_absent(done_file: str) -> None:
    """The done file of a build-only run with no FlashInfer to build."""
    with open(done_file, "w") as f:
        f.write("no flashinfer\n")
