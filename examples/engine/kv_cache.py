"""The paged KV pool and its page allocator.

The pool holds, for every layer, one key tensor and one value tensor of shape
``[num_pages, page_size, num_kv_heads, head_dim]`` (FlashInfer's NHD layout, passed as a ``(k, v)``
tuple). With ``page_size == 1`` the attention wrappers get 3-D ``[slots, num_kv_heads, head_dim]`` views,
as mini-sglang passes them. Page 0 is never handed out: padded rows of a CUDA-graph batch write there.
"""

from __future__ import annotations

import torch


class PageAllocator:
    """Free list of page ids with reservations.

    A request reserves, when it is admitted, every page it can ever need (prompt plus
    ``max_new_tokens``), so a running request never finds the pool empty; pages are then taken from the
    reservation one at a time as the request grows, and given back when it finishes.
    """

    def __init__(self, num_pages: int, reserved_ids: int = 1):
        if num_pages <= reserved_ids:
            raise ValueError(f"num_pages: expected more than {reserved_ids}, got {num_pages}")
        self.num_pages = num_pages
        # Popped from the end: low ids first, which keeps small runs easy to read when debugging.
        self._free = list(range(num_pages - 1, reserved_ids - 1, -1))
        self._reserved = 0

    @property
    def num_free(self) -> int:
        """Pages neither in use nor reserved."""
        return len(self._free) - self._reserved

    def reserve(self, n: int) -> bool:
        """Reserve ``n`` pages; False (and nothing reserved) when too few are free."""
        if n < 0:
            raise ValueError(f"n: expected >= 0, got {n}")
        if n > self.num_free:
            return False
        self._reserved += n
        return True

    def unreserve(self, n: int) -> None:
        if n < 0 or n > self._reserved:
            raise ValueError(f"n: expected 0..{self._reserved}, got {n}")
        self._reserved -= n

    def alloc(self, n: int, reserved: bool = True) -> list[int]:
        """Take ``n`` pages (from the caller's reservation when ``reserved``)."""
        if reserved:
            if n > self._reserved:
                raise RuntimeError(f"alloc: {n} pages asked, only {self._reserved} reserved")
            self._reserved -= n
        elif n > self.num_free:
            raise RuntimeError(f"alloc: {n} pages asked, only {self.num_free} free")
        pages = self._free[len(self._free) - n :][::-1]
        del self._free[len(self._free) - n :]
        return pages

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


class KVPool:
    """Per-layer paged K and V tensors plus the allocator of their pages."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        if page_size < 1:
            raise ValueError(f"page_size: expected >= 1, got {page_size}")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)
        self.allocator = PageAllocator(num_pages)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` of one layer, ``[P, page_size, Hkv, D]`` each (for ``append_paged_kv_cache``)."""
        return self.k[layer], self.v[layer]

    def attention_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v)`` for the wrappers' ``run()``: 3-D ``[slots, Hkv, D]`` views when ``page_size == 1``."""
        k, v = self.k[layer], self.v[layer]
        if self.page_size == 1:
            return k.view(self.num_pages, self.num_kv_heads, self.head_dim), v.view(
                self.num_pages, self.num_kv_heads, self.head_dim
            )
        return k, v

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2
