"""Page and bit-packing API: appends touch exactly their slots; lengths, positions and packing match."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashinfer_triton as fi
from flashinfer_triton import reference as R
from helpers import page_table


def _byte_view(cache):
    parts = cache if isinstance(cache, tuple) else (cache,)
    return torch.cat([p.contiguous().view(torch.uint8).reshape(-1) for p in parts])


def _fill_random_bytes(cache):
    for p in cache if isinstance(cache, tuple) else (cache,):
        p.view(torch.uint8).copy_(torch.randint(0, 256, p.view(torch.uint8).shape, dtype=torch.uint8))


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("form", ["5d", "tuple"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float8_e4m3fn"])
def test_append_writes_exactly_the_addressed_slots(device, layout, form, dtype):
    dtype = getattr(torch, dtype, None)
    if dtype is None:
        pytest.skip("torch without float8")
    num_pages, ps, hkv, d = 9, 5, 2, 32
    shape = (num_pages, ps, hkv, d) if layout == "NHD" else (num_pages, hkv, ps, d)
    k_cache = torch.empty(shape, dtype=dtype, device=device)
    v_cache = torch.empty(shape, dtype=dtype, device=device)
    cache = torch.stack([k_cache, v_cache], 1) if form == "5d" else (k_cache, v_cache)
    _fill_random_bytes(cache)
    kv_indptr = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    kv_indices = torch.tensor([4, 0, 7, 1, 2, 8, 5], dtype=torch.int32)
    last = torch.tensor([2, 0, 5], dtype=torch.int32)
    seq_lens = fi.get_seq_lens(kv_indptr, last, ps)
    append_indptr = torch.tensor([0, 4, 4, 9], dtype=torch.int32)
    bi, pos = fi.get_batch_indices_positions(append_indptr, seq_lens, 9)
    key = torch.randn(9, hkv, d, device=device).half()
    value = torch.randn(9, hkv, d, device=device).half()
    original = tuple(x.clone() for x in cache) if form == "tuple" else cache.clone()
    expected = tuple(x.clone() for x in cache) if form == "tuple" else cache.clone()
    R.append_paged_kv_cache(key, value, bi, pos, expected, kv_indices, kv_indptr, last, layout)
    fi.append_paged_kv_cache(
        key,
        value,
        bi.to(device),
        pos.to(device),
        cache,
        kv_indices.to(device),
        kv_indptr.to(device),
        last.to(device),
        layout,
    )
    assert torch.equal(_byte_view(cache), _byte_view(expected))
    # independently: every (page, slot) not addressed keeps its bytes, every addressed one holds the token
    addressed = {}
    for t in range(9):
        b, p = int(bi[t]), int(pos[t])
        addressed[(int(kv_indices[int(kv_indptr[b]) + p // ps]), p % ps)] = t
    kv_new = cache if form == "tuple" else (cache[:, 0], cache[:, 1])
    kv_old = original if form == "tuple" else (original[:, 0], original[:, 1])
    for new, old, src in zip(kv_new, kv_old, (key, value)):
        new_nhd = new if layout == "NHD" else new.transpose(1, 2)
        old_nhd = old if layout == "NHD" else old.transpose(1, 2)
        for page in range(num_pages):
            for slot in range(ps):
                got = new_nhd[page, slot].contiguous().view(torch.uint8)
                if (page, slot) in addressed:
                    want = src[addressed[(page, slot)]].to(dtype).contiguous().view(torch.uint8)
                else:
                    want = old_nhd[page, slot].contiguous().view(torch.uint8)
                assert torch.equal(got, want), f"page {page} slot {slot}"


def test_get_seq_lens_and_positions_match_reference():
    kv_indptr = torch.tensor([0, 2, 2, 5, 6], dtype=torch.int32)
    last = torch.tensor([3, 0, 16, 1], dtype=torch.int32)
    assert torch.equal(fi.get_seq_lens(kv_indptr, last, 16), R.get_seq_lens(kv_indptr, last, 16))
    assert fi.get_seq_lens(kv_indptr, last, 16).tolist() == [19, 0, 48, 1]
    append_indptr = torch.tensor([0, 3, 3, 4, 9], dtype=torch.int32)
    seq_lens = torch.tensor([10, 2, 1, 5], dtype=torch.int32)
    bi, pos = fi.get_batch_indices_positions(append_indptr, seq_lens, 9)
    ebi, epos = R.get_batch_indices_positions(append_indptr, seq_lens, 9)
    assert torch.equal(bi, ebi) and torch.equal(pos, epos)
    assert bi.tolist() == [0, 0, 0, 2, 3, 3, 3, 3, 3] and pos.tolist() == [7, 8, 9, 0, 0, 1, 2, 3, 4]


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as a view of stride 2 into a larger tensor whose other entries are random."""
    big = torch.randint(0, 1 << 20, (2 * t.numel(),), dtype=t.dtype, device=t.device)
    big[::2] = t
    return big[::2]


@pytest.mark.interpret
def test_lengths_positions_and_packing_of_strided_index_views(device):
    """Index arrays given as strided views (every other entry of larger tensors) give their values' results."""
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    kv_indptr, last = i32(0, 2, 2, 5, 6), i32(3, 0, 16, 1)
    assert fi.get_seq_lens(_strided(kv_indptr), _strided(last), 16).tolist() == [19, 0, 48, 1]
    bi, pos = fi.get_batch_indices_positions(_strided(i32(0, 3, 3, 4, 9)), _strided(i32(10, 2, 1, 5)), 9)
    assert bi.tolist() == [0, 0, 0, 2, 3, 3, 3, 3, 3] and pos.tolist() == [7, 8, 9, 0, 0, 1, 2, 3, 4]
    x = torch.rand(20, device=device) < 0.5
    packed, new_indptr = fi.segment_packbits(x, _strided(i32(0, 7, 20)), bitorder="little")
    expected = [np.packbits(x[a:b].cpu().numpy(), bitorder="little") for a, b in ((0, 7), (7, 20))]
    assert packed.cpu().numpy().tolist() == np.concatenate(expected).tolist()
    assert new_indptr.tolist() == [0, 1, 3]


@pytest.mark.interpret
@pytest.mark.parametrize("bitorder", ["big", "little"])
def test_packbits_of_strided_views_equals_numpy(device, bitorder):
    """A strided bool view (every other entry, a column) packs the values it shows."""
    gen = torch.Generator().manual_seed(7)
    # (sliced on the device: .to() of a strided CPU view makes it contiguous)
    for base, view in (
        (torch.rand(46, generator=gen), lambda t: t[::2]),
        (torch.rand(19, 3, generator=gen), lambda t: t[:, 1]),
    ):
        x = view(base.to(device) < 0.5)
        assert not x.is_contiguous()
        xs = x.cpu().numpy()
        assert fi.packbits(x, bitorder).cpu().numpy().tolist() == np.packbits(xs, bitorder=bitorder).tolist()
        n = x.shape[0]
        packed, _ = fi.segment_packbits(x, torch.tensor([0, 5, n], dtype=torch.int32, device=device), bitorder)
        expected = np.concatenate([np.packbits(xs[a:b], bitorder=bitorder) for a, b in ((0, 5), (5, n))])
        assert packed.cpu().numpy().tolist() == expected.tolist()


def test_append_rejects_strided_index_views(device):
    """append reads its index arrays at unit stride, as FlashInfer does: a strided view is refused, by name,
    before anything is written."""
    cache = torch.randn(4, 2, 2, 1, 8, device=device)
    before = cache.clone()
    key = torch.randn(3, 1, 8, device=device)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    args = dict(batch_indices=i32(0, 0, 1), positions=i32(0, 1, 0), kv_indices=i32(2, 0, 1), kv_indptr=i32(0, 1, 3))
    for name in args:
        bad = {**args, name: _strided(args[name])}
        with pytest.raises(ValueError, match=name):
            fi.append_paged_kv_cache(key, key, bad["batch_indices"], bad["positions"], cache, bad["kv_indices"],
                                     bad["kv_indptr"], i32(2, 1))  # fmt: skip
        assert torch.equal(cache, before), name


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 123])
@pytest.mark.parametrize("bitorder", ["big", "little"])
def test_packbits_equals_numpy(n, bitorder):
    x = torch.rand(n) > 0.5
    got = fi.packbits(x, bitorder)
    assert got.dtype == torch.uint8
    assert got.tolist() == np.packbits(x.numpy(), bitorder=bitorder).tolist()


@pytest.mark.parametrize("bitorder", ["big", "little"])
def test_segment_packbits_equals_numpy(bitorder):
    lens = [5, 0, 16, 9, 1]
    indptr = torch.tensor([0] + np.cumsum(lens).tolist(), dtype=torch.int32)
    x = torch.rand(int(indptr[-1])) > 0.3
    packed, new_indptr = fi.segment_packbits(x, indptr, bitorder)
    expected, offsets = [], [0]
    for i in range(len(lens)):
        seg = np.packbits(x[int(indptr[i]) : int(indptr[i + 1])].numpy(), bitorder=bitorder).tolist()
        expected += seg
        offsets.append(offsets[-1] + len(seg))
    assert packed.tolist() == expected
    assert new_indptr.tolist() == offsets


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_append_3d_page_size_1_writes_exactly_the_addressed_slots(device, layout):
    """Engines' common form: a ``(k, v)`` pair of ``[slots, H, D]`` (page size 1, same in both layouts)."""
    slots, hkv, d = 40, 2, 32
    cache = (torch.empty(slots, hkv, d, device=device).half(), torch.empty(slots, hkv, d, device=device).half())
    _fill_random_bytes(cache)
    kv_indptr, kv_indices, last, _ = page_table([6, 0, 7], 1, spare_pages=slots - 13, seed=None)
    append_indptr = torch.tensor([0, 2, 2, 7], dtype=torch.int32)
    bi, pos = fi.get_batch_indices_positions(append_indptr, fi.get_seq_lens(kv_indptr, last, 1), 7)
    key = torch.randn(7, hkv, d, device=device).half()
    value = torch.randn(7, hkv, d, device=device).half()
    expected = tuple(x.clone() for x in cache)
    R.append_paged_kv_cache(key, value, bi, pos, expected, kv_indices, kv_indptr, last, layout)
    args = [t.to(device) for t in (bi, pos)] + [cache] + [t.to(device) for t in (kv_indices, kv_indptr, last)]
    fi.append_paged_kv_cache(key, value, *args, kv_layout=layout)
    assert torch.equal(_byte_view(cache), _byte_view(expected))


@pytest.mark.gpu
@pytest.mark.parametrize("pinned", [False, True], ids=["pageable", "pinned"])
def test_batch_indices_positions_host_seq_lens_device_indptr(pinned):
    """FlashInfer accepts seq_lens on the host with a device append_indptr: so do we (one copy)."""
    append_indptr = torch.tensor([0, 3, 3, 4, 9], dtype=torch.int32)
    seq_lens = torch.tensor([10, 2, 1, 5], dtype=torch.int32)
    host_lens = seq_lens.pin_memory() if pinned else seq_lens
    bi, pos = fi.get_batch_indices_positions(append_indptr.cuda(), host_lens, 9)
    ebi, epos = R.get_batch_indices_positions(append_indptr, seq_lens, 9)
    assert bi.is_cuda and pos.is_cuda
    assert torch.equal(bi.cpu(), ebi) and torch.equal(pos.cpu(), epos)
    with pytest.raises(ValueError, match="seq_lens"):
        fi.get_batch_indices_positions(append_indptr.cuda(), seq_lens[:3], 9)


@pytest.mark.gpu
def test_bad_append_on_cuda_raises_and_writes_nothing():
    """The CUDA fast path falls back to the full checks: same errors, cache untouched."""
    dev = "cuda"
    cache = torch.randn(6, 2, 4, 2, 64, device=dev).half()
    before = cache.clone()
    good = dict(
        append_key=torch.randn(3, 2, 64, device=dev).half(),
        append_value=torch.randn(3, 2, 64, device=dev).half(),
        batch_indices=torch.zeros(3, dtype=torch.int32, device=dev),
        positions=torch.arange(3, dtype=torch.int32, device=dev),
        paged_kv_cache=cache,
        kv_indices=torch.arange(2, dtype=torch.int32, device=dev),
        kv_indptr=torch.tensor([0, 2], dtype=torch.int32, device=dev),
        kv_last_page_len=torch.tensor([3], dtype=torch.int32, device=dev),
    )
    bad = [
        ("append_key", dict(append_key=torch.randn(3, 2, 32, device=dev).half()), ValueError),
        ("append_value", dict(append_value=torch.randn(2, 2, 64, device=dev).half()), ValueError),
        ("batch_indices", dict(batch_indices=torch.zeros(3, dtype=torch.int64, device=dev)), TypeError),
        ("positions", dict(positions=torch.arange(3, dtype=torch.int32)), ValueError),
        ("kv_last_page_len", dict(kv_last_page_len=torch.tensor([3, 1], dtype=torch.int32, device=dev)), ValueError),
        ("append_key", dict(append_key=torch.zeros(3, 2, 64, dtype=torch.int32, device=dev)), TypeError),
        ("kv_layout", dict(kv_layout="XYZ"), ValueError),
    ]
    for name, over, exc in bad:
        with pytest.raises(exc, match=name):
            fi.append_paged_kv_cache(**{**good, **over})
    torch.cuda.synchronize()
    assert torch.equal(cache, before)
    fi.append_paged_kv_cache(**good)  # the good call goes through
    assert torch.equal(cache[0, 0, 2], good["append_key"][2])


def test_batch_indices_positions_rejects_seq_lens_on_another_device():
    """Only the host is accepted besides append_indptr's own device (here: a meta tensor)."""
    with pytest.raises(ValueError, match="seq_lens"):
        fi.get_batch_indices_positions(
            torch.tensor([0, 2], dtype=torch.int32), torch.empty(1, dtype=torch.int32, device="meta"), 2
        )


def test_append_names_a_non_string_layout_after_a_known_form():
    """After a call of a known form, a layout that compares elementwise (an array) is named by the checks, not
    compared against the kept form's key (whose truth value would raise numpy's own error)."""
    torch.manual_seed(0)
    cache = torch.zeros(4, 2, 2, 4, 8)
    args = (
        torch.randn(3, 4, 8),
        torch.randn(3, 4, 8),
        torch.zeros(3, dtype=torch.int32),
        torch.arange(3, dtype=torch.int32),
        cache,
        torch.arange(2, dtype=torch.int32),
        torch.tensor([0, 2], dtype=torch.int32),
        torch.tensor([1], dtype=torch.int32),
    )
    fi.append_paged_kv_cache(*args, "NHD")
    before = cache.clone()
    for layout in (np.array(["NHD", "HND"]), ["NHD"]):
        with pytest.raises(ValueError, match="kv_layout"):
            fi.append_paged_kv_cache(*args, layout)
    assert torch.equal(cache, before)
