"""Tile sweep of vLLM's paged_attention_v1 (our decode kernel, vLLM layout) against our CSR decode on the
same data, both replayed from CUDA graphs (issue 6: within 5% of CSR).

    PYTHONPATH=src python3 scripts/vllm_sweep.py [--cases 64x4096,256x1024] [--out DIR]

For each case: CSR with its default tiles, then v1 under each (BLOCK_N, num_warps, num_stages) override
(``_decode_impl.CONFIG_OVERRIDE``, which only the vLLM path reads during the sweep: CSR is planned first),
keys loaded as 3-D tiles (default) and as [BLOCK_N, D] tiles; prints the best against CSR.

    python scripts/vllm_sweep.py --offline csr,v1-k1,v1-k2,v2-k2-r128 [--out DIR]

compiles instead (no GPU: sm_90 through a stand-in driver, specialised as the JIT would for 64 x 4096 32/8
D128 block 16 fp16 (``--offline-shape 1x32768``: other sequences x keys), CPU tensors) and prints per label
(``bench_vllm_paged.parse_label``) registers / stack / shared bytes (cuobjdump), the TTGIR's ``async_wait``
counts and ``cp.async`` copies, and the SASS instruction mix of the longest loop holding tensor-core MMAs (the
key loop, also for v2, whose fused reduction has a longer loop); ``--out`` keeps each kernel's ttgir / ptx / sass.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))

import bench_vllm_paged as B  # noqa: E402

from flashinfer_triton import _decode_impl  # noqa: E402


def _stand_in_driver():
    """Make Triton compile for sm_90 without a GPU (what ``JITFunction.run`` asks of the driver)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class _StandIn:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

    driver.set_active(_StandIn())


def _host(labels, iters=3000, profile=False):
    """Host time per call of ``paged_attention_v1`` / ``_v2`` up to the launch, on this machine: CPU tensors, the
    Triton path forced, ``_decode_kernel.run`` with ``warmup=True`` (argument binding, specialisation key, cache
    lookup of the sm_90 kernel: everything but the driver's launch). Labels ``v1@1x32768``, ``v2@64x4096``, ...
    (32/8 heads, D128, block 16, fp16). Prints the median per call, the part inside ``_decode_kernel.run``, and
    with ``profile`` the top of a cProfile of the calls."""
    import cProfile
    import functools
    import pstats
    import statistics
    import time

    _stand_in_driver()
    from flashinfer_triton import vllm
    from flashinfer_triton.kernels import decode as K

    vllm.use_triton = lambda device: True
    _decode_impl._num_sms = lambda device: 132
    run0 = K._decode_kernel.run
    spent = [0.0]

    def run(*a, grid, warmup, **kw):
        t0 = time.perf_counter()
        r = run0(*a, grid=grid, warmup=True, **kw)
        spent[0] += time.perf_counter() - t0
        return r

    K._decode_kernel.run = run
    hq, hkv, d, bs, x = 32, 8, 128, 16, 8
    dt = torch.float16
    for label in labels:
        version, shape = label.split("@")
        bsz, kv_len = (int(v) for v in shape.split("x"))
        pages = bsz * kv_len // bs
        q = torch.randn(bsz, hq, d, dtype=dt)
        out = torch.empty_like(q)
        kc = torch.empty(pages, hkv, d // x, bs, x, dtype=dt)
        vc = torch.empty(pages, hkv, d, bs, dtype=dt)
        bt = torch.randperm(pages, dtype=torch.int32).view(bsz, -1)
        sl = torch.full((bsz,), kv_len, dtype=torch.int32)
        parts = -(-kv_len // 512)
        es = torch.empty(bsz, hq, parts)
        ml = torch.empty_like(es)
        tmp = torch.empty(bsz, hq, parts, d, dtype=dt)
        scale = d**-0.5
        if version == "v1":
            fn = functools.partial(vllm.paged_attention_v1, out, q, kc, vc, hkv, scale, bt, sl, bs, kv_len, None,
                                   "auto", 1.0, 1.0)  # fmt: skip
        else:
            fn = functools.partial(vllm.paged_attention_v2, out, es, ml, tmp, q, kc, vc, hkv, scale, bt, sl, bs,
                                   kv_len, None, "auto", 1.0, 1.0)  # fmt: skip
        for _ in range(50):
            fn()
        times = []
        spent[0] = 0.0
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        med = statistics.median(times) * 1e6
        print(f"{label}: {med:.1f} us per call (median of {iters}; min {min(times) * 1e6:.1f}), of which "
              f"_decode_kernel.run {spent[0] / iters * 1e6:.1f} us (mean)", flush=True)  # fmt: skip
        if profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(500):
                fn()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(14)


def _offline(labels, out_dir=None, shape=(64, 4096)):
    """Compile the labelled variants for sm_90 on a machine without a GPU and print their compile facts."""
    import collections
    import math
    import re
    import subprocess

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class _StandIn:  # what JITFunction.run asks of the driver before compiling
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

    driver.set_active(_StandIn())
    from flashinfer_triton._backend import AttentionBatch, AttentionOptions, Workspace
    from flashinfer_triton.kernels import decode as K

    compiled = []
    run0 = K._decode_kernel.run

    def run(*a, grid, warmup, **kw):  # compile only (warmup), never launch
        compiled.append(run0(*a, grid=grid, warmup=True, **kw))
        return compiled[-1]

    K._decode_kernel.run = run
    _decode_impl._num_sms = lambda device: 132
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    (bsz, kv_len), (hq, hkv, d, bs, x) = shape, (32, 8, 128, 16, 8)
    pages = bsz * kv_len // bs
    dt = torch.float16
    defaults = {
        k: getattr(_decode_impl, k)
        for k in (
            "VLLM_K3D",
            "VLLM_MAXNREG",
            "VLLM_PAGE_PREFETCH",
            "VLLM_V2_PARTS_PER_PROGRAM",
            "MERGE_MAX_K",
            "MERGE_TILE",
            "VLLM_V2_FUSED",
        )
    }
    for label in labels:
        q = torch.randn(bsz, hq, d, dtype=dt)
        out = torch.empty_like(q)
        if label == "csr" or label.startswith("csr-"):
            # csr[-rope][-alibi][-cap][-fp8][-bf16][-d64|-d96|-d256][-g1|-g8][-ps1][-masked]: CSR decode options
            parts_ = label.split("-")[1:]
            c_d = next((int(p_[1:]) for p_ in parts_ if p_[:1] == "d" and p_[1:].isdigit()), d)
            c_g = next((int(p_[1:]) for p_ in parts_ if p_[:1] == "g" and p_[1:].isdigit()), hq // hkv)
            c_bs = 1 if "ps1" in parts_ else bs
            c_dt = torch.bfloat16 if "bf16" in parts_ else dt
            kv_dt = torch.float8_e4m3fn if "fp8" in parts_ else c_dt
            extra = {}
            if "rope" in parts_:
                extra["pos_encoding_mode"] = "ROPE_LLAMA"
            if "alibi" in parts_:
                extra["pos_encoding_mode"] = "ALIBI"
            if "cap" in parts_:
                extra["logits_soft_cap"] = 30.0
            c_pages = bsz * kv_len // c_bs
            opts = AttentionOptions(num_qo_heads=hkv * c_g, num_kv_heads=hkv, head_dim=c_d, page_size=c_bs,
                                    paged=True, is_decode=True, sm_scale=c_d**-0.5, q_dtype=c_dt, kv_dtype=kv_dt,
                                    o_dtype=c_dt, **extra)  # fmt: skip
            q = torch.randn(bsz, hkv * c_g, c_d, dtype=c_dt)
            out = torch.empty_like(q)
            lens = torch.full((bsz,), kv_len, dtype=torch.int32)
            indptr = torch.arange(bsz + 1, dtype=torch.int32) * (kv_len // c_bs)
            batch = AttentionBatch(bsz, torch.arange(bsz + 1, dtype=torch.int32), indptr,
                                   torch.arange(c_pages, dtype=torch.int32), lens, torch.arange(bsz + 1), lens.long(),
                                   indptr.long())  # fmt: skip
            if "alibi" in parts_:
                batch.alibi_slopes = torch.rand(hkv * c_g)
            ws = Workspace(torch.empty(128 << 20, dtype=torch.uint8), torch.empty(8 << 20, dtype=torch.uint8))
            saved_whole = _decode_impl.CSR_WHOLE_TILES
            _decode_impl.CSR_WHOLE_TILES = "masked" not in parts_
            try:
                plan = _decode_impl.plan(opts, batch, ws)
                kv = torch.empty(c_pages, c_bs, hkv, c_d, dtype=kv_dt)
                _decode_impl.run(plan, opts, batch, q, kv, kv, out, None)
            finally:
                _decode_impl.CSR_WHOLE_TILES = saved_whole
        else:
            version, settings, tiles = B.parse_label(label)
            for key, val in {**defaults, **settings}.items():
                setattr(_decode_impl, key, val)
            _decode_impl.CONFIG_OVERRIDE.clear()
            _decode_impl.CONFIG_OVERRIDE.update(tiles)
            parts = math.ceil(kv_len / 512)
            kw = dict(partitioned=False)
            if version == "v2":
                tmp = torch.empty(bsz, hq, parts, d, dtype=dt)
                kw = dict(partitioned=True, max_num_partitions=parts, exp_sums=torch.empty(bsz, hq, parts),
                          max_logits=torch.empty(bsz, hq, parts), tmp_out=tmp)  # fmt: skip
            try:
                _decode_impl.run_vllm(q, torch.empty(pages, hkv, d // x, bs, x, dtype=dt),
                                      torch.empty(pages, hkv, d, bs, dtype=dt), out,
                                      torch.arange(pages, dtype=torch.int32).view(bsz, -1),
                                      torch.full((bsz,), kv_len, dtype=torch.int32), num_kv_heads=hkv,
                                      scale=d**-0.5, alibi_slopes=None, k_scale=1.0, v_scale=1.0,
                                      max_seq_len=kv_len, **kw)  # fmt: skip
            finally:
                for key, val in defaults.items():
                    setattr(_decode_impl, key, val)
                _decode_impl.CONFIG_OVERRIDE.clear()
        kern = compiled[-1]
        folder = os.path.join(out_dir or "/tmp", f"vllm-offline-{label}")
        os.makedirs(folder, exist_ok=True)
        for ext, src in kern.asm.items():
            with open(os.path.join(folder, f"kernel.{ext}"), "wb" if isinstance(src, bytes) else "w") as f:
                f.write(src)
        cubin = os.path.join(folder, "kernel.cubin")
        tool = os.path.join(bindir, "cuobjdump")
        res = subprocess.run([tool, "-res-usage", cubin], capture_output=True, text=True)
        sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True).stdout
        with open(os.path.join(folder, "kernel.sass"), "w") as f:
            f.write(sass)
        usage = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res.stdout)
        ttgir = kern.asm["ttgir"]
        # The main loop: the longest backward branch of the SASS whose body holds tensor-core MMAs (the key
        # loop; v2's fused reduction has a longer loop without them).
        ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
        loop = (0, -1)
        for addr, txt in ins:
            m = re.search(r"BRA (0x[0-9a-f]+)", txt)
            if m and int(m.group(1), 16) < addr and addr - int(m.group(1), 16) > loop[1] - loop[0]:
                lo = int(m.group(1), 16)
                if any("HMMA" in t for a, t in ins if lo <= a <= addr):
                    loop = (lo, addr)
        # The innermost loop holding MMAs (for v2 with several partitions per program: the key loop inside the
        # partition loop).
        inner = (0, 1 << 62)
        for addr, txt in ins:
            m = re.search(r"BRA (0x[0-9a-f]+)", txt)
            if m and int(m.group(1), 16) < addr and addr - int(m.group(1), 16) < inner[1] - inner[0]:
                lo = int(m.group(1), 16)
                if any("HMMA" in t for a, t in ins if lo <= a <= addr):
                    inner = (lo, addr)
        imix = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for a, t in ins
                                   if inner[0] <= a <= inner[1])  # fmt: skip
        mix = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for a, t in ins
                                  if loop[0] <= a <= loop[1])  # fmt: skip
        waits = re.findall(r"async_wait[^{]*[{]num = (\d+)", ttgir)
        copies = len(re.findall(r"async_copy_global_to_local[^\n]*xf16", ttgir))
        top = ", ".join(f"{k} {v}" for k, v in mix.most_common(12))
        converts = ttgir.count("ttg.convert_layout")
        itop = ", ".join(f"{k} {v}" for k, v in imix.most_common(8))
        print(f"{label}: regs {usage.group(1)}, stack {usage.group(2)} B, local {usage.group(4)} B, shared "
              f"{kern.metadata.shared} B; async_wait num {waits}; f16 cp.async copies {copies}, convert_layout "
              f"{converts}; longest loop {sum(mix.values())} SASS instrs: {top}; innermost MMA loop "
              f"{sum(imix.values())}: {itop}", flush=True)  # fmt: skip


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="64x4096 32/8,256x1024")
    ap.add_argument("--out", default=None)
    ap.add_argument("--modes", default="1,0", help="VLLM_K3D values (0: 2-D keys, 1: 3-D + permute, 2: [N, D/x, x])")
    ap.add_argument("--block-n", default="32,64,128")
    ap.add_argument("--offline", default=None, help="compile these labels for sm_90 without a GPU (see above)")
    ap.add_argument("--host", default=None, help="host time per call (no GPU), e.g. v1@1x32768,v2@1x32768")
    ap.add_argument("--profile", action="store_true", help="--host: also a cProfile of the calls")
    ap.add_argument("--offline-shape", default="64x4096", help="--offline: sequences x keys (e.g. 1x32768)")
    args = ap.parse_args(argv)
    if args.host:
        return _host([x.strip() for x in args.host.split(",") if x.strip()], profile=args.profile)
    if args.offline:
        shape = tuple(int(v) for v in args.offline_shape.split("x"))
        return _offline([x.strip() for x in args.offline.split(",") if x.strip()], args.out, shape)
    dev = torch.device("cuda")
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    result = []
    for case in [c for c in B.CASES if any(c[0].startswith(p) for p in args.cases.split(","))]:
        data = B.build(case, dev)
        csr, csr_one = B.csr_fns(case, data, ws)
        csr_ms = B.graph_ms(csr)
        rows = []
        for bn, nw, ns, k3d in itertools.product(
            [int(x) for x in args.block_n.split(",")], (4, 8), (2, 3, 4), [int(x) for x in args.modes.split(",")]
        ):
            _decode_impl.CONFIG_OVERRIDE.clear()
            _decode_impl.CONFIG_OVERRIDE.update(BLOCK_N=bn, num_warps=nw, num_stages=ns)
            _decode_impl.VLLM_K3D = k3d
            try:
                fns, out = B.vllm_fns(case, data, "v1")
                fns[0]()
                ref = csr_one()
                diff = float((out.float() - ref.float()).abs().max())
                ms = B.graph_ms(fns)
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is a result too
                rows.append(dict(cfg=[bn, nw, ns, k3d], error=f"{type(exc).__name__}: {str(exc)[:120]}"))
                continue
            rows.append(dict(cfg=[bn, nw, ns, k3d], ms=ms, ratio_vs_csr=csr_ms / ms, maxdiff=diff))
        _decode_impl.CONFIG_OVERRIDE.clear()
        _decode_impl.VLLM_K3D = True
        ok = sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"])
        print(f"{case[0]}: CSR {csr_ms * 1e3:.1f} us")
        for r in ok[:8]:
            print(f"   BLOCK_N {r['cfg'][0]} w{r['cfg'][1]} s{r['cfg'][2]} keys={r['cfg'][3]}: {r['ms'] * 1e3:.1f} us, "
                  f"{r['ratio_vs_csr']:.3f} of CSR, maxdiff {r['maxdiff']:.1e}")  # fmt: skip
        errs = [r for r in rows if "error" in r]
        if errs:
            print(f"   {len(errs)} configs failed, e.g. {errs[0]}")
        result.append(dict(case=case[0], csr_ms=csr_ms, rows=rows))
    if args.out:
        with open(os.path.join(args.out, "vllm-sweep.json"), "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), cases=result), f, indent=1)


if __name__ == "__main__":
    main()
