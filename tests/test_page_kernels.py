"""Device kernels of the page and bit-packing helpers (``_page_impl``, ``_quantization_impl``) against the
reference and numpy.

Runs the Triton kernels: on CUDA when present, else on the CPU under ``TRITON_INTERPRET=1``.
Appends are checked byte for byte over the whole cache (filled with random bytes first), so a write
outside the addressed slots fails as surely as a wrong value.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import DEVICE
from conftest import INTERPRET as _INTERPRET
from flashinfer_triton import reference
from helpers import page_table

pytestmark = pytest.mark.interpret

if DEVICE.type == "cpu" and not _INTERPRET:
    pytest.skip("Triton kernels need CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from flashinfer_triton import _page_impl, _quantization_impl  # noqa: E402  (after the skip: imports Triton code)


def _assert_equal_bytes(name: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    """Exact comparison of two byte tensors; on failure names the first differing index and values."""
    got, expected = got.cpu(), expected.cpu()
    assert got.shape == expected.shape, f"{name}: shape {tuple(got.shape)} != {tuple(expected.shape)}"
    diff = (got != expected).reshape(-1)
    if diff.any():
        flat = int(diff.nonzero()[0])
        idx = np.unravel_index(flat, tuple(got.shape)) if got.dim() else ()
        raise AssertionError(
            f"{name}: {int(diff.sum())} of {diff.numel()} elements differ; first at {tuple(map(int, idx))}: "
            f"got {got.reshape(-1)[flat].item()}, expected {expected.reshape(-1)[flat].item()}"
        )


def _random_bytes(shape, dtype, gen) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are random (NaNs included): the poison outside the slots."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * itemsize), dtype=torch.uint8, generator=gen)
    return raw.view(dtype)


# ----------------------------------------------------------------------------- append
def _page_table(gen, lens_before, lens_append, page_size, spare_pages):
    """Random disjoint pages for each request after its append, shuffled among spare pages."""
    lens_after = [a + b for a, b in zip(lens_before, lens_append, strict=True)]
    seed = int(torch.randint(1 << 30, (1,), generator=gen))
    kv_indptr, kv_indices, kv_last_page_len, num_pages = page_table(
        lens_after, page_size, spare_pages=spare_pages, seed=seed
    )
    append_indptr = torch.tensor([0, *np.cumsum(lens_append).tolist()], dtype=torch.int32)
    return num_pages, kv_indices, kv_indptr, kv_last_page_len, append_indptr


def _nhd_views(cache, layout):
    """4-D ``[pages, page_size, heads, dim]`` views of a cache in FlashInfer's forms (5-D, tuple, 3-D)."""
    if isinstance(cache, tuple):
        k, v = cache
        if k.dim() == 3:  # [slots, heads, dim] in both layouts (SPEC, FlashInfer)
            k, v = k.unsqueeze(1), v.unsqueeze(1)
        elif layout == "HND":
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        return k, v
    k, v = cache[:, 0], cache[:, 1]
    if layout == "HND":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    return k, v


APPEND_CASES = [
    # id, form, layout, page_size, cache dtype, append dtype, heads, head_dim
    ("5d-NHD-ps4-fp16", "5d", "NHD", 4, torch.float16, torch.float16, 2, 16),
    ("5d-HND-ps5-bf16", "5d", "HND", 5, torch.bfloat16, torch.bfloat16, 3, 32),
    ("tuple-NHD-ps3-bf16", "tuple", "NHD", 3, torch.bfloat16, torch.bfloat16, 2, 16),
    ("tuple-HND-ps4-fp16", "tuple", "HND", 4, torch.float16, torch.float16, 1, 64),
    ("3d-NHD-ps1-fp16", "3d", "NHD", 1, torch.float16, torch.float16, 2, 16),
    ("3d-HND-ps1-bf16", "3d", "HND", 1, torch.bfloat16, torch.bfloat16, 2, 16),
    ("5d-NHD-ps4-e4m3-from-fp16", "5d", "NHD", 4, torch.float8_e4m3fn, torch.float16, 2, 16),
    ("tuple-HND-ps4-e5m2-from-bf16", "tuple", "HND", 4, torch.float8_e5m2, torch.bfloat16, 2, 32),
    ("5d-NHD-ps4-e4m3-from-e4m3", "5d", "NHD", 4, torch.float8_e4m3fn, torch.float8_e4m3fn, 2, 16),
]


@pytest.mark.parametrize(
    "form,layout,page_size,cache_dtype,append_dtype,heads,head_dim",
    [c[1:] for c in APPEND_CASES],
    ids=[c[0] for c in APPEND_CASES],
)
def test_append_paged_kv_cache(form, layout, page_size, cache_dtype, append_dtype, heads, head_dim):
    gen = torch.Generator().manual_seed(1234)
    # An empty append, a decode-like single token, a request with no earlier tokens, a page boundary.
    lens_before, lens_append = [3, 0, 7, 2], [0, 5, 1, 4]
    num_pages, kv_indices, kv_indptr, kv_last_page_len, append_indptr = _page_table(
        gen, lens_before, lens_append, page_size, spare_pages=3
    )
    nnz = sum(lens_append)
    if form == "5d":
        inner = (page_size, heads, head_dim) if layout == "NHD" else (heads, page_size, head_dim)
        cache = _random_bytes((num_pages, 2, *inner), cache_dtype, gen)
    elif form == "tuple":
        inner = (page_size, heads, head_dim) if layout == "NHD" else (heads, page_size, head_dim)
        cache = tuple(_random_bytes((num_pages, *inner), cache_dtype, gen) for _ in range(2))
    else:
        cache = tuple(_random_bytes((num_pages, heads, head_dim), cache_dtype, gen) for _ in range(2))
    # Keys and values as slices of one fused projection: non-contiguous rows.
    fused = (torch.randn(nnz, 3, heads, head_dim, generator=gen) * 4).to(append_dtype)
    append_key, append_value = fused[:, 1], fused[:, 2]

    seq_lens = reference.get_seq_lens(kv_indptr, kv_last_page_len, page_size)
    batch_indices, positions = reference.get_batch_indices_positions(append_indptr, seq_lens, nnz)

    expected = tuple(c.clone() for c in cache) if isinstance(cache, tuple) else cache.clone()
    ref_cache, ref_layout = expected, layout
    reference.append_paged_kv_cache(
        append_key, append_value, batch_indices, positions, ref_cache, kv_indices, kv_indptr,
        kv_last_page_len, kv_layout=ref_layout,
    )  # fmt: skip

    dev = lambda t: t.to(DEVICE)
    got = tuple(dev(c) for c in cache) if isinstance(cache, tuple) else dev(cache)
    k_view, v_view = _nhd_views(got, layout)
    assert k_view.shape == (num_pages, page_size, heads, head_dim)
    _page_impl.append_paged_kv_cache(
        dev(append_key), dev(append_value), dev(batch_indices), dev(positions), k_view, v_view,
        dev(kv_indices), dev(kv_indptr),
    )  # fmt: skip

    pairs = zip(got, expected, strict=True) if isinstance(cache, tuple) else [(got, expected)]
    for i, (g, e) in enumerate(pairs):
        _assert_equal_bytes(f"cache[{i}] bytes", g.view(torch.uint8), e.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("append_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_append_cast_on_store_gpu(cache_dtype, append_dtype):
    """The in-kernel float -> fp8 conversion (CUDA only) rounds as torch does."""
    gen = torch.Generator().manual_seed(7)
    num_pages, page_size, heads, head_dim, nnz = 64, 16, 8, 128, 300
    cache = _random_bytes((num_pages, 2, page_size, heads, head_dim), cache_dtype, gen).cuda()
    expected = cache.clone()
    append = (torch.randn(nnz, 2, heads, head_dim, generator=gen) * 20).to(append_dtype).cuda()
    kv_indptr, kv_indices, _, _ = page_table([nnz], page_size, spare_pages=num_pages - 19, seed=7, device="cuda")
    batch_indices = torch.zeros(nnz, dtype=torch.int32, device="cuda")
    positions = torch.arange(nnz, dtype=torch.int32, device="cuda")
    _page_impl.append_paged_kv_cache(
        append[:, 0], append[:, 1], batch_indices, positions, cache[:, 0], cache[:, 1], kv_indices, kv_indptr
    )
    pages, slots = kv_indices.long()[positions.long() // page_size], positions.long() % page_size
    expected[pages, 0, slots] = append[:, 0].to(cache_dtype)
    expected[pages, 1, slots] = append[:, 1].to(cache_dtype)
    _assert_equal_bytes("cache bytes", cache.view(torch.uint8), expected.view(torch.uint8))


# ----------------------------------------------------------------------------- indices
BATCH_CASES = [
    ("bs4-with-empty", [3, 0, 7, 2], [5, 2, 9, 2]),
    ("bs1", [6], [6]),
    ("bs9-decode", [1] * 9, [4, 1, 17, 8, 2, 3, 9, 30, 1]),
]


@pytest.mark.parametrize("lens_append,seq_lens", [c[1:] for c in BATCH_CASES], ids=[c[0] for c in BATCH_CASES])
def test_get_batch_indices_positions(lens_append, seq_lens):
    append_indptr = torch.tensor([0, *np.cumsum(lens_append).tolist()], dtype=torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    nnz = sum(lens_append)
    exp_b, exp_p = reference.get_batch_indices_positions(append_indptr, seq_lens_t, nnz)
    got_b, got_p = _page_impl.get_batch_indices_positions(append_indptr.to(DEVICE), seq_lens_t.to(DEVICE), nnz)
    assert got_b.dtype == torch.int32 and got_p.dtype == torch.int32
    _assert_equal_bytes("batch_indices", got_b, exp_b)
    _assert_equal_bytes("positions", got_p, exp_p)


def test_get_batch_indices_positions_padding_rows():
    """``nnz`` beyond ``append_indptr[-1]``: the extra rows get -1 / 0, as FlashInfer writes them."""
    append_indptr = torch.tensor([0, 2, 3], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([4, 1], dtype=torch.int32, device=DEVICE)
    got_b, got_p = _page_impl.get_batch_indices_positions(append_indptr, seq_lens, 5)
    _assert_equal_bytes("batch_indices", got_b, torch.tensor([0, 0, 1, -1, -1], dtype=torch.int32))
    _assert_equal_bytes("positions", got_p, torch.tensor([2, 3, 0, 0, 0], dtype=torch.int32))


def test_get_seq_lens():
    kv_indptr = torch.tensor([0, 3, 3, 4, 9], dtype=torch.int32)
    kv_last_page_len = torch.tensor([5, 0, 16, 1], dtype=torch.int32)
    expected = reference.get_seq_lens(kv_indptr, kv_last_page_len, 16)
    got = _page_impl.get_seq_lens(kv_indptr.to(DEVICE), kv_last_page_len.to(DEVICE), 16)
    _assert_equal_bytes("seq_lens", got, expected)


# ----------------------------------------------------------------------------- bit packing
@pytest.mark.parametrize("bitorder", ["big", "little"])
@pytest.mark.parametrize("n", [1, 7, 8, 13, 2051], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8], ids=["bool", "uint8"])
def test_packbits(n, bitorder, dtype):
    gen = torch.Generator().manual_seed(n)
    # uint8 input with values 0..3: numpy counts every nonzero as a 1.
    x = torch.randint(0, 2 if dtype == torch.bool else 4, (n,), generator=gen).to(dtype)
    expected = torch.from_numpy(np.packbits(x.numpy() != 0, bitorder=bitorder))
    got = _quantization_impl.packbits(x.to(DEVICE), bitorder)
    assert got.dtype == torch.uint8
    _assert_equal_bytes("packed", got, expected)


def test_packbits_empty():
    assert _quantization_impl.packbits(torch.zeros(0, dtype=torch.bool, device=DEVICE), "big").numel() == 0


SEGMENT_CASES = [
    ("empty-first-and-middle", [0, 5, 0, 17, 8, 0, 1]),
    ("one-long", [1000]),
    ("all-empty", [0, 0, 0]),
    ("many-small", [3, 9, 1, 16, 7, 0, 24, 2, 8, 15, 1]),
]


@pytest.mark.parametrize("bitorder", ["big", "little"])
@pytest.mark.parametrize("where", ["host", "device", "device+host-copy"], ids=lambda w: f"indptr-{w}")
@pytest.mark.parametrize("lens", [c[1] for c in SEGMENT_CASES], ids=[c[0] for c in SEGMENT_CASES])
def test_segment_packbits(lens, where, bitorder):
    gen = torch.Generator().manual_seed(len(lens))
    indptr = torch.tensor([0, *np.cumsum(lens).tolist()], dtype=torch.int32)
    x = torch.randint(0, 2, (int(indptr[-1]),), generator=gen).to(torch.bool)
    pieces = [
        np.packbits(x[int(a) : int(b)].numpy(), bitorder=bitorder) for a, b in zip(indptr[:-1], indptr[1:], strict=True)
    ]
    expected = torch.from_numpy(np.concatenate(pieces)) if pieces else torch.zeros(0, dtype=torch.uint8)
    expected_indptr = torch.tensor([0, *np.cumsum([(n + 7) // 8 for n in lens]).tolist()], dtype=torch.int32)
    ref_packed, ref_indptr = reference.segment_packbits(x, indptr, bitorder)
    _assert_equal_bytes("reference packed", ref_packed, expected)

    # "device+host-copy": the public layer's call, which passes the host copy it read for its checks
    # (nothing is then read back from the device).
    got, got_indptr = _quantization_impl.segment_packbits(
        x.to(DEVICE),
        indptr if where == "host" else indptr.to(DEVICE),
        bitorder,
        indptr_host=indptr.to(torch.int64) if where == "device+host-copy" else None,
    )
    assert got.dtype == torch.uint8 and got_indptr.dtype == torch.int32
    _assert_equal_bytes("packed", got, expected)
    _assert_equal_bytes("new_indptr", got_indptr, expected_indptr)
