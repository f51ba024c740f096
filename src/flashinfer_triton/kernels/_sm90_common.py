"""The schedule the Hopper (sm_90) Gluon attention kernels share: ``decode_sm90`` and ``prefill_sm90``.

Both kernels are one TMA loader warp filling a ring of ``STAGES`` K and V buffers, and consumer warpgroups of 64
query rows each running the online softmax over that ring in base 2:

    m_i = max(m_i, rowmax(S) * qk_scale),  P = exp2(S * qk_scale - m_i),  acc = acc * exp2(m_old - m_i) + P @ V

(``S = Q K^T`` unscaled, ``qk_scale`` = sm_scale x log2(e) > 0), then ``O = acc / l_i`` and ``lse = m_i +
log2(l_i)``. This module holds what is the same in both: the ring and its mbarriers, the paged K/V copies of the
loader, the consumer's loop with its handshake, the normalization and the row stores, and the shared-memory layouts
of the descriptors' blocks (``kernel_layouts``, which the host code builds its descriptors with). What differs stays
in the kernels: where a tile's query rows come from and which (token, head) each row is (decode: a KV head's query
heads as rows, loaded into registers; prefill: head-major runs of tokens, copied into shared memory), which keys a
row sees (prefill's causal diagonal), and where finished rows go (decode merges its split pieces in the same launch,
prefill in a separate one).

The ring is a tuple ``(k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty)``: ``*_bufs`` are
``[STAGES, BLOCK_N, HEAD_DIM]`` buffers, ``*_ready`` complete when the loader's copies of a stage land, and
``*_empty`` when every consumer is done with it (K once its scores have landed, V once its ``P @ V`` has).
Tile ``i`` uses stage ``i % STAGES`` in phase ``(i // STAGES) & 1``.
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

from ._math import tanh

ROWS = gl.constexpr(64)  # query rows of one consumer warpgroup (one wgmma tile)


@gluon.constexpr_function
def score_layout(block_n):
    """Register layout of a warpgroup's [64, block_n] score tile (wgmma's accumulator)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, block_n, 16])


@gluon.constexpr_function
def acc_layout(head_dim):
    """Register layout of a warpgroup's [64, head_dim] output accumulator."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, head_dim, 16])


@gluon.jit
def alloc_ring(k_desc, v_desc, STAGES: gl.constexpr, BLOCK_N: gl.constexpr, CONSUMERS: gl.constexpr):
    """The K/V ring in shared memory and its mbarriers, initialized; ``CONSUMERS`` warpgroups release a stage."""
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[1]
    k_bufs = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=CONSUMERS)
        mbarrier.init(v_empty.index(i), count=CONSUMERS)
    return k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty


@gluon.jit
def _copy_pages(desc, buf, bar, pages, offs_p, kvh, rows_per_page, head_row, head_col, PAGE_SIZE: gl.constexpr):
    """One TMA copy per page of a tile into ``buf`` (``PAGE_SIZE`` rows of one head each), counted on ``bar``."""
    NP: gl.constexpr = buf.shape[0] // PAGE_SIZE
    mbarrier.expect(bar, desc.block_type.nbytes * NP)
    for j in gl.static_range(NP):
        # (each page number taken out of the tile's vector by a one-warp reduction)
        page = gl.sum(gl.where(offs_p == j, pages, 0), axis=0)
        row = page * rows_per_page + kvh * head_row
        tma.async_copy_global_to_shared(desc, [row, kvh * head_col], bar, buf.slice(j * PAGE_SIZE, PAGE_SIZE))


@gluon.jit
def load_paged_kv(
    k_desc,
    v_desc,
    ring,
    page_tab,
    ks,
    n_tiles,
    last_page,
    kvh,
    rows_per_page,
    head_row,
    head_col,
    PAGE_SIZE: gl.constexpr,
):
    """The loader's K/V of keys ``[ks, ks + n_tiles * BLOCK_N)`` from a page table (``ks`` on a page boundary):
    K then V of each tile into the ring (K first: the scores start sooner), one TMA copy per page.

    A tile's page numbers are one vector load issued a tile ahead, so that no L2 round trip stands between a
    released stage and its next copies. Pages past ``last_page`` read it again: the consumers mask those keys
    and zero their V rows."""
    k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty = ring
    STAGES: gl.constexpr = k_bufs.shape[0]
    BLOCK_N: gl.constexpr = k_bufs.shape[1]
    NP: gl.constexpr = BLOCK_N // PAGE_SIZE
    pl: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    offs_p = gl.arange(0, NP, layout=pl)
    pg0 = ks // PAGE_SIZE
    # (no load at all without tiles: last_page may then lie before the request's page-table entries)
    pv = gl.load(page_tab + gl.minimum(pg0 + offs_p, last_page), mask=n_tiles > 0, other=0).to(gl.int32)
    for i in range(n_tiles):
        st = i % STAGES
        ph = (i // STAGES) & 1
        cur = pv
        pv = gl.load(page_tab + gl.minimum(pg0 + (i + 1) * NP + offs_p, last_page)).to(gl.int32)
        # A fresh mbarrier counts as having completed the phase before phase 0: the first pass does not wait.
        mbarrier.wait(k_empty.index(st), ph ^ 1)
        _copy_pages(k_desc, k_bufs.index(st), k_ready.index(st), cur, offs_p, kvh, rows_per_page, head_row, head_col,
                    PAGE_SIZE)  # fmt: skip
        mbarrier.wait(v_empty.index(st), ph ^ 1)
        _copy_pages(v_desc, v_bufs.index(st), v_ready.index(st), cur, offs_p, kvh, rows_per_page, head_row, head_col,
                    PAGE_SIZE)  # fmt: skip


@gluon.jit
def softmax_step(s, m_i, qk_scale, kidx, limit, ke, MASKED: gl.constexpr, CAUSAL: gl.constexpr, cap_scale=1.0,
                 SOFTCAP: gl.constexpr = False, WINDOW: gl.constexpr = False, window_left=0):  # fmt: skip
    """New running maximum (scaled units), probabilities and the rescale factor of one score tile. Masked: keys
    at or past ``ke``, causal, past a row's ``limit`` (its diagonal key) and, ``WINDOW``, before ``limit -
    window_left`` score ``-inf``.

    ``SOFTCAP``: the scores become ``tanh(s * cap_scale)`` first (``cap_scale`` = sm_scale / cap, and ``qk_scale``
    = cap x log2(e)), so that ``qk_scale`` times them is the capped score ``cap * tanh(s * sm_scale / cap)`` in
    base 2 and everything after is unchanged: the lse is that of the capped scores."""
    if SOFTCAP:
        s = tanh(s * cap_scale, True)  # tanh.approx.f32: one MUFU operation, as FlashInfer's soft cap
    if MASKED:
        ok = gl.expand_dims(kidx, 0) < ke
        if CAUSAL:
            ok = ok & (gl.expand_dims(kidx, 0) <= gl.expand_dims(limit, 1))
        if WINDOW:
            ok = ok & (gl.expand_dims(kidx, 0) >= gl.expand_dims(limit - window_left, 1))
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
def _body_tile(i, n_body, n_head, WINDOW: gl.constexpr):
    """Whether tile ``i`` needs no mask: before ``n_body`` and, ``WINDOW``, not among the first ``n_head``."""
    if WINDOW:
        return (i < n_body) & (i >= n_head)
    else:
        return i < n_body


@gluon.jit
def attend_ring(
    q,
    q_bar,
    ring,
    qk_scale,
    ks,
    ke,
    n_tiles,
    n_body,
    limit,
    CAUSAL: gl.constexpr,
    ZERO_V_TAIL: gl.constexpr,
    cap_scale=1.0,
    SOFTCAP: gl.constexpr = False,
    WINDOW: gl.constexpr = False,
    window_left=0,
    n_head=0,
    t_base=0,
    q_phase=0,
    q_free=None,
    k_hold=None,
):
    """One consumer warpgroup over the ring: keys ``[ks, ke)`` in ``n_tiles`` tiles, the first ``n_body`` of them
    wholly visible (no mask) except, ``WINDOW``, the first ``n_head`` (cut by some row's window edge ``limit -
    window_left``). Returns the unnormalized accumulator, the running maximum (scaled units, base 2) and the row
    sums; rows that saw no key keep ``-inf`` and 0.

    ``q``: the warpgroup's [64, HEAD_DIM] query rows, in shared memory (``q_bar`` completes when they have
    landed) or in registers (``q_bar`` None): wgmma's A operand either way. ``limit``: each row's last visible key
    (``CAUSAL`` only). ``cap_scale``, ``SOFTCAP``: see :func:`softmax_step`.

    The scores of tile ``i`` and ``P @ V`` of tile ``i - 1`` are in flight together: the softmax of tile ``i``
    runs while ``P @ V`` of tile ``i - 1`` is still on the tensor cores, and the accumulator is rescaled once that
    product has landed. ``ZERO_V_TAIL``: rows past ``ke`` in the last tile's V may hold anything (a page's
    unwritten slots, a re-read last page, a descriptor over a whole buffer), NaN included, and 0 x NaN would reach
    the output through ``P @ V``: they are zeroed in shared memory first.

    A persistent program's later work items (``kernels/prefill_sm90_persist.py``): ``t_base`` ring tiles were used
    before this range, so tile ``i`` is ring tile ``t_base + i`` (stage ``(t_base + i) % STAGES``, phase
    ``((t_base + i) // STAGES) & 1``, as its loader counts); the query tile completes phase ``q_phase`` of
    ``q_bar``; ``q_free`` (an mbarrier, or None) is arrived on once the last scores have landed, before the last
    ``P @ V``, so that the loader may copy the next item's query tile over this one; ``k_hold`` (an mbarrier, or
    None) is arrived on instead of the last tile's K ``empty`` barrier, after the loop, so that the caller may
    use that stage once every consumer's last scores have landed (it releases the stage itself afterwards). The
    one-shot kernels pass neither (None): each tile's K stage is released as soon as its scores have landed."""
    k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty = ring
    STAGES: gl.constexpr = k_bufs.shape[0]
    BLOCK_N: gl.constexpr = k_bufs.shape[1]
    HEAD_DIM: gl.constexpr = k_bufs.shape[2]
    M: gl.constexpr = ROWS
    s_layout: gl.constexpr = score_layout(BLOCK_N)
    o_layout: gl.constexpr = acc_layout(HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = k_bufs.dtype

    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    m_i = gl.full([M], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([M], gl.float32, layout=row_s)
    acc = gl.zeros([M, HEAD_DIM], gl.float32, layout=o_layout)
    s = gl.zeros([M, BLOCK_N], gl.float32, layout=s_layout)
    if q_bar is not None:
        mbarrier.wait(q_bar, q_phase)
    if n_tiles > 0:
        st0 = t_base % STAGES
        mbarrier.wait(k_ready.index(st0), (t_base // STAGES) & 1)
        s = warpgroup_mma(q, k_bufs.index(st0).permute((1, 0)), s, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,))
        if k_hold is None:
            mbarrier.arrive(k_empty.index(st0), count=1)
        else:
            mbarrier.arrive(k_empty.index(st0), count=1, pred=n_tiles > 1)
        if _body_tile(0, n_body, n_head, WINDOW):
            p, m_i, alpha = softmax_step(s, m_i, qk_scale, ks + offs_n, limit, ke, False, CAUSAL, cap_scale, SOFTCAP)
        else:
            p, m_i, alpha = softmax_step(
                s, m_i, qk_scale, ks + offs_n, limit, ke, True, CAUSAL, cap_scale, SOFTCAP, WINDOW,
                window_left,
            )  # fmt: skip
        l_i = gl.sum(p, axis=1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        for i in range(1, n_tiles):
            gi = t_base + i
            st = gi % STAGES
            pst = (gi - 1) % STAGES
            mbarrier.wait(k_ready.index(st), (gi // STAGES) & 1)
            mbarrier.wait(v_ready.index(pst), ((gi - 1) // STAGES) & 1)
            s = warpgroup_mma(q, k_bufs.index(st).permute((1, 0)), s, use_acc=False, is_async=True)
            acc = warpgroup_mma(p_op, v_bufs.index(pst), acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s,))
            if k_hold is None:
                mbarrier.arrive(k_empty.index(st), count=1)
            else:
                mbarrier.arrive(k_empty.index(st), count=1, pred=i < n_tiles - 1)
            kidx = ks + i * BLOCK_N + offs_n
            if _body_tile(i, n_body, n_head, WINDOW):
                p, m_i, alpha = softmax_step(s, m_i, qk_scale, kidx, limit, ke, False, CAUSAL, cap_scale, SOFTCAP)
            else:
                p, m_i, alpha = softmax_step(
                    s, m_i, qk_scale, kidx, limit, ke, True, CAUSAL, cap_scale, SOFTCAP, WINDOW,
                    window_left,
                )  # fmt: skip
            acc = warpgroup_mma_wait(0, deps=(acc,))
            mbarrier.arrive(v_empty.index(pst), count=1)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            l_i = l_i * alpha + gl.sum(p, axis=1)
            p_op = gl.convert_layout(p.to(dtype), p_layout)
        if q_free is not None:
            mbarrier.arrive(q_free, count=1)  # (every score of the range has landed: the query tile is free)
        if k_hold is not None:
            mbarrier.arrive(k_hold, count=1)  # (the last tile's K: kept for the caller)
        last = n_tiles - 1
        glast = t_base + last
        lst = glast % STAGES
        mbarrier.wait(v_ready.index(lst), (glast // STAGES) & 1)
        if ZERO_V_TAIL:
            lo = ks + last * BLOCK_N
            if ke - lo < BLOCK_N:
                # (every consumer writes the same values, so their writes agree)
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
    else:
        if q_free is not None:
            mbarrier.arrive(q_free, count=1)
    return acc, m_i, l_i


@gluon.jit
def normalize(acc, l_i):
    """The finished rows ``acc / l_i`` (a row that saw no key: 0)."""
    row_o: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    o = acc * gl.expand_dims(gl.convert_layout(1.0 / l_safe, row_o), 1)
    return o


@gluon.jit
def row_lse(m_i, l_i):
    """lse ``m_i + log2(l_i)`` of the finished rows (a row that saw no key: ``-inf``)."""
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    return gl.where(empty, float("-inf"), m_i + gl.log2(l_safe))


@gluon.jit
def store_rows(o, lse, o_ptr, o_off, ok_o, lse_ptr, l_off, ok_l, WRITE_LSE: gl.constexpr):
    """Row ``r`` of ``o`` to ``o_ptr + o_off[r]`` (HEAD_DIM contiguous values) where ``ok_o[r]``, and (WRITE_LSE)
    of ``lse`` to ``lse_ptr + l_off[r]`` where ``ok_l[r]``: ``o_off`` and ``ok_o`` in the accumulator's row layout,
    ``l_off`` and ``ok_l`` in the scores'."""
    HEAD_DIM: gl.constexpr = o.shape[1]
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o.type.layout))
    o_mask = gl.expand_dims(ok_o, 1) & gl.expand_dims(offs_d < HEAD_DIM, 0)
    gl.store(o_ptr + gl.expand_dims(o_off, 1) + gl.expand_dims(offs_d, 0), o.to(o_ptr.dtype.element_ty), mask=o_mask)
    if WRITE_LSE:
        gl.store(lse_ptr + l_off, lse, mask=ok_l)


def kernel_layouts(dtype_str: str, tile_t: int, block_n: int, head_dim: int):
    """NVMMA shared layouts of the query and K/V descriptors' blocks (2-D: rows x head dim of one head, over
    a ``[tokens, heads * head_dim]`` view; paged: ``block_n`` = the page size, one page of one head)."""
    gdt = {"fp16": gl.float16, "bf16": gl.bfloat16}[dtype_str]
    q_layout = gl.NVMMASharedLayout.get_default_for([tile_t, head_dim], gdt)
    kv_layout = gl.NVMMASharedLayout.get_default_for([block_n, head_dim], gdt)
    return q_layout, kv_layout


__all__ = [
    "ROWS",
    "acc_layout",
    "alloc_ring",
    "attend_ring",
    "kernel_layouts",
    "load_paged_kv",
    "normalize",
    "row_lse",
    "score_layout",
    "softmax_step",
    "store_rows",
]
