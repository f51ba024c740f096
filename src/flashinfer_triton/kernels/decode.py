"""Batch decode attention: one query per request, the GQA group packed into the tile's rows.

One program handles one work item (request ``b``, key range ``[start, end)``) for one KV head ``g``;
its rows are the query heads ``h = g * GROUP + r`` (``r < GROUP``), so each K/V tile is loaded once
for the whole group. For key ``j`` the score is

    s_hj = (q_h . k_j) * sm_scale                     (q, k rotated first under ROPE_LLAMA)
    s_hj = s_hj + slope_h * j                         (ALIBI, decode query index 0)
    s_hj = cap * tanh(s_hj / cap)                     (logits_soft_cap > 0; with ALiBi FlashInfer caps
                                                       cap * tanh(sm_scale * s_hj / cap), bias included)

kept in base 2 (times log2 e) for an online softmax over the key tiles:

    m' = max(m, max_j s_j),  l' = l 2^(m - m') + sum_j 2^(s_j - m'),
    acc' = acc 2^(m - m') + sum_j 2^(s_j - m') v_j

The state written is ``o = acc / l * v_scale`` and ``lse = m + log2(l)`` (``o = 0``, ``lse = -inf``
when the range is empty): straight into the output when the request is not split, else into the
partial buffer (row ``work index``), which ``kernels/merge.py`` reduces.

KV addressing lives in ``_kv_locate`` (token -> page, slot) and ``_kv_offsets`` (-> element offset of
its row of ``D`` values).

vLLM's paged layout has its own kernel, ``kernels/vllm_decode.py``; both merge split requests with
``merge.merge_group``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._math import cos_sin, tanh
from .merge import merge_group

# log2(e) = 1.4426950408889634 and ln(2) = 0.6931471805599453 are written as literals in the kernels: a
# global constexpr is compared on every launch by Triton's changed-globals check (~0.5 us of host time each).


@triton.jit
def _kv_locate(
    kv_indices_ptr, seq_base, offs_n, mask_n, PAGE_SIZE: tl.constexpr, PAGED: tl.constexpr, MASKED: tl.constexpr = True
):
    """(page, slot) of tokens ``offs_n`` of the request whose table starts at ``seq_base``, int64
    (``MASKED`` False: every token of the tile is live, the page numbers are loaded without a mask)."""
    if PAGED:
        # The physical page is looked up per token, so the tile does not depend on the page size.
        if MASKED:
            page = tl.load(kv_indices_ptr + seq_base + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
        else:
            page = tl.load(kv_indices_ptr + seq_base + offs_n // PAGE_SIZE).to(tl.int64)
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
    """Accurate cos/sin (angles reach tens of thousands of radians at long positions), without libdevice
    (``kernels/_math.py``: the same code under the interpreter and compiled)."""
    return cos_sin(angle)


@triton.jit
def _attend_tile(
    n0, end, m_i, l_i, acc, b_q, b_q_c, kv_indices_ptr, seq_base, k_ptr, v_ptr, stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh, g64, k_d, v_d, offs_d, mask_d, offs_rot, freq, sign, slope, pos0, qk_scale,
    soft_cap,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    PAGED: tl.constexpr, USE_DOT: tl.constexpr, SOFT_CAP: tl.constexpr, POS_MODE: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr, INTERPRET: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """One key tile ``[n0, n0 + BLOCK_N)`` of the online softmax; keys at or past ``end`` are masked when
    ``MASKED`` (without it every key of the tile must be below ``end``). Returns the new (m, l, acc)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if MASKED:
        mask_n = offs_n < end
    else:
        mask_n = offs_n >= 0  # only for the index loads: every key of the tile is live
    if MASKED:
        mask_nd = mask_n[:, None] & mask_d[None, :]
    else:
        mask_nd = mask_d[None, :]
    page, slot = _kv_locate(kv_indices_ptr, seq_base, offs_n, mask_n, PAGE_SIZE, PAGED, MASKED)
    k_off = _kv_offsets(page, slot, g64, stride_kp, stride_ks, stride_kh)
    if not MASKED and BLOCK_D == HEAD_DIM:
        b_k = tl.load(k_ptr + k_off[:, None] + k_d[None, :])  # [BLOCK_N, BLOCK_D], every key live
    else:
        b_k = tl.load(k_ptr + k_off[:, None] + k_d[None, :], mask=mask_nd, other=0.0)  # [BLOCK_N, BLOCK_D]
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
    if SOFT_CAP and POS_MODE == 2:
        # FlashInfer's order: the bias joins the scaled score, then sm_scale applies once more inside the cap
        # (slope carries log2(e): divide it out to stay in natural-log units until the cap).
        x = s * qk_scale + (slope[:, None] * 0.6931471805599453) * (offs_n.to(tl.float32)[None, :] - pos0)
        s = (soft_cap * 1.4426950408889634) * tanh(x * (qk_scale / soft_cap))
    else:
        if SOFT_CAP:
            s = (soft_cap * 1.4426950408889634) * tanh(s * (qk_scale / soft_cap))
        else:
            s = s * (qk_scale * 1.4426950408889634)
        if POS_MODE == 2:
            s += slope[:, None] * (offs_n.to(tl.float32)[None, :] - pos0)
    if MASKED:
        s = tl.where(mask_n[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v_off = _kv_offsets(page, slot, g64, stride_vp, stride_vs, stride_vh)
    if not MASKED and BLOCK_D == HEAD_DIM:
        b_v = tl.load(v_ptr + v_off[:, None] + v_d[None, :])  # [BLOCK_N, BLOCK_D], every key live
    else:
        b_v = tl.load(v_ptr + v_off[:, None] + v_d[None, :], mask=mask_nd, other=0.0)  # [BLOCK_N, BLOCK_D]
    if USE_DOT:
        if INTERPRET:
            b_v = b_v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE_DTYPE), b_v.to(COMPUTE_DTYPE))
    else:
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * b_v.to(tl.float32)[None, :, :], axis=1)
    return m_new, l_i, acc


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
    # Scales read on the device (``SCALE_PTRS``); the fused split-KV merge's per-(request, KV head) arrival counters.
    k_scale_ptr=None,
    v_scale_ptr=None,
    counter_ptr=None,
    SCALE_PTRS: tl.constexpr = False,
    FUSED_MERGE: tl.constexpr = False,
    MERGE_BLOCK_K: tl.constexpr = 1,
    GROUP_P2: tl.constexpr = 1,
    WHOLE_TILES: tl.constexpr = False,
):
    """Decode attention of one work item for one KV head (all query heads of its group).
    ``WHOLE_TILES`` (CSR / contiguous addressing): the key tiles wholly below the end run without key masks
    (unmasked page-number and K/V loads, no score select), then one masked tail tile."""
    w = tl.program_id(0)
    g = tl.program_id(1)
    first = 0
    count = 1
    if CHECK_NUM_WORK:
        # CUDA-graph mode: the grid is fixed by capacity, slots past the live work exit at once.
        num_work = tl.load(num_work_ptr)
        if w >= num_work:
            return
        valid = w < num_work
    else:
        valid = w >= 0
    req = tl.load(work_ptr + w, mask=valid, other=0)
    start = tl.load(work_ptr + work_cap + w, mask=valid, other=0)
    end = tl.load(work_ptr + 2 * work_cap + w, mask=valid, other=0)
    split = tl.load(work_ptr + 3 * work_cap + w, mask=valid, other=0)
    end = tl.where(valid, end, start)
    if FUSED_MERGE:
        # The request's partial states are work rows work_indptr[req] .. work_indptr[req + 1].
        first = tl.load(work_ptr + 4 * work_cap + req, mask=valid, other=0)
        count = tl.load(work_ptr + 4 * work_cap + req + 1, mask=valid, other=0) - first
    if SCALE_PTRS:
        qk_scale = qk_scale * tl.load(k_scale_ptr).to(tl.float32)
        v_scale = v_scale * tl.load(v_scale_ptr).to(tl.float32)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < GROUP
    mask_d = offs_d < HEAD_DIM
    mask_md = mask_m[:, None] & mask_d[None, :]
    k_d = offs_d
    v_d = offs_d
    heads = g * GROUP + offs_m
    req64 = req.to(tl.int64)
    g64 = g.to(tl.int64)

    q_row = q_ptr + req64 * stride_qb + heads[:, None].to(tl.int64) * stride_qh
    mask_q = mask_md & valid
    b_q = tl.load(q_row + offs_d[None, :], mask=mask_q, other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_D]
    # Placeholders for what the tile helper reads only under some modes.
    offs_rot = offs_d
    sign = 0.0
    freq = 0.0
    slope = 0.0
    pos0 = 0.0
    b_q_c = b_q
    if POS_MODE == 1:
        HALF: tl.constexpr = HEAD_DIM // 2
        offs_rot = (offs_d + HALF) % HEAD_DIM
        sign = tl.where(offs_d < HALF, -1.0, 1.0)
        freq = tl.load(rope_freq_ptr + offs_d % HALF, mask=mask_d, other=0.0)  # [BLOCK_D]
        kv_len = tl.load(kv_lens_ptr + req, mask=valid, other=0)
        cos_q, sin_q = _cos_sin((kv_len - 1).to(tl.float32) * freq, INTERPRET)
        b_q_rot = tl.load(q_row + offs_rot[None, :], mask=mask_q, other=0.0).to(tl.float32)
        b_q = b_q * cos_q[None, :] + sign[None, :] * b_q_rot * sin_q[None, :]
    if POS_MODE == 2:
        slope = tl.load(alibi_ptr + heads, mask=mask_m, other=0.0) * 1.4426950408889634  # [BLOCK_M]
    if USE_DOT:
        b_q_c = b_q.to(COMPUTE_DTYPE)

    seq_base = tl.load(kv_indptr_ptr + req, mask=valid, other=0).to(tl.int64)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if WHOLE_TILES:
        # Whole key tiles first, without any key mask (no per-key predicates and selects), then the partial last
        # tile with masks (its unwritten slots may hold NaN: masked loads read zeros).
        end_full = start + ((end - start) // BLOCK_N) * BLOCK_N
        for n0 in range(start, end_full, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                n0, end, m_i, l_i, acc, b_q, b_q_c, kv_indices_ptr, seq_base, k_ptr, v_ptr, stride_kp,
                stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, g64, k_d, v_d, offs_d, mask_d, offs_rot,
                freq, sign, slope, pos0, qk_scale, soft_cap, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, PAGED,
                USE_DOT, SOFT_CAP, POS_MODE, COMPUTE_DTYPE, INTERPRET, False,
            )  # fmt: skip
        if end_full < end:
            m_i, l_i, acc = _attend_tile(
                end_full, end, m_i, l_i, acc, b_q, b_q_c, kv_indices_ptr, seq_base, k_ptr, v_ptr, stride_kp,
                stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, g64, k_d, v_d, offs_d, mask_d, offs_rot, freq,
                sign, slope, pos0, qk_scale, soft_cap, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, PAGED, USE_DOT,
                SOFT_CAP, POS_MODE, COMPUTE_DTYPE, INTERPRET, True,
            )  # fmt: skip
    else:
        for n0 in range(start, end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                n0, end, m_i, l_i, acc, b_q, b_q_c, kv_indices_ptr, seq_base, k_ptr, v_ptr, stride_kp, stride_ks,
                stride_kh, stride_vp, stride_vs, stride_vh, g64, k_d, v_d, offs_d, mask_d, offs_rot, freq, sign,
                slope, pos0, qk_scale, soft_cap, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, PAGED, USE_DOT, SOFT_CAP,
                POS_MODE, COMPUTE_DTYPE, INTERPRET, True,
            )  # fmt: skip

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
    if FUSED_MERGE:  # noqa: SIM102 (constexpr, then a runtime branch)
        if partial:
            # Count this (request, KV head)'s finished chunks; the last one to finish merges them all.
            # Barrier: every thread's partial stores precede the (gpu-scope, acq_rel) increment.
            tl.debug_barrier()
            c_ptr = counter_ptr + req64 * tl.num_programs(1) + g64
            done = tl.atomic_add(c_ptr, 1, sem="acq_rel", scope="gpu")
            if done == count - 1:
                tl.atomic_xchg(c_ptr, 0, sem="relaxed", scope="gpu")  # ready for the next launch
                merge_group(
                    part_o_ptr,
                    part_lse_ptr,
                    o_ptr,
                    lse_ptr,
                    first,
                    count,
                    req64,
                    g,
                    stride_ob,
                    stride_oh,
                    stride_lb,
                    stride_lh,
                    NUM_QO_HEADS,
                    GROUP,
                    GROUP_P2,
                    HEAD_DIM,
                    BLOCK_D,
                    MERGE_BLOCK_K,
                    HAS_LSE,
                )
