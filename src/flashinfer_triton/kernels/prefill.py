"""Prefill / append attention: ragged queries over paged or ragged keys and values.

For one query row ``i`` (token ``i`` of its request, one query head) and the keys ``j`` it may see::

    s_ij = (q_i . k_j) * sm_scale            (then ALiBi bias, soft cap, mask; with both, the cap is
                                              cap * tanh(sm_scale * s_ij / cap), as FlashInfer)
    o_i  = sum_j 2**(s_ij*log2e - m_i) v_j / l_i,      l_i = sum_j 2**(s_ij*log2e - m_i)
    lse_i = m_i + log2(l_i)                  (base 2, FlashInfer's convention)

computed as an online softmax in base 2 over KV tiles of ``BLOCK_N`` keys, with ``log2(e) * sm_scale``
folded into one multiply before ``exp2``. A program owns one work item (request, a run of query tokens,
a KV range) for one KV head; the query heads of that KV head are packed into the tile's rows
(row ``r`` = token ``r // GROUP``, head ``r % GROUP``), so one K/V tile load serves the whole group.

The KV range is cut in three loops: a masked head (sliding-window edge), an unmasked body (keys every
row sees: no mask arithmetic), and a masked tail (causal diagonal, the end of the KV range). Tiles no
row sees are never visited: the planner clips the range per query tile on the host. A custom mask
is walked as the planner's runs of KV tiles holding a set bit (empty tiles are never visited; runs whose
bits are all set load no mask bits). When the planner split the KV range of a tile, the program writes a partial
state (o normalized, lse) that ``_merge_partials_kernel`` combines (merging inside the attention launch, the
last piece to finish merging its tile, measured slower where splits matter: the last pieces' merges ran on a
fraction of the SMs at the end of the launch).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._work_row import REQ_AT, WORK_FIELDS
from ._math import cos_sin, finish_state, max_finite, tanh, weighted

_ROW: tl.constexpr = tl.constexpr(WORK_FIELDS)
_REQ: tl.constexpr = tl.constexpr(REQ_AT)

LOG2E = 1.4426950408889634


@triton.jit
def _rope(x, x_rot, pos, offs_d, HALF: tl.constexpr, rope_rcp_scale, rope_log2_theta, HEAD_DIM: tl.constexpr):
    """Rotate-half RoPE of rows ``x`` at positions ``pos``; ``x_rot`` is ``x`` with halves swapped."""
    t = tl.where(offs_d < HALF, offs_d, offs_d - HALF).to(tl.float32)
    freq = tl.exp2(t * (-2.0 / HEAD_DIM) * rope_log2_theta) * rope_rcp_scale  # [BLOCK_D]
    angle = pos.to(tl.float32)[:, None] * freq[None, :]
    sign = tl.where(offs_d < HALF, -1.0, 1.0)
    cos_a, sin_a = cos_sin(angle)
    return x * cos_a + sign[None, :] * x_rot * sin_a


@triton.jit
def _tile_pages(page_tab_ptr, start, offs_n, ke, ok, PAGE_SIZE: tl.constexpr):
    """Page number of every key ``start + offs_n`` of a tile (0 past ``ke`` or when not ``ok``)."""
    offs = start + offs_n
    return tl.load(page_tab_ptr + offs // PAGE_SIZE, mask=ok & (offs < ke), other=0)


@triton.jit
def _attn_tiles(
    acc,
    l_i,
    m_i,
    b_q,
    lo,
    hi,
    ke,
    k_ptr,
    v_ptr,
    kv_row0,
    page_tab_ptr,
    stride_kp,
    stride_ks,
    stride_vp,
    stride_vs,
    offs_n,
    offs_d,
    q_tok,
    row_valid,
    delta,
    window_left,
    qk_scale,
    soft_cap,
    slope,
    mask_ptr,
    row_bit,
    load_bits,
    rope_rcp_scale,
    rope_log2_theta,
    k_desc,
    v_desc,
    kvh,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    CUSTOM_MASK: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr,
    ROPE: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_F32: tl.constexpr,
    USE_TMA: tl.constexpr,
    FOLD_SCALE: tl.constexpr = False,
    PAGE_INV: tl.constexpr = False,
    KV_SHARED: tl.constexpr = False,
    KV_I32: tl.constexpr = False,
):
    """Online-softmax update of (acc, l_i, m_i) over the KV tiles starting at lo, lo + BLOCK_N, ... < hi.
    Paged: the page numbers of the next tile are read one iteration ahead into registers, so the K/V copies do
    not wait on an index load issued in the same pipeline stage. ``PAGE_INV`` (paged, BLOCK_N a multiple of the
    page size): ``lo`` is a multiple of BLOCK_N (the planner starts every work item, split
    chunk and custom-mask run on a KV-tile boundary), so every tile starts on a page boundary: each key row's
    slot offset and page-table offset are fixed before the loop, and a tile costs one page-number load and
    one multiply-add per row; ``KV_SHARED`` (K and V have equal page / slot strides): one offset per row
    serves both; ``KV_I32``: the offsets fit in 32 bits (the caller checked the cache's extent).
    """
    mask_d = offs_d < HEAD_DIM
    INV: tl.constexpr = PAGE_INV
    if INV:
        tl.static_assert(PAGED and BLOCK_N % PAGE_SIZE == 0)
        pg_rel = offs_n // PAGE_SIZE  # [BLOCK_N] page of each key row within a tile
        slot_r = offs_n % PAGE_SIZE
        if KV_I32:
            slot_k = slot_r * stride_ks
            slot_v = slot_r * stride_vs
        else:
            slot_k = slot_r.to(tl.int64) * stride_ks
            slot_v = slot_r.to(tl.int64) * stride_vs
        page_nx = tl.load(page_tab_ptr + lo // PAGE_SIZE + pg_rel, mask=(lo < hi) & (lo + offs_n < ke), other=0)
    elif PAGED:
        page_nx = _tile_pages(page_tab_ptr, lo, offs_n, ke, lo < hi, PAGE_SIZE)
    for start in range(lo, hi, BLOCK_N):
        offs_j = start + offs_n  # [BLOCK_N]
        in_range = offs_j < ke
        if INV:
            page = page_nx
            nxt = start + BLOCK_N
            page_nx = tl.load(page_tab_ptr + nxt // PAGE_SIZE + pg_rel, mask=nxt + offs_n < ke, other=0)
            if KV_I32:
                k_off = page * stride_kp + slot_k
            else:
                k_off = page.to(tl.int64) * stride_kp + slot_k
            if KV_SHARED:
                v_off = k_off
            elif KV_I32:
                v_off = page * stride_vp + slot_v
            else:
                v_off = page.to(tl.int64) * stride_vp + slot_v
        elif PAGED:
            page = page_nx.to(tl.int64)
            page_nx = _tile_pages(page_tab_ptr, start + BLOCK_N, offs_n, ke, True, PAGE_SIZE)
            slot = (offs_j % PAGE_SIZE).to(tl.int64)
            k_off = page * stride_kp + slot * stride_ks
            v_off = page * stride_vp + slot * stride_vs
        else:
            tok = kv_row0 + offs_j.to(tl.int64)
            k_off = tok * stride_kp
            v_off = tok * stride_vp
        k_ptrs = k_ptr + k_off[:, None] + offs_d[None, :]
        v_ptrs = v_ptr + v_off[:, None] + offs_d[None, :]
        if MASKED:
            ld_mask = in_range[:, None] & mask_d[None, :]
        if USE_TMA:
            # Rows past this request's range hold other requests' keys (or TMA zeros): masked below.
            b_k = tl.reshape(k_desc.load([(kv_row0 + start).to(tl.int32), kvh, 0]), [BLOCK_N, BLOCK_D])
        elif MASKED:
            b_k = tl.load(k_ptrs, mask=ld_mask, other=0.0)
        elif BLOCK_D != HEAD_DIM:
            b_k = tl.load(k_ptrs, mask=mask_d[None, :], other=0.0)
        else:
            b_k = tl.load(k_ptrs)
        if ROPE:
            HALF: tl.constexpr = HEAD_DIM // 2
            offs_rot = tl.where(offs_d < HALF, offs_d + HALF, offs_d - HALF)
            rot_ptrs = k_ptr + k_off[:, None] + offs_rot[None, :]
            if MASKED:
                b_k2 = tl.load(rot_ptrs, mask=ld_mask, other=0.0)
            else:
                b_k2 = tl.load(rot_ptrs, mask=mask_d[None, :], other=0.0)
            b_kf = _rope(
                b_k.to(tl.float32), b_k2.to(tl.float32), offs_j, offs_d, HALF, rope_rcp_scale, rope_log2_theta, HEAD_DIM
            )
            b_k = b_kf.to(b_q.dtype)
        elif DOT_F32:
            b_k = b_k.to(tl.float32)
        else:
            b_k = b_k.to(b_q.dtype)
        qk = tl.dot(b_q, tl.trans(b_k))  # [BLOCK_M, BLOCK_N] float32
        if FOLD_SCALE:
            # qk_scale > 0 and no score transform: the row maximum of qk scaled is the scaled maximum, and
            # the exponent below is one FMA per score (qk * qk_scale - m).
            s = qk
        elif SOFTCAP or ALIBI:
            x = qk * qk_scale
            if ALIBI:
                x = x + slope[:, None] * (offs_j[None, :] - q_tok[:, None]).to(tl.float32)
                if SOFTCAP:
                    # FlashInfer's order: bias first, then sm_scale once more inside the cap
                    x = soft_cap * tanh(x * (qk_scale / soft_cap))
            elif SOFTCAP:
                x = soft_cap * tanh(x / soft_cap)
            s = x * 1.4426950408889634
        else:
            s = qk * qk_scale
        if MASKED:
            vis = in_range[None, :] & row_valid[:, None]
            diag = q_tok + delta  # [BLOCK_M]
            if CUSTOM_MASK:
                bit = row_bit[:, None] + offs_j[None, :]  # row_bit = token * kv_len (int32 or int64)
                # load_bits False (a run whose bits are all set): no loads, 0xFF keeps every key visible.
                byte = tl.load(mask_ptr + (bit >> 3), mask=vis & load_bits, other=255).to(tl.int32)
                vis = vis & (((byte >> (bit & 7).to(tl.int32)) & 1) != 0)
            elif CAUSAL:
                vis = vis & (offs_j[None, :] <= diag[:, None])
            if WINDOW:
                vis = vis & (offs_j[None, :] >= (diag - window_left)[:, None])
            s = tl.where(vis, s, float("-inf"))
        if FOLD_SCALE:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASKED:
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        if FOLD_SCALE:
            x = s * qk_scale - m_use[:, None]
        else:
            x = s - m_use[:, None]
        p = tl.exp2(x)
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if USE_TMA:
            b_v = tl.reshape(v_desc.load([(kv_row0 + start).to(tl.int32), kvh, 0]), [BLOCK_N, BLOCK_D])
        elif MASKED:
            b_v = tl.load(v_ptrs, mask=ld_mask, other=0.0)
        elif BLOCK_D != HEAD_DIM:
            b_v = tl.load(v_ptrs, mask=mask_d[None, :], other=0.0)
        else:
            b_v = tl.load(v_ptrs)
        if DOT_F32:
            acc = tl.dot(p, b_v.to(tl.float32), acc)
        else:
            acc = tl.dot(p.to(b_q.dtype), b_v.to(b_q.dtype), acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    lse_ptr,
    part_o_ptr,
    part_lse_ptr,
    work_ptr,
    num_work_ptr,
    kv_indices_ptr,
    mask_ptr,
    mask_indptr_ptr,
    alibi_ptr,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    qk_scale,
    v_scale,
    soft_cap,
    window_left,
    rope_rcp_scale,
    rope_log2_theta,
    k_desc,
    v_desc,
    blk_ptr,
    NUM_QO_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILE_T: tl.constexpr,
    PAGED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    CUSTOM_MASK: tl.constexpr,
    SOFTCAP: tl.constexpr,
    ALIBI: tl.constexpr,
    ROPE: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    HAS_SPLIT: tl.constexpr,
    DOT_F32: tl.constexpr,
    USE_TMA: tl.constexpr,
    MASK_I64: tl.constexpr,
    FOLD_SCALE: tl.constexpr = False,
    PAGE_INV: tl.constexpr = False,
    KV_SHARED: tl.constexpr = False,
    KV_I32: tl.constexpr = False,
    PDL_TRIGGER: tl.constexpr = False,
):
    """One work item (request, TILE_T query tokens x GROUP heads, KV range) for one KV head."""
    if PDL_TRIGGER:
        # The partial merge is launched as a programmatic dependent: once every program of this launch has
        # started, its programs may take the free SM room and wait there (gdc_wait) for this launch's end.
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    if pid >= tl.load(num_work_ptr):
        return
    # (the row's layout: _work_row; the request's scalars ride in it)
    w = work_ptr + pid * _ROW
    b = tl.load(w)
    t0 = tl.load(w + 1)
    ks = tl.load(w + 2)
    ke = tl.load(w + 3)
    prow0 = tl.load(w + 4)
    pstride = tl.load(w + 5)
    qo_start = tl.load(w + _REQ)
    qo_len = tl.load(w + (_REQ + 1))
    kv_len = tl.load(w + (_REQ + 2))
    kv_first = tl.load(w + (_REQ + 3))
    delta = kv_len - qo_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    q_tok = t0 + offs_m // GROUP  # [BLOCK_M] token index within the request
    head = kvh * GROUP + offs_m % GROUP  # [BLOCK_M] query head
    row_valid = (offs_m < TILE_T * GROUP) & (q_tok < qo_len)
    q_row = (qo_start + q_tok).to(tl.int64)
    q_ptrs = q_ptr + q_row[:, None] * stride_qt + head.to(tl.int64)[:, None] * stride_qh + offs_d[None, :]
    q_mask = row_valid[:, None] & mask_d[None, :]
    b_q = tl.load(q_ptrs, mask=q_mask, other=0.0)
    if ROPE:
        HALF: tl.constexpr = HEAD_DIM // 2
        offs_rot = tl.where(offs_d < HALF, offs_d + HALF, offs_d - HALF)
        rot_ptrs = q_ptr + q_row[:, None] * stride_qt + head.to(tl.int64)[:, None] * stride_qh + offs_rot[None, :]
        b_q2 = tl.load(rot_ptrs, mask=q_mask, other=0.0)
        b_qf = _rope(
            b_q.to(tl.float32),
            b_q2.to(tl.float32),
            q_tok + delta,
            offs_d,
            HALF,
            rope_rcp_scale,
            rope_log2_theta,
            HEAD_DIM,
        )
        if DOT_F32:
            b_q = b_qf
        else:
            b_q = b_qf.to(b_q.dtype)
    elif DOT_F32:
        b_q = b_q.to(tl.float32)

    if ALIBI:
        slope = tl.load(alibi_ptr + head)
    else:
        slope = tl.zeros([BLOCK_M], dtype=tl.float32)
    if CUSTOM_MASK:
        mask_base = mask_ptr + tl.load(mask_indptr_ptr + b).to(tl.int64)
    else:
        mask_base = mask_ptr
    if MASK_I64:
        row_bit = q_tok.to(tl.int64) * kv_len
    else:
        row_bit = q_tok * kv_len

    k_base = k_ptr + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + kvh.to(tl.int64) * stride_vh
    if PAGED:
        page_tab = kv_indices_ptr + kv_first
        kv_row0 = 0
    else:
        page_tab = kv_indices_ptr
        kv_row0 = kv_first.to(tl.int64)

    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)

    # Cut [ks, ke) into a masked head (window edge), an unmasked body and a masked tail (diagonal, end).
    # A custom mask instead walks the planner's list of KV tiles with set bits: [ks, ke) / BLOCK_N index it.
    t_hi = tl.minimum(t0 + TILE_T, qo_len) - 1
    if CUSTOM_MASK:
        # Runs of consecutive KV tiles with a set bit (planner): (first key * 2 + all-set, end key) pairs.
        # One masked loop per run (one set of pipeline buffers); an all-set run loads no mask bits.
        for r in range(ks // BLOCK_N, ke // BLOCK_N):
            run0 = tl.load(blk_ptr + 2 * r)
            run_lo = run0 >> 1
            run_hi = tl.load(blk_ptr + 2 * r + 1)
            acc, l_i, m_i = _attn_tiles(
                acc, l_i, m_i, b_q, run_lo, run_hi, kv_len, k_base, v_base, kv_row0, page_tab,
                stride_kp, stride_ks, stride_vp, stride_vs, offs_n, offs_d, q_tok, row_valid, delta, window_left,
                qk_scale, soft_cap, slope, mask_base, row_bit, (run0 & 1) == 0, rope_rcp_scale, rope_log2_theta,
                k_desc, v_desc, kvh, True, CAUSAL, WINDOW, CUSTOM_MASK, SOFTCAP, ALIBI, ROPE, PAGED, PAGE_SIZE,
                BLOCK_N, HEAD_DIM, BLOCK_D, DOT_F32, USE_TMA, FOLD_SCALE, PAGE_INV, KV_SHARED, KV_I32,
            )  # fmt: skip
    else:
        lead_end = ks
        if WINDOW:
            need = t_hi + delta - window_left - ks
            if need > 0:
                lead_end = tl.minimum(ks + tl.cdiv(need, BLOCK_N) * BLOCK_N, ke)
        body_lim = ke
        if CAUSAL:
            body_lim = tl.minimum(ke, t0 + delta + 1)
        body_end = lead_end + tl.maximum(body_lim - lead_end, 0) // BLOCK_N * BLOCK_N
        if WINDOW:
            acc, l_i, m_i = _attn_tiles(
                acc, l_i, m_i, b_q, ks, lead_end, ke, k_base, v_base, kv_row0, page_tab,
                stride_kp, stride_ks, stride_vp, stride_vs, offs_n, offs_d, q_tok, row_valid, delta, window_left,
                qk_scale, soft_cap, slope, mask_base, row_bit, True, rope_rcp_scale, rope_log2_theta, k_desc, v_desc, kvh,
                True, CAUSAL, WINDOW, CUSTOM_MASK, SOFTCAP, ALIBI, ROPE, PAGED, PAGE_SIZE, BLOCK_N,
                HEAD_DIM, BLOCK_D, DOT_F32, USE_TMA, FOLD_SCALE, PAGE_INV, KV_SHARED, KV_I32,
            )  # fmt: skip
        acc, l_i, m_i = _attn_tiles(
            acc, l_i, m_i, b_q, lead_end, body_end, ke, k_base, v_base, kv_row0, page_tab,
            stride_kp, stride_ks, stride_vp, stride_vs, offs_n, offs_d, q_tok, row_valid, delta, window_left,
            qk_scale, soft_cap, slope, mask_base, row_bit, True, rope_rcp_scale, rope_log2_theta, k_desc, v_desc, kvh,
            False, CAUSAL, WINDOW, CUSTOM_MASK, SOFTCAP, ALIBI, ROPE, PAGED, PAGE_SIZE, BLOCK_N,
            HEAD_DIM, BLOCK_D, DOT_F32, USE_TMA, FOLD_SCALE, PAGE_INV, KV_SHARED, KV_I32,
        )  # fmt: skip
        acc, l_i, m_i = _attn_tiles(
            acc, l_i, m_i, b_q, body_end, ke, ke, k_base, v_base, kv_row0, page_tab,
            stride_kp, stride_ks, stride_vp, stride_vs, offs_n, offs_d, q_tok, row_valid, delta, window_left,
            qk_scale, soft_cap, slope, mask_base, row_bit, True, rope_rcp_scale, rope_log2_theta, k_desc, v_desc, kvh,
            True, CAUSAL, WINDOW, CUSTOM_MASK, SOFTCAP, ALIBI, ROPE, PAGED, PAGE_SIZE, BLOCK_N,
            HEAD_DIM, BLOCK_D, DOT_F32, USE_TMA, FOLD_SCALE, PAGE_INV, KV_SHARED, KV_I32,
        )  # fmt: skip

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    o = acc * (v_scale / l_safe)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(l_safe))
    o_mask = row_valid[:, None] & mask_d[None, :]
    to_partial = False
    if HAS_SPLIT:
        to_partial = prow0 >= 0
    if to_partial:
        p_row = (prow0 + (q_tok - t0) * pstride).to(tl.int64) * NUM_QO_HEADS + head
        tl.store(
            part_o_ptr + p_row[:, None] * HEAD_DIM + offs_d[None, :], o.to(part_o_ptr.dtype.element_ty), mask=o_mask
        )
        tl.store(part_lse_ptr + p_row, lse, mask=row_valid)
    else:
        o_ptrs = o_ptr + q_row[:, None] * stride_ot + head.to(tl.int64)[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=o_mask)
        if WRITE_LSE:
            l_ptrs = lse_ptr + q_row * stride_lt + head.to(tl.int64) * stride_lh
            tl.store(l_ptrs, lse, mask=row_valid)


@triton.jit
def _load_partial(part_o_ptr, part_lse_ptr, prow0, k, num, h2, cols, mask_h, mask_c, NUM_QO_HEADS, HEAD_DIM):
    """Split ``k``'s lse ``[ROWS, 1]`` and values ``[ROWS, VEC]`` of a partial-merge tile (-inf / 0 past ``num``)."""
    live = k < num
    row = (prow0 + k).to(tl.int64) * NUM_QO_HEADS + h2
    lse = tl.load(part_lse_ptr + row, mask=mask_h & live, other=float("-inf"))
    o = tl.load(part_o_ptr + (row * HEAD_DIM + cols), mask=mask_c & live, other=0.0).to(tl.float32)
    return lse, o


@triton.jit
def _merge_partials_kernel(
    part_o_ptr,
    part_lse_ptr,
    merge_ptr,
    num_merge_ptr,
    o_ptr,
    lse_ptr,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    NUM_QO_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    PDL_WAIT: tl.constexpr = False,
):
    """Merge the split-KV partial states of one query row (the heads of one block) into out / lse.

    The ``BLOCK_H x BLOCK_D`` values are ``[ROWS, 4]`` tiles, a row = 4 consecutive columns of one head, so
    the split's lse of a row is a ``[ROWS, 1]`` tile laid out as the rows of the values (one load and one
    exp2 per thread and split, no data from other threads). One pass, online, eight splits per step: their
    loads do not depend on the running maximum and are all in flight together (one L2 round trip per eight
    splits; the loop is latency-bound). PDL_WAIT: launched as a programmatic dependent of the attention
    launch, whose programs all arrive before this kernel's start; wait for its results here."""
    if PDL_WAIT:
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    if pid >= tl.load(num_merge_ptr):
        return
    out_row = tl.load(merge_ptr + pid * 3).to(tl.int64)
    prow0 = tl.load(merge_ptr + pid * 3 + 1)
    num = tl.load(merge_ptr + pid * 3 + 2)
    VEC: tl.constexpr = 4
    ROWS: tl.constexpr = BLOCK_H * BLOCK_D // VEC
    offs_row = tl.arange(0, ROWS)
    h = tl.program_id(1) * BLOCK_H + offs_row // (BLOCK_D // VEC)  # [ROWS] query head
    cols = ((offs_row % (BLOCK_D // VEC)) * VEC)[:, None] + tl.arange(0, VEC)[None, :]  # [ROWS, VEC]
    mask_h = (h < NUM_QO_HEADS)[:, None]  # [ROWS, 1]
    mask_c = mask_h & (cols < HEAD_DIM)
    h2 = h[:, None]
    m = tl.full([ROWS, 1], float("-inf"), dtype=tl.float32)
    s = tl.zeros([ROWS, 1], dtype=tl.float32)
    acc = tl.zeros([ROWS, VEC], dtype=tl.float32)
    # Eight splits per step, every load written before any use (ptxas keeps that order: with the loads
    # interleaved with the arithmetic, each split's exp2 waited for its load before the next was issued).
    for k0 in range(0, num, 8):
        l0, o0 = _load_partial(
            part_o_ptr, part_lse_ptr, prow0, k0, num, h2, cols, mask_h, mask_c, NUM_QO_HEADS, HEAD_DIM
        )
        l1, o1 = _load_partial(
            part_o_ptr, part_lse_ptr, prow0, k0 + 1, num, h2, cols, mask_h, mask_c, NUM_QO_HEADS, HEAD_DIM
        )
        l2, o2 = _load_partial(
            part_o_ptr, part_lse_ptr, prow0, k0 + 2, num, h2, cols, mask_h, mask_c, NUM_QO_HEADS, HEAD_DIM
        )
        l3, o3 = _load_partial(
            part_o_ptr, part_lse_ptr, prow0, k0 + 3, num, h2, cols, mask_h, mask_c, NUM_QO_HEADS, HEAD_DIM
        )
        l4, o4 = _load_partial(
            part_o_ptr, part_lse_ptr, prow0, k0 + 4, num, h2, cols, mask_h, mask_c, NUM_QO_HEADS, HEAD_DIM
        )
        l5, o5 = _load_partial(
            part_o_ptr, part_lse_ptr, prow0, k0 + 5, num, h2, cols, mask_h, mask_c, NUM_QO_HEADS, HEAD_DIM
        )
        l6, o6 = _load_partial(
            part_o_ptr, part_lse_ptr, prow0, k0 + 6, num, h2, cols, mask_h, mask_c, NUM_QO_HEADS, HEAD_DIM
        )
        l7, o7 = _load_partial(
            part_o_ptr, part_lse_ptr, prow0, k0 + 7, num, h2, cols, mask_h, mask_c, NUM_QO_HEADS, HEAD_DIM
        )
        m_new = tl.maximum(
            tl.maximum(tl.maximum(tl.maximum(m, l0), tl.maximum(l1, l2)), tl.maximum(l3, l4)),
            tl.maximum(tl.maximum(l5, l6), l7),
        )
        m_use = max_finite(m_new)  # no -inf - -inf while every state is empty
        alpha = tl.exp2(m - m_use)
        # weights: 0 for an empty split (lse -inf) and past `num`; `weighted` drops those splits' values
        w0, w1, w2, w3 = tl.exp2(l0 - m_use), tl.exp2(l1 - m_use), tl.exp2(l2 - m_use), tl.exp2(l3 - m_use)
        w4, w5, w6, w7 = tl.exp2(l4 - m_use), tl.exp2(l5 - m_use), tl.exp2(l6 - m_use), tl.exp2(l7 - m_use)
        acc = (
            acc * alpha
            + ((weighted(o0, w0) + weighted(o1, w1)) + (weighted(o2, w2) + weighted(o3, w3)))
            + ((weighted(o4, w4) + weighted(o5, w5)) + (weighted(o6, w6) + weighted(o7, w7)))
        )
        s = s * alpha + ((w0 + w1) + (w2 + w3)) + ((w4 + w5) + (w6 + w7))
        m = m_new
    out, lse_out = finish_state(acc, s, m, False)  # [ROWS, 1] sums: the lse keeps that shape
    o_ptrs = o_ptr + out_row * stride_ot + h2.to(tl.int64) * stride_oh + cols
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=mask_c)
    if WRITE_LSE:
        first = (offs_row % (BLOCK_D // VEC) == 0)[:, None]  # one row of each head writes its lse
        tl.store(lse_ptr + out_row * stride_lt + h2.to(tl.int64) * stride_lh, lse_out, mask=mask_h & first)


@triton.jit
def _mask_tiles_kernel(
    mask_ptr,
    mask_indptr_ptr,
    qo_indptr_ptr,
    kv_lens_ptr,
    tile_ptr,
    out_ptr,
    n_blk,
    TILE_T: tl.constexpr,
    TILE_TP: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Plan-time pre-pass: for one (query tile, KV tile), 0 = no set bit, 1 = some, 2 = every in-range bit set.

    ``tile_ptr`` holds (request, first token) per query tile; bits are FlashInfer's packed custom mask
    (little bit order, bit ``i * kv_len + j`` of the request's segment).
    """
    pid = tl.program_id(0)
    tile = pid // n_blk
    blk = pid % n_blk
    b = tl.load(tile_ptr + tile * 2)
    t0 = tl.load(tile_ptr + tile * 2 + 1)
    qo_len = tl.load(qo_indptr_ptr + b + 1) - tl.load(qo_indptr_ptr + b)
    kv_len = tl.load(kv_lens_ptr + b)
    base = mask_ptr + tl.load(mask_indptr_ptr + b).to(tl.int64)
    offs_t = t0 + tl.arange(0, TILE_TP)
    offs_j = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = ((offs_t < t0 + TILE_T) & (offs_t < qo_len))[:, None] & (offs_j < kv_len)[None, :]
    bit = offs_t.to(tl.int64)[:, None] * kv_len + offs_j[None, :]
    byte = tl.load(base + (bit >> 3), mask=valid, other=0).to(tl.int32)
    on = (byte >> (bit & 7).to(tl.int32)) & 1
    ones = tl.sum(tl.sum(on, 1), 0)
    cnt = tl.sum(tl.sum(valid.to(tl.int32), 1), 0)
    cls = tl.where(ones == 0, 0, tl.where(ones == cnt, 2, 1))
    tl.store(out_ptr + tile.to(tl.int64) * n_blk + blk, cls.to(tl.int8))
