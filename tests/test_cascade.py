"""Cascade API: merging states, multi-level cascade = attention over the concatenated KV, legacy wrappers."""

from __future__ import annotations

import functools

import pytest
import torch

import flashinfer_triton as fi
from conftest import INTERPRET, LSE_TOL, assert_close, poison
from flashinfer_triton import reference as R
from helpers import make_paged


def _states(n, h, d, device, dtype=torch.float16):
    return torch.randn(n, h, d, device=device).to(dtype), torch.randn(n, h, device=device) * 3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_merge_state_equals_attention_over_union(device, dtype):
    q = torch.randn(5, 4, 64, device=device)
    k = torch.randn(30, 4, 64, device=device)
    v = torch.randn(30, 4, 64, device=device)
    oa, sa = R.attention(q, k[:11], v[:11])
    ob, sb = R.attention(q, k[11:], v[11:])
    o, s = fi.merge_state(oa.to(dtype), sa, ob.to(dtype), sb)
    eo, es = R.attention(q, k, v)
    assert o.dtype == dtype
    assert_close(o, eo)
    assert_close(s, es, *LSE_TOL, name="lse")


def test_merge_state_empty_sides(device):
    va, sa = _states(6, 2, 32, device)
    vb, sb = _states(6, 2, 32, device)
    sb[:3] = float("-inf")
    sa[4] = float("-inf")
    sb[4] = float("-inf")
    v, s = fi.merge_state(va, sa, vb, sb)
    assert_close(v[:3], va[:3])
    assert torch.equal(s[:3], sa[:3])
    assert torch.equal(v[4].float(), torch.zeros_like(v[4].float())) and torch.isinf(s[4]).all()


def test_merge_state_in_place_mask(device):
    v, s = _states(8, 2, 32, device)
    vo, so = _states(8, 2, 32, device)
    mask = torch.tensor([True, False] * 4, device=device)
    v0, s0 = v.clone(), s.clone()
    fi.merge_state_in_place(v, s, vo, so, mask)
    ev, es = R.merge_state(v0, s0, vo, so)
    assert_close(v[mask], ev[mask])
    assert_close(s[mask], es[mask], *LSE_TOL, name="lse")
    assert torch.equal(v[~mask], v0[~mask]) and torch.equal(s[~mask], s0[~mask])
    fi.merge_state_in_place(v, s, vo, so)  # no mask: every row


def test_merge_states_equals_sequential(device):
    v = torch.randn(5, 4, 3, 32, device=device).half()
    s = torch.randn(5, 4, 3, device=device)
    s[1, 2] = float("-inf")
    o, ls = fi.merge_states(v, s)
    ev, es = v[:, 0].float(), s[:, 0]
    for i in range(1, 4):
        ev, es = R.merge_state(ev, es, v[:, i], s[:, i])
    assert o.shape == (5, 3, 32) and o.dtype == torch.float16
    assert_close(o, ev)
    assert_close(ls, es, *LSE_TOL, name="lse")


def _cascade_case(device, shared_len, unique_lens, page_size, causal, qo_lens=None):
    """Level 0: one shared prefix for all requests; level 1: each request's own pages."""
    hq, hkv, d = 8, 2, 64
    bs = len(unique_lens)
    qo_lens = qo_lens or [1] * bs
    cache, indptr, indices, last, ks, vs = make_paged(
        [shared_len] + unique_lens, page_size, hkv, d, torch.float16, device, spare_pages=3
    )
    n_shared_pages = int(indptr[1])
    total_q = sum(qo_lens)
    qo_unique = torch.tensor([0] + torch.tensor(qo_lens).cumsum(0).tolist(), dtype=torch.int32)
    level0 = (
        torch.tensor([0, total_q], dtype=torch.int32),
        indptr[:2].clone(),
        indices[:n_shared_pages].clone(),
        last[:1].clone(),
    )
    level1 = (qo_unique, (indptr[1:] - indptr[1]).to(torch.int32), indices[n_shared_pages:].clone(), last[1:].clone())
    q = torch.randn(total_q, hq, d, device=device).half()
    # expected: each request attends to shared ++ own KV, causal aligned to the end of the whole sequence
    outs = []
    for b in range(bs):
        k_full = torch.cat([ks[0], ks[b + 1]])
        v_full = torch.cat([vs[0], vs[b + 1]])
        qs, qe = int(qo_unique[b]), int(qo_unique[b + 1])
        outs.append(R.attention(q[qs:qe], k_full, v_full, causal=causal)[0])
    return cache, level0, level1, q, torch.cat(outs)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("causal", [False, True])
def test_multilevel_cascade_equals_full_attention(device, page_size, causal):
    cache, l0, l1, q, expected = _cascade_case(device, 37, [5, 0, 20], page_size, causal, qo_lens=[2, 1, 3])
    w = fi.MultiLevelCascadeAttentionWrapper(2, torch.empty(8 << 20, dtype=torch.uint8, device=device))
    w.plan([l0[0], l1[0]], [l0[1], l1[1]], [l0[2], l1[2]], [l0[3], l1[3]], 8, 2, 64, page_size, causal=causal)
    o = w.run(q, cache)
    assert_close(o, expected)


def test_multilevel_cascade_empty_shared_level(device):
    cache, l0, l1, q, expected = _cascade_case(device, 0, [5, 9], 16, False)
    w = fi.MultiLevelCascadeAttentionWrapper(2, torch.empty(8 << 20, dtype=torch.uint8, device=device))
    w.plan([l0[0], l1[0]], [l0[1], l1[1]], [l0[2], l1[2]], [l0[3], l1[3]], 8, 2, 64, 16)
    assert_close(w.run(q, cache), expected)
    with pytest.raises(RuntimeError, match="plan"):
        fi.MultiLevelCascadeAttentionWrapper(1, torch.empty(8, dtype=torch.uint8, device=device)).run(q, cache)


def _shared_then_causal_own(q, k_shared, v_shared, k_own, v_own, causal):
    """Reference for the legacy prefill wrapper: every shared key visible, the request's own keys causal
    (aligned to the end of its own keys, as FlashInfer's two-state merge defines it)."""
    qo, n_shared, n_own = q.shape[0], k_shared.shape[0], k_own.shape[0]
    mask = torch.ones(qo, n_shared + n_own, dtype=torch.bool, device=q.device)
    if causal:
        i = torch.arange(qo, device=q.device)[:, None]
        j = torch.arange(n_own, device=q.device)[None, :]
        mask[:, n_shared:] = j <= i + n_own - qo
    return R.attention(q, torch.cat([k_shared, k_own]), torch.cat([v_shared, v_own]), custom_mask=mask)[0]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("shared", [0, 25], ids=["empty-shared", "shared25"])
def test_legacy_shared_prefix_wrappers(device, page_size, shared):
    """Both legacy wrappers equal attention over shared ++ own KV, with an empty shared prefix and a
    request that has no own tokens."""
    hq, hkv, d = 8, 2, 64
    own = [4, 0, 11]
    k_shared = torch.randn(shared, hkv, d, device=device).half()
    v_shared = torch.randn(shared, hkv, d, device=device).half()
    cache, indptr, indices, last, ks, vs = make_paged(own, page_size, hkv, d, torch.float16, device)
    ws = torch.empty(8 << 20, dtype=torch.uint8, device=device)
    dec = fi.BatchDecodeWithSharedPrefixPagedKVCacheWrapper(ws, "NHD")
    dec.begin_forward(indptr, indices, last, hq, hkv, d, page_size)
    q = torch.randn(3, hq, d, device=device).half()
    o = dec.forward(q, k_shared, v_shared, cache)
    for b in range(3):
        eo, _ = R.attention(q[b : b + 1], torch.cat([k_shared, ks[b]]), torch.cat([v_shared, vs[b]]))
        assert_close(o[b : b + 1], eo, name=f"decode request {b}")
    pre = fi.BatchPrefillWithSharedPrefixPagedKVCacheWrapper(ws, "NHD")
    qo_lens = [3, 2, 4]
    qo_indptr = torch.tensor([0, 3, 5, 9], dtype=torch.int32)
    pre.begin_forward(qo_indptr, indptr, indices, last, hq, hkv, d, page_size)
    q = poison(torch.empty(sum(qo_lens), hq, d, device=device).half()).normal_()
    for causal in (True, False):
        o = pre.forward(q, k_shared, v_shared, cache, causal=causal)
        for b in range(3):
            qs, qe = int(qo_indptr[b]), int(qo_indptr[b + 1])
            eo = _shared_then_causal_own(q[qs:qe], k_shared, v_shared, ks[b], vs[b], causal)
            assert_close(o[qs:qe], eo, name=f"prefill request {b} causal={causal}")


@pytest.mark.interpret
def test_merge_kernels_through_api(device):
    va, sa = _states(5, 3, 64, device)
    vb, sb = _states(5, 3, 64, device)
    sb[0] = float("-inf")
    v, s = fi.merge_state(va, sa, vb, sb)
    ev, es = R.merge_state(va, sa, vb, sb)
    assert_close(v, ev)
    assert_close(s, es, *LSE_TOL, name="lse")


def test_fused_cascade_split_choice():
    """The fused plan's KV pieces for the H100 benchmark shapes (132 SMs, 64-key tiles, 32/8 heads, D128):
    the shared level is cut, the per-request level is not, and the merge-traffic cap holds the batch-64
    case near its measured optimum (docs/cascade.md)."""
    import numpy as np

    from flashinfer_triton._config import CascadeConfig
    from flashinfer_triton.cascade import _choose_splits

    def splits(batch, shared):
        tiles = -(-batch * 4 // 128)  # 128-row tiles of 32 tokens x group 4
        return _choose_splits([np.full(tiles, shared), np.full(batch, 256)], 64, 132, batch, 32, 8, 128, 2)

    assert splits(64, 16384) == [13, 1]
    assert splits(128, 32768) == [14, 1]
    assert splits(256, 32768) == [7, 1]
    assert _choose_splits([np.zeros(0, dtype=np.int64), np.full(3, 10)], 16, 4, 3, 4, 1, 32, 2) == [1, 1]
    # A configuration passed in (the default gives [13, 1] here): fewer waves, fewer pieces; without the
    # merge-traffic cap the shared level takes split_waves x SMs' worth.
    ranges = [np.full(2, 16384), np.full(64, 256)]
    assert _choose_splits(ranges, 64, 132, 64, 32, 8, 128, 2, CascadeConfig(split_waves=2)) == [11, 1]
    assert _choose_splits(ranges, 64, 132, 64, 32, 8, 128, 2, CascadeConfig(merge_share=1e9)) == [22, 1]


def _plan_two_levels(device):
    """A planned two-level cascade: one shared request over both query rows, then two requests of one row."""
    w = fi.MultiLevelCascadeAttentionWrapper(2, torch.empty(1 << 20, dtype=torch.uint8, device=device), "NHD")
    assert w.plan_info() is None
    i32 = functools.partial(torch.tensor, dtype=torch.int32, device=device)
    w.plan([i32([0, 2]), i32([0, 1, 2])], [i32([0, 2]), i32([0, 1, 2])], [i32([0, 1]), i32([2, 3])],
           [i32([5]), i32([3, 7])], 4, 2, 32, 8)  # fmt: skip
    return w


@pytest.mark.skipif(INTERPRET, reason="CPU tensors run the Triton kernels under TRITON_INTERPRET=1")
def test_multilevel_plan_info_torch_path():
    """None before plan(); then one PlanInfo per level, and no fused plan on the PyTorch path (CPU tensors)."""
    info = _plan_two_levels(torch.device("cpu")).plan_info()
    assert info.fused is None and [lv.batch_size for lv in info.levels] == [1, 2]
    assert all(lv.backend == "torch" for lv in info.levels)


@pytest.mark.interpret
def test_multilevel_plan_info_fused(device):
    """On the Triton path the fused plan reports its combined batch: each level's requests plus one empty
    request after each level, as many as its ``kv_lens`` entries."""
    info = _plan_two_levels(device).plan_info()
    assert [lv.batch_size for lv in info.levels] == [1, 2]
    assert all(lv.backend in ("triton", "gluon") for lv in info.levels)
    fused = info.fused
    assert fused is not None and fused.backend in ("triton", "gluon")
    assert fused.batch_size == (1 + 1) + (2 + 1) == len(fused.arrays["kv_lens"])
    assert fused.arrays["kv_lens"].tolist() == [8 + 5, 0, 3, 7, 0]
    assert fused.total_q == 2 and fused.grid[0] == fused.details["grid0"]


def test_multilevel_is_cuda_graph_enabled():
    ws = torch.empty(1 << 20, dtype=torch.uint8)
    assert fi.MultiLevelCascadeAttentionWrapper(2, ws, "NHD").is_cuda_graph_enabled is False
    bufs = dict(
        qo_indptr_buf_arr=[torch.zeros(3, dtype=torch.int32) for _ in range(2)],
        paged_kv_indptr_buf_arr=[torch.zeros(3, dtype=torch.int32) for _ in range(2)],
        paged_kv_indices_buf_arr=[torch.zeros(8, dtype=torch.int32) for _ in range(2)],
        paged_kv_last_page_len_buf_arr=[torch.zeros(2, dtype=torch.int32) for _ in range(2)],
    )
    assert fi.MultiLevelCascadeAttentionWrapper(2, ws, "NHD", use_cuda_graph=True, **bufs).is_cuda_graph_enabled
