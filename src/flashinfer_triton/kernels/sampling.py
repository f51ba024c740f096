"""Sampling kernels: softmax, exact filtered sampling (top-k / top-p / min-p), renormalisation,
top-k logit masking and chain speculative sampling.

Three layouts. Softmax and sampling with top-k, with both top-k and top-p, or without a filter split each
row over several programs (the row-split path) so that small batches fill the GPU; min-p, renormalisation,
masking and chain speculative sampling run one program per row, walking it in ``BLOCK``-wide tiles; top-p
alone runs rejection rounds (at the end of this file), which need no threshold unless a row exhausts its rounds:
one program per row, with the first round split over chunks of the row at small batch. The row-wise
threshold search below also serves the row-split path, over its compacted candidates and as its exact
fallback. No launch reads back to the host and every launch has a fixed grid, so all of it is CUDA-graph
safe.

Row-wise filters are exact thresholds, found without sorting. Each element maps to an int32 *key* that orders
like its float value (the bit pattern, lower 31 bits flipped for negatives). ``_search`` finds the
largest element key ``t`` whose aggregate ``F(t)`` over the elements with key ``>= t`` (their count for
top-k, their probability mass for top-p) still reaches a target. Every pass evaluates ``F`` at ``NP``
pivots spread over the remaining key interval and snaps the interval's ends to element keys (the
smallest key at or above the last pivot that reached the target, the largest key below the first that
did not), so the interval shrinks at least ``NP``-fold per pass and ends on an element key, and the
count and mass of the kept set come out of the search. Sampling then draws by inverse CDF over the kept
set: the first index whose running mass exceeds ``u * S`` for one uniform ``u`` per row, with tiles in a
fixed order, so a draw is deterministic given ``u``. (The rejection rounds take ``R * K + 1`` uniforms a
row and are deterministic given them in the same way.)
"""

import torch
import triton
import triton.language as tl

from .. import _config
from .._launch import FastKernel, bind, hooks_set

# constexpr: compiled Triton (unlike the interpreter) rejects plain globals inside jitted functions
INT32_MAX = tl.constexpr(2147483647)
INT32_MIN = tl.constexpr(-2147483648)


@triton.jit
def _key(x):
    """int32 key ordered like the float32 value ``x``."""
    b = x.to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _unkey(k):
    return (k ^ ((k >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _row_stats(x_ptr, V, BLOCK: tl.constexpr):
    """(sum, min key, max key) of one row."""
    total = tl.zeros((), tl.float32)
    kmin = tl.full((), INT32_MAX, tl.int32)
    kmax = tl.full((), INT32_MIN, tl.int32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < V
        x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
        k = _key(x)
        total += tl.sum(x, axis=0)
        kmin = tl.minimum(kmin, tl.min(tl.where(m, k, INT32_MAX), axis=0))
        kmax = tl.maximum(kmax, tl.max(tl.where(m, k, INT32_MIN), axis=0))
    return total, kmin, kmax


@triton.jit
def _search(x_ptr, V, target, lo, hi, cnt_lo, sum_lo, BY_SUM: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr):
    """Largest element key ``t`` in ``[lo, hi]`` with ``F(t) >= target``; ``F`` = count (or mass, ``BY_SUM``)
    of the elements with key ``>= t``. Needs ``F(lo) >= target``, ``lo`` an element key and ``cnt_lo`` /
    ``sum_lo`` its count and mass. Returns ``(t, count, mass)`` of the kept set."""
    steps = tl.arange(1, NP + 1).to(tl.int64)
    sel = tl.arange(0, NP)
    while lo < hi:
        span = hi.to(tl.int64) - lo.to(tl.int64)
        piv = (lo.to(tl.int64) + (span * steps + NP - 1) // NP).to(tl.int32)  # [NP], last == hi
        cnt = tl.zeros((NP,), tl.int32)
        mass = tl.zeros((NP,), tl.float32)
        above = tl.full((NP,), INT32_MAX, tl.int32)
        below = tl.full((NP,), INT32_MIN, tl.int32)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < V
            x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
            k = _key(x)
            ge = (k[:, None] >= piv[None, :]) & m[:, None]
            cnt += tl.sum(ge.to(tl.int32), axis=0)
            mass += tl.sum(tl.where(ge, x[:, None], 0.0), axis=0)
            above = tl.minimum(above, tl.min(tl.where(ge, k[:, None], INT32_MAX), axis=0))
            below = tl.maximum(below, tl.max(tl.where(ge | (~m[:, None]), INT32_MIN, k[:, None]), axis=0))
        if BY_SUM:
            good = mass >= target
        else:
            good = cnt.to(tl.float32) >= target
        g = tl.sum(good.to(tl.int32), axis=0)  # good pivots form a prefix
        if g > 0:
            pick = sel == g - 1
            lo = tl.sum(tl.where(pick, above, 0), axis=0)
            cnt_lo = tl.sum(tl.where(pick, cnt, 0), axis=0)
            sum_lo = tl.sum(tl.where(pick, mass, 0.0), axis=0)
        if g < NP:
            hi = tl.sum(tl.where(sel == g, below, 0), axis=0)
        else:
            hi = lo
    return lo, cnt_lo, sum_lo


@triton.jit
def _search_regs(x, k, valid, target, lo, hi, cnt_lo, sum_lo, BY_SUM: tl.constexpr, NP: tl.constexpr):
    """``_search`` over values held in registers (``x``, their keys ``k``, ``valid`` marking the elements):
    no load per pass, so a pass costs its compares and reductions alone."""
    steps = tl.arange(1, NP + 1).to(tl.int64)
    sel = tl.arange(0, NP)
    while lo < hi:
        span = hi.to(tl.int64) - lo.to(tl.int64)
        piv = (lo.to(tl.int64) + (span * steps + NP - 1) // NP).to(tl.int32)
        ge = (k[:, None] >= piv[None, :]) & valid[:, None]
        cnt = tl.sum(ge.to(tl.int32), axis=0)
        mass = tl.sum(tl.where(ge, x[:, None], 0.0), axis=0)
        above = tl.min(tl.where(ge, k[:, None], INT32_MAX), axis=0)
        below = tl.max(tl.where(ge | (~valid[:, None]), INT32_MIN, k[:, None]), axis=0)
        if BY_SUM:
            good = mass >= target
        else:
            good = cnt.to(tl.float32) >= target
        g = tl.sum(good.to(tl.int32), axis=0)
        if g > 0:
            pick = sel == g - 1
            lo = tl.sum(tl.where(pick, above, 0), axis=0)
            cnt_lo = tl.sum(tl.where(pick, cnt, 0), axis=0)
            sum_lo = tl.sum(tl.where(pick, mass, 0.0), axis=0)
        if g < NP:
            hi = tl.sum(tl.where(sel == g, below, 0), axis=0)
        else:
            hi = lo
    return lo, cnt_lo, sum_lo


@triton.jit
def _thresholds(
    x_ptr, V, i, k_ptr, k_val, p_ptr, p_val,
    HAS_K: tl.constexpr, K_ARR: tl.constexpr, HAS_P: tl.constexpr, P_ARR: tl.constexpr, K_FIRST: tl.constexpr,
    NP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_SCAN: tl.constexpr,
):  # fmt: skip
    """Key threshold of the kept set under top-k and/or top-p (joint, or top-p on the top-k set with
    ``K_FIRST``), its mass, and the row's mass."""
    total, kmin, kmax = _row_stats(x_ptr, V, BLOCK_SCAN)
    t = kmin
    n_all = V + tl.zeros((), tl.int32)
    cnt = n_all
    mass = total
    if HAS_K:
        if K_ARR:
            k = tl.load(k_ptr + i).to(tl.int32)
        else:
            k = k_val + tl.zeros((), tl.int32)
        if (k > 0) & (k < V):
            t, cnt, mass = _search(x_ptr, V, k.to(tl.float32), kmin, kmax, cnt, mass, False, NP, BLOCK)
    if HAS_P:
        if P_ARR:
            p = tl.load(p_ptr + i).to(tl.float32)
        else:
            p = p_val + tl.zeros((), tl.float32)
        if p < 1.0:
            if K_FIRST:
                tp, cp, mp = _search(x_ptr, V, p * mass, t, kmax, cnt, mass, True, NP, BLOCK)
            else:
                tp, cp, mp = _search(x_ptr, V, p * total, kmin, kmax, n_all, total, True, NP, BLOCK)
            if tp > t:
                t = tp
                mass = mp
    return t, mass, total


@triton.jit
def _draw(x_ptr, V, t, thr_val, mass, u, USE_VAL: tl.constexpr, FROM_LOGITS: tl.constexpr, mx, BLOCK: tl.constexpr):
    """First index whose running kept weight exceeds ``u * mass`` (the last kept index if rounding leaves
    none). Kept: key ``>= t`` (or value ``>= thr_val`` with ``USE_VAL``); weight ``exp(x - mx)`` for logits."""
    target = u * mass
    run = tl.zeros((), tl.float32)
    res = tl.full((), -1, tl.int32)
    last = tl.full((), -1, tl.int32)
    start = 0
    while (start < V) & (res < 0):
        offs = start + tl.arange(0, BLOCK)
        m = offs < V
        x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
        if FROM_LOGITS:
            w = tl.where(m, tl.exp(x - mx), 0.0)
        else:
            if USE_VAL:
                keep = x >= thr_val
            else:
                keep = _key(x) >= t
            w = tl.where(m & keep, x, 0.0)
        cs = tl.cumsum(w, axis=0) + run
        hit = (cs > target) & (w > 0)
        res = tl.min(tl.where(hit, offs, INT32_MAX), axis=0)
        res = tl.where(res == INT32_MAX, -1, res)
        last = tl.maximum(last, tl.max(tl.where(w > 0, offs, -1), axis=0))
        run += tl.sum(w, axis=0)
        start += BLOCK
    return tl.where(res >= 0, res, last)


@triton.jit
def _sample_kernel(
    x_ptr, stride_x, idx_ptr, u_ptr, out_ptr, valid_ptr, V,
    k_ptr, k_val, p_ptr, p_val, minp_ptr, minp_val,
    HAS_INDICES: tl.constexpr, FROM_LOGITS: tl.constexpr,
    HAS_K: tl.constexpr, K_ARR: tl.constexpr, HAS_P: tl.constexpr, P_ARR: tl.constexpr, K_FIRST: tl.constexpr,
    HAS_MINP: tl.constexpr, MINP_ARR: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK_SCAN: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    if HAS_INDICES:
        row = tl.load(idx_ptr + i).to(tl.int64)
    else:
        row = i.to(tl.int64)
    x_row = x_ptr + row * stride_x
    u = tl.load(u_ptr + i)
    mx = 0.0
    thr_val = 0.0
    t = tl.full((), INT32_MIN, tl.int32)
    if FROM_LOGITS:
        mx = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        for start in range(0, V, BLOCK_SCAN):
            offs = start + tl.arange(0, BLOCK_SCAN)
            x = tl.load(x_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
            new_mx = tl.maximum(mx, tl.max(x, axis=0))
            s = s * tl.exp(mx - new_mx) + tl.sum(tl.exp(x - new_mx), axis=0)
            mx = new_mx
        mass = s
    elif HAS_MINP:
        total, kmin, kmax = _row_stats(x_row, V, BLOCK_SCAN)
        if MINP_ARR:
            mp = tl.load(minp_ptr + i).to(tl.float32)
        else:
            mp = minp_val + tl.zeros((), tl.float32)
        thr_val = mp * _unkey(kmax)
        mass = tl.zeros((), tl.float32)
        for start in range(0, V, BLOCK_SCAN):
            offs = start + tl.arange(0, BLOCK_SCAN)
            x = tl.load(x_row + offs, mask=offs < V, other=0.0).to(tl.float32)
            mass += tl.sum(tl.where(x >= thr_val, x, 0.0), axis=0)
    else:
        t, mass, total = _thresholds(
            x_row, V, i, k_ptr, k_val, p_ptr, p_val, HAS_K, K_ARR, HAS_P, P_ARR, K_FIRST, NP, BLOCK, BLOCK_SCAN
        )
    res = _draw(x_row, V, t, thr_val, mass, u, HAS_MINP, FROM_LOGITS, mx, BLOCK_SCAN)
    ok = (res >= 0) & (mass > 0)
    tl.store(out_ptr + i, tl.maximum(res, 0).to(out_ptr.dtype.element_ty))
    tl.store(valid_ptr + i, ok.to(valid_ptr.dtype.element_ty))


@triton.jit
def _renorm_kernel(
    x_ptr, out_ptr, stride_x, stride_o, V, k_ptr, k_val, p_ptr, p_val,
    HAS_K: tl.constexpr, K_ARR: tl.constexpr, HAS_P: tl.constexpr, P_ARR: tl.constexpr,
    MASK_LOGITS: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr, BLOCK_SCAN: tl.constexpr,
):  # fmt: skip
    """Top-k / top-p renormalised probabilities (kept / kept mass, else 0), or top-k masked logits
    (kept logits, else -inf)."""
    i = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + i * stride_x
    o_row = out_ptr + i * stride_o
    t, mass, total = _thresholds(
        x_row, V, i, k_ptr, k_val, p_ptr, p_val, HAS_K, K_ARR, HAS_P, P_ARR, False, NP, BLOCK, BLOCK_SCAN
    )
    inv = 1.0 / mass
    for start in range(0, V, BLOCK_SCAN):
        offs = start + tl.arange(0, BLOCK_SCAN)
        m = offs < V
        x = tl.load(x_row + offs, mask=m, other=0.0).to(tl.float32)
        keep = _key(x) >= t
        if MASK_LOGITS:
            y = tl.where(keep, x, float("-inf"))
        else:
            y = tl.where(keep, x * inv, 0.0)
        tl.store(o_row + offs, y.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _uniform_kernel(seed_ptr, seed_val, off_ptr, off_val, out_ptr, n_u, SEED_ARR: tl.constexpr, BLOCK: tl.constexpr):
    """``out[i, j]``: Philox uniform of key ``seed ^ (i << 40)`` at counter ``offset + j`` (seed and
    offset per row when given as tensors of the batch size, else shared)."""
    i = tl.program_id(0)
    if SEED_ARR:
        seed = tl.load(seed_ptr + i).to(tl.int64)
        off = tl.load(off_ptr + i).to(tl.int64)
    else:
        seed = seed_val + tl.zeros((), tl.int64)
        off = off_val + tl.zeros((), tl.int64)
    key = seed ^ (i.to(tl.int64) << 40)
    j = tl.arange(0, BLOCK)
    u = tl.rand(key, (off + j).to(tl.int32))
    tl.store(out_ptr + i * n_u + j, u, mask=j < n_u)


@triton.jit
def _chain_kernel(
    draft_ptr, draft_ids_ptr, target_ptr, u_ptr, out_ptr, acc_ptr, emit_ptr, n_spec, V, BLOCK: tl.constexpr
):  # fmt: skip
    """Chain speculative sampling of one request: accept draft token ``i`` while ``u_i * q_i < p_i``
    (``q`` draft, ``p`` target probability of the draft token), then draw the first rejected position
    from ``relu(p - q)`` (the bonus position from ``p``), pad with -1."""
    b = tl.program_id(0).to(tl.int64)
    u_row = u_ptr + b * (n_spec + 1)
    pos = n_spec + tl.zeros((), tl.int32)
    accepted = tl.zeros((), tl.int32)
    for i in range(0, n_spec):
        d = tl.load(draft_ids_ptr + b * n_spec + i).to(tl.int64)
        q = tl.load(draft_ptr + (b * n_spec + i) * V + d).to(tl.float32)
        p = tl.load(target_ptr + (b * (n_spec + 1) + i) * V + d).to(tl.float32)
        u = tl.load(u_row + i)
        ok = u * q < p
        if pos == n_spec:
            if ok:
                tl.store(out_ptr + b * (n_spec + 1) + i, d.to(out_ptr.dtype.element_ty))
            else:
                pos = i
        accepted += ok.to(tl.int32)
    tl.store(acc_ptr + b, tl.load(acc_ptr + b) + accepted)
    tl.store(emit_ptr + b, tl.load(emit_ptr + b) + pos)
    p_row = target_ptr + (b * (n_spec + 1) + pos) * V
    q_row = draft_ptr + (b * n_spec + pos) * V
    has_q = pos < n_spec
    total = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < V
        p = tl.load(p_row + offs, mask=m, other=0.0).to(tl.float32)
        q = tl.load(q_row + offs, mask=m & has_q, other=0.0).to(tl.float32)
        total += tl.sum(tl.maximum(p - q, 0.0), axis=0)
    target = tl.load(u_row + n_spec) * total
    run = tl.zeros((), tl.float32)
    res = tl.full((), -1, tl.int32)
    last = tl.full((), -1, tl.int32)
    start = 0
    while (start < V) & (res < 0):
        offs = start + tl.arange(0, BLOCK)
        m = offs < V
        p = tl.load(p_row + offs, mask=m, other=0.0).to(tl.float32)
        q = tl.load(q_row + offs, mask=m & has_q, other=0.0).to(tl.float32)
        w = tl.maximum(p - q, 0.0)
        cs = tl.cumsum(w, axis=0) + run
        hit = (cs > target) & (w > 0)
        res = tl.min(tl.where(hit, offs, INT32_MAX), axis=0)
        res = tl.where(res == INT32_MAX, -1, res)
        last = tl.maximum(last, tl.max(tl.where(w > 0, offs, -1), axis=0))
        run += tl.sum(w, axis=0)
        start += BLOCK
    res = tl.where(res >= 0, res, last)
    o_row = out_ptr + b * (n_spec + 1)
    tl.store(o_row + pos, tl.maximum(res, 0).to(out_ptr.dtype.element_ty))
    for j in range(0, n_spec + 1):
        if j > pos:
            tl.store(o_row + j, tl.full((), -1, tl.int32).to(out_ptr.dtype.element_ty))


# ----------------------------------------------------------------------------------------------- row-split path
#
# Rows are cut into chunks of ``CH`` elements and each (row, chunk) is one program, so a small batch still
# fills the GPU (batch 1: chunks of 2048, one or two tiles per program, so every pass costs about one
# memory round trip). Partial results go to a workspace written with plain stores (no atomics, no memset)
# and every later program re-reduces the partials it needs in a fixed order, so results are deterministic.
# Sampling without a filter uses chunks of one tile (its partials and draw: two launches).
#
# Filtered sampling (top-k / top-p / both), exact, in four launches, two of them streaming passes over the row
# in chunks of one tile (each tile loaded whole, so a program keeps its whole chunk's loads in flight):
# 1. ``_pivot_kernel``: per chunk, the sum, the max, and the count at or above each pivot of a grid of keys
#    ``top - j * 2**SH`` under the chunk's max (a histogram of ``_binade``, a few integer operations an
#    element). Chunks share the grid, so a chunk's counts are its row's, shifted by its top's distance from
#    the row's. Top-k alone: 16 pivots a binade apart; with top-p, 256 pivots, 8 a binade.
# 2. ``_band_kernel``: one program per row sums the row's counts, bounds the mass at or above each pivot from
#    them (``_mass_bounds``: no pass computes masses) and finds the *band* of pivot intervals that must hold
#    the threshold. The per-chunk counts give each chunk's band count, so their prefix over the chunks is
#    each chunk's exact offset in the row's ``SLOTS`` candidate slots.
# 3. ``_compact_kernel``: the chunks write their band elements' values densely, in index order, and the
#    count and mass above the band. Both passes classify elements alike (``_binade`` is the float compares
#    on the pivots), and a chunk whose count still disagrees sends its row to the fallback.
# 4. ``_finish_kernel``: one program per row runs ``_search`` over the candidate values (in registers when
#    they fit one tile, else from L2; at most ``SLOTS``) with its targets less the count / mass above the
#    band: the exact threshold in a few passes. Kept mass per chunk (mass above the band plus the chunk's
#    kept candidates, read off a running sum in slot order) picks the chunk of the inverse-CDF draw, and
#    only that chunk is scanned.
#
# A row whose band holds more than ``SLOTS`` elements (flat rows: high temperatures) takes a second level in the
# same launches: the compaction counts the band's elements in 256 bins of the band's key range and sums their
# mass, and the finish bounds the mass at each bin edge from those (a bin spans 1/256 of the band, so the bounds
# are tight), collects the few bins that must hold the threshold in one pass over the row, with the exact count
# and mass above them, and searches them like candidates. A row whose band misses the threshold (a top-k
# threshold more than 15 binades below the max, a top-p threshold more than 32, unnormalised rows with extreme
# values), or whose second-level bins still hold more than ``SLOTS`` elements (many tied values), takes
# ``_search`` over the whole row instead, so the result is always exact; only its speed depends on the data.


@triton.jit
def _row_ptr(x_ptr, stride_x, idx_ptr, i, HAS_INDICES: tl.constexpr):
    if HAS_INDICES:
        row = tl.load(idx_ptr + i).to(tl.int64)
    else:
        row = i.to(tl.int64)
    return x_ptr + row * stride_x


@triton.jit
def _carve(ws, NC, NP: tl.constexpr):
    """The regions of one float32 workspace (``NC`` = rows x chunks): chunk sums (or logit maxima), chunk
    maxima (or exp-sums), mass above the band, candidate counts, counts above the band, pivot counts (then the
    second level's counts), candidate values. One allocation and no host-side views: each view costs host time
    per call."""
    wi = ws.to(tl.pointer_type(tl.int32), bitcast=True)
    return ws, ws + NC, ws + 2 * NC, wi + 3 * NC, wi + 4 * NC, wi + 12 * NC, ws + 12 * NC + NC.to(tl.int64) * NP


@triton.jit
def _carve_band(ws, NC):
    """The band regions of the workspace, per (row, chunk): the chunk's first candidate slot, its band count
    and the band's upper and lower edges as the compaction compares them (NaN: no element is above the
    band / none is in it, no filter being on; -inf: the band has no lower edge)."""
    wi = ws.to(tl.pointer_type(tl.int32), bitcast=True)
    return wi + 5 * NC, wi + 6 * NC, ws + 7 * NC, ws + 8 * NC


@triton.jit
def _carve_fine(ws, NC):
    """The second level's regions, per (row, chunk): the band's mass, the row's band count and the key just above
    the band (the top of the second level's range)."""
    wi = ws.to(tl.pointer_type(tl.int32), bitcast=True)
    return ws + 9 * NC, wi + 10 * NC, wi + 11 * NC


@triton.jit
def _fine_range(v_lo, hi_k, NP: tl.constexpr):
    """The second level's grid over the band's keys ``[key(v_lo), hi_k)``: ``NP`` bins of ``w`` keys from the top,
    bin ``j`` holding keys ``[max(hi_k - (j + 1) * w, lo_k), hi_k - j * w)``. Returns ``(lo_k, w)``."""
    lo_k = _key(v_lo)
    w = tl.maximum((hi_k - lo_k + NP - 1) // NP, 1)
    return lo_k, w


@triton.jit
def _pdl_start(PDL: tl.constexpr):
    """Programmatic dependent launch (sm_90+): the kernel may start while the previous one in the stream runs,
    so it waits for that kernel's completion before any load or store (its workspace may be memory the previous
    kernel still reads). It then lets the next kernel launch at once: that one waits the same way, so only the
    launches overlap the work, never a read of an unfinished write."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _scaled(ptrs, mask, rt):
    """Logits ``* rt`` (1 / temperature) as float32, -inf past the row: the padding is not scaled, so a temperature
    of inf (rt = 0) gives 0 on the row's finite logits, not ``-inf * 0`` = NaN on the padding."""
    return tl.where(mask, tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) * rt, float("-inf"))


# Every row-split kernel takes the same leading parameters, the ones that change from call to call
# (tensors and scalar filter values): a launch bound to everything else takes just these.
@triton.jit(do_not_specialize=["k_val"])
def _partials_kernel(
    x_ptr, idx_ptr, u_ptr, out_ptr, valid_ptr, ws, k_ptr, k_val, t_ptr, t_val, stride_x, V, CH, C, NC,
    HAS_INDICES: tl.constexpr, LOGITS: tl.constexpr, T_ARR: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Per (row, chunk): the sum and the max (probabilities), or the max and ``sum(exp(x/T - max))``
    (logits). The temperature comes in the place of the top-p value."""
    _pdl_start(PDL)
    ws_a = ws
    ws_b = ws + NC
    i = tl.program_id(0)
    c = tl.program_id(1)
    x_row = _row_ptr(x_ptr, stride_x, idx_ptr, i, HAS_INDICES)
    lo = c * CH
    hi = tl.minimum(lo + CH, V)
    if LOGITS:
        if T_ARR:
            rt = 1.0 / tl.load(t_ptr + i).to(tl.float32)
        else:
            rt = 1.0 / (t_val + tl.zeros((), tl.float32))
        mx = tl.full((BLOCK,), float("-inf"), tl.float32)
        s = tl.zeros((BLOCK,), tl.float32)
        for start in range(lo, hi, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = _scaled(x_row + offs, offs < hi, rt)
            new = tl.maximum(mx, x)
            s = s * tl.exp(tl.where(new == float("-inf"), 0.0, mx - new)) + tl.where(
                x == float("-inf"), 0.0, tl.exp(x - new)
            )
            mx = new
        m = tl.max(mx, axis=0)
        tot = tl.sum(tl.where(mx == float("-inf"), 0.0, s * tl.exp(mx - m)), axis=0)
        tl.store(ws_a + i * C + c, m)
        tl.store(ws_b + i * C + c, tot)
    else:
        s = tl.zeros((BLOCK,), tl.float32)
        mx = tl.full((BLOCK,), float("-inf"), tl.float32)
        for start in range(lo, hi, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < hi, other=float("-inf")).to(tl.float32)
            s += tl.where(offs < hi, x, 0.0)
            mx = tl.maximum(mx, x)
        tl.store(ws_a + i * C + c, tl.sum(s, axis=0))
        tl.store(ws_b + i * C + c, tl.max(mx, axis=0))


@triton.jit(do_not_specialize=["k_val"])
def _softmax_write_kernel(
    x_ptr, idx_ptr, u_ptr, out_ptr, valid_ptr, ws, k_ptr, k_val, t_ptr, t_val, stride_x, stride_o, V, CH, C, NC,
    T_ARR: tl.constexpr, CP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    _pdl_start(PDL)
    ws_m = ws
    ws_s = ws + NC
    # Programs in the reverse order of the partials pass: the chunks it read last are still in L2.
    i = (tl.num_programs(0) - 1 - tl.program_id(0)).to(tl.int64)
    c = tl.num_programs(1) - 1 - tl.program_id(1)
    if T_ARR:
        rt = 1.0 / tl.load(t_ptr + i).to(tl.float32)
    else:
        rt = 1.0 / (t_val + tl.zeros((), tl.float32))
    cc = tl.arange(0, CP)
    pm = tl.load(ws_m + i * C + cc, mask=cc < C, other=float("-inf"))
    ps = tl.load(ws_s + i * C + cc, mask=cc < C, other=0.0)
    mx = tl.max(pm, axis=0)
    inv = 1.0 / tl.sum(tl.where(pm == float("-inf"), 0.0, ps * tl.exp(pm - mx)), axis=0)
    lo = c * CH
    hi = tl.minimum(lo + CH, V)
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < hi
        x = tl.load(x_ptr + i * stride_x + offs, mask=m, other=float("-inf")).to(tl.float32) * rt
        tl.store(out_ptr + i * stride_o + offs, tl.exp(x - mx) * inv, mask=m)


@triton.jit
def _softmax_rows_kernel(
    x_ptr, idx_ptr, u_ptr, out_ptr, valid_ptr, ws, k_ptr, k_val, t_ptr, t_val, stride_x, stride_o, V,
    T_ARR: tl.constexpr, W: tl.constexpr, NPC: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One program a row, the row held whole in registers as ``NPC`` pieces of ``W`` (16 entries a thread each):
    the max, the exp-sum and the write all come from that copy, so the row is read once (the split path reads it
    twice)."""
    _pdl_start(PDL)
    i = tl.program_id(0).to(tl.int64)
    if T_ARR:
        rt = 1.0 / tl.load(t_ptr + i).to(tl.float32)
    else:
        rt = 1.0 / (t_val + tl.zeros((), tl.float32))
    x_row = x_ptr + i * stride_x
    o_row = out_ptr + i * stride_o
    offs = tl.arange(0, W)
    xs = ()
    for j in tl.static_range(NPC):  # (every piece's loads in flight at once)
        o = j * W + offs
        xs = xs + (_scaled(x_row + o, o < V, rt),)
    mx = tl.max(xs[0], axis=0)
    for j in tl.static_range(1, NPC):
        mx = tl.maximum(mx, tl.max(xs[j], axis=0))
    es = ()
    tot = tl.zeros((), tl.float32)
    for j in tl.static_range(NPC):
        e = tl.exp(xs[j] - mx)
        tot += tl.sum(e, axis=0)
        es = es + (e,)
    inv = 1.0 / tot
    for j in tl.static_range(NPC):
        o = j * W + offs
        tl.store(o_row + o, es[j] * inv, mask=o < V)


@triton.jit
def _softmax_rowpass_kernel(
    x_ptr, idx_ptr, u_ptr, out_ptr, valid_ptr, ws, k_ptr, k_val, t_ptr, t_val, stride_x, stride_o, V, n,
    T_ARR: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Persistent programs, a row at a time: the online max and exp-sum over the row in order, then the write pass
    over it backwards, so that it reads first what the first pass read last (still in L2), its loads and stores
    marked evict-first (their lines are not read again). Few rows in flight at once (one program an SM) keep the
    reuse distance about the L2's size at batch 256 over 128256 entries. Both loops run unstaged (``num_stages=1``):
    cp.async stages carry no eviction hint, and on an H100 at batch 256 over 128256 entries three stages gained 0.4%
    over the row-split path where plain loads gained 3.7%."""
    _pdl_start(PDL)
    nb = tl.cdiv(V, BLOCK)
    for i in range(tl.program_id(0), n, tl.num_programs(0)):
        i64 = tl.zeros((), tl.int64) + i  # (the interpreter gives a plain int)
        if T_ARR:
            rt = 1.0 / tl.load(t_ptr + i64).to(tl.float32)
        else:
            rt = 1.0 / (t_val + tl.zeros((), tl.float32))
        x_row = x_ptr + i64 * stride_x
        o_row = out_ptr + i64 * stride_o
        mx = tl.full((BLOCK,), float("-inf"), tl.float32)
        sm = tl.zeros((BLOCK,), tl.float32)
        for start in tl.range(0, V, BLOCK, num_stages=1):
            offs = start + tl.arange(0, BLOCK)
            x = _scaled(x_row + offs, offs < V, rt)
            new = tl.maximum(mx, x)
            sm = sm * tl.exp(tl.where(new == float("-inf"), 0.0, mx - new)) + tl.where(
                x == float("-inf"), 0.0, tl.exp(x - new)
            )
            mx = new
        m = tl.max(mx, axis=0)
        inv = 1.0 / tl.sum(tl.where(mx == float("-inf"), 0.0, sm * tl.exp(mx - m)), axis=0)
        for b in tl.range(0, nb, num_stages=1):
            offs = (nb - 1 - b) * BLOCK + tl.arange(0, BLOCK)
            msk = offs < V
            x = tl.load(x_row + offs, mask=msk, other=float("-inf"), eviction_policy="evict_first").to(tl.float32)
            tl.store(o_row + offs, tl.exp(x * rt - m) * inv, mask=msk, eviction_policy="evict_first")


@triton.jit
def _top(mx, SH: tl.constexpr):
    """The pivot grid's top key above a maximum ``mx``: its key rounded up to a multiple of ``2**SH`` (at most
    that of +inf). Chunks and rows share the grid, so a chunk's intervals are its row's, shifted."""
    k = tl.minimum(tl.maximum(_key(mx), 0), 0x7F800000)
    return ((k + ((1 << SH) - 1)) >> SH) << SH


@triton.jit
def _pivots(ws_s, ws_m, i, C, CP: tl.constexpr, NP: tl.constexpr, SH: tl.constexpr):
    """``NP`` descending pivots of a row, ``v[j] = unkey(top - j * 2**SH)`` (``2**(23 - SH)`` a binade), so that
    ``x >= v[j]`` holds exactly when ``_binade(x, top) <= j``, and each chunk's histogram offset into them
    (its own top's distance from the row's, in pivots). Returns ``(v, offsets [CP], sum, max)``. Every program
    of a row computes the same pivots."""
    cc = tl.arange(0, CP)
    total = tl.sum(tl.load(ws_s + i * C + cc, mask=cc < C, other=0.0), axis=0)
    c_mx = tl.load(ws_m + i * C + cc, mask=cc < C, other=float("-inf"))
    mx = tl.max(c_mx, axis=0)
    top = _top(mx, SH)
    shift = (top - _top(c_mx, SH)) >> SH
    v = _unkey(top - (tl.arange(0, NP) << SH))
    return v, shift, total, mx


@triton.jit
def _mass_bounds(f_cnt, v, mx, total, V, NP: tl.constexpr):
    """Lower and upper bounds of the mass at or above each pivot, from the counts at or above them alone
    (``f_cnt``): the elements between two pivots weigh at least the lower and less than the upper one (and
    at most the max), and the row's sum bounds the complement too, which keeps the bounds tight where the
    mass below a pivot is small (top-p near 1). Slack of ``1e-4`` of the sum covers float rounding (sums of
    256 products and of the chunk sums); the finish checks the band it gets anyway."""
    jj = tl.arange(0, NP)
    prev = tl.gather(f_cnt, tl.maximum(jj - 1, 0), 0)
    n_b = tl.where(jj == 0, f_cnt, f_cnt - prev).to(tl.float32)  # elements in [v_j, v_(j-1))
    v_up = tl.minimum(tl.where(jj == 0, mx, tl.gather(v, tl.maximum(jj - 1, 0), 0)), mx)
    v_lo = tl.maximum(v, 0.0)
    lo_d = tl.cumsum(n_b * v_lo, axis=0)
    hi_d = tl.cumsum(n_b * v_up, axis=0)
    n_below = V - tl.sum(tl.where(jj == NP - 1, f_cnt, 0), axis=0)  # below the last pivot, each < v_(NP-1)
    last = tl.sum(tl.where(jj == NP - 1, v_lo, 0.0), axis=0)
    below_lo = tl.sum(n_b * v_lo, axis=0) - lo_d
    below_hi = tl.sum(n_b * v_up, axis=0) - hi_d + n_below.to(tl.float32) * last
    slack = 1e-4 * total
    f_lo = tl.maximum(lo_d, total - below_hi) - slack
    f_hi = tl.minimum(hi_d, total - below_lo) + slack
    return f_lo, f_hi


@triton.jit(do_not_specialize=["k_val"])
def _pivot_kernel(
    x_ptr, idx_ptr, u_ptr, out_ptr, valid_ptr, ws, k_ptr, k_val, p_ptr, p_val, stride_x, V, CH, C, NC,
    HAS_INDICES: tl.constexpr, NP: tl.constexpr, SH: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Per (row, chunk of one ``BLOCK`` tile): the sum, the max and the count of the elements at or above each
    pivot of the chunk's own grid top (``_top``), from a histogram of their pivot intervals (``_binade``: a
    few integer operations an element, where ``NP`` compares and adds would bind the pass to the ALUs at
    large batch). The tile is loaded once, whole: its top comes from its max. The row's grid top is the
    largest of its chunks', so the band pass reads each chunk's counts shifted into the row's intervals,
    and bounds the pivot masses that top-p needs from these counts: no pass computes them."""
    _pdl_start(PDL)
    ws_s, ws_m, _am, _cc, _ac, ws_pc, _cd = _carve(ws, NC, NP)
    i = tl.program_id(0)
    c = tl.program_id(1)
    x_row = _row_ptr(x_ptr, stride_x, idx_ptr, i, HAS_INDICES)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    m = offs < V
    x = tl.load(x_row + offs, mask=m, other=float("-inf")).to(tl.float32)
    mx = tl.max(x, axis=0)
    tl.store(ws_s + i * C + c, tl.sum(tl.where(m, x, 0.0), axis=0))
    tl.store(ws_m + i * C + c, mx)
    b = _binade(x, _top(mx, SH), SH, NP)
    hist = tl.histogram(b, NP, mask=m & (b < NP))
    tl.store(ws_pc + (i * C + c).to(tl.int64) * NP + tl.arange(0, NP), tl.cumsum(hist, axis=0))


@triton.jit
def _binade(x, top, SH: tl.constexpr, NP: tl.constexpr):
    """Pivot interval of ``x``: the smallest ``j`` in ``[0, NP]`` with ``key(x) >= top - j * 2**SH``, i.e.
    ``x >= v[j]`` for the pivots of ``_pivots``, so the compaction's float compares count the same
    elements. Negative values and -0 (sign bit set) count as +0, below every positive pivot."""
    d = tl.maximum(top - tl.maximum(x.to(tl.int32, bitcast=True), 0), 0)
    return tl.minimum((d + ((1 << SH) - 1)) >> SH, NP)


@triton.jit
def _first_at(cum, jj, target, NP: tl.constexpr):
    """First pivot whose aggregate at-or-above reaches ``target`` (``NP``: none, the bottom interval)."""
    return tl.min(tl.where(cum >= target, jj, NP), axis=0)


@triton.jit
def _load_kp(i, k_ptr, k_val, p_ptr, p_val, V, HAS_K: tl.constexpr, K_ARR: tl.constexpr,
             HAS_P: tl.constexpr, P_ARR: tl.constexpr):  # fmt: skip
    if K_ARR:
        k = tl.load(k_ptr + i).to(tl.int32)
    else:
        k = k_val + tl.zeros((), tl.int32)
    if P_ARR:
        p = tl.load(p_ptr + i).to(tl.float32)
    else:
        p = p_val + tl.zeros((), tl.float32)
    k_on = HAS_K & (k > 0) & (k < V)
    p_on = HAS_P & (p < 1.0)
    return k, k_on, p, p_on


@triton.jit
def _band_range(f_cnt, f_lo, f_hi, jj, k, k_on, p, p_on, total, K_FIRST: tl.constexpr, NP: tl.constexpr):
    """The band ``[ja, jb]`` of intervals that must hold the threshold, from the count at or above each pivot
    (``f_cnt``, exact) and bounds of the mass there (``f_lo``, ``f_hi``)."""
    ja = tl.zeros((), tl.int32)
    jb = tl.zeros((), tl.int32)
    j_k = tl.zeros((), tl.int32)
    if k_on:
        j_k = _first_at(f_cnt, jj, k, NP)
        ja = j_k
        jb = j_k
    if p_on:
        # The top-k set's mass (the base of top-p's target under "top_k_first") lies between the mass at or
        # above the pivot before its interval and that at or above the pivot after it.
        if K_FIRST & k_on:
            s_lo = tl.sum(tl.where(jj == j_k - 1, f_lo, 0.0), axis=0)
            s_hi = tl.where(j_k == NP, total, tl.sum(tl.where(jj == j_k, f_hi, 0.0), axis=0))
        else:
            s_lo = total
            s_hi = total
        # the pivot sums and the finish's sums round differently: widen by a relative 1e-5
        pa = _first_at(f_hi, jj, p * s_lo * 0.99999, NP)
        pb = _first_at(f_lo, jj, p * s_hi * 1.00001, NP)
        if k_on:
            ja = tl.minimum(j_k, pa)
            if not K_FIRST:
                jb = tl.minimum(j_k, pb)
        else:
            ja = pa
            jb = pb
    return ja, jb


@triton.jit(do_not_specialize=["k_val"])  # one compiled variant for every scalar top_k
def _band_kernel(
    x_ptr, idx_ptr, u_ptr, out_ptr, valid_ptr, ws, k_ptr, k_val, p_ptr, p_val, stride_x, V, CH, C, NC,
    HAS_K: tl.constexpr, K_ARR: tl.constexpr, HAS_P: tl.constexpr, P_ARR: tl.constexpr, K_FIRST: tl.constexpr,
    CP: tl.constexpr, NP: tl.constexpr, SH: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Per row: the band of pivot intervals that holds the threshold, and each chunk's share of the
    candidate slots. Interval ``j`` is ``[v_j, v_(j-1))`` (``j = 0``: at or above the top pivot, ``j = NP``:
    below the last); the band ``[ja, jb]`` of intervals holds the threshold, and its elements become
    candidates. One program a row reads the row's pivot counts once, so the compaction's programs start
    streaming at once."""
    _pdl_start(PDL)
    ws_s, ws_m, _am, _cc, acnt_ptr, ws_pc, _cd = _carve(ws, NC, NP)
    off_ptr, want_ptr, vhi_ptr, vlo_ptr = _carve_band(ws, NC)
    i = tl.program_id(0)
    k, k_on, p, p_on = _load_kp(i, k_ptr, k_val, p_ptr, p_val, V, HAS_K, K_ARR, HAS_P, P_ARR)
    v, shift, total, mx = _pivots(ws_s, ws_m, i, C, CP, NP, SH)
    cc = tl.arange(0, CP)
    jj = tl.arange(0, NP)
    # Chunk c's count at the row's pivot j is its own at pivot j - shift[c] (none above its top).
    src = jj[None, :] - shift[:, None]
    pc_row = ws_pc + (i * C).to(tl.int64) * NP
    c_cnt = tl.load(pc_row + cc[:, None] * NP + tl.maximum(src, 0), mask=(cc < C)[:, None] & (src >= 0), other=0)
    f_cnt = tl.sum(c_cnt, axis=0)
    f_lo = tl.zeros((NP,), tl.float32)
    f_hi = tl.zeros((NP,), tl.float32)
    if HAS_P:
        f_lo, f_hi = _mass_bounds(f_cnt, v, mx, total, V, NP)
    ja, jb = _band_range(f_cnt, f_lo, f_hi, jj, k, k_on, p, p_on, total, K_FIRST, NP)
    active = k_on | p_on
    has_above = active & (ja > 0)
    has_below = jb < NP
    v_hi = tl.sum(tl.where(jj == ja - 1, v, 0.0), axis=0)
    v_lo = tl.sum(tl.where(jj == jb, v, 0.0), axis=0)
    # Each chunk's band count from its pivot counts; the prefix over the chunks before it is its first slot.
    len_c = tl.minimum(tl.maximum(V - cc * CH, 0), CH)
    n_lo = tl.where(has_below, tl.sum(tl.where(jj[None, :] == jb, c_cnt, 0), axis=1), len_c)
    n_hi = tl.where(has_above, tl.sum(tl.where(jj[None, :] == ja - 1, c_cnt, 0), axis=1), 0)
    band = tl.where(active & (cc < C), n_lo - n_hi, 0)
    cm = cc < C
    base = i * C + cc
    tl.store(off_ptr + base, tl.cumsum(band, axis=0) - band, mask=cm)
    tl.store(want_ptr + base, band, mask=cm)
    # The count above the band is the pivot count at its upper edge (the compaction checks that its compares
    # count the same); the edges fold in whether there is one, so the compaction classifies by two compares.
    tl.store(acnt_ptr + base, n_hi, mask=cm)
    v_hi = tl.where(has_above, v_hi, float("nan"))
    v_lo = tl.where(active, tl.where(has_below, v_lo, float("-inf")), float("nan"))
    tl.store(vhi_ptr + base, v_hi + tl.zeros((CP,), tl.float32), mask=cm)
    tl.store(vlo_ptr + base, v_lo + tl.zeros((CP,), tl.float32), mask=cm)
    # For the second level (a band over the slots): the row's band count and the top of the band's keys.
    _bm, btot_ptr, hik_ptr = _carve_fine(ws, NC)
    hi_k = tl.where(has_above, _key(v_hi), _key(mx) + 1)
    tl.store(btot_ptr + base, tl.sum(band, axis=0) + tl.zeros((CP,), tl.int32), mask=cm)
    tl.store(hik_ptr + base, hi_k + tl.zeros((CP,), tl.int32), mask=cm)


@triton.jit(do_not_specialize=["k_val"])
def _compact_kernel(
    x_ptr, idx_ptr, u_ptr, out_ptr, valid_ptr, ws, k_ptr, k_val, p_ptr, p_val, stride_x, V, CH, C, NC,
    HAS_INDICES: tl.constexpr, NP: tl.constexpr, SLOTS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Per (row, chunk of one ``BLOCK`` tile): the band elements' values, densely in index order from the
    chunk's first slot, and the mass of the elements above the band (their count is the band pass's). Pivot
    and compaction passes classify elements alike (``_binade`` is the float compares on the pivots), but should
    this chunk's band or above-band count still differ from the band pass's, the other chunks' offsets are
    off too: the count written then exceeds the slots, and the finish takes the exact row-wise search. ``NP``:
    the pivot counts' region width a chunk, the second level's bins."""
    _pdl_start(PDL)
    _s, _m, amass_ptr, ccount_ptr, acnt_ptr, _pc, cand_ptr = _carve(ws, NC, NP)
    off_ptr, want_ptr, vhi_ptr, vlo_ptr = _carve_band(ws, NC)
    # Programs in the reverse order of the pivot pass: the chunks it read last are still in L2.
    i = tl.num_programs(0) - 1 - tl.program_id(0)
    c = tl.num_programs(1) - 1 - tl.program_id(1)
    x_row = _row_ptr(x_ptr, stride_x, idx_ptr, i, HAS_INDICES)
    at = i * C + c
    off = tl.load(off_ptr + at)
    want = tl.load(want_ptr + at)
    v_hi = tl.load(vhi_ptr + at)
    v_lo = tl.load(vlo_ptr + at)
    # The tile as rows of SEG consecutive elements, each row inside one thread: the slot scan runs along the rows
    # in registers, then over the row counts, about half the instructions of one scan over the flat tile.
    SEG: tl.constexpr = 4
    offs = c * BLOCK + tl.arange(0, BLOCK // SEG)[:, None] * SEG + tl.arange(0, SEG)[None, :]
    # (padding loads as NaN, which no compare keeps)
    x = tl.load(x_row + offs, mask=offs < V, other=float("nan")).to(tl.float32)
    ab = x >= v_hi
    sel = (~ab) & (x >= v_lo)
    sel_i = sel.to(tl.int32)
    # Band and above-band counts in one sum, band in the low 16 bits: a chunk under 2**15 fits, and a count that
    # overflowed (larger chunks) would disagree with the band pass's and send the row to the exact search.
    packed = tl.sum(sel_i + (ab.to(tl.int32) << 16), axis=1)
    n_row = packed & 0xFFFF
    both = tl.sum(packed, axis=0)
    ns = both & 0xFFFF
    if ns > 0:  # the scan costs several times the rest of the pass, and most chunks of top-k hold no band element
        pos = off + (tl.cumsum(n_row, axis=0) - n_row)[:, None] + tl.cumsum(sel_i, axis=1) - 1
        tl.store(cand_ptr + i.to(tl.int64) * SLOTS + pos, x, mask=sel & (pos < SLOTS))
    tl.store(ccount_ptr + at, tl.where((ns == want) & ((both >> 16) == tl.load(acnt_ptr + at)), ns, SLOTS + 1))
    tl.store(amass_ptr + at, tl.sum(tl.sum(tl.where(ab, x, 0.0), axis=1), axis=0))
    bmass_ptr, btot_ptr, hik_ptr = _carve_fine(ws, NC)
    if (tl.load(btot_ptr + at) > SLOTS) & (v_lo > 0.0):
        # The row's band overflows the slots: the second level. The band's elements counted in NP bins of its key
        # range (the pivot counts' place: the band pass has read them), and its mass, so that the finish can bound
        # the mass at each bin's edge tightly (a bin spans a 1/NP of the band) and collect the few bins that hold
        # the threshold.
        lo_k, w = _fine_range(v_lo, tl.load(hik_ptr + at), NP)
        hi_k = tl.load(hik_ptr + at)
        fb = tl.minimum(tl.maximum((hi_k - 1 - _key(x)) // w, 0), NP - 1)
        hist = tl.histogram(tl.reshape(fb, [BLOCK]), NP, mask=tl.reshape(sel, [BLOCK]))
        tl.store(_pc + at.to(tl.int64) * NP + tl.arange(0, NP), hist)
        tl.store(bmass_ptr + at, tl.sum(tl.sum(tl.where(sel, x, 0.0), axis=1), axis=0))


@triton.jit
def _draw_range(x_ptr, lo, hi, t, run0, target, FROM_LOGITS: tl.constexpr, mx, rt, BLOCK: tl.constexpr):
    """``_draw`` on ``[lo, hi)`` starting from running weight ``run0``."""
    run = run0
    res = tl.full((), -1, tl.int32)
    last = tl.full((), -1, tl.int32)
    start = lo
    while (start < hi) & (res < 0):
        offs = start + tl.arange(0, BLOCK)
        m = offs < hi
        if FROM_LOGITS:
            x = tl.load(x_ptr + offs, mask=m, other=float("-inf")).to(tl.float32) * rt
            w = tl.where(m, tl.exp(x - mx), 0.0)
        else:
            x = tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32)
            w = tl.where(m & (_key(x) >= t), x, 0.0)
        cs = tl.cumsum(w, axis=0) + run
        hit = (cs > target) & (w > 0)
        res = tl.min(tl.where(hit, offs, INT32_MAX), axis=0)
        res = tl.where(res == INT32_MAX, -1, res)
        last = tl.maximum(last, tl.max(tl.where(w > 0, offs, -1), axis=0))
        run += tl.sum(w, axis=0)
        start += BLOCK
    return tl.where(res >= 0, res, last)


@triton.jit
def _pick_chunk(kc, cc, C, target):
    """Chunk whose running kept mass first exceeds ``target`` (else the last with mass), and the mass
    before it."""
    incl = tl.cumsum(kc, axis=0)
    ok = (cc < C) & (kc > 0)
    first = tl.min(tl.where(ok & (incl > target), cc, INT32_MAX), axis=0)
    lastc = tl.max(tl.where(ok, cc, -1), axis=0)
    pick = tl.where(first == INT32_MAX, tl.maximum(lastc, 0), first)
    before = tl.sum(tl.where(cc == pick, incl - kc, 0.0), axis=0)
    return pick, before


@triton.jit
def _csearch(c_row, nc, xs, ks, cv, target, lo, hi, cnt_lo, sum_lo, BY_SUM: tl.constexpr, REG: tl.constexpr,
             NP: tl.constexpr, CBLOCK: tl.constexpr):  # fmt: skip
    if REG:
        return _search_regs(xs, ks, cv, target, lo, hi, cnt_lo, sum_lo, BY_SUM, NP)
    else:
        return _search(c_row, nc, target, lo, hi, cnt_lo, sum_lo, BY_SUM, NP, CBLOCK)


@triton.jit
def _cand_threshold(c_row, nc, k, k_on, p, p_on, a_cnt, a_mass, total, K_FIRST: tl.constexpr, REG: tl.constexpr,
                    NP: tl.constexpr, CBLOCK: tl.constexpr):  # fmt: skip
    """The kept set's key threshold among a row's ``nc`` candidates (``REG``: at most ``CBLOCK``, searched in
    registers) given the count and mass above the band, and whether the row must fall back: a threshold
    below the band is only possible for "joint", where the other filter's threshold (in the band)
    dominates it; both below, or either above, falls back."""
    r = tl.arange(0, CBLOCK)
    cv = r < nc
    if REG:
        xs = tl.load(c_row + r, mask=cv, other=0.0)
        ks = _key(xs)
        c_mass = tl.sum(tl.where(cv, xs, 0.0), axis=0)
        c_kmin = tl.min(tl.where(cv, ks, INT32_MAX), axis=0)
        c_kmax = tl.max(tl.where(cv, ks, INT32_MIN), axis=0)
    else:
        xs = tl.zeros((CBLOCK,), tl.float32)
        ks = tl.zeros((CBLOCK,), tl.int32)
        c_mass, c_kmin, c_kmax = _row_stats(c_row, nc, CBLOCK)
    t = tl.full((), INT32_MIN, tl.int32)
    fb = nc < 0
    t_k = c_kmin
    k_cnt = nc
    k_mass = c_mass
    if k_on:
        k_below = a_cnt + nc < k
        fb = fb | (a_cnt >= k)
        t_k, k_cnt, k_mass = _csearch(
            c_row, nc, xs, ks, cv, (k - a_cnt).to(tl.float32), c_kmin, c_kmax, nc, c_mass, False, REG, NP, CBLOCK
        )
        t_k = tl.where(k_below, INT32_MIN, t_k)
        t = t_k
    if p_on:
        if K_FIRST & k_on:
            target = p * (a_mass + k_mass) - a_mass
            t_p, cp_, mp_ = _csearch(c_row, nc, xs, ks, cv, target, t_k, c_kmax, k_cnt, k_mass, True, REG, NP, CBLOCK)
            fb = fb | (t_k == INT32_MIN)
        else:
            target = p * total - a_mass
            t_p, cp_, mp_ = _csearch(c_row, nc, xs, ks, cv, target, c_kmin, c_kmax, nc, c_mass, True, REG, NP, CBLOCK)
            t_p = tl.where(c_mass < target, INT32_MIN, t_p)
        fb = fb | (target <= 0.0)
        t = tl.maximum(t, t_p)
    fb = fb | ((k_on | p_on) & (t == INT32_MIN))
    return t, fb


@triton.jit
def _fine_threshold(x_row, V, ws, NC, i, C, c_row, k, k_on, p, p_on, a_cnt, a_mass, total, v_lo,
                    K_FIRST: tl.constexpr, NP: tl.constexpr, SLOTS: tl.constexpr, CBLOCK: tl.constexpr,
                    NP_C: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """The second level, for a row whose band holds more elements than the slots: the compaction counted the band
    in ``NP`` bins of its keys (``_fine_range``), so the row's bin counts bound the mass at each bin edge within a
    1/NP of the band (and the band's mass, the complement). The bins that must hold the threshold (``_band_range``
    again) are collected in one pass over the row into the slots, with the exact count and mass above them, and
    searched like the first level's candidates. Returns the key threshold, the kept mass and whether the row
    must still take the row-wise search (the bins hold more than the slots: many ties; or a check failed)."""
    bmass_ptr, _bt, hik_ptr = _carve_fine(ws, NC)
    pc_row = ws.to(tl.pointer_type(tl.int32), bitcast=True) + 12 * NC + (i * C).to(tl.int64) * NP
    jj = tl.arange(0, NP)
    cb = tl.arange(0, 8)
    cnt = tl.zeros((NP,), tl.int32)
    m_band = tl.zeros((), tl.float32)
    for c0 in range(0, C, 8):  # 8 chunks' counts at a time: few registers (this branch is rare)
        cm = (c0 + cb) < C
        cnt += tl.sum(tl.load(pc_row + (c0 + cb)[:, None] * NP + jj[None, :], mask=cm[:, None], other=0), axis=0)
        m_band += tl.sum(tl.load(bmass_ptr + i * C + c0 + cb, mask=cm, other=0.0), axis=0)
    hi_k = tl.load(hik_ptr + i * C)
    lo_k, w = _fine_range(v_lo, hi_k, NP)
    e = tl.maximum(hi_k - (jj + 1) * w, lo_k)  # lower edge key of each bin
    v_e = _unkey(e)
    v_up = _unkey(hi_k - jj * w)  # (above every element of the bin)
    cum = tl.cumsum(cnt, axis=0)
    f_cnt = a_cnt + cum
    n_b = cnt.to(tl.float32)
    lo_d = tl.cumsum(n_b * v_e, axis=0)
    hi_d = tl.cumsum(n_b * v_up, axis=0)
    below_lo = tl.sum(n_b * v_e, axis=0) - lo_d
    below_hi = tl.sum(n_b * v_up, axis=0) - hi_d
    slack = 1e-5 * total
    f_lo = a_mass + tl.maximum(lo_d, m_band - below_hi) - slack
    f_hi = a_mass + tl.minimum(hi_d, m_band - below_lo) + slack
    ja, jb = _band_range(f_cnt, f_lo, f_hi, jj, k, k_on, p, p_on, total, K_FIRST, NP)
    fb = jb >= NP  # below the band: the first level's bounds missed
    jb = tl.minimum(jb, NP - 1)
    lo_f = tl.sum(tl.where(jj == jb, e, 0), axis=0)
    hi_f = tl.where(ja == 0, hi_k, tl.sum(tl.where(jj == ja - 1, e, 0), axis=0))
    a_cnt_f = tl.where(ja == 0, a_cnt, tl.sum(tl.where(jj == ja - 1, f_cnt, 0), axis=0))
    n_f = tl.sum(tl.where(jj == jb, f_cnt, 0), axis=0) - a_cnt_f
    fb = fb | (n_f > SLOTS)
    t = tl.full((), INT32_MIN, tl.int32)
    kept = tl.zeros((), tl.float32)
    if fb == 0:
        # One pass: the elements of the chosen bins, densely in index order, and the count and mass above them.
        n_in = tl.zeros((), tl.int32)
        n_up = tl.zeros((), tl.int32)
        m_up = tl.zeros((), tl.float32)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < V
            x = tl.load(x_row + offs, mask=m, other=0.0).to(tl.float32)
            kx = _key(x)
            up = m & (kx >= hi_f)
            inr = m & (kx >= lo_f) & (kx < hi_f)
            pos = n_in + tl.cumsum(inr.to(tl.int32), axis=0) - 1
            tl.store(c_row + pos, x, mask=inr & (pos < SLOTS))
            n_in += tl.sum(inr.to(tl.int32), axis=0)
            n_up += tl.sum(up.to(tl.int32), axis=0)
            m_up += tl.sum(tl.where(up, x, 0.0), axis=0)
        tl.debug_barrier()  # the search below reads slots that other threads of this program wrote
        fb = (n_in != n_f) | (n_up != a_cnt_f)
        nc = tl.minimum(n_in, SLOTS)
        if nc <= CBLOCK:
            t, fb2 = _cand_threshold(c_row, nc, k, k_on, p, p_on, n_up, m_up, total, K_FIRST, True, NP_C, CBLOCK)
        else:
            t, fb2 = _cand_threshold(c_row, nc, k, k_on, p, p_on, n_up, m_up, total, K_FIRST, False, NP_C, CBLOCK)
        fb = fb | fb2
        kept = m_up
        for s0 in range(0, nc, CBLOCK):
            r = s0 + tl.arange(0, CBLOCK)
            cv = tl.load(c_row + r, mask=r < nc, other=0.0)
            kept += tl.sum(tl.where((r < nc) & (_key(cv) >= t), cv, 0.0), axis=0)
    return t, kept, fb


@triton.jit(do_not_specialize=["k_val"])  # one compiled variant for every scalar top_k
def _finish_kernel(
    x_ptr, idx_ptr, u_ptr, out_ptr, valid_ptr, ws, k_ptr, k_val, p_ptr, p_val, stride_x, V, CH, C, NC,
    HAS_INDICES: tl.constexpr, MODE: tl.constexpr, HAS_K: tl.constexpr, K_ARR: tl.constexpr,
    HAS_P: tl.constexpr, P_ARR: tl.constexpr, K_FIRST: tl.constexpr, CP: tl.constexpr, SLOTS: tl.constexpr,
    CBLOCK: tl.constexpr, NP: tl.constexpr, NP_C: tl.constexpr, NP_WS: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK_SCAN: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """MODE 0: probabilities, 1: logits (``ws_a``/``ws_b`` per-chunk max / exp-sum), 2: filtered."""
    _pdl_start(PDL)
    ws_a, ws_b, amass_ptr, ccount_ptr, acnt_ptr, _pc, cand_ptr = _carve(ws, NC, NP_WS)
    i = tl.program_id(0)
    x_row = _row_ptr(x_ptr, stride_x, idx_ptr, i, HAS_INDICES)
    u = tl.load(u_ptr + i)
    cc = tl.arange(0, CP)
    cm = cc < C
    mx = tl.zeros((), tl.float32)
    t = tl.full((), INT32_MIN, tl.int32)
    fallback = False
    fine = False
    f_mass = tl.zeros((), tl.float32)
    if MODE == 1:
        pm = tl.load(ws_a + i * C + cc, mask=cm, other=float("-inf"))
        mx = tl.max(pm, axis=0)
        kc = tl.where(pm == float("-inf"), 0.0, tl.load(ws_b + i * C + cc, mask=cm, other=0.0) * tl.exp(pm - mx))
    elif MODE == 0:
        kc = tl.load(ws_a + i * C + cc, mask=cm, other=0.0)
    else:
        k, k_on, p, p_on = _load_kp(i, k_ptr, k_val, p_ptr, p_val, V, HAS_K, K_ARR, HAS_P, P_ARR)
        chunk_sum = tl.load(ws_a + i * C + cc, mask=cm, other=0.0)
        total = tl.sum(chunk_sum, axis=0)
        ncand = tl.load(ccount_ptr + i * C + cc, mask=cm, other=0)
        n_all = tl.sum(ncand, axis=0)
        fallback = n_all > SLOTS
        a_cnt = tl.sum(tl.load(acnt_ptr + i * C + cc, mask=cm, other=0), axis=0)
        a_mass_c = tl.load(amass_ptr + i * C + cc, mask=cm, other=0.0)
        a_mass = tl.sum(a_mass_c, axis=0)
        c_row = cand_ptr + i.to(tl.int64) * SLOTS
        # A band over the slots whose chunks all counted as the band pass did takes the second level.
        off_ptr, want_ptr, vhi_ptr, vlo_ptr = _carve_band(ws, NC)
        want_c = tl.load(want_ptr + i * C + cc, mask=cm, other=0)
        v_lo_r = tl.load(vlo_ptr + i * C)
        fine = fallback & (tl.sum((ncand != want_c).to(tl.int32), axis=0) == 0) & (v_lo_r > 0.0)
        if fine:
            t, f_mass, fallback = _fine_threshold(x_row, V, ws, NC, i, C, c_row, k, k_on, p, p_on, a_cnt, a_mass, total,
                                                  v_lo_r, K_FIRST, NP_WS, SLOTS, CBLOCK, NP_C, BLOCK_SCAN)  # fmt: skip
        # The threshold among the candidates: the row-wise search run over the (L2-resident) candidate
        # values, its targets less what lies above the band (a search costs a few passes over at most
        # ``SLOTS`` values; sorting them in registers cost far more). Up to ``CBLOCK`` candidates are loaded
        # once and searched in registers.
        nc = tl.where(fallback | fine, 0, tl.minimum(n_all, SLOTS))
        if nc <= CBLOCK:
            t1, fb = _cand_threshold(c_row, nc, k, k_on, p, p_on, a_cnt, a_mass, total, K_FIRST, True, NP_C, CBLOCK)
        else:
            t1, fb = _cand_threshold(c_row, nc, k, k_on, p, p_on, a_cnt, a_mass, total, K_FIRST, False, NP_C, CBLOCK)
        t = tl.where(fine, t, t1)
        fallback = fallback | (fb & ~fine)
        # Kept candidate mass per chunk: the chunks' candidates sit in slot order, so a running sum over
        # the slots read at each chunk's last slot, minus that at the previous chunk's, gives it. The sum runs
        # over the filled slots only, a CBLOCK tile at a time (not the whole SLOTS-wide region: its registers).
        end = tl.cumsum(ncand, axis=0)
        beg = end - ncand
        at_end = tl.zeros((CP,), tl.float32)
        at_beg = tl.zeros((CP,), tl.float32)
        carry = tl.zeros((), tl.float32)
        for s0 in range(0, nc, CBLOCK):
            r = s0 + tl.arange(0, CBLOCK)
            cv = tl.load(c_row + r, mask=r < nc, other=0.0)
            run = tl.cumsum(tl.where((r < nc) & (_key(cv) >= t), cv, 0.0), axis=0) + carry
            ie = end - 1 - s0
            ib = beg - 1 - s0
            at_end = tl.where((ie >= 0) & (ie < CBLOCK), tl.gather(run, tl.minimum(tl.maximum(ie, 0), CBLOCK - 1), 0),
                              at_end)  # fmt: skip
            at_beg = tl.where((ib >= 0) & (ib < CBLOCK), tl.gather(run, tl.minimum(tl.maximum(ib, 0), CBLOCK - 1), 0),
                              at_beg)  # fmt: skip
            carry = tl.sum(tl.where(tl.arange(0, CBLOCK) == CBLOCK - 1, run, 0.0), axis=0)
        kc = tl.where(k_on | p_on, a_mass_c + (at_end - at_beg), chunk_sum)
    if fallback:
        tf, mass, tot = _thresholds(
            x_row, V, i, k_ptr, k_val, p_ptr, p_val, HAS_K, K_ARR, HAS_P, P_ARR, K_FIRST, NP, BLOCK, BLOCK_SCAN
        )
        res = _draw(x_row, V, tf, 0.0, mass, u, False, False, mx, BLOCK_SCAN)
    elif fine:
        mass = f_mass
        res = _draw(x_row, V, t, 0.0, mass, u, False, False, mx, BLOCK_SCAN)
    else:
        kc = tl.where(cm, kc, 0.0)
        mass = tl.sum(kc, axis=0)
        target = u * mass
        pick, before = _pick_chunk(kc, cc, C, target)
        lo = pick * CH
        res = _draw_range(x_row, lo, tl.minimum(lo + CH, V), t, before, target, MODE == 1, mx, 1.0, BLOCK_SCAN)
    ok = (res >= 0) & (mass > 0)
    tl.store(out_ptr + i, tl.maximum(res, 0).to(out_ptr.dtype.element_ty))
    tl.store(valid_ptr + i, ok.to(valid_ptr.dtype.element_ty))


_FAST: dict = {}


def _launch(kernel, grid, *args, num_warps=4, launch_pdl=False, **consts):
    """Launch with every parameter positional (the constexprs given by name here) through the library's
    short host path: ``JITFunction.run`` costs tens of microseconds of host time per launch, more than
    these kernels' GPU time at small batch. Returns what ``FastKernel.run`` returned (the compiled kernel) and
    the full argument list."""
    fast = _FAST.get(kernel)
    if fast is None:
        fast = _FAST[kernel] = FastKernel(kernel)
    full = (*args, *[consts[a] for a in kernel.arg_names[len(args) :]])
    opts = {"num_warps": num_warps}
    if launch_pdl:
        opts["launch_pdl"] = True
    if consts.get("MAXNREG"):  # (not a kernel parameter: a compile option)
        opts["maxnreg"] = consts["MAXNREG"]
    return fast.run(*full, grid=grid, warmup=False, **opts), full


def _block(V: int) -> int:
    return max(16, min(_np2(V), 2048 if V >= 16384 else 1024))


def _scan_block(V: int, cap: int) -> int:
    """Tiles of the streaming passes (no pivot tiles): wide, so one program keeps 16-32 KB of loads in
    flight; a single program per row is bound by load latency, not bandwidth, at small batch."""
    return max(16, min(_np2(V), cap if V >= 32768 else 1024))


def _warps(V: int) -> int:
    # 2048-wide tiles with 8 warps keep twice the bytes in flight per program at the same registers per
    # thread as 1024 with 4 (the search's [BLOCK, 8] pivot tiles dominate the register budget).
    return 8 if V >= 16384 else 4


def _launch_sample_rowwise(x, indices, u, out, valid, k, p, minp, from_logits: bool, k_first: bool) -> None:
    """One program per row (min-p, and the reference for the row-split path)."""
    n, V = out.shape[0], x.shape[1]
    if n == 0:
        return

    def arg(v, dtype_is_int):
        if v is None:
            return x, 0, False, False
        if isinstance(v, (int, float)):
            return x, (int(v) if dtype_is_int else float(v)), True, False
        return v, 0 if dtype_is_int else 0.0, True, True

    k_ptr, k_val, has_k, k_arr = arg(k, True)
    p_ptr, p_val, has_p, p_arr = arg(p, False)
    m_ptr, m_val, has_m, m_arr = arg(minp, False)
    _launch(_sample_kernel, (n,),
        x, x.stride(0), indices if indices is not None else x, u, out, valid, V,
        k_ptr, k_val, p_ptr, p_val, m_ptr, m_val,
        HAS_INDICES=indices is not None, FROM_LOGITS=from_logits,
        HAS_K=has_k, K_ARR=k_arr, HAS_P=has_p, P_ARR=p_arr, K_FIRST=k_first,
        HAS_MINP=has_m, MINP_ARR=m_arr, NP=8, BLOCK=_block(V), BLOCK_SCAN=_scan_block(V, 4096),
        num_warps=_warps(V),
    )  # fmt: skip


def launch_renorm(x, out, k, p, mask_logits: bool) -> None:
    n, V = x.shape
    if n == 0:
        return
    k_arr = k is not None and not isinstance(k, (int, float))
    p_arr = p is not None and not isinstance(p, (int, float))
    _launch(_renorm_kernel, (n,),
        x, out, x.stride(0), out.stride(0), V,
        k if k_arr else x, int(k) if (k is not None and not k_arr) else 0,
        p if p_arr else x, float(p) if (p is not None and not p_arr) else 0.0,
        HAS_K=k is not None, K_ARR=k_arr, HAS_P=p is not None, P_ARR=p_arr,
        MASK_LOGITS=mask_logits, NP=8, BLOCK=_block(V), BLOCK_SCAN=_scan_block(V, 4096), num_warps=_warps(V),
    )  # fmt: skip


def launch_softmax(x, out, temperature, enable_pdl=None) -> None:
    if x.shape[0] == 0:
        return
    cfg = _config.SAMPLING
    # (float32 logits only: 16-bit ones convert between the load's and the store's layouts through shared memory and,
    # at three pieces, spill on sm_90)
    if x.dtype == torch.float32 and softmax_rows_shape(x.shape[0], x.shape[1], cfg):
        _launch_softmax_rows(x, out, temperature, enable_pdl, cfg)
        return
    # (rows longer than the registers' path ever takes: the row pass was measured over 128256 entries, where the
    # row-split path is the alternative; shorter rows at large batches keep that path)
    if x.shape[1] > _ROWS_MAX_VOCAB and 0 < cfg.softmax_rowpass_min_batch <= x.shape[0]:
        _launch_softmax_rowpass(x, out, temperature, enable_pdl, cfg)
        return
    _launch_softmax_split(x, out, temperature, enable_pdl)


_ROW_PIECES = 3  # pieces of a row a program holds at most (3 x 16 entries a thread: 64 registers at 32 warps)
_ROWS_MAX_VOCAB = _ROW_PIECES * 32 * 512  # the longest row the registers' path holds (SamplingConfig's bound)


def softmax_rows_shape(n: int, V: int, cfg: _config.SamplingConfig):
    """(warps, piece width, pieces) of the softmax that holds each row in one program's registers, or None where the
    row-split path runs: at least ``softmax_rows_min_batch`` rows of at most ``softmax_rows_max_vocab`` entries. The
    fewest warps (4-32) whose pieces of 16 entries a thread cover the row in at most three (float32 rows of 49152 at
    32 warps: three of 16384, 64 registers a thread on sm_90 without spills, one program an SM)."""
    if cfg.softmax_rows_max_vocab < V or n < cfg.softmax_rows_min_batch:
        return None
    nw = 4
    while nw < 32 and _cdiv(V, nw * 512) > _ROW_PIECES:
        nw *= 2
    w = nw * 512
    npc = _cdiv(V, w)
    if npc > _ROW_PIECES:  # (the configuration refuses such vocabularies; a guard, not a path)
        return None
    return nw, w, npc


def _launch_softmax_rowpass(x, out, temperature, enable_pdl, cfg: _config.SamplingConfig) -> None:
    """Persistent programs (``softmax_rowpass_programs_per_sm`` an SM, at most a row each) of 32 warps, a row at a time
    in two passes, the second backwards (``_softmax_rowpass_kernel``)."""
    n, V = x.shape
    t_arr = type(temperature) is not float and type(temperature) is not int
    t_ptr, t_val = (temperature, 1.0) if t_arr else (x, float(temperature))
    key = ("softmax_rowpass", n, V, x.stride(0), out.stride(0), x.dtype, x.device, t_arr, cfg, enable_pdl)
    plan = _PLANS.get(key)
    if plan is None:
        sms = _config.num_sms(x.device) if x.device.type == "cuda" else 132
        progs = max(1, min(n, sms * cfg.softmax_rowpass_programs_per_sm))
        blk = max(16, min(4096, _np2(V)))
        nw = max(1, min(32, blk // 128))
        pdl = _config.pdl_launch(enable_pdl, x.device, cfg.pdl)
        plan = _new_plan(key, 1)
        plan.steps.append((_softmax_rowpass_kernel, (progs,), (x.stride(0), out.stride(0), V, n), nw,
                           dict(T_ARR=t_arr, BLOCK=blk, PDL=pdl)))  # fmt: skip
    _run(plan, (x, x, x, out, x, x, x, 0, t_ptr, t_val))


def _launch_softmax_rows(x, out, temperature, enable_pdl, cfg: _config.SamplingConfig) -> None:
    n, V = x.shape
    t_arr = type(temperature) is not float and type(temperature) is not int
    t_ptr, t_val = (temperature, 1.0) if t_arr else (x, float(temperature))
    key = ("softmax_rows", n, V, x.stride(0), out.stride(0), x.dtype, x.device, t_arr, cfg, enable_pdl)
    plan = _PLANS.get(key)
    if plan is None:
        nw, w, npc = softmax_rows_shape(n, V, cfg)
        pdl = _config.pdl_launch(enable_pdl, x.device, cfg.pdl)
        plan = _new_plan(key, 1)
        plan.steps.append((_softmax_rows_kernel, (n,), (x.stride(0), out.stride(0), V), nw,
                           dict(T_ARR=t_arr, W=w, NPC=npc, PDL=pdl)))  # fmt: skip
    _run(plan, (x, x, x, out, x, x, x, 0, t_ptr, t_val))


def _launch_softmax_split(x, out, temperature, enable_pdl=None) -> None:
    n, V = x.shape
    t_arr = type(temperature) is not float and type(temperature) is not int
    t_ptr, t_val = (temperature, 1.0) if t_arr else (x, float(temperature))
    cfg = _config.SAMPLING
    key = ("softmax", n, V, x.stride(0), out.stride(0), x.dtype, x.device, t_arr, cfg, enable_pdl)
    plan = _PLANS.get(key)
    if plan is None:
        ch, c, cp = _chunks(n, V, x.device, cfg)
        blk = min(2048, ch)
        pdl = _config.pdl_launch(enable_pdl, x.device, cfg.pdl)
        plan = _new_plan(key, 2 * n * c)
        plan.steps.append((_partials_kernel, (n, c), (x.stride(0), V, ch, c, n * c), 8,
                           dict(HAS_INDICES=False, LOGITS=True, T_ARR=t_arr, BLOCK=blk, PDL=pdl)))  # fmt: skip
        plan.steps.append((_softmax_write_kernel, (n, c), (x.stride(0), out.stride(0), V, ch, c, n * c), 8,
                           dict(T_ARR=t_arr, CP=cp, BLOCK=blk, PDL=pdl)))  # fmt: skip
    ws = torch.empty(plan.ws_numel, dtype=torch.float32, device=x.device)
    _run(plan, (x, x, x, out, x, ws, x, 0, t_ptr, t_val))


def launch_uniform(seed, offset, n: int, n_u: int, out) -> None:
    arr = not isinstance(seed, int)
    _launch(_uniform_kernel, (n,),
        seed if arr else out, 0 if arr else seed, offset if arr else out, 0 if arr else offset, out, n_u,
        SEED_ARR=arr, BLOCK=max(16, _np2(n_u)),
    )  # fmt: skip


def launch_chain(draft, draft_ids, target, u, out, acc, emit) -> None:
    b, n_spec, V = draft.shape
    if b == 0:
        return
    _launch(
        _chain_kernel,
        (b,),
        draft,
        draft_ids,
        target,
        u,
        out,
        acc,
        emit,
        n_spec,
        V,
        BLOCK=_block(V),
        num_warps=_warps(V),
    )


# The row-split parameters are ``_config.SAMPLING`` (a SamplingConfig), read once per call: the object is part
# of every plan key, so a test that swaps in its own configuration gets plans of its own.


_np2 = _config.next_pow2
_cdiv = _config.cdiv


def _chunks(n: int, V: int, device, cfg: _config.SamplingConfig):
    """(chunk length, chunks per row, width of the partial tiles: a power of 2, at least 8 so that small
    shapes share one compiled variant): about two waves of programs in all, chunks of at most ``cfg.chunk_max``.
    Off CUDA the waves are an H100's (132 SMs), so that the interpreter plans the chunks the GPU would."""
    sms = _config.num_sms(device) if device.type == "cuda" else 132
    want = _cdiv(n * V, 2 * sms)
    ch = max(cfg.chunk_min, min(cfg.chunk_max, _np2(want)))
    ch = max(ch, _np2(_cdiv(V, cfg.max_chunks)))
    ch = min(ch, max(cfg.chunk_min, _np2(V)))
    c = _cdiv(V, ch)
    return ch, c, max(8, _np2(c))


# ----------------------------------------------------------------------------------------------- launch plans
#
# The host work of a call, apart from its allocations, is done once per call form: a plan holds the launches
# (kernel, grid, the arguments after the common lead, warps, constexprs) and the workspace size. Once a form
# has launched through ``FastKernel`` with 16-byte aligned tensors, its launches are bound to everything but
# the lead (``_launch.bind``), and later calls pass the lead's addresses and values straight to the compiled
# kernels: the whole call then costs a few microseconds of host time per launch.

_PLANS: dict = {}
_PLANS_MAX = 256
_N_LEAD = 10  # x, indices, uniforms, out, valid, workspace, top-k tensor and value, top-p tensor and value


class _Plan:
    __slots__ = ("steps", "ws_numel", "bound", "bind_tried")

    def __init__(self, ws_numel: int):
        self.steps = []
        self.ws_numel = max(1, ws_numel)
        self.bound = None
        self.bind_tried = False


def _new_plan(key, ws_numel: int) -> _Plan:
    if len(_PLANS) >= _PLANS_MAX:
        _PLANS.clear()
    plan = _PLANS[key] = _Plan(ws_numel)
    return plan


def _run(plan: _Plan, lead: tuple) -> None:
    """Launch a plan's kernels with the call's leading arguments (tensors where a kernel takes a pointer;
    ``x`` stands in for absent ones)."""
    ptrs = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in lead]  # (Tensor subclasses too)
    aligned = not (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3] | ptrs[4] | ptrs[5] | ptrs[6] | ptrs[8]) & 15
    bound = plan.bound
    if bound is not None and aligned and not hooks_set() and bound[0](*ptrs):
        for b in bound[1:]:
            b(*ptrs)
        return
    got = [
        _launch(kernel, grid, *lead, *tail, num_warps=nw, launch_pdl=consts["PDL"], **consts)
        for kernel, grid, tail, nw, consts in plan.steps
    ]
    # (not under a launch hook, where nothing binds: a later call without one binds the plan)
    if aligned and not plan.bind_tried and not hooks_set():
        plan.bind_tried = True
        fasts = [_FAST.get(st[0]) for st in plan.steps]
        if all(f is not None for f in fasts):
            bs = [bind(f, k, full, st[1], _N_LEAD) for f, st, (k, full) in zip(fasts, plan.steps, got, strict=True)]
        else:
            bs = [None]
        if all(b is not None for b in bs):
            plan.bound = bs


def _filter_arg(v, x, is_int: bool, V: int):
    """(pointer, value, given, per-row tensor) of a top-k / top-p argument; scalar top-k is clamped to
    ``[0, V]`` (``k <= 0`` and ``k >= V`` both keep everything), so it always fits the kernels' int32."""
    if v is None:
        return x, (0 if is_int else 1.0), False, False
    if type(v) is int or type(v) is float:
        return x, (min(max(v, 0), V) if is_int else float(v)), True, False
    return v, (0 if is_int else 1.0), True, True


def launch_sample(x, indices, u, out, valid, k, p, minp, from_logits: bool, k_first: bool) -> None:
    """``k``/``p``/``minp``: None, a python scalar or a per-row tensor."""
    n = out.shape[0]
    if n == 0:
        return
    args = (x, indices, u, out, valid, k, p, minp, from_logits, k_first)
    if minp is not None:
        _launch_sample_rowwise(*args)
        return
    _launch_sample_split(*args)


def _launch_sample_split(x, indices, u, out, valid, k, p, minp, from_logits: bool, k_first: bool) -> None:
    n, V = out.shape[0], x.shape[1]
    k_ptr, k_val, has_k, k_arr = _filter_arg(k, x, True, V)
    p_ptr, p_val, has_p, p_arr = _filter_arg(p, x, False, V)
    has_idx = indices is not None
    cfg = _config.SAMPLING
    key = (
        "sample", n, V, x.stride(0), x.dtype, x.device, indices.dtype if has_idx else None, out.dtype, valid.dtype,
        has_k, k_arr, has_p, p_arr, from_logits, k_first, cfg,
    )  # fmt: skip
    plan = _PLANS.get(key) or _sample_plan(key, n, V, x, has_idx, has_k, k_arr, has_p, p_arr, from_logits, k_first,
                                           cfg)  # fmt: skip
    ws = torch.empty(plan.ws_numel, dtype=torch.float32, device=x.device)
    _run(plan, (x, indices if has_idx else x, u, out, valid, ws, k_ptr, k_val, p_ptr, p_val))


def _sample_plan(key, n, V, x, has_idx, has_k, k_arr, has_p, p_arr, from_logits, k_first, cfg) -> _Plan:
    pdl = _config.pdl_launch(None, x.device, cfg.pdl)
    common = dict(NP=8, BLOCK=_block(V), BLOCK_SCAN=_scan_block(V, 4096), PDL=pdl)
    sx = x.stride(0)
    if not (has_k or has_p):
        # Chunks of one tile: the draw scans a single tile of the row, whatever the batch.
        ch = min(max(cfg.chunk_min, _np2(_cdiv(V, cfg.max_chunks))), max(cfg.chunk_min, _np2(V)))
        c = _cdiv(V, ch)
        cp = max(8, _np2(c))
        nc = n * c
        common["BLOCK_SCAN"] = min(common["BLOCK_SCAN"], ch)
        plan = _new_plan(key, 5 * nc)
        part = dict(HAS_INDICES=has_idx, LOGITS=from_logits, T_ARR=False, BLOCK=min(2048, ch), PDL=pdl)
        plan.steps.append((_partials_kernel, (n, c), (sx, V, ch, c, nc), 8, part))
        plan.steps.append((_finish_kernel, (n,), (sx, V, ch, c, nc), 8,
                           dict(HAS_INDICES=has_idx, MODE=1 if from_logits else 0, HAS_K=False, K_ARR=False,
                                HAS_P=False, P_ARR=False, K_FIRST=False, CP=cp, SLOTS=16, CBLOCK=16, NP_C=8, NP_WS=1,
                                **common)))  # fmt: skip
        return plan
    # Chunks of one tile, loaded whole by the pivot and compaction passes: a warp per 1024 entries, 32 warps at most.
    ch, c, cp = _chunks(n, V, x.device, cfg)
    if ch > 32 * 1024:
        raise ValueError(
            f"SamplingConfig.max_chunks={cfg.max_chunks}: a row of {V} entries would take chunks of {ch}, more than "
            f"the {32 * 1024} a filtered pass holds; max_chunks >= {_cdiv(V, 32 * 1024)} is needed"
        )
    npiv = cfg.pivots_p if has_p else cfg.pivots
    # top-k alone: a pivot a binade; with top-p: binades_p binades of pivots whatever their number
    sh = 23 if not has_p else 23 - (npiv // cfg.binades_p).bit_length() + 1
    slots = max(16, min(cfg.cand_slots, _np2(V)))
    nc = n * c
    # The pivot counts' region is then the second level's: 256 bins a chunk whatever the pivots.
    pw = max(npiv, 256)
    plan = _new_plan(key, 12 * nc + nc * pw + n * slots)
    kp = dict(HAS_K=has_k, K_ARR=k_arr, HAS_P=has_p, P_ARR=p_arr, CP=cp)
    tail = (sx, V, ch, c, nc)
    # A warp per 1024 elements keeps the histogram's and the scan's instructions per element lowest (32 a
    # thread); at most about two waves of programs (small batch) take 4 warps for shorter programs.
    sms = _config.num_sms(x.device) if x.device.type == "cuda" else 132
    nw = max(1, ch // 1024) if nc > 2 * sms else max(4, ch // 1024)
    plan.steps.append((_pivot_kernel, (n, c), tail, nw, dict(HAS_INDICES=has_idx, NP=npiv, SH=sh, BLOCK=ch, PDL=pdl)))
    # 16 warps once the row's [chunks, pivots] counts pass 16 a thread at 8: 32 x 256 counts at 8 warps need 236
    # registers a thread, at 16 warps 106 and about 30% fewer instructions.
    plan.steps.append((_band_kernel, (n,), tail, 8 if cp * npiv <= 4096 else 16,
                       dict(K_FIRST=k_first, NP=npiv, SH=sh, PDL=pdl, **kp)))  # fmt: skip
    plan.steps.append((_compact_kernel, (n, c), tail, nw,
                       dict(HAS_INDICES=has_idx, NP=pw, SLOTS=slots, BLOCK=ch, PDL=pdl)))  # fmt: skip
    kp["HAS_INDICES"] = has_idx
    # (the fallback's tile sets the finish's registers, and so how many programs share an SM; the draw scans one
    # chunk, in one tile of its length)
    common["BLOCK"] = min(common["BLOCK"], cfg.finish_block)
    # At most 128 registers a thread, two programs an SM (batch 256 in one wave): left to itself, ptxas gives the
    # finish about 180 (one program an SM); capped, it spills 0-108 bytes (sm_90: top-k 0, top-p 8, top-k first
    # 108).
    common["MAXNREG"] = 128
    common["BLOCK_SCAN"] = min(common["BLOCK_SCAN"], ch)
    plan.steps.append((_finish_kernel, (n,), tail, 8,
                       dict(MODE=2, K_FIRST=k_first, SLOTS=slots,
                            CBLOCK=max(16, min(cfg.search_cells // 8, slots)),
                            NP_C=8, NP_WS=pw, **kp,
                            **common)))  # fmt: skip
    return plan


# ----------------------------------------------------------------------------------------------- top-p by rejection
#
# Top-p alone (every top-p-alone draw from generated uniforms). The kept set is the exact threshold's: x is kept iff
# G(x) = sum_{y > x} y < target = top_p * M (M the row's sum; top_p >= 1 keeps all). Round r < R draws K proposals
# from the row restricted to S_r = {y > low} (K in 1-3): each is the first index whose running restricted mass
# (tile sums, then an in-order cumsum in the tile a target falls in) exceeds u[r*K+j] * c_r, else a miss, and the
# pass stops once every target is crossed. c_0 is a bound on the row's sum that needs no pass before it (1 + 2^-10:
# probabilities); c_r = q_r (1 + 2^-12) after, q_r = G(low) from the previous pass. Conditional on a hit a proposal
# is an exact draw from the row restricted to S_r; a miss is a rejection. One pass over the row then sums G at every
# proposal x0 and at x1 = (x0 + high) / 2 (two pivots as FlashInfer's TopPSamplingFromProbKernel), and M in round 0,
# whose proposals are used only if M <= c_0 (1 - 2^-16) (M does not depend on the uniforms). The first usable
# proposal with G(x0) < target (or G = 0) is the sample; else low rises to the largest pivot with G >= target (below
# the threshold, so S_{r+1} still holds the kept set) and high falls to the smallest x1 with G < target. After R
# rounds: the exact threshold and one inverse CDF over the kept set at u[R*K]. Exact in distribution (rejection from
# supersets of the kept set with exact restricted proposals and an exact acceptance test) and deterministic given a
# row's R*K+1 uniforms (tiles and sums in a fixed order).
#
# Two layouts. One program a row runs every round (``_topp_reject_kernel``). At small batch (``topp_split_chunk``:
# at most ``SamplingConfig.topp_split_max_batch`` rows, two or more chunks a row in one wave), round 0 (98% of rows
# at top-p 0.9 end there) is split over several programs a row, each a chunk of the row (``_topp_split_*``): chunk
# sums; the proposals, found by the chunk whose prefix of chunk sums crosses each target; the pivot sums per chunk;
# then one program a row reduces them, decides round 0 and runs any later round and the fallback as the one-program
# kernel does (the same helpers: one implementation of the rounds).


@triton.jit
def _rej_tile(x_row, start, V, RT: tl.constexpr, CW: tl.constexpr):
    """Elements [start, start + RT * CW) as [RT, CW]: 4 consecutive a thread along CW (16-byte loads), so the sum
    over axis 0 stays in each thread."""
    offs = start + tl.arange(0, RT)[:, None] * CW + tl.arange(0, CW)[None, :]
    return tl.load(x_row + offs, mask=offs < V, other=0.0).to(tl.float32)


@triton.jit
def _rej_find(x_row, start, V, low, run, t0, t1, t2, i0, i1, i2, cr0, cr1, cr2, RT: tl.constexpr, CW: tl.constexpr,
              K3: tl.constexpr):  # fmt: skip
    """In the tile at ``start`` (whose restricted sum takes the running mass past t0, t1 or t2): the first index
    whose running restricted mass exceeds each crossed target. The tile is read again (L1/L2) a row of CW at a time,
    so the in-order cumsum holds 4 values a thread. A rounding shortfall (the tile's sum crossed, its cumsum did
    not) takes the tile's last candidate."""
    last = tl.full((), -1, tl.int32)
    f0 = tl.full((), INT32_MAX, tl.int32)
    f1 = tl.full((), INT32_MAX, tl.int32)
    f2 = tl.full((), INT32_MAX, tl.int32)
    base = run
    for rr in range(RT):
        o = start + rr * CW + tl.arange(0, CW)
        xr = tl.load(x_row + o, mask=o < V, other=0.0).to(tl.float32)
        wr = tl.where(xr > low, xr, 0.0)
        cs = tl.cumsum(wr, axis=0) + base
        pos = wr > 0
        f0 = tl.minimum(f0, tl.min(tl.where((cs > t0) & pos, o, INT32_MAX), axis=0))
        f1 = tl.minimum(f1, tl.min(tl.where((cs > t1) & pos, o, INT32_MAX), axis=0))
        if K3:  # (a third proposal: compiled in only with three)
            f2 = tl.minimum(f2, tl.min(tl.where((cs > t2) & pos, o, INT32_MAX), axis=0))
        last = tl.maximum(last, tl.max(tl.where(pos, o, -1), axis=0))
        base += tl.sum(wr, axis=0)
    if cr0:
        i0 = tl.where(f0 == INT32_MAX, last, f0)
    if cr1:
        i1 = tl.where(f1 == INT32_MAX, last, f1)
    if K3:  # noqa: SIM102 (constexpr, then a runtime branch)
        if cr2:
            i2 = tl.where(f2 == INT32_MAX, last, f2)
    return i0, i1, i2


@triton.jit
def _pending(i0, i1, i2, K3: tl.constexpr):
    """Whether a proposal of the sampling pass is still to be found (the third only with three)."""
    if K3:
        return (i0 < 0) | (i1 < 0) | (i2 < 0)
    else:
        return (i0 < 0) | (i1 < 0)


@triton.jit
def _rej_sample_pass(x_row, start, end, V, low, run, t0, t1, t2, i0, i1, i2, RT: tl.constexpr, CW: tl.constexpr,
                     TO_LAST: tl.constexpr, K3: tl.constexpr):  # fmt: skip
    """The sampling pass over elements [start, end) (the row, or one chunk of it) restricted to {y > low}, the running
    mass starting at ``run``: proposals i0 / i1 / i2 for targets t0 / t1 / t2 (the third only with ``K3``), each
    left as passed once >= 0 (a proposal not wanted comes in as 0); it stops once all are found. A target the range's
    mass never reaches leaves -1, or with ``TO_LAST`` the range's last candidate (a chunk that owns the target by sums
    taken in another order). Also returns where it stopped: the start of the tile it loaded last (the one ahead of the
    last it summed)."""
    BLOCK: tl.constexpr = RT * CW
    start = start + tl.zeros((), tl.int32)  # (a loop-carried tensor, also where the row's start is a constant 0)
    last = tl.full((), -1, tl.int32)
    x = _rej_tile(x_row, start, V, RT, CW)
    while (start < end) & _pending(i0, i1, i2, K3):
        xn = _rej_tile(x_row, start + BLOCK, V, RT, CW)  # the next tile's loads fly during this one's sums
        w = tl.where(x > low, x, 0.0)
        s = tl.sum(tl.sum(w, axis=0), axis=0)
        if TO_LAST:
            offs = start + tl.arange(0, RT)[:, None] * CW + tl.arange(0, CW)[None, :]
            last = tl.maximum(last, tl.max(tl.max(tl.where(w > 0, offs, -1), axis=0), axis=0))
        cr0 = (i0 < 0) & (run + s > t0)
        cr1 = (i1 < 0) & (run + s > t1)
        if K3:
            cr2 = (i2 < 0) & (run + s > t2)
            hit = cr0 | cr1 | cr2
        else:
            cr2 = cr1  # (no third proposal: unused)
            hit = cr0 | cr1
        if hit:
            i0, i1, i2 = _rej_find(x_row, start, V, low, run, t0, t1, t2, i0, i1, i2, cr0, cr1, cr2, RT, CW, K3)
        run += s
        start += BLOCK
        x = xn
    if TO_LAST:
        i0 = tl.where(i0 < 0, last, i0)
        i1 = tl.where(i1 < 0, last, i1)
        if K3:
            i2 = tl.where(i2 < 0, last, i2)
    return i0, i1, i2, start


@triton.jit
def _gt_sum(acc, x, piv):
    return acc + tl.sum(tl.where(x > piv, x, 0.0), axis=0)


@triton.jit
def _piv_acc(x, x0a, x1a, x0b, x1b, x0c, x1c, g0a, g1a, g0b, g1b, g0c, g1c, tot, K: tl.constexpr):
    """One tile of the pivot pass: per-thread sums above each pivot, and of everything (M: needed in round 0 only,
    one add an element)."""
    g0a = _gt_sum(g0a, x, x0a)
    g1a = _gt_sum(g1a, x, x1a)
    if K >= 2:
        g0b = _gt_sum(g0b, x, x0b)
        g1b = _gt_sum(g1b, x, x1b)
    if K == 3:
        g0c = _gt_sum(g0c, x, x0c)
        g1c = _gt_sum(g1c, x, x1c)
    tot += tl.sum(x, axis=0)
    return g0a, g1a, g0b, g1b, g0c, g1c, tot


@triton.jit
def _piv_at(s, start, top, RECENT: tl.constexpr):
    """The tile the pivot pass reads at loop position ``s``: with ``RECENT``, tiles ``top`` down to ``start`` first
    (the sampling pass's most recent loads first, while they are still in L2), then the ones after ``top`` in
    order (``top`` below ``start``: every tile in order); else ``s`` itself."""
    if RECENT:
        return tl.where(s <= top, top - (s - start), s)
    else:
        return s


@triton.jit
def _rej_pivot_pass(x_row, start, end, V, x0a, x1a, x0b, x1b, x0c, x1c, top, K: tl.constexpr, RT: tl.constexpr,
                    CW: tl.constexpr, STAGES: tl.constexpr, RECENT: tl.constexpr):  # fmt: skip
    """The pivot pass over elements [start, end) (the row, or one chunk of it): G(x0a), G(x1a), G(x0b), G(x1b),
    G(x0c), G(x1c) (those of the ``K`` proposals) and the sum of everything. The sums stay in per-thread [CW]
    accumulators (no barrier in the loop). With ``RECENT`` the tiles from ``top`` (a tile start in [start, end)) down
    to ``start`` come first (``_piv_at``)."""
    BLOCK: tl.constexpr = RT * CW
    g0a = tl.zeros((CW,), tl.float32)
    g1a = tl.zeros((CW,), tl.float32)
    g0b = tl.zeros((CW,), tl.float32)
    g1b = tl.zeros((CW,), tl.float32)
    g0c = tl.zeros((CW,), tl.float32)
    g1c = tl.zeros((CW,), tl.float32)
    tot = tl.zeros((CW,), tl.float32)
    if STAGES > 1:
        # cp.async into STAGES shared-memory buffers (Triton's loop pipeliner): deeper than one tile ahead
        for s in tl.range(start, end, BLOCK, num_stages=STAGES):
            x = _rej_tile(x_row, _piv_at(s, start, top, RECENT), V, RT, CW)
            g0a, g1a, g0b, g1b, g0c, g1c, tot = _piv_acc(x, x0a, x1a, x0b, x1b, x0c, x1c, g0a, g1a, g0b, g1b, g0c,
                                                         g1c, tot, K)  # fmt: skip
    else:
        x = _rej_tile(x_row, _piv_at(start, start, top, RECENT), V, RT, CW)
        for s in range(start, end, BLOCK):
            # the next tile's loads fly during this one's sums
            xn = _rej_tile(x_row, _piv_at(s + BLOCK, start, top, RECENT), V, RT, CW)
            g0a, g1a, g0b, g1b, g0c, g1c, tot = _piv_acc(x, x0a, x1a, x0b, x1b, x0c, x1c, g0a, g1a, g0b, g1b, g0c,
                                                         g1c, tot, K)  # fmt: skip
            x = xn
    G0a = tl.sum(g0a, axis=0)
    G1a = tl.sum(g1a, axis=0)
    G0b = tl.sum(g0b, axis=0)
    G1b = tl.sum(g1b, axis=0)
    G0c = tl.sum(g0c, axis=0)
    G1c = tl.sum(g1c, axis=0)
    return G0a, G1a, G0b, G1b, G0c, G1c, tl.sum(tot, axis=0)


@triton.jit
def _rej_round0(M, p, c0, high):
    """What round 0's pivot pass learns from the row's sum M: (target, round 0's proposals usable, high, no mass)."""
    target = tl.where(p < 1.0, p * M, float("inf"))
    # (M <= c0 (1 - 2^-16): the margin covers the float32 disagreement between M and the sampling pass's running
    # total of the same row, about 2^-17 of the sum at worst over 128k entries)
    usable0 = c0 * 0.9999847412109375 >= M
    # (no positive mass, or a NaN in the row: invalid at once, as on the PyTorch path)
    return target, usable0, tl.minimum(high, M), ~(M > 0.0)


@triton.jit
def _rej_decide(i0, i1, i2, x0a, x1a, x0b, x1b, x0c, x1c, G0a, G1a, G0b, G1b, G0c, G1c, target, use, low, q, high,
                K: tl.constexpr):  # fmt: skip
    """A round's decision: (the token or -1, low, q, high). The first usable proposal with G(x0) < target (or 0) is
    the token; otherwise low rises to the largest pivot whose G reaches the target (q: that G) and high falls to the
    smallest x1 whose G does not."""
    res = tl.full((), -1, tl.int32)
    f0 = i0 >= 0
    if K >= 2:
        f1 = i1 >= 0
    else:
        f1 = tl.zeros((), tl.int1)
    if K == 3:
        f2 = i2 >= 0
    else:
        f2 = tl.zeros((), tl.int1)
    acc_a = f0 & ((G0a < target) | (G0a == 0.0)) & use
    acc_b = f1 & ((G0b < target) | (G0b == 0.0)) & use
    acc_c = f2 & ((G0c < target) | (G0c == 0.0)) & use
    if acc_a:
        res = i0
    elif acc_b:
        res = i1
    elif acc_c:
        res = i2
    else:
        nl = low
        nq = q
        nh = high
        if f0 & (G0a >= target) & (G0a != 0.0) & (x0a > nl):
            nl = x0a
            nq = G0a
        if f0 & (G1a >= target) & (G1a != 0.0):
            if x1a > nl:
                nl = x1a
                nq = G1a
        elif f0:
            nh = tl.minimum(nh, x1a)
        if f1 & (G0b >= target) & (G0b != 0.0) & (x0b > nl):
            nl = x0b
            nq = G0b
        if f1 & (G1b >= target) & (G1b != 0.0):
            if x1b > nl:
                nl = x1b
                nq = G1b
        elif f1:
            nh = tl.minimum(nh, x1b)
        if K == 3:
            if f2 & (G0c >= target) & (G0c != 0.0) & (x0c > nl):
                nl = x0c
                nq = G0c
            if f2 & (G1c >= target) & (G1c != 0.0):
                if x1c > nl:
                    nl = x1c
                    nq = G1c
            elif f2:
                nh = tl.minimum(nh, x1c)
        low = nl
        q = nq
        high = nh
    return res, low, q, high


@triton.jit
def _rej_rounds(x_row, u_row, V, p, c0, low, high, q, M, target, usable0, res, empty, R0: tl.constexpr,
                K: tl.constexpr, R: tl.constexpr, RT: tl.constexpr, CW: tl.constexpr, PIV_STAGES: tl.constexpr,
                RECENT_MIN: tl.constexpr):  # fmt: skip
    """Rounds R0 .. R - 1 over the whole row from the state after round R0 - 1, while the row has no token (``res``
    < 0) and has mass. Returns (res, empty). At grids of at least ``RECENT_MIN`` rows each pivot pass reads the
    sampling pass's tiles first, most recent first (``_piv_at``), else the row in order: a runtime select on the
    grid's size, so that one compiled kernel serves every batch."""
    # (a loop whose constexpr bound is 0 would be folded to nothing around values still in use: Triton 3.6's
    # coalescing pass fails on what is left, so no rounds means no loop at all)
    if R > R0:
        r = R0
        while (r < R) & (res < 0) & (~empty):
            if r == 0:
                c = c0 + tl.zeros((), tl.float32)
            else:
                c = q * 1.000244140625  # 1 + 2^-12
            t0 = tl.load(u_row + r * K) * c
            t1 = t0
            t2 = t0
            if K >= 2:
                t1 = tl.load(u_row + r * K + 1) * c
            if K == 3:
                t2 = tl.load(u_row + r * K + 2) * c
            i0 = tl.full((), -1, tl.int32)
            i1 = tl.full((), -1, tl.int32)
            i2 = tl.full((), -1, tl.int32)
            if K == 1:
                i1 = tl.zeros((), tl.int32)  # (no second proposal: counts as found)
            if K < 3:
                i2 = tl.zeros((), tl.int32)  # (no third)
            i0, i1, i2, stop = _rej_sample_pass(x_row, 0, V, V, low, tl.zeros((), tl.float32), t0, t1, t2, i0, i1, i2,
                                                RT, CW, False, K == 3)  # fmt: skip
            # (the tile the sampling pass loaded last, or the row's last tile where it ran to the end)
            # (below the rule's batch a tile before the row's first, so every tile is read in order; -(RT * CW), not
            # -1: a multiple of the tile keeps the tile addresses provably aligned, else the pivot loads narrow to
            # 4-byte cp.async for float32 and to plain loads for 16-bit rows, sm_90)
            top = tl.where(tl.num_programs(0) >= RECENT_MIN, tl.minimum(stop, ((V - 1) // (RT * CW)) * (RT * CW)),
                           -(RT * CW))  # fmt: skip
            x0a = tl.load(x_row + tl.maximum(i0, 0)).to(tl.float32)
            x0b = tl.load(x_row + tl.maximum(i1, 0)).to(tl.float32)
            x1a = (x0a + high) * 0.5
            x1b = (x0b + high) * 0.5
            x0c = x0b
            if K == 3:
                x0c = tl.load(x_row + tl.maximum(i2, 0)).to(tl.float32)
            x1c = (x0c + high) * 0.5
            G0a, G1a, G0b, G1b, G0c, G1c, tot = _rej_pivot_pass(x_row, 0, V, V, x0a, x1a, x0b, x1b, x0c, x1c, top, K,
                                                                RT, CW, PIV_STAGES, True)  # fmt: skip
            if r == 0:
                M = tot
                target, usable0, high, empty = _rej_round0(M, p, c0, high)
                q = M
            use = (r > 0) | usable0
            res, low, q, high = _rej_decide(i0, i1, i2, x0a, x1a, x0b, x1b, x0c, x1c, G0a, G1a, G0b, G1b, G0c, G1c,
                                            target, use, low, q, high, K)  # fmt: skip
            r += 1
    return res, empty


@triton.jit
def _rej_store(x_row, u_row, V, i, p_ptr, p_val, res, empty, out_ptr, valid_ptr, P_ARR: tl.constexpr,
               K: tl.constexpr, R: tl.constexpr, BLOCK_FB: tl.constexpr):  # fmt: skip
    """A row's token and validity, after the exact fallback where the rounds left it undecided: the threshold, then
    one inverse CDF over the kept set at the row's last uniform."""
    ok = ~empty
    if (res < 0) & ok:
        t, mass, total = _thresholds(
            x_row, V, i, p_ptr, 0, p_ptr, p_val, False, False, True, P_ARR, False, 8, BLOCK_FB, BLOCK_FB
        )
        res = _draw(x_row, V, t, 0.0, mass, tl.load(u_row + R * K), False, False, 0.0, BLOCK_FB)
        ok = (res >= 0) & (mass > 0)
    tl.store(out_ptr + i, tl.where(ok, tl.maximum(res, 0), 0).to(out_ptr.dtype.element_ty))
    tl.store(valid_ptr + i, ok.to(valid_ptr.dtype.element_ty))


@triton.jit
def _topp_reject_kernel(
    x_ptr, idx_ptr, u_ptr, out_ptr, valid_ptr, stride_x, n_u, V, p_ptr, p_val, c0,
    HAS_INDICES: tl.constexpr, P_ARR: tl.constexpr, K: tl.constexpr, R: tl.constexpr,
    RT: tl.constexpr, CW: tl.constexpr, BLOCK_FB: tl.constexpr, PIV_STAGES: tl.constexpr, RECENT_MIN: tl.constexpr,
):  # fmt: skip
    """Every round of one row in one program."""
    i = tl.program_id(0)
    x_row = _row_ptr(x_ptr, stride_x, idx_ptr, i, HAS_INDICES)
    u_row = u_ptr + i.to(tl.int64) * n_u
    if P_ARR:
        p = tl.load(p_ptr + i).to(tl.float32)
    else:
        p = p_val + tl.zeros((), tl.float32)
    zero = tl.zeros((), tl.float32)
    res, empty = _rej_rounds(x_row, u_row, V, p, c0, zero, c0 + zero, c0 + zero, zero, zero, tl.zeros((), tl.int1),
                             tl.full((), -1, tl.int32), tl.zeros((), tl.int1), 0, K, R, RT, CW, PIV_STAGES,
                             RECENT_MIN)  # fmt: skip
    _rej_store(x_row, u_row, V, i, p_ptr, p_val, res, empty, out_ptr, valid_ptr, P_ARR, K, R, BLOCK_FB)


# Round 0 split over S chunks of CH entries a row (grid (n, S) but the last kernel's (n,)). The kernels take the
# row-split samplers' leading parameters (``_N_LEAD``), so their launches bind like theirs; the float32 workspace
# holds, per (row, chunk): the chunk's positive sum (region 0), then its pivot sums G(x0a), G(x1a), G(x0b), G(x1b)
# and its total (regions 1-5), with three proposals also G(x0c), G(x1c) (regions 6-7); then K int32 proposals a row
# (two with one proposal: the second unused).


@triton.jit
def _prop_ptr(ws, NC, i, K: tl.constexpr):
    """Row ``i``'s round-0 proposals (int32) in the workspace, after the per-chunk regions (6, or 8 with three
    proposals: their G(x0c), G(x1c) last)."""
    base = ws.to(tl.pointer_type(tl.int32), bitcast=True)
    if K == 3:
        return base + 8 * NC + 3 * i
    else:
        return base + 6 * NC + 2 * i


@triton.jit
def _pos_sum(x_row, start, end, V, RT: tl.constexpr, CW: tl.constexpr, STAGES: tl.constexpr):
    """Sum of the positive entries of [start, end) (the mass round 0 samples from, {y > 0})."""
    acc = tl.zeros((CW,), tl.float32)
    for s in tl.range(start, end, RT * CW, num_stages=STAGES):
        x = _rej_tile(x_row, s, V, RT, CW)
        acc += tl.sum(tl.where(x > 0.0, x, 0.0), axis=0)
    return tl.sum(acc, axis=0)


@triton.jit
def _topp_split_sums_kernel(
    x_ptr, idx_ptr, u_ptr, out_ptr, valid_ptr, ws, k_ptr, k_val, p_ptr, p_val, stride_x, V, S, NC,
    HAS_INDICES: tl.constexpr, CH: tl.constexpr, RT: tl.constexpr, CW: tl.constexpr, STAGES: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Per (row, chunk): the chunk's positive mass."""
    _pdl_start(PDL)
    i = tl.program_id(0)
    c = tl.program_id(1)
    x_row = _row_ptr(x_ptr, stride_x, idx_ptr, i, HAS_INDICES)
    start = c * CH
    tl.store(ws + i * S + c, _pos_sum(x_row, start, tl.minimum(start + CH, V), V, RT, CW, STAGES))


@triton.jit
def _topp_split_propose_kernel(
    x_ptr, idx_ptr, u_ptr, out_ptr, valid_ptr, ws, k_ptr, k_val, p_ptr, p_val, stride_x, n_u, V, S, NC, c0,
    HAS_INDICES: tl.constexpr, K: tl.constexpr, CH: tl.constexpr, SP: tl.constexpr, RT: tl.constexpr,
    CW: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Per (row, chunk): round 0's proposals that fall in this chunk. Every program of a row takes the same inclusive
    cumsum of the chunk sums, so exactly one chunk owns each target (the first whose cumsum exceeds it); the owner
    walks its chunk from the cumsum before it, as the one-program sampling pass walks the row. A target beyond the
    row's mass is a miss, written by chunk 0."""
    _pdl_start(PDL)
    i = tl.program_id(0)
    c = tl.program_id(1)
    jj = tl.arange(0, SP)
    cs = tl.cumsum(tl.load(ws + i * S + jj, mask=jj < S, other=0.0), axis=0)
    u_row = u_ptr + i.to(tl.int64) * n_u
    cc = c0 + tl.zeros((), tl.float32)
    t0 = tl.load(u_row) * cc
    own0 = tl.min(tl.where(cs > t0, jj, SP), axis=0)
    t1 = t0
    t2 = t0
    own1 = tl.full((), SP, tl.int32)
    own2 = tl.full((), SP, tl.int32)
    if K >= 2:
        t1 = tl.load(u_row + 1) * cc
        own1 = tl.min(tl.where(cs > t1, jj, SP), axis=0)
    if K == 3:
        t2 = tl.load(u_row + 2) * cc
        own2 = tl.min(tl.where(cs > t2, jj, SP), axis=0)
    prop = _prop_ptr(ws, NC, i, K)
    mine0 = own0 == c
    mine1 = own1 == c
    mine2 = own2 == c
    if mine0 | mine1 | mine2:
        x_row = _row_ptr(x_ptr, stride_x, idx_ptr, i, HAS_INDICES)
        start = c * CH
        end = tl.minimum(start + CH, V)
        base = tl.sum(tl.where(jj == c - 1, cs, 0.0), axis=0)
        i0 = tl.where(mine0, -1, 0)
        i1 = tl.where(mine1, -1, 0)
        i2 = tl.where(mine2, -1, 0)
        # (a rounding shortfall, the chunk sums past the target where this walk's own sums of the chunk are not,
        # takes the chunk's last candidate)
        i0, i1, i2, _ = _rej_sample_pass(x_row, start, end, V, tl.zeros((), tl.float32), base, t0, t1, t2, i0, i1, i2,
                                         RT, CW, True, K == 3)  # fmt: skip
        tl.store(prop, i0, mask=mine0)
        tl.store(prop + 1, i1, mask=mine1)
        if K == 3:
            tl.store(prop + 2, i2, mask=mine2)
    if c == 0:
        tl.store(prop, -1, mask=own0 >= S)
        if K >= 2:
            tl.store(prop + 1, -1, mask=own1 >= S)
        if K == 3:
            tl.store(prop + 2, -1, mask=own2 >= S)


@triton.jit
def _round0_pivots(x_row, ws, NC, i, c0, K: tl.constexpr):
    """Round 0's proposals from the workspace and their pivots: x0 = the entry, x1 = (x0 + c0) / 2 (``high`` before
    M is known). Proposals not wanted (K < 3) read as found at index 0."""
    prop = _prop_ptr(ws, NC, i, K)
    i0 = tl.load(prop)
    i1 = tl.zeros((), tl.int32)  # (no second proposal: counts as found)
    i2 = tl.zeros((), tl.int32)
    if K >= 2:
        i1 = tl.load(prop + 1)
    if K == 3:
        i2 = tl.load(prop + 2)
    high = c0 + tl.zeros((), tl.float32)
    x0a = tl.load(x_row + tl.maximum(i0, 0)).to(tl.float32)
    x0b = tl.load(x_row + tl.maximum(i1, 0)).to(tl.float32)
    x0c = x0b
    if K == 3:
        x0c = tl.load(x_row + tl.maximum(i2, 0)).to(tl.float32)
    x1a = (x0a + high) * 0.5
    x1b = (x0b + high) * 0.5
    x1c = (x0c + high) * 0.5
    return i0, i1, i2, x0a, x1a, x0b, x1b, x0c, x1c


@triton.jit
def _topp_split_pivots_kernel(
    x_ptr, idx_ptr, u_ptr, out_ptr, valid_ptr, ws, k_ptr, k_val, p_ptr, p_val, stride_x, V, S, NC, c0,
    HAS_INDICES: tl.constexpr, K: tl.constexpr, CH: tl.constexpr, RT: tl.constexpr, CW: tl.constexpr,
    STAGES: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Per (row, chunk): round 0's pivot sums over the chunk, and its total. Round 0's upper pivots halve towards
    c0 (``high`` before M is known), as in the one-program kernel."""
    _pdl_start(PDL)
    i = tl.program_id(0)
    c = tl.program_id(1)
    x_row = _row_ptr(x_ptr, stride_x, idx_ptr, i, HAS_INDICES)
    i0, i1, i2, x0a, x1a, x0b, x1b, x0c, x1c = _round0_pivots(x_row, ws, NC, i, c0, K)
    start = c * CH
    G0a, G1a, G0b, G1b, G0c, G1c, tot = _rej_pivot_pass(x_row, start, tl.minimum(start + CH, V), V, x0a, x1a, x0b,
                                                        x1b, x0c, x1c, start, K, RT, CW, STAGES, False)  # fmt: skip
    part = ws + i * S + c
    tl.store(part + NC, G0a)
    tl.store(part + 2 * NC, G1a)
    if K >= 2:
        tl.store(part + 3 * NC, G0b)
        tl.store(part + 4 * NC, G1b)
    tl.store(part + 5 * NC, tot)
    if K == 3:
        tl.store(part + 6 * NC, G0c)
        tl.store(part + 7 * NC, G1c)


@triton.jit
def _topp_split_finish_kernel(
    x_ptr, idx_ptr, u_ptr, out_ptr, valid_ptr, ws, k_ptr, k_val, p_ptr, p_val, stride_x, n_u, V, S, NC, c0,
    HAS_INDICES: tl.constexpr, P_ARR: tl.constexpr, K: tl.constexpr, R: tl.constexpr, SP: tl.constexpr,
    RT: tl.constexpr, CW: tl.constexpr, BLOCK_FB: tl.constexpr, PIV_STAGES: tl.constexpr, RECENT_MIN: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Per row: round 0's decision from the chunks' sums (in chunk order), then the later rounds and the fallback
    over the whole row, as the one-program kernel runs them."""
    _pdl_start(PDL)
    i = tl.program_id(0)
    x_row = _row_ptr(x_ptr, stride_x, idx_ptr, i, HAS_INDICES)
    u_row = u_ptr + i.to(tl.int64) * n_u
    if P_ARR:
        p = tl.load(p_ptr + i).to(tl.float32)
    else:
        p = p_val + tl.zeros((), tl.float32)
    jj = tl.arange(0, SP)
    part = ws + i * S + jj
    m = jj < S
    G0a = tl.sum(tl.load(part + NC, mask=m, other=0.0), axis=0)
    G1a = tl.sum(tl.load(part + 2 * NC, mask=m, other=0.0), axis=0)
    G0b = G0a
    G1b = G1a
    if K >= 2:
        G0b = tl.sum(tl.load(part + 3 * NC, mask=m, other=0.0), axis=0)
        G1b = tl.sum(tl.load(part + 4 * NC, mask=m, other=0.0), axis=0)
    G0c = G0b
    G1c = G1b
    if K == 3:
        G0c = tl.sum(tl.load(part + 6 * NC, mask=m, other=0.0), axis=0)
        G1c = tl.sum(tl.load(part + 7 * NC, mask=m, other=0.0), axis=0)
    M = tl.sum(tl.load(part + 5 * NC, mask=m, other=0.0), axis=0)
    i0, i1, i2, x0a, x1a, x0b, x1b, x0c, x1c = _round0_pivots(x_row, ws, NC, i, c0, K)
    high = c0 + tl.zeros((), tl.float32)
    target, usable0, high, empty = _rej_round0(M, p, c0, high)
    res, low, q, high = _rej_decide(i0, i1, i2, x0a, x1a, x0b, x1b, x0c, x1c, G0a, G1a, G0b, G1b, G0c, G1c, target,
                                    usable0, tl.zeros((), tl.float32), M, high, K)  # fmt: skip
    res, empty = _rej_rounds(x_row, u_row, V, p, c0, low, high, q, M, target, usable0, res, empty, 1, K, R, RT, CW,
                             PIV_STAGES, RECENT_MIN)  # fmt: skip
    _rej_store(x_row, u_row, V, i, p_ptr, p_val, res, empty, out_ptr, valid_ptr, P_ARR, K, R, BLOCK_FB)


_C0 = 1.0 + 2.0**-10  # round 0's bound on a row's sum (sampling.py's _C0)


def _topp_shape(n: int, V: int, sms: int, cfg: _config.SamplingConfig):
    """(warps, tile rows, tile width) of the program that runs a row's rounds."""
    if n < sms:  # a program has an SM to itself: wide tiles, the most bytes in flight
        nw, rt = cfg.topp_warps_small_batch, cfg.topp_tile_rows_small_batch
    else:
        nw, rt = cfg.topp_warps, cfg.topp_tile_rows
    cw = nw * 128
    while rt > 1 and rt * cw > max(V, cw):  # (short rows: no tile rows past the row's end)
        rt //= 2
    return nw, rt, cw


def topp_split_chunk(n: int, V: int, sms: int, cfg: _config.SamplingConfig) -> int:
    """The chunk length of the split round 0 for ``n`` rows of ``V``, or 0 where one program a row runs it. Split:
    at most ``topp_split_max_batch`` rows, with rounds to run, and at least two chunks a row, the chunks of every row
    fitting one wave (at most ``sms // n`` a row); a chunk is the smallest power of two >= ``topp_split_chunk`` that
    does."""
    if n > cfg.topp_split_max_batch or cfg.topp_rounds == 0 or 2 * n > sms:
        return 0
    ch = max(cfg.topp_split_chunk, _np2(_cdiv(V, sms // n)))
    return ch if _cdiv(V, ch) >= 2 else 0


def launch_topp_reject(x, indices, u, out, valid, p, cfg: _config.SamplingConfig) -> None:
    """Top-p alone by rejection rounds. ``u``: [n, cfg.topp_rounds * cfg.topp_proposals_at(n) + 1] float32, the last
    column the exact fallback's (``cfg``: the configuration the caller sized ``u`` by, read once per call)."""
    n, V = out.shape[0], x.shape[1]
    # Off CUDA an H100's SM count, so that the interpreter runs the tiles and splits the GPU would.
    sms = _config.num_sms(x.device) if x.device.type == "cuda" else 132
    ch = topp_split_chunk(n, V, sms, cfg)
    if ch:
        _launch_topp_split(x, indices, u, out, valid, p, cfg, ch, sms)
        return
    nw, rt, cw = _topp_shape(n, V, sms, cfg)
    p_arr = not isinstance(p, (int, float))
    # At most 8 warps: capped at 128 registers a thread, so that two 8-warp programs share an SM (sm_90: float32
    # rows compile to 128 with no stack when capped, with 24 bytes of stack when not; bfloat16 rows to 155 uncapped,
    # one program an SM; three proposals, capped: 8 bytes of stack for float32, 32 for bfloat16 against 24 with two).
    # 16 and 32 warps cannot take more than 128 and 64 in any case (32 warps, three proposals: 64 and 63, no stack). The exact fallback's [tile, 8]
    # pivot cells set the registers: 1024 at 8 warps (2048 took 201), and as many a warp below (1 warp at 1024: 1.7 KB
    # of stack).
    fb = min(1024, _np2(V), 128 * nw)
    _launch(_topp_reject_kernel, (n,),
        x, indices if indices is not None else x, u, out, valid, x.stride(0), u.stride(0), V,
        p if p_arr else x, 0.0 if p_arr else float(p), _C0,
        HAS_INDICES=indices is not None, P_ARR=p_arr, K=cfg.topp_proposals_at(n), R=cfg.topp_rounds, RT=rt, CW=cw,
        BLOCK_FB=fb, PIV_STAGES=cfg.topp_stages, RECENT_MIN=cfg.topp_pivot_recent_first_min_batch,
        num_warps=nw,
        MAXNREG=128 if nw <= 8 else 0,
    )  # fmt: skip


def _launch_topp_split(x, indices, u, out, valid, p, cfg: _config.SamplingConfig, ch: int, sms: int) -> None:
    n, V = out.shape[0], x.shape[1]
    p_ptr, p_val, _, p_arr = _filter_arg(p, x, False, V)
    has_idx = indices is not None
    key = ("topp_split", n, V, x.stride(0), u.stride(0), x.dtype, x.device, indices.dtype if has_idx else None,
           out.dtype, valid.dtype, p_arr, cfg)  # fmt: skip
    plan = _PLANS.get(key)
    if plan is None:
        s = _cdiv(V, ch)
        nc = n * s
        sp = max(8, _np2(s))
        K = cfg.topp_proposals_at(n)
        pdl = _config.pdl_launch(None, x.device, cfg.pdl)
        # The chunk passes' tile: [topp_split_tile_rows, warps * 128], within one chunk (a power of two: whole tiles).
        nw = max(1, min(cfg.topp_split_warps, ch // 128))
        cw = nw * 128
        rt = max(1, min(cfg.topp_split_tile_rows, ch // cw))
        st = max(1, cfg.topp_stages)
        sx = x.stride(0)
        plan = _new_plan(key, (8 * nc + 3 * n) if K == 3 else (6 * nc + 2 * n))
        plan.steps.append((_topp_split_sums_kernel, (n, s), (sx, V, s, nc), nw,
                           dict(HAS_INDICES=has_idx, CH=ch, RT=rt, CW=cw, STAGES=st, PDL=pdl)))  # fmt: skip
        plan.steps.append((_topp_split_propose_kernel, (n, s), (sx, u.stride(0), V, s, nc, _C0), nw,
                           dict(HAS_INDICES=has_idx, K=K, CH=ch, SP=sp, RT=rt, CW=cw, PDL=pdl)))  # fmt: skip
        plan.steps.append((_topp_split_pivots_kernel, (n, s), (sx, V, s, nc, _C0), nw,
                           dict(HAS_INDICES=has_idx, K=K, CH=ch, RT=rt, CW=cw, STAGES=st, PDL=pdl)))  # fmt: skip
        # The later rounds and the fallback: the one-program kernel's shape below a batch of one row an SM, at 16 warps
        # of one tile row at most, with a cap of 128 registers a thread given to ptxas (sm_90, compiled offline:
        # 76-94 registers and no spills, float32 and bfloat16, one or two proposals, 112-118 with three; at 32 warps,
        # 64 registers a thread, two proposals spill 16 bytes; uncapped at 16 warps ptxas picks 64 for bfloat16 with
        # one proposal, and spills). Rounds after the first are rare, so the shape matters little.
        fw, frt, fcw = _topp_shape(n, V, sms, cfg)
        if fw > 16:
            frt, fw, fcw = 1, 16, 16 * 128
        plan.steps.append((_topp_split_finish_kernel, (n,), (sx, u.stride(0), V, s, nc, _C0), fw,
                           dict(HAS_INDICES=has_idx, P_ARR=p_arr, K=K, R=cfg.topp_rounds, SP=sp, RT=frt, CW=fcw,
                                BLOCK_FB=min(1024, _np2(V), 128 * fw), PIV_STAGES=cfg.topp_stages,
                                RECENT_MIN=cfg.topp_pivot_recent_first_min_batch, PDL=pdl,
                                MAXNREG=128)))  # fmt: skip
    ws = torch.empty(plan.ws_numel, dtype=torch.float32, device=x.device)
    _run(plan, (x, indices if has_idx else x, u, out, valid, ws, x, 0, p_ptr, p_val))
