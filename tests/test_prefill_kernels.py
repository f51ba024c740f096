"""The prefill/append Triton kernel (``_prefill_impl``) called through the backend seam, against the reference.

Interpreter cases (``-m interpret`` with TRITON_INTERPRET=1) are tiny on purpose (a few programs, a few
KV tiles each); the GPU cases cover the real tile shapes, long sequences and CUDA-graph replay.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from conftest import DEVICE, assert_close_named
from flashinfer_triton import reference
from flashinfer_triton._backend import AttentionBatch, AttentionOptions, Workspace, use_triton
from helpers import page_table

pytestmark = pytest.mark.skipif(not use_triton(DEVICE), reason="needs CUDA or TRITON_INTERPRET=1")

# (o atol, o rtol, lse atol) by output dtype; the interpreter computes in float32, the GPU in fp16/bf16 MMAs.
TOL = {torch.float16: (3e-3, 3e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2, 5e-3), torch.float32: (1e-3, 1e-3, 1e-3)}
if torch.cuda.is_available():
    # fp16/bf16 MMAs (P is rounded to the input dtype before P @ V), as FlashInfer does.
    TOL = {torch.float16: (5e-3, 5e-3, 2e-3), torch.bfloat16: (3e-2, 3e-2, 5e-3), torch.float32: (2e-3, 2e-3, 2e-3)}
FP8 = {"e4m3": getattr(torch, "float8_e4m3fn", None), "e5m2": getattr(torch, "float8_e5m2", None)}


def _impl():
    from flashinfer_triton import _prefill_impl

    return _prefill_impl


def make_case(
    lens,
    *,
    hq=4,
    hkv=2,
    d=64,
    page_size=16,
    paged=True,
    layout="NHD",
    dtype=torch.float16,
    kv_dtype=None,
    causal=False,
    window_left=-1,
    soft_cap=0.0,
    pos="NONE",
    mask=None,
    q_noncontig=False,
    kv_tail_nan=False,
    seed=0,
):
    """Random batch: ``lens`` is [(qo_len, kv_len), ...]. Returns a dict with everything plan/run need."""
    g = torch.Generator().manual_seed(seed)
    kv_dtype = kv_dtype or dtype
    qo = torch.tensor([a for a, _ in lens], dtype=torch.int64)
    kv = torch.tensor([b for _, b in lens], dtype=torch.int64)
    qo_indptr = torch.zeros(len(lens) + 1, dtype=torch.int64)
    qo_indptr[1:] = torch.cumsum(qo, 0)
    total_q = int(qo_indptr[-1])
    q_full = torch.randn(total_q, hq + (2 if q_noncontig else 0), d, generator=g)
    q = q_full[:, 1 : hq + 1] if q_noncontig else q_full
    q = q.to(dtype)

    def rnd(*shape):
        x = torch.randn(*shape, generator=g)
        if kv_dtype in (FP8["e4m3"], FP8["e5m2"]):
            return (x * 2).to(kv_dtype)
        return x.to(kv_dtype)

    if paged:
        kv_indptr, perm, _, num_pages = page_table(kv.tolist(), page_size, spare_pages=3, seed=seed)
        kv_indptr = kv_indptr.long()
        if layout == "NHD":
            cache = rnd(num_pages, 2, page_size, hkv, d)
            k4, v4 = cache[:, 0], cache[:, 1]
        else:
            cache = rnd(num_pages, 2, hkv, page_size, d)
            k4, v4 = cache[:, 0].transpose(1, 2), cache[:, 1].transpose(1, 2)
        kv_indices = perm.to(torch.int32)
        dense = []
        for b in range(len(lens)):
            pages = perm[int(kv_indptr[b]) : int(kv_indptr[b + 1])].long()
            kd = k4[pages].reshape(-1, hkv, d)[: int(kv[b])]
            vd = v4[pages].reshape(-1, hkv, d)[: int(kv[b])]
            dense.append((kd, vd))
    else:
        kv_indptr = torch.zeros(len(lens) + 1, dtype=torch.int64)
        kv_indptr[1:] = torch.cumsum(kv, 0)
        n = int(kv_indptr[-1]) + 2
        if layout == "NHD":
            k3, v3 = rnd(n, hkv, d), rnd(n, hkv, d)
        else:
            k3, v3 = rnd(hkv, n, d).transpose(0, 1), rnd(hkv, n, d).transpose(0, 1)
        if kv_tail_nan:
            # An engine's ragged buffer past kv_indptr[-1]: never written, may hold anything.
            k3[int(kv_indptr[-1]) :] = float("nan")
            v3[int(kv_indptr[-1]) :] = float("nan")
        k4, v4 = k3[:, None], v3[:, None]
        kv_indices = None
        page_size = 1
        dense = [
            (k3[int(kv_indptr[b]) : int(kv_indptr[b + 1])], v3[int(kv_indptr[b]) : int(kv_indptr[b + 1])])
            for b in range(len(lens))
        ]

    masks = None
    mask_packed = mask_indptr = None
    if mask is not None:
        if callable(mask):  # mask(request, qo_len, kv_len) -> bool [qo_len, kv_len]
            masks = [mask(i, int(a), int(b)) for i, (a, b) in enumerate(zip(qo, kv, strict=True))]
        else:  # a probability of each bit being set
            masks = [torch.rand(int(a), int(b), generator=g) < mask for a, b in zip(qo, kv, strict=True)]
        pieces, mptr = [], [0]
        for m in masks:
            pk = reference.packbits(m.reshape(-1), "little")
            pieces.append(pk)
            mptr.append(mptr[-1] + pk.numel())
        mask_packed = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8)
        mask_indptr = torch.tensor(mptr, dtype=torch.int32)

    opts = AttentionOptions(
        num_qo_heads=hq,
        num_kv_heads=hkv,
        head_dim=d,
        page_size=page_size,
        paged=paged,
        causal=causal and mask is None,
        window_left=window_left,
        logits_soft_cap=soft_cap,
        sm_scale=1.0 / math.sqrt(d),
        pos_encoding_mode=pos,
        rope_scale=1.5 if pos == "ROPE_LLAMA" else 1.0,
        rope_theta=5e3 if pos == "ROPE_LLAMA" else 1e4,
        has_custom_mask=mask is not None,
        q_dtype=dtype,
        kv_dtype=kv_dtype,
        o_dtype=dtype,
    )
    dev = DEVICE
    batch = AttentionBatch(
        batch_size=len(lens),
        qo_indptr=qo_indptr.to(torch.int32).to(dev),
        kv_indptr=kv_indptr.to(torch.int32).to(dev),
        kv_indices=kv_indices.to(dev) if kv_indices is not None else None,
        kv_lens=kv.to(torch.int32).to(dev),
        qo_indptr_host=qo_indptr,
        kv_lens_host=kv,
        kv_indptr_host=kv_indptr,
        mask_packed=mask_packed.to(dev) if mask_packed is not None else None,
        mask_indptr=mask_indptr.to(dev) if mask_indptr is not None else None,
        alibi_slopes=reference.alibi_slopes(hq).to(dev) if pos == "ALIBI" else None,
    )
    return dict(opts=opts, batch=batch, q=q, k4=k4, v4=v4, dense=dense, masks=masks, qo_indptr=qo_indptr)


def expected(case, qk_scale_mult=1.0, v_scale=1.0):
    opts = case["opts"]
    outs, lses = [], []
    for b, (kd, vd) in enumerate(case["dense"]):
        qs, qe = int(case["qo_indptr"][b]), int(case["qo_indptr"][b + 1])
        o, lse = reference.attention(
            case["q"][qs:qe].float(),
            kd.float(),
            vd.float(),
            causal=opts.causal,
            window_left=opts.window_left,
            logits_soft_cap=opts.logits_soft_cap or None,
            sm_scale=opts.sm_scale,
            pos_encoding_mode=opts.pos_encoding_mode,
            rope_scale=opts.rope_scale,
            rope_theta=opts.rope_theta,
            custom_mask=case["masks"][b] if case["masks"] is not None else None,
            k_scale=qk_scale_mult,
            v_scale=v_scale,
        )
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def run_impl(case, *, qk_scale_mult=1.0, v_scale=1.0, ws=None, config=None, fixed_split_size=None, with_lse=True):
    """plan() + run() through the seam, outputs poisoned with NaN first; returns (out, lse, plan)."""
    impl = _impl()
    opts = case["opts"]
    if fixed_split_size is not None:
        from dataclasses import replace

        opts = replace(opts, fixed_split_size=fixed_split_size)
    assert impl.supports(opts)
    dev = DEVICE
    if ws is None:
        ws = Workspace(
            float_buffer=torch.empty(1 << 20, dtype=torch.uint8, device=dev),
            int_buffer=torch.empty(1 << 16, dtype=torch.uint8, device=dev),
        )
    plan_obj = impl.plan(opts, case["batch"], ws, config=config)
    q = case["q"].to(dev)
    k4, v4 = case["k4"].to(dev), case["v4"].to(dev)
    out = torch.full(q.shape, float("nan"), dtype=opts.o_dtype, device=dev)
    lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device=dev) if with_lse else None
    impl.run(plan_obj, opts, case["batch"], q, k4, v4, out, lse, qk_scale_mult=qk_scale_mult, v_scale=v_scale)
    return out, lse, plan_obj


def check(case, *, qk_scale_mult=1.0, v_scale=1.0, **kw):
    out, lse, plan_obj = run_impl(case, qk_scale_mult=qk_scale_mult, v_scale=v_scale, **kw)
    want_o, want_lse = expected(case, qk_scale_mult, v_scale)
    atol, rtol, latol = TOL[case["opts"].o_dtype]
    if case["opts"].kv_dtype in (FP8["e4m3"], FP8["e5m2"]):
        atol, rtol = atol * 4, rtol * 4
    assert_close_named("o", out, want_o, atol, rtol)
    if lse is not None:
        assert_close_named("lse", lse, want_lse, latol, latol)
    return plan_obj


# ----------------------------------------------------------------------------- interpreter grid (tiny)
INTERP_CASES = {
    # id: (lens, kwargs)
    "append-causal-bs3-ps5-hq6-hkv2-d64-NHD": ([(5, 23), (0, 7), (9, 9)], dict(hq=6, hkv=2, page_size=5, causal=True)),
    "full-bs2-ps16-g1-d64-HND": ([(7, 40), (3, 0)], dict(hq=2, hkv=2, layout="HND", causal=False)),
    "ragged-causal-qo>kv-g3-d80": ([(12, 8), (4, 19)], dict(hq=3, hkv=1, d=80, paged=False, causal=True)),
    "window7-causal-ps1-g4": ([(6, 45)], dict(hq=4, hkv=1, page_size=1, causal=True, window_left=7)),
    "window5-noncausal-ragged-HND": ([(5, 30)], dict(hq=2, hkv=1, paged=False, layout="HND", window_left=5)),
    "custom-mask-ps5-g2": ([(5, 18), (3, 11)], dict(hq=4, hkv=2, page_size=5, mask=0.5)),
    "custom-mask-sparse-window": ([(4, 21)], dict(hq=2, hkv=1, paged=False, mask=0.15, window_left=9)),
    "softcap-bf16-causal": ([(7, 20)], dict(hq=2, hkv=1, dtype=torch.bfloat16, causal=True, soft_cap=2.0)),
    "rope-causal-append-ps5": ([(5, 19)], dict(hq=2, hkv=1, page_size=5, causal=True, pos="ROPE_LLAMA")),
    "alibi-causal-g3": ([(4, 17)], dict(hq=3, hkv=1, causal=True, pos="ALIBI")),
    "fp8e4m3-kv-scales-causal": ([(6, 25)], dict(hq=4, hkv=2, kv_dtype=FP8["e4m3"], causal=True)),
    "fp8e5m2-kv-bf16-ragged": ([(3, 14)], dict(hq=2, hkv=2, dtype=torch.bfloat16, paged=False, kv_dtype=FP8["e5m2"])),
    "d128-g4-noncontig-q-causal": ([(3, 20)], dict(hq=4, hkv=1, d=128, q_noncontig=True, causal=True)),
    "d256-g1-ps16": ([(2, 18)], dict(hq=1, hkv=1, d=256)),
    "all-empty-kv-and-zero-q": ([(3, 0), (0, 0), (2, 0)], dict(hq=2, hkv=1, causal=True)),
}


@pytest.mark.interpret
@pytest.mark.parametrize("case_id", list(INTERP_CASES))
def test_prefill_interpret(case_id):
    lens, kw = INTERP_CASES[case_id]
    case = make_case(lens, **kw)
    scales = {}
    if kw.get("kv_dtype") is not None:
        scales = dict(qk_scale_mult=0.7, v_scale=1.3)
    check(case, **scales)


@pytest.mark.interpret
@pytest.mark.parametrize("fold", [True, False])
@pytest.mark.parametrize("mult", [1.0, -40.0])
def test_prefill_fold_scale_interpret(fold, mult):
    """The exponent as one FMA on unscaled scores (fold_scale) and the two-op form agree with the reference,
    on masked (causal, window) and unmasked tiles. A negative scale must not fold (the row maximum of the
    unscaled scores is then the minimum of the scaled ones, and 2**x overflows at these magnitudes)."""
    from flashinfer_triton._prefill_impl import PrefillConfig

    case = make_case([(9, 60), (3, 35)], hq=4, hkv=2, page_size=5, causal=True, window_left=30)
    check(case, qk_scale_mult=mult, config=PrefillConfig(32, 16, 4, 1, fold_scale=fold))


@pytest.mark.interpret
@pytest.mark.parametrize("kv,split,dtype", [(70, 32, "fp16"), (180, 16, "fp16"), (180, 16, "bf16")])
def test_prefill_split_kv_interpret(kv, split, dtype):
    """A forced KV split (fixed_split_size): partial states merged by the merge kernel (eight pieces per step:
    3 pieces, and 12 = a full step and a partial one), lse included; the partial values are stored in the
    output dtype."""
    dt = torch.bfloat16 if dtype == "bf16" else torch.float16
    case = make_case([(3, kv), (2, 5)], hq=4, hkv=2, page_size=16, causal=True, dtype=dt)
    plan_obj = check(case, fixed_split_size=split)
    assert plan_obj.num_merge_host > 0 and plan_obj.part_o.dtype == dt and plan_obj.merge is not None
    bn = plan_obj.config.block_n  # the piece is rounded up to whole KV tiles (16 keys in the interpreter, 64 on GPUs)
    assert int(plan_obj.work[: plan_obj.num_work_host, 5].max()) == -(-kv // (-(-split // bn) * bn))


@pytest.mark.interpret
def test_prefill_auto_split_whole_waves_interpret():
    """Few query tiles over a long KV range: plan() splits it on its own, into at most as many pieces as the
    GPU holds programs at once (no short last wave), and the merged result equals the reference."""
    from flashinfer_triton import _prefill_impl as impl

    # at least 8 KV tiles (16 keys in the interpreter, 64 on GPUs); on GPUs past PrefillConfig.split_min_tile_bytes
    kv = 200 if DEVICE.type == "cpu" else 8000
    case = make_case([(2, kv)], hq=6, hkv=3, paged=False, causal=False)  # 3 programs before the split
    plan_obj = check(case)
    assert plan_obj.num_merge_host > 0
    cfg = impl.choose_config(case["opts"], 4, DEVICE)
    slots = impl._programs_per_sm(cfg, case["opts"]) * impl._num_sms(DEVICE)
    assert plan_obj.num_work_host >= 2 and plan_obj.num_work_host * 3 <= slots  # grid: pieces x KV heads


@pytest.mark.interpret
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_prefill_tensor_descriptor_interpret(layout):
    """The TMA (tensor descriptor) K/V path of ragged batches: tiles past a request read its neighbour's rows."""
    from flashinfer_triton._prefill_impl import PrefillConfig

    case = make_case(
        [(12, 40), (5, 3), (0, 4), (20, 20)],
        hq=4,
        hkv=2,
        paged=False,
        layout=layout,
        causal=True,
        window_left=17,
        kv_tail_nan=True,
    )
    check(case, config=PrefillConfig(32, 16, 4, 1, use_tma=True))


@pytest.mark.gpu
def test_prefill_tensor_descriptors_only_when_they_pay(monkeypatch):
    """Default config, ragged K/V on Hopper: a small eager launch over K/V not seen before reads them with pointer
    loads (encoding descriptors costs more host time than the kernel gains), the next launch over the same K/V
    uses descriptors (then cached by the launch path: later launches encode nothing), a launch over the work
    threshold and one captured into a CUDA graph use them; every result matches the reference."""
    from flashinfer_triton import clear_host_caches, host_caches

    impl = _impl()
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("tensor descriptors: Hopper or newer")
    clear_host_caches("tma_inputs")  # (K/V of earlier tests may have had these addresses)
    seen = _record_launches(monkeypatch)
    case = make_case([(12, 40), (5, 30)], hq=4, hkv=2, paged=False, causal=True)
    want_o, _ = expected(case, 1.0, 1.0)
    atol, rtol, _ = TOL[case["opts"].o_dtype]
    ws = Workspace(
        float_buffer=torch.empty(1 << 20, dtype=torch.uint8, device=DEVICE),
        int_buffer=torch.empty(1 << 16, dtype=torch.uint8, device=DEVICE),
    )
    opts = case["opts"]
    plan_obj = impl.plan(opts, case["batch"], ws)
    assert plan_obj.work_flops < plan_obj.config.tma_eager_min_flops
    q, k, v = case["q"].to(DEVICE), case["k4"].to(DEVICE), case["v4"].to(DEVICE)

    def run_once():
        out = torch.full(q.shape, float("nan"), dtype=opts.o_dtype, device=DEVICE)
        impl.run(plan_obj, opts, case["batch"], q, k, v, out, None)
        torch.cuda.synchronize()
        assert_close_named("o", out, want_o, atol, rtol)
        return seen[-1]["USE_TMA"]

    assert run_once() is False
    assert run_once() is True  # (a new kernel variant: compiled and launched by Triton's own path)
    assert run_once() is True  # the short launch path: descriptors encoded and cached
    n_desc = len(host_caches()["tensor_descriptors"])
    assert n_desc >= 2
    assert run_once() is True and len(host_caches()["tensor_descriptors"]) == n_desc  # the cached ones served it
    keep = [k, v]  # alive to the end: a new tensor must not reuse a recorded address
    k2, v2 = k.clone(), v.clone()  # K/V not seen before: pointer loads again
    k, v = k2, v2
    assert run_once() is False
    plan_obj = dataclasses.replace(plan_obj, config=dataclasses.replace(plan_obj.config, tma_eager_min_flops=0.0))
    k, v = k2.clone(), v2.clone()
    keep += [k, v]
    assert run_once() is True  # over the threshold
    plan_obj = dataclasses.replace(
        plan_obj, config=dataclasses.replace(plan_obj.config, tma_eager_min_flops=float("inf"))
    )
    k, v = k2.clone(), v2.clone()
    keep += [k, v]
    out = torch.full(q.shape, float("nan"), dtype=opts.o_dtype, device=DEVICE)
    impl.run(plan_obj, opts, case["batch"], q, k, v, out, None)  # eager, first sight: pointer loads
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.run(plan_obj, opts, case["batch"], q, k, v, out, None)
    assert seen[-1]["USE_TMA"] is True and seen[-2]["USE_TMA"] is False
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_close_named("o", out, want_o, atol, rtol)


@pytest.mark.interpret
@pytest.mark.parametrize("max_total_q", [None, 64])
def test_prefill_graph_mode_replan_interpret(max_total_q):
    """CUDA-graph mode: a second plan() with other lengths keeps the grid and tile shape (what a captured
    graph replays) and writes its work list into the same int-workspace memory; both plans compute right."""
    ws = Workspace(
        float_buffer=torch.empty(1 << 16, dtype=torch.uint8, device=DEVICE),
        int_buffer=torch.empty(1 << 16, dtype=torch.uint8, device=DEVICE),
        cuda_graph=True,
        max_batch_size=3,
        max_total_q=max_total_q,
    )
    case1 = make_case([(20, 30), (1, 9), (0, 4)], hq=4, hkv=2, causal=True, seed=1)
    case2 = make_case([(3, 50), (2, 2)], hq=4, hkv=2, causal=True, seed=2)
    out1, _, p1 = run_impl(case1, ws=ws)
    assert_close_named("o (plan 1)", out1, expected(case1)[0], *TOL[torch.float16][:2])
    out2, _, p2 = run_impl(case2, ws=ws)
    assert (p2.grid0, p2.config, p2.tile_t) == (p1.grid0, p1.config, p1.tile_t)
    assert p2.work.data_ptr() == p1.work.data_ptr() and p2.num_merge_host == 0
    assert_close_named("o (plan 2)", out2, expected(case2)[0], *TOL[torch.float16][:2])


@pytest.mark.interpret
def test_prefill_no_lse_interpret():
    case = make_case([(4, 12)], hq=2, hkv=1, causal=True)
    out, lse, _ = run_impl(case, with_lse=False)
    want_o, _ = expected(case)
    assert lse is None
    assert_close_named("o", out, want_o, *TOL[torch.float16][:2])


@pytest.mark.interpret
def test_plan_tiles_skip_masked_ranges():
    """Host-side planning (no kernel): causal tiles stop at their diagonal, windows start late."""
    impl = _impl()
    case = make_case([(64, 96)], hq=1, hkv=1, causal=True, window_left=16)
    cfg = impl.PrefillConfig(32, 16, 4, 1)
    p = impl.plan(
        case["opts"],
        case["batch"],
        Workspace(torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8)),
        config=cfg,
    )
    work = sorted(p.work.cpu().tolist(), key=lambda w: w[1])
    # tile 0: tokens 0..31 -> diag 32..63, window from 32-16=16 to 63+1
    assert work[0][:4] == [0, 0, 16, 64]
    assert work[1][:4] == [0, 32, 48, 96]


def _block_diagonal(rows: int, cols: int):
    """mask(request, qo, kv): block-diagonal with rows x cols blocks, so most KV tiles of a query tile are empty.

    Request 1 (when present) gets a few rows with no set bit and request 2 no set bit at all (o = 0, lse = -inf).
    """

    def make(b, qo, kv):
        i = torch.arange(qo)[:, None] // rows
        j = torch.arange(kv)[None, :] // cols
        m = i == j
        if b == 1:
            m[1:4] = False
        if b == 2:
            m[:] = False
        return m

    return make


def _banded(width: int, keep: float, seed: int = 5):
    """mask(request, qo, kv): a band of ``width`` keys ending at the diagonal, bits inside kept with ``keep``."""

    def make(b, qo, kv):
        g = torch.Generator().manual_seed(seed + b)
        i = torch.arange(qo)[:, None] + (kv - qo)
        j = torch.arange(kv)[None, :]
        return (j <= i) & (j > i - width) & (torch.rand(qo, kv, generator=g) < keep)

    return make


def _striped(width: int, keep: float, seed: int = 7):
    """mask(request, qo, kv): keys in every other stripe of ``width`` keys, bits kept with ``keep`` (many runs)."""

    def make(b, qo, kv):
        g = torch.Generator().manual_seed(seed + b)
        j = torch.arange(kv)[None, :]
        return ((j // width) % 2 == 0) & (torch.rand(qo, kv, generator=g) < keep)

    return make


def _expected_mask_tiles(case, plan_obj, block_n):
    """KV tiles a query tile must visit: those with a set bit in its rows (computed here from the bool masks),
    from the tile holding its rows' first in-window key on."""
    count = 0
    t = plan_obj.tile_t
    w = case["opts"].window_left
    for m in case["masks"]:
        qo, kv = m.shape
        for t0 in range(0, qo, t):
            rows = m[t0 : t0 + t]
            first = max(0, t0 + kv - qo - w) // block_n * block_n if w >= 0 else 0
            for j0 in range(first, kv, block_n):
                count += bool(rows[:, j0 : j0 + block_n].any())
    return count


MASK_SPARSE = {
    # id: (lens, make_case kwargs, forced split size)
    "block-diagonal-16x32-bs3-g2-paged": (
        [(48, 96), (32, 40), (16, 33)],
        dict(hq=4, hkv=2, page_size=5, mask=_block_diagonal(16, 32)),
        None,
    ),
    "striped-ragged-tma-split": ([(40, 100)], dict(hq=2, hkv=1, paged=False, mask=_striped(16, 0.7)), 16),
    "full-tiles-window": (
        [(32, 128)],
        dict(hq=2, hkv=2, paged=False, mask=_block_diagonal(32, 48), window_left=120),
        None,
    ),
}


@pytest.mark.interpret
@pytest.mark.parametrize("case_id", list(MASK_SPARSE))
def test_prefill_custom_mask_skips_empty_tiles_interpret(case_id):
    """Custom masks with large empty regions: only KV tiles with a set bit are visited (checked against a count
    from the bool masks), results equal the reference, fully masked rows/requests give o = 0 and lse = -inf."""
    from flashinfer_triton._prefill_impl import PrefillConfig

    lens, kw, split = MASK_SPARSE[case_id]
    case = make_case(lens, **kw)
    cfg = PrefillConfig(32, 16, 4, 1, use_tma=not kw.get("paged", True))
    plan_obj = check(case, config=cfg, fixed_split_size=split)
    if split is None:
        assert plan_obj.num_blocks_host == _expected_mask_tiles(case, plan_obj, cfg.block_n)
    else:
        assert plan_obj.num_merge_host > 0
    n_all = sum(-(-m.shape[0] // plan_obj.tile_t) * -(-m.shape[1] // cfg.block_n) for m in case["masks"])
    assert plan_obj.num_blocks_host <= 0.6 * n_all
    if split is None:
        runs = plan_obj.blocks.cpu().view(-1, 2)
        assert bool((runs[:, 0] & 1).any()), "no run of KV tiles was recognised as all set (unmasked loop)"
        assert bool(((runs[:, 0] & 1) == 0).any()) or case_id.startswith("full"), "no partially set run"


@pytest.mark.interpret
def test_prefill_custom_mask_graph_replan_interpret():
    """CUDA-graph mode with a custom mask: the KV-tile list lives at a fixed place in the int workspace and a
    re-plan with more query rows (within max_total_q) and another mask still computes right."""
    ws = Workspace(
        float_buffer=torch.empty(1 << 16, dtype=torch.uint8, device=DEVICE),
        int_buffer=torch.empty(1 << 16, dtype=torch.uint8, device=DEVICE),
        cuda_graph=True,
        max_batch_size=2,
        max_total_q=64,
    )
    case1 = make_case([(8, 40)], hq=2, hkv=1, mask=_block_diagonal(8, 16), seed=1)
    case2 = make_case([(30, 64), (20, 20)], hq=2, hkv=1, mask=_banded(20, 0.8), seed=2)
    out1, _, p1 = run_impl(case1, ws=ws)
    assert_close_named("o (plan 1)", out1, expected(case1)[0], *TOL[torch.float16][:2])
    out2, lse2, p2 = run_impl(case2, ws=ws)
    assert (p2.grid0, p2.config, p2.tile_t) == (p1.grid0, p1.config, p1.tile_t)
    assert p2.blocks.data_ptr() == p1.blocks.data_ptr()
    want_o, want_lse = expected(case2)
    assert_close_named("o (plan 2)", out2, want_o, *TOL[torch.float16][:2])
    assert_close_named("lse (plan 2)", lse2, want_lse, TOL[torch.float16][2], TOL[torch.float16][2])


def _record_launches(monkeypatch):
    """Wrap the prefill kernel so each launch's arguments are recorded by name (a list of dicts). White-box: it
    replaces the kernel pair ``run`` launches (``_prefill_impl._KERNELS``)."""
    from helpers import LaunchRecorder

    impl = _impl()
    kernel, merge = impl._load_kernels()
    rec = LaunchRecorder(kernel)
    monkeypatch.setattr(impl, "_KERNELS", [rec, merge])
    return rec.seen


@pytest.mark.interpret
@pytest.mark.parametrize("variant", ["shared-i32", "separate-v", "i64", "split-window", "page16", "off"])
def test_prefill_paged_offsets_interpret(variant, monkeypatch):
    """Paged addressing with the per-row slot / page-table offsets made once per loop (PAGE_INV): K and V
    sharing one offset (KV_SHARED) or not (V with its own page stride), 32- or 64-bit offsets (a cache past the
    32-bit extent, the limit lowered), window edges and split chunks, a page as long as the tile, and the
    per-tile addressing of pages longer than the key tile; each launch is checked to have taken the intended
    path. PAGE_INV relies on every work item starting on a KV-tile boundary (so on a page boundary): checked on
    the plan's work list."""
    from flashinfer_triton._prefill_impl import PrefillConfig

    ps = {"page16": 16, "off": 32}.get(variant, 4)
    case = make_case([(9, 70), (4, 17), (0, 5)], hq=4, hkv=2, page_size=ps, causal=True, window_left=37, seed=3)
    kw = dict(config=PrefillConfig(32, 16, 4, 1))
    if variant == "i64":
        monkeypatch.setattr(_impl(), "_INT32_LIMIT", 1)  # white-box: the 32-bit extent lowered under this small cache
    if variant == "separate-v":
        v4 = case["v4"]
        n_pages, _, hkv, d = v4.shape
        # Made on the device: .to(cuda) of a strided CPU view would give a contiguous copy (K's strides again).
        wide = torch.full((n_pages, ps + 1, hkv + 1, d), float("nan"), dtype=v4.dtype, device=DEVICE)[:, :ps, :hkv]
        wide.copy_(v4)  # same values, other page and slot strides (the padding stays NaN: never read)
        case["v4"] = wide
    if variant == "split-window":
        kw["fixed_split_size"] = 32
    seen = _record_launches(monkeypatch)
    plan_obj = check(case, **kw)
    if variant == "split-window":
        assert plan_obj.num_merge_host > 0
    work = plan_obj.work[: plan_obj.num_work_host].cpu()
    assert bool((work[:, 2] % 16 == 0).all()), "a work item starts inside a KV tile"
    inv = variant != "off"
    want = (inv, inv and variant != "separate-v", inv and variant != "i64")
    assert seen and all((s["PAGE_INV"], s["KV_SHARED"], s["KV_I32"]) == want for s in seen)


# ----------------------------------------------------------------------------- GPU
GPU_CASES = {
    "causal-4k-hq8-hkv8-d128-ragged": ([(1024, 1024)], dict(hq=8, hkv=8, d=128, paged=False, causal=True)),
    "append-512-over-3000-ps16-g4-d128": ([(512, 3000), (77, 1000)], dict(hq=8, hkv=2, d=128, causal=True)),
    "batch-paged-ps1-g3-d64-HND": (
        [(200, 700), (0, 5), (33, 0), (300, 301)],
        dict(hq=6, hkv=2, page_size=1, layout="HND", causal=True),
    ),
    "full-d256-bf16-ps5": ([(300, 517)], dict(hq=4, hkv=2, d=256, page_size=5, dtype=torch.bfloat16)),
    "d80-g7-window-causal": ([(300, 900)], dict(hq=7, hkv=1, d=80, causal=True, window_left=128)),
    "custom-mask-g4": ([(100, 300), (64, 64)], dict(hq=8, hkv=2, d=128, mask=0.3)),
    "custom-mask-blockdiag-ragged-tma": (
        [(700, 1500), (64, 300), (9, 9)],
        dict(hq=8, hkv=2, d=128, paged=False, mask=_block_diagonal(128, 256)),
    ),
    "custom-mask-banded-paged-ps16": ([(500, 2000)], dict(hq=4, hkv=4, d=64, mask=_banded(300, 0.9))),
    "rope-alibi-softcap": ([(257, 600)], dict(hq=4, hkv=1, d=128, causal=True, pos="ROPE_LLAMA", soft_cap=30.0)),
    "alibi-causal-g1": ([(257, 600)], dict(hq=4, hkv=4, d=64, causal=True, pos="ALIBI")),
    "fp8-e4m3-paged": ([(128, 2048)], dict(hq=8, hkv=2, d=128, kv_dtype=FP8["e4m3"], causal=True)),
    "decode-like-qo1-split": ([(1, 8000), (1, 33), (1, 0)], dict(hq=32, hkv=8, d=128)),
    "cascade-shared-prefix-64q-16k": ([(64, 16384)], dict(hq=32, hkv=8, d=128)),
    "ragged-batch-tma-g4": (
        [(300, 1000), (1, 77), (129, 129), (0, 5)],
        dict(hq=8, hkv=2, d=128, paged=False, causal=True),
    ),
    "ragged-HND-full-d64-tma": ([(200, 333)], dict(hq=4, hkv=4, d=64, paged=False, layout="HND")),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case_id", list(GPU_CASES))
def test_prefill_gpu(case_id):
    lens, kw = GPU_CASES[case_id]
    case = make_case(lens, **kw)
    scales = dict(qk_scale_mult=0.7, v_scale=1.3) if kw.get("kv_dtype") is not None else {}
    check(case, **scales)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefill_public_entry_points_gpu():
    """single_prefill_with_kv_cache and the paged wrapper route to this kernel and agree with the reference."""
    import flashinfer_triton as fit
    from flashinfer_triton import _backend

    opts = AttentionOptions(8, 2, 128, 16, True, causal=True)
    assert _backend.select_impl(opts, DEVICE).__name__.endswith("_prefill_impl")
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(700, 8, 128, device="cuda", generator=g).half()
    k = torch.randn(900, 2, 128, device="cuda", generator=g).half()
    v = torch.randn(900, 2, 128, device="cuda", generator=g).half()
    o, lse = fit.single_prefill_with_kv_cache(q, k, v, causal=True, return_lse=True)
    want_o, want_lse = reference.attention(q, k, v, causal=True)
    assert_close_named("o", o, want_o, 5e-3, 5e-3)
    assert_close_named("lse", lse, want_lse, 2e-3, 2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefill_cuda_graph_replan():
    """Capture after one plan(), replay after another plan() with different lengths: same grid, right answer."""
    impl = _impl()
    dev = DEVICE
    hq, hkv, d, ps = 8, 2, 128, 16
    max_bs, max_q = 4, 512
    ws = Workspace(
        float_buffer=torch.empty(1 << 24, dtype=torch.uint8, device=dev),
        int_buffer=torch.empty(1 << 20, dtype=torch.uint8, device=dev),
        cuda_graph=True,
        max_batch_size=max_bs,
        max_total_q=max_q,
    )
    num_pages = 400
    cache = torch.randn(num_pages, 2, ps, hkv, d, device=dev).half()
    k4, v4 = cache[:, 0], cache[:, 1]
    qo_buf = torch.zeros(max_bs + 1, dtype=torch.int32, device=dev)
    kvp_buf = torch.zeros(max_bs + 1, dtype=torch.int32, device=dev)
    kvi_buf = torch.zeros(num_pages, dtype=torch.int32, device=dev)
    kvl_buf = torch.zeros(max_bs, dtype=torch.int32, device=dev)
    q_buf = torch.randn(max_q, hq, d, device=dev).half()
    out_buf = torch.zeros(max_q, hq, d, device=dev).half()
    lse_buf = torch.zeros(max_q, hq, device=dev)
    opts = AttentionOptions(hq, hkv, d, ps, True, causal=True, sm_scale=d**-0.5)

    def replan(lens, seed):
        qo = torch.tensor([a for a, _ in lens])
        kv = torch.tensor([b for _, b in lens])
        qo_indptr = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(qo, 0)])
        spare = num_pages - sum(-(-int(n) // ps) for n in kv)
        kv_indptr, perm, _, _ = page_table(kv.tolist(), ps, spare_pages=spare, seed=seed)
        kv_indptr = kv_indptr.long()
        qo_buf[: len(lens) + 1].copy_(qo_indptr)
        kvp_buf[: len(lens) + 1].copy_(kv_indptr)
        kvi_buf[: perm.numel()].copy_(perm)
        kvl_buf[: len(lens)].copy_(kv)
        batch = AttentionBatch(
            len(lens),
            qo_buf[: len(lens) + 1],
            kvp_buf[: len(lens) + 1],
            kvi_buf,
            kvl_buf[: len(lens)],
            qo_indptr,
            kv,
            kv_indptr,
        )
        return batch, impl.plan(opts, batch, ws), qo_indptr, kv_indptr, perm, kv

    def want(lens, qo_indptr, kv_indptr, perm, kv):
        outs = []
        for b in range(len(lens)):
            pg = perm[int(kv_indptr[b]) : int(kv_indptr[b + 1])].long().to(dev)
            kd = k4[pg].reshape(-1, hkv, d)[: int(kv[b])]
            vd = v4[pg].reshape(-1, hkv, d)[: int(kv[b])]
            o, _ = reference.attention(q_buf[int(qo_indptr[b]) : int(qo_indptr[b + 1])], kd, vd, causal=True)
            outs.append(o)
        return torch.cat(outs)

    lens1 = [(100, 300), (200, 900), (5, 5), (0, 17)]
    batch, p1, *rest1 = replan(lens1, 1)
    impl.run(p1, opts, batch, q_buf, k4, v4, out_buf, lse_buf, qk_scale_mult=1.0, v_scale=1.0)  # warm up / compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        impl.run(p1, opts, batch, q_buf, k4, v4, out_buf, lse_buf, qk_scale_mult=1.0, v_scale=1.0)
    out_buf.fill_(float("nan"))
    graph.replay()
    n1 = int(rest1[0][-1])
    assert_close_named("o (first plan)", out_buf[:n1], want(lens1, *rest1), *TOL[torch.float16][:2])

    lens2 = [(300, 1200), (212, 212)]
    _, p2, *rest2 = replan(lens2, 2)
    assert p2.grid0 == p1.grid0
    out_buf.fill_(float("nan"))
    graph.replay()
    n2 = int(rest2[0][-1])
    assert_close_named("o (after re-plan)", out_buf[:n2], want(lens2, *rest2), *TOL[torch.float16][:2])
