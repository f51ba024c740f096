"""The benchmarks' shared builders (benchmarks/_common.py): page tables and caches mean what they say."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

from flashinfer_triton import reference as R
from flashinfer_triton.testing import ragged_lens

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def common():
    spec = importlib.util.spec_from_file_location("bench_common", ROOT / "benchmarks" / "_common.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_page_table_lengths_and_pages(common, page_size):
    kv_lens = [5, 16, 0, 33, 1]
    indptr, indices, last, num_pages = common.page_table(kv_lens, page_size, spare_pages=3, seed=7)
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32
    assert R.get_seq_lens(indptr, last, page_size).tolist() == kv_lens
    assert num_pages == indptr[-1].item() + 3
    assert len(set(indices.tolist())) == indices.numel() and int(indices.max()) < num_pages
    again = common.page_table(kv_lens, page_size, spare_pages=3, seed=7)
    assert torch.equal(again[1], indices)  # reproducible from the seed


def test_paged_caches_shapes_and_rotation(common):
    caches = common.paged_caches(6, 4, 2, 8, torch.bfloat16, "cpu", count=3)
    assert len(caches) == 3 and all(k.shape == v.shape == (6, 4, 2, 8) for k, v in caches)
    assert all(k.dtype == torch.bfloat16 for k, _ in caches)
    assert not torch.equal(caches[0][0], caches[1][0])  # distinct copies to rotate past L2
    assert common.num_rotations(10 * common.L2_BYTES) == 2 and common.num_rotations(1) == 8


@pytest.fixture(scope="module")
def bench_prefill():
    spec = importlib.util.spec_from_file_location("bench_prefill", ROOT / "benchmarks" / "bench_prefill.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("qo,kv", [(7, 7), (3, 11), (11, 11), (1, 9)])
@pytest.mark.parametrize("causal,window_left", [(True, -1), (False, -1), (True, 0), (True, 4), (False, 3)])
def test_prefill_bench_counts_the_visible_pairs(bench_prefill, qo, kv, causal, window_left):
    """The FLOP count's pairs equal the keys the reference's mask keeps (bottom-right causal, window)."""
    i = torch.arange(qo)[:, None] + (kv - qo)
    j = torch.arange(kv)[None, :]
    keep = torch.ones(qo, kv, dtype=torch.bool)
    if causal:
        keep &= j <= i
    if window_left >= 0:
        keep &= j >= i - window_left
    assert bench_prefill._pairs(qo, kv, causal, window_left) == int(keep.sum())


def test_prefill_bench_cases(bench_prefill):
    names = [c.name for c in bench_prefill.CASES]
    assert len(set(names)) == len(names)
    ragged = [c for c in bench_prefill.CASES if c.kind == "ragged"]
    assert ragged and all(len(c.lens) == c.batch and 100 <= min(c.lens) <= max(c.lens) <= 4000 for c in ragged)
    assert ragged_lens(64, 100, 4000) == ragged[0].lens  # a fixed seed: the same batch every run
    fp8 = [c for c in bench_prefill.CASES if c.kv_type != c.dtype]
    assert fp8 and not any(bench_prefill.fa3_offered(c) for c in fp8)
    assert [c.name for c in bench_prefill.select_cases("D64,D256 causal bf16")] == [
        n for n in names if "D64" in n or "D256 causal bf16" in n
    ]


@pytest.mark.parametrize("form,layout,page_size", [("5d", "NHD", 4), ("tuple", "HND", 4), ("3d", "NHD", 1)])
def test_make_paged_nan_unused(common, form, layout, page_size):
    """``nan_unused``: NaN exactly in the slots no request owns; the dense copies stay finite."""
    kv_lens = [5, 8, 0, 3]
    cache, indptr, indices, last, ks, vs = common.make_paged(
        kv_lens, page_size, 2, 8, torch.float32, "cpu", layout=layout, form=form, spare_pages=2, nan_unused=True
    )
    kc = cache[:, 0] if form == "5d" else cache[0]
    if layout == "HND":
        kc = kc.transpose(1, 2)
    if form == "3d":
        kc = kc[:, None]
    owned = torch.zeros(kc.shape[:2], dtype=torch.bool)
    for b, n in enumerate(kv_lens):
        for j in range(n):
            owned[int(indices[int(indptr[b]) + j // page_size]), j % page_size] = True
    nan = torch.isnan(kc).any(-1).any(-1)
    assert torch.equal(nan, ~owned)
    assert all(torch.isfinite(k).all() and torch.isfinite(v).all() for k, v in zip(ks, vs, strict=True))


@pytest.mark.parametrize("fill", [None, -7])
def test_block_table_rows(common, fill):
    """Row b starts with request b's blocks, all distinct; the rest is ``fill`` or more distinct blocks."""
    from flashinfer_triton.testing import block_table

    kv_lens, bs = [9, 0, 4, 17], 4
    table, num_blocks = block_table(kv_lens, bs, max_blocks=6, spare_blocks=2, fill=fill, seed=5)
    assert table.shape == (4, 6) and table.dtype == torch.int32
    owned = [table[b, : -(-n // bs)].tolist() for b, n in enumerate(kv_lens)]
    flat = sum(owned, [])
    assert len(set(flat)) == len(flat) and all(0 <= x < num_blocks for x in flat)
    if fill is None:
        assert num_blocks == 4 * 6 + 2 and len(set(table.flatten().tolist())) == 24
    else:
        assert num_blocks == len(flat) + 2
        assert all(x == fill for b, n in enumerate(kv_lens) for x in table[b, -(-n // bs) :].tolist())
    with pytest.raises(ValueError, match="max_blocks"):
        block_table(kv_lens, bs, max_blocks=2)


def test_prefill_prebuild_calls_each_variant_with_its_backend(bench_prefill, monkeypatch, tmp_path):
    """--fi-build-only makes one FlashInfer call per variant, each with that variant's backend name."""
    seen = []

    def fake_fn(fi, case, inp, backend):
        seen.append((case.kind, backend))
        return lambda: None

    monkeypatch.setattr(bench_prefill, "flashinfer_fn", fake_fn)
    monkeypatch.setattr(bench_prefill, "make_inputs", lambda case: {})
    monkeypatch.setattr(bench_prefill.C, "import_flashinfer", lambda: object())
    monkeypatch.setattr(bench_prefill.torch.cuda, "synchronize", lambda: None)
    done = tmp_path / "done"
    bench_prefill.fi_build_only(str(done), True, None)
    assert done.read_text().startswith("done")
    variants = bench_prefill.fi_variants(True)
    assert len(seen) == len(variants) and {b for _, b in seen} == {"fa2", "fa3"}
