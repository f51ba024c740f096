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
from conftest import DEVICE, assert_close
from flashinfer_triton import reference as R
from helpers import i32, make_paged

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

DT = torch.float16
ATOL = 2e-2


def close(got, expected, what):
    assert_close(got, expected, ATOL, 0.0, name=what)


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


# ----------------------------------------------------------------------------- 0.2's positional run()
def test_run_v02_positional_scales_and_return_lse():
    """0.2's run(q, cache, q_scale, k_scale, v_scale, return_lse) (decode), run(q, cache, k_scale, v_scale,
    return_lse) (paged prefill) and run(q, k, v, return_lse) (ragged); 0.7 keeps that slot for custom-kernel
    arguments, which are refused naming *args."""
    cache, indptr, indices, last, q = _decode_setup()
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    w.plan(indptr, indices, last, 4, 2, 32, 4)
    exp, exp_lse = _decode_ref(q, cache, indptr, indices, last, k_scale=0.6 * 0.8, v_scale=1.5)
    o, lse = w.run(q, cache, 0.6, 0.8, 1.5, True)
    close(o, exp, "decode 0.2 run")
    close(lse, exp_lse, "decode 0.2 run lse")
    with pytest.raises(NotImplementedError, match=r"\*args"):
        w.run(q, cache, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(TypeError, match="q_scale"):
        w.run(q, cache, 0.6, q_scale=0.6)

    cache, indptr, indices, last, qo_indptr, q, _ = _prefill_setup()
    p = fi.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    p.plan(qo_indptr, indptr, indices, last, 4, 2, 32, 4, causal=True)
    exp, exp_lse = R.batch_prefill_with_paged_kv_cache(
        q, qo_indptr, cache, indptr, indices, last, causal=True, k_scale=0.7, v_scale=1.25
    )
    o, lse = p.run(q, cache, 0.7, 1.25, True)
    close(o, exp, "paged 0.2 run")
    close(lse, exp_lse, "paged 0.2 run lse")
    with pytest.raises(NotImplementedError, match=r"\*args"):
        p.run(q, cache, 0.7, 1.25, True, "extra")

    torch.manual_seed(4)
    k = torch.randn(23, 2, 32, dtype=DT)
    v = torch.randn(23, 2, 32, dtype=DT)
    r = fi.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    r.plan(qo_indptr, i32(0, 9, 23), 4, 2, 32, causal=True)
    exp, exp_lse = R.batch_prefill_with_ragged_kv_cache(q, k, v, qo_indptr, i32(0, 9, 23), causal=True)
    o, lse = r.run(q, k, v, True)
    close(o, exp, "ragged 0.2 run")
    close(lse, exp_lse, "ragged 0.2 run lse")


# ----------------------------------------------------------------------------- rope: 0.2's cos/sin caches
def _rope_v02_expected(x, cos_cache, sin_cache, pos, interleave):
    """Element by element: x[i] * cos[p, i] + partner(i) * sin[p, i] over the rotated dims."""
    rot = cos_cache.shape[1]
    idx = torch.arange(rot)
    if interleave:
        partner = idx ^ 1
        sign = torch.where(idx % 2 == 0, -1.0, 1.0)
    else:
        partner = (idx + rot // 2) % rot
        sign = torch.where(idx < rot // 2, -1.0, 1.0)
    xf = x.float()
    out = xf.clone()
    c, s = cos_cache[pos.long()][:, None, :], sin_cache[pos.long()][:, None, :]
    out[..., :rot] = xf[..., :rot] * c + sign * xf[..., partner] * s
    return out


@pytest.mark.parametrize("interleave", [False, True])
def test_rope_cos_sin_cache_v02_form(interleave):
    torch.manual_seed(8 + interleave)
    nnz, d, rot = 6, 32, 24
    q = torch.randn(nnz, 4, d, dtype=DT)
    k = torch.randn(nnz, 2, d, dtype=DT)
    cos_cache, sin_cache = torch.randn(20, rot), torch.randn(20, rot)  # no value repeated within a pair
    pos = torch.randint(0, 20, (nnz,), dtype=torch.int32)
    q0, k0 = q.clone(), k.clone()
    eq = _rope_v02_expected(q, cos_cache, sin_cache, pos, interleave)
    ek = _rope_v02_expected(k, cos_cache, sin_cache, pos, interleave)
    qr, kr = fi.apply_rope_with_cos_sin_cache(q, k, cos_cache, sin_cache, pos, interleave)
    assert torch.equal(q, q0) and torch.equal(k, k0), "out of place: the inputs are unchanged"
    close(qr, eq, "q")
    close(kr, ek, "k")
    qk, kk = fi.apply_rope_with_cos_sin_cache(q=q, k=k, cos_cache=cos_cache, sin_cache=sin_cache, pos_ids=pos,
                                              interleave=interleave)  # fmt: skip
    close(qk, eq, "keywords")
    fi.apply_rope_with_cos_sin_cache_inplace(q, k, cos_cache, sin_cache, pos.long(), interleave)
    close(q, eq, "in place q")
    close(k, ek, "in place k")
    # a cache whose pairs repeat their cosine and sine is 0.7's per-pair cache: both forms agree
    half = torch.randn(20, rot // 2)
    sin_half = torch.randn(20, rot // 2)
    if interleave:
        c2, s2 = half.repeat_interleave(2, 1), sin_half.repeat_interleave(2, 1)
    else:
        c2, s2 = torch.cat((half, half), 1), torch.cat((sin_half, sin_half), 1)
    q02, k02 = fi.apply_rope_with_cos_sin_cache(q0, k0, c2, s2, pos)  if not interleave else \
        fi.apply_rope_with_cos_sin_cache(q0, k0, c2, s2, pos, True)  # fmt: skip
    q07, k07 = fi.apply_rope_with_cos_sin_cache(
        pos, q0.reshape(nnz, -1), k0.reshape(nnz, -1), d, torch.cat((half, sin_half), 1), not interleave
    )
    close(q02, _rope_v02_expected(q0, c2, s2, pos, interleave), "0.2 form, per-pair cache, q")
    close(k02, _rope_v02_expected(k0, c2, s2, pos, interleave), "0.2 form, per-pair cache, k")
    close(q02, q07.view(nnz, 4, d), "0.2 vs 0.7 q")
    close(k02, k07.view(nnz, 2, d), "0.2 vs 0.7 k")


def test_rope_cos_sin_cache_v02_bad_input_writes_nothing():
    torch.manual_seed(9)
    q = torch.randn(3, 2, 16, dtype=DT)
    k = torch.randn(3, 2, 16, dtype=DT)
    q0 = q.clone()
    c, s = torch.randn(5, 16), torch.randn(5, 16)
    with pytest.raises(ValueError, match="pos_ids"):
        fi.apply_rope_with_cos_sin_cache_inplace(q, k, c, s, i32(0, 5, 1))
    with pytest.raises(TypeError, match="sin_cache"):
        fi.apply_rope_with_cos_sin_cache_inplace(q, k, c, s.half(), i32(0, 1, 1))
    with pytest.raises(ValueError, match="cos_cache"):
        fi.apply_rope_with_cos_sin_cache_inplace(q, k, torch.randn(5, 18), torch.randn(5, 18), i32(0, 1, 1))
    assert torch.equal(q, q0)


# ----------------------------------------------------------------------------- 0.7.2's parameter names
# FlashInfer 0.7.2's public signatures (read from its released Python sources): the parameters in positional
# order, then after "|" the keyword-only ones. decode plan()'s optional parameters are taken positionally there
# (deprecated) in the order listed; window_right and is_causal are keyword-only.
SIGNATURES_072 = {
    "activation.gelu_and_mul": "input out enable_pdl",
    "activation.gelu_tanh_and_mul": "input out enable_pdl",
    "activation.silu_and_mul": "input out enable_pdl",
    "cascade.BatchDecodeWithSharedPrefixPagedKVCacheWrapper.__init__": "float_workspace_buffer kv_layout",
    "cascade.BatchDecodeWithSharedPrefixPagedKVCacheWrapper.begin_forward": "unique_kv_indptr unique_kv_indices "
    "unique_kv_last_page_len num_qo_heads num_kv_heads head_dim page_size data_type",
    "cascade.BatchDecodeWithSharedPrefixPagedKVCacheWrapper.forward": "q k_shared v_shared unique_kv_cache",
    "cascade.BatchDecodeWithSharedPrefixPagedKVCacheWrapper.reset_workspace_buffer": "float_workspace_buffer "
    "int_workspace_buffer",
    "cascade.BatchPrefillWithSharedPrefixPagedKVCacheWrapper.__init__": "float_workspace_buffer kv_layout",
    "cascade.BatchPrefillWithSharedPrefixPagedKVCacheWrapper.begin_forward": "qo_indptr paged_kv_indptr "
    "paged_kv_indices paged_kv_last_page_len num_qo_heads num_kv_heads head_dim page_size",
    "cascade.BatchPrefillWithSharedPrefixPagedKVCacheWrapper.forward": "q k_shared v_shared unique_kv_cache causal "
    "use_fp16_qk_reduction sm_scale rope_scale rope_theta",
    "cascade.BatchPrefillWithSharedPrefixPagedKVCacheWrapper.prewarm_paged_kv_stride_variant": "variant",
    "cascade.BatchPrefillWithSharedPrefixPagedKVCacheWrapper.reset_workspace_buffer": "float_workspace_buffer "
    "int_workspace_buffer",
    "cascade.MultiLevelCascadeAttentionWrapper.__init__": "num_levels float_workspace_buffer kv_layout "
    "use_cuda_graph qo_indptr_buf_arr paged_kv_indptr_buf_arr paged_kv_indices_buf_arr "
    "paged_kv_last_page_len_buf_arr",
    "cascade.MultiLevelCascadeAttentionWrapper.plan": "qo_indptr_arr paged_kv_indptr_arr paged_kv_indices_arr "
    "paged_kv_last_page_len num_qo_heads num_kv_heads head_dim page_size causal pos_encoding_mode "
    "use_fp16_qk_reduction sm_scale window_left logits_soft_cap rope_scale rope_theta q_data_type kv_data_type",
    "cascade.MultiLevelCascadeAttentionWrapper.prewarm_paged_kv_stride_variant": "variant",
    "cascade.MultiLevelCascadeAttentionWrapper.reset_workspace_buffer": "float_workspace_buffer int_workspace_buffers",
    "cascade.MultiLevelCascadeAttentionWrapper.run": "q paged_kv_cache",
    "cascade.merge_state": "v_a s_a v_b s_b",
    "cascade.merge_state_in_place": "v s v_other s_other mask",
    "cascade.merge_states": "v s",
    "decode.BatchDecodeWithPagedKVCacheWrapper.__init__": "float_workspace_buffer kv_layout use_cuda_graph "
    "use_tensor_cores paged_kv_indptr_buffer paged_kv_indices_buffer paged_kv_last_page_len_buffer backend "
    "jit_args",
    "decode.BatchDecodeWithPagedKVCacheWrapper.forward": "q paged_kv_cache pos_encoding_mode q_scale k_scale "
    "v_scale window_left logits_soft_cap sm_scale rope_scale rope_theta",
    "decode.BatchDecodeWithPagedKVCacheWrapper.forward_return_lse": "q paged_kv_cache pos_encoding_mode q_scale "
    "k_scale v_scale window_left logits_soft_cap sm_scale rope_scale rope_theta",
    "decode.BatchDecodeWithPagedKVCacheWrapper.plan": "indptr indices last_page_len num_qo_heads num_kv_heads "
    "head_dim page_size pos_encoding_mode window_left logits_soft_cap q_data_type kv_data_type o_data_type "
    "data_type sm_scale rope_scale rope_theta non_blocking block_tables seq_lens fixed_split_size disable_split_kv "
    "q_len_per_req | window_right is_causal",
    "decode.BatchDecodeWithPagedKVCacheWrapper.prewarm_paged_kv_stride_variant": "variant",
    "decode.BatchDecodeWithPagedKVCacheWrapper.reset_workspace_buffer": "float_workspace_buffer int_workspace_buffer",
    "decode.BatchDecodeWithPagedKVCacheWrapper.run": "q paged_kv_cache | q_scale k_scale v_scale out lse "
    "return_lse enable_pdl window_left sinks q_len_per_req skip_softmax_threshold_scale_factor kv_cache_sf",
    "decode.BatchDecodeWithPagedKVCacheWrapper.workspace_size": "indptr indices last_page_len num_qo_heads "
    "num_kv_heads head_dim page_size pos_encoding_mode window_left logits_soft_cap q_data_type kv_data_type "
    "o_data_type data_type sm_scale rope_scale rope_theta block_tables seq_lens fixed_split_size disable_split_kv "
    "q_len_per_req",
    "decode.CUDAGraphBatchDecodeWithPagedKVCacheWrapper.__init__": "workspace_buffer indptr_buffer indices_buffer "
    "last_page_len_buffer kv_layout use_tensor_cores",
    "decode.fast_decode_plan": "self indptr indices last_page_len num_qo_heads num_kv_heads head_dim page_size "
    "pos_encoding_mode window_left logits_soft_cap q_data_type kv_data_type data_type sm_scale rope_scale "
    "rope_theta non_blocking fixed_split_size disable_split_kv q_len_per_req global_override_indptr_cpu",
    "decode.single_decode_with_kv_cache": "q k v kv_layout pos_encoding_mode use_tensor_cores q_scale k_scale "
    "v_scale window_left logits_soft_cap sm_scale rope_scale rope_theta return_lse",
    "norm.fused_add_rmsnorm": "input residual weight eps enable_pdl",
    "norm.gemma_fused_add_rmsnorm": "input residual weight eps enable_pdl",
    "norm.gemma_rmsnorm": "input weight eps out enable_pdl",
    "norm.layernorm": "input gemma beta eps",
    "norm.rmsnorm": "input weight eps out enable_pdl",
    "page.append_paged_kv_cache": "append_key append_value batch_indices positions paged_kv_cache kv_indices "
    "kv_indptr kv_last_page_len kv_layout",
    "page.get_batch_indices_positions": "append_indptr seq_lens nnz batch_indices positions",
    "page.get_seq_lens": "kv_indptr kv_last_page_len page_size",
    "prefill.BatchPrefillWithPagedKVCacheWrapper.__init__": "float_workspace_buffer kv_layout use_cuda_graph "
    "qo_indptr_buf paged_kv_indptr_buf paged_kv_indices_buf paged_kv_last_page_len_buf custom_mask_buf "
    "mask_indptr_buf backend jit_args jit_kwargs variant_owns_mask",
    "prefill.BatchPrefillWithPagedKVCacheWrapper.forward": "q paged_kv_cache causal pos_encoding_mode "
    "use_fp16_qk_reduction k_scale v_scale window_left logits_soft_cap sm_scale rope_scale rope_theta",
    "prefill.BatchPrefillWithPagedKVCacheWrapper.forward_return_lse": "q paged_kv_cache causal pos_encoding_mode "
    "use_fp16_qk_reduction k_scale v_scale window_left logits_soft_cap sm_scale rope_scale rope_theta",
    "prefill.BatchPrefillWithPagedKVCacheWrapper.plan": "qo_indptr paged_kv_indptr paged_kv_indices "
    "paged_kv_last_page_len num_qo_heads num_kv_heads head_dim_qk page_size head_dim_vo custom_mask "
    "packed_custom_mask causal pos_encoding_mode use_fp16_qk_reduction sm_scale window_left logits_soft_cap "
    "rope_scale rope_theta q_data_type kv_data_type o_data_type non_blocking prefix_len_ptr token_pos_in_items_ptr "
    "token_pos_in_items_len max_item_len_ptr seq_lens seq_lens_q block_tables max_token_per_sequence "
    "max_sequence_kv fixed_split_size disable_split_kv uniform_q_len",
    "prefill.BatchPrefillWithPagedKVCacheWrapper.prewarm_paged_kv_stride_variant": "variant",
    "prefill.BatchPrefillWithPagedKVCacheWrapper.reset_workspace_buffer": "float_workspace_buffer int_workspace_buffer",
    "prefill.BatchPrefillWithPagedKVCacheWrapper.run": "q paged_kv_cache | q_scale k_scale v_scale out lse "
    "return_lse lse_base lse_layout enable_pdl window_left sinks kv_cache_sf skip_softmax_threshold_scale_factor "
    "use_fp16_softmax uses_spcompress",
    "prefill.BatchPrefillWithPagedKVCacheWrapper.workspace_size": "qo_indptr paged_kv_indptr paged_kv_indices "
    "paged_kv_last_page_len num_qo_heads num_kv_heads head_dim_qk page_size head_dim_vo custom_mask "
    "packed_custom_mask causal pos_encoding_mode use_fp16_qk_reduction sm_scale window_left logits_soft_cap "
    "rope_scale rope_theta q_data_type kv_data_type o_data_type prefix_len_ptr token_pos_in_items_ptr "
    "token_pos_in_items_len max_item_len_ptr seq_lens seq_lens_q block_tables max_token_per_sequence "
    "max_sequence_kv fixed_split_size disable_split_kv uniform_q_len",
    "prefill.BatchPrefillWithRaggedKVCacheWrapper.__init__": "float_workspace_buffer kv_layout use_cuda_graph "
    "qo_indptr_buf kv_indptr_buf custom_mask_buf mask_indptr_buf backend jit_args jit_kwargs variant_owns_mask",
    "prefill.BatchPrefillWithRaggedKVCacheWrapper.forward": "q k v causal pos_encoding_mode use_fp16_qk_reduction "
    "window_left logits_soft_cap sm_scale rope_scale rope_theta",
    "prefill.BatchPrefillWithRaggedKVCacheWrapper.forward_return_lse": "q k v causal pos_encoding_mode "
    "use_fp16_qk_reduction window_left logits_soft_cap sm_scale rope_scale rope_theta",
    "prefill.BatchPrefillWithRaggedKVCacheWrapper.plan": "qo_indptr kv_indptr num_qo_heads num_kv_heads "
    "head_dim_qk head_dim_vo custom_mask packed_custom_mask causal pos_encoding_mode use_fp16_qk_reduction "
    "window_left logits_soft_cap sm_scale rope_scale rope_theta q_data_type kv_data_type o_data_type non_blocking "
    "prefix_len_ptr token_pos_in_items_ptr token_pos_in_items_len max_item_len_ptr fixed_split_size "
    "disable_split_kv seq_lens seq_lens_q max_token_per_sequence max_sequence_kv v_indptr o_indptr uniform_q_len",
    "prefill.BatchPrefillWithRaggedKVCacheWrapper.reset_workspace_buffer": "float_workspace_buffer "
    "int_workspace_buffer",
    "prefill.BatchPrefillWithRaggedKVCacheWrapper.run": "q k v | q_scale k_scale v_scale o_scale out lse "
    "return_lse lse_base lse_layout enable_pdl kv_cache_sf",
    "prefill.single_prefill_with_kv_cache": "q k v scale_q scale_k scale_v o_dtype custom_mask packed_custom_mask "
    "causal kv_layout pos_encoding_mode use_fp16_qk_reduction sm_scale window_left logits_soft_cap rope_scale "
    "rope_theta backend return_lse kv_cache_sf k_scale v_scale",
    "quantization.packbits": "x bitorder",
    "quantization.segment_packbits": "x indptr bitorder",
    "rope.apply_llama31_rope": "q k indptr offsets rotary_dim interleave rope_scale rope_theta low_freq_factor "
    "high_freq_factor old_context_len",
    "rope.apply_llama31_rope_inplace": "q k indptr offsets rotary_dim interleave rope_scale rope_theta "
    "low_freq_factor high_freq_factor old_context_len",
    "rope.apply_llama31_rope_pos_ids": "q k pos_ids rotary_dim interleave rope_scale rope_theta low_freq_factor "
    "high_freq_factor old_context_len",
    "rope.apply_llama31_rope_pos_ids_inplace": "q k pos_ids rotary_dim interleave rope_scale rope_theta "
    "low_freq_factor high_freq_factor old_context_len",
    "rope.apply_rope": "q k indptr offsets rotary_dim interleave rope_scale rope_theta",
    "rope.apply_rope_inplace": "q k indptr offsets rotary_dim interleave rope_scale rope_theta",
    "rope.apply_rope_pos_ids": "q k pos_ids rotary_dim interleave rope_scale rope_theta",
    "rope.apply_rope_pos_ids_inplace": "q k pos_ids rotary_dim interleave rope_scale rope_theta",
    "rope.apply_rope_with_cos_sin_cache": "positions query key head_size cos_sin_cache is_neox",
    "rope.apply_rope_with_cos_sin_cache_inplace": "positions query key head_size cos_sin_cache is_neox",
    "sampling.chain_speculative_sampling": "draft_probs draft_token_ids target_probs maybe_output_accepted_token_num "
    "maybe_output_emitted_draft_token_num deterministic generator seed offset",
    "sampling.min_p_sampling_from_probs": "probs min_p indices deterministic generator check_nan seed offset "
    "return_valid",
    "sampling.sampling_from_logits": "logits indices deterministic generator check_nan seed offset",
    "sampling.sampling_from_probs": "probs indices deterministic generator check_nan seed offset return_valid",
    "sampling.softmax": "logits temperature enable_pdl",
    "sampling.top_k_mask_logits": "logits top_k",
    "sampling.top_k_renorm_probs": "probs top_k is_deterministic",
    "sampling.top_k_sampling_from_probs": "probs top_k indices deterministic generator check_nan seed offset "
    "return_valid",
    "sampling.top_k_top_p_sampling_from_logits": "logits top_k top_p indices filter_apply_order deterministic "
    "generator check_nan seed offset",
    "sampling.top_k_top_p_sampling_from_probs": "probs top_k top_p indices filter_apply_order deterministic "
    "generator check_nan seed offset return_valid",
    "sampling.top_p_renorm_probs": "probs top_p is_deterministic",
    "sampling.top_p_sampling_from_probs": "probs top_p indices deterministic generator check_nan seed offset "
    "return_valid",
}
# the CUDA-graph decode wrapper inherits every other method of the decode wrapper
for _k, _v in list(SIGNATURES_072.items()):
    if _k.startswith("decode.BatchDecodeWithPagedKVCacheWrapper.") and not _k.endswith("__init__"):
        SIGNATURES_072[_k.replace("BatchDecode", "CUDAGraphBatchDecode")] = _v


def _resolve(path):
    import inspect

    mod, *attrs = path.split(".")
    obj = getattr(fi, mod)
    for a in attrs:
        obj = getattr(obj, a)
    # a method's self is not a parameter of the call; fast_decode_plan's (a plain function) is
    params = [p for p in inspect.signature(obj).parameters.values() if not (p.name == "self" and len(attrs) > 1)]
    if [p.kind for p in params] == [inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]:
        # run_return_lse / forward_return_lse pass everything on to run / forward
        assert attrs[-1].endswith("_return_lse"), f"{path}: (*args, **kwargs) hides the parameters"
        return _resolve(path[: -len("_return_lse")])
    return params


@pytest.mark.parametrize("path", sorted(SIGNATURES_072))
def test_every_072_parameter_is_named(path):
    """Each of FlashInfer 0.7.2's parameters is a named parameter here (never left to **kwargs, where it could be
    dropped), positional ones at 0.7.2's position."""
    import inspect

    params = _resolve(path)
    positional, _, keyword = SIGNATURES_072[path].partition("|")
    ours_pos = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    named = {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    want = positional.split()
    assert ours_pos[: len(want)] == want, f"{path}: positional order {ours_pos[: len(want)]} != 0.7.2's {want}"
    missing = [n for n in keyword.split() if n not in named]
    assert not missing, f"{path}: 0.7.2's {missing} not named in the signature"
    assert all(p.kind != inspect.Parameter.VAR_POSITIONAL or p.name == "args" for p in params)


# ----------------------------------------------------------------------------- sampling: 0.2's uniform_samples
# the PyTorch path on CPU tensors; the kernels on DEVICE (the GPU, or the CPU under TRITON_INTERPRET=1)
PATHS = [pytest.param("cpu", id="torch"), pytest.param(DEVICE, id="kernels", marks=pytest.mark.interpret)]


def _inverse_cdf(w, u):
    """Index of the first cumulative weight above ``u * total`` per row (float64, independent of the library)."""
    w, u = w.cpu(), u.cpu()
    cs = w.double().cumsum(1)
    return [int((cs[i] > u[i] * cs[i, -1]).nonzero()[0]) for i in range(w.shape[0])]


@pytest.mark.parametrize("dev", PATHS)
def test_sampling_v02_uniform_samples(dev):
    """0.2's samplers took caller-drawn uniforms in the slot 0.7 gives to the filter: each sample is the inverse
    CDF of the filtered distribution at round 0's uniform; filtered samplers return (samples, success)."""
    torch.manual_seed(12)
    b, vocab = 5, 40
    probs = torch.softmax(torch.randn(b, vocab) * 2, -1).to(dev)
    u = (torch.rand(3, b) * 0.98 + 0.01).to(dev)
    srt = probs.sort(1, descending=True)
    got = fi.sampling_from_probs(probs, u[0])
    assert got.tolist() == _inverse_cdf(probs, u[0])
    # top-k 4: the 4 largest probabilities of each row
    keep = torch.zeros_like(probs).scatter(1, srt.indices[:, :4], 1.0)
    s, ok = fi.top_k_sampling_from_probs(probs, u, 4)
    assert s.tolist() == _inverse_cdf(probs * keep, u[0]) and bool(ok.all())
    # top-p 0.5: the smallest top set of mass >= 0.5
    n_keep = (srt.values.cumsum(1) < 0.5).sum(1) + 1
    keep_p = torch.zeros_like(probs)
    for i in range(b):
        keep_p[i, srt.indices[i, : int(n_keep[i])]] = 1.0
    s, ok = fi.top_p_sampling_from_probs(probs, u, 0.5, True, False)
    assert s.tolist() == _inverse_cdf(probs * keep_p, u[0]) and bool(ok.all())
    # min-p 0.3 (keyword uniform_samples)
    keep_m = (probs >= 0.3 * probs.max(1, keepdim=True).values).float()
    s, ok = fi.min_p_sampling_from_probs(probs, uniform_samples=u, min_p=0.3)
    assert s.tolist() == _inverse_cdf(probs * keep_m, u[0])
    # top-k then top-p, from probabilities and from logits
    s, ok = fi.top_k_top_p_sampling_from_probs(probs, u, torch.full((b,), vocab, dtype=torch.int32, device=dev), 0.5)
    assert s.tolist() == _inverse_cdf(probs * keep_p, u[0])
    s, ok = fi.top_k_top_p_sampling_from_logits(probs.log(), u, vocab, 0.5, "top_k_first")
    assert s.tolist() == _inverse_cdf(probs * keep_p, u[0])
    with pytest.raises(ValueError, match="uniform_samples"):
        fi.top_p_sampling_from_probs(probs, torch.rand(3, b + 1, device=dev), 0.5)


@pytest.mark.parametrize("dev", PATHS)
def test_chain_speculative_sampling_v02_uniform_samples(dev):
    """0.2's (draft_probs, draft_token_ids, uniform_samples [B, n + 1], target_probs, ...): acceptance of draft
    token i while u_i * q_i < p_i, then a draw from relu(p - q) at u_n."""
    torch.manual_seed(13)
    b, n, vocab = 3, 2, 16
    draft = torch.softmax(torch.randn(b, n, vocab), -1)
    target = torch.softmax(torch.randn(b, n + 1, vocab), -1)
    ids = torch.multinomial(draft.view(-1, vocab), 1).view(b, n).int()
    u = torch.rand(b, n + 1)
    u[0, :n] = 0.0  # request 0 accepts every draft token
    u[1, 0] = 0.999999  # request 1 rejects the first one (unless p >= q there)
    out, acc, emit = fi.chain_speculative_sampling(draft.to(dev), ids.to(dev), u.to(dev), target.to(dev))
    out, emit = out.cpu(), emit.cpu()
    for r in range(b):
        pos = n
        for i in range(n):
            t = int(ids[r, i])
            if not float(u[r, i]) * float(draft[r, i, t]) < float(target[r, i, t]):
                pos = i
                break
        resid = target[r, pos] - (draft[r, pos] if pos < n else 0.0)
        expected = ids[r, :pos].tolist() + _inverse_cdf(resid.clamp(min=0)[None], u[r, n:])
        assert out[r, : pos + 1].tolist() == expected, f"request {r}"
        assert (out[r, pos + 1 :] == -1).all() and int(emit[r]) == pos
    with pytest.raises(ValueError, match="uniform_samples"):
        fi.chain_speculative_sampling(draft.to(dev), ids.to(dev), torch.rand(b, n, device=dev), target.to(dev))


# ----------------------------------------------------------------------------- 0.2's parameter names
# FlashInfer 0.2's parameter names that 0.7.2's signatures lack (renamed, or 0.2-only forms). Each is accepted:
# by keyword in the signature, or by the 0.2 form that the function recognises (its __flashinfer_v02_order__).
V02_ONLY_NAMES = {
    "cascade.BatchPrefillWithSharedPrefixPagedKVCacheWrapper.forward": "allow_fp16_qk_reduction",
    "cascade.MultiLevelCascadeAttentionWrapper.plan": "allow_fp16_qk_reduction",
    "prefill.BatchPrefillWithPagedKVCacheWrapper.__init__": "qk_indptr_buf",
    "prefill.BatchPrefillWithPagedKVCacheWrapper.forward": "allow_fp16_qk_reduction",
    "prefill.BatchPrefillWithPagedKVCacheWrapper.plan": "head_dim allow_fp16_qk_reduction",
    "prefill.BatchPrefillWithRaggedKVCacheWrapper.__init__": "qk_indptr_buf",
    "prefill.BatchPrefillWithRaggedKVCacheWrapper.forward": "allow_fp16_qk_reduction",
    "prefill.BatchPrefillWithRaggedKVCacheWrapper.plan": "head_dim allow_fp16_qk_reduction",
    "prefill.single_prefill_with_kv_cache": "allow_fp16_qk_reduction",
    "rope.apply_rope_with_cos_sin_cache": "q k cos_cache sin_cache pos_ids interleave",
    "rope.apply_rope_with_cos_sin_cache_inplace": "q k cos_cache sin_cache pos_ids interleave",
    "sampling.chain_speculative_sampling": "uniform_samples maybe_output_emitted_token_num",
    "sampling.min_p_sampling_from_probs": "uniform_samples",
    "sampling.sampling_from_probs": "uniform_samples",
    "sampling.top_k_sampling_from_probs": "uniform_samples",
    "sampling.top_k_top_p_sampling_from_logits": "probs uniform_samples",
    "sampling.top_k_top_p_sampling_from_probs": "uniform_samples",
    "sampling.top_p_sampling_from_probs": "uniform_samples",
}


@pytest.mark.parametrize("path", sorted(V02_ONLY_NAMES))
def test_every_02_parameter_name_is_accepted(path):
    mod, *attrs = path.split(".")
    obj = getattr(fi, mod)
    for a in attrs:
        obj = getattr(obj, a)
    named = {p.name for p in _resolve(path) if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    named |= set(getattr(obj, "__flashinfer_v02_order__", ()))
    missing = [n for n in V02_ONLY_NAMES[path].split() if n not in named]
    assert not missing, f"{path}: FlashInfer 0.2's {missing} not accepted"


def test_cascade_plan_v02_precision_hint_keyword():
    cache, indptr, indices, last, q = _decode_setup()
    w = fi.MultiLevelCascadeAttentionWrapper(1, torch.empty(1 << 20, dtype=torch.uint8))
    w.plan([i32(0, 1, 2, 3)], [indptr], [indices], [last], 4, 2, 32, 4, allow_fp16_qk_reduction=True)
    close(w.run(q, cache), _decode_ref(q, cache, indptr, indices, last)[0], "cascade, one level")
