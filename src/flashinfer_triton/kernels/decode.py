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

KV addressing lives in ``_kv_locate`` (token -> page, slot), ``_kv_offsets`` (-> element offset of
its row of ``D`` values) and ``_d_offsets`` (-> offset of element ``d`` within that row).

``VLLM`` (constexpr) is vLLM's paged layout (``flashinfer_triton.vllm``): keys ``[blocks, Hkv, D/X,
block_size, X]`` (element ``d`` at ``(d // X) * block_size * X + d % X``), values ``[blocks, Hkv, D,
block_size]`` (element ``d`` at ``d * block_size``; the inner dimensions must be contiguous, so
every in-page offset is a compile-time multiple and loads stay 16-byte vectors), the page of token ``j`` of sequence ``b`` is
``block_tables[b, j // block_size]``. The work item comes from the program id instead of a work array:
``w = b * num_parts + p`` covers keys ``[p * PART_SIZE, min((p + 1) * PART_SIZE, seq_len))`` (the whole
sequence when ``PART_SIZE == 0``, vLLM's v1). v1 writes ``out``; v2 (``PART_SIZE > 0``) writes the
partition's state in vLLM's form straight from the online-softmax registers: ``max_logits = m`` (natural
units), ``exp_sums = sum exp(s - m)``, ``tmp_out = acc / exp_sums * v_scale``; ``_vllm_reduce_kernel``
then reduces the partitions into ``out``. ALiBi uses vLLM's position ``j - seq_len + 1``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._math import cos_sin

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
def _d_offsets(offs_d, stride_d, SPLIT_X: tl.constexpr):
    """Offset of element ``d`` of a token's row: unit stride, vLLM's split keys (``SPLIT_X > 0``:
    ``(d // X) * stride_d + d % X``) or a strided row (``SPLIT_X < 0``: ``d * stride_d``)."""
    if SPLIT_X > 0:
        off = (offs_d // SPLIT_X) * stride_d + offs_d % SPLIT_X
        return tl.max_contiguous(tl.multiple_of(off, SPLIT_X), SPLIT_X)
    elif SPLIT_X < 0:
        return offs_d * stride_d
    else:
        return offs_d


@triton.jit
def _cos_sin(angle, INTERPRET: tl.constexpr):
    """Accurate cos/sin (angles reach tens of thousands of radians at long positions), without libdevice
    (``kernels/_math.py``: the same code under the interpreter and compiled)."""
    return cos_sin(angle)


@triton.jit
def _tanh(x):
    """tanh through exp2 (no libdevice in the interpreter); saturates cleanly at +-1."""
    e = tl.exp2(x * (2.0 * 1.4426950408889634))
    return 1.0 - 2.0 / (e + 1.0)


@triton.jit
def _merge_group(
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
    NUM_QO_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MERGE_BLOCK_K: tl.constexpr,
    HAS_LSE: tl.constexpr,
    TWO_PASS: tl.constexpr = True,
):
    """Merge the ``count`` partial states (rows ``first ..``) of one request's GROUP heads of KV head ``g``
    into ``o`` / ``lse``: MERGE_BLOCK_K states per step, in base 2 (the states were just written by
    other programs: read through L2, ``.cg``). Tiles are ``[heads, D]``; a state's lse is loaded per head,
    not per column (one load and one exp2 per head and thread), and broadcast over D: every thread merges
    its own elements in registers, no cross-thread reduction. ``TWO_PASS``: the maximum lse first (lse loads
    only), then every weight is final (independent exp2s, an add chain); else online (a rescale with an
    exp2 on the chain of every state)."""
    offs_r = tl.arange(0, GROUP_P2)
    offs_d = tl.arange(0, BLOCK_D)
    mask_r = offs_r < GROUP
    mask_rd = mask_r[:, None] & (offs_d < HEAD_DIM)[None, :]
    heads = g * GROUP + offs_r  # [G] int32
    # 64-bit scalar bases, 32-bit offsets within one request's states (few registers per element).
    lse_base = part_lse_ptr + first.to(tl.int64) * NUM_QO_HEADS
    o_base = part_o_ptr + first.to(tl.int64) * (NUM_QO_HEADS * HEAD_DIM)
    o_cols = heads[:, None] * HEAD_DIM + offs_d[None, :]  # [G, D] int32
    m = tl.full([GROUP_P2], float("-inf"), dtype=tl.float32)
    den = tl.zeros([GROUP_P2], dtype=tl.float32)
    acc = tl.zeros([GROUP_P2, BLOCK_D], dtype=tl.float32)
    m_ref = m
    if TWO_PASS:  # the maximum first (lse loads only): every weight below is final, no rescaling on the chain
        for k0 in range(0, count, MERGE_BLOCK_K):
            for kk in tl.static_range(MERGE_BLOCK_K):
                live = k0 + kk < count
                row = (k0 + kk) * NUM_QO_HEADS + heads
                m = tl.maximum(
                    m, tl.load(lse_base + row, mask=mask_r & live, other=float("-inf"), cache_modifier=".cg")
                )
        m_ref = tl.where(m == float("-inf"), 0.0, m)
    # Two-pass: a state's lse is loaded as a [heads, 1] tile, so its weight is made in the accumulator's
    # layout (a [heads] vector would be converted to it through shared memory, for every state).
    heads2 = heads[:, None]
    mask_r2 = mask_r[:, None]
    m_ref2 = m_ref[:, None]
    den2 = tl.zeros([GROUP_P2, 1], dtype=tl.float32)
    for k0 in range(0, count, MERGE_BLOCK_K):
        # Unrolled: the MERGE_BLOCK_K states' loads do not depend on one another, so they are all in flight
        # together; the accumulation runs state by state in registers.
        for kk in tl.static_range(MERGE_BLOCK_K):
            live = k0 + kk < count
            v_r = tl.load(
                o_base + ((k0 + kk) * (NUM_QO_HEADS * HEAD_DIM) + o_cols), mask=mask_rd & live, other=0.0,
                cache_modifier=".cg",
            )  # fmt: skip
            # A state with no keys has lse -inf (weight 0) and o = 0; past `count` the loads give 0.
            if TWO_PASS:
                s2 = tl.load(
                    lse_base + ((k0 + kk) * NUM_QO_HEADS + heads2), mask=mask_r2 & live, other=float("-inf"),
                    cache_modifier=".cg",
                )  # fmt: skip
                w2 = tl.exp2(s2 - m_ref2)
                acc += w2 * v_r
                den2 += w2
            else:  # online: rescale what was accumulated to the new maximum
                s_r = tl.load(
                    lse_base + ((k0 + kk) * NUM_QO_HEADS + heads), mask=mask_r & live, other=float("-inf"),
                    cache_modifier=".cg",
                )  # fmt: skip
                m_new = tl.maximum(m, s_r)
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
                scale = tl.exp2(m - m_ref)
                acc = acc * scale[:, None]
                den = den * scale
                m = m_new
                w_r = tl.exp2(s_r - m_ref)
                acc += w_r[:, None] * v_r
                den += w_r
    if TWO_PASS:
        den_o = den2
        den = tl.sum(den2, axis=1)
    else:
        den_o = den[:, None]
    out = acc / tl.where(den_o > 0, den_o, 1.0)
    h64 = heads.to(tl.int64)
    o_ptrs = o_ptr + req64 * stride_ob + h64[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=mask_rd)
    if HAS_LSE:
        has = den > 0
        lse = tl.where(has, m + tl.log2(tl.where(has, den, 1.0)), float("-inf"))
        tl.store(lse_ptr + req64 * stride_lb + h64 * stride_lh, lse, mask=mask_r)


@triton.jit
def _vllm_reduce_group(
    o_ptr, es_ptr, ml_ptr, tmp_ptr, seq_len, num_parts, req64, g, stride_ob, stride_oh, stride_eb, stride_eh,
    stride_tb, stride_th, stride_tp,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    MERGE_BLOCK_K: tl.constexpr, PART_SIZE: tl.constexpr, TWO_PASS: tl.constexpr = True,
):  # fmt: skip
    """vLLM v2's reduction (as ``_vllm_reduce_kernel``) for the GROUP heads of KV head ``g`` of one sequence,
    inside the decode launch: ``out = sum_p tmp_out_p w_p / sum_p w_p``, ``w_p = exp_sums_p *
    exp(max_logits_p - max)``, over the partitions the sequence covers (at most ``num_parts``).

    The GROUP x D outputs are ``[ROWS, 4]`` tiles: a row is 4 consecutive columns of one head, so a thread
    holding a row loads a partition's max_logits / exp_sums once (a ``[ROWS, 1]`` tile, laid out as the rows
    of the values' tile) and makes one weight for its 4 values, with no data from other threads (every row
    walks all the partitions of its head). MERGE_BLOCK_K partitions unrolled. ``TWO_PASS``: the maximum
    first, then final weights (an add chain); else online."""
    VEC: tl.constexpr = 4
    ROWS: tl.constexpr = GROUP_P2 * BLOCK_D // VEC
    offs_row = tl.arange(0, ROWS)
    r_h = offs_row // (BLOCK_D // VEC)  # [ROWS] head within the group
    cols = ((offs_row % (BLOCK_D // VEC)) * VEC)[:, None] + tl.arange(0, VEC)[None, :]  # [ROWS, VEC]
    mask_h = (r_h < GROUP)[:, None]  # [ROWS, 1]
    mask_c = mask_h & (cols < HEAD_DIM)
    n_parts = tl.minimum((seq_len + PART_SIZE - 1) // PART_SIZE, num_parts)
    # 64-bit scalar bases (the group's first head), 32-bit offsets within: few registers per element.
    h0 = (g * GROUP).to(tl.int64)
    t_base = tmp_ptr + req64 * stride_tb + h0 * stride_th
    t_off = (r_h * stride_th)[:, None] + cols  # [ROWS, VEC]
    ml_base = ml_ptr + req64 * stride_eb + h0 * stride_eh
    es_base = es_ptr + req64 * stride_eb + h0 * stride_eh
    e_off = (r_h * stride_eh)[:, None]  # [ROWS, 1]
    m = tl.full([ROWS, 1], float("-inf"), dtype=tl.float32)
    den = tl.zeros([ROWS, 1], dtype=tl.float32)
    acc = tl.zeros([ROWS, VEC], dtype=tl.float32)
    m_ref = m
    if TWO_PASS:  # the maximum first: every weight below is final, no rescaling on the chain
        for p0 in range(0, n_parts, MERGE_BLOCK_K):
            for kk in tl.static_range(MERGE_BLOCK_K):
                p = p0 + kk
                live = mask_h & (p < n_parts)
                m = tl.maximum(m, tl.load(ml_base + (e_off + p), mask=live, other=float("-inf"), cache_modifier=".cg"))
        m_ref = tl.where(m == float("-inf"), 0.0, m)
    for p0 in range(0, n_parts, MERGE_BLOCK_K):
        for kk in tl.static_range(MERGE_BLOCK_K):
            p = p0 + kk
            live = p < n_parts
            ml = tl.load(ml_base + (e_off + p), mask=mask_h & live, other=float("-inf"), cache_modifier=".cg")
            es = tl.load(es_base + (e_off + p), mask=mask_h & live, other=0.0, cache_modifier=".cg")
            t = tl.load(t_base + (t_off + p * stride_tp), mask=mask_c & live, other=0.0, cache_modifier=".cg")
            if not TWO_PASS:  # online: rescale what was accumulated to the new maximum
                m_new = tl.maximum(m, ml)
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
                scale = tl.exp2((m - m_ref) * 1.4426950408889634)
                acc = acc * scale
                den = den * scale
                m = m_new
            # An empty partition (max_logits -inf) weighs 0; its tmp_out was written as 0.
            wgt = tl.where(ml > float("-inf"), es * tl.exp2((ml - m_ref) * 1.4426950408889634), 0.0)
            acc += wgt * t.to(tl.float32)
            den += wgt
    out = acc / tl.where(den > 0, den, 1.0)
    o_base = o_ptr + req64 * stride_ob + h0 * stride_oh
    tl.store(o_base + ((r_h * stride_oh)[:, None] + cols), out.to(o_ptr.dtype.element_ty), mask=mask_c)


@triton.jit
def _attend_tile(
    n0, end, m_i, l_i, acc, b_q, b_q_c, kv_indices_ptr, seq_base, k_ptr, v_ptr, stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh, g64, k_d, v_d, offs_d, mask_d, offs_rot, freq, sign, slope, pos0, qk_scale,
    soft_cap,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    PAGED: tl.constexpr, USE_DOT: tl.constexpr, SOFT_CAP: tl.constexpr, POS_MODE: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr, INTERPRET: tl.constexpr, VLLM: tl.constexpr, KX: tl.constexpr,
    VLLM_K3D: tl.constexpr, MASKED: tl.constexpr, page_pre=0, PAGE_PRE: tl.constexpr = False,
):  # fmt: skip
    """One key tile ``[n0, n0 + BLOCK_N)`` of the online softmax; keys at or past ``end`` are masked when
    ``MASKED`` (without it every key of the tile must be below ``end``). Returns the new (m, l, acc).
    ``PAGE_PRE``: the tile's page numbers were loaded by the caller (``page_pre``, one per key)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if MASKED:
        mask_n = offs_n < end
    else:
        mask_n = offs_n >= 0  # only for the index loads: every key of the tile is live
    if MASKED:
        mask_nd = mask_n[:, None] & mask_d[None, :]
    else:
        mask_nd = mask_d[None, :]
    if VLLM_K3D >= 3 and not MASKED:
        # Block tiles (vLLM, whole tiles only): NB = BLOCK_N / block_size whole blocks, one page number per
        # block; a block's keys ([D/X, block_size * X]) and values ([D, block_size]) are each one contiguous
        # run, loaded as [NB, rows, run] tiles (scalar base per block + affine in-block offsets).
        NB: tl.constexpr = BLOCK_N // PAGE_SIZE
        offs_b = tl.arange(0, NB)
        pg = tl.load(kv_indices_ptr + seq_base + n0 // PAGE_SIZE + offs_b).to(tl.int64)  # [NB]
        page = pg
        slot = pg * 0
        KC: tl.constexpr = BLOCK_D // KX
        KR: tl.constexpr = PAGE_SIZE * KX
        offs_kc = tl.arange(0, KC)
        offs_ke = tl.arange(0, KR)
        k_base = pg * stride_kp + g64 * stride_kh
        if VLLM_K3D >= 4:
            # Modes 4 / 5: one flat [NB, C * bs * X] tile, a block's whole run along the last dimension (a warp's
            # copy is 512 contiguous bytes; mode 3's [NB, C, bs * X] tile gives 2 x 256).
            offs_kf = tl.arange(0, KC * KR)
            if BLOCK_D == HEAD_DIM:
                b_kf = tl.load(k_ptr + k_base[:, None] + offs_kf[None, :])
            else:
                b_kf = tl.load(
                    k_ptr + k_base[:, None] + offs_kf[None, :], mask=(offs_kf[None, :] // KR) * KX < HEAD_DIM, other=0.0
                )
            b_k3 = tl.reshape(b_kf, (NB, KC, KR))
        else:
            k_in = offs_kc[:, None] * KR + offs_ke[None, :]  # [C, bs * X]: one contiguous run per block
            if BLOCK_D == HEAD_DIM:
                b_k3 = tl.load(k_ptr + k_base[:, None, None] + k_in[None, :, :])  # [NB, C, bs * X]
            else:
                b_k3 = tl.load(
                    k_ptr + k_base[:, None, None] + k_in[None, :, :],
                    mask=(offs_kc[None, :, None] * KX < HEAD_DIM) & (offs_ke[None, None, :] >= 0),
                    other=0.0,
                )
        b_k = tl.reshape(tl.permute(tl.reshape(b_k3, (NB, KC, PAGE_SIZE, KX)), (0, 2, 1, 3)), (BLOCK_N, BLOCK_D))
    else:
        if PAGE_PRE:
            page = page_pre.to(tl.int64)
            slot = (offs_n % PAGE_SIZE).to(tl.int64)
        else:
            page, slot = _kv_locate(kv_indices_ptr, seq_base, offs_n, mask_n, PAGE_SIZE, PAGED, MASKED)
    if VLLM_K3D >= 3 and not MASKED:
        pass  # block tiles: keys loaded above, no per-key offsets
    elif VLLM:
        # Slot stride X and value slot stride 1 as constants: the compiler then sees 16-byte runs.
        k_off = _kv_offsets(page, slot, g64, stride_kp, KX, stride_kh)
    else:
        k_off = _kv_offsets(page, slot, g64, stride_kp, stride_ks, stride_kh)
    if VLLM_K3D >= 3 and not MASKED:
        pass
    elif VLLM_K3D == 2:
        # vLLM keys as a [BLOCK_N, D/X, X] pointer tile: no permute, the reshape to [BLOCK_N, D] merges the
        # two inner dimensions (the load's thread order may then run along the keys, i.e. along memory).
        offs_c = tl.arange(0, BLOCK_D // KX)
        offs_x = tl.arange(0, KX)
        d3 = offs_c[None, :, None] * KX + offs_x[None, None, :]
        if MASKED:
            mask3 = mask_n[:, None, None] & (d3 < HEAD_DIM)
        else:
            mask3 = d3 < HEAD_DIM
        b_k3 = tl.load(
            k_ptr + k_off[:, None, None] + (offs_c[None, :, None] * (PAGE_SIZE * KX) + offs_x[None, None, :]),
            mask=mask3,
            other=0.0,
        )
        b_k = tl.reshape(b_k3, (BLOCK_N, BLOCK_D))
    elif VLLM_K3D:
        # vLLM keys as [D/X, BLOCK_N, X]: a page's 16-byte vectors of one chunk are adjacent in memory,
        # so consecutive threads read consecutive addresses; then viewed back as [BLOCK_N, D].
        offs_c = tl.arange(0, BLOCK_D // KX)
        offs_x = tl.arange(0, KX)
        d3 = offs_c[:, None, None] * KX + offs_x[None, None, :]
        if MASKED:
            mask3 = mask_n[None, :, None] & (d3 < HEAD_DIM)
        else:
            mask3 = d3 < HEAD_DIM
        b_k3 = tl.load(
            k_ptr + k_off[None, :, None] + (offs_c[:, None, None] * (PAGE_SIZE * KX) + offs_x[None, None, :]),
            mask=mask3,
            other=0.0,
        )
        b_k = tl.reshape(tl.permute(b_k3, (1, 0, 2)), (BLOCK_N, BLOCK_D))
    else:
        if not MASKED and BLOCK_D == HEAD_DIM:
            b_k = tl.load(k_ptr + k_off[:, None] + k_d[None, :])  # [BLOCK_N, BLOCK_D], every key live
        else:
            b_k = tl.load(k_ptr + k_off[:, None] + k_d[None, :], mask=mask_nd, other=0.0)  # [BLOCK_N, BLOCK_D]
    if POS_MODE == 1:
        if VLLM:
            k_rot = _d_offsets(offs_rot, PAGE_SIZE * KX, KX)
        else:
            k_rot = offs_rot
        b_k_rot = tl.load(k_ptr + k_off[:, None] + k_rot[None, :], mask=mask_nd, other=0.0)
        cos_k, sin_k = _cos_sin(offs_n.to(tl.float32)[:, None] * freq[None, :], INTERPRET)
        b_k = b_k.to(tl.float32) * cos_k + sign[None, :] * b_k_rot.to(tl.float32) * sin_k
    if USE_DOT:
        if INTERPRET:
            b_k = b_k.to(tl.float32)
        s = tl.dot(b_q_c, tl.trans(b_k.to(COMPUTE_DTYPE)))  # [BLOCK_M, BLOCK_N]
    else:
        s = tl.sum(b_q[:, None, :] * b_k.to(tl.float32)[None, :, :], axis=2)
    if SOFT_CAP and POS_MODE == 2 and not VLLM:
        # FlashInfer's order: the bias joins the scaled score, then sm_scale applies once more inside the cap
        # (slope carries log2(e): divide it out to stay in natural-log units until the cap).
        x = s * qk_scale + (slope[:, None] * 0.6931471805599453) * (offs_n.to(tl.float32)[None, :] - pos0)
        s = (soft_cap * 1.4426950408889634) * _tanh(x * (qk_scale / soft_cap))
    else:
        if SOFT_CAP:
            s = (soft_cap * 1.4426950408889634) * _tanh(s * (qk_scale / soft_cap))
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
    if VLLM_K3D >= 3 and not MASKED:
        # A block's values [D, block_size] are one contiguous run: an [NB, D, bs] tile (modes 3 and 5) or a flat
        # [NB, D * bs] one (mode 4), then [BLOCK_N, D].
        offs_vs = tl.arange(0, PAGE_SIZE)
        v_base = page * stride_vp + g64 * stride_vh
        if VLLM_K3D == 4:
            offs_vf = tl.arange(0, BLOCK_D * PAGE_SIZE)
            if BLOCK_D == HEAD_DIM:
                b_vf = tl.load(v_ptr + v_base[:, None] + offs_vf[None, :])
            else:
                b_vf = tl.load(
                    v_ptr + v_base[:, None] + offs_vf[None, :], mask=offs_vf[None, :] // PAGE_SIZE < HEAD_DIM, other=0.0
                )
            b_v3 = tl.reshape(b_vf, (NB, BLOCK_D, PAGE_SIZE))
        else:
            v_in = offs_d[:, None] * PAGE_SIZE + offs_vs[None, :]  # [D, bs]
            if BLOCK_D == HEAD_DIM:
                b_v3 = tl.load(v_ptr + v_base[:, None, None] + v_in[None, :, :])
            else:
                b_v3 = tl.load(
                    v_ptr + v_base[:, None, None] + v_in[None, :, :],
                    mask=mask_d[None, :, None] & (offs_vs[None, None, :] >= 0),
                    other=0.0,
                )
        b_v = tl.reshape(tl.permute(b_v3, (0, 2, 1)), (BLOCK_N, BLOCK_D))
    else:
        if VLLM:
            v_off = _kv_offsets(page, slot, g64, stride_vp, 1, stride_vh)
            # Slots of one page are contiguous in vLLM's value layout: runs of PAGE_SIZE along the keys.
            v_off = tl.max_contiguous(tl.multiple_of(v_off, PAGE_SIZE), PAGE_SIZE)
        else:
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
    # vLLM addressing variant (``flashinfer_triton.vllm``); the defaults are the CSR decode.
    stride_bt=0,
    num_parts=1,
    es_ptr=None,
    ml_ptr=None,
    stride_tb=0,
    stride_th=0,
    stride_tp=0,
    stride_eb=0,
    stride_eh=0,
    k_scale_ptr=None,
    v_scale_ptr=None,
    # Fused split-KV merge: per-(request, KV head) arrival counters; vLLM v1's internal chunk size.
    counter_ptr=None,
    v1_chunk=0,
    VLLM: tl.constexpr = False,
    KX: tl.constexpr = 8,
    PART_SIZE: tl.constexpr = 0,
    SCALE_PTRS: tl.constexpr = False,
    FUSED_MERGE: tl.constexpr = False,
    MERGE_BLOCK_K: tl.constexpr = 1,
    GROUP_P2: tl.constexpr = 1,
    VLLM_K3D: tl.constexpr = False,
    VLLM_PREFETCH: tl.constexpr = False,
    V2_PPP: tl.constexpr = 1,
    WHOLE_TILES: tl.constexpr = False,
    MERGE_TWO_PASS: tl.constexpr = True,
):
    """Decode attention of one work item for one KV head (all query heads of its group).
    ``WHOLE_TILES`` (CSR / contiguous addressing): the key tiles wholly below the end run without key masks
    (unmasked page-number and K/V loads, no score select), then one masked tail tile, as the vLLM path does.
    ``V2_PPP`` (vLLM v2): partitions per program, walked one after the other, each one's state written at its
    512-key boundary (the grid then has ``ceil(num_parts / V2_PPP)`` programs per sequence)."""
    w = tl.program_id(0)
    g = tl.program_id(1)
    first = 0
    count = 1
    if VLLM:
        # The work item follows from the program id: sequence w // num_parts, partition w % num_parts.
        valid = w >= 0
        if PART_SIZE > 0 and V2_PPP > 1:
            # Several partitions per program: the first one is part, the program walks V2_PPP of them.
            n_progs = (num_parts + V2_PPP - 1) // V2_PPP
            req = w // n_progs
            part = (w % n_progs) * V2_PPP
        else:
            n_progs = num_parts
            req = w // num_parts
            part = w % num_parts
        seq_len = tl.load(kv_lens_ptr + req)
        if PART_SIZE > 0:
            start = part * PART_SIZE
            end = tl.maximum(tl.minimum(start + PART_SIZE, seq_len), start)
            split = 1
        elif FUSED_MERGE:
            # v1 cut into chunks of v1_chunk keys (at most num_parts; the last takes the rest), merged below.
            count = tl.minimum(tl.maximum((seq_len + v1_chunk - 1) // v1_chunk, 1), num_parts)
            valid = part < count
            start = part * v1_chunk
            end = tl.where(part == count - 1, seq_len, tl.minimum(start + v1_chunk, seq_len))
            end = tl.where(valid, tl.maximum(end, start), start)
            split = tl.where(count > 1, 1, 0)
            first = req * num_parts
        else:
            start = 0
            end = seq_len
            split = 0
    else:
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
    if VLLM:
        # Inner dimensions are contiguous (checked by the caller): [D/X, block_size, X] and [D, block_size].
        k_d = _d_offsets(offs_d, PAGE_SIZE * KX, KX)
        v_d = _d_offsets(offs_d, PAGE_SIZE, -1)
    else:
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
        if VLLM:
            pos0 = (seq_len - 1).to(tl.float32)  # vLLM's ALiBi position: j - seq_len + 1
        else:
            pos0 = 0.0
    if USE_DOT:
        b_q_c = b_q.to(COMPUTE_DTYPE)

    if VLLM:
        seq_base = req64 * stride_bt  # this sequence's row of block_tables
    else:
        seq_base = tl.load(kv_indptr_ptr + req, mask=valid, other=0).to(tl.int64)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if VLLM and PART_SIZE > 0 and V2_PPP > 1:
        # v2, several partitions per program (part .. part + n_mine - 1): the partitions holding keys are walked
        # in one loop, whole tiles only (only the last of them can end inside a tile), each one's state written
        # in vLLM's form at its boundary and m / l / acc restarted; the last one's masked tail tile and state
        # follow the loop (as the single-partition path); partitions past the sequence get -inf / 0 / 0.
        h64_p = heads.to(tl.int64)
        n_mine = tl.minimum(num_parts - part, V2_PPP)
        n_live = tl.minimum(tl.maximum((seq_len - start + PART_SIZE - 1) // PART_SIZE, 0), n_mine)
        # (State addresses are formed where they are stored: hoisted, the [rows, D] 64-bit pointer tile would stay
        # live across the key loops.)
        for i in range(0, n_live):
            s_i = start + i * PART_SIZE
            e_full = s_i + ((tl.minimum(s_i + PART_SIZE, seq_len) - s_i) // BLOCK_N) * BLOCK_N
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
            for n0 in range(s_i, e_full, BLOCK_N):
                m_i, l_i, acc = _attend_tile(
                    n0, e_full, m_i, l_i, acc, b_q, b_q_c, kv_indices_ptr, seq_base, k_ptr, v_ptr, stride_kp,
                    stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, g64, k_d, v_d, offs_d, mask_d, offs_rot,
                    freq, sign, slope, pos0, qk_scale, soft_cap, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, PAGED,
                    USE_DOT, SOFT_CAP, POS_MODE, COMPUTE_DTYPE, INTERPRET, VLLM, KX, VLLM_K3D, False,
                )  # fmt: skip
            if i < n_live - 1:  # a whole partition (not the sequence's last): its state now
                p64 = (part + i).to(tl.int64)
                has_i = l_i > 0
                o_i = acc / tl.where(has_i, l_i, 1.0)[:, None] * v_scale
                t_ptrs = part_o_ptr + req64 * stride_tb + h64_p[:, None] * stride_th + p64 * stride_tp + offs_d[None, :]
                tl.store(t_ptrs, o_i.to(part_o_ptr.dtype.element_ty), mask=mask_md)
                e_off = req64 * stride_eb + h64_p * stride_eh + p64
                tl.store(es_ptr + e_off, l_i, mask=mask_m)
                tl.store(ml_ptr + e_off, tl.where(has_i, m_i * 0.6931471805599453, float("-inf")), mask=mask_m)
        # The last partition holding keys (none when n_live = 0): its tail tile, then its state.
        p_last = part + n_live - 1
        s_last = start + (n_live - 1) * PART_SIZE
        e_last = tl.where(n_live > 0, tl.minimum(s_last + PART_SIZE, seq_len), s_last)
        e_full = tl.where(n_live > 0, s_last + ((e_last - s_last) // BLOCK_N) * BLOCK_N, s_last)
        if e_full < e_last:
            m_i, l_i, acc = _attend_tile(
                e_full, e_last, m_i, l_i, acc, b_q, b_q_c, kv_indices_ptr, seq_base, k_ptr, v_ptr, stride_kp,
                stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, g64, k_d, v_d, offs_d, mask_d, offs_rot, freq,
                sign, slope, pos0, qk_scale, soft_cap, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, PAGED, USE_DOT,
                SOFT_CAP, POS_MODE, COMPUTE_DTYPE, INTERPRET, VLLM, KX, VLLM_K3D, True,
            )  # fmt: skip
        if n_live > 0:
            p64 = p_last.to(tl.int64)
            has_i = l_i > 0
            o_i = acc / tl.where(has_i, l_i, 1.0)[:, None] * v_scale
            t_ptrs = part_o_ptr + req64 * stride_tb + h64_p[:, None] * stride_th + p64 * stride_tp + offs_d[None, :]
            tl.store(t_ptrs, o_i.to(part_o_ptr.dtype.element_ty), mask=mask_md)
            e_off = req64 * stride_eb + h64_p * stride_eh + p64
            tl.store(es_ptr + e_off, l_i, mask=mask_m)
            tl.store(ml_ptr + e_off, tl.where(has_i, m_i * 0.6931471805599453, float("-inf")), mask=mask_m)
        zeros_o = tl.zeros([BLOCK_M, BLOCK_D], dtype=part_o_ptr.dtype.element_ty)
        for k in range(n_live, n_mine):
            p64 = part.to(tl.int64) + k
            t_ptrs = part_o_ptr + req64 * stride_tb + h64_p[:, None] * stride_th + p64 * stride_tp + offs_d[None, :]
            tl.store(t_ptrs, zeros_o, mask=mask_md)
            e_off = req64 * stride_eb + h64_p * stride_eh + p64
            tl.store(es_ptr + e_off, tl.zeros([BLOCK_M], dtype=tl.float32), mask=mask_m)
            tl.store(ml_ptr + e_off, tl.full([BLOCK_M], float("-inf"), dtype=tl.float32), mask=mask_m)
    elif VLLM or WHOLE_TILES:
        # Whole key tiles first, without any key mask (vLLM: both loads stay 16-byte cp.async vectors, the value
        # rows being contiguous along the keys, where a per-key mask would split them into scalars; CSR with
        # WHOLE_TILES: no per-key predicates and selects), then the partial last tile with masks (its unwritten
        # slots may hold NaN: masked loads read zeros).
        end_full = start + ((end - start) // BLOCK_N) * BLOCK_N
        if VLLM_PREFETCH:
            # The next tile's page numbers are read one iteration ahead into registers, so the K/V copies
            # of a tile do not wait on an index load of the same pipeline stage.
            offs_t = tl.arange(0, BLOCK_N)
            pg_nx = tl.load(
                kv_indices_ptr + seq_base + (start + offs_t) // PAGE_SIZE, mask=start + offs_t < end, other=0
            )
            for n0 in range(start, end_full, BLOCK_N):
                pg = pg_nx
                nx = n0 + BLOCK_N + offs_t
                pg_nx = tl.load(kv_indices_ptr + seq_base + nx // PAGE_SIZE, mask=nx < end, other=0)
                m_i, l_i, acc = _attend_tile(
                    n0, end, m_i, l_i, acc, b_q, b_q_c, kv_indices_ptr, seq_base, k_ptr, v_ptr, stride_kp,
                    stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, g64, k_d, v_d, offs_d, mask_d, offs_rot,
                    freq, sign, slope, pos0, qk_scale, soft_cap, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, PAGED,
                    USE_DOT, SOFT_CAP, POS_MODE, COMPUTE_DTYPE, INTERPRET, VLLM, KX, VLLM_K3D, False, pg, True,
                )  # fmt: skip
        else:
            for n0 in range(start, end_full, BLOCK_N):
                m_i, l_i, acc = _attend_tile(
                    n0, end, m_i, l_i, acc, b_q, b_q_c, kv_indices_ptr, seq_base, k_ptr, v_ptr, stride_kp,
                    stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, g64, k_d, v_d, offs_d, mask_d, offs_rot,
                    freq, sign, slope, pos0, qk_scale, soft_cap, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, PAGED,
                    USE_DOT, SOFT_CAP, POS_MODE, COMPUTE_DTYPE, INTERPRET, VLLM, KX, VLLM_K3D, False,
                )  # fmt: skip
        if end_full < end:
            m_i, l_i, acc = _attend_tile(
                end_full, end, m_i, l_i, acc, b_q, b_q_c, kv_indices_ptr, seq_base, k_ptr, v_ptr, stride_kp,
                stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, g64, k_d, v_d, offs_d, mask_d, offs_rot, freq,
                sign, slope, pos0, qk_scale, soft_cap, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, PAGED, USE_DOT,
                SOFT_CAP, POS_MODE, COMPUTE_DTYPE, INTERPRET, VLLM, KX, VLLM_K3D, True,
            )  # fmt: skip
    else:
        for n0 in range(start, end, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                n0, end, m_i, l_i, acc, b_q, b_q_c, kv_indices_ptr, seq_base, k_ptr, v_ptr, stride_kp, stride_ks,
                stride_kh, stride_vp, stride_vs, stride_vh, g64, k_d, v_d, offs_d, mask_d, offs_rot, freq, sign,
                slope, pos0, qk_scale, soft_cap, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE, PAGED, USE_DOT, SOFT_CAP,
                POS_MODE, COMPUTE_DTYPE, INTERPRET, VLLM, KX, VLLM_K3D, True,
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
    if VLLM and PART_SIZE > 0:
        if V2_PPP == 1:
            # vLLM's v2 partition state: tmp_out [B, Hq, P, D], exp_sums / max_logits [B, Hq, P].
            h64 = heads.to(tl.int64)
            part64 = part.to(tl.int64)
            t_ptrs = part_o_ptr + req64 * stride_tb + h64[:, None] * stride_th + part64 * stride_tp + offs_d[None, :]
            tl.store(t_ptrs, o.to(part_o_ptr.dtype.element_ty), mask=mask_md)
            e_off = req64 * stride_eb + h64 * stride_eh + part64
            tl.store(es_ptr + e_off, l_i, mask=mask_m)
            tl.store(ml_ptr + e_off, tl.where(has_key, m_i * 0.6931471805599453, float("-inf")), mask=mask_m)
        if FUSED_MERGE:
            # The reduction in the same launch: the last of the sequence's n_progs programs (every
            # partition of the grid writes its state, empty ones included, before its program counts
            # itself) reduces them into out.
            tl.debug_barrier()
            c_ptr = counter_ptr + req64 * tl.num_programs(1) + g64
            done = tl.atomic_add(c_ptr, 1, sem="acq_rel", scope="gpu")
            if done == n_progs - 1:
                tl.atomic_xchg(c_ptr, 0, sem="relaxed", scope="gpu")  # ready for the next launch
                _vllm_reduce_group(
                    o_ptr, es_ptr, ml_ptr, part_o_ptr, seq_len, num_parts, req64, g, stride_ob, stride_oh,
                    stride_eb, stride_eh, stride_tb, stride_th, stride_tp,
                    GROUP, GROUP_P2, HEAD_DIM, BLOCK_D, MERGE_BLOCK_K, PART_SIZE, MERGE_TWO_PASS,
                )  # fmt: skip
    if not VLLM or (FUSED_MERGE and PART_SIZE == 0):
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
                    _merge_group(
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
                        MERGE_TWO_PASS,
                    )


@triton.jit
def _vllm_reduce_kernel(
    out_ptr,
    es_ptr,
    ml_ptr,
    tmp_ptr,
    seq_lens_ptr,
    stride_ob,
    stride_oh,
    stride_eb,
    stride_eh,
    stride_tb,
    stride_th,
    stride_tp,
    max_parts,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PART_SIZE: tl.constexpr,
):
    """vLLM v2 reduction of one (sequence, head): out = sum_p tmp_out_p * w_p / sum_p w_p with
    w_p = exp_sums_p * exp(max_logits_p - max_p max_logits_p), over the sequence's partitions."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + b)
    # Never past the partitions the attention grid covered (a seq_len above max_seq_len is the caller's error).
    n_parts = tl.minimum((seq_len + PART_SIZE - 1) // PART_SIZE, max_parts)
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    e_base = b * stride_eb + h * stride_eh
    m = tl.full([BLOCK_P], float("-inf"), dtype=tl.float32)
    for p0 in range(0, n_parts, BLOCK_P):
        mask_p = (p0 + offs_p) < n_parts
        ml = tl.load(ml_ptr + e_base + p0 + offs_p, mask=mask_p, other=float("-inf"))
        m = tl.maximum(m, ml)
    m_all = tl.max(m, axis=0)
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    total = tl.zeros([BLOCK_P], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    t_base = tmp_ptr + b * stride_tb + h * stride_th
    for p0 in range(0, n_parts, BLOCK_P):
        pp = p0 + offs_p
        mask_p = pp < n_parts
        ml = tl.load(ml_ptr + e_base + pp, mask=mask_p, other=float("-inf"))
        es = tl.load(es_ptr + e_base + pp, mask=mask_p, other=0.0)
        wgt = tl.where(mask_p & (ml > float("-inf")), es * tl.exp2((ml - m_safe) * 1.4426950408889634), 0.0)
        total += wgt
        t = tl.load(
            t_base + pp.to(tl.int64)[:, None] * stride_tp + offs_d[None, :],
            mask=mask_p[:, None] & mask_d[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(wgt[:, None] * t, axis=0)
    tot = tl.sum(total, axis=0)
    o = acc / tl.where(tot > 0, tot, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=mask_d)
