"""Paged KV-cache bookkeeping on the device: appends, per-token coordinates and sequence lengths.

* append: token ``t`` of request ``b = batch_indices[t]`` at position ``p = positions[t]`` lands in
  page ``kv_indices[kv_indptr[b] + p // page_size]``, slot ``p % page_size``; nothing else is written.
  The caches are 4-D views ``[num_pages, page_size, num_kv_heads, head_dim]`` with any strides, so NHD,
  HND, 5-D and tuple caches differ only in the strides they pass. Checking the indices on the host would
  cost a sync, so the kernel checks them: a batch index outside ``[0, batch_size)``, a position outside its
  request's pages (or past ``kv_indices``) or a page outside ``[0, num_pages)`` reads and writes nothing
  out of bounds, skips that token and records a device-side error (``_errors.py``, codes 6, 7, 8).
* batch indices / positions: the ragged append ``append_indptr`` (CSR) is turned into COO form. Each
  token finds its request by a branch-free binary search over the indptr (largest ``b`` with
  ``indptr[b] <= t``, ``_segments.py``), so one launch covers every token whatever the spread of lengths.
* sequence lengths: ``(num_pages - 1) * page_size + last_page_len``, 0 for a request without pages.
"""

import triton
import triton.language as tl

from ._segments import segment_of


# The extents are only compared against: one compiled variant whatever their values (an engine's batch size and
# page-table length change every step).
@triton.jit(do_not_specialize=["batch_size", "num_indices", "num_pages"])
def _append_paged_kv_kernel(
    key_ptr,
    value_ptr,
    batch_indices_ptr,
    positions_ptr,
    k_cache_ptr,
    v_cache_ptr,
    kv_indices_ptr,
    kv_indptr_ptr,
    err_ptr,
    batch_size,
    num_indices,
    num_pages,
    page_size,
    num_heads,
    head_dim,
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_kc_p,
    stride_kc_s,
    stride_kc_h,
    stride_vc_p,
    stride_vc_s,
    stride_vc_h,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAST: tl.constexpr,
):
    """Copy one appended token's K and V rows (a block of heads) into their page slot.

    The source rows do not depend on the page lookup, so they are loaded first: their memory latency
    overlaps the dependent chain batch index -> ``kv_indptr[b]`` -> ``kv_indices[...]`` (three round trips
    to memory, the whole cost of a small append when the caches are cold)."""
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_hd = (offs_h[:, None] < num_heads) & (offs_d[None, :] < head_dim)
    offs_h64 = offs_h.to(tl.int64)
    t64 = pid_t.to(tl.int64)
    src_k = key_ptr + t64 * stride_key_t + offs_h64[:, None] * stride_key_h + offs_d[None, :]
    src_v = value_ptr + t64 * stride_value_t + offs_h64[:, None] * stride_value_h + offs_d[None, :]
    b_k = tl.load(src_k, mask=mask_hd)  # [BLOCK_H, BLOCK_D]
    b_v = tl.load(src_v, mask=mask_hd)  # [BLOCK_H, BLOCK_D]

    b = tl.load(batch_indices_ptr + pid_t).to(tl.int64)
    pos = tl.load(positions_ptr + pid_t).to(tl.int64)
    # Every index is checked before it addresses memory; a bad one stops the chain at that step.
    b_ok = (b >= 0) & (b < batch_size)
    b_safe = tl.where(b_ok, b, 0)
    page_start = tl.load(kv_indptr_ptr + b_safe).to(tl.int64)
    page_end = tl.load(kv_indptr_ptr + b_safe + 1).to(tl.int64)
    idx = page_start + tl.where(pos >= 0, pos, 0) // page_size
    pos_ok = b_ok & (pos >= 0) & (idx < page_end) & (idx >= 0) & (idx < num_indices)
    page = tl.load(kv_indices_ptr + tl.where(pos_ok, idx, 0)).to(tl.int64)
    page_ok = pos_ok & (page >= 0) & (page < num_pages)
    if (page_ok == 0) & (pid_h == 0):
        code = tl.where(b_ok, tl.where(pos_ok, 8, 7), 6)
        old = tl.atomic_cas(err_ptr, 0, code)
        if old == 0:
            tl.store(err_ptr + 1, pid_t)
            tl.store(err_ptr + 2, tl.where(b_ok, tl.where(pos_ok, page, pos), b).to(tl.int32))
    page = tl.where(page_ok, page, 0)
    mask_hd = mask_hd & page_ok
    slot = tl.where(page_ok, pos, 0) % page_size
    dst_k = k_cache_ptr + page * stride_kc_p + slot * stride_kc_s + offs_h64[:, None] * stride_kc_h + offs_d[None, :]
    dst_v = v_cache_ptr + page * stride_vc_p + slot * stride_vc_s + offs_h64[:, None] * stride_vc_h + offs_d[None, :]

    if CAST:
        # Widen first: the interpreter converts only from float32, and it rounds once on every path.
        b_k = b_k.to(tl.float32).to(k_cache_ptr.dtype.element_ty)
        b_v = b_v.to(tl.float32).to(v_cache_ptr.dtype.element_ty)
    tl.store(dst_k, b_k, mask=mask_hd)
    tl.store(dst_v, b_v, mask=mask_hd)


@triton.jit
def _batch_indices_positions_kernel(
    append_indptr_ptr,
    seq_lens_ptr,
    batch_indices_ptr,
    positions_ptr,
    batch_size,
    nnz,
    num_steps,
    BLOCK: tl.constexpr,
):
    """For a block of appended tokens: the request each belongs to and its position in that request."""
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask_t = offs_t < nnz
    b = segment_of(append_indptr_ptr, offs_t, batch_size, num_steps)
    b_start = tl.load(append_indptr_ptr + b).to(tl.int64)
    b_end = tl.load(append_indptr_ptr + b + 1).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int64)
    pos = seq_len - (b_end - b_start) + (offs_t - b_start)
    # Rows past append_indptr[-1] (nnz larger than the appended tokens) get FlashInfer's -1 / 0.
    valid = offs_t < b_end
    tl.store(batch_indices_ptr + offs_t, tl.where(valid, b, -1).to(tl.int32), mask=mask_t)
    tl.store(positions_ptr + offs_t, tl.where(valid, pos, 0).to(tl.int32), mask=mask_t)


@triton.jit
def _seq_lens_kernel(kv_indptr_ptr, kv_last_page_len_ptr, seq_lens_ptr, batch_size, page_size, BLOCK: tl.constexpr):
    """KV length of a block of requests from their page counts and last-page lengths."""
    offs_b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask_b = offs_b < batch_size
    start = tl.load(kv_indptr_ptr + offs_b, mask=mask_b, other=0).to(tl.int64)
    end = tl.load(kv_indptr_ptr + offs_b + 1, mask=mask_b, other=0).to(tl.int64)
    last = tl.load(kv_last_page_len_ptr + offs_b, mask=mask_b, other=0).to(tl.int64)
    num_pages = end - start
    lens = tl.where(num_pages > 0, (num_pages - 1) * page_size + last, 0)
    tl.store(seq_lens_ptr + offs_b, lens.to(tl.int32), mask=mask_b)
