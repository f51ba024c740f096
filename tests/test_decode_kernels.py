"""Triton batch decode (``_decode_impl``) against the float32 reference.

Kernel cases run on CUDA, or on CPU in Triton's interpreter (``TRITON_INTERPRET=1``); the interpreter
cases are tiny (a few programs, one or two key tiles each).
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import DEVICE, HAS_CUDA, assert_close_named
from flashinfer_triton import reference
from flashinfer_triton._backend import AttentionBatch, AttentionOptions, Workspace, use_triton
from helpers import page_table

TRITON_OK = use_triton(DEVICE)
needs_triton = pytest.mark.skipif(not TRITON_OK, reason="needs CUDA or TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")

# (atol, rtol) of the output; lse uses its own absolute tolerance.
TOL = {torch.float16: (3e-3, 3e-3), torch.bfloat16: (2e-2, 2e-2)}
LSE_TOL = {torch.float16: 2e-3, torch.bfloat16: 2e-2}
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def make_case(
    lens,
    page_size,
    hq,
    hkv,
    d,
    *,
    layout="NHD",
    dtype=torch.float16,
    kv_dtype=None,
    device=DEVICE,
    seed=0,
    spare_pages=3,
):
    """A random paged batch: cache (k, v as 4-D NHD views), page table on ``device``, host copies."""
    gen = torch.Generator().manual_seed(seed)
    kv_dtype = kv_dtype or dtype
    bsz = len(lens)
    indptr, indices, last, total = page_table(lens, page_size, spare_pages=spare_pages, seed=seed)
    shape = (total, page_size, hkv, d) if layout == "NHD" else (total, hkv, page_size, d)
    k_cache = torch.randn(shape, generator=gen).to(kv_dtype).to(device)
    v_cache = torch.randn(shape, generator=gen).to(kv_dtype).to(device)
    q = torch.randn((bsz, hq, d), generator=gen).to(dtype).to(device)
    kv_lens = torch.tensor(lens, dtype=torch.int32)
    batch = AttentionBatch(
        batch_size=bsz,
        qo_indptr=torch.arange(bsz + 1, dtype=torch.int32, device=device),
        kv_indptr=indptr.to(device),
        kv_indices=indices.to(device),
        kv_lens=kv_lens.to(device),
        qo_indptr_host=torch.arange(bsz + 1, dtype=torch.int64),
        kv_lens_host=kv_lens.to(torch.int64),
        kv_indptr_host=indptr.to(torch.int64),
        alibi_slopes=reference.alibi_slopes(hq).to(device),
    )
    k4, v4 = (k_cache, v_cache) if layout == "NHD" else (k_cache.transpose(1, 2), v_cache.transpose(1, 2))
    return dict(
        q=q, k_cache=k_cache, v_cache=v_cache, k=k4, v=v4, indptr=indptr, indices=indices, last=last, batch=batch
    )


def workspace(device=DEVICE, float_mb=16, graph=False, max_batch=None):
    return Workspace(
        float_buffer=torch.empty(float_mb << 20, dtype=torch.uint8, device=device),
        int_buffer=torch.empty(1 << 20, dtype=torch.uint8, device=device),
        cuda_graph=graph,
        max_batch_size=max_batch,
    )


def run_decode(case, opts, ws=None, *, k_scale=None, v_scale=None, return_lse=True, config=None):
    from flashinfer_triton import _decode_impl

    assert _decode_impl.supports(opts)
    ws = ws or workspace(case["q"].device)
    plan = _decode_impl.plan(opts, case["batch"], ws, config=config)
    out = torch.full_like(case["q"], float("nan"), dtype=opts.o_dtype)
    lse = torch.full(case["q"].shape[:2], float("nan"), device=case["q"].device) if return_lse else None
    _decode_impl.run(
        plan,
        opts,
        case["batch"],
        case["q"],
        case["k"],
        case["v"],
        out,
        lse,
        qk_scale_mult=1.0 if k_scale is None else k_scale,
        v_scale=1.0 if v_scale is None else v_scale,
    )
    return out, lse, plan


def reference_decode(case, layout, opts, k_scale=None, v_scale=None):
    return reference.batch_decode_with_paged_kv_cache(
        case["q"].cpu(),
        (case["k_cache"].cpu(), case["v_cache"].cpu()),
        case["indptr"],
        case["indices"],
        case["last"],
        layout,
        sm_scale=opts.sm_scale,
        logits_soft_cap=opts.logits_soft_cap or None,
        window_left=opts.window_left,
        pos_encoding_mode=opts.pos_encoding_mode,
        rope_scale=opts.rope_scale,
        rope_theta=opts.rope_theta,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def options(hq, hkv, d, page_size, *, dtype=torch.float16, kv_dtype=None, **kw):
    return AttentionOptions(
        num_qo_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        page_size=page_size,
        paged=True,
        sm_scale=kw.pop("sm_scale", 1.0 / math.sqrt(d)),
        is_decode=True,
        q_dtype=dtype,
        kv_dtype=kv_dtype or dtype,
        o_dtype=kw.pop("o_dtype", dtype),
        **kw,
    )


def check(lens, page_size, hq, hkv, d, layout="NHD", dtype=torch.float16, kv=None, k_scale=None, v_scale=None, **kw):
    kv_dtype = FP8[kv] if kv else None
    case = make_case(lens, page_size, hq, hkv, d, layout=layout, dtype=dtype, kv_dtype=kv_dtype)
    opts = options(hq, hkv, d, page_size, dtype=dtype, kv_dtype=kv_dtype, **kw)
    out, lse, plan = run_decode(case, opts, k_scale=k_scale, v_scale=v_scale)
    o_ref, lse_ref = reference_decode(case, layout, opts, k_scale, v_scale)
    atol, rtol = TOL[dtype]
    assert_close_named("out", out, o_ref, atol, rtol)
    assert_close_named("lse", lse, lse_ref, LSE_TOL[dtype], 0.0)
    return plan


# ----------------------------------------------------------------------------- interpreter-sized grid
# lens: kv_len 1, 17 (partly filled last page) and an empty request; 97 only where it stays cheap.
SMALL = [
    # (lens, page_size, hq, hkv, d, layout, dtype)
    ([1, 17, 0], 5, 4, 1, 64, "NHD", torch.float16),
    ([17, 0, 1], 16, 3, 1, 64, "HND", torch.float16),
    ([97, 0], 1, 8, 1, 64, "NHD", torch.bfloat16),
    ([17, 1], 5, 1, 1, 64, "HND", torch.bfloat16),
    ([17, 0], 16, 8, 2, 80, "NHD", torch.float16),
]


def _id(c):
    lens, ps, hq, hkv, d, layout, dtype = c
    return f"kv{'-'.join(map(str, lens))}-ps{ps}-hq{hq}-hkv{hkv}-d{d}-{layout}-{str(dtype)[6:]}"


@pytest.mark.interpret
@needs_triton
@pytest.mark.parametrize("case", SMALL, ids=_id)
def test_decode_grid(case):
    lens, ps, hq, hkv, d, layout, dtype = case
    check(lens, ps, hq, hkv, d, layout, dtype)


@pytest.mark.interpret
@needs_triton
@pytest.mark.parametrize(
    "kw",
    [
        dict(pos_encoding_mode="ROPE_LLAMA", rope_theta=500.0, rope_scale=2.0),
        dict(pos_encoding_mode="ALIBI"),
        dict(logits_soft_cap=5.0),
        dict(window_left=6),
        dict(window_left=0, logits_soft_cap=30.0, pos_encoding_mode="ALIBI"),
    ],
    ids=["rope", "alibi", "softcap", "window6", "window0-softcap-alibi"],
)
def test_decode_variants(kw):
    check([17, 0, 9], 5, 4, 1, 64, "NHD", torch.float16, **kw)


@pytest.mark.interpret
@needs_triton
@pytest.mark.parametrize("kv", ["e4m3", "e5m2"])
def test_decode_fp8_kv_with_scales(kv):
    check([17, 1], 16, 3, 1, 64, "HND", torch.float16, kv=kv, k_scale=0.7, v_scale=1.3)


@pytest.mark.interpret
@needs_triton
def test_decode_split_kv_and_no_lse():
    # A forced split (2 pages of 5 keys a chunk) goes through the partial buffer and the merge kernel.
    case = make_case([23, 0, 4], 5, 4, 1, 64)
    opts = options(4, 1, 64, 5, fixed_split_size=2)
    out, lse, plan = run_decode(case, opts)
    assert plan.needs_merge and plan.num_work == 5
    o_ref, lse_ref = reference_decode(case, "NHD", opts)
    assert_close_named("out", out, o_ref, *TOL[torch.float16])
    assert_close_named("lse", lse, lse_ref, LSE_TOL[torch.float16], 0.0)
    out2, lse2, _ = run_decode(case, opts, return_lse=False)
    assert lse2 is None
    assert_close_named("out (no lse)", out2, o_ref, *TOL[torch.float16])


@pytest.mark.interpret
@needs_triton
def test_decode_split_merge_repeat():
    """Split requests merged in the decode kernel (last chunk to arrive merges, group 3 padded to 4 rows); the
    same plan run twice (the arrival counters reset) agrees."""
    case = make_case([23, 0, 40, 4], 5, 6, 2, 64, seed=5)
    opts = options(6, 2, 64, 5, fixed_split_size=2)
    ws = workspace()
    o_ref, lse_ref = reference_decode(case, "NHD", opts)
    for i in range(2):
        out, lse, plan = run_decode(case, opts, ws)
        assert plan.needs_merge and plan.fused and plan.num_work == 9
        assert_close_named(f"out (call {i})", out, o_ref, *TOL[torch.float16])
        assert_close_named(f"lse (call {i})", lse, lse_ref, LSE_TOL[torch.float16], 0.0)
        assert int(plan.counters.abs().sum()) == 0


@pytest.mark.interpret
@needs_triton
def test_decode_ragged_rows():
    """paged=False: token j of request b is row kv_indptr[b] + j (single_decode uses this)."""
    from flashinfer_triton import _decode_impl

    gen = torch.Generator().manual_seed(3)
    lens, hq, hkv, d = [9, 0, 20], 6, 2, 64
    ind = torch.tensor([0, 9, 9, 29], dtype=torch.int32)
    k = torch.randn(29, hkv, d, generator=gen).half().to(DEVICE)
    v = torch.randn(29, hkv, d, generator=gen).half().to(DEVICE)
    q = torch.randn(3, hq, d, generator=gen).half().to(DEVICE)
    kl = torch.tensor(lens, dtype=torch.int32)
    batch = AttentionBatch(
        batch_size=3,
        qo_indptr=torch.arange(4, dtype=torch.int32, device=DEVICE),
        kv_indptr=ind.to(DEVICE),
        kv_indices=None,
        kv_lens=kl.to(DEVICE),
        qo_indptr_host=torch.arange(4),
        kv_lens_host=kl.long(),
    )
    opts = AttentionOptions(hq, hkv, d, 1, False, sm_scale=0.1, is_decode=True, fixed_split_size=8)
    plan = _decode_impl.plan(opts, batch, workspace())
    out = torch.full_like(q, float("nan"))
    lse = torch.full((3, hq), float("nan"), device=DEVICE)
    _decode_impl.run(plan, opts, batch, q, k[:, None], v[:, None], out, lse, qk_scale_mult=1.0, v_scale=1.0)
    for b in range(3):
        o_r, l_r = reference.attention(
            q[b : b + 1].cpu(), k[ind[b] : ind[b + 1]].cpu(), v[ind[b] : ind[b + 1]].cpu(), sm_scale=0.1
        )
        assert_close_named(f"out[{b}]", out[b], o_r[0], *TOL[torch.float16])
        assert_close_named(f"lse[{b}]", lse[b], l_r[0], LSE_TOL[torch.float16], 0.0)


@pytest.mark.interpret
@needs_triton
def test_decode_graph_mode_fixed_grid():
    """CUDA-graph mode planning: the grid is fixed by capacity across plans; idle slots write nothing."""
    ws = workspace(graph=True, max_batch=4)
    opts = options(4, 1, 64, 5)
    grids = set()
    for lens, seed in (([23, 0, 300, 4], 1), ([1, 200, 2], 2)):
        case = make_case(lens, 5, 4, 1, 64, seed=seed)
        out, lse, plan = run_decode(case, opts, ws)
        grids.add((plan.work_cap, plan.batch_cap))
        assert plan.graph and plan.needs_merge and plan.num_work <= plan.work_cap
        o_ref, lse_ref = reference_decode(case, "NHD", opts)
        assert_close_named(f"out {lens}", out, o_ref, *TOL[torch.float16])
        assert_close_named(f"lse {lens}", lse, lse_ref, LSE_TOL[torch.float16], 0.0)
    assert len(grids) == 1


def test_supports_and_split_rule():
    """Host-side only: which variants are covered, and the split-size rule."""
    from flashinfer_triton import _decode_impl

    assert _decode_impl.supports(options(32, 8, 128, 16))
    assert not _decode_impl.supports(options(32, 8, 128, 16, has_custom_mask=True))
    assert not _decode_impl.supports(options(32, 8, 100, 16))
    assert not _decode_impl.supports(AttentionOptions(32, 8, 128, 16, True, is_decode=False, q_dtype=torch.float16))
    import numpy as np

    # 1 x 32768 on 132 SMs with 8 KV heads: split; 64 x 4096 x 8 heads: no split.
    opts = options(32, 8, 128, 16)
    cfg = _decode_impl.choose_config(opts)
    assert cfg.block_n == 64
    assert _decode_impl._chunk_size(opts, cfg, np.array([32768]), 1, 132) is not None
    assert _decode_impl._chunk_size(opts, cfg, np.array([4096] * 64), 64, 132) is None
    no_split = options(32, 8, 128, 16, disable_split_kv=True)
    assert _decode_impl._chunk_size(no_split, cfg, np.array([32768]), 1, 132) is None


# ----------------------------------------------------------------------------- CUDA only
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("page_size", [1, 5, 16])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_decode_gpu_grid(layout, page_size, group, dtype):
    hkv = 2
    check([1, 17, 97, 0, 300], page_size, hkv * group, hkv, 128, layout, dtype)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("d", [64, 96, 256])
@pytest.mark.parametrize(
    "kw",
    [
        {},
        dict(pos_encoding_mode="ROPE_LLAMA"),
        dict(pos_encoding_mode="ALIBI", logits_soft_cap=20.0),
        dict(window_left=100),
    ],
    ids=["plain", "rope", "alibi-softcap", "window"],
)
def test_decode_gpu_head_dims_variants(d, kw):
    check([1, 17, 97, 0, 1000], 16, 7 * 2, 2, d, "NHD", torch.float16, **kw)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kv", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_decode_gpu_fp8(kv, dtype):
    check([1, 17, 97, 0, 2000], 16, 32, 8, 128, "HND", dtype, kv=kv, k_scale=0.5, v_scale=2.0)


@pytest.mark.gpu
@needs_cuda
def test_decode_gpu_long_and_wide():
    # Long KV (split-KV chosen by the planner) and 128+ requests (no split).
    plan = check([32768 - 3], 16, 32, 8, 128, "NHD", torch.float16, pos_encoding_mode="ROPE_LLAMA")
    assert plan.needs_merge
    gen = torch.Generator().manual_seed(1)
    lens = torch.randint(0, 700, (160,), generator=gen).tolist()
    plan = check(lens, 16, 32, 8, 128, "NHD", torch.bfloat16)
    assert not plan.needs_merge


@pytest.mark.gpu
@needs_cuda
def test_decode_gpu_cuda_graph_replan():
    """Capture run() after plan A, re-plan B (other lengths and page counts), replay, compare."""
    from flashinfer_triton import _decode_impl

    hq, hkv, d, ps, cap = 32, 8, 128, 16, 8
    ws = workspace(graph=True, max_batch=cap)
    lens_a = [3000, 17, 0, 1, 97, 5000, 64, 2]
    lens_b = [1, 9000, 33, 0, 700, 16, 12000, 250]
    case_a = make_case(lens_a, ps, hq, hkv, d, seed=1, spare_pages=2000)
    case_b = make_case(lens_b, ps, hq, hkv, d, seed=2, spare_pages=10)
    opts = options(hq, hkv, d, ps)
    # Persistent buffers, as the CUDA-graph wrapper keeps them (sized for the larger table).
    dev = DEVICE
    indptr_buf = torch.zeros(cap + 1, dtype=torch.int32, device=dev)
    indices_buf = torch.zeros(4096, dtype=torch.int32, device=dev)
    lens_buf = torch.zeros(cap, dtype=torch.int32, device=dev)
    pages = max(case_a["k_cache"].shape[0], case_b["k_cache"].shape[0])
    k_buf = torch.zeros((pages, ps, hkv, d), dtype=torch.float16, device=dev)
    v_buf = torch.zeros_like(k_buf)
    q_buf = torch.zeros((cap, hq, d), dtype=torch.float16, device=dev)
    out = torch.full((cap, hq, d), float("nan"), dtype=torch.float16, device=dev)
    lse = torch.full((cap, hq), float("nan"), device=dev)

    def load(case):
        n = case["indices"].numel()
        indptr_buf.copy_(case["indptr"])
        indices_buf[:n].copy_(case["indices"])
        lens_buf.copy_(case["batch"].kv_lens)
        k_buf[: case["k_cache"].shape[0]].copy_(case["k_cache"])
        v_buf[: case["v_cache"].shape[0]].copy_(case["v_cache"])
        q_buf.copy_(case["q"])
        b = case["batch"]
        batch = AttentionBatch(
            cap, b.qo_indptr, indptr_buf, indices_buf[:n], lens_buf, b.qo_indptr_host, b.kv_lens_host
        )
        return _decode_impl.plan(opts, batch, ws), batch

    plan_a, batch_a = load(case_a)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _decode_impl.run(plan_a, opts, batch_a, q_buf, k_buf, v_buf, out, lse, qk_scale_mult=1.0, v_scale=1.0)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _decode_impl.run(plan_a, opts, batch_a, q_buf, k_buf, v_buf, out, lse, qk_scale_mult=1.0, v_scale=1.0)
    for case, lens in ((case_b, lens_b), (case_a, lens_a)):
        plan, _ = load(case)
        assert plan.work_cap == plan_a.work_cap
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        o_ref, lse_ref = reference_decode(case, "NHD", opts)
        assert_close_named(f"graph out {lens}", out, o_ref, *TOL[torch.float16])
        assert_close_named(f"graph lse {lens}", lse, lse_ref, LSE_TOL[torch.float16], 0.0)


@pytest.mark.gpu
@needs_cuda
def test_decode_gpu_fused_merge_repeat():
    """One long request split over many chunks, merged in-kernel: repeated launches agree, counters end at 0."""
    case = make_case([32768 - 5, 3000], 16, 32, 8, 128, seed=7)
    opts = options(32, 8, 128, 16)
    ws = workspace(float_mb=64)
    o_ref, lse_ref = reference_decode(case, "NHD", opts)
    for _ in range(3):
        out, lse, plan = run_decode(case, opts, ws)
        assert plan.fused and plan.max_chunks > 8
        assert_close_named("out", out, o_ref, *TOL[torch.float16])
        assert_close_named("lse", lse, lse_ref, LSE_TOL[torch.float16], 0.0)
    torch.cuda.synchronize()
    assert int(plan.counters.abs().sum()) == 0


@pytest.mark.interpret
@needs_triton
@pytest.mark.parametrize("whole", [True, False], ids=["whole-tiles", "all-masked"])
@pytest.mark.parametrize("kw", [{}, dict(pos_encoding_mode="ALIBI", window_left=80)], ids=["plain", "alibi-window"])
def test_decode_whole_tiles_then_tail(whole, kw):
    """DecodeConfig.whole_tiles: the tiles wholly inside a request run unmasked, the last one masked (lengths a
    multiple of the key tile, one past it, shorter than one tile, empty); the all-masked loop gives the same
    answer."""
    import dataclasses

    from flashinfer_triton import _decode_impl

    case = make_case([97, 64, 0, 5], 16, 4, 1, 64, seed=11)
    opts = options(4, 1, 64, 16, **kw)
    cfg = dataclasses.replace(_decode_impl.choose_config(opts), whole_tiles=whole)
    out, lse, plan = run_decode(case, opts, config=cfg)
    assert plan.config.block_n <= 64 and 64 % plan.config.block_n == 0  # whole tiles and a tail both occur
    o_ref, lse_ref = reference_decode(case, "NHD", opts)
    assert_close_named("out", out, o_ref, *TOL[torch.float16])
    assert_close_named("lse", lse, lse_ref, LSE_TOL[torch.float16], 0.0)
