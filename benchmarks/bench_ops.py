"""Engine ops (norm, activation, RoPE, sampling): ours (Triton) against FlashInfer's CUDA kernels.

Both run in the same process on the same GPU through their public APIs, eager, timed by
``_common.bench`` (do_bench's median, L2 flushed before each call, host time kept out), ours and FlashInfer
alternating over three rounds, the best median of each kept. Shapes are those of SmolLM2-135M
(hidden 576, 9/3 heads of 64, intermediate 1536, vocabulary 49152) and Llama-3-8B (hidden 4096, 32/8
heads of 128, intermediate 14336, vocabulary 128256) at 1, 32 and 256 tokens; sampling at batch 1, 32
and 256 over each vocabulary (probabilities softmax(3 * randn), top-k 50, top-p 0.9; top-p over flatter rows too).
``ratio`` is FlashInfer's time over ours (> 1: ours faster).

Run: ``PYTHONPATH=src python3 benchmarks/bench_ops.py [--out DIR] [--only norm,activation,rope,sampling]``
with FlashInfer importable as ``flashinfer``; writes ``<DIR>/<gpu>/ops.json`` (DIR: benchmarks/results).
Without FlashInfer only our times are written.
"""

# ruff: noqa: B023  (each closure is timed inside its own loop iteration, before the loop rebinds its names)
from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

import flashinfer_triton as ours

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import bench, import_flashinfer, print_table, write_json  # noqa: E402

MODELS = {
    "smollm2-135m": dict(hidden=576, hq=9, hk=3, d=64, inter=1536, vocab=49152),
    "llama3-8b": dict(hidden=4096, hq=32, hk=8, d=128, inter=14336, vocab=128256),
}
TOKENS = (1, 32, 256)
MAX_POS = 8192


def _prebuild(fi, groups) -> None:
    """Start FlashInfer's JIT builds of the modules used, in parallel (each takes tens of seconds)."""
    jobs = []
    if "norm" in groups:
        jobs.append(lambda: fi.norm.get_norm_module())
    if "activation" in groups:
        jobs += [lambda a=a: fi.activation.get_act_and_mul_module(a) for a in ("silu", "gelu")]
    if "rope" in groups:
        jobs.append(lambda: fi.rope.get_rope_module())
    if "sampling" in groups:
        jobs.append(lambda: fi.sampling.get_sampling_module())

    def run(job):
        try:
            job()
        except Exception as exc:  # the first real call reports it again
            print(f"[bench_ops] prebuild: {type(exc).__name__}: {exc}", file=sys.stderr)

    with ThreadPoolExecutor(len(jobs) or 1) as pool:
        list(pool.map(run, jobs))


def _time(fn) -> float | None:
    if fn is None:
        return None
    try:
        return bench(fn) * 1000.0
    except Exception as exc:
        print(f"[bench_ops] failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None


def _best(times: list) -> float | None:
    times = [t for t in times if t is not None]
    return min(times) if times else None


def _row(op, case, ours_fn, fi_fn, rounds: int = 3):
    # These kernels take 2-10 us; one median moves by up to 1 us from one run to the next (clock and L2
    # state), as much as the gaps measured. Ours and FlashInfer alternate, and each keeps its best median.
    o_times, f_times = [], []
    for _ in range(rounds):
        o_times.append(_time(ours_fn))
        f_times.append(_time(fi_fn))
    o, f = _best(o_times), _best(f_times)
    ratio = (f / o) if (o and f) else None
    # (each row as measured: a run cut short by a time limit still shows what it timed)
    cells = [f"{v:.1f}" if v is not None else "-" for v in (o, f)] + [f"{ratio:.2f}" if ratio else "-"]
    print(f"[bench_ops] {op} | {case} | ours {cells[0]} us | flashinfer {cells[1]} us | ratio {cells[2]}", flush=True)
    return {"op": op, "case": case, "ours_us": o, "flashinfer_us": f, "ratio": ratio}


def norm_rows(fi, dev):
    rows = []
    for name, m in MODELS.items():
        for t in TOKENS:
            h = m["hidden"]
            x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
            r = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
            w = torch.randn(h, device=dev, dtype=torch.bfloat16)
            out = torch.empty_like(x)
            case = f"{name} T={t} h={h} bf16"
            rows.append(_row("rmsnorm", case, lambda: ours.norm.rmsnorm(x, w, 1e-6, out),
                             fi and (lambda: fi.norm.rmsnorm(x, w, 1e-6, out))))  # fmt: skip
            rows.append(_row("fused_add_rmsnorm", case, lambda: ours.norm.fused_add_rmsnorm(x, r, w, 1e-6),
                             fi and (lambda: fi.norm.fused_add_rmsnorm(x, r, w, 1e-6))))  # fmt: skip
    return rows


def activation_rows(fi, dev):
    rows = []
    for name, m in MODELS.items():
        for t in TOKENS:
            i = m["inter"]
            x = torch.randn(t, 2 * i, device=dev, dtype=torch.bfloat16)
            out = torch.empty(t, i, device=dev, dtype=torch.bfloat16)
            case = f"{name} T={t} inter={i} bf16"
            for op in ("silu_and_mul", "gelu_and_mul"):
                mine, theirs = getattr(ours.activation, op), fi and getattr(fi.activation, op)
                rows.append(_row(op, case, lambda f=mine: f(x, out), theirs and (lambda f=theirs: f(x, out))))
    return rows


def rope_rows(fi, dev):
    rows = []
    for name, m in MODELS.items():
        d, hq, hk = m["d"], m["hq"], m["hk"]
        inv = 1.0 / (1e4 ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d))
        ang = torch.arange(MAX_POS, device=dev, dtype=torch.float32)[:, None] * inv[None, :]
        cache = torch.cat([ang.cos(), ang.sin()], dim=1).contiguous()
        for t in TOKENS:
            qkv = torch.randn(t, (hq + 2 * hk) * d, device=dev, dtype=torch.bfloat16)
            q, k = qkv[:, : hq * d], qkv[:, hq * d : (hq + hk) * d]
            pos = torch.randint(0, MAX_POS, (t,), device=dev)
            case = f"{name} T={t} {hq}/{hk}x{d} bf16"
            op = "apply_rope_with_cos_sin_cache_inplace"
            rows.append(_row(op, case, lambda: getattr(ours.rope, op)(pos, q, k, d, cache, True),
                             fi and (lambda: getattr(fi.rope, op)(pos, q, k, d, cache, True))))  # fmt: skip
    return rows


def sampling_rows(fi, dev):
    rows = []
    # (the larger vocabulary first: a run cut short by a time limit keeps its rows)
    for name, m in sorted(MODELS.items(), key=lambda kv: -kv[1]["vocab"]):
        V = m["vocab"]
        for b in TOKENS:
            logits = torch.randn(b, V, device=dev) * 3
            probs = torch.softmax(logits, dim=1)
            top_k = torch.full((b,), 50, device=dev, dtype=torch.int32)
            top_p = torch.full((b,), 0.9, device=dev)
            # Flatter rows (high temperatures): softmax of 2 * randn and of randn. Their top-p bands hold thousands
            # of elements (more than the candidate slots for randn at V=128256: the second level).
            flat2 = torch.softmax(torch.randn(b, V, device=dev) * 2, dim=1)
            flat1 = torch.softmax(torch.randn(b, V, device=dev), dim=1)
            case = f"{name} B={b} V={V}"
            cases = [
                ("softmax", lambda mod: mod.sampling.softmax(logits, 0.8)),
                ("sampling_from_probs", lambda mod: mod.sampling.sampling_from_probs(probs)),
                ("top_k_sampling_from_probs", lambda mod: mod.sampling.top_k_sampling_from_probs(probs, top_k)),
                ("top_p_sampling_from_probs", lambda mod: mod.sampling.top_p_sampling_from_probs(probs, top_p)),
                ("top_k_top_p_sampling_from_probs",
                 lambda mod: mod.sampling.top_k_top_p_sampling_from_probs(probs, top_k, top_p)),
                ("top_p_sampling_from_probs flat 2*randn",
                 lambda mod: mod.sampling.top_p_sampling_from_probs(flat2, top_p)),
                ("top_p_sampling_from_probs flat randn",
                 lambda mod: mod.sampling.top_p_sampling_from_probs(flat1, top_p)),
            ]  # fmt: skip
            for op, call in cases:
                rows.append(_row(op, case, lambda c=call: c(ours), fi and (lambda c=call: c(fi))))
    return rows


GROUPS = {"norm": norm_rows, "activation": activation_rows, "rope": rope_rows, "sampling": sampling_rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="results folder (default: benchmarks/results)")
    ap.add_argument("--only", default=",".join(GROUPS), help="comma-separated groups: " + ",".join(GROUPS))
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--prebuild-only", action="store_true", help="only build FlashInfer's JIT modules, then exit")
    args = ap.parse_args()
    groups = [g for g in args.only.split(",") if g]
    for g in groups:
        if g not in GROUPS:
            ap.error(f"--only: unknown group {g!r}")
    if not torch.cuda.is_available():
        sys.exit("bench_ops needs a CUDA GPU")
    fi = None if args.no_flashinfer else import_flashinfer()
    if fi is not None and getattr(fi, "__name__", "") == ours.__name__:
        sys.exit("'flashinfer' resolves to flashinfer_triton: put the real FlashInfer on PYTHONPATH")
    if fi is not None:
        import flashinfer.activation  # noqa: F401
        import flashinfer.norm  # noqa: F401
        import flashinfer.rope  # noqa: F401
        import flashinfer.sampling  # noqa: F401

        _prebuild(fi, groups)
    if args.prebuild_only:
        return
    torch.manual_seed(0)
    meta = {
        "timing": "best of three medians of _common.bench (do_bench's method, L2 flushed, host time kept out), "
        "ours and FlashInfer alternating; eager public-API calls, microseconds",
        "flashinfer": getattr(fi, "__version__", None) if fi is not None else None,
    }
    rows = []
    for g in groups:  # the table is rewritten after every group, so a cut-short run keeps what it measured
        rows += GROUPS[g](fi, torch.device("cuda"))
        path = write_json("ops", rows, meta, args.out)
    print_table(rows, ["op", "case", "ours_us", "flashinfer_us", "ratio"])
    print(path)


if __name__ == "__main__":
    main()
