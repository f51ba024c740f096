"""Prefill/append API: paged and ragged wrappers and single prefill against the reference."""

from __future__ import annotations

import pytest
import torch

import flashinfer_triton as fi
from conftest import LSE_TOL, assert_close, poison
from flashinfer_triton import reference as R
from helpers import FP8, make_paged


def _expected(q, qo_indptr, ks, vs, masks=None, **opts):
    outs, lses = [], []
    for b in range(len(ks)):
        qs, qe = int(qo_indptr[b]), int(qo_indptr[b + 1])
        o, lse = R.attention(q[qs:qe], ks[b], vs[b], custom_mask=None if masks is None else masks[b], **opts)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


PAGED_GRID = [
    # qo_lens, kv_lens, page_size, Hq, Hkv, D, layout, form, causal
    ([3, 1, 0, 7], [3, 17, 4, 97], 16, 8, 8, 64, "NHD", "5d", True),
    ([5, 16], [21, 16], 5, 12, 4, 64, "HND", "tuple", True),
    ([4, 2], [4, 9], 1, 9, 3, 128, "NHD", "3d", False),
    ([6, 1], [40, 0], 16, 16, 2, 256, "NHD", "5d", True),
    ([8], [30], 16, 4, 1, 80, "HND", "5d", False),
]


def _pid(c):
    qo, kv = "_".join(map(str, c[0])), "_".join(map(str, c[1]))
    return f"qo{qo}-kv{kv}-ps{c[2]}-hq{c[3]}-hkv{c[4]}-d{c[5]}-{c[6]}-{c[7]}-c{int(c[8])}"


def run_paged(
    device,
    qo_lens,
    kv_lens,
    page_size,
    hq,
    hkv,
    d,
    layout,
    form,
    causal,
    dtype=torch.float16,
    kv_dtype=None,
    plan_opts=None,
    run_opts=None,
    ref_opts=None,
    masks=None,
    packed=False,
):
    kv_dtype = kv_dtype or dtype
    cache, indptr, indices, last, ks, vs = make_paged(kv_lens, page_size, hkv, d, kv_dtype, device, layout, form)
    qo_indptr = torch.tensor([0] + torch.tensor(qo_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(qo_indptr[-1]), hq, d, device=device).to(dtype)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(torch.empty(32 << 20, dtype=torch.uint8, device=device), layout)
    extra = dict(plan_opts or {})
    if masks is not None:
        flat = torch.cat([m.reshape(-1) for m in masks])
        if packed:
            seg = torch.tensor([0] + torch.tensor([m.numel() for m in masks]).cumsum(0).tolist(), dtype=torch.int32)
            extra["packed_custom_mask"] = fi.segment_packbits(flat, seg, bitorder="little")[0]
        else:
            extra["custom_mask"] = flat
    w.plan(
        qo_indptr,
        indptr,
        indices,
        last,
        hq,
        hkv,
        d,
        page_size,
        causal=causal,
        q_data_type=dtype,
        kv_data_type=kv_dtype,
        **extra,
    )
    out = poison(torch.empty_like(q))
    lse = poison(torch.empty(q.shape[:2], dtype=torch.float32, device=device))
    o, s = w.run(q, cache, out=out, lse=lse, return_lse=True, **(run_opts or {}))
    ref = dict(plan_opts or {}) if ref_opts is None else ref_opts
    eo, es = _expected(q, qo_indptr, ks, vs, masks=masks, causal=causal, **ref)
    return o, s, eo, es


@pytest.mark.parametrize("case", PAGED_GRID, ids=_pid)
def test_batch_prefill_paged_matches_reference(device, case):
    o, s, eo, es = run_paged(device, *case)
    assert_close(o, eo)
    assert_close(s, es, *LSE_TOL, name="lse")


OPTIONS = {
    "rope": dict(pos_encoding_mode="ROPE_LLAMA", rope_theta=1e6),
    "alibi": dict(pos_encoding_mode="ALIBI"),
    "softcap": dict(logits_soft_cap=8.0),
    "window": dict(window_left=4),
    "smscale": dict(sm_scale=0.07),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_batch_prefill_options(device, name):
    o, s, eo, es = run_paged(device, [5, 3], [12, 30], 5, 8, 2, 64, "NHD", "5d", True, plan_opts=OPTIONS[name])
    assert_close(o, eo)
    assert_close(s, es, *LSE_TOL, name="lse")


@pytest.mark.parametrize("packed", [False, True], ids=["bool", "packed"])
def test_batch_prefill_custom_mask(device, packed):
    qo, kv = [3, 4], [7, 13]
    masks = [torch.rand(a, b) > 0.4 for a, b in zip(qo, kv)]
    masks[0][1] = False  # a row that sees nothing: o = 0, lse = -inf
    o, s, eo, es = run_paged(device, qo, kv, 5, 8, 2, 64, "NHD", "5d", True, masks=masks, packed=packed)
    assert_close(o, eo)
    assert_close(s, es, *LSE_TOL, name="lse")
    assert torch.isinf(s[1]).all()


@pytest.mark.skipif(FP8 is None, reason="torch without float8")
def test_batch_prefill_fp8(device):
    scales = dict(k_scale=0.8, v_scale=1.25)
    o, s, eo, es = run_paged(
        device, [4, 2], [9, 20], 16, 8, 2, 64, "NHD", "5d", True, kv_dtype=FP8, run_opts=scales, ref_opts=scales
    )
    assert_close(o, eo)


def test_batch_prefill_bf16(device):
    o, s, eo, es = run_paged(device, [4, 2], [9, 20], 16, 8, 2, 64, "NHD", "5d", True, dtype=torch.bfloat16)
    assert_close(o, eo)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_batch_prefill_ragged(device, layout):
    hq, hkv, d = 6, 2, 64  # qo lens 4, 0, 9 over kv lens 10, 3, 9
    qo_indptr = torch.tensor([0, 4, 4, 13], dtype=torch.int32)
    kv_indptr = torch.tensor([0, 10, 13, 22], dtype=torch.int32)
    q = torch.randn(13, hq, d, device=device).half()
    k = torch.randn(22, hkv, d, device=device).half()
    v = torch.randn(22, hkv, d, device=device).half()
    w = fi.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device), layout)
    w.plan(qo_indptr, kv_indptr, hq, hkv, d, causal=True)
    kk, vv = (k, v) if layout == "NHD" else (k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous())
    o, s = w.run(q, kk, vv, return_lse=True)
    ks = [k[0:10], k[10:13], k[13:22]]
    vs = [v[0:10], v[10:13], v[13:22]]
    eo, es = _expected(q, qo_indptr, ks, vs, causal=True)
    assert_close(o, eo)
    assert_close(s, es, *LSE_TOL, name="lse")


def test_single_prefill_matches_reference_and_batch(device):
    q = torch.randn(9, 8, 64, device=device).half()
    k = torch.randn(20, 4, 64, device=device).half()
    v = torch.randn(20, 4, 64, device=device).half()
    o, s = fi.single_prefill_with_kv_cache_return_lse(q, k, v, causal=True)
    eo, es = R.attention(q, k, v, causal=True)
    assert_close(o, eo)
    assert_close(s, es, *LSE_TOL, name="lse")
    mask = torch.rand(9, 20) > 0.5
    o = fi.single_prefill_with_kv_cache(q, k, v, custom_mask=mask.to(device))
    assert_close(o, R.attention(q, k, v, custom_mask=mask)[0])
    packed = fi.packbits(mask.reshape(-1), bitorder="little")
    o2 = fi.single_prefill_with_kv_cache(q, k, v, packed_custom_mask=packed.to(device))
    assert_close(o2, R.attention(q, k, v, custom_mask=mask)[0])
    o3 = fi.single_prefill_with_kv_cache(
        q,
        k.transpose(0, 1).contiguous(),
        v.transpose(0, 1).contiguous(),
        kv_layout="HND",
        causal=True,
        allow_fp16_qk_reduction=True,
    )
    assert_close(o3, eo)


def test_prefill_lifecycle_and_cuda_graph_buffers(device):
    ws = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(ws)
    with pytest.raises(RuntimeError, match="plan"):
        w.run(torch.randn(1, 8, 64, device=device).half(), torch.randn(1, 2, 16, 2, 64, device=device).half())
    cap, max_pages = 4, 12
    bufs = dict(
        qo_indptr_buf=torch.zeros(cap + 1, dtype=torch.int32, device=device),
        paged_kv_indptr_buf=torch.zeros(cap + 1, dtype=torch.int32, device=device),
        paged_kv_indices_buf=torch.zeros(max_pages, dtype=torch.int32, device=device),
        paged_kv_last_page_len_buf=torch.zeros(cap, dtype=torch.int32, device=device),
    )
    g = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=True, **bufs)
    for qo, kv in (([2, 3], [9, 30]), ([1, 1, 4, 2], [17, 3, 4, 20])):
        cache, indptr, indices, last, ks, vs = make_paged(kv, 16, 2, 64, torch.float16, device)
        qo_indptr = torch.tensor([0] + torch.tensor(qo).cumsum(0).tolist(), dtype=torch.int32)
        g.begin_forward(qo_indptr, indptr, indices, last, 8, 2, 64, 16, causal=True)
        assert torch.equal(bufs["qo_indptr_buf"][: len(qo) + 1].cpu(), qo_indptr)
        q = torch.randn(int(qo_indptr[-1]), 8, 64, device=device).half()
        assert_close(g.run(q, cache), _expected(q, qo_indptr, ks, vs, causal=True)[0])
        o = g.forward(q, cache, causal=False)
        assert_close(o, _expected(q, qo_indptr, ks, vs, causal=False)[0])
    with pytest.raises(ValueError, match="paged_kv_indptr_buf"):
        fi.BatchPrefillWithPagedKVCacheWrapper(ws, use_cuda_graph=True, qo_indptr_buf=bufs["qo_indptr_buf"])


def test_engine_style_plan_kwargs(device):
    cache, indptr, indices, last, ks, vs = make_paged([6, 11], 1, 2, 64, torch.float16, device, form="3d")
    qo_indptr = torch.tensor([0, 6, 8], dtype=torch.int32)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device), backend="fa3")
    w.plan(
        qo_indptr,
        indptr,
        indices,
        last,
        num_qo_heads=8,
        num_kv_heads=2,
        head_dim_qk=64,
        page_size=1,
        head_dim_vo=64,
        causal=True,
        q_data_type=torch.float16,
        kv_data_type=torch.float16,
        o_data_type=torch.float16,
        non_blocking=True,
        seq_lens=torch.tensor([6, 11], dtype=torch.int32),
        fixed_split_size=None,
        disable_split_kv=True,
    )
    q = torch.randn(8, 8, 64, device=device).half()
    assert_close(w.run(q, cache), _expected(q, qo_indptr, ks, vs, causal=True)[0])


@pytest.mark.interpret
def test_batch_prefill_kernels_through_api(device):
    """The public wrapper on the Triton kernels (interpreter on CPU, real GPU on CUDA)."""
    o, s, eo, es = run_paged(device, [3, 1, 0], [3, 17, 4], 16, 4, 2, 64, "NHD", "5d", True)
    assert_close(o, eo)
    assert_close(s, es, *LSE_TOL, name="lse")


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as a view of stride 2 into a larger tensor whose other entries are random."""
    high = {torch.bool: 2, torch.uint8: 256}.get(t.dtype, 1 << 20)
    big = torch.randint(0, high, (2 * t.numel(),), dtype=t.dtype, device=t.device)
    big[::2] = t
    return big[::2]


@pytest.mark.interpret
def test_plans_of_strided_index_views(device):
    """Index arrays given as strided views (every other entry of larger tensors) plan the batch they show, paged
    and ragged."""
    cache, indptr, indices, last, ks, vs = make_paged([3, 17], 16, 2, 64, torch.float16, device)
    qo_indptr = torch.tensor([0, 2, 5], dtype=torch.int32)
    q = torch.randn(5, 4, 64, device=device).half()
    ws = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    paged = fi.BatchPrefillWithPagedKVCacheWrapper(ws)
    paged.plan(_strided(qo_indptr), _strided(indptr), _strided(indices.to(device)), _strided(last), 4, 2, 64, 16)
    k, v = torch.cat(ks), torch.cat(vs)
    ragged = fi.BatchPrefillWithRaggedKVCacheWrapper(ws)
    ragged.plan(_strided(qo_indptr), _strided(torch.tensor([0, 3, 20], dtype=torch.int32)), 4, 2, 64)
    outs = {
        "paged": paged.run(q, cache, out=poison(torch.empty_like(q))),
        "ragged": ragged.run(q, k, v, out=poison(torch.empty_like(q))),
    }
    for name, o in outs.items():
        for b in range(2):
            qs, qe = int(qo_indptr[b]), int(qo_indptr[b + 1])
            eo, _ = R.attention(q[qs:qe].float(), ks[b].float(), vs[b].float())
            assert_close(o[qs:qe], eo, name=f"{name}, request {b}")


@pytest.mark.interpret
def test_strided_custom_masks(device):
    """A custom mask given as a strided view, bool or packed, masks by the values it shows."""
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(3, 4, 64, generator=gen).half().to(device)
    k = torch.randn(17, 2, 64, generator=gen).half().to(device)
    v = torch.randn(17, 2, 64, generator=gen).half().to(device)
    mask = torch.rand(3, 17, generator=gen) < 0.6
    mask[:, 0] = True  # (every row keeps a key)
    eo, _ = R.attention(q.float(), k.float(), v.float(), custom_mask=mask.to(device))
    flat = mask.reshape(-1).to(device)
    packed = fi.packbits(flat, "little")
    for name, kw in (
        ("custom_mask", {"custom_mask": _strided(flat)}),
        ("packed", {"packed_custom_mask": _strided(packed)}),
    ):
        o = fi.single_prefill_with_kv_cache(q, k, v, **kw)
        assert_close(o, eo, name=f"single, {name}")
        w = fi.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device))
        w.plan(torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 17], dtype=torch.int32), 4, 2, 64, **kw)
        assert_close(w.run(q, k, v, out=poison(torch.empty_like(q))), eo, name=f"batch, {name}")


def test_failed_plans_leave_forward_the_previous_batch(device):
    """A plan() that raises leaves the wrapper's previous plan whole, the arguments forward() re-plans from
    included (paged and ragged)."""
    cache, indptr, indices, last, ks, vs = make_paged([3, 17], 16, 2, 64, torch.float16, device)
    qo_indptr = torch.tensor([0, 2, 5], dtype=torch.int32)
    q = torch.randn(5, 4, 64, device=device).half()
    ws = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    paged = fi.BatchPrefillWithPagedKVCacheWrapper(ws)
    paged.plan(qo_indptr, indptr, indices, last, 4, 2, 64, 16)
    with pytest.raises(ValueError, match="paged_kv_last_page_len"):
        paged.plan(qo_indptr, indptr, indices, torch.zeros_like(last), 4, 2, 64, 16)
    ragged = fi.BatchPrefillWithRaggedKVCacheWrapper(ws)
    ragged.plan(qo_indptr, torch.tensor([0, 3, 20], dtype=torch.int32), 4, 2, 64)
    with pytest.raises(ValueError, match="kv_indptr"):
        ragged.plan(qo_indptr, torch.tensor([0, 3, 2], dtype=torch.int32), 4, 2, 64)
    outs = {
        "paged": paged.forward(q, cache, sm_scale=0.05),
        "ragged": ragged.forward(q, torch.cat(ks), torch.cat(vs), sm_scale=0.05),
    }
    for name, o in outs.items():
        for b in range(2):
            qs, qe = int(qo_indptr[b]), int(qo_indptr[b + 1])
            eo, _ = R.attention(q[qs:qe].float(), ks[b].float(), vs[b].float(), sm_scale=0.05)
            assert_close(o[qs:qe], eo, name=f"{name}, request {b}")


@pytest.mark.parametrize("case", PAGED_GRID[:3], ids=_pid)
def test_batch_prefill_equals_single_prefill(device, case):
    qo_lens, kv_lens, page_size, hq, hkv, d, layout, form, causal = case
    cache, indptr, indices, last, ks, vs = make_paged(kv_lens, page_size, hkv, d, torch.float16, device, layout, form)
    qo_indptr = torch.tensor([0] + torch.tensor(qo_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(qo_indptr[-1]), hq, d, device=device).half()
    w = fi.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device), layout)
    w.plan(qo_indptr, indptr, indices, last, hq, hkv, d, page_size, causal=causal)
    o, s = w.run(q, cache, return_lse=True)
    for b in range(len(kv_lens)):
        qs, qe = int(qo_indptr[b]), int(qo_indptr[b + 1])
        ob, sb = fi.single_prefill_with_kv_cache(q[qs:qe], ks[b], vs[b], causal=causal, return_lse=True)
        assert_close(o[qs:qe], ob, name=f"request {b}")
        assert_close(s[qs:qe], sb, *LSE_TOL, name=f"lse of request {b}")


@pytest.mark.interpret
@pytest.mark.parametrize("packed", [False, True], ids=["bool", "packed"])
def test_batch_prefill_block_sparse_mask_through_api(device, packed):
    """A block-diagonal custom mask (most KV tiles empty, skipped by the kernels), one row and one request
    fully masked: equals the reference, the masked rows give o = 0 and lse = -inf."""
    qo, kv = [40, 6, 5], [64, 30, 9]
    masks = []
    for a, b in zip(qo, kv):
        m = (torch.arange(a)[:, None] // 16) == (torch.arange(b)[None, :] // 20)
        masks.append(m & (torch.rand(a, b) > 0.2))
    masks[1][2] = False
    masks[2][:] = False
    o, s, eo, es = run_paged(device, qo, kv, 4, 4, 2, 64, "NHD", "5d", False, masks=masks, packed=packed)
    assert_close(o, eo)
    assert_close(s, es, *LSE_TOL, name="lse")
    assert torch.isinf(s[40 + 2]).all() and torch.isinf(s[46:]).all()
    assert (o[46:] == 0).all()


def _graph_capacity_replan(device, max_total_q):
    """CUDA-graph wrapper: the query-row capacity comes from max_total_q (or the first plan, doubled); a re-plan
    with more rows within it computes right with the same launch grid; beyond it plan() raises ValueError."""
    ws = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    cap, max_pages = 3, 40
    bufs = dict(
        qo_indptr_buf=torch.zeros(cap + 1, dtype=torch.int32, device=device),
        paged_kv_indptr_buf=torch.zeros(cap + 1, dtype=torch.int32, device=device),
        paged_kv_indices_buf=torch.zeros(max_pages, dtype=torch.int32, device=device),
        paged_kv_last_page_len_buf=torch.zeros(cap, dtype=torch.int32, device=device),
    )
    g = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=True, max_total_q=max_total_q, **bufs)
    grids = []
    for qo, kv in (([2, 3], [9, 30]), ([9, 1, 20], [17, 3, 40])):
        cache, indptr, indices, last, ks, vs = make_paged(kv, 8, 2, 64, torch.float16, device)
        qo_indptr = torch.tensor([0] + torch.tensor(qo).cumsum(0).tolist(), dtype=torch.int32)
        g.plan(qo_indptr, indptr, indices, last, 4, 2, 64, 8, causal=True)
        grids.append(g.plan_info().grid)
        q = torch.randn(int(qo_indptr[-1]), 4, 64, device=device).half()
        out = poison(torch.empty_like(q))
        assert_close(g.run(q, cache, out=out), _expected(q, qo_indptr, ks, vs, causal=True)[0])
    assert grids[0] == grids[1]
    limit = max_total_q or 10
    with pytest.raises(ValueError, match="qo_indptr"):
        g.plan(torch.tensor([0, limit + 1], dtype=torch.int32), indptr[:2], indices, last[:1], 4, 2, 64, 8)


def test_prefill_cuda_graph_capacity(device):
    _graph_capacity_replan(device, 32)
    with pytest.raises(ValueError, match="max_total_q"):
        fi.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(8, dtype=torch.uint8), max_total_q=0)


@pytest.mark.interpret
def test_prefill_cuda_graph_capacity_kernels(device):
    _graph_capacity_replan(device, 32)


def test_prefill_cuda_graph_default_capacity(device):
    """Without max_total_q the first plan fixes the capacity at twice its rows (FlashInfer: exactly its rows)."""
    cache, indptr, indices, last, ks, vs = make_paged([9, 30], 8, 2, 64, torch.float16, device)
    bufs = dict(
        qo_indptr_buf=torch.zeros(3, dtype=torch.int32, device=device),
        paged_kv_indptr_buf=torch.zeros(3, dtype=torch.int32, device=device),
        paged_kv_indices_buf=torch.zeros(16, dtype=torch.int32, device=device),
        paged_kv_last_page_len_buf=torch.zeros(2, dtype=torch.int32, device=device),
    )
    g = fi.BatchPrefillWithPagedKVCacheWrapper(
        torch.empty(1 << 20, dtype=torch.uint8, device=device), **bufs, use_cuda_graph=True
    )
    g.plan(torch.tensor([0, 2, 5], dtype=torch.int32), indptr, indices, last, 4, 2, 64, 8)
    g.plan(torch.tensor([0, 4, 10], dtype=torch.int32), indptr, indices, last, 4, 2, 64, 8)
    with pytest.raises(ValueError, match="at most 10 query rows"):
        g.plan(torch.tensor([0, 4, 11], dtype=torch.int32), indptr, indices, last, 4, 2, 64, 8)


# ----------------------------------------------------------------------------- CUDA-graph re-plans keep their addresses


def _prefill_graph_wrapper(cap, with_mask, device):
    bufs = dict(
        qo_indptr_buf=torch.zeros(cap + 1, dtype=torch.int32, device=device),
        paged_kv_indptr_buf=torch.zeros(cap + 1, dtype=torch.int32, device=device),
        paged_kv_indices_buf=torch.zeros(32, dtype=torch.int32, device=device),
        paged_kv_last_page_len_buf=torch.zeros(cap, dtype=torch.int32, device=device),
    )
    if with_mask:
        bufs["custom_mask_buf"] = torch.zeros(4096, dtype=torch.uint8, device=device)
        bufs["qk_indptr_buf"] = torch.zeros(cap + 1, dtype=torch.int32, device=device)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(
        torch.empty(8 << 20, dtype=torch.uint8, device=device), "NHD", use_cuda_graph=True, **bufs
    )
    return w, bufs


@pytest.mark.interpret
def test_prefill_graph_replan_smaller_batch_refills_buffers(device):
    """Prefill CUDA-graph mode: a re-plan with fewer requests refills the caller's buffers and the kernel's
    staged arrays keep their addresses (padded past the live batch)."""
    cap, ps, hq, hkv, d = 3, 8, 2, 1, 32
    w, bufs = _prefill_graph_wrapper(cap, with_mask=False, device=device)
    seen = set()
    for qo, kv in (([2, 3, 1], [9, 20, 4]), ([4], [17])):
        cache, indptr, indices, last, ks, vs = make_paged(kv, ps, hkv, d, torch.float16, device)
        qo_indptr = torch.tensor([0] + torch.tensor(qo).cumsum(0).tolist(), dtype=torch.int32, device=device)
        w.plan(qo_indptr, indptr, indices, last, hq, hkv, d, ps, q_data_type=torch.float16)
        n = len(qo)
        assert torch.equal(bufs["qo_indptr_buf"][: n + 1], qo_indptr)
        assert torch.equal(bufs["paged_kv_indptr_buf"][: n + 1], indptr)
        assert torch.equal(bufs["paged_kv_last_page_len_buf"][:n], last)
        a = w.plan_info().addresses
        seen.add((a["qo_indptr"], a["kv_indptr"], a["kv_lens"], a["kv_indices"]))
        q = torch.randn(int(qo_indptr[-1]), hq, d, device=device).half()
        out = w.run(q, cache)
        for r in range(n):
            rows = slice(int(qo_indptr[r]), int(qo_indptr[r + 1]))
            o_ref, _ = R.attention(q[rows].float(), ks[r].float(), vs[r].float())
            assert_close(out[rows], o_ref, name=f"out request {r} of {qo}")
    assert len(seen) == 1, seen


def _blocks_address(w):
    """The address _prefill_impl.run passes as the custom mask's run list (blk_ptr)."""
    a = w.plan_info().addresses
    return a["blocks"] if "blocks" in a else a["qo_indptr"]


@pytest.mark.interpret
def test_prefill_graph_mask_run_list_address_stable(device):
    """The custom mask's KV-tile run list must sit at one fixed address across CUDA-graph re-plans, also when
    the plan at capture time has no set bit (an all-false mask, as capture-time dummy batches may have)."""
    cap, ps, hq, hkv, d = 2, 8, 2, 1, 32
    w, _ = _prefill_graph_wrapper(cap, with_mask=True, device=device)
    qo, kv = [3, 5], [20, 30]
    cache, indptr, indices, last, ks, vs = make_paged(kv, ps, hkv, d, torch.float16, device)
    qo_indptr = torch.tensor([0, 3, 8], dtype=torch.int32, device=device)
    seen = set()
    for fill in (False, True):
        masks = [
            (torch.rand(a, c, device=device) < 0.5) if fill else torch.zeros(a, c, dtype=torch.bool, device=device)
            for a, c in zip(qo, kv)
        ]
        cm = torch.cat([m.reshape(-1) for m in masks])
        w.plan(qo_indptr, indptr, indices, last, hq, hkv, d, ps, custom_mask=cm, q_data_type=torch.float16)
        seen.add(_blocks_address(w))
    assert len(seen) == 1, seen
