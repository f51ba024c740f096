"""Head dims past 256: 512 (the largest FlashInfer 0.7.2's attention tests run) and 320 (a multiple of 16 that is not
a power of two, a masked slice of the 512-wide tile), through every attention entry point, against the float32
reference.

Unmarked tests run the PyTorch path on the CPU (and the Triton kernels on a GPU); ``interpret`` tests run the Triton
kernels, in Triton's interpreter on the CPU (tiny shapes: a 512-wide tile costs more per iteration); ``gpu`` tests
run model-sized shapes.
"""

from __future__ import annotations

import pytest
import torch

import flashinfer_triton as fi
from conftest import assert_close, poison
from flashinfer_triton import reference as R
from helpers import FP8, expected_decode, make_paged, page_table

# (o atol, o rtol) at fp16 against the float32 reference: sums over 512 products carry more rounding than at 128.
TOL = (4e-3, 4e-3)
LSE_TOL = (4e-3, 4e-3)
DTYPE = torch.float16


def _ws(device):
    return torch.empty(32 << 20, dtype=torch.uint8, device=device)


def _single_prefill(d, device, qo=5, kv=21, hq=4, hkv=2, **opts):
    q = torch.randn(qo, hq, d, device=device).to(DTYPE)
    k = torch.randn(kv, hkv, d, device=device).to(DTYPE)
    v = torch.randn(kv, hkv, d, device=device).to(DTYPE)
    out, lse = fi.single_prefill_with_kv_cache(q, k, v, causal=True, return_lse=True, **opts)
    want_o, want_lse = R.attention(q, k, v, causal=True, **opts)
    assert out.shape == (qo, hq, d)
    assert_close(out, want_o, *TOL)
    assert_close(lse, want_lse, *LSE_TOL, name="lse")


def _single_decode(d, device, kv=37, hq=4, hkv=2):
    q = torch.randn(hq, d, device=device).to(DTYPE)
    k = torch.randn(kv, hkv, d, device=device).to(DTYPE)
    v = torch.randn(kv, hkv, d, device=device).to(DTYPE)
    out, lse = fi.single_decode_with_kv_cache(q, k, v, return_lse=True)
    want_o, want_lse = R.attention(q[None], k, v)
    assert_close(out, want_o[0], *TOL)
    assert_close(lse, want_lse[0], *LSE_TOL, name="lse")


def _batch_decode(
    d, device, kv_lens=(19, 5), page_size=4, hq=4, hkv=2, window_left=-1, tensor_cores=False, kv_dtype=DTYPE
):
    cache, indptr, indices, last, ks, vs = make_paged(list(kv_lens), page_size, hkv, d, kv_dtype, device)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(_ws(device), "NHD", use_tensor_cores=tensor_cores)
    w.plan(
        indptr, indices, last, hq, hkv, d, page_size, window_left=window_left, q_data_type=DTYPE, kv_data_type=kv_dtype
    )
    q = torch.randn(len(kv_lens), hq, d, device=device).to(DTYPE)
    out = poison(torch.empty_like(q))
    lse = poison(torch.empty(len(kv_lens), hq, device=device))
    w.run(q, cache, out=out, lse=lse)
    want_o, want_lse = expected_decode(q, ks, vs, window_left=window_left)
    assert_close(out, want_o, *TOL)
    assert_close(lse, want_lse, *LSE_TOL, name="lse")


def _batch_prefill_paged(d, device, qo_lens=(3, 6), kv_lens=(11, 6), page_size=4, hq=4, hkv=2, soft_cap=None):
    """Append-style requests (fewer queries than keys: the queries are the last tokens) over a paged cache."""
    cache, kv_indptr, indices, last, ks, vs = make_paged(list(kv_lens), page_size, hkv, d, DTYPE, device)
    qo_indptr = torch.tensor([0, *torch.tensor(qo_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(_ws(device), "NHD")
    w.plan(qo_indptr, kv_indptr, indices, last, hq, hkv, d, page_size, causal=True, logits_soft_cap=soft_cap)
    q = torch.randn(sum(qo_lens), hq, d, device=device).to(DTYPE)
    out = poison(torch.empty_like(q))
    lse = poison(torch.empty(q.shape[0], hq, device=device))
    w.run(q, cache, out=out, lse=lse)
    for b, (qs, qe) in enumerate(zip(qo_indptr[:-1].tolist(), qo_indptr[1:].tolist())):
        want_o, want_lse = R.attention(q[qs:qe], ks[b], vs[b], causal=True, logits_soft_cap=soft_cap)
        assert_close(out[qs:qe], want_o, *TOL, name=f"out[{b}]")
        assert_close(lse[qs:qe], want_lse, *LSE_TOL, name=f"lse[{b}]")


def _batch_prefill_ragged(d, device, qo_lens=(4, 2), kv_lens=(9, 2), hq=4, hkv=1):
    qo_indptr = torch.tensor([0, *torch.tensor(qo_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    kv_indptr = torch.tensor([0, *torch.tensor(kv_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q = torch.randn(sum(qo_lens), hq, d, device=device).to(DTYPE)
    k = torch.randn(sum(kv_lens), hkv, d, device=device).to(DTYPE)
    v = torch.randn(sum(kv_lens), hkv, d, device=device).to(DTYPE)
    w = fi.BatchPrefillWithRaggedKVCacheWrapper(_ws(device), "NHD")
    w.plan(qo_indptr, kv_indptr, hq, hkv, d, causal=True)
    out = poison(torch.empty_like(q))
    lse = poison(torch.empty(q.shape[0], hq, device=device))
    w.run(q, k, v, out=out, lse=lse)
    for b in range(len(qo_lens)):
        qs, qe = qo_indptr[b].item(), qo_indptr[b + 1].item()
        ks_, ke_ = kv_indptr[b].item(), kv_indptr[b + 1].item()
        want_o, want_lse = R.attention(q[qs:qe], k[ks_:ke_], v[ks_:ke_], causal=True)
        assert_close(out[qs:qe], want_o, *TOL, name=f"out[{b}]")
        assert_close(lse[qs:qe], want_lse, *LSE_TOL, name=f"lse[{b}]")


def _cascade(d, device, page_size=4, hq=2, hkv=1):
    """Two levels: a shared prefix of 7 keys, then each request's own keys (5 and 2), one query token each."""
    lens = (7, 5, 2)
    indptr, indices, last, num_pages = page_table(lens, page_size, spare_pages=1, seed=None)
    pages = (indptr[1:] - indptr[:-1]).tolist()
    ids = [indices[indptr[r] : indptr[r + 1]].tolist() for r in range(3)]
    cache = torch.randn(num_pages, 2, page_size, hkv, d, device=device).to(DTYPE)
    dense_k = [cache[ids[r], 0].reshape(-1, hkv, d)[: lens[r]] for r in range(3)]
    dense_v = [cache[ids[r], 1].reshape(-1, hkv, d)[: lens[r]] for r in range(3)]
    i32 = dict(dtype=torch.int32, device=device)
    last = last.tolist()
    w = fi.MultiLevelCascadeAttentionWrapper(2, _ws(device), "NHD")
    w.plan(
        [torch.tensor([0, 2], **i32), torch.tensor([0, 1, 2], **i32)],
        [torch.tensor([0, pages[0]], **i32), torch.tensor([0, pages[1], pages[1] + pages[2]], **i32)],
        [torch.tensor(ids[0], **i32), torch.tensor(ids[1] + ids[2], **i32)],
        [torch.tensor(last[:1], **i32), torch.tensor(last[1:], **i32)],
        hq,
        hkv,
        d,
        page_size,
    )
    q = torch.randn(2, hq, d, device=device).to(DTYPE)
    out = w.run(q, cache)
    for b in range(2):
        k_all = torch.cat([dense_k[0], dense_k[1 + b]])
        v_all = torch.cat([dense_v[0], dense_v[1 + b]])
        want_o, _ = R.attention(q[b : b + 1], k_all, v_all)
        assert_close(out[b : b + 1], want_o, *TOL, name=f"out[{b}]")


CASES = {
    "single_prefill": _single_prefill,
    "single_prefill_rope": lambda d, device: _single_prefill(d, device, pos_encoding_mode="ROPE_LLAMA"),
    "batch_decode_window_tensor_cores": lambda d, device: _batch_decode(d, device, window_left=6, tensor_cores=True),
    "batch_decode_fp8_kv": lambda d, device: _batch_decode(d, device, kv_dtype=FP8),
    # A GQA group of 128: past 256 the decode kernel's output tile would not fit shared memory, the prefill
    # kernel takes the batch.
    "batch_decode_group_128": lambda d, device: _batch_decode(d, device, kv_lens=(9, 3), hq=128, hkv=1),
    "batch_prefill_paged_soft_cap": lambda d, device: _batch_prefill_paged(d, device, soft_cap=30.0),
    "single_decode": _single_decode,
    "batch_decode": _batch_decode,
    "batch_prefill_paged": _batch_prefill_paged,
    "batch_prefill_ragged": _batch_prefill_ragged,
    "cascade": _cascade,
}


@pytest.mark.parametrize("head_dim", [512, 320])
@pytest.mark.parametrize("entry", list(CASES))
def test_head_dim(entry, head_dim, device):
    CASES[entry](head_dim, device)


@pytest.mark.interpret
@pytest.mark.parametrize("head_dim", [512, 320])
@pytest.mark.parametrize("entry", list(CASES))
def test_head_dim_interpret(entry, head_dim, device, monkeypatch):
    from flashinfer_triton import _torch_backend

    def no_fallback(*args, **kwargs):
        raise AssertionError("the PyTorch path ran: the Triton kernels must take this head dim")

    monkeypatch.setattr(_torch_backend, "plan", no_fallback)
    CASES[entry](head_dim, device)


def test_head_dim_bad_values_name_the_argument(device):
    q = torch.randn(3, 2, 1024, device=device).to(DTYPE)
    with pytest.raises(ValueError, match="head_dim: expected a multiple of 16 up to 512, got 1024"):
        fi.single_prefill_with_kv_cache(q, q, q)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(_ws(device), "NHD")
    indptr = torch.tensor([0, 1], dtype=torch.int32, device=device)
    one = torch.tensor([1], dtype=torch.int32, device=device)
    for bad in (528, 24, 0):
        with pytest.raises(ValueError, match="head_dim"):
            w.plan(indptr, one - 1, one, 2, 2, bad, 4)
    pw = fi.BatchPrefillWithPagedKVCacheWrapper(_ws(device), "NHD")
    # Different query/key and value head dims (FlashInfer's MLA-style 192/128 prefill) are not taken.
    with pytest.raises(ValueError, match="head_dim_vo"):
        pw.plan(indptr, indptr, one - 1, one, 2, 2, 192, 4, head_dim_vo=128)


# ----------------------------------------------------------------------------- GPU: model-sized shapes

GPU_TOL = (3e-3, 3e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [512, 320])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_single_prefill_large_head_dim_gpu(head_dim, dtype):
    q = torch.randn(2048, 8, head_dim, device="cuda").to(dtype)
    k = torch.randn(3072, 2, head_dim, device="cuda").to(dtype)
    v = torch.randn(3072, 2, head_dim, device="cuda").to(dtype)
    out, lse = fi.single_prefill_with_kv_cache(q, k, v, causal=True, return_lse=True)
    want_o, want_lse = R.attention(q, k, v, causal=True)
    tol = GPU_TOL if dtype == torch.float16 else (1.6e-2, 1.6e-2)
    assert_close(out, want_o, *tol)
    assert_close(lse, want_lse, *LSE_TOL, name="lse")


@pytest.mark.gpu
@pytest.mark.parametrize("group", [1, 4, 5, 64])
def test_batch_prefill_paged_large_head_dim_gpu(group):
    """Append-style requests over a paged cache at D512; a GQA group of 64 grows the query tile to 64 rows."""
    hkv = 2 if group < 64 else 1
    qo_lens, kv_lens = (300, 1, 77), (1500, 40, 77)
    cache, kv_indptr, indices, last, ks, vs = make_paged(list(kv_lens), 16, hkv, 512, DTYPE, "cuda")
    qo_indptr = torch.tensor([0, *torch.tensor(qo_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    hq = hkv * group
    w = fi.BatchPrefillWithPagedKVCacheWrapper(_ws("cuda"), "NHD")
    w.plan(qo_indptr, kv_indptr, indices, last, hq, hkv, 512, 16, causal=True)
    q = torch.randn(sum(qo_lens), hq, 512, device="cuda").to(DTYPE)
    out = poison(torch.empty_like(q))
    lse = poison(torch.empty(q.shape[0], hq, device="cuda"))
    w.run(q, cache, out=out, lse=lse)
    for b, (qs, qe) in enumerate(zip(qo_indptr[:-1].tolist(), qo_indptr[1:].tolist())):
        want_o, want_lse = R.attention(q[qs:qe], ks[b], vs[b], causal=True)
        assert_close(out[qs:qe], want_o, *GPU_TOL, name=f"out[{b}]")
        assert_close(lse[qs:qe], want_lse, *LSE_TOL, name=f"lse[{b}]")


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [512, 320])
@pytest.mark.parametrize("tensor_cores", [False, True])
def test_batch_decode_large_head_dim_gpu(head_dim, tensor_cores):
    """16 requests, split KV included (a few long requests leave most SMs idle without it)."""
    kv_lens = [4096, 17, 900, 2500] * 4
    cache, indptr, indices, last, ks, vs = make_paged(kv_lens, 16, 4, head_dim, DTYPE, "cuda")
    w = fi.BatchDecodeWithPagedKVCacheWrapper(_ws("cuda"), "NHD", use_tensor_cores=tensor_cores)
    w.plan(indptr, indices, last, 16, 4, head_dim, 16, q_data_type=DTYPE)
    q = torch.randn(len(kv_lens), 16, head_dim, device="cuda").to(DTYPE)
    out = poison(torch.empty_like(q))
    lse = poison(torch.empty(len(kv_lens), 16, device="cuda"))
    w.run(q, cache, out=out, lse=lse)
    want_o, want_lse = expected_decode(q, ks, vs)
    assert_close(out, want_o, *GPU_TOL)
    assert_close(lse, want_lse, *LSE_TOL, name="lse")


@pytest.mark.gpu
def test_ragged_prefill_large_head_dim_gpu():
    _batch_prefill_ragged(512, torch.device("cuda"), qo_lens=(700, 33, 1), kv_lens=(700, 1200, 5), hq=16, hkv=4)
