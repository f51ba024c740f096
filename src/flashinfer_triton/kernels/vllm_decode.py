"""vLLM's paged attention (``flashinfer_triton.vllm``): one decode query per sequence over vLLM's cache layout.

Layout: keys ``[blocks, Hkv, D/X, block_size, X]`` (element ``d`` of slot ``s`` at ``(d // X) * block_size * X +
s * X + d % X`` within its block and head), values ``[blocks, Hkv, D, block_size]`` (``d * block_size + s``); the
inner dimensions are contiguous (checked by the caller), so every in-block offset is a compile-time multiple and
loads stay 16-byte vectors. Token ``j`` of sequence ``b`` is in block ``block_tables[b, j // block_size]``.

One program handles one (work item, KV head); its rows are the GROUP query heads of that KV head, so each K/V tile
is loaded once for the whole group. Work item ``w`` is sequence ``w // num_parts``, part ``w % num_parts``:

* v2 (``PART_SIZE > 0``): keys ``[p * PART_SIZE, min((p + 1) * PART_SIZE, seq_len))``; the partition's state is
  written in vLLM's form (``max_logits = m`` in natural units, ``exp_sums = sum exp(s - m)``, ``tmp_out = acc /
  exp_sums * v_scale``), then the last partition program of each (sequence, KV head) to finish (an arrival counter
  per pair) reduces them into ``out`` in the same launch;
* v1 with ``SPLIT``: the sequence cut into chunks of ``v1_chunk`` keys (when the batch alone leaves the GPU idle),
  partial states into a float32 workspace, merged by the last chunk to finish (``merge.merge_group``);
* v1 otherwise: the whole sequence, straight into ``out``.

Score ``s_j = scale * k_scale * (q . k_j)`` (+ ``slope_h * (j - seq_len + 1)``, vLLM's ALiBi position), kept in
base 2 for the online softmax. Key tiles wholly inside the range load ``BLOCK_N / block_size`` whole blocks, one
block-table entry each (a block's keys and values are each one contiguous run), without key masks; the partial last
tile loads per key, masked.

Bad indices: every block-table entry read is checked against the cache's extent (``0 <= entry < num_blocks``), and
``seq_lens`` against the block table's capacity (``max_blocks * block_size``) and, for v2, the partitions the grid
covers (``num_parts * PART_SIZE``). An offending entry is replaced by block 0 (no read outside the cache), the
program's results are written as NaN, and the first such error is recorded in ``err_ptr`` (int32 ``[code,
sequence, value]``, ``_errors.py`` reads it): code 1 a block-table entry, 2 a length past the table, 3 a length
past ``max_seq_len``'s partitions.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .merge import merge_group

# log2(e) = 1.4426950408889634 and ln(2) = 0.6931471805599453 are literals in the kernels: a global constexpr is
# compared on every launch by Triton's changed-globals check (host time). -2147483648 (int32 min) marks "no bad
# block-table entry seen".


@triton.jit
def _record_error(err_ptr, code, seq, value):
    """Record the first error of the device: ``[code, sequence, value]`` (later ones keep the first)."""
    old = tl.atomic_cas(err_ptr, 0, code)
    if old == 0:
        tl.store(err_ptr + 1, seq)
        tl.store(err_ptr + 2, value)


@triton.jit
def _attend_tile(
    n0, end, m_i, l_i, acc, bad_val, b_q_c, bt_ptr, seq_base, k_ptr, v_ptr, stride_kp, stride_kh, stride_vp,
    stride_vh, g64, offs_d, mask_d, slope, pos0, qk_scale, num_blocks,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    KX: tl.constexpr, ALIBI: tl.constexpr, COMPUTE_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    INTERPRET: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """One key tile ``[n0, n0 + BLOCK_N)`` of the online softmax; keys at or past ``end`` are masked when ``MASKED``
    (without it every key of the tile is below ``end`` and ``n0`` is a multiple of the block size). Returns the new
    (m, l, acc, bad_val): ``bad_val`` is the largest out-of-range block-table entry seen (int32 min: none)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if not MASKED:
        # NB = BLOCK_N / block_size whole blocks, one table entry per block; a block's keys ([D/X, block_size * X])
        # and values ([D, block_size]) are each one contiguous run, loaded as [NB, run] / [NB, D, block_size] tiles.
        NB: tl.constexpr = BLOCK_N // PAGE_SIZE
        offs_b = tl.arange(0, NB)
        raw = tl.load(bt_ptr + seq_base + n0 // PAGE_SIZE + offs_b)  # [NB]
        ok = (raw >= 0) & (raw < num_blocks)
        bad_val = tl.maximum(bad_val, tl.max(tl.where(ok, -2147483648, raw), axis=0))
        pg = tl.where(ok, raw, 0).to(tl.int64)
        KC: tl.constexpr = BLOCK_D // KX
        KR: tl.constexpr = PAGE_SIZE * KX
        offs_kf = tl.arange(0, KC * KR)
        k_base = pg * stride_kp + g64 * stride_kh
        if BLOCK_D == HEAD_DIM:
            b_kf = tl.load(k_ptr + k_base[:, None] + offs_kf[None, :])
        else:  # padded head: the chunks past D/X are masked
            b_kf = tl.load(
                k_ptr + k_base[:, None] + offs_kf[None, :], mask=(offs_kf[None, :] // KR) * KX < HEAD_DIM, other=0.0
            )
        b_k = tl.reshape(tl.permute(tl.reshape(b_kf, (NB, KC, PAGE_SIZE, KX)), (0, 2, 1, 3)), (BLOCK_N, BLOCK_D))
    else:
        mask_n = offs_n < end
        raw = tl.load(bt_ptr + seq_base + offs_n // PAGE_SIZE, mask=mask_n, other=0)  # [BLOCK_N]
        ok = (raw >= 0) & (raw < num_blocks)
        bad_val = tl.maximum(bad_val, tl.max(tl.where(ok | (offs_n >= end), -2147483648, raw), axis=0))
        page = tl.where(ok, raw, 0).to(tl.int64)
        slot = (offs_n % PAGE_SIZE).to(tl.int64)
        # Keys as [D/X, BLOCK_N, X]: a block's 16-byte vectors of one chunk are adjacent in memory, so consecutive
        # threads read consecutive addresses; then viewed back as [BLOCK_N, D].
        k_off = page * stride_kp + slot * KX + g64 * stride_kh
        offs_c = tl.arange(0, BLOCK_D // KX)
        offs_x = tl.arange(0, KX)
        d3 = offs_c[:, None, None] * KX + offs_x[None, None, :]
        b_k3 = tl.load(
            k_ptr + k_off[None, :, None] + (offs_c[:, None, None] * (PAGE_SIZE * KX) + offs_x[None, None, :]),
            mask=mask_n[None, :, None] & (d3 < HEAD_DIM),
            other=0.0,
        )
        b_k = tl.reshape(tl.permute(b_k3, (1, 0, 2)), (BLOCK_N, BLOCK_D))
    if INTERPRET:
        b_k = b_k.to(tl.float32)
    s = tl.dot(b_q_c, tl.trans(b_k.to(COMPUTE_DTYPE)), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
    s = s * (qk_scale * 1.4426950408889634)
    if ALIBI:
        s += slope[:, None] * (offs_n.to(tl.float32)[None, :] - pos0)
    if MASKED:
        s = tl.where(mask_n[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if not MASKED:
        offs_vs = tl.arange(0, PAGE_SIZE)
        v_base = pg * stride_vp + g64 * stride_vh
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
        v_off = page * stride_vp + slot + g64 * stride_vh
        # Slots of one block are contiguous in vLLM's value layout: runs of PAGE_SIZE along the keys.
        v_off = tl.max_contiguous(tl.multiple_of(v_off, PAGE_SIZE), PAGE_SIZE)
        b_v = tl.load(
            v_ptr + v_off[:, None] + (offs_d * PAGE_SIZE)[None, :], mask=mask_n[:, None] & mask_d[None, :], other=0.0
        )
    if INTERPRET:
        b_v = b_v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE_DTYPE), b_v.to(COMPUTE_DTYPE), input_precision=DOT_PRECISION)
    return m_new, l_i, acc, bad_val


@triton.jit
def _reduce_partitions(
    o_ptr, es_ptr, ml_ptr, tmp_ptr, seq_len, num_parts, req64, g, stride_ob, stride_oh, stride_eb, stride_eh,
    stride_tb, stride_th, stride_tp,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    MERGE_BLOCK_K: tl.constexpr, PART_SIZE: tl.constexpr,
):  # fmt: skip
    """v2's reduction for the GROUP heads of KV head ``g`` of one sequence: ``out = sum_p tmp_out_p w_p / sum_p w_p``,
    ``w_p = exp_sums_p * exp(max_logits_p - max)``, over the partitions the sequence covers (at most ``num_parts``).

    The GROUP x D outputs are ``[ROWS, 4]`` tiles: a row is 4 consecutive columns of one head, so a thread holding a
    row loads a partition's max_logits / exp_sums once and makes one weight for its 4 values, with no data from other
    threads. The maximum first, then final weights (independent exp2s, an add chain); MERGE_BLOCK_K partitions
    unrolled per step."""
    VEC: tl.constexpr = 4
    ROWS: tl.constexpr = GROUP_P2 * BLOCK_D // VEC
    offs_row = tl.arange(0, ROWS)
    r_h = offs_row // (BLOCK_D // VEC)  # [ROWS] head within the group
    cols = ((offs_row % (BLOCK_D // VEC)) * VEC)[:, None] + tl.arange(0, VEC)[None, :]  # [ROWS, VEC]
    mask_h = (r_h < GROUP)[:, None]  # [ROWS, 1]
    mask_c = mask_h & (cols < HEAD_DIM)
    n_parts = tl.minimum((seq_len + PART_SIZE - 1) // PART_SIZE, num_parts)
    h0 = (g * GROUP).to(tl.int64)
    t_base = tmp_ptr + req64 * stride_tb + h0 * stride_th
    t_off = (r_h * stride_th)[:, None] + cols  # [ROWS, VEC]
    ml_base = ml_ptr + req64 * stride_eb + h0 * stride_eh
    es_base = es_ptr + req64 * stride_eb + h0 * stride_eh
    e_off = (r_h * stride_eh)[:, None]  # [ROWS, 1]
    m = tl.full([ROWS, 1], float("-inf"), dtype=tl.float32)
    den = tl.zeros([ROWS, 1], dtype=tl.float32)
    acc = tl.zeros([ROWS, VEC], dtype=tl.float32)
    # The states were just written by other programs: read through L2 (.cg).
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
            # An empty partition (max_logits -inf) weighs 0; its tmp_out was written as 0.
            wgt = tl.where(ml > float("-inf"), es * tl.exp2((ml - m_ref) * 1.4426950408889634), 0.0)
            acc += wgt * t.to(tl.float32)
            den += wgt
    out = acc / tl.where(den > 0, den, 1.0)
    o_base = o_ptr + req64 * stride_ob + h0 * stride_oh
    tl.store(o_base + ((r_h * stride_oh)[:, None] + cols), out.to(o_ptr.dtype.element_ty), mask=mask_c)


@triton.jit
def _vllm_decode_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, tmp_ptr, part_lse_ptr, es_ptr, ml_ptr, bt_ptr, seq_lens_ptr, alibi_ptr, k_scale_ptr,
    v_scale_ptr, counter_ptr, err_ptr,
    stride_qb, stride_qh, stride_kp, stride_kh, stride_vp, stride_vh, stride_ob, stride_oh, stride_bt, stride_tb,
    stride_th, stride_tp, stride_eb, stride_eh,
    num_blocks, max_blocks, num_parts, v1_chunk, qk_scale, v_scale,
    NUM_QO_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, KX: tl.constexpr,
    PART_SIZE: tl.constexpr, SPLIT: tl.constexpr, ALIBI: tl.constexpr, SCALE_PTRS: tl.constexpr,
    MERGE_BLOCK_K: tl.constexpr, COMPUTE_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """One (work item, KV head) of vLLM's paged attention (see the module docstring)."""
    w = tl.program_id(0)
    g = tl.program_id(1)
    req = w // num_parts
    part = w % num_parts
    raw_len = tl.load(seq_lens_ptr + req)
    # Never past the block table: a longer length is an error (code 2), the keys it covers are read.
    cap = max_blocks * PAGE_SIZE
    seq_len = tl.minimum(tl.maximum(raw_len, 0), cap)
    len_err = tl.where((raw_len < 0) | (raw_len > cap), 2, 0)
    first = 0
    count = 1
    valid = w >= 0
    if PART_SIZE > 0:
        # v2: the grid covers num_parts partitions; a longer sequence would lose keys (code 3).
        len_err = tl.where((len_err == 0) & (raw_len > num_parts * PART_SIZE), 3, len_err)
        start = part * PART_SIZE
        end = tl.maximum(tl.minimum(start + PART_SIZE, seq_len), start)
        split = 1
    elif SPLIT:
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
    if SCALE_PTRS:
        qk_scale = qk_scale * tl.load(k_scale_ptr).to(tl.float32)
        v_scale = v_scale * tl.load(v_scale_ptr).to(tl.float32)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < GROUP
    mask_d = offs_d < HEAD_DIM
    mask_md = mask_m[:, None] & mask_d[None, :]
    heads = g * GROUP + offs_m
    req64 = req.to(tl.int64)
    g64 = g.to(tl.int64)
    q_row = q_ptr + req64 * stride_qb + heads[:, None].to(tl.int64) * stride_qh
    b_q = tl.load(q_row + offs_d[None, :], mask=mask_md & valid, other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_D]
    b_q_c = b_q.to(COMPUTE_DTYPE)
    slope = 0.0
    pos0 = 0.0
    if ALIBI:
        slope = tl.load(alibi_ptr + heads, mask=mask_m, other=0.0) * 1.4426950408889634  # [BLOCK_M]
        pos0 = (seq_len - 1).to(tl.float32)  # vLLM's ALiBi position: j - seq_len + 1

    seq_base = req64 * stride_bt  # this sequence's row of block_tables
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bad_val = tl.full([], -2147483648, dtype=tl.int32)
    # Whole key tiles first, without any key mask (both loads stay 16-byte vectors: the value rows are contiguous
    # along the keys, where a per-key mask would split them into scalars), then the partial last tile with masks
    # (its unwritten slots may hold NaN: masked loads read zeros).
    end_full = start + ((end - start) // BLOCK_N) * BLOCK_N
    for n0 in range(start, end_full, BLOCK_N):
        m_i, l_i, acc, bad_val = _attend_tile(
            n0, end, m_i, l_i, acc, bad_val, b_q_c, bt_ptr, seq_base, k_ptr, v_ptr, stride_kp, stride_kh, stride_vp,
            stride_vh, g64, offs_d, mask_d, slope, pos0, qk_scale, num_blocks, HEAD_DIM, BLOCK_D, BLOCK_N, PAGE_SIZE,
            KX, ALIBI, COMPUTE_DTYPE, DOT_PRECISION, INTERPRET, False,
        )  # fmt: skip
    if end_full < end:
        m_i, l_i, acc, bad_val = _attend_tile(
            end_full, end, m_i, l_i, acc, bad_val, b_q_c, bt_ptr, seq_base, k_ptr, v_ptr, stride_kp, stride_kh,
            stride_vp, stride_vh, g64, offs_d, mask_d, slope, pos0, qk_scale, num_blocks, HEAD_DIM, BLOCK_D, BLOCK_N,
            PAGE_SIZE, KX, ALIBI, COMPUTE_DTYPE, DOT_PRECISION, INTERPRET, True,
        )  # fmt: skip

    has_key = l_i > 0
    o = acc / tl.where(has_key, l_i, 1.0)[:, None] * v_scale
    lse = tl.where(has_key, m_i + tl.log2(tl.where(has_key, l_i, 1.0)), float("-inf"))
    bad = (bad_val != -2147483648) | (len_err != 0)
    if bad:
        # The work this program did rests on a bad index: its results are NaN, the error is recorded.
        o = tl.full([BLOCK_M, BLOCK_D], float("nan"), dtype=tl.float32)
        _record_error(err_ptr, tl.where(len_err != 0, len_err, 1), req, tl.where(len_err != 0, raw_len, bad_val))
    direct = valid & (split == 0)
    o_ptrs = o_ptr + req64 * stride_ob + heads[:, None].to(tl.int64) * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=mask_md & direct)
    if PART_SIZE > 0:
        # vLLM's v2 partition state: tmp_out [B, Hq, P, D], exp_sums / max_logits [B, Hq, P].
        h64 = heads.to(tl.int64)
        part64 = part.to(tl.int64)
        t_ptrs = tmp_ptr + req64 * stride_tb + h64[:, None] * stride_th + part64 * stride_tp + offs_d[None, :]
        tl.store(t_ptrs, o.to(tmp_ptr.dtype.element_ty), mask=mask_md)
        e_off = req64 * stride_eb + h64 * stride_eh + part64
        tl.store(es_ptr + e_off, l_i, mask=mask_m)
        tl.store(ml_ptr + e_off, tl.where(has_key, m_i * 0.6931471805599453, float("-inf")), mask=mask_m)
        # The reduction in the same launch: the last of the sequence's num_parts programs (every partition of the
        # grid writes its state, empty ones included, before its program counts itself) reduces them into out.
        tl.debug_barrier()
        c_ptr = counter_ptr + req64 * tl.num_programs(1) + g64
        done = tl.atomic_add(c_ptr, 1, sem="acq_rel", scope="gpu")
        if done == num_parts - 1:
            tl.atomic_xchg(c_ptr, 0, sem="relaxed", scope="gpu")  # ready for the next launch
            _reduce_partitions(
                o_ptr, es_ptr, ml_ptr, tmp_ptr, seq_len, num_parts, req64, g, stride_ob, stride_oh, stride_eb,
                stride_eh, stride_tb, stride_th, stride_tp, GROUP, GROUP_P2, HEAD_DIM, BLOCK_D, MERGE_BLOCK_K,
                PART_SIZE,
            )  # fmt: skip
    if SPLIT:
        partial = valid & (split != 0)
        part_row = w.to(tl.int64) * NUM_QO_HEADS + heads.to(tl.int64)  # [BLOCK_M]
        tl.store(tmp_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=mask_md & partial)
        tl.store(part_lse_ptr + part_row, lse, mask=mask_m & partial)
        if partial:
            # Count this (sequence, KV head)'s finished chunks; the last one to finish merges them all.
            # Barrier: every thread's partial stores precede the (gpu-scope, acq_rel) increment.
            tl.debug_barrier()
            c_ptr = counter_ptr + req64 * tl.num_programs(1) + g64
            done = tl.atomic_add(c_ptr, 1, sem="acq_rel", scope="gpu")
            if done == count - 1:
                tl.atomic_xchg(c_ptr, 0, sem="relaxed", scope="gpu")  # ready for the next launch
                merge_group(
                    tmp_ptr, part_lse_ptr, o_ptr, part_lse_ptr, first, count, req64, g, stride_ob, stride_oh, 0, 0,
                    NUM_QO_HEADS, GROUP, GROUP_P2, HEAD_DIM, BLOCK_D, MERGE_BLOCK_K, False,
                )  # fmt: skip
