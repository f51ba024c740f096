"""Merging attention states (output ``v``, base-2 log-sum-exp ``s``) over disjoint key sets.

For states ``(v_k, s_k)``:

    m = max_k s_k,  w_k = 2^(s_k - m),  s = m + log2(sum_k w_k),  v = sum_k w_k v_k / sum_k w_k

A state with ``s_k = -inf`` weighs nothing (its ``v_k`` is dropped by a select, never multiplied in, so
garbage there, NaN included, cannot leak); when every state is empty the result is ``v = 0``, ``s = -inf``. Accumulation is float32,
whatever the storage dtype.

Two kernels, one rule:

* ``_merge_states_kernel``: ``merge_states`` with any number ``K`` of states per row (a runtime count
  walked ``BLOCK_K`` states at a time).
* ``_merge_pair_kernel``: two states, optionally in place and under a per-row mask
  (``merge_state``, ``merge_state_in_place``).
* ``_merge_fixed_kernel``: ``merge_states`` with a compile-time state count (2 to
  ``MergeConfig.fixed_max_k``): a 2-D ``[BLOCK_H, D]`` tile, the maximum lse taken first, then every
  state's values loaded in one unrolled block (all loads independent of each other, no rescaling, no
  layout conversion through shared memory).

Every merge, these and the ones fused into the attention kernels, ends through the helpers of
``kernels/_math.py`` (``max_finite``, ``weighted``, ``finish_state``): one rule for empty states.
``merge_head_rows`` is the merge fused into every decode kernel (Triton CSR and vLLM, Gluon on Hopper);
``merge_group`` calls it over the GQA group of one KV head (the two Triton decode kernels).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._math import finish_state, max_finite, weighted


@triton.jit
def _merge_states_kernel(
    v_ptr,
    s_ptr,
    out_v_ptr,
    out_s_ptr,
    num_states,
    num_heads,
    stride_vr,
    stride_vk,
    stride_vh,
    stride_sr,
    stride_sk,
    stride_sh,
    stride_or,
    stride_oh,
    stride_osr,
    stride_osh,
    HEAD_DIM: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    STREAM: tl.constexpr = False,
):
    """Merge the states of one row for BLOCK_H heads, BLOCK_K states per step (online, base 2)."""
    r = tl.program_id(0)
    hb = tl.program_id(1)
    r64 = r.to(tl.int64)
    count = num_states

    offs_k = tl.arange(0, BLOCK_K)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < num_heads
    mask_d = offs_d < HEAD_DIM
    s_base = s_ptr + r64 * stride_sr + offs_h.to(tl.int64)[None, :] * stride_sh  # [1, BLOCK_H]
    v_base = v_ptr + r64 * stride_vr + offs_h.to(tl.int64)[None, :, None] * stride_vh + offs_d[None, None, :]

    # All BLOCK_K states of a step are loaded at once (a serial loop over states is latency-bound).
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    den = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for k0 in range(0, count, BLOCK_K):
        mask_k = (k0 + offs_k) < count
        idx = k0 + offs_k.to(tl.int64)  # [BLOCK_K]
        s_t = tl.load(
            s_base + idx[:, None] * stride_sk, mask=mask_k[:, None] & mask_h[None, :], other=float("-inf")
        )  # [BLOCK_K, BLOCK_H]
        m_new = tl.maximum(m, tl.max(s_t, axis=0))
        m_safe = max_finite(m_new)
        scale = tl.exp2(m - m_safe)
        w_t = tl.exp2(s_t - m_safe[None, :])
        # Not masked by the weights: the value loads then do not wait for the lse loads (one round trip, not
        # two); an empty state's garbage is dropped by ``weighted``, never multiplied in.
        mask_v = mask_k[:, None, None] & mask_h[None, :, None] & mask_d[None, None, :]
        if STREAM:  # read once: first out of L2
            b_v = tl.load(
                v_base + idx[:, None, None] * stride_vk, mask=mask_v, other=0.0, eviction_policy="evict_first"
            )
        else:
            b_v = tl.load(v_base + idx[:, None, None] * stride_vk, mask=mask_v, other=0.0)
        b_v = b_v.to(tl.float32)  # [BLOCK_K, BLOCK_H, BLOCK_D]
        acc = acc * scale[:, None] + tl.sum(weighted(b_v, w_t[:, :, None]), axis=0)
        den = den * scale + tl.sum(w_t, axis=0)
        m = m_new
    out, s_out = finish_state(acc, den, m)
    mask_hd = mask_h[:, None] & mask_d[None, :]
    o_ptrs = out_v_ptr + r64 * stride_or + offs_h.to(tl.int64)[:, None] * stride_oh + offs_d[None, :]
    if STREAM:  # written once, read by someone else later: streaming store
        tl.store(o_ptrs, out.to(out_v_ptr.dtype.element_ty), mask=mask_hd, cache_modifier=".cs")
    else:
        tl.store(o_ptrs, out.to(out_v_ptr.dtype.element_ty), mask=mask_hd)
    tl.store(out_s_ptr + r64 * stride_osr + offs_h.to(tl.int64) * stride_osh, s_out, mask=mask_h)


@triton.jit
def _merge_pair_kernel(
    va_ptr,
    sa_ptr,
    vb_ptr,
    sb_ptr,
    out_v_ptr,
    out_s_ptr,
    mask_ptr,
    num_rows,
    rows_per_mask,
    stride_va,
    stride_vb,
    stride_vo,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_MASK: tl.constexpr,
):
    """Merge two states row by row (``[rows, D]`` values, ``[rows]`` lse); rows with mask False untouched."""
    pid = tl.program_id(0)
    offs_r = pid.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    mask_r = offs_r < num_rows
    if HAS_MASK:
        sel = tl.load(mask_ptr + offs_r // rows_per_mask, mask=mask_r, other=0) != 0
        mask_r = mask_r & sel
    mask_rd = mask_r[:, None] & (offs_d < HEAD_DIM)[None, :]
    s_a = tl.load(sa_ptr + offs_r, mask=mask_r, other=float("-inf"))
    s_b = tl.load(sb_ptr + offs_r, mask=mask_r, other=float("-inf"))
    m_safe = max_finite(tl.maximum(s_a, s_b))
    w_a = tl.exp2(s_a - m_safe)
    w_b = tl.exp2(s_b - m_safe)
    b_a = tl.load(va_ptr + offs_r[:, None] * stride_va + offs_d[None, :], mask=mask_rd, other=0.0).to(tl.float32)
    b_b = tl.load(vb_ptr + offs_r[:, None] * stride_vb + offs_d[None, :], mask=mask_rd, other=0.0).to(tl.float32)
    num = weighted(b_a, w_a[:, None]) + weighted(b_b, w_b[:, None])
    out, s_out = finish_state(num, w_a + w_b, m_safe)
    tl.store(
        out_v_ptr + offs_r[:, None] * stride_vo + offs_d[None, :], out.to(out_v_ptr.dtype.element_ty), mask=mask_rd
    )
    tl.store(out_s_ptr + offs_r, s_out, mask=mask_r)


@triton.jit
def _merge_fixed_kernel(
    v_ptr,
    s_ptr,
    out_v_ptr,
    out_s_ptr,
    num_rows,
    num_heads,
    num_hblocks,
    stride_vr,
    stride_vk,
    stride_vh,
    stride_sr,
    stride_sk,
    stride_sh,
    stride_or,
    stride_oh,
    stride_osr,
    stride_osh,
    NUM_K: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    STREAM: tl.constexpr,
    EVEN: tl.constexpr,
):
    """``merge_states`` with ``NUM_K`` states per row, one tile (row, block of BLOCK_H heads) per program.

    ``STREAM``: evict_first value loads and ``.cs`` stores. ``EVEN``: no masks (BLOCK_H divides the head count,
    BLOCK_D == HEAD_DIM)."""
    t = tl.program_id(0)
    r = t // num_hblocks
    hb = t - r * num_hblocks
    r = r.to(tl.int64)
    offs_h = (hb * BLOCK_H + tl.arange(0, BLOCK_H)).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    if EVEN:
        mask_h = None
        mask_hd = None
        zero = None
        ninf = None
    else:
        mask_h = offs_h < num_heads
        mask_hd = mask_h[:, None] & (offs_d < HEAD_DIM)[None, :]
        zero = 0.0
        ninf = float("-inf")
    s_row = s_ptr + r * stride_sr + offs_h * stride_sh
    v_row = v_ptr + r * stride_vr + offs_h[:, None] * stride_vh + offs_d[None, :]
    # Every load is issued before the first use: the values of all states (a tuple, unrolled), then the
    # lse. Not masked by the weights: garbage in an empty state is dropped by ``weighted``.
    vals = ()
    for k in tl.static_range(NUM_K):
        if STREAM:
            vals = vals + (tl.load(v_row + k * stride_vk, mask=mask_hd, other=zero, eviction_policy="evict_first"),)
        else:
            vals = vals + (tl.load(v_row + k * stride_vk, mask=mask_hd, other=zero),)
    lses = ()
    for k in tl.static_range(NUM_K):
        lses = lses + (tl.load(s_row + k * stride_sk, mask=mask_h, other=ninf),)
    # The maximum first, so each weight below is final: no rescaling of the accumulator.
    m = lses[0]
    for k in tl.static_range(1, NUM_K):
        m = tl.maximum(m, lses[k])
    m_safe = max_finite(m)
    den = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for k in tl.static_range(NUM_K):
        w = tl.exp2(lses[k] - m_safe)
        acc += weighted(vals[k].to(tl.float32), w[:, None])
        den += w
    out, s_out = finish_state(acc, den, m_safe)
    o_ptrs = out_v_ptr + r * stride_or + offs_h[:, None] * stride_oh + offs_d[None, :]
    if STREAM:
        tl.store(o_ptrs, out.to(out_v_ptr.dtype.element_ty), mask=mask_hd, cache_modifier=".cs")
    else:
        tl.store(o_ptrs, out.to(out_v_ptr.dtype.element_ty), mask=mask_hd)
    tl.store(out_s_ptr + r * stride_osr + offs_h * stride_osh, s_out, mask=mask_h)


@triton.jit
def merge_head_rows(
    part_o_ptr,
    part_lse_ptr,
    o_ptr,
    lse_ptr,
    first,
    count,
    req64,
    heads,
    offs_d,
    mask_r,
    stride_ob,
    stride_oh,
    stride_lb,
    stride_lh,
    NUM_QO_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MERGE_BLOCK_K: tl.constexpr,
    HAS_LSE: tl.constexpr,
):
    """The merge fused into the decode kernels (Triton CSR and vLLM, Gluon on Hopper): the ``count`` partial states
    (float32 rows ``first ..`` of ``[rows, NUM_QO_HEADS, HEAD_DIM]`` / ``[rows, NUM_QO_HEADS]``) of the query
    ``heads`` (masked by ``mask_r``) into row ``req64`` of ``o`` / ``lse``.

    The caller makes ``heads`` / ``mask_r`` and ``offs_d`` (``tl.arange``, or ``gl.arange`` in the layout of its
    choice): every tensor here is made from them, never by ``tl.arange`` / ``tl.zeros``, so one body compiles
    for both (a Gluon kernel may call a ``@triton.jit`` function; Gluon only insists that new tensors name a
    layout). The states were just written by other programs: read through L2 (``.cg``). The maximum lse first (lse
    loads only), then every weight is final: independent exp2s and an add chain (an online rescale puts an exp2
    on the chain of every state, in the one program that runs last). MERGE_BLOCK_K states per step, unrolled, so
    their loads are in flight together. Tiles are ``[heads, D]`` and a state's lse is loaded as a ``[heads, 1]``
    tile, so its weight is made in the accumulator's layout (no conversion through shared memory)."""
    mask_d = offs_d < HEAD_DIM
    mask_rd = mask_r[:, None] & mask_d[None, :]
    # 64-bit scalar bases, 32-bit offsets within one request's states (few registers per element).
    lse_base = part_lse_ptr + first.to(tl.int64) * NUM_QO_HEADS
    o_base = part_o_ptr + first.to(tl.int64) * (NUM_QO_HEADS * HEAD_DIM)
    o_cols = heads[:, None] * HEAD_DIM + offs_d[None, :]  # [G, D] int32
    m = tl.where(mask_r, float("-inf"), float("-inf"))
    for k0 in range(0, count, MERGE_BLOCK_K):
        for kk in tl.static_range(MERGE_BLOCK_K):
            live = k0 + kk < count
            row = (k0 + kk) * NUM_QO_HEADS + heads
            m = tl.maximum(m, tl.load(lse_base + row, mask=mask_r & live, other=float("-inf"), cache_modifier=".cg"))
    heads2 = heads[:, None]
    mask_r2 = mask_r[:, None]
    m_ref2 = max_finite(m)[:, None]
    den2 = tl.where(mask_r2, 0.0, 0.0)
    acc = tl.where(mask_rd, 0.0, 0.0)
    for k0 in range(0, count, MERGE_BLOCK_K):
        for kk in tl.static_range(MERGE_BLOCK_K):
            live = k0 + kk < count
            v_r = tl.load(
                o_base + ((k0 + kk) * (NUM_QO_HEADS * HEAD_DIM) + o_cols), mask=mask_rd & live, other=0.0,
                cache_modifier=".cg",
            )  # fmt: skip
            # A state with no keys has lse -inf (weight 0); past `count` the loads give lse -inf too.
            s2 = tl.load(
                lse_base + ((k0 + kk) * NUM_QO_HEADS + heads2), mask=mask_r2 & live, other=float("-inf"),
                cache_modifier=".cg",
            )  # fmt: skip
            w2 = tl.exp2(s2 - m_ref2)
            acc += weighted(v_r.to(tl.float32), w2)
            den2 += w2
    out, lse2 = finish_state(acc, den2, m_ref2, False)
    h64 = heads2.to(tl.int64)
    tl.store(
        o_ptr + req64 * stride_ob + h64 * stride_oh + offs_d[None, :], out.to(o_ptr.dtype.element_ty), mask=mask_rd
    )
    if HAS_LSE:
        tl.store(lse_ptr + req64 * stride_lb + h64 * stride_lh, lse2, mask=mask_r2)


@triton.jit
def merge_group(
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
):
    """Merge the ``count`` partial states (rows ``first ..``) of one request's GROUP heads of KV head ``g`` into
    ``o`` / ``lse``: ``merge_head_rows`` over ``[GROUP_P2, BLOCK_D]`` tiles."""
    offs_r = tl.arange(0, GROUP_P2)
    merge_head_rows(
        part_o_ptr, part_lse_ptr, o_ptr, lse_ptr, first, count, req64, g * GROUP + offs_r, tl.arange(0, BLOCK_D),
        offs_r < GROUP, stride_ob, stride_oh, stride_lb, stride_lh, NUM_QO_HEADS, HEAD_DIM, MERGE_BLOCK_K, HAS_LSE,
    )  # fmt: skip
