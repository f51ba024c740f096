"""Cascade on the Triton kernels (CUDA, or the interpreter on the CPU): the fused plan (all levels in one
attention launch plus one merge) and the per-level path (causal prefill levels, CUDA-graph mode), each
compared with the float32 reference over every request's concatenated KV. Outputs are poisoned with NaN."""

from __future__ import annotations

import pytest
import torch

import flashinfer_triton as fi
from conftest import LSE_TOL, assert_close
from flashinfer_triton import reference as R
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
def test_cascade_equals_attention_over_concatenated_kv(device, level_lens, qo_lens, page_size, causal, fused):
    cache, tables, kv = _levels(device, level_lens, page_size, qo_lens)
    w = fi.MultiLevelCascadeAttentionWrapper(len(tables), torch.empty(4 << 20, dtype=torch.uint8, device=device))
    _plan(w, tables, page_size, causal)
    assert (w._fused is not None) == fused
    q = torch.randn(sum(qo_lens), HQ, D, device=device).half()
    out, lse = _run(w, q, cache)
    eo, es = _expected(q, kv, qo_lens, causal)
    assert_close(out, eo)
    assert_close(lse, es, *LSE_TOL, name="lse")
    assert_close(w.run(q, cache), eo)  # without lse: the merge writes out only


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
        assert w._fused is None
        q = torch.randn(sum(qo_lens), HQ, D, device=device).half()
        out, lse = _run(w, q, cache)
        eo, es = _expected(q, kv, qo_lens, False)
        assert_close(out, eo)
        assert_close(lse, es, *LSE_TOL, name="lse")
