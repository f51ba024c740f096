"""Hopper (sm_90) paged batch decode written in Gluon: a TMA-fed ring of K/V page copies, one consumer warpgroup.

Same work list and semantics as ``decode._decode_kernel`` on its CSR paged path (one program = one work item
``(request, key start, key end, split)`` for one KV head; ``_decode_impl`` plans it), for the variants the
decode table runs: fp16/bf16 q = K/V, pages of 8-64 keys (a whole number per key tile), no score transform, no
window. The GROUP query heads of the KV head are the first rows of a 64-row wgmma tile (the other rows compute
on zeros and are never stored).

A program is two partitions, on the schedule the Gluon prefill kernel uses too (``_sm90_common``):

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

from ._sm90_common import (
    ROWS,
    acc_layout,
    alloc_ring,
    attend_ring,
    load_paged_kv,
    normalize,
    row_lse,
    score_layout,
    store_rows,
)
from .merge import merge_head_rows


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
    ring,
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
    WRITE_LSE: gl.constexpr,
    MERGE_BLOCK_K: gl.constexpr,
):
    """One warpgroup: the online softmax over the ring, then the output, or the partial state and the merge."""
    M: gl.constexpr = ROWS
    q_op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=score_layout(BLOCK_N), k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, score_layout(BLOCK_N))
    row_o: gl.constexpr = gl.SliceLayout(1, acc_layout(HEAD_DIM))

    # The group's query heads as the tile's first rows (zeros below), straight into wgmma's register operand.
    qb: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    q_r = gl.arange(0, M, layout=gl.SliceLayout(1, qb))
    q_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, qb))
    q_off = req.to(gl.int64) * stride_qb + gl.expand_dims((kvh * GROUP + q_r).to(gl.int64) * stride_qh, 1)
    q_mask = gl.expand_dims((q_r < GROUP) & live, 1) & gl.expand_dims(q_d < HEAD_DIM, 0)
    q = gl.load(q_ptr + q_off + gl.expand_dims(q_d, 0), mask=q_mask, other=0.0)
    q = gl.convert_layout(q.to(ring[0].dtype), q_op_layout)

    # Every key of [ks, ke) is visible to every row: whole tiles unmasked, the last (partial) one masked, its V
    # rows past ke zeroed. (No causal limit: ks stands in for it.)
    n_body = (ke - ks) // BLOCK_N
    acc, m_i, l_i = attend_ring(q, None, ring, qk_scale, ks, ke, n_tiles, n_body, ks, False, True)
    o = normalize(acc, l_i)
    lse = row_lse(m_i, l_i)

    heads_o = (kvh * GROUP + gl.arange(0, M, layout=row_o)).to(gl.int64)
    heads_l = (kvh * GROUP + gl.arange(0, M, layout=row_s)).to(gl.int64)
    ok_o = (gl.arange(0, M, layout=row_o) < GROUP) & live
    ok_l = (gl.arange(0, M, layout=row_s) < GROUP) & live
    if split == 0:
        store_rows(o, lse, o_ptr, req.to(gl.int64) * stride_ob + heads_o * stride_oh, ok_o, lse_ptr,
                   req.to(gl.int64) * stride_lb + heads_l * stride_lh, ok_l, WRITE_LSE)  # fmt: skip
    else:
        # Partial row w of the float workspace, then count this piece; the last of the request's pieces merges.
        prow = w.to(gl.int64) * NUM_QO_HEADS
        store_rows(o, lse, part_o_ptr, (prow + heads_o) * HEAD_DIM, ok_o, part_lse_ptr, prow + heads_l, ok_l, True)
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
def _decode_gluon_kernel(
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
    ring = alloc_ring(k_desc, v_desc, STAGES, BLOCK_N, 1)

    gl.warp_specialize(
        [
            # (tuples written in place: a tuple assigned to a name first turns its constexprs into tensors)
            (
                _dec_consumer,
                (
                    q_ptr,
                    ring,
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
                    WRITE_LSE,
                    MERGE_BLOCK_K,
                ),
            ),
            (
                load_paged_kv,
                (
                    k_desc,
                    v_desc,
                    ring,
                    kv_indices_ptr + kv_first,
                    ks,
                    n_tiles,
                    last_page,
                    kvh,
                    rows_per_page,
                    head_row,
                    head_col,
                    PAGE_SIZE,
                ),
            ),  # fmt: skip
        ],
        [1],
        [LOADER_REGS],
    )


__all__ = ["_decode_gluon_kernel", "ROWS"]
