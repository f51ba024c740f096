"""FlashInfer 0.2's and 0.7's call forms of every entry point whose positional order differs between them.

Each case calls the library three ways (FlashInfer 0.2's positional order, 0.7's positional order, keywords)
and compares each result with the float32 reference, so an argument landing in the wrong parameter fails.
CPU tensors: the PyTorch path.
"""

from __future__ import annotations

import math

import pytest
import torch

import flashinfer_triton as fi
from flashinfer_triton import reference as R
from helpers import i32, make_paged

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

DT = torch.float16
ATOL = 2e-2


def close(got, expected, what):
    got, expected = got.float(), expected.float()
    assert not torch.isnan(got).any(), f"{what}: NaN in the result"
    err = (got - expected).abs()
    worst = int(err.argmax())
    assert err.max() <= ATOL, f"{what}: max error {float(err.max()):.3g} at flat index {worst}"


def _qkv(qo_len=5, kv_len=11, hq=4, hkv=2, d=32):
    torch.manual_seed(qo_len * 100 + kv_len)
    q = torch.randn(qo_len, hq, d, dtype=DT)
    k = torch.randn(kv_len, hkv, d, dtype=DT)
    v = torch.randn(kv_len, hkv, d, dtype=DT)
    return q, k, v


# ----------------------------------------------------------------------------- single prefill
def test_single_prefill_generations():
    q, k, v = _qkv()
    mask = torch.rand(5, 11) > 0.4
    mask[:, 0] = True
    exp, exp_lse = R.single_prefill_with_kv_cache(q, k, v, custom_mask=mask, sm_scale=0.3, return_lse=True)
    # 0.2: q, k, v, custom_mask, packed_custom_mask, causal, kv_layout, pos_encoding_mode,
    #      allow_fp16_qk_reduction, sm_scale, window_left, logits_soft_cap, rope_scale, rope_theta, return_lse
    o02, lse02 = fi.single_prefill_with_kv_cache(
        q, k, v, mask, None, False, "NHD", "NONE", False, 0.3, -1, None, None, None, True
    )
    # 0.7: q, k, v, scale_q, scale_k, scale_v, o_dtype, custom_mask, packed_custom_mask, causal, kv_layout,
    #      pos_encoding_mode, use_fp16_qk_reduction, sm_scale, window_left, logits_soft_cap, rope_scale,
    #      rope_theta, backend, return_lse
    o07, lse07 = fi.single_prefill_with_kv_cache(
        q,
        k,
        v,
        None,
        None,
        None,
        None,
        mask,
        None,
        False,
        "NHD",
        "NONE",
        False,
        0.3,
        -1,
        None,
        None,
        None,
        "auto",
        True,
    )
    okw, lsekw = fi.single_prefill_with_kv_cache(q, k, v, custom_mask=mask, sm_scale=0.3, return_lse=True)
    for name, o, lse in (("0.2", o02, lse02), ("0.7", o07, lse07), ("keywords", okw, lsekw)):
        close(o, exp, f"{name} o")
        close(lse, exp_lse, f"{name} lse")


def test_single_prefill_02_causal_positional():
    """0.2's ``(q, k, v, None, None, True)``: the bool lands in 0.7's scale_v slot, so the call is 0.2's."""
    q, k, v = _qkv()
    exp = R.single_prefill_with_kv_cache(q, k, v, causal=True)
    close(fi.single_prefill_with_kv_cache(q, k, v, None, None, True), exp, "causal")
    close(fi.single_prefill_with_kv_cache_return_lse(q, k, v, None, None, True)[0], exp, "return_lse partial")


def test_single_prefill_07_scales_and_o_dtype():
    """0.7's scale_q / scale_k / scale_v (numbers and per-head tensors) and o_dtype at positions 4-7."""
    q, k, v = _qkv()
    sq = torch.rand(4) + 0.5
    sk = torch.rand(2) + 0.5
    sv = torch.rand(2) + 0.5
    group = 2
    qs = (q.float() * (sq * sk.repeat_interleave(group))[None, :, None]).to(DT)
    exp = R.single_prefill_with_kv_cache(qs, k, v, causal=True) * sv.repeat_interleave(group)[None, :, None]
    o = fi.single_prefill_with_kv_cache(q, k, v, sq, sk, sv, torch.float32, None, None, True)
    assert o.dtype == torch.float32
    close(o, exp, "per-head scales")
    exp2 = R.single_prefill_with_kv_cache(q, k, v, causal=True, k_scale=0.5 * 0.7, v_scale=1.5)
    close(fi.single_prefill_with_kv_cache(q, k, v, 0.5, 0.7, 1.5, None, None, None, True), exp2, "scalar scales")


def test_single_prefill_lse_base_ln():
    q, k, v = _qkv()
    _, lse2 = fi.single_prefill_with_kv_cache(q, k, v, return_lse=True)
    _, lse_e = fi.single_prefill_with_kv_cache(q, k, v, return_lse=True, lse_base="ln")
    close(lse_e, lse2 * math.log(2), "natural-log lse")


# ----------------------------------------------------------------------------- batch decode
def _decode_setup(kv_lens=(9, 1, 23), page_size=4, hq=4, hkv=2, d=32):
    torch.manual_seed(7)
    cache, indptr, indices, last, ks, vs = make_paged(list(kv_lens), page_size, hkv, d, DT, "cpu")
    q = torch.randn(len(kv_lens), hq, d, dtype=DT)
    return cache, indptr, indices, last, q


def _decode_ref(q, cache, indptr, indices, last, **opts):
    o, lse = R.batch_decode_with_paged_kv_cache(q, cache, indptr, indices, last, **opts)
    return o, lse


@pytest.mark.parametrize("form", ["v02", "v02-fp8-data_type", "v07", "keywords"])
def test_decode_plan_generations(form):
    cache, indptr, indices, last, q = _decode_setup()
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    head = (indptr, indices, last, 4, 2, 32, 4)
    if form == "v02":
        # 0.2: ..., pos_encoding_mode, window_left, logits_soft_cap, q_data_type, kv_data_type, data_type,
        #      sm_scale, rope_scale, rope_theta, non_blocking
        w.plan(*head, "NONE", 6, 5.0, DT, DT, DT, 0.2, None, None, False)
    elif form == "v02-fp8-data_type":
        # 13th positional fp8: 0.2's data_type (an output dtype is never fp8), here with sm_scale after it
        w.plan(*head, "NONE", 6, 5.0, DT, None, torch.float8_e4m3fn, 0.2)
        cache = cache.to(torch.float8_e4m3fn)
    elif form == "v07":
        # 0.7: ..., q_data_type, kv_data_type, o_data_type, data_type, sm_scale, rope_scale, rope_theta,
        #      non_blocking, block_tables, seq_lens, fixed_split_size, disable_split_kv, q_len_per_req
        w.plan(*head, "NONE", 6, 5.0, DT, DT, torch.float32, None, 0.2, None, None, False, None, None, None, False, 1)
    else:
        w.plan(*head, window_left=6, logits_soft_cap=5.0, q_data_type=DT, sm_scale=0.2)
    exp, exp_lse = _decode_ref(q, cache, indptr, indices, last, window_left=6, logits_soft_cap=5.0, sm_scale=0.2)
    o, lse = w.run(q, cache, return_lse=True)
    assert o.dtype == (torch.float32 if form == "v07" else DT)
    close(o, exp, form)
    close(lse, exp_lse, form + " lse")


def test_decode_forward_window_left_positional():
    """forward(q, cache, pos_encoding_mode, q_scale, k_scale, v_scale, window_left, logits_soft_cap, ...)."""
    cache, indptr, indices, last, q = _decode_setup()
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    w.begin_forward(indptr, indices, last, 4, 2, 32, 4)
    exp, _ = _decode_ref(q, cache, indptr, indices, last, window_left=3, logits_soft_cap=4.0)
    close(w.forward(q, cache, "NONE", None, None, None, 3, 4.0), exp, "forward")
    o, lse = w.forward_return_lse(q, cache, "NONE", None, None, None, 3, 4.0)
    close(o, exp, "forward_return_lse")


# ----------------------------------------------------------------------------- batch prefill (paged, ragged)
def _prefill_setup(hq=4, hkv=2, d=32, page_size=4):
    torch.manual_seed(11)
    kv_lens, qo_lens = [9, 14], [3, 5]
    cache, indptr, indices, last, _, _ = make_paged(kv_lens, page_size, hkv, d, DT, "cpu")
    qo_indptr = i32(0, 3, 8)
    q = torch.randn(8, hq, d, dtype=DT)
    mask = torch.rand(sum(a * b for a, b in zip(qo_lens, kv_lens))) > 0.3
    return cache, indptr, indices, last, qo_indptr, q, mask


@pytest.mark.parametrize("form", ["v02-mask", "v02-causal", "v07", "keywords"])
def test_paged_prefill_plan_generations(form):
    cache, indptr, indices, last, qo_indptr, q, mask = _prefill_setup()
    w = fi.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    head = (qo_indptr, indptr, indices, last, 4, 2, 32, 4)
    opts = dict(custom_mask=mask)
    if form == "v02-mask":
        w.plan(*head, mask)  # the seed's positional custom_mask (9th): a bool tensor can't be head_dim_vo
    elif form == "v02-causal":
        # 0.2: custom_mask, packed_custom_mask, causal, pos_encoding_mode, allow_fp16_qk_reduction, sm_scale
        w.plan(*head, None, None, True, "NONE", False, 0.25)
        opts = dict(causal=True, sm_scale=0.25)
    elif form == "v07":
        # 0.7: head_dim_vo, custom_mask, packed_custom_mask, causal, pos_encoding_mode, use_fp16_qk_reduction,
        #      sm_scale, window_left, logits_soft_cap, rope_scale, rope_theta, q_data_type, kv_data_type,
        #      o_data_type, non_blocking
        w.plan(*head, 32, None, None, True, "NONE", False, 0.25, 5, None, None, None, DT, DT, torch.float32, True)
        opts = dict(causal=True, sm_scale=0.25, window_left=5)
    else:
        w.plan(*head, causal=True, sm_scale=0.25, window_left=5)
        opts = dict(causal=True, sm_scale=0.25, window_left=5)
    exp, exp_lse = R.batch_prefill_with_paged_kv_cache(q, qo_indptr, cache, indptr, indices, last, **opts)
    o, lse = w.run(q, cache, return_lse=True)
    close(o, exp, form)
    close(lse, exp_lse, form + " lse")


@pytest.mark.parametrize("form", ["v02-mask", "v02-causal", "v07", "keywords"])
def test_ragged_prefill_plan_generations(form):
    torch.manual_seed(5)
    qo_indptr, kv_indptr = i32(0, 3, 8), i32(0, 9, 23)
    q = torch.randn(8, 4, 32, dtype=DT)
    k = torch.randn(23, 2, 32, dtype=DT)
    v = torch.randn(23, 2, 32, dtype=DT)
    mask = torch.rand(3 * 9 + 5 * 14) > 0.3
    w = fi.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    head = (qo_indptr, kv_indptr, 4, 2, 32)
    opts = dict(custom_mask=mask)
    if form == "v02-mask":
        w.plan(*head, mask)  # 0.2's 6th positional: custom_mask (0.7: head_dim_vo)
    elif form == "v02-causal":
        # 0.2: custom_mask, packed_custom_mask, causal, pos_encoding_mode, allow_fp16_qk_reduction,
        #      window_left, logits_soft_cap, sm_scale
        w.plan(*head, None, None, True, "NONE", False, 4, None, 0.25)
        opts = dict(causal=True, window_left=4, sm_scale=0.25)
    elif form == "v07":
        w.plan(*head, 32, None, None, True, "NONE", False, 4, None, 0.25)
        opts = dict(causal=True, window_left=4, sm_scale=0.25)
    else:
        w.plan(*head, causal=True, window_left=4, sm_scale=0.25)
        opts = dict(causal=True, window_left=4, sm_scale=0.25)
    exp, exp_lse = R.batch_prefill_with_ragged_kv_cache(q, k, v, qo_indptr, kv_indptr, **opts)
    o, lse = w.run(q, k, v, return_lse=True)
    close(o, exp, form)
    close(lse, exp_lse, form + " lse")


def test_prefill_forward_defaults_not_causal():
    """FlashInfer's forward() defaults causal to False, and its 5th positional is use_fp16_qk_reduction."""
    cache, indptr, indices, last, qo_indptr, q, _ = _prefill_setup()
    w = fi.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    w.begin_forward(qo_indptr, indptr, indices, last, 4, 2, 32, 4, causal=True)
    exp, _ = R.batch_prefill_with_paged_kv_cache(q, qo_indptr, cache, indptr, indices, last, causal=False)
    close(w.forward(q, cache), exp, "paged forward default")
    close(w.forward(q, cache, False, "NONE", False, None, None, -1), exp, "paged forward positional")
    torch.manual_seed(3)
    k = torch.randn(23, 2, 32, dtype=DT)
    v = torch.randn(23, 2, 32, dtype=DT)
    r = fi.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    r.begin_forward(qo_indptr, i32(0, 9, 23), 4, 2, 32, causal=True)
    exp_r, _ = R.batch_prefill_with_ragged_kv_cache(q, k, v, qo_indptr, i32(0, 9, 23), causal=False)
    close(r.forward(q, k, v), exp_r, "ragged forward default")


@pytest.mark.parametrize("layout", ["NH", "HN"])
def test_prefill_run_lse_base_and_layout(layout):
    cache, indptr, indices, last, qo_indptr, q, _ = _prefill_setup()
    w = fi.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    w.plan(qo_indptr, indptr, indices, last, 4, 2, 32, 4, causal=True)
    _, exp_lse = R.batch_prefill_with_paged_kv_cache(q, qo_indptr, cache, indptr, indices, last, causal=True)
    exp_lse = exp_lse * math.log(2)
    lse_buf = torch.full((4, 8) if layout == "HN" else (8, 4), float("nan"))
    _, lse = w.run(q, cache, return_lse=True, lse_base="ln", lse_layout=layout, lse=lse_buf)
    assert lse.data_ptr() == lse_buf.data_ptr()
    close(lse, exp_lse.t() if layout == "HN" else exp_lse, "lse")


# ----------------------------------------------------------------------------- int64 index tensors
def test_int64_index_tensors():
    cache, indptr, indices, last, q = _decode_setup()
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    w.plan(indptr.long(), indices.long(), last.long(), 4, 2, 32, 4)
    exp, _ = _decode_ref(q, cache, indptr, indices, last)
    close(w.run(q, cache), exp, "int64 decode plan")
    x = torch.rand(37) > 0.5
    seg = torch.tensor([0, 5, 5, 37])
    p64, ip64 = fi.segment_packbits(x, seg, "little")
    p32, ip32 = fi.segment_packbits(x, seg.int(), "little")
    assert torch.equal(p64, p32) and torch.equal(ip64, ip32)
    assert torch.equal(fi.get_seq_lens(indptr.long(), last.long(), 4), fi.get_seq_lens(indptr, last, 4))
    b64 = fi.get_batch_indices_positions(torch.tensor([0, 2, 5]), torch.tensor([4, 3]), 5)
    b32 = fi.get_batch_indices_positions(i32(0, 2, 5), i32(4, 3), 5)
    assert all(torch.equal(a, b) for a, b in zip(b64, b32))


def test_get_batch_indices_positions_out_buffers():
    bi = torch.full((5,), -7, dtype=torch.int32)
    pos = torch.full((5,), -7, dtype=torch.int32)
    got = fi.get_batch_indices_positions(i32(0, 2, 5), i32(4, 3), 5, bi, pos)
    assert got[0] is bi and got[1] is pos
    assert bi.tolist() == [0, 0, 1, 1, 1] and pos.tolist() == [2, 3, 0, 1, 2]


# ----------------------------------------------------------------------------- cascade, shared prefix
def test_shared_prefix_prefill_forward_order():
    """0.7's forward(q, k_shared, v_shared, unique_kv_cache, causal, use_fp16_qk_reduction, sm_scale, ...)."""
    torch.manual_seed(2)
    cache, indptr, indices, last, qo_indptr, q, _ = _prefill_setup()
    ks = torch.randn(6, 2, 32, dtype=DT)
    vs = torch.randn(6, 2, 32, dtype=DT)
    w = fi.BatchPrefillWithSharedPrefixPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    w.begin_forward(qo_indptr, indptr, indices, last, 4, 2, 32, 4)
    o = w.forward(q, ks, vs, cache, True, False, 0.3)
    o_s, lse_s = R.single_prefill_with_kv_cache(q, ks, vs, sm_scale=0.3, return_lse=True)
    o_u, lse_u = R.batch_prefill_with_paged_kv_cache(
        q, qo_indptr, cache, indptr, indices, last, causal=True, sm_scale=0.3
    )
    exp, _ = R.merge_state(o_s, lse_s, o_u, lse_u)
    close(o, exp, "shared-prefix forward")
    w.reset_workspace_buffer(torch.empty(1 << 20, dtype=torch.uint8), torch.empty(1 << 20, dtype=torch.uint8))


def test_signatures_follow_07_order():
    """What inspect (and keyword binding) sees is 0.7's order; 0.2's order is kept beside it for reference."""
    import inspect

    def names(fn):
        return [p for p in inspect.signature(fn).parameters if p not in ("self", "args", "kwargs")]

    dec = names(fi.BatchDecodeWithPagedKVCacheWrapper.plan)
    assert dec[12:14] == ["o_data_type", "data_type"] and dec[22] == "q_len_per_req"
    assert names(fi.BatchPrefillWithPagedKVCacheWrapper.plan)[8] == "head_dim_vo"
    assert names(fi.BatchPrefillWithRaggedKVCacheWrapper.plan)[5] == "head_dim_vo"
    assert names(fi.single_prefill_with_kv_cache)[3:7] == ["scale_q", "scale_k", "scale_v", "o_dtype"]
    assert fi.single_prefill_with_kv_cache.__flashinfer_v02_order__[3] == "custom_mask"
    assert names(fi.BatchDecodeWithPagedKVCacheWrapper.forward)[6] == "window_left"
