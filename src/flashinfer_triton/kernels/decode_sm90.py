"""Hopper (sm_90) paged batch decode written in Gluon: a TMA-fed ring of K/V page copies, one consumer warpgroup.

Same work list and semantics as ``decode._decode_kernel`` on its CSR paged path (one program = one work item
``(request, key start, key end, split)`` for one KV head; ``_decode_impl`` plans it), for the variants the
decode table runs: fp16/bf16 q = K/V, pages of 8-64 keys (a whole number per key tile), no score transform, no
window. The GROUP query heads of the KV head are the first rows of a 64-row wgmma tile (the other rows compute
on zeros and are never stored).

A program is two partitions:

* a loader warp: the tile's page numbers (one vector load, a tile ahead), then one TMA copy per page of K, then
  of V, into a ring of ``STAGES`` buffers of ``BLOCK_N`` keys. K is released once the tile's scores have landed,
  V once its ``P @ V`` has;
* one consumer warpgroup: the query rows from global memory into registers (wgmma's A operand), then the online
  softmax with the scores of tile ``i`` and ``P @ V`` of tile ``i - 1`` in flight together; ``P @ V`` of the
  last tile after the loop. A split piece writes its normalized state into the partial rows and counts itself
  on the (request, KV head)'s arrival counter; the last piece to arrive merges all of them into ``out`` / ``lse``
  (``merge.merge_head_rows``, the merge the Triton decode kernels fuse too), then resets the counter for the next
  launch.

Scores are scaled inside the exponent (``s * qk_scale - m``; ``qk_scale`` = sm_scale x log2(e) > 0, the running
maximum taken on unscaled scores). Keys past a range's end are masked in the last tile and their V rows zeroed in
shared memory (a page's unwritten slots may hold anything, NaN included; tiles past the last page re-read it).
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

from .merge import merge_head_rows
from .prefill_sm90 import _softmax_step

ROWS = gl.constexpr(64)  # wgmma tile rows (the group's query heads first)


@gluon.jit
def _dec_loader(
    k_desc,
    v_desc,
    k_bufs,
    v_bufs,
    k_ready,
    v_ready,
    k_empty,
    v_empty,
    page_tab,
    ks,
    n_tiles,
    last_page,
    kvh,
    rows_per_page,
    head_row,
    head_col,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
):
    """One warp: K then V of every tile, one TMA copy per page, into the ring."""
    NP: gl.constexpr = BLOCK_N // PAGE_SIZE
    pl: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    offs_p = gl.arange(0, NP, layout=pl)
    pg0 = ks // PAGE_SIZE
    # The next tile's page numbers are loaded while this tile's copies are issued (clamped to the range's last
    # page: a tile reaching past it re-reads that page; those keys are masked and their V rows zeroed).
    pv = gl.load(page_tab + gl.minimum(pg0 + offs_p, last_page), mask=n_tiles > 0, other=0).to(gl.int32)
    for i in range(n_tiles):
        st = i % STAGES
        ph = (i // STAGES) & 1
        cur = pv
        pv = gl.load(page_tab + gl.minimum(pg0 + (i + 1) * NP + offs_p, last_page)).to(gl.int32)
        # A fresh mbarrier counts as having completed the phase before phase 0: the first pass does not wait.
        mbarrier.wait(k_empty.index(st), ph ^ 1)
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


@gluon.jit
def _dec_merge(
    part_o_ptr,
    part_lse_ptr,
    o_ptr,
    lse_ptr,
    first,
    count,
    req,
    kvh,
    stride_ob,
    stride_oh,
    stride_lb,
    stride_lh,
    NUM_QO_HEADS: gl.constexpr,
    GROUP: gl.constexpr,
    GROUP_P2: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    MERGE_BLOCK_K: gl.constexpr,
    WRITE_LSE: gl.constexpr,
):
    """The ``count`` partial states (rows ``first ..``) of one request's GROUP heads of KV head ``kvh`` into
    ``o`` / ``lse``: ``merge.merge_head_rows``, the ``@triton.jit`` merge the Triton decode kernels fuse too, over
    ``[GROUP_P2, HEAD_DIM]`` tiles of a blocked layout (4 consecutive columns per thread, a warp across a row)."""
    blk: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])
    offs_r = gl.arange(0, GROUP_P2, layout=gl.SliceLayout(1, blk))
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, blk))
    merge_head_rows(
        part_o_ptr, part_lse_ptr, o_ptr, lse_ptr, first, count, req.to(gl.int64), kvh * GROUP + offs_r, offs_d,
        offs_r < GROUP, stride_ob, stride_oh, stride_lb, stride_lh, NUM_QO_HEADS, HEAD_DIM, MERGE_BLOCK_K, WRITE_LSE,
    )  # fmt: skip


@gluon.jit
def _dec_consumer(
    q_ptr,
    k_bufs,
    v_bufs,
    k_ready,
    v_ready,
    k_empty,
    v_empty,
    o_ptr,
    lse_ptr,
    part_o_ptr,
    part_lse_ptr,
    counter_ptr,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_lb,
    stride_lh,
    qk_scale,
    w,
    req,
    kvh,
    num_kv_heads,
    ks,
    ke,
    n_tiles,
    split,
    first,
    count,
    live,
    NUM_QO_HEADS: gl.constexpr,
    GROUP: gl.constexpr,
    GROUP_P2: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    WRITE_LSE: gl.constexpr,
    MERGE_BLOCK_K: gl.constexpr,
):
    """One warpgroup: the online softmax over the ring, then the output, or the partial state and the merge."""
    M: gl.constexpr = ROWS
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    q_op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_o: gl.constexpr = gl.SliceLayout(0, o_layout)
    dtype: gl.constexpr = k_bufs.dtype

    # The group's query heads as the tile's first rows (zeros below), straight into wgmma's register operand.
    qb: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    q_r = gl.arange(0, M, layout=gl.SliceLayout(1, qb))
    q_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, qb))
    q_off = req.to(gl.int64) * stride_qb + gl.expand_dims((kvh * GROUP + q_r).to(gl.int64) * stride_qh, 1)
    q_mask = gl.expand_dims((q_r < GROUP) & live, 1) & gl.expand_dims(q_d < HEAD_DIM, 0)
    q = gl.load(q_ptr + q_off + gl.expand_dims(q_d, 0), mask=q_mask, other=0.0)
    q = gl.convert_layout(q.to(dtype), q_op_layout)

    offs_n = gl.arange(0, BLOCK_N, layout=col_s)
    n_body = (ke - ks) // BLOCK_N  # tiles wholly inside the range: no key mask
    m_i = gl.full([M], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([M], gl.float32, layout=row_s)
    acc = gl.zeros([M, HEAD_DIM], gl.float32, layout=o_layout)
    s = gl.zeros([M, BLOCK_N], gl.float32, layout=s_layout)
    if n_tiles > 0:
        mbarrier.wait(k_ready.index(0), 0)
        s = warpgroup_mma(q, k_bufs.index(0).permute((1, 0)), s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,))
        mbarrier.arrive(k_empty.index(0), count=1)
        if n_body > 0:
            p, m_i, alpha = _softmax_step(s, m_i, qk_scale, ks + offs_n, m_i, ke, False, False)
        else:
            p, m_i, alpha = _softmax_step(s, m_i, qk_scale, ks + offs_n, m_i, ke, True, False)
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
                p, m_i, alpha = _softmax_step(s, m_i, qk_scale, kidx, m_i, ke, False, False)
            else:
                p, m_i, alpha = _softmax_step(s, m_i, qk_scale, kidx, m_i, ke, True, False)
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(v_empty.index(pst), count=1)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            l_i = l_i * alpha + gl.sum(p, axis=1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
        last = n_tiles - 1
        lst = last % STAGES
        mbarrier.wait(v_ready.index(lst), (last // STAGES) & 1)
        lo = ks + last * BLOCK_N
        if ke - lo < BLOCK_N:
            # Rows past the range's end (a page's unwritten slots, a re-read last page) may hold NaN, and 0 * NaN
            # would reach the output through P @ V: zero them in shared memory first.
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
    lse = gl.where(empty, float("-inf"), m_i + gl.log2(l_safe))
    rows_o = gl.arange(0, M, layout=row_o)
    offs_d = gl.arange(0, HEAD_DIM, layout=col_o)
    rows_l = gl.arange(0, M, layout=row_s)
    heads_o = (kvh * GROUP + rows_o).to(gl.int64)
    heads_l = (kvh * GROUP + rows_l).to(gl.int64)
    o_mask = gl.expand_dims((rows_o < GROUP) & live, 1) & gl.expand_dims(offs_d < HEAD_DIM, 0)
    l_mask = (rows_l < GROUP) & live
    if split == 0:
        o_off = req.to(gl.int64) * stride_ob + heads_o * stride_oh
        gl.store(o_ptr + gl.expand_dims(o_off, 1) + gl.expand_dims(offs_d, 0), o.to(o_ptr.dtype.element_ty),
                 mask=o_mask)  # fmt: skip
        if WRITE_LSE:
            gl.store(lse_ptr + req.to(gl.int64) * stride_lb + heads_l * stride_lh, lse, mask=l_mask)
    else:
        # Partial row w of the float workspace, then count this piece; the last of the request's pieces merges.
        prow_o = w.to(gl.int64) * NUM_QO_HEADS + heads_o
        gl.store(part_o_ptr + gl.expand_dims(prow_o * HEAD_DIM, 1) + gl.expand_dims(offs_d, 0),
                 o.to(part_o_ptr.dtype.element_ty), mask=o_mask)  # fmt: skip
        gl.store(part_lse_ptr + w.to(gl.int64) * NUM_QO_HEADS + heads_l, lse, mask=l_mask)
        if live:
            # Every thread's partial stores precede the (gpu-scope, acq_rel) increment.
            gl.thread_barrier()
            c_ptr = counter_ptr + req.to(gl.int64) * num_kv_heads + kvh
            done = gl.atomic_add(c_ptr, 1, sem="acq_rel", scope="gpu")
            if done == count - 1:
                gl.atomic_xchg(c_ptr, 0, sem="relaxed", scope="gpu")  # ready for the next launch
                _dec_merge(part_o_ptr, part_lse_ptr, o_ptr, lse_ptr, first, count, req, kvh, stride_ob, stride_oh,
                           stride_lb, stride_lh, NUM_QO_HEADS, GROUP, GROUP_P2, HEAD_DIM, MERGE_BLOCK_K,
                           WRITE_LSE)  # fmt: skip


@gluon.jit
def _decode_ws_kernel(
    q_ptr,
    k_desc,
    v_desc,
    o_ptr,
    lse_ptr,
    part_o_ptr,
    part_lse_ptr,
    counter_ptr,
    work_ptr,
    num_work_ptr,
    kv_indptr_ptr,
    kv_indices_ptr,
    kv_lens_ptr,
    rows_per_page,
    head_row,
    head_col,
    stride_qb,
    stride_qh,
    stride_ob,
    stride_oh,
    stride_lb,
    stride_lh,
    work_cap,
    qk_scale,
    NUM_QO_HEADS: gl.constexpr,
    GROUP: gl.constexpr,
    GROUP_P2: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    WRITE_LSE: gl.constexpr,
    MERGE_BLOCK_K: gl.constexpr,
    LOADER_REGS: gl.constexpr = 32,
):
    """One work item (request, keys [ks, ke), split flag) of ``_decode_impl``'s list for one KV head."""
    w = gl.program_id(0)
    kvh = gl.program_id(1)
    num_kv_heads = gl.num_programs(1)
    live = w < gl.load(num_work_ptr)
    wl = gl.where(live, w, 0)
    req = gl.load(work_ptr + wl)
    ks = gl.load(work_ptr + work_cap + wl)
    ke = gl.load(work_ptr + 2 * work_cap + wl)
    ke = gl.where(live, ke, ks)
    split = gl.load(work_ptr + 3 * work_cap + wl)
    # The request's partial states are work rows work_indptr[req] .. work_indptr[req + 1].
    first = gl.load(work_ptr + 4 * work_cap + req)
    count = gl.load(work_ptr + 4 * work_cap + req + 1) - first
    n_tiles = gl.cdiv(ke - ks, BLOCK_N)
    kv_first = gl.load(kv_indptr_ptr + req)
    last_page = gl.maximum(ke - 1, ks) // PAGE_SIZE

    dtype: gl.constexpr = k_desc.dtype
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=1)
        mbarrier.init(v_empty.index(i), count=1)

    gl.warp_specialize(
        [
            # (tuples written in place: a tuple assigned to a name first turns its constexprs into tensors)
            (
                _dec_consumer,
                (
                    q_ptr,
                    k_bufs,
                    v_bufs,
                    k_ready,
                    v_ready,
                    k_empty,
                    v_empty,
                    o_ptr,
                    lse_ptr,
                    part_o_ptr,
                    part_lse_ptr,
                    counter_ptr,
                    stride_qb,
                    stride_qh,
                    stride_ob,
                    stride_oh,
                    stride_lb,
                    stride_lh,
                    qk_scale,
                    w,
                    req,
                    kvh,
                    num_kv_heads,
                    ks,
                    ke,
                    n_tiles,
                    split,
                    first,
                    count,
                    live,
                    NUM_QO_HEADS,
                    GROUP,
                    GROUP_P2,
                    HEAD_DIM,
                    BLOCK_N,
                    STAGES,
                    WRITE_LSE,
                    MERGE_BLOCK_K,
                ),
            ),
            (
                _dec_loader,
                (
                    k_desc,
                    v_desc,
                    k_bufs,
                    v_bufs,
                    k_ready,
                    v_ready,
                    k_empty,
                    v_empty,
                    kv_indices_ptr + kv_first,
                    ks,
                    n_tiles,
                    last_page,
                    kvh,
                    rows_per_page,
                    head_row,
                    head_col,
                    BLOCK_N,
                    STAGES,
                    PAGE_SIZE,
                ),
            ),  # fmt: skip
        ],
        [1],
        [LOADER_REGS],
    )


__all__ = ["_decode_ws_kernel", "ROWS"]
