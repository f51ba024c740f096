"""plan() with page indices on the GPU: no read-back at plan(), the range checked at the first run()."""

import pytest
import torch

import flashinfer_triton as fi
from flashinfer_triton._wrapper import PendingPageRange, check_page_range


def test_check_page_range_ints():
    check_page_range(3, 4)
    with pytest.raises(ValueError, match="paged_kv_indices"):
        check_page_range(4, 4)


def test_combine_ints_is_max():
    assert PendingPageRange.combine([3, 7, -1]) == 7


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_indices_checked_at_run():
    dev = torch.device("cuda")
    ws = torch.empty(1 << 22, dtype=torch.uint8, device=dev)
    cache = torch.randn(4, 2, 16, 2, 64, dtype=torch.float16, device=dev)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    q = torch.randn(1, 2, 64, dtype=torch.float16, device=dev)
    w.plan(
        torch.tensor([0, 2], dtype=torch.int32),
        torch.tensor([0, 3], dtype=torch.int32, device=dev),
        torch.tensor([5], dtype=torch.int32),
        2,
        2,
        64,
        16,
    )
    assert w.run(q, cache).isfinite().all()
    w.plan(
        torch.tensor([0, 2], dtype=torch.int32),
        torch.tensor([0, 4], dtype=torch.int32, device=dev),
        torch.tensor([5], dtype=torch.int32),
        2,
        2,
        64,
        16,
    )
    out = torch.full_like(q, float("nan"))
    with pytest.raises(ValueError, match="paged_kv_indices"):
        w.run(q, cache, out=out)
    assert out.isnan().all()  # nothing written
    w.plan(
        torch.tensor([0, 2], dtype=torch.int32),
        torch.tensor([-1, 1], dtype=torch.int32, device=dev),
        torch.tensor([5], dtype=torch.int32),
        2,
        2,
        64,
        16,
    )
    with pytest.raises(ValueError, match="non-negative"):
        w.run(q, cache)


def test_range_scratch_read_on_cpu_is_a_copy_of_the_values():
    from flashinfer_triton._wrapper import RangeScratch

    x = torch.tensor([3, -1, 7], dtype=torch.int32)
    assert RangeScratch().read(x).tolist() == [3, -1, 7]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_range_scratch_read_reuses_a_pinned_buffer():
    """plan()'s device-to-host reads land in one pinned buffer per wrapper, grown when a read is larger."""
    from flashinfer_triton._wrapper import RangeScratch

    s = RangeScratch()
    a = torch.randint(-50, 50, (5,), dtype=torch.int32, device="cuda")
    assert s.read(a).tolist() == a.cpu().tolist()
    big = torch.randint(0, 1 << 30, (5000,), dtype=torch.int32, device="cuda")
    got = s.read(big)
    assert got.tolist() == big.cpu().tolist() and s._read.is_pinned()
    assert s.read(a.long()).tolist() == a.cpu().tolist()  # another dtype: its own buffer
