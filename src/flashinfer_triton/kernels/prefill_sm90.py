"""Hopper (sm_90) prefill attention written in Gluon: warp-specialized, TMA-fed, asynchronous wgmma.

Same work list and semantics as ``prefill._prefill_kernel`` (one program = one work item for one KV head; split
pieces write partial rows that the same merge launch combines), for the variants the Triton kernel reaches least
well on Hopper: fp16/bf16 q = K/V, head dim 64, 128 or 256, ragged (or single) K/V or pages of 8-64 keys, causal
or no mask, a sliding window (``WINDOW``) or none, a logits soft cap (``SOFTCAP``: see
``_sm90_common.softmax_step``) or none. The GROUP query heads of the KV head are packed into the tile's rows
head-major: row ``r`` = head ``r // TILE_T``, token ``r % TILE_T`` (one TMA copy of [TILE_T, D] per head; a run
of TILE_T tokens off the 8-row swizzle atom, as 25 of a group of 5, is loaded by the consumers through ``q_ptr``).

A program is a loader partition and its consumers, on the schedule the Gluon decode kernel uses too (``_sm90_common``):

* a loader warp: the query tile (unless the consumers load it), then K and V tiles into a ring of ``STAGES``
  buffers (paged: one copy per page, the tile's page numbers loaded a tile ahead). A K buffer is released once every consumer's scores of its
  tile have landed, a V buffer once their ``P @ V`` has (mbarriers counting the consumers);
* two consumer warpgroups (``CONSUMERS``; three at head dim 64, a 192-row tile), 64 query rows each, each running
  ``_sm90_common.attend_ring``: the online softmax with its two matrix products in flight across iterations. The
  warpgroups run unsynchronized (one's exponentials overlap another's products; making two take turns, as
  FlashAttention-3 does, measured slower).

The KV range of a work item is walked as unmasked tiles, then masked ones (causal diagonal, the end of the range),
with a window's masked edge tiles first; a row that sees no key yields 0 and lse ``-inf``. When rows past a range's
end may hold anything (pages' unwritten slots, CUDA-graph plans whose descriptors cover whole buffers:
``ZERO_V_TAIL``), the consumers zero those V rows in shared memory before the last ``P @ V``.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from .._work_row import REQ_AT, WORK_FIELDS
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

_ROW: gl.constexpr = gl.constexpr(WORK_FIELDS)
_REQ: gl.constexpr = gl.constexpr(REQ_AT)


@gluon.jit
def _loader(
    q_desc,
    k_desc,
    v_desc,
    q_smem,
    ring,
    q_bar,
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
    GROUP: gl.constexpr,
    PAGED: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
):
    """One warp: the query tile once (the GROUP heads' rows head-major: row r = head r // TILE_T, token r %
    TILE_T), then K and V of every tile into the ring."""
    if TILE_T % 8 == 0:
        copy_q_tile(q_desc, q_smem, q_bar, q_row0, q_head0, GROUP, TILE_T)
    # (else runs off the 8-row swizzle atom: the consumers load their query rows themselves, see _load_q_rows)
    if PAGED:
        load_paged_kv(k_desc, v_desc, ring, page_tab, ks, n_tiles, last_page, kvh, rows_per_page, head_row, head_col,
                      PAGE_SIZE)  # fmt: skip
    else:
        # Ragged: one copy of BLOCK_N contiguous rows per tile.
        BLOCK_N: gl.constexpr = ring[0].shape[1]
        for i in range(n_tiles):
            copy_kv_tile(k_desc, v_desc, ring, kv_row0 + i * BLOCK_N, kvh, i)


@gluon.jit
def copy_q_tile(q_desc, q_smem, q_bar, q_row0, q_head0, GROUP: gl.constexpr, TILE_T: gl.constexpr):
    """The query tile by TMA: the GROUP heads' runs of TILE_T tokens (from query row ``q_row0``, head ``q_head0``)
    head-major into ``q_smem``, completing a phase of ``q_bar``. A TMA box has power-of-two sides: TILE_T tokens per
    copy when TILE_T is one, else boxes of QB tokens (TILE_T's largest power-of-two divisor), TILE_T // QB of them
    per head (paged groups 3 and 5: TILE_T = 40, 24 in boxes of 8; D64 group 4: 48 in boxes of 16)."""
    QB: gl.constexpr = q_desc.block_type.shape[0]
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    mbarrier.expect(q_bar, q_desc.block_type.nbytes * GROUP * (TILE_T // QB))
    for g in gl.static_range(GROUP):
        for j in gl.static_range(TILE_T // QB):
            tma.async_copy_global_to_shared(
                q_desc, [q_row0 + j * QB, (q_head0 + g) * HEAD_DIM], q_bar, q_smem.slice(g * TILE_T + j * QB, QB)
            )


@gluon.jit
def copy_kv_tile(k_desc, v_desc, ring, row, kvh, gi):
    """K and V of one ragged tile (rows ``[row, row + BLOCK_N)`` of KV head ``kvh``) into ring tile ``gi`` (stage
    ``gi % STAGES``), K first: scores start sooner."""
    k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty = ring
    STAGES: gl.constexpr = k_bufs.shape[0]
    HEAD_DIM: gl.constexpr = k_bufs.shape[2]
    st = gi % STAGES
    ph = (gi // STAGES) & 1
    # A fresh mbarrier counts as having completed the phase before phase 0: the first pass does not wait.
    mbarrier.wait(k_empty.index(st), ph ^ 1)
    mbarrier.expect(k_ready.index(st), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [row, kvh * HEAD_DIM], k_ready.index(st), k_bufs.index(st))
    mbarrier.wait(v_empty.index(st), ph ^ 1)
    mbarrier.expect(v_ready.index(st), v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [row, kvh * HEAD_DIM], v_ready.index(st), v_bufs.index(st))


@gluon.jit
def _row_tokens(c: gl.constexpr, t0, TILE_T: gl.constexpr, layout: gl.constexpr):
    """Row index in the tile and query token of consumer ``c``'s 64 rows (in ``layout``): row ``r`` of the tile is
    head ``r // TILE_T``, token ``t0 + r % TILE_T``."""
    rows = c * ROWS + gl.arange(0, ROWS, layout=layout)
    return rows, t0 + rows % TILE_T


@gluon.jit
def _tile_rows(c: gl.constexpr, t0, qo_len, kvh, live, GROUP: gl.constexpr, TILE_T: gl.constexpr,
               layout: gl.constexpr):  # fmt: skip
    """Token, query head and whether it is stored, of consumer ``c``'s 64 rows (tokens past the request and rows
    past TILE_T x GROUP are not)."""
    rows, tok = _row_tokens(c, t0, TILE_T, layout)
    ok = live & (tok < qo_len) & (rows < TILE_T * GROUP)
    head = kvh * GROUP + rows // TILE_T
    return tok, head, ok


@gluon.jit
def _consumer(
    c: gl.constexpr,
    q_smem,
    ring,
    q_bar,
    o_ptr,
    lse_ptr,
    part_o_ptr,
    part_lse_ptr,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    qk_scale,
    cap_scale,
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
    CAUSAL: gl.constexpr,
    SOFTCAP: gl.constexpr,
    WRITE_LSE: gl.constexpr,
    ZERO_V_TAIL: gl.constexpr,
    HAS_SPLIT: gl.constexpr,
    WINDOW: gl.constexpr,
    window_left,
    n_head,
    q_ptr,
    stride_qt,
    EPI_SMEM: gl.constexpr,
):
    """One warpgroup: rows ``[64 c, 64 c + 64)`` of the tile. Runs of TILE_T tokens off the 8-row swizzle atom
    (TILE_T % 8 != 0): the warpgroup loads its query rows itself from ``q_ptr`` (row stride ``stride_qt``).
    ``EPI_SMEM``: the output rows go out through the warpgroup's slice of the query tile (free once its last
    scores have landed: no other warpgroup reads it) with 16-byte stores."""
    M: gl.constexpr = ROWS
    row_s: gl.constexpr = gl.SliceLayout(1, score_layout(BLOCK_N))
    q = q_smem.slice(c * M, M)
    limit = _row_tokens(c, t0, TILE_T, row_s)[1] + delta  # a row's diagonal key (causal: the last it sees)
    if TILE_T % 8 == 0:
        acc, m_i, l_i = attend_ring(q, q_bar, ring, qk_scale, ks, ke, n_tiles, n_body, limit, CAUSAL, ZERO_V_TAIL,
                                   cap_scale, SOFTCAP, WINDOW, window_left, n_head)  # fmt: skip
    else:
        _load_q_rows(q, q_ptr, stride_qt, c, q_row0, t0, qo_len, kvh, live, GROUP, TILE_T, HEAD_DIM)
        acc, m_i, l_i = attend_ring(q, None, ring, qk_scale, ks, ke, n_tiles, n_body, limit, CAUSAL, ZERO_V_TAIL,
                                   cap_scale, SOFTCAP, WINDOW, window_left, n_head)  # fmt: skip
    if EPI_SMEM:
        write_tile(c, acc, m_i, l_i, o_ptr, lse_ptr, part_o_ptr, part_lse_ptr, stride_ot, stride_oh, stride_lt,
                   stride_lh, num_qo_heads, prow0, pstride, q_row0, t0, qo_len, kvh, live, GROUP, TILE_T, HEAD_DIM,
                   BLOCK_N, WRITE_LSE, HAS_SPLIT, q)  # fmt: skip
    else:
        write_tile(c, acc, m_i, l_i, o_ptr, lse_ptr, part_o_ptr, part_lse_ptr, stride_ot, stride_oh, stride_lt,
                   stride_lh, num_qo_heads, prow0, pstride, q_row0, t0, qo_len, kvh, live, GROUP, TILE_T, HEAD_DIM,
                   BLOCK_N, WRITE_LSE, HAS_SPLIT)  # fmt: skip


@gluon.jit
def write_tile(c: gl.constexpr, acc, m_i, l_i, o_ptr, lse_ptr, part_o_ptr, part_lse_ptr, stride_ot, stride_oh,
               stride_lt, stride_lh, num_qo_heads, prow0, pstride, q_row0, t0, qo_len, kvh, live,
               GROUP: gl.constexpr, TILE_T: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
               WRITE_LSE: gl.constexpr, HAS_SPLIT: gl.constexpr, stage=None):  # fmt: skip
    """Consumer ``c``'s rows of a finished work item: normalized into the output (and lse), or, a piece of a split
    KV range, into its partial rows. ``stage`` (None: the rows go out straight from the accumulator's registers,
    32 bits a store): a free [64, HEAD_DIM] shared-memory buffer of the output's dtype, this warpgroup's own; the
    output rows (not the partial rows) go through it with 16-byte stores (:func:`_store_out_staged`)."""
    row_s: gl.constexpr = gl.SliceLayout(1, score_layout(BLOCK_N))
    row_o: gl.constexpr = gl.SliceLayout(1, acc_layout(HEAD_DIM))
    o = normalize(acc, l_i)
    tok_o, head_o, ok_o = _tile_rows(c, t0, qo_len, kvh, live, GROUP, TILE_T, row_o)
    tok_l, head_l, ok_l = _tile_rows(c, t0, qo_len, kvh, live, GROUP, TILE_T, row_s)
    if HAS_SPLIT:
        if prow0 >= 0:
            # A piece of a split KV range: normalized o and lse into the partial rows (token-major, pstride
            # pieces per token), combined by the merge launch.
            p_o = (prow0 + (tok_o - t0) * pstride).to(gl.int64) * num_qo_heads + head_o
            p_l = (prow0 + (tok_l - t0) * pstride).to(gl.int64) * num_qo_heads + head_l
            store_rows(o, row_lse(m_i, l_i), part_o_ptr, p_o * HEAD_DIM, ok_o, part_lse_ptr, p_l, ok_l, True)
        elif stage is None:
            _store_out(o, m_i, l_i, o_ptr, lse_ptr, stride_ot, stride_oh, stride_lt, stride_lh, q_row0, t0, tok_o,
                       head_o, ok_o, tok_l, head_l, ok_l, WRITE_LSE)  # fmt: skip
        else:
            _store_out_staged(c, o, m_i, l_i, stage, o_ptr, lse_ptr, stride_ot, stride_oh, stride_lt, stride_lh,
                              q_row0, t0, qo_len, kvh, live, tok_l, head_l, ok_l, GROUP, TILE_T,
                              WRITE_LSE)  # fmt: skip
    elif stage is None:
        _store_out(o, m_i, l_i, o_ptr, lse_ptr, stride_ot, stride_oh, stride_lt, stride_lh, q_row0, t0, tok_o, head_o,
                   ok_o, tok_l, head_l, ok_l, WRITE_LSE)  # fmt: skip
    else:
        _store_out_staged(c, o, m_i, l_i, stage, o_ptr, lse_ptr, stride_ot, stride_oh, stride_lt, stride_lh, q_row0,
                          t0, qo_len, kvh, live, tok_l, head_l, ok_l, GROUP, TILE_T, WRITE_LSE)  # fmt: skip


@gluon.jit
def _load_q_rows(q, q_ptr, stride_qt, c: gl.constexpr, q_row0, t0, qo_len, kvh, live, GROUP: gl.constexpr,
                 TILE_T: gl.constexpr, HEAD_DIM: gl.constexpr):  # fmt: skip
    """Consumer ``c``'s 64 query rows into its slice ``q`` of the query tile by pointer loads (row ``r`` = head
    ``r // TILE_T``, token ``t0 + r % TILE_T``; rows past the request or the group's rows: zeros), made visible
    to the warpgroup's wgmma (async proxy) before it reads them."""
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = c * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, blk))
    j = rows % TILE_T
    ok = live & (t0 + j < qo_len) & (rows < TILE_T * GROUP)
    head = kvh * GROUP + rows // TILE_T
    row_off = (q_row0 + j).to(gl.int64) * stride_qt + head.to(gl.int64) * HEAD_DIM
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, blk))
    vals = gl.load(q_ptr + gl.expand_dims(row_off, 1) + gl.expand_dims(offs_d, 0), mask=gl.expand_dims(ok, 1),
                   other=0.0)  # fmt: skip
    q.store(vals)
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _store_out(o, m_i, l_i, o_ptr, lse_ptr, stride_ot, stride_oh, stride_lt, stride_lh, q_row0, t0, tok_o, head_o,
               ok_o, tok_l, head_l, ok_l, WRITE_LSE: gl.constexpr):  # fmt: skip
    """Rows of the output (and lse) of an unsplit work item: token ``t`` at row ``q_row0 + t - t0``."""
    o_off = (q_row0 + tok_o - t0).to(gl.int64) * stride_ot + head_o.to(gl.int64) * stride_oh
    l_off = (q_row0 + tok_l - t0).to(gl.int64) * stride_lt + head_l.to(gl.int64) * stride_lh
    store_rows(o, row_lse(m_i, l_i), o_ptr, o_off, ok_o, lse_ptr, l_off, ok_l, WRITE_LSE)


@gluon.constexpr_function
def out_layout(head_dim):
    """Register layout of a warpgroup's [64, head_dim] 16-bit output rows read back from shared memory: 8 values (16
    bytes) a thread, a row's threads adjacent (one 128-bit store each, whole rows per warp instruction)."""
    tc = min(head_dim // 8, 32)
    return gl.BlockedLayout([1, 8], [32 // tc, tc], [4, 1], [1, 0])


@gluon.jit
def _store_out_staged(c: gl.constexpr, o, m_i, l_i, stage, o_ptr, lse_ptr, stride_ot, stride_oh, stride_lt,
                      stride_lh, q_row0, t0, qo_len, kvh, live, tok_l, head_l, ok_l, GROUP: gl.constexpr,
                      TILE_T: gl.constexpr, WRITE_LSE: gl.constexpr):  # fmt: skip
    """:func:`_store_out` through shared memory: consumer ``c``'s rows, converted to the output's dtype, into
    ``stage`` (its own [64, HEAD_DIM] buffer, which nothing else reads or writes meanwhile), read back 16 bytes a
    thread along the rows and written with 128-bit stores, a row's mask (past the request, past TILE_T x GROUP)
    on each; the lse straight from the registers, as there. (A caller that writes ``stage`` again afterwards
    syncs the warpgroup first.)"""
    HEAD_DIM: gl.constexpr = o.shape[1]
    blk: gl.constexpr = out_layout(HEAD_DIM)
    stage.store(o.to(stage.dtype))
    gl.thread_barrier()
    vals = stage.load(blk)
    tok, head, ok = _tile_rows(c, t0, qo_len, kvh, live, GROUP, TILE_T, gl.SliceLayout(1, blk))
    o_off = (q_row0 + tok - t0).to(gl.int64) * stride_ot + head.to(gl.int64) * stride_oh
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, blk))
    gl.store(o_ptr + gl.expand_dims(o_off, 1) + gl.expand_dims(offs_d, 0), vals, mask=gl.expand_dims(ok, 1))
    if WRITE_LSE:
        l_off = (q_row0 + tok_l - t0).to(gl.int64) * stride_lt + head_l.to(gl.int64) * stride_lh
        gl.store(lse_ptr + l_off, row_lse(m_i, l_i), mask=ok_l)


@gluon.jit
def item_fields(work_ptr, item):
    """Work item ``item``'s fields, all from its row of the work list (``_work_row``: independent loads, one
    round trip): first token, KV range, first partial row, partial stride, and its request's first query row,
    queries, keys, first key row (or page-table entry)."""
    w = work_ptr + item * _ROW
    t0 = gl.load(w + 1)
    ks = gl.load(w + 2)
    ke = gl.load(w + 3)
    prow0 = gl.load(w + 4)
    pstride = gl.load(w + 5)
    qo_start = gl.load(w + _REQ)
    qo_len = gl.load(w + (_REQ + 1))
    kv_len = gl.load(w + (_REQ + 2))
    kv_first = gl.load(w + (_REQ + 3))
    return t0, ks, ke, prow0, pstride, qo_start, qo_len, kv_len, kv_first


@gluon.jit
def item_tiles(t0, ks, ke, qo_len, kv_len, window_left, BLOCK_N: gl.constexpr, TILE_T: gl.constexpr,
               CAUSAL: gl.constexpr, WINDOW: gl.constexpr):  # fmt: skip
    """A work item's KV length past its queries, and its tiles: all, the unmasked body (every key below ``ke`` and,
    causal, at or before the diagonal of the tile's first token), the masked window head (the first tiles reach
    below the last token's window edge; the body starts past it)."""
    delta = kv_len - qo_len
    n_tiles = gl.cdiv(ke - ks, BLOCK_N)
    body_lim = ke
    if CAUSAL:
        body_lim = gl.minimum(ke, t0 + delta + 1)
    n_body = gl.maximum(body_lim - ks, 0) // BLOCK_N
    n_head = 0
    if WINDOW:
        n_head = gl.cdiv(gl.maximum(t0 + (TILE_T - 1) + delta - window_left - ks, 0), BLOCK_N)
    return delta, n_tiles, n_body, n_head


@gluon.jit
def _prefill_gluon_kernel(
    q_desc,
    k_desc,
    v_desc,
    o_ptr,
    lse_ptr,
    q_ptr,
    part_o_ptr,
    part_lse_ptr,
    work_ptr,
    num_work_ptr,
    kv_indices_ptr,
    rows_per_page,
    head_row,
    head_col,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    qk_scale,
    cap_scale,
    num_qo_heads,
    GROUP: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    BLOCK_N: gl.constexpr,
    TILE_T: gl.constexpr,
    STAGES: gl.constexpr,
    CAUSAL: gl.constexpr,
    SOFTCAP: gl.constexpr,
    WRITE_LSE: gl.constexpr,
    ZERO_V_TAIL: gl.constexpr,
    HAS_SPLIT: gl.constexpr,
    PAGED: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
    LOADER_REGS: gl.constexpr,
    window_left=0,
    WINDOW: gl.constexpr = False,
    CONSUMERS: gl.constexpr = 2,
    stride_qt=0,
    EPI_SMEM: gl.constexpr = False,
):
    """One work item (request, TILE_T tokens x GROUP heads = 64 x CONSUMERS rows, KV range [ks, ke)) for one KV
    head. ``WINDOW``: token ``t`` sees no key before ``t + delta - window_left`` (the plan's ``ks`` is already the
    first tile any row of the item sees). ``q_ptr`` (row stride ``stride_qt``): q, which the TMA descriptor
    covers too; the consumers read their query rows through it when a run of TILE_T tokens is off the 8-row
    swizzle atom (TILE_T % 8 != 0), else it is unused. ``EPI_SMEM`` (the output's dtype is q's): the output rows
    are written through shared memory with 16-byte stores (:func:`_store_out_staged`), else straight from the
    accumulator's registers."""
    pid = gl.program_id(0)
    kvh = gl.program_id(1)
    # The row is loaded whatever the live count (every program of the grid has one: ``PrefillPlan.work``), so its
    # loads and the count's go out together; a program past the count (a CUDA-graph grid) then runs an empty range.
    t0, ks, ke, prow0, pstride, qo_start, qo_len, kv_len, kv_first = item_fields(work_ptr, pid)
    live = pid < gl.load(num_work_ptr)
    ke = gl.where(live, ke, ks)
    delta, n_tiles, n_body, n_head = item_tiles(t0, ks, ke, qo_len, kv_len, window_left, BLOCK_N, TILE_T, CAUSAL,
                                                WINDOW)  # fmt: skip

    dtype: gl.constexpr = q_desc.dtype
    # 64 x CONSUMERS rows whatever the group: TILE_T x GROUP may leave rows at the end unused (groups 3, 5, 6, 7 of
    # 128 rows: TILE_T a multiple of 8, so that every head's copy starts on a swizzle atom, or, off the atom, 128 //
    # GROUP tokens that the consumers load themselves); their output rows are not stored.
    # (shared-memory shapes are powers of two: 192 rows take a 256-row buffer)
    q_smem = gl.allocate_shared_memory(dtype, [128 if CONSUMERS == 2 else 256, HEAD_DIM], q_desc.layout)
    if TILE_T % 8 == 0:
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
    ring = alloc_ring(k_desc, v_desc, STAGES, BLOCK_N, CONSUMERS)  # every consumer releases a stage
    if TILE_T % 8 != 0:
        # Runs off the 8-row atom: the consumers load their query rows and nothing uses a query barrier, so none is
        # made. (Made and initialized, it would be dead past its init and the allocator would give its bytes to a
        # K/V ring buffer: the TMA copies would go over an mbarrier object never invalidated, which PTX leaves
        # undefined.)
        q_bar = ring[2]  # (a stand-in, unused: warp_specialize's arguments are not None)

    q_row0 = qo_start + t0
    if CONSUMERS == 3:
        # (the same partitions with a third consumer warpgroup: a 192-row tile)
        gl.warp_specialize(
            [
                # (tuples written in place: a tuple assigned to a name first turns its constexprs into tensors)
                (
                    _consumer,
                    (
                        0,
                        q_smem,
                        ring,
                        q_bar,
                        o_ptr,
                        lse_ptr,
                        part_o_ptr,
                        part_lse_ptr,
                        stride_ot,
                        stride_oh,
                        stride_lt,
                        stride_lh,
                        qk_scale,
                        cap_scale,
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
                        CAUSAL,
                        SOFTCAP,
                        WRITE_LSE,
                        ZERO_V_TAIL,
                        HAS_SPLIT,
                        WINDOW,
                        window_left,
                        n_head,
                        q_ptr,
                        stride_qt,
                        EPI_SMEM,
                    ),
                ),
                (
                    _consumer,
                    (
                        1,
                        q_smem,
                        ring,
                        q_bar,
                        o_ptr,
                        lse_ptr,
                        part_o_ptr,
                        part_lse_ptr,
                        stride_ot,
                        stride_oh,
                        stride_lt,
                        stride_lh,
                        qk_scale,
                        cap_scale,
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
                        CAUSAL,
                        SOFTCAP,
                        WRITE_LSE,
                        ZERO_V_TAIL,
                        HAS_SPLIT,
                        WINDOW,
                        window_left,
                        n_head,
                        q_ptr,
                        stride_qt,
                        EPI_SMEM,
                    ),
                ),
                (
                    _consumer,
                    (
                        2,
                        q_smem,
                        ring,
                        q_bar,
                        o_ptr,
                        lse_ptr,
                        part_o_ptr,
                        part_lse_ptr,
                        stride_ot,
                        stride_oh,
                        stride_lt,
                        stride_lh,
                        qk_scale,
                        cap_scale,
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
                        CAUSAL,
                        SOFTCAP,
                        WRITE_LSE,
                        ZERO_V_TAIL,
                        HAS_SPLIT,
                        WINDOW,
                        window_left,
                        n_head,
                        q_ptr,
                        stride_qt,
                        EPI_SMEM,
                    ),
                ),
                (
                    _loader,
                    (
                        q_desc,
                        k_desc,
                        v_desc,
                        q_smem,
                        ring,
                        q_bar,
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
                        GROUP,
                        PAGED,
                        PAGE_SIZE,
                    ),
                ),  # fmt: skip
            ],
            [4, 4, 1],
            [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS],
        )
    else:
        gl.warp_specialize(
            [
                # (tuples written in place: a tuple assigned to a name first turns its constexprs into tensors)
                (
                    _consumer,
                    (
                        0,
                        q_smem,
                        ring,
                        q_bar,
                        o_ptr,
                        lse_ptr,
                        part_o_ptr,
                        part_lse_ptr,
                        stride_ot,
                        stride_oh,
                        stride_lt,
                        stride_lh,
                        qk_scale,
                        cap_scale,
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
                        CAUSAL,
                        SOFTCAP,
                        WRITE_LSE,
                        ZERO_V_TAIL,
                        HAS_SPLIT,
                        WINDOW,
                        window_left,
                        n_head,
                        q_ptr,
                        stride_qt,
                        EPI_SMEM,
                    ),
                ),
                (
                    _consumer,
                    (
                        1,
                        q_smem,
                        ring,
                        q_bar,
                        o_ptr,
                        lse_ptr,
                        part_o_ptr,
                        part_lse_ptr,
                        stride_ot,
                        stride_oh,
                        stride_lt,
                        stride_lh,
                        qk_scale,
                        cap_scale,
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
                        CAUSAL,
                        SOFTCAP,
                        WRITE_LSE,
                        ZERO_V_TAIL,
                        HAS_SPLIT,
                        WINDOW,
                        window_left,
                        n_head,
                        q_ptr,
                        stride_qt,
                        EPI_SMEM,
                    ),
                ),
                (
                    _loader,
                    (
                        q_desc,
                        k_desc,
                        v_desc,
                        q_smem,
                        ring,
                        q_bar,
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
                        GROUP,
                        PAGED,
                        PAGE_SIZE,
                    ),
                ),  # fmt: skip
            ],
            [4, 1],
            [CONSUMER_REGS, LOADER_REGS],
        )


__all__ = ["_prefill_gluon_kernel"]
