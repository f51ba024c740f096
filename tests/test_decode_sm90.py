"""The Gluon Hopper decode kernel (kernels/decode_sm90.py), sm_90 only.

On an sm_90 GPU: the batch decode wrapper against the float32 reference with the Gluon kernel forced on (outputs
poisoned with NaN, the unwritten slots of every last page and the spare pages NaN too), asserting that it ran,
split plans (the merge fused into the launch) and unsplit ones, and a CUDA graph replayed after re-plans with
other lengths. Without a GPU: the kernel compiles for sm_90a with no spills and fits two programs per SM, and
the planner's choice.
"""

from __future__ import annotations

import os

import pytest
import torch

import flashinfer_triton as fi
from conftest import INTERPRET, LSE_TOL, assert_close, poison
from flashinfer_triton import _config
from flashinfer_triton._config import GluonDecodeConfig
from helpers import expected_decode, make_paged, page_table, plan_as_on_h100

IS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _impl():
    from flashinfer_triton import _decode_impl

    return _decode_impl


def _record_gluon(monkeypatch) -> list:
    """The Gluon kernel's launches from now on (the work slots of each)."""
    impl = _impl()
    calls = []
    real = impl._run_gluon

    def spy(p, *a, **kw):
        calls.append(p.work_cap)
        return real(p, *a, **kw)

    monkeypatch.setattr(impl, "_run_gluon", spy)
    return calls


@pytest.fixture
def gluon_calls(monkeypatch):
    """The Gluon kernel on every plan it covers (``plans="all"``), whatever the environment says; its launches."""
    with _config.using(gluon_decode=GluonDecodeConfig(plans="all")):
        yield _record_gluon(monkeypatch)


@pytest.fixture
def gluon_split_calls(monkeypatch):
    """The Gluon kernel on the plans of the default's rule (``plans="split"``); its launches."""
    with _config.using(gluon_decode=GluonDecodeConfig(plans="split")):
        yield _record_gluon(monkeypatch)


# kv_lens, page_size, Hq, Hkv, D, layout, dtype
CASES = {
    # one long request: split into many pieces, merged inside the launch
    "split-1x9000-ps16-g4-NHD": ([9000], 16, 32, 8, 128, "NHD", torch.float16),
    "split-2-ps64-g8-HND-bf16": ([5000, 1234], 64, 16, 2, 128, "HND", torch.bfloat16),
    "split-ps8-g1-d64": ([3001, 17], 8, 4, 4, 64, "NHD", torch.float16),
    "split-ps32-g7-empty": ([4100, 0, 33], 32, 14, 2, 128, "NHD", torch.float16),
    # head dim 256: 32-key ring buffers (two pages of 16, one of 32), one program per SM
    "split-1x5000-ps16-g2-d256-bf16": ([5000], 16, 4, 2, 256, "NHD", torch.bfloat16),
    "split-ps32-g5-d256-HND": ([3000, 31, 0], 32, 10, 2, 256, "HND", torch.float16),
    # many requests, ragged lengths (some planned unsplit)
    "batch-ps16-g4": ([1, 17, 64, 65, 300, 1000, 2048, 513] * 5, 16, 32, 8, 128, "NHD", torch.float16),
    "batch-ps16-g3-HND-bf16": ([129, 2, 700, 64] * 10, 16, 12, 4, 128, "HND", torch.bfloat16),
    "batch-ps8-g1-d256-bf16": ([1, 40, 300, 1025] * 8, 8, 4, 4, 256, "NHD", torch.bfloat16),
}


@pytest.mark.gpu
@pytest.mark.skipif(not IS_SM90, reason="the Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("case_id", list(CASES))
def test_gluon_decode_against_reference(case_id, gluon_calls):
    lens, ps, hq, hkv, d, layout, dtype = CASES[case_id]
    calls = gluon_calls
    dev = torch.device("cuda")
    cache, indptr, indices, last, ks, vs = make_paged(
        lens, ps, hkv, d, dtype, dev, layout, "5d", spare_pages=3, nan_unused=True
    )
    q = torch.randn(len(lens), hq, d, device=dev).to(dtype)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device=dev), layout)
    w.plan(indptr, indices, last, hq, hkv, d, ps, q_data_type=dtype, sm_scale=0.07)
    for return_lse in (True, False):
        out = poison(torch.empty_like(q))
        lse = poison(torch.empty(q.shape[:2], dtype=torch.float32, device=dev))
        if return_lse:
            o, s = w.run(q, cache, out=out, lse=lse, return_lse=True)
        else:
            o = w.run(q, cache, out=out)
        torch.cuda.synchronize()
        eo, es = expected_decode(q, ks, vs, sm_scale=0.07)
        assert_close(o, eo.to(dtype))
        if return_lse:
            assert_close(s, es, *LSE_TOL, name="lse")
    assert len(calls) == 2, "the Gluon kernel did not run"


@pytest.mark.gpu
@pytest.mark.skipif(not IS_SM90, reason="the Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("variant", ["fixed-split-3-pages-fp32-out", "group-64", "fixed-split-1-page-ps64-HND"])
def test_gluon_decode_plan_options(variant, gluon_split_calls):
    """fixed_split_size (chunks of whole pages, no evening out), a float32 output, the largest group it takes."""
    calls = gluon_split_calls
    dev = torch.device("cuda")
    lens, ps, hq, hkv, layout, kw, odt = {
        "fixed-split-3-pages-fp32-out": ([1000, 77, 300], 16, 16, 4, "NHD", dict(fixed_split_size=3), torch.float32),
        "group-64": ([3000, 5], 16, 64, 1, "NHD", {}, torch.float16),
        "fixed-split-1-page-ps64-HND": ([700, 64], 64, 8, 2, "HND", dict(fixed_split_size=1), torch.float16),
    }[variant]
    d = 128
    cache, indptr, indices, last, ks, vs = make_paged(lens, ps, hkv, d, torch.float16, dev, layout, nan_unused=True)
    q = torch.randn(len(lens), hq, d, device=dev).half()
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device=dev), layout)
    w.plan(indptr, indices, last, hq, hkv, d, ps, o_data_type=odt, **kw)
    out = poison(torch.empty(q.shape, dtype=odt, device=dev))
    lse = poison(torch.empty(q.shape[:2], dtype=torch.float32, device=dev))
    w.run(q, cache, out=out, lse=lse, return_lse=True)
    eo, es = expected_decode(q, ks, vs, sm_scale=d**-0.5)
    assert_close(out, eo.to(odt), *((2e-3, 2e-3) if odt == torch.float32 else (None, None)))
    assert_close(lse, es, *LSE_TOL, name="lse")
    assert calls, "the Gluon kernel did not run"


@pytest.mark.gpu
@pytest.mark.skipif(not IS_SM90, reason="the Gluon kernel runs on sm_90 only")
def test_gluon_decode_small_workspace(gluon_split_calls):
    """A float workspace of a few partial rows forces chunks larger than the split rule's (still whole pages)."""
    calls = gluon_split_calls
    dev = torch.device("cuda")
    lens, hq, hkv, d, ps = [33333, 1001, 7777], 32, 8, 128, 16
    cache, indptr, indices, last, ks, vs = make_paged(lens, ps, hkv, d, torch.float16, dev, nan_unused=True)
    q = torch.randn(3, hq, d, device=dev).half()
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(13 * hq * (d + 1) * 4, dtype=torch.uint8, device=dev), "NHD")
    w.plan(indptr, indices, last, hq, hkv, d, ps)
    out = poison(torch.empty_like(q))
    w.run(q, cache, out=out)
    eo, _ = expected_decode(q, ks, vs, sm_scale=d**-0.5)
    assert_close(out, eo.half())
    assert calls, "the Gluon kernel did not run"


@pytest.mark.gpu
@pytest.mark.skipif(not IS_SM90, reason="the Gluon kernel runs on sm_90 only")
def test_gluon_decode_repeated_calls_reset_counters(gluon_calls):
    """Split plans count arrivals per (request, KV head); every launch must leave the counters at zero."""
    calls = gluon_calls
    dev = torch.device("cuda")
    lens = [6000, 2500]
    cache, indptr, indices, last, ks, vs = make_paged(lens, 16, 4, 128, torch.float16, dev)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device=dev), "NHD")
    w.plan(indptr, indices, last, 16, 4, 128, 16)
    for i in range(4):
        q = torch.randn(2, 16, 128, device=dev).half()
        out = poison(torch.empty_like(q))
        w.run(q, cache, out=out)
        eo, _ = expected_decode(q, ks, vs, sm_scale=128**-0.5)
        # (a counter left non-zero would make no piece of the next call the last one: its rows stay NaN)
        assert_close(out, eo.half(), name=f"call {i}")
    assert calls, "the Gluon kernel did not run"  # (once: the later calls take the plan's bound launch)


@pytest.mark.gpu
@pytest.mark.skipif(not IS_SM90, reason="the Gluon kernel runs on sm_90 only")
def test_gluon_decode_cuda_graph_replan(gluon_calls):
    """A graph captured after one plan() replays correctly after plans with other lengths and page counts."""
    calls = gluon_calls
    dev = torch.device("cuda")
    bs, hq, hkv, d, ps = 3, 16, 4, 128, 16
    max_pages = 600
    kc = torch.randn(max_pages, 2, ps, hkv, d, device=dev).half()
    ws = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
    indptr_buf = torch.zeros(bs + 1, dtype=torch.int32, device=dev)
    indices_buf = torch.zeros(max_pages, dtype=torch.int32, device=dev)
    last_buf = torch.zeros(bs, dtype=torch.int32, device=dev)
    w = fi.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(ws, indptr_buf, indices_buf, last_buf, "NHD")
    q = torch.randn(bs, hq, d, device=dev).half()
    out = torch.empty_like(q)

    def plan(lens):
        spare = max_pages - sum(-(-n // ps) for n in lens)
        indptr, perm, last, _ = page_table(lens, ps, spare_pages=spare, seed=None)
        w.plan(indptr.to(dev), perm.to(dev), last.to(dev), hq, hkv, d, ps)
        ks = [kc[perm[indptr[b] : indptr[b + 1]].long(), 0].reshape(-1, hkv, d)[:n] for b, n in enumerate(lens)]
        vs = [kc[perm[indptr[b] : indptr[b + 1]].long(), 1].reshape(-1, hkv, d)[:n] for b, n in enumerate(lens)]
        return ks, vs

    ks, vs = plan([300, 40, 1000])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        w.run(q, kc, out=out)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.run(q, kc, out=out)
    for lens in ([300, 40, 1000], [7000, 1, 2000], [17, 64, 9000]):
        ks, vs = plan(lens)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        eo, _ = expected_decode(q, ks, vs, sm_scale=d**-0.5)
        assert_close(out, eo.half(), name=f"lens {lens}")
    assert calls, "the Gluon kernel did not run"


@pytest.mark.gpu
@pytest.mark.skipif(not IS_SM90, reason="the Gluon kernel runs on sm_90 only")
def test_gluon_decode_falls_back_for_other_variants(gluon_calls):
    """Variants it does not cover (soft cap, page size 1, a window) run the Triton kernel, correctly."""
    calls = gluon_calls
    dev = torch.device("cuda")
    cache, indptr, indices, last, ks, vs = make_paged([3000], 1, 2, 128, torch.float16, dev, "NHD", "3d")
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device=dev), "NHD")
    w.plan(indptr, indices, last, 8, 2, 128, 1)
    q = torch.randn(1, 8, 128, device=dev).half()
    o = w.run(q, cache)
    eo, _ = expected_decode(q, ks, vs, sm_scale=128**-0.5)
    assert_close(o, eo.half())
    assert not calls


def test_gluon_decode_plan_choice(monkeypatch):
    """The planner's choice: only on sm_90 CUDA devices, only for the variants the kernel covers; "split" takes
    it for split plans only."""
    impl = _impl()
    import dataclasses

    from flashinfer_triton._backend import AttentionOptions

    base = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16, paged=True, is_decode=True,
                sm_scale=0.1)  # fmt: skip
    plan_as_on_h100(monkeypatch, impl)
    cuda = torch.device("cuda", 0)
    opts = AttentionOptions(**base)
    cfg = dataclasses.replace(impl.choose_config(opts), gluon=GluonDecodeConfig(plans="all"))
    assert impl._gluon_candidate(opts, cuda, cfg)
    assert not impl._gluon_candidate(opts, torch.device("cpu"), cfg)
    # its split plans aim at its own programs per SM, the Triton kernel's at split_target_waves
    assert impl._split_waves(opts, cuda, cfg) == cfg.gluon.split_waves
    assert impl._split_waves(AttentionOptions(**{**base, "page_size": 1}), cuda, cfg) == cfg.split_target_waves
    for change in (
        dict(page_size=1),
        dict(page_size=128),
        dict(paged=False, page_size=1),
        dict(head_dim=512),
        dict(head_dim=96),
        dict(head_dim=256, page_size=64),  # (a 32-key ring buffer at D256)
        dict(logits_soft_cap=30.0),
        dict(window_left=100),
        dict(pos_encoding_mode="ALIBI"),
        dict(pos_encoding_mode="ROPE_LLAMA"),
        dict(kv_dtype=torch.float8_e4m3fn),
        dict(num_qo_heads=8 * 65),
    ):
        assert not impl._gluon_candidate(AttentionOptions(**{**base, **change}), cuda, cfg), change
    assert impl._gluon_candidate(AttentionOptions(**{**base, "head_dim": 256}), cuda, cfg)
    # the plan's choice: "split" takes split eager plans, whole ones of 1-2 programs per SM (8 KV heads: 17-32
    # requests on 132 SMs), every plan at D256 and every CUDA-graph plan; never a key tile of part pages
    cfg = dataclasses.replace(cfg, gluon=GluonDecodeConfig(plans="split"))
    assert impl._gluon_use(opts, cfg, cuda, 1024, False, 4) and impl._gluon_use(opts, cfg, cuda, None, True, 4)
    assert not impl._gluon_use(opts, cfg, cuda, None, False, 4)  # too few programs to matter: the Triton kernel
    assert [impl._gluon_use(opts, cfg, cuda, None, False, b) for b in (16, 17, 32, 33)] == [False, True, True, False]
    d256 = AttentionOptions(**{**base, "head_dim": 256})
    cfg256 = dataclasses.replace(impl.choose_config(d256), gluon=GluonDecodeConfig(plans="split"))
    assert impl._gluon_use(d256, cfg256, cuda, None, False, 512)
    small = dataclasses.replace(cfg, block_n=16)
    opts32 = AttentionOptions(**{**base, "page_size": 32})
    assert impl._gluon_use(opts32, cfg, cuda, 1024, False, 4)
    assert not impl._gluon_use(opts32, small, cuda, 1024, False, 4)
    assert not impl._gluon_candidate(opts, cuda, dataclasses.replace(cfg, gluon=GluonDecodeConfig(plans="none")))


@pytest.mark.skipif(INTERPRET, reason="compiles for sm_90a; the interpreter has no compiler")
@pytest.mark.parametrize("variant", ["g4-ps16-lse", "g8-ps64-bf16-d64", "g2-ps16-bf16-d256"])
def test_gluon_decode_compiles_for_sm90(variant):
    """Offline sm_90a build (stand-in driver, nothing launched): no spills, and two programs fit on an SM
    (registers at the launch's cap, shared memory under half of the 227 KB); at D256 one program per SM."""
    import re
    import subprocess
    import sys
    import tempfile

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    script = os.path.join(root, "benchmarks", "bench_decode.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(root, "src"), os.environ.get("PYTHONPATH", "")])}
    args = {
        "g4-ps16-lse": ["--group", "4", "--ps", "16", "--lse"],
        "g8-ps64-bf16-d64": ["--group", "8", "--ps", "64", "--dtype", "bf16", "--d", "64"],
        "g2-ps16-bf16-d256": ["--group", "2", "--ps", "16", "--dtype", "bf16", "--d", "256", "--lse"],
    }[variant]
    d = int(args[args.index("--d") + 1]) if "--d" in args else 128
    block_n, stages, maxnreg = GluonDecodeConfig().tile(d)
    per_sm = 2 if d <= 128 else 1
    args += ["--maxnreg", str(maxnreg), "--stages", str(stages), "--bn", str(block_n)]
    # A Triton cache of its own: the figures come from this compile, never from an entry another process (a test
    # worker launching the kernel on the GPU, another build) wrote or is writing in the shared cache.
    with tempfile.TemporaryDirectory(prefix="triton-cache-") as cache:
        try:
            r = subprocess.run(
                [sys.executable, script, "--resources", *args],
                capture_output=True, text=True, timeout=300, env={**env, "TRITON_CACHE_DIR": cache},
            )  # fmt: skip
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"--resources {' '.join(args)}: no result in {e.timeout} s{_tails(e.stdout, e.stderr)}")
    out = f"--resources {' '.join(args)} exited {r.returncode}{_tails(r.stdout, r.stderr)}"
    assert r.returncode == 0, out
    # the three lines by their form (anything else the run prints, warnings included, is not read)
    shared = re.search(r"^shared (\d+) bytes, num_warps (\d+)$", r.stdout, re.M)
    res = re.search(r"^\s*REG:(\d+) STACK:(\d+) .*LOCAL:(\d+)", r.stdout, re.M)
    spills = re.search(r"^HGMMA=.* STL=(\d+) LDL=(\d+) ", r.stdout, re.M)
    assert shared and res and spills, f"a line of the report is missing: {out}"
    report = "\n".join(m[0].strip() for m in (shared, res, spills))
    assert int(shared[1]) <= 227 * 1024 // per_sm, f"shared memory over {per_sm} program(s) per SM:\n{report}"
    assert maxnreg * 8 * 32 * per_sm <= 65536  # (8 warps: the consumer warpgroup and the loader, padded)
    assert int(res[1]) <= maxnreg and res[2] == "0" and res[3] == "0", f"registers or stack:\n{report}"
    assert spills[1] == "0" and spills[2] == "0", f"spills:\n{report}"


def _tails(stdout, stderr) -> str:
    """A subprocess's stdout (its start and end: a ptxas error prints the whole PTX there) and the end of its
    stderr (the traceback), for a failure's message."""
    out, err = (x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (stdout, stderr))
    if len(out) > 6000:
        out = f"{out[:3000]}\n[... {len(out) - 6000} characters ...]\n{out[-3000:]}"
    return f"\n--- stdout:\n{out}\n--- stderr:\n{err[-6000:]}"


@pytest.mark.skipif(INTERPRET, reason="Gluon's descriptor class with compiled Triton only")
def test_gluon_descs_geometry():
    """run()'s caches as 2-D page descriptors: NHD and HND 5-D caches fit (rows and columns as the kernel indexes
    them), a cache view not 16-byte aligned does not (the Triton kernel runs it); the form is worked out once."""
    impl = _impl()
    from flashinfer_triton._backend import AttentionOptions

    opts = AttentionOptions(num_qo_heads=8, num_kv_heads=2, head_dim=128, page_size=16, paged=True, is_decode=True)
    q = torch.empty(1, 8, 128, dtype=torch.float16)
    fi.clear_host_caches("gluon_geometries")
    nhd = torch.empty(10, 2, 16, 2, 128, dtype=torch.float16)  # [pages, 2, slots, heads, D]
    k_desc, v_desc, rpp, hr, hc = impl._gluon_descs(q, nhd[:, 0], nhd[:, 1], opts)
    # NHD: a row = one slot's heads; page p starts at row p * (2 * 16) (K and V pages interleaved), head h at column
    # h * 128
    assert (rpp, hr, hc) == (32, 0, 128)
    assert list(k_desc.block_shape) == [16, 128] and k_desc.shape[1] == 256
    (form,) = fi.host_caches()["gluon_geometries"]
    assert form.shapes == ((10, 16, 2, 128), (10, 16, 2, 128)) and form.dtypes == (torch.float16, torch.float16)
    impl._gluon_descs(q, nhd[:, 0], nhd[:, 1], opts)
    assert fi.host_caches()["gluon_geometries"] == (form,)  # the same form: no new entry
    hnd = torch.empty(10, 2, 2, 16, 128, dtype=torch.float16)  # [pages, 2, heads, slots, D]
    _, _, rpp, hr, hc = impl._gluon_descs(q, hnd[:, 0].transpose(1, 2), hnd[:, 1].transpose(1, 2), opts)
    # HND: a row = one head's slot; page p at row p * (2 * 2 * 16), head h at row offset h * 16, column 0
    assert (rpp, hr, hc) == (64, 16, 0)
    flat = torch.empty(10 * 2 * 16 * 2 * 128 + 1, dtype=torch.float16)[1:].view(10, 2, 16, 2, 128)
    assert impl._gluon_descs(q, flat[:, 0], flat[:, 1], opts) is None  # 2-byte aligned


def test_split_chunks_start_on_page_boundaries(monkeypatch):
    """The Gluon kernel copies whole pages from a chunk's first key: every split chunk the planner makes (also when
    a small float workspace or the CUDA-graph slot count forces larger chunks) starts on a multiple of the key tile,
    hence of every page size it takes."""
    import numpy as np

    impl = _impl()
    from flashinfer_triton._backend import AttentionOptions

    opts = AttentionOptions(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=16, paged=True, is_decode=True)
    cfg = impl.choose_config(opts)
    monkeypatch.setattr(impl, "_num_sms", lambda device: 132)  # an H100's split decision on the CPU
    lens = np.array([33333, 1001, 7777], dtype=np.int64)
    cpu = torch.device("cpu")
    row_bytes = 32 * 129 * 4
    for slots in (10, 13, 40, 1000):  # float workspace of `slots` partial rows: the smaller, the larger the chunks
        layout = impl.eager_layout(opts, lens, slots * row_bytes, cpu, cfg)
        starts, lens_eff, chunk, work_cap, n_counters, align = layout
        assert chunk is not None and chunk % cfg.block_n == 0, (slots, chunk)
        host, num_work, _ = impl._work_host(3, work_cap, 3, n_counters, starts, lens, lens_eff, chunk, align)
        assert num_work <= slots
        assert np.all(host[work_cap : work_cap + num_work] % cfg.block_n == 0)
    for extra in (1, 3, 7, 33):  # CUDA-graph work slots past the batch
        chunk = impl._graph_chunk(opts, cfg, lens, 3, 132, extra, 1.0)
        assert chunk is not None and chunk % cfg.block_n == 0, (extra, chunk)
        assert int(np.maximum((lens + chunk - 1) // chunk, 1).sum()) <= 3 + extra
