"""Device implementations of the page helpers (Triton kernels in ``kernels/page.py``).

The public module (``page.py``) validates the arguments and calls these functions when the tensors are on
CUDA, or on the CPU under ``TRITON_INTERPRET=1``. Nothing here synchronizes with the host.

* ``append_paged_kv_cache``: one program per (appended token, block of heads); when the cache has the
  dtype of the appended rows the kernel loads and stores the elements untouched (a bit-exact copy);
  otherwise (fp8 caches fed fp16/bf16 rows) it widens to float32 and rounds once (to nearest even) on
  store. Under the interpreter (CPU tensors) torch casts the rows first, because the interpreter's
  float32 -> fp8 conversion drops the carry into the exponent.
* ``get_batch_indices_positions`` / ``get_seq_lens``: one launch each, no host reads.
"""

from __future__ import annotations

import functools

import torch
import triton

from . import _config
from ._errors import error_flag
from ._launch import FastKernel
from ._launch import bind as _bind
from .kernels._segments import segment_steps
from .kernels.page import _append_paged_kv_kernel as _append_paged_kv_jit
from .kernels.page import _batch_indices_positions_kernel, _seq_lens_kernel

_append_paged_kv_kernel = FastKernel(_append_paged_kv_jit)

# append_paged_kv_cache passes every argument positionally (host time per launch): this parameter order.
_APPEND_PARAMS = ["key_ptr", "value_ptr", "batch_indices_ptr", "positions_ptr", "k_cache_ptr", "v_cache_ptr",
                  "kv_indices_ptr", "kv_indptr_ptr", "err_ptr", "batch_size", "num_indices", "num_pages", "page_size",
                  "num_heads", "head_dim", "stride_key_t",
                  "stride_key_h", "stride_value_t", "stride_value_h", "stride_kc_p", "stride_kc_s", "stride_kc_h",
                  "stride_vc_p", "stride_vc_s", "stride_vc_h", "BLOCK_H", "BLOCK_D", "CAST"]  # fmt: skip
if _append_paged_kv_kernel.arg_names != _APPEND_PARAMS:
    raise RuntimeError("_append_paged_kv_kernel's parameters changed: update the positional launch in _page_impl")

__all__ = [
    "append_paged_kv_cache",
    "get_batch_indices_positions",
    "get_seq_lens",
]


@functools.cache
def _append_config(num_heads: int, head_dim: int, tile: int) -> tuple[int, int, int, int]:
    """``(BLOCK_H, BLOCK_D, num_warps, head blocks)``: one program moves about ``tile`` elements."""
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_heads), max(1, tile // block_d))
    num_warps = 4 if block_h * block_d >= 1024 else 2
    return block_h, block_d, num_warps, triton.cdiv(num_heads, block_h)


def append_paged_kv_cache(
    append_key: torch.Tensor,
    append_value: torch.Tensor,
    batch_indices: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    bind: list | None = None,
) -> None:
    """Write token ``t`` into page ``kv_indices[kv_indptr[b] + p // page_size]``, slot ``p % page_size``.

    ``append_key``/``append_value``: ``[nnz, num_kv_heads, head_dim]`` (last dim contiguous);
    ``batch_indices``/``positions``: integer ``[nnz]``; ``k_cache``/``v_cache``: 4-D views
    ``[num_pages, page_size, num_kv_heads, head_dim]`` with any strides (last dim contiguous).
    Only the addressed slots are written; values are cast to the cache dtype on store. ``bind``: a list that
    receives the launch bound to everything but the eight tensors above, in that order (``_launch.bind``), for
    later calls whose tensors have the same shapes, strides and dtypes.
    """
    nnz, num_heads, head_dim = append_key.shape
    if nnz == 0:
        return
    page_size = k_cache.shape[1]
    cast = append_key.dtype != k_cache.dtype or append_value.dtype != v_cache.dtype
    if cast and k_cache.device.type == "cpu":
        # Triton's interpreter mis-rounds float32 -> fp8 when rounding carries into the exponent
        # (7.9 -> 4 instead of 8): on the CPU the rows are cast by torch first, then copied as bits.
        append_key, append_value = append_key.to(k_cache.dtype), append_value.to(v_cache.dtype)
        cast = False
    block_h, block_d, num_warps, head_blocks = _append_config(num_heads, head_dim, _config.PAGE.append_tile)
    args = (
        append_key,
        append_value,
        batch_indices,
        positions,
        k_cache,
        v_cache,
        kv_indices,
        kv_indptr,
        error_flag(k_cache.device),
        kv_indptr.shape[0] - 1,
        kv_indices.shape[0],
        k_cache.shape[0],
        page_size,
        num_heads,
        head_dim,
        append_key.stride(0),
        append_key.stride(1),
        append_value.stride(0),
        append_value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_h,  # BLOCK_H
        block_d,  # BLOCK_D
        cast,  # CAST
    )
    grid = (nnz, head_blocks)
    kernel = _append_paged_kv_kernel.run(*args, grid=grid, warmup=False, num_warps=num_warps)
    if bind is not None:
        bound = _bind(_append_paged_kv_kernel, kernel, args, grid, 8)
        if bound is not None:
            bind.append(bound)


def get_batch_indices_positions(
    append_indptr: torch.Tensor, seq_lens: torch.Tensor, nnz: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(batch_indices, positions)``, int32 ``[nnz]`` on ``append_indptr``'s device.

    Token ``t`` of request ``b`` (``append_indptr[b] <= t < append_indptr[b+1]``) sits at position
    ``seq_lens[b] - (append_indptr[b+1] - append_indptr[b]) + (t - append_indptr[b])``. Rows past
    ``append_indptr[-1]`` (when ``nnz`` is larger) get batch index -1 and position 0, as in FlashInfer.
    """
    device = append_indptr.device
    batch_size = append_indptr.shape[0] - 1
    batch_indices = torch.empty(nnz, dtype=torch.int32, device=device)
    positions = torch.empty(nnz, dtype=torch.int32, device=device)
    if nnz == 0:
        return batch_indices, positions
    if batch_size <= 0:
        return batch_indices.fill_(-1), positions.zero_()
    if seq_lens.device != device:
        seq_lens = seq_lens.to(device, non_blocking=True)
    grid = (triton.cdiv(nnz, _config.PAGE.index_block),)
    _batch_indices_positions_kernel[grid](
        append_indptr,
        seq_lens,
        batch_indices,
        positions,
        batch_size,
        nnz,
        segment_steps(batch_size),
        BLOCK=_config.PAGE.index_block,
        num_warps=4,
    )
    return batch_indices, positions


def get_seq_lens(kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, page_size: int) -> torch.Tensor:
    """KV length of each request, int32 ``[batch_size]`` on ``kv_indptr``'s device (0 without pages)."""
    device = kv_indptr.device
    batch_size = kv_indptr.shape[0] - 1
    seq_lens = torch.empty(max(batch_size, 0), dtype=torch.int32, device=device)
    if batch_size <= 0:
        return seq_lens
    if kv_last_page_len.device != device:
        kv_last_page_len = kv_last_page_len.to(device, non_blocking=True)
    block = _config.PAGE.index_block
    _seq_lens_kernel[(triton.cdiv(batch_size, block),)](
        kv_indptr, kv_last_page_len, seq_lens, batch_size, int(page_size), BLOCK=block
    )
    return seq_lens
