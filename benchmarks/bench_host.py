"""Host time per eager call: ours against FlashInfer, in the same process.

    PYTHONPATH=src python3 benchmarks/bench_host.py [--iters 300] [--out DIR] [--no-flashinfer]
    PYTHONPATH=src python3 benchmarks/bench_host.py --python-only --iters 400
    PYTHONPATH=src python3 benchmarks/bench_host.py --fi-build-only DONE_FILE   # warm FlashInfer's JIT

What an engine that runs a layer eagerly pays is the host time of each call, not the kernel's: each row is
the wall time of ``--iters`` back-to-back calls divided by ``--iters``, with one device synchronization at
the end (the GPU work of these small shapes is shorter than the host's, so the figure is the host's). Both
libraries get the same inputs (fp16, page size 16, NHD caches). ``plan()`` rows are given host page tables
(``indptr``, ``indices`` and ``last_page_len`` on the CPU), as engines that build them in Python do.

The 30-layer rows time one eager forward step of a model's attention: one ``plan()`` then one ``run()`` per
layer, each layer over its own cache, for SmolLM2-135M's shape (9 query / 3 KV heads, head dim 64) and
Llama-3-8B's (32 / 8, head dim 128); prefill is 1 request of 512 new tokens, decode 8 requests of 1024 keys.

Writes ``benchmarks/results/<gpu>/host.json``: ``{"rows": [{case, ours_us, flashinfer_us, ratio}]}`` with
``ratio = flashinfer_us / ours_us`` (above 1: ours spends less host time). ``--device cpu`` runs our side on
the CPU path (a smoke test of the script; FlashInfer needs CUDA).

``--python-only`` times the Python of ``plan()`` alone, on this machine's CPU, with no GPU: the Triton
implementations are selected for CPU tensors (as on CUDA, so their planning code runs) and nothing is
launched (``plan()`` launches nothing). Rows: decode ``plan()`` at batch 1 and 8, prefill ``plan()`` of 1 x 128
over 512 and 4 x 256 over 1024 keys (the shapes above, host page tables), and mini-sglang's per-step plan()
forms (``minisglang_plans``: the CUDA-graph decode wrapper and the fa2 prefill wrapper, page size 1); each figure
is the best of ``--rounds`` rounds of ``--iters`` back-to-back calls (``time.perf_counter_ns``). It writes nothing.
The planning code sees 4 SMs off CUDA (so that interpreter tests split); ``--sms 132`` plans as for an H100 (decode
plans of these shapes then split their requests, as they do on the GPU machine).

``--fi-build-only DONE_FILE`` builds, all at once, the FlashInfer JIT modules the cases use (one case of each
module, ``fi_variants``; FlashInfer compiles each on first use, tens of seconds), then writes DONE_FILE; nothing
is timed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

PAGE = 16
DTYPE = torch.float16


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def per_call_us(fn, iters: int, device, warmup: int = 10) -> float:
    """Wall microseconds per call of ``iters`` back-to-back calls with one synchronization at the end."""
    for _ in range(warmup):
        fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) / iters * 1e6


def _i32(values, device="cpu"):
    return torch.tensor(values, dtype=torch.int32, device=device)


def page_table(kv_lens, device, gen, spare: int = 0):
    """(indptr, indices, last_page_len, num_pages) on ``device`` for requests of ``kv_lens`` keys: the shared
    builder's table, its page order drawn from ``gen``."""
    seed = int(torch.randint(1 << 30, (), generator=gen))
    return C.page_table(kv_lens, PAGE, spare_pages=spare, seed=seed, device=device)


def kv_cache(num_pages, hkv, d, device, gen):
    return torch.randn(num_pages, 2, PAGE, hkv, d, generator=gen, dtype=torch.float32).to(device, DTYPE)


def decode_wrapper(lib, ws, table, hq, hkv, d):
    w = lib.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    w.plan(*table, hq, hkv, d, PAGE, q_data_type=DTYPE, kv_data_type=DTYPE)
    return w


def prefill_wrapper(lib, ws, qo_indptr, table, hq, hkv, d, causal=True):
    w = lib.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    w.plan(qo_indptr, *table, hq, hkv, d, PAGE, causal=causal, q_data_type=DTYPE, kv_data_type=DTYPE)
    return w


def cases(lib, device, gen):
    """(case name, builder, FlashInfer module key) triples for one library; a builder makes the inputs (and plans)
    and returns a callable that is one eager call of the public API. Built lazily, so that ``--only`` compiles only
    what it times. The key names the JIT module FlashInfer 0.7.2 builds for the case (its kind, dtype and head dim:
    the batch, heads and page size are runtime arguments there); ``--fi-build-only`` builds one case of each key."""
    cpu = torch.device("cpu")
    hq, hkv, d = 32, 8, 128
    fp16 = str(DTYPE)[6:]
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=device)
    out = []

    # decode run() / plan()
    for bs, keys in ((1, 512), (8, 1024)):

        def decode_run(bs=bs, keys=keys):
            ip, ix, lp, n = page_table([keys] * bs, cpu, gen)
            cache = kv_cache(n, hkv, d, device, gen)
            w = decode_wrapper(lib, ws, (ip, ix, lp), hq, hkv, d)
            q = torch.randn(bs, hq, d, generator=gen).to(device, DTYPE)
            return lambda: w.run(q, cache)

        def decode_plan(bs=bs, keys=keys):
            t = page_table([keys] * bs, cpu, gen)[:3]
            wp = lib.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
            return lambda: wp.plan(*t, hq, hkv, d, PAGE, q_data_type=DTYPE, kv_data_type=DTYPE)

        out.append((f"decode run() bs{bs} {keys} keys 32/8 D128", decode_run, ("batch decode", fp16, d)))
        out.append((f"decode plan() bs{bs} {keys} keys, host page table", decode_plan, ("batch decode", fp16, d)))

    # prefill run() / plan(), paged, causal
    for bs, qlen, keys in ((1, 128, 512), (4, 256, 1024)):
        qo = _i32([i * qlen for i in range(bs + 1)])

        def prefill_run(bs=bs, qlen=qlen, keys=keys, qo=qo):
            ip, ix, lp, n = page_table([keys] * bs, cpu, gen)
            cache = kv_cache(n, hkv, d, device, gen)
            w = prefill_wrapper(lib, ws, qo, (ip, ix, lp), hq, hkv, d)
            q = torch.randn(bs * qlen, hq, d, generator=gen).to(device, DTYPE)
            return lambda: w.run(q, cache)

        def prefill_plan(bs=bs, keys=keys, qo=qo):
            t = page_table([keys] * bs, cpu, gen)[:3]
            wp = lib.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
            return lambda: wp.plan(qo, *t, hq, hkv, d, PAGE, causal=True, q_data_type=DTYPE, kv_data_type=DTYPE)

        paged = ("paged prefill", fp16, d)
        out.append((f"prefill run() {bs}x{qlen} over {keys} paged causal", prefill_run, paged))
        out.append((f"prefill plan() bs{bs} {qlen} over {keys}, host page table", prefill_plan, paged))

    def merge():
        va, vb = (torch.randn(64, hq, d, generator=gen).to(device, DTYPE) for _ in range(2))
        sa, sb = (torch.randn(64, hq, generator=gen).to(device) for _ in range(2))
        return lambda: lib.merge_state(va, sa, vb, sb)

    out.append(("merge_state 64 x 32 heads D128", merge, ("cascade ops",)))

    def append():
        # 8 requests, one new token each (a decode step's append)
        lens = [1000 + 7 * i for i in range(8)]
        ip, ix, lp, n = page_table(lens, device, gen, spare=8)
        cache = kv_cache(n, hkv, d, device, gen)
        key = torch.randn(8, hkv, d, generator=gen).to(device, DTYPE)
        value = torch.randn(8, hkv, d, generator=gen).to(device, DTYPE)
        append_indptr = _i32(list(range(9)), device)
        seq_lens = lib.get_seq_lens(ip, lp, PAGE)
        bi, pos = lib.get_batch_indices_positions(append_indptr, seq_lens, 8)
        return lambda: lib.append_paged_kv_cache(key, value, bi, pos, cache, ix, ip, lp, kv_layout="NHD")

    out.append(("append_paged_kv_cache 8 tokens", append, ("page ops",)))

    def cascade():
        # 8 requests sharing a 2048-key prefix, 256 own keys each (decode)
        shared_pages, own_pages, bs = 2048 // PAGE, 256 // PAGE, 8
        # one table: the prefix as the first request, then each request's own pages
        _, perm, _, n = page_table([2048] + [256] * bs, cpu, gen)
        cache = kv_cache(n, hkv, d, device, gen)
        cw = lib.MultiLevelCascadeAttentionWrapper(2, ws, "NHD")
        cw.plan(
            [_i32([0, bs]), _i32(list(range(bs + 1)))],
            [_i32([0, shared_pages]), _i32([i * own_pages for i in range(bs + 1)])],
            [perm[:shared_pages], perm[shared_pages:]],
            [_i32([PAGE]), _i32([PAGE] * bs)],
            hq, hkv, d, PAGE, q_data_type=DTYPE, kv_data_type=DTYPE,
        )  # fmt: skip
        q = torch.randn(bs, hq, d, generator=gen).to(device, DTYPE)
        return lambda: cw.run(q, cache)

    # (its levels run FlashInfer's paged prefill module, then merge_state_in_place: both modules of other keys,
    # built again here under FlashInfer's build lock, which ninja finds up to date)
    out.append(("cascade run() 8 x (2048 shared + 256 own) decode", cascade, ("cascade wrapper", fp16, d)))

    def single(kind):
        k1 = torch.randn(1024, hkv, d, generator=gen).to(device, DTYPE)
        v1 = torch.randn(1024, hkv, d, generator=gen).to(device, DTYPE)
        if kind == "decode":
            q1 = torch.randn(hq, d, generator=gen).to(device, DTYPE)
            return lambda: lib.single_decode_with_kv_cache(q1, k1, v1)
        qp = torch.randn(128, hq, d, generator=gen).to(device, DTYPE)
        return lambda: lib.single_prefill_with_kv_cache(qp, k1, v1, causal=True)

    out.append(("single_decode_with_kv_cache 1024 keys", lambda: single("decode"), ("single decode", fp16, d)))
    out.append(
        ("single_prefill_with_kv_cache 128 over 1024 causal", lambda: single("prefill"), ("single prefill", fp16, d))
    )

    # 30-layer eager steps: one plan() then one run() per layer, each layer over its own cache
    for model, heads in (("SmolLM2-135M", (9, 3, 64)), ("Llama-3-8B", (32, 8, 128))):
        mhkv, md = heads[1], heads[2]

        def decode_step(heads=heads, mhkv=mhkv, md=md):
            t = page_table([1024] * 8, cpu, gen)
            caches = [kv_cache(t[3], mhkv, md, device, gen) for _ in range(30)]
            q = torch.randn(8, heads[0], md, generator=gen).to(device, DTYPE)
            dw = lib.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")

            def step():
                dw.plan(*t[:3], *heads, PAGE, q_data_type=DTYPE, kv_data_type=DTYPE)
                for c in caches:
                    dw.run(q, c)

            return step

        def prefill_step(heads=heads, mhkv=mhkv, md=md):
            # 1 request of 512 new tokens (empty cache before: 512 keys), causal
            t = page_table([512], cpu, gen)
            caches = [kv_cache(t[3], mhkv, md, device, gen) for _ in range(30)]
            qo = _i32([0, 512])
            q = torch.randn(512, heads[0], md, generator=gen).to(device, DTYPE)
            pw = lib.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")

            def step():
                pw.plan(qo, *t[:3], *heads, PAGE, causal=True, q_data_type=DTYPE, kv_data_type=DTYPE)
                for c in caches:
                    pw.run(q, c)

            return step

        out.append((f"30-layer decode step {model} 8 x 1024", decode_step, ("batch decode", fp16, md)))
        out.append((f"30-layer prefill step {model} 1 x 512", prefill_step, ("paged prefill", fp16, md)))
    return out


def wanted(name: str, only: str | None) -> bool:
    """Whether ``--only`` (substrings separated by ``|``; None: all) selects the case."""
    return not only or any(o in name for o in only.split("|"))


def measure(lib, device, iters: int, only: str | None = None, seed: int = 0) -> dict:
    """{case: microseconds per call} for one library (a failing case is reported and left out)."""
    gen = torch.Generator().manual_seed(seed)
    res = {}
    for name, make, _ in cases(lib, device, gen):
        if not wanted(name, only):
            continue
        n = max(3, iters // 30) if name.startswith("30-layer") else iters
        try:
            fn = make()
            res[name] = per_call_us(fn, n, device, warmup=3 if name.startswith("30-layer") else 10)
        except Exception as exc:
            print(f"[{lib.__name__}] {name}: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
            _sync(device)
    return res


def fi_variants(only: str | None = None) -> list:
    """``[(key, case name)]``: the first selected case of each FlashInfer module key (see ``cases``)."""
    seen, out = set(), []
    for name, _, key in cases(None, torch.device("cpu"), torch.Generator()):
        if wanted(name, only) and key not in seen:
            seen.add(key)
            out.append((key, name))
    return out


def fi_build_only(done_file: str, device, only: str | None = None, seed: int = 0) -> None:
    """Build FlashInfer's modules for the selected cases at once: one call of one case per module key, with the
    inputs the timed run builds (its own workspace and generator, so concurrent plans share nothing)."""
    fi = C.import_flashinfer()
    if fi is None:
        return C.fi_absent(done_file)

    def call(name):
        gen = torch.Generator().manual_seed(seed)
        make = {n: m for n, m, _ in cases(fi, device, gen)}[name]
        make()()

    C.fi_prebuild(done_file, fi_variants(only), call)


def python_only(iters: int, rounds: int, sms: int | None = None) -> list:
    """``[(case, us)]``: the Python time of ``plan()`` on the CPU, Triton planning code selected (see the
    module's docstring); ``sms``: the SM count the planning code assumes (None: its CPU default)."""
    import flashinfer_triton
    from flashinfer_triton import _backend, _decode_impl, _prefill_impl

    # every attention call on CPU tensors selects the Triton implementations, whose plan() is host code only
    _backend.use_triton = lambda device: True
    if sms is not None:
        _decode_impl._num_sms = _prefill_impl._num_sms = lambda device: sms
    gen = torch.Generator().manual_seed(0)
    cpu = torch.device("cpu")
    hq, hkv, d = 32, 8, 128
    ws = torch.empty(128 << 20, dtype=torch.uint8)
    calls = []
    for bs, keys in ((1, 512), (8, 1024)):
        t = page_table([keys] * bs, cpu, gen)[:3]
        w = flashinfer_triton.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        calls.append(
            (
                f"decode plan() bs{bs} {keys} keys, host page table",
                lambda w=w, t=t: w.plan(*t, hq, hkv, d, PAGE, q_data_type=DTYPE, kv_data_type=DTYPE),
            )
        )
    for bs, qlen, keys in ((1, 128, 512), (4, 256, 1024)):
        qo = _i32([i * qlen for i in range(bs + 1)])
        t = page_table([keys] * bs, cpu, gen)[:3]
        w = flashinfer_triton.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        calls.append(
            (
                f"prefill plan() bs{bs} {qlen} over {keys}, host page table",
                lambda w=w, t=t, qo=qo: w.plan(
                    qo, *t, hq, hkv, d, PAGE, causal=True, q_data_type=DTYPE, kv_data_type=DTYPE
                ),
            )
        )
    calls += minisglang_plans()
    rows = []
    for name, fn in calls:
        for _ in range(20):
            fn()
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter_ns()
            for _ in range(iters):
                fn()
            best = min(best, (time.perf_counter_ns() - t0) / iters / 1e3)
        rows.append((name, best))
    return rows


def minisglang_plans() -> list:
    """``[(case, call)]``: the plan() forms mini-sglang calls every step, on CPU tensors (``--python-only``): the
    CUDA-graph decode wrapper (buffers passed, ``indptr`` / ``last_page_len`` / ``seq_lens`` on the host, page size
    1, lengths that grow by one key per step over 40 steps) and the fa2 prefill wrapper (page size 1, causal,
    ``seq_lens``), 9 query / 3 KV heads of head dim 64, bf16. On the GPU machine the page indices are on the device;
    here they are host tensors."""
    import flashinfer_triton

    hq, hkv, d, dt, slots = 9, 3, 64, torch.bfloat16, 65536
    i32 = dict(dtype=torch.int32)
    gen = torch.Generator().manual_seed(1)
    calls = []
    for bs in (1, 8, 32):
        ws = torch.empty(128 << 20, dtype=torch.uint8)
        w = flashinfer_triton.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(
            ws, torch.zeros(bs + 1, **i32), torch.zeros(bs * 1024, **i32), torch.ones(bs, **i32), "NHD"
        )
        steps = []
        for step in range(40):
            lens = [300 + step + 7 * i for i in range(bs)]
            steps.append(
                dict(
                    indptr=torch.tensor([0] + lens, **i32).cumsum_(0).to(torch.int32),
                    indices=torch.randperm(slots, generator=gen, dtype=torch.int32)[: sum(lens)],
                    last_page_len=torch.ones(bs, **i32),
                    num_qo_heads=hq,
                    num_kv_heads=hkv,
                    head_dim=d,
                    page_size=1,
                    pos_encoding_mode="NONE",
                    seq_lens=torch.tensor(lens, **i32),
                    data_type=dt,
                    q_data_type=dt,
                    kv_data_type=dt,
                    non_blocking=True,
                )  # fmt: skip
            )
        it = iter(range(1 << 62))
        calls.append(
            (
                f"graph decode plan() bs{bs} ~{300 + 7 * (bs - 1) // 2} keys, page size 1 (mini-sglang)",
                lambda w=w, steps=steps, it=it: w.plan(**steps[next(it) % 40]),
            )
        )
    for bs in (1, 8, 32):
        ws = torch.empty(128 << 20, dtype=torch.uint8)
        w = flashinfer_triton.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
        cu = torch.tensor([0] + [256] * bs, **i32).cumsum_(0).to(torch.int32)
        kw = dict(
            qo_indptr=cu, paged_kv_indptr=cu,
            paged_kv_indices=torch.randperm(slots, generator=gen, dtype=torch.int32)[: 256 * bs],
            paged_kv_last_page_len=torch.ones(bs, **i32), num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=d,
            page_size=1, pos_encoding_mode="NONE", seq_lens=torch.full((bs,), 256, **i32), q_data_type=dt,
            kv_data_type=dt, non_blocking=True, causal=True,
        )  # fmt: skip
        calls.append(
            (f"prefill plan() bs{bs} 256 over 256, page size 1, fa2 (mini-sglang)", lambda w=w, kw=kw: w.plan(**kw))
        )
    return calls


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--out", default=None, help="results root (default benchmarks/results): <root>/<gpu>/host.json")
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--only", default=None, help="only the cases whose name contains one of these (a|b)")
    ap.add_argument("--python-only", action="store_true", help="the Python time of plan() on the CPU (no GPU)")
    ap.add_argument("--rounds", type=int, default=5, help="--python-only: rounds, the best one kept")
    ap.add_argument("--sms", type=int, default=None, help="--python-only: the SM count planning assumes (132: H100)")
    ap.add_argument("--fi-build-only", default=None, metavar="DONE_FILE", help="only build FlashInfer's JIT modules")
    args = ap.parse_args()
    if args.fi_build_only:
        fi_build_only(args.fi_build_only, torch.device(args.device), args.only)
        return
    if args.python_only:
        for name, us in python_only(args.iters, args.rounds, args.sms):
            print(f"{name:66s} {us:8.1f} us")
        return
    device = torch.device(args.device)
    import flashinfer_triton

    fi = None if args.no_flashinfer or device.type != "cuda" else C.import_flashinfer()
    # Both libraries measured in turn, twice, keeping each case's faster figure (host noise is one-sided).
    ours, theirs = {}, {}
    for _ in range(2):
        for k, v in measure(flashinfer_triton, device, args.iters, args.only).items():
            ours[k] = min(v, ours.get(k, float("inf")))
        if fi is not None:
            for k, v in measure(fi, device, args.iters, args.only).items():
                theirs[k] = min(v, theirs.get(k, float("inf")))
    rows = []
    for name, us in ours.items():
        f = theirs.get(name)
        rows.append(
            dict(
                case=name,
                ours_us=round(us, 1),
                flashinfer_us=None if f is None else round(f, 1),
                ratio=None if f is None else round(f / us, 3),
            )
        )
    C.print_table(rows, ["case", "ours_us", "flashinfer_us", "ratio"])
    out_dir = os.path.dirname(C.results_path("host", args.out))
    os.makedirs(out_dir, exist_ok=True)
    doc = {
        "op": "host",
        "gpu": C.gpu_name() if device.type == "cuda" else "cpu",
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "flashinfer": getattr(fi, "__version__", None),
        "method": f"wall time of {args.iters} back-to-back eager calls / {args.iters}, one sync at the end; "
        "30-layer steps: plan() + 30 run() per step",
        "rows": rows,
    }
    try:
        import triton

        doc["triton"] = triton.__version__
    except Exception:  # pragma: no cover
        pass
    path = os.path.join(out_dir, "host.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
