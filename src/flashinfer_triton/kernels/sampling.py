"""Sampling kernels: softmax, exact filtered sampling (top-k / top-p / min-p), renormalisation,
top-k logit masking and chain speculative sampling.

One program owns one row and walks it in ``BLOCK``-wide tiles, so a row of any vocabulary size needs
no workspace and no host round trip (every launch is CUDA-graph safe).

Filters are exact thresholds, found without sorting. Each element maps to an int32 *key* that orders
like its float value (the bit pattern, lower 31 bits flipped for negatives). ``_search`` finds the
largest element key ``t`` whose aggregate ``F(t)`` over the elements with key ``>= t`` (their count for
top-k, their probability mass for top-p) still reaches a target. Every pass evaluates ``F`` at ``NP``
pivots spread over the remaining key interval and snaps the interval's ends to element keys (the
smallest key at or above the last pivot that reached the target, the largest key below the first that
did not), so the interval shrinks at least ``NP``-fold per pass and ends on an element key, and the
count and mass of the kept set come out of the search. Sampling then draws by inverse CDF over the kept
set: the first index whose running mass exceeds ``u * S`` for one uniform ``u`` per row, with tiles in a
fixed order, so a draw is deterministic given ``u``.
"""

import triton
import triton.language as tl

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
    tl.store(valid_ptr + i, ok.to(tl.int8))


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
def _softmax_kernel(
    x_ptr, out_ptr, stride_x, stride_o, V, t_ptr, t_val, T_ARR: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    """``softmax(x / temperature)`` of one row: an online max/sum pass, then a write pass."""
    i = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + i * stride_x
    o_row = out_ptr + i * stride_o
    if T_ARR:
        temp = tl.load(t_ptr + i).to(tl.float32)
    else:
        temp = t_val + tl.zeros((), tl.float32)
    rt = 1.0 / temp
    mx = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32) * rt
        new_mx = tl.maximum(mx, tl.max(x, axis=0))
        s = s * tl.exp(mx - new_mx) + tl.sum(tl.exp(x - new_mx), axis=0)
        mx = new_mx
    inv = 1.0 / s
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < V
        x = tl.load(x_row + offs, mask=m, other=float("-inf")).to(tl.float32) * rt
        tl.store(o_row + offs, tl.exp(x - mx) * inv, mask=m)


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


def _block(V: int) -> int:
    return max(16, min(triton.next_power_of_2(V), 2048 if V >= 16384 else 1024))


def _scan_block(V: int, cap: int) -> int:
    """Tiles of the streaming passes (no pivot tiles): wide, so one program keeps 16-32 KB of loads in
    flight; a single program per row is bound by load latency, not bandwidth, at small batch."""
    return max(16, min(triton.next_power_of_2(V), cap if V >= 32768 else 1024))


def _warps(V: int) -> int:
    # 2048-wide tiles with 8 warps keep twice the bytes in flight per program at the same registers per
    # thread as 1024 with 4 (the search's [BLOCK, 8] pivot tiles dominate the register budget).
    return 8 if V >= 16384 else 4


def launch_sample(x, indices, u, out, valid, k, p, minp, from_logits: bool, k_first: bool) -> None:
    """``k``/``p``/``minp``: None, a python scalar or a per-row tensor."""
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
    _sample_kernel[(n,)](
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
    _renorm_kernel[(n,)](
        x, out, x.stride(0), out.stride(0), V,
        k if k_arr else x, int(k) if (k is not None and not k_arr) else 0,
        p if p_arr else x, float(p) if (p is not None and not p_arr) else 0.0,
        HAS_K=k is not None, K_ARR=k_arr, HAS_P=p is not None, P_ARR=p_arr,
        MASK_LOGITS=mask_logits, NP=8, BLOCK=_block(V), BLOCK_SCAN=_scan_block(V, 4096), num_warps=_warps(V),
    )  # fmt: skip


def launch_softmax(x, out, temperature) -> None:
    n, V = x.shape
    if n == 0:
        return
    t_arr = not isinstance(temperature, (int, float))
    _softmax_kernel[(n,)](
        x, out, x.stride(0), out.stride(0), V, temperature if t_arr else x, 0.0 if t_arr else float(temperature),
        T_ARR=t_arr, BLOCK=_scan_block(V, 8192), num_warps=16 if V >= 32768 else _warps(V),
    )  # fmt: skip


def launch_uniform(seed, offset, n: int, n_u: int, out) -> None:
    arr = not isinstance(seed, int)
    _uniform_kernel[(n,)](
        seed if arr else out, 0 if arr else seed, offset if arr else out, 0 if arr else offset, out, n_u,
        SEED_ARR=arr, BLOCK=max(16, triton.next_power_of_2(n_u)),
    )  # fmt: skip


def launch_chain(draft, draft_ids, target, u, out, acc, emit) -> None:
    b, n_spec, V = draft.shape
    if b == 0:
        return
    _chain_kernel[(b,)](draft, draft_ids, target, u, out, acc, emit, n_spec, V, BLOCK=_block(V), num_warps=_warps(V))
