"""The work list of a CUDA-graph decode plan, built on the device from the staged key counts.

Request ``r`` of ``len_r`` keys sees keys ``[start_r, len_r)`` (``start_r = max(len_r - 1 - window_left, 0)``
under a sliding window, else 0), ``eff_r = len_r - start_r`` of them. With a split chunk ``C`` (0: no split) it
is cut into ``c_r = max(ceil(eff_r / C), 1)`` items (1 without a split), each of ``size_r`` keys:

    size_r = min(ceil(ceil(eff_r / c_r) / ALIGN) * ALIGN, C)     (ALIGN > 0: the chunks evened out)
    size_r = C                                                  (ALIGN = 0: exact chunks)

Item ``j`` of request ``r`` is work slot ``w = sum_{q < r} c_q + j``: (``r``, ``start_r + j * size_r``, its end,
``c_r > 1``), where the end is ``start_r + (j + 1) * size_r`` except for the request's last item, which ends at
``len_r`` (``c_r * size_r >= eff_r``). This is the host planner's rule (``_decode_impl._work_host``), value for
value; the array's layout is that of ``_work_host``: four rows of ``work_cap`` entries (request, start, end,
split flag; zero past the live items), then ``work_indptr [batch_cap + 1]`` (each request's first item, the live
count for the rows past the batch) and the live count.

The same launch refills the caller's buffers from the staged arrays (``indptr``, ``last_page_len``) and copies
the first ``n_copy`` page indices into the caller's indices buffer: programs ``1 ..`` copy ``BLOCK_C`` indices
each while program 0 writes the work list, so a plan makes one launch where it made a launch and a copy call.
"""

from __future__ import annotations

import triton
import triton.language as tl


# ``n_copy`` and ``chunk`` change with every plan (with the page indices' address) while the other arguments are
# fixed with the plan's layout: not specialized (a value of 1 or off a multiple of 16 would compile another kernel),
# so one bound launch serves every plan.
@triton.jit(do_not_specialize=["n_copy", "chunk"])
def _decode_work_kernel(
    idx_src_ptr,
    n_copy,
    chunk,
    idx_dst_ptr,
    kv_lens_ptr,
    work_ptr,
    stage_ip_ptr,
    stage_lp_ptr,
    buf_ip_ptr,
    buf_lp_ptr,
    n,
    work_cap,
    batch_cap,
    window_left,
    ALIGN: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Program 0: the work rows, work_indptr and live count of ``n`` requests and the refilled indptr /
    last_page_len buffers; programs 1 ..: ``BLOCK_C`` page indices each (see the module docstring)."""
    pid = tl.program_id(0)
    if pid > 0:
        offs_c = (pid - 1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask_c = offs_c < n_copy
        tl.store(idx_dst_ptr + offs_c, tl.load(idx_src_ptr + offs_c, mask=mask_c), mask=mask_c)
    else:
        offs_b = tl.arange(0, BLOCK_B)
        mask_b = offs_b < n
        b_len = tl.load(kv_lens_ptr + offs_b, mask=mask_b, other=0).to(tl.int64)  # [BLOCK_B]
        b_start = tl.where(window_left >= 0, tl.maximum(b_len - 1 - window_left, 0), 0)
        b_eff = b_len - b_start
        chunk64 = chunk.to(tl.int64)
        # chunks per request: at least one item (also for no visible keys), one without a split
        b_cnt = tl.where(chunk64 > 0, (b_eff + chunk64 - 1) // tl.maximum(chunk64, 1), 1)
        b_cnt = tl.where(mask_b, tl.maximum(b_cnt, 1), 0)
        if ALIGN > 0:
            b_even = (b_eff + b_cnt - 1) // tl.maximum(b_cnt, 1)
            b_size = tl.minimum((b_even + ALIGN - 1) // ALIGN * ALIGN, chunk64)
        else:
            b_size = chunk64
        # each request's first slot; past the batch the inclusive sum stays at the live count
        b_incl = tl.cumsum(b_cnt, 0)
        b_first = b_incl - b_cnt
        num_work = tl.sum(b_cnt, 0)
        b_flag = (b_cnt > 1).to(tl.int32)
        for j in range(0, tl.max(b_cnt, 0)):
            mask_j = j < b_cnt
            offs_w = b_first + j
            b_s = b_start + j * b_size
            b_e = tl.where(j == b_cnt - 1, b_len, b_s + b_size)
            tl.store(work_ptr + offs_w, offs_b, mask=mask_j)
            tl.store(work_ptr + work_cap + offs_w, b_s.to(tl.int32), mask=mask_j)
            tl.store(work_ptr + 2 * work_cap + offs_w, b_e.to(tl.int32), mask=mask_j)
            tl.store(work_ptr + 3 * work_cap + offs_w, b_flag, mask=mask_j)
        # zeros in the slots past the live items (the items' own slots are disjoint: no ordering between the stores)
        for w0 in range(0, work_cap, BLOCK_W):
            offs_z = w0 + tl.arange(0, BLOCK_W)
            mask_z = (offs_z >= num_work) & (offs_z < work_cap)
            zero = tl.zeros([BLOCK_W], dtype=tl.int32)
            tl.store(work_ptr + offs_z, zero, mask=mask_z)
            tl.store(work_ptr + work_cap + offs_z, zero, mask=mask_z)
            tl.store(work_ptr + 2 * work_cap + offs_z, zero, mask=mask_z)
            tl.store(work_ptr + 3 * work_cap + offs_z, zero, mask=mask_z)
        # work_indptr[0] = 0, work_indptr[r + 1] = the inclusive sum (the live count past the batch), then the count
        ind_ptr = work_ptr + 4 * work_cap
        tl.store(ind_ptr, 0)
        tl.store(ind_ptr + 1 + offs_b, b_incl.to(tl.int32), mask=offs_b <= batch_cap)
        # the caller's buffers: indptr [n + 1] and last_page_len [n] as staged
        mask_ip = offs_b <= n
        tl.store(buf_ip_ptr + offs_b, tl.load(stage_ip_ptr + offs_b, mask=mask_ip), mask=mask_ip)
        tl.store(buf_lp_ptr + offs_b, tl.load(stage_lp_ptr + offs_b, mask=mask_b), mask=mask_b)
