"""The CUDA-graph decode wrapper's fast re-plan (an engine's per-step ``plan()`` with unchanged options):
same results, buffers and addresses as the general path, and the same errors for bad tables."""

from __future__ import annotations

import pytest
import torch

import flashinfer_triton as fi
from conftest import assert_close, poison
from flashinfer_triton import decode as dmod
from flashinfer_triton import reference as R
from helpers import expected_decode as _expected
from helpers import make_paged

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def spy(monkeypatch):
    """Counts the plan() calls the fast path served."""
    hits = []
    orig = dmod._DecodeCore._replan_fast

    def wrapped(self, *a, **k):
        ok = orig(self, *a, **k)
        hits.append(ok)
        return ok

    monkeypatch.setattr(dmod._DecodeCore, "_replan_fast", wrapped)
    return hits


def _graph_wrapper(cap, pages):
    bufs = (
        torch.zeros(cap + 1, dtype=torch.int32, device=DEV),
        torch.zeros(pages, dtype=torch.int32, device=DEV),
        torch.zeros(cap, dtype=torch.int32, device=DEV),
    )
    ws = torch.empty(8 << 20, dtype=torch.uint8, device=DEV)
    return fi.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(ws, *bufs, "NHD"), bufs


@pytest.mark.interpret
@pytest.mark.parametrize("split", [None, 2], ids=["auto-split", "fixed-split-2-pages"])
def test_fast_replan_matches_reference(spy, split):
    """Re-plans with other lengths (0 keys, one page, several chunks), page indices passed as a separate
    tensor or as the caller's own buffer (as the engine does), window on: results equal the reference,
    the caller's buffers hold the table, the split merge's counters end at zero, addresses never move."""
    cap, ps, hq, hkv, d = 4, 8, 4, 2, 32
    w, (ind_buf, idx_buf, last_buf) = _graph_wrapper(cap, 64)
    addrs = set()
    opts = dict(window_left=40, fixed_split_size=split, q_data_type=torch.float16)
    runs = ([70, 0, 5, 33], [3, 90, 0, 1], [0, 0, 0, 0], [17, 16, 8, 64], [9, 120, 40, 2])
    for i, lens in enumerate(runs):
        cache, indptr, indices, last, ks, vs = make_paged(lens, ps, hkv, d, torch.float16, DEV, spare_pages=1)
        if i % 2:
            idx_buf[: indices.numel()].copy_(indices)  # the engine's way: indices already in the buffer
            indices = idx_buf[: indices.numel()]
        w.plan(indptr.cpu(), indices, last.cpu(), hq, hkv, d, ps, **opts)
        assert torch.equal(ind_buf.cpu(), indptr.cpu()) and torch.equal(last_buf.cpu(), last.cpu())
        assert torch.equal(idx_buf[: indices.numel()].cpu(), indices.cpu())
        p, b = w._w._planned["plan"], w._w._planned["batch"]
        addrs.add((p.work.data_ptr(), b.kv_indptr.data_ptr(), b.kv_lens.data_ptr(), b.kv_indices.data_ptr()))
        q = torch.randn(cap, hq, d, device=DEV).half()
        out = poison(torch.empty(cap, hq, d, device=DEV, dtype=torch.float16))
        lse = poison(torch.empty(cap, hq, device=DEV))
        w.run(q, cache, out=out, lse=lse)
        o_ref, lse_ref = _expected(q, ks, vs, window_left=40)
        assert_close(out, o_ref, name=f"out {lens}")
        nonempty = torch.tensor(lens, device=DEV) > 0
        assert_close(lse[nonempty], lse_ref[nonempty], 2e-3, 2e-3, name=f"lse {lens}")
        if p.counters is not None:
            assert int(p.counters.abs().sum()) == 0
    assert spy == [True] * (len(runs) - 1)  # every plan() after the first took the fast path
    assert len(addrs) == 1, addrs


@pytest.mark.interpret
def test_fast_replan_follows_option_and_workspace_changes(spy):
    """Other options (sm_scale, soft cap) or a swapped workspace go through the general path, with the
    reference's result."""
    cap, ps, hq, hkv, d = 2, 8, 2, 1, 32
    w, _ = _graph_wrapper(cap, 16)
    cache, indptr, indices, last, ks, vs = make_paged([9, 20], ps, hkv, d, torch.float16, DEV)
    q = torch.randn(cap, hq, d, device=DEV).half()
    for kw in (dict(), dict(), dict(sm_scale=0.05), dict(sm_scale=0.05), dict(logits_soft_cap=5.0)):
        w.plan(indptr.cpu(), indices, last.cpu(), hq, hkv, d, ps, **kw)
        assert_close(w.run(q, cache), _expected(q, ks, vs, **kw)[0], name=f"out {kw}")
    assert spy == [True, False, True, False]
    w.reset_workspace_buffer(torch.empty(8 << 20, dtype=torch.uint8, device=DEV))
    w.plan(indptr.cpu(), indices, last.cpu(), hq, hkv, d, ps, logits_soft_cap=5.0)
    assert spy[-1] is False
    assert_close(w.run(q, cache), _expected(q, ks, vs, logits_soft_cap=5.0)[0])


@pytest.mark.interpret
def test_fast_replan_rejects_bad_tables():
    """After a plan the fast path could follow, bad tables raise the general path's errors (naming the
    argument) and the next good plan works."""
    cap, ps, hq, hkv, d = 2, 8, 2, 1, 32
    w, _ = _graph_wrapper(cap, 16)
    cache, indptr, indices, last, ks, vs = make_paged([9, 20], ps, hkv, d, torch.float16, DEV)
    ip, lp = indptr.cpu(), last.cpu()
    w.plan(ip, indices, lp, hq, hkv, d, ps)
    bad = [
        (dict(last=torch.tensor([0, 4], dtype=torch.int32)), "last_page_len"),
        (dict(last=torch.tensor([1, 9], dtype=torch.int32)), "last_page_len"),
        (dict(ip=torch.tensor([1, 2, 5], dtype=torch.int32)), "indptr"),
        (dict(ip=torch.tensor([0, 3, 2], dtype=torch.int32)), "indptr"),
        (dict(ip=torch.tensor([0, 2, 40], dtype=torch.int32)), "indices|pages"),
        (dict(ip=torch.tensor([0, 2], dtype=torch.int32)), "indptr"),
        (dict(last=lp.long()), "last_page_len"),
    ]
    for change, name in bad:
        args = dict(ip=ip, last=lp) | change
        with pytest.raises((ValueError, TypeError), match=name):
            w.plan(args["ip"], indices, args["last"], hq, hkv, d, ps)
    neg = indices.clone()
    neg[1] = -3
    with pytest.raises(ValueError, match="indices"):
        w.plan(ip, neg, lp, hq, hkv, d, ps)
        w.run(torch.randn(cap, hq, d, device=DEV).half(), cache)  # device indices are checked at run()
    w.plan(ip, indices, lp, hq, hkv, d, ps)
    q = torch.randn(cap, hq, d, device=DEV).half()
    assert_close(w.run(q, cache), _expected(q, ks, vs)[0])


@pytest.mark.interpret
@pytest.mark.parametrize("balance", [True, False], ids=["balanced", "unbalanced"])
def test_split_chunks_evened_out(monkeypatch, balance):
    """An automatically split request gets chunks of even size (520 keys in 3 chunks: 192, 192, 136 rather
    than 256, 256, 8), both ways equal to the reference."""
    from flashinfer_triton import _decode_impl

    monkeypatch.setattr(_decode_impl, "BALANCE_CHUNKS", balance)
    ps, hq, hkv, d = 16, 2, 1, 32
    cache, indptr, indices, last, ks, vs = make_paged([520], ps, hkv, d, torch.float16, DEV)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(8 << 20, dtype=torch.uint8, device=DEV))
    w.plan(indptr, indices, last, hq, hkv, d, ps)
    p = w._w._planned["plan"]
    if p.chunk is None:
        pytest.skip("this device's split rule does not split one 520-key request")
    work = p.work.cpu()
    n, cap = p.num_work, p.work_cap
    sizes = (work[2 * cap : 2 * cap + n] - work[cap : cap + n]).tolist()
    assert sum(sizes) == 520 and len(sizes) == -(-520 // p.chunk)
    if balance:
        assert max(sizes) - min(sizes) <= p.config.block_n, sizes
    else:
        assert sizes[:-1] == [p.chunk] * (n - 1), sizes
    q = torch.randn(1, hq, d, device=DEV).half()
    out, lse = w.run(q, cache, return_lse=True)
    o_ref, lse_ref = _expected(q, ks, vs)
    assert_close(out, o_ref)
    assert_close(lse, lse_ref, 2e-3, 2e-3, name="lse")


@pytest.mark.interpret
def test_single_prefill_reuses_plan_for_same_shapes():
    """single_prefill_with_kv_cache keeps the plan of a (lengths, options) pair: a second call with new data
    reuses it and still matches the reference; other options or a custom mask plan afresh."""
    from flashinfer_triton import _wrapper

    _wrapper._SINGLE_PLANS.clear()
    hq, hkv, d = 4, 2, 32
    for i in range(3):
        q = torch.randn(5, hq, d, device=DEV).half()
        k = torch.randn(40, hkv, d, device=DEV).half()
        v = torch.randn(40, hkv, d, device=DEV).half()
        scale = 0.1 if i == 2 else None
        out = fi.single_prefill_with_kv_cache(q, k, v, causal=True, sm_scale=scale)
        o_ref, _ = R.attention(q.float(), k.float(), v.float(), causal=True, **({"sm_scale": scale} if scale else {}))
        assert_close(out, o_ref, name=f"call {i}")
        assert len(_wrapper._SINGLE_PLANS) == (1 if i < 2 else 2)
    mask = torch.rand(5, 40, device=DEV) < 0.5
    out = fi.single_prefill_with_kv_cache(q, k, v, custom_mask=mask)
    o_ref, _ = R.attention(q.float(), k.float(), v.float(), custom_mask=mask)
    assert_close(out, o_ref, name="custom mask")
    assert len(_wrapper._SINGLE_PLANS) == 2
