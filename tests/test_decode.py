"""Decode API: the wrappers against the reference and the single-request function, and the lifecycle."""

from __future__ import annotations

import pytest
import torch

import flashinfer_triton as fi
from conftest import LSE_TOL, assert_close, poison
from flashinfer_triton import reference as R
from helpers import FP8, expected_decode, make_paged

GRID = [
    # kv_lens, page_size, Hq, Hkv, D, layout, form
    ([1, 17, 97, 0], 16, 8, 8, 64, "NHD", "5d"),
    ([17, 97, 1], 5, 12, 4, 64, "HND", "tuple"),
    ([33, 0, 8], 1, 9, 3, 128, "NHD", "3d"),
    ([97, 40], 16, 32, 8, 128, "HND", "5d"),
    ([5, 64, 18], 16, 16, 2, 256, "NHD", "tuple"),
    ([20, 3], 5, 8, 1, 80, "NHD", "5d"),
]


def _ids(c):
    return f"kv{'_'.join(map(str, c[0]))}-ps{c[1]}-hq{c[2]}-hkv{c[3]}-d{c[4]}-{c[5]}-{c[6]}"


def run_decode(
    device,
    kv_lens,
    page_size,
    hq,
    hkv,
    d,
    layout,
    form,
    dtype=torch.float16,
    kv_dtype=None,
    plan_opts=None,
    run_opts=None,
    ref_opts=None,
):
    kv_dtype = kv_dtype or dtype
    cache, indptr, indices, last, ks, vs = make_paged(kv_lens, page_size, hkv, d, kv_dtype, device, layout, form)
    q = torch.randn(len(kv_lens), hq, d, device=device).to(dtype)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(32 << 20, dtype=torch.uint8, device=device), layout)
    w.plan(indptr, indices, last, hq, hkv, d, page_size, q_data_type=dtype, kv_data_type=kv_dtype, **(plan_opts or {}))
    out = poison(torch.empty_like(q))
    lse = poison(torch.empty(q.shape[:2], dtype=torch.float32, device=device))
    o, s = w.run(q, cache, out=out, lse=lse, return_lse=True, **(run_opts or {}))
    eo, es = expected_decode(q, ks, vs, **(ref_opts if ref_opts is not None else plan_opts or {}))
    return o, s, eo, es


@pytest.mark.parametrize("case", GRID, ids=_ids)
def test_batch_decode_matches_reference(device, case):
    o, s, eo, es = run_decode(device, *case)
    assert_close(o, eo)
    assert_close(s, es, *LSE_TOL, name="lse")


OPTIONS = {
    "rope": dict(pos_encoding_mode="ROPE_LLAMA", rope_scale=2.0, rope_theta=5e4),
    "alibi": dict(pos_encoding_mode="ALIBI"),
    "softcap": dict(logits_soft_cap=5.0),
    "window": dict(window_left=7),
    "smscale": dict(sm_scale=0.3),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_batch_decode_options(device, name):
    opts = OPTIONS[name]
    o, s, eo, es = run_decode(device, [1, 17, 40], 5, 12, 4, 64, "NHD", "5d", plan_opts=opts)
    assert_close(o, eo)
    assert_close(s, es, *LSE_TOL, name="lse")


def test_batch_decode_bf16(device):
    o, s, eo, es = run_decode(device, [17, 3], 16, 8, 2, 64, "NHD", "5d", dtype=torch.bfloat16)
    assert o.dtype == torch.bfloat16
    assert_close(o, eo)


@pytest.mark.skipif(FP8 is None, reason="torch without float8")
@pytest.mark.parametrize("kv_dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_batch_decode_fp8_scales(device, kv_dtype):
    kv_dtype = getattr(torch, kv_dtype)
    scales = dict(q_scale=0.5, k_scale=1.5, v_scale=0.75)
    o, s, eo, es = run_decode(
        device, [17, 9], 16, 8, 2, 64, "NHD", "5d", kv_dtype=kv_dtype, run_opts=scales, ref_opts=scales
    )
    assert_close(o, eo)
    assert_close(s, es, *LSE_TOL, name="lse")


def test_single_decode_matches_batch(device):
    hq, hkv, d = 8, 2, 64
    k = torch.randn(37, hkv, d, device=device).half()
    v = torch.randn(37, hkv, d, device=device).half()
    q = torch.randn(hq, d, device=device).half()
    o, lse = fi.single_decode_with_kv_cache(q, k, v, return_lse=True)
    eo, es = R.attention(q[None], k, v)
    assert o.shape == (hq, d) and lse.shape == (hq,)
    assert_close(o, eo[0])
    assert_close(lse, es[0], *LSE_TOL, name="lse")
    # HND layout of the same data
    o2 = fi.single_decode_with_kv_cache(q, k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous(), "HND")
    assert_close(o2, eo[0])


def test_single_decode_options_and_empty(device):
    q = torch.randn(4, 64, device=device).half()
    k = torch.randn(0, 4, 64, device=device).half()
    o, lse = fi.single_decode_with_kv_cache(q, k, k, return_lse=True)
    assert torch.equal(o.float(), torch.zeros_like(o.float()))
    assert torch.isinf(lse).all() and (lse < 0).all()
    k = torch.randn(23, 1, 64, device=device).half()
    v = torch.randn(23, 1, 64, device=device).half()
    o = fi.single_decode_with_kv_cache(q, k, v, pos_encoding_mode="ROPE_LLAMA", window_left=5, logits_soft_cap=3.0)
    eo, _ = R.attention(q[None], k, v, pos_encoding_mode="ROPE_LLAMA", window_left=5, logits_soft_cap=3.0)
    assert_close(o, eo[0])


def test_non_contiguous_q(device):
    cache, indptr, indices, last, ks, vs = make_paged([9, 30], 16, 2, 64, torch.float16, device)
    qkv = torch.randn(2, 8 + 2 * 2, 64, device=device).half()
    q = qkv[:, :8]  # a slice of a fused projection
    assert not q.is_contiguous()
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device))
    w.plan(indptr, indices, last, 8, 2, 64, 16)
    eo, _ = expected_decode(q, ks, vs)
    assert_close(w.run(q, cache), eo)


def test_plan_reused_across_layers_and_aliases(device):
    cache, indptr, indices, last, ks, vs = make_paged([12, 40, 1], 16, 2, 64, torch.float16, device)
    ws = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
    assert w._backend == "fa2"
    w.begin_forward(indptr, indices, last, 8, 2, 64, 16)
    q = torch.randn(3, 8, 64, device=device).half()
    eo, es = expected_decode(q, ks, vs)
    for _ in range(2):  # one plan, several layers
        assert_close(w.run(q, cache), eo)
    o, s = w.run_return_lse(q, cache)
    assert_close(s, es, *LSE_TOL, name="lse")
    o, s = w.forward_return_lse(q, cache)
    assert_close(o, eo)
    o = w.forward(q, cache, logits_soft_cap=4.0)  # per-call option of the deprecated API
    eo2, _ = expected_decode(q, ks, vs, logits_soft_cap=4.0)
    assert_close(o, eo2)
    w.end_forward()
    # engines share one int workspace between wrappers by assignment
    other = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    other._int_workspace_buffer = w._int_workspace_buffer
    assert other._int_workspace_buffer is w._int_workspace_buffer
    w.reset_workspace_buffer(torch.empty(1 << 20, dtype=torch.uint8, device=device), w._int_workspace_buffer)


def test_engine_plan_kwargs(device):
    cache, indptr, indices, last, ks, vs = make_paged([3, 8], 1, 2, 64, torch.float16, device, form="3d")
    w = fi.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(1 << 20, dtype=torch.uint8, device=device), use_tensor_cores=True
    )
    w.plan(
        indptr,
        indices,
        last,
        8,
        2,
        64,
        1,
        data_type=torch.float16,
        q_data_type=torch.float16,
        non_blocking=True,
        seq_lens=torch.tensor([3, 8], dtype=torch.int32),
        fixed_split_size=None,
        disable_split_kv=False,
    )
    q = torch.randn(2, 8, 64, device=device).half()
    assert_close(w.run(q, cache), expected_decode(q, ks, vs)[0])


def test_run_before_plan_raises(device):
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1024, dtype=torch.uint8, device=device))
    with pytest.raises(RuntimeError, match="plan"):
        w.run(torch.randn(1, 8, 64, device=device).half(), torch.randn(1, 2, 16, 2, 64, device=device).half())


def test_cuda_graph_wrapper_buffers(device):
    """CUDA-graph mode on any device: plan() writes the page table into the caller's buffers."""
    bs, max_pages = 3, 16
    ind_buf = torch.zeros(bs + 1, dtype=torch.int32, device=device)
    idx_buf = torch.zeros(max_pages, dtype=torch.int32, device=device)
    last_buf = torch.zeros(bs, dtype=torch.int32, device=device)
    w = fi.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(
        torch.empty(1 << 20, dtype=torch.uint8, device=device), ind_buf, idx_buf, last_buf
    )
    assert w.is_cuda_graph_enabled
    for lens in ([5, 40, 1], [33, 2, 17]):
        cache, indptr, indices, last, ks, vs = make_paged(lens, 16, 2, 64, torch.float16, device, spare_pages=4)
        w.plan(indptr, indices, last, 8, 2, 64, 16)
        assert torch.equal(ind_buf.cpu(), indptr.cpu())
        assert torch.equal(idx_buf[: indices.numel()].cpu(), indices.cpu())
        assert torch.equal(last_buf.cpu(), last.cpu())
        q = torch.randn(bs, 8, 64, device=device).half()
        assert_close(w.run(q, cache), expected_decode(q, ks, vs)[0])
    with pytest.raises(ValueError, match="indptr"):
        w.plan(
            torch.tensor([0, 1], dtype=torch.int32),
            torch.tensor([0], dtype=torch.int32),
            torch.tensor([1], dtype=torch.int32),
            8,
            2,
            64,
            16,
        )
    with pytest.raises(ValueError, match="paged_kv_indptr_buffer"):
        fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8, device=device), use_cuda_graph=True)


@pytest.mark.interpret
@pytest.mark.parametrize("case", [GRID[0], GRID[2]], ids=_ids)
def test_batch_decode_kernels_through_api(device, case):
    """The public wrapper on the Triton kernels (interpreter on CPU, real GPU on CUDA)."""
    o, s, eo, es = run_decode(device, *case)
    assert_close(o, eo)
    assert_close(s, es, *LSE_TOL, name="lse")


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as a view of stride 2 into a larger tensor whose other entries are random."""
    big = torch.randint(0, 1 << 20, (2 * t.numel(),), dtype=t.dtype, device=t.device)
    big[::2] = t
    return big[::2]


@pytest.mark.interpret
def test_plan_of_strided_index_views(device):
    """A page table given as strided views (every other entry of larger tensors) plans the batch it shows."""
    cache, indptr, indices, last, ks, vs = make_paged([17, 0, 33], 16, 2, 64, torch.float16, device)
    q = torch.randn(3, 8, 64, device=device).half()
    eo, es = expected_decode(q, ks, vs)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device))
    w.plan(_strided(indptr), _strided(indices.to(device)), _strided(last), 8, 2, 64, 16)
    o, s = w.run(q, cache, out=poison(torch.empty_like(q)), return_lse=True)
    assert_close(o, eo)
    assert_close(s, es, *LSE_TOL, name="lse")


def test_failed_plan_leaves_forward_the_previous_batch(device):
    """A plan() that raises leaves the wrapper's previous plan whole, the arguments forward() re-plans from
    included."""
    cache, indptr, indices, last, ks, vs = make_paged([17, 5], 16, 2, 64, torch.float16, device)
    q = torch.randn(2, 8, 64, device=device).half()
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device))
    w.plan(indptr, indices, last, 8, 2, 64, 16)
    with pytest.raises(ValueError, match="last_page_len"):
        w.plan(indptr, indices, torch.zeros_like(last), 8, 2, 64, 16)
    eo, _ = expected_decode(q, ks, vs, sm_scale=0.05)
    assert_close(w.forward(q, cache, sm_scale=0.05), eo)


def test_block_table_plan_equals_csr_plan(device):
    """A 2-D block table with seq_lens (FlashAttention-style engines) gives the CSR plan's results."""
    cache, indptr, indices, last, ks, vs = make_paged([17, 0, 33], 16, 2, 64, torch.float16, device)
    seq_lens = torch.tensor([17, 0, 33], dtype=torch.int32)
    table = torch.full((3, 4), -1, dtype=torch.int32)  # unused entries may hold anything
    for b in range(3):
        row = indices[int(indptr[b]) : int(indptr[b + 1])].cpu()
        table[b, : row.numel()] = row
    q = torch.randn(3, 8, 64, device=device).half()
    ws = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    a = fi.BatchDecodeWithPagedKVCacheWrapper(ws)
    a.plan(indptr, indices, last, 8, 2, 64, 16)
    b = fi.BatchDecodeWithPagedKVCacheWrapper(ws)
    b.plan(None, None, None, 8, 2, 64, 16, block_tables=table, seq_lens=seq_lens)
    assert torch.equal(a.run(q, cache), b.run(q, cache))
    with pytest.raises(ValueError, match="seq_lens"):
        b.plan(None, None, None, 8, 2, 64, 16, block_tables=table)
    with pytest.raises(ValueError, match="seq_lens"):
        b.plan(
            None, None, None, 8, 2, 64, 16, block_tables=table, seq_lens=torch.tensor([17, 0, 70], dtype=torch.int32)
        )


@pytest.mark.parametrize("case", GRID[:3], ids=_ids)
def test_batch_decode_equals_single_decode(device, case):
    kv_lens, page_size, hq, hkv, d, layout, form = case
    cache, indptr, indices, last, ks, vs = make_paged(kv_lens, page_size, hkv, d, torch.float16, device, layout, form)
    q = torch.randn(len(kv_lens), hq, d, device=device).half()
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device), layout)
    w.plan(indptr, indices, last, hq, hkv, d, page_size)
    o, s = w.run(q, cache, return_lse=True)
    for b in range(len(kv_lens)):
        ob, sb = fi.single_decode_with_kv_cache(q[b], ks[b], vs[b], return_lse=True)
        assert_close(o[b], ob, name=f"request {b}")
        assert_close(s[b], sb, *LSE_TOL, name=f"lse of request {b}")


# ----------------------------------------------------------------------------- CUDA-graph re-plans, the options memo


@pytest.mark.interpret
def test_decode_graph_replan_fused_merge_keeps_addresses(device):
    """CUDA-graph decode wrapper re-planned with other lengths (a request with 0 keys, one with 1 chunk,
    many chunks, then all short): results match, arrival counters end at 0, and every device address the
    decode launch reads (work list, counters, partial states, staged arrays, page indices) stays the same."""
    cap, ps, hq, hkv, d = 4, 8, 2, 1, 32
    ind_buf = torch.zeros(cap + 1, dtype=torch.int32, device=device)
    idx_buf = torch.zeros(64, dtype=torch.int32, device=device)
    last_buf = torch.zeros(cap, dtype=torch.int32, device=device)
    w = fi.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(
        torch.empty(8 << 20, dtype=torch.uint8, device=device), ind_buf, idx_buf, last_buf
    )
    addrs = set()
    for lens in ([70, 0, 5, 33], [3, 90, 0, 0], [0, 0, 0, 1]):
        cache, indptr, indices, last, ks, vs = make_paged(lens, ps, hkv, d, torch.float16, device, spare_pages=1)
        w.plan(indptr, indices, last, hq, hkv, d, ps, fixed_split_size=2)
        assert torch.equal(ind_buf, indptr) and torch.equal(last_buf, last)
        assert torch.equal(idx_buf[: indices.numel()], indices)
        info = w.plan_info()
        assert info.cuda_graph and info.details["fused"]
        names = ("work", "counters", "part_o", "part_lse", "work_indptr", "num_work_dev", "kv_indptr", "kv_lens",
                 "kv_indices")  # fmt: skip
        addrs.add(tuple(info.addresses[name] for name in names))
        q = torch.randn(cap, hq, d, device=device).half()
        out, lse = w.run(q, cache, return_lse=True)
        o_ref, lse_ref = expected_decode(q, ks, vs)
        assert_close(out, o_ref, name=f"out {lens}")
        nonempty = torch.tensor(lens, device=device) > 0
        assert_close(lse[nonempty], lse_ref[nonempty], 2e-3, 2e-3, name=f"lse {lens}")
        assert int(w.plan_info().arrays["counters"].abs().sum()) == 0
    assert len(addrs) == 1, addrs


@pytest.mark.interpret
def test_plan_memo_follows_option_changes(device):
    """plan() reuses checked options only for identical arguments: ALiBi -> none -> another sm_scale ->
    soft cap on one wrapper each give the reference's result."""
    lens, ps, hq, hkv, d = [9, 20], 8, 4, 2, 32
    cache, indptr, indices, last, ks, vs = make_paged(lens, ps, hkv, d, torch.float16, device)
    q = torch.randn(2, hq, d, device=device).half()
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device))
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
        o_ref, _ = expected_decode(q, ks, vs, **ref_kw)
        assert_close(w.run(q, cache), o_ref, name=f"out {kw}")


def test_plan_memo_still_rejects_bad_types(device):
    """An argument equal to the memo's but of a rejected type (num_qo_heads=4.0 after 4) still raises."""
    cache, indptr, indices, last, ks, vs = make_paged([9, 20], 8, 2, 32, torch.float16, device)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device))
    with pytest.raises(ValueError, match="num_qo_heads"):
        w.plan(indptr, indices, last, 4.0, 2, 32, 8)
    w.plan(indptr, indices, last, 4, 2, 32, 8)
    with pytest.raises(ValueError, match="num_qo_heads"):
        w.plan(indptr, indices, last, 4.0, 2, 32, 8)
