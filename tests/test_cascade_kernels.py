"""Cascade on the Triton kernels (CUDA, or the interpreter on the CPU): the fused plan (all levels in one
attention launch plus one merge) and the per-level path (causal prefill levels, CUDA-graph mode), each
compared with the float32 reference over every request's concatenated KV. Outputs are poisoned with NaN."""

from __future__ import annotations

import pytest
import torch

import flashinfer_triton as fi
from conftest import LSE_TOL, assert_close
from flashinfer_triton import _config
from flashinfer_triton import reference as R
from flashinfer_triton._config import CascadeConfig
from helpers import make_paged

pytestmark = pytest.mark.interpret

HQ, HKV, D = 4, 1, 32


def _levels(device, level_lens, page_size, qo_lens):
    """A cache holding every level's requests, and per level (qo_indptr, kv_indptr, kv_indices, last_page_len).

    ``level_lens[l]`` lists level l's KV lengths; level 0 is shared by all requests (one request), the last
    level has one request per query group. Returns the cache, the page tables, each request's K/V per level."""
    flat = [n for lens in level_lens for n in lens]
    cache, indptr, indices, last, ks, vs = make_paged(flat, page_size, HKV, D, torch.float16, device, spare_pages=2)
    total_q = sum(qo_lens)
    qo_per_request = torch.tensor([0] + torch.tensor(qo_lens).cumsum(0).tolist(), dtype=torch.int32)
    tables, kv, first = [], [], 0
    for lens in level_lens:
        n = len(lens)
        p0, p1 = int(indptr[first]), int(indptr[first + n])
        qo = torch.tensor([0, total_q], dtype=torch.int32) if n == 1 else qo_per_request
        tables.append(
            (
                qo,
                (indptr[first : first + n + 1] - p0).to(torch.int32),
                indices[p0:p1].clone(),
                last[first : first + n].clone(),
            )
        )
        kv.append([(ks[first + i], vs[first + i]) for i in range(n)])
        first += n
    return cache, tables, kv


def _expected(q, kv, qo_lens, causal):
    """Request b attends to the concatenation of its KV over the levels (level 0 shared by all)."""
    outs, lses, row = [], [], 0
    for b, n in enumerate(qo_lens):
        parts = [lv[0] if len(lv) == 1 else lv[b] for lv in kv]
        k = torch.cat([p[0] for p in parts])
        v = torch.cat([p[1] for p in parts])
        o, s = R.attention(q[row : row + n], k, v, causal=causal)
        outs.append(o)
        lses.append(s)
        row += n
    return torch.cat(outs), torch.cat(lses)


@pytest.fixture
def split_long_levels():
    """Tiny batches: the merge-traffic cap lifted so that long levels are split (as large ones are on a GPU)."""
    with _config.using(cascade=CascadeConfig(merge_share=1e9)):
        yield


def _plan(w, tables, page_size, causal=False):
    w.plan(*[list(x) for x in zip(*tables, strict=True)], HQ, HKV, D, page_size, causal=causal)


def _run(w, q, cache):
    out, lse = w.run(q, cache, return_lse=True)
    return out, lse


CASES = [
    # id, level lens (level 0 shared), query tokens per request, causal, fused expected
    ("decode-ps16-split-shared", [[150], [5, 0, 20]], [1, 1, 1], 16, False, True),
    ("decode-ps1-split-shared", [[70], [3, 9]], [1, 1], 1, False, True),
    ("decode-causal-is-vacuous", [[40], [7, 0]], [1, 1], 16, True, True),
    ("prefill-noncausal", [[33], [4, 17]], [3, 2], 16, False, True),
    ("empty-shared-level", [[0], [5, 9]], [1, 1], 16, False, True),
    ("uneven-last-level-split", [[20], [100, 3, 0]], [1, 1, 1], 16, False, True),
    ("three-levels", [[40], [18], [2, 11, 0]], [1, 2, 1], 16, False, True),
    ("prefill-causal-per-level", [[33], [4, 17]], [3, 2], 16, True, False),
]


@pytest.mark.parametrize("level_lens,qo_lens,page_size,causal,fused", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_cascade_equals_attention_over_concatenated_kv(
    device, split_long_levels, level_lens, qo_lens, page_size, causal, fused
):
    cache, tables, kv = _levels(device, level_lens, page_size, qo_lens)
    w = fi.MultiLevelCascadeAttentionWrapper(len(tables), torch.empty(4 << 20, dtype=torch.uint8, device=device))
    _plan(w, tables, page_size, causal)
    info = w.plan_info()
    assert (info.fused is not None) == fused and len(info.levels) == len(tables)
    if fused and max(max(lens) for lens in level_lens) > 64 and device.type == "cpu":
        assert info.fused.arrays["part_o"].shape[0] > sum(qo_lens) * len(tables), "a long level should be split"
    q = torch.randn(sum(qo_lens), HQ, D, device=device).half()
    out, lse = _run(w, q, cache)
    eo, es = _expected(q, kv, qo_lens, causal)
    assert_close(out, eo)
    assert_close(lse, es, *LSE_TOL, name="lse")
    assert_close(w.run(q, cache), eo)  # without lse: the merge writes out only


def test_cascade_per_level_configuration_matches_fused(device, split_long_levels):
    """CascadeConfig(fused=False) plans the per-level path for a batch the fused plan takes; both give the
    attention over the concatenated KV. The fused plan reports its tile, work items and partial slots."""
    level_lens, qo_lens = [[1100], [5, 0, 20]], [1, 1, 1]  # longer than 4 KV tiles of any tile choice
    cache, tables, kv = _levels(device, level_lens, 16, qo_lens)
    q = torch.randn(sum(qo_lens), HQ, D, device=device).half()
    eo, es = _expected(q, kv, qo_lens, False)
    w = fi.MultiLevelCascadeAttentionWrapper(len(tables), torch.empty(4 << 20, dtype=torch.uint8, device=device))
    _plan(w, tables, 16)
    fused = w.plan_info().fused
    assert fused is not None and fused.details["grid0"] > 0 and fused.config.block_m > 0
    assert fused.arrays["part_o"].shape[0] > sum(qo_lens) * len(tables)  # the long shared level is split
    with _config.using(cascade=CascadeConfig(fused=False)):
        _plan(w, tables, 16)
    assert w.plan_info().fused is None  # the plan keeps the configuration it was made with
    out, lse = _run(w, q, cache)
    assert_close(out, eo)
    assert_close(lse, es, *LSE_TOL, name="lse")


def test_fused_cascade_errors_leave_nothing_launched(device):
    cache, tables, _ = _levels(device, [[20], [3, 4]], 16, [1, 1])
    w = fi.MultiLevelCascadeAttentionWrapper(2, torch.empty(1 << 20, dtype=torch.uint8, device=device))
    _plan(w, tables, 16)
    q = torch.randn(2, HQ, D, device=device).half()
    with pytest.raises(TypeError, match="q: expected dtype"):
        w.run(q.float(), cache)
    with pytest.raises(ValueError, match="q: expected shape"):
        w.run(q[:1], cache)
    with pytest.raises(TypeError, match="paged_kv_cache"):
        w.run(q, cache.float())
    with pytest.raises(ValueError, match="page_size = 16"):
        w.run(q, cache.reshape(cache.shape[0], 2, 8, 2 * HKV, D)[:, :, :, :HKV])
    with pytest.raises(ValueError, match="paged_kv_indices"):
        w.run(q, cache[:1])


def test_cascade_cuda_graph_mode_replans(device):
    """use_cuda_graph=True: fixed buffers, per-level launches; a second plan() into the same buffers."""
    cap_q, cap_pages = 3, 64
    bufs = {
        "qo_indptr_buf_arr": [
            torch.zeros(2, dtype=torch.int32, device=device),
            torch.zeros(cap_q + 1, dtype=torch.int32, device=device),
        ],
        "paged_kv_indptr_buf_arr": [
            torch.zeros(2, dtype=torch.int32, device=device),
            torch.zeros(cap_q + 1, dtype=torch.int32, device=device),
        ],
        "paged_kv_indices_buf_arr": [torch.zeros(cap_pages, dtype=torch.int32, device=device) for _ in range(2)],
        "paged_kv_last_page_len_buf_arr": [
            torch.zeros(1, dtype=torch.int32, device=device),
            torch.zeros(cap_q, dtype=torch.int32, device=device),
        ],
    }
    ws = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    w = fi.MultiLevelCascadeAttentionWrapper(2, ws, "NHD", use_cuda_graph=True, **bufs)
    for level_lens, qo_lens in (([[30], [5, 0, 12]], [1, 1, 1]), ([[0], [9, 3]], [1, 1])):
        cache, tables, kv = _levels(device, level_lens, 16, qo_lens)
        _plan(w, tables, 16)
        assert w.plan_info().fused is None
        q = torch.randn(sum(qo_lens), HQ, D, device=device).half()
        out, lse = _run(w, q, cache)
        eo, es = _expected(q, kv, qo_lens, False)
        assert_close(out, eo)
        assert_close(lse, es, *LSE_TOL, name="lse")


@pytest.mark.parametrize("page_size,shared", [(1, 25), (16, 0)], ids=["ps1-shared25", "ps16-empty-shared"])
def test_legacy_wrappers_on_the_kernels(device, page_size, shared):
    """The legacy two-level wrappers (tests in test_cascade.py) through the Triton kernels."""
    from test_cascade import test_legacy_shared_prefix_wrappers

    test_legacy_shared_prefix_wrappers(device, page_size, shared)


def _graph_buffers(device, cap_q, cap_pages):
    z = lambda n: torch.zeros(n, dtype=torch.int32, device=device)  # noqa: E731
    return {
        "qo_indptr_buf_arr": [z(2), z(cap_q + 1)],
        "paged_kv_indptr_buf_arr": [z(2), z(cap_q + 1)],
        "paged_kv_indices_buf_arr": [z(cap_pages), z(cap_pages)],
        "paged_kv_last_page_len_buf_arr": [z(1), z(cap_q)],
    }


def _gathered_expected(q, cache, tables, page_size):
    """Expected output read straight from the cache: request b's keys are its pages of every level."""
    outs = []
    for b in range(q.shape[0]):
        ks, vs = [], []
        for qo, indptr, indices, last in tables:
            r = 0 if len(qo) == 2 else b
            pages = indices[int(indptr[r]) : int(indptr[r + 1])].long().to(cache.device)
            n = 0 if len(pages) == 0 else (len(pages) - 1) * page_size + int(last[r])
            ks.append(cache[pages, 0].reshape(-1, HKV, D)[:n])
            vs.append(cache[pages, 1].reshape(-1, HKV, D)[:n])
        outs.append(R.attention(q[b : b + 1], torch.cat(ks), torch.cat(vs))[0])
    return torch.cat(outs)


@pytest.mark.gpu
@pytest.mark.parametrize("use_cuda_graph", [False, True], ids=["fused-captured", "graph-mode-replanned"])
def test_cascade_captured_in_a_cuda_graph(use_cuda_graph):
    """run() captured in a CUDA graph: the fused plan replays its own batch; use_cuda_graph=True replays
    correctly after a second plan() into the same buffers (another page table over the same cache)."""
    device = torch.device("cuda")
    ps = 16
    kwargs = _graph_buffers(device, 4, 64) if use_cuda_graph else {}
    w = fi.MultiLevelCascadeAttentionWrapper(
        2, torch.empty(8 << 20, dtype=torch.uint8, device=device), use_cuda_graph=use_cuda_graph, **kwargs
    )
    cache, tables, _ = _levels(device, [[300], [5, 0, 40]], ps, [1, 1, 1])
    _plan(w, tables, ps)
    assert (w.plan_info().fused is None) == use_cuda_graph
    q = torch.randn(3, HQ, D, device=device).half()
    out = torch.full((3, HQ, D), float("nan"), dtype=torch.float16, device=device)
    w.run(q, cache)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(w.run(q, cache))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, _gathered_expected(q, cache, tables, ps), name="first batch")
    if use_cuda_graph:
        shared_pages, own_pages = tables[0][2], tables[1][2]
        i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
        tables2 = [
            (i32(0, 3), i32(0, 2), shared_pages[3:5].clone(), i32(7)),
            (i32(0, 1, 2, 3), i32(0, 1, 1, 3), own_pages[[3, 0, 1]].clone(), i32(9, 0, 16)),
        ]
        _plan(w, tables2, ps)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, _gathered_expected(q, cache, tables2, ps), name="second batch after replan")


def test_fused_cascade_options_bf16_softcap_scale_strided_q(device, split_long_levels):
    """bf16, logits soft cap and sm_scale through the fused plan; q a strided slice of a fused projection."""
    level_lens, ps = [[90], [6, 0, 13]], 16
    flat = [n for lens in level_lens for n in lens]
    cache, indptr, indices, last, ks, vs = make_paged(flat, ps, HKV, D, torch.bfloat16, device)
    n0 = int(indptr[1])
    tables = [
        (torch.tensor([0, 3], dtype=torch.int32), indptr[:2].clone(), indices[:n0].clone(), last[:1].clone()),
        (torch.tensor([0, 1, 2, 3], dtype=torch.int32), (indptr[1:] - n0).to(torch.int32), indices[n0:], last[1:]),
    ]
    w = fi.MultiLevelCascadeAttentionWrapper(2, torch.empty(4 << 20, dtype=torch.uint8, device=device))
    w.plan(
        *[list(x) for x in zip(*tables, strict=True)],
        HQ,
        HKV,
        D,
        ps,
        logits_soft_cap=5.0,
        sm_scale=0.3,
        q_data_type=torch.bfloat16,
        kv_data_type=torch.bfloat16,
    )
    assert w.plan_info().fused is not None
    qkv = torch.randn(3, HQ + 2 * HKV, D, device=device).to(torch.bfloat16)
    q = qkv[:, :HQ]  # non-contiguous rows, contiguous last dim
    out, lse = w.run(q, cache, return_lse=True)
    for b in range(3):
        k = torch.cat([ks[0], ks[b + 1]])
        v = torch.cat([vs[0], vs[b + 1]])
        eo, es = R.attention(q[b : b + 1], k, v, logits_soft_cap=5.0, sm_scale=0.3)
        assert_close(out[b : b + 1], eo, name=f"request {b}")
        assert_close(lse[b : b + 1], es, *LSE_TOL, name=f"lse {b}")


def test_fused_cascade_empty_batch(device):
    """No query rows at all: run() returns empty tensors and launches nothing."""
    cache, tables, _ = _levels(device, [[20], [3]], 16, [1])
    empty = [(torch.tensor([0, 0], dtype=torch.int32), t[1], t[2], t[3]) for t in tables]
    w = fi.MultiLevelCascadeAttentionWrapper(2, torch.empty(1 << 20, dtype=torch.uint8, device=device))
    _plan(w, empty, 16)
    out, lse = w.run(torch.empty(0, HQ, D, device=device).half(), cache, return_lse=True)
    assert out.shape == (0, HQ, D) and lse.shape == (0, HQ)
