"""Hopper (sm_90) prefill attention written in Gluon: warp-specialized, TMA-fed, asynchronous wgmma.

Same work list and semantics as ``prefill._prefill_kernel`` (one program = one work item for one KV head; split
pieces write partial rows that the same merge launch combines), for the variants the Triton kernel reaches least
well on Hopper: fp16/bf16 q = K/V, head dim 64 or 128, ragged (or single) K/V or pages of 8-64 keys, causal or
no mask, no score transform. The GROUP query heads of the KV head are packed into the tile's rows head-major:
row ``r`` = head ``r // TILE_T``, token ``r % TILE_T`` (one TMA copy of [TILE_T, D] per head).

A program is two or three partitions:

* a loader warp: the query tile, then K and V tiles into a ring of ``STAGES`` buffers (paged: one copy per page,
  the tile's page numbers loaded a tile ahead). A K buffer is released once every consumer's scores of its
  tile have landed, a V buffer once their ``P @ V`` has (mbarriers counting the consumers);
* two consumer warpgroups, 64 query rows each. Each runs the online softmax with its two
  matrix products in flight across iterations: the scores of KV tile ``i`` are issued, then ``P @ V`` of tile
  ``i - 1``; the softmax of tile ``i`` runs while ``P @ V`` of tile ``i - 1`` is still on the tensor cores, and
  the accumulator is rescaled only once that product has landed. The two warpgroups run unsynchronized (one's
  exponentials overlap the other's products; making them take turns, as FlashAttention-3 does, measured slower).

Scores are scaled inside the exponent (``s * qk_scale - m``, one FMA; the running maximum is taken on the
unscaled scores, exact for ``qk_scale > 0``). The KV range of a work item is walked as unmasked tiles, then
masked ones (causal diagonal, the end of the range); a row that sees no key yields 0 and lse ``-inf``. When rows
past a range's end may hold anything (pages' unwritten slots, CUDA-graph plans whose descriptors cover whole
buffers: ``ZERO_V_TAIL``), the consumers zero those V rows in shared memory before the last ``P @ V``.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

ROWS_PER_CONSUMER = 64


@gluon.jit
def _loader(
    q_desc,
    k_desc,
    v_desc,
    q_smem,
    k_bufs,
    v_bufs,
    q_bar,
    k_ready,
    v_ready,
    k_empty,
    v_empty,
    q_row0,
    q_head0,
    kv_row0,
    kvh,
    n_tiles,
    page_tab,
    ks,
    last_page,
    rows_per_page,
    head_row,
    head_col,
    TILE_T: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP: gl.constexpr,
    PAGED: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
):
    """One warp: the query tile once, then K and V of every tile into the ring (K first: scores start sooner).
    A K buffer is released once both consumers' scores of its tile have landed, a V buffer once their P @ V has."""
    # The GROUP heads' rows go head-major into the tile: row r = head r // TILE_T, token r % TILE_T. A TMA box
    # has power-of-two sides: TILE_T tokens per copy when TILE_T is one, else (groups 3, 5, 7: TILE_T = 40, 24,
    # 16 x 7 rows) boxes of 8 tokens, TILE_T // 8 of them per head.
    QB: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    mbarrier.expect(q_bar, q_desc.block_type.nbytes * GROUP * (TILE_T // QB))
    for g in gl.static_range(GROUP):
        for j in gl.static_range(TILE_T // QB):
            tma.async_copy_global_to_shared(
                q_desc, [q_row0 + j * QB, (q_head0 + g) * HEAD_DIM], q_bar, q_smem.slice(g * TILE_T + j * QB, QB)
            )
    # Paged: a tile's page numbers as one vector load, issued a tile ahead so that no L2 round trip
    # stands between a released buffer and its next copies; each page number is taken out of the vector by a
    # one-warp reduction.
    NP: gl.constexpr = BLOCK_N // PAGE_SIZE
    pl: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    offs_p = gl.arange(0, NP, layout=pl)
    if PAGED:
        # (no load at all without tiles: last_page may then be -1, before the request's page-table entries)
        pv = gl.load(
            page_tab + gl.minimum(ks // PAGE_SIZE + offs_p, last_page), mask=(offs_p < NP) & (n_tiles > 0), other=0
        ).to(gl.int32)
    else:
        pv = gl.zeros([NP], gl.int32, layout=pl)
    for i in range(n_tiles):
        st = i % STAGES
        ph = (i // STAGES) & 1
        if PAGED:
            cur = pv
            nxt = gl.minimum((ks + (i + 1) * BLOCK_N) // PAGE_SIZE + offs_p, last_page)
            pv = gl.load(page_tab + nxt).to(gl.int32)
        # A fresh mbarrier counts as having completed the phase before phase 0: the first pass does not wait.
        mbarrier.wait(k_empty.index(st), ph ^ 1)
        if PAGED:
            # One copy per page of the tile (PAGE_SIZE rows of one head); pages past the request's last read its
            # last page again (their keys are masked, their V rows zeroed by the consumers).
            mbarrier.expect(k_ready.index(st), k_desc.block_type.nbytes * NP)
            for j in gl.static_range(NP):
                page = gl.sum(gl.where(offs_p == j, cur, 0), axis=0)
                row = page * rows_per_page + kvh * head_row
                tma.async_copy_global_to_shared(
                    k_desc, [row, kvh * head_col], k_ready.index(st), k_bufs.index(st).slice(j * PAGE_SIZE, PAGE_SIZE)
                )
            mbarrier.wait(v_empty.index(st), ph ^ 1)
            mbarrier.expect(v_ready.index(st), v_desc.block_type.nbytes * NP)
            for j in gl.static_range(NP):
                page = gl.sum(gl.where(offs_p == j, cur, 0), axis=0)
                row = page * rows_per_page + kvh * head_row
                tma.async_copy_global_to_shared(
                    v_desc, [row, kvh * head_col], v_ready.index(st), v_bufs.index(st).slice(j * PAGE_SIZE, PAGE_SIZE)
                )
        else:
            row = kv_row0 + i * BLOCK_N
            mbarrier.expect(k_ready.index(st), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [row, kvh * HEAD_DIM], k_ready.index(st), k_bufs.index(st))
            mbarrier.wait(v_empty.index(st), ph ^ 1)
            mbarrier.expect(v_ready.index(st), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [row, kvh * HEAD_DIM], v_ready.index(st), v_bufs.index(st))


@gluon.jit
def _softmax_step(s, m_i, qk_scale, kidx, limit, ke, MASKED: gl.constexpr, CAUSAL: gl.constexpr):
    """New running maximum (scaled units), probabilities and the rescale factor of one score tile."""
    if MASKED:
        ok = gl.expand_dims(kidx, 0) < ke
        if CAUSAL:
            ok = ok & (gl.expand_dims(kidx, 0) <= gl.expand_dims(limit, 1))
        s = gl.where(ok, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    if MASKED:
        # A row that has seen no key yet keeps -inf: exponents relative to 0 instead (all give 0).
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_use, 1))
    alpha = gl.exp2(m_i - m_use)
    return p, m_new, alpha


@gluon.jit
def _consumer(
    c: gl.constexpr,
    q_smem,
    k_bufs,
    v_bufs,
    q_bar,
    k_ready,
    v_ready,
    k_empty,
    v_empty,
    o_ptr,
    lse_ptr,
    part_o_ptr,
    part_lse_ptr,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    qk_scale,
    prow0,
    pstride,
    num_qo_heads,
    q_row0,
    t0,
    qo_len,
    delta,
    kvh,
    ks,
    ke,
    n_tiles,
    n_body,
    live,
    GROUP: gl.constexpr,
    TILE_T: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    CAUSAL: gl.constexpr,
    WRITE_LSE: gl.constexpr,
    ZERO_V_TAIL: gl.constexpr,
    HAS_SPLIT: gl.constexpr,
):
    """One warpgroup: rows ``[64 c, 64 c + 64)`` of the tile."""
    M: gl.constexpr = 64
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_o: gl.constexpr = gl.SliceLayout(0, o_layout)
    dtype: gl.constexpr = q_smem.dtype

    q = q_smem.slice(c * M, M)  # [M, HEAD_DIM]
    rows = c * M + gl.arange(0, M, layout=row_s)
    q_tok = t0 + rows % TILE_T
    limit = q_tok + delta  # causal: the last key a row sees
    offs_n = gl.arange(0, BLOCK_N, layout=col_s)

    m_i = gl.full([M], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([M], gl.float32, layout=row_s)
    acc = gl.zeros([M, HEAD_DIM], gl.float32, layout=o_layout)
    s = gl.zeros([M, BLOCK_N], gl.float32, layout=s_layout)
    mbarrier.wait(q_bar, 0)
    if n_tiles > 0:
        mbarrier.wait(k_ready.index(0), 0)
        s = warpgroup_mma(q, k_bufs.index(0).permute((1, 0)), s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,))
        mbarrier.arrive(k_empty.index(0), count=1)
        if n_body > 0:
            p, m_i, alpha = _softmax_step(s, m_i, qk_scale, ks + offs_n, limit, ke, False, CAUSAL)
        else:
            p, m_i, alpha = _softmax_step(s, m_i, qk_scale, ks + offs_n, limit, ke, True, CAUSAL)
        l_i = gl.sum(p, axis=1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        for i in range(1, n_tiles):
            st = i % STAGES
            pst = (i - 1) % STAGES
            mbarrier.wait(k_ready.index(st), (i // STAGES) & 1)
            mbarrier.wait(v_ready.index(pst), ((i - 1) // STAGES) & 1)
            s = warpgroup_mma(q, k_bufs.index(st).permute((1, 0)), s, use_acc=False, is_async=True)
            acc = warpgroup_mma(p_op, v_bufs.index(pst), acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s,))
            mbarrier.arrive(k_empty.index(st), count=1)
            kidx = ks + i * BLOCK_N + offs_n
            if i < n_body:
                p, m_i, alpha = _softmax_step(s, m_i, qk_scale, kidx, limit, ke, False, CAUSAL)
            else:
                p, m_i, alpha = _softmax_step(s, m_i, qk_scale, kidx, limit, ke, True, CAUSAL)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(v_empty.index(pst), count=1)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            l_i = l_i * alpha + gl.sum(p, axis=1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
        last = n_tiles - 1
        lst = last % STAGES
        mbarrier.wait(v_ready.index(lst), (last // STAGES) & 1)
        if ZERO_V_TAIL:
            # The descriptor covers the caller's whole buffer (CUDA-graph plans: the batch's end is not known
            # when the graph is captured); rows past ke may hold anything (NaN included), and 0 * NaN would
            # reach the output through P @ V. Both consumers write the same values, so their writes agree.
            lo = ks + last * BLOCK_N
            if ke - lo < BLOCK_N:
                vb = v_bufs.index(lst)
                blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
                vt = vb.load(blk)
                vrow = lo + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, blk))
                vt = gl.where(gl.expand_dims(vrow < ke, 1), vt, gl.zeros_like(vt))
                vb.store(vt)
                fence_async_shared()
                gl.thread_barrier()
        acc = warpgroup_mma(p_op, v_bufs.index(lst), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(v_empty.index(lst), count=1)

    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    o = acc * gl.expand_dims(gl.convert_layout(1.0 / l_safe, row_o), 1)
    rows_o = c * M + gl.arange(0, M, layout=row_o)
    tok_o = t0 + rows_o % TILE_T
    ok_o = live & (tok_o < qo_len) & (rows_o < TILE_T * GROUP)
    head_o = kvh * GROUP + rows_o // TILE_T
    offs_d = gl.arange(0, HEAD_DIM, layout=col_o)
    o_mask = gl.expand_dims(ok_o, 1) & gl.expand_dims(offs_d < HEAD_DIM, 0)
    rows_l = c * M + gl.arange(0, M, layout=row_s)
    tok_l = t0 + rows_l % TILE_T
    ok_l = live & (tok_l < qo_len) & (rows_l < TILE_T * GROUP)
    head_l = kvh * GROUP + rows_l // TILE_T
    if HAS_SPLIT:
        if prow0 >= 0:
            # A piece of a split KV range: normalized o and lse into the partial rows (token-major, pstride
            # pieces per token), combined by the merge launch.
            lse = gl.where(empty, float("-inf"), m_i + gl.log2(l_safe))
            p_o = (prow0 + (tok_o - t0) * pstride).to(gl.int64) * num_qo_heads + head_o
            p_ptrs = part_o_ptr + gl.expand_dims(p_o * HEAD_DIM, 1) + gl.expand_dims(offs_d, 0)
            gl.store(p_ptrs, o.to(part_o_ptr.dtype.element_ty), mask=o_mask)
            p_l = (prow0 + (tok_l - t0) * pstride).to(gl.int64) * num_qo_heads + head_l
            gl.store(part_lse_ptr + p_l, lse, mask=ok_l)
        else:
            _store_out(o, m_i, l_safe, empty, o_ptr, lse_ptr, stride_ot, stride_oh, stride_lt, stride_lh, q_row0, t0,
                       tok_o, head_o, offs_d, o_mask, tok_l, head_l, ok_l, WRITE_LSE)  # fmt: skip
    else:
        _store_out(o, m_i, l_safe, empty, o_ptr, lse_ptr, stride_ot, stride_oh, stride_lt, stride_lh, q_row0, t0,
                   tok_o, head_o, offs_d, o_mask, tok_l, head_l, ok_l, WRITE_LSE)  # fmt: skip


@gluon.jit
def _store_out(o, m_i, l_safe, empty, o_ptr, lse_ptr, stride_ot, stride_oh, stride_lt, stride_lh, q_row0, t0, tok_o,
               head_o, offs_d, o_mask, tok_l, head_l, ok_l, WRITE_LSE: gl.constexpr):  # fmt: skip
    """Rows of the output (and lse) of an unsplit work item."""
    o_off = (q_row0 + tok_o - t0).to(gl.int64) * stride_ot + head_o.to(gl.int64) * stride_oh
    o_ptrs = o_ptr + gl.expand_dims(o_off, 1) + gl.expand_dims(offs_d, 0)
    gl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=o_mask)
    if WRITE_LSE:
        lse = gl.where(empty, float("-inf"), m_i + gl.log2(l_safe))
        l_off = (q_row0 + tok_l - t0).to(gl.int64) * stride_lt + head_l.to(gl.int64) * stride_lh
        gl.store(lse_ptr + l_off, lse, mask=ok_l)


@gluon.jit
def _consumer1(
    q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, k_empty, v_empty, o_ptr, lse_ptr, part_o_ptr, part_lse_ptr, stride_ot,
    stride_oh, stride_lt, stride_lh, qk_scale, prow0, pstride, num_qo_heads, q_row0, t0, qo_len, delta, kvh, ks, ke, n_tiles, n_body, live,
    GROUP: gl.constexpr, TILE_T: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, CAUSAL: gl.constexpr, WRITE_LSE: gl.constexpr, ZERO_V_TAIL: gl.constexpr,
    HAS_SPLIT: gl.constexpr,
):  # fmt: skip
    _consumer(
        1, q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, k_empty, v_empty, o_ptr, lse_ptr, part_o_ptr, part_lse_ptr,
        stride_ot, stride_oh, stride_lt, stride_lh, qk_scale, prow0, pstride, num_qo_heads, q_row0, t0, qo_len, delta, kvh, ks, ke, n_tiles, n_body, live,
        GROUP, TILE_T, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, WRITE_LSE, ZERO_V_TAIL, HAS_SPLIT,
    )  # fmt: skip


@gluon.jit
def _consumer0(
    q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, k_empty, v_empty, o_ptr, lse_ptr, part_o_ptr, part_lse_ptr, stride_ot,
    stride_oh, stride_lt, stride_lh, qk_scale, prow0, pstride, num_qo_heads, q_row0, t0, qo_len, delta, kvh, ks, ke, n_tiles, n_body, live,
    GROUP: gl.constexpr, TILE_T: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, CAUSAL: gl.constexpr, WRITE_LSE: gl.constexpr, ZERO_V_TAIL: gl.constexpr,
    HAS_SPLIT: gl.constexpr,
):  # fmt: skip
    _consumer(
        0, q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, k_empty, v_empty, o_ptr, lse_ptr, part_o_ptr, part_lse_ptr,
        stride_ot, stride_oh, stride_lt, stride_lh, qk_scale, prow0, pstride, num_qo_heads, q_row0, t0, qo_len, delta, kvh, ks, ke, n_tiles, n_body, live,
        GROUP, TILE_T, HEAD_DIM, BLOCK_N, STAGES, CAUSAL, WRITE_LSE, ZERO_V_TAIL, HAS_SPLIT,
    )  # fmt: skip


@gluon.jit
def _prefill_ws_kernel(
    q_desc,
    k_desc,
    v_desc,
    o_ptr,
    lse_ptr,
    part_o_ptr,
    part_lse_ptr,
    work_ptr,
    num_work_ptr,
    qo_indptr_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    kv_lens_ptr,
    rows_per_page,
    head_row,
    head_col,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    qk_scale,
    num_qo_heads,
    GROUP: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    BLOCK_N: gl.constexpr,
    TILE_T: gl.constexpr,
    STAGES: gl.constexpr,
    CAUSAL: gl.constexpr,
    WRITE_LSE: gl.constexpr,
    ZERO_V_TAIL: gl.constexpr,
    HAS_SPLIT: gl.constexpr,
    PAGED: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    LOADER_REGS: gl.constexpr,
):
    """One work item (request, TILE_T tokens x GROUP heads = 128 rows, KV range [ks, ke)) for one KV head."""
    pid = gl.program_id(0)
    kvh = gl.program_id(1)
    live = pid < gl.load(num_work_ptr)
    w = work_ptr + gl.where(live, pid, 0) * 8  # _prefill_impl._WORK_FIELDS
    b = gl.load(w)
    t0 = gl.load(w + 1)
    ks = gl.load(w + 2)
    ke = gl.load(w + 3)
    ke = gl.where(live, ke, ks)
    prow0 = gl.load(w + 4)
    pstride = gl.load(w + 5)
    qo_start = gl.load(qo_indptr_ptr + b)
    qo_len = gl.load(qo_indptr_ptr + b + 1) - qo_start
    kv_len = gl.load(kv_lens_ptr + b)
    kv_first = gl.load(kv_indptr_ptr + b)
    delta = kv_len - qo_len
    n_tiles = gl.cdiv(ke - ks, BLOCK_N)
    # Unmasked tiles: every key below ke and, causal, at or before the diagonal of the tile's first token.
    body_lim = ke
    if CAUSAL:
        body_lim = gl.minimum(ke, t0 + delta + 1)
    n_body = gl.maximum(body_lim - ks, 0) // BLOCK_N

    dtype: gl.constexpr = q_desc.dtype
    # 128 rows whatever the group: TILE_T x GROUP may leave rows at the end unused (groups 3, 5, 6, 7: TILE_T is a
    # multiple of 8, so that every head's copy starts on a swizzle atom); nothing is written into them and their
    # output rows are not stored.
    q_smem = gl.allocate_shared_memory(dtype, [128, HEAD_DIM], q_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # both consumers
        mbarrier.init(v_empty.index(i), count=2)

    q_row0 = qo_start + t0
    gl.warp_specialize(
        [
            # (tuples written in place: a tuple assigned to a name first turns its constexprs into tensors)
            (
                _consumer0,
                (
                    q_smem,
                    k_bufs,
                    v_bufs,
                    q_bar,
                    k_ready,
                    v_ready,
                    k_empty,
                    v_empty,
                    o_ptr,
                    lse_ptr,
                    part_o_ptr,
                    part_lse_ptr,
                    stride_ot,
                    stride_oh,
                    stride_lt,
                    stride_lh,
                    qk_scale,
                    prow0,
                    pstride,
                    num_qo_heads,
                    q_row0,
                    t0,
                    qo_len,
                    delta,
                    kvh,
                    ks,
                    ke,
                    n_tiles,
                    n_body,
                    live,
                    GROUP,
                    TILE_T,
                    HEAD_DIM,
                    BLOCK_N,
                    STAGES,
                    CAUSAL,
                    WRITE_LSE,
                    ZERO_V_TAIL,
                    HAS_SPLIT,
                ),
            ),
            (
                _consumer1,
                (
                    q_smem,
                    k_bufs,
                    v_bufs,
                    q_bar,
                    k_ready,
                    v_ready,
                    k_empty,
                    v_empty,
                    o_ptr,
                    lse_ptr,
                    part_o_ptr,
                    part_lse_ptr,
                    stride_ot,
                    stride_oh,
                    stride_lt,
                    stride_lh,
                    qk_scale,
                    prow0,
                    pstride,
                    num_qo_heads,
                    q_row0,
                    t0,
                    qo_len,
                    delta,
                    kvh,
                    ks,
                    ke,
                    n_tiles,
                    n_body,
                    live,
                    GROUP,
                    TILE_T,
                    HEAD_DIM,
                    BLOCK_N,
                    STAGES,
                    CAUSAL,
                    WRITE_LSE,
                    ZERO_V_TAIL,
                    HAS_SPLIT,
                ),
            ),
            (
                _loader,
                (
                    q_desc,
                    k_desc,
                    v_desc,
                    q_smem,
                    k_bufs,
                    v_bufs,
                    q_bar,
                    k_ready,
                    v_ready,
                    k_empty,
                    v_empty,
                    q_row0,
                    kvh * GROUP,
                    kv_first + ks,
                    kvh,
                    n_tiles,
                    kv_indices_ptr + kv_first,
                    ks,
                    (kv_len - 1) // PAGE_SIZE,
                    rows_per_page,
                    head_row,
                    head_col,
                    TILE_T,
                    BLOCK_N,
                    STAGES,
                    GROUP,
                    PAGED,
                    PAGE_SIZE,
                ),
            ),  # fmt: skip
        ],
        [4, 1],
        [CONSUMER_REGS, LOADER_REGS],
    )


def kernel_layouts(dtype_str: str, tile_t: int, block_n: int, head_dim: int):
    """NVMMA shared layouts of the query and K/V descriptors' blocks (2-D: rows x head dim of one head, over
    a ``[tokens, heads * head_dim]`` view; paged: ``block_n`` = the page size, one page of one head)."""
    gdt = {"fp16": gl.float16, "bf16": gl.bfloat16}[dtype_str]
    q_layout = gl.NVMMASharedLayout.get_default_for([tile_t, head_dim], gdt)
    kv_layout = gl.NVMMASharedLayout.get_default_for([block_n, head_dim], gdt)
    return q_layout, kv_layout


__all__ = ["_prefill_ws_kernel", "kernel_layouts", "ROWS_PER_CONSUMER"]
