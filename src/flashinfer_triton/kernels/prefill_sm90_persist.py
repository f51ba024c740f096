"""The Gluon prefill kernel (``prefill_sm90``) on a persistent grid with a static, host-planned schedule.

One program per SM runs a list of units, a unit being one work item of the plan's list for one KV head. The lists
are the plan's (``_prefill_impl._persist_lists``): the units in FlashInfer's sm90 batch order (KV head, then
requests by KV length, longest first, then query tiles last to first), dealt one per program a round and balanced
by estimated cost, so that the programs walk the sequence together and end together. Nothing is claimed on the
device: no counter, no atomics, and the lists are read from the plan's device buffer like the work list.

What a program saves over one-shot CTAs (one per work item and KV head, which at this kernel's 227 KB of shared
memory cannot overlap on an SM): the launch and set-up of every CTA (barriers, register reallocation, the work
list's loads) and the pipeline's fill. The loader copies the next unit's first K/V tile as soon as a ring stage is
free, and its query tile as soon as both consumers' last scores of the current unit have landed (``q_empty``,
arrived inside ``attend_ring``, before its last ``P @ V``), so both copies overlap the current unit's last
``P @ V`` and epilogue. The ring's tile count and the query tile's phase run on across units (``t_base``;
``j & 1`` for a program's unit ``j``). The key loop is ``attend_ring``'s, unchanged.

Same arguments as ``_prefill_gluon_kernel`` plus two: ``cta_ptr`` (``nprog + 1`` offsets: program ``p`` runs
units ``[cta_ptr[p], cta_ptr[p + 1])``) and ``unit_ptr`` (a unit: ``KV head << 23 | work item``).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from ._sm90_common import ROWS, alloc_ring, attend_ring, score_layout
from .prefill_sm90 import _load_q_rows, _row_tokens, copy_kv_tile, copy_q_tile, item_fields, item_tiles, write_tile


@gluon.jit
def _unit(u, unit_ptr, work_ptr):
    """Unit ``u``'s KV head and its work item's fields (``item_fields``). A unit is one int: ``KV head << 23 | work
    item``."""
    code = gl.load(unit_ptr + u)
    t0, ks, ke, prow0, pstride, qo_start, qo_len, kv_len, kv_first = item_fields(work_ptr, code & 0x7FFFFF)
    return code >> 23, t0, ks, ke, prow0, pstride, qo_start, qo_len, kv_len, kv_first


@gluon.jit
def _s_loader(
    q_desc,
    k_desc,
    v_desc,
    q_smem,
    ring,
    q_bar,
    q_empty,
    work_ptr,
    kv_indices_ptr,
    cta_ptr,
    unit_ptr,
    rows_per_page,
    head_row,
    head_col,
    TILE_T: gl.constexpr,
    GROUP: gl.constexpr,
    PAGED: gl.constexpr,
    PAGE_SIZE: gl.constexpr,
    BLOCK_N: gl.constexpr,
):
    """The loader warp of a persistent program (ragged K/V): for each of its units, K and V of the first tile (as
    soon as a stage is free: while the consumers still work on the previous unit), then, once both consumers' last
    scores of the previous unit have landed (``q_empty``), the query tile (runs of TILE_T tokens on the 8-row
    atom; off it the consumers load their rows), then the other tiles. ``PAGED`` (unused arguments) is never set."""
    pid = gl.program_id(0)
    lo = gl.load(cta_ptr + pid)
    hi = gl.load(cta_ptr + pid + 1)
    t_base = lo * 0
    for j in range(hi - lo):
        kvh, t0, ks, ke, prow0, pstride, qo_start, qo_len, kv_len, kv_first = _unit(lo + j, unit_ptr, work_ptr)
        n_tiles = gl.cdiv(ke - ks, BLOCK_N)
        kv_row0 = kv_first + ks
        if n_tiles > 0:
            copy_kv_tile(k_desc, v_desc, ring, kv_row0, kvh, t_base)
        if TILE_T % 8 == 0:
            # (phase j - 1 of q_empty: both consumers are past the previous unit's last scores; a fresh mbarrier
            # counts as having completed the phase before phase 0)
            mbarrier.wait(q_empty, (j & 1) ^ 1)
            copy_q_tile(q_desc, q_smem, q_bar, qo_start + t0, kvh * GROUP, GROUP, TILE_T)
        for i in range(1, n_tiles):
            copy_kv_tile(k_desc, v_desc, ring, kv_row0 + i * BLOCK_N, kvh, t_base + i)
        t_base += n_tiles


@gluon.jit
def _s_consumer(
    c: gl.constexpr,
    q_smem,
    ring,
    q_bar,
    q_empty,
    o_ptr,
    lse_ptr,
    part_o_ptr,
    part_lse_ptr,
    q_ptr,
    stride_qt,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    qk_scale,
    cap_scale,
    num_qo_heads,
    work_ptr,
    cta_ptr,
    unit_ptr,
    window_left,
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
    k_hold,
    EPI_SMEM: gl.constexpr,
):
    """One consumer warpgroup of a persistent program: rows ``[64 c, 64 c + 64)`` of each of its units' tiles, in
    the list's order. The next unit's fields are loaded right after a unit's last ``P @ V``, so their latency
    overlaps its epilogue.

    ``EPI_SMEM``: the output rows go out through shared memory with 16-byte stores (``write_tile``'s ``stage``).
    The query tile is the loader's again by then, so they go through this warpgroup's half of the last tile's K
    buffer: ``attend_ring`` arrives on ``k_hold`` instead of releasing that stage, the warpgroup waits for
    ``k_hold``'s phase (every consumer's last scores have landed), writes and reads its half, then releases the
    stage. The loader needs that stage again only for the next unit's third tile. A unit without tiles has no
    stage: its (empty) rows go out directly."""
    M: gl.constexpr = ROWS
    row_s: gl.constexpr = gl.SliceLayout(1, score_layout(BLOCK_N))
    q = q_smem.slice(c * M, M)
    pid = gl.program_id(0)
    lo = gl.load(cta_ptr + pid)
    hi = gl.load(cta_ptr + pid + 1)
    n_units = hi - lo
    t_base = lo * 0
    held = lo * 0  # (units whose last K stage this warpgroup held: k_hold's phase)
    hold = k_hold if EPI_SMEM else None
    # The row strides zero-extended to int64 once (they are never negative): their sign words are then known to be
    # zero, instead of loop-invariant registers across the unit loop (groups 3, 6 and 7 of full masks with lse
    # spilled two of them, computed before the partitions' register reallocation).
    stride_qt = gl.to_tensor(stride_qt).to(gl.uint32, bitcast=True).to(gl.int64)
    stride_ot = gl.to_tensor(stride_ot).to(gl.uint32, bitcast=True).to(gl.int64)
    stride_oh = gl.to_tensor(stride_oh).to(gl.uint32, bitcast=True).to(gl.int64)
    stride_lt = gl.to_tensor(stride_lt).to(gl.uint32, bitcast=True).to(gl.int64)
    stride_lh = gl.to_tensor(stride_lh).to(gl.uint32, bitcast=True).to(gl.int64)
    kvh, t0, ks, ke, prow0, pstride, qo_start, qo_len, kv_len, _kvf = _unit(
        gl.minimum(lo, gl.maximum(hi - 1, 0)), unit_ptr, work_ptr
    )
    for j in range(n_units):
        delta, n_tiles, n_body, n_head = item_tiles(t0, ks, ke, qo_len, kv_len, window_left, BLOCK_N, TILE_T, CAUSAL,
                                                    WINDOW)  # fmt: skip
        q_row0 = qo_start + t0
        limit = _row_tokens(c, t0, TILE_T, row_s)[1] + delta  # a row's diagonal key (causal: the last it sees)
        if TILE_T % 8 == 0:
            acc, m_i, l_i = attend_ring(q, q_bar, ring, qk_scale, ks, ke, n_tiles, n_body, limit, CAUSAL, ZERO_V_TAIL,
                                       cap_scale, SOFTCAP, WINDOW, window_left, n_head, t_base, j & 1,
                                       q_empty, hold)  # fmt: skip
        else:
            # (runs off the 8-row atom: this warpgroup's own rows, loaded by itself; its previous products have
            # landed, so nothing reads its slice any more)
            _load_q_rows(q, q_ptr, stride_qt, c, q_row0, t0, qo_len, kvh, True, GROUP, TILE_T, HEAD_DIM)
            acc, m_i, l_i = attend_ring(q, None, ring, qk_scale, ks, ke, n_tiles, n_body, limit, CAUSAL, ZERO_V_TAIL,
                                       cap_scale, SOFTCAP, WINDOW, window_left, n_head, t_base, 0, None,
                                       hold)  # fmt: skip
        t_base += n_tiles
        # The next unit's fields (the last unit reads its own again): loads in flight during the epilogue.
        nu = lo + gl.minimum(j + 1, n_units - 1)
        n_kvh, n_t0, n_ks, n_ke, n_prow0, n_pstride, n_qo_start, n_qo_len, n_kv_len, _nkvf = _unit(
            nu, unit_ptr, work_ptr
        )
        if EPI_SMEM:
            if n_tiles > 0:
                k_bufs = ring[0]
                lst = (t_base - 1) % k_bufs.shape[0]
                mbarrier.wait(k_hold, held & 1)  # (every consumer's last scores of the unit have landed)
                held += 1
                write_tile(c, acc, m_i, l_i, o_ptr, lse_ptr, part_o_ptr, part_lse_ptr, stride_ot, stride_oh,
                           stride_lt, stride_lh, num_qo_heads, prow0, pstride, q_row0, t0, qo_len, kvh, True, GROUP,
                           TILE_T, HEAD_DIM, BLOCK_N, WRITE_LSE, HAS_SPLIT,
                           k_bufs.index(lst).slice(c * M, M))  # fmt: skip
                # (the warpgroup's reads of the stage done, and ordered before the loader's next copy into it)
                gl.thread_barrier()
                fence_async_shared()
                mbarrier.arrive(ring[4].index(lst), count=1)
            else:
                write_tile(c, acc, m_i, l_i, o_ptr, lse_ptr, part_o_ptr, part_lse_ptr, stride_ot, stride_oh,
                           stride_lt, stride_lh, num_qo_heads, prow0, pstride, q_row0, t0, qo_len, kvh, True, GROUP,
                           TILE_T, HEAD_DIM, BLOCK_N, WRITE_LSE, HAS_SPLIT)  # fmt: skip
        else:
            write_tile(c, acc, m_i, l_i, o_ptr, lse_ptr, part_o_ptr, part_lse_ptr, stride_ot, stride_oh, stride_lt,
                       stride_lh, num_qo_heads, prow0, pstride, q_row0, t0, qo_len, kvh, True, GROUP, TILE_T,
                       HEAD_DIM, BLOCK_N, WRITE_LSE, HAS_SPLIT)  # fmt: skip
        kvh, t0, ks, ke, prow0, pstride, qo_start, qo_len, kv_len = (
            n_kvh, n_t0, n_ks, n_ke, n_prow0, n_pstride, n_qo_start, n_qo_len, n_kv_len
        )  # fmt: skip


@gluon.jit
def _prefill_gluon_persist_kernel(
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
    cta_ptr=None,
    unit_ptr=None,
    EPI_SMEM: gl.constexpr = False,
):
    """``_prefill_gluon_kernel``'s work on a persistent 1-D grid: program ``p`` runs units ``[cta_ptr[p],
    cta_ptr[p + 1])`` (``unit_ptr``: ``KV head << 23 | work item``). Two consumers (128-row tiles);
    ``num_work_ptr`` is unused (the lists hold live units only). ``EPI_SMEM`` (128-key tiles: a K buffer holds both
    consumers' 64 output rows; the output's dtype is q's): the output rows go out through the last tile's K buffer
    with 16-byte stores (``_s_consumer``)."""
    gl.static_assert(CONSUMERS == 2, "the persistent kernel runs two consumer warpgroups")
    gl.static_assert(not PAGED, "the persistent kernel reads ragged K/V")
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [128, HEAD_DIM], q_desc.layout)
    if TILE_T % 8 == 0:
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        mbarrier.init(q_empty, count=CONSUMERS)  # every consumer releases the query tile
    ring = alloc_ring(k_desc, v_desc, STAGES, BLOCK_N, CONSUMERS)
    if TILE_T % 8 != 0:
        # Runs off the 8-row atom: the consumers load their query rows and nothing uses a query barrier, so none is
        # made. (Made and initialized, the two would be dead past their init and the allocator would give their
        # bytes to K stage 0, row 0's first 24 bytes: the K copies and the staged epilogue's stores and loads would
        # go over mbarrier objects never invalidated, which PTX leaves undefined.)
        q_bar = ring[2]  # (stand-ins, unused: warp_specialize's arguments are not None)
        q_empty = ring[2]
    if EPI_SMEM:
        gl.static_assert(BLOCK_N == 2 * ROWS, "the staged epilogue takes a K buffer of 128 rows")
        k_hold = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(k_hold, count=CONSUMERS)  # every consumer's last scores of a unit have landed
    else:
        k_hold = q_empty  # (a stand-in, unused: warp_specialize's arguments are not None)
    gl.warp_specialize(
        [
            # (tuples written in place: a tuple assigned to a name first turns its constexprs into tensors)
            (
                _s_consumer,
                (0, q_smem, ring, q_bar, q_empty, o_ptr, lse_ptr, part_o_ptr, part_lse_ptr, q_ptr, stride_qt,
                 stride_ot, stride_oh, stride_lt, stride_lh, qk_scale, cap_scale, num_qo_heads, work_ptr,
                 cta_ptr, unit_ptr, window_left, GROUP,
                 TILE_T, HEAD_DIM, BLOCK_N, CAUSAL, SOFTCAP, WRITE_LSE, ZERO_V_TAIL, HAS_SPLIT, WINDOW, k_hold,
                 EPI_SMEM),
            ),
            (
                _s_consumer,
                (1, q_smem, ring, q_bar, q_empty, o_ptr, lse_ptr, part_o_ptr, part_lse_ptr, q_ptr, stride_qt,
                 stride_ot, stride_oh, stride_lt, stride_lh, qk_scale, cap_scale, num_qo_heads, work_ptr,
                 cta_ptr, unit_ptr, window_left, GROUP,
                 TILE_T, HEAD_DIM, BLOCK_N, CAUSAL, SOFTCAP, WRITE_LSE, ZERO_V_TAIL, HAS_SPLIT, WINDOW, k_hold,
                 EPI_SMEM),
            ),
            (
                _s_loader,
                (q_desc, k_desc, v_desc, q_smem, ring, q_bar, q_empty, work_ptr, kv_indices_ptr, cta_ptr,
                 unit_ptr, rows_per_page, head_row,
                 head_col, TILE_T, GROUP, PAGED, PAGE_SIZE, BLOCK_N),
            ),
        ],
        [4, 1],
        [CONSUMER_REGS, LOADER_REGS],
    )  # fmt: skip


__all__ = ["_prefill_gluon_persist_kernel"]
