"""Paged KV caches and the benchmark cases, for tests and benchmarks: one builder of page tables and caches, one
list of the shapes the benchmarks time (which a GPU test checks against the reference at the same shapes).

``page_table`` lays requests of given lengths over shuffled pages (FlashInfer's CSR form: ``indptr``,
``indices``, ``last_page_len``); ``paged_caches`` fills random caches to rotate past L2; ``make_paged`` writes
random per-request K/V into a cache of any accepted form and returns the dense copies a reference needs.
``DECODE_CASES``, ``PREFILL_CASES`` and ``CASCADE_CASES`` are the benchmark tables' rows; ``decode_inputs``,
``prefill_inputs`` and ``shared_prefix_inputs`` build the inputs of one row. Built with plain torch indexing,
independently of the library's kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

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


def block_table(
    kv_lens,
    block_size: int,
    *,
    max_blocks: int | None = None,
    spare_blocks: int = 0,
    fill: int | None = None,
    seed: int | None = 0,
    device="cpu",
):
    """vLLM's form of a shuffled page table: ``(table [batch, max_blocks] int32, num_blocks)``, row ``b`` starting
    with request ``b``'s blocks (``page_table``'s order). ``max_blocks`` defaults to the longest request's count.
    The entries past a request's blocks hold ``fill`` (a value a kernel must never read, e.g. -7) or, with
    ``fill=None``, further distinct blocks (every entry a real block, as flash-attn's and transformers' callers
    allocate). ``num_blocks`` counts ``spare_blocks`` never referenced."""
    pages = [-(-int(n) // block_size) for n in kv_lens]
    width = max(pages + [1]) if max_blocks is None else max_blocks
    if width < max(pages + [0]):
        raise ValueError(f"max_blocks: {width} is fewer than the longest request's {max(pages)} blocks")
    if fill is None:
        _, indices, _, num_blocks = page_table(
            [width * block_size] * len(pages), block_size, spare_pages=spare_blocks, seed=seed
        )
        return indices.reshape(len(pages), width).to(device), num_blocks
    indptr, indices, _, num_blocks = page_table(kv_lens, block_size, spare_pages=spare_blocks, seed=seed)
    table = torch.full((len(pages), width), fill, dtype=torch.int32)
    for b, p in enumerate(pages):
        table[b, :p] = indices[int(indptr[b]) : int(indptr[b + 1])]
    return table.to(device), num_blocks


def paged_caches(num_pages: int, page_size: int, kv_heads: int, head_dim: int, dtype, device, *, count: int = 1):
    """``count`` random ``(k, v)`` NHD caches ``[num_pages, page_size, kv_heads, head_dim]`` (benchmarks rotate
    them past L2); fp8 values are drawn in float32 and cast."""
    shape = (num_pages, page_size, kv_heads, head_dim)
    return [
        (torch.randn(shape, device=device).to(dtype), torch.randn(shape, device=device).to(dtype)) for _ in range(count)
    ]


def nan_unused_slots(cache, indptr, indices, last_page_len, layout: str = "NHD") -> None:
    """Write NaN into every slot no request owns: the spare pages and the tail of each request's last page past
    ``last_page_len`` (an engine's cache may hold anything there, so a kernel that reads them fails a test).
    ``cache``: a 5-D tensor, a ``(k, v)`` pair of 4-D tensors in ``layout``, or a pair of 3-D ``[slots, H, D]``
    tensors (page size 1: no tails)."""
    if layout not in ("NHD", "HND"):
        raise ValueError(f"layout: expected 'NHD' or 'HND', got {layout!r}")
    kc, vc = (cache[:, 0], cache[:, 1]) if isinstance(cache, torch.Tensor) else cache
    used = torch.zeros(kc.shape[0], dtype=torch.bool)
    ind, ptr, last = indices.cpu().long(), indptr.cpu().long(), last_page_len.cpu().long()
    for b in range(len(ptr) - 1):
        mine = ind[ptr[b] : ptr[b + 1]]
        used[mine] = True
        if len(mine) and kc.dim() == 4:
            for x in (kc, vc):
                tail = x[int(mine[-1])]
                (tail[int(last[b]) :] if layout == "NHD" else tail[:, int(last[b]) :]).fill_(float("nan"))
    for x in (kc, vc):
        x[~used.to(x.device)] = float("nan")


def make_paged(
    kv_lens, page_size, num_kv_heads, head_dim, dtype, device, layout="NHD", form="5d", spare_pages=2, nan_unused=False
):
    """A paged cache holding random per-request K/V; pages assigned in shuffled order (``page_table`` with
    torch's global generator).

    Returns (cache, indptr, indices, last_page_len, ks, vs) with ks[b], vs[b] the dense NHD K/V of request b.
    form: "5d" (one tensor), "tuple" (a (k, v) pair of 4-D tensors), "3d" (a pair of [slots, H, D], page size 1,
    the same in both layouts). ``nan_unused``: NaN in every slot no request owns (``nan_unused_slots``).
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
    if nan_unused:
        nan_unused_slots(cache, indptr, indices, last, layout)
    return cache, indptr.to(device), indices.to(device), last.to(device), ks, vs


# ----------------------------------------------------------------------------- benchmark cases
class DecodeCase(NamedTuple):
    """One batch-decode row: ``batch`` requests of ``kv_len`` keys each, one query row per request, NHD pages."""

    name: str
    batch: int
    kv_len: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype


_F16, _BF16 = torch.float16, torch.bfloat16
_FP8 = getattr(torch, "float8_e4m3fn", None)

DECODE_CASES = [
    DecodeCase("1x32768 32/8", 1, 32768, 32, 8, 128, 16, _F16),
    DecodeCase("16x8192 32/8", 16, 8192, 32, 8, 128, 16, _F16),
    DecodeCase("64x4096 32/8", 64, 4096, 32, 8, 128, 16, _F16),
    DecodeCase("128x2048 32/8", 128, 2048, 32, 8, 128, 16, _F16),
    DecodeCase("256x1024 32/8", 256, 1024, 32, 8, 128, 16, _F16),
    DecodeCase("64x4096 32/32", 64, 4096, 32, 32, 128, 16, _F16),
    DecodeCase("64x4096 64/8", 64, 4096, 64, 8, 128, 16, _F16),
    DecodeCase("1x32768 32/8 ps1", 1, 32768, 32, 8, 128, 1, _F16),
    DecodeCase("64x4096 32/8 ps1", 64, 4096, 32, 8, 128, 1, _F16),
    DecodeCase("1x32768 32/8 bf16", 1, 32768, 32, 8, 128, 16, _BF16),
    DecodeCase("64x4096 32/8 bf16", 64, 4096, 32, 8, 128, 16, _BF16),
    DecodeCase("16x8192 16/16 D256 bf16", 16, 8192, 16, 16, 256, 16, _BF16),
    DecodeCase("64x4096 16/16 D256 bf16", 64, 4096, 16, 16, 256, 16, _BF16),
    DecodeCase("64x4096 40/8 (group 5)", 64, 4096, 40, 8, 128, 16, _F16),
    DecodeCase("64x4096 48/8 (group 6)", 64, 4096, 48, 8, 128, 16, _F16),
    DecodeCase("64x4096 28/4 (group 7)", 64, 4096, 28, 4, 128, 16, _F16),
    DecodeCase("16x8192 28/4 (group 7)", 16, 8192, 28, 4, 128, 16, _F16),
]


def decode_inputs(case: DecodeCase, device, *, seed: int = 0, copies: int = 1) -> dict:
    """One decode row's inputs: the shuffled page table (``indptr``, ``indices``, ``last`` on ``device``, and the
    ``*_cpu`` copies), ``copies`` random ``(k, v)`` caches (benchmarks rotate them past L2) and ``q [batch, Hq, D]``
    drawn after the caches from torch's global generator."""
    indptr, indices, last, num_pages = page_table([case.kv_len] * case.batch, case.page_size, seed=seed)
    caches = paged_caches(num_pages, case.page_size, case.num_kv_heads, case.head_dim, case.dtype, device, count=copies)
    q = torch.randn((case.batch, case.num_qo_heads, case.head_dim), dtype=case.dtype, device=device)
    return dict(
        indptr=indptr.to(device),
        indices=indices.to(device),
        last=last.to(device),
        indptr_cpu=indptr,
        indices_cpu=indices,
        last_cpu=last,
        caches=caches,
        q=q,
    )


@dataclass(frozen=True)
class PrefillCase:
    """One prefill row. ``kind``: "single" (one request), "paged" (``batch`` requests of ``qo`` queries over ``kv``
    keys in pages of ``page_size``) or "ragged" (requests of ``lens[b]`` queries over as many keys, K/V rows back to
    back). ``mask``: None or "blockdiag:N" (a block-diagonal custom mask of N x N blocks, a block-sparse case)."""

    name: str
    kind: str
    batch: int
    qo: int
    kv: int
    hq: int
    hkv: int
    d: int
    causal: bool
    dtype: torch.dtype = torch.float16
    page_size: int = 1
    mask: str | None = None
    window_left: int = -1
    soft_cap: float = 0.0
    kv_dtype: torch.dtype | None = None  # None: dtype
    lens: tuple[int, ...] | None = None  # ragged only

    @property
    def kv_type(self) -> torch.dtype:
        return self.dtype if self.kv_dtype is None else self.kv_dtype


def ragged_lens(n: int, lo: int, hi: int, seed: int = 0) -> tuple[int, ...]:
    """``n`` request lengths drawn uniformly from [lo, hi] with a fixed seed (the same on every machine)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return tuple(int(x) for x in torch.randint(lo, hi + 1, (n,), generator=gen))


_MIXED = ragged_lens(64, 100, 4000)
_P = PrefillCase
PREFILL_CASES = [
    _P("4096 32/32 D128 causal", "single", 1, 4096, 4096, 32, 32, 128, True),
    _P("4096 32/32 D128 full", "single", 1, 4096, 4096, 32, 32, 128, False),
    _P("8192 32/8 D128 causal", "single", 1, 8192, 8192, 32, 8, 128, True),
    _P("8192 32/8 D128 causal bf16", "single", 1, 8192, 8192, 32, 8, 128, True, _BF16),
    _P("16384 32/8 D128 causal", "single", 1, 16384, 16384, 32, 8, 128, True),
    _P("16384 32/8 D128 full", "single", 1, 16384, 16384, 32, 8, 128, False),
    _P("4096 32/32 D64 causal", "single", 1, 4096, 4096, 32, 32, 64, True),
    _P("16384 32/8 D64 causal", "single", 1, 16384, 16384, 32, 8, 64, True),
    _P("16x(1024 over 2048 paged) 32/8", "paged", 16, 1024, 2048, 32, 8, 128, True, page_size=16),
    _P("4096 32/32 D128 causal bf16", "single", 1, 4096, 4096, 32, 32, 128, True, _BF16),
    _P("4096 16/16 D256 causal", "single", 1, 4096, 4096, 16, 16, 256, True),
    _P("4096 16/16 D256 causal bf16", "single", 1, 4096, 4096, 16, 16, 256, True, _BF16),
    _P("16384 16/16 D256 causal", "single", 1, 16384, 16384, 16, 16, 256, True),
    _P("4096 16/16 D512 causal bf16", "single", 1, 4096, 4096, 16, 16, 512, True, _BF16),
    _P("4096 40/8 D128 causal bf16 (group 5)", "single", 1, 4096, 4096, 40, 8, 128, True, _BF16),
    _P("4096 28/4 D128 causal bf16 (group 7)", "single", 1, 4096, 4096, 28, 4, 128, True, _BF16),
    _P("append 512 over 8192 32/8", "single", 1, 512, 8192, 32, 8, 128, True),
    _P("16384 32/8 D128 causal window 4096", "single", 1, 16384, 16384, 32, 8, 128, True, window_left=4096),
    _P("8192 32/8 D128 causal soft cap 30", "single", 1, 8192, 8192, 32, 8, 128, True, soft_cap=30.0),
    _P("8192 32/8 D128 causal fp8 KV", "single", 1, 8192, 8192, 32, 8, 128, True, kv_dtype=_FP8),
    _P(f"ragged 64 x (100-4000, {sum(_MIXED)} tokens) 32/8", "ragged", 64, 0, 0, 32, 8, 128, True, lens=_MIXED),
    _P("shared prefix 64q x 16384 32/8", "single", 1, 64, 16384, 32, 8, 128, False),
    _P("4096 32/8 D128 blockdiag-512 mask", "single", 1, 4096, 4096, 32, 8, 128, False, mask="blockdiag:512"),
]
del _P


def prefill_mask(case: PrefillCase, device="cuda"):
    """The custom mask of a case as bool ``[qo, kv]``, or None."""
    if case.mask is None:
        return None
    kind, n = case.mask.split(":")
    if kind != "blockdiag":
        raise ValueError(f"mask: unknown kind {kind!r} in {case.mask!r} (expected 'blockdiag:N')")
    n = int(n)
    i = torch.arange(case.qo, device=device)[:, None] // n
    j = torch.arange(case.kv, device=device)[None, :] // n
    return i == j


def request_lens(case: PrefillCase) -> list[tuple[int, int]]:
    """(queries, keys) of every request of a prefill case."""
    if case.kind == "ragged":
        return [(n, n) for n in case.lens]
    return [(case.qo, case.kv)] * case.batch


def _indptr(lens, device) -> torch.Tensor:
    out = torch.zeros(len(lens) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lens, dtype=torch.int64).cumsum(0).to(torch.int32)
    return out.to(device)


def prefill_inputs(case: PrefillCase, *, seed: int = 0, device="cuda") -> dict:
    """One prefill row's inputs: ``q``, ``mask``, ``qo_indptr`` and ``kv_indptr``; paged rows add ``cache`` (a
    ``(k, v)`` pair), ``kv_indices`` and ``last_page_len`` (a shuffled page table), the others ``k`` and ``v`` (rows
    back to back). Values come from a generator seeded with ``seed`` on ``device``; fp8 K/V are drawn in the query
    dtype and cast."""
    g = torch.Generator(device=device).manual_seed(seed)
    lens = request_lens(case)
    total_q = sum(q for q, _ in lens)

    def kv_rows(n):
        return torch.randn(n, case.hkv, case.d, device=device, dtype=case.dtype, generator=g).to(case.kv_type)

    q = torch.randn(total_q, case.hq, case.d, device=device, dtype=case.dtype, generator=g)
    inp = {"q": q, "mask": prefill_mask(case, device), "qo_indptr": _indptr([qo for qo, _ in lens], device)}
    if case.kind == "paged":
        kv_lens = [kv for _, kv in lens]
        indptr, indices, last, num_pages = page_table(kv_lens, case.page_size, seed=seed, device=device)
        inp["cache"] = paged_caches(num_pages, case.page_size, case.hkv, case.d, case.kv_type, device)[0]
        inp["kv_indptr"], inp["kv_indices"], inp["last_page_len"] = indptr, indices, last
    else:
        total_kv = sum(kv for _, kv in lens)
        inp["k"], inp["v"] = kv_rows(total_kv), kv_rows(total_kv)
        inp["kv_indptr"] = _indptr([kv for _, kv in lens], device)
    return inp


class CascadeCase(NamedTuple):
    """One shared-prefix decode row: ``batch`` requests share ``shared`` prefix keys (whole pages) and own
    ``unique`` keys each, one query row per request; the heads, head dim, page size and dtype below."""

    batch: int
    shared: int
    unique: int
    num_qo_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    dtype: torch.dtype = _F16

    @property
    def name(self) -> str:
        return (
            f"b{self.batch}-shared{self.shared}-own{self.unique}-h{self.num_qo_heads}/{self.num_kv_heads}"
            f"-d{self.head_dim}-ps{self.page_size}"
        )


CASCADE_CASES = [CascadeCase(64, 16384, 256), CascadeCase(128, 32768, 256), CascadeCase(256, 32768, 256)]


def shared_prefix_inputs(case: CascadeCase, *, seed: int = 0, device="cuda"):
    """``(cache, q, levels, flat)`` of one shared-prefix row: a 5-D NHD cache, ``q [batch, Hq, D]`` (both from
    torch's global generator), the two levels' page tables (``qo_indptr``, ``kv_indptr``, ``kv_indices``,
    ``last_page_len``: lists of one tensor per level) and ``flat``, every request's whole page list (``indptr``,
    ``indices``, ``last_page_len``) for a plain batch decode. Pages are shuffled (``page_table`` with ``seed``)."""
    ps = case.page_size
    if case.shared % ps:
        raise ValueError(f"shared: the prefix is whole pages of {ps} keys, got {case.shared}")
    shared_pages, own_pages = case.shared // ps, -(-case.unique // ps)
    # One page table: the prefix as the first "request", then each request's own pages.
    _, perm, last, num_pages = page_table([case.shared] + [case.unique] * case.batch, ps, seed=seed)
    shared_idx, own_idx = perm[:shared_pages], perm[shared_pages:].reshape(case.batch, own_pages)
    own_last = int(last[1])
    shape = (num_pages, 2, ps, case.num_kv_heads, case.head_dim)
    cache = torch.randn(shape, dtype=case.dtype, device=device)
    q = torch.randn(case.batch, case.num_qo_heads, case.head_dim, dtype=case.dtype, device=device)

    def i32(x):
        return torch.as_tensor(x, dtype=torch.int32, device=device)

    levels = dict(
        qo_indptr=[i32([0, case.batch]), i32(list(range(case.batch + 1)))],
        kv_indptr=[i32([0, shared_pages]), i32([i * own_pages for i in range(case.batch + 1)])],
        kv_indices=[shared_idx.to(device), own_idx.reshape(-1).to(device)],
        last_page_len=[i32([ps]), i32([own_last] * case.batch)],
    )
    flat = dict(
        indptr=i32([b * (shared_pages + own_pages) for b in range(case.batch + 1)]),
        indices=torch.cat([torch.cat([shared_idx, own_idx[b]]) for b in range(case.batch)]).to(device),
        last_page_len=i32([own_last] * case.batch),
    )
    return cache, q, levels, flat
