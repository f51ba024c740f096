"""CUDA-graph re-plans keep every address a captured graph reads, the fused split-KV merge across re-plans
(0 keys, 1 chunk, many chunks), caller buffers refilled, the options memo."""

from __future__ import annotations

import pytest
import torch

import flashinfer_triton as fi
from conftest import assert_close
from flashinfer_triton import reference as R
from helpers import expected_decode as _expected
from helpers import make_paged

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CUDA on the GPU machine


@pytest.mark.interpret
def test_decode_graph_replan_fused_merge_keeps_addresses():
    """CUDA-graph decode wrapper re-planned with other lengths (a request with 0 keys, one with 1 chunk,
    many chunks, then all short): results match, arrival counters end at 0, and every device address the
    decode launch reads (work list, counters, partial states, staged arrays, page indices) stays the same."""
    cap, ps, hq, hkv, d = 4, 8, 2, 1, 32
    ind_buf = torch.zeros(cap + 1, dtype=torch.int32, device=DEV)
    idx_buf = torch.zeros(64, dtype=torch.int32, device=DEV)
    last_buf = torch.zeros(cap, dtype=torch.int32, device=DEV)
    w = fi.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(
        torch.empty(8 << 20, dtype=torch.uint8, device=DEV), ind_buf, idx_buf, last_buf
    )
    addrs = set()
    for lens in ([70, 0, 5, 33], [3, 90, 0, 0], [0, 0, 0, 1]):
        cache, indptr, indices, last, ks, vs = make_paged(lens, ps, hkv, d, torch.float16, DEV, spare_pages=1)
        w.plan(indptr, indices, last, hq, hkv, d, ps, fixed_split_size=2)
        assert torch.equal(ind_buf, indptr) and torch.equal(last_buf, last)
        assert torch.equal(idx_buf[: indices.numel()], indices)
        planned = w._w._planned
        p, b = planned["plan"], planned["batch"]
        assert p.graph and p.fused
        addrs.add(
            (
                p.work.data_ptr(),
                p.counters.data_ptr(),
                p.part_o.data_ptr(),
                p.part_lse.data_ptr(),
                p.work_indptr.data_ptr(),
                p.num_work_dev.data_ptr(),
                b.kv_indptr.data_ptr(),
                b.kv_lens.data_ptr(),
                b.kv_indices.data_ptr(),
            )
        )
        q = torch.randn(cap, hq, d, device=DEV).half()
        out, lse = w.run(q, cache, return_lse=True)
        o_ref, lse_ref = _expected(q, ks, vs)
        assert_close(out, o_ref, name=f"out {lens}")
        nonempty = torch.tensor(lens, device=DEV) > 0
        assert_close(lse[nonempty], lse_ref[nonempty], 2e-3, 2e-3, name=f"lse {lens}")
        assert int(p.counters.abs().sum()) == 0
    assert len(addrs) == 1, addrs


def _prefill_graph_wrapper(cap, with_mask):
    bufs = dict(
        qo_indptr_buf=torch.zeros(cap + 1, dtype=torch.int32, device=DEV),
        paged_kv_indptr_buf=torch.zeros(cap + 1, dtype=torch.int32, device=DEV),
        paged_kv_indices_buf=torch.zeros(32, dtype=torch.int32, device=DEV),
        paged_kv_last_page_len_buf=torch.zeros(cap, dtype=torch.int32, device=DEV),
    )
    if with_mask:
        bufs["custom_mask_buf"] = torch.zeros(4096, dtype=torch.uint8, device=DEV)
        bufs["qk_indptr_buf"] = torch.zeros(cap + 1, dtype=torch.int32, device=DEV)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(
        torch.empty(8 << 20, dtype=torch.uint8, device=DEV), "NHD", use_cuda_graph=True, **bufs
    )
    return w, bufs


@pytest.mark.interpret
def test_prefill_graph_replan_smaller_batch_refills_buffers():
    """Prefill CUDA-graph mode: a re-plan with fewer requests refills the caller's buffers and the kernel's
    staged arrays keep their addresses (padded past the live batch)."""
    cap, ps, hq, hkv, d = 3, 8, 2, 1, 32
    w, bufs = _prefill_graph_wrapper(cap, with_mask=False)
    seen = set()
    for qo, kv in (([2, 3, 1], [9, 20, 4]), ([4], [17])):
        cache, indptr, indices, last, ks, vs = make_paged(kv, ps, hkv, d, torch.float16, DEV)
        qo_indptr = torch.tensor([0] + torch.tensor(qo).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
        w.plan(qo_indptr, indptr, indices, last, hq, hkv, d, ps, q_data_type=torch.float16)
        n = len(qo)
        assert torch.equal(bufs["qo_indptr_buf"][: n + 1], qo_indptr)
        assert torch.equal(bufs["paged_kv_indptr_buf"][: n + 1], indptr)
        assert torch.equal(bufs["paged_kv_last_page_len_buf"][:n], last)
        b = w._w._planned["batch"]
        seen.add((b.qo_indptr.data_ptr(), b.kv_indptr.data_ptr(), b.kv_lens.data_ptr(), b.kv_indices.data_ptr()))
        q = torch.randn(int(qo_indptr[-1]), hq, d, device=DEV).half()
        out = w.run(q, cache)
        for r in range(n):
            rows = slice(int(qo_indptr[r]), int(qo_indptr[r + 1]))
            o_ref, _ = R.attention(q[rows].float(), ks[r].float(), vs[r].float())
            assert_close(out[rows], o_ref, name=f"out request {r} of {qo}")
    assert len(seen) == 1, seen


def _blocks_address(planned):
    """The address _prefill_impl.run passes as the custom mask's run list (blk_ptr)."""
    p, b = planned["plan"], planned["batch"]
    return p.blocks.data_ptr() if p.blocks is not None else b.qo_indptr.data_ptr()


@pytest.mark.interpret
def test_prefill_graph_mask_run_list_address_stable():
    """The custom mask's KV-tile run list must sit at one fixed address across CUDA-graph re-plans, also when
    the plan at capture time has no set bit (an all-false mask, as capture-time dummy batches may have)."""
    cap, ps, hq, hkv, d = 2, 8, 2, 1, 32
    w, _ = _prefill_graph_wrapper(cap, with_mask=True)
    qo, kv = [3, 5], [20, 30]
    cache, indptr, indices, last, ks, vs = make_paged(kv, ps, hkv, d, torch.float16, DEV)
    qo_indptr = torch.tensor([0, 3, 8], dtype=torch.int32, device=DEV)
    seen = set()
    for fill in (False, True):
        masks = [
            (torch.rand(a, c, device=DEV) < 0.5) if fill else torch.zeros(a, c, dtype=torch.bool, device=DEV)
            for a, c in zip(qo, kv)
        ]
        cm = torch.cat([m.reshape(-1) for m in masks])
        w.plan(qo_indptr, indptr, indices, last, hq, hkv, d, ps, custom_mask=cm, q_data_type=torch.float16)
        seen.add(_blocks_address(w._w._planned))
    assert len(seen) == 1, seen


@pytest.mark.interpret
def test_plan_memo_follows_option_changes():
    """plan() reuses checked options only for identical arguments: ALiBi -> none -> another sm_scale ->
    soft cap on one wrapper each give the reference's result."""
    lens, ps, hq, hkv, d = [9, 20], 8, 4, 2, 32
    cache, indptr, indices, last, ks, vs = make_paged(lens, ps, hkv, d, torch.float16, DEV)
    q = torch.randn(2, hq, d, device=DEV).half()
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=DEV))
    cases = [
        dict(pos_encoding_mode="ALIBI"),
        dict(),
        dict(sm_scale=0.05),
        dict(sm_scale=0.05),  # same arguments: the memo is reused
        dict(logits_soft_cap=5.0),
    ]
    for kw in cases:
        w.plan(indptr, indices, last, hq, hkv, d, ps, **kw)
        ref_kw = {}
        if kw.get("pos_encoding_mode") == "ALIBI":
            ref_kw["pos_encoding_mode"] = "ALIBI"
        if "sm_scale" in kw:
            ref_kw["sm_scale"] = kw["sm_scale"]
        if "logits_soft_cap" in kw:
            ref_kw["logits_soft_cap"] = kw["logits_soft_cap"]
        o_ref, _ = _expected(q, ks, vs, **ref_kw)
        assert_close(w.run(q, cache), o_ref, name=f"out {kw}")


def test_plan_memo_still_rejects_bad_types():
    """An argument equal to the memo's but of a rejected type (num_qo_heads=4.0 after 4) still raises."""
    cache, indptr, indices, last, ks, vs = make_paged([9, 20], 8, 2, 32, torch.float16, DEV)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=DEV))
    with pytest.raises(ValueError, match="num_qo_heads"):
        w.plan(indptr, indices, last, 4.0, 2, 32, 8)
    w.plan(indptr, indices, last, 4, 2, 32, 8)
    with pytest.raises(ValueError, match="num_qo_heads"):
        w.plan(indptr, indices, last, 4.0, 2, 32, 8)
