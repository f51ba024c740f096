"""The warp-specialized Gluon prefill kernel (kernels/prefill_sm90.py), Hopper only.

On an sm_90 GPU: every variant it covers against the float32 reference (outputs poisoned with NaN first),
asserting the Gluon kernel ran, plus a CUDA-graph capture replayed after re-plans with other lengths. Without
a GPU: the kernel compiles for sm_90a (Triton's binder with a stand-in driver; nothing is launched), and the
planner's choice between it and the Triton kernel.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from conftest import INTERPRET, assert_close_named
from flashinfer_triton import reference
from flashinfer_triton._backend import AttentionBatch, AttentionOptions, Workspace
from flashinfer_triton._config import GluonPrefillConfig
from helpers import nan_unused_slots, page_table, plan_as_on_h100, record_epilogues, use_config

IS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _impl():
    from flashinfer_triton import _prefill_impl

    return _prefill_impl


def _spy(monkeypatch, request, gluon=None):
    """Records the Gluon kernel's launches; the default Gluon configuration replaced by ``gluon`` (default: every
    head dim and group the kernel supports, D64 group 1 included) for the rest of the test."""
    impl = _impl()
    default = GluonPrefillConfig(head_dims=(64, 128, 256), groups=tuple(range(1, 17)), d64_min_group=1)
    use_config(request, gluon_prefill=gluon or default)
    calls = []
    real = impl._run_gluon

    def spy(*a, **kw):
        calls.append(a[1])
        return real(*a, **kw)

    monkeypatch.setattr(impl, "_run_gluon", spy)
    return calls


# (lens [(qo, kv), ...], make_case kwargs)
GLUON_CASES = {
    "causal-g1-d128-fp16": ([(300, 300), (200, 1000), (129, 129)], dict(hq=2, hkv=2, d=128, causal=True)),
    "full-g1-d128-bf16": ([(300, 700), (130, 5)], dict(hq=2, hkv=2, d=128, dtype=torch.bfloat16)),
    "causal-g4-d128-bf16": ([(64, 900), (100, 100)], dict(hq=8, hkv=2, d=128, dtype=torch.bfloat16, causal=True)),
    "full-g8-d64": ([(40, 333), (17, 17)], dict(hq=8, hkv=1, d=64)),
    "causal-g2-d64-qo>kv": ([(300, 100), (128, 0), (0, 50), (70, 200)], dict(hq=4, hkv=2, d=64, causal=True)),
    "causal-g16-d128-tail-nan": ([(16, 1000), (9, 300)], dict(hq=16, hkv=1, d=128, causal=True, kv_tail_nan=True)),
    "full-g1-d128-noncontig-q": ([(256, 513)], dict(hq=2, hkv=2, d=128, q_noncontig=True)),
    "causal-g4-d128-long": ([(2048, 2048)], dict(hq=32, hkv=8, d=128, causal=True)),
    # too few tiles for the GPU: the KV range is split, pieces into partial rows, merged by the merge launch
    "split-full-g4-d128": ([(64, 9000), (3, 3000)], dict(hq=8, hkv=2, d=128)),
    "split-causal-g1-d64-append": ([(300, 6000)], dict(hq=2, hkv=2, d=64, causal=True, kv_tail_nan=True)),
    # head dim 256: 64-key tiles, 2 stages
    "causal-g1-d256-bf16": (
        [(300, 300), (200, 1000), (129, 129)],
        dict(hq=2, hkv=2, d=256, dtype=torch.bfloat16, causal=True),
    ),  # fmt: skip
    "full-g2-d256-tail-nan": ([(150, 333), (70, 5)], dict(hq=4, hkv=2, d=256, kv_tail_nan=True)),
    "split-causal-g4-d256-append": ([(100, 4000)], dict(hq=8, hkv=2, d=256, causal=True)),
    # groups that do not divide 128, ragged K/V: runs of exactly 128 // group tokens per head (g3 42, g5 25, g6 21,
    # g7 18; at D256 too), the query rows loaded by the consumers, the last 2-3 rows idle
    "causal-g3-d128": ([(300, 300), (200, 1000), (43, 43)], dict(hq=6, hkv=2, d=128, causal=True)),
    "full-g5-d128-bf16": ([(100, 333), (30, 5)], dict(hq=10, hkv=2, d=128, dtype=torch.bfloat16)),
    "causal-g6-d128-qo>kv": ([(100, 60), (50, 500)], dict(hq=12, hkv=2, d=128, causal=True)),
    "causal-g7-d128-tail-nan": ([(120, 700), (17, 17)], dict(hq=7, hkv=1, d=128, causal=True, kv_tail_nan=True)),
    "causal-g3-d256": ([(150, 400)], dict(hq=3, hkv=1, d=256, causal=True, dtype=torch.bfloat16)),
    "split-full-g5-d128": ([(40, 9000)], dict(hq=10, hkv=2, d=128)),
    # logits soft cap (tanh, then the exponentials, both on the MUFU unit): caps that bend the scores
    "softcap-causal-g4-d128": (
        [(300, 300), (200, 1000), (129, 129)],
        dict(hq=8, hkv=2, d=128, causal=True, soft_cap=2.0),
    ),
    "softcap-full-g1-d256-bf16-tail-nan": (
        [(150, 333), (70, 5)],
        dict(hq=2, hkv=2, d=256, dtype=torch.bfloat16, soft_cap=5.0, kv_tail_nan=True),
    ),
    "softcap-causal-g7-d128-qo>kv": ([(100, 60), (50, 500)], dict(hq=7, hkv=1, d=128, causal=True, soft_cap=3.0)),
    "split-softcap-causal-g4-d128-append": ([(64, 9000)], dict(hq=8, hkv=2, d=128, causal=True, soft_cap=8.0)),
    # sliding windows: edge tiles masked before the body (windows narrower than a tile, 0 included, and wider)
    "window-causal-g4-d128": (
        [(300, 300), (200, 1000), (129, 129)],
        dict(hq=8, hkv=2, d=128, causal=True, window_left=100),
    ),  # fmt: skip
    "window0-causal-g1-d128-bf16": (
        [(200, 200)],
        dict(hq=2, hkv=2, d=128, causal=True, window_left=0, dtype=torch.bfloat16),
    ),  # fmt: skip
    "window-full-g1-d64-tail-nan": ([(300, 700), (130, 5)], dict(hq=2, hkv=2, d=64, window_left=200, kv_tail_nan=True)),
    "window-causal-g3-d256-bf16": (
        [(150, 600)],
        dict(hq=3, hkv=1, d=256, causal=True, window_left=333, dtype=torch.bfloat16),
    ),  # fmt: skip
    "split-window-softcap-causal-g5-d128-append": (
        [(40, 9000)],
        dict(hq=10, hkv=2, d=128, causal=True, window_left=3000, soft_cap=8.0),
    ),  # fmt: skip
}
SPLIT = {
    "split-window-softcap-causal-g5-d128-append",
    "causal-g1-d256-bf16",  # (6 query tiles x 2 KV heads)
    "split-full-g4-d128",
    "split-causal-g1-d64-append",
    "paged-split-full-ps16-g4",
    "split-causal-g4-d256-append",
    "split-full-g5-d128",
    "paged-split-causal-ps16-g3-d256",
    "split-softcap-causal-g4-d128-append",
}
# paged K/V (every page size the kernel takes, both layouts; the last pages' unwritten slots hold NaN)
GLUON_CASES.update(
    {
        "paged-causal-ps16-g4-NHD": (
            [(300, 700), (129, 129), (64, 1000)],
            dict(hq=8, hkv=2, d=128, page_size=16, causal=True),
        ),
        "paged-full-ps64-g1-HND-bf16": (
            [(200, 333), (130, 64)],
            dict(hq=2, hkv=2, d=128, page_size=64, layout="HND", dtype=torch.bfloat16),
        ),
        "paged-causal-ps8-g2-d64": ([(150, 400), (128, 77)], dict(hq=4, hkv=2, d=64, page_size=8, causal=True)),
        "paged-full-ps32-g8-HND": ([(40, 650)], dict(hq=8, hkv=1, d=128, page_size=32, layout="HND")),
        "paged-split-full-ps16-g4": ([(64, 9000)], dict(hq=8, hkv=2, d=128, page_size=16)),
        "paged-causal-ps64-g1-d256": ([(200, 333), (130, 64)], dict(hq=2, hkv=2, d=256, page_size=64, causal=True)),
        "paged-full-ps8-g2-d256-HND": ([(150, 400)], dict(hq=4, hkv=2, d=256, page_size=8, layout="HND")),
        "paged-causal-ps8-g7": ([(60, 300), (20, 90)], dict(hq=14, hkv=2, d=128, page_size=8, causal=True)),
        "paged-full-ps32-g3-HND-bf16": (
            [(100, 333)],
            dict(hq=6, hkv=2, d=128, page_size=32, layout="HND", dtype=torch.bfloat16),
        ),  # fmt: skip
        "paged-split-causal-ps16-g3-d256": ([(60, 5000)], dict(hq=6, hkv=2, d=256, page_size=16, causal=True)),
        "paged-softcap-causal-ps16-g3-HND": (
            [(200, 700), (129, 129)],
            dict(hq=6, hkv=2, d=128, page_size=16, layout="HND", causal=True, soft_cap=4.0),
        ),  # fmt: skip
        "paged-window-causal-ps8-g4": (
            [(300, 700), (129, 129)],
            dict(hq=8, hkv=2, d=128, page_size=8, causal=True, window_left=250),
        ),  # fmt: skip
    }
)


def _nan_unwritten_slots(case):
    """Unwritten slots of each request's last page (an engine's cache may hold anything there): NaN."""
    b = case["batch"]
    ps = case["opts"].page_size
    ind = b.kv_indices.cpu()
    for r in range(b.batch_size):
        lo, hi = int(b.kv_indptr_host[r]), int(b.kv_indptr_host[r + 1])
        n = int(b.kv_lens_host[r])
        if hi > lo and n % ps:
            page = int(ind[hi - 1])
            case["k4"][page, n % ps :] = float("nan")
            case["v4"][page, n % ps :] = float("nan")


@pytest.mark.gpu
@pytest.mark.skipif(not IS_SM90, reason="the Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("variant", ["lse", "no-lse"])
@pytest.mark.parametrize("case_id", list(GLUON_CASES))
def test_gluon_kernel_against_reference(case_id, variant, monkeypatch, request):
    from test_prefill_kernels import TOL, expected, make_case, run_impl

    lens, kw = GLUON_CASES[case_id]
    paged = "page_size" in kw
    case = make_case(lens, paged=paged, **kw)
    if paged:
        _nan_unwritten_slots(case)
    calls = _spy(monkeypatch, request)
    with_lse = variant != "no-lse"
    out, lse, plan_obj = run_impl(case, with_lse=with_lse, qk_scale_mult=0.8)
    torch.cuda.synchronize()
    assert plan_obj.config.gluon and len(calls) == 1
    assert (plan_obj.part_o is not None) == (case_id in SPLIT)
    want_o, want_lse = expected(case, 0.8, 1.0)
    atol, rtol, latol = TOL[case["opts"].o_dtype]
    assert_close_named("o", out, want_o, atol, rtol)
    if with_lse:
        assert_close_named("lse", lse, want_lse, latol, latol)


# The epilogue's row masks at their edges: requests whose lengths are not multiples of the tile (a tail tile's
# rows past its request are the next request's), groups 3 / 5 / 7 (rows past TILE_T x GROUP; runs by rows and
# 8-aligned paged runs), pages, D64 (three consumers) and D256, split pieces, windows, no-lse. The output rows go
# out through shared memory (stmatrix, 128-bit stores) except where that cannot apply: an output of another dtype
# than q's is stored from the registers (the launch's EPI_SMEM off), and so are split pieces' partial rows (inside
# the kernel: the compile tests count their 32-bit stores).
EPILOGUE_CASES = {
    "ragged-causal-g4-tails": (
        [(1, 1), (7, 50), (33, 33), (127, 400), (129, 129), (255, 700), (40, 0)],
        dict(hq=8, hkv=2, d=128, causal=True),
    ),  # fmt: skip
    "causal-g1-d128-fp16": GLUON_CASES["causal-g1-d128-fp16"],
    "causal-g3-d128": GLUON_CASES["causal-g3-d128"],
    "full-g5-d128-bf16": GLUON_CASES["full-g5-d128-bf16"],
    "causal-g7-d128-tail-nan": GLUON_CASES["causal-g7-d128-tail-nan"],
    "causal-g2-d64-qo>kv": GLUON_CASES["causal-g2-d64-qo>kv"],
    "full-g8-d64": GLUON_CASES["full-g8-d64"],
    "causal-g3-d256": GLUON_CASES["causal-g3-d256"],
    "full-g2-d256-tail-nan": GLUON_CASES["full-g2-d256-tail-nan"],
    "paged-causal-ps8-g7": GLUON_CASES["paged-causal-ps8-g7"],
    "paged-full-ps32-g3-HND-bf16": GLUON_CASES["paged-full-ps32-g3-HND-bf16"],
    "paged-causal-ps64-g1-d256": GLUON_CASES["paged-causal-ps64-g1-d256"],
    "paged-causal-ps8-g2-d64": GLUON_CASES["paged-causal-ps8-g2-d64"],
    "paged-causal-ps16-g5": ([(150, 400), (20, 90), (1, 16)], dict(hq=10, hkv=2, d=128, page_size=16, causal=True)),
    "split-full-g5-d128": GLUON_CASES["split-full-g5-d128"],
    "window-causal-g4-d128": GLUON_CASES["window-causal-g4-d128"],
    # (fp16 q, a bf16 output: the staged rows would take q's dtype, so they are stored from the registers)
    "out-bf16-causal-g7-d128": ([(300, 300), (77, 500)], dict(hq=14, hkv=2, d=128, causal=True)),
}
EPILOGUE_NO_LSE = {"ragged-causal-g4-tails", "causal-g3-d128", "paged-causal-ps8-g7", "full-g8-d64"}
EPILOGUE_OUT_DTYPE = {"out-bf16-causal-g7-d128": torch.bfloat16}


def _epilogue_case(case_id):
    """``EPILOGUE_CASES[case_id]`` as a case, its output dtype ``EPILOGUE_OUT_DTYPE``'s where given; and whether
    the one-shot launch stages the output rows (``EPI_SMEM``)."""
    from dataclasses import replace

    from test_prefill_kernels import make_case

    lens, kw = EPILOGUE_CASES[case_id]
    case = make_case(lens, paged="page_size" in kw, **kw)
    if case_id in EPILOGUE_OUT_DTYPE:
        case["opts"] = replace(case["opts"], o_dtype=EPILOGUE_OUT_DTYPE[case_id])
    return case, case_id not in EPILOGUE_OUT_DTYPE


@pytest.mark.gpu
@pytest.mark.skipif(not IS_SM90, reason="the Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize(
    "case_id,with_lse",
    [(c, True) for c in EPILOGUE_CASES] + [(c, False) for c in sorted(EPILOGUE_NO_LSE)],
)  # fmt: skip
def test_gluon_epilogue_against_reference(case_id, with_lse, monkeypatch, request):
    """The epilogue against the float32 reference, the outputs inside NaN-filled buffers with guard rows on both
    sides: every row of the batch written, none outside it; the launch took the store path its gates give."""
    from test_prefill_kernels import TOL, expected

    impl = _impl()
    case, staged = _epilogue_case(case_id)
    if "page_size" in EPILOGUE_CASES[case_id][1]:
        _nan_unwritten_slots(case)
    gcfg = GluonPrefillConfig(head_dims=(64, 128, 256), groups=tuple(range(1, 17)), d64_min_group=1)
    calls = _spy(monkeypatch, request, gcfg)
    epilogues = record_epilogues(monkeypatch)
    opts, dev = case["opts"], torch.device("cuda")
    ws = Workspace(
        float_buffer=torch.empty(1 << 20, dtype=torch.uint8, device=dev),
        int_buffer=torch.empty(1 << 16, dtype=torch.uint8, device=dev),
    )
    p = impl.plan(opts, case["batch"], ws)
    q = case["q"].to(dev)
    guard = 37
    o_buf = torch.full((q.shape[0] + 2 * guard, *q.shape[1:]), float("nan"), dtype=opts.o_dtype, device=dev)
    out = o_buf[guard : guard + q.shape[0]]
    l_buf = lse = None
    if with_lse:
        l_buf = torch.full((q.shape[0] + 2 * guard, q.shape[1]), float("nan"), dtype=torch.float32, device=dev)
        lse = l_buf[guard : guard + q.shape[0]]
    impl.run(p, opts, case["batch"], q, case["k4"].to(dev), case["v4"].to(dev), out, lse, qk_scale_mult=0.8)
    torch.cuda.synchronize()
    assert p.config.gluon and len(calls) == 1 and p.persist_nprog == 0
    # (a gate that wrongly fell back to the register stores, or staged an output of another dtype, fails here)
    assert epilogues == [("one-shot", staged)], epilogues
    want_o, want_lse = expected(case, 0.8, 1.0)
    atol, rtol, latol = TOL[opts.o_dtype]
    assert_close_named("o", out, want_o, atol, rtol)
    assert o_buf[:guard].isnan().all() and o_buf[guard + q.shape[0] :].isnan().all(), "o stored out of bounds"
    if with_lse:
        assert_close_named("lse", lse, want_lse, latol, latol)
        assert l_buf[:guard].isnan().all() and l_buf[guard + q.shape[0] :].isnan().all(), "lse out of bounds"


@pytest.mark.parametrize("case_id", list(EPILOGUE_CASES))
def test_gluon_epilogue_plan(case_id, monkeypatch, request):
    """The plans and launches of the GPU runs above, on any machine (as on an H100; the kernel stands in): the
    one-shot Gluon kernel, launched with the staged epilogue (``EPI_SMEM``) in every case whose output has q's
    dtype and without it otherwise, with and without lse."""
    impl = _impl()
    plan_as_on_h100(monkeypatch, impl)
    real = impl._gluon_candidate
    monkeypatch.setattr(impl, "_gluon_candidate", lambda o, d, g: real(o, torch.device("cuda", 0), g))
    gcfg = GluonPrefillConfig(head_dims=(64, 128, 256), groups=tuple(range(1, 17)), d64_min_group=1)
    _spy(monkeypatch, request, gcfg)
    epilogues = record_epilogues(monkeypatch, launch=False)
    case, staged = _epilogue_case(case_id)
    opts = case["opts"]
    p = impl.plan(opts, case["batch"], _small_ws())
    assert p.config.gluon and p.persist_nprog == 0
    assert (p.part_o is not None) == (case_id in SPLIT)
    q = case["q"]
    out = torch.empty(q.shape, dtype=opts.o_dtype)
    for lse in (None, torch.empty(q.shape[:2])):
        impl._run_gluon(p, opts, case["batch"], q, case["k4"], case["v4"], out, lse, 0.1)
    assert epilogues == [("one-shot", staged)] * 2, epilogues


# Runs by rows (ragged K/V, groups that do not divide 128: 128 // group tokens, the consumers load their query
# rows through q_ptr) at their edges; paged K/V keeps runs on the 8-row atom. (lens, make_case kwargs, tile_t)
Q_BY_ROWS_CASES = {
    # group 5 over 8 KV heads: a request of exactly one run, one of a single token, one without keys
    "g5-causal-hkv8-bf16": (
        [(300, 700), (25, 25), (1, 40), (40, 0)],
        dict(hq=40, hkv=8, d=128, causal=True, dtype=torch.bfloat16),
        25,
    ),  # fmt: skip
    # on the GPU, q's rows strided past its heads (stride_qt != heads x head dim), q not at its storage's start
    "g5-full-strided-q": ([(130, 300), (7, 9)], dict(hq=10, hkv=2, d=128), 25),
    # group 7, split, window and soft cap: 18-token runs into the partial rows
    "g7-split-window-softcap-append": (
        [(40, 9000)],
        dict(hq=14, hkv=2, d=128, causal=True, window_left=3000, soft_cap=8.0),
        18,
    ),  # fmt: skip
    # group 6 (not a default group): 21-token runs, 126 rows; queries past the keys
    "g6-causal-qo>kv": ([(100, 60), (64, 500)], dict(hq=12, hkv=2, d=128, causal=True), 21),
    # paged group 5: TMA copies of 8-token boxes, 24-token runs; unwritten slots NaN
    "g5-paged-causal-ps16": ([(150, 400), (20, 90)], dict(hq=10, hkv=2, d=128, page_size=16, causal=True), 24),
}


def _q_by_rows_case(case_id):
    from test_prefill_kernels import make_case

    lens, kw, tile_t = Q_BY_ROWS_CASES[case_id]
    return make_case(lens, paged="page_size" in kw, **kw), tile_t


@pytest.mark.parametrize("case_id", list(Q_BY_ROWS_CASES))
def test_gluon_q_by_rows_plan(case_id, monkeypatch, request):
    """The plans of the GPU runs below, on any machine (as on an H100): the Gluon kernel, runs of 128 // group
    tokens with ragged K/V, of a multiple of 8 with pages."""
    impl = _impl()
    plan_as_on_h100(monkeypatch, impl)
    real = impl._gluon_candidate
    monkeypatch.setattr(impl, "_gluon_candidate", lambda o, d, g: real(o, torch.device("cuda", 0), g))
    _spy(monkeypatch, request)
    case, tile_t = _q_by_rows_case(case_id)
    p = impl.plan(case["opts"], case["batch"], _small_ws())
    assert p.config.gluon and p.tile_t == tile_t
    assert (p.part_o is not None) == ("split" in case_id)


@pytest.mark.gpu
@pytest.mark.skipif(not IS_SM90, reason="the Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("case_id", list(Q_BY_ROWS_CASES))
def test_gluon_q_by_rows_against_reference(case_id, monkeypatch, request):
    """Runs by rows at their edges: outputs and lse against the reference (poisoned with NaN first), with the
    plan's run length asserted."""
    from test_prefill_kernels import TOL, expected

    impl = _impl()
    case, tile_t = _q_by_rows_case(case_id)
    opts, dev = case["opts"], torch.device("cuda")
    if opts.paged:
        _nan_unwritten_slots(case)
    calls = _spy(monkeypatch, request)
    q = case["q"].to(dev)
    if "strided-q" in case_id:
        wide = torch.zeros(q.shape[0], q.shape[1] + 2, q.shape[2], dtype=q.dtype, device=dev)
        wide[:, 1:-1] = q
        q = wide[:, 1:-1]
        assert q.stride(0) == (q.shape[1] + 2) * q.shape[2] and q.storage_offset() == q.shape[2]
    ws = Workspace(
        float_buffer=torch.empty(1 << 20, dtype=torch.uint8, device=dev),
        int_buffer=torch.empty(1 << 16, dtype=torch.uint8, device=dev),
    )
    p = impl.plan(opts, case["batch"], ws)
    out = torch.full(q.shape, float("nan"), dtype=opts.o_dtype, device=dev)
    lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device=dev)
    impl.run(p, opts, case["batch"], q, case["k4"].to(dev), case["v4"].to(dev), out, lse, qk_scale_mult=0.8)
    torch.cuda.synchronize()
    assert len(calls) == 1 and p.config.gluon and p.tile_t == tile_t
    want_o, want_lse = expected(case, 0.8, 1.0)
    atol, rtol, latol = TOL[case["opts"].o_dtype]
    assert_close_named("o", out, want_o, atol, rtol)
    assert_close_named("lse", lse, want_lse, latol, latol)


@pytest.mark.gpu
@pytest.mark.skipif(not IS_SM90, reason="the Gluon kernel runs on sm_90 only")
def test_gluon_q_by_rows_bound_run(monkeypatch, request):
    """A ragged wrapper's group-5 plan (25-token runs: the consumers read q through q_ptr): its first run binds
    the launch, and later calls with other q tensors of the same form take the bound launch, with their own q."""
    import flashinfer_triton as fi

    calls = _spy(monkeypatch, request)
    dev = torch.device("cuda")
    hq, hkv, d = 10, 2, 128
    lens = [(100, 300), (160, 400)]
    qo = torch.tensor([0, 100, 260], dtype=torch.int32, device=dev)
    kv = torch.tensor([0, 300, 700], dtype=torch.int32, device=dev)
    w = fi.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 24, dtype=torch.uint8, device=dev), "NHD")
    w.plan(qo, kv, hq, hkv, d, causal=True)
    info = w.plan_info()
    assert info.backend == "gluon" and info.details["tile_t"] == 25 and not info.split
    k, v = (torch.randn(700, hkv, d, device=dev).half() for _ in range(2))
    qs = []  # (kept alive: each call's q at its own address, so a q_ptr bound to an earlier one reads stale rows)
    for i in range(3):
        q = torch.randn(260, hq, d, device=dev).half()
        qs.append(q)
        out = w.run(q, k, v)
        torch.cuda.synchronize()
        want = torch.cat([
            reference.attention(q[a:a + n], k[b:b + m], v[b:b + m], causal=True)[0]
            for (n, m), a, b in zip(lens, (0, 100), (0, 300), strict=True)
        ])  # fmt: skip
        assert_close_named("o", out, want, 5e-3, 5e-3)
        # (the general path only at the first run: later ones go through the bound launch)
        assert len(calls) == 1 and w.plan_info().bound, i
    assert len({x.data_ptr() for x in qs}) == 3


def test_q_twice_launch():
    """The Gluon prefill kernel's bound launch takes the call's usual leading arguments and passes q's address
    again as q_ptr, right after lse (split: 5 leading arguments; else 7, out twice more)."""
    impl = _impl()
    seen = []
    b = impl._QTwice(lambda *a: seen.append(a) or True)
    assert b(1, 2, 3, 4, 5) and b(1, 2, 3, 4, 5, 4, 4)
    assert seen == [(1, 2, 3, 4, 5, 1), (1, 2, 3, 4, 5, 1, 4, 4)]
    names = impl._GLUON_KERNEL[0].arg_names if impl._GLUON_KERNEL else None
    if names is None:
        from flashinfer_triton.kernels.prefill_sm90 import _prefill_gluon_kernel

        names = _prefill_gluon_kernel.arg_names
    assert names[:8] == ["q_desc", "k_desc", "v_desc", "o_ptr", "lse_ptr", "q_ptr", "part_o_ptr", "part_lse_ptr"]


# D64: three consumer warpgroups (192-row tiles: 192 // group tokens, boxes of the largest power of two that
# divides them); group 16 keeps 8-token tiles of 128 rows, the two-consumer kernel under the same plan tile.
THREE_CONSUMER_CASES = {
    "c3-causal-g4": ([(300, 300), (200, 1000), (49, 49)], dict(hq=8, hkv=2, d=64, causal=True)),
    "c3-full-g1-bf16-tail-nan": (
        [(400, 700), (130, 5)],
        dict(hq=2, hkv=2, d=64, dtype=torch.bfloat16, kv_tail_nan=True),
    ),  # fmt: skip
    "c3-causal-g3-qo>kv": ([(100, 60), (250, 500)], dict(hq=6, hkv=2, d=64, causal=True)),
    "c3-causal-g16": ([(20, 300), (9, 9)], dict(hq=16, hkv=1, d=64, causal=True)),
    "c3-split-causal-g2-append": ([(100, 6000)], dict(hq=4, hkv=2, d=64, causal=True)),
    "c3-paged-window-softcap-ps16-g4": (
        [(300, 700), (129, 129)],
        dict(hq=8, hkv=2, d=64, page_size=16, causal=True, window_left=200, soft_cap=5.0),
    ),  # fmt: skip
}


@pytest.mark.gpu
@pytest.mark.skipif(not IS_SM90, reason="the Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("case_id", list(THREE_CONSUMER_CASES))
def test_gluon_three_consumers_against_reference(case_id, monkeypatch, request):
    from test_prefill_kernels import TOL, expected, make_case, run_impl

    lens, kw = THREE_CONSUMER_CASES[case_id]
    paged = "page_size" in kw
    case = make_case(lens, paged=paged, **kw)
    if paged:
        _nan_unwritten_slots(case)
    cfg = GluonPrefillConfig(groups=tuple(range(1, 17)), d64_min_group=1)
    calls = _spy(monkeypatch, request, cfg)
    out, lse, plan_obj = run_impl(case, with_lse=True, qk_scale_mult=0.8)
    torch.cuda.synchronize()
    group = kw["hq"] // kw["hkv"]
    assert plan_obj.config is cfg.tile_rows192 and len(calls) == 1
    assert plan_obj.tile_t == cfg.tile_tokens(group, 64) and (plan_obj.tile_t * group > 128) == (group != 16)
    want_o, want_lse = expected(case, 0.8, 1.0)
    atol, rtol, latol = TOL[case["opts"].o_dtype]
    assert_close_named("o", out, want_o, atol, rtol)
    assert_close_named("lse", lse, want_lse, latol, latol)


@pytest.mark.interpret
def test_three_consumer_plan_on_the_triton_kernel(monkeypatch, request):
    """A 192-row plan (D64, three consumers) that run() hands to the Triton kernel, as when the tensors do not fit
    the Gluon kernel's descriptors: its 256-row fallback tile holds the 48-token runs of a group of 4."""
    from test_prefill_kernels import check, make_case

    impl = _impl()
    c3 = GluonPrefillConfig()
    use_config(request, gluon_prefill=c3)
    monkeypatch.setattr(impl, "_gluon_args_ok", lambda *a: False)
    case = make_case([(100, 130), (20, 20)], hq=8, hkv=2, d=64, causal=True)
    plan = impl.plan(case["opts"], case["batch"], _small_ws(), config=c3.tile_rows192)
    assert plan.tile_t == 48 and plan.config.block_m == 256
    check(case, qk_scale_mult=0.8, config=c3.tile_rows192)


@pytest.mark.interpret
def test_q_by_rows_plan_on_the_triton_kernel(monkeypatch, request):
    """A plan of runs by rows (group 5, ragged K/V: 25-token runs) that run() hands to the Triton kernel, as when
    the tensors do not fit the Gluon kernel's descriptors: its 128-row tile holds 25 tokens x 5 heads."""
    from test_prefill_kernels import check, make_case

    impl = _impl()
    cfg = GluonPrefillConfig()
    use_config(request, gluon_prefill=cfg)
    monkeypatch.setattr(impl, "_gluon_args_ok", lambda *a: False)
    case = make_case([(60, 90), (7, 7)], hq=5, hkv=1, d=128, paged=False, causal=True)
    plan = impl.plan(case["opts"], case["batch"], _small_ws(), config=cfg.tile)
    assert plan.tile_t == 25 and plan.config.block_m == 128
    check(case, qk_scale_mult=0.8, config=cfg.tile)


def _small_ws():
    return Workspace(
        float_buffer=torch.empty(1 << 20, dtype=torch.uint8), int_buffer=torch.empty(1 << 16, dtype=torch.uint8)
    )


@pytest.mark.gpu
@pytest.mark.skipif(not IS_SM90, reason="the Gluon kernel runs on sm_90 only")
def test_gluon_public_entry_point_and_switch(monkeypatch, request):
    """single_prefill_with_kv_cache reaches the Gluon kernel; a Gluon configuration with enabled=False gives the
    Triton kernel; both agree with the reference."""
    import flashinfer_triton as fit
    from flashinfer_triton import _config

    calls = _spy(monkeypatch, request)
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(700, 8, 128, device="cuda", generator=g).half()
    k = torch.randn(900, 2, 128, device="cuda", generator=g).half()
    v = torch.randn(900, 2, 128, device="cuda", generator=g).half()

    # (a new length each time: single_prefill_with_kv_cache keeps the plans of lengths it has seen)
    for enabled, n, n_calls in ((True, 700, 1), (False, 650, 1), (True, 600, 2)):
        want_o, want_lse = reference.attention(q[:n], k, v, causal=True)
        with _config.using(gluon_prefill=GluonPrefillConfig(enabled=enabled)):
            o, lse = fit.single_prefill_with_kv_cache(q[:n], k, v, causal=True, return_lse=True)
        torch.cuda.synchronize()
        assert len(calls) == n_calls
        assert_close_named("o", o, want_o, 5e-3, 5e-3)
        assert_close_named("lse", lse, want_lse, 2e-3, 2e-3)


def test_gluon_args_ok():
    """run()'s tensors must have [tokens, heads * D] views with 16-byte rows, one dtype, a positive scale."""
    from flashinfer_triton import _sm90

    impl = _impl()
    opts = AttentionOptions(8, 2, 128, 1, False, causal=True)
    q = torch.empty(64, 8, 128, dtype=torch.float16)
    k = torch.empty(100, 1, 2, 128, dtype=torch.float16)
    assert impl._gluon_args_ok(opts, q, k, k, 0.1)
    assert impl._gluon_args_ok(opts, torch.empty(64, 10, 128, dtype=torch.float16)[:, 1:9], k, k, 0.1)
    assert not impl._gluon_args_ok(opts, q, k, k, -0.1)
    assert not impl._gluon_args_ok(opts, torch.empty(64, 8, 2, 128, dtype=torch.float16)[:, :, 0], k, k, 0.1)
    assert not impl._gluon_args_ok(opts, q, k.transpose(0, 2).contiguous().transpose(0, 2), k, 0.1)
    assert not impl._gluon_args_ok(opts, q, k, k.bfloat16(), 0.1)
    assert not impl._gluon_args_ok(
        opts, q, torch.empty(100 * 2 * 128 + 1, dtype=torch.float16)[1:].view(100, 1, 2, 128), k, 0.1
    )
    assert not impl._gluon_args_ok(opts, q, k[:0], k[:0], 0.1)
    # paged: NHD (5-D cache halves, tuple), HND; K / V strides must agree
    po = AttentionOptions(8, 2, 128, 16, True, causal=True)
    cache = torch.empty(10, 2, 16, 2, 128, dtype=torch.float16)
    assert _sm90.gluon_page_geometry(cache[:, 0], cache[:, 1], 128) == (256, 9 * 32 + 16, 256, 32, 0, 128)
    assert impl._gluon_args_ok(po, q, cache[:, 0], cache[:, 1], 0.1)
    hnd = torch.empty(10, 2, 2, 16, 128, dtype=torch.float16)  # [pages, 2, heads, slots, D]
    kh, vh = hnd[:, 0].transpose(1, 2), hnd[:, 1].transpose(1, 2)
    assert _sm90.gluon_page_geometry(kh, vh, 128) == (128, 9 * 64 + 16 + 16, 128, 64, 16, 0)
    assert not impl._gluon_args_ok(po, q, cache[:, 0], cache[:, 1].contiguous(), 0.1)


@pytest.mark.gpu
@pytest.mark.skipif(not IS_SM90, reason="the Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("causal,hq", [(True, 8), (False, 8), (True, 10)], ids=["causal-g4", "full-g4", "causal-g5"])
def test_gluon_cuda_graph_replan(monkeypatch, request, causal, hq):
    """CUDA-graph mode, ragged K/V: a graph captured after one plan() replays right after plans with other
    lengths, more keys than at capture included (the descriptors must cover the caller's whole buffer). Group 5:
    25-token runs, the query rows read through q_ptr."""

    impl = _impl()
    calls = _spy(monkeypatch, request)
    dev = torch.device("cuda")
    hkv, d = 2, 128
    max_bs, max_q, max_kv = 3, 768, 4096
    ws = Workspace(
        float_buffer=torch.empty(1 << 24, dtype=torch.uint8, device=dev),
        int_buffer=torch.empty(1 << 20, dtype=torch.uint8, device=dev),
        cuda_graph=True,
        max_batch_size=max_bs,
        max_total_q=max_q,
    )
    opts = AttentionOptions(hq, hkv, d, 1, False, causal=causal, sm_scale=d**-0.5)
    q_buf = torch.randn(max_q, hq, d, device=dev).half()
    k_buf = torch.randn(max_kv, 1, hkv, d, device=dev).half()
    v_buf = torch.randn(max_kv, 1, hkv, d, device=dev).half()
    used = 300 + 64 + 1500 + 2000  # the most keys of any plan below; past them: an engine's unwritten rows
    k_buf[used:] = float("nan")
    v_buf[used:] = float("nan")
    out_buf = torch.zeros(max_q, hq, d, device=dev).half()
    lse_buf = torch.zeros(max_q, hq, device=dev)
    qo_buf = torch.zeros(max_bs + 1, dtype=torch.int32, device=dev)
    kvp_buf = torch.zeros(max_bs + 1, dtype=torch.int32, device=dev)
    kvl_buf = torch.zeros(max_bs, dtype=torch.int32, device=dev)

    def replan(lens):
        qo = torch.tensor([a for a, _ in lens])
        kv = torch.tensor([b for _, b in lens])
        qo_indptr = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(qo, 0)])
        kv_indptr = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(kv, 0)])
        qo_buf[: len(lens) + 1].copy_(qo_indptr)
        kvp_buf[: len(lens) + 1].copy_(kv_indptr)
        kvl_buf[: len(lens)].copy_(kv)
        batch = AttentionBatch(
            len(lens), qo_buf[: len(lens) + 1], kvp_buf[: len(lens) + 1], None, kvl_buf[: len(lens)],
            qo_indptr, kv, kv_indptr,
        )  # fmt: skip
        return batch, impl.plan(opts, batch, ws), qo_indptr, kv_indptr

    def want(qo_indptr, kv_indptr):
        outs = []
        for b in range(len(qo_indptr) - 1):
            qs, qe = int(qo_indptr[b]), int(qo_indptr[b + 1])
            ks, ke = int(kv_indptr[b]), int(kv_indptr[b + 1])
            o, _ = reference.attention(q_buf[qs:qe], k_buf[ks:ke, 0], v_buf[ks:ke, 0], causal=causal)
            outs.append(o)
        return torch.cat(outs)

    batch, p1, qi, ki = replan([(100, 300), (200, 900)])
    impl.run(p1, opts, batch, q_buf, k_buf, v_buf, out_buf, lse_buf)
    torch.cuda.synchronize()
    assert p1.config.gluon and len(calls) == 1
    assert p1.tile_t == 128 // (hq // hkv)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.run(p1, opts, batch, q_buf, k_buf, v_buf, out_buf, lse_buf)
    for lens in ([(100, 300), (200, 900)], [(300, 2000), (64, 64), (400, 1500)], [(5, 5)], [(700, 3864)]):
        batch, p, qi, ki = replan(lens)
        out_buf.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        n = int(qi[-1])
        assert_close_named("o", out_buf[:n], want(qi, ki), 5e-3, 5e-3)
    # the Triton kernel on the same graph-mode plans (pointer loads: no descriptor fixed at capture)
    use_config(request, gluon_prefill=GluonPrefillConfig(enabled=False))
    batch, p1, qi, ki = replan([(100, 300), (200, 900)])
    assert not p1.config.gluon
    impl.run(p1, opts, batch, q_buf, k_buf, v_buf, out_buf, lse_buf)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.run(p1, opts, batch, q_buf, k_buf, v_buf, out_buf, lse_buf)
    for lens in ([(300, 2000), (64, 64), (400, 1500)], [(700, 3864)]):
        batch, p, qi, ki = replan(lens)
        out_buf.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        n = int(qi[-1])
        assert_close_named("o", out_buf[:n], want(qi, ki), 5e-3, 5e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not IS_SM90, reason="the Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize(
    "hq,hkv,d,ps,dtype,cap",
    [(8, 2, 128, 16, torch.float16, None), (4, 2, 256, 16, torch.bfloat16, None), (6, 2, 128, 8, torch.float16, None),
     (7, 1, 256, 64, torch.bfloat16, None), (8, 2, 128, 16, torch.float16, 4.0), (8, 2, 64, 16, torch.bfloat16, None)],
    ids=["g4-d128-ps16", "g2-d256-ps16-bf16", "g3-d128-ps8", "g7-d256-ps64-bf16", "g4-d128-ps16-softcap",
         "g4-d64-ps16-bf16"],
)  # fmt: skip
def test_gluon_paged_cuda_graph_replan(monkeypatch, request, hq, hkv, d, ps, dtype, cap):
    """The paged wrapper in CUDA-graph mode: the Gluon launch captured after one plan() replays right after
    plans with other lengths and pages (more pages than at capture included); every slot of the cache outside the
    current batch's pages, and the unwritten slots of its last pages, hold NaN. ``cap``: a logits soft cap."""
    import flashinfer_triton as fit

    calls = _spy(monkeypatch, request)
    dev = torch.device("cuda")
    max_batch, max_pages, max_q = 3, 400, 600
    gen = torch.Generator(device="cuda").manual_seed(11)
    cache = torch.randn(max_pages, 2, ps, hkv, d, device=dev, generator=gen).to(dtype)
    bufs = dict(
        qo_indptr_buf=torch.zeros(max_batch + 1, dtype=torch.int32, device=dev),
        paged_kv_indptr_buf=torch.zeros(max_batch + 1, dtype=torch.int32, device=dev),
        paged_kv_indices_buf=torch.zeros(max_pages, dtype=torch.int32, device=dev),
        paged_kv_last_page_len_buf=torch.zeros(max_batch, dtype=torch.int32, device=dev),
    )
    ws = torch.empty(1 << 26, dtype=torch.uint8, device=dev)
    w = fit.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=True, **bufs)
    q_buf = torch.randn(max_q, hq, d, device=dev, generator=gen).to(dtype)
    out_buf = torch.empty(max_q, hq, d, device=dev, dtype=dtype)
    pristine = cache.clone()

    def replan(lens):
        cache.copy_(pristine)
        kv_lens = [n for _, n in lens]
        spare = max_pages - sum(-(-n // ps) for n in kv_lens)
        indptr, indices, last, _ = page_table(kv_lens, ps, spare_pages=spare, seed=len(lens))
        nan_unused_slots(cache, indptr, indices, last)
        qo_indptr = torch.tensor([0] + torch.tensor([a for a, _ in lens]).cumsum(0).tolist(), dtype=torch.int32)
        w.plan(qo_indptr, indptr, indices, last, hq, hkv, d, ps, causal=True, q_data_type=dtype, logits_soft_cap=cap)
        return qo_indptr, indptr.tolist(), indices.tolist()

    def want(qo_indptr, indptr, indices, lens):
        outs = []
        for b, (qo, n) in enumerate(lens):
            pg = torch.tensor(indices[indptr[b] : indptr[b + 1]], device=dev)
            kb = cache[pg, 0].reshape(-1, hkv, d)[:n]
            vb = cache[pg, 1].reshape(-1, hkv, d)[:n]
            qs = int(qo_indptr[b])
            outs.append(reference.attention(q_buf[qs : qs + qo], kb, vb, causal=True, logits_soft_cap=cap)[0])
        return torch.cat(outs)

    first = [(150, 300), (200, 700)]
    replan(first)
    w.run(q_buf[:350], cache, out=out_buf[:350])
    torch.cuda.synchronize()
    assert len(calls) == 1
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w.run(q_buf[:350], cache, out=out_buf[:350])
    for lens in (first, [(100, 1500), (64, 64), (186, 900)], [(350, 2000)]):
        qi, ip, ind = replan(lens)
        out_buf.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        n = int(qi[-1])
        assert_close_named("o", out_buf[:n], want(qi, ip, ind, lens), 2e-2, 2e-2)


def test_gluon_plan_choice(monkeypatch):
    """The planner takes the Gluon config only for the variants it covers on sm_90, with a full 128-row tile."""

    impl = _impl()
    plan_as_on_h100(monkeypatch, impl)
    dev = torch.device("cuda", 0)
    base = dict(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=1, paged=False, causal=True)
    opts = AttentionOptions(**base)
    default = GluonPrefillConfig()
    assert impl._gluon_candidate(opts, dev, default)
    from dataclasses import replace

    for ok in (
        dict(head_dim=256),
        dict(num_qo_heads=24),  # group 3
        dict(num_qo_heads=56, head_dim=256),  # group 7
        dict(logits_soft_cap=30.0),
        dict(logits_soft_cap=5.0, paged=True, page_size=16, head_dim=256),
        dict(window_left=10),
        dict(window_left=0, logits_soft_cap=30.0, paged=True, page_size=8),
        dict(head_dim=64),  # group 4: three consumers
        dict(head_dim=64, num_qo_heads=16),  # group 2
        dict(head_dim=64, num_qo_heads=128, window_left=100),  # group 16: two consumers (8-token runs)
    ):
        assert impl._gluon_candidate(replace(opts, **ok), dev, default), ok
    assert [default.tile_tokens(g) for g in (1, 2, 3, 4, 5, 6, 7, 8, 16)] == [128, 64, 40, 32, 24, 16, 16, 16, 8]
    # ragged K/V: runs of exactly 128 // group tokens (the query rows loaded by the consumers), at D256 too;
    # three consumers (D64) keep runs on the 8-row atom
    assert [default.tile_tokens(g, 128, True) for g in (1, 3, 5, 6, 7, 16)] == [128, 42, 25, 21, 18, 8]
    assert default.tile_tokens(7, 256, True) == 18 and default.tile_tokens(5, 64, True) == 32
    assert default.tile_for(256).block_n == 64 and default.stages(256) == 2 and default.tile_for(128) is default.tile
    # D64, group 1: the Triton kernel unless the configuration lowers d64_min_group
    d64_g1 = replace(opts, head_dim=64, num_kv_heads=32)
    assert not impl._gluon_candidate(d64_g1, dev, default)
    assert impl._gluon_candidate(d64_g1, dev, GluonPrefillConfig(d64_min_group=1))
    assert not impl._gluon_candidate(replace(opts, head_dim=64), dev, GluonPrefillConfig(d64_min_group=8))
    assert not impl._gluon_candidate(replace(opts, head_dim=64), dev, GluonPrefillConfig(head_dims=(128, 256)))
    assert [default.tile_tokens(g, 64) for g in (1, 2, 3, 4, 5, 7, 8, 16)] == [192, 96, 64, 48, 32, 24, 24, 8]
    assert default.consumers(64) == 3 and default.consumers(128) == default.consumers(256) == 2
    assert default.tile_for(64) is default.tile_rows192 and default.tile_tokens(4, 128) == 32
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="d64_min_group"):
            GluonPrefillConfig(d64_min_group=bad)
    assert not impl._gluon_candidate(opts, dev, GluonPrefillConfig(enabled=False))

    assert impl._gluon_candidate(replace(opts, paged=True, page_size=16), dev, default)
    for bad in (
        dict(paged=True, page_size=1),
        dict(paged=True, page_size=5),
        dict(window_left=10, num_qo_heads=48),  # group 6
        dict(logits_soft_cap=30.0, pos_encoding_mode="ALIBI"),
        dict(pos_encoding_mode="ALIBI"),
        dict(head_dim=64, num_kv_heads=32),  # group 1 at D64
        dict(num_qo_heads=72),  # group 9
        dict(num_qo_heads=48),  # group 6: the Triton kernel by default
        dict(q_dtype=torch.float16, kv_dtype=torch.bfloat16),
        dict(has_custom_mask=True, causal=False),
    ):
        assert not impl._gluon_candidate(replace(opts, **bad), dev, default), bad
    assert not impl._gluon_candidate(opts, torch.device("cpu"), default)
    ws = Workspace(
        float_buffer=torch.empty(1 << 16, dtype=torch.uint8), int_buffer=torch.empty(1 << 16, dtype=torch.uint8)
    )
    # plan() with the default configuration: a window takes the Gluon tile; D64 the 192-row tile from group 2 and
    # the Triton kernel's own tile at group 1 (the batch's CPU tensors asked about as if on the GPU)
    real = impl._gluon_candidate
    monkeypatch.setattr(impl, "_gluon_candidate", lambda o, d, g: real(o, dev, g))
    qi, kl = torch.tensor([0, 256]), torch.tensor([1000])
    batch = AttentionBatch(1, qi.int(), torch.tensor([0, 1000]).int(), None, kl.int(), qi, kl, torch.tensor([0, 1000]))
    for kw, want in (
        (dict(window_left=300), default.tile),
        (dict(window_left=300, head_dim=64), default.tile_rows192),
        (dict(head_dim=64, num_qo_heads=16), default.tile_rows192),
        (dict(head_dim=64, num_kv_heads=32), None),
        (dict(head_dim=64, num_kv_heads=32, window_left=300), None),
    ):
        p = impl.plan(replace(opts, **kw), batch, ws)
        assert (p.config is want) if want is not None else not p.config.gluon, kw
    # plan(): the Gluon config for a candidate with a full 128-row tile, the Triton one below it
    monkeypatch.setattr(impl, "_gluon_candidate", lambda o, d, g: True)
    for qo, want_gluon in ((256, True), (16, False)):
        qi = torch.tensor([0, qo])
        kl = torch.tensor([1000])
        batch = AttentionBatch(
            1, qi.int(), torch.tensor([0, 1000]).int(), None, kl.int(), qi, kl, torch.tensor([0, 1000])
        )
        monkeypatch.setattr(impl, "_num_sms", lambda dev: 132)
        p = impl.plan(opts, batch, ws)
        assert p.config.gluon == want_gluon and (p.config is default.tile) == want_gluon
    # a group of 3: 42-token runs (126 rows, ragged K/V); head dim 256: 64-key tiles
    qi = torch.tensor([0, 100])
    kl = torch.tensor([1000])
    batch = AttentionBatch(1, qi.int(), torch.tensor([0, 1000]).int(), None, kl.int(), qi, kl, torch.tensor([0, 1000]))
    p = impl.plan(replace(opts, num_qo_heads=24), batch, ws)
    assert p.config.gluon and p.tile_t == 42 and p.grid0 == 3
    p = impl.plan(replace(opts, head_dim=256), batch, ws)
    assert p.config is default.tile_d256 and p.tile_t == 32
    # D64 (three consumers): 48-token tiles of a group of 4 (192 rows), the 256-row Triton fallback tile
    p = impl.plan(replace(opts, head_dim=64), batch, ws)
    assert p.config is default.tile_rows192 and p.tile_t == 48 and p.grid0 == 3


@pytest.mark.skipif(INTERPRET, reason="compiles for sm_90a; the interpreter has no compiler")
@pytest.mark.parametrize(
    "variant",
    ["causal-g4-lse", "full-g16-bf16-d64", "paged-split", "causal-d256", "paged-g3-d256", "softcap-g4",
     "softcap-paged-ps8-g4", "window-split-g3", "d64-three-consumers-g4", "qrows-causal-g7-bf16",
     "qrows-split-softcap-g5", "qrows-causal-g3-d256", "causal-g4-lse-stages3", "paged-g3-d256-lse",
     "qrows-full-g5-lse"],
)  # fmt: skip
def test_gluon_kernel_compiles_for_sm90(variant):
    """The Gluon kernel compiles for sm_90a on any machine (no GPU needed): no spills, registers and shared
    memory within the SM's budget, the warps it was written for."""
    import subprocess
    import sys

    args = {
        "causal-g4-lse": ["--causal", "--group", "4", "--lse"],
        # (runs of 18 tokens of a group of 7: the consumers load their query rows; 126 of 128 rows busy)
        "qrows-causal-g7-bf16": [
            "--causal",
            "--group",
            "7",
            "--dtype",
            "bf16",
            "--stages",
            "3",
            "--loader-regs",
            "32",
            "--q-rows",
        ],  # fmt: skip
        # (runs of 25 tokens of a group of 5 into split pieces, lse and a soft cap)
        "qrows-split-softcap-g5": [
            "--causal",
            "--group",
            "5",
            "--split",
            "--lse",
            "--soft-cap",
            "--stages",
            "3",
            "--loader-regs",
            "32",
            "--q-rows",
        ],  # fmt: skip
        # (head dim 256, runs of 42 tokens of a group of 3: 64 x 256 query values loaded per consumer)
        "qrows-causal-g3-d256": [
            "--d",
            "256",
            "--bn",
            "64",
            "--stages",
            "2",
            "--group",
            "3",
            "--causal",
            "--q-rows",
            "--loader-regs",
            "32",
        ],  # fmt: skip
        # (D64 group 16: 8-token runs, 128 rows, two consumers)
        "full-g16-bf16-d64": ["--dtype", "bf16", "--d", "64", "--group", "16", "--stages", "4"],
        "paged-split": [
            "--ps",
            "16",
            "--loader-regs",
            "32",
            "--split",
            "--stages",
            "3",
        ],
        "causal-d256": ["--causal", "--lse", "--d", "256", "--bn", "64", "--stages", "2", "--dtype", "bf16"],
        # (the soft cap: tanh and ex2 on MUFU)
        "softcap-g4": ["--causal", "--group", "4", "--stages", "3", "--lse", "--soft-cap"],
        # (the host's register split for pages under 16 keys: 232 for the consumers, where a soft cap's extra live
        # values would spill first)
        "softcap-paged-ps8-g4": [
            "--causal",
            "--group",
            "4",
            "--ps",
            "8",
            "--stages",
            "3",
            "--loader-regs",
            "40",
            "--regs",
            "232",
            "--soft-cap",
        ],  # fmt: skip
        # (D64, three consumers: 48-token runs in boxes of 16, 16 warps launched at 128 registers, 160 for the
        # consumers, the planner's 4 stages)
        "d64-three-consumers-g4": [
            "--causal",
            "--group",
            "4",
            "--d",
            "64",
            "--stages",
            "4",
            "--lse",
            "--consumers",
            "3",
            "--regs",
            "160",
            "--loader-regs",
            "32",
            "--maxnreg",
            "128",
        ],  # fmt: skip
        # (a sliding window: the masked edge tiles before the body; split pieces, 40-token runs of a group of 3)
        "window-split-g3": [
            "--causal",
            "--group",
            "3",
            "--stages",
            "3",
            "--lse",
            "--split",
            "--loader-regs",
            "32",
            "--window",
        ],  # fmt: skip
        # (the host's register split for paged, non-power-of-two runs of tokens: 40 for the loader, 232; with split
        # pieces at D256 the partial rows' store spills 16-24 bytes, outside the key loop)
        "paged-g3-d256": [
            "--group",
            "3",
            "--ps",
            "16",
            "--d",
            "256",
            "--bn",
            "64",
            "--stages",
            "2",
            "--causal",
            "--loader-regs",
            "40",
            "--regs",
            "232",
        ],
    }
    args["causal-g4-lse-stages3"] = args["causal-g4-lse"] + ["--stages", "3"]
    args["paged-g3-d256-lse"] = args["paged-g3-d256"] + ["--lse"]
    # (runs of 25 tokens of a group of 5 without a mask, lse)
    args["qrows-full-g5-lse"] = ["--group", "5", "--lse", "--stages", "3", "--loader-regs", "32", "--q-rows"]
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    script = os.path.join(root, "benchmarks", "bench_prefill.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(root, "src"), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(
        [sys.executable, script, "--resources", *args[variant]], capture_output=True, text=True, timeout=600, env=env
    )
    assert r.returncode == 0, r.stderr[-3000:]
    text = r.stdout
    shared = int(text.split("shared ")[1].split(" ")[0])
    assert shared <= 227 * 1024, text
    # No mbarrier shares bytes with a buffer (offsets from the allocation pass): runs by rows make no query barrier;
    # made and left unused past its init, the allocator gave its bytes to the start of a K/V ring buffer, which
    # the TMA copies then wrote over an initialized mbarrier
    assert "mbarrier overlays none" in text, text
    # The output rows go out through shared memory (stmatrix) with 128-bit stores; the 32-bit stores left are the
    # lse's (two a thread and consumer), and with split pieces their partial rows' (stored from the registers)
    widths = dict(kv.split("=") for kv in text.split("widths ")[1].splitlines()[0].split())
    assert int(widths.get("STG.E.128", 0)) > 0 and int(widths.get("STSM.16.M88.4", 0)) > 0, text
    if "--split" in args[variant]:
        assert int(widths.get("STG.E", 0)) > 6, text
    else:
        assert int(widths.get("STG.E", 0)) <= 6, text
    if variant == "d64-three-consumers-g4":
        # (launched at 128 registers: the consumers keep a few addresses on the stack across their key loop, stored
        # before its first wgmma and loaded after its last; none inside it)
        assert "num_warps 16" in text, text
        assert int(re.search(r"STACK:(\d+)", text).group(1)) <= 32, text
    else:
        assert "num_warps 12" in text, text
        assert "LOCAL:0" in text and "STL=0" in text, text
