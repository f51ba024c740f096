"""Paged KV caches for tests and benchmarks: one builder of page tables and caches for both.

``page_table`` lays requests of given lengths over shuffled pages (FlashInfer's CSR form: ``indptr``,
``indices``, ``last_page_len``); ``paged_caches`` fills random caches to rotate past L2; ``make_paged`` writes
random per-request K/V into a cache of any accepted form and returns the dense copies a reference needs.
Built with plain torch indexing, independently of the library's kernels.
"""

from __future__ import annotations

import torch


def page_table(kv_lens, page_size: int, *, spare_pages: int = 0, seed: int | None = 0, device="cpu"):
    """A shuffled CSR page table for requests of ``kv_lens`` keys: ``(indptr, indices, last_page_len,
    num_pages)``, int32 on ``device``; ``num_pages`` counts ``spare_pages`` never referenced. A request with no
    keys has no pages and ``last_page_len`` 0. The same seed gives the same table on every machine;
    ``seed=None`` draws the order from torch's global generator (tests seed it per test)."""
    pages = [-(-int(n) // page_size) for n in kv_lens]
    indptr = [0]
    for p in pages:
        indptr.append(indptr[-1] + p)
    num_pages = indptr[-1] + spare_pages
    gen = None if seed is None else torch.Generator(device="cpu").manual_seed(seed)
    indices = torch.randperm(num_pages, generator=gen)[: indptr[-1]].to(torch.int32)
    last = [(int(n) - 1) % page_size + 1 if n else 0 for n in kv_lens]
    i32 = dict(dtype=torch.int32, device=device)
    return torch.tensor(indptr, **i32), indices.to(device), torch.tensor(last, **i32), num_pages


def paged_caches(num_pages: int, page_size: int, kv_heads: int, head_dim: int, dtype, device, *, count: int = 1):
    """``count`` random ``(k, v)`` NHD caches ``[num_pages, page_size, kv_heads, head_dim]`` (benchmarks rotate
    them past L2); fp8 values are drawn in float32 and cast."""
    shape = (num_pages, page_size, kv_heads, head_dim)
    return [
        (torch.randn(shape, device=device).to(dtype), torch.randn(shape, device=device).to(dtype)) for _ in range(count)
    ]


def make_paged(kv_lens, page_size, num_kv_heads, head_dim, dtype, device, layout="NHD", form="5d", spare_pages=2):
    """A paged cache holding random per-request K/V; pages assigned in shuffled order (``page_table`` with
    torch's global generator).

    Returns (cache, indptr, indices, last_page_len, ks, vs) with ks[b], vs[b] the dense NHD K/V of request b.
    form: "5d" (one tensor), "tuple" (a (k, v) pair of 4-D tensors), "3d" (a pair of [slots, H, D], page size 1,
    the same in both layouts).
    """
    indptr, indices, last, total_pages = page_table(kv_lens, page_size, spare_pages=spare_pages, seed=None)
    (k_pages, v_pages) = paged_caches(total_pages, page_size, num_kv_heads, head_dim, dtype, device)[0]
    ks, vs = [], []
    for b, n in enumerate(kv_lens):
        pages = indices[int(indptr[b]) : int(indptr[b + 1])].long().to(device)
        ks.append(k_pages[pages].reshape(-1, num_kv_heads, head_dim)[:n])
        vs.append(v_pages[pages].reshape(-1, num_kv_heads, head_dim)[:n])
    if form == "3d":
        if page_size != 1:
            raise ValueError(f"page_size: form '3d' holds one key per slot, got page_size {page_size}")
        cache = (k_pages[:, 0], v_pages[:, 0])  # [slots, H, D] whatever the layout
    else:
        kc, vc = k_pages, v_pages
        if layout == "HND":
            kc, vc = kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
        cache = torch.stack([kc, vc], dim=1) if form == "5d" else (kc, vc)
    return cache, indptr.to(device), indices.to(device), last.to(device), ks, vs
