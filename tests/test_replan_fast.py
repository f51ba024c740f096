"""Decode re-plans (an engine's per-step ``plan()`` with unchanged options): one planning path for a first plan
and every re-plan, so a re-plan leaves what a first plan of the same table leaves on a fresh wrapper, keeps
the checked options (and in CUDA-graph mode every address), gives the reference's results, and raises the
same errors for bad tables."""

from __future__ import annotations

import pytest
import torch

import flashinfer_triton as fi
from conftest import DEVICE as DEV
from conftest import assert_close, poison
from flashinfer_triton import _config
from flashinfer_triton import decode as dmod
from flashinfer_triton import reference as R
from helpers import expected_decode as _expected
from helpers import make_paged


@pytest.fixture
def host_path(request):
    """The host-path configuration the test is parametrized with (indirect), in effect for the whole test."""
    with _config.using(host_path=request.param):
        yield request.param


@pytest.fixture
def spy(monkeypatch):
    """For each plan() after a wrapper's first: whether it kept the previous plan's checked options (the same
    object: no option was checked again) and, in CUDA-graph mode, its plan object (the same layout and
    addresses). False for a plan() that raised."""
    hits = []
    orig = dmod._DecodeCore.plan

    def wrapped(self, **kw):
        prev = self.plan_info()
        try:
            orig(self, **kw)
        except Exception:
            hits.append(False)
            raise
        if prev is not None:
            now = self.plan_info()
            hits.append(now.options is prev.options and (not self._use_cuda_graph or now.plan_id == prev.plan_id))

    monkeypatch.setattr(dmod._DecodeCore, "plan", wrapped)
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
def test_replan_matches_reference(spy, split):
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
        a = w.plan_info().addresses
        addrs.add((a["work"], a["kv_indptr"], a["kv_lens"], a["kv_indices"]))
        q = torch.randn(cap, hq, d, device=DEV).half()
        out = poison(torch.empty(cap, hq, d, device=DEV, dtype=torch.float16))
        lse = poison(torch.empty(cap, hq, device=DEV))
        w.run(q, cache, out=out, lse=lse)
        o_ref, lse_ref = _expected(q, ks, vs, window_left=40)
        assert_close(out, o_ref, name=f"out {lens}")
        nonempty = torch.tensor(lens, device=DEV) > 0
        assert_close(lse[nonempty], lse_ref[nonempty], 2e-3, 2e-3, name=f"lse {lens}")
        counters = w.plan_info().arrays.get("counters")
        if counters is not None:
            assert int(counters.abs().sum()) == 0
    assert spy == [True] * (len(runs) - 1)  # every plan() after the first kept the options and the layout
    assert len(addrs) == 1, addrs


@pytest.mark.interpret
def test_replan_follows_option_and_workspace_changes(spy):
    """Other options (sm_scale, soft cap) are checked anew and a swapped workspace gets a new layout, with the
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
def test_graph_replan_rejects_bad_tables():
    """After a plan, bad tables raise errors naming the argument (the one validation of every plan) and the
    next good plan works."""
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
        (dict(last=lp.float()), "last_page_len"),  # (int64 tables are accepted, as FlashInfer's)
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
def test_split_chunks_evened_out():
    """An automatically split request gets chunks of even size (520 keys in 3 chunks: 192, 192, 136 rather
    than 256, 256, 8), equal to the reference."""
    ps, hq, hkv, d = 16, 2, 1, 32
    cache, indptr, indices, last, ks, vs = make_paged([520], ps, hkv, d, torch.float16, DEV)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(8 << 20, dtype=torch.uint8, device=DEV))
    w.plan(indptr, indices, last, hq, hkv, d, ps)
    info = w.plan_info()
    chunk = info.details["chunk"]
    if chunk is None:
        pytest.skip("this device's split rule does not split one 520-key request")
    work = info.arrays["work"]
    n, cap = info.details["num_work"], info.details["work_cap"]
    sizes = (work[2 * cap : 2 * cap + n] - work[cap : cap + n]).tolist()
    assert sum(sizes) == 520 and len(sizes) == -(-520 // chunk)
    assert max(sizes) - min(sizes) <= info.config.block_n, sizes
    q = torch.randn(1, hq, d, device=DEV).half()
    out, lse = w.run(q, cache, return_lse=True)
    o_ref, lse_ref = _expected(q, ks, vs)
    assert_close(out, o_ref)
    assert_close(lse, lse_ref, 2e-3, 2e-3, name="lse")


@pytest.mark.interpret
def test_single_prefill_reuses_plan_for_same_shapes():
    """single_prefill_with_kv_cache keeps the plan of a (lengths, options) pair: a second call with new data
    reuses it and still matches the reference; other options or a custom mask plan afresh."""
    fi.clear_host_caches("single_plans")
    hq, hkv, d = 4, 2, 32
    for i in range(3):
        q = torch.randn(5, hq, d, device=DEV).half()
        k = torch.randn(40, hkv, d, device=DEV).half()
        v = torch.randn(40, hkv, d, device=DEV).half()
        scale = 0.1 if i == 2 else None
        out = fi.single_prefill_with_kv_cache(q, k, v, causal=True, sm_scale=scale)
        o_ref, _ = R.attention(q.float(), k.float(), v.float(), causal=True, **({"sm_scale": scale} if scale else {}))
        assert_close(out, o_ref, name=f"call {i}")
        assert len(fi.host_caches()["single_plans"]) == (1 if i < 2 else 2)
    mask = torch.rand(5, 40, device=DEV) < 0.5
    out = fi.single_prefill_with_kv_cache(q, k, v, custom_mask=mask)
    o_ref, _ = R.attention(q.float(), k.float(), v.float(), custom_mask=mask)
    assert_close(out, o_ref, name="custom mask")
    assert len(fi.host_caches()["single_plans"]) == 2


def _state(w):
    """Everything a plan leaves for run(), as host values (device arrays read back)."""
    info = w.plan_info()
    a, d = info.arrays, info.details

    def arr(name):
        return a[name].tolist() if name in a else None

    def buf(name):  # a partial-state buffer: its shape and address
        return (tuple(a[name].shape), info.addresses[name]) if name in a else None

    mpi = info.max_page_index
    return dict(
        opts=info.options,
        total_q=info.total_q,
        # an int, or (device page indices) a pending / deferred range: compared by its resolved maximum
        max_page_index=mpi if type(mpi) is int else mpi.value()[1],
        batch=(
            info.batch_size,
            arr("qo_indptr"),
            arr("kv_indptr"),
            a["kv_indices"][: int(a["kv_indptr_host"][-1])].tolist(),  # CUDA-graph mode: the whole caller buffer
            arr("kv_lens"),
            arr("qo_indptr_host"),
            arr("kv_lens_host"),
            arr("kv_indptr_host"),
            arr("alibi_slopes"),
        ),
        plan=(
            arr("work"),
            d["work_cap"],
            d["batch_cap"],
            d["num_work"],
            arr("work_indptr"),
            arr("num_work_dev"),
            d["needs_merge"],
            buf("part_o"),
            buf("part_lse"),
            arr("rope_freq"),
            info.config,
            d["chunk"],
            d["graph"],
            d["max_chunks"],
            arr("counters"),
            d["fused"],
            d["merge_block_k"],
            d["group_p2"],
        ),
    )


EAGER_CASES = {
    "default": dict(),
    "window": dict(window_left=40),
    "fixed-split": dict(fixed_split_size=2),
    "rope": dict(pos_encoding_mode="ROPE_LLAMA", rope_theta=1e3),
    "alibi-softcap": dict(pos_encoding_mode="ALIBI", logits_soft_cap=20.0),
    "no-split-bf16": dict(disable_split_kv=True, q_data_type=torch.bfloat16),
}


@pytest.mark.interpret
@pytest.mark.parametrize("case", list(EAGER_CASES), ids=list(EAGER_CASES))
def test_eager_replan_equals_first_plan(spy, case):
    """A re-plan with the options of the previous plan() leaves exactly what a first plan leaves on a fresh
    wrapper: same batch arrays (device and host), work list, split and merge settings."""
    opts = EAGER_CASES[case]
    ps, hq, hkv, d = 16, 4, 1, 32
    ws = torch.empty(8 << 20, dtype=torch.uint8, device=DEV)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(ws)
    tables = ([5, 700, 0, 33], [520, 3, 0, 77, 16], [1], [0, 0], [300] * 3)
    for i, lens in enumerate(tables):
        _, indptr, indices, last, _, _ = make_paged(lens, ps, hkv, d, torch.float16, DEV, spare_pages=1)
        if i % 2:  # page table on the host
            indptr, indices, last = indptr.cpu(), indices.cpu(), last.cpu()
        w.plan(indptr, indices, last, hq, hkv, d, ps, **opts)
        ref = fi.BatchDecodeWithPagedKVCacheWrapper(ws)
        ref.plan(indptr, indices, last, hq, hkv, d, ps, **opts)
        got, want = _state(w), _state(ref)
        for k in want:
            assert got[k] == want[k], f"table {i} ({lens}): {k} differs"
    assert spy == [True] * (len(tables) - 1)


@pytest.mark.interpret
def test_eager_replan_results(spy):
    """Outputs after re-plans (host and device page tables, a split request, an empty one) equal the
    reference; the staged arrays start on 16-byte boundaries (one kernel variant whatever the batch size)."""
    ps, hq, hkv, d = 8, 4, 2, 32
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(8 << 20, dtype=torch.uint8, device=DEV))
    for i, lens in enumerate(([40, 9], [300, 0, 17], [1, 2, 3, 4, 5])):
        cache, indptr, indices, last, ks, vs = make_paged(lens, ps, hkv, d, torch.float16, DEV)
        if i == 1:
            indptr, indices, last = indptr.cpu(), indices.cpu(), last.cpu()
        w.plan(indptr, indices, last, hq, hkv, d, ps, window_left=100)
        a = w.plan_info().addresses
        for name in ("qo_indptr", "kv_indptr", "kv_lens", "work"):
            assert a[name] % 16 == 0, name
        q = torch.randn(len(lens), hq, d, device=DEV).half()
        out = poison(torch.empty_like(q))
        w.run(q, cache, out=out)
        assert_close(out, _expected(q, ks, vs, window_left=100)[0], name=f"out {lens}")
    assert spy == [True, True]


@pytest.mark.interpret
def test_eager_replan_rejects_bad_tables():
    """After an eager plan, bad tables raise errors naming the argument; a good plan afterwards works."""
    ps, hq, hkv, d = 8, 2, 1, 32
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(8 << 20, dtype=torch.uint8, device=DEV))
    cache, indptr, indices, last, ks, vs = make_paged([9, 20], ps, hkv, d, torch.float16, DEV)
    ip, ix, lp = indptr.cpu(), indices.cpu(), last.cpu()
    w.plan(ip, ix, lp, hq, hkv, d, ps)
    neg = ix.clone()
    neg[2] = -1
    bad = [
        (dict(lp=torch.tensor([0, 4], dtype=torch.int32)), "last_page_len"),
        (dict(lp=torch.tensor([1, 9], dtype=torch.int32)), "last_page_len"),
        (dict(lp=torch.tensor([1], dtype=torch.int32)), "last_page_len"),
        (dict(ip=torch.tensor([1, 2, 5], dtype=torch.int32)), "indptr"),
        (dict(ip=torch.tensor([0, 3, 2], dtype=torch.int32)), "indptr"),
        (dict(ip=torch.tensor([0, 2, 40], dtype=torch.int32)), "indices"),
        (dict(ip=ip.float()), "indptr"),  # (int64 tables are accepted, as FlashInfer's)
        (dict(ix=neg), "indices"),
        (dict(ix=ix.float()), "indices"),
    ]
    for change, name in bad:
        args = dict(ip=ip, ix=ix, lp=lp) | change
        with pytest.raises((ValueError, TypeError), match=name):
            w.plan(args["ip"], args["ix"], args["lp"], hq, hkv, d, ps)
    w.plan(ip, ix, lp, hq, hkv, d, ps)
    q = torch.randn(2, hq, d, device=DEV).half()
    assert_close(w.run(q, cache), _expected(q, ks, vs)[0])


@pytest.mark.interpret
def test_graph_replan_equals_first_plan(spy):
    """CUDA-graph mode: after a re-plan the stage, the work list and the caller's buffers hold what a first
    plan of the same table writes (compared on a second wrapper that plans it first)."""
    cap, ps, hq, hkv, d = 3, 8, 4, 1, 32
    w, bufs = _graph_wrapper(cap, 64)
    runs = ([70, 0, 5], [3, 400, 1], [0, 0, 0], [17, 16, 8])
    for lens in runs:
        _, indptr, indices, last, _, _ = make_paged(lens, ps, hkv, d, torch.float16, DEV, spare_pages=1)
        w.plan(indptr.cpu(), indices, last.cpu(), hq, hkv, d, ps, window_left=200)
        ref, ref_bufs = _graph_wrapper(cap, 64)
        ref.plan(indptr.cpu(), indices, last.cpu(), hq, hkv, d, ps, window_left=200)
        got, want = _state(w), _state(ref)
        for k in want:
            if k != "plan":
                assert got[k] == want[k], f"{lens}: {k} differs"
        assert got["plan"][0] == want["plan"][0] and got["plan"][3] == want["plan"][3], f"{lens}: work list"
        for mine, theirs in zip(bufs, ref_bufs):
            assert torch.equal(mine[: indices.numel()].cpu(), theirs[: indices.numel()].cpu())
    assert spy == [True] * (len(runs) - 1)


def _gpu_only():
    return pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@_gpu_only()
@pytest.mark.parametrize(
    "host_path",
    [_config.HostPathConfig(graph_page_range=m) for m in ("lazy", "plan")],
    ids=["lazy", "plan"],
    indirect=True,
)
def test_graph_replan_device_page_range(spy, host_path):
    """CUDA-graph re-plans with the page indices in the device buffer: while no eager run() reads the range
    ("lazy") the re-plan queues no reduction; an eager run() still rejects an out-of-range or negative page
    before writing anything, and accepts good pages."""
    from flashinfer_triton import _wrapper

    mode = host_path.graph_page_range
    cap, ps, hq, hkv, d = 2, 8, 2, 1, 32
    w, (_, idx_buf, _) = _graph_wrapper(cap, 16)
    cache, indptr, indices, last, ks, vs = make_paged([9, 20], ps, hkv, d, torch.float16, DEV)
    n = indices.numel()
    idx_buf[:n].copy_(indices)
    q = torch.randn(cap, hq, d, device=DEV).half()

    def plan():
        w.plan(indptr.cpu(), idx_buf[:n], last.cpu(), hq, hkv, d, ps)
        return w.plan_info().max_page_index

    plan()
    assert_close(w.run(q, cache), _expected(q, ks, vs)[0])  # the eager run reads the range
    assert type(plan()) is _wrapper.PendingPageRange  # read since: reduced at plan()
    deferred = plan()  # unread since: deferred ("lazy")
    assert type(deferred) is (_wrapper.DeferredPageRange if mode == "lazy" else _wrapper.PendingPageRange)
    for bad, msg in ((cache.shape[0], "paged_kv_indices"), (-2, "non-negative")):
        idx_buf[1] = bad
        plan()
        assert type(plan()) is type(deferred)  # deferred again one plan after a run() that read the range
        out = poison(torch.empty_like(q))
        with pytest.raises(ValueError, match=msg):
            w.run(q, cache, out=out)
        assert out.isnan().all()
        idx_buf[:n].copy_(indices)
    plan()
    plan()
    assert_close(w.run(q, cache), _expected(q, ks, vs)[0])
    assert all(spy[1:])


@pytest.mark.gpu
@_gpu_only()
@pytest.mark.parametrize(
    "host_path",
    [_config.HostPathConfig(device_index_read=n) for n in (1 << 14, 0)],
    ids=["indices-read-back", "indices-reduced"],
    indirect=True,
)
def test_eager_replan_device_tables_page_range(spy, host_path):
    """Eager plans with the whole page table on the device: the page range comes back with the
    lengths (an int: the indices read back, or their min/max reduced on the device when the indices tensor
    is exactly the table), else pending; every form is checked."""
    read = host_path.device_index_read
    ps, hq, hkv, d = 8, 2, 1, 32
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(8 << 20, dtype=torch.uint8, device=DEV))
    cache, indptr, indices, last, ks, vs = make_paged([9, 20], ps, hkv, d, torch.float16, DEV)
    q = torch.randn(2, hq, d, device=DEV).half()
    w.plan(indptr, indices, last, hq, hkv, d, ps)  # the indices (or their range) read back with the lengths
    assert type(w.plan_info().max_page_index) is int
    for longer in (False, True):
        ix = torch.cat([indices, indices.new_full((3,), 10**6)]) if longer else indices
        w.plan(indptr, ix, last, hq, hkv, d, ps)
        assert (type(w.plan_info().max_page_index) is int) == (bool(read) or not longer)
        assert_close(w.run(q, cache), _expected(q, ks, vs)[0])
        for bad, msg in ((cache.shape[0], "paged_kv_indices"), (-1, "non-negative|indices")):
            ix2 = ix.clone()
            ix2[0] = bad
            out = poison(torch.empty_like(q))
            with pytest.raises(ValueError, match=msg):
                w.plan(indptr, ix2, last, hq, hkv, d, ps)
                w.run(q, cache, out=out)
            assert out.isnan().all()
    assert spy[0] is True


@pytest.mark.interpret
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda-graph"])
def test_replan_with_seq_lens(spy, graph):
    """Engines that pass seq_lens every step keep the re-plan's options when it agrees with the table (host
    int32 or int64), with a first plan's result; a disagreeing seq_lens raises an error naming it."""
    ps, hq, hkv, d = 8, 2, 1, 32
    if graph:
        w, _ = _graph_wrapper(3, 64)
    else:
        w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(8 << 20, dtype=torch.uint8, device=DEV))
    for i, lens in enumerate(([9, 20, 1], [30, 0, 17], [64, 8, 3])):
        cache, indptr, indices, last, ks, vs = make_paged(lens, ps, hkv, d, torch.float16, DEV)
        seq = torch.tensor(lens, dtype=torch.int64 if i % 2 else torch.int32)
        w.plan(indptr.cpu(), indices, last.cpu(), hq, hkv, d, ps, seq_lens=seq)
        ref = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(8 << 20, dtype=torch.uint8, device=DEV))
        ref.plan(indptr.cpu(), indices, last.cpu(), hq, hkv, d, ps)
        assert _state(w)["batch"][4:7] == _state(ref)["batch"][4:7]
        q = torch.randn(3, hq, d, device=DEV).half()
        assert_close(w.run(q, cache), _expected(q, ks, vs)[0], name=f"out {lens}")
    assert spy == [True, True]
    with pytest.raises(ValueError, match="seq_lens"):
        w.plan(indptr.cpu(), indices, last.cpu(), hq, hkv, d, ps, seq_lens=seq + 1)
    assert spy[-1] is False


@pytest.mark.interpret
def test_replan_with_block_tables(spy):
    """Block tables (FlashAttention-style engines) re-planned with the same options keep them after their
    conversion to CSR, with the CSR plan's state and results."""
    ps, hq, hkv, d = 16, 4, 2, 32
    ws = torch.empty(8 << 20, dtype=torch.uint8, device=DEV)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(ws)
    for lens in ([17, 0, 33], [40, 5, 1]):
        cache, indptr, indices, last, ks, vs = make_paged(lens, ps, hkv, d, torch.float16, DEV)
        table = torch.full((3, 4), -1, dtype=torch.int32)
        for b in range(3):
            row = indices[int(indptr[b]) : int(indptr[b + 1])].cpu()
            table[b, : row.numel()] = row
        w.plan(None, None, None, hq, hkv, d, ps, block_tables=table, seq_lens=torch.tensor(lens, dtype=torch.int32))
        ref = fi.BatchDecodeWithPagedKVCacheWrapper(ws)
        ref.plan(indptr, indices, last, hq, hkv, d, ps)
        assert _state(w)["batch"] == _state(ref)["batch"]
        q = torch.randn(3, hq, d, device=DEV).half()
        assert_close(w.run(q, cache), _expected(q, ks, vs)[0], name=f"out {lens}")
    assert spy == [True]
