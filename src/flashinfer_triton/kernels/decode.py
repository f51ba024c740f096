"""Batch decode attention: one query per request, the GQA group packed into the tile's rows.

One program handles one work item (request ``b``, key range ``[start, end)``) for one KV head ``g``;
its rows are the query heads ``h = g * GROUP + r`` (``r < GROUP``), so each K/V tile is loaded once
for the whole group. For key ``j`` the score is

    s_hj = (q_h . k_j) * sm_scale                     (q, k rotated first under ROPE_LLAMA)
    s_hj = cap * tanh(s_hj / cap)                     (logits_soft_cap > 0)
    s_hj = s_hj + slope_h * j                         (ALIBI, decode query index 0)

kept in base 2 (times log2 e) for an online softmax over the key tiles:

    m' = max(m, max_j s_j),  l' = l 2^(m - m') + sum_j 2^(s_j - m'),
    acc' = acc 2^(m - m') + sum_j 2^(s_j - m') v_j

The state written is ``o = acc / l * v_scale`` and ``lse = m + log2(l)`` (``o = 0``, ``lse = -inf``
when the range is empty): straight into the output when the request is not split, else into the
partial buffer (row ``work index``), which ``kernels/merge.py`` reduces.

KV addressing lives in ``_kv_locate`` (token -> page, slot) and ``_kv_offsets`` (-> element offset of
its row of ``D`` values) alone, so another cache layout (vLLM's split-D keys) is one more constexpr
branch there.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _kv_locate(kv_indices_ptr, seq_base, offs_n, mask_n, PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr):
    """(page, slot) of tokens ``offs_n`` of the request whose table starts at ``seq_base``, int64."""
    if PAGED:
        # The physical page is looked up per token, so the tile does not depend on the page size.
        page = tl.load(kv_indices_ptr + seq_base + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        slot = (offs_n % PAGE_SIZE).to(tl.int64)
    else:
        page = seq_base + offs_n.to(tl.int64)
        slot = (offs_n * 0).to(tl.int64)
    return page, slot


@triton.jit
def _kv_offsets(page, slot, head, stride_p, stride_s, stride_h):
    """Element offset of the first value of each token's row (``[P, PS, H, D]`` view, unit D stride)."""
    return page * stride_p + slot * stride_s + head * stride_h


@triton.jit
def _cos_sin(angle, INTERPRET: tl.constexpr):
    """Accurate cos/sin (angles reach tens of thousands of radians at long positions)."""
    if INTERPRET:
        return tl.cos(angle), tl.sin(angle)
    else:
        return libdevice.cos(angle), libdevice.sin(angle)


@triton.jit
def _tanh(x):
    """tanh through exp2 (no libdevice in the interpreter); saturates cleanly at +-1."""
    e = tl.exp2(x * (2.0 * 1.4426950408889634))
    return 1.0 - 2.0 / (e + 1.0)


@triton.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    lse_ptr,
    part_o_ptr,
    part_lse_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    kv_lens_ptr,
    alibi_ptr,
    rope_freq_ptr,
    work_ptr,
    num_work_ptr,
    stride_qb,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_ob,
    stride_oh,
    stride_lb,
    stride_lh,
    work_cap,
    qk_scale,
    soft_cap,
    v_scale,
    NUM_QO_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PAGED: tl.constexpr,
    USE_DOT: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    POS_MODE: tl.constexpr,  # 0 none, 1 rope_llama, 2 alibi
    HAS_LSE: tl.constexpr,
    CHECK_NUM_WORK: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Decode attention of one work item for one KV head (all query heads of its group)."""
    w = tl.program_id(0)
    g = tl.program_id(1)
    if CHECK_NUM_WORK:
        # CUDA-graph mode: the grid is fixed by capacity, slots past the live work do nothing.
        valid = w < tl.load(num_work_ptr)
    else:
        valid = w >= 0
    req = tl.load(work_ptr + w, mask=valid, other=0)
    start = tl.load(work_ptr + work_cap + w, mask=valid, other=0)
    end = tl.load(work_ptr + 2 * work_cap + w, mask=valid, other=0)
    split = tl.load(work_ptr + 3 * work_cap + w, mask=valid, other=0)
    end = tl.where(valid, end, start)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < GROUP
    mask_d = offs_d < HEAD_DIM
    mask_md = mask_m[:, None] & mask_d[None, :]
    heads = g * GROUP + offs_m
    req64 = req.to(tl.int64)
    g64 = g.to(tl.int64)

    q_row = q_ptr + req64 * stride_qb + heads[:, None].to(tl.int64) * stride_qh
    b_q = tl.load(q_row + offs_d[None, :], mask=mask_md, other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_D]
    if POS_MODE == 1:
        HALF: tl.constexpr = HEAD_DIM // 2
        offs_rot = (offs_d + HALF) % HEAD_DIM
        sign = tl.where(offs_d < HALF, -1.0, 1.0)
        freq = tl.load(rope_freq_ptr + offs_d % HALF, mask=mask_d, other=0.0)  # [BLOCK_D]
        kv_len = tl.load(kv_lens_ptr + req, mask=valid, other=0)
        cos_q, sin_q = _cos_sin((kv_len - 1).to(tl.float32) * freq, INTERPRET)
        b_q_rot = tl.load(q_row + offs_rot[None, :], mask=mask_md, other=0.0).to(tl.float32)
        b_q = b_q * cos_q[None, :] + sign[None, :] * b_q_rot * sin_q[None, :]
    if POS_MODE == 2:
        slope = tl.load(alibi_ptr + heads, mask=mask_m, other=0.0) * LOG2E  # [BLOCK_M]
    if USE_DOT:
        b_q_c = b_q.to(COMPUTE_DTYPE)

    seq_base = tl.load(kv_indptr_ptr + req, mask=valid, other=0).to(tl.int64)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        mask_nd = mask_n[:, None] & mask_d[None, :]
        page, slot = _kv_locate(kv_indices_ptr, seq_base, offs_n, mask_n, PAGE_SIZE, PAGED)
        k_off = _kv_offsets(page, slot, g64, stride_kp, stride_ks, stride_kh)
        b_k = tl.load(k_ptr + k_off[:, None] + offs_d[None, :], mask=mask_nd, other=0.0)  # [BLOCK_N, BLOCK_D]
        if POS_MODE == 1:
            b_k_rot = tl.load(k_ptr + k_off[:, None] + offs_rot[None, :], mask=mask_nd, other=0.0)
            cos_k, sin_k = _cos_sin(offs_n.to(tl.float32)[:, None] * freq[None, :], INTERPRET)
            b_k = b_k.to(tl.float32) * cos_k + sign[None, :] * b_k_rot.to(tl.float32) * sin_k
        if USE_DOT:
            if INTERPRET:
                b_k = b_k.to(tl.float32)
            s = tl.dot(b_q_c, tl.trans(b_k.to(COMPUTE_DTYPE)))  # [BLOCK_M, BLOCK_N]
        else:
            s = tl.sum(b_q[:, None, :] * b_k.to(tl.float32)[None, :, :], axis=2)
        if SOFT_CAP:
            s = (soft_cap * LOG2E) * _tanh(s * (qk_scale / soft_cap))
        else:
            s = s * (qk_scale * LOG2E)
        if POS_MODE == 2:
            s += slope[:, None] * offs_n.to(tl.float32)[None, :]
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_off = _kv_offsets(page, slot, g64, stride_vp, stride_vs, stride_vh)
        b_v = tl.load(v_ptr + v_off[:, None] + offs_d[None, :], mask=mask_nd, other=0.0)  # [BLOCK_N, BLOCK_D]
        if USE_DOT:
            if INTERPRET:
                b_v = b_v.to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE_DTYPE), b_v.to(COMPUTE_DTYPE))
        else:
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * b_v.to(tl.float32)[None, :, :], axis=1)
        m_i = m_new

    has_key = l_i > 0
    o = acc / tl.where(has_key, l_i, 1.0)[:, None] * v_scale
    lse = tl.where(has_key, m_i + tl.log2(tl.where(has_key, l_i, 1.0)), float("-inf"))
    direct = valid & (split == 0)
    partial = valid & (split != 0)
    o_ptrs = o_ptr + req64 * stride_ob + heads[:, None].to(tl.int64) * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=mask_md & direct)
    if HAS_LSE:
        tl.store(lse_ptr + req64 * stride_lb + heads.to(tl.int64) * stride_lh, lse, mask=mask_m & direct)
    part_row = w.to(tl.int64) * NUM_QO_HEADS + heads.to(tl.int64)  # [BLOCK_M]
    tl.store(part_o_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=mask_md & partial)
    tl.store(part_lse_ptr + part_row, lse, mask=mask_m & partial)
