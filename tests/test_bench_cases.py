"""The benchmark tables' rows (``flashinfer_triton.testing``): well-formed on the CPU, and on the GPU each row's
output, at the benchmark's own shape and inputs, matches the float32 reference.

One call per row, through the public entry point the benchmark times. The reference runs on a few requests of
each batch and, for long prefills, on a few hundred query rows (the first, the last and a spread between), with
the causal / window / custom mask of those rows written out as a custom mask: the full score matrix of a
16384-token prefill would not fit.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from dataclasses import replace

import pytest
import torch

import flashinfer_triton as fit
from conftest import assert_close, poison
from flashinfer_triton import reference as R
from flashinfer_triton.testing import (
    CASCADE_CASES,
    DECODE_CASES,
    PREFILL_CASES,
    CascadeCase,
    DecodeCase,
    decode_inputs,
    prefill_inputs,
    prefill_mask,
    ragged_lens,
    request_lens,
    shared_prefix_inputs,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKSPACE_BYTES = 128 << 20


def _load_bench(name):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return mod


# ----------------------------------------------------------------------------- CPU: the lists are well formed
@pytest.mark.parametrize(
    "bench,attr,cases",
    [("bench_decode", "CASES", DECODE_CASES), ("bench_prefill", "CASES", PREFILL_CASES)],
    ids=["decode", "prefill"],
)
def test_benchmarks_time_the_shared_cases(bench, attr, cases):
    assert getattr(_load_bench(bench), attr) is cases


def test_cascade_bench_times_the_shared_cases():
    mod = _load_bench("bench_cascade")
    assert mod.CASCADE_CASES is CASCADE_CASES
    assert all((c.num_qo_heads, c.num_kv_heads, c.head_dim, c.page_size) == (mod.HQ, mod.HKV, mod.D, mod.PAGE)
               for c in CASCADE_CASES)  # fmt: skip


@pytest.mark.parametrize("cases", [DECODE_CASES, PREFILL_CASES, CASCADE_CASES], ids=["decode", "prefill", "cascade"])
def test_case_names_are_unique(cases):
    names = [c.name for c in cases]
    assert names and len(set(names)) == len(names)


def test_decode_cases_are_well_formed():
    for c in DECODE_CASES:
        assert isinstance(c, DecodeCase) and c.batch > 0 and c.kv_len > 0 and c.page_size > 0, c.name
        assert c.num_qo_heads % c.num_kv_heads == 0, c.name
        assert c.name.startswith(f"{c.batch}x{c.kv_len} {c.num_qo_heads}/{c.num_kv_heads}"), c.name
        assert ("bf16" in c.name) == (c.dtype == torch.bfloat16), c.name
        assert (f"D{c.head_dim}" in c.name) == (c.head_dim != 128), c.name


def test_prefill_cases_are_well_formed():
    for c in PREFILL_CASES:
        assert c.kind in ("single", "paged", "ragged") and c.hq % c.hkv == 0, c.name
        lens = request_lens(c)
        assert len(lens) == c.batch and all(0 < q <= k for q, k in lens), c.name
        assert (c.kind == "ragged") == (c.lens is not None), c.name
        assert c.kind == "paged" or c.page_size == 1, c.name
        if c.mask is not None:
            assert c.kind == "single" and not c.causal, c.name
            assert prefill_mask(c, "cpu").shape == (c.qo, c.kv), c.name
        if c.kind != "ragged":
            assert c.name.split()[0] in (str(c.qo), "append", "shared", f"{c.batch}x({c.qo}"), c.name
    ragged = [c for c in PREFILL_CASES if c.kind == "ragged"]
    assert ragged and ragged[0].lens == ragged_lens(64, 100, 4000)  # a fixed seed: the same batch on every machine


def test_prefill_inputs_match_the_case():
    """The builder at a reduced row of each kind: shapes, dtypes and index arrays agree with the case."""
    for c in PREFILL_CASES:
        small = replace(c, qo=min(c.qo, 8), kv=min(c.kv, 24), lens=(5, 9) if c.lens else None, batch=min(c.batch, 2))
        if small.mask is not None:
            small = replace(small, mask="blockdiag:4")
        inp = prefill_inputs(small, device="cpu")
        lens = request_lens(small)
        assert inp["q"].shape == (sum(q for q, _ in lens), c.hq, c.d) and inp["q"].dtype == c.dtype, c.name
        assert inp["qo_indptr"].tolist()[-1] == inp["q"].shape[0], c.name
        if small.kind == "paged":
            seq = R.get_seq_lens(inp["kv_indptr"], inp["last_page_len"], small.page_size)
            assert seq.tolist() == [k for _, k in lens] and inp["cache"][0].dtype == c.kv_type, c.name
        else:
            assert inp["k"].shape == (inp["kv_indptr"].tolist()[-1], c.hkv, c.d), c.name
            assert inp["k"].dtype == c.kv_type, c.name


def test_decode_inputs_page_every_key():
    c = DecodeCase("tiny", 3, 37, 4, 2, 16, 8, torch.float16)
    d = decode_inputs(c, "cpu", seed=3, copies=2)
    assert R.get_seq_lens(d["indptr"], d["last"], c.page_size).tolist() == [37] * 3
    assert len(d["caches"]) == 2 and d["caches"][0][0].shape == (15, 8, 2, 16)
    assert d["q"].shape == (3, 4, 16) and torch.equal(d["indices"], d["indices_cpu"])
    assert len(set(d["indices"].tolist())) == 15


def test_shared_prefix_levels_cover_the_flat_table():
    """Each request's flat page list is the prefix's pages then its own, and the levels hold the same pages."""
    c = CascadeCase(3, 32, 21, 4, 2, 16, 16)
    cache, q, levels, flat = shared_prefix_inputs(c, device="cpu")
    assert cache.shape == (2 + 3 * 2, 2, 16, 2, 16) and q.shape == (3, 4, 16)
    shared = levels["kv_indices"][0].tolist()
    own = levels["kv_indices"][1].tolist()
    assert len(set(shared + own)) == len(shared) + len(own) == cache.shape[0]
    assert R.get_seq_lens(flat["indptr"], flat["last_page_len"], 16).tolist() == [53] * 3
    for b in range(3):
        pages = flat["indices"][int(flat["indptr"][b]) : int(flat["indptr"][b + 1])].tolist()
        assert pages == shared + own[2 * b : 2 * b + 2]
    with pytest.raises(ValueError, match="shared"):
        shared_prefix_inputs(CascadeCase(1, 20, 4, 4, 2, 16, 16), device="cpu")


# ----------------------------------------------------------------------------- GPU: each row against the reference
def _dense(k_pages, v_pages, indices, indptr, b, n):
    pages = indices[int(indptr[b]) : int(indptr[b + 1])].long()
    h, d = k_pages.shape[-2:]
    return k_pages[pages].reshape(-1, h, d)[:n], v_pages[pages].reshape(-1, h, d)[:n]


def _picked(n: int, k: int = 3) -> list[int]:
    """First, middle and last of ``range(n)`` (fewer when ``n`` is small)."""
    return sorted({0, n // 2, n - 1})[:k]


def _rows(qo: int) -> torch.Tensor:
    """The query rows the reference checks: all of a short request, else the first and last 64 and 64 between."""
    if qo <= 192:
        return torch.arange(qo)
    return torch.cat([torch.arange(64), torch.linspace(64, qo - 65, 64).long(), torch.arange(qo - 64, qo)]).unique()


def _expected_rows(case, q, k, v, rows, mask):
    """The float32 reference of query ``rows`` of one request (``q`` all its rows), its mask written out."""
    qo, kv = q.shape[0], k.shape[0]
    dev = q.device
    rows = rows.to(dev)
    diag = rows[:, None] + (kv - qo)
    j = torch.arange(kv, device=dev)[None, :]
    visible = mask[rows] if mask is not None else torch.ones(rows.numel(), kv, dtype=torch.bool, device=dev)
    if case.causal and mask is None:
        visible = visible & (j <= diag)
    if case.window_left >= 0:
        visible = visible & (j >= diag - case.window_left)
    soft_cap = case.soft_cap if case.soft_cap > 0 else None
    return R.attention(q[rows].float(), k.float(), v.float(), custom_mask=visible, logits_soft_cap=soft_cap)[0]


def _poisoned_block(like: torch.Tensor) -> None:
    """For entry points that allocate their output: leave a NaN-filled block of the output's size in the caching
    allocator, which hands it to the next allocation of that size, so an unwritten element reads as NaN."""
    block = torch.empty_like(like)
    poison(block)
    del block


@pytest.mark.gpu
@pytest.mark.parametrize("case", DECODE_CASES, ids=[c.name for c in DECODE_CASES])
def test_decode_case_matches_reference(case):
    dev = torch.device("cuda")
    data = decode_inputs(case, dev)
    k_pages, v_pages = data["caches"][0]
    w = fit.BatchDecodeWithPagedKVCacheWrapper(torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=dev), "NHD")
    w.plan(data["indptr"], data["indices"], data["last"], case.num_qo_heads, case.num_kv_heads, case.head_dim,
           case.page_size, q_data_type=case.dtype, kv_data_type=case.dtype)  # fmt: skip
    out = poison(torch.empty_like(data["q"]))
    w.run(data["q"], (k_pages, v_pages), out=out)
    assert not torch.isnan(out).any(), "decode: unwritten output rows"
    for b in _picked(case.batch):
        k, v = _dense(k_pages, v_pages, data["indices"], data["indptr"], b, case.kv_len)
        expected = R.attention(data["q"][b : b + 1].float(), k, v)[0][0]
        assert_close(out[b], expected, name=f"decode request {b}")


def _prefill_call(case, inp, dev):
    """One call of the public entry point the benchmark's ``ours_public_ms`` times; returns the output."""
    kw = dict(window_left=case.window_left, logits_soft_cap=case.soft_cap if case.soft_cap > 0 else None)
    if case.kind == "single":
        if inp["mask"] is not None:
            kw["custom_mask"] = inp["mask"]
        else:
            kw["causal"] = case.causal
        _poisoned_block(inp["q"])
        return fit.single_prefill_with_kv_cache(inp["q"], inp["k"], inp["v"], **kw)
    ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
    dtypes = dict(q_data_type=case.dtype, kv_data_type=case.kv_type, causal=case.causal)
    out = poison(torch.empty_like(inp["q"]))
    if case.kind == "paged":
        w = fit.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(inp["qo_indptr"], inp["kv_indptr"], inp["kv_indices"], inp["last_page_len"], case.hq, case.hkv,
               case.d, case.page_size, **kw, **dtypes)  # fmt: skip
        w.run(inp["q"], inp["cache"], out=out)
    else:
        w = fit.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
        w.plan(inp["qo_indptr"], inp["kv_indptr"], case.hq, case.hkv, case.d, **kw, **dtypes)
        w.run(inp["q"], inp["k"], inp["v"], out=out)
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("case", PREFILL_CASES, ids=[c.name for c in PREFILL_CASES])
def test_prefill_case_matches_reference(case):
    dev = torch.device("cuda")
    inp = prefill_inputs(case, device=dev)
    out = _prefill_call(case, inp, dev)
    assert out.shape == inp["q"].shape and not torch.isnan(out).any(), "prefill: unwritten output rows"
    qo_indptr, kv_indptr = inp["qo_indptr"].tolist(), inp["kv_indptr"].tolist()
    for b in _picked(case.batch):
        q = inp["q"][qo_indptr[b] : qo_indptr[b + 1]]
        if case.kind == "paged":
            kv_len = request_lens(case)[b][1]
            k, v = _dense(*inp["cache"], inp["kv_indices"], inp["kv_indptr"], b, kv_len)
        else:
            k, v = inp["k"][kv_indptr[b] : kv_indptr[b + 1]], inp["v"][kv_indptr[b] : kv_indptr[b + 1]]
        rows = _rows(q.shape[0])
        expected = _expected_rows(case, q, k, v, rows, inp["mask"])
        assert_close(out[qo_indptr[b] : qo_indptr[b + 1]][rows.to(dev)], expected, name=f"prefill request {b}")


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASCADE_CASES, ids=[c.name for c in CASCADE_CASES])
def test_cascade_case_matches_reference(case):
    dev = torch.device("cuda")
    cache, q, levels, flat = shared_prefix_inputs(case, device=dev)
    w = fit.MultiLevelCascadeAttentionWrapper(2, torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=dev), "NHD")
    w.plan(levels["qo_indptr"], levels["kv_indptr"], levels["kv_indices"], levels["last_page_len"],
           case.num_qo_heads, case.num_kv_heads, case.head_dim, case.page_size, q_data_type=case.dtype,
           kv_data_type=case.dtype)  # fmt: skip
    _poisoned_block(q)
    out = w.run(q, cache)
    assert out.shape == q.shape and not torch.isnan(out).any(), "cascade: unwritten output rows"
    for b in _picked(case.batch):
        k, v = _dense(cache[:, 0], cache[:, 1], flat["indices"], flat["indptr"], b, case.shared + case.unique)
        expected = R.attention(q[b : b + 1].float(), k, v)[0][0]
        assert_close(out[b], expected, name=f"cascade request {b}")
