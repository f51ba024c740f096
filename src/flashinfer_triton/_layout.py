"""KV layouts reduced to one shape: 4-D views ``[num_pages, page_size, num_kv_heads, head_dim]``.

NHD and HND, the 5-D cache, the ``(k, v)`` tuple and the 3-D page-size-1 pair differ only in strides;
kernels read any strides with a contiguous last dimension, so no copy is ever made here.
"""

from __future__ import annotations

import torch

from ._checks import check_last_dim_contiguous, check_tensor, shape_str, type_error, value_error


def paged_kv_views(paged_kv_cache, kv_layout: str, name: str = "paged_kv_cache"):
    """``(k, v)`` 4-D NHD-ordered views of a paged cache in any of FlashInfer's forms."""
    if isinstance(paged_kv_cache, (tuple, list)):
        if len(paged_kv_cache) != 2:
            raise value_error(name, "a (k_cache, v_cache) pair", f"a sequence of {len(paged_kv_cache)}")
        k, v = paged_kv_cache
        check_tensor(f"{name}[0]", k)
        check_tensor(f"{name}[1]", v)
        if k.shape != v.shape:
            raise value_error(f"{name}[1]", f"the shape of {name}[0] {shape_str(k.shape)}", shape_str(v.shape))
        if k.dtype != v.dtype:
            raise type_error(f"{name}[1]", f"the dtype of {name}[0] ({k.dtype})", str(v.dtype))
        if k.device != v.device:
            raise value_error(f"{name}[1]", f"a tensor on {k.device}", f"one on {v.device}")
        if k.dim() == 3:  # [slots, H, D] in either layout (as FlashInfer): page size 1
            k, v = k.unsqueeze(1), v.unsqueeze(1)
        elif k.dim() == 4:
            if kv_layout == "HND":
                k, v = k.transpose(1, 2), v.transpose(1, 2)
        else:
            raise value_error(f"{name}[0]", "a 4-D [num_pages, ...] or 3-D [slots, ...] tensor", shape_str(k.shape))
    else:
        check_tensor(name, paged_kv_cache)
        if paged_kv_cache.dim() != 5 or paged_kv_cache.shape[1] != 2:
            raise value_error(
                name,
                "a 5-D tensor [num_pages, 2, page_size, num_kv_heads, head_dim] (NHD) or "
                "[num_pages, 2, num_kv_heads, page_size, head_dim] (HND), or a (k, v) tuple",
                f"shape {shape_str(paged_kv_cache.shape)}",
            )
        k, v = paged_kv_cache[:, 0], paged_kv_cache[:, 1]
        if kv_layout == "HND":
            k, v = k.transpose(1, 2), v.transpose(1, 2)
    check_last_dim_contiguous(name, k)
    check_last_dim_contiguous(name, v)
    return k, v


def ragged_kv_view(x: torch.Tensor, kv_layout: str, name: str) -> torch.Tensor:
    """``[kv_len, 1, H, D]`` view of a single-request or ragged K/V (NHD ``[L, H, D]`` / HND ``[H, L, D]``)."""
    check_tensor(name, x, dim=3)
    check_last_dim_contiguous(name, x)
    nhd = x if kv_layout == "NHD" else x.transpose(0, 1)
    return nhd.unsqueeze(1)
